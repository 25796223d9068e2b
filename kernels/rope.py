"""Rotary position embedding on interleaved pairs (Wan's RoPE) for queries and keys in one pass.

Wan's stock processor rotates each head's pairs ``(x[2i], x[2i+1])`` by the token's angle with eight
torch operations per tensor, every intermediate a full fp32 copy of the (B, S, H, D) tensor: at
Wan2.2 720p that moves about ten times the tensor's bytes. Here one program reads a block of tokens'
pairs of both tensors and the tokens' cos/sin once, and writes the rotated pairs: the tensors' bytes
in and out. The arithmetic is the stock's, operation for operation in fp32 (``x1·cos − x2·sin`` and
``x1·sin + x2·cos``, each product rounded, no fused multiply-add) and rounded once to the input's
dtype, so the result equals the stock's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import round_bf16

__all__ = ["rope_pairs", "rope_pairs_supported"]

BLOCK_T = 16   # tokens per program
BLOCK_P = 128  # pairs per program (of the H · D/2 pairs of a token)


@triton.jit
def _rotate(X, O, sx, t64, even, live, cos, sin, pairs, BF16: tl.constexpr):
    base = t64[:, None] * sx + even
    x1 = tl.load(X + base, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + 1, mask=live, other=0.0).to(tl.float32)
    obase = t64[:, None] * (2 * pairs) + even
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    if BF16:  # rounded to nearest here: the CPU interpreter's own cast to bfloat16 truncates
        o1, o2 = round_bf16(o1), round_bf16(o2)
    tl.store(O + obase, o1.to(O.dtype.element_ty), mask=live)
    tl.store(O + obase + 1, o2.to(O.dtype.element_ty), mask=live)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_tok, seq, pairs, half, sq, sk,
                 BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = (t[:, None] < n_tok) & (p[None, :] < pairs)
    t64 = t.to(tl.int64)
    pos = (t64 % seq)[:, None] * half + (p % half)[None, :]  # the token's angle for pair p of its head
    cos = tl.load(COS + pos, mask=live, other=0.0)
    sin = tl.load(SIN + pos, mask=live, other=0.0)
    even = 2 * p.to(tl.int64)[None, :]
    _rotate(Q, QO, sq, t64, even, live, cos, sin, pairs, BF16)
    _rotate(K, KO, sk, t64, even, live, cos, sin, pairs, BF16)


def _angles(table: torch.Tensor, seq: int, half: int, odd: bool) -> torch.Tensor | None:
    """Wan's (1, S, 1, D) fp32 cos or sin table (each angle repeated for both members of a pair) as the
    (S, D/2) angles the kernel reads: the stock reads cos at the even and sin at the odd positions."""
    if table.dtype != torch.float32 or table.dim() != 4 or table.shape[0] != 1 or table.shape[2] != 1 \
            or table.shape[1] != seq or table.shape[3] != 2 * half:
        return None
    return table[0, :, 0, int(odd)::2].contiguous()


def _rows(x: torch.Tensor) -> int | None:
    """The stride between tokens of a (B, S, H, D) tensor whose heads and dims are packed, else None."""
    B, S, H, D = x.shape
    if x.stride(3) != 1 or x.stride(2) != D:
        return None
    if S == 1:  # token t is batch entry t
        return x.stride(0)
    return x.stride(1) if B == 1 or x.stride(0) == S * x.stride(1) else None


def rope_pairs_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope_pairs` takes these operands (else the caller runs the stock operations)."""
    if q.dim() != 4 or q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.shape[-1] % 2:
        return False
    if cos.device != q.device or sin.device != q.device or q.numel() == 0:
        return False
    B, S, H, D = q.shape
    return (_rows(q) is not None and _rows(k) is not None
            and _angles(cos, S, D // 2, False) is not None and _angles(sin, S, D // 2, True) is not None)


def rope_pairs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``q`` and ``k`` (B, S, H, D) rotated by Wan's interleaved RoPE (``cos``/``sin``: its (1, S, 1, D)
    fp32 tables), as new contiguous tensors of the inputs' dtype; the inputs are left as they are.
    Operands :func:`rope_pairs_supported` refuses get a one-line ``ValueError``."""
    if not rope_pairs_supported(q, k, cos, sin):
        raise ValueError(f"rope_pairs takes (B, S, H, D) queries and keys of one shape and 16/32-bit dtype "
                         f"with packed heads and (1, S, 1, D) fp32 cos/sin tables; got q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)}, cos {tuple(cos.shape)} {cos.dtype}")
    B, S, H, D = q.shape
    half = D // 2
    cos_h, sin_h = _angles(cos, S, half, False), _angles(sin, S, half, True)
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    pairs = H * half
    grid = (triton.cdiv(B * S, BLOCK_T), triton.cdiv(pairs, BLOCK_P))
    _rope_kernel[grid](q, k, qo, ko, cos_h, sin_h, B * S, S, pairs, half, _rows(q), _rows(k),
                       BLOCK_T=BLOCK_T, BLOCK_P=BLOCK_P, BF16=q.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False)
    return qo, ko
