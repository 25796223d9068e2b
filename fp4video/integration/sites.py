"""Where a diffusers transformer attends, read from its structure (no list of model names).

An *attention site* is a module with a diffusers attention processor (``Attention`` and every
``AttentionModuleMixin`` module). Its *block* is the position of the transformer block holding it
in the model's block lists — the ``nn.ModuleList`` children of the model whose items contain
attention — counted across the lists in the order the model registers them (HunyuanVideo: its 20
dual-stream blocks are 0–19, its single-stream blocks 20 onwards). Sites outside every block list
(HunyuanVideo's token refiner, inside its text embedder) have block -1.

A site is *routable* when its processor calls diffusers' ``dispatch_attention_fn`` (processors that
do carry an ``_attention_backend`` attribute, which diffusers' dispatcher reads); processors that
call PyTorch's SDPA themselves (CogVideoX, Mochi, Allegro, the generic ``AttnProcessor2_0``) are
not, and fp4video says so instead of skipping them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Site", "attention_sites", "is_attention", "routable", "names_its_backend", "dispatches_without_backend",
           "NotRoutable"]


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


def dispatches_without_backend(processor) -> bool:
    """Whether ``processor`` calls diffusers' dispatcher without naming a backend (Cosmos 1.0 and
    2.5), so that the process-wide active backend runs its attention: read from the source of its
    ``__call__`` (False where the source cannot be read)."""
    import inspect

    try:
        source = inspect.getsource(type(processor).__call__)
    except (OSError, TypeError):
        return False
    return "dispatch_attention_fn(" in source


def routable(processor) -> bool:
    """Whether ``processor`` hands its attention to diffusers' dispatcher (which fp4video routes)."""
    return names_its_backend(processor) or dispatches_without_backend(processor)


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
