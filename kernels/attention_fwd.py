"""Fused FP4 attention forward (Triton): online softmax with in-loop P quantization.

Numerics: exactly :mod:`fp4video.reference` (same key tile, same block rounding of P̃), except
for the usual floating-point differences (``exp2`` implementation, fp32 accumulation order),
which can flip the rounding of an element of P̃ that sits on a rounding boundary.

Five loops, picked per recipe and GPU by :func:`mx_kernel` / :func:`prepare`:

- ``_mx_fp8_attn_fwd`` (MXFP4 methods on sm_89+, e.g. Hopper): Q̂, K̂, V̂ and P̂ on e4m3 tensor
  cores, block scales folded into power-of-two factors (:func:`.prepass.prepass_fp8`); exact
  inside e4m3's window (README, ``scripts/fp8_window_report.py``); P rounded on f16 pairs
  (:func:`.fp4_math.round_e2m1_f16x2_odd`). On Hopper its K̂/V̂ᵀ tiles come by TMA
  (:func:`tma_loop`; K̂ stored in tile key order) and three programs share an SM.
- :mod:`.attention_scaled` (MXFP4 methods on sm_100+): ``tl.dot_scaled`` on packed E2M1 with
  E8M0 scales, Blackwell's native FP4 MMAs.
- :mod:`.attention_nvfp4` (NVFP4 methods): the pre-pass writes the dequantized values in bf16
  (E2M1 times an E4M3 scale needs at most 6 significant bits: exact; K̂ and V̂ rows in tile key
  order, :func:`.prepass.prepass_tiles`), bf16 tensor-core products with fp32 accumulation, P
  blocks laid out one per lane as in the e4m3 loop. On Hopper (head dims 128) the same numerics
  run as :mod:`.attention_nvfp4_sm90` (Gluon): two warpgroups take turns on the tensor cores, one
  quantizing P while the other's MMAs run; bit for bit the Triton loop's output, a few percent
  faster (sage3 4.5% at Wan 720p, BENCHMARKS.md). ``FP4VIDEO_NV_KERNEL=triton|sm90`` picks one.
- ``_fp4_attn_fwd`` (``fp16``; MXFP4 methods on GPUs older than sm_89): the same bf16 pre-pass,
  the P tile quantized in the loop (exact in bf16). ``fp16`` reads the inputs as they are (fp32
  with IEEE-precision dots).

Limits (``supports`` reports them): key-padding masks ``(B, 1, 1, Sk)`` only; P blocks whose
maximum is below 2^-124 (weights ~1e-37 of the row maximum) are flushed to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE, poison_heads

from .fp4_math import fake_quant_rows, mx_block_exponent, pow2, round_e2m1_at_scale, round_e2m1_f16x2_odd
from .launch import fitting_stages
from .prepass import (E4M3_V_SPAN_LIMIT, k_smoothing_mean, next_pow2, nonfinite_heads, prepass,
                      prepass_fp8_window, prepass_packed, prepass_tiles, smoothing_lse_shift)

# P quantization modes (constexpr)
P_NONE, P_MX = 0, 1


@triton.jit
def _quantize_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_MODE: tl.constexpr,
                QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr):
    """Quantize-dequantize p >= 0 ([BLOCK_M, BLOCK_N]) in blocks of QB along keys."""
    return fake_quant_rows(p, BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX, False)


#: the largest finite bfloat16, (2 - 2^-7) · 2^127
BF16_MAX = tl.constexpr(3.3895313892515355e38)


@triton.jit
def program_rows(H, SQ, BLOCK_M: tl.constexpr):
    """This program's batch, head, query rows and their in-range mask (every attention kernel's
    grid is (query blocks, B·H))."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return bh // H, bh % H, offs_m, offs_m < SQ


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


