"""``kvserve eval-demo``: how well the demo model answers hotel requests it has not seen.

Three figures, all on real generations by the kvserve engine (greedy, fp32):

* **constraint accuracy**: the share of held-out requests whose answer is right by the
  world's rules (``corpus.check_answer``): every listed place is under the price cap, has
  every requested amenity and is of the requested kind; or, when nothing can match, the
  answer says so.
* **well-formed**: the share of answers that parse at all (a list or a "sorry").
* **held-out perplexity** of the assistant turns of conversations from a separate random
  stream (teacher-forced, ``LLMEngine.prompt_logprobs``).

Evaluation prompts come from ``corpus.eval_rng``; prompts whose user message also occurs
word for word in the training corpus are skipped, so every prompt is new text (the
request space is small, so the *request* behind a prompt was usually seen in training,
phrased differently).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.demo_model import corpus
from kvserve.demo_model.train import TrainConfig, encode_corpus

if TYPE_CHECKING:
    from kvserve.llm import LLM


@dataclass
class Sample:
    messages: list[dict[str, str]]
    answer: str
    correct: bool


@dataclass
class EvalReport:
    num_prompts: int
    correct: int
    well_formed: int
    feasible_prompts: int
    feasible_correct: int
    perplexity: float
    perplexity_tokens: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.num_prompts if self.num_prompts else 0.0


def heldout_rng(seed: int) -> random.Random:
    """The stream of the perplexity conversations (neither training nor the eval prompts)."""
    return random.Random(f"kvserve-demo-heldout:{seed}")


def eval_prompts(n: int, seed: int, exclude: set[str]) -> list[corpus.EvalPrompt]:
    """``n`` evaluation prompts whose user message is not in ``exclude``."""
    out: list[corpus.EvalPrompt] = []
    pool = 0
    while len(out) < n:
        pool = max(2 * n, 2 * pool)
        prompts = corpus.sample_eval_prompts(pool, seed)
        out = [p for p in prompts if p.messages[-1]["content"] not in exclude][:n]
        if pool > 64 * n:
            raise RuntimeError("too few evaluation prompts are new to the training corpus")
    return out


def training_user_messages(cfg: TrainConfig) -> set[str]:
    return {
        m["content"]
        for conv in corpus.generate_corpus(cfg.num_conversations, cfg.seed)
        for m in conv.messages
        if m["role"] == "user"
    }


def perplexity(llm: LLM, conversations: list[corpus.Conversation]) -> tuple[float, int]:
    """exp(mean NLL) of the assistant tokens of ``conversations``, and how many there were."""
    import torch

    tok = llm.engine.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("perplexity needs a fast (tokenizers) tokenizer")
    nll = 0.0
    count = 0
    for ids, labels in encode_corpus(conversations, backend):
        logprobs = llm.engine.prompt_logprobs(ids)  # [T, vocab]; row t predicts token t+1
        target = torch.tensor(labels[1:])
        mask = target != -100
        picked = logprobs[:-1][mask].gather(1, target[mask].unsqueeze(1))
        nll -= float(picked.sum())
        count += int(mask.sum())
    return math.exp(nll / max(count, 1)), count


def evaluate(
    llm: LLM,
    num_prompts: int = 200,
    num_conversations: int = 100,
    seed: int = 0,
    num_samples: int = 5,
    exclude: set[str] | None = None,
    max_tokens: int = 200,
) -> EvalReport:
    """Generate answers for held-out prompts with ``llm`` (greedy) and score them."""
    from kvserve import SamplingParams

    start = time.perf_counter()
    prompts = eval_prompts(num_prompts, seed, exclude or set())
    outs = llm.chat(
        [p.messages for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    correct = well_formed = feasible = feasible_correct = 0
    samples: list[Sample] = []
    for p, out in zip(prompts, outs, strict=True):
        text = out.outputs[0].text
        ok = corpus.check_answer(p.request, text)
        parsed = corpus.parse_answer(text)
        correct += ok
        well_formed += parsed is None or len(parsed) > 0
        if corpus.is_feasible(p.request):
            feasible += 1
            feasible_correct += ok
        if len(samples) < num_samples:
            samples.append(Sample(p.messages, text, ok))
    rng = heldout_rng(seed)
    held_out = [corpus.generate_conversation(rng) for _ in range(num_conversations)]
    ppl, ppl_tokens = perplexity(llm, held_out) if held_out else (float("nan"), 0)
    return EvalReport(
        num_prompts=len(prompts),
        correct=correct,
        well_formed=well_formed,
        feasible_prompts=feasible,
        feasible_correct=feasible_correct,
        perplexity=ppl,
        perplexity_tokens=ppl_tokens,
        seconds=time.perf_counter() - start,
        samples=samples,
    )


# ---- CLI -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument(
        "--num-conversations", type=int, default=100, help="held-out conversations (perplexity)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the evaluation streams")
    p.add_argument("--samples", type=int, default=5, help="conversations to print")
    p.add_argument("--dtype", default="float32", help="float32 (the reference) or bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvserve import LLM
    from kvserve.demo_model import default_model_dir

    if args.num_prompts < 1 or args.num_conversations < 0:
        print("kvserve eval-demo: error: --num-prompts must be ≥ 1", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else default_model_dir()
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    llm = LLM(str(model), dtype=args.dtype, device=args.device)
    print("collecting the training corpus's user messages ...", file=sys.stderr, flush=True)
    exclude = training_user_messages(TrainConfig())
    print(f"answering {args.num_prompts} held-out requests ...", file=sys.stderr, flush=True)
    rep = evaluate(
        llm,
        num_prompts=args.num_prompts,
        num_conversations=args.num_conversations,
        seed=args.seed,
        num_samples=args.samples,
        exclude=exclude,
    )
    if args.json:
        print(json.dumps({**asdict(rep), "accuracy": rep.accuracy}))
        return 0
    for i, s in enumerate(rep.samples, 1):
        print(f"--- sample {i} ({'correct' if s.correct else 'WRONG'})")
        for m in s.messages:
            print(f"[{m['role']}] {m['content']}")
        print(f"[assistant] {s.answer}\n")
    print(
        f"constraint accuracy: {rep.correct}/{rep.num_prompts} = {rep.accuracy:.1%} "
        f"(target ≥ 80%); requests that can be met: {rep.feasible_correct}/"
        f"{rep.feasible_prompts}; well-formed answers: {rep.well_formed}/{rep.num_prompts}"
    )
    print(
        f"held-out perplexity (assistant tokens): {rep.perplexity:.3f} over "
        f"{rep.perplexity_tokens} tokens; {rep.seconds:.0f} s"
    )
    return 0
