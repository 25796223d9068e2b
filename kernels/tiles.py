"""What every attention loop shares: the program's rows, one key tile's logits, the common end
(output and LSE stores), and the host helpers their launchers use."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp4video.rotation import next_power_of_two

from .fp4_math import mul_f32x2
from .key_order import mma_key_order

LOG2E = 1.4426950408889634
#: the largest finite bfloat16, (2 - 2^-7) · 2^127
BF16_MAX = tl.constexpr(3.3895313892515355e38)


def next_pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= n, at least ``floor`` (the loops' padded head dims)."""
    return max(floor, next_power_of_two(n))


def work_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the bf16 loops compute in: FP4 values are exact in bf16; the CPU interpreter has
    no bf16 matmul, so fp32 there."""
    return torch.bfloat16 if q.is_cuda else torch.float32


def key_mask(key_alive, device) -> torch.Tensor:
    """``key_alive`` (B, Sk) as the int8 rows the loops read, or a 1 × 1 dummy when there is none."""
    if key_alive is not None:
        return key_alive.to(torch.int8).contiguous()
    return torch.empty(1, 1, dtype=torch.int8, device=device)


def outputs(q_shape, dv: int, device, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Sq, Dv) in ``out_dtype``, lse (B, H, Sq) fp32), uninitialized."""
    b, h, sq = q_shape[:3]
    return (torch.empty(b, h, sq, dv, device=device, dtype=out_dtype),
            torch.empty(b, h, sq, device=device, dtype=torch.float32))


def sparse_rows(lists, block_m: int, given: bool) -> int:
    """The rows per program of a launch: ``block_m``, or for a block-sparse call (``lists``:
    :class:`.operands.KeyTileLists`, None for a dense one) whose query tile
    it does not divide, the largest count that does (a program's rows lie in one query tile; at
    least 16, a dot's smallest). ValueError where none does or the caller gave ``block_m``."""
    if lists is None or lists.query_tile % block_m == 0:
        return block_m
    rows = math.gcd(block_m, lists.query_tile)
    if given or rows < 16:
        raise ValueError(f"a block-sparse selection's query tile ({lists.query_tile} rows) must be a multiple of the "
                         f"loop's {block_m} rows per program" + ("" if given else " or of 16"))
    return rows


@triton.jit
def round_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even; NaN stays NaN), as fp32: the bits
    themselves, so the CPU interpreter (whose cast truncates) rounds as the GPU does."""
    bits = x.to(tl.uint32, bitcast=True)
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, up.to(tl.float32, bitcast=True))


@triton.jit
def visited_tiles(KIdx, KCnt, NQT, NKT, SK, QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A block-sparse program's key tiles (:class:`.operands.KeyTileLists`): (its list's pointer,
    how many whole tiles it visits first, the first key of the partial last tile if it visits it,
    else -1). Its list is ascending, so the partial tile (keys past SK) can only come last."""
    row = tl.program_id(1) * NQT + (tl.program_id(0) * BLOCK_M) // QT
    n = tl.load(KCnt + row)
    visits = KIdx + row.to(tl.int64) * NKT
    last = tl.load(visits + tl.maximum(n - 1, 0)) * BLOCK_N
    partial = (n > 0) & (last + BLOCK_N > SK)
    return visits, n - partial.to(tl.int32), tl.where(partial, last, -1)


@triton.jit
def program_rows(H, SQ, BLOCK_M: tl.constexpr):
    """This program's batch, head, query rows and their in-range mask (every attention kernel's
    grid is (query blocks, B·H))."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return bh // H, bh % H, offs_m, offs_m < SQ


@triton.jit
def kv_bases(K, V, b, h, skb, skh, svb, svh, TMA: tl.constexpr):
    """The loops' K̂ and V̂ᵀ bases for head (b, h): the tensor descriptors themselves (TMA: a row
    offset picks the head) or the head's pointers."""
    if TMA:
        k_base = K
        v_base = V
    else:
        k_base = K + b * skb + h * skh
        v_base = V + b * svb + h * svh
    return k_base, v_base


