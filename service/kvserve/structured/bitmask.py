"""The batch's token masks: filled by llguidance, applied to the logits by the sampler."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from kvserve.structured.matcher import MAX_MASK_CPU_SECONDS, GrammarMatcher


@dataclass
class TokenMask:
    """Allowed tokens of the constrained rows of a batch: bit ``t % 32`` of word
    ``t // 32`` of a row is set when token ``t`` is allowed."""

    rows: list[int]  # the rows of the batch's logits that are constrained
    bits: torch.Tensor  # int32 [len(rows), words], on the CPU


# With fewer CPUs than this, masks are filled one after the other: on the 2-core dev host,
# llguidance's thread pool took 4-7x longer per mask (~200-340 µs vs ~45 µs, a
# 10-property schema) than a plain loop, its hand-offs costing more than the masks.
PARALLEL_MIN_CPUS = 8
PARALLEL_MIN_ROWS = 4


class TokenMasker:
    """Fills the masks of a batch's constrained rows (llguidance releases the GIL, so a
    GPU forward pass launched before runs meanwhile): in llguidance's thread pool on a
    machine with ``PARALLEL_MIN_CPUS`` or more, else in a loop."""

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None
        self._parallel = (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS
        # A parallel fill that took long: the next one goes row by row, to find which
        # grammar costs it (GrammarMatcher.mask_cost).
        self._attribute = False
        self.seconds = 0.0  # spent filling masks, in total
        self.rows = 0  # masks filled, in total

    def fill(self, grammars: Sequence[GrammarMatcher | None]) -> TokenMask | None:
        """The masks for ``grammars`` (one per batch row; None: unconstrained), or None
        when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        start = time.perf_counter()
        constrained = [g for g in grammars if g is not None]
        matchers = [g.matcher for g in constrained]
        words = max(g.mask_words for g in constrained)
        bits = torch.empty((len(rows), words), dtype=torch.int32)
        if self._parallel and len(rows) >= PARALLEL_MIN_ROWS and not self._attribute:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, k) for k, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(rows)
            )
            self._attribute = time.perf_counter() - start > MAX_MASK_CPU_SECONDS
        else:
            self._attribute = False
            for k, (g, m) in enumerate(zip(constrained, matchers, strict=True)):
                cpu = time.thread_time()  # this thread's CPU: the machine's load aside
                m.unsafe_compute_mask_ptr(bits[k].data_ptr(), words * 4)
                g.mask_cost(time.thread_time() - cpu)
        self.seconds += time.perf_counter() - start
        self.rows += len(rows)
        return TokenMask(rows, bits)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """``logits`` [batch, vocab] with every token a mask disallows at -inf (a new tensor).

    Ids past the mask's width (a model's padded vocabulary) are disallowed too.
    """
    vocab = logits.shape[1]
    allowed = _unpack(mask.bits, logits.device)  # bool [rows, words * 32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    disallowed = allowed[:, :vocab].logical_not_()
    if len(mask.rows) == logits.shape[0]:  # every row constrained
        return logits.masked_fill(disallowed, float("-inf"))
    rows = torch.tensor(mask.rows, device=logits.device)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(disallowed, float("-inf"))
    return out


def _unpack(bits: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One bool per token from little-endian int32 words: bit j of byte i is token 8i + j."""
    as_bytes = bits.view(torch.uint8)
    if device.type == "cpu":  # numpy unpacks bits ~100x faster than torch ops on a CPU
        return torch.from_numpy(np.unpackbits(as_bytes.numpy(), axis=1, bitorder="little")).view(
            torch.bool
        )
    # On an accelerator: ship the packed bits (32x fewer bytes), unpack with a byte table.
    packed = as_bytes.to(device, non_blocking=True).long()
    return _byte_bits(device)[packed].flatten(1)


_byte_tables: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """bool [256, 8]: row b holds the bits of byte b, least significant first."""
    table = _byte_tables.get(device)
    if table is None:
        table = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool().to(device)
        _byte_tables[device] = table
    return table
