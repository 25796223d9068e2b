"""Wan's rotary position embedding on the queries and keys, and which processors let fp4video apply it.

Wan's stock processors rotate the queries and keys with eight torch operations per tensor, each
intermediate a full fp32 copy (about ten times the tensor's bytes moved at Wan2.2 720p).
:func:`wan_rope` computes the same bits with one fused kernel (:mod:`fp4video.kernels.rope`) on a GPU.
For diffusers' ``WanAttnProcessor`` (Wan and Wan-Animate's: it rotates the queries and keys and
passes them straight to its one self-attention dispatch), the routing takes the tables off
the module's call and applies them here at the dispatch (:mod:`fp4video.integration.routing`).
"""

from __future__ import annotations

import torch

__all__ = ["wan_rope", "stock_wan_rope", "defers", "deferrable"]


def stock_wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs, as its stock processor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def wan_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated by Wan's RoPE: one fused kernel on a GPU (the stock's bits), the stock
    operations elsewhere and under ``torch.compile`` (which fuses them itself)."""
    if q.is_cuda and not torch.compiler.is_compiling():
        from fp4video.kernels import triton_available

        if triton_available():
            from fp4video.kernels import rope

            if rope.rope_pairs_supported(q, k, cos, sin):
                return rope.rope_pairs(q, k, cos, sin)
    return stock_wan_rope(q, cos, sin), stock_wan_rope(k, cos, sin)


def _deferrable_classes() -> tuple:
    """diffusers' processors that rotate q and k with :func:`stock_wan_rope`'s operations right before
    their only dispatch of a call with RoPE (the self-attention; their image attention runs on
    cross-attention calls, which carry no RoPE)."""
    classes = []
    for module in ("transformer_wan", "transformer_wan_animate"):
        try:
            mod = __import__(f"diffusers.models.transformers.{module}", fromlist=["WanAttnProcessor"])
        except Exception:  # an older diffusers without it
            continue
        cls = getattr(mod, "WanAttnProcessor", None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def defers(processor, module) -> bool:
    """Whether calls of ``module`` with ``processor`` may have their RoPE applied at the dispatch: a
    diffusers ``WanAttnProcessor`` (exactly, not a subclass: another processor may use the tables
    otherwise) on a module without image keys. Decided at install (outside any compiled graph)."""
    return type(processor) in _deferrable_classes() and getattr(module, "add_k_proj", None) is None


def deferrable(processor, hidden_states, context, rotary_emb) -> bool:
    """Whether this call of a module :func:`defers` admits can have its RoPE applied at the dispatch:
    self-attention, Wan's (cos, sin) tables of the queries' tokens, and no context parallelism (whose
    dispatch sees other tokens than the tables')."""
    if context is not None or getattr(processor, "_parallel_config", None) is not None:
        return False
    if not isinstance(rotary_emb, (tuple, list)) or len(rotary_emb) != 2:
        return False
    cos, sin = rotary_emb
    return (torch.is_tensor(cos) and torch.is_tensor(sin) and torch.is_tensor(hidden_states)
            and hidden_states.dim() == 3 and cos.dim() == 4 and cos.shape == sin.shape
            and cos.shape[1] == hidden_states.shape[1])
