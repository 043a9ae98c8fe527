"""What KV-cache events add to the engine's step time (docs/performance.md, "KV-cache
events").

One engine publishes KV-cache events to a subscriber in another process (as a router
would be) in some rounds and not in others: an "off" round detaches the publisher
(``engine.kv_events`` and the block pool's ``events`` set to None: the code path of an
engine started without ``kv_events_endpoint``). Rounds alternate on, off, off, on, ...,
so drift and warm-up fall on both alike, and both run on the same engine and memory (two
engines differ between themselves by more than 2%). Each round is 64 requests over 4
shared system prompts, under a cache salt of its own, so every round stores its blocks
anew and, the pool being smaller than all rounds' blocks, evicts older rounds' blocks
(BlockStored and BlockRemoved both flow).

Measured per round: wall time inside ``step()``; CPU time of the engine's thread inside
``step()``; CPU time of the whole process (the publisher's thread and torch's included).
On a busy machine wall time mostly measures the other load: the CPU times are the
figures to read, and even they are blurred by other load (caches, frequency). So the
events' own work is also measured directly: the engine thread's CPU time inside the
recorder's calls and the publisher's ``end_step()`` (building, encoding and queueing the
events; the timers' own cost included, so it is an upper bound of that part), and the
publisher thread's CPU time (from /proc, on Linux).

    python -m kvserve.bench.kv_events [--model DIR] [--rounds N]

Without ``--model``, a small random Llama checkpoint is built in a temp directory: its
steps are short, so the events' share of a step is the largest there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_events import KVEventPublisher, KVEventRecorder
from kvserve.engine.llm_engine import LLMEngine

REQUESTS = 64
PREFIXES = 4
PREFIX_TOKENS = 48
QUESTION_TOKENS = 16
OUTPUT_TOKENS = 32  # the prompt + output cross a block boundary while decoding
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 512  # about two rounds' blocks: later rounds evict

# The subscriber: counts what arrives until its stdin closes, then prints the count.
SUBSCRIBER = """
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
poller = zmq.Poller()
poller.register(sub, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
print("ready", flush=True)
count = 0
while True:
    ready = dict(poller.poll())
    if sub in ready:
        while sub.poll(0):
            sub.recv_multipart()
            count += 1
    elif ready:
        break
print(count, flush=True)
"""


@dataclass
class Mode:
    wall: list[float] = field(default_factory=list)  # per round: in step(), wall time
    thread_cpu: list[float] = field(default_factory=list)  # in step(), the engine thread's
    process_cpu: list[float] = field(default_factory=list)  # the round, every thread's
    steps: list[int] = field(default_factory=list)


def workload(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    return [
        prefixes[i % PREFIXES] + [rng.randrange(3, vocab) for _ in range(QUESTION_TOKENS)]
        for i in range(REQUESTS)
    ]


def run_round(engine: LLMEngine, mode: Mode, prompts: list[list[int]], salt: str) -> None:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{salt}-{i}", prompt, params, cache_salt=salt)
    wall = cpu = 0.0
    steps = 0
    process0 = time.process_time()
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        steps += 1
    mode.process_cpu.append(time.process_time() - process0)
    mode.wall.append(wall)
    mode.thread_cpu.append(cpu)
    mode.steps.append(steps)


def thread_cpu_seconds(native_id: int | None) -> float | None:
    """A thread's CPU time so far, from /proc (None where there is no /proc)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return None


class Timers:
    """The engine thread's CPU time inside the events' calls (wrapped on the instances)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.seconds = 0.0
        recorder: KVEventRecorder = publisher.recorder
        for obj, name in (
            (recorder, "stored"),
            (recorder, "removed"),
            (recorder, "cleared"),
            (publisher, "end_step"),
        ):
            setattr(obj, name, self.timed(getattr(obj, name)))

    def timed(self, fn):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            c0 = time.thread_time()
            fn(*args)
            self.seconds += time.thread_time() - c0

        return call


def attach(engine: LLMEngine, publisher: KVEventPublisher | None) -> None:
    engine.kv_events = publisher
    engine.kv.pool.events = publisher.recorder if publisher is not None else None


def compare(name: str, on: list[float], off: list[float], unit: float, label: str) -> str:
    ratios = [a / b - 1 for a, b in zip(on, off, strict=True)]
    total = sum(on) / sum(off) - 1
    return (
        f"{name}: off {sum(off) / len(off) * unit:.1f} {label}, on "
        f"{sum(on) / len(on) * unit:.1f} {label} per round; on/off {total * 100:+.2f}% "
        f"(median of per-pair ratios {statistics.median(ratios) * 100:+.2f}%, "
        f"quartiles {statistics.quantiles(ratios, n=4)[0] * 100:+.2f}% / "
        f"{statistics.quantiles(ratios, n=4)[2] * 100:+.2f}%)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.bench.kv_events", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: a small random Llama)")
    p.add_argument("--rounds", type=int, default=20, help="rounds per mode (default: 20)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvserve.testing.checkpoints import build_random_checkpoint

            model = str(build_random_checkpoint(Path(tmp) / "llama", "llama"))
        endpoint = f"ipc://{tmp}/kv-events"
        llm = LLM(
            model,
            dtype="float32",
            device=args.device,
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_KV_BLOCKS,
            max_num_seqs=REQUESTS,
            kv_events_endpoint=endpoint,
        )
        engine = llm.engine
        publisher = engine.kv_events
        assert publisher is not None
        subscriber = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert subscriber.stdout is not None and subscriber.stdin is not None
        subscriber.stdout.readline()  # connected (batches before the join are not counted)

        timers = Timers(publisher)
        prompts = workload(engine.model_config.vocab_size)
        warm = Mode()
        run_round(engine, warm, prompts, "warm-on")  # warm-up, not counted
        attach(engine, None)
        run_round(engine, warm, prompts, "warm-off")
        timers.seconds = 0.0
        publisher_cpu0 = thread_cpu_seconds(publisher.thread_id)
        on, off = Mode(), Mode()
        for r in range(args.rounds):
            for events in (True, False) if r % 2 == 0 else (False, True):
                attach(engine, publisher if events else None)
                run_round(engine, on if events else off, prompts, f"round-{r}")
        published, dropped = publisher.next_seq, publisher.dropped_batches
        publisher_cpu1 = thread_cpu_seconds(publisher.thread_id)
        publisher.close()
        subscriber.stdin.close()
        received = int(subscriber.stdout.readline())
        subscriber.wait(timeout=30)

    print(f"model: {model if args.model else 'random llama (hidden 64, 2 layers)'}")
    print(
        f"{args.rounds} rounds per mode of {REQUESTS} requests ({PREFIXES} prefixes of "
        f"{PREFIX_TOKENS} tokens + {QUESTION_TOKENS}, {OUTPUT_TOKENS} output tokens), "
        f"block_size {BLOCK_SIZE}, {NUM_KV_BLOCKS} blocks; {statistics.median(on.steps):.0f} "
        "steps per round"
    )
    print(compare("engine thread CPU in step()", on.thread_cpu, off.thread_cpu, 1e3, "ms"))
    print(compare("process CPU", on.process_cpu, off.process_cpu, 1e3, "ms"))
    print(compare("wall time in step()", on.wall, off.wall, 1e3, "ms"))
    step_cpu = sum(on.thread_cpu)
    print(
        f"engine thread CPU in the events' calls (record, encode, queue): "
        f"{timers.seconds * 1e3:.1f} ms of {step_cpu * 1e3:.0f} ms in step() over the on "
        f"rounds = {timers.seconds / step_cpu * 100:.2f}%"
    )
    if publisher_cpu0 is not None and publisher_cpu1 is not None:
        spent = publisher_cpu1 - publisher_cpu0
        print(
            f"publisher thread CPU: {spent * 1e3:.1f} ms = {spent / step_cpu * 100:.2f}% of "
            "the engine thread's CPU in step(); events' CPU in all: "
            f"{(timers.seconds + spent) / step_cpu * 100:.2f}%"
        )
    print(
        f"batches published {published}, dropped {dropped}, received by the subscriber {received}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
