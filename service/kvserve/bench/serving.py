"""``kvserve bench serve``: ``kvserve serve`` under load vs the offline engine.

Both sides run the same workload (random token-id prompts, greedy, ``ignore_eos``, each
request's own ``max_tokens``) on engines built with the same settings, at the same
concurrency:

* offline: ``LLM.generate`` over the whole workload with ``max_num_seqs = concurrency``,
  in this process;
* serving: a ``kvserve serve`` process on 127.0.0.1 (the real server, as deployed, with
  its request log at INFO), and ``concurrency`` asyncio clients (httpx, on uvloop where
  installed, like the server) in this process that take prompts from a shared queue and
  stream ``POST /v1/completions`` (``stream_options.include_usage``) until it is empty.

Throughput is output tokens / wall seconds on each side (the serving side counts the
tokens each response's ``usage`` reports); the rounds alternate the two sides.

TTFT: the same lone request (one 32-token prompt, prefix caching off, so every one is the
same engine work) alternates between the offline engine's step-level API and the server,
one pair at a time, so drift in the machine's speed falls on both alike. Two figures:

* paired: the median of (server TTFT − offline TTFT) over the pairs, client side against
  engine side. It carries the run-to-run noise of the forward pass itself. The offline
  output is visible when ``step()`` returns it, detokenized, to the caller.
* decomposed: the server's request log gives each request's engine timeline on the same
  monotonic clock as the client's timestamps (one machine), which splits the client's
  TTFT into: HTTP in (the request body's write → the handler stamps arrival, which it does
  on the request's head, so this is often slightly negative), to the engine (reading and
  validating the body, tokenization, hand-off to the engine thread → first scheduled), compute
  (first scheduled → the visible token), and out (that token → its SSE chunk read by the
  client). What the server adds is TTFT − compute, per request; its median is reported.
  That still holds the engine's own work outside compute (admitting and scheduling the
  request, detokenizing the token and building the output), which the offline side does
  as well: its median there is reported, and per pair the server's share net of it
  ((server TTFT − compute) − (offline TTFT − offline compute)) is the figure held to the
  2 ms target.

Every latency figure comes from ``kvserve.telemetry.definitions`` (docs/architecture.md §3):
``s`` = when the request's last byte was written to the socket (client side) or its
arrival (engine side), ``f``/``e`` = the first/last non-empty visible output (SSE chunks
with text on the client; steps whose ``delta_text`` is non-empty in the engine), so both
sides of the TTFT comparison wait for the same token.

The offline engine computes in one long-lived thread of this process (never the main
thread, which runs the clients): see ``kvserve.engine.cpu_threads`` for why one thread.
The model has ``kvserve bench offline``'s layer dimensions but the test tokenizer's own
vocabulary, so every generated id decodes to text (with the offline bench's 8192-token
vocabulary most ids are ones the tokenizer cannot show, and the streams would be nearly
empty). The clients share the machine's CPUs with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.bench.offline import MODEL_SIZES, make_workload
from kvserve.bench.processes import Proc, stop
from kvserve.bench.timelines import Workload
from kvserve.config import DTYPES
from kvserve.telemetry import definitions
from kvserve.telemetry.request_log import REQUEST_LOGGER

if TYPE_CHECKING:
    import httpx

    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.llm import LLM

MODEL_NAME = "bench-model"
TTFT_PROMPT_LEN = 32  # the TTFT pass repeats one prompt: every request is the same work
TTFT_MAX_TOKENS = 8  # enough to reach the first visible token; keeps the pass short
SERVER_STARTUP_TIMEOUT_S = 300.0
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="clients = max_num_seqs")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument(
        "--ttft-requests",
        type=int,
        default=48,
        help="requests sent one at a time (per round) to measure the server's TTFT overhead",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model-size",
        choices=sorted(MODEL_SIZES),
        default="30m",
        help="the layer dimensions of `kvserve bench offline`'s models, with the test "
        "tokenizer's own 512-token vocabulary so that every generated id streams as text "
        "(30m: ~26M parameters, about 1-2 minutes on 2 CPU cores; tiny: a smoke test)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate offline and serving this many times; report each one's best time "
        "and the TTFT medians over all rounds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ---- results ---------------------------------------------------------------------------
@dataclass
class ClientRecord:
    """One streamed request as the client saw it (``time.perf_counter`` seconds)."""

    send: float
    first: float | None = None  # first chunk with visible text
    last: float | None = None  # last chunk with visible text
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None


@dataclass
class ServingPass:
    seconds: float
    records: list[ClientRecord]


@dataclass
class TtftPair:
    """One lone request on each side; the server's with its engine timeline (from the
    request log, same clock as the client) when it was found there."""

    offline: float  # engine-side TTFT (to the step that hands the token over)
    server: float  # client-side TTFT
    offline_compute: float | None = None  # its first scheduled → that token sampled
    http_in: float | None = None  # the request body's write → arrival stamped
    to_engine: float | None = None  # arrival → first scheduled
    compute: float | None = None  # first scheduled → the visible token
    http_out: float | None = None  # the visible token → its chunk read by the client


@dataclass
class BenchResult:
    model_size: str
    model_params: int
    vocab_size: int
    dtype: str
    device: str
    num_prompts: int
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    rounds: int
    offline_seconds: float
    serving_seconds: float
    offline_output_tok_s: float
    serving_output_tok_s: float
    throughput_ratio: float  # serving / offline, best round of each
    throughput_ratio_per_round: list[float]  # serving / offline, round by round
    serving_requests_completed: int  # over all rounds
    serving_requests_failed: int  # over all rounds
    serving_output_tokens: int  # in the best round
    serving_ttft_p50_ms: float | None
    serving_ttft_p99_ms: float | None
    serving_tpot_p50_ms: float | None
    serving_itl_p50_ms: float | None
    serving_itl_p99_ms: float | None
    serving_e2e_p50_ms: float | None
    ttft_pairs: int  # lone requests on each side, interleaved
    ttft_server_p50_ms: float | None
    ttft_engine_p50_ms: float | None
    ttft_overhead_ms: float | None  # median of the pairs' (server − offline)
    ttft_overhead_p25_ms: float | None
    ttft_overhead_p75_ms: float | None
    # The decomposition (medians over the pairs whose server request was in the log).
    ttft_decomposed_requests: int
    ttft_http_in_p50_ms: float | None
    ttft_to_engine_p50_ms: float | None
    ttft_compute_p50_ms: float | None
    ttft_http_out_p50_ms: float | None
    ttft_server_added_p50_ms: float | None  # median of (client TTFT − compute)
    # The offline engine's own time outside compute (arrival → scheduled, the token → its
    # step returning it), which the server's requests spend in the engine too, and the
    # median per pair of the server's share net of it.
    ttft_engine_own_p50_ms: float | None
    ttft_server_net_p50_ms: float | None


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else round(seconds * 1000, 2)


# ---- engines and the server ------------------------------------------------------------
def run_on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark's clients (or stand-in server) on uvloop where it is installed, as
    the servers run.

    A client's own wake-ups fall inside the TTFT it measures (the offline side has no
    client), so a slower client loop would be charged to the server.
    """
    try:
        import uvloop
    except ImportError:  # not on Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _max_model_len(work: Workload) -> int:
    return max(map(len, work.prompts)) + max(work.output_lens)


