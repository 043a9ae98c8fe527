"""Seeded request generators for the load tests: the same seed gives the same requests.

Prompts are built in code from small word lists and sentence templates about hotel search
(the bundled demo model's domain, so its tokenizer spends about one token per word on them;
any model accepts them as text). Nothing is downloaded.

Workloads (``--workload``):

* ``chat`` -- a mix of prompt lengths (short questions, paragraphs, long briefs) and output
  lengths (16 to 256 tokens), three quarters chat, one quarter legacy completions.
* ``agents`` -- the shared-prefix scenario: many agents whose requests all start with the
  same ~150-word (~200-token) system prompt, each agent asking its own questions. With prefix
  caching the shared blocks are computed once; ``cached_tokens`` in the records shows it.
* ``rag`` -- long prompts: several retrieved "documents" (about 60% of the context) and a
  question, with short answers; prefill dominates.
* ``cancel`` -- the chat mix where a share of the clients disconnect mid-stream after a few
  chunks (``cancel_after_chunks``); the server must free what those requests held.

Lengths are chosen to fit the model's context (``context_tokens``, from ``/v1/models``'s
``max_model_len`` when the server reports it) using ``tokens_per_word``, which the load test
measures at the start by sending :func:`calibration_text` (see ``kvserve.loadtest.run``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat", "completions"]
TOKENS_PER_WORD = 2.0  # when not measured: ~1.2-1.9 for these words with the demo tokenizer
CONTEXT_USE = 0.9  # keep a margin below max_model_len for chat templates and estimates

CITIES = (
    "Kyoto", "Lisbon", "Vienna", "Paris", "Osaka", "Porto", "Rome", "Prague", "Seville",
    "Tokyo", "Berlin", "Madrid", "Hakone", "Budapest", "Florence", "Sapporo",
)  # fmt: skip
KINDS = ("hotel", "ryokan", "guesthouse", "hostel", "apartment", "inn")
AMENITIES = (
    "free breakfast", "a pool", "an onsen", "parking", "free wifi", "a gym", "a kitchen",
    "a garden", "air conditioning", "a late checkout", "a view of the river", "a quiet room",
)  # fmt: skip
PRICES = (60, 80, 100, 120, 150, 180, 200, 250, 300, 400)
NAMES = (
    "Sakura", "Alfama", "Danube", "Riverside", "Old Town", "Harbor", "Maple", "Lantern",
    "Garden", "Station", "Cedar", "Hillside", "Plaza", "Willow", "Moon", "Bridge",
)  # fmt: skip
ADJECTIVES = (
    "quiet", "clean", "friendly", "small", "bright", "modern", "old", "cosy", "busy",
    "central", "helpful", "spacious", "simple", "calm",
)  # fmt: skip
ASKS = (
    "Find me a {kind} in {city} under ${price} a night with {amenity}.",
    "Is there a {kind} in {city} with {amenity} for less than ${price} a night?",
    "I need a place to stay in {city}, a {kind} under ${price} a night, with {amenity}.",
    "Which {kind} in {city} has {amenity} and costs under ${price} a night?",
    "We are two adults looking for a {kind} in {city} with {amenity}, budget ${price} a night.",
)  # fmt: skip
FACTS = (
    "The {name} {kind} in {city} costs ${price} a night and offers {amenity}.",
    "Guests say the {name} {kind} has {adj} rooms and {adj2} staff.",
    "The {name} {kind} is a short walk from the station in {city}.",
    "In {city} the {name} {kind} adds {amenity} for ${small} more a night.",
    "The {name} {kind} in {city} has {amenity} but no {amenity2}.",
    "Breakfast at the {name} {kind} starts at seven and the rooms are {adj}.",
)  # fmt: skip


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: what the workload decided, before any timing."""

    scenario: str
    api: Api
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content), for chat
    prompt: str = ""  # for completions
    cancel_after_chunks: int | None = None  # disconnect after this many chunks with text

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self, model: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The OpenAI request body: streaming, with the usage chunk at the end."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        else:
            body["prompt"] = self.prompt
        return {**body, **(extra or {})}

    @property
    def prompt_words(self) -> int:
        text = self.prompt + " ".join(c for _, c in self.messages)
        return len(text.split())


