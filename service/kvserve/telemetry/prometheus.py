"""Prometheus metrics for one engine, built from request timelines and engine stats.

Every series carries the label ``model``; ``kvserve_requests_finished_total`` also carries
``finished_reason`` (``stop``, ``length``, ``abort``, ``error``). Latency figures come from
``kvserve.telemetry.definitions`` (docs/architecture.md §3) applied to the server-side timeline of
each request (``RequestMetrics``): ``s`` = arrival at the engine, ``f`` = first output
token, ``e`` = last output token, ``O`` = output tokens. Timeline figures are observed
once per finished request (``observe_finished``); a request that produced no token (for
example one aborted while queued) adds only to the finished and prompt-token counters,
plus its queue time if it was ever scheduled.

=============================================== ============================================
Metric                                          Definition
=============================================== ============================================
``kvserve_time_to_first_token_seconds``         histogram: TTFT = f − s (queueing + prefill)
``kvserve_inter_token_latency_seconds``         histogram: ITL, one observation per gap
                                                between consecutive streamed outputs (O − 1
                                                per request, fewer when a step streams
                                                several tokens: accepted drafts)
``kvserve_time_per_output_token_seconds``       histogram: TPOT = (e − f) / (O − 1), one per
                                                request with O > 1
``kvserve_request_queue_time_seconds``          histogram: first scheduled − s
``kvserve_request_prefill_time_seconds``        histogram: f − first scheduled
``kvserve_request_decode_time_seconds``         histogram: e − f
``kvserve_e2e_request_latency_seconds``         histogram: E2E = e − s
``kvserve_request_prompt_tokens``               histogram: prompt tokens per finished request
``kvserve_request_generation_tokens``           histogram: O per finished request
``kvserve_prompt_tokens_total``                 counter: prompt tokens of finished requests
                                                (failed ones included)
``kvserve_generation_tokens_total``             counter: output tokens of finished requests
                                                (aborted ones included)
``kvserve_prefix_cache_queried_tokens_total``   counter: prompt tokens looked up in the prefix
                                                cache (once per admitted request)
``kvserve_prefix_cache_hit_tokens_total``       counter: of those, tokens served from cache
``kvserve_requests_finished_total``             counter by ``finished_reason``: stop (EOS,
                                                stop token or string), length (max_tokens or
                                                max_model_len), abort (cancelled), error
                                                (failed with an exception)
``kvserve_num_preemptions_total``               counter: running requests preempted for KV
                                                blocks (to be recomputed later)
``kvserve_spec_decode_num_drafts_total``        counter: runs of draft tokens verified (one
                                                per request per step that had drafts)
``kvserve_spec_decode_num_draft_tokens_total``  counter: draft tokens verified
``kvserve_spec_decode_num_accepted_tokens_total`` counter: of those, tokens accepted
``kvserve_spec_decode_num_accepted_tokens_per_pos_total`` counter by ``position`` (0-based
                                                place in the run): drafts accepted there;
                                                a position's series appears with its first
                                                acceptance (vLLM's ``vllm:spec_decode_*``)
``kvserve_num_requests_running``                gauge: requests in the running batch
``kvserve_num_requests_waiting``                gauge: requests queued (new or preempted)
``kvserve_kv_cache_usage_ratio``                gauge: share of KV blocks in use, 0–1
``kvserve_cache_config_info``                   gauge, always 1: labels ``block_size``,
                                                ``cache_dtype`` (``kv_cache_dtype``:
                                                ``auto``, ``fp8_e4m3``, ``fp8_e5m2``, as
                                                vLLM's) and ``num_gpu_blocks`` (the KV
                                                pool's size)
``kvserve_lora_requests_info``                  gauge, with LoRA on: the time (Unix
                                                seconds) of its last update; labels
                                                ``max_lora`` (slots), and the comma-joined
                                                names of the ``running_lora_adapters``
                                                and ``waiting_lora_adapters`` (vLLM's
                                                ``vllm:lora_requests_info``, which the
                                                Inference Extension's endpoint pickers
                                                read); one series, the current one
``kvserve_lora_requests_total``                 counter, with LoRA on: finished requests
                                                per adapter (label ``lora_adapter``); only
                                                the adapters the engine can hold in memory
                                                (``set_lora_limit``) have a series, the
                                                least recently counted one's is dropped
                                                first, so its cardinality is bounded
``kvserve_kv_events_dropped_batches_total``     counter, with KV-cache events on: batches
                                                of events dropped because the publisher's
                                                queue was full (each leaves a gap in the
                                                sequence numbers; ``kvserve.engine.
                                                kv_events``), read at each scrape
=============================================== ============================================

With ``compat="vllm"`` (``kvserve serve --metrics-compat vllm``), the load gauges, the
cache and LoRA info and the speculative-decoding counters are also exported under vLLM's
names (``kvserve.telemetry.vllm_compat``).

Counters are exposed with the ``_total`` suffix (and prometheus_client's ``_created``
timestamps); histograms as ``_bucket``/``_count``/``_sum``. The prefix-cache,
preemption and speculative-decoding counters follow the engine's cumulative totals
(``EngineStats``): each ``observe_engine`` call adds what grew since the previous call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Final, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvserve.outputs import RequestOutput
from kvserve.spec_decode.metrics import SpecDecodeStats
from kvserve.telemetry import definitions as d
from kvserve.telemetry.vllm_compat import METRICS_COMPAT, VllmMetrics

if TYPE_CHECKING:  # the engine module loads torch; the gateway, which uses this one, needs not
    from kvserve.engine.llm_engine import EngineStats

FINISHED_REASONS: Final = ("stop", "length", "abort", "error")


class DroppedBatches(Protocol):
    """What the metrics read of the engine's KV-cache events publisher
    (``kvserve.engine.kv_events.KVEventPublisher``; not imported: the gateway, which uses
    this module, does not load the engine's modules)."""

    @property
    def dropped_batches(self) -> int: ...


# Bucket upper bounds, seconds. Each set includes the SLO thresholds dashboards and alert
# rules compare against, so a threshold's share is read off a bucket exactly.
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.025, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4,
    0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS: Final = (  # ITL and TPOT
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (  # queue, prefill, decode, e2e: up to 30 minutes
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    90.0, 120.0, 180.0, 240.0, 300.0, 600.0, 900.0, 1200.0, 1800.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS: Final = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
    131072,
)  # fmt: skip


class EngineMetrics:
    """The Prometheus metrics of one engine, in a registry of their own.

    Call ``observe_finished`` once per finished request, ``observe_error`` for a request
    that failed with an exception, ``observe_engine`` after every engine step and after
    aborts; ``render`` returns the exposition for ``/metrics``. Thread-safe.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        compat: str | None = None,
    ) -> None:
        """``compat="vllm"``: also the load gauges, cache and LoRA info and speculative
        decoding counters under vLLM's names (``vllm_compat``)."""
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        if compat not in (None, *METRICS_COMPAT):
            raise ValueError(f"metrics compat {compat!r} is not one of {METRICS_COMPAT}")
        self._vllm = VllmMetrics(model_name, reg) if compat == "vllm" else None
        m = ("model",)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, registry=reg, buckets=buckets)

        # Counters are named without "_total": prometheus_client appends it.
        def counter(name: str, doc: str, labels: tuple[str, ...] = m) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = m) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        self._ttft = hist(
            "kvserve_time_to_first_token_seconds",
            "Time to first token: first output token - arrival (queueing + prefill).",
            TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = hist(
            "kvserve_inter_token_latency_seconds",
            "Inter-token latency: each gap between consecutive streamed outputs.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(model_name)
        self._tpot = hist(
            "kvserve_time_per_output_token_seconds",
            "Time per output token: (last - first token) / (O - 1), requests with O > 1.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(model_name)
        self._queue = hist(
            "kvserve_request_queue_time_seconds",
            "Queue time: first scheduled - arrival.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._prefill = hist(
            "kvserve_request_prefill_time_seconds",
            "Prefill time: first output token - first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._decode = hist(
            "kvserve_request_decode_time_seconds",
            "Decode time: last output token - first output token.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._e2e = hist(
            "kvserve_e2e_request_latency_seconds",
            "End-to-end latency: last output token - arrival.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._prompt_len = hist(
            "kvserve_request_prompt_tokens",
            "Prompt tokens per finished request.",
            TOKEN_COUNT_BUCKETS,
        ).labels(model_name)
        self._gen_len = hist(
            "kvserve_request_generation_tokens",
            "Output tokens per finished request.",
            TOKEN_COUNT_BUCKETS,
        ).labels(model_name)

        self._prompt_tokens = counter(
            "kvserve_prompt_tokens", "Prompt tokens of finished requests."
        ).labels(model_name)
        self._generation_tokens = counter(
            "kvserve_generation_tokens", "Output tokens of finished requests."
        ).labels(model_name)
        self._prefix_queried = counter(
            "kvserve_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
        ).labels(model_name)
        self._prefix_hit = counter(
            "kvserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
        ).labels(model_name)
        self._preemptions = counter(
            "kvserve_num_preemptions",
            "Running requests preempted for lack of KV blocks.",
        ).labels(model_name)
        self._spec_drafts = counter(
            "kvserve_spec_decode_num_drafts", "Runs of draft tokens verified."
        ).labels(model_name)
        self._spec_draft_tokens = counter(
            "kvserve_spec_decode_num_draft_tokens", "Draft tokens verified."
        ).labels(model_name)
        self._spec_accepted = counter(
            "kvserve_spec_decode_num_accepted_tokens", "Draft tokens accepted."
        ).labels(model_name)
        self._spec_per_pos = counter(
            "kvserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the run of drafts (0-based).",
            (*m, "position"),
        )
        finished = counter(
            "kvserve_requests_finished",
            "Finished requests by reason: stop, length, abort, error.",
            (*m, "finished_reason"),
        )
        self._finished = {r: finished.labels(model_name, r) for r in FINISHED_REASONS}

        self._running = gauge(
            "kvserve_num_requests_running", "Requests in the running batch."
        ).labels(model_name)
        self._waiting = gauge(
            "kvserve_num_requests_waiting", "Requests waiting to be scheduled."
        ).labels(model_name)
        self._kv_usage = gauge(
            "kvserve_kv_cache_usage_ratio", "Share of KV cache blocks in use (0-1)."
        ).labels(model_name)
        self._cache_info = gauge(
            "kvserve_cache_config_info",
            "KV cache configuration (value is always 1).",
            (*m, "block_size", "cache_dtype", "num_gpu_blocks"),
        )

        self._lora_info = gauge(
            "kvserve_lora_requests_info",
            "LoRA adapters running and waiting; the value is the time of the last update.",
            (*m, "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self._lora_requests = counter(
            "kvserve_lora_requests",
            "Finished requests per LoRA adapter (series only for the adapters the engine "
            "can hold in memory; the least recently counted is dropped first).",
            (*m, "lora_adapter"),
        )
        self._lora_series: OrderedDict[str, None] = OrderedDict()  # least recent first
        self._lora_series_limit = 0  # 0: LoRA off, no series
        self._kv_events_dropped = counter(
            "kvserve_kv_events_dropped_batches",
            "KV-cache event batches dropped because the publisher's queue was full.",
        )
        self._kv_events: DroppedBatches | None = None  # None: events off, no series
        self._last_kv_events_dropped = 0

        # Engine totals at the previous observe_engine call, to turn them into deltas.
        self._lock = threading.Lock()
        self._last_queried = 0
        self._last_hit = 0
        self._last_preemptions = 0
        self._last_spec = SpecDecodeStats()

    def set_cache_info(self, block_size: int, num_blocks: int, cache_dtype: str) -> None:
        """Publish the KV cache configuration (replaces any earlier one); ``cache_dtype``
        is the engine's ``kv_cache_dtype`` (``auto``, ``fp8_e4m3``, ``fp8_e5m2``)."""
        labels = (str(block_size), cache_dtype, str(num_blocks))
        with self._lock:
            self._cache_info.clear()
            self._cache_info.labels(self.model_name, *labels).set(1)
            if self._vllm is not None:
                self._vllm.set_cache_info(labels)

    def track_kv_events(self, publisher: DroppedBatches) -> None:
        """Export ``publisher``'s dropped batches as ``kvserve_kv_events_dropped_batches``
        (the engine's KV-cache events are on); the count is read at each ``render``."""
        with self._lock:
            self._kv_events = publisher
            self._last_kv_events_dropped = 0
            self._kv_events_dropped.labels(self.model_name)  # the series, at 0

    def set_lora_limit(self, adapters: int) -> None:
        """How many adapters may have a ``kvserve_lora_requests_total`` series: those the
        engine can hold in memory (slots + host copies), which bounds its cardinality."""
        with self._lock:
            self._lora_series_limit = adapters

    def _count_lora(self, name: str) -> None:
        with self._lock:
            if self._lora_series_limit <= 0:
                return
            self._lora_series[name] = None
            self._lora_series.move_to_end(name)
            while len(self._lora_series) > self._lora_series_limit:
                dropped, _ = self._lora_series.popitem(last=False)
                self._lora_requests.remove(self.model_name, dropped)
            self._lora_requests.labels(self.model_name, name).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished request (``out.finished``); call once per request."""
        if not out.finished:
            raise ValueError(
                f"request {out.request_id!r} has not finished: call observe_finished only "
                "with the final output of a request"
            )
        reason = out.outputs[0].finish_reason if out.outputs else None
        if reason not in FINISHED_REASONS:
            raise ValueError(
                f"request {out.request_id!r} finished with reason {reason!r}; expected one "
                f"of {', '.join(FINISHED_REASONS)}"
            )
        num_prompt = len(out.prompt_token_ids)
        num_output = sum(len(c.token_ids) for c in out.outputs)
        self._finished[reason].inc()
        self._prompt_tokens.inc(num_prompt)
        self._generation_tokens.inc(num_output)
        self._prompt_len.observe(num_prompt)
        self._gen_len.observe(num_output)
        if out.lora_request is not None:
            self._count_lora(out.lora_request.lora_name)

        m = out.metrics
        s = m.arrival_time
        if m.first_scheduled_time is not None:
            self._queue.observe(d.queue_time(s, m.first_scheduled_time))
        if m.first_token_time is None or not m.token_times:
            return  # no output token: no token latency is defined
        f, e = m.first_token_time, m.token_times[-1]
        self._ttft.observe(d.ttft(s, f))
        self._e2e.observe(d.e2e(s, e))
        if m.first_scheduled_time is not None:
            self._prefill.observe(d.prefill_time(m.first_scheduled_time, f))
        self._decode.observe(d.decode_time(f, e))
        tpot = d.tpot(f, e, len(m.token_times))
        if tpot is not None:
            self._tpot.observe(tpot)
        for gap in d.itls(d.output_times(m.token_times)):
            self._itl.observe(gap)

    def observe_error(self, prompt_tokens: int) -> None:
        """Record a request that failed with an exception."""
        self._finished["error"].inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._prompt_len.observe(prompt_tokens)

    def observe_engine(self, stats: EngineStats) -> None:
        """Set the gauges and add the engine's counter growth since the last call.

        Call after every step and after aborts. If a total goes down (a new engine), the
        new total counts as growth from zero.
        """
        with self._lock:
            self._running.set(stats.num_running)
            self._waiting.set(stats.num_waiting)
            self._kv_usage.set(stats.kv_cache_usage)
            if self._vllm is not None:
                self._vllm.observe(stats)
            self._prefix_queried.inc(_growth(self._last_queried, stats.prefix_cache_queried_tokens))
            self._prefix_hit.inc(_growth(self._last_hit, stats.prefix_cache_hit_tokens))
            self._preemptions.inc(_growth(self._last_preemptions, stats.num_preemptions))
            self._last_queried = stats.prefix_cache_queried_tokens
            self._last_hit = stats.prefix_cache_hit_tokens
            self._last_preemptions = stats.num_preemptions
            self._observe_spec_decode(stats.spec_decode)
            if stats.max_lora:
                labels = (
                    str(stats.max_lora),
                    ",".join(stats.running_lora_adapters),
                    ",".join(stats.waiting_lora_adapters),
                )
                changed = labels != self._lora_labels
                if changed:  # one series: the current adapters
                    self._lora_info.clear()
                    self._lora_labels = labels
                self._lora_info.labels(self.model_name, *labels).set_to_current_time()
                if self._vllm is not None:
                    self._vllm.set_lora(labels, changed)

    def _observe_spec_decode(self, now: SpecDecodeStats) -> None:
        grew = _spec_decode_growth(self._last_spec, now)
        self._spec_drafts.inc(grew.num_drafts)
        self._spec_draft_tokens.inc(grew.num_draft_tokens)
        self._spec_accepted.inc(grew.num_accepted_tokens)
        for pos, count in enumerate(grew.accepted_per_pos):
            if count > 0:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(count)
        if self._vllm is not None:
            self._vllm.add_spec_decode(grew)
        self._last_spec = now.copy()

    def render(self) -> tuple[bytes, str]:
        """The exposition text of this registry and its HTTP content type."""
        with self._lock:
            if self._kv_events is not None:
                dropped = self._kv_events.dropped_batches
                grew = _growth(self._last_kv_events_dropped, dropped)
                self._kv_events_dropped.labels(self.model_name).inc(grew)
                self._last_kv_events_dropped = dropped
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _spec_decode_growth(last: SpecDecodeStats, now: SpecDecodeStats) -> SpecDecodeStats:
    """What the engine's speculative-decoding totals grew by since ``last``: all of
    ``now`` when they went down (a new engine)."""
    if now.num_drafts < last.num_drafts:
        last = SpecDecodeStats()
    before = last.accepted_per_pos + [0] * (len(now.accepted_per_pos) - len(last.accepted_per_pos))
    return SpecDecodeStats(
        now.num_drafts - last.num_drafts,
        now.num_draft_tokens - last.num_draft_tokens,
        now.num_accepted_tokens - last.num_accepted_tokens,
        [count - b for count, b in zip(now.accepted_per_pos, before, strict=False)],
    )


def _growth(last: int, now: int) -> int:
    return now - last if now >= last else now
