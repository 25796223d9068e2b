"""Install a precision policy into a diffusers pipeline (every transformer, both Wan2.2 experts)
and keep the denoising step current for it; ``uninstall`` restores the model as it was.

Works for every diffusers transformer whose attention processors call diffusers' dispatcher (Wan
T2V / I2V / VACE / Animate, Wan2.2, SkyReels-V2, HunyuanVideo and HunyuanVideo-1.5, LTX-Video,
LTX-2, Sana-Video, Kandinsky 5, Cosmos, ...): blocks and attention roles are read from the model's
structure (:mod:`fp4video.integration.sites`) and the model keeps its own processors
(:mod:`fp4video.integration.routing`). Models whose processors call PyTorch's SDPA themselves
(CogVideoX, Mochi, Allegro) are refused with a message saying so.

The installation lives with each transformer it changes (``_fp4video_saved``), whatever handle it
came through: a pipeline, a bare transformer, or another pipeline sharing that transformer. A
transformer takes one installation at a time: installing on one that has one (through any
handle) is refused, and nothing is changed. :func:`uninstall` on any handle restores every
transformer of it that has an installation, whichever handle installed it, so uninstalling in
any order ends with the stock model. Rules that can never match on the transformers installed
(an expert rule without two experts, a kind their calls never have, a step rule where no
denoising step is known, a rule every call of which an earlier one takes) are refused at install,
and so is sparsity that could never apply to calls its rule (or the default) takes: a static
window on cross-attention modules' calls, on the attention outside the blocks or on a transformer
whose latent grid cannot be read, the dynamic selection's neighbours on cross-attention calls.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .callers import caller_stacklevel
from .policy import CROSS_KINDS, CallSpace, Policy, as_policy
from .processor import AttentionContext, FP4Processor, check_backend
from .routing import is_routed, patch_sizes, possible_kinds, route, unroute
from .sites import NotRoutable, Site, attention_sites, routable, unroutable_reason

__all__ = ["install", "uninstall", "annotate", "block_sites", "installed_context"]


@dataclass
class _Installed:
    """What :func:`install` changed on one transformer (its ``_fp4video_saved``)."""

    ctx: AttentionContext
    route: object  # routing._Route
    hook: object  # the step hook's handle
    through: str  # the handle install was given, for messages


def transformers_of(target):
    """[(expert name or None, model)] for a pipeline or a bare transformer."""
    if isinstance(target, torch.nn.Module):
        return [(None, target)]
    t1, t2 = getattr(target, "transformer", None), getattr(target, "transformer_2", None)
    if not isinstance(t1, torch.nn.Module):
        raise TypeError(f"{type(target).__name__} has no `transformer` module: pass a diffusers video pipeline or a "
                        "transformer")
    if t2 is None:
        return [(None, t1)]
    if not isinstance(t2, torch.nn.Module):
        raise TypeError(f"{type(target).__name__}.transformer_2 is a {type(t2).__name__}, not a transformer")
    if t2 is t1:
        raise ValueError(f"{type(target).__name__}.transformer and .transformer_2 are the same model: fp4video cannot "
                         "tell its high- and low-noise calls apart")
    return [("high_noise", t1), ("low_noise", t2)]


def installed_context(model: torch.nn.Module) -> AttentionContext | None:
    """The :class:`AttentionContext` of the installation on ``model`` (a transformer), or None."""
    saved = getattr(model, "_fp4video_saved", None)
    return saved.ctx if saved is not None else None


def annotate(model: torch.nn.Module) -> dict[str, int]:
    """Tag each attention module in the model's block lists with its block index
    (``_fp4video_block``, read by :class:`FP4Processor`). Returns {processor name: block}."""
    sites = {}
    for site in attention_sites(model):
        if site.block >= 0:
            site.module._fp4video_block = site.block
            sites[f"{site.name}.processor"] = site.block
    return sites


def block_sites(model: torch.nn.Module) -> list[Site]:
    """The attention sites of the model's transformer blocks (what a policy's blocks count)."""
    return [s for s in attention_sites(model) if s.block >= 0]


def install(pipe, policy: Policy | str | None = None, *, backend: str = "auto", record: bool = True) -> AttentionContext:
    """Apply ``policy`` (a :class:`Policy`, a method name, default ``"mxattn"``) to every attention call
    of ``pipe``'s transformer blocks (a pipeline, both Wan2.2 experts included, or a bare transformer).
    Returns the shared :class:`AttentionContext` (its ``calls`` list records each attention call).

    Refused, with nothing changed: a transformer that has an installation already (through this
    handle or another: uninstall it first), a policy with a rule that can never match on these
    transformers or sparsity that could never apply to calls it takes, a ``backend`` that is not
    one of ``auto``, ``reference``, ``triton``."""
    policy = as_policy(policy)
    check_backend(backend)
    if not isinstance(record, bool):
        raise TypeError(f"record must be True or False, got {type(record).__name__} {record!r:.40}")
    models = transformers_of(pipe)
    for _, model in models:
        saved = getattr(model, "_fp4video_saved", None)
        if saved is not None:
            raise RuntimeError(f"fp4video is already installed on {type(model).__name__} (through {saved.through}): "
                               "call fp4video.uninstall on it, or on the pipeline it was installed through, first")
    ctx = AttentionContext(policy=policy, backend=backend, record=record)
    # every model is checked before any is changed: an error leaves the pipeline as it was
    all_sites = [_checked_sites(model, policy) for _, model in models]
    _check_rules_can_match(pipe, policy, models, all_sites)
    ctx.external, ctx.fp16_exact = _resolve_backends(policy, models)
    for _, model in models:
        unrouted = _unrouted(model)
        if unrouted:
            ctx.unrouted.update({f"{type(model).__name__}.{n}": c for n, c in unrouted.items()})
            classes = sorted(set(unrouted.values()))
            warnings.warn(f"fp4video: {len(unrouted)} attention modules of {type(model).__name__}'s blocks keep their "
                          f"own attention ({', '.join(classes)}: not through diffusers' dispatcher, e.g. linear "
                          "attention); the policy covers the others (AttentionContext.unrouted lists them)", stacklevel=2)
    through = type(pipe).__name__ if not isinstance(pipe, torch.nn.Module) else f"the bare {type(pipe).__name__}"
    for (expert, model), sites in zip(models, all_sites):
        routed = route(model, sites, ctx)  # (the routing knows each site's block: no annotation)
        hook = model.register_forward_pre_hook(_step_hook(pipe, ctx, expert), with_kwargs=True)
        model._fp4video_saved = _Installed(ctx, routed, hook, through)
    return ctx


def model_place(model) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of the most of ``model``'s parameter elements: where and in what its attention
    runs. diffusers keeps a few small modules in float32 in a bf16 model (``_keep_in_fp32_modules``:
    Wan's ``scale_shift_table`` is its first parameter), so the first parameter does not tell.
    (cpu, float32) for a model without parameters."""
    counts = {}
    for p in model.parameters():
        counts[(p.device, p.dtype)] = counts.get((p.device, p.dtype), 0) + p.numel()
    return max(counts, key=counts.get) if counts else (torch.device("cpu"), torch.float32)


