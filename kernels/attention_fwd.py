"""Fused FP4 attention forward (Triton): online softmax with in-loop P quantization.

Numerics: exactly :mod:`fp4video.reference` (same key tile, same block rounding of P̃), except
for the usual floating-point differences (``exp`` implementation, fp32 accumulation order),
which can flip the rounding of an element of P̃ that sits on a rounding boundary.

The fused pre-pass (:mod:`.prepass`: smoothing, rotation, Q/K/V block quantization) writes the
*dequantized* values in bf16, which this kernel reads: E2M1 values
times an E8M0 or E4M3 scale need at most 6 significant bits, so bf16 holds them exactly and
bf16 tensor-core products with fp32 accumulation are exact up to summation order. The P tile
quantized in the loop is likewise exact in bf16. Unquantized methods (``fp16``) keep the input
dtype (fp32 with IEEE-precision dots).

Limits (``supports`` reports them): key-padding masks ``(B, 1, 1, Sk)`` only; P blocks whose
maximum is below 2^-124 (weights ~1e-37 of the row maximum) are flushed to zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, PScale, RowSum
from fp4video.reference import KEY_TILE, TWO_LEVEL_P_RANGE

from .fp4_math import fake_quant_rows
from .prepass import next_pow2, prepass

# P quantization modes (constexpr)
P_NONE, P_MX, P_NV = 0, 1, 2


@triton.jit
def _quantize_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, P_MODE: tl.constexpr,
                QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr):
    """Quantize-dequantize p >= 0 ([BLOCK_M, BLOCK_N]) in blocks of QB along keys."""
    return fake_quant_rows(p, BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX, False)


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
    QMAX: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr, IEEE: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < SQ
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
        if P_MODE == 0:
            p_hat = p
            row_factor = tl.full((BLOCK_M,), 1.0, tl.float32)
        elif TWO_LEVEL:
            rmax = tl.max(p, axis=1)
            live = rmax > 0
            inv_s1 = tl.where(live, tl.math.div_rn(tl.full((BLOCK_M,), P_RANGE, tl.float32),
                                                   tl.where(live, rmax, 1.0)), 0.0)
            p_hat = _quantize_p(p * inv_s1[:, None], BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX)
            row_factor = tl.math.div_rn(rmax, tl.full((BLOCK_M,), P_RANGE, tl.float32))
        else:
            p_hat = _quantize_p(p, BLOCK_M, BLOCK_N, P_MODE, QB, OCP, QMAX)
            row_factor = tl.full((BLOCK_M,), 1.0, tl.float32)
        if PNQ:
            l_i = alpha * l_i + tl.sum(p_hat, axis=1) * row_factor
        else:
            l_i = alpha * l_i + tl.sum(p, axis=1)
        v = tl.load(V + b * svb + h * svh + keys[:, None] * svs + offs_dv[None, :] * svd,
                    mask=(keys < SK)[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if IEEE:
            pv = tl.dot(p_hat, v, input_precision="ieee")
        else:
            pv = tl.dot(p_hat.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv * row_factor[:, None]
        m_i = m_new

    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    out = tl.where(live[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(live, m_i + tl.log(l_safe), float("-inf"))
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * sos + offs_dv[None, :] * sod,
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b * slb + h * slh + offs_m * sls, lse, mask=row_ok)


def supports(recipe: AttentionRecipe, q: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[bool, str]:
    import os

    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False, "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
    if mask is not None and (mask.shape[1] != 1 or mask.shape[2] != 1):
        return False, "the Triton kernel takes key-padding masks (B, 1, 1, Sk) only; this mask varies over heads/queries"
    return True, ""


#: Launch configuration per P mode, from scripts/sweep_kernel_configs.py on an H200 (2026-11-29,
#: S=32,760, H=40, D=128; BENCHMARKS.md): fp16/MXFP4 best at 128/8/3, NVFP4 (E4M3 rounding of the
#: block scales in the loop, register-heavy) at 128/8/1.
LAUNCH = {P_NONE: (128, 8, 3), P_MX: (128, 8, 3), P_NV: (128, 8, 1)}


def attention(q, k, v, *, recipe: AttentionRecipe, mask, scale: float, **launch):
    """q, k, v: (B, H, S, D) views, any strides. Returns (out (B, H, Sq, Dv) in q's dtype, lse fp32)."""
    b, sk = q.shape[0], k.shape[-2]
    key_alive = None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]
    if recipe.quantized:
        qh, kh, vh = prepass(q, k, v, recipe, key_alive, work_dtype(q))
    else:  # the inputs as they are: no copy, any strides
        qh, kh, vh = q, k, v
    return attention_prepared(qh, kh, vh, key_alive, recipe=recipe, scale=scale, out_dtype=q.dtype, **launch)


def work_dtype(q: torch.Tensor) -> torch.dtype:
    """FP4 values are exact in bf16; the CPU interpreter has no bf16 matmul, so fp32 there."""
    return torch.bfloat16 if q.is_cuda else torch.float32


def attention_prepared(qh, kh, vh, key_alive, *, recipe: AttentionRecipe, scale: float, out_dtype,
                       block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None):
    """The attention loop alone, on pre-pass outputs (or unquantized inputs); (B, H, S, D) views."""
    b, h, sq, dqk = qh.shape
    sk, dv = kh.shape[-2], vh.shape[-1]
    dev = qh.device
    out = torch.empty(b, h, sq, dv, device=dev, dtype=out_dtype)
    lse = torch.empty(b, h, sq, device=dev, dtype=torch.float32)
    if key_alive is not None:
        km = key_alive.to(torch.int8).contiguous()
    else:
        km = torch.empty(1, 1, dtype=torch.int8, device=dev)
    p_mode = {None: P_NONE, Format.MXFP4: P_MX, Format.NVFP4: P_NV}[recipe.pv_format]
    qb = recipe.pv_format.block if recipe.pv_format else 32
    bm, nw, ns = LAUNCH[p_mode]
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
        QMAX=recipe.scale_rule.qmax, TWO_LEVEL=recipe.p_scale is PScale.TWO_LEVEL, P_RANGE=TWO_LEVEL_P_RANGE,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, IEEE=qh.dtype == torch.float32,
        D=next_pow2(dqk), BLOCK_DV=next_pow2(dv), BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse
