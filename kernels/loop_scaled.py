"""MXFP4 attention through ``tl.dot_scaled``: packed E2M1 operands with E8M0 block scales.

On Blackwell (sm_100 / sm_120) Triton lowers ``tl.dot_scaled(.., "e2m1", .., "e2m1")`` to the
native FP4 MMAs (``tcgen05.mma … kind::mxf4`` / ``mma.sync … kind::mxf4nvf4``; the tests
compile this kernel for those targets offline and check). Every MXFP4
block of the method maps onto the MMA's own scale blocks: Q and K blocks of 32 along the head
dim (the QKᵀ reduction), P blocks of 32 keys per row and V blocks of 32 tokens per channel (the
PV reduction). No e4m3 window applies: every block carries its own E8M0 scale.

On Hopper and older, Triton emulates ``dot_scaled`` (operands upcast to bf16), so the e4m3 kernel
of :mod:`.loop_e4m3` is the fast path there; this one still runs and matches the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4video.formats import ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from .fp4_math import e2m1_magnitude_codes, mx_block_exponent, pack_nibbles, pow2, round_e2m1_at_scale
from .launch import LoopLaunch
from .tiles import LOG2E, key_mask, outputs, program_rows, store_out_lse


@triton.jit
def _scaled_tile(q4, q_sc, m_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, SK_PAD, sks,
                 svd, svsd, sms, scale_log2,
                 HAS_MASK: tl.constexpr, TAIL: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
                 PNQ: tl.constexpr, D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, QB: tl.constexpr):
    """One key tile: returns the updated (m, l, acc); m in log2 units."""
    NB: tl.constexpr = BLOCK_N // QB
    keys = start + tl.arange(0, BLOCK_N)
    half_d = tl.arange(0, D // 2)
    nb_d = tl.arange(0, D // QB)
    dv = tl.arange(0, BLOCK_DV)
    key_ok = keys < SK
    k4 = tl.load(K_base + keys[:, None] * sks + half_d[None, :], mask=key_ok[:, None], other=0)
    k_sc = tl.load(KS_base + keys[:, None] * (D // QB) + nb_d[None, :], mask=key_ok[:, None], other=127)
    s = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), k_sc, "e2m1") * scale_log2
    if HAS_MASK:
        km = tl.load(M_base + keys * sms, mask=key_ok, other=0)
        s = tl.where((km != 0)[None, :], s, float("-inf"))
    elif TAIL:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    block_max = tl.max(tl.reshape(s, (BLOCK_M, NB, QB)), axis=2)
    m_new = tl.maximum(m_i, tl.max(block_max, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    amax = tl.exp2(block_max - m_safe[:, None])  # the block maximum of P̃ (exp2 is monotonic)
    e_blk = tl.where(amax > 0, tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126), 0)
    p = tl.exp2(s - m_safe[:, None])
    p3 = tl.reshape(p, (BLOCK_M, NB, QB))
    p_hat3 = round_e2m1_at_scale(p3, pow2(e_blk)[:, :, None])
    codes = tl.reshape(e2m1_magnitude_codes(p_hat3 * pow2(-e_blk)[:, :, None]), (BLOCK_M, BLOCK_N))
    alpha = tl.exp2(m_i - m_safe)
    if PNQ:
        l_i = tl.fma(alpha, l_i, tl.sum(tl.reshape(p_hat3, (BLOCK_M, BLOCK_N)), axis=1))
    else:
        l_i = tl.fma(alpha, l_i, tl.sum(p, axis=1))
    half_n = start // 2 + tl.arange(0, BLOCK_N // 2)
    nb_n = start // QB + tl.arange(0, NB)
    v4t = tl.load(V_base + dv[:, None] * svd + half_n[None, :])  # padded to whole tiles: no mask
    v_sc = tl.load(VS_base + dv[:, None] * svsd + nb_n[None, :])
    pv = tl.dot_scaled(pack_nibbles(codes, BLOCK_M, BLOCK_N), (e_blk + 127).to(tl.uint8), "e2m1",
                       tl.trans(v4t), v_sc, "e2m1")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _mx_scaled_attn_fwd(
    Q4, QS, K4, KS, V4T, VS, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svd, svsd,
    smb, sms,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
):
    """Online-softmax MXFP4 attention on ``tl.dot_scaled``; operands from :func:`.prepass.prepass_packed`."""
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    bh = tl.program_id(1)
    half_d = tl.arange(0, D // 2)
    nb_d = tl.arange(0, D // QB)
    q4 = tl.load(Q4 + b * sqb + h * sqh + offs_m[:, None] * sqs + half_d[None, :], mask=row_ok[:, None], other=0)
    q_sc = tl.load(QS + (bh * SQ + offs_m)[:, None] * (D // QB) + nb_d[None, :], mask=row_ok[:, None], other=127)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    K_base = K4 + b * skb + h * skh
    KS_base = KS + bh * SK * (D // QB)
    V_base = V4T + b * svb + h * svh
    VS_base = VS + bh * BLOCK_DV * svsd
    M_base = KeyMask + b * smb
    n_full = (SK // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _scaled_tile(
            q4, q_sc, m_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, SK_PAD, sks, svd, svsd,
            sms, scale_log2, HAS_MASK, False, OCP, QMAX, PNQ, D, BLOCK_DV, BLOCK_M, BLOCK_N, QB)
    if n_full < SK:
        m_i, l_i, acc = _scaled_tile(
            q4, q_sc, m_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, n_full, SK, SK_PAD, sks, svd, svsd,
            sms, scale_log2, HAS_MASK, True, OCP, QMAX, PNQ, D, BLOCK_DV, BLOCK_M, BLOCK_N, QB)

    store_out_lse(Out, Lse, acc, 1.0, l_i, m_i, 0.0, b, h, offs_m, row_ok, tl.arange(0, BLOCK_DV), DV,
                  sob, soh, sos, sod, slb, slh, sls)


#: Shared memory (bytes), compiled offline (Triton 3.9, head dim 128, masked, 8 warps): the same at 1-3 stages
SHARED_MEMORY = {"sm_100": {1: 32768, 2: 32768, 3: 32768}, "sm_120": {1: 32768, 2: 32768, 3: 32768}}
LAUNCH = LoopLaunch(128, 8, 2, shared_memory=SHARED_MEMORY, reason="not tuned: no Blackwell GPU has run it")


def attention_packed(q4, q_scale, k4, k_scale, v4t, v_scale, key_alive, *, recipe: AttentionRecipe, scale: float,
                     out_dtype, dv: int, block_m=None, num_warps=None, num_stages=None):
    """The loop on :func:`.prepass.prepass_packed`'s output. Returns (out, lse)."""
    b, h, sq, d2 = q4.shape
    sk, dvp, sk_pad = k4.shape[-2], v4t.shape[-2], v4t.shape[-1] * 2
    dev = q4.device
    out, lse = outputs(q4.shape, dv, dev, out_dtype)
    km = key_mask(key_alive, dev)
    block_m, num_warps, num_stages = LAUNCH.resolve(dev, block_m, num_warps, num_stages)
    _mx_scaled_attn_fwd[(triton.cdiv(sq, block_m), b * h)](
        q4, q_scale, k4, k_scale, v4t, v_scale, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q4.stride()[:3], *k4.stride()[:3], *v4t.stride()[:3], v_scale.stride(2),
        km.stride(0), km.stride(1),
        *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d2 * 2, BLOCK_DV=dvp, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        QB=recipe.pv_format.block, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,  # explicit tl.fma only, as the reference
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _mx_scaled_attn_fwd