def _resolve_backends(policy: Policy, models) -> tuple[dict, object]:
    """The external backends ``policy`` names, each made ready for the transformers' device and
    dtype (a probe call), and the backend of its fp16 tier (None: stock). A backend that is not
    installed or cannot run there is refused here, with the reason, before anything is changed."""
    from .backends import BackendUnavailable, fastest_exact, resolve

    places = []
    for _, model in models:
        place = model_place(model)
        if place not in places:
            places.append(place)
    if len(places) > 1 and (policy.external_backends() or policy.fp16_backend != "stock"):
        raise ValueError("the transformers are on different devices or dtypes ("
                         + ", ".join(f"{d} {str(t).removeprefix('torch.')}" for d, t in places)
                         + "): move them to one before installing a policy that names external backends")
    if not places:
        return {}, None
    device, dtype = places[0]
    external, fp16 = {}, None
    try:
        for name in policy.external_backends():
            external[name] = resolve(name, device=device, dtype=dtype)
        if policy.fp16_backend == "fastest":
            fp16, _ = fastest_exact(device=device, dtype=dtype)
        elif policy.fp16_backend != "stock":
            fp16 = external[policy.fp16_backend]
    except BackendUnavailable as e:
        raise BackendUnavailable(f"the policy cannot be installed: {e}") from None
    return external, fp16