def _make_llm(model_dir: Path, work: Workload, args: argparse.Namespace) -> LLM:
    """One engine; called twice so both sides get exactly the same settings."""
    from kvserve import LLM

    return LLM(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.concurrency,
        max_model_len=_max_model_len(work),
        seed=args.seed,
        enable_prefix_caching=False,  # random prompts share nothing; keep rounds identical
    )


def _start_server(
    model_dir: Path, work: Workload, args: argparse.Namespace, workdir: Path
) -> tuple[Proc, str]:
    """``kvserve serve`` with the offline engine's settings; returns once it is ready.

    Its log level is INFO, the default, so its request log (one JSON line per request,
    with the engine timeline) lands in the process's log file.
    """
    from kvserve.bench.processes import free_ports, spawn, wait_ready

    (port,) = free_ports(1)
    argv = [
        sys.executable, "-m", "kvserve", "serve", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--no-grpc", "--dtype", args.dtype, "--device", args.device,
        "--max-num-seqs", str(args.concurrency), "--max-model-len", str(_max_model_len(work)),
        "--seed", str(args.seed), "--no-prefix-caching", "--drain-timeout", "2",
        "--log-level", "info",
    ]  # fmt: skip
    proc = spawn("server", argv, workdir / "server.log", dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{url}/ready", time.monotonic() + SERVER_STARTUP_TIMEOUT_S)
    except BaseException:
        stop([proc])
        raise
    return proc, url


def _request_log(log: Path) -> dict[str, dict[str, Any]]:
    """The server's request log records (``kvserve.telemetry.request_log``) by request id."""
    records: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        _, found, payload = line.partition(f" {REQUEST_LOGGER.name} ")
        if found and payload.startswith("{"):
            try:
                record = json.loads(payload)
            except json.JSONDecodeError:
                continue
            records[str(record.get("request_id"))] = record
    return records


# ---- the serving side ------------------------------------------------------------------
def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_sse(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    rec: ClientRecord,
    on_event: Callable[[dict[str, Any], float], None],
    headers: dict[str, str] | None = None,
) -> None:
    """POST ``body`` (with ``headers``) and hand each SSE event to ``on_event`` with its
    arrival time.

    ``rec.send`` becomes the moment the request body's write begins: the write that puts
    the request's last byte on the socket (httpcore's trace events give it, so the client
    library's own work before it is not charged to the server; the call time stands in if
    the event never comes). Stamped before the write rather than after: a client thread
    preempted right after its write (the server waking on its CPU) would otherwise stamp
    ``send`` late and hide part of the server's time. Chunks are timed when their
    bytes arrive, before any parsing. HTTP and transport failures land in ``rec.error``;
    ``rec.first``/``rec.last`` are set from ``rec.chunk_times`` at the end.
    """
    rec.send = time.perf_counter()

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.started":
            rec.send = time.perf_counter()

    try:
        async with client.stream(
            "POST", path, json=body, headers=headers, extensions={"trace": trace}
        ) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return
            pending = b""
            async for raw in r.aiter_bytes():
                now = time.perf_counter()
                *lines, pending = (pending + raw).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: ") :].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = str(event["error"].get("message"))
                    on_event(event, now)
    except Exception as exc:  # a benchmark reports failures rather than dying on one
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        if rec.chunk_times:
            rec.first, rec.last = rec.chunk_times[0], rec.chunk_times[-1]


async def _stream_one(
    client: httpx.AsyncClient, body: dict[str, Any], request_id: str | None = None
) -> ClientRecord:
    """Stream one completion (timing: ``stream_sse``), as ``request_id`` if given."""
    rec = ClientRecord(send=time.perf_counter())

    def handle(event: dict[str, Any], now: float) -> None:
        if event.get("usage"):
            rec.output_tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            if choice.get("text"):
                rec.chunk_times.append(now)
            if choice.get("finish_reason") is not None:
                rec.finish_reason = choice["finish_reason"]

    headers = {"x-request-id": request_id} if request_id is not None else None
    await stream_sse(client, "/v1/completions", body, rec, handle, headers=headers)
    return rec


def _client(url: str, concurrency: int) -> httpx.AsyncClient:
    import httpx

    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(600.0),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )


