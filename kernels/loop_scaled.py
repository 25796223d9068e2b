"""FP4 attention through ``tl.dot_scaled``: packed E2M1 operands with E8M0 block scales (MXFP4)
or E4M3 block scales of 16 (NVFP4: ``nvfp4``, ``sage3``, ``sage3-hpnq``).

On Blackwell (sm_100 / sm_120) Triton lowers ``tl.dot_scaled(.., "e2m1", .., "e2m1")`` to the
native FP4 MMAs (``tcgen05.mma … kind::mxf4`` / ``mma.sync … kind::mxf4nvf4``; the tests
compile this kernel for those targets offline and check). Every MXFP4
block of the method maps onto the MMA's own scale blocks: Q and K blocks of 32 along the head
dim (the QKᵀ reduction), P blocks of 32 keys per row and V blocks of 32 tokens per channel (the
PV reduction). No e4m3 window applies: every block carries its own E8M0 scale.

NVFP4 (``kind::mxf4nvf4 … block16`` / ``scale_vec::4X … ue4m3``): Q, K blocks of 16 along the head
dim, P blocks of 16 keys, V blocks of 16 tokens, each with its E4M3 scale; the heads' power-of-two
tensor scales multiply the logits' and the output's units. P is quantized with the arithmetic of
the bf16 NVFP4 loop (:func:`.loop_nvfp4.nv_quantize_p`: the same block scales, two-level row
factors and reciprocals, so the same codes), in natural key order: a block is 16 consecutive
columns, as the MMA's scale blocks are.

On sm_100+ (``HW_E2M1``) P is rounded to E2M1 and packed by the hardware conversion
(``cvt.rn.satfinite.e2m1x2.f32``: round to nearest even, saturating at 6, the reference's rounding),
and PNQ's row sum reads the rounded values back by the reverse conversion (``cvt.rn.f16x2.e2m1x2``):
one conversion for each pair of elements, in place of the magic-number rounding, the code extraction
and the nibble packing. Elsewhere, the interpreter included, the fp32 rounding runs
(:func:`_packed_p`; its equality with the reference's rounding and packing is tested exhaustively).

On Hopper and older, Triton emulates ``dot_scaled`` (operands upcast to bf16), so the e4m3 kernel
of :mod:`.loop_e4m3` and the NVFP4 loops are the fast paths there; this one still runs and matches
the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

import torch

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, PScale, RowSum
from fp4video.reference import KEY_TILE, TWO_LEVEL_P_RANGE

from .fp4_math import (e2m1_block_sums_hw, e2m1_magnitude_codes, e2m1_pack_hw, e2m1_pair_sums_hw, e4m3_bits, e4m3_p_shift,
                       mul_f32x2, sub_lanes, mx_block_exponent, pack_nibbles, pow2, round_e2m1_at_scale,
                       round_e4m3_signed)
from .key_order import quad_key_order
from .launch import LoopLaunch
from .operands import PackedOperands
from .plan import WS_MAJORS, Plan, pointer_loop_reason
from .loop_e4m3 import TILE_EXP_FLOOR
from .loop_nvfp4 import block_scale_and_reciprocal, two_level_factors
from .tiles import LOG2E, key_mask, kv_bases, outputs, program_rows, scaled_masked, store_out_lse


@triton.jit
def _packed_p(x, HW_E2M1: tl.constexpr):
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
def _code_block_sums(packed, pairs, NB: tl.constexpr, QB: tl.constexpr, WS: tl.constexpr, F32X2: tl.constexpr):
    """Per-block sums (BLOCK_M, NB) fp32 of P's rounded values in units of their block scales, from
    :func:`_packed_p`'s outputs. In datacenter Blackwell's warp-specialized loop (F32X2 and WS) from
    the codes by :func:`.fp4_math.e2m1_block_sums_hw` (each byte converted back to an f16 pair, the
    pairs added two lanes an instruction), whose blocks must be whole in a thread — what that loop's S tile
    layout gives (tests/test_offline_compile.py reads it off the compiled loop); else
    :func:`_block_sums` of the pair sums (WS: in fp16). The same values: every sum is exact."""
    if F32X2 and WS:
        return e2m1_block_sums_hw(packed, QB)
    return _block_sums(pairs, NB, WS)


@triton.jit
def _codes_in_key_order(p4):
    """Packed P codes of an S tile whose K̂ rows are in :func:`.key_order.quad_key_order` (byte
    4j + t of each 32 keys holds keys 8t + 2j, 8t + 2j + 1), relabelled into key order (byte 4t + j):
    the digits j (a register) and t (a lane) swap places in the index, no data moves, and each lane
    holds the 4 consecutive bytes the FP4 MMA's A operand takes from it."""
    x = tl.reshape(p4, (p4.shape[0], p4.shape[1] // 16, 4, 4))  # byte digits (group, j, t)
    return tl.reshape(tl.permute(x, (0, 1, 3, 2)), (p4.shape[0], p4.shape[1]))


@triton.jit
def _block_sums(pairs, NB: tl.constexpr, F16: tl.constexpr = False):
    """Per-block sums (BLOCK_M, NB) fp32 of :func:`_packed_p`'s pair sums (exact: at most 6 a key, in
    halves: 192 for a block of 32; F16: added in fp16, exact as well, and converted once a block)."""
    if F16:
        return tl.sum(tl.reshape(pairs, (pairs.shape[0], NB, pairs.shape[1] // NB)), axis=2,
                      dtype=tl.float16).to(tl.float32)
    return tl.sum(tl.reshape(pairs.to(tl.float32), (pairs.shape[0], NB, pairs.shape[1] // NB)), axis=2)


@triton.jit
def _probe():
    """A kernel that does nothing: what ``triton.jit`` turned it into tells :data:`_INTERPRETED`."""
    pass


#: whether this module's kernels run in Triton's CPU interpreter, as ``triton.jit`` decides it when
#: they are defined (an ``InterpretedFunction`` there, on every Triton from the declared 3.2 floor)
_INTERPRETED = tl.constexpr(isinstance(_probe, InterpretedFunction))


@triton.jit
def _block_exp2(x):
    """exp2 of a per-block tensor (BLOCK_M, NB) — the block maxima of P̃ from the blocks' largest
    logits — by libdevice's exp2: the same instruction as ``tl.exp2`` (``ex2.approx.ftz.f32``), but
    an op Triton's warp-specialization partitioner (Triton 3.9, sm_100) leaves in the softmax
    partition. A ``tl.exp2`` of this size it moves, with everything it depends on, into the default
    partition, which then draws the tile's logits there (a 24-register partition that spills them
    and hands them on through shared memory); split in pieces, one piece still goes
    (``tests/test_offline_compile.py`` checks that no partition spills). Interpreted (no
    libdevice there): ``tl.exp2``."""
    if _INTERPRETED:
        return tl.exp2(x)
    return libdevice.exp2(x)


@triton.jit
def _mx_p(qk, m_i, l_i, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr, QB: tl.constexpr,
          HW_E2M1: tl.constexpr, WS: tl.constexpr = False, F32X2: tl.constexpr = False):
    """MXFP4 P of one tile of logits ``qk`` in log2 units (scaled, then masked keys selected to -inf:
    :func:`.tiles.scaled_masked`): (packed codes, E8M0 scale bytes, m_new, l_new, alpha). The block
    holding the row maximum gets exactly exp2(0) = 1. Each element is computed in units of its block
    scale, exp2((qk - m) - e): the difference with the row maximum first (exact near it), then the
    block exponent, so neither is lost at any logit magnitude (one fused qk · scale - (m + e) keeps
    the product's rounding residual and drops e from m + e once |m| reaches 2^24: rows of zeros
    past 1e7 nats). WS (the warp-specialized loop):
    PNQ's block sums added in fp16 (exact: at most 192, in halves), converted once a block (shorter
    on sm_100; sm_120's loop, which it lengthens, keeps fp32). F32X2 (datacenter Blackwell): the exp2
    arguments two lanes an instruction, and in the warp-specialized loop PNQ's block sums from the
    codes (:func:`_code_block_sums`); the same values."""
    BLOCK_M: tl.constexpr = qk.shape[0]
    BLOCK_N: tl.constexpr = qk.shape[1]
    NB: tl.constexpr = BLOCK_N // QB
    block_max = tl.max(tl.reshape(qk, (BLOCK_M, NB, QB)), axis=2)
    m_new = tl.maximum(m_i, tl.max(block_max, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    amax = _block_exp2(block_max - m_safe[:, None])  # the block maximum of P̃ (exp2 is monotonic)
    e_blk = tl.where(amax > 0, tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126), 0)
    # in units of the block scale (no P̃ exceeds 8 units: the block's maximum is at most QMAX of them)
    d3 = sub_lanes(tl.reshape(qk, (BLOCK_M, NB, QB)), m_safe[:, None, None], F32X2)  # qk - m, exact near m
    x3 = tl.exp2(sub_lanes(d3, e_blk.to(tl.float32)[:, :, None], F32X2))
    packed, pairs = _packed_p(tl.reshape(x3, (BLOCK_M, BLOCK_N)), HW_E2M1)
    alpha = tl.exp2(m_i - m_safe)
    if PNQ:
        l_new = tl.fma(alpha, l_i, tl.sum(_code_block_sums(packed, pairs, NB, QB, WS, F32X2) * pow2(e_blk), axis=1))
    else:
        l_new = tl.fma(alpha, l_i, tl.sum(tl.sum(x3, axis=2) * pow2(e_blk), axis=1))
    return packed, (e_blk + 127).to(tl.uint8), m_new, l_new, alpha


@triton.jit
def _nv_p(qk, m_i, r_i, l_i, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr,
          FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr, QB: tl.constexpr, HW_E2M1: tl.constexpr,
          QUAD: tl.constexpr = False, WS: tl.constexpr = False, F32X2: tl.constexpr = False):
    """NVFP4 P of one tile of logits ``qk`` in log2 units (scaled, then masked keys selected to -inf:
    :func:`.tiles.scaled_masked`), blocks of QB consecutive keys: (packed codes, E4M3 scale bytes, m_new, r_new, l_new,
    acc_scale), with :func:`.loop_nvfp4.nv_quantize_p`'s arithmetic step for step (its lane layout
    aside): P̂ is in units of r_new, the accumulator is rescaled by acc_scale. QUAD (QB = 16): the
    columns in :func:`.key_order.quad_key_order` (column 8j + 2t + e of each 32 holds key 8t + 2j + e,
    so a block of 16 keys is the columns of one t // 2, and a lane holds half a block); the codes
    come out in that order too. F32X2 (datacenter Blackwell): the exp2 arguments and P̃'s scaling by
    the block reciprocals two lanes an instruction, PNQ's block sums as :func:`_mx_p`'s (the same
    values). WS (the warp-specialized loop): PNQ's block sums added in fp16
    (exact: at most 96, in halves), converted once a block. The
    block maxima's exp2 is :func:`_block_exp2`'s (Triton's partitioner keeps it with the softmax;
    taking each block's maximum over its P̃ elements instead costs more). PNQ with TWO_LEVEL
    (``sage3-hpnq``): ``l`` is kept in units of r, as the accumulator, and rescaled by the same
    acc_scale (the caller's LSE adds log2 r; out = acc / l, the factor's rounding cancels): a row
    sum multiplied by r_new would tie the tile's E2M1 packing to the two-level factors, which Triton's
    partitioner computes in the correction partition, and send the scaled P̃ there through shared
    memory."""
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
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if QUAD:
        p = tl.exp2(s3 - m_safe[:, None, None, None, None, None])
    else:
        p = tl.exp2(sub_lanes(s3, m_safe[:, None, None], F32X2))  # qk - m (exact near m)
    # the block maxima of P̃ by the exp2 of the blocks' largest logits: one exp2 a block, no
    # reduction of P̃ (the reference takes the largest of the block's P̃: the same value, exp2 and
    # the subtraction being monotonic)
    amax = _block_exp2(bmax - m_safe[:, None])
    if TWO_LEVEL:
        inv_s1, r_new, acc_ratio = two_level_factors(tl.exp2(tile_max - m_safe), r_i, P_RANGE, FAST_RCP)
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
    packed, pairs = _packed_p(tl.reshape(x, (BLOCK_M, BLOCK_N)), HW_E2M1)
    alpha = tl.exp2(m_i - m_safe)
    if PNQ and QUAD:  # pair 4j + t of each 32 keys: the block of t // 2. Within the lane first (j), scaled
        # by the block's scale, summed over the lane's blocks, and only then across the lanes (t % 2):
        # a shuffle a row, not one a block
        # (row, group, t // 2, t % 2); the lane's four pair sums added in fp16 (exact: at most 48, in halves)
        lane = tl.sum(tl.reshape(pairs, (BLOCK_M, BLOCK_N // 32, 4, 2, 2)), axis=2, dtype=tl.float16).to(tl.float32)
        lane = lane * tl.reshape(scale, (BLOCK_M, BLOCK_N // 32, 2))[:, :, :, None]
        part = tl.sum(tl.sum(tl.sum(lane, axis=1), axis=1), axis=1)
    elif PNQ:  # the row sum of P̂ = q · scale (· r_new)
        part = tl.sum(_code_block_sums(packed, pairs, NB, QB, WS, F32X2) * scale, axis=1)
    else:  # the row at once: across the lanes once a row, not once a block
        part = tl.sum(tl.reshape(p, (BLOCK_M, BLOCK_N)), axis=1)
    if PNQ and TWO_LEVEL:  # l in units of r, as the accumulator (rescaled alike; the caller's LSE adds log2 r)
        l_new = tl.fma(alpha * acc_ratio, l_i, part)
    else:
        l_new = tl.fma(alpha, l_i, part)
    return packed, e4m3_bits(scale), m_new, r_new, l_new, alpha * acc_ratio


#: the e4m3 loop's floor of a tile's shift exponent, as a constant the jit functions may read
_EXP_FLOOR = tl.constexpr(TILE_EXP_FLOOR)


@triton.jit
def _e4m3_p(qk, m_i, k_i, l_i, PNQ: tl.constexpr, HW_E4M3: tl.constexpr, F32X2: tl.constexpr = False):
    """FP8 P of one tile of logits ``qk`` in log2 units (scaled, then masked keys selected to -inf)
    for the FP8-P·V methods, the e4m3 loop's rule (:func:`.loop_e4m3.quantize_p` with ``P_E4M3``): one
    power-of-two scale per row and tile, k = 7 - ⌊log2 (the tile's largest P̃)⌋, P̂ = P̃ · 2^k rounded
    to E4M3 once; each element's exponent (qk - m) + k, as there.
    Returns (P̂ e4m3, m_new, k_new, l_new, alpha); ``acc`` and ``l`` are kept in units of 2^k."""
    tile_max = tl.max(qk, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    top = tl.exp2(tile_max - m_safe)
    k_new = e4m3_p_shift(top, _EXP_FLOOR)
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
def _chunk_scales(desc, chunk, ROWS: tl.constexpr, NS: tl.constexpr):
    """The (ROWS, NS) block scales of one key tile (K̂: its keys' scales along D; V̂ᵀ: its
    channels' scales along the tile's keys) from chunk ``chunk`` of :func:`scale_chunks`'s layout,
    by TMA. Written as the reshape, permute and reshape that Triton recognizes (its
    ``UseShmemForScales`` rewrite): the scales then go from shared to tensor memory by the MMA
    partition's ``tcgen05.cp``, not through registers into a ``tcgen05.st`` of four warps."""
    raw = desc.load([chunk, 0, 0])
    return raw.reshape(ROWS // 128, NS // 4, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(ROWS, NS)


@triton.jit
def _scaled_tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, sks,
                 svd, svsd, sms, scale_log2,
                 HAS_MASK: tl.constexpr, TAIL: tl.constexpr, NV: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
                 PNQ: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, FAST_RCP: tl.constexpr,
                 HW_E4M3: tl.constexpr, D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, QB: tl.constexpr, HW_E2M1: tl.constexpr, TMA: tl.constexpr, k_row, v_row,
                 P_E4M3: tl.constexpr, QUAD: tl.constexpr, WS: tl.constexpr = False, SC_TMA: tl.constexpr = False,
                 chunk=0, F32X2: tl.constexpr = False):
    """One key tile: returns the updated (m, r, k, l, acc); m in log2 units, acc in units of r (the
    two-level row factor; 1 otherwise) and, P_E4M3, of 2^k (P̂ and V̂ᵀ in E4M3: ``V_base`` V̂ᵀ's
    e4m3 rows, keys in order, padded to whole tiles; TMA: a tensor descriptor of them). NV: the scale bytes follow the codes in each row of K̂
    (``KS_base`` = ``K_base`` + D/2) and V̂ᵀ, E4M3 to be read as such. TMA: ``K_base`` and
    ``V_base`` are tensor descriptors of K̂'s rows (this head's first at ``k_row``; rows past SK are
    another head's or zeros, masked like any key past SK) and V̂ᵀ's (this head's first channel at
    ``v_row``), a box holding a key tile's codes. SC_TMA: ``KS_base`` (and, FP4 P·V, ``VS_base``) are
    tensor descriptors of :func:`scale_chunks`'s layout, ``chunk`` this tile's (else the scales are
    pointer loads: 4 or 8 bytes a row, below TMA's 16-byte box). QUAD (pointer loads): K̂'s rows (MXFP4: and scales) in
    :func:`.key_order.quad_key_order` within each 32 keys, so column c of S holds key
    quad_key_order(c) (MXFP4's P blocks of 32 are the same keys, NVFP4's of 16 are picked out by
    :func:`_nv_p`), and P's codes are put in key order for P̂·V̂ (:func:`_codes_in_key_order`)."""
    NB: tl.constexpr = BLOCK_N // QB
    keys = start + tl.arange(0, BLOCK_N)
    half_d = tl.arange(0, D // 2)
    nb_d = tl.arange(0, D // QB)
    dv = tl.arange(0, BLOCK_DV)
    held = start + quad_key_order(tl.arange(0, BLOCK_N)) if QUAD else keys  # the key of each row / column
    key_ok = held < SK
    if TMA:
        k4 = K_base.load([k_row + start, 0])
    else:
        k4 = tl.load(K_base + keys[:, None] * sks + half_d[None, :], mask=key_ok[:, None], other=0)
    if SC_TMA:
        k_sc = _chunk_scales(KS_base, chunk, BLOCK_N, D // QB)
        qk = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), k_sc, "e2m1")
    elif NV:
        k_sc = tl.load(KS_base + keys[:, None] * sks + nb_d[None, :], mask=key_ok[:, None], other=0)
        qk = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), k_sc.to(tl.float8e4nv, bitcast=True), "e2m1")
    else:
        k_sc = tl.load(KS_base + keys[:, None] * (D // QB) + nb_d[None, :], mask=key_ok[:, None], other=127)
        qk = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), k_sc, "e2m1")
    # log2 units, dead keys -inf; the product two lanes an instruction on datacenter Blackwell except
    # in the FP8-P·V form, where it spills
    qk = scaled_masked(qk, scale_log2, M_base, held, SK, sms, HAS_MASK, TAIL, F32X2 and not P_E4M3)
    if P_E4M3:  # FP8 P·V: P̂ and V̂ᵀ in E4M3 on the FP8 MMA
        p8, m_new, k_i, l_i, alpha = _e4m3_p(qk, m_i, k_i, l_i, PNQ, HW_E4M3, F32X2)
        if TMA:
            v8t = V_base.load([v_row, start])
        else:
            v8t = tl.load(V_base + dv[:, None] * svd + keys[None, :])  # padded to whole tiles: no mask
        # the rescaled accumulator plus P̂·V̂, as the FP4-P form writes it: the warp-specialized loop's
        # MMA then adds into the accumulator in tensor memory, the correction partition rescales it
        # there (as an FMA of a fresh product, that partition reads both and spills)
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(v8t))
    else:
        if NV:
            p4, p_sc, m_new, r_i, l_i, acc_scale = _nv_p(qk, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ,
                                                         FAST_RCP, HW_E4M3, QB, HW_E2M1, QUAD, WS, F32X2)
            p_sc = p_sc.to(tl.float8e4nv, bitcast=True)
        else:
            p4, p_sc, m_new, l_i, acc_scale = _mx_p(qk, m_i, l_i, OCP, QMAX, PNQ, QB, HW_E2M1, WS, F32X2)
        if QUAD:
            p4 = _codes_in_key_order(p4)
        half_n = start // 2 + tl.arange(0, BLOCK_N // 2)
        nb_n = start // QB + tl.arange(0, NB)
        if TMA:
            v4t = V_base.load([v_row, start // 2])
        else:
            v4t = tl.load(V_base + dv[:, None] * svd + half_n[None, :])  # padded to whole tiles: no mask
        if SC_TMA:
            v_sc = _chunk_scales(VS_base, chunk, BLOCK_DV, NB)
        else:
            v_sc = tl.load(VS_base + dv[:, None] * svsd + nb_n[None, :])
            if NV:
                v_sc = v_sc.to(tl.float8e4nv, bitcast=True)
        pv = tl.dot_scaled(p4, p_sc, "e2m1", tl.trans(v4t), v_sc, "e2m1")
        acc = acc * acc_scale[:, None] + pv
    return m_new, r_i, k_i, l_i, acc


@triton.jit
def _scaled_attn_fwd(
    Q4, QS, K4, KS, V4T, VS, GQK, GV, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svd, svsd,
    smb, sms,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: tl.constexpr, NV: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
    TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
    HW_E2M1: tl.constexpr = False, TMA: tl.constexpr = False, WS: tl.constexpr = False,
    P_E4M3: tl.constexpr = False, QUAD: tl.constexpr = False, SC_TMA: tl.constexpr = False,
    F32X2: tl.constexpr = False,
):
    """Online-softmax FP4 attention on ``tl.dot_scaled``; operands from :func:`.prepass.prepass_packed`.
    MXFP4: scales in their own tensors (QS, KS, VS). NV (NVFP4): each row of Q4 / K4 / V4T holds its
    codes then its E4M3 scale bytes (QS, KS, VS are those tensors again, read past the codes);
    GQK (B·H) the product of Q's and K's tensor scales, GV (B·H) V's. TMA: K4 and V4T are tensor
    descriptors of the rows (B·H·SK and B·H·BLOCK_DV rows; a box holds a key tile's codes). SC_TMA
    (with TMA): KS, and VS for FP4 P·V, are tensor descriptors of the K̂ / V̂ᵀ block scales in
    :func:`scale_chunks`'s layout, chunk bh · (SK_PAD / BLOCK_N) + tile. WS: the
    key loop is Triton's warp-specialized loop (on sm_100: a TMA-load partition, an MMA partition
    issuing the asynchronous ``tcgen05`` MMAs, correction partitions, and the softmax in the default
    partition; S double-buffered in tensor memory). F32X2 (sm_10x / sm_11x): two-lane fp32 arithmetic
    in P's quantization (:func:`.fp4_math.sub_lanes`, :func:`.fp4_math.mul_f32x2`)."""
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    bh = tl.program_id(1)
    half_d = tl.arange(0, D // 2)
    nb_d = tl.arange(0, D // QB)
    q_rows = Q4 + b * sqb + h * sqh + offs_m[:, None] * sqs
    q4 = tl.load(q_rows + half_d[None, :], mask=row_ok[:, None], other=0)
    K_base, V_base = kv_bases(K4, V4T, b, h, skb, skh, svb, svh, TMA)
    k_row = bh * SK
    v_row = bh * BLOCK_DV
    out_factor = 1.0
    if NV:
        q_sc = tl.load(q_rows + D // 2 + nb_d[None, :], mask=row_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        scale_log2 = scale_log2 * tl.load(GQK + bh)  # a power of two: the logits' product is exact
        if SC_TMA:
            KS_base = KS
            VS_base = VS
        else:
            KS_base = KS + b * skb + h * skh + D // 2  # (KS, VS: K4's and V4T's rows again, as pointers)
            VS_base = VS + b * svb + h * svh + SK_PAD // 2
        if not P_E4M3:
            out_factor = tl.load(GV + bh)
    else:
        q_sc = tl.load(QS + (bh * SQ + offs_m)[:, None] * (D // QB) + nb_d[None, :], mask=row_ok[:, None], other=127)
        if SC_TMA:
            KS_base = KS
            VS_base = VS
        else:
            KS_base = KS + bh * (tl.cdiv(SK, 32) * 32 if QUAD else SK) * (D // QB)  # (QUAD: 32-key groups whole)
            VS_base = VS + bh * BLOCK_DV * svsd

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    r_i = tl.full((BLOCK_M,), 1.0, tl.float32)  # units of acc (the two-level row factor)
    k_i = tl.zeros((BLOCK_M,), tl.int32)  # P_E4M3: units of acc and l, 2^k_i
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    M_base = KeyMask + b * smb
    n_full = (SK // BLOCK_N) * BLOCK_N
    if WS:  # (the keyword exists from Triton 3.4: only named where asked for)
        for start in tl.range(0, n_full, BLOCK_N, warp_specialize=True, disallow_acc_multi_buffer=P_E4M3):
            m_i, r_i, k_i, l_i, acc = _scaled_tile(
                q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, sks, svd, svsd,
                sms, scale_log2, HAS_MASK, False, NV, OCP, QMAX, PNQ, TWO_LEVEL, P_RANGE, FAST_RCP, HW_E4M3, D,
                BLOCK_DV, BLOCK_M, BLOCK_N, QB, HW_E2M1, TMA, k_row, v_row, P_E4M3, QUAD, WS, SC_TMA,
                bh * (SK_PAD // BLOCK_N) + start // BLOCK_N, F32X2)
    else:
        for start in range(0, n_full, BLOCK_N):
            m_i, r_i, k_i, l_i, acc = _scaled_tile(
                q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, sks, svd, svsd,
                sms, scale_log2, HAS_MASK, False, NV, OCP, QMAX, PNQ, TWO_LEVEL, P_RANGE, FAST_RCP, HW_E4M3, D,
                BLOCK_DV, BLOCK_M, BLOCK_N, QB, HW_E2M1, TMA, k_row, v_row, P_E4M3, QUAD, False, SC_TMA,
                bh * (SK_PAD // BLOCK_N) + start // BLOCK_N, F32X2)
    if n_full < SK:
        m_i, r_i, k_i, l_i, acc = _scaled_tile(
            q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, n_full, SK, sks, svd, svsd,
            sms, scale_log2, HAS_MASK, True, NV, OCP, QMAX, PNQ, TWO_LEVEL, P_RANGE, FAST_RCP, HW_E4M3, D, BLOCK_DV,
            BLOCK_M, BLOCK_N, QB, HW_E2M1, TMA, k_row, v_row, P_E4M3, QUAD, False, SC_TMA,
            bh * (SK_PAD // BLOCK_N) + n_full // BLOCK_N, F32X2)

    if P_E4M3:  # acc in units of V̂'s channel factors and of 2^k
        v_fac = tl.load(VS + bh * BLOCK_DV + tl.arange(0, BLOCK_DV))
        store_out_lse(Out, Lse, acc, v_fac[None, :], l_i, m_i, k_i.to(tl.float32), b, h, offs_m, row_ok,
                      tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)
    elif NV and PNQ and TWO_LEVEL:  # acc and l in units of r (:func:`_nv_p`): out = acc / l, the LSE adds log2 r
        store_out_lse(Out, Lse, acc, out_factor, l_i, m_i, -tl.log2(r_i), b, h, offs_m, row_ok,
                      tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)
    else:
        store_out_lse(Out, Lse, acc, r_i[:, None] * out_factor, l_i, m_i, 0.0, b, h, offs_m, row_ok,
                      tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)


#: Shared memory (bytes), compiled offline (Triton 3.9, head dim 128, masked, 8 warps): the same at 1-3
#: stages, the FP8-P·V form's (the most: ``sage3-pv8``; the FP4-P forms 32768)
SHARED_MEMORY = {"sm_100": {1: 37888, 2: 37888, 3: 37888}, "sm_120": {1: 33792, 2: 33792, 3: 33792}}
LAUNCH = LoopLaunch(128, 8, 2, shared_memory=SHARED_MEMORY, reason="not tuned on a Blackwell GPU")
#: The warp-specialized loop of sm_100 (K̂ / V̂ᵀ codes and block scales by TMA), compiled offline
#: (Triton 3.9, head dim 128, masked): the most shared memory any method of the format takes
TMA_SHARED_MEMORY = {"mx": {"sm_100": {1: 27928, 2: 45320, 3: 62792}},
                     "nv": {"sm_100": {1: 31096, 2: 49512, 3: 68008}},
                     "pv8": {"sm_100": {1: 38840, 2: 64440, 3: 90088}}}  # FP8 P·V: the larger of the two methods
#: Per format, offline (Triton 3.9): 8 softmax warps, with which no partition's loop spills (at 4 the
#: two-level P state of ``sage3-hpnq`` and the FP8-P·V methods' softmax spill;
#: ``python -m fp4video.kernels.report`` counts both, ``tests/test_offline_compile.py`` checks them).
#: The FP8-P·V methods' accumulator is single-buffered in tensor memory (double, with S's two buffers
#: and P̂ for the MMA, it needs 576 of the 512 columns and Triton compiles the kernel to a trap). The
#: block maxima's exp2 is :func:`_block_exp2`'s, which keeps the tile's logits in the softmax
#: partition; K̂'s and V̂ᵀ's block scales come by TMA in :func:`scale_chunks`'s layout, to tensor
#: memory by ``tcgen05.cp`` (SC_TMA), so the MMA partition is one warp (by pointer loads it takes
#: four, storing the scales from registers)
TMA_LAUNCH = {
    "mx": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["mx"],
                     reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "nv": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["nv"],
                     reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "mx-pv8": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["pv8"],
                         reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "nv-pv8": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["pv8"],
                         reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
}


def tma_launch_key(nv: bool, pv8: bool) -> str:
    """The :data:`TMA_LAUNCH` entry of a method: its Q·K format, and FP8 P·V apart."""
    return ("nv" if nv else "mx") + ("-pv8" if pv8 else "")


#: one chunk of :func:`scale_chunks`: 32 × 16 bytes, a 32-row × 128-bit piece of tensor memory's scale
#: layout for each of the 4 row groups of 32 (the unit ``tcgen05.cp`` copies), laid out as two rows of
#: 256 bytes (a TMA box's dimensions are at most 256)
SCALE_CHUNK = (2, 256)


def scale_chunks_fit(d: int, qb: int, dv_pad: int, pv8: bool) -> bool:
    """Whether :func:`scale_chunks` can lay out this loop's scales: K̂'s D / qb scales a key, and
    (FP4 P·V) V̂ᵀ's padded channels, in whole chunks (a multiple of 4 scales a row, of 128 rows)."""
    return (d // qb) % 4 == 0 and (pv8 or dv_pad % KEY_TILE == 0)


def scale_chunks(tiles: torch.Tensor) -> torch.Tensor:
    """Block scales ``tiles`` (N, R, C) — N tiles of R rows (a multiple of 128) and C scales a row
    (a multiple of 4) — in the layout Blackwell's tensor memory takes them in: (N, R·C/256, 256),
    tile n's bytes contiguous, scale (r, c) with r = 128·g + 32·j + i and c = 4·u + w at
    ((g·C/4 + u)·32 + i)·16 + 4·j + w. :func:`_chunk_scales` reads a tile back as (R, C)."""
    n, r, c = tiles.shape
    if r % 128 or c % 4:
        raise ValueError(f"scale tiles need a multiple of 128 rows and of 4 scales a row, got {r} × {c}")
    x = tiles.reshape(n, r // 128, 4, 32, c // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return x.reshape(n, r * c // SCALE_CHUNK[1], SCALE_CHUNK[1])


def _key_tile_scales(scales: torch.Tensor, tiles: int, fill: int) -> torch.Tensor:
    """K̂'s scales (B, H, SK, C), keys padded with ``fill`` to ``tiles`` whole key tiles, as
    :func:`scale_chunks`'s (B·H·tiles, 128, C) input."""
    b, h, sk, c = scales.shape
    padded = scales.new_full((b, h, tiles * KEY_TILE, c), fill)
    padded[:, :, :sk] = scales
    return padded.reshape(b * h * tiles, KEY_TILE, c)


def _channel_tile_scales(scales: torch.Tensor, tiles: int) -> torch.Tensor:
    """V̂ᵀ's scales (B, H, Dv_pad, tiles · C): each key tile's (Dv_pad, C), as (B·H·tiles, Dv_pad, C)."""
    b, h, dvp, n = scales.shape
    c = n // tiles
    return scales.reshape(b, h, dvp, tiles, c).permute(0, 1, 3, 2, 4).reshape(b * h * tiles, dvp, c)


def chunked_scales(nv: bool, pv8: bool, d: int, qb: int, sk_pad: int, k4, ks, v4t, vs):
    """K̂'s block scales and (FP4 P·V) V̂ᵀ's in :func:`scale_chunks`'s layout, one chunk run a key
    tile (``sk_pad`` / 128 a head): (k_chunks, v_chunks or None), uint8 (NVFP4: viewed as E4M3),
    from :func:`.prepass.prepass_packed`'s tensors (NVFP4: the scale bytes after the codes of each
    row; keys past SK padded with scale bytes of 0, MXFP4 with 127, 2^0: masked like any key past SK).
    A copy of 1/16 (MXFP4) or 1/8 (NVFP4) of K̂'s and V̂ᵀ's bytes, per call."""
    tiles = sk_pad // KEY_TILE
    k_scales = k4[..., d // 2:d // 2 + d // qb] if nv else ks
    k_chunks = scale_chunks(_key_tile_scales(k_scales, tiles, 0 if nv else 127))
    v_chunks = None
    if not pv8:
        v_scales = v4t[..., sk_pad // 2:sk_pad // 2 + sk_pad // qb] if nv else vs[..., :sk_pad // qb]
        v_chunks = scale_chunks(_channel_tile_scales(v_scales, tiles))
    if nv:
        k_chunks = k_chunks.view(torch.float8_e4m3fn)
        v_chunks = None if v_chunks is None else v_chunks.view(torch.float8_e4m3fn)
    return k_chunks, v_chunks


def _scale_descriptor(chunks: torch.Tensor):
    """A TMA descriptor over :func:`chunked_scales`'s chunks, one box a key tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(chunks, [1, *chunks.shape[1:]])


def attention_packed(ops: PackedOperands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float, out_dtype,
                     dv: int, exact: bool = True, block_m=None, num_warps=None, num_stages=None):
    """The loop on :func:`.prepass.prepass_packed`'s operands (MXFP4 or NVFP4 Q·K, FP4 or FP8 P·V).
    ``plan.tma``: K̂ / V̂ᵀ codes by TMA (the CPU interpreter runs it when asked, which is how CI
    tests it); ``plan.warp_specialized``: the warp-specialized loop (TMA only); ``plan.key_order``
    ``"quad"``: K̂ is in the quad key order (``prepass_packed(..., quad_order=True)``: the
    pointer-load loop of consumer Blackwell, FP4 P·V). The loop has one exponent form, exact at any
    logit magnitude (``exact`` is the call's uniform argument). Returns (out, lse)."""
    nv = recipe.qk_format is Format.NVFP4
    pv8 = recipe.pv_format is Format.E4M3
    tma, ws, quad_order = plan.tma, plan.warp_specialized, ops.quad_order
    if recipe.qk_format not in (Format.MXFP4, Format.NVFP4) or recipe.pv_format not in (recipe.qk_format, Format.E4M3):
        raise ValueError(f"{recipe.name}: the dot_scaled loop runs MXFP4 or NVFP4 Q·K with P·V in the same format or "
                         f"in E4M3, not {recipe.qk_format} / {recipe.pv_format}")
    if quad_order != (plan.key_order == "quad"):
        raise ValueError(f"the operands' K̂ is {'' if quad_order else 'not '}in the quad key order, the plan's "
                         f"{plan.key_order!r}: prepare them with the plan")
    q4, k4, v4t = ops.q4, ops.k4, ops.v
    if pv8:  # FP8 P·V: V̂ᵀ e4m3 in key order with its channel factors
        qb = Format.NVFP4.block if nv else 32
        d = q4.shape[-1] * qb // (qb // 2 + 1) if nv else q4.shape[-1] * 2
        sk_pad = v4t.shape[-1]
        gqk, gv = (ops.g_q * ops.g_k).reshape(-1).contiguous(), q4.new_ones(1, dtype=torch.float32)
        qs, ks, vs = (q4, k4, ops.v_fac) if nv else (ops.q_scale, ops.k_scale, ops.v_fac)
        if reason := (pointer_loop_reason(plan.arch, recipe, "the dot_scaled loop's FP8-P·V form")):
            raise ValueError(f"{recipe.name}: {reason}")
    elif nv:
        qb = Format.NVFP4.block
        d = q4.shape[-1] * qb // (qb // 2 + 1)  # rows of D/2 code bytes and D/16 scale bytes
        sk_pad = -(-k4.shape[-2] // KEY_TILE) * KEY_TILE  # (K̂'s and V̂ᵀ's rows are padded to 16 bytes)
        qs = ks = vs = None
        gqk, gv = (ops.g_q * ops.g_k).reshape(-1).contiguous(), ops.g_v.reshape(-1).contiguous()
    else:
        qs, ks, vs = ops.q_scale, ops.k_scale, ops.v_scale
        qb = recipe.pv_format.block
        d, sk_pad = q4.shape[-1] * 2, v4t.shape[-1] * 2
        gqk = gv = q4.new_ones(1, dtype=torch.float32)
    b, h, sq = q4.shape[:3]
    sk, dvp = k4.shape[-2], v4t.shape[-2]
    dev = q4.device
    out, lse = outputs((b, h, sq, d), dv, dev, out_dtype)
    km = key_mask(key_alive, dev)
    if quad_order and (tma or pv8):
        raise ValueError("the quad key order: K̂'s rows are read by pointer loads (no TMA), for FP4 P·V")
    if ws and not tma:
        raise ValueError("a warp-specialized plan reads K̂ / V̂ᵀ by TMA (tma=True)")
    launch = TMA_LAUNCH[tma_launch_key(nv, pv8)] if tma else LAUNCH
    block_m, num_warps, num_stages = launch.resolve(dev, block_m, num_warps, num_stages)
    cap = torch.cuda.get_device_capability(dev) if q4.is_cuda else (0, 0)
    kt, vt = k4, v4t
    k_sc_arg, v_sc_arg = (k4 if nv else ks), (vs if pv8 else v4t if nv else vs)
    sc_tma = tma and scale_chunks_fit(d, qb, dvp, pv8)
    if sc_tma:  # the block scales by TMA in tensor memory's layout (:func:`scale_chunks`), one box a key tile
        k_chunks, v_chunks = chunked_scales(nv, pv8, d, qb, sk_pad, k4, ks, v4t, vs)
        k_sc_arg = _scale_descriptor(k_chunks)
        if v_chunks is not None:
            v_sc_arg = _scale_descriptor(v_chunks)
    if tma:  # the code rows as (B·H·SK, D/2) and (B·H·Dv, SK_pad/2) tables (FP8 P·V: V̂ᵀ's e4m3 rows
        # (B·H·Dv, SK_pad)): one box per key tile
        from triton.tools.tensor_descriptor import TensorDescriptor

        kt = TensorDescriptor.from_tensor(k4.reshape(b * h * sk, k4.shape[-1]), [KEY_TILE, d // 2])
        vt = TensorDescriptor.from_tensor(v4t.reshape(b * h * dvp, v4t.shape[-1]),
                                          [dvp, KEY_TILE if pv8 else KEY_TILE // 2])
    _scaled_attn_fwd[(triton.cdiv(sq, block_m), b * h)](
        q4, q4 if nv else qs, kt, k_sc_arg, vt, v_sc_arg, gqk, gv, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q4.stride()[:3], *k4.stride()[:3], *v4t.stride()[:3], 0 if pv8 else v4t.stride(2) if nv else vs.stride(2),
        km.stride(0), km.stride(1),
        *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, NV=nv, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, TWO_LEVEL=recipe.p_scale is PScale.TWO_LEVEL, P_RANGE=TWO_LEVEL_P_RANGE,
        FAST_RCP=cap >= (8, 0), HW_E4M3=cap >= (8, 9), D=d, BLOCK_DV=dvp, BLOCK_M=block_m, BLOCK_N=KEY_TILE, QB=qb,
        HW_E2M1=cap >= (10, 0),  # Blackwell's E2M1 conversions
        F32X2=cap[0] in WS_MAJORS,  # datacenter Blackwell's two-lane fp32 arithmetic
        TMA=tma, WS=ws, P_E4M3=pv8, QUAD=quad_order, SC_TMA=sc_tma,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,  # explicit tl.fma only, as the reference
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _scaled_attn_fwd
