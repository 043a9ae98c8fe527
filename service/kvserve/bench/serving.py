"""``kvserve bench serve``: the HTTP server under load vs the offline engine, one process.

Both sides run the same workload (random token-id prompts, greedy, ``ignore_eos``, each
request's own ``max_tokens``) on two engines built with the same settings, at the same
concurrency:

* offline: ``LLM.generate`` over the whole workload with ``max_num_seqs = concurrency``;
* serving: the real app (``create_app``) under uvicorn on 127.0.0.1 in a background
  thread, and ``concurrency`` asyncio clients (httpx) that take prompts from a shared
  queue and stream ``POST /v1/completions`` (``stream_options.include_usage``) until it
  is empty.

Throughput is output tokens / wall seconds on each side (the serving side counts the
tokens each response's ``usage`` reports). Then requests go one at a time: the same
request (one 32-token prompt, so every one is the same engine work) through the offline
engine's step-level API (engine-side TTFT) and through the server (client-side TTFT); the
difference of the medians is what the server adds to TTFT (HTTP, validation, the hop to
the engine thread and back, SSE, and the engine thread's own costs).

Every latency figure comes from ``kvserve.telemetry.definitions`` (DESIGN.md §3):
``s`` = when the request's last byte was written to the socket (client side) or its
arrival (engine side), ``f``/``e`` = the first/last non-empty visible output (SSE chunks
with text on the client; steps whose ``delta_text`` is non-empty in the engine), so both
sides of the TTFT comparison wait for the same token.

The model has ``kvserve bench offline``'s layer dimensions but the test tokenizer's own
vocabulary, so every generated id decodes to text (with the offline bench's 8192-token
vocabulary most ids are ones the tokenizer cannot show, and the streams would be nearly
empty). The clients run in this process too and share its CPUs with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.offline import MODEL_SIZES, make_workload
from kvserve.bench.timelines import Workload
from kvserve.config import DTYPES
from kvserve.telemetry import definitions

if TYPE_CHECKING:
    import httpx
    import uvicorn

    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.llm import LLM
    from kvserve.outputs import RequestMetrics, RequestOutput

MODEL_NAME = "bench-model"
TTFT_PROMPT_LEN = 32  # the TTFT pass repeats one prompt: every request is the same work
TTFT_MAX_TOKENS = 8  # enough to reach the first visible token; keeps the pass short


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
    throughput_ratio: float  # serving / offline
    serving_requests_completed: int  # over all rounds
    serving_requests_failed: int  # over all rounds
    serving_output_tokens: int  # in the best round
    serving_ttft_p50_ms: float | None
    serving_ttft_p99_ms: float | None
    serving_tpot_p50_ms: float | None
    serving_itl_p50_ms: float | None
    serving_itl_p99_ms: float | None
    serving_e2e_p50_ms: float | None
    ttft_requests_server: int  # lone requests, all rounds
    ttft_requests_engine: int
    ttft_server_p50_ms: float | None
    ttft_engine_p50_ms: float | None
    ttft_overhead_ms: float | None  # server median − engine median
    # The same request's TTFT inside the server's engine (its own timeline), which splits
    # the overhead into the engine thread's share and the HTTP/SSE path's share.
    ttft_server_engine_p50_ms: float | None
    ttft_overhead_engine_thread_ms: float | None
    ttft_overhead_http_ms: float | None


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
def _make_llm(model_dir: Path, work: Workload, args: argparse.Namespace) -> LLM:
    """One engine; called twice so both sides get exactly the same settings."""
    from kvserve import LLM

    return LLM(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.concurrency,
        max_model_len=max(map(len, work.prompts)) + max(work.output_lens),
        seed=args.seed,
        enable_prefix_caching=False,  # random prompts share nothing; keep rounds identical
    )


class BackgroundServer:
    """The engine server's app under uvicorn, in a daemon thread, on a loopback port.

    A fresh one per round, stopped before the offline side runs again, so that only one
    thread at a time computes with torch (see ``kvserve.engine.cpu_threads``): the
    server's engine thread here, as in `kvserve serve`, and the offline side's short-lived
    thread when it runs.

    ``finished`` collects the timeline of every request the server's engine finishes.
    """

    def __init__(self, engine: LLMEngine) -> None:
        import uvicorn

        from kvserve.server.app import create_app
        from kvserve.telemetry.prometheus import EngineMetrics

        self.finished: list[RequestMetrics] = []
        finished = self.finished

        class Recording(EngineMetrics):
            def observe_finished(self, out: RequestOutput) -> None:
                super().observe_finished(out)
                finished.append(out.metrics)

        app = create_app(engine, MODEL_NAME, metrics=Recording(MODEL_NAME))
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says
        # TCP, and a proto-0 listener would leave Nagle on (40 ms delayed-ACK stalls), unlike
        # `kvserve serve`, whose sockets asyncio creates itself.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self._server: uvicorn.Server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


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
) -> None:
    """POST ``body`` and hand each SSE event to ``on_event`` with its arrival time.

    ``rec.send`` becomes the moment the request's last byte went to the socket (httpcore's
    trace events give it, so the client library's own work before it is not charged to the
    server; the call time stands in if the event never comes). Chunks are timed when their
    bytes arrive, before any parsing. HTTP and transport failures land in ``rec.error``;
    ``rec.first``/``rec.last`` are set from ``rec.chunk_times`` at the end.
    """
    rec.send = time.perf_counter()

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.complete":
            rec.send = time.perf_counter()

    try:
        async with client.stream("POST", path, json=body, extensions={"trace": trace}) as r:
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


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> ClientRecord:
    """Stream one completion (timing: ``stream_sse``)."""
    rec = ClientRecord(send=time.perf_counter())

    def handle(event: dict[str, Any], now: float) -> None:
        if event.get("usage"):
            rec.output_tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            if choice.get("text"):
                rec.chunk_times.append(now)
            if choice.get("finish_reason") is not None:
                rec.finish_reason = choice["finish_reason"]

    await stream_sse(client, "/v1/completions", body, rec, handle)
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
) -> tuple[float, int] | None:
    """Engine-side TTFT of a lone request, first visible output − arrival (engine clock),
    and the index of that output token; None if no output was visible."""
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    found: tuple[float, int] | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if found is None and out.outputs[0].delta_text:
                times = out.metrics.token_times
                found = definitions.ttft(out.metrics.arrival_time, times[-1]), len(times) - 1
    return found


def _engine_ttft_pass(
    engine: LLMEngine, work: Workload, n: int, tag: str
) -> tuple[list[float], int | None]:
    """TTFTs of ``n`` lone requests, and the index of their first visible token."""
    prompt, max_tokens = _ttft_request(work)
    _engine_ttft(engine, f"{tag}-warmup", prompt, 2)
    got = [_engine_ttft(engine, f"{tag}-{i}", prompt, max_tokens) for i in range(n)]
    found = [g for g in got if g is not None]
    return [t for t, _ in found], (found[0][1] if found else None)


async def _server_ttft_pass(url: str, work: Workload, n: int) -> list[float]:
    """Client-side TTFTs of ``n`` lone requests through the server, one after another."""
    prompt, max_tokens = _ttft_request(work)
    ttfts: list[float] = []
    async with _client(url, 1) as client:
        await _stream_one(client, _body(prompt, 2))  # warm-up (and the keep-alive connection)
        for _ in range(n):
            rec = await _stream_one(client, _body(prompt, max_tokens))
            if rec.error is not None:
                raise RuntimeError(f"TTFT request failed: {rec.error}")
            if rec.first is not None:
                ttfts.append(definitions.ttft(rec.send, rec.first))
    return ttfts


# ---- the run ---------------------------------------------------------------------------
def _summarise(
    args: argparse.Namespace,
    params: int,
    vocab_size: int,
    work: Workload,
    offline_times: list[float],
    serving: list[ServingPass],
    server_ttft: list[float],
    engine_ttft: list[float],
    server_engine_ttft: list[float],
) -> BenchResult:
    best = min(serving, key=lambda p: p.seconds)
    ok = [r for r in best.records if r.ok]
    served_tokens = sum(r.output_tokens for r in ok)
    t_off, t_srv = min(offline_times), best.seconds
    off_rate, srv_rate = work.output_tokens / t_off, served_tokens / t_srv
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
    srv_med = statistics.median(server_ttft) if server_ttft else math.nan
    eng_med = statistics.median(engine_ttft) if engine_ttft else math.nan
    srv_eng_med = statistics.median(server_engine_ttft) if server_engine_ttft else math.nan

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
        serving_requests_completed=sum(r.ok for p in serving for r in p.records),
        serving_requests_failed=sum(not r.ok for p in serving for r in p.records),
        serving_output_tokens=served_tokens,
        serving_ttft_p50_ms=_ms(_percentile(ttfts, 50)),
        serving_ttft_p99_ms=_ms(_percentile(ttfts, 99)),
        serving_tpot_p50_ms=_ms(_percentile(tpots, 50)),
        serving_itl_p50_ms=_ms(_percentile(itls, 50)),
        serving_itl_p99_ms=_ms(_percentile(itls, 99)),
        serving_e2e_p50_ms=_ms(_percentile(e2es, 50)),
        ttft_requests_server=len(server_ttft),
        ttft_requests_engine=len(engine_ttft),
        ttft_server_p50_ms=_ms(srv_med),
        ttft_engine_p50_ms=_ms(eng_med),
        ttft_overhead_ms=_ms(srv_med - eng_med),
        ttft_server_engine_p50_ms=_ms(srv_eng_med),
        ttft_overhead_engine_thread_ms=_ms(srv_eng_med - eng_med),
        ttft_overhead_http_ms=_ms(srv_med - srv_eng_med),
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
        f"{'serving (HTTP + SSE)':<28}{res.serving_seconds:>9.2f}"
        f"{res.serving_output_tok_s:>14.1f}{f(res.serving_ttft_p50_ms)}"
        f"{f(res.serving_ttft_p99_ms)}{f(res.serving_tpot_p50_ms)}{f(res.serving_itl_p99_ms)}"
    )
    print(
        f"requests: {res.serving_requests_completed} completed, "
        f"{res.serving_requests_failed} failed over {res.rounds} round(s); "
        f"{res.serving_output_tokens} output tokens served in the best round"
    )
    print(f"serving/offline throughput: {res.throughput_ratio:.2f} (target ≥ 0.90)")
    if res.ttft_overhead_ms is None:
        print("server TTFT overhead: not measured (--ttft-requests 0 or no visible output)")
        return
    print(
        f"server TTFT overhead (median, 1 request at a time): {res.ttft_overhead_ms:+.1f} ms "
        f"(target ≤ 2 ms)"
    )
    print(
        f"  TTFT p50 through the server (client side) {res.ttft_server_p50_ms:.1f} ms, "
        f"in the offline engine {res.ttft_engine_p50_ms:.1f} ms "
        f"({res.ttft_requests_server} and {res.ttft_requests_engine} requests)"
    )
    if res.ttft_overhead_engine_thread_ms is not None and res.ttft_overhead_http_ms is not None:
        print(
            f"  of which the server's engine thread {res.ttft_overhead_engine_thread_ms:+.1f} ms "
            f"(TTFT inside it {res.ttft_server_engine_p50_ms:.1f} ms), HTTP and SSE "
            f"{res.ttft_overhead_http_ms:+.1f} ms"
        )


def run(args: argparse.Namespace) -> int:
    from kvserve.engine.cpu_threads import call_in_short_lived_thread
    from kvserve.model.config import ModelConfig
    from kvserve.testing.checkpoints import build_random_checkpoint

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.concurrency < 1 or args.num_prompts < 1 or args.rounds < 1:
        say("kvserve bench serve: error: --concurrency, --num-prompts, --rounds must be ≥ 1")
        return 2
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-serve-") as tmp:
        # The offline bench's layer dimensions; the vocabulary is the tokenizer's own
        # (vocab_size=None), so generated ids decode to text and stream as SSE chunks.
        dims = {k: v for k, v in MODEL_SIZES[args.model_size].items() if k != "vocab_size"}
        say(f"building a random {args.model_size} Llama checkpoint ...")
        model_dir = build_random_checkpoint(
            Path(tmp) / "model",
            "llama",
            max_position_embeddings=1024,
            seed=args.seed,
            **dims,  # type: ignore[arg-type]
        )
        model_config = ModelConfig.from_file(model_dir)
        params = model_config.num_params()
        work = make_workload(args, model_config.vocab_size)
        say(
            f"workload: {args.num_prompts} prompts, {sum(map(len, work.prompts))} prompt "
            f"tokens, {work.output_tokens} output tokens, concurrency {args.concurrency}"
        )
        say("loading the offline engine and the server's engine ...")
        # Torch computes in short-lived threads only (loading, the offline passes) and in
        # the server's engine thread: see kvserve.engine.cpu_threads.
        offline = call_in_short_lived_thread(lambda: _make_llm(model_dir, work, args))
        served = call_in_short_lived_thread(lambda: _make_llm(model_dir, work, args).engine)
        from kvserve import SamplingParams

        sampling = [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens
        ]
        call_in_short_lived_thread(
            lambda: offline.generate(work.prompts[:2], sampling[:2], use_tqdm=False)  # warm-up
        )

        offline_times: list[float] = []
        serving: list[ServingPass] = []
        server_ttft: list[float] = []
        engine_ttft: list[float] = []
        server_engine_ttft: list[float] = []
        for r in range(args.rounds):
            # The offline side runs while no server (and so no engine thread) exists; see
            # ``BackgroundServer`` for why that matters on CPU.
            start = time.perf_counter()
            outs = call_in_short_lived_thread(
                lambda: offline.generate(work.prompts, sampling, use_tqdm=False)
            )
            offline_times.append(time.perf_counter() - start)
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            assert produced == work.output_tokens, (produced, work.output_tokens)
            say(f"  round {r + 1}/{args.rounds}: offline  {offline_times[-1]:7.2f} s")
            visible_at: int | None = None
            if args.ttft_requests > 0:
                got, visible_at = call_in_short_lived_thread(
                    _engine_ttft_pass, offline.engine, work, args.ttft_requests, f"ttft-{r}"
                )
                engine_ttft += got

            with BackgroundServer(served) as server:
                serving.append(asyncio.run(_serving_pass(server.url, work, args.concurrency)))
                failed = sum(not rec.ok for rec in serving[-1].records)
                say(
                    f"  round {r + 1}/{args.rounds}: serving  {serving[-1].seconds:7.2f} s"
                    + (f"  ({failed} failed)" if failed else "")
                )
                if args.ttft_requests > 0:
                    server.finished.clear()
                    server_ttft += asyncio.run(
                        _server_ttft_pass(server.url, work, args.ttft_requests)
                    )
                    # Greedy: the server's copy of the request shows text at the same token.
                    k = visible_at
                    server_engine_ttft += [
                        definitions.ttft(m.arrival_time, m.token_times[k])
                        for m in server.finished[1:]  # after the warm-up request
                        if k is not None and len(m.token_times) > k
                    ]

    res = _summarise(
        args,
        params,
        model_config.vocab_size,
        work,
        offline_times,
        serving,
        server_ttft,
        engine_ttft,
        server_engine_ttft,
    )
    if args.json:
        print(json.dumps(asdict(res)))
    else:
        _print_table(res)
    errors = [rec.error for p in serving for rec in p.records if rec.error is not None]
    if errors:
        say(f"{len(errors)} requests failed; the first: {errors[0]}")
    return 0 if res.serving_requests_failed == 0 else 1