async def _serving_pass(url: str, work: Workload, concurrency: int) -> ServingPass:
    """``concurrency`` workers drain a shared queue of the workload's requests."""
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(work.prompts)):
        todo.put_nowait(i)
    records: list[ClientRecord | None] = [None] * len(work.prompts)

    async with _client(url, concurrency) as client:
        # Warm-up (connections, first forward passes), outside the timed window.
        await asyncio.gather(
            *(_stream_one(client, _body(p, 4)) for p in work.prompts[: min(2, concurrency)])
        )

        async def worker() -> None:
            while True:
                try:
                    i = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records[i] = await _stream_one(client, _body(work.prompts[i], work.output_lens[i]))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return ServingPass(seconds, [r for r in records if r is not None])


# ---- TTFT, one request at a time -------------------------------------------------------
def _ttft_request(work: Workload) -> tuple[list[int], int]:
    """The one request the TTFT passes repeat (prefix caching is off): same work each time."""
    return work.prompts[0][:TTFT_PROMPT_LEN], min(TTFT_MAX_TOKENS, max(work.output_lens))


def _engine_ttft(
    engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int] | None:
    """Engine-side TTFT of a lone request, the first visible output − arrival (engine
    clock), its compute part (first scheduled → that token sampled), and the index of
    that output token; None if no output was visible.

    The output is visible when ``step()`` returns it, detokenized, to its caller (as the
    server's is when its chunk reaches the client), not when its token was sampled.
    """
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    found: tuple[float, float, int] | None = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        handed_over = engine.clock()
        for out in outs:
            m = out.metrics
            if found is None and out.outputs[0].delta_text and m.first_scheduled_time is not None:
                compute = m.token_times[-1] - m.first_scheduled_time
                found = (
                    definitions.ttft(m.arrival_time, handed_over),
                    compute,
                    len(m.token_times) - 1,
                )
    return found


