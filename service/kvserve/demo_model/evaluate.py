"""``kvserve eval-demo``: how well the demo model answers hotel requests it has not seen.

Three figures, all on real generations by the kvserve engine (greedy, fp32):

* **constraint accuracy**: the share of held-out requests whose answer is right by the
  world's rules (``corpus.check_answer``): every listed place is under the price cap, has
  every requested amenity and is of the requested kind; or, when nothing can match, the
  answer says so.
* **well-formed**: the share of answers that parse at all (a list or a "sorry").
* **held-out perplexity** of the assistant turns of conversations from a separate random
  stream (teacher-forced, ``LLMEngine.prompt_logprobs``).

And, with the ``search_hotels`` tool offered (``corpus.SEARCH_HOTELS_TOOL``):

* **tool-call accuracy**: the share of held-out requests whose completion is exactly one
  ``<tool_call>`` (parsed strictly: ``tool_call.parse_tool_call``) of ``search_hotels``
  with arguments that ask for exactly the request (``tool_call.call_satisfies``);
* **answer-from-result accuracy**: given the reference call and its result (from the world
  model), the share of answers that pass ``corpus.check_answer``; **faithful**, the
  share that pass and list only places from the result; and **complete**, the share that
  pass and list exactly the result's places, in its order (or say "sorry" for an empty one).
  The same figures for a second request in the same chat, after a whole first round
  (``corpus.sample_tool_follow_up_prompts``).

And, for the demo LoRA adapter (``--adapter travel-table``), on the same held-out prompts
answered with the adapter and without it in one batch:

* **style rate**: the share of the adapter's answers in its layout
  (``table_style.is_table_answer``);
* **constraint accuracy with the adapter**: ``table_style.check_table_answer``, the same
  rules as ``corpus.check_answer``; and the base model's own accuracy beside it.

``--quantization int8`` scores the same engine with int8 weights (docs/engine.md, "int8
weights"), for comparison with the fp32 figures.
``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) scores it with an fp8 KV cache
(docs/engine.md, "fp8 KV cache").

Evaluation prompts come from ``corpus.eval_rng`` (tool prompts from
``corpus.tool_eval_rng``); prompts whose user message also occurs
word for word in the training corpus are skipped, so every prompt is new text (the
request space is small, so the *request* behind a prompt was usually seen in training,
phrased differently).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from kvserve.demo_model import corpus
from kvserve.demo_model.table_style import check_table_answer, is_table_answer
from kvserve.demo_model.tool_call import call_satisfies, parse_tool_call
from kvserve.demo_model.train import TOOL_RECIPE, TrainConfig, encode_corpus
from kvserve.json_input import parse_json

PromptT = TypeVar("PromptT", corpus.EvalPrompt, corpus.ToolEvalPrompt)

if TYPE_CHECKING:
    from kvserve.llm import LLM
    from kvserve.lora import LoRARequest


#: What ``kvserve eval-demo`` holds the bundled model to.
TARGET_ACCURACY = 0.95
TARGET_TOOL_CALL_ACCURACY = 0.90
#: ... and the demo adapter (``--adapter``): answers in its style, and right by the rules.
TARGET_ADAPTER_STYLE_RATE = 0.90
TARGET_ADAPTER_ACCURACY = 0.90


@dataclass
class Sample:
    messages: list[dict[str, Any]]
    answer: str
    correct: bool


@dataclass
class ToolEvalReport:
    num_prompts: int
    calls_parsed: int  # completions that are exactly one well-formed call
    calls_correct: int  # ... of search_hotels, asking for exactly the request
    answers_correct: int  # answers from the reference result that pass check_answer
    answers_faithful: int  # ... and list only places from the result
    answers_complete: int  # ... and list every place of the result, in its order
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def call_accuracy(self) -> float:
        return self.calls_correct / self.num_prompts if self.num_prompts else 0.0

    @property
    def answer_accuracy(self) -> float:
        return self.answers_correct / self.num_prompts if self.num_prompts else 0.0


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


@dataclass
class AdapterEvalReport:
    adapter: str
    num_prompts: int
    styled: int  # adapter answers laid out in its style (table_style.is_table_answer)
    correct: int  # ... that are also right by the world's rules (check_table_answer)
    base_correct: int  # the base model's answers (no adapter) to the same prompts, right
    base_styled: int  # ... and those in the adapter's style (0 unless the style leaks)
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def style_rate(self) -> float:
        return self.styled / self.num_prompts if self.num_prompts else 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.num_prompts if self.num_prompts else 0.0

    @property
    def base_accuracy(self) -> float:
        return self.base_correct / self.num_prompts if self.num_prompts else 0.0


def heldout_rng(seed: int) -> random.Random:
    """The stream of the perplexity conversations (neither training nor the eval prompts)."""
    return random.Random(f"kvserve-demo-heldout:{seed}")


def eval_prompts(n: int, seed: int, exclude: set[str]) -> list[corpus.EvalPrompt]:
    """``n`` evaluation prompts whose user message is not in ``exclude``."""
    return _new_prompts(corpus.sample_eval_prompts, n, seed, exclude)


def tool_eval_prompts(
    n: int, seed: int, exclude: set[str], second_request: bool = False
) -> list[corpus.ToolEvalPrompt]:
    """``n`` tool evaluation prompts whose first user message is not in ``exclude``; with
    ``second_request``, prompts that ask a second request after a first whole round."""
    if second_request:
        return _new_prompts(corpus.sample_tool_follow_up_prompts, n, seed, exclude)
    return _new_prompts(corpus.sample_tool_eval_prompts, n, seed, exclude)


def _new_prompts(
    sample: Callable[[int, int], Sequence[PromptT]], n: int, seed: int, exclude: set[str]
) -> list[PromptT]:
    """The first ``n`` of ``sample``'s prompts (drawing more as needed) whose first user
    message is not in ``exclude`` (a second one may be a follow-up such as "Anything cheaper,
    under $100?", which training has too: the conversation is new by its first)."""
    out: list[PromptT] = []
    pool = 0
    while len(out) < n:
        pool = max(2 * n, 2 * pool)
        out = [p for p in sample(pool, seed) if _first_user(p.messages) not in exclude][:n]
        if pool > 64 * n:
            raise RuntimeError("too few evaluation prompts are new to the training corpus")
    return out


def _first_user(messages: Sequence[dict[str, Any]]) -> str:
    return str(next(m["content"] for m in messages if m["role"] == "user"))


def _faithful(text: str, listings: list[corpus.Listing]) -> bool:
    """Every place the answer lists is one of ``listings`` (name, kind, price, amenities)."""
    parsed = corpus.parse_answer(text)
    if parsed is None:
        return not listings
    return bool(parsed) and set(parsed) <= set(listings)


def evaluate_tools(
    llm: LLM,
    num_prompts: int = 200,
    seed: int = 0,
    num_samples: int = 3,
    exclude: set[str] | None = None,
    max_tokens: int = 200,
    second_request: bool = False,
) -> ToolEvalReport:
    """Generate (greedy) calls for held-out tool prompts, and answers from their results;
    ``second_request``: for the second request of a chat (:func:`tool_eval_prompts`)."""
    from kvserve import SamplingParams

    start = time.perf_counter()
    prompts = tool_eval_prompts(num_prompts, seed, exclude or set(), second_request)
    tools = [corpus.SEARCH_HOTELS_TOOL]

    def fitting(conversations: list[list[dict[str, Any]]]) -> list[SamplingParams]:
        # Up to max_tokens, but never past the context: a prompt with a long tool result
        # leaves less room than max_tokens (and an answer needs far less).
        rooms = [
            llm.engine.context_left(len(llm.engine.chat_prompt(c, tools))) for c in conversations
        ]
        return [SamplingParams(temperature=0, max_tokens=min(max_tokens, r)) for r in rooms]

    call_prompts = [p.messages for p in prompts]
    answer_prompts = [p.messages + p.call_and_result for p in prompts]
    calls = llm.chat(call_prompts, fitting(call_prompts), use_tqdm=False, tools=tools)
    answers = llm.chat(answer_prompts, fitting(answer_prompts), use_tqdm=False, tools=tools)
    parsed = correct = answered = faithful = complete = 0
    samples: list[Sample] = []
    for p, call_out, answer_out in zip(prompts, calls, answers, strict=True):
        text = call_out.outputs[0].text
        call = parse_tool_call(text)
        ok = call is not None and call_satisfies(p.request, call)
        parsed += call is not None
        correct += ok
        answer = answer_out.outputs[0].text
        good = corpus.check_answer(p.request, answer)
        answered += good
        faithful += good and _faithful(answer, p.listings)
        complete += good and corpus.parse_answer(answer) == (p.listings or None)
        if len(samples) < num_samples:
            samples.append(Sample(p.messages, text, ok))
            samples.append(Sample(p.messages + p.call_and_result, answer, good))
    return ToolEvalReport(
        num_prompts=len(prompts),
        calls_parsed=parsed,
        calls_correct=correct,
        answers_correct=answered,
        answers_faithful=faithful,
        answers_complete=complete,
        seconds=time.perf_counter() - start,
        samples=samples,
    )


def training_user_messages(cfg: TrainConfig) -> set[str]:
    """The user messages of ``cfg``'s training corpus.

    Generating the 60,000 conversations of a recipe takes about 5 s, so the set is kept in
    the user's cache (``$XDG_CACHE_HOME/kvserve/eval-demo``, else ``~/.cache/...``) under
    a name hashed from all that decides it: ``corpus.py``'s source, the recipe's corpus
    fields and Python's version (``random``'s streams). A file that cannot be read, or
    does not hold a list of strings, is made again; one that cannot be written is skipped.
    """
    key = repr(
        (
            Path(corpus.__file__).read_bytes(),
            cfg.num_conversations,
            cfg.seed,
            cfg.tool_share,
            sys.version_info[:2],
        )
    )
    name = f"training-user-messages-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    path = _cache_dir() / name
    with contextlib.suppress(OSError, ValueError):
        cached = parse_json(path.read_bytes())
        if isinstance(cached, list) and all(isinstance(m, str) for m in cached):
            return set(cached)
    messages = {
        m["content"]
        for conv in corpus.generate_corpus(cfg.num_conversations, cfg.seed, cfg.tool_share)
        for m in conv.messages
        if m["role"] == "user"
    }
    partial = path.with_name(f"{name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(sorted(messages)))
        os.replace(partial, path)  # whole or not at all, also with two runs at once
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    return messages


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve" / "eval-demo"


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


def evaluate_adapter(
    llm: LLM,
    lora: LoRARequest,
    num_prompts: int = 200,
    seed: int = 0,
    num_samples: int = 5,
    exclude: set[str] | None = None,
    max_tokens: int = 200,
) -> AdapterEvalReport:
    """Answer held-out prompts (greedy) under the ``travel-table`` adapter ``lora`` and
    without it, in one batch; score the adapter's style and both models' answers."""
    from kvserve import SamplingParams

    start = time.perf_counter()
    prompts = eval_prompts(num_prompts, seed, exclude or set())
    # LLM.chat takes no lora_request: render the chat prompts here, as it does.
    rendered = [llm.engine.chat_prompt(p.messages, None) for p in prompts]
    outs = llm.generate(
        rendered + rendered,
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
        lora_request=[lora] * len(prompts) + [None] * len(prompts),
    )
    styled = correct = base_correct = base_styled = 0
    samples: list[Sample] = []
    for p, out, base in zip(prompts, outs[: len(prompts)], outs[len(prompts) :], strict=True):
        text = out.outputs[0].text
        ok = check_table_answer(p.request, text)
        styled += is_table_answer(text)
        correct += ok
        base_text = base.outputs[0].text
        base_correct += corpus.check_answer(p.request, base_text)
        base_styled += is_table_answer(base_text)
        if len(samples) < num_samples:
            samples.append(Sample(p.messages, text, ok))
    return AdapterEvalReport(
        adapter=lora.lora_name,
        num_prompts=len(prompts),
        styled=styled,
        correct=correct,
        base_correct=base_correct,
        base_styled=base_styled,
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
    p.add_argument(
        "--num-tool-prompts",
        type=int,
        default=200,
        help="held-out requests with the tool, and as many second requests in a chat",
    )
    p.add_argument("--samples", type=int, default=5, help="conversations to print")
    p.add_argument("--dtype", default="float32", help="float32 (the reference) or bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        help="weight quantization to evaluate (int8: docs/engine.md, int8 weights)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache dtype to evaluate (fp8_e4m3, fp8_e5m2: docs/engine.md, fp8 KV cache)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--adapter",
        metavar="NAME",
        help="score the bundled demo LoRA adapter NAME instead (travel-table): its style "
        "rate and constraint accuracy, and the base model's on the same prompts",
    )
    p.add_argument(
        "--adapter-dir", help="the adapter's PEFT folder (default: the bundled one of --adapter)"
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.demo_model import default_model_dir

    if args.num_prompts < 1 or args.num_conversations < 0 or args.num_tool_prompts < 0:
        print(
            "kvserve eval-demo: error: --num-prompts must be ≥ 1, --num-conversations and "
            "--num-tool-prompts ≥ 0",
            file=sys.stderr,
        )
        return 2
    model = Path(args.model) if args.model else default_model_dir()
    if args.adapter is not None or args.adapter_dir is not None:
        return _run_adapter(args, model)
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    llm = _load(args, model)
    if llm is None:
        return 2
    print("collecting the training corpus's user messages ...", file=sys.stderr, flush=True)
    # Either recipe may have trained the model under test: new text means new to both.
    exclude = training_user_messages(TrainConfig()) | training_user_messages(TOOL_RECIPE)
    print(f"answering {args.num_prompts} held-out requests ...", file=sys.stderr, flush=True)
    rep = evaluate(
        llm,
        num_prompts=args.num_prompts,
        num_conversations=args.num_conversations,
        seed=args.seed,
        num_samples=args.samples,
        exclude=exclude,
    )
    tools: ToolEvalReport | None = None
    second: ToolEvalReport | None = None
    if args.num_tool_prompts:
        print(
            f"calling the tool for {args.num_tool_prompts} held-out requests, and for "
            f"{args.num_tool_prompts} second requests in a chat ...",
            file=sys.stderr,
            flush=True,
        )
        tools, second = (
            evaluate_tools(
                llm,
                num_prompts=args.num_tool_prompts,
                seed=args.seed,
                num_samples=min(args.samples, 2),
                exclude=exclude,
                second_request=second_request,
            )
            for second_request in (False, True)
        )
    if args.json:
        out: dict[str, Any] = {**asdict(rep), "accuracy": rep.accuracy}
        for key, report in (("tools", tools), ("tools_second_request", second)):
            if report is not None:
                out[key] = {
                    **asdict(report),
                    "call_accuracy": report.call_accuracy,
                    "answer_accuracy": report.answer_accuracy,
                }
        print(json.dumps(out))
        return 0
    # (no samples of the second requests: their prompts are long)
    for i, s in enumerate(rep.samples + (tools.samples if tools else []), 1):
        print(f"--- sample {i} ({'correct' if s.correct else 'WRONG'})")
        for m in s.messages:
            print(f"[{m['role']}] {_shown(m)}")
        print(f"[assistant] {s.answer}\n")
    print(
        f"constraint accuracy: {rep.correct}/{rep.num_prompts} = {rep.accuracy:.1%} "
        f"(target ≥ {TARGET_ACCURACY:.0%}); requests that can be met: {rep.feasible_correct}/"
        f"{rep.feasible_prompts}; well-formed answers: {rep.well_formed}/{rep.num_prompts}"
    )
    if tools is not None:
        n = tools.num_prompts
        print(
            f"tool-call accuracy: {tools.calls_correct}/{n} = {tools.call_accuracy:.1%} "
            f"(target ≥ {TARGET_TOOL_CALL_ACCURACY:.0%}); well-formed calls: "
            f"{tools.calls_parsed}/{n}"
        )
        print(
            f"answer-from-result accuracy: {tools.answers_correct}/{n} = "
            f"{tools.answer_accuracy:.1%}; listing only places from the result: "
            f"{tools.answers_faithful}/{n}; listing exactly the result's places: "
            f"{tools.answers_complete}/{n}; {tools.seconds:.0f} s"
        )
    if second is not None:
        n = second.num_prompts
        print(
            f"second request in the same chat: tool-call accuracy {second.calls_correct}/{n} = "
            f"{second.call_accuracy:.1%}; answers listing exactly the result's places: "
            f"{second.answers_complete}/{n}"
        )
    print(
        f"held-out perplexity (assistant tokens): {rep.perplexity:.3f} over "
        f"{rep.perplexity_tokens} tokens; {rep.seconds:.0f} s"
    )
    return 0


def _load(args: argparse.Namespace, model: Path, **settings: Any) -> LLM | None:
    """The engine the flags ask for, or None after printing why it cannot be built
    (``LLM()`` checks the settings and the folder before it imports torch)."""
    from kvserve import LLM

    try:
        return LLM(
            str(model),
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            **settings,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve eval-demo: error: {exc}", file=sys.stderr)
        return None


def _run_adapter(args: argparse.Namespace, model: Path) -> int:
    from kvserve.demo_model import ADAPTER_NAMES, ADAPTERS_DIR

    if args.adapter is None or args.adapter not in ADAPTER_NAMES:
        print(
            f"kvserve eval-demo: error: --adapter must be one of {', '.join(ADAPTER_NAMES)}",
            file=sys.stderr,
        )
        return 2
    from kvserve.lora import LoRARequest
    from kvserve.lora.adapter import read_config

    path = Path(args.adapter_dir) if args.adapter_dir else ADAPTERS_DIR / args.adapter
    try:
        rank, _ = read_config(path, max_rank=1 << 16)
    except ValueError as exc:
        print(f"kvserve eval-demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"loading {model} with the adapter {path} ...", file=sys.stderr, flush=True)
    llm = _load(args, model, enable_lora=True, max_lora_rank=rank)
    if llm is None:
        return 2
    print("collecting the training corpora's user messages ...", file=sys.stderr, flush=True)
    exclude = training_user_messages(TrainConfig()) | training_user_messages(TOOL_RECIPE)
    exclude |= adapter_user_messages()
    print(f"answering {args.num_prompts} held-out requests ...", file=sys.stderr, flush=True)
    rep = evaluate_adapter(
        llm,
        LoRARequest(args.adapter, str(path)),
        num_prompts=args.num_prompts,
        seed=args.seed,
        num_samples=args.samples,
        exclude=exclude,
    )
    if args.json:
        print(
            json.dumps(
                {
                    **asdict(rep),
                    "style_rate": rep.style_rate,
                    "accuracy": rep.accuracy,
                    "base_accuracy": rep.base_accuracy,
                }
            )
        )
        return 0
    for i, s in enumerate(rep.samples, 1):
        print(f"--- sample {i} ({'correct' if s.correct else 'WRONG'})")
        for m in s.messages:
            print(f"[{m['role']}] {_shown(m)}")
        print(f"[assistant: {rep.adapter}] {s.answer}\n")
    n = rep.num_prompts
    print(
        f"adapter {rep.adapter}: style rate {rep.styled}/{n} = {rep.style_rate:.1%} (target ≥ "
        f"{TARGET_ADAPTER_STYLE_RATE:.0%}); constraint accuracy {rep.correct}/{n} = "
        f"{rep.accuracy:.1%} (target ≥ {TARGET_ADAPTER_ACCURACY:.0%})"
    )
    print(
        f"base model, same prompts, no adapter: constraint accuracy {rep.base_correct}/{n} = "
        f"{rep.base_accuracy:.1%}; in the adapter's style: {rep.base_styled}/{n}; "
        f"{rep.seconds:.0f} s"
    )
    return 0


def adapter_user_messages() -> set[str]:
    """The user messages of the demo adapter's training conversations (default recipe)."""
    from kvserve.demo_model.train_adapter import AdapterConfig, adapter_corpus

    cfg = AdapterConfig()
    return {
        m["content"]
        for conv in adapter_corpus(cfg.num_conversations, cfg.seed)
        for m in conv.messages
        if m["role"] == "user"
    }


def _shown(message: dict[str, Any]) -> str:
    """A message as one line of the sample printout (a call shows its arguments)."""
    if message.get("tool_calls"):
        return "; ".join(
            f"{c['function']['name']}({json.dumps(c['function']['arguments'], ensure_ascii=False)})"
            for c in message["tool_calls"]
        )
    return str(message.get("content") or "")
