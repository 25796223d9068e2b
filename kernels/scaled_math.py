"""The Triton math the dot_scaled loops share (:mod:`.loop_scaled_sm100`, :mod:`.loop_scaled_sm120`,
:mod:`.loop_scaled_pointer`): P of one tile of logits quantized to MXFP4, NVFP4 or E4M3 with the
online softmax's running statistics, P's E2M1 packing, the block scales read by pointers, and a
program's end (its output and LSE). Each variant loads its Q̂ rows itself: behind a helper those
loads' constants reach the kernel in another order, and ptxas assigns the registers differently.

A launch's constexprs reach these helpers as one :class:`Config`, built in each kernel from its
arguments; its formats are the named codes of :mod:`.fp4_math` (``FMT_MXFP4``, ``FMT_NVFP4``,
``FMT_E4M3``).

On sm_100+ (``HW_E2M1``) P is rounded to E2M1 and packed by the hardware conversion
(``cvt.rn.satfinite.e2m1x2.f32``: round to nearest even, saturating at 6, the reference's rounding),
and PNQ's row sum reads the rounded values back by the reverse conversion (``cvt.rn.f16x2.e2m1x2``):
one conversion for each pair of elements, in place of the magic-number rounding, the code extraction
and the nibble packing. Elsewhere, the interpreter included, the fp32 rounding runs
(:func:`packed_p`; its equality with the reference's rounding and packing is tested exhaustively).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from .fp4_math import (FMT_E4M3, FMT_MXFP4, FMT_NVFP4, e2m1_block_sums_lut, e2m1_magnitude_codes, e2m1_pack_hw,
                       e2m1_pair_sums_hw, e4m3_bits, e4m3_p_shift, fma_lanes, mul_f32x2, mx_block_exponent,
                       pack_nibbles, pow2, round_e2m1_at_scale, round_e4m3_signed, sub_lanes)
from .loop_e4m3 import TILE_EXP_FLOOR
from .loop_nvfp4 import block_scale_and_reciprocal, two_level_factors
from .tiles import scaled_masked, store_out_lse

__all__ = ["EXP_FLOOR", "FMT_E4M3", "FMT_MXFP4", "FMT_NVFP4", "INTERPRETED", "Config", "as_scales", "block_exp2",
           "block_sums", "code_block_sums", "e4m3_p", "exponent_scale", "fp4_p", "key_scales",
           "masked_logits", "mx_p", "nv_p", "packed_p", "store_result", "value_scales"]


class Config(NamedTuple):
    """What a launch fixes for its whole loop (every field a constexpr): the method's formats and
    rules, the tile shapes, the key-padding mask, and the instructions the target has.

    ``QK``: Q̂·K̂ᵀ's format, ``FMT_MXFP4`` (scales in their own tensors, E8M0) or ``FMT_NVFP4``
    (each row of codes followed by its E4M3 scale bytes); ``PV``: P̂·V̂'s, the same FP4 format or
    ``FMT_E4M3`` (the FP8-P·V methods: P̂ and V̂ᵀ in E4M3 on the FP8 MMA). ``OCP``, ``QMAX``: the
    MXFP4 scale rule; ``PNQ``: the row sum of the quantized P̂; ``TWO_LEVEL``, ``P_RANGE``: NVFP4's
    two-level P. ``FAST_RCP`` (sm_80+), ``HW_E4M3`` (sm_89+), ``HW_E2M1`` (sm_100+), ``F32X2``
    (sm_10x / sm_11x: two-lane fp32 arithmetic): the target's instructions. ``D``: the head dim,
    ``QB``: the Q̂·K̂ᵀ block, ``BLOCK_DV``: the padded value head dim. ``EXACT``: the exponents'
    exact form; False runs two-level NVFP4 P's fused form (:func:`nv_p`, :func:`masked_logits`),
    which the dispatch picks only where every logit lies within :data:`.loop_e4m3.FAST_LOGIT_BOUND`
    nats."""

    HAS_MASK: tl.constexpr
    QK: tl.constexpr
    PV: tl.constexpr
    OCP: tl.constexpr
    QMAX: tl.constexpr
    PNQ: tl.constexpr
    TWO_LEVEL: tl.constexpr
    P_RANGE: tl.constexpr
    FAST_RCP: tl.constexpr
    HW_E4M3: tl.constexpr
    HW_E2M1: tl.constexpr
    F32X2: tl.constexpr
    D: tl.constexpr
    QB: tl.constexpr
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_DV: tl.constexpr
    EXACT: tl.constexpr


@triton.jit
def packed_p(x, HW_E2M1: tl.constexpr):
    """P in units of its block scales (``x``: (BLOCK_M, BLOCK_N) fp32 >= 0) as packed E2M1 codes
    (BLOCK_M, BLOCK_N // 2), and, for PNQ, the rounded values' sums of consecutive pairs
    (BLOCK_M, BLOCK_N // 2) fp16 (exact: at most 12, in halves). HW_E2M1 (sm_100+): Blackwell's conversions
    (:func:`.fp4_math.e2m1_pack_hw`, :func:`.fp4_math.e2m1_pair_sums_hw`); else the rounding of
    :func:`.fp4_math.round_e2m1_at_scale` at unit 1 (the same: ties to even, saturating at 6)."""
    BLOCK_M: tl.constexpr = x.shape[0]
    BLOCK_N: tl.constexpr = x.shape[1]
    if HW_E2M1:
        lo, hi = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        packed = e2m1_pack_hw(lo, hi)
        pairs = e2m1_pair_sums_hw(packed)
    else:
        q = round_e2m1_at_scale(x, 1.0)  # grid values 0 … 6
        packed = pack_nibbles(e2m1_magnitude_codes(q), BLOCK_M, BLOCK_N)
        q_lo, q_hi = tl.split(tl.reshape(q, (BLOCK_M, BLOCK_N // 2, 2)))
        pairs = (q_lo + q_hi).to(tl.float16)  # exact (at most 12, in halves)
    return packed, pairs


@triton.jit
def code_block_sums(packed, pairs, NB: tl.constexpr, QB: tl.constexpr, WS: tl.constexpr, F32X2: tl.constexpr):
    """Per-block sums (BLOCK_M, NB) fp32 of P's rounded values in units of their block scales, from
    :func:`packed_p`'s outputs. In datacenter Blackwell's warp-specialized loop (F32X2 and WS) from
    the codes by :func:`.fp4_math.e2m1_block_sums_lut` (P's codes have no sign bit: each four codes'
    doubled magnitudes by one table look-up, added as integers), whose blocks must be whole in a
    thread — what that loop's S tile layout gives (tests/test_offline_compile.py reads it off the
    compiled loop); else :func:`block_sums` of the pair sums (WS: in fp16). The same values: every
    sum is exact."""
    if F32X2 and WS:
        return e2m1_block_sums_lut(packed, QB)
    return block_sums(pairs, NB, WS)


@triton.jit
def block_sums(pairs, NB: tl.constexpr, F16: tl.constexpr = False):
    """Per-block sums (BLOCK_M, NB) fp32 of :func:`packed_p`'s pair sums (exact: at most 6 a key, in
    halves: 192 for a block of 32; F16: added in fp16, exact as well, and converted once a block)."""
    if F16:
        return tl.sum(tl.reshape(pairs, (pairs.shape[0], NB, pairs.shape[1] // NB)), axis=2,
                      dtype=tl.float16).to(tl.float32)
    return tl.sum(tl.reshape(pairs.to(tl.float32), (pairs.shape[0], NB, pairs.shape[1] // NB)), axis=2)


@triton.jit
def _probe():
    """A kernel that does nothing: what ``triton.jit`` turned it into tells :data:`INTERPRETED`."""


#: whether these kernels run in Triton's CPU interpreter, as ``triton.jit`` decides it when they
#: are defined (an ``InterpretedFunction`` there, on every Triton from the declared 3.2 floor)
INTERPRETED = tl.constexpr(isinstance(_probe, InterpretedFunction))


@triton.jit
def block_exp2(x):
    """exp2 of a per-block tensor (BLOCK_M, NB) — the block maxima of P̃ from the blocks' largest
    logits — by libdevice's exp2: the same instruction as ``tl.exp2`` (``ex2.approx.ftz.f32``), but
    an op Triton's warp-specialization partitioner (sm_100) leaves in the softmax partition. A
    ``tl.exp2`` of this size it moves, with everything it depends on, into the default partition,
    which then draws the tile's logits there (a small partition that spills them and hands them on
    through shared memory); split in pieces, one piece still goes (``tests/test_offline_compile.py``
    checks that no partition spills). Interpreted (no libdevice there): ``tl.exp2``."""
    if INTERPRETED:
        return tl.exp2(x)
    return libdevice.exp2(x)


@triton.jit
def masked_logits(qk, scale_log2, M_base, keys, SK, sms, C, TAIL: tl.constexpr):
    """One tile's Q̂·K̂ᵀ products ``qk`` as P's quantization (:func:`fp4_p`, :func:`e4m3_p`) takes
    them, dead keys (``keys``, the key of each column, not alive in the key-padding mask, or at or
    past SK: :func:`.tiles.scaled_masked`) selected to -inf: in log2 units (times ``scale_log2``,
    rounded once, then masked), or, where the exponents are fused, the raw products masked
    (:func:`nv_p` scales them in its exponents). The fused form is two-level NVFP4 P's (``sage3``,
    ``sage3-hpnq``) where the launch is not EXACT; MXFP4 P keeps the exact form (under the OCP rule
    a residual that leaves the row's largest P̃ at 1 - 2^-24 moves its block one scale down), and
    so do single-level NVFP4 P (:func:`nv_p` says why) and FP8 P. On datacenter Blackwell the
    product runs two lanes an instruction, except in the FP8-P·V form, where it spills."""
    if C.QK == FMT_NVFP4 and C.PV != FMT_E4M3 and C.TWO_LEVEL and not C.EXACT:
        return scaled_masked(qk, 1.0, M_base, keys, SK, sms, C.HAS_MASK, TAIL)
    return scaled_masked(qk, scale_log2, M_base, keys, SK, sms, C.HAS_MASK, TAIL, C.F32X2 and C.PV != FMT_E4M3)


@triton.jit
def exponent_scale(scale_log2):
    """The fused exponents' factor: ``scale_log2`` held at or above fp32's smallest normal, so that
    a masked product (-inf) stays -inf when the factor underflows (heads of zeros or ~1e-30, whose
    tensor scales multiply to below fp32's range; live products then stay ~0, as they are)."""
    return tl.maximum(scale_log2, 1.1754943508222875e-38)


@triton.jit
def mx_p(qk, m_i, l_i, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr, QB: tl.constexpr,
         HW_E2M1: tl.constexpr, WS: tl.constexpr = False, F32X2: tl.constexpr = False):
    """MXFP4 P of one tile of logits ``qk`` in log2 units (scaled, then masked keys selected to -inf:
    :func:`.tiles.scaled_masked`): (packed codes, E8M0 scale bytes, m_new, l_new, alpha). The block
    holding the row maximum gets exactly exp2(0) = 1. Each element is computed in units of its block
    scale, exp2((qk - m) - e): the difference with the row maximum first (exact near it), then the
    block exponent, so neither is lost at any logit magnitude (one fused qk · scale - (m + e) keeps
    the product's rounding residual and drops e from m + e once |m| reaches 2^24: rows of zeros
    past 1e7 nats). WS (the warp-specialized loop's arithmetic):
    PNQ's block sums added in fp16 (exact: at most 192, in halves), converted once a block (shorter
    on sm_100; sm_120's loop, which it lengthens, keeps fp32). F32X2 (datacenter Blackwell): the exp2
    arguments two lanes an instruction, and in the warp-specialized loop PNQ's block sums from the
    codes (:func:`code_block_sums`); the same values. The blocks are QB consecutive columns of
    ``qk``: in the quad key order (:func:`.key_order.quad_key_order`) a block of 32 columns holds
    the same 32 keys as in key order."""
    BLOCK_M: tl.constexpr = qk.shape[0]
    BLOCK_N: tl.constexpr = qk.shape[1]
    NB: tl.constexpr = BLOCK_N // QB
    block_max = tl.max(tl.reshape(qk, (BLOCK_M, NB, QB)), axis=2)
    m_new = tl.maximum(m_i, tl.max(block_max, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    amax = block_exp2(block_max - m_safe[:, None])  # the block maximum of P̃ (exp2 is monotonic)
    e_blk = tl.where(amax > 0, tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126), 0)
    # in units of the block scale (no P̃ exceeds 8 units: the block's maximum is at most QMAX of them)
    d3 = sub_lanes(tl.reshape(qk, (BLOCK_M, NB, QB)), m_safe[:, None, None], F32X2)  # qk - m, exact near m
    x3 = tl.exp2(sub_lanes(d3, e_blk.to(tl.float32)[:, :, None], F32X2))
    packed, pairs = packed_p(tl.reshape(x3, (BLOCK_M, BLOCK_N)), HW_E2M1)
    alpha = tl.exp2(m_i - m_safe)
    if PNQ:
        l_new = tl.fma(alpha, l_i, tl.sum(code_block_sums(packed, pairs, NB, QB, WS, F32X2) * pow2(e_blk), axis=1))
    else:
        l_new = tl.fma(alpha, l_i, tl.sum(tl.sum(x3, axis=2) * pow2(e_blk), axis=1))
    return packed, (e_blk + 127).to(tl.uint8), m_new, l_new, alpha


@triton.jit
def nv_p(qk, m_i, r_i, l_i, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr,
         FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr, QB: tl.constexpr, HW_E2M1: tl.constexpr,
         QUAD: tl.constexpr = False, WS: tl.constexpr = False, F32X2: tl.constexpr = False, scale_log2=1.0,
         EXACT: tl.constexpr = True):
    """NVFP4 P of one tile of logits (masked keys selected to -inf: :func:`masked_logits`), blocks of
    QB consecutive keys: (packed codes, E4M3 scale bytes, m_new, r_new, l_new, acc_scale), with
    :func:`.loop_nvfp4.nv_quantize_p`'s arithmetic step for step (its lane layout aside): P̂ is in
    units of r_new, the accumulator is rescaled by acc_scale. Two forms of the exponents (m is in
    log2 units in both):

    - EXACT: ``qk`` holds the logits in log2 units, and every exponent is the exact difference
      ``qk - m`` (exact near the row maximum: the row's largest P̃ is exactly 1 at any magnitude).
    - fused (TWO_LEVEL only; where :func:`masked_logits` says): ``qk`` holds the raw products,
      every exponent is one ``fma(qk, scale_log2, -m)`` (two lanes an instruction where F32X2), and
      m is the rounded product of the largest one. Each P̃ then carries exp2 of m's rounding
      residual, one factor for the whole row (at most half an ulp of m: under 2^-7 of a binade
      within :data:`.loop_e4m3.FAST_LOGIT_BOUND`, where |m| < 2^18; it grows with |m|, to half a
      binade at 1e7 nats, so the dispatch runs the exact form past the bound), and no element's
      own product is rounded. The two-level row factor is the tile's largest P̃ by the same FMA,
      so P̂ (quantized relative to it) and the row sum carry that factor alike and it cancels in
      out = acc / l; the LSE moves by at most the residual. Without two-level P (``nvfp4``) the
      block scales' rounding absorbs the factor where the unquantized row sum keeps it, so that
      method keeps the exact form.

    QUAD (QB = 16; the S tile of :mod:`.loop_scaled_sm120`): the columns in
    :func:`.key_order.quad_key_order` (column 8j + 2t + e of each 32 holds key 8t + 2j + e, so a
    block of 16 keys is the columns of one t // 2, and a lane holds half a block); the codes come
    out in that order too. F32X2 (datacenter Blackwell): the exp2 arguments and P̃'s scaling by
    the block reciprocals two lanes an instruction, PNQ's block sums as :func:`mx_p`'s (the same
    values). WS (the warp-specialized loop's arithmetic): PNQ's block sums added in fp16 (exact: at
    most 96, in halves), converted once a block. The block maxima's exp2 is :func:`block_exp2`'s
    (Triton's partitioner keeps it with the softmax; taking each block's maximum over its P̃
    elements instead costs more). PNQ
    with TWO_LEVEL (``sage3-hpnq``): ``l`` is kept in units of r, as the accumulator, and rescaled
    by the same acc_scale (the caller's LSE adds log2 r; out = acc / l, the factor's rounding
    cancels): a row sum multiplied by r_new would tie the tile's E2M1 packing to the two-level
    factors, which Triton's partitioner computes in the correction partition, and send the scaled
    P̃ there through shared memory."""
    BLOCK_M: tl.constexpr = qk.shape[0]
    BLOCK_N: tl.constexpr = qk.shape[1]
    NB: tl.constexpr = BLOCK_N // QB
    if QUAD:  # (row, group, j, t // 2, t % 2, e)
        tl.static_assert(QB == 16, "the quad key order's blocks of 16")
        s3 = tl.reshape(qk, (BLOCK_M, BLOCK_N // 32, 4, 2, 2, 2))
        bmax = tl.reshape(tl.max(tl.max(tl.max(s3, axis=5), axis=4), axis=2), (BLOCK_M, NB))
    else:
        s3 = tl.reshape(qk, (BLOCK_M, NB, QB))
        bmax = tl.max(s3, axis=2)
    tile_max = tl.max(bmax, axis=1)
    if EXACT:
        m_new = tl.maximum(m_i, tile_max)
    else:  # the tile's largest logit, its product rounded once (monotonic: the largest product's)
        m_new = tl.maximum(m_i, tile_max * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if EXACT:
        if QUAD:
            p = tl.exp2(s3 - m_safe[:, None, None, None, None, None])
        else:
            p = tl.exp2(sub_lanes(s3, m_safe[:, None, None], F32X2))  # qk - m (exact near m)
        # the block maxima of P̃ by the exp2 of the blocks' largest logits: one exp2 a block, no
        # reduction of P̃ (the reference takes the largest of the block's P̃: the same value, exp2 and
        # the subtraction being monotonic)
        amax = block_exp2(bmax - m_safe[:, None])
        top = tl.exp2(tile_max - m_safe)  # the tile's largest P̃ (the same value again)
    else:  # the same, each exponent one FMA (monotonic as well: amax is the block's largest P̃)
        if QUAD:
            p = tl.exp2(tl.fma(s3, scale_log2, -m_safe[:, None, None, None, None, None]))
        else:
            p = tl.exp2(fma_lanes(s3, scale_log2, -m_safe[:, None, None], F32X2))
        amax = block_exp2(tl.fma(bmax, scale_log2, -m_safe[:, None]))
        top = tl.exp2(tl.fma(tile_max, scale_log2, -m_safe))
    if TWO_LEVEL:
        inv_s1, r_new, acc_ratio = two_level_factors(top, r_i, P_RANGE, FAST_RCP)
        amax = amax * inv_s1[:, None]
    else:
        r_new = r_i
        acc_ratio = 1.0
    scale, inv = block_scale_and_reciprocal(amax, FAST_RCP, HW_E4M3)
    if TWO_LEVEL:
        inv = inv * inv_s1[:, None]
    if QUAD:
        x = p * tl.reshape(inv, (BLOCK_M, BLOCK_N // 32, 2))[:, :, None, :, None, None]
    elif F32X2:
        x = mul_f32x2(p, tl.broadcast_to(inv[:, :, None], p.shape))
    else:
        x = p * inv[:, :, None]
    packed, pairs = packed_p(tl.reshape(x, (BLOCK_M, BLOCK_N)), HW_E2M1)
    alpha = tl.exp2(m_i - m_safe)
    if PNQ and QUAD:  # pair 4j + t of each 32 keys: the block of t // 2. Within the lane first (j), scaled
        # by the block's scale, summed over the lane's blocks, and only then across the lanes (t % 2):
        # a shuffle a row, not one a block
        # (row, group, t // 2, t % 2); the lane's four pair sums added in fp16 (exact: at most 48, in halves)
        lane = tl.sum(tl.reshape(pairs, (BLOCK_M, BLOCK_N // 32, 4, 2, 2)), axis=2, dtype=tl.float16).to(tl.float32)
        lane = lane * tl.reshape(scale, (BLOCK_M, BLOCK_N // 32, 2))[:, :, :, None]
        part = tl.sum(tl.sum(tl.sum(lane, axis=1), axis=1), axis=1)
    elif PNQ:  # the row sum of P̂ = q · scale (· r_new)
        part = tl.sum(code_block_sums(packed, pairs, NB, QB, WS, F32X2) * scale, axis=1)
    else:  # the row at once: across the lanes once a row, not once a block
        part = tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_N)), axis=1)
    if PNQ and TWO_LEVEL:  # l in units of r, as the accumulator (rescaled alike; the caller's LSE adds log2 r)
        l_new = tl.fma(alpha * acc_ratio, l_i, part)
    else:
        l_new = tl.fma(alpha, l_i, part)
    return packed, e4m3_bits(scale), m_new, r_new, l_new, alpha * acc_ratio


#: the e4m3 loop's floor of a tile's shift exponent, as a constant the jit functions may read
EXP_FLOOR = tl.constexpr(TILE_EXP_FLOOR)


@triton.jit
def e4m3_p(qk, m_i, k_i, l_i, PNQ: tl.constexpr, HW_E4M3: tl.constexpr, F32X2: tl.constexpr = False):
    """FP8 P of one tile of logits ``qk`` in log2 units (scaled, then masked keys selected to -inf)
    for the FP8-P·V methods, the e4m3 loop's rule (:func:`.loop_e4m3.quantize_p` with ``P_E4M3``): one
    power-of-two scale per row and tile, k = 7 - ⌊log2 (the tile's largest P̃)⌋, P̂ = P̃ · 2^k rounded
    to E4M3 once; each element's exponent (qk - m) + k, as there.
    Returns (P̂ e4m3, m_new, k_new, l_new, alpha); ``acc`` and ``l`` are kept in units of 2^k."""
    tile_max = tl.max(qk, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    top = tl.exp2(tile_max - m_safe)
    k_new = e4m3_p_shift(top, EXP_FLOOR)
    d = sub_lanes(qk, m_safe[:, None], F32X2)  # qk - m, exact near m
    p = tl.exp2(sub_lanes(d, -k_new.to(tl.float32)[:, None], F32X2))  # P̃ · 2^k_new < 256
    p8 = round_e4m3_signed(p, HW_E4M3)
    if PNQ:  # the sum of the rounded values
        part = tl.sum(p8.to(tl.float32), axis=1)
    else:
        part = tl.sum(p, axis=1)
    alpha = tl.exp2(m_i - m_safe + (k_new - k_i).to(tl.float32))
    return p8, m_new, k_new, tl.fma(alpha, l_i, part), alpha


@triton.jit
def fp4_p(qk, m_i, r_i, l_i, scale_log2, C, WS: tl.constexpr, QUAD: tl.constexpr = False):
    """FP4 P of one tile of logits in P̂·V̂'s format (``C``: the launch's :class:`Config`; ``qk`` as
    :func:`masked_logits` gives them, ``scale_log2`` the launch's factor from products to log2 units):
    (packed codes, block scales as ``tl.dot_scaled`` takes them, m_new, r_new, l_new, acc_scale) by
    :func:`mx_p` (r unchanged) or :func:`nv_p`; WS, QUAD as there."""
    if C.QK == FMT_NVFP4:
        p4, p_sc, m_new, r_i, l_i, acc_scale = nv_p(qk, m_i, r_i, l_i, C.TWO_LEVEL, C.P_RANGE, C.PNQ, C.FAST_RCP,
                                                    C.HW_E4M3, C.QB, C.HW_E2M1, QUAD, WS, C.F32X2,
                                                    exponent_scale(scale_log2), C.EXACT or not C.TWO_LEVEL)
        p_sc = p_sc.to(tl.float8e4nv, bitcast=True)
    else:
        p4, p_sc, m_new, l_i, acc_scale = mx_p(qk, m_i, l_i, C.OCP, C.QMAX, C.PNQ, C.QB, C.HW_E2M1, WS, C.F32X2)
    return p4, p_sc, m_new, r_i, l_i, acc_scale


@triton.jit
def key_scales(KS_base, keys, nb_d, key_ok, sks, C):
    """The block scale bytes ``nb_d`` of K̂'s rows ``keys`` (BLOCK_N, D / QB) by pointer loads
    (rows not ``key_ok`` read as 0, MXFP4's as 2^0; :func:`as_scales` makes them
    ``tl.dot_scaled``'s operand): NVFP4's E4M3 bytes from the rows of stride ``sks`` (``KS_base``
    past the codes), MXFP4's from their own table of D / QB bytes a row."""
    if C.QK == FMT_NVFP4:
        k_sc = tl.load(KS_base + keys[:, None] * sks + nb_d[None, :], mask=key_ok[:, None], other=0)
    else:
        k_sc = tl.load(KS_base + keys[:, None] * (C.D // C.QB) + nb_d[None, :], mask=key_ok[:, None], other=127)
    return k_sc


@triton.jit
def as_scales(x, C):
    """Block scale bytes as ``tl.dot_scaled`` takes them: NVFP4's as E4M3 (scales that are E4M3
    already, from a tensor descriptor of them, stay as they are), MXFP4's E8M0 bytes as they are."""
    if C.QK == FMT_NVFP4:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x


@triton.jit
def value_scales(VS_base, dv, nb_n, svsd, C):
    """The block scales of V̂ᵀ's channels ``dv`` over one key tile's blocks ``nb_n`` by pointer
    loads (V̂ᵀ is padded to whole tiles: no mask), as ``tl.dot_scaled`` takes them."""
    v_sc = tl.load(VS_base + dv[:, None] * svsd + nb_n[None, :])
    if C.QK == FMT_NVFP4:
        v_sc = v_sc.to(tl.float8e4nv, bitcast=True)
    return v_sc


@triton.jit
def store_result(out_ptrs, acc, m_i, r_i, k_i, l_i, out_factor, VS, b, h, bh, offs_m, row_ok, DV, strides_o,
                 strides_lse, C):
    """A program's end: out and LSE (``out_ptrs``: (Out, Lse)) from the accumulator and the row
    statistics in the units the P form keeps them in — FP8 P·V: acc in units of V̂'s channel
    factors (``VS``, B·H·BLOCK_DV fp32) and, with l, of 2^k (``k_i``; unread in FP4 P·V); NVFP4 with
    PNQ and two-level P: acc and l in units of r (:func:`nv_p`: out = acc / l, the LSE adds log2 r);
    else acc in units of r and of ``out_factor`` (V's tensor scale, or 1)."""
    Out, Lse = out_ptrs
    sob, soh, sos, sod = strides_o
    slb, slh, sls = strides_lse
    if C.PV == FMT_E4M3:  # acc in units of V̂'s channel factors and of 2^k
        v_fac = tl.load(VS + bh * C.BLOCK_DV + tl.arange(0, C.BLOCK_DV))
        store_out_lse(Out, Lse, acc, v_fac[None, :], l_i, m_i, k_i.to(tl.float32), b, h, offs_m, row_ok,
                      tl.arange(0, C.BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)
    elif C.QK == FMT_NVFP4 and C.PNQ and C.TWO_LEVEL:  # acc and l in units of r: out = acc / l, the LSE adds log2 r
        store_out_lse(Out, Lse, acc, out_factor, l_i, m_i, -tl.log2(r_i), b, h, offs_m, row_ok,
                      tl.arange(0, C.BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)
    else:
        store_out_lse(Out, Lse, acc, r_i[:, None] * out_factor, l_i, m_i, 0.0, b, h, offs_m, row_ok,
                      tl.arange(0, C.BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)
