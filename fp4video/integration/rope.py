"""Rotary position embedding on the queries and keys at the dispatch, and which processors let
fp4video apply it there.

Wan's and HunyuanVideo's stock processors rotate the queries and keys with six to eight torch
operations per tensor, each intermediate a full fp32 copy (about ten times the tensor's bytes moved
at 720p: 12 ms a call at Wan2.2 720p on an H200). :func:`apply_rope` computes the same bits with one
fused kernel (:mod:`fp4video.kernels.rope`) on a GPU. For the processors :func:`defers` names, which
rotate the queries and keys and pass them, with nothing else done to them, to their one dispatch of a
call with RoPE, the routing takes the tables off the module's call and applies them at that dispatch
(:mod:`fp4video.integration.routing`):

- diffusers' ``WanAttnProcessor`` (Wan, Wan-Animate, ChronoEdit) and ``SkyReelsV2AttnProcessor`` (the
  same code): ``style="wan"``, the (1, S, 1, D) tables of a self-attention call's S tokens;
- diffusers' ``HunyuanVideoAttnProcessor2_0``: ``style="interleaved"``, the (S, D) tables of the video
  tokens, which come first in the joint call's queries and keys (the text tokens after them keep no
  RoPE).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "stock_rope", "stock_wan_rope", "defers", "deferrable"]


def stock_wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs, as its stock processor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def stock_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1,
    sequence_dim=1)`` on the first ``len(cos)`` tokens of ``x``, the rest as they are (HunyuanVideo's
    processor: its video tokens, then its text tokens)."""
    rows = cos.shape[0]
    cos, sin = cos.to(x.device), sin.to(x.device)
    head = x[:, :rows]
    real, imag = head.reshape(*head.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    out = (head.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(x.dtype)
    return out if rows == x.shape[1] else torch.cat([out, x[:, rows:]], dim=1)


def stock_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """``x`` rotated by the ``style``'s stock operations."""
    return stock_wan_rope(x, cos, sin) if style == "wan" else stock_interleaved_rope(x, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "wan"):
    """(q, k) rotated as the ``style``'s stock rotates them: one fused kernel on a GPU (the stock's
    bits), the stock operations elsewhere and under ``torch.compile`` (which fuses them itself)."""
    if q.is_cuda and not torch.compiler.is_compiling():
        from fp4video.kernels import triton_available

        if triton_available():
            from fp4video.kernels import rope

            if rope.rope_pairs_supported(q, k, cos, sin, style):
                return rope.rope_pairs(q, k, cos, sin, style)
    return stock_rope(q, cos, sin, style), stock_rope(k, cos, sin, style)


def _processor_class(module: str, name: str):
    try:
        return getattr(__import__(f"diffusers.models.transformers.{module}", fromlist=[name]), name, None)
    except Exception:  # a diffusers without it
        return None


#: (diffusers module, processor class, style, the keyword its module call passes the tables by)
_DEFERRABLE = (("transformer_wan", "WanAttnProcessor", "wan", "rotary_emb"),
               ("transformer_wan_animate", "WanAttnProcessor", "wan", "rotary_emb"),
               ("transformer_chronoedit", "WanAttnProcessor", "wan", "rotary_emb"),
               ("transformer_skyreels_v2", "SkyReelsV2AttnProcessor", "wan", "rotary_emb"),
               ("transformer_hunyuan_video", "HunyuanVideoAttnProcessor2_0", "interleaved", "image_rotary_emb"))


def defers(processor, module) -> tuple[str, str] | None:
    """(style, keyword) when calls of ``module`` with ``processor`` may have their RoPE applied at the
    dispatch, else None: one of the processors above (exactly, not a subclass: another processor may use
    the tables otherwise); Wan's on a module without image keys. Decided at install (outside any
    compiled graph)."""
    for mod, name, style, keyword in _DEFERRABLE:
        cls = _processor_class(mod, name)
        if cls is not None and type(processor) is cls:
            if style == "wan" and getattr(module, "add_k_proj", None) is not None:
                return None
            return style, keyword
    return None


def deferrable(style: str, processor, hidden_states, context, rotary_emb) -> bool:
    """Whether this call of a module :func:`defers` admits can have its RoPE applied at the dispatch:
    the style's (cos, sin) tables of the module's input tokens, Wan's on self-attention only, and no
    context parallelism (whose dispatch sees other tokens than the tables')."""
    if getattr(processor, "_parallel_config", None) is not None:
        return False
    if not isinstance(rotary_emb, (tuple, list)) or len(rotary_emb) != 2:
        return False
    cos, sin = rotary_emb
    if not (torch.is_tensor(cos) and torch.is_tensor(sin) and torch.is_tensor(hidden_states)
            and hidden_states.dim() == 3 and cos.shape == sin.shape):
        return False
    if style == "wan":
        return context is None and cos.dim() == 4 and cos.shape[1] == hidden_states.shape[1]
    return cos.dim() == 2 and cos.shape[0] == hidden_states.shape[1]
