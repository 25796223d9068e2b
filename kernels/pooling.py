"""The dynamic selection's reading of Q and K on the GPU: :func:`fp4video.sparse.tile_pool` in one
pass over the tensor, a program per tile of tokens and head.

The selection reads Q once (the tiles' sums and their directions' sums) and K twice (its sums give
K's mean over the live keys; then the directions less that mean): three passes of 16-bit values,
where the reference's tensor operations make fp32 copies and several passes each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import next_pow2

__all__ = ["tile_pool"]

@triton.jit
def _tile_pool_kernel(X, W, C, Sums, Units, H, S, D, n_tiles,
                      sxb, sxh, sxs, sxd, swb, swh, sws, scb, sch,
                      tile, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, HAS_C: tl.constexpr,
                      SUMS: tl.constexpr, UNITS: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = tl.arange(0, BLOCK_T)
    rows = t * tile + r
    d = tl.arange(0, BLOCK_D)
    ok = (r < tile) & (rows < S)
    if HAS_W:  # tokens of weight 0 are not read: they may hold anything
        ok = ok & (tl.load(W + b * swb + h * swh + rows * sws, mask=ok, other=0.0) > 0)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + d[None, :] * sxd, mask=ok[:, None] & (d[None, :] < D),
                other=0.0).to(tl.float32)
    out = (bh * n_tiles + t) * D + d
    if SUMS:
        tl.store(Sums + out, tl.sum(x, axis=0), mask=d < D)
    if UNITS:
        if HAS_C:
            x = x - tl.load(C + b * scb + h * sch + d, mask=d < D, other=0.0)[None, :]
        # x / ‖x‖ as u / ‖u‖ with u = x / max|x|: the same directions at any magnitude (no square
        # underflows or overflows), as fp4video.sparse.estimate.directions
        big = tl.max(tl.abs(x), axis=1)
        u = tl.where((big > 0)[:, None], x / tl.where(big > 0, big, 1.0)[:, None], 0.0)
        norm = tl.sqrt(tl.sum(u * u, axis=1))
        unit = tl.where(ok[:, None], u / tl.maximum(norm, 1.0)[:, None], 0.0)
        tl.store(Units + out, tl.sum(unit, axis=0), mask=d < D)


def tile_pool(x: torch.Tensor, tile: int, *, weight: torch.Tensor | None = None, center: torch.Tensor | None = None,
              sums: bool = True, units: bool = True):
    """:func:`fp4video.sparse.tile_pool` on the GPU (the same contract; sums in another order, so
    equal to fp32 rounding)."""
    b, h, s, d = x.shape
    n = -(-s // tile)
    dev = x.device
    total = torch.empty(b, h, n, d, device=dev, dtype=torch.float32) if sums else None
    unit_total = torch.empty(b, h, n, d, device=dev, dtype=torch.float32) if units else None
    dummy = torch.empty(1, device=dev, dtype=torch.float32)
    w = dummy if weight is None else weight.to(torch.float32).expand(b, h, s)
    c = dummy if center is None else center.to(torch.float32).expand(b, h, 1, d)
    _tile_pool_kernel[(n, b * h)](
        x, w, c, dummy if total is None else total, dummy if unit_total is None else unit_total, h, s, d, n,
        *x.stride(), *(w.stride() if weight is not None else (0, 0, 0)),
        *(c.stride()[:2] if center is not None else (0, 0)), tile,
        BLOCK_T=next_pow2(tile), BLOCK_D=next_pow2(d), HAS_W=weight is not None, HAS_C=center is not None, SUMS=sums, UNITS=units,
        num_warps=8 if next_pow2(tile) * next_pow2(d) >= 128 * 128 else 4,
    )
    return total, unit_total
