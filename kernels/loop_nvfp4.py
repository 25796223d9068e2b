"""NVFP4 attention (``nvfp4``, ``sage3``, ``sage3-hpnq``) on bf16 tensor cores.

Q̂, K̂, V̂ come from the bf16 pre-pass (:func:`.prepass.prepass_tiles`): NVFP4 values (E2M1 times
an E4M3 scale: at most 6 significant bits) are exact in bf16, and so is every P̂ value. NVFP4
cannot use the e4m3 tensor cores the MXFP4 methods use: its products need more bits than e4m3 has.

The loop is laid out like the e4m3 MXFP4 loop of :mod:`.loop_e4m3`: the keys of each tile sit
in :func:`.key_order.mma_key_order` (QB = 32; the pre-pass stores K̂ and V̂ rows in that order, padded with zero
rows to whole tiles), so each lane of an MMA quad holds 32 consecutive keys of every row, i.e.
two whole NVFP4 blocks of 16. Block maxima, E4M3 scales and their reciprocals are then
computed once per lane and block, with no cross-lane work. For 16-bit operands the accumulator
layout of Q̂·K̂ᵀ is already the A-operand layout of P̂·V̂, so P̂ needs no relabelling, only V̂'s
rows in the same key order.

Numerics: those of the reference (:func:`fp4video.reference.quantize_p`): the same block scales
and two-level row factors bit for bit (their divisions are FMA sequences proven correctly
rounded, :mod:`.fp4_math`), and E2M1 rounding of P̃ times one per-block factor, the correctly
rounded reciprocal of the scale (times the two-level factor): within 2.5 ulp of the reference's
divided value, so an element that close to a rounding boundary may round the other way; fp32
accumulation in another order. The two-level row factor is folded into the accumulator's units
(one per-row rescale per tile, like the softmax's), so the P̂·V̂ MMA accumulates in place; the
rescale's ratio r_old / r_new is taken as r_old · (448·6 / rowmax), within 2 ulp of the quotient
(the reference has no such step: it scales each P̂ by its own factor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.formats import Format
from fp4video.recipe import AttentionRecipe, PScale, RowSum
from fp4video.reference import KEY_TILE, TWO_LEVEL_P_FLOOR, TWO_LEVEL_P_RANGE

from .fp4_math import (const_div_rn, div_const_rn, e2m1_times_scale, nvfp4_block_scale, pow2, recip_rn_few_bits,
                       round_e2m1_at_scale, round_e4m3_signed)
from .launch import LoopLaunch
from .operands import TileOperands
from .plan import Plan
from .tiles import LOG2E, key_mask, next_pow2, outputs, program_rows, store_out_lse, tile_logits

#: rn(1 / (448·6)) in fp32, for div_const_rn
RCP_P_RANGE = tl.constexpr(float(torch.tensor(1.0 / TWO_LEVEL_P_RANGE, dtype=torch.float32)))
P_FLOOR = tl.constexpr(TWO_LEVEL_P_FLOOR)

#: Shared memory (bytes) per number of stages, compiled offline (Triton 3.9, head dim 128, masked, 8
#: warps): 3 stages fit Hopper but not sm_100 (233,504 > 232,448), 2 fit sm_120's 99 KB.
SHARED_MEMORY = {"sm_90": {1: 65536, 2: 163840, 3: 229376}, "sm_100": {1: 65544, 2: 167968, 3: 233504},
                 "sm_120": {1: 65536, 2: 98304, 3: 163840}}
LAUNCH = LoopLaunch(
    128, 8, 3, shared_memory=SHARED_MEMORY,
    reason="as many stages as fit (each one more is faster); 3 stages (224 KB) fit Hopper only: 2 on A100 "
           "and B200, 1 on Ada's 99 KB, 2 on sm_120's")


@triton.jit
def _rows3(x):
    """A per-row vector (as :func:`_row_reduce3` leaves it) broadcast to the blocks' (row, jh, t)."""
    return x[:, None][:, None, :]


