"""Rotary position embedding on interleaved pairs for queries and keys in one pass: Wan's, and
diffusers' ``apply_rotary_emb`` (HunyuanVideo's).

The stock processors rotate each head's pairs ``(x[2i], x[2i+1])`` by the token's angle with six to
eight torch operations per tensor, every intermediate a full fp32 copy of the (B, S, H, D) tensor: at
720p that moves about ten times the tensor's bytes. Here one program reads a block of tokens' values
of both tensors and the tokens' cos/sin once, and writes the rotated values: the tensors' bytes in and
out. The arithmetic is the stock's, operation for operation (``x1·cos − x2·sin`` and
``x1·sin + x2·cos``, no fused multiply-add), each result rounded as torch rounds it in the dtype it
computes in, then cast to the input's dtype, so the result equals the stock's bit for bit (a NaN is NaN
where the stock's is, its payload aside; bfloat16 is read and written as its bits, so subnormals are
exact under Triton's CPU interpreter too). The kernel has no backward: operands that need a gradient
are refused, and the callers run the stock operations on them.

- ``style="wan"``: Wan's processor, (1, S, 1, D) tables; both members of a pair take cos from its even
  and sin from its odd entry; the operations in the dtype torch promotes q's and the tables' to (fp32
  with diffusers' fp32 tables).
- ``style="interleaved"``: ``apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1,
  sequence_dim=1)``, (S', D) tables; each member takes its own entry; the operations in fp32. Only the
  first S' tokens are rotated, the rest copied as they are (HunyuanVideo's text tokens follow its
  video tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import round_bf16

__all__ = ["rope_pairs", "rope_pairs_supported"]

BLOCK_T = 8    # tokens per program (the launch sweep's fastest at Wan 720p, with 2 warps)
BLOCK_P = 256  # pairs per program (of the H · D/2 pairs of a token)

#: how an operation's result is rounded, by the dtype the stock computes it in
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
STYLES = ("wan", "interleaved")


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """fp32 ``x`` rounded as an operation of the stock's dtype rounds it (to nearest even), as fp32."""
    if ROUND == 1:
        x = round_bf16(x)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _load_f32(ptr, mask, BITS: tl.constexpr):
    """Values as fp32; ``BITS``: bfloat16 given as its int16 bits, widened by a shift (exact for every
    value, subnormals included, which the CPU interpreter's own conversion is not)."""
    if BITS:
        return (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rotate(X, O, sxb, sxs, sob, sos, b, s, cols, live, c1, s1, c2, s2, OP: tl.constexpr, OUT: tl.constexpr,
            BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    # the tokens' 2·BLOCK_P consecutive values at once, split into the pairs' members
    x = _load_f32(X + b[:, None] * sxb + s[:, None] * sxs + cols[None, :], live, BITS)
    x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_P, 2)))
    o1 = _rounded(_rounded(x1 * c1, OP) - _rounded(x2 * s1, OP), OP)
    o2 = _rounded(_rounded(x1 * s2, OP) + _rounded(x2 * c2, OP), OP)
    o = _rounded(tl.reshape(tl.join(o1, o2), (BLOCK_T, 2 * BLOCK_P)), OUT)
    if BITS:  # a bfloat16 value held in fp32: its upper half is its bits
        o = (o.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    tl.store(O + b[:, None] * sob + s[:, None] * sos + cols[None, :], o.to(O.dtype.element_ty), mask=live)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_tok, seq, D, width, sqb, sqs, skb, sks, sob, sos,
                 WAN: tl.constexpr, OP: tl.constexpr, OUT: tl.constexpr, BITS: tl.constexpr, TABLE_BITS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    b, s = t // seq, t % seq  # the batch entry and the token of each row (the tables' tokens)
    cols = tl.program_id(1) * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
    live = (t[:, None] < n_tok) & (cols[None, :] < width)
    angle = s[:, None] * D + (cols % D)[None, :]  # the token's table entry for each value of each head
    ce, co = tl.split(tl.reshape(_load_f32(COS + angle, live, TABLE_BITS), (BLOCK_T, BLOCK_P, 2)))
    se, so = tl.split(tl.reshape(_load_f32(SIN + angle, live, TABLE_BITS), (BLOCK_T, BLOCK_P, 2)))
    if WAN:  # cos from the pair's even entry, sin from its odd one, for both members
        c1, s1, c2, s2 = ce, so, ce, so
    else:  # each member its own entry
        c1, s1, c2, s2 = ce, se, co, so
    _rotate(Q, QO, sqb, sqs, sob, sos, b, s, cols, live, c1, s1, c2, s2, OP, OUT, BITS, BLOCK_T, BLOCK_P)
    _rotate(K, KO, skb, sks, sob, sos, b, s, cols, live, c1, s1, c2, s2, OP, OUT, BITS, BLOCK_T, BLOCK_P)


def _table(table: torch.Tensor, style: str, seq: int, dim: int) -> torch.Tensor | None:
    """``table`` as the contiguous (S', D) rows the kernel reads, None when the style takes no such
    table for ``seq`` tokens of ``dim`` values (Wan: (1, S, 1, D); interleaved: (S', D), S' ≤ S)."""
    if table.dtype not in _ROUND:
        return None
    if style == "wan":
        if table.dim() != 4 or tuple(table.shape) != (1, seq, 1, dim):
            return None
    elif table.dim() != 2 or table.shape[0] > seq or table.shape[0] == 0 or table.shape[1] != dim:
        return None
    return table.reshape(-1, dim).contiguous()


def _packed(x: torch.Tensor) -> bool:
    """Whether each token's heads and values are one contiguous run (the kernel's loads)."""
    return x.stride(3) == 1 and x.stride(2) == x.shape[3]


def rope_pairs_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         style: str = "wan") -> bool:
    """Whether :func:`rope_pairs` takes these operands (else the caller runs the stock operations)."""
    if style not in STYLES or q.dim() != 4 or q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        return False
    if q.dtype not in _ROUND or q.shape[-1] % 2 or q.numel() == 0:
        return False
    if cos.device != q.device or sin.device != q.device or cos.dtype != sin.dtype or cos.shape != sin.shape:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)):
        return False  # the kernel has no backward: the stock operations keep the graph
    S, D = q.shape[1], q.shape[3]
    return _packed(q) and _packed(k) and _table(cos, style, S, D) is not None