def _same_clock() -> bool:
    """Whether the client's ``perf_counter`` and the engine's ``monotonic`` are one clock
    (true on Linux: both CLOCK_MONOTONIC), so their instants can be subtracted."""
    a, b = time.get_clock_info("perf_counter"), time.get_clock_info("monotonic")
    return a.implementation == b.implementation


async def _ttft_pairs(
    url: str, run_offline: Callable[..., Any], engine: LLMEngine, work: Workload, n: int
) -> tuple[list[TtftPair], list[tuple[str, ClientRecord]], int]:
    """``n`` lone requests on each side, one offline then one through the server, in turn.

    A probe finds the index k of the first visible output token. Both sides then ask for
    max(k + 1, 2) tokens: the visible token is the request log's ``first_token_time``
    when k = 0, else its ``last_token_time`` (and then also the request's last, whose
    bookkeeping runs before it is handed over). Returns the pairs (without the
    decomposition), each server request's id and client record, and k.
    """
    prompt, max_tokens = _ttft_request(work)
    probe = await run_offline(_engine_ttft, engine, "ttft-probe", prompt, max_tokens)
    if probe is None:
        return [], [], 0
    max_tokens = max(probe[2] + 1, 2)
    pairs: list[TtftPair] = []
    sent: list[tuple[str, ClientRecord]] = []
    async with _client(url, 1) as client:
        await _stream_one(client, _body(prompt, 2))  # warm-up (and the keep-alive connection)
        for i in range(n):
            offline = await run_offline(_engine_ttft, engine, f"ttft-off-{i}", prompt, max_tokens)
            rid = f"ttft-srv-{i}"
            rec = await _stream_one(client, _body(prompt, max_tokens), request_id=rid)
            if rec.error is not None:
                raise RuntimeError(f"TTFT request failed: {rec.error}")
            if offline is None or rec.first is None:
                continue
            server = definitions.ttft(rec.send, rec.first)
            pairs.append(TtftPair(offline[0], server, offline_compute=offline[1]))
            sent.append((rid, rec))
    return pairs, sent, probe[2]


def _decompose(
    pairs: list[TtftPair],
    sent: list[tuple[str, ClientRecord]],
    visible_at: int,
    log: dict[str, Any],
) -> None:
    """Fill in each pair's server-side parts from the request log (same clock)."""
    if not _same_clock():
        return
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


