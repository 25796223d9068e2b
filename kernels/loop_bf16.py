"""The bf16 attention loop: ``fp16`` everywhere, and the MXFP4 methods where no faster loop runs
(GPUs older than sm_89, and an e4m3 call whose V does not fit e4m3's window).

Q̂, K̂, V̂ come from :func:`.prepass.prepass` (dequantized FP4 values, exact in bf16); the P tile
is quantized in the loop (:func:`.fp4_math.fake_quant_rows`, exact in bf16) and both products run
on bf16 tensor cores with fp32 accumulation. ``fp16`` reads the inputs as they are (fp32 inputs
with IEEE-precision dots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from .fp4_math import FMT_MXFP4, FMT_NONE, fake_quant_rows
from .launch import LoopLaunch
from .operands import KeyTileLists, WorkOperands
from .plan import Plan
from .tiles import (key_mask, next_pow2, outputs, program_rows, sparse_rows, store_out_lse,
                    visited_tiles)

#: P quantization modes (constexpr): none (``fp16``), MXFP4 blocks of QB keys
#: ``P_MODE``: P kept, or quantized to MXFP4 (the format codes of :func:`.fp4_math.fake_quant_rows`)
P_NONE, P_MX = FMT_NONE, FMT_MXFP4

#: Shared memory (bytes) per number of stages, compiled offline (Triton 3.9, head dim 128, MXFP4 P,
#: masked, 8 warps)
SHARED_MEMORY = {"sm_90": {1: 65536, 2: 163840, 3: 229376}, "sm_100": {1: 69632, 2: 164384, 3: 229920},
                 "sm_120": {1: 65536, 2: 98304, 3: 163840}}
LAUNCH = LoopLaunch(
    128, 8, 3, shared_memory=SHARED_MEMORY,
    reason="128 rows x 8 warps x 3 stages: the fastest launch for fp16 and MXFP4 on Hopper; 1 stage on Ada's "
           "and sm_86's ~100 KB, 2 on sm_120's")


@triton.jit
def _key_tile(q, m_i, l_i, acc, K, V, KeyMask, start, b, h, SK, DQK, DV, skb, skh, sks, skd, svb, svh, svs, svd, smb,
              sms, scale, HAS_MASK: tl.constexpr, P_MODE: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr,
              QMAX: tl.constexpr, PNQ: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tile of keys [start, start + BLOCK_N) (those past SK masked): the updated (m, l, acc),
    m in natural-log units."""
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
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
    s = tl.where(valid[None, :], s, float("-inf"))  # scaled first, then selected: no -inf is multiplied
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    p_hat = p if P_MODE == P_NONE else fake_quant_rows(p, BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX, False)
    if PNQ:
        l_i = alpha * l_i + tl.sum(p_hat, axis=1)
    else:
        l_i = alpha * l_i + tl.sum(p, axis=1)
    # a dead key's V row is selected away (loaded as 0), not multiplied by its zero weight:
    # ``fp16`` reads V as given, and a NaN / Inf there would turn 0 · v into NaN
    v = tl.load(V + b * svb + h * svh + keys[:, None] * svs + offs_dv[None, :] * svd,
                mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if IEEE:
        acc = tl.dot(p_hat, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p_hat.to(v.dtype), v, acc * alpha[:, None])
    m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _bf16_attn_fwd(
    # pointers
    Q, K, V, KeyMask, KIdx, KCnt, Out, Lse,
    # sizes
    H, SQ, SK, DQK, DV, NQT, NKT,
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
    SPARSE: tl.constexpr = False, QT: tl.constexpr = 128,
):
    """Online-softmax attention on bf16 (IEEE: fp32) tensor cores, P quantized per P_MODE. SPARSE:
    the program visits only its query tile's key tiles (``KIdx``, ``KCnt``:
    :class:`.operands.KeyTileLists`), in ascending order."""
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < DQK), other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if SPARSE:
        visits, n_whole, tail = visited_tiles(KIdx, KCnt, NQT, NKT, SK, QT, BLOCK_M, BLOCK_N)
        for i in range(0, n_whole + (tail >= 0).to(tl.int32)):  # keys past SK are masked in every tile
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, K, V, KeyMask, tl.load(visits + i) * BLOCK_N, b, h, SK, DQK, DV,
                                      skb, skh, sks, skd, svb, svh, svs, svd, smb, sms, scale, HAS_MASK, P_MODE, QB, OCP,
                                      QMAX, PNQ, IEEE, D, BLOCK_DV, BLOCK_M, BLOCK_N)
    else:
        for start in range(0, SK, BLOCK_N):
            m_i, l_i, acc = _key_tile(q, m_i, l_i, acc, K, V, KeyMask, start, b, h, SK, DQK, DV, skb, skh, sks, skd,
                                      svb, svh, svs, svd, smb, sms, scale, HAS_MASK, P_MODE, QB, OCP, QMAX, PNQ, IEEE,
                                      D, BLOCK_DV, BLOCK_M, BLOCK_N)

    # m in natural-log units here (tl.exp): to log2 units for the common end
    store_out_lse(Out, Lse, acc, 1.0, l_i, m_i * 1.4426950408889634, 0.0, b, h, offs_m, row_ok,
                  tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)


def attention_bf16(ops: WorkOperands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float, out_dtype,
                   dv: int, exact: bool = True, block_m=None, num_warps=None, num_stages=None,
                   visit: KeyTileLists | None = None):
    """The loop on :func:`.prepass.prepass`'s operands (or the inputs themselves for ``fp16``): (B, H,
    S, D) views, any strides. The loop has one exponent form, exact at any logit magnitude (``exact``
    is the call's uniform argument). ``visit``: a block-sparse call's key tiles (None: every tile).
    Returns (out (B, H, Sq, Dv) in ``out_dtype``, lse fp32)."""
    qh, kh, vh = ops.q, ops.k, ops.v
    b, h, sq, dqk = qh.shape
    sk = kh.shape[-2]
    if dv != vh.shape[-1]:
        raise ValueError(f"dv={dv}, but V̂ has {vh.shape[-1]} channels")
    dev = qh.device
    out, lse = outputs(qh.shape, dv, dev, out_dtype)
    km = key_mask(key_alive, dev)
    p_mode = {None: P_NONE, Format.MXFP4: P_MX}[recipe.pv_format].value
    given = block_m is not None
    block_m, num_warps, num_stages = LAUNCH.resolve(dev, block_m, num_warps, num_stages)
    block_m = sparse_rows(visit, block_m, given)
    _bf16_attn_fwd[(triton.cdiv(sq, block_m), b * h)](
        qh, kh, vh, km, *KeyTileLists.pointers(visit, km), out, lse,
        h, sq, sk, dqk, dv, *(visit.index.shape[-2:] if visit else (1, 1)),
        *qh.stride(), *kh.stride(), *vh.stride(),
        km.stride(0), km.stride(1),
        *out.stride(), *lse.stride(),
        scale,
        HAS_MASK=key_alive is not None, P_MODE=p_mode, QB=recipe.pv_format.block if recipe.pv_format else 32,
        OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, IEEE=qh.dtype == torch.float32,
        D=next_pow2(dqk), BLOCK_DV=next_pow2(dv), BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        SPARSE=visit is not None, QT=visit.query_tile if visit else KEY_TILE,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _bf16_attn_fwd
