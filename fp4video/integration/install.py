"""Install FP4 attention into a diffusers pipeline (every transformer, both Wan2.2 experts) and
keep the denoising step current for the policy; ``uninstall`` restores the stock processors."""

from __future__ import annotations

import re
import warnings

import torch

from .policy import Policy
from .processor import AttentionContext, FP4Processor

__all__ = ["install", "uninstall", "annotate"]

# processor names -> (block index offset group, kind of blocks)
_WAN_BLOCK = re.compile(r"^blocks\.(\d+)\.attn[12]\.processor$")
_HY_DUAL = re.compile(r"^transformer_blocks\.(\d+)\.attn\.processor$")
_HY_SINGLE = re.compile(r"^single_transformer_blocks\.(\d+)\.attn\.processor$")
_HY_REFINER = re.compile(r"token_refiner\.refiner_blocks\.(\d+)\.attn\.processor$")


def _transformers(target):
    """[(expert name or None, model)] for a pipeline or a bare transformer."""
    if isinstance(target, torch.nn.Module):
        return [(None, target)]
    t1, t2 = getattr(target, "transformer", None), getattr(target, "transformer_2", None)
    if t1 is None:
        raise ValueError(f"{type(target).__name__} has no `transformer`: pass a diffusers video pipeline or a transformer")
    return [("high_noise", t1), ("low_noise", t2)] if t2 is not None else [(None, t1)]


def _site(name: str, n_dual: int):
    """(block index, covered) for a processor name; None for names fp4video does not handle."""
    if m := _WAN_BLOCK.match(name):
        return int(m.group(1))
    if m := _HY_DUAL.match(name):
        return int(m.group(1))
    if m := _HY_SINGLE.match(name):
        return n_dual + int(m.group(1))
    return None


def annotate(model: torch.nn.Module) -> dict[str, int]:
    """Tag each attention module with its block index (``_fp4video_block``), for policies and records.
    Returns {processor name: block} for the modules fp4video handles."""
    names = list(model.attn_processors)
    n_dual = sum(bool(_HY_DUAL.match(n)) for n in names)
    sites = {}
    for name in names:
        block = _site(name, n_dual)
        if block is not None:
            model.get_submodule(name.removesuffix(".processor"))._fp4video_block = block
            sites[name] = block
    return sites


def install(pipe, policy: Policy | str | None = None, *, backend: str = "auto", record: bool = True) -> AttentionContext:
    """Put :class:`FP4Processor` on every Wan / HunyuanVideo attention module of ``pipe`` (a pipeline,
    both Wan2.2 experts included, or a bare transformer). Returns the shared
    :class:`AttentionContext` (its ``calls`` list records each attention call)."""
    if isinstance(policy, str) or policy is None:
        policy = Policy(method=policy or "mxattn")
    if getattr(pipe, "_fp4video_context", None) is not None:
        raise RuntimeError("fp4video is already installed on this pipeline: call fp4video.uninstall(pipe) first")
    ctx = AttentionContext(policy=policy, backend=backend, record=record)
    processor = FP4Processor(context=ctx)
    models = _transformers(pipe)
    try:  # every model is checked before any is changed: an error leaves the pipeline as it was
        all_sites = [_checked_sites(model, policy) for _, model in models]
    except (ValueError, NotImplementedError):
        for _, model in models:
            _unannotate(model)
        raise
    for (expert, model), sites in zip(models, all_sites):
        original = dict(model.attn_processors)
        model.set_attn_processor({name: processor if name in sites else proc for name, proc in original.items()})
        parallel = getattr(model, "_parallel_config", None)  # enable_parallelism ran before install
        if parallel is not None and getattr(parallel, "context_parallel_config", None) is not None:
            processor._parallel_config = parallel
        hook = model.register_forward_pre_hook(_step_hook(pipe, ctx, expert))
        model._fp4video_saved = (original, hook)
    pipe._fp4video_context = ctx
    return ctx


def uninstall(pipe) -> None:
    """Restore the processors that were there before :func:`install`."""
    for _, model in _transformers(pipe):
        saved = getattr(model, "_fp4video_saved", None)
        if saved is None:
            continue
        original, hook = saved
        model.set_attn_processor(original)
        hook.remove()
        del model._fp4video_saved
        _unannotate(model)
    pipe._fp4video_context = None


def _checked_sites(model: torch.nn.Module, policy: Policy) -> dict[str, int]:
    """:func:`annotate`, refusing a model fp4video does not know or a policy that does not fit it."""
    sites = annotate(model)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no Wan or HunyuanVideo attention modules fp4video knows")
    policy.check_blocks(max(sites.values()) + 1, type(model).__name__)
    if policy.refiner and any(_HY_REFINER.search(name) for name in model.attn_processors):
        raise NotImplementedError("quantizing HunyuanVideo's token refiner is not supported yet (refiner: false)")
    return sites


def _unannotate(model: torch.nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "_fp4video_block"):
            del module._fp4video_block


def _step_hook(pipe, ctx: AttentionContext, expert):
    """Before each transformer call: the denoising step is the position of the pipeline's current
    timestep in its scheduler's schedule (right under classifier-free guidance, which calls the
    transformer twice per step, and with two experts). Warns once per schedule length about step
    rules that cover every step or none."""
    warned = set()

    def hook(module, args):
        ctx.expert = expert
        t = getattr(pipe, "_current_timestep", None)
        scheduler = getattr(pipe, "scheduler", None)
        if t is None or scheduler is None or getattr(scheduler, "timesteps", None) is None:
            ctx.step = ctx.num_steps = None
            return
        timesteps = scheduler.timesteps
        hits = (timesteps == torch.as_tensor(t, device=timesteps.device).flatten()[0]).nonzero()
        ctx.step = int(hits[0]) // getattr(scheduler, "order", 1) if len(hits) else None
        ctx.num_steps = len(timesteps) // getattr(scheduler, "order", 1)
        if ctx.num_steps not in warned:
            warned.add(ctx.num_steps)
            for msg in ctx.policy.step_warnings(ctx.num_steps):
                warnings.warn(f"fp4video policy: {msg}", stacklevel=2)

    return hook