@triton.jit
def _fp4_attn_fwd(
    # pointers
    Q, K, V, KeyMask, Out, Lse,
    # sizes
    H, SQ, SK, DQK, DV,
    # strides (elements)
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    smb, sms,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale,
    # meta
    HAS_MASK: tl.constexpr, P_MODE: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr,
    QMAX: tl.constexpr, PNQ: tl.constexpr, IEEE: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < DQK), other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for start in range(0, SK, BLOCK_N):
        keys = start + offs_n
        k = tl.load(K + b * skb + h * skh + keys[:, None] * sks + offs_d[None, :] * skd,
                    mask=(keys < SK)[:, None] & (offs_d[None, :] < DQK), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        valid = keys < SK
        if HAS_MASK:
            km = tl.load(KeyMask + b * smb + keys * sms, mask=valid, other=0)
            valid = valid & (km != 0)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        p_hat = p if P_MODE == 0 else _quantize_p(p, BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX)
        if PNQ:
            l_i = alpha * l_i + tl.sum(p_hat, axis=1)
        else:
            l_i = alpha * l_i + tl.sum(p, axis=1)
        v = tl.load(V + b * svb + h * svh + keys[:, None] * svs + offs_dv[None, :] * svd,
                    mask=(keys < SK)[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if IEEE:
            acc = tl.dot(p_hat, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p_hat.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # m in natural-log units here (tl.exp): to log2 units for the common end
    store_out_lse(Out, Lse, acc, 1.0, l_i, m_i * 1.4426950408889634, 0.0, b, h, offs_m, row_ok,
                  tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)


LOG2E = 1.4426950408889634
#: lowest block exponent a key tile's shift follows (tiles entirely below 2^-60 of the row
#: maximum keep a fixed shift; their weights are below 1e-18)
TILE_EXP_FLOOR = -60


@triton.jit
def mma_key_order(cols, NB: tl.constexpr, QB: tl.constexpr):
    """The key (within its tile) that column ``cols`` of the e4m3 kernel's S tile holds.

    Hopper's MMA gives each lane of a quad the columns 8j + 2t + {0, 1} of its rows (t: the lane
    in the quad). Loading keys QB·t + 2j + {0, 1} there puts every P-quantization block (QB
    consecutive keys) in one lane: block maxima, scales and rounding units are computed once per
    lane, with no cross-lane reduction and no replicated per-block work. In general: column
    c = 2·NB·j + 2·t + e holds key QB·t + 2·j + e (NB = BLOCK_N // QB blocks per tile).
    V̂ᵀ's stored columns follow this map composed with :func:`as_mma_operand`'s relabelling
    (:func:`fp4video.kernels.prepass.v8t_key_order`); the NVFP4 loop loads K̂ and V̂ rows in it.
    """
    return QB * ((cols // 2) % NB) + 2 * (cols // (2 * NB)) + cols % 2


@triton.jit
def as_mma_operand(p8, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P̂ (e4m3, laid out as the Q̂·K̂ᵀ accumulator) with its columns relabelled so that it is
    already where Hopper's 8-bit MMA wants its A operand: no data moves.

    Within each 32-key slice of the MMA's reduction, lane t of a quad holds the accumulator's
    columns 8b + 2t + e (b < 4, e < 2) but feeds the A operand's k = 4t + u and 16 + 4t + u
    (u < 4). Relabelling column 16a + 8b + 2t + e as k = 16a + 4t + 2b + e (a swap of two index
    digits, free in registers) makes every lane's values its own operand slots; Triton otherwise
    exchanges them between lanes (0.25 shuffles and 0.3 selects per element of S, measured with
    ``scripts/count_loop_instructions.py``). P̂·V̂ only needs V̂'s rows in the same relabelled
    order, which the pre-pass stores (:func:`fp4video.kernels.prepass.v8t_key_order`).
    """
    x = tl.reshape(p8, (BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2))  # column digits (slice, a, b, t, e)
    return tl.reshape(tl.permute(x, (0, 1, 2, 4, 3, 5)), (BLOCK_M, BLOCK_N))  # -> (slice, a, t, b, e)


@triton.jit
def _tile_logits(q, K_base, M_base, start, SK, sks, sms, HAS_MASK: tl.constexpr, TAIL: tl.constexpr,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr, PRECISE_QK: tl.constexpr,
                 IEEE: tl.constexpr = False, TILE_ORDERED: tl.constexpr = False, TMA: tl.constexpr = False,
                 k_row=0):
    """Q̂·K̂ᵀ of one key tile with its keys in :func:`mma_key_order`, masked keys at -inf (the e4m3
    MXFP4 loop and the bf16 NVFP4 loop of :mod:`.attention_nvfp4`). In the e4m3 loop the logit in
    log2 units is qk · q_scale, q_scale > 0 per row (Q̂'s row factor times this tile's K̂ factor,
    scale and log2(e)). PRECISE_QK: fp8 partial sums promoted to fp32 every 32; IEEE: fp32 operands
    multiplied exactly (the CPU interpreter's work dtype). TILE_ORDERED: K̂ is stored in that order
    already, padded to whole tiles (:func:`.prepass.prepass_tiles`): rows read as stored; TMA
    (with TILE_ORDERED): ``K_base`` is a tensor descriptor of K̂'s rows, this head's first at
    ``k_row``."""
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
    if PRECISE_QK:
        qk = tl.dot(q, tl.trans(k), max_num_imprecise_acc=32)
    elif IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if HAS_MASK:
        km = tl.load(M_base + keys * sms, mask=keys < SK, other=0)
        qk = tl.where((km != 0)[None, :], qk, float("-inf"))
    elif TAIL:
        qk = tl.where((keys < SK)[None, :], qk, float("-inf"))
    return qk


@triton.jit
def _mx_blocks(x):
    """A per-block (row, t) tensor broadcast to the 5-d view (row, a, b, t, e) of an S tile."""
    return x[:, None, :][:, :, None, :][:, :, :, :, None]


@triton.jit
def _mx_rows(x):
    """A per-row vector (as :func:`mx_quantize_p` leaves it) broadcast to the 5-d view."""
    return _mx_blocks(x[:, None])


@triton.jit
def _mx_block_reduce(x5, MAX: tl.constexpr):
    """Per-block maxima (MAX) or sums (row, t) of the 5-d view: e, then b, then a. In-thread
    reductions are chains of dependent instructions, and trees of 2, 4 and 4 are shorter than one
    chain of 16 (the row sum's chain cost 3% of the loop on the H200)."""
    if MAX:
        return tl.max(tl.max(tl.max(x5, axis=4), axis=2), axis=1)
    else:
        return tl.sum(tl.sum(tl.sum(x5, axis=4), axis=2), axis=1)


@triton.jit
def _mx_view(qk, QB: tl.constexpr):
    """S tile (BLOCK_M, BLOCK_N) in :func:`mma_key_order` as (row, a, b, t, e): column
    c = 2·NB·j + 2·t + e with j = (QB / 8)·a + b holds key QB·t + 2·j + e, so P block t is the
    columns with that t, within one lane of the MMA's quad."""
    return tl.reshape(qk, (qk.shape[0], 4, QB // 8, qk.shape[1] // QB, 2))


@triton.jit
def mx_quantize_p(qk, q_scale, m_i, k_i, l_i, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
                  QB: tl.constexpr, EXP_FLOOR: tl.constexpr, QUANTIZE_P: tl.constexpr, F16_P: tl.constexpr = False,
                  ASM: tl.constexpr = False):
    """Online softmax and MXFP4 quantization of one key tile of logits ``qk`` (keys in
    :func:`mma_key_order`, masked keys at -inf; the logit in log2 units is qk · q_scale, q_scale > 0
    per row) of :func:`_mx_fp8_attn_fwd`. Returns (P̂ as the e4m3 A operand of P̂·V̂
    (:func:`as_mma_operand`), m_new, k_new, l_new, alpha): the caller rescales its accumulator by
    alpha and adds P̂·V̂. ``l`` is kept per row and P block (each lane's share), summed by the caller
    after the loop.

    P̃ = exp2(s - m) is quantized per block of QB keys as the reference does (block exponent from
    the block maximum, E2M1 rounding), in units of 2^k per row and tile, k = 6 - (the tile's
    largest block exponent), folded into the exp2 argument: the largest P̂ value is 6·2^6 = 384 <
    448, and every block whose scale is within 2^14 of the tile's largest is exact in e4m3.

    F16_P (the loop's default): the rounding runs on f16 pairs
    (:func:`.fp4_math.round_e2m1_f16x2_odd`, ASM: inline PTX, else its fp32 stand-in) and PNQ's
    block sums too (exact: a block's values are multiples of half its unit, at most 192 units). Its
    magic number needs values below 128, so k = 4 - (largest block exponent): the largest P̂ is
    6·2^4 = 96, and blocks within 2^12 of the tile's largest are exact in e4m3. The same values
    as in fp32 but at exact ties of the E2M1 grid (rounded up, not to even); 1.8 instructions per
    element fewer (offline sm_90 count: 11.9 against 13.8).
    """
    BLOCK_M: tl.constexpr = qk.shape[0]
    BLOCK_N: tl.constexpr = qk.shape[1]
    s5 = _mx_view(qk, QB)
    block_max = _mx_block_reduce(s5, True) * q_scale[:, None]
    tile_max = tl.max(block_max, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # block exponents of P̃ = exp2(s - m) from the block maxima (exp2 is monotonic); the block
    # holding the row maximum must get exactly exp2(0) = 1, which is why the kernel is compiled
    # without FMA contraction (a fused block_max · q_scale - m leaves a residual of either sign:
    # amax = 1 - 2^-24 would move that block to the next lower scale under the OCP rule)
    amax = tl.exp2(block_max - m_safe[:, None])
    e_blk = tl.where(amax > 0, mx_block_exponent(amax, OCP, QMAX), EXP_FLOOR)
    # the tile's largest block exponent is the exponent of its largest block maximum: computed
    # per row from the row's tile maximum (the same arithmetic on the same value), not reduced
    # across the lanes that hold the blocks (shuffles on the loop's critical path)
    top = tl.exp2(tile_max - m_safe)
    e_top = tl.maximum(tl.where(top > 0, mx_block_exponent(top, OCP, QMAX), EXP_FLOOR), EXP_FLOOR)
    e_blk = tl.minimum(e_blk, e_top[:, None])  # a no-op (exp2 is monotonic); the f16 rounding's unit <= 16 relies on it
    k_new = (4 if F16_P else 6) - e_top
    p = tl.exp2(tl.fma(s5, _mx_rows(q_scale), _mx_rows(k_new.to(tl.float32) - m_safe)))  # P̃ · 2^k_new
    unit = pow2(tl.maximum(e_blk + k_new[:, None], -126))
    if QUANTIZE_P and F16_P:
        p_hat = round_e2m1_f16x2_odd(p, _mx_blocks(unit.to(tl.float16)), _mx_blocks((unit * 6.0).to(tl.float16)), ASM)
    elif QUANTIZE_P:
        p_hat = round_e2m1_at_scale(p, _mx_blocks(unit))
    else:
        p_hat = p
    alpha = tl.exp2(m_i - m_safe + (k_new - k_i).to(tl.float32))
    # l per row and block (lane): summed over the lanes once, after the loop
    if PNQ and F16_P and QUANTIZE_P:  # block sums on f16 pairs (exact: multiples of unit / 2, at most 192 units)
        part = tl.sum(tl.sum(tl.sum(p_hat, axis=2), axis=1).to(tl.float32), axis=2)
    else:
        part = _mx_block_reduce(p_hat if PNQ else p, False)  # PNQ: the sums of the quantized blocks
    l_new = tl.fma(alpha[:, None], l_i, part)
    p8 = as_mma_operand(tl.reshape(p_hat, (BLOCK_M, BLOCK_N)).to(tl.float8e4nv), BLOCK_M, BLOCK_N)
    return p8, m_new, k_new, l_new, alpha


@triton.jit
def _mx_fp8_tile(qk, q_scale, m_i, k_i, l_i, acc, V_base, start, svd,
                 OCP: tl.constexpr, QMAX: tl.constexpr,
                 PNQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, QB: tl.constexpr, EXP_FLOOR: tl.constexpr, QUANTIZE_P: tl.constexpr,
                 PRECISE_PV: tl.constexpr, TMA: tl.constexpr, v_row, F16_P: tl.constexpr = False,
                 ASM: tl.constexpr = False, FRESH_PV: tl.constexpr = False):
    """:func:`mx_quantize_p` and P̂·V̂ of one key tile of :func:`_mx_fp8_attn_fwd`, given its
    logits from :func:`_tile_logits`: returns the updated (m, k, l, acc). TMA: ``V_base`` is a
    tensor descriptor of V̂ᵀ's rows (channels), this head's first at ``v_row``.

    FRESH_PV: P̂·V̂ goes into a fresh accumulator and is added to the rescaled one by an FMA (as
    many instructions as rescaling it before the MMA), so the MMA is awaited within its tile. Left
    in flight into the next tile (the plain form), its accumulator and P̂ stay reserved while the
    next tile's Q̂·K̂ᵀ runs, and ptxas, short of registers at three programs per SM, made every
    MMA wait for the previous one (its warning C7512); this way both chains issue back to back
    (Wan 720p loop: 158.2 ms against 171.6, H200). The tile's products are also summed in fp32
    by the FMA instead of in the fp8 MMA's accumulator."""
    p8, m_new, k_new, l_i, alpha = mx_quantize_p(qk, q_scale, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR,
                                                 QUANTIZE_P, F16_P, ASM)
    # V̂ᵀ is stored in P̂'s operand order (prepass.v8t_key_order), padded with zeros to whole tiles:
    # plain loads
    if TMA:
        vt = V_base.load([v_row, start])
    else:
        vt = tl.load(V_base + tl.arange(0, BLOCK_DV)[:, None] * svd + (start + tl.arange(0, BLOCK_N))[None, :])
    if PRECISE_PV:  # promote the fp8 MMA's partial sums to fp32 every 32 keys
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=32)
    elif FRESH_PV:
        acc = tl.fma(acc, alpha[:, None], tl.dot(p8, tl.trans(vt)))
    else:
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return m_new, k_new, l_i, acc


@triton.jit
def _mx_fp8_attn_fwd(
    Q8, QFac, K8, KFac, V8T, VFac, KeyMask, Out, Lse,
    H, SQ, SK, DV,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svd,
    smb, sms, SK_PAD,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QB: tl.constexpr, EXP_FLOOR: tl.constexpr, QUANTIZE_P: tl.constexpr = True, WARP_SPEC: tl.constexpr = False,
    PRECISE_QK: tl.constexpr = False, PRECISE_PV: tl.constexpr = False, TMA: tl.constexpr = False,
    K_TILE_ORDER: tl.constexpr = False, F16_P: tl.constexpr = False, ASM: tl.constexpr = False,
    FRESH_PV: tl.constexpr = False,
):
    """MXFP4 attention on e4m3 tensor cores (Hopper/Ada fp8 MMA).

    Q̂, K̂, V̂ come from :func:`.prepass.prepass_fp8` (e4m3 values, power-of-two factors per query
    row / key tile / value channel). P̃ is quantized per block of QB keys exactly as the reference
    does (block exponent from the block maximum, E2M1 rounding), but computed in units of
    2^k per row and tile, k = 4 - (the tile's largest block exponent) (F16_P; 6 without), folded
    into the exp2 argument: the largest P̂ value is then 6·2^4 = 96 (384 = 6·2^6 without), and every
    block whose scale is within 2^12 (2^14) of the tile's largest block scale is exact in e4m3
    (smaller ones lose low bits to e4m3's subnormals; their weights are below 2^-12·7.25 of the
    tile's largest). ``acc`` and
    ``l`` are kept in the current tile's units (their rescale factor is one exp2 per row), so no
    per-element scaling is added. Within a tile, keys sit in :func:`mma_key_order` (K̂ rows are
    loaded in that order, V̂ᵀ is stored in it), so each P block lives in one lane; P̂·V̂ sums the
    same products as in key order. TMA (with K_TILE_ORDER: K̂ stored in that order, whole tiles):
    ``K8`` and ``V8T`` are tensor descriptors of K̂'s rows (B·H·SK_PAD) and V̂ᵀ's (B·H·BLOCK_DV),
    one box per key tile; else pointers.
    """
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, D)
    q = tl.load(Q8 + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    # logits in log2 units: dot(q8, k8) · q_fac · k_fac · scale · log2(e), k_fac per key tile (all
    # factors powers of two: the products are exact)
    q_scale = tl.load(QFac + bh * SQ + offs_m, mask=row_ok, other=1.0) * scale_log2

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    k_i = tl.zeros((BLOCK_M,), tl.int32)  # units of acc and l: 2^k_i
    l_i = tl.zeros((BLOCK_M, BLOCK_N // QB), tl.float32)  # per row and P block (lane): summed at the end
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if TMA:  # tensor descriptors of K̂ (B·H·SK_PAD rows, tile key order) and V̂ᵀ (B·H·BLOCK_DV rows)
        K_base = K8
        V_base = V8T
    else:
        K_base = K8 + b * skb + h * skh
        V_base = V8T + b * svb + h * svh
    k_row = bh * SK_PAD
    v_row = bh * BLOCK_DV
    M_base = KeyMask + b * smb
    KF_base = KFac + bh * tl.cdiv(SK, BLOCK_N)
    # full key tiles without a bounds mask (the key-padding mask, if any, applies to every
    # tile), then the partial last tile
    n_full = (SK // BLOCK_N) * BLOCK_N
    for start in tl.range(0, n_full, BLOCK_N, warp_specialize=WARP_SPEC):
        qk_scale = q_scale * tl.load(KF_base + start // BLOCK_N)
        qk = _tile_logits(q, K_base, M_base, start, SK, sks, sms, HAS_MASK, False, D, BLOCK_N, QB, PRECISE_QK,
                          False, K_TILE_ORDER, TMA, k_row)
        m_i, k_i, l_i, acc = _mx_fp8_tile(
            qk, qk_scale, m_i, k_i, l_i, acc, V_base, start, svd, OCP, QMAX, PNQ, BLOCK_DV,
            BLOCK_M, BLOCK_N, QB, EXP_FLOOR, QUANTIZE_P, PRECISE_PV, TMA, v_row, F16_P, ASM, FRESH_PV)
    if n_full < SK:
        qk_scale = q_scale * tl.load(KF_base + n_full // BLOCK_N)
        qk = _tile_logits(q, K_base, M_base, n_full, SK, sks, sms, HAS_MASK, True, D, BLOCK_N, QB, PRECISE_QK,
                          False, K_TILE_ORDER, TMA, k_row)
        m_i, k_i, l_i, acc = _mx_fp8_tile(
            qk, qk_scale, m_i, k_i, l_i, acc, V_base, n_full, svd, OCP, QMAX, PNQ, BLOCK_DV,
            BLOCK_M, BLOCK_N, QB, EXP_FLOOR, QUANTIZE_P, PRECISE_PV, TMA, v_row, F16_P, ASM, FRESH_PV)

    v_fac = tl.load(VFac + bh * BLOCK_DV + tl.arange(0, BLOCK_DV))  # acc is in units of V̂'s channel factors
    store_out_lse(Out, Lse, acc, v_fac[None, :], tl.sum(l_i, axis=1), m_i, k_i.to(tl.float32), b, h, offs_m, row_ok,
                  tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)


def supports(recipe: AttentionRecipe, q: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[bool, str]:
    import os

    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False, "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
    if mask is not None and (mask.shape[1] != 1 or mask.shape[2] != 1):
        return False, "the Triton kernel takes key-padding masks (B, 1, 1, Sk) only; this mask varies over heads/queries"
    return True, ""


#: Launch configuration (BLOCK_M, warps, stages) per P mode, from scripts/sweep_kernel_configs.py on
#: an H200 (2026-11-29, S=32,760, H=40, D=128; BENCHMARKS.md): fp16/MXFP4 best at 128/8/3.
#: ``"fp8"``: the MXFP4 e4m3 kernel, 64 rows and one warpgroup per program, so that two programs
#: share an SM (221 registers, 106.5 KB shared memory) and one's MMAs overlap the other's softmax:
#: 32.41 ms against 36.16 at 128/8/3 (``kernel_breakdown.py``, 2026-11-30). ``"fp8-tma"``: the same
#: loop reading K̂/V̂ᵀ tiles by TMA (Hopper), 2 stages, which with P rounded on f16 pairs and
#: P̂·V̂ in a fresh accumulator needs at most :data:`FP8_TMA_REGISTER_BUDGET` registers, so that
#: three programs share an SM (73.8 KB of shared memory each, no spills): 158.24 ms at Wan 720p
#: against 160.14 with the budget imposed as a cap and 165.59 at 3 stages (2026-11-30, seventh
#: session; 169.34 in the sixth). NVFP4: ``attention_nvfp4.LAUNCH``.
LAUNCH = {P_NONE: (128, 8, 3), P_MX: (128, 8, 3), "fp8": (64, 4, 3), "fp8-tma": (64, 4, 2)}
#: registers per thread that let three TMA e4m3 programs share an SM: 3 × 128 threads × 168 ≤ 64 K
#: (ptxas allocates 8 at a time). The loop takes 167 by itself; with a key-padding mask it would
#: take 202 (two programs per SM), so masked launches are capped at it (no spills, MMAs still
#: asynchronous; offline sm_90 compiles, tests/test_kernels.py): HunyuanVideo 720p 280.30 ms
#: against 361.89 uncapped; unmasked, the cap costs 1.2% (160.14 against 158.24 ms at Wan 720p;
#: ``kernel_breakdown.py``, H200, 2026-11-30, seventh session)
FP8_TMA_REGISTER_BUDGET = 168


def mx_kernel(recipe: AttentionRecipe, device: torch.device) -> str | None:
    """Which MXFP4 kernel runs this recipe: ``"scaled"`` (``tl.dot_scaled``: native FP4 MMAs on
    sm_100+), ``"fp8"`` (e4m3 tensor cores: sm_89+, and the CPU interpreter) or None (the bf16
    loop: not an MXFP4 recipe, or an older GPU). ``FP4VIDEO_MX_KERNEL=scaled|fp8|bf16`` overrides
    the choice (e.g. to run the Blackwell kernel, emulated, on a Hopper GPU)."""
    import os

    if recipe.qk_format is not Format.MXFP4 or recipe.pv_format is not Format.MXFP4:
        return None
    forced = os.environ.get("FP4VIDEO_MX_KERNEL")
    if forced:
        if forced not in ("scaled", "fp8", "bf16"):
            raise ValueError(f"FP4VIDEO_MX_KERNEL must be 'scaled', 'fp8' or 'bf16', got {forced!r}")
        return None if forced == "bf16" else forced
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return "scaled" if cap >= (10, 0) else "fp8" if cap >= (8, 9) else None
    return "fp8" if os.environ.get("TRITON_INTERPRET") == "1" else None


def tma_loop(device: torch.device) -> bool:
    """Whether the e4m3 loop reads its K̂/V̂ᵀ tiles by TMA on this device: where it can
    (:func:`tma_unsupported_reason`), unless ``FP4VIDEO_MX_TMA=0`` asks for pointer loads (the
    pre-pass then keeps K̂ in key order). ``FP4VIDEO_MX_TMA=1`` where TMA cannot run is an error."""
    import os

    forced = os.environ.get("FP4VIDEO_MX_TMA")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"FP4VIDEO_MX_TMA must be '0' or '1', got {forced!r}")
    reason = tma_unsupported_reason(device)
    if forced == "1" and reason:
        raise ValueError(f"FP4VIDEO_MX_TMA=1, but the e4m3 loop cannot copy tiles by TMA here: {reason}")
    return forced != "0" and reason is None


def tma_unsupported_reason(device: torch.device) -> str | None:
    """Why the e4m3 loop cannot read its tiles by TMA on this device, or None: TMA needs sm_90+
    (Hopper's bulk tensor copies; Ada, sm_89, has none) and a Triton with host tensor descriptors
    (3.3+). The CPU interpreter runs the TMA path only when asked (``tma=True``)."""
    if device.type != "cuda":
        return f"not a CUDA device ({device})"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"sm_{cap[0]}{cap[1]} has no TMA (sm_90+)"
    import importlib.util

    if importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
        return "this Triton has no host tensor descriptors (3.3+)"
    return None


def uses_fp8(recipe: AttentionRecipe, device: torch.device) -> bool:
    """MXFP4 Q·K and P·V run on e4m3 tensor cores."""
    return mx_kernel(recipe, device) == "fp8"


def prepare(q, k, v, recipe: AttentionRecipe, key_alive, mean=None):
    """The pre-pass for this recipe and device: a tuple the attention loop takes. ``mean``: K's
    smoothing mean (:func:`.prepass.k_smoothing_mean`) when the caller has it already."""
    return _prepare_checked(q, k, v, recipe, key_alive, mean, None)[0]


def _prepare_checked(q, k, v, recipe: AttentionRecipe, key_alive, mean, bad):
    """:func:`prepare`, and whether any head is ``bad`` (holds a NaN/Inf; True where unknown). Both
    decisions here read the GPU's answer back in **one** transfer: whether V fits the e4m3 loop's
    window (else the exact bf16 loop runs), and whether heads need poisoning. While a CUDA graph is
    captured nothing can be read back: the window check is skipped and heads are always poisoned."""
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()

    def read_back(*flags):
        """(whether any head is bad, *flags as ints) in one transfer; True / None for what is
        unknown or cannot be read back."""
        wanted = ([bad.any()] if bad is not None else []) + list(flags)
        if capturing or not wanted:
            return (True, *[None] * len(flags))
        values = torch.stack([f.to(torch.int32) for f in wanted]).tolist()
        return (bool(values.pop(0)) if bad is not None else True, *values)

    path = mx_kernel(recipe, q.device)
    if path == "fp8":  # (…, Sk, whether K̂'s rows are in tile key order: where the loop uses TMA)
        tiled = tma_loop(q.device)
        tensors, v_span = prepass_fp8_window(q, k, v, recipe, key_alive, k_tile_order=tiled, mean=mean)
        if bad is not None:  # heads with a NaN/Inf become NaN anyway: their V does not count
            v_span = v_span.masked_fill(bad[..., None], 0)
        has_bad, widest = read_back(v_span.max())
        if widest is None or widest <= E4M3_V_SPAN_LIMIT:
            return ("fp8", (*tensors, k.shape[-2], tiled)), has_bad
        return ("work", prepass(q, k, v, recipe, key_alive, work_dtype(q), mean)), has_bad
    if path == "scaled":
        prepared = ("scaled", prepass_packed(q, k, v, recipe, key_alive, mean))
    elif recipe.pv_format is Format.NVFP4:  # the NVFP4 loops read K̂, V̂ in tile key order, whole tiles
        prepared = ("nvfp4", (*prepass_tiles(q, k, v, recipe, key_alive, work_dtype(q), mean), k.shape[-2]))
    elif recipe.quantized:
        prepared = ("work", prepass(q, k, v, recipe, key_alive, work_dtype(q), mean))
    elif not q.is_cuda and q.dtype != torch.float32:  # the CPU interpreter's 16-bit dots are wrong: fp32 (exact)
        prepared = ("work", (q.float(), k.float(), v.float()))
    else:
        prepared = ("work", (q, k, v))  # the inputs as they are: no copy, any strides
    return prepared, read_back()[0]


def attention(q, k, v, *, recipe: AttentionRecipe, mask, scale: float, **launch):
    """q, k, v: (B, H, S, D) views, any strides. Returns (out (B, H, Sq, Dv) in q's dtype, lse fp32)."""
    return attention_with_key_alive(q, k, v, recipe=recipe, key_alive=key_padding(mask, q.shape[0], k.shape[-2]),
                                    scale=scale, **launch)


def key_padding(mask, b: int, sk: int):
    """A key-padding mask (B|1, 1, 1, Sk) as the kernels' ``key_alive`` (B, Sk), or None."""
    return None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]


def attention_with_key_alive(q, k, v, *, recipe: AttentionRecipe, key_alive, scale: float, **launch):
    """:func:`attention` with the key-padding mask as ``key_alive`` (B, Sk) bool or None."""
    bad = nonfinite_heads(q, k, v, key_alive)  # the NaN/Inf policy: those heads' outputs become NaN
    mean = k_smoothing_mean(k, key_alive) if recipe.smooth_k else None
    prepared, has_bad = _prepare_checked(q, k, v, recipe, key_alive, mean, bad)
    out, lse = attention_prepared(prepared, key_alive, recipe=recipe, scale=scale, out_dtype=q.dtype,
                                  dv=v.shape[-1], **launch)
    if mean is not None:  # the loops' LSE is of the smoothed logits: back to the unsmoothed ones
        lse = lse + smoothing_lse_shift(q, mean, scale)
    if has_bad:  # a pass over the output only where some head holds a NaN/Inf
        poison_heads(out, lse, bad)
    return out, lse


def work_dtype(q: torch.Tensor) -> torch.dtype:
    """FP4 values are exact in bf16; the CPU interpreter has no bf16 matmul, so fp32 there."""
    return torch.bfloat16 if q.is_cuda else torch.float32


def attention_prepared(prepared, key_alive, *, recipe: AttentionRecipe, scale: float, out_dtype, dv: int,
                       block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       **fp8_options):
    """The attention loop alone, on :func:`prepare`'s output; ``dv``: the value head dim."""
    path, tensors = prepared
    if fp8_options and path != "fp8":
        raise ValueError(f"{sorted(fp8_options)}: options of the e4m3 MXFP4 loop, not of the {path!r} path")
    if path == "scaled":
        from .attention_scaled import attention_packed

        return attention_packed(*tensors, key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype, dv=dv,
                                block_m=block_m, num_warps=num_warps, num_stages=num_stages)
    if path == "fp8":
        return _attention_fp8(*tensors, key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype, dv=dv,
                              block_m=block_m, num_warps=num_warps, num_stages=num_stages, **fp8_options)
    if path == "nvfp4":
        qh, kh, vh, sk = tensors
        sm90 = _gluon_nvfp4()
        if sm90 is not None and sm90.choose(qh, vh, launch_given=any((block_m, num_warps, num_stages))) == "sm90":
            return sm90.attention_nvfp4_sm90(qh, kh, vh, key_alive, sk=sk, recipe=recipe, scale=scale,
                                             out_dtype=out_dtype)
        from .attention_nvfp4 import attention_nvfp4

        return attention_nvfp4(qh, kh, vh, key_alive, sk=sk, recipe=recipe, scale=scale, out_dtype=out_dtype,
                               block_m=block_m, num_warps=num_warps, num_stages=num_stages)
    qh, kh, vh = tensors
    b, h, sq, dqk = qh.shape
    sk, dv = kh.shape[-2], vh.shape[-1]
    dev = qh.device
    out = torch.empty(b, h, sq, dv, device=dev, dtype=out_dtype)
    lse = torch.empty(b, h, sq, device=dev, dtype=torch.float32)
    km = _key_mask(key_alive, dev)
    p_mode = {None: P_NONE, Format.MXFP4: P_MX}[recipe.pv_format]
    qb = recipe.pv_format.block if recipe.pv_format else 32
    bm, nw, ns = LAUNCH[p_mode]
    ns = fitting_stages(dev, ns, BF16_LOOP_SHARED_MEMORY)  # 3 stages: 160 KB (1 on ~100 KB GPUs, e.g. sm_86)
    block_m, num_warps, num_stages = block_m or bm, num_warps or nw, num_stages or ns
    grid = (triton.cdiv(sq, block_m), b * h)
    _fp4_attn_fwd[grid](
        qh, kh, vh, km, out, lse,
        h, sq, sk, dqk, dv,
        *qh.stride(), *kh.stride(), *vh.stride(),
        km.stride(0), km.stride(1),
        *out.stride(), *lse.stride(),
        scale,
        HAS_MASK=key_alive is not None, P_MODE=p_mode, QB=qb, OCP=recipe.scale_rule is ScaleRule.OCP,
        QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, IEEE=qh.dtype == torch.float32,
        D=next_pow2(dqk), BLOCK_DV=next_pow2(dv), BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


def _gluon_nvfp4():
    """:mod:`.attention_nvfp4_sm90`, or None where this Triton has no Gluon Hopper API (< 3.5)."""
    try:
        from . import attention_nvfp4_sm90
    except ImportError:
        return None
    return attention_nvfp4_sm90


def _key_mask(key_alive, dev):
    if key_alive is not None:
        return key_alive.to(torch.int8).contiguous()
    return torch.empty(1, 1, dtype=torch.int8, device=dev)


#: shared memory of the e4m3 loop at 64 × 4 (pointer loads; TMA) and of the bf16 loop
#: (``_fp4_attn_fwd``) at 128 × 8, by stages (offline sm_90 compiles, head dim 128): what
#: ``launch.fitting_stages`` checks
FP8_SHARED_MEMORY = {2: 73732, 3: 106504}
FP8_TMA_SHARED_MEMORY = {2: 73764, 3: 106568}
BF16_LOOP_SHARED_MEMORY = {1: 65536, 2: 131072, 3: 163840}


def fp8_launch(device: torch.device, tma: bool = False) -> tuple[int, int, int]:
    """``LAUNCH["fp8"]`` (``LAUNCH["fp8-tma"]``) for this GPU: the pointer loop's 3 stages take
    ~107 KB of shared memory per program at head dim 128, more than Ada's (sm_89) 99 KB per block,
    so there it runs 2 stages (~74 KB; chosen by that limit, not timed: no Ada GPU here)."""
    bm, nw, ns = LAUNCH["fp8-tma" if tma else "fp8"]
    return bm, nw, fitting_stages(device, ns, FP8_TMA_SHARED_MEMORY if tma else FP8_SHARED_MEMORY)


def _attention_fp8(q8, q_fac, k8, k_fac, v8t, v_fac, sk, k_tile_order, key_alive, *, recipe, scale, out_dtype, dv,
                   block_m, num_warps, num_stages, quantize_p=True, warp_specialize=False, precise_qk=False,
                   precise_pv=False, tma=None, max_registers=None, f16_p=True, fresh_pv=None):
    """The e4m3 loop on :func:`.prepass.prepass_fp8`'s outputs for ``sk`` keys (``k_tile_order``:
    K̂'s rows are in tile key order, padded to whole tiles). ``tma``: K̂/V̂ᵀ tiles by TMA (None:
    where K̂ is in tile order, i.e. as :func:`prepare` chose for the device). ``f16_p``: P
    rounded on f16 pairs (:func:`.fp4_math.round_e2m1_f16x2_odd`), else in fp32 (slower; the
    same values but at exact ties). ``fresh_pv``: ``FRESH_PV`` (None: with TMA, where it pays;
    the pointer-load loop, not register-bound, is faster overlapping P̂·V̂ with the next tile:
    163.49 against 169.04 ms at Wan 720p). ``max_registers``: a cap (ptxas spills past it; None:
    :data:`FP8_TMA_REGISTER_BUDGET` for the masked TMA loop, else none)."""
    b, h, sq, d = q8.shape
    sk_pad, dvp = k8.shape[-2], v8t.shape[-2]
    tma = k_tile_order if tma is None else tma
    if tma and not k_tile_order:
        raise ValueError("tma=True copies K̂ tiles as stored: it needs K̂ in tile key order "
                         "(prepass_fp8(..., k_tile_order=True))")
    if tma and q8.is_cuda and (reason := tma_unsupported_reason(q8.device)):
        raise ValueError(f"tma=True, but the e4m3 loop cannot copy tiles by TMA here: {reason}")
    if v8t.shape[-1] % KEY_TILE or (k_tile_order and sk_pad % KEY_TILE):
        raise ValueError(f"V̂ᵀ (and K̂ in tile order) must be padded to whole key tiles of {KEY_TILE} (prepass_fp8 "
                         f"does), got {v8t.shape[-1]} (and {sk_pad})")
    dev = q8.device
    out = torch.empty(b, h, sq, dv, device=dev, dtype=out_dtype)
    lse = torch.empty(b, h, sq, device=dev, dtype=torch.float32)
    km = _key_mask(key_alive, dev)
    bm, nw, ns = fp8_launch(dev, tma)
    if tma and key_alive is not None and max_registers is None and not any((block_m, num_warps, num_stages)):
        max_registers = FP8_TMA_REGISTER_BUDGET  # three programs per SM (the mask's loads need registers)
    block_m, num_warps, num_stages = block_m or bm, num_warps or nw, num_stages or ns
    kt, vt = k8, v8t
    if tma:  # K̂ as (B·H·Sk_pad, D) rows and V̂ᵀ as (B·H·Dv_pad, Sk_pad) rows: one box per key tile
        from triton.tools.tensor_descriptor import TensorDescriptor

        kt = TensorDescriptor.from_tensor(k8.reshape(b * h * sk_pad, d), [KEY_TILE, d])
        vt = TensorDescriptor.from_tensor(v8t.reshape(b * h * dvp, v8t.shape[-1]), [dvp, KEY_TILE])
    _mx_fp8_attn_fwd[(triton.cdiv(sq, block_m), b * h)](
        q8, q_fac, kt, k_fac, vt, v_fac, km, out, lse,
        h, sq, sk, dv,
        *q8.stride()[:3], *k8.stride()[:3], *v8t.stride()[:3],
        km.stride(0), km.stride(1), sk_pad,
        *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d, BLOCK_DV=dvp, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        QB=recipe.pv_format.block, EXP_FLOOR=TILE_EXP_FLOOR, QUANTIZE_P=quantize_p, WARP_SPEC=warp_specialize,
        PRECISE_QK=precise_qk, PRECISE_PV=precise_pv, TMA=tma, K_TILE_ORDER=k_tile_order,
        F16_P=f16_p, ASM=q8.is_cuda, FRESH_PV=tma if fresh_pv is None else fresh_pv,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,  # explicit tl.fma only
        **({"maxnreg": max_registers} if max_registers else {}),  # registers per thread (ptxas spills the rest)
    )
    return out, lse
