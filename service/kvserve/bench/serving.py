"""``kvserve bench serve``: ``kvserve serve`` under load vs the offline engine
(docs/bench-methods.md, "kvserve bench serve")."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.bench.launcher import Launcher, LaunchSettings, Replica
from kvserve.bench.offline import MODEL_SIZES, make_workload, workload_arguments, workload_problem
from kvserve.bench.results import say, text_row
from kvserve.bench.sse_client import (
    COMPLETIONS,
    ClientRecord,
    Connection,
    WorkloadPass,
    completion_body,
    itls,
    run_on_uvloop,
    stream_workload,
)
from kvserve.bench.suite import SuiteContext
from kvserve.bench.timelines import Workload, greedy, percentile_ms, timed_generate
from kvserve.engine_options import flag_type
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.llm import LLM
    from kvserve.model.config import ModelConfig

TTFT_PROMPT_LEN = 32  # the TTFT pass repeats one prompt: every request is the same work
TTFT_MAX_TOKENS = 8  # enough to reach the first visible token; keeps the pass short
T = TypeVar("T")
SERVE_POSITIONS = 1024  # the benchmark checkpoint's max_position_embeddings


def add_arguments(p: argparse.ArgumentParser) -> None:
    workload_arguments(
        p,
        num_prompts=64,
        rounds=1,
        size_help="the layer dimensions of `kvserve bench offline`'s models, with the test "
        "tokenizer's own 512-token vocabulary so that every generated id streams as text "
        "(30m: ~26M parameters, about 1-2 minutes on 2 CPU cores; tiny: a smoke test)",
        rounds_help="alternate offline and serving this many times; report each one's best "
        "time and the TTFT medians over all rounds",
    )
    p.add_argument(
        "--concurrency", type=flag_type("max_num_seqs"), default=32, help="clients = max_num_seqs"
    )
    p.add_argument(
        "--ttft-requests",
        type=int,
        default=48,
        help="requests sent one at a time (per round) to measure the server's TTFT overhead",
    )


@dataclass
class TtftPair:
    """One lone request on each side; the server's with its engine timeline (from the
    request log, same clock as the client) when it was found there."""

    offline: float  # engine-side TTFT (to the step that hands the token over)
    offline_compute: float  # its first scheduled → that token sampled
    server: float  # client-side TTFT
    http_in: float | None = None  # the request body's write → arrival stamped
    to_engine: float | None = None  # arrival → first scheduled
    compute: float | None = None  # first scheduled → the visible token
    http_out: float | None = None  # the visible token → its chunk read by the client


def _engine_ttft(
    engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int] | None:
    """A lone request's engine-side TTFT (to the step that returns its first visible
    output), its compute part, and that output's index; None if none was visible."""
    engine.add_request(rid, prompt, greedy(max_tokens))
    found: tuple[float, float, int] | None = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        handed_over = engine.clock()
        for out in outs:
            m = out.metrics
            if found is None and out.outputs[0].delta_text and m.first_scheduled_time is not None:
                ttft = definitions.ttft(m.arrival_time, handed_over)
                found = (ttft, m.token_times[-1] - m.first_scheduled_time, len(m.token_times) - 1)
    return found


async def _ttft_pairs(
    url: str, run_offline: Callable[..., Any], engine: LLMEngine, work: Workload, n: int
) -> tuple[list[TtftPair], list[tuple[str, ClientRecord]], int]:
    """``n`` lone requests on each side, in turn, after a probe for the index k of the
    first visible token: the pairs, each server request's id and record, and k."""
    # The one request repeated (prefix caching is off): the same work every time.
    prompt = work.prompts[0][:TTFT_PROMPT_LEN]
    max_tokens = min(TTFT_MAX_TOKENS, max(work.output_lens))
    probe = await run_offline(_engine_ttft, engine, "ttft-probe", prompt, max_tokens)
    if probe is None:
        return [], [], 0
    max_tokens = max(probe[2] + 1, 2)
    pairs: list[TtftPair] = []
    sent: list[tuple[str, ClientRecord]] = []
    async with Connection(url) as client:
        await client.stream(COMPLETIONS, completion_body(prompt, 2))  # warm-up, keep-alive
        for i in range(n):
            offline = await run_offline(_engine_ttft, engine, f"ttft-off-{i}", prompt, max_tokens)
            rid = f"ttft-srv-{i}"
            rec = await client.stream(COMPLETIONS, completion_body(prompt, max_tokens), rid)
            if rec.error is not None:
                raise RuntimeError(f"TTFT request failed: {rec.error}")
            if offline is None or rec.ttft is None:
                continue
            pairs.append(TtftPair(offline[0], offline[1], rec.ttft))
            sent.append((rid, rec))
    return pairs, sent, probe[2]