# ---- text ------------------------------------------------------------------------------
def ask(rng: random.Random, city: str | None = None) -> str:
    return rng.choice(ASKS).format(
        kind=rng.choice(KINDS),
        city=city or rng.choice(CITIES),
        price=rng.choice(PRICES),
        amenity=rng.choice(AMENITIES),
    )


def fact(rng: random.Random, city: str | None = None) -> str:
    a, b = rng.sample(AMENITIES, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    return rng.choice(FACTS).format(
        name=rng.choice(NAMES),
        kind=rng.choice(KINDS),
        city=city or rng.choice(CITIES),
        price=rng.choice(PRICES),
        small=rng.choice((10, 15, 20, 30)),
        amenity=a,
        amenity2=b,
        adj=adj,
        adj2=adj2,
    )


def paragraph(rng: random.Random, words: int, city: str | None = None) -> str:
    """Whole sentences of facts, at most ``words`` words (but always one sentence)."""
    out: list[str] = []
    n = 0
    while True:
        sentence = fact(rng, city)
        if out and n + len(sentence.split()) > words:
            return " ".join(out)
        out.append(sentence)
        n += len(sentence.split())


def system_prompt(seed: int, words: int = 150) -> str:
    """The agents' shared system prompt: fixed by the seed, the same for every agent; its
    first ``words`` words (at most 150, about 200 tokens)."""
    rng = random.Random(f"kvserve-loadtest-system:{seed}")
    rules = (
        "You are a careful travel planning agent working for a small booking team. "
        "Always restate the city, the kind of place, the budget per night and the amenities "
        "before you answer. Never invent a price. If nothing fits, say so and suggest raising "
        "the budget or changing the city. Keep every answer short and list at most three "
        "places, cheapest first. Here is what the team knows today:"
    )
    full = rules + " " + paragraph(rng, 150 - len(rules.split()))
    return " ".join(full.split()[:words])


# ---- workloads ---------------------------------------------------------------------------
class Workload:
    """A seeded stream of :class:`RequestSpec`; ``next()`` is deterministic for a seed.

    Locust's users run as greenlets on one thread, so they can share one instance.
    """

    name = "base"

    def __init__(
        self,
        seed: int = 0,
        context_tokens: int = 4096,
        max_tokens: int | None = None,
        tokens_per_word: float = TOKENS_PER_WORD,
    ):
        if context_tokens < 64:
            raise ValueError(f"context_tokens must be at least 64, got {context_tokens}")
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word
        self.seed = seed
        self.context_tokens = context_tokens
        self.fixed_max_tokens = max_tokens
        self.rng = random.Random(f"kvserve-loadtest-{self.name}:{seed}")
        self.count = 0

    def next(self) -> RequestSpec:
        self.count += 1
        return self._next()

    def _next(self) -> RequestSpec:
        raise NotImplementedError

    # Sizing: output first (capped at 40% of the context), then the prompt in what is left.
    def fit_output(self, tokens: int) -> int:
        if self.fixed_max_tokens is not None:
            tokens = self.fixed_max_tokens
        return max(1, min(tokens, int(self.context_tokens * 0.4)))

    def fit_prompt_words(self, words: int, max_tokens: int, reserved_words: int = 0) -> int:
        budget = (self.context_tokens * CONTEXT_USE - max_tokens) / self.tokens_per_word
        return max(1, min(words, int(budget) - reserved_words))


class ChatMix(Workload):
    """Varied prompt and output lengths; chat and completions."""

    name = "chat"
    PROMPTS = ((0.5, 0, 20), (0.35, 40, 120), (0.15, 150, 400))  # (share, min, max) words
    OUTPUTS = ((0.4, 16, 64), (0.4, 64, 160), (0.2, 160, 256))  # (share, min, max) tokens

    def _draw(self, table: tuple[tuple[float, int, int], ...]) -> int:
        _, lo, hi = self.rng.choices(table, weights=[w for w, _, _ in table])[0]
        return self.rng.randint(lo, hi)

    def _next(self) -> RequestSpec:
        return self._mixed()

    def _mixed(self, min_tokens: int = 1) -> RequestSpec:
        max_tokens = self.fit_output(max(self._draw(self.OUTPUTS), min_tokens))
        question = ask(self.rng)
        extra = self.fit_prompt_words(self._draw(self.PROMPTS), max_tokens, len(question.split()))
        context = paragraph(self.rng, extra) + " " if extra >= 20 else ""
        text = context + question
        if self.rng.random() < 0.25:
            return RequestSpec(
                "completion", "completions", max_tokens, prompt=f"User: {text}\nAssistant:"
            )
        return RequestSpec("chat", "chat", max_tokens, messages=(("user", text),))


class SharedPrefixAgents(Workload):
    """Many agents, one shared system prompt, each agent with its own questions."""

    name = "agents"
    NUM_AGENTS = 32

    def __init__(
        self,
        seed: int = 0,
        context_tokens: int = 4096,
        max_tokens: int | None = None,
        tokens_per_word: float = TOKENS_PER_WORD,
    ):
        super().__init__(seed, context_tokens, max_tokens, tokens_per_word)
        # ~150 words (~200 tokens), less when the context is short: room for a question
        # (~30 words) and the longest answer.
        self.system = system_prompt(seed, self.fit_prompt_words(150, self.fit_output(128), 30))
        self.agent_cities = [self.rng.choice(CITIES) for _ in range(self.NUM_AGENTS)]

    def _next(self) -> RequestSpec:
        agent = self.rng.randrange(self.NUM_AGENTS)
        city = self.agent_cities[agent]
        max_tokens = self.fit_output(self.rng.randint(32, 128))
        question = f"Agent {agent} here, planning a trip to {city}. " + ask(self.rng, city)
        return RequestSpec(
            "agent", "chat", max_tokens, messages=(("system", self.system), ("user", question))
        )


class LongPromptRag(Workload):
    """Retrieved documents filling ~60% of the context, a question, a short answer."""

    name = "rag"

    def _next(self) -> RequestSpec:
        max_tokens = self.fit_output(self.rng.randint(32, 96))
        target = int(self.context_tokens * 0.6 / self.tokens_per_word)
        question = ask(self.rng)
        words = self.fit_prompt_words(target, max_tokens, len(question.split()) + 12)
        city = self.rng.choice(CITIES)
        docs: list[str] = []
        per_doc = max(words // 4, 10)
        while sum(len(d.split()) for d in docs) + per_doc <= words or not docs:
            docs.append(f"[doc {len(docs) + 1}] " + paragraph(self.rng, per_doc - 2, city))
        text = "Answer from these documents only.\n" + "\n".join(docs) + f"\nQuestion: {question}"
        return RequestSpec("rag", "chat", max_tokens, messages=(("user", text),))


class CancellationMix(ChatMix):
    """The chat mix; a share of the clients disconnect after a few chunks of text."""

    name = "cancel"
    CANCEL_SHARE = 0.3

    def _next(self) -> RequestSpec:
        if self.rng.random() >= self.CANCEL_SHARE:
            return self._mixed()
        spec = self._mixed(min_tokens=64)  # long enough to still be streaming at the cancel
        return RequestSpec(
            "cancel",
            spec.api,
            spec.max_tokens,
            messages=spec.messages,
            prompt=spec.prompt,
            cancel_after_chunks=self.rng.randint(1, 8),
        )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    w.name: w for w in (ChatMix, SharedPrefixAgents, LongPromptRag, CancellationMix)
}


def make_workload(
    name: str,
    seed: int = 0,
    context_tokens: int = 4096,
    max_tokens: int | None = None,
    tokens_per_word: float = TOKENS_PER_WORD,
) -> Workload:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})"
        ) from None
    return factory(
        seed=seed,
        context_tokens=context_tokens,
        max_tokens=max_tokens,
        tokens_per_word=tokens_per_word,
    )


def calibration_text(words: int = 200) -> str:
    """Text like the workloads' (facts, then requests), to measure the tokenizer's
    tokens per word on it: the server's ``usage.prompt_tokens`` / the words sent."""
    rng = random.Random("kvserve-loadtest-calibration")
    asks = " ".join(ask(rng) for _ in range(4))
    return paragraph(rng, words - len(asks.split())) + " " + asks
