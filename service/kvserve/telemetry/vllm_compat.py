"""``kvserve serve --metrics-compat vllm``: the engine's load gauges, cache and LoRA info
and speculative-decoding counters also under vLLM's names.

The Gateway API Inference Extension's model-server protocol asks a model server for its
queued and running requests, its KV-cache utilisation, its cache configuration and its
LoRA adapters; its endpoint pickers, and the KEDA and HPA setups written for vLLM, read
them under vLLM's names. With this on, an unmodified picker or autoscaler works with a
kvserve replica (README, "Running under the Gateway API Inference Extension"), and
dashboards written for vLLM's speculative decoding read its acceptance:

==================================  =================================  ===================
vLLM series                         the same figure as                 labels
==================================  =================================  ===================
``vllm:num_requests_waiting``       ``kvserve_num_requests_waiting``   ``model_name``,
``vllm:num_requests_running``       ``kvserve_num_requests_running``   ``engine`` ("0")
``vllm:kv_cache_usage_perc``        ``kvserve_kv_cache_usage_ratio``   (a 0-1 share, as
                                                                       vLLM's despite its
                                                                       name)
``vllm:cache_config_info``          ``kvserve_cache_config_info``      + ``block_size``,
                                                                       ``cache_dtype``,
                                                                       ``num_gpu_blocks``
``vllm:lora_requests_info``         ``kvserve_lora_requests_info``     ``max_lora``,
                                                                       ``running_lora_
                                                                       adapters``,
                                                                       ``waiting_lora_
                                                                       adapters`` (only
                                                                       these, as vLLM's)
``vllm:spec_decode_num_drafts_      ``kvserve_spec_decode_num_         ``model_name``,
total``                             drafts_total``                     ``engine``
``vllm:spec_decode_num_draft_       ``kvserve_spec_decode_num_draft_
tokens_total``                      tokens_total``
``vllm:spec_decode_num_accepted_    ``kvserve_spec_decode_num_
tokens_total``                      accepted_tokens_total``
``vllm:spec_decode_num_accepted_    ``kvserve_spec_decode_num_         + ``position``
tokens_per_pos_total``              accepted_tokens_per_pos_total``
==================================  =================================  ===================

Off by default: the series double the exposition of these gauges, and a Prometheus that
also scrapes real vLLM pods would mix kvserve's figures into vLLM's dashboards and alerts
unless its queries filter by pod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import EngineStats
    from kvserve.spec_decode.metrics import SpecDecodeStats

METRICS_COMPAT: Final = ("vllm",)  # the accepted values of --metrics-compat
ENGINE_INDEX: Final = "0"  # vLLM labels each engine core; a kvserve replica has one


class VllmMetrics:
    """vLLM-named copies of the engine's load gauges, infos and speculative-decoding
    counters, in the engine's registry. Not thread-safe on its own: ``EngineMetrics``
    calls it under its lock."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = ("model_name", "engine")
        values = (model_name, ENGINE_INDEX)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
            registry=registry,
        ).labels(*values)  # fmt: skip
        self._running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels,
            registry=registry,
        ).labels(*values)  # fmt: skip
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (1 means all blocks in use).",
            labels, registry=registry,
        ).labels(*values)  # fmt: skip
        self._cache_info = Gauge(
            "vllm:cache_config_info", "KV cache configuration (value is always 1).",
            (*labels, "block_size", "cache_dtype", "num_gpu_blocks"), registry=registry,
        )  # fmt: skip
        self._values = values
        self._lora_info = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters running and waiting; the value is the time of the last update.",
            ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            registry=registry,
        )

        # vLLM's counters, named without "_total" (prometheus_client appends it).
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self._spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Runs of draft tokens verified."
        ).labels(*values)
        self._spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(*values)
        self._spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(*values)
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the run of drafts (0-based).",
            (*labels, "position"),
            registry=registry,
        )

    def set_cache_info(self, labels: tuple[str, str, str]) -> None:
        """The cache series (``block_size``, ``cache_dtype``, ``num_gpu_blocks``), as
        ``EngineMetrics`` made them."""
        self._cache_info.clear()
        self._cache_info.labels(*self._values, *labels).set(1)

    def observe(self, stats: EngineStats) -> None:
        self._waiting.set(stats.num_waiting)
        self._running.set(stats.num_running)
        self._kv_usage.set(stats.kv_cache_usage)

    def add_spec_decode(self, grew: SpecDecodeStats) -> None:
        """What the engine's speculative-decoding totals grew by, as ``EngineMetrics``
        counted it; a position's series appears with its first acceptance, as ours."""
        self._spec_drafts.inc(grew.num_drafts)
        self._spec_draft_tokens.inc(grew.num_draft_tokens)
        self._spec_accepted.inc(grew.num_accepted_tokens)
        for pos, count in enumerate(grew.accepted_per_pos):
            if count > 0:
                self._spec_per_pos.labels(*self._values, str(pos)).inc(count)

    def set_lora(self, labels: tuple[str, str, str], changed: bool) -> None:
        """The LoRA series (``max_lora``, running, waiting), as ``EngineMetrics`` made
        them; ``changed``: they differ from the last call's."""
        if changed:  # one series: the current adapters
            self._lora_info.clear()
        self._lora_info.labels(*labels).set_to_current_time()
