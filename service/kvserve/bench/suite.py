"""kvserve bench suite: the performance benchmarks, one command, one report.

Sections (--only picks some; each is a module of kvserve.bench):

  engine_vs_transformers  kvserve vs transformers generate (static batches) and
                          transformers' own continuous batching, same workload
  batching                kvserve static vs continuous batching at concurrency 1/4/16
  prefix_caching          the shared-prefix agent scenario, prefix caching on vs off
  roofline                decode and prefill vs this machine's measured bandwidth and
                          matmul peak, ≥100M-parameter model, bf16 and fp32
  kv_memory               allocated KV slots vs tokens held over a mixed run
  serving_path            gateway + engine server processes vs the offline engine,
                          32 streams
  structured              JSON-schema-constrained vs unconstrained throughput at
                          concurrency 16, mask time per token, cold/cached compile
  lora                    throughput with 4 LoRA adapters vs the base model at
                          concurrency 16; 1/4/16 adapters in flight, load time, memory
  quantization            int8 weights vs fp32 (and bf16): decode tokens/s at batch 1/4/16
  speculative             prompt lookup and suffix decoding vs none, demo model chat at
                          concurrency 1 and 16: output tokens/s and acceptance
  kv_dtype                fp8 KV cache vs the fp32 cache: decode tokens/s at batch 1/16
  tensor_parallel         2 ranks × 1 thread vs 1 rank × 2 threads on this CPU: decode
                          tokens/s at batch 1/16 (the cost of TP's communication)
  kv_events               KV-cache events published to a subscriber vs not: the engine's
                          step CPU and wall time, and the events' own CPU share

Each section runs the sides it compares in the same run, alternating them for --rounds
rounds (this machine's speed drifts) and keeping each side's best, on random
checkpoints it builds itself (no downloads). Output in --out: results.json, results.md
and the PNG plots. --smoke runs every section at tiny sizes: it checks the machinery,
and its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kvserve.bench.results import Section, SuiteResult, hardware, say
from kvserve.bench.timelines import Workload, random_workload
from kvserve.config import DTYPES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvserve.llm import LLM
    from kvserve.model.config import ModelConfig

R = TypeVar("R")
P = ParamSpec("P")

SECTIONS = (
    "engine_vs_transformers",
    "batching",
    "prefix_caching",
    "roofline",
    "kv_memory",
    "serving_path",
    "structured",
    "lora",
    "quantization",
    "speculative",
    "kv_dtype",
    "tensor_parallel",
    "kv_events",
)

CHECKPOINT_POSITIONS = 2048  # the random checkpoints' max_position_embeddings
# Model shapes (random Llama checkpoints). vocab_size None = the test tokenizer's own
# vocabulary, so every generated id decodes to text (the serving path streams text).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # ~34M parameters: the workload model of most sections.
    "30m": dict(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        intermediate_size=1536, vocab_size=8192,
    ),
    # ~158M parameters: the roofline's "≥100M-parameter model".
    "150m": dict(
        hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8,
        intermediate_size=2816, vocab_size=8192,
    ),
    # ~1.24B parameters, Llama 3.2 1B's shape (tied embeddings): for GPUs (--model-shape).
    "1b": dict(
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, vocab_size=512,
    ),
}  # fmt: skip
# On a GPU the engine's KV pool takes this share of its memory (EngineConfig's default
# takes 0.9): the sections load transformers' models beside it in the same process.
CUDA_MEMORY_SHARE = 0.4


@dataclass
class SuiteContext:
    """What every section gets: where to write, which device, smoke or not, and a cache
    of the checkpoints built so far (each shape is built once per run). ``shape``, if
    set, replaces every section's own model shape; ``dtype`` is the workload sections'
    engine dtype (the sections that compare against fp32 keep fp32)."""

    out_dir: Path
    work_dir: Path
    device: str = "cpu"
    smoke: bool = False
    seed: int = 0
    rounds: int = 2
    shape: str | None = None
    dtype: str = "float32"
    _checkpoints: dict[tuple[str, bool], Path] = field(default_factory=dict)

    def say(self, msg: str) -> None:
        say(msg)

    def checkpoint(self, shape: str, *, tokenizer_vocab: bool = False) -> Path:
        """A random Llama checkpoint of ``shape`` (``tiny`` in smoke mode).
        ``tokenizer_vocab``: use the test tokenizer's vocabulary (ids decode to text)."""
        from kvserve.testing.checkpoints import build_random_checkpoint

        shape = "tiny" if self.smoke else self.shape or shape
        key = (shape, tokenizer_vocab)
        if key not in self._checkpoints:
            dims = dict(MODEL_SHAPES[shape])
            if tokenizer_vocab:
                dims["vocab_size"] = None
            suffix = "-textvocab" if tokenizer_vocab else ""
            self.say(f"building a random {shape} Llama checkpoint{suffix} ...")
            self._checkpoints[key] = build_random_checkpoint(
                self.work_dir / f"model-{shape}{suffix}",
                "llama",
                max_position_embeddings=CHECKPOINT_POSITIONS,
                seed=self.seed,
                initializer_range=0.02,
                **dims,
            )
        return self._checkpoints[key]

    def model(self, shape: str, *, tokenizer_vocab: bool = False) -> tuple[Path, ModelConfig]:
        """``checkpoint`` and its configuration."""
        from kvserve.model.config import ModelConfig

        path = self.checkpoint(shape, tokenizer_vocab=tokenizer_vocab)
        return path, ModelConfig.from_file(path)

    def llm(self, model_dir: Path, **settings: Any) -> LLM:
        """An engine on this run's device and seed, in float32 and with prefix caching off
        unless ``settings`` say otherwise (random prompts share nothing, and every round
        must cost the engine the same); on a GPU, with CUDA_MEMORY_SHARE of its memory."""
        from kvserve import LLM

        defaults: dict[str, Any] = {"dtype": "float32", "device": self.device, "seed": self.seed}
        if self.device.startswith("cuda"):
            defaults["gpu_memory_utilization"] = CUDA_MEMORY_SHARE
        return LLM(str(model_dir), **(defaults | {"enable_prefix_caching": False} | settings))

    def mixed_workload(
        self, num: int, vocab: int, smoke: tuple[int, tuple[int, int], tuple[int, int]]
    ) -> Workload:
        """``num`` random prompts of 16–256 tokens asking for 16–128 tokens each, or in
        smoke mode the ``smoke`` (number, prompt lengths, output lengths)."""
        n, prompt_len, output_len = smoke if self.smoke else (num, (16, 256), (16, 128))
        return random_workload(n, prompt_len, output_len, vocab, self.seed)

    def best_of(
        self, runs: Mapping[str, Callable[[], R]], seconds: Callable[[R], float], label: str = ""
    ) -> dict[str, R]:
        """Every run ``rounds`` times, the runs alternating within each round (this
        machine's speed drifts, and so falls on all alike), and each one's fastest."""
        best: dict[str, R] = {}
        width = max(map(len, runs))
        for r in range(self.rounds):
            for name, once in runs.items():
                res = once()
                took = seconds(res)
                self.say(f"  {label}round {r + 1}/{self.rounds}: {name:<{width}} {took:7.2f} s")
                if name not in best or took < seconds(best[name]):
                    best[name] = res
        return best

    def save_plot(
        self, name: str, draw: Callable[Concatenate[Figure, P], None], *args: P.args, **kw: P.kwargs
    ) -> list[str]:
        """Draw a figure with ``draw(figure, *args, **kw)`` and save it as ``name`` (a .png)
        in the output directory; returns the section's plots: ``[name]``, or none without
        matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.figure import Figure
        except ImportError:
            self.say(f"matplotlib is not installed: skipping {name} (pip install matplotlib)")
            return []
        fig = Figure(figsize=(7, 4.5), dpi=110)
        draw(fig, *args, **kw)
        fig.tight_layout()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.out_dir / name)
        return [name]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections (of: {', '.join(SECTIONS)})",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument(
        "--model-shape",
        choices=[s for s in MODEL_SHAPES if s != "tiny"],
        help="the random model of every section (default: each section's own, 30m for the "
        "workloads and 150m for the roofline and quantization; 1b is Llama 3.2 1B's shape)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the engines' dtype in the workload sections (default: float32); the roofline "
        "measures bf16 and fp32, and the sections that compare with fp32 keep it",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoints and workloads")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved rounds per comparison; each side's best round is reported",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes: checks the machinery, not speed"
    )


def _import_section(name: str) -> ModuleType:
    return importlib.import_module(f"kvserve.bench.{name}")


def run_sections(
    ctx: SuiteContext,
    names: Sequence[str],
    load: Callable[[str], ModuleType] = _import_section,
) -> list[Section]:
    """Each section in turn. A section that raises is reported as failed, with its error,
    and the rest still run: one run on a lent GPU must bring back every figure it can."""
    sections = []
    for name in names:
        module = load(name)
        ctx.say(f"== {name} ==")
        start = time.perf_counter()
        try:
            section: Section = module.run(ctx)
        except Exception as e:  # reported in the results, and by the exit code
            ctx.say(traceback.format_exc().rstrip())
            section = Section(name, module.TITLE, {}, [], error=f"{type(e).__name__}: {e}")
        section.seconds = round(time.perf_counter() - start, 1)
        sections.append(section)
        if section.error is not None:
            ctx.say(f"  FAILED: {section.error}")
            gc.collect()  # the failed section's engines and models (its traceback is gone)
        for t in section.targets:
            verdict = {True: "met", False: "NOT MET", None: "n/a"}[t.met]
            ctx.say(f"  target {t.name}: {t.measured} {t.unit} ({t.op} {t.target}) {verdict}")
    return sections


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (for the report)."""
    parts = ["kvserve", "bench", "suite", *(["--only", *args.only] if args.only else [])]
    parts += ["--smoke"] if args.smoke else []
    for flag, value, default in (("--device", args.device, "cpu"),
                                 ("--model-shape", args.model_shape, None),
                                 ("--dtype", args.dtype, "float32"), ("--rounds", args.rounds, 2),
                                 ("--seed", args.seed, 0)):  # fmt: skip
        parts += [flag, str(value)] if value != default else []
    return shlex.join([*parts, "--out", str(args.out)])


def device_problem(device: str) -> str | None:
    """Why ``--device`` cannot run here (CUDA named but absent), or None."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"--device {device}, but CUDA is not available here"
    return None


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        print("error: --rounds must be at least 1", file=sys.stderr)
        return 2
    if problem := device_problem(args.device):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    names = [s for s in SECTIONS if args.only is None or s in args.only]
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        ctx = SuiteContext(
            out_dir=args.out,
            work_dir=Path(tmp),
            device=args.device,
            smoke=args.smoke,
            seed=args.seed,
            rounds=args.rounds,
            shape=args.model_shape,
            dtype=args.dtype,
        )
        date = SuiteResult.now()
        sections = run_sections(ctx, names)
    result = SuiteResult(
        date=date,
        command=_command(args),
        hardware=hardware(args.device),
        smoke=args.smoke,
        sections=sections,
    )
    js, md = result.write(args.out)
    print(md.read_text())
    print(f"wrote {js} and {md}", file=sys.stderr)
    failed = [s.name for s in sections if s.error is not None]
    if failed:
        print(f"error: sections failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
