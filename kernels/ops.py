"""The fused attention as a PyTorch custom op, so it lives inside ``torch.compile``d models and
CUDA graphs: ``torch.ops.fp4video.attention`` is opaque to the compiler (no graph break), its
fake (meta) implementation only describes the outputs, and the real one launches the kernels.
"""

from __future__ import annotations

import functools

import torch

from fp4video.recipe import AttentionRecipe


@torch.library.custom_op("fp4video::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_alive: torch.Tensor | None, recipe: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) views in; (out (B, H, Sq, Dv) in q's dtype, lse (B, H, Sq) fp32) out.

    ``key_alive``: (B, Sk) bool or None; ``recipe``: :meth:`AttentionRecipe.to_spec`.
    """
    from .dispatch import attention_with_key_alive

    return attention_with_key_alive(q, k, v, recipe=_recipe(recipe), key_alive=key_alive, scale=scale)


@functools.lru_cache(maxsize=64)
def _recipe(spec: str) -> AttentionRecipe:
    """The spec parsed once, not on every attention call."""
    return AttentionRecipe.from_spec(spec)


@attention_op.register_fake
def _(q, k, v, key_alive, recipe, scale):
    b, h, sq, _ = q.shape
    return q.new_empty(b, h, sq, v.shape[-1]), q.new_empty(b, h, sq, dtype=torch.float32)