@triton.jit
def _rows6(x):
    """A per-row vector (as :func:`_row_reduce3` leaves it) broadcast to its 6-d tile."""
    return _rows3(x)[:, :, None, None, :, None]


@triton.jit
def _blocks6(x):
    """A per-block (row, jh, t) tensor broadcast to its 6-d tile."""
    return x[:, :, None, None, :, None]


@triton.jit
def _row_reduce3(x, MAX: tl.constexpr):
    """Row maxima (MAX) or sums of a per-block (row, jh, t) tensor: jh first (within the thread),
    then t (across a lane quad: one butterfly per row, not one per block). Every row vector here
    comes from this order (the same layout in Gluon)."""
    if MAX:
        return tl.max(tl.max(x, axis=1), axis=1)
    else:
        return tl.sum(tl.sum(x, axis=1), axis=1)


@triton.jit
def _row_sum6(x):
    """Row sums of a 6-d tile: per block (within the thread), then :func:`_row_reduce3`."""
    return _row_reduce3(tl.sum(tl.sum(tl.sum(x, axis=5), axis=3), axis=2), False)


@triton.jit
def two_level_factors(rmax, r_i, P_RANGE: tl.constexpr, FAST_RCP: tl.constexpr):
    """Two-level P of one key tile from its largest P̃ per row ``rmax``: (inv_s1 = rn(448·6 / r),
    the pre-scale of P̃; r_new = rn(r / (448·6)), the units of P̂ and of the accumulator; acc_ratio
    = r_i / r_new, the accumulator's rescale), with r = max(rmax, the reference's floor). The
    floor keeps the pre-scale and the units finite however far below the running maximum the tile
    lies; a tile with no live key (rmax = 0: its P̂ is 0 whatever the factor) keeps the units. The
    ratio is taken without a division: 1 / r_new = rmax⁻¹·P_RANGE ≈ inv_s1 (within 2 ulp; the
    accumulator's rescaling is not part of the reference's rounding)."""
    live = rmax > 0
    r_floor = tl.maximum(rmax, P_FLOOR)
    inv_s1 = const_div_rn(P_RANGE, r_floor, FAST_RCP)
    r_new = tl.where(live, div_const_rn(r_floor, P_RANGE, RCP_P_RANGE), r_i)
    return inv_s1, r_new, tl.where(live, r_i * inv_s1, 1.0)


@triton.jit
def block_scale_and_reciprocal(amax, FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr):
    """NVFP4 block scales of P from the blocks' maxima, and their correctly rounded reciprocals:
    elements are multiplied by the reciprocal (times the two-level factor), not divided, so
    p · rn(inv_s1 · rn(1/s)) is within 2.5 ulp of the reference's rn(rn(p · inv_s1) / s) and an
    element that close to an E2M1 rounding boundary may round the other way; a block whose scale
    rounds to 0 becomes 0 (reciprocal 0)."""
    scale = nvfp4_block_scale(amax, HW_E4M3)
    live_b = scale > 0
    return scale, tl.where(live_b, recip_rn_few_bits(tl.where(live_b, scale, 1.0), FAST_RCP), 0.0)


@triton.jit
def nv_row_vector(tile, value):
    """A per-row vector of ``value`` in the layout :func:`nv_quantize_p`'s row vectors have (for the
    Gluon kernel's initial state; ``tile``: any finite tile of S's shape and layout)."""
    BLOCK_M: tl.constexpr = tile.shape[0]
    NV: tl.constexpr = (BLOCK_M, 2, 2, 4, 4, 2)
    bmax = tl.max(tl.max(tl.max(tl.reshape(tile, NV), axis=5), axis=3), axis=2)
    return _row_reduce3(bmax, True) * 0.0 + value


