"""Where a diffusers transformer attends, read from its structure (no list of model names).

An *attention site* is a module with a diffusers attention processor (``Attention`` and every
``AttentionModuleMixin`` module). Its *block* is the position of the transformer block holding it
in the model's block lists — the ``nn.ModuleList`` children of the model whose items contain
attention — counted across the lists in the order the model registers them (HunyuanVideo: its 20
dual-stream blocks are 0–19, its single-stream blocks 20 onwards). Sites outside every block list
(HunyuanVideo's token refiner, inside its text embedder) have block -1.

A site is *routable* when its processor calls diffusers' ``dispatch_attention_fn`` (processors that
do carry an ``_attention_backend`` attribute, which diffusers' dispatcher reads); processors that
call PyTorch's SDPA themselves (CogVideoX, Mochi, Allegro, the generic ``AttnProcessor2_0``), or
hand the dispatcher a fixed backend (Kandinsky 6's super-resolution model: flex attention with a
block-sparse mask), are not, and fp4video says so instead of skipping them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Site", "attention_sites", "is_attention", "routable", "names_its_backend", "dispatches_without_backend",
           "fixed_backend", "unroutable_reason", "NotRoutable"]


class NotRoutable(ValueError):
    """A model whose block attention fp4video cannot reach (its processors bypass the dispatcher)."""


@dataclass(frozen=True)
class Site:
    name: str  # module path, e.g. "blocks.3.attn1"
    block: int  # index over the model's block lists; -1 outside them
    block_list: str | None  # the list holding it ("blocks", "single_transformer_blocks"), or None
    module: torch.nn.Module

    @property
    def processor(self):
        return self.module.processor

    @property
    def role(self) -> str:
        """The structural role: ``joint`` (projects the context tokens itself: ``add_q_proj``),
        ``cross`` (built for another sequence's keys), else ``self``. A call can be more specific:
        see :func:`fp4video.integration.routing.call_kind`."""
        m = self.module
        if getattr(m, "add_q_proj", None) is not None:
            return "joint"
        if getattr(m, "is_cross_attention", False):
            return "cross"
        return "self"


def is_attention(module: torch.nn.Module) -> bool:
    return hasattr(module, "processor") and callable(getattr(module, "set_processor", None))


def names_its_backend(processor) -> bool:
    """Whether ``processor`` passes its own ``_attention_backend`` to diffusers' dispatcher (most
    processors of diffusers 0.42: Wan, HunyuanVideo, LTX-Video, ...)."""
    return hasattr(type(processor), "_attention_backend") or hasattr(processor, "_attention_backend")


def call_source(processor) -> str:
    """The source of ``processor``'s ``__call__`` ("" where it cannot be read)."""
    import inspect

    try:
        return inspect.getsource(type(processor).__call__)
    except (OSError, TypeError):
        return ""


def dispatches_without_backend(processor) -> bool:
    """Whether ``processor`` calls diffusers' dispatcher without naming a backend (Cosmos 1.0 and
    2.5), so that the process-wide active backend runs its attention: read from the source of its
    ``__call__`` (False where the source cannot be read)."""
    source = call_source(processor)
    return "dispatch_attention_fn(" in source and "backend=" not in source


def fixed_backend(processor) -> str | None:
    """The backend ``processor`` hands diffusers' dispatcher by name, whatever the model's setting
    (Kandinsky 6's super-resolution model: ``AttentionBackendName.FLEX`` with a block-sparse mask),
    or None: such a call cannot be routed."""
    import re

    m = re.search(r"backend\s*=\s*AttentionBackendName\.(\w+)", call_source(processor))
    return m.group(1) if m else None


def routable(processor) -> bool:
    """Whether ``processor`` hands its attention to diffusers' dispatcher under the backend the model
    sets (which fp4video routes)."""
    return (names_its_backend(processor) or dispatches_without_backend(processor)) and fixed_backend(processor) is None


def unroutable_reason(processor) -> str:
    """Why fp4video cannot route ``processor``, in a few words."""
    backend = fixed_backend(processor)
    if backend is not None:
        return f"hands diffusers' dispatcher a fixed backend ({backend})"
    return "calls PyTorch's scaled_dot_product_attention itself"


def attention_sites(model: torch.nn.Module) -> list[Site]:
    """Every attention site of ``model``, in module order, with its block index."""
    block_of: dict[int, tuple[int, str]] = {}
    index = 0
    for list_name, child in model.named_children():
        if not isinstance(child, torch.nn.ModuleList):
            continue
        if not any(is_attention(m) for block in child for m in block.modules()):
            continue
        for block in child:
            for m in block.modules():
                if is_attention(m):
                    block_of[id(m)] = (index, list_name)
            index += 1
    sites = []
    for name, m in model.named_modules():
        if is_attention(m):
            block, list_name = block_of.get(id(m), (-1, None))
            sites.append(Site(name, block, list_name, m))
    return sites
