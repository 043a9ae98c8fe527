"""Turns a scheduled batch into one forward pass and samples the next tokens.

With tensor parallelism this runner is rank 0's: before each forward pass it broadcasts
the step's model input to the workers, whose runners ``follow`` it through the same
forward pass (and the logits' gather), so every rank runs every collective in the same
order. Calibration (fp8 KV scales) needs no broadcast: each rank runs the same fixed
prefill when it allocates its cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvserve.config import blocks_for
from kvserve.engine.block_table import BlockTable
from kvserve.engine.request import Request
from kvserve.model.attention import (
    FP8_DTYPES,
    AttentionMetadata,
    DecodeGroup,
    KVCache,
    allocate_kv_cache,
    gather_rows,
)
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.rope import RotaryEmbedding
from kvserve.outputs import RequestMetrics
from kvserve.parallel.group import TensorGroup, to_device
from kvserve.sample import prompt_logprobs
from kvserve.sample.prompt_logprobs import PromptScores
from kvserve.sample.sampler import Sampler, StepTokens
from kvserve.sampling_params import SamplingParams
from kvserve.structured.bitmask import TokenMasker

if TYPE_CHECKING:
    from kvserve.lora.layers import LoRALayers

_SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0)

# fp8 KV scales (docs/engine.md, "fp8 KV cache"): calibrated once at load on this many
# tokens, with this much room above the largest |key| / |value| seen there.
KV_CALIBRATION_TOKENS = 256
KV_SCALE_HEADROOM = 8.0


# The messages rank 0 broadcasts besides steps: a keepalive while idle (and None: stop).
KEEPALIVE = "keepalive"


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # rows of the hidden states whose logits are sampled
    sample_requests: list[Request]
    token_slots: list[int] | None = None  # LoRA slot of each token (-1: base model)
    # Prompt positions scored for prompt logprobs, and their rows of the hidden states.
    prompt_scores: list[PromptScores] = field(default_factory=list)
    prompt_rows: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        seed: int,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        group: TensorGroup | None = None,
    ) -> None:
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.max_model_len = max_model_len
        self.device = device
        self.block_size = block_size
        self.group = group if group is not None and group.size > 1 else None
        self.model = load_model(model_dir, config, dtype, device, quantization, self.group)
        # This rank's shapes (its heads and KV heads with tensor parallelism): the KV
        # cache and the gathers are sized from them.
        self.config = self.model.local
        self.rope = RotaryEmbedding(config, max_model_len, device)
        self.sampler = Sampler(device, seed)
        self.token_masker = TokenMasker()  # structured outputs' masks (and their cost)
        self.kv_caches: list[KVCache] = []
        self.lora: LoRALayers | None = None  # set by the engine when LoRA is on

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim] in
        ``kv_cache_dtype``; an fp8 cache gets its per-layer scales first."""
        c = self.config
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        dtype = self.kv_cache_dtype
        scales = self.calibrate_kv_scales() if dtype in FP8_DTYPES else None
        # Zeroed, not empty: masked-out cache slots still meet the attention weights (as 0),
        # and 0 × NaN from uninitialised memory would poison the output.
        self.kv_caches = [
            KVCache(
                allocate_kv_cache(*shape, dtype=dtype, device=self.device),
                allocate_kv_cache(*shape, dtype=dtype, device=self.device),
                *(scales[i] if scales is not None else (1.0, 1.0)),
            )
            for i in range(c.num_layers)
        ]

    @torch.inference_mode()
    def calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Per layer, (k_scale, v_scale) for an fp8 cache: one prefill of a fixed
        pseudo-random token sequence into a temporary cache in the model's dtype; each
        scale is the power of two that puts the largest |key| (|value|) seen at or below
        1/KV_SCALE_HEADROOM of the fp8 format's largest finite value.

        Fixed at load and independent of traffic, so outputs are reproducible; a power of
        two, so scaling is exact and only the fp8 rounding loses precision."""
        n = min(KV_CALIBRATION_TOKENS, self.max_model_len)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.config.vocab_size, (n,), generator=gen).tolist()
        blocks = blocks_for(n, self.block_size)
        c = self.config
        shape = (blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            KVCache(
                allocate_kv_cache(*shape, dtype=self.dtype, device=self.device),
                allocate_kv_cache(*shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]
        req = Request("calibrate", tokens, _SCORE_PARAMS, RequestMetrics(arrival_time=0.0))
        tables = BlockTable()
        tables.extend("calibrate", range(blocks))
        self._forward(self.prepare([(req, n)], tables, {"calibrate": -1}))
        limit = torch.finfo(self.kv_cache_dtype).max / KV_SCALE_HEADROOM

        def scale(cache: torch.Tensor) -> float:
            amax = float(cache.abs().max())
            return 1.0 if amax == 0 else float(2.0 ** math.ceil(math.log2(amax / limit)))

        scales = [(scale(kv.k), scale(kv.v)) for kv in self.kv_caches]
        self.kv_caches = []
        return scales

    @torch.inference_mode()
    def execute(
        self,
        batch: Sequence[tuple[Request, int]],
        tables: BlockTable,
        lora_slots: Mapping[str, int] | None = None,
    ) -> tuple[list[Request], StepTokens]:
        """Run the batch; returns the requests that sampled, and their new tokens (one
        each, or with drafts to verify, the accepted drafts and one more).

        ``lora_slots``: each request's LoRA slot (-1: the base model), with LoRA on."""
        inp = self.prepare(batch, tables, lora_slots)
        reqs = inp.sample_requests
        # The rows whose logits are made, in this order on every rank (the logits' gather
        # is a collective): the sampled ones, then the scored prompt positions, in parts.
        prompt_parts = [] if inp.prompt_rows is None else prompt_logprobs.parts(inp.prompt_rows)
        self._lead(inp, ([inp.sample_indices] if reqs else []) + prompt_parts)
        hidden = self._forward(inp)
        tokens = StepTokens([], [])
        if reqs:
            speculative = any(r.spec_token_ids for r in reqs)
            rows = (
                [r for r in reqs for _ in range(1 + len(r.spec_token_ids))] if speculative else reqs
            )
            # Filled on the CPU while a GPU still runs the forward pass launched above.
            mask = self.token_masker.fill([r.grammar for r in rows])
            logits = self.model.compute_logits(hidden.index_select(0, inp.sample_indices))
            if speculative:
                tokens = self.sampler.verify(logits, reqs, mask)
            else:
                tokens = StepTokens.single(self.sampler(logits, reqs, mask))
        if prompt_parts:
            logits_parts = (self.model.compute_logits(hidden.index_select(0, part))
                            for part in prompt_parts)  # fmt: skip
            prompt_logprobs.record(logits_parts, inp.prompt_scores)
        return reqs, tokens

    @torch.inference_mode()
    def prompt_logprobs(
        self, request_id: str, token_ids: Sequence[int], tables: BlockTable
    ) -> torch.Tensor:
        """Log-softmax at every position of ``token_ids`` (teacher forcing), float32 [T, V],
        for the request whose blocks ``tables`` holds under ``request_id``."""
        req = Request(request_id, list(token_ids), _SCORE_PARAMS, RequestMetrics(0.0))
        inp = self.prepare([(req, len(token_ids))], tables, {request_id: -1})
        self._lead(inp, [torch.arange(len(token_ids), device=self.device)])
        hidden = self._forward(inp)
        return torch.log_softmax(self.model.compute_logits(hidden), dim=-1)

    def _lead(self, inp: ModelInput, logit_parts: list[torch.Tensor]) -> None:
        """With tensor parallelism: send the workers this step (without its requests)
        and the hidden rows whose logits rank 0 will gather, part by part."""
        if self.group is not None:
            step = ModelInput(inp.input_ids, inp.positions, inp.meta, inp.sample_indices, [])
            self.group.broadcast((step, logit_parts))

    @torch.inference_mode()
    def follow(self, message: object) -> None:
        """A worker rank: run one message of rank 0's (``_lead``, or a keepalive)."""
        if message == KEEPALIVE:
            return
        inp, logit_parts = to_device(message, self.device)
        hidden = self._forward(inp)
        for rows in logit_parts:
            self.model.compute_logits(hidden.index_select(0, rows))

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        if self.lora is not None:
            self.lora.set_batch(inp.token_slots or [])
        cos, sin = self.rope.lookup(inp.positions, self.dtype)
        return self.model(inp.input_ids, cos, sin, self.kv_caches, inp.meta)  # type: ignore[no-any-return]

    def prepare(
        self,
        batch: Sequence[tuple[Request, int]],
        tables: BlockTable,
        lora_slots: Mapping[str, int] | None = None,
    ) -> ModelInput:
        """The step's model input. Python work here is per scheduled request and token;
        block tables and slots come from ``tables`` in a few tensor ops (block_table.py)."""
        bs = self.block_size
        # Decodes first, shortest context first (see _split_by_length), then the prefill
        # chunks that continue a sequence (earlier chunks, a prefix-cache hit, drafts to
        # verify), then fresh prompts, which attend to their own keys only.
        decodes = sorted(
            ((r, n) for r, n in batch if n == 1), key=lambda x: x[0].num_computed_tokens
        )
        prefills = [(r, n) for r, n in batch if n > 1 and r.num_computed_tokens > 0]
        fresh = [(r, n) for r, n in batch if n > 1 and r.num_computed_tokens == 0]
        ordered = decodes + prefills + fresh
        tokens: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []  # each token's request, as its index in ``ordered``
        sample_indices: list[int] = []
        sample_requests: list[Request] = []
        token_slots: list[int] | None = [] if lora_slots is not None else None
        prompt_scores: list[PromptScores] = []
        prompt_rows: list[int] = []
        for i, (req, n) in enumerate(ordered):
            start = req.num_computed_tokens
            scored = req.prompt_logprobs is not None and prompt_logprobs.scored(req, start, n)
            if scored:
                prompt_scores.append(PromptScores(req, start, scored))
                prompt_rows.extend(range(len(tokens), len(tokens) + scored))
            if req.spec_token_ids:  # its last token and the drafts to verify
                tokens.extend((req.all_token_ids[start:] + req.spec_token_ids)[:n])
            else:
                tokens.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            token_rows.extend([i] * n)
            if token_slots is not None and lora_slots is not None:
                token_slots.extend([lora_slots[req.request_id]] * n)
            # Caught up: this step yields its next token(s), from the logits of its last
            # committed token and of each draft.
            if start + n >= req.num_tokens:
                sample_indices.extend(
                    range(len(tokens) - (start + n - req.num_tokens + 1), len(tokens))
                )
                sample_requests.append(req)

        rows = tables.rows([r.request_id for r, _ in ordered])  # decodes first
        pos = torch.tensor(positions, dtype=torch.long)
        slots = tables.slots(rows[torch.tensor(token_rows, dtype=torch.long)], pos, bs)
        meta = AttentionMetadata(
            slot_mapping=self._device(slots),
            num_decodes=len(decodes),
            fresh_lens=[n for _, n in fresh],
        )
        # Every layer's cache has this many blocks and KV heads: the gathers' rows are
        # computed here, once per step (not per layer).
        num_blocks, kv_heads = self.kv_caches[0].k.shape[0], self.config.num_kv_heads
        if decodes:
            ctx = [r.num_computed_tokens + 1 for r, _ in decodes]
            for lo, hi in _split_by_length(ctx, bs):
                bt = self._device(tables.gather(rows[lo:hi], blocks_for(ctx[hi - 1], bs)))
                keys = torch.arange(bt.shape[1] * bs, device=self.device)
                visible = keys[None, :] < self._long(ctx[lo:hi])[:, None]
                mask = self._additive(visible)[:, None, None, :]
                group_rows = gather_rows(bt, num_blocks, kv_heads)
                meta.decode_groups.append(DecodeGroup(lo, bt, group_rows, mask))
        if prefills:
            meta.num_prefills = len(prefills)
            meta.max_query_len = qmax = max(n for _, n in prefills)
            ends = [r.num_computed_tokens + n for r, n in prefills]
            meta.prefill_block_tables = bt = self._device(
                tables.gather(rows[len(decodes) : len(decodes) + len(prefills)],
                              blocks_for(max(ends), bs))
            )  # fmt: skip
            meta.prefill_rows = gather_rows(bt, num_blocks, kv_heads)
            dest: list[int] = []
            qpos = torch.zeros(len(prefills), qmax, dtype=torch.long)
            for b, (req, n) in enumerate(prefills):
                dest.extend(range(b * qmax, b * qmax + n))
                qpos[b, :n] = torch.arange(req.num_computed_tokens, req.num_computed_tokens + n)
            meta.prefill_dest = self._long(dest)
            keys = torch.arange(bt.shape[1] * bs, device=self.device)
            # Causal from each chunk's offset; padded query rows see key 0 only.
            visible = keys[None, None, :] <= qpos.to(self.device)[:, :, None]
            meta.prefill_mask = self._additive(visible)[:, None]
        return ModelInput(
            input_ids=self._long(tokens),
            positions=self._device(pos),
            meta=meta,
            sample_indices=self._long(sample_indices),
            sample_requests=sample_requests,
            token_slots=token_slots,
            prompt_scores=prompt_scores,
            prompt_rows=self._long(prompt_rows) if prompt_rows else None,
        )

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def _long(self, data: Sequence[int]) -> torch.Tensor:
        return self._device(torch.tensor(data, dtype=torch.long))

    def _device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)


def _split_by_length(sorted_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split ascending context lengths into one or two groups, whichever gathers fewer
    padded blocks (a second attention call costs about as much as ~20% padding)."""
    n = len(sorted_lens)
    blocks = [blocks_for(t, block_size) for t in sorted_lens]
    one = n * blocks[-1]
    best, cut = one, n
    for i in range(1, n):
        area = i * blocks[i - 1] + (n - i) * blocks[-1]
        if area < best:
            best, cut = area, i
    if cut == n or best > 0.8 * one:
        return [(0, n)]
    return [(0, cut), (cut, n)]