@triton.jit
def tile_logits(q, scale, K_base, M_base, start, SK, sks, sms, HAS_MASK: tl.constexpr, TAIL: tl.constexpr,
                D: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr, IEEE: tl.constexpr = False,
                TILE_ORDERED: tl.constexpr = False, TMA: tl.constexpr = False, k_row=0):
    """The logits of one key tile in log2 units, Q̂·K̂ᵀ · ``scale`` (a scalar, or per row as
    ``(BLOCK_M, 1)``), rounded once, with its keys in :func:`.key_order.mma_key_order` (the e4m3 MXFP4 loop and
    the bf16 NVFP4 loop). Masked keys (the key-padding mask; keys past SK) are selected to -inf
    *after* the scaling (:func:`scaled_masked`). IEEE: fp32 operands multiplied exactly (the CPU
    interpreter's work dtype). TILE_ORDERED: K̂ is stored in that order already, padded to whole
    tiles: rows read as stored; TMA (with TILE_ORDERED): ``K_base`` is a tensor descriptor of K̂'s
    rows, this head's first at ``k_row``."""
    order = mma_key_order(tl.arange(0, BLOCK_N), BLOCK_N // QB, QB)
    keys = start + order
    if TMA:
        tl.static_assert(TILE_ORDERED, "TMA loads K̂ tiles as stored: in tile key order")
        k = K_base.load([k_row + start, 0])
    else:
        rows = tl.arange(0, BLOCK_N) if TILE_ORDERED else order
        # the tile's offsets are loop-invariant, plus one scalar per tile (fewer address instructions)
        ptrs = (K_base + start * sks) + (rows[:, None] * sks + tl.arange(0, D)[None, :])
        if TAIL and not TILE_ORDERED:
            k = tl.load(ptrs, mask=(keys < SK)[:, None], other=0.0)
        else:
            k = tl.load(ptrs)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    return scaled_masked(qk, scale, M_base, keys, SK, sms, HAS_MASK, TAIL)


@triton.jit
def scaled_masked(qk, scale, M_base, keys, SK, sms, HAS_MASK: tl.constexpr, TAIL: tl.constexpr,
                  F32X2: tl.constexpr = False):
    """Raw products ``qk`` (rows × keys) times ``scale`` (a scalar, or per row as ``(rows, 1)``), then the
    dead keys — ``keys`` (the key of each column) not alive in the key-padding mask (HAS_MASK), or
    at or past SK (TAIL) — selected to -inf. Every loop masks its logits this way, so no -inf is
    ever multiplied: a factor that underflows to 0 (all-zero or ~1e-30 heads, whose Q̂ / K̂ factors
    multiply to below fp32's range) makes the live logits 0, never a masked one NaN (-inf · 0).
    The products are rounded once, and the loops' exponentials are exp2 of the difference of such a
    rounded logit and the running maximum (itself one of them): exact near the maximum, so a row's
    largest logit gives exactly exp2(0) = 1 at any magnitude (a fused ``qk · scale - m`` keeps the
    product's rounding residual, up to half an ulp of m: 2^64 at logits of 1e9 nats)."""
    if F32X2:  # (datacenter Blackwell: two elements an instruction, the same values)
        t = mul_f32x2(qk, tl.broadcast_to(scale, qk.shape))
    else:
        t = qk * scale
    if HAS_MASK:
        km = tl.load(M_base + keys * sms, mask=keys < SK, other=0)
        t = tl.where((km != 0)[None, :], t, float("-inf"))
    elif TAIL:
        t = tl.where((keys < SK)[None, :], t, float("-inf"))
    return t


@triton.jit
def store_out_lse(Out, Lse, acc, factor, l_i, m_log2, shift, b, h, offs_m, row_ok, offs_dv, DV, sob, soh, sos, sod,
                  slb, slh, sls):
    """The loops' common end: out = acc · factor / l in Out's dtype (``factor`` broadcasts per row
    or per channel: the accumulator's units), LSE = (m + log2 l - shift) · ln 2 with m in log2
    units and l in units of 2^shift; rows without a live key get 0 and -inf. ``offs_m``/``offs_dv``:
    the rows and channels of ``acc`` (aranges in its layout, for the Gluon kernel)."""
    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    out = tl.where(live[:, None], acc * (factor / l_safe[:, None]), 0.0)
    # saturate at the output dtype's largest finite value: FP4 rounding may step past it (fp16 V at
    # 60,000 rounds to 65,536 under UOS), and a convex combination of the inputs never lies beyond it
    if Out.dtype.element_ty == tl.float16:
        out = tl.minimum(tl.maximum(out, -65504.0, tl.PropagateNan.ALL), 65504.0, tl.PropagateNan.ALL)
    elif Out.dtype.element_ty == tl.bfloat16:
        out = tl.minimum(tl.maximum(out, -BF16_MAX, tl.PropagateNan.ALL), BF16_MAX, tl.PropagateNan.ALL)
    lse = tl.where(live, (m_log2 + tl.log2(l_safe) - shift) * 0.6931471805599453, float("-inf"))
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sos + offs_dv[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b * slb + h * slh + offs_m * sls, lse, mask=row_ok)