def decompose(
    pairs: list[TtftPair],
    sent: list[tuple[str, ClientRecord]],
    visible_at: int,
    log: dict[str, Any],
) -> None:
    """Fill in each pair's server-side parts from the server's request log (on the
    client's clock)."""
    for pair, (rid, rec) in zip(pairs, sent, strict=True):
        r = log.get(rid)
        if r is None or rec.first is None or r.get("last_token_time") is None:
            continue
        arrival, scheduled = float(r["arrival_time"]), float(r["first_scheduled_time"])
        # The visible token: the first, or the last when k > 0 (see _ttft_pairs).
        token = float(r["last_token_time" if visible_at > 0 else "first_token_time"])
        pair.http_in = arrival - rec.send
        pair.to_engine = definitions.queue_time(arrival, scheduled)
        pair.compute = token - scheduled
        pair.http_out = rec.first - token


def _summarise(
    args: argparse.Namespace,
    config: ModelConfig,
    work: Workload,
    offline_times: list[float],
    serving: list[WorkloadPass],
    pairs: list[TtftPair],
) -> dict[str, Any]:
    """Every figure, by the name ``--json`` prints it under."""

    def served(p: WorkloadPass) -> int:
        return sum(r.output_tokens for r in p.records if r.ok)

    best = min(serving, key=lambda p: p.seconds)
    ok = [r for r in best.records if r.ok]
    t_off, t_srv = min(offline_times), best.seconds
    off_rate, srv_rate = work.output_tokens / t_off, served(best) / t_srv
    records = [r for p in serving for r in p.records]
    res: dict[str, Any] = {
        "model_size": args.model_size,
        "model_params": config.num_params(),
        "vocab_size": config.vocab_size,
        "dtype": args.dtype,
        "device": args.device,
        "num_prompts": len(work.prompts),
        "concurrency": args.concurrency,
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "rounds": args.rounds,
        "offline_seconds": round(t_off, 3),
        "serving_seconds": round(t_srv, 3),
        "offline_output_tok_s": round(off_rate, 1),
        "serving_output_tok_s": round(srv_rate, 1),
        # serving / offline: best round of each, then round by round
        "throughput_ratio": round(srv_rate / off_rate, 3),
        "throughput_ratio_per_round": [
            round((served(p) / p.seconds) / (work.output_tokens / t), 3)
            for t, p in zip(offline_times, serving, strict=True)
        ],
        "serving_requests_completed": sum(r.ok for r in records),  # over all rounds
        "serving_requests_failed": sum(not r.ok for r in records),
        "serving_output_tokens": served(best),  # in the best round
    }
    shown = [(r, r.first, r.last) for r in ok if r.first is not None and r.last is not None]
    latencies: dict[str, tuple[list[float | None], tuple[int, ...]]] = {
        "ttft": ([definitions.ttft(r.send, f) for r, f, _ in shown], (50, 99)),
        "tpot": ([definitions.tpot(f, e, r.output_tokens) for r, f, e in shown], (50,)),
        "itl": ([*itls(ok)], (50, 99)),
        "e2e": ([definitions.e2e(r.send, e) for r, _, e in shown], (50,)),
    }
    for name, (values, qs) in latencies.items():
        for q in qs:
            res[f"serving_{name}_p{q}_ms"] = percentile_ms([v for v in values if v is not None], q)
    # The decomposition is over the pairs whose server request was in the log; "net" is
    # the server's share per pair without the engine's own time outside compute.
    diffs = [p.server - p.offline for p in pairs]
    parts = [p for p in pairs if p.compute is not None]
    added = [p.server - (p.compute or 0.0) for p in parts]
    own = [p.offline - p.offline_compute for p in pairs]
    res |= {
        "ttft_pairs": len(pairs),
        "ttft_server_p50_ms": percentile_ms([p.server for p in pairs], 50),
        "ttft_engine_p50_ms": percentile_ms([p.offline for p in pairs], 50),
        "ttft_overhead_ms": percentile_ms(diffs, 50),  # median of (server − offline)
        "ttft_overhead_p25_ms": percentile_ms(diffs, 25),
        "ttft_overhead_p75_ms": percentile_ms(diffs, 75),
        "ttft_decomposed_requests": len(parts),
    }
    for part in ("http_in", "to_engine", "compute", "http_out"):
        res[f"ttft_{part}_p50_ms"] = percentile_ms([getattr(p, part) for p in parts], 50)
    res["ttft_server_added_p50_ms"] = percentile_ms(added, 50)
    res["ttft_engine_own_p50_ms"] = percentile_ms(own, 50)
    net = [a - (p.offline - p.offline_compute) for a, p in zip(added, parts, strict=True)]
    res["ttft_server_net_p50_ms"] = percentile_ms(net, 50)
    return res


