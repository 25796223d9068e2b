"""The fixed orthonormal Hadamard rotation MXAttention applies to Q and K.

Q·H and K·H with H orthonormal leave every logit unchanged in exact arithmetic
((QH)(KH)ᵀ = Q H Hᵀ Kᵀ = QKᵀ) while spreading channel outliers over the whole head
dimension, which is what block quantization along that dimension needs.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["hadamard_matrix", "next_power_of_two"]


def next_power_of_two(n: int) -> int:
    if n < 1:
        raise ValueError(f"expected a positive size, got {n}")
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def hadamard_matrix(n: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), scaled by 1/√n (orthonormal, symmetric)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    return _sylvester(n).to(dtype=dtype, device=device)