def uninstall(pipe) -> None:
    """Restore every transformer of ``pipe`` (a pipeline or a transformer) that has an installation,
    whichever handle installed it: its stock processors' backends, no fp4video hook; its
    installation's context records no more calls from it. Transformers without one are left as
    they are."""
    for _, model in transformers_of(pipe):
        saved = getattr(model, "_fp4video_saved", None)
        if saved is None:
            continue
        unroute(saved.route)
        saved.hook.remove()
        del model._fp4video_saved


def _check_rules_can_match(pipe, policy: Policy, models, all_sites) -> None:
    """Refuse a policy with a rule that no attention call of these transformers can match, or with
    sparsity (on a rule or the default) that cannot apply to calls the structure shows it takes."""
    if not policy.rules and policy.sparsity is None:
        return
    bare = isinstance(pipe, torch.nn.Module)
    names = " and ".join(sorted({type(m).__name__ for _, m in models}))
    calls = {(expert, s.block, kind) for (expert, _), sites in zip(models, all_sites) for s in sites
             for kind in possible_kinds(s)}
    cross, no_window = set(), {}
    for (expert, model), sites in zip(models, all_sites):
        gridless = patch_sizes(model) is None
        for s in sites:
            for kind in possible_kinds(s):
                call = (expert, s.block, kind)
                if s.role == "cross" and kind in CROSS_KINDS:  # a module built for another sequence's keys
                    cross.add(call)
                if s.block < 0:
                    no_window[call] = "attention outside the transformer blocks (the token refiner's, over text)"
                elif gridless:
                    no_window[call] = ("attention, whose latent grid is unknown (the transformer's config gives no "
                                       "patch sizes)")
    if bare:
        no_experts = (f"installed on a bare {names}, no call has an expert (experts tell Wan2.2's two "
                      "transformers apart: install on the pipeline)")
    else:
        no_experts = f"{type(pipe).__name__} has one transformer, so no call has an expert (Wan2.2's pipelines have two)"
    space = CallSpace(calls=calls, steps_known=not bare, name=names, no_experts=no_experts,
                      no_steps=f"installed on a bare {names}, no denoising step is known (install on the pipeline: "
                               "it follows the scheduler's step)", cross=frozenset(cross), no_window=no_window)
    problems = policy.unmatchable(space) + policy.unfit_sparsity(space)
    if problems:
        raise ValueError(f"the policy does not fit {names}: " + "; ".join(problems))


