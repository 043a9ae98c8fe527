"""Speculative decoding on the demo model's chat workload: prompt lookup ("ngram") and
suffix decoding ("suffix") vs plain decoding (docs/engine.md, "Speculative decoding").

The bundled demo model's answers restate the request ("Hotels in Paris under $150 a night
- ...") and repeat a listing format, so prompt lookup finds some drafts, and the phrases
every answer shares give suffix decoding many more. Greedy decoding, so every side
produces the same tokens and only the time differs. Every round answers new chats (the
same ones on each side), after the same 64 warm-up chats: suffix decoding would
otherwise draft a repeated chat from its own earlier answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

from kvserve.bench.results import Section, Target, model_setup, table
from kvserve.bench.suite import SuiteContext

NAME = "speculative"
TITLE = "speculative decoding (prompt lookup, suffix) vs plain decoding, demo model chat"
NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}
SUFFIX: dict[str, Any] = NGRAM | {"method": "suffix"}
WARM_UP = 64  # chats answered by every side before the measured rounds
MAX_TOKENS = 128
TARGET_C1 = 1.5  # output tokens/s ratio at concurrency 1
TARGET_C16 = 0.98  # and at concurrency 16 (where the default threshold turns it off)


def run(ctx: SuiteContext) -> Section:
    from kvserve import LLM, SamplingParams
    from kvserve.config import DEFAULT_SPECULATIVE_MAX_BATCH
    from kvserve.demo_model import corpus, default_model_dir
    from kvserve.model.config import ModelConfig

    model_dir = default_model_dir()
    config = ModelConfig.from_file(model_dir)
    system = {"role": "system", "content": corpus.SYSTEM_PROMPTS[0]}

    def chats(n: int, seed: int) -> list[list[dict[str, str]]]:
        return [[system, p.messages[-1]] for p in corpus.sample_eval_prompts(n, seed=seed)]

    warm_up = chats(4 if ctx.smoke else WARM_UP, seed=8)
    params = SamplingParams(max_tokens=8 if ctx.smoke else MAX_TOKENS, temperature=0)
    rows: list[list[Any]] = []
    ratios: dict[tuple[str, int], float] = {}
    acceptance: dict[int, float] = {}
    bound = 1.0
    for concurrency, num in ((1, 2 if ctx.smoke else 12), (16, 4 if ctx.smoke else 48)):
        sides: dict[str, dict[str, Any]] = {
            "off": {},
            "ngram": {"speculative_config": NGRAM},
            "suffix": {"speculative_config": SUFFIX},
        }
        if concurrency >= DEFAULT_SPECULATIVE_MAX_BATCH:
            # Past the threshold the others do not speculate; this side shows why.
            sides["ngram, no threshold"] = {
                "speculative_config": NGRAM,
                "speculative_max_batch": 10**6,
            }
        llms: dict[str, LLM] = {
            side: ctx.llm(model_dir, max_num_seqs=concurrency, **settings)
            for side, settings in sides.items()
        }
        pool = chats(num * ctx.rounds, seed=7)
        per_round = [pool[r * num : (r + 1) * num] for r in range(ctx.rounds)]
        for llm in llms.values():
            llm.chat(warm_up, params, use_tqdm=False)  # type: ignore[arg-type]

        def once(llm: LLM, rounds: Iterator[list[list[dict[str, str]]]]) -> tuple[float, int]:
            convs = next(rounds)  # this side's next round: new chats every round
            start = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)  # type: ignore[arg-type]
            return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

        runs = {side: partial(once, llm, iter(per_round)) for side, llm in llms.items()}
        best = ctx.best_of(runs, seconds=lambda r: r[0], label=f"c={concurrency} ")
        rate = {side: tokens / secs for side, (secs, tokens) in best.items()}
        for side, llm in llms.items():
            spec = llm.engine.stats().spec_decode
            rows.append(
                [
                    concurrency,
                    side,
                    round(best[side][0], 3),
                    round(rate[side], 1),
                    round(rate[side] / rate["off"], 2),
                    round(spec.acceptance_rate, 2) if spec.num_draft_tokens else "",
                    round(spec.num_accepted_tokens / spec.num_drafts, 2) if spec.num_drafts else "",
                ]
            )
        for method in ("ngram", "suffix"):
            ratios[method, concurrency] = rate[method] / rate["off"]
        forced = llms.get("ngram, no threshold", llms["ngram"])
        acceptance[concurrency] = forced.engine.stats().spec_decode.acceptance_rate
        if concurrency == 1:
            outs = llms["off"].chat(per_round[0], params, use_tqdm=False)  # type: ignore[arg-type]
            bound = _step_bound([(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs])

    setup = model_setup(config, "float32", ctx.device) | {
        "model": "the demo model (kvserve-travel-tiny)",
        "workload": "demo eval chats (system prompt + one user turn), greedy, "
        f"max_tokens {params.max_tokens}",
        "speculative_config": f"{json.dumps(NGRAM)}, and the same with method suffix",
        "rounds": f"each on {WARM_UP} warm-up chats, then new chats each round",
        "speculative_max_batch (default)": DEFAULT_SPECULATIVE_MAX_BATCH,
    }
    tables = [
        table(
            "Output tokens/s, speculation vs none (alternating rounds, best of each)",
            "concurrency | side | seconds | output tok/s | vs off | acceptance | "
            "accepted per draft run",
            rows,
        )
    ]
    targets = [
        Target(f"{method} / off, concurrency {c}", round(ratios[method, c], 2), goal, "x")
        for method in ("ngram", "suffix")
        for c, goal in ((1, TARGET_C1), (16, TARGET_C16))
    ]
    notes = [
        f"Upper bound of prompt lookup at concurrency 1: replaying it over the plain run's greedy "
        f"outputs, speculation needs {bound:.2f}x fewer decode steps; that is the speedup "
        "if a verification step cost no more than a decode step.",
        f"Prompt lookup's acceptance (accepted / proposed draft tokens): {acceptance[1]:.2f} "
        f"at concurrency 1, {acceptance[16]:.2f} at 16 without the threshold.",
        "A verification step runs 1 + k tokens per request through the prefill path; on a "
        "CPU a small model's step costs about the same for 1 or 5 tokens at batch 1, so "
        "every accepted draft is nearly free there; at larger batches the extra tokens "
        "cost real compute, hence the threshold.",
    ]
    return Section(NAME, TITLE, setup, tables, targets, notes)


def _step_bound(runs: list[tuple[list[int], Sequence[int]]]) -> float:
    """Decode steps without speculation / with it, for these (prompt, output) pairs if
    the proposer's drafts were verified against the known outputs."""
    from kvserve.config import speculative_settings
    from kvserve.spec_decode.proposer import NgramProposer

    proposer = NgramProposer(speculative_settings(dict(NGRAM)))
    plain = spec = 0
    for prompt, out in runs:
        plain += len(out) - 1  # the first token comes from the prefill
        i = 1
        while i < len(out):
            drafts = proposer.propose(prompt + list(out[:i]), len(out) - i - 1)
            accepted = 0
            while accepted < len(drafts) and out[i + accepted] == drafts[accepted]:
                accepted += 1
            spec += 1
            i += accepted + 1
    return plain / spec if spec else 1.0