@triton.jit
def nv_quantize_p(qk, m_i, r_i, l_i, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr,
                  PNQ: tl.constexpr, FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr, P_DTYPE: tl.constexpr,
                  P_E4M3: tl.constexpr = False):
    """Online softmax and NVFP4 quantization of one key tile of logits ``qk`` in log2 units
    (BLOCK_M × 128, keys in ``mma_key_order`` with QB = 32, scaled and then masked keys selected to
    -inf: :func:`.tiles.scaled_masked`): the part both NVFP4 loops (this module's and the Gluon one
    of :mod:`.loop_nvfp4_sm90`) share. P̃ = exp2(qk - m), the exact difference of two rounded
    logits near the maximum, so the row's largest is exactly 1 however large the logits (a fused
    ``qk · scale - m`` kept the product's rounding residual, up to half an ulp of m: P̃ of 2^16 at
    1e8 nats, beyond the E4M3 block scales' 448).

    Returns (P̂ in units of r_new as ``P_DTYPE`` (V̂'s bf16 or fp16, exact), (BLOCK_M, 128),
    m_new (log2 units), r_new (the tile's two-level row factor, 1 without two-level scaling),
    l_new, acc_scale): the caller rescales its accumulator by acc_scale (= alpha · r_i / r_new, the
    ratio taken from inv_s1 without a division) and adds P̂·V̂. FAST_RCP: the GPU's instructions
    (sm_80+: the approximate reciprocal of :func:`.fp4_math.approx_recip`, the packed 16-bit
    steps of :func:`.fp4_math.e2m1_times_scale`; False in the interpreter, which has no inline PTX).
    HW_E4M3: the block scales by the hardware's E4M3 conversion (:func:`.fp4_math.nvfp4_block_scale`;
    sm_89+, not in the interpreter, whose fp8 conversion rounds differently). P_E4M3 (``sage3-pv8``,
    the Triton loop only): P̃ in E4M3 with one power-of-two scale per row and tile instead
    (:func:`fp4video.formats.e4m3_pow2_quantize_dequantize`), exact in bf16.
    """
    BLOCK_M: tl.constexpr = qk.shape[0]
    tl.static_assert(qk.shape[1] == 128, "the lane layout below is that of 128-key tiles")
    # column c = 8j + 2t + e holds key 32t + 2j + e: the NVFP4 block (16 keys) is 2t + j // 8.
    # j = 8·jh + 4·j1 + j0 spread over three axes, so that block reductions are short trees; every
    # reduction and broadcast keeps one axis order (Gluon's explicit layouts need it)
    NV: tl.constexpr = (BLOCK_M, 2, 2, 4, 4, 2)  # (row, jh, j1, j0, t, e)
    s6 = tl.reshape(qk, NV)
    bmax = tl.max(tl.max(tl.max(s6, axis=5), axis=3), axis=2)  # (row, jh, t): blocks
    tile_max = _row_reduce3(bmax, True)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # P̃ = exp2(qk - m); the blocks' maxima with the same subtraction on their largest logit, so
    # they equal the largest P̃ of their block bit for bit (exp2 is monotonic)
    amax = tl.exp2(bmax - _rows3(m_safe))
    p = tl.exp2(s6 - _rows6(m_safe))
    if P_E4M3:  # the tile's largest P̃ (from its largest logit, the same arithmetic) into [128, 256)
        rmax = tl.exp2(tile_max - m_safe)
        k = tl.minimum(7 - (((rmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127), 126)
        q = round_e4m3_signed(p * _rows6(pow2(k)), HW_E4M3).to(tl.float32) * _rows6(pow2(-k))
        alpha = tl.exp2(m_i - m_safe)
        l_new = tl.fma(alpha, l_i, _row_sum6(q if PNQ else p))
        return tl.reshape(q.to(P_DTYPE), (BLOCK_M, 128)), m_new, r_i, l_new, alpha
    if TWO_LEVEL:  # P̃ · (448·6 / rowmax P̃) is quantized; P̂ = that · (rowmax / (448·6))
        rmax = tl.exp2(tile_max - m_safe)  # the largest amax (monotonic): no reduction
        inv_s1, r_new, acc_ratio = two_level_factors(rmax, r_i, P_RANGE, FAST_RCP)
        amax = amax * _rows3(inv_s1)  # the block maxima of the scaled P̃ (a monotonic rounding)
    else:
        r_new = r_i
        acc_ratio = 1.0
    scale, inv = block_scale_and_reciprocal(amax, FAST_RCP, HW_E4M3)
    if TWO_LEVEL:
        inv = inv * _rows3(inv_s1)
    alpha = tl.exp2(m_i - m_safe)
    if PNQ:  # the row sum of P̂ = q · r_new
        q = round_e2m1_at_scale(p * _blocks6(inv), 1.0) * _blocks6(scale)
        part = _row_sum6(q) * r_new
        p_hat = q.to(P_DTYPE)
    else:  # the saturation and the block scale on packed 16-bit pairs (same bits)
        p_hat = e2m1_times_scale(p * _blocks6(inv), _blocks6(scale), P_DTYPE, FAST_RCP)
        part = _row_sum6(p)
    l_new = tl.fma(alpha, l_i, part)
    return tl.reshape(p_hat, (BLOCK_M, 128)), m_new, r_new, l_new, alpha * acc_ratio


@triton.jit
def _nv_tile(qk, m_i, r_i, l_i, acc, V_base, start, SK, svs, DV,
             TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr,
             IEEE: tl.constexpr, FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, DV_PAD: tl.constexpr, P_E4M3: tl.constexpr = False):
    """:func:`nv_quantize_p` and P̂·V̂ for one key tile. Returns the updated (m, r, l, acc): m in
    log2 units, acc in units of r (the last tile's two-level row factor)."""
    tl.static_assert(BLOCK_N == 128, "the lane layout of nv_quantize_p is that of 128-key tiles")
    p_hat, m_new, r_new, l_i, acc_scale = nv_quantize_p(qk, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ,
                                                           FAST_RCP, HW_E4M3, V_base.dtype.element_ty, P_E4M3)
    offs_dv = tl.arange(0, BLOCK_DV)
    # V̂ is stored in tile key order and padded to whole tiles (prepass.prepass_tiles): its rows
    # are read as stored, without a bounds mask (V's offsets are not hoisted out of the loop like
    # K's: the extra registers made it spill)
    ptrs = V_base + (start + tl.arange(0, BLOCK_N))[:, None] * svs + offs_dv[None, :]
    if DV_PAD:
        v = tl.load(ptrs, mask=(offs_dv < DV)[None, :], other=0.0)
    else:
        v = tl.load(ptrs)
    acc = acc * acc_scale[:, None]
    if IEEE:
        acc = tl.dot(p_hat, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p_hat, v, acc)
    return m_new, r_new, l_i, acc


@triton.jit
def _nv_attn_fwd(
    Q, K, V, KeyMask, Out, Lse,
    H, SQ, SK, DV,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svs,
    smb, sms,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr,
    IEEE: tl.constexpr, FAST_RCP: tl.constexpr, HW_E4M3: tl.constexpr, D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_E4M3: tl.constexpr = False,
):
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    r_i = tl.full((BLOCK_M,), 1.0, tl.float32)  # units of acc
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    K_base = K + b * skb + h * skh
    V_base = V + b * svb + h * svh
    M_base = KeyMask + b * smb
    n_full = (SK // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):
        qk = tile_logits(q, scale_log2, K_base, M_base, start, SK, sks, sms, HAS_MASK, False, D, BLOCK_N, 32, IEEE,
                         True)
        m_i, r_i, l_i, acc = _nv_tile(qk, m_i, r_i, l_i, acc, V_base, start, SK, svs, DV, TWO_LEVEL,
                                      P_RANGE, PNQ, IEEE, FAST_RCP, HW_E4M3, BLOCK_M, BLOCK_N, BLOCK_DV,
                                      DV_PAD, P_E4M3)
    if n_full < SK:
        qk = tile_logits(q, scale_log2, K_base, M_base, n_full, SK, sks, sms, HAS_MASK, True, D, BLOCK_N, 32, IEEE,
                         True)
        m_i, r_i, l_i, acc = _nv_tile(qk, m_i, r_i, l_i, acc, V_base, n_full, SK, svs, DV, TWO_LEVEL,
                                      P_RANGE, PNQ, IEEE, FAST_RCP, HW_E4M3, BLOCK_M, BLOCK_N, BLOCK_DV,
                                      DV_PAD, P_E4M3)

    store_out_lse(Out, Lse, acc, r_i[:, None], l_i, m_i, 0.0, b, h, offs_m, row_ok, tl.arange(0, BLOCK_DV), DV,
                  sob, soh, sos, sod, slb, slh, sls)  # acc is in units of the last two-level row factor


def nv_launch_args(qh, kh, vh, key_alive, *, sk: int, recipe: AttentionRecipe, scale: float, out_dtype):
    """What both NVFP4 kernels (this module's and :mod:`.loop_nvfp4_sm90`'s) take: the outputs,
    the runtime arguments by parameter name and the shared constexprs, for :func:`.prepass.prepass_tiles`' outputs
    (Q̂ (B, H, Sq, D); K̂, V̂ (B, H, Sk_pad, ·) in tile key order) and ``sk`` keys."""
    for name, t in (("q", qh), ("k", kh), ("v", vh)):
        if t.stride(-1) != 1:
            raise ValueError(f"the NVFP4 kernel wants {name} contiguous along its last dim (the pre-pass writes it so)")
    if kh.shape[-2] != -(-sk // KEY_TILE) * KEY_TILE or vh.shape[-2] != kh.shape[-2]:
        raise ValueError(f"the NVFP4 kernel wants K̂ and V̂ padded to whole tiles of {KEY_TILE} keys "
                         f"(prepass_tiles writes them so), got {kh.shape[-2]} and {vh.shape[-2]} rows for {sk} keys")
    b, h, sq, d = qh.shape
    dv = vh.shape[-1]
    out, lse = outputs(qh.shape, dv, qh.device, out_dtype)
    km = key_mask(key_alive, qh.device)
    values = (qh, kh, vh, km, out, lse,
              h, sq, sk, dv,
              *qh.stride()[:3], *kh.stride()[:3], *vh.stride()[:3],
              km.stride(0), km.stride(1),
              *out.stride(), *lse.stride(),
              scale * LOG2E)
    args = dict(zip(_nv_attn_fwd.arg_names, values))  # by name: the Gluon loop takes the same names
    meta = dict(HAS_MASK=key_alive is not None, TWO_LEVEL=recipe.p_scale is PScale.TWO_LEVEL,
                P_RANGE=TWO_LEVEL_P_RANGE, PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d, BLOCK_N=KEY_TILE)
    return out, lse, args, meta


def attention_nvfp4(ops: TileOperands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float, out_dtype,
                    dv: int, exact: bool = True, block_m=None, num_warps=None, num_stages=None):
    """The NVFP4 loop on :func:`.prepass.prepass_tiles`' operands (contiguous along D). The loop has
    one exponent form, exact at any logit magnitude (``exact`` is the call's uniform argument)."""
    qh, kh, vh = ops.q, ops.k, ops.v
    if dv != vh.shape[-1]:
        raise ValueError(f"dv={dv}, but V̂ has {vh.shape[-1]} channels")
    out, lse, args, meta = nv_launch_args(qh, kh, vh, key_alive, sk=ops.sk, recipe=recipe, scale=scale,
                                          out_dtype=out_dtype)
    b, h, sq, _ = qh.shape
    block_dv = next_pow2(dv)
    block_m, num_warps, num_stages = LAUNCH.resolve(qh.device, block_m, num_warps, num_stages)
    cap = torch.cuda.get_device_capability(qh.device) if qh.is_cuda else (0, 0)
    _nv_attn_fwd[(triton.cdiv(sq, block_m), b * h)](  # packed bf16x2 / f16x2 min and fma: sm_80+; cvt to e4m3: sm_89+
        **args, **meta, IEEE=qh.dtype == torch.float32, FAST_RCP=cap >= (8, 0), HW_E4M3=cap >= (8, 9), BLOCK_DV=block_dv,
        DV_PAD=block_dv != dv, P_E4M3=recipe.pv_format is Format.E4M3,
        BLOCK_M=block_m, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,  # explicit tl.fma only
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _nv_attn_fwd
