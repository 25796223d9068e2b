"""Fused quantization pre-pass: one pass per tensor, the numerics of
:func:`fp4video.reference.prepare_qkv`.

Q and K: zero dead keys, subtract K's smoothing mean, rotate by the Hadamard matrix (fp32,
IEEE dot), block-quantize along the head dim; V: zero dead keys, block-quantize along tokens.
Outputs hold the dequantized values in bf16 (exact for E2M1 × E8M0/E4M3 scales) in a contiguous
(B, H, S, D) layout, Q/K zero-padded along D to the kernel's power-of-two head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe
from fp4video.reference import qk_padded_dim, smoothing_mean
from fp4video.rotation import hadamard_matrix

from .fp4_math import fake_quant_rows

FMT_CODE = {None: 0, Format.MXFP4: 1, Format.NVFP4: 2}


@triton.jit
def _prepass_rows(
    X, Alive, Mean, Hm, Out,
    H, S, D_IN,
    sxb, sxh, sxs, sxd,
    sab, sas,
    smb, smh,
    sob, soh, sos,
    HAS_ALIVE: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr, ROT_PRECISION: tl.constexpr,
    FMT: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
    D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Q or K: rows of D channels, quantized along D."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D)
    ok = rows < S
    if HAS_ALIVE:
        ok = ok & (tl.load(Alive + b * sab + rows * sas, mask=rows < S, other=0) != 0)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                mask=ok[:, None] & (cols[None, :] < D_IN), other=0.0).to(tl.float32)
    if SMOOTH:
        mean = tl.load(Mean + b * smb + h * smh + cols, mask=cols < D_IN, other=0.0)
        x = tl.where(ok[:, None], x - mean[None, :], 0.0)
    if ROTATE:
        hm = tl.load(Hm + cols[:, None] * D + cols[None, :])
        x = tl.dot(x, hm, input_precision=ROT_PRECISION)
    if FMT != 0:
        x = fake_quant_rows(x, BLOCK_S, D, FMT, QB, OCP, QMAX, True)
    tl.store(Out + b * sob + h * soh + rows[:, None] * sos + cols[None, :], x.to(Out.dtype.element_ty),
             mask=(rows < S)[:, None])


@triton.jit
def _prepass_v(
    V, Alive, Out,
    H, S, DV,
    svb, svh, svs, svd,
    sab, sas,
    sob, soh, sos,
    HAS_ALIVE: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """V: quantized along tokens (blocks of QB consecutive keys per channel)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_DV)
    ok = rows < S
    if HAS_ALIVE:
        ok = ok & (tl.load(Alive + b * sab + rows * sas, mask=rows < S, other=0) != 0)
    x = tl.load(V + b * svb + h * svh + rows[:, None] * svs + cols[None, :] * svd,
                mask=ok[:, None] & (cols[None, :] < DV), other=0.0).to(tl.float32)
    if FMT != 0:
        x = tl.trans(fake_quant_rows(tl.trans(x), BLOCK_DV, BLOCK_S, FMT, QB, OCP, QMAX, True))
    tl.store(Out + b * sob + h * soh + rows[:, None] * sos + cols[None, :], x.to(Out.dtype.element_ty),
             mask=(rows < S)[:, None] & (cols[None, :] < DV))


def next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def prepass(q, k, v, recipe: AttentionRecipe, key_alive, work_dtype):
    """(q̂, k̂, v̂) for the attention kernel. ``key_alive``: (B, Sk) bool or None."""
    b, h, sq, d_in = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    dp = qk_padded_dim(d_in, recipe)
    d = next_pow2(dp)
    dev = q.device
    alive = key_alive.to(torch.int8).contiguous() if key_alive is not None else torch.empty(1, 1, dtype=torch.int8, device=dev)
    if recipe.hadamard:
        hm = torch.zeros(d, d, device=dev)
        hm[:dp, :dp] = hadamard_matrix(dp, device=dev)
    else:
        hm = torch.empty(1, device=dev)
    rule = recipe.scale_rule
    block_s = 64

    def rows_pass(x, s, fmt, alive_rows, mean):
        out = torch.empty(b, h, s, d, device=dev, dtype=work_dtype)
        _prepass_rows[(triton.cdiv(s, block_s), b * h)](
            x, alive, mean, hm, out,
            h, s, d_in,
            *x.stride(),
            alive.stride(0), alive.stride(1),
            mean.stride(0), mean.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            HAS_ALIVE=alive_rows, SMOOTH=mean.dim() == 3, ROTATE=recipe.hadamard,
            # fp32-accurate rotation: three tf32 tensor-core products on the GPU (ieee fp32 dots
            # spill at D=128 and ran 10x slower on the H200); exact fp32 in the interpreter
            ROT_PRECISION="tf32x3" if dev.type == "cuda" else "ieee",
            FMT=FMT_CODE[fmt], QB=fmt.block if fmt else 32, OCP=rule is ScaleRule.OCP, QMAX=rule.qmax,
            D=d, BLOCK_S=block_s,
        )
        return out

    none = torch.empty(1, 1, device=dev)
    q_hat = rows_pass(q, sq, recipe.qk_format, False, none)
    mean = none
    if recipe.smooth_k:
        kf = k.float()
        if key_alive is not None:
            kf = torch.where(key_alive[:, None, :, None], kf, 0.0)
        mean = smoothing_mean(kf, key_alive[:, None, :] if key_alive is not None else None)[..., 0, :].contiguous()
    k_hat = rows_pass(k, sk, recipe.qk_format, key_alive is not None, mean)
    v_hat = torch.empty(b, h, sk, dv, device=dev, dtype=work_dtype)
    fmt = recipe.pv_format
    _prepass_v[(triton.cdiv(sk, block_s), b * h)](
        v, alive, v_hat,
        h, sk, dv,
        *v.stride(),
        alive.stride(0), alive.stride(1),
        v_hat.stride(0), v_hat.stride(1), v_hat.stride(2),
        HAS_ALIVE=key_alive is not None, FMT=FMT_CODE[fmt], QB=fmt.block if fmt else 32,
        OCP=rule is ScaleRule.OCP, QMAX=rule.qmax, BLOCK_DV=next_pow2(dv), BLOCK_S=block_s,
    )
    return q_hat, k_hat, v_hat
