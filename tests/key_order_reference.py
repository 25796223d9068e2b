"""The e4m3 pre-pass's operands read back in key order, for tests checking them against the
reference: the inverses of the stored orders of :mod:`fp4video.kernels.key_order` on torch tensors."""

from __future__ import annotations

import functools

import torch

from fp4video.kernels.key_order import tile_key_order, v8t_key_order
from fp4video.reference import KEY_TILE


def k8_in_key_order(k8: torch.Tensor, sk: int) -> torch.Tensor:
    """The e4m3 pre-pass's K̂ stored in tile key order (…, Sk_pad, D) as its first ``sk`` keys in order (a copy)."""
    return k8[..., tile_key_order(k8.shape[-2]).argsort().to(k8.device), :][..., :sk, :]


@functools.lru_cache(maxsize=64)
def _v8t_key_order_on(n: int, device: torch.device) -> torch.Tensor:
    """:func:`v8t_key_order` on ``device``, made once per length."""
    return v8t_key_order(n).to(device)


def v8t_in_key_order(v8t: torch.Tensor) -> torch.Tensor:
    """The e4m3 pre-pass's V̂ᵀ (…, Dv, Sk_pad) with its tokens back in order (a copy; the dot_scaled
    loop's pre-pass writes its V̂ᵀ in order)."""
    order = _v8t_key_order_on(v8t.shape[-1], v8t.device)
    out = torch.empty_like(v8t)
    out[..., order] = v8t
    return out


def k_fac_per_key(k_fac: torch.Tensor, sk: int) -> torch.Tensor:
    """The e4m3 pre-pass's K̂ factors (one per key tile) repeated for each of the ``sk`` keys."""
    return k_fac.repeat_interleave(KEY_TILE, dim=-1)[..., :sk]
