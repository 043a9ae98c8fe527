"""Engine metrics and request log lines, checked against a real engine's requests."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import EngineStats, LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.spec_decode.metrics import SpecDecodeStats
from kvserve.telemetry import definitions as d
from kvserve.telemetry.prometheus import EngineMetrics
from kvserve.telemetry.request_log import log_request, request_record

MODEL = "tiny-llama"
TTFT_SLOS = (0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0)
TOKEN_SLOS = (0.01, 0.025, 0.05, 0.1, 0.2)
HISTOGRAMS = (
    "kvserve_time_to_first_token_seconds",
    "kvserve_inter_token_latency_seconds",
    "kvserve_time_per_output_token_seconds",
    "kvserve_request_queue_time_seconds",
    "kvserve_request_prefill_time_seconds",
    "kvserve_request_decode_time_seconds",
    "kvserve_e2e_request_latency_seconds",
)
COUNTERS = (
    "kvserve_prompt_tokens_total",
    "kvserve_generation_tokens_total",
    "kvserve_prefix_cache_queried_tokens_total",
    "kvserve_prefix_cache_hit_tokens_total",
    "kvserve_requests_finished_total",
    "kvserve_num_preemptions_total",
)
GAUGES = (
    "kvserve_num_requests_running",
    "kvserve_num_requests_waiting",
    "kvserve_kv_cache_usage_ratio",
    "kvserve_cache_config_info",
)


def samples(metrics: EngineMetrics) -> list[Sample]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    want = {"model": MODEL, **labels}
    found = [s.value for s in samples(metrics) if s.name == name and s.labels == want]
    assert len(found) == 1, f"{name}{want}: {found}"
    return found[0]


def bucket_bounds(metrics: EngineMetrics, name: str) -> set[float]:
    return {float(s.labels["le"]) for s in samples(metrics) if s.name == f"{name}_bucket"}


class Driver:
    """Runs the engine step by step and feeds every output and stats to the metrics."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.finished: dict[str, RequestOutput] = {}

    def _feed(self, outs: Iterable[RequestOutput]) -> None:
        for out in outs:
            if out.finished:
                assert out.request_id not in self.finished
                self.finished[out.request_id] = out
                self.metrics.observe_finished(out)
        self.metrics.observe_engine(self.engine.stats())

    def step(self) -> None:
        self._feed(self.engine.step())

    def abort(self, *request_ids: str) -> None:
        self._feed(self.engine.abort_request(list(request_ids)))

    def run_until_idle(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


@pytest.fixture
def llm(checkpoint_dir) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(
        str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=4, max_num_seqs=2
    )


@pytest.fixture
def driven(llm: LLM) -> tuple[Driver, EngineMetrics, list[int]]:
    """A mix of requests: length, stop, one-token, aborted waiting/running, an error."""
    eng = llm.engine
    metrics = EngineMetrics(MODEL)
    metrics.set_cache_info(eng.config.block_size, eng.num_kv_blocks, eng.config.kv_cache_dtype)
    drv = Driver(eng, metrics)
    prompt = list(range(10, 33))  # 23 tokens: 5 full blocks of 4
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    eng.add_request("long", prompt, greedy)
    eng.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    eng.add_request("queued", [8, 9, 10, 11], greedy)  # max_num_seqs=2 keeps it waiting
    drv.step()  # "long" and "one" run ("one" finishes); "queued" waits
    assert value(metrics, "kvserve_num_requests_running") == 1
    assert value(metrics, "kvserve_num_requests_waiting") == 1
    assert value(metrics, "kvserve_kv_cache_usage_ratio") > 0
    drv.abort("queued")
    drv.run_until_idle()
    long_ids = drv.finished["long"].outputs[0].token_ids

    # The same prompt again hits the prefix cache; it stops on its third token's id.
    stop_id = long_ids[2]
    eng.add_request(
        "stopped",
        prompt,
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    eng.add_request(
        "running",
        [40, 41, 42, 43, 44],
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
    )
    for _ in range(3):
        drv.step()
    drv.abort("running")
    drv.run_until_idle()
    metrics.observe_error(prompt_tokens=7)
    return drv, metrics, long_ids


def test_counts_follow_the_requests(driven: tuple[Driver, EngineMetrics, list[int]]) -> None:
    drv, metrics, long_ids = driven
    outs = list(drv.finished.values())
    assert {o.request_id: o.outputs[0].finish_reason for o in outs} == {
        "long": "length",
        "one": "length",
        "queued": "abort",
        "stopped": "stop",
        "running": "abort",
    }
    assert drv.finished["queued"].outputs[0].token_ids == []
    assert len(drv.finished["running"].outputs[0].token_ids) == 3
    assert (
        drv.finished["stopped"].outputs[0].token_ids == long_ids[: long_ids.index(long_ids[2]) + 1]
    )

    def n_out(o: RequestOutput) -> int:
        return len(o.outputs[0].token_ids)

    with_tokens = [o for o in outs if n_out(o) >= 1]
    assert len(with_tokens) == 4
    count = {name: value(metrics, f"{name}_count") for name in HISTOGRAMS}
    assert count["kvserve_time_to_first_token_seconds"] == len(with_tokens)
    assert count["kvserve_e2e_request_latency_seconds"] == len(with_tokens)
    assert count["kvserve_request_decode_time_seconds"] == len(with_tokens)
    assert count["kvserve_request_prefill_time_seconds"] == len(with_tokens)
    assert count["kvserve_request_queue_time_seconds"] == len(outs) - 1  # "queued" never ran
    assert count["kvserve_inter_token_latency_seconds"] == sum(n_out(o) - 1 for o in with_tokens)
    assert count["kvserve_time_per_output_token_seconds"] == sum(n_out(o) > 1 for o in outs)

    def sum_of(name: str) -> float:
        return value(metrics, f"{name}_sum")

    assert sum_of("kvserve_time_to_first_token_seconds") == pytest.approx(
        sum(d.ttft(o.metrics.arrival_time, o.metrics.token_times[0]) for o in with_tokens)
    )
    assert sum_of("kvserve_inter_token_latency_seconds") == pytest.approx(
        sum(sum(d.itls(o.metrics.token_times)) for o in with_tokens)
    )
    assert sum_of("kvserve_e2e_request_latency_seconds") == pytest.approx(
        sum(d.e2e(o.metrics.arrival_time, o.metrics.token_times[-1]) for o in with_tokens)
    )

    assert value(metrics, "kvserve_generation_tokens_total") == sum(n_out(o) for o in outs)
    assert value(metrics, "kvserve_prompt_tokens_total") == (
        sum(len(o.prompt_token_ids) for o in outs) + 7
    )
    by_reason = {
        r: value(metrics, "kvserve_requests_finished_total", finished_reason=r)
        for r in ("stop", "length", "abort", "error")
    }
    assert by_reason == {"stop": 1, "length": 2, "abort": 2, "error": 1}


def test_engine_counters_and_gauges(driven: tuple[Driver, EngineMetrics, list[int]]) -> None:
    drv, metrics, _ = driven
    stats = drv.engine.stats()
    assert stats.prefix_cache_hit_tokens >= 20  # the repeated prompt's 5 full blocks
    assert drv.finished["stopped"].num_cached_tokens == 20
    queried = value(metrics, "kvserve_prefix_cache_queried_tokens_total")
    assert queried == stats.prefix_cache_queried_tokens
    assert value(metrics, "kvserve_prefix_cache_hit_tokens_total") == stats.prefix_cache_hit_tokens
    assert value(metrics, "kvserve_num_preemptions_total") == stats.num_preemptions
    assert value(metrics, "kvserve_num_requests_running") == 0
    assert value(metrics, "kvserve_num_requests_waiting") == 0
    assert value(metrics, "kvserve_kv_cache_usage_ratio") == 0.0
    assert (
        value(
            metrics,
            "kvserve_cache_config_info",
            block_size="4",
            cache_dtype="auto",
            num_gpu_blocks=str(drv.engine.num_kv_blocks),
        )
        == 1
    )


def test_exposed_names_and_buckets(driven: tuple[Driver, EngineMetrics, list[int]]) -> None:
    _, metrics, _ = driven
    names = {s.name for s in samples(metrics)}
    for h in HISTOGRAMS:
        assert {f"{h}_bucket", f"{h}_count", f"{h}_sum"} <= names
    assert set(COUNTERS) <= names
    assert set(GAUGES) <= names
    assert not any(n.endswith("_total_total") for n in names)
    body = metrics.render()[0].decode()
    assert "_total_total" not in body
    assert "# TYPE kvserve_prompt_tokens_total counter" in body
    assert set(TTFT_SLOS) <= bucket_bounds(metrics, "kvserve_time_to_first_token_seconds")
    for h in ("kvserve_inter_token_latency_seconds", "kvserve_time_per_output_token_seconds"):
        assert set(TOKEN_SLOS) <= bucket_bounds(metrics, h)
    for h in HISTOGRAMS[3:]:
        assert max(bucket_bounds(metrics, h) - {float("inf")}) >= 300
    # Every series carries the model label; only low-cardinality labels (no request ids).
    allowed = {"model", "finished_reason", "le", "block_size", "cache_dtype", "num_gpu_blocks"}
    for s in samples(metrics):
        assert s.labels.get("model") == MODEL
        assert set(s.labels) <= allowed, s


def test_fresh_metrics_expose_zeroes() -> None:
    metrics = EngineMetrics(MODEL)
    for r in ("stop", "length", "abort", "error"):
        assert value(metrics, "kvserve_requests_finished_total", finished_reason=r) == 0
    assert value(metrics, "kvserve_time_to_first_token_seconds_count") == 0
    # Two instances in one process do not collide: each has its own registry.
    other = EngineMetrics(MODEL)
    other.observe_error(3)
    assert value(metrics, "kvserve_requests_finished_total", finished_reason="error") == 0


def test_engine_counters_add_deltas_and_survive_a_reset() -> None:
    metrics = EngineMetrics(MODEL)

    def stats(queried: int, hit: int, preempted: int) -> EngineStats:
        return EngineStats(1, 0, 0.5, 10, queried, hit, preempted)

    for q, h, p in [(10, 4, 0), (10, 4, 0), (30, 12, 2), (5, 0, 1)]:  # the last: a new engine
        metrics.observe_engine(stats(q, h, p))
    assert value(metrics, "kvserve_prefix_cache_queried_tokens_total") == 35
    assert value(metrics, "kvserve_prefix_cache_hit_tokens_total") == 12
    assert value(metrics, "kvserve_num_preemptions_total") == 3


def test_preemptions_counted_from_a_real_engine(checkpoint_dir) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(checkpoint_dir("llama")), dtype="float32", device="cpu", block_size=4, num_kv_blocks=6
    )
    metrics = EngineMetrics(MODEL)
    drv = Driver(llm.engine, metrics)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.engine.add_request("a", list(range(10, 18)), params)  # 20 tokens = 5 blocks each
    llm.engine.add_request("b", list(range(20, 28)), params)
    drv.run_until_idle()
    assert llm.engine.stats().num_preemptions > 0
    assert value(metrics, "kvserve_num_preemptions_total") == llm.engine.stats().num_preemptions
    assert value(metrics, "kvserve_generation_tokens_total") == 24
    assert value(metrics, "kvserve_inter_token_latency_seconds_count") == 22
    assert sum(o.metrics.num_preemptions for o in drv.finished.values()) > 0


def test_observe_finished_refuses_an_unfinished_output(llm: LLM) -> None:
    llm.engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    (out,) = llm.engine.step()
    assert not out.finished
    with pytest.raises(ValueError, match="has not finished"):
        EngineMetrics(MODEL).observe_finished(out)


def test_request_record(
    driven: tuple[Driver, EngineMetrics, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    drv, _, _ = driven
    keys = {
        "request_id",
        "engine_request_id",
        "trace_id",
        "model",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "finish_reason",
        "num_preemptions",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "finished_time",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "queue_time_s",
    }
    for out in drv.finished.values():
        rec = request_record(out, MODEL, trace_id="4bf92f3577b34da6a3ce929d0e0e4736")
        assert set(rec) == keys
        assert json.loads(json.dumps(rec)) == rec
        assert rec["request_id"] == out.request_id and rec["model"] == MODEL
        assert rec["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert rec["prompt_tokens"] == len(out.prompt_token_ids)
        assert rec["output_tokens"] == len(out.outputs[0].token_ids)
        assert rec["finish_reason"] == out.outputs[0].finish_reason
        assert rec["finished_time"] == out.metrics.finished_time
        if rec["output_tokens"] == 0:
            continue
        s, f, e = rec["arrival_time"], rec["first_token_time"], rec["last_token_time"]
        q = rec["first_scheduled_time"]
        assert isinstance(s, float) and isinstance(f, float) and isinstance(e, float)
        assert isinstance(q, float)
        assert s <= q <= f <= e
        assert rec["ttft_s"] == pytest.approx(f - s)
        assert rec["e2e_s"] == pytest.approx(e - s)
        assert rec["queue_time_s"] == pytest.approx(q - s)
        o = rec["output_tokens"]
        assert isinstance(o, int)
        assert rec["tpot_s"] == (pytest.approx((e - f) / (o - 1)) if o > 1 else None)

    stopped = request_record(drv.finished["stopped"], MODEL)
    assert stopped["cached_tokens"] == 20 and stopped["trace_id"] is None
    queued = request_record(drv.finished["queued"], MODEL)
    assert queued["finish_reason"] == "abort" and queued["output_tokens"] == 0
    for k in (
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "queue_time_s",
    ):
        assert queued[k] is None, k

    with caplog.at_level(logging.INFO, logger="kvserve.requests"):
        log_request(drv.finished["long"], MODEL, trace_id="t-1")
    (line,) = [r for r in caplog.records if r.name == "kvserve.requests"]
    assert line.levelno == logging.INFO
    assert " " not in line.getMessage()  # compact separators
    assert json.loads(line.getMessage()) == request_record(drv.finished["long"], MODEL, "t-1")


def test_vllm_names_only_with_metrics_compat() -> None:
    plain = EngineMetrics("m")
    plain.set_cache_info(16, 100, "auto")
    assert b"vllm:" not in plain.render()[0]
    compat = EngineMetrics("m", compat="vllm")
    compat.set_cache_info(16, 100, "fp8_e4m3")
    body = compat.render()[0]
    assert (
        b'kvserve_cache_config_info{block_size="16",cache_dtype="fp8_e4m3",model="m",'
        b'num_gpu_blocks="100"} 1.0' in body
    )
    assert (
        b'vllm:cache_config_info{block_size="16",cache_dtype="fp8_e4m3",engine="0",'
        b'model_name="m",num_gpu_blocks="100"} 1.0' in body
    )
    with pytest.raises(ValueError, match="'sglang' is not one of"):
        EngineMetrics("m", compat="sglang")


def spec_decode_series(metrics: EngineMetrics, prefix: str) -> dict[tuple[str, str], float]:
    """The speculative-decoding counters' samples under ``prefix`` (``kvserve_`` or
    ``vllm:``), by name without the prefix and position ("" for the totals)."""
    return {
        (s.name.removeprefix(prefix), s.labels.get("position", "")): s.value
        for s in samples(metrics)
        if s.name.startswith(f"{prefix}spec_decode_") and s.name.endswith("_total")
    }


def test_vllm_compat_mirrors_the_speculative_decoding_counters() -> None:
    metrics = EngineMetrics(MODEL, compat="vllm")

    def observe(drafts: int, draft_tokens: int, accepted_per_pos: list[int]) -> None:
        spec = SpecDecodeStats(drafts, draft_tokens, sum(accepted_per_pos), accepted_per_pos)
        metrics.observe_engine(EngineStats(0, 0, 0.0, 8, 0, 0, 0, spec_decode=spec))

    observe(0, 0, [])
    ours, theirs = spec_decode_series(metrics, "kvserve_"), spec_decode_series(metrics, "vllm:")
    assert (
        ours
        == theirs
        == {
            ("spec_decode_num_drafts_total", ""): 0,
            ("spec_decode_num_draft_tokens_total", ""): 0,
            ("spec_decode_num_accepted_tokens_total", ""): 0,
        }
    )
    assert {
        s.name: s.labels for s in samples(metrics) if s.name == "vllm:spec_decode_num_drafts_total"
    } == {"vllm:spec_decode_num_drafts_total": {"model_name": MODEL, "engine": "0"}}
    observe(3, 12, [3, 2])
    observe(5, 20, [5, 3, 1])  # a position's series appears with its first acceptance
    observe(2, 8, [1])  # a new engine: its totals count from zero
    want = {
        ("spec_decode_num_drafts_total", ""): 7,
        ("spec_decode_num_draft_tokens_total", ""): 28,
        ("spec_decode_num_accepted_tokens_total", ""): 10,
        ("spec_decode_num_accepted_tokens_per_pos_total", "0"): 6,
        ("spec_decode_num_accepted_tokens_per_pos_total", "1"): 3,
        ("spec_decode_num_accepted_tokens_per_pos_total", "2"): 1,
    }
    assert spec_decode_series(metrics, "kvserve_") == want
    assert spec_decode_series(metrics, "vllm:") == want
    plain = EngineMetrics(MODEL)
    assert spec_decode_series(plain, "vllm:") == {}