def _checked_sites(model: torch.nn.Module, policy: Policy) -> list[Site]:
    """The sites to route, refusing a model fp4video cannot reach or a policy that does not fit it."""
    name = type(model).__name__
    sites = attention_sites(model)
    blocks = [s for s in sites if s.block >= 0]
    if not blocks:
        raise ValueError(f"{name} has no transformer blocks with attention modules (no nn.ModuleList of blocks "
                         "holding diffusers attention modules): fp4video finds attention through them")
    ours = sorted({s.name for s in sites if isinstance(s.processor, FP4Processor)})
    if ours:
        raise ValueError(f"{name} already has FP4Processor on {ours[0]} (and {len(ours) - 1} more): fp4video.install "
                         "routes the model's own processors; restore them first (set_attn_processor(original))")
    from .routing import BACKEND

    routed = sorted({s.name for s in sites if getattr(getattr(s.processor, "_attention_backend", None), "value", None)
                     == BACKEND and not is_routed(s.processor)})
    if routed:
        raise ValueError(f"{name}'s processor on {routed[0]} (and {len(routed) - 1} more) is set to the {BACKEND} "
                         "backend outside fp4video.install; reset it first (model.reset_attention_backend())")
    stuck = [s for s in blocks if not routable(s.processor)]
    if len(stuck) == len(blocks):
        kinds = {type(s.processor).__name__: unroutable_reason(s.processor) for s in stuck}
        raise NotRoutable(
            f"{name}: the attention processors of its blocks ({'; '.join(f'{k} {why}' for k, why in sorted(kinds.items()))}) "
            "instead of handing diffusers' dispatch_attention_fn the model's backend, so fp4video cannot route them "
            "(e.g. CogVideoX, Mochi and Allegro in diffusers 0.42 call SDPA themselves); transformers whose "
            "processors use the dispatcher are supported (Wan, HunyuanVideo, LTX-Video, Sana-Video, ...)")
    policy.check_blocks(max(s.block for s in blocks) + 1, name)
    blocks = [s for s in blocks if routable(s.processor)]
    outside = [s for s in sites if s.block < 0]
    if policy.refiner and not outside:
        raise ValueError(f"refiner: true asks to quantize the attention outside {name}'s transformer blocks "
                         "(HunyuanVideo's token refiner), but it has none there: leave refiner out")
    if policy.refiner:
        stuck = sorted({type(s.processor).__name__ for s in outside if not routable(s.processor)})
        if stuck:
            raise NotImplementedError(
                f"refiner: true asks to quantize the attention outside {name}'s blocks (HunyuanVideo's token "
                f"refiner), but its processors ({', '.join(stuck)}) call SDPA directly; refiner: false keeps "
                "them in full precision")
        keep = {id(s.module) for s in blocks}  # the routable block sites and those outside, in module order
        return [s for s in sites if s.block < 0 or id(s.module) in keep]
    return blocks


def _unrouted(model: torch.nn.Module) -> dict[str, str]:
    """{site name: processor class} for the block attention fp4video cannot route."""
    return {s.name: type(s.processor).__name__ for s in block_sites(model) if not routable(s.processor)}


def _step_hook(pipe, ctx: AttentionContext, expert):
    """Before each transformer call: the denoising step is the position of the pipeline's current
    timestep in its scheduler's schedule (right under classifier-free guidance, which calls the
    transformer twice per step, and with two experts). The current timestep is the pipeline's
    ``_current_timestep`` or, for pipelines that keep none (Sana-Video), the ``timestep`` the
    transformer is called with; one found in neither, or not in the schedule (a rescaled one),
    leaves the step unknown (None). Warns once per schedule length about step rules that cover
    every step or none."""
    warned = set()

    def hook(module, args, kwargs):
        ctx.expert = expert
        t = getattr(pipe, "_current_timestep", None)
        if t is None:
            t = kwargs.get("timestep")
        scheduler = getattr(pipe, "scheduler", None)
        if t is None or scheduler is None or getattr(scheduler, "timesteps", None) is None:
            ctx.step = ctx.num_steps = None
            return
        timesteps = scheduler.timesteps
        hits = (timesteps == torch.as_tensor(t, device=timesteps.device).flatten()[0]).nonzero()
        ctx.step = int(hits[0]) // getattr(scheduler, "order", 1) if len(hits) else None
        ctx.num_steps = len(timesteps) // getattr(scheduler, "order", 1)
        if ctx.num_steps < 1:  # fewer timesteps than the scheduler's order: no schedule to place a step in
            ctx.step = ctx.num_steps = None
            return
        if ctx.num_steps not in warned:
            warned.add(ctx.num_steps)
            for msg in ctx.policy.step_warnings(ctx.num_steps):
                warnings.warn(f"fp4video policy: {msg}", stacklevel=caller_stacklevel())
        return None

    return hook