# ---- the run ---------------------------------------------------------------------------
def _summarise(
    args: argparse.Namespace,
    params: int,
    vocab_size: int,
    work: Workload,
    offline_times: list[float],
    serving: list[ServingPass],
    pairs: list[TtftPair],
) -> BenchResult:
    best = min(serving, key=lambda p: p.seconds)
    ok = [r for r in best.records if r.ok]
    served_tokens = sum(r.output_tokens for r in ok)
    t_off, t_srv = min(offline_times), best.seconds
    off_rate, srv_rate = work.output_tokens / t_off, served_tokens / t_srv
    per_round = [
        (sum(r.output_tokens for r in p.records if r.ok) / p.seconds) / (work.output_tokens / t)
        for t, p in zip(offline_times, serving, strict=True)
    ]
    ttfts = [definitions.ttft(r.send, r.first) for r in ok if r.first is not None]
    e2es = [definitions.e2e(r.send, r.last) for r in ok if r.last is not None]
    tpots = [
        t
        for r in ok
        if r.first is not None and r.last is not None
        for t in [definitions.tpot(r.first, r.last, r.output_tokens)]
        if t is not None
    ]
    itls = [gap for r in ok for gap in definitions.itls(r.chunk_times)]
    diffs = [p.server - p.offline for p in pairs]
    parts = [p for p in pairs if p.compute is not None]

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    def part(name: str) -> float | None:
        return _ms(median([getattr(p, name) for p in parts]))

    own = [p.offline - p.offline_compute for p in pairs if p.offline_compute is not None]
    net = [
        (p.server - p.compute) - (p.offline - p.offline_compute)
        for p in parts
        if p.compute is not None and p.offline_compute is not None
    ]

    return BenchResult(
        model_size=args.model_size,
        model_params=params,
        vocab_size=vocab_size,
        dtype=args.dtype,
        device=args.device,
        num_prompts=len(work.prompts),
        concurrency=args.concurrency,
        prompt_tokens=sum(map(len, work.prompts)),
        output_tokens=work.output_tokens,
        rounds=args.rounds,
        offline_seconds=round(t_off, 3),
        serving_seconds=round(t_srv, 3),
        offline_output_tok_s=round(off_rate, 1),
        serving_output_tok_s=round(srv_rate, 1),
        throughput_ratio=round(srv_rate / off_rate, 3),
        throughput_ratio_per_round=[round(x, 3) for x in per_round],
        serving_requests_completed=sum(r.ok for p in serving for r in p.records),
        serving_requests_failed=sum(not r.ok for p in serving for r in p.records),
        serving_output_tokens=served_tokens,
        serving_ttft_p50_ms=_ms(_percentile(ttfts, 50)),
        serving_ttft_p99_ms=_ms(_percentile(ttfts, 99)),
        serving_tpot_p50_ms=_ms(_percentile(tpots, 50)),
        serving_itl_p50_ms=_ms(_percentile(itls, 50)),
        serving_itl_p99_ms=_ms(_percentile(itls, 99)),
        serving_e2e_p50_ms=_ms(_percentile(e2es, 50)),
        ttft_pairs=len(pairs),
        ttft_server_p50_ms=_ms(median([p.server for p in pairs])),
        ttft_engine_p50_ms=_ms(median([p.offline for p in pairs])),
        ttft_overhead_ms=_ms(median(diffs)),
        ttft_overhead_p25_ms=_ms(_percentile(diffs, 25)),
        ttft_overhead_p75_ms=_ms(_percentile(diffs, 75)),
        ttft_decomposed_requests=len(parts),
        ttft_http_in_p50_ms=part("http_in"),
        ttft_to_engine_p50_ms=part("to_engine"),
        ttft_compute_p50_ms=part("compute"),
        ttft_http_out_p50_ms=part("http_out"),
        ttft_server_added_p50_ms=_ms(median([p.server - (p.compute or 0.0) for p in parts])),
        ttft_engine_own_p50_ms=_ms(median(own)),
        ttft_server_net_p50_ms=_ms(median(net)),
    )


