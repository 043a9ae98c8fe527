"""``kvserve bench offline``: continuous batching vs transformers static batching, one
process (docs/bench-methods.md, "engine_vs_transformers")."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kvserve.arg_types import MinMax, positive_int, torch_device
from kvserve.bench.results import text_row
from kvserve.bench.suite import CHECKPOINT_POSITIONS, MODEL_SHAPES, SuiteContext, device_problem
from kvserve.bench.timelines import Workload, random_workload
from kvserve.config import DTYPES
from kvserve.engine_options import flag_type

MODEL_SIZES = {name: MODEL_SHAPES[name] for name in ("30m", "tiny")}


def workload_arguments(
    p: argparse.ArgumentParser, num_prompts: int, rounds: int, size_help: str, rounds_help: str
) -> None:
    """The arguments ``kvserve bench offline`` and ``kvserve bench serve`` share: the
    workload, the engine, the model size and the rounds."""
    p.add_argument("--num-prompts", type=positive_int, default=num_prompts)
    for flag, default in (("--prompt-len", (16, 256)), ("--output-len", (16, 128))):
        p.add_argument(
            flag,
            type=positive_int,
            nargs=2,
            action=MinMax,
            default=default,
            metavar=("MIN", "MAX"),
            help=f"tokens, drawn uniformly from MIN to MAX (default: {default[0]} {default[1]})",
        )
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="30m", help=size_help)
    p.add_argument("--rounds", type=positive_int, default=rounds, help=rounds_help)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(p: argparse.ArgumentParser) -> None:
    workload_arguments(
        p,
        num_prompts=48,
        rounds=2,
        size_help="30m: ~34M-parameter Llama (the reference workload); tiny: a smoke test",
        rounds_help="alternate the two engines this many times; report each one's best time "
        "(this machine's speed drifts, so interleaving keeps the comparison fair)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=flag_type("max_num_seqs"),
        default=16,
        help="concurrency for both sides",
    )


def workload_problem(args: argparse.Namespace, max_positions: int) -> str | None:
    """What makes the workload impossible for a model of ``max_positions`` positions, or
    for this machine (found before minutes of building and loading, not after)."""
    longest = args.prompt_len[1] + args.output_len[1]
    if longest > max_positions:
        return (
            f"--prompt-len MAX + --output-len MAX is {longest} tokens, more than the "
            f"benchmark model's {max_positions} positions"
        )
    return device_problem(args.device)


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    return random_workload(
        args.num_prompts, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.model.config import ModelConfig

    if problem := workload_problem(args, CHECKPOINT_POSITIONS):
        print(f"kvserve bench offline: error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        ctx = SuiteContext(Path(tmp), Path(tmp), args.device, seed=args.seed, rounds=args.rounds)
        model_dir = ctx.checkpoint(args.model_size)
        params = ModelConfig.from_file(model_dir).num_params()
        work = make_workload(args, int(MODEL_SIZES[args.model_size]["vocab_size"]))
        ctx.say(
            f"workload: {args.num_prompts} prompts, {work.prompt_tokens} prompt tokens, "
            f"{work.output_tokens} output tokens, concurrency {args.max_num_seqs}, {args.dtype}"
        )
        ctx.say("loading both engines ...")
        # Here, not at the top: the runners load torch, and every `kvserve` command
        # imports this module to build its parser.
        from kvserve.bench.engine_vs_transformers import hf_static_runner, kvserve_runner

        c = args.max_num_seqs
        runners = {
            "kvserve": kvserve_runner(ctx, model_dir, work, c, args.dtype),
            "transformers": hf_static_runner(model_dir, work, c, args.dtype, args.device),
        }
        best = ctx.best_of(runners, lambda run: run[0])
        t_kv, t_hf = best["kvserve"][0], best["transformers"][0]

    res = {
        "model_params": params,
        "num_prompts": args.num_prompts,
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "kvserve_seconds": round(t_kv, 3),
        "transformers_seconds": round(t_hf, 3),
        "kvserve_output_tok_s": round(work.output_tokens / t_kv, 1),
        "transformers_output_tok_s": round(work.output_tokens / t_hf, 1),
        "ratio": round(t_hf / t_kv, 2),
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"model: random Llama, {params / 1e6:.1f}M parameters, {args.dtype}, {args.device}")
    widths = (34, 9, 14)
    print(text_row(["engine", "seconds", "output tok/s"], widths))
    for name, label in (("kvserve", "continuous batching"), ("transformers", "static batches")):
        cells = [f"{name} ({label})", res[f"{name}_seconds"], res[f"{name}_output_tok_s"]]
        print(text_row(cells, widths, ".2f .1f"))
    print(
        f"ratio (kvserve / transformers): {res['ratio']:.2f}x  (best of {args.rounds} "
        "interleaved rounds each)"
    )
    return 0