def rope_pairs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "wan", *,
               block_tokens: int = BLOCK_T, block_pairs: int = BLOCK_P, num_warps: int = 2):
    """``q`` and ``k`` (B, S, H, D) rotated as the ``style``'s stock rotates them (module docstring), as
    new contiguous tensors of the inputs' dtype; the inputs are left as they are (``block_tokens`` ×
    ``block_pairs`` a program, powers of two). Operands :func:`rope_pairs_supported` refuses get a
    one-line ``ValueError``."""
    if not rope_pairs_supported(q, k, cos, sin, style):
        shapes = "(1, S, 1, D)" if style == "wan" else "(S' <= S, D)"
        raise ValueError(f"rope_pairs(style={style!r}) takes (B, S, H, D) queries and keys of one shape and 16/32-bit "
                         f"dtype with packed heads and {shapes} 16/32-bit cos/sin tables; got q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)}, cos {tuple(cos.shape)} {cos.dtype}")
    B, S, H, D = q.shape
    cos_t, sin_t = _table(cos, style, S, D), _table(sin, style, S, D)
    rows = cos_t.shape[0]
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if rows < S:  # the tokens past the tables' as they are
        qo[:, rows:], ko[:, rows:] = q[:, rows:], k[:, rows:]
    # each operation rounded as the stock's dtype rounds it; then the stock's cast to q's dtype (the
    # interpreter's own cast to bfloat16 truncates, so the kernel rounds before it)
    op = torch.promote_types(q.dtype, cos.dtype) if style == "wan" else torch.float32
    out = _ROUND[q.dtype] if q.dtype != op else 0
    grid = (triton.cdiv(B * rows, block_tokens), triton.cdiv(H * D // 2, block_pairs))
    for n in (block_tokens, block_pairs):
        if not isinstance(n, int) or n < 1 or n & (n - 1):
            raise ValueError(f"rope_pairs: block_tokens and block_pairs must be powers of two, got {n!r}")
    bits = q.dtype == torch.bfloat16  # bfloat16 read and written as its bits (see _load_f32)
    as_bits = (lambda t: t.view(torch.int16)) if bits else (lambda t: t)
    table_bits = (lambda t: t.view(torch.int16)) if cos_t.dtype == torch.bfloat16 else (lambda t: t)
    _rope_kernel[grid](as_bits(q), as_bits(k), as_bits(qo), as_bits(ko), table_bits(cos_t), table_bits(sin_t),
                       B * rows, rows, D, H * D, q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0),
                       qo.stride(1), WAN=style == "wan", OP=_ROUND[op], OUT=out, BITS=bits,
                       TABLE_BITS=cos_t.dtype == torch.bfloat16, BLOCK_T=block_tokens, BLOCK_P=block_pairs,
                       num_warps=num_warps, enable_fp_fusion=False)
    return qo, ko
