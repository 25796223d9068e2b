"""The exact attention mass of sampled query rows on every key tile: :func:`fp4video.sparse.row_block_mass`
on the GPU, the read behind every block-sparse call's check (and the ``sampled`` estimate).

A program takes ``BLOCK_R`` sampled rows of one batch entry and head and walks a run of key tiles once
(the tiles are independent, so the key tiles split over programs until the GPU has several waves):
Q·Kᵀ of those rows in fp32 (16-bit inputs on the tensor cores, exact products), and per key tile the
rows' largest logit and the sum of their exponentials below it. A second kernel combines the tiles
into each row's softmax weight per tile. Its work is the rows' share of a dense call's Q·Kᵀ (2 of 128 rows: 1/64),
with no P·V.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp4video.sparse import row_block_mass as reference_row_block_mass
from fp4video.sparse.check import row_shares as reference_row_shares
from fp4video.sparse.selection import positive_int

from .plan import interpreting
from .tiles import LOG2E, next_pow2

__all__ = ["row_block_mass", "row_shares"]


@triton.jit
def _tile_stats(q, K, Max, Sum, out, j, n, live, d, D, kbase, sks, skd, scale_log2, r_ok,
                MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the rows: its largest logit (log2 units) and the sum of exponentials below it.
    A NaN or +Inf logit makes the sum NaN (as the reference's row); masked keys weigh nothing."""
    if MASKED:
        kt = tl.load(K + kbase + n[None, :] * sks + d[:, None] * skd, mask=live[None, :] & (d[:, None] < D), other=0.0)
    else:
        kt = tl.load(K + kbase + n[None, :] * sks + d[:, None] * skd, mask=d[:, None] < D, other=0.0)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee") * scale_log2
    else:
        s = tl.dot(q, kt) * scale_log2
    if MASKED:
        s = tl.where(live[None, :], s, -float("inf"))
    m = tl.max(s, axis=1)
    total = tl.sum(tl.exp2(s - tl.where(m == -float("inf"), 0.0, m)[:, None]), axis=1)
    tl.store(Max + out + j, m, mask=r_ok)
    tl.store(Sum + out + j, total, mask=r_ok)


@triton.jit
def _row_tile_stats_kernel(Q, K, Rows, Alive, Max, Sum, H, Sk, R, n_key_tiles, D, scale_log2,
                           sqb, sqh, sqs, sqd, skb, skh, sks, skd, sab, sas,
                           tiles_per_program,
                           BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           HAS_ALIVE: tl.constexpr, IEEE: tl.constexpr):
    pr = tl.program_id(0)
    bh = tl.program_id(1)
    j0 = tl.program_id(2) * tiles_per_program  # this program's share of the key tiles: [j0, j1)
    j1 = tl.minimum(j0 + tiles_per_program, n_key_tiles)
    b = bh // H
    h = bh % H
    r = pr * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    rows = tl.load(Rows + r, mask=r_ok, other=0)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + d[None, :] * sqd,
                mask=r_ok[:, None] & (d[None, :] < D), other=0.0)
    out = (bh * R + r).to(tl.int64) * n_key_tiles  # (past 2^31 values at long clips with many rows)
    kbase = b * skb + h * skh
    n0 = tl.arange(0, BLOCK_N)
    if HAS_ALIVE:  # a key-padding mask: every tile masked
        for j in range(j0, j1):
            n = j * BLOCK_N + n0
            live = (n < Sk) & (tl.load(Alive + b * sab + n * sas, mask=n < Sk, other=0) != 0)
            _tile_stats(q, K, Max, Sum, out, j, n, live, d, D, kbase, sks, skd, scale_log2, r_ok, True, IEEE)
    else:  # whole tiles unmasked, the partial last one masked
        full = Sk // BLOCK_N
        for j in range(j0, tl.minimum(j1, full)):
            n = j * BLOCK_N + n0
            _tile_stats(q, K, Max, Sum, out, j, n, n < Sk, d, D, kbase, sks, skd, scale_log2, r_ok, False, IEEE)
        if (full < n_key_tiles) & (full >= j0) & (full < j1):
            n = full * BLOCK_N + n0
            _tile_stats(q, K, Max, Sum, out, full, n, n < Sk, d, D, kbase, sks, skd, scale_log2, r_ok, True, IEEE)