def _print_table(res: dict[str, Any]) -> None:
    print(
        f"model: random Llama ({res['model_size']} dims, {res['vocab_size']}-token vocabulary), "
        f"{res['model_params'] / 1e6:.1f}M parameters, {res['dtype']}, {res['device']}"
    )
    print(
        f"workload: {res['num_prompts']} prompts, {res['prompt_tokens']} prompt tokens, "
        f"{res['output_tokens']} output tokens, concurrency {res['concurrency']}, "
        f"best of {res['rounds']} interleaved round(s)"
    )
    widths = (28, 9, 14, 12, 12, 12, 12)
    header = ("seconds", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ITL p99 ms")
    print(text_row(["", *header], widths))
    served = [res[f"serving_{x}_ms"] for x in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p99")]
    for label, side, figures in (
        ("offline (LLM.generate)", "offline", [None] * 4),
        ("serving (kvserve serve)", "serving", served),
    ):
        cells = [label, res[f"{side}_seconds"], res[f"{side}_output_tok_s"], *figures]
        print(text_row(cells, widths, ".2f .1f .1f .1f .1f .1f"))
    print(
        f"requests: {res['serving_requests_completed']} completed, "
        f"{res['serving_requests_failed']} failed over {res['rounds']} round(s); "
        f"{res['serving_output_tokens']} output tokens served in the best round"
    )
    rounds = ", ".join(f"{x:.2f}" for x in res["throughput_ratio_per_round"])
    print(
        f"serving/offline throughput: {res['throughput_ratio']:.2f} best vs best "
        f"(target ≥ 0.90); round by round: {rounds}"
    )
    if res["ttft_overhead_ms"] is None:
        print("server TTFT overhead: not measured (--ttft-requests 0 or no visible output)")
        return
    if res["ttft_server_added_p50_ms"] is not None:  # and so the net figure too
        print(
            f"server TTFT overhead (median over {res['ttft_decomposed_requests']} lone requests of "
            f"TTFT − the engine's compute): {res['ttft_server_added_p50_ms']:+.2f} ms"
        )
        print(
            f"  medians: HTTP in {res['ttft_http_in_p50_ms']:.2f} ms, to the engine "
            f"{res['ttft_to_engine_p50_ms']:.2f} ms, compute {res['ttft_compute_p50_ms']:.2f} ms, "
            f"out to the client {res['ttft_http_out_p50_ms']:.2f} ms"
        )
        print(
            f"  the engine's own time outside compute, offline (scheduling, detokenizing: "
            f"{res['ttft_engine_own_p50_ms']:.2f} ms) is in that too; net of it, per pair: "
            f"{res['ttft_server_net_p50_ms']:+.2f} ms (target ≤ 2 ms)"
        )
    print(
        f"paired with the offline engine ({res['ttft_pairs']} pairs, interleaved): median "
        f"difference {res['ttft_overhead_ms']:+.2f} ms (p25 {res['ttft_overhead_p25_ms']:+.2f}, "
        f"p75 {res['ttft_overhead_p75_ms']:+.2f}); TTFT p50 {res['ttft_server_p50_ms']:.2f} ms "
        f"through the server, {res['ttft_engine_p50_ms']:.2f} ms offline"
    )


def _measure(
    args: argparse.Namespace,
    offline: LLM,
    server: Replica,
    work: Workload,
    torch_thread: ThreadPoolExecutor,
) -> tuple[list[float], list[WorkloadPass], list[TtftPair]]:
    """The throughput rounds (the whole workload offline, then through the server), then
    the lone requests of the TTFT comparison, decomposed with the server's request log."""
    from kvserve.heap import freeze_startup_heap

    async def on_torch(fn: Callable[..., T], *fn_args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(torch_thread, fn, *fn_args)

    # As `kvserve serve` does (kvserve.heap), so neither side pays for collections the
    # other skips; undone at the end (a caller may go on running).
    freeze_startup_heap()
    try:
        offline_times: list[float] = []
        serving: list[WorkloadPass] = []
        for r in range(1, args.rounds + 1):
            seconds, timelines = torch_thread.submit(timed_generate, offline, work).result()
            produced = sum(t.n for t in timelines)
            assert produced == work.output_tokens, (produced, work.output_tokens)
            offline_times.append(seconds)
            say(f"  round {r}/{args.rounds}: offline  {seconds:7.2f} s")
            streamed = run_on_uvloop(stream_workload(server.http_url, None, work, args.concurrency))
            serving.append(streamed)
            failed = sum(not rec.ok for rec in streamed.records)
            failures = f"  ({failed} failed)" if failed else ""
            say(f"  round {r}/{args.rounds}: serving  {streamed.seconds:7.2f} s{failures}")
        pairs: list[TtftPair] = []
        if args.ttft_requests > 0:
            say(f"  TTFT: {args.ttft_requests} lone requests on each side, interleaved ...")
            pairs, sent, visible_at = run_on_uvloop(
                _ttft_pairs(server.http_url, on_torch, offline.engine, work, args.ttft_requests)
            )
            decompose(pairs, sent, visible_at, server.request_log())
    finally:
        gc.unfreeze()
    return offline_times, serving, pairs


def run(args: argparse.Namespace) -> int:
    from kvserve.model.config import ModelConfig
    from kvserve.testing.checkpoints import build_random_checkpoint

    if problem := workload_problem(args, SERVE_POSITIONS):
        say(f"kvserve bench serve: error: {problem}")
        return 2
    # Every torch computation of this process runs in this one thread (one OpenMP team;
    # see kvserve.engine.cpu_threads); the main thread runs the clients' event loop.
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-torch")

    def on_torch(fn: Callable[..., T], *fn_args: Any) -> T:
        return torch_thread.submit(fn, *fn_args).result()

    with tempfile.TemporaryDirectory(prefix="kvserve-bench-serve-") as tmp, torch_thread:
        # The offline bench's layer dimensions; the vocabulary is the tokenizer's own
        # (vocab_size=None), so generated ids decode to text and stream as SSE chunks.
        dims = {k: v for k, v in MODEL_SIZES[args.model_size].items() if k != "vocab_size"}
        say(f"building a random {args.model_size} Llama checkpoint ...")
        model_dir = on_torch(
            lambda: build_random_checkpoint(
                Path(tmp) / "model", "llama", max_position_embeddings=SERVE_POSITIONS,
                seed=args.seed,
                **dims,  # type: ignore[arg-type]
            )
        )  # fmt: skip
        config = ModelConfig.from_file(model_dir)
        work = make_workload(args, config.vocab_size)
        say(
            f"workload: {args.num_prompts} prompts, {work.prompt_tokens} prompt "
            f"tokens, {work.output_tokens} output tokens, concurrency {args.concurrency}"
        )
        say("loading the offline engine and starting `kvserve serve` ...")
        # The same engine settings on both sides.
        engine: dict[str, Any] = dict(
            dtype=args.dtype, max_num_seqs=args.concurrency, max_model_len=work.max_len
        )
        settings = LaunchSettings(str(model_dir), device=args.device, seed=args.seed, **engine)
        ctx = SuiteContext(Path(tmp), Path(tmp), args.device, seed=args.seed)
        offline = on_torch(lambda: ctx.llm(model_dir, **engine))
        on_torch(timed_generate, offline, Workload(work.prompts[:2], work.output_lens[:2]))
        try:
            with Launcher(settings, Path(tmp)) as launcher:
                (server,) = launcher.start_replicas(
                    1, prefix_caching=False, grpc=False, log_level="info"
                )
                offline_times, serving, pairs = _measure(args, offline, server, work, torch_thread)
        except RuntimeError as exc:
            say(f"kvserve bench serve: error: {exc}")
            return 1

    res = _summarise(args, config, work, offline_times, serving, pairs)
    if args.json:
        print(json.dumps(res))
    else:
        _print_table(res)
    errors = [rec.error for p in serving for rec in p.records if rec.error is not None]
    if errors:
        say(f"{len(errors)} requests failed; the first: {errors[0]}")
    return 0 if res["serving_requests_failed"] == 0 else 1
