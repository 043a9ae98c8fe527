"""Prompts the engine tests share, and the greedy reference a teacher-forced comparison
(another dtype, another KV cache format) is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve import LLM, SamplingParams
from kvserve.outputs import RequestOutput

# Short texts of different kinds (words, punctuation, digits, code, a cut-off word) so
# the continuations visit varied parts of the vocabulary.
TEXTS = (
    "the cache keeps",
    "hello world, how are you",
    "a b c d e f",
    "streaming responses",
    "numbers 1 2 3",
    "The scheduler",
    "def generate(",
    "Mixed text: caf",
)


@dataclass(frozen=True)
class GreedyReference:
    """``llm``'s greedy continuation of each of ``TEXTS``, each prompt + continuation as
    token ids, and ``llm``'s teacher-forced log-softmax over each ([T, vocab])."""

    outputs: list[RequestOutput]
    sequences: list[list[int]]
    logprobs: list[torch.Tensor]


def greedy_reference(llm: LLM, max_tokens: int = 40) -> GreedyReference:
    tok = llm.get_tokenizer()
    outs = llm.generate(
        [tok.encode(t) for t in TEXTS],
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    return GreedyReference(outs, sequences, [llm.engine.prompt_logprobs(s) for s in sequences])
