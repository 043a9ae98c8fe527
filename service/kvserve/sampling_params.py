"""Per-request generation settings, validated when built."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.errors import InvalidRequestError

GREEDY_TEMPERATURE = 1e-5
# The integer ranges of the wire (engine.proto's int32 and int64 fields): a value outside
# them could not reach a replica, so every front end refuses it the same way, with a 400.
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64


STRUCTURED_OUTPUTS_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# logit_bias: OpenAI's value range, and this server's bound on the entries (each one is
# work for every step of the request).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024
# Stop token ids are bounded like logit_bias: the sampler masks each of them in every
# step while min_tokens lasts.
MAX_STOP_TOKEN_IDS = 1024
# n: OpenAI's bound on the samples one request may ask for.
MAX_N = 128


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, with vLLM's names (docs/engine.md, structured outputs).

    Exactly one of ``json`` / ``json_object`` / ``regex`` / ``choice`` / ``grammar`` is set
    (checked here; whether the schema, regex or grammar compiles is checked by
    ``kvserve.structured.validate``, which needs the tokenizer). The engine applies the
    constraint from the first output token; when the constraint allows nothing but EOS
    the request ends with finish reason ``stop``.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema (object or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # a Lark grammar in llguidance's syntax (may embed %json {...})
    # Not vLLM's: the constraint applies after a reasoning model's <think>...</think>
    # block. "optional": the output may begin with one (Qwen3); "open": the prompt opened
    # it, so the output begins inside it and must close it (DeepSeek-R1). The engine
    # server sets it from --reasoning-parser for schemas and tool calls.
    think_block: Literal["optional", "open"] | None = None

    def __post_init__(self) -> None:
        if self.think_block not in (None, "optional", "open"):
            raise InvalidRequestError(
                f"think_block must be 'optional' or 'open', got {self.think_block!r}",
                "structured_outputs",
            )
        chosen = [kind for kind in STRUCTURED_OUTPUTS_KINDS if self._is_set(kind)]
        if len(chosen) != 1:
            found = ", ".join(chosen) if chosen else "none"
            raise InvalidRequestError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUTS_KINDS)}; got {found}",
                "structured_outputs",
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of strings",
                    "structured_outputs",
                )
            # A list is not hashable; a frozen value with a tuple inside would be, but the
            # contract's type is a list, so keep it and copy it so callers cannot mutate it.
            object.__setattr__(self, "choice", list(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(
                    f"structured_outputs.{kind} must be a string", "structured_outputs"
                )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                "structured_outputs",
            )

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """Which one of the five is set."""
        return next(k for k in STRUCTURED_OUTPUTS_KINDS if self._is_set(k))


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``temperature=0`` is greedy decoding. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible for this request whatever else is in the
    batch. ``logprobs=N`` returns the sampled token's log-probability and the top N
    alternatives, computed from the model's raw distribution (before biases, penalties and
    temperature, and before a structured-outputs mask). ``structured_outputs`` constrains
    the output to a JSON schema, regex, choice or grammar (``StructuredOutputsParams``).

    ``logit_bias`` (OpenAI's): token id → a value in [-100, 100] added to its logit at
    every step. ``repetition_penalty`` (vLLM's and transformers'): each token that occurs
    in the prompt or the output so far has its logit divided by it when positive and
    multiplied by it when negative; 1 is off, above 1 discourages repeats. Both apply
    before the presence and frequency penalties, as in vLLM. ``min_tokens`` (vLLM's): no
    EOS or ``stop_token_ids`` token is sampled, and no stop string ends the output, before
    this many tokens (it cannot go with ``structured_outputs``, whose grammar may need to
    end sooner).

    ``prompt_logprobs=N`` (vLLM's): each prompt token's log-probability given the tokens
    before it, and the top N there (the first token has none); such a request computes
    its whole prompt, whatever the prefix cache holds. With ``max_tokens=0`` it only
    scores the prompt: it ends after its prefill with no token, finish reason "length".

    ``n`` (OpenAI's and vLLM's): how many answers to sample for the prompt, at most
    ``MAX_N``. They run as ``n`` requests of one sample each (``samples()``), the i-th
    with seed ``seed + i`` when a seed is set, so each is reproducible and they differ.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])  # None: none, as in vLLM
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        scoring = self.prompt_logprobs is not None and self.max_tokens == 0
        if self.max_tokens < 1 and not scoring:
            raise InvalidRequestError(
                f"max_tokens must be an integer ≥ 1 (0 only to score the prompt, with "
                f"prompt_logprobs), got {self.max_tokens!r}",
                "max_tokens",
            )
        if self.max_tokens > INT32_MAX:
            raise InvalidRequestError(
                f"max_tokens must be at most {INT32_MAX}, got {self.max_tokens}", "max_tokens"
            )
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise InvalidRequestError(
                f"temperature must be a finite number ≥ 0, got {self.temperature}", "temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not INT32_MIN <= self.top_k <= INT32_MAX:
            raise InvalidRequestError(
                f"top_k must be in [{INT32_MIN}, {INT32_MAX}], got {self.top_k}", "top_k"
            )
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0 < self.repetition_penalty < math.inf:  # NaN too
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
                "min_tokens",
            )
        if self.min_tokens and self.structured_outputs is not None:
            raise InvalidRequestError(
                "min_tokens cannot be combined with structured outputs or forced tool calls "
                "(their grammar may have to end sooner)",
                "min_tokens",
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidRequestError(
                f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}", "seed"
            )
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if self.seed is not None and self.seed + self.n - 1 > SEED_RANGE[1]:
            raise InvalidRequestError(
                f"seed + n - 1 must be at most {SEED_RANGE[1]} (sample i uses seed + i)", "seed"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                "prompt_logprobs",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams", "structured_outputs"
            )
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be token ids in [0, {INT32_MAX}]", "stop_token_ids"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                f"{len(self.stop_token_ids)}",
                "stop_token_ids",
            )

    def _check_types(self) -> None:
        """InvalidRequestError naming the first field of the wrong type (a float seed, a
        string temperature, a stop list holding a number ...), before a value the checks
        below compare or the engine computes with fails there as a TypeError. Booleans are
        not numbers here."""
        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(
                    f"{name} must be an integer, got {getattr(self, name)!r}", name
                )
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
        for name in (
            "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            if not _is_real(getattr(self, name)):
                raise InvalidRequestError(
                    f"{name} must be a number, got {getattr(self, name)!r}", name
                )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (
            not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop)
        ):
            raise InvalidRequestError("stop must be a string or a list of strings", "stop")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, Sequence) or not all(map(_is_int, ids))):
            raise InvalidRequestError(
                "stop_token_ids must be a list of token ids", "stop_token_ids"
            )

    def samples(self) -> list[SamplingParams]:
        """The requests of one sample each that ``n`` stands for: ``[self]`` when n is 1,
        else n copies with n=1, the i-th with seed ``seed + i`` (when a seed is set)."""
        if self.n == 1:
            return [self]
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
            for i in range(self.n)
        ]

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits this request samples from."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.repetition_penalty != 1
            or self.presence_penalty
            or self.frequency_penalty
        )

    @property
    def greedy(self) -> bool:
        # Below this, dividing logits by the temperature overflows float32: treat as 0.
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """``bias`` as token id → value (InvalidRequestError naming ``logit_bias`` unless it is
    one: at most MAX_LOGIT_BIAS_ENTRIES ids in the wire's range, values in LOGIT_BIAS_RANGE).
    Whether each id is in the model's vocabulary the engine checks."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
            "logit_bias",
        )
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids in [0, {INT32_MAX}], got {token!r}",
                "logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [{low:g}, {high:g}]; "
                f"token {token} has {value!r}",
                "logit_bias",
            )
        out[token] = float(value)
    return out


@dataclass(frozen=True)
class StopLimits:
    """How many stop strings a request may send, and how long each may be.

    OpenAI allows 4. Matching costs the engine thread time for every stop string of every
    running request, so a server bounds them (``--max-stop-strings`` and
    ``--max-stop-string-chars`` on ``kvserve serve``; the gateway's config).
    """

    max_count: int = 16
    max_chars: int = 256

    def check(self, stop: Sequence[str]) -> None:
        """Raise InvalidRequestError (param ``stop``) for stop strings over the limits."""
        if len(stop) > self.max_count:
            raise InvalidRequestError(
                f"at most {self.max_count} stop strings are allowed, got {len(stop)}", "stop"
            )
        for i, s in enumerate(stop):
            if len(s) > self.max_chars:
                raise InvalidRequestError(
                    f"stop strings may have at most {self.max_chars} characters; "
                    f"stop[{i}] has {len(s)}",
                    "stop",
                )
