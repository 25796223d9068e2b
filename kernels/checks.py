"""What an attention call computes about its inputs besides the pre-pass: which heads hold a
NaN/Inf (the NaN policy of :func:`fp4video.reference.nonfinite_heads`), K's smoothing mean, and
the LSE shift that gives smooth-K methods the LSE of the unsmoothed logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.reference import smoothing_mean

from .tiles import key_mask, next_pow2


def k_smoothing_mean(k: torch.Tensor, key_alive) -> torch.Tensor:
    """K's smoothing mean (B, H, D) fp32 over the live keys (``key_alive``: (B, Sk) bool or None):
    :func:`fp4video.reference.smoothing_mean` of K with its dead keys zeroed (K read in its own dtype)."""
    if key_alive is not None:
        k = torch.where(key_alive[:, None, :, None], k, 0.0)
    return smoothing_mean(k, key_alive[:, None, :] if key_alive is not None else None)[..., 0, :].contiguous()


@triton.jit
def _row_dot(X, Mean, Out, H, S, D_IN, sxb, sxh, sxs, sxd, smb, smh, scale,
             D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Out[b, h, s] = scale · Σ_d X[b, h, s, d] · Mean[b, h, d] in fp32 (one read of X)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                mask=(rows < S)[:, None] & (cols < D_IN)[None, :], other=0.0).to(tl.float32)
    mean = tl.load(Mean + b * smb + h * smh + cols, mask=cols < D_IN, other=0.0)
    tl.store(Out + bh * S + rows, tl.sum(x * mean[None, :], axis=1) * scale, mask=rows < S)


@triton.jit
def _nonfinite_heads(X, Alive, Flag, H, S, D_IN, sxb, sxh, sxs, sxd, sab, sas,
                     HAS_ALIVE: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Flag[b·H + h] = 1 where X[b, h] holds a NaN or ±Inf in a row that is live (HAS_ALIVE: at a
    key with Alive[b, s] != 0); other flags are left as they are."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D)
    ok = rows < S
    if HAS_ALIVE:
        ok = ok & (tl.load(Alive + b * sab + rows * sas, mask=rows < S, other=0) != 0)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                mask=ok[:, None] & (cols < D_IN)[None, :], other=0.0).to(tl.float32)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32))
    if bad > 0:
        tl.atomic_max(Flag + bh, 1)


def nonfinite_heads(q, k, v, key_alive) -> torch.Tensor:
    """:func:`fp4video.reference.nonfinite_heads` in one read of each tensor: (B, H) bool for
    (B, H, S, D) views (any strides); ``key_alive``: (B, Sk) bool or None."""
    b, h = q.shape[:2]
    flag = torch.zeros(b * h, device=q.device, dtype=torch.int32)
    alive = key_mask(key_alive, q.device)
    block_s = 64
    for x, masked in ((q, False), (k, True), (v, True)):
        s, d = x.shape[-2:]
        _nonfinite_heads[(triton.cdiv(s, block_s), b * h)](
            x, alive, flag, h, s, d, *x.stride(), alive.stride(0), alive.stride(1),
            HAS_ALIVE=masked and key_alive is not None, D=next_pow2(d), BLOCK_S=block_s, num_warps=4)
    return flag.view(b, h) != 0


def smoothing_lse_shift(q: torch.Tensor, mean: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`fp4video.reference.smoothing_lse_shift` on the GPU without an fp32 copy of Q:
    ``scale · q·mean`` (B, H, Sq) fp32 for ``q`` (B, H, Sq, D) (any strides) and ``mean`` (B, H, D)."""
    b, h, sq, d = q.shape
    out = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    block_s = 64
    _row_dot[(triton.cdiv(sq, block_s), b * h)](
        q, mean, out, h, sq, d, *q.stride(), mean.stride(0), mean.stride(1), float(scale),
        D=next_pow2(d), BLOCK_S=block_s, num_warps=4)
    return out
