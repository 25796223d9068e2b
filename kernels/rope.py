"""Rotary position embedding on interleaved pairs (Wan's RoPE) for queries and keys in one pass.

Wan's stock processor rotates each head's pairs ``(x[2i], x[2i+1])`` by the token's angle with eight
torch operations per tensor, every intermediate a full fp32 copy of the (B, S, H, D) tensor: at
Wan2.2 720p that moves about ten times the tensor's bytes. Here one program reads a block of tokens'
pairs of both tensors and the tokens' cos/sin once, and writes the rotated pairs: the tensors' bytes
in and out. The arithmetic is the stock's, operation for operation (``x1·cos − x2·sin`` and
``x1·sin + x2·cos``, no fused multiply-add), each result rounded as torch rounds it in the dtype it
promotes the tensor's and the tables' to (fp32 with diffusers' fp32 tables), then cast to the input's
dtype, so the result equals the stock's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import round_bf16

__all__ = ["rope_pairs", "rope_pairs_supported"]

BLOCK_T = 8    # tokens per program (the launch sweep's fastest at Wan 720p, with 2 warps)
BLOCK_P = 256  # pairs per program (of the H · D/2 pairs of a token)

#: how the stock rounds each operation's result: in the dtype torch promotes q's and the tables' to
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded as an operation of the stock's dtype rounds it (to nearest even), as fp32."""
    if ROUND == 1:
        x = round_bf16(x)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rotate(X, O, sx, t64, cols, live, cos, sin, pairs, OP: tl.constexpr, OUT: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    # the tokens' 2·BLOCK_P consecutive values at once, split into the pairs' members
    x = tl.load(X + t64[:, None] * sx + cols[None, :], mask=live, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_P, 2)))
    o1 = _rounded(_rounded(x1 * cos, OP) - _rounded(x2 * sin, OP), OP)
    o2 = _rounded(_rounded(x1 * sin, OP) + _rounded(x2 * cos, OP), OP)
    o = _rounded(tl.reshape(tl.join(o1, o2), (BLOCK_T, 2 * BLOCK_P)), OUT)
    tl.store(O + t64[:, None] * (2 * pairs) + cols[None, :], o.to(O.dtype.element_ty), mask=live)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_tok, seq, pairs, half, sq, sk,
                 BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, OP: tl.constexpr, OUT: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    t64 = t.to(tl.int64)
    pos = (t64 % seq)[:, None] * half + (p % half)[None, :]  # the token's angle for pair p of its head
    angle_ok = (t[:, None] < n_tok) & (p[None, :] < pairs)
    cos = tl.load(COS + pos, mask=angle_ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos, mask=angle_ok, other=0.0).to(tl.float32)
    cols = tl.program_id(1) * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
    live = (t[:, None] < n_tok) & (cols[None, :] < 2 * pairs)
    _rotate(Q, QO, sq, t64, cols, live, cos, sin, pairs, OP, OUT, BLOCK_T, BLOCK_P)
    _rotate(K, KO, sk, t64, cols, live, cos, sin, pairs, OP, OUT, BLOCK_T, BLOCK_P)


def _angles(table: torch.Tensor, seq: int, half: int, odd: bool) -> torch.Tensor | None:
    """Wan's (1, S, 1, D) cos or sin table (each angle repeated for both members of a pair) as the
    (S, D/2) angles the kernel reads: the stock reads cos at the even and sin at the odd positions."""
    if table.dtype not in _ROUND or table.dim() != 4 or table.shape[0] != 1 or table.shape[2] != 1 \
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
    if q.dtype not in _ROUND or q.shape[-1] % 2:
        return False
    if cos.device != q.device or sin.device != q.device or q.numel() == 0 or cos.dtype != sin.dtype:
        return False
    B, S, H, D = q.shape
    return (_rows(q) is not None and _rows(k) is not None
            and _angles(cos, S, D // 2, False) is not None and _angles(sin, S, D // 2, True) is not None)


def rope_pairs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               block_tokens: int = BLOCK_T, block_pairs: int = BLOCK_P, num_warps: int = 2):
    """``q`` and ``k`` (B, S, H, D) rotated by Wan's interleaved RoPE (``cos``/``sin``: its (1, S, 1, D)
    tables, fp32 as diffusers keeps them, or 16-bit), as new contiguous tensors of the inputs' dtype;
    the inputs are left as they are (``block_tokens`` × ``block_pairs`` a program, powers of two).
    Operands :func:`rope_pairs_supported` refuses get a one-line ``ValueError``."""
    if not rope_pairs_supported(q, k, cos, sin):
        raise ValueError(f"rope_pairs takes (B, S, H, D) queries and keys of one shape and 16/32-bit dtype "
                         f"with packed heads and (1, S, 1, D) 16/32-bit cos/sin tables; got q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)}, cos {tuple(cos.shape)} {cos.dtype}")
    B, S, H, D = q.shape
    half = D // 2
    cos_h, sin_h = _angles(cos, S, half, False), _angles(sin, S, half, True)
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    pairs = H * half
    grid = (triton.cdiv(B * S, block_tokens), triton.cdiv(pairs, block_pairs))
    op = torch.promote_types(q.dtype, cos.dtype)
    # each operation rounded as the stock's dtype rounds it; then the stock's cast to q's dtype (the
    # interpreter's own cast to bfloat16 truncates, so the kernel rounds before it)
    out = _ROUND[q.dtype] if q.dtype != op else 0
    _rope_kernel[grid](q, k, qo, ko, cos_h, sin_h, B * S, S, pairs, half, _rows(q), _rows(k),
                       BLOCK_T=block_tokens, BLOCK_P=block_pairs, OP=_ROUND[op], OUT=out, num_warps=num_warps,
                       enable_fp_fusion=False)
    return qo, ko
