"""Log-probabilities in the two OpenAI response formats."""

from __future__ import annotations

from typing import Any

from kvserve.outputs import TokenLogprob


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/chat/completions."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e.token_id, e.logprob),
                "top_logprobs": [item(t, lp) for t, lp in e.top.items()],
            }
            for e in entries
        ]
    }


def completion_logprobs(
    tokenizer: Any, entries: list[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    """``choices[].logprobs`` of /v1/completions (legacy format)."""
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {_token_text(tokenizer, t): lp for t, lp in e.top.items()} for e in entries
        ],
        "text_offset": offsets,
    }
