"""Measure three ways to apply many LoRA adapters to one mixed batch, and print a table.

``python -m kvserve.lora.measure [--device cpu|cuda]``. Each token of the batch belongs to
the base model or to one of the adapters in ``slots`` device slots; a projection's output
gains ``(x @ A_s.T) @ B_s.T`` for the token's slot ``s``. The formulations:

- segments: for each adapter present in the batch, pick its rows, multiply, add them back;
- gathered bmm: gather each token's A and B, then one batched matmul pair;
- stacked slots: one matmul against every slot's A at once, zero the columns of the
  other slots, one matmul against every slot's B.

The figures decide ``kvserve.lora.layers`` (docs/engine.md, "LoRA adapters").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def segments(
    x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    for s in torch.unique(slot).tolist():
        if s < 0:
            continue
        rows = (slot == s).nonzero().squeeze(1)
        y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a[s]), b[s]))
    return y


def gathered_bmm(
    x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    # A zero slot at the end stands for the base model.
    a0 = torch.cat([a, a.new_zeros(1, *a.shape[1:])])
    b0 = torch.cat([b, b.new_zeros(1, *b.shape[1:])])
    idx = torch.where(slot < 0, a.shape[0], slot)
    xa = torch.bmm(x[:, None, :], a0[idx].transpose(1, 2))  # [T, 1, r]
    return y + torch.bmm(xa, b0[idx].transpose(1, 2))[:, 0]


def stacked(
    x: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    s, r, n_in = a.shape
    a_all = a.reshape(s * r, n_in)
    b_all = b.permute(1, 0, 2).reshape(b.shape[1], s * r)
    onehot = (slot[:, None] == torch.arange(s, device=x.device)[None, :]).to(x.dtype)
    xa = F.linear(x, a_all).view(-1, s, r) * onehot[:, :, None]
    return y + F.linear(xa.view(-1, s * r), b_all)


FORMULATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "segments": segments,
    "gathered bmm": gathered_bmm,
    "stacked slots": stacked,
}


def _apply(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    slot: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    return fn(x, F.linear(x, w), slot, a, b)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call over a ~50 ms round."""
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= 0.05:
            return elapsed / n


def _overheads(
    base: Callable[[], object], fns: list[Callable[[], object]], device: torch.device, rounds: int
) -> tuple[float, list[float]]:
    """The base's best time per call, and each formulation's added time relative to the
    base: the median over rounds that time the base and every formulation back to back,
    so that a busy machine's drift hits both sides of each ratio alike."""
    for fn in (base, *fns):
        fn()
    base_times: list[float] = []
    ratios: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        t_base = _time(base, device)
        base_times.append(t_base)
        for i, fn in enumerate(fns):
            ratios[i].append(_time(fn, device) / t_base - 1)
    return min(base_times), [statistics.median(r) for r in ratios]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvserve.lora.measure")
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", type=int, default=3072)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    h, o, r, slots = args.hidden, args.out, args.rank, args.slots
    w = torch.randn(o, h, generator=gen).to(device)
    a = (torch.randn(slots, r, h, generator=gen) * 0.02).to(device)
    b = (torch.randn(slots, o, r, generator=gen) * 0.02).to(device)
    print(
        f"device {device}, projection {h}->{o}, rank {r}, {slots} slots, fp32, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print("| tokens | adapters in batch | base linear | " + " | ".join(FORMULATIONS) + " |")
    print("|---|---|---|" + "---|" * len(FORMULATIONS))
    with torch.inference_mode():
        for tokens in (16, 64, 512):
            x = torch.randn(tokens, h, generator=gen).to(device)
            for in_batch in (1, 4):
                # A quarter of the tokens on the base model, the rest spread over adapters;
                # the batch's tokens alternate adapters (the worst case for segments).
                slot = torch.tensor(
                    [-1 if i % 4 == 3 else i % in_batch for i in range(tokens)], device=device
                )
                ref = segments(x, F.linear(x, w), slot, a, b)
                for fn in FORMULATIONS.values():
                    got = fn(x, F.linear(x, w), slot, a, b)
                    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)
                base_t, added = _overheads(
                    functools.partial(F.linear, x, w),
                    [
                        functools.partial(_apply, fn, x, w, slot, a, b)
                        for fn in FORMULATIONS.values()
                    ],
                    device,
                    args.rounds,
                )
                cells = " | ".join(f"+{v:.0%}" for v in added)
                print(f"| {tokens} | {in_batch} | {base_t * 1e6:.0f} µs | {cells} |")
    print("(formulation cells: time added to the base linear's, median over the rounds)")


if __name__ == "__main__":
    main()
