"""Pick the next token for every request in the batch at once.

Order: the structured-outputs mask (disallowed tokens to -inf), then each request's logit
bias, repetition, presence and frequency penalties and ``min_tokens`` (stop tokens to -inf
until then), then temperature, then top-k / top-p / min-p filters, then sampling.
Sampling uses the exponential-race trick (argmax of p / q with q ~ Exp(1)), which draws
from p exactly and lets a seeded request take its noise from its own generator: its
tokens do not depend on what else is in the batch.

``verify`` does the same for a batch in which some requests carry draft tokens
(speculative decoding): each row picks its token as above, and a draft is kept while its
row picked it, so the tokens are distributed exactly as if sampled one per step (and a
seeded request's are the very same tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.request import Request
from kvserve.outputs import TokenLogprob
from kvserve.sampling_params import SamplingParams
from kvserve.structured.bitmask import TokenMask, apply_token_mask

# A seeded request's generator state (``SeededNoise.get_state``).
NoiseState = tuple[torch.Tensor, torch.Tensor | None]


class SeededNoise:
    """The sampling noise of a request with a seed: every one of the seed's 64 bits counts.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so seeds equal
    modulo 2^32 would sample alike. A seed whose high half is zero (the common small
    seeds) keeps one generator, exactly as before; any other seed draws its uniforms from
    two generators, one per half, and adds them modulo 1, which is again uniform and
    depends on both halves.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        bits = seed % 2**64  # two's complement: -1 and 2^64 - 1 are one seed
        self._low = torch.Generator(device=device)
        self._low.manual_seed(bits & 0xFFFFFFFF)
        self._high: torch.Generator | None = None
        if bits >> 32:
            self._high = torch.Generator(device=device)
            self._high.manual_seed(bits >> 32)

    def get_state(self) -> NoiseState:
        return self._low.get_state(), None if self._high is None else self._high.get_state()

    def set_state(self, state: NoiseState) -> None:
        low, high = state
        self._low.set_state(low)
        if self._high is not None and high is not None:
            self._high.set_state(high)

    def exponential_(self, row: torch.Tensor) -> torch.Tensor:
        """Fill ``row`` with Exp(1) samples, in place."""
        if self._high is None:
            return row.exponential_(generator=self._low)
        u = torch.rand(row.shape, generator=self._low, device=row.device, dtype=row.dtype)
        u.add_(torch.rand(row.shape, generator=self._high, device=row.device, dtype=row.dtype))
        u.frac_()  # uniform on [0, 1)
        return row.copy_(torch.log1p(-u).neg_())  # -log(1 - u) ~ Exp(1), finite


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class StepTokens:
    """Each request's new tokens of one step (one, or accepted drafts and one more), and
    their logprobs (None where not asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]

    @classmethod
    def single(cls, out: SamplerOutput) -> StepTokens:
        return cls([[t] for t in out.token_ids], [[lp] for lp in out.logprobs])


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def request_generator(self, seed: int) -> SeededNoise:
        return SeededNoise(seed, self.device)

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request], mask: TokenMask | None = None
    ) -> SamplerOutput:
        """``logits``: float32 [len(requests), vocab]; ``mask``: the allowed tokens of the
        constrained rows (structured outputs), or None when no row is constrained."""
        params = [r.params for r in requests]
        raw = logits
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None

        if mask is not None:
            logits = apply_token_mask(logits, mask)
        logits = self._apply_penalties(logits, requests)
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list: list[int] = tokens.tolist()

        return SamplerOutput(token_list, _logprobs(raw_logprobs, tokens, token_list, params))

    def verify(
        self, logits: torch.Tensor, requests: Sequence[Request], mask: TokenMask | None = None
    ) -> StepTokens:
        """Verify the drafts (``spec_token_ids``) of ``requests`` and sample one more token.

        ``logits``: float32, ``1 + len(spec_token_ids)`` rows per request, in order: row
        ``j`` predicts the token after the request's last token and its first ``j``
        drafts. ``mask`` covers those rows (only requests without drafts are constrained).

        Each row's token is chosen as without speculation: the argmax (greedy), or a
        sample from the row's distribution ``p`` (after temperature, top-k/p, min-p) by
        the exponential race. A draft is accepted when its row chose it; the first row
        that chose another token (or the last row) yields that token. Each token is then
        distributed as ``p``, as without speculation: for a point-mass (n-gram) draft
        this is rejection sampling (the draft is accepted with probability ``p(x)``, and
        otherwise the token is drawn from ``p`` without ``x``). A seeded request's rows
        take its noise in order, one row per position, and its generator is then set
        back to where it stood after the rows whose tokens were kept: every position
        gets the noise it gets without speculation, so its tokens are the same whether a
        step speculated or not, and so do not depend on the rest of the batch (which
        decides that: ``speculative_max_batch``).
        """
        rows = [r for r in requests for _ in range(1 + len(r.spec_token_ids))]
        drafts = [t for r in requests for t in (*r.spec_token_ids, -1)]  # -1: sample only
        params = [r.params for r in rows]
        dev = logits.device
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        if mask is not None:
            logits = apply_token_mask(logits, mask)
        logits = self._apply_penalties(logits, rows)
        draft_t = torch.tensor(drafts, device=dev)
        # A seeded row's generator state after its draw, to set the request back to.
        states: dict[int, NoiseState] = {}
        if all(p.greedy for p in params):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample(logits, rows, states)
        chosen_l: list[int] = chosen.tolist()
        accept_l: list[bool] = (chosen == draft_t).tolist()  # never for a -1 row
        row_logprobs = _logprobs(raw_logprobs, chosen, chosen_l, params)

        out = StepTokens([], [])
        row = 0
        for req in requests:
            n = 1 + len(req.spec_token_ids)
            take = 1
            while take < n and accept_l[row + take - 1]:
                take += 1
            last = row + take - 1
            gen = req.generator
            if gen is not None and take < n and last in states:  # later rows' noise unused
                gen.set_state(states[last])
            out.token_ids.append(chosen_l[row : row + take])
            out.logprobs.append(row_logprobs[row : row + take])
            row += n
        return out

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Each row's logit bias, then its repetition, presence and frequency penalties
        (``SamplingParams``), in vLLM's order, and last its ``min_tokens`` (no stop token
        yet); only rows that ask for one cost anything."""
        rows = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
        if not rows:
            return logits
        logits = logits.clone()
        vocab, dev = logits.shape[1], logits.device
        for i in rows:  # per request: each has its own ids and counts
            req = requests[i]
            p = req.params
            if req.logits_state is None:
                req.logits_state = LogitsState(req, vocab, dev)
            state = req.logits_state
            if state.bias is not None:
                logits[i].index_add_(0, *state.bias)
            if p.repetition_penalty != 1:
                row = logits[i]
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                logits[i] = torch.where(state.seen(req.all_token_ids), penalised, row)
            if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
                ids = torch.tensor(req.output_token_ids, device=dev)
                counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if req.num_output_tokens < p.min_tokens:
                logits[i, state.stop_ids] = -math.inf
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        states: dict[int, NoiseState] | None = None,
    ) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        greedy_tokens = logits.argmax(dim=-1)
        sampled = self._race(self._probs(logits, requests), requests, states)
        return torch.where(greedy, greedy_tokens, sampled)

    def _probs(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k/p, min-p (a greedy
        row gets temperature 1; its caller takes the argmax instead)."""
        params = [r.params for r in requests]
        dev = logits.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        logits = logits / temps.unsqueeze(1)

        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            vocab = logits.shape[1]
            top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
            top_p = torch.tensor([p.top_p for p in params])
            logits = _top_k_top_p(logits, top_k.to(dev), top_p.to(dev))
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0)
        return probs

    def _race(
        self,
        probs: torch.Tensor,
        requests: Sequence[Request],
        states: dict[int, NoiseState] | None = None,
    ) -> torch.Tensor:
        """One token per row drawn from ``probs`` (unnormalised is fine): the argmax of
        p / q with q ~ Exp(1), a seeded request's q from its own generator (in row order;
        with ``states``, each such row's generator state after its draw is kept there)."""
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, req in enumerate(requests):
            if req.generator is not None and not req.params.greedy:
                req.generator.exponential_(noise[i])
                if states is not None:
                    states[i] = req.generator.get_state()
        return (probs / noise).argmax(dim=-1)


class LogitsState:
    """What a request's logit adjustments keep between steps, built at its first one (on
    the request, so a verify step's repeated rows share it): its ``logit_bias`` and its
    ``min_tokens`` stop ids as tensors, and for a repetition penalty the set of token ids
    its prompt and output hold, grown by each step's new tokens only."""

    def __init__(self, req: Request, vocab: int, device: torch.device) -> None:
        p = req.params
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device)
            self.bias = ids, values
        stops = [t for t in (*req.eos_token_ids, *p.stop_token_ids) if t < vocab]
        self.stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
        self._vocab, self._device = vocab, device
        self._seen: torch.Tensor | None = None  # made at the first ``seen``
        self._seen_count = 0  # how many of the request's tokens are in it

    def seen(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Which ids occur in ``token_ids`` (the request's prompt and output so far)."""
        if self._seen is None:
            self._seen = torch.zeros(self._vocab, dtype=torch.bool, device=self._device)
        if self._seen_count < len(token_ids):
            new = torch.tensor(token_ids[self._seen_count :], device=self._device)
            self._seen[new[new < self._vocab]] = True
            self._seen_count = len(token_ids)
        return self._seen


def _logprobs(
    raw_logprobs: torch.Tensor | None,
    tokens: torch.Tensor,
    token_list: list[int],
    params: Sequence[SamplingParams],
) -> list[TokenLogprob | None]:
    """Each row's chosen token's logprob and top alternatives, for rows that ask."""
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if raw_logprobs is None:
        return logprobs
    max_n = max(p.logprobs or 0 for p in params)
    top_vals, top_ids = raw_logprobs.topk(max(max_n, 1), dim=-1)
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    for i, p in enumerate(params):
        if p.logprobs is not None:
            n = p.logprobs
            logprobs[i] = TokenLogprob(
                token_id=token_list[i],
                logprob=chosen[i],
                top=dict(zip(top_ids_l[i][:n], top_vals_l[i][:n], strict=True)),
            )
    return logprobs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (keeps ≥ 1).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