def _print_table(res: BenchResult) -> None:
    def f(x: float | None, spec: str = ">12.1f") -> str:
        return f"{'-':>12}" if x is None else format(x, spec)

    print(
        f"model: random Llama ({res.model_size} dims, {res.vocab_size}-token vocabulary), "
        f"{res.model_params / 1e6:.1f}M parameters, {res.dtype}, {res.device}"
    )
    print(
        f"workload: {res.num_prompts} prompts, {res.prompt_tokens} prompt tokens, "
        f"{res.output_tokens} output tokens, concurrency {res.concurrency}, "
        f"best of {res.rounds} interleaved round(s)"
    )
    print(
        f"{'':<28}{'seconds':>9}{'output tok/s':>14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}"
        f"{'TPOT p50 ms':>12}{'ITL p99 ms':>12}"
    )
    print(
        f"{'offline (LLM.generate)':<28}{res.offline_seconds:>9.2f}"
        f"{res.offline_output_tok_s:>14.1f}{'-':>12}{'-':>12}{'-':>12}{'-':>12}"
    )
    print(
        f"{'serving (kvserve serve)':<28}{res.serving_seconds:>9.2f}"
        f"{res.serving_output_tok_s:>14.1f}{f(res.serving_ttft_p50_ms)}"
        f"{f(res.serving_ttft_p99_ms)}{f(res.serving_tpot_p50_ms)}{f(res.serving_itl_p99_ms)}"
    )
    print(
        f"requests: {res.serving_requests_completed} completed, "
        f"{res.serving_requests_failed} failed over {res.rounds} round(s); "
        f"{res.serving_output_tokens} output tokens served in the best round"
    )
    rounds = ", ".join(f"{x:.2f}" for x in res.throughput_ratio_per_round)
    print(
        f"serving/offline throughput: {res.throughput_ratio:.2f} best vs best "
        f"(target ≥ 0.90); round by round: {rounds}"
    )
    if res.ttft_overhead_ms is None:
        print("server TTFT overhead: not measured (--ttft-requests 0 or no visible output)")
        return
    if res.ttft_server_added_p50_ms is not None:
        print(
            f"server TTFT overhead (median over {res.ttft_decomposed_requests} lone requests of "
            f"TTFT − the engine's compute): {res.ttft_server_added_p50_ms:+.2f} ms"
        )
        print(
            f"  medians: HTTP in {res.ttft_http_in_p50_ms:.2f} ms, to the engine "
            f"{res.ttft_to_engine_p50_ms:.2f} ms, compute {res.ttft_compute_p50_ms:.2f} ms, "
            f"out to the client {res.ttft_http_out_p50_ms:.2f} ms"
        )
    if res.ttft_server_net_p50_ms is not None and res.ttft_engine_own_p50_ms is not None:
        print(
            f"  the engine's own time outside compute, offline (scheduling, detokenizing: "
            f"{res.ttft_engine_own_p50_ms:.2f} ms) is in that too; net of it, per pair: "
            f"{res.ttft_server_net_p50_ms:+.2f} ms (target ≤ 2 ms)"
        )
    print(
        f"paired with the offline engine ({res.ttft_pairs} pairs, interleaved): median "
        f"difference {res.ttft_overhead_ms:+.2f} ms (p25 {res.ttft_overhead_p25_ms:+.2f}, "
        f"p75 {res.ttft_overhead_p75_ms:+.2f}); TTFT p50 {res.ttft_server_p50_ms:.2f} ms "
        f"through the server, {res.ttft_engine_p50_ms:.2f} ms offline"
    )