@triton.jit
def _normalize_kernel(Top, Total, Mass, n_rows, n_key_tiles, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's tiles' (largest logit, sum below it) into its softmax weight per tile: one pass brings
    the sums to the row's running largest logit and adds them, a second writes each tile's share. A
    tile without a live key weighs nothing; a NaN sum makes the row's total, and so every share, NaN."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = r < n_rows
    base_r = r.to(tl.int64)[:, None] * n_key_tiles  # (past 2^31 values at long clips with many rows)
    c0 = tl.arange(0, BLOCK_K)
    row_max = tl.full((BLOCK_ROWS,), -float("inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_ROWS,), tl.float32)
    for j in range(0, n_key_tiles, BLOCK_K):
        c = j + c0
        ok = r_ok[:, None] & (c[None, :] < n_key_tiles)
        top = tl.load(Top + base_r + c[None, :], mask=ok, other=-float("inf"))
        total = tl.load(Total + base_r + c[None, :], mask=ok, other=0.0)
        new_max = tl.maximum(row_max, tl.max(top, axis=1))
        base = tl.where(new_max == -float("inf"), 0.0, new_max)
        part = tl.where((top == -float("inf")) & (total == total), 0.0, total * tl.exp2(top - base[:, None]))
        row_sum = row_sum * tl.exp2(row_max - base) + tl.sum(part, axis=1)
        row_max = new_max
    base = tl.where(row_max == -float("inf"), 0.0, row_max)
    denom = tl.maximum(row_sum, 1.1754943508222875e-38)  # (a NaN sum stays NaN)
    denom = tl.where(row_sum != row_sum, row_sum, denom)
    for j in range(0, n_key_tiles, BLOCK_K):
        c = j + c0
        ok = r_ok[:, None] & (c[None, :] < n_key_tiles)
        top = tl.load(Top + base_r + c[None, :], mask=ok, other=-float("inf"))
        total = tl.load(Total + base_r + c[None, :], mask=ok, other=0.0)
        part = tl.where((top == -float("inf")) & (total == total), 0.0, total * tl.exp2(top - base[:, None]))
        tl.store(Mass + base_r + c[None, :], part / denom[:, None], mask=ok)


def row_block_mass(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, scale: float | None = None,
                   attn_mask: torch.Tensor | None = None, key_tile: int = 128, rows_at_once: int = 1024,
                   block_r: int | None = None, num_warps: int | None = None, num_stages: int = 3,
                   splits: int | None = None) -> torch.Tensor:
    """:func:`fp4video.sparse.row_block_mass` on the GPU (the same contract and values to fp32
    rounding: the sums run in another order). A mask other than a key-padding one ((B, 1, 1, Sk) or
    a broadcast of it) runs the reference, on the same device. ``block_r`` (rows a program takes: 64
    or 128), ``num_warps``, ``num_stages`` and ``splits`` (programs sharing one row block's key
    tiles) are for tuning (None: the defaults below)."""
    if attn_mask is not None and not (attn_mask.dim() == 4 and attn_mask.shape[1] == attn_mask.shape[2] == 1):
        return reference_row_block_mass(q, k, rows, scale=scale, attn_mask=attn_mask, key_tile=key_tile,
                                        rows_at_once=rows_at_once)
    if key_tile & (key_tile - 1) or key_tile < 16:
        return reference_row_block_mass(q, k, rows, scale=scale, attn_mask=attn_mask, key_tile=key_tile,
                                        rows_at_once=rows_at_once)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flat = rows.reshape(-1).to(device=q.device, dtype=torch.int64)
    n_rows, nk = flat.numel(), -(-sk // key_tile)
    dev = q.device
    top = torch.empty(b, h, n_rows, nk, device=dev, dtype=torch.float32)
    total = torch.empty_like(top)
    alive = None
    if attn_mask is not None:
        alive = attn_mask.expand(b, 1, 1, sk).reshape(b, sk).to(torch.int8).contiguous()
    a = alive if alive is not None else torch.empty(1, 1, dtype=torch.int8, device=dev)
    if q.dtype != k.dtype or not q.is_cuda:  # (the CPU interpreter has no 16-bit dot)
        q, k = q.float(), k.float()
    ieee = q.dtype == torch.float32
    if block_r is None:  # 64 rows, 4 warps, 3 stages: the fastest of the sweep at Wan 720p (BENCHMARKS.md)
        block_r = 64
    if block_r not in (64, 128):
        raise ValueError(f"block_r must be 64 or 128, got {block_r!r}")
    row_blocks = triton.cdiv(n_rows, block_r)
    if splits is None:  # several waves of programs on the GPU's processors, each with a long run of tiles
        processors = torch.cuda.get_device_properties(dev).multi_processor_count if q.is_cuda else 1
        splits = max(1, min(nk // 16, -(-8 * processors // max(1, row_blocks * b * h))))
    positive_int(splits, "splits")
    per_program = -(-nk // min(splits, nk)) if nk else 1
    if n_rows:
        _row_tile_stats_kernel[(row_blocks, b * h, -(-nk // per_program) if nk else 1)](
            q, k, flat, a, top, total, h, sk, n_rows, nk, d, scale * LOG2E,
            *q.stride(), *k.stride(), *(a.stride() if alive is not None else (0, 0)), per_program,
            BLOCK_R=block_r, BLOCK_N=key_tile, BLOCK_D=next_pow2(d), HAS_ALIVE=alive is not None, IEEE=ieee,
            num_warps=num_warps or (8 if block_r == 128 else 4), num_stages=num_stages,
        )
    mass = torch.empty_like(top)  # each row's softmax weight per tile
    rows_total = b * h * n_rows
    if rows_total and nk:
        _normalize_kernel[(triton.cdiv(rows_total, 16),)](top, total, mass, rows_total, nk, BLOCK_ROWS=16,
                                                          BLOCK_K=min(256, next_pow2(nk)), num_warps=4)
    return mass.reshape(b, h, *rows.shape, nk)


@triton.jit
def _row_shares_kernel(Mass, Tiles, Kept, Total, n_rows, R, NQ, H, n_key_tiles, stb, sth, stq, stk,
                       BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's mass summed over the key tiles its query tile visits, and over all: one read of the
    row. Row ``i`` of ``Mass`` (contiguous (B, H, nq, r, nk)) belongs to query tile ``i // R``."""
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = i < n_rows
    g = i // R  # (b·H + h)·nq + query tile
    qt = g % NQ
    bh = g // NQ
    tbase = (bh // H).to(tl.int64) * stb + (bh % H).to(tl.int64) * sth + qt.to(tl.int64) * stq
    c0 = tl.arange(0, BLOCK_K)
    kept = tl.zeros((BLOCK_ROWS,), tl.float32)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    for j in range(0, n_key_tiles, BLOCK_K):
        c = j + c0
        m_ok = ok[:, None] & (c[None, :] < n_key_tiles)
        mass = tl.load(Mass + i.to(tl.int64)[:, None] * n_key_tiles + c[None, :], mask=m_ok, other=0.0)
        visit = tl.load(Tiles + tbase[:, None] + c[None, :].to(tl.int64) * stk, mask=m_ok, other=0)
        kept += tl.sum(tl.where(visit != 0, mass, 0.0), axis=1)
        total += tl.sum(mass, axis=1)
    tl.store(Kept + i, kept, mask=ok)
    tl.store(Total + i, total, mask=ok)


def row_shares(mass: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp4video.sparse.check.row_shares` in one kernel launch (the same contract; the sums run
    in another order). Runs the reference for tensors neither on CUDA nor under ``TRITON_INTERPRET=1``
    and for a ``mass`` that is not contiguous fp32."""
    if (mass.dim() != 5 or mass.dtype != torch.float32 or not mass.is_contiguous() or tiles.dtype != torch.bool
            or not (mass.is_cuda or (interpreting() and mass.device.type == "cpu")) or tiles.device != mass.device):
        return reference_row_shares(mass, tiles)
    b, h, nq, r, nk = mass.shape
    t = tiles.expand(b, h, nq, nk).view(torch.uint8)  # broadcast dims keep stride 0
    kept = torch.empty(b, h, nq, r, device=mass.device, dtype=torch.float32)
    total = torch.empty_like(kept)
    n_rows = kept.numel()
    if n_rows and nk:
        _row_shares_kernel[(triton.cdiv(n_rows, 16),)](mass, t, kept, total, n_rows, r, nq, h, nk, *t.stride(),
                                                      BLOCK_ROWS=16, BLOCK_K=min(256, next_pow2(nk)), num_warps=4)
    else:
        kept.zero_()
        total.zero_()
    return kept, total
