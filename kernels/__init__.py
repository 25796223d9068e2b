"""Fused Triton kernels for fp4video (installed as ``fp4video.kernels``).

They implement the numerics of :mod:`fp4video.reference` and import only torch, triton and
fp4video's numerics modules. This version ships no attention kernel yet, so :func:`supports`
says so and ``fp4_attention(backend="auto")`` runs the PyTorch reference.
"""

from __future__ import annotations

__all__ = ["supports", "attention"]


def supports(recipe, q) -> tuple[bool, str]:
    """Whether a fused kernel can run this call, and if not, why (for the error message)."""
    return False, "fp4video ships no fused Triton attention kernel in this version; use backend='reference'"


def attention(q, k, v, *, recipe, mask, scale):
    ok, why = supports(recipe, q)
    raise NotImplementedError(why)