def run(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from kvserve.heap import freeze_startup_heap
    from kvserve.model.config import ModelConfig
    from kvserve.testing.checkpoints import build_random_checkpoint

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.concurrency < 1 or args.num_prompts < 1 or args.rounds < 1:
        say("kvserve bench serve: error: --concurrency, --num-prompts, --rounds must be ≥ 1")
        return 2
    # Every torch computation of this process runs in this one thread (one OpenMP team;
    # see kvserve.engine.cpu_threads); the main thread runs the clients' event loop.
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-torch")

    def on_torch(fn: Callable[..., T], *fn_args: Any) -> T:
        return torch_thread.submit(fn, *fn_args).result()

    async def on_torch_async(fn: Callable[..., T], *fn_args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(torch_thread, fn, *fn_args)

    with tempfile.TemporaryDirectory(prefix="kvserve-bench-serve-") as tmp, torch_thread:
        # The offline bench's layer dimensions; the vocabulary is the tokenizer's own
        # (vocab_size=None), so generated ids decode to text and stream as SSE chunks.
        dims = {k: v for k, v in MODEL_SIZES[args.model_size].items() if k != "vocab_size"}
        say(f"building a random {args.model_size} Llama checkpoint ...")
        model_dir = on_torch(
            lambda: build_random_checkpoint(
                Path(tmp) / "model",
                "llama",
                max_position_embeddings=1024,
                seed=args.seed,
                **dims,  # type: ignore[arg-type]
            )
        )
        model_config = ModelConfig.from_file(model_dir)
        params = model_config.num_params()
        work = make_workload(args, model_config.vocab_size)
        say(
            f"workload: {args.num_prompts} prompts, {sum(map(len, work.prompts))} prompt "
            f"tokens, {work.output_tokens} output tokens, concurrency {args.concurrency}"
        )
        say("loading the offline engine and starting `kvserve serve` ...")
        offline = on_torch(lambda: _make_llm(model_dir, work, args))
        from kvserve import SamplingParams

        sampling = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
        ]
        on_torch(lambda: offline.generate(work.prompts[:2], sampling[:2], use_tqdm=False))
        # As `kvserve serve` does before serving (kvserve.heap): both sides then run
        # with the garbage collector off their start-up heaps, and neither pays for
        # collections the other skips. Undone at the end (a caller may go on running).
        server, url = _start_server(model_dir, work, args, Path(tmp))
        freeze_startup_heap()
        try:
            offline_times: list[float] = []
            serving: list[ServingPass] = []
            for r in range(args.rounds):
                start = time.perf_counter()
                outs = on_torch(lambda: offline.generate(work.prompts, sampling, use_tqdm=False))
                offline_times.append(time.perf_counter() - start)
                produced = sum(len(o.outputs[0].token_ids) for o in outs)
                assert produced == work.output_tokens, (produced, work.output_tokens)
                say(f"  round {r + 1}/{args.rounds}: offline  {offline_times[-1]:7.2f} s")
                serving.append(run_on_uvloop(_serving_pass(url, work, args.concurrency)))
                failed = sum(not rec.ok for rec in serving[-1].records)
                say(
                    f"  round {r + 1}/{args.rounds}: serving  {serving[-1].seconds:7.2f} s"
                    + (f"  ({failed} failed)" if failed else "")
                )
            pairs: list[TtftPair] = []
            if args.ttft_requests > 0:
                say(f"  TTFT: {args.ttft_requests} lone requests on each side, interleaved ...")
                pairs, sent, visible_at = run_on_uvloop(
                    _ttft_pairs(url, on_torch_async, offline.engine, work, args.ttft_requests)
                )
                _decompose(pairs, sent, visible_at, _request_log(server.log))
        finally:
            stop([server])
            gc.unfreeze()

    res = _summarise(args, params, model_config.vocab_size, work, offline_times, serving, pairs)
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        _print_table(res)
    errors = [rec.error for p in serving for rec in p.records if rec.error is not None]
    if errors:
        say(f"{len(errors)} requests failed; the first: {errors[0]}")
    return 0 if res.serving_requests_failed == 0 else 1
