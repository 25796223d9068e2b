"""Policies on any diffusers transformer whose processors call diffusers' dispatcher.

The model keeps its own (stock) processors: projections, norms, RoPE, masks and output
projections stay diffusers' code. :func:`route` points each routable processor's
``_attention_backend`` at one fp4video backend (``fp4video_policy``) and hooks each attention module,
so when a processor calls ``dispatch_attention_fn`` the backend knows the site (block, role), the
call's kind and the installation's :class:`~fp4video.integration.processor.AttentionContext`
(denoising step, expert, policy). Processors that call the dispatcher without naming a backend
(Cosmos) run on diffusers' process-wide active backend: for them the module's hooks make
``fp4video_policy`` the active backend while that module runs, and put the previous one back. With
method ``fp16`` the call goes on to the backend the processor had before, so the output is the
stock output.

Kinds of a call: ``joint`` (the queries include the context tokens: HunyuanVideo's dual- and
single-stream blocks), ``image`` (keys from the module's added K projection — Wan I2V's image
context — or queries from its image Q projection — Cosmos 2.5's), ``cross`` (keys from another
sequence), ``self``.

Caches (diffusers' ``enable_cache``: FirstBlockCache, PyramidAttentionBroadcast, FasterCache,
MagCache, TaylorSeer) skip blocks or reuse attention outputs; every site that did not attend in a
transformer forward is recorded with method ``"skipped"``, and the step stays the denoising step
(it is read from the pipeline, not counted).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import torch

from .dispatcher import AttentionCall, diffusers_backend
from .parallel import uses_ring
from .policy import backend_of
from .rope import apply_rope, deferrable, defers
from .sites import Site

__all__ = ["BACKEND", "route", "unroute", "call_kind", "possible_kinds", "boolean_mask", "current_selection",
           "patch_sizes", "latent_grid"]

#: The diffusers backend name fp4video's routed processors use.
BACKEND = "fp4video_policy"

#: An additive float mask entry at or below this is a masked key (diffusers' models use -10000 or -inf).
MASKED_BELOW = -1e4

_local = threading.local()  # the attention module calls in progress (innermost last), per thread

#: Submodules whose outputs are image keys or queries (Wan I2V's added K projection; Cosmos 2.5's)
ADDED_KEY_MODULES = ("add_k_proj", "norm_added_k", "k_img_norm", "q_img_norm")

#: id(processor) -> [processor, its _attention_backend before routing, whether set on the instance,
#: how many routes use it]: the stock state of every processor routed now, kept once whatever the
#: number of models (or installations) sharing it, so unrouting the last one restores it exactly
_ROUTED: dict = {}
_routed_lock = threading.Lock()


@dataclass
class _Call:
    """One attention module's forward in progress."""

    site: Site
    route: "_Route"
    queries_in: int | None  # hidden_states' token count (None: not passed by that name or first)
    context: int | None  # encoder_hidden_states' token count, None without one
    added_keys: set = field(default_factory=set)  # storages of the added (image) projections' outputs
    attended: int = 0
    stock_backend: object = None  # the backend the processor would have used: fp16 goes on to it
    active_before: object = None  # the process-wide backend this module's call replaced (None: it replaced none)
    rope: tuple | None = None  # (style, cos, sin) taken off the module's call, applied at its dispatch


@dataclass
class _Route:
    """One transformer's routing: its sites, the stock backends, the shared context."""

    model: torch.nn.Module
    sites: list[Site]
    ctx: object  # AttentionContext
    original: dict  # id(processor) -> (processor, its stock _attention_backend, whether set on the instance,
    #                 whether it names its backend: else it runs on the process-wide one)
    handles: list
    member: object = None  # the fp4video_policy backend
    attended: set = field(default_factory=set)  # site names that attended in this forward
    replicated_context: bool = False  # fp4video's HunyuanVideo plan: the context tokens on every rank
    grid: tuple | None = None  # (frames, height, width) of this forward's video tokens (None: unknown)
    active: bool = True  # False once unrouted: a call still naming this route is refused
    rope_sites: dict = field(default_factory=dict)  # site name -> (style, keyword, processor class): RoPE at the dispatch


def call_stack() -> list:
    """The attention module calls in progress on this thread (innermost last)."""
    if not hasattr(_local, "calls"):
        _local.calls = []
    return _local.calls


def _joins_context(processor) -> bool:
    """Whether ``processor`` may put context tokens among the queries: its ``__call__`` reads
    ``add_q_proj`` (the processors of dual- and single-stream blocks, HunyuanVideo's and Motif's,
    share one ``__call__`` that joins the context projected by ``add_q_proj`` or, without it,
    concatenates the context before the projections); True where its source cannot be read."""
    from .sites import call_source

    source = call_source(processor)
    return not source or "add_q_proj" in source


def possible_kinds(site: Site) -> set:
    """The kinds :func:`call_kind` can give the calls of ``site``, read from its structure: a
    superset (never missing a kind a call can have), exact for ``image`` and ``joint`` on diffusers'
    video transformers. ``joint`` sites (``add_q_proj``: HunyuanVideo's dual-stream attention)
    whose processor joins the context into the queries only attend jointly; others attend ``self``
    or ``cross``, ``image`` with an added K projection (Wan I2V, Cosmos 2.5), ``joint`` where the
    processor may join context tokens into the queries (single-stream blocks)."""
    m, proc = site.module, site.processor
    added = any(isinstance(getattr(m, n, None), torch.nn.Module) for n in ADDED_KEY_MODULES)
    if site.role == "joint":
        return {"joint"} if _joins_context(proc) else {"joint", "cross", "image"} if added else {"joint", "cross"}
    return {"self", "cross"} | ({"image"} if added else set()) | ({"joint"} if _joins_context(proc) else set())


def call_kind(call: _Call, q: torch.Tensor, k: torch.Tensor) -> str:
    """The kind of one dispatch within ``call`` (q, k as (B, S, H, D))."""
    if call.context is not None and call.queries_in is not None and q.shape[1] != call.queries_in \
            and q.shape[1] == k.shape[1]:
        return "joint"
    if k.untyped_storage().data_ptr() in call.added_keys or q.untyped_storage().data_ptr() in call.added_keys:
        return "image"
    if call.context is not None or k.shape[1] != q.shape[1]:
        return "cross"
    return "joint" if call.site.role == "joint" else "self"


def boolean_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """diffusers' masks as fp4video takes them (bool, True = attend): a bool mask unchanged; an
    additive float mask whose entries are 0 (attend) or ≤ -1e4 / -inf (masked) as bool. Any other
    additive mask (a bias) raises: fp4video cannot add it, and dropping it would change the output."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"attention mask of dtype {mask.dtype}: fp4video takes bool masks or additive float masks")
    keep = mask == 0
    if not bool((keep | (mask <= MASKED_BELOW)).all()):
        bad = mask[~keep & (mask > MASKED_BELOW)]
        raise ValueError(f"additive attention mask with bias values (e.g. {float(bad.flatten()[0]):g}): fp4video "
                         "takes masks that only keep (0) or remove (≤ -1e4, -inf) keys; this call needs method fp16")
    return keep


class _Refused(Exception):
    """A call its target cannot take: ``reason`` for messages, ``original`` the error to re-raise
    under ``fallback: error`` (None: a one-line ValueError is raised)."""

    def __init__(self, reason: str, original: BaseException | None = None):
        super().__init__(reason)
        self.reason, self.original = reason, original


def _policy_attention(a: AttentionCall):
    """The ``fp4video_policy`` diffusers backend: the policy's target for this call."""
    stack = call_stack()
    if not stack or not stack[-1].route.active:
        raise RuntimeError(f"diffusers called the {BACKEND} attention backend outside an attention module fp4video "
                           "routed: use fp4video.install(pipe, policy), not set_attention_backend, for it")
    call = stack[-1]
    route, site, ctx = call.route, call.site, call.route.ctx
    if call.rope is not None:  # the RoPE its processor would have applied to exactly these q and k
        style, cos, sin = call.rope
        call.rope = None
        rows = cos.shape[1] if style == "wan" else cos.shape[0]
        fits = (a.query.shape[1] == a.key.shape[1] == rows) if style == "wan" else \
            (a.query.shape[1] >= rows and a.key.shape[1] >= rows)
        if a.parallel_config is not None or not fits:
            raise RuntimeError(f"{site.name}: the attention call of a module whose RoPE fp4video applies at the "
                               f"dispatch has {a.query.shape[1]} query and {a.key.shape[1]} key tokens for RoPE tables "
                               f"of {rows}" + (" under context parallelism" if a.parallel_config else ""))
        q, k = apply_rope(a.query, a.key, cos, sin, style)
        a = dataclasses.replace(a, query=q, key=k)
    kind = call_kind(call, a.query, a.key)
    target, sparsity = ctx.route_for(site.block, kind, site=site.name)
    call.attended += 1
    route.attended.add(site.name)
    try:
        out, ran, extra = _run(call, kind, target, a, sparsity)
    except _Refused as refused:
        fallback = ctx.policy.fallback
        if fallback == "error":
            if refused.original is not None:
                raise refused.original
            raise ValueError(f"{site.name} ({kind} attention): {target} {refused.reason}; the policy's fallback is "
                             "error (fallback: stock, or {method: ...} / {backend: ...}, sends such calls elsewhere)"
                             ) from None
        ctx.fallbacks[f"{kind}: {refused.reason}"] += 1
        if fallback == "stock":
            out, ran, extra = _stock(call, a), "stock-fallback", {}
        else:
            try:
                out, ran, extra = _run(call, kind, fallback.target, a)
            except _Refused as again:
                raise ValueError(f"{site.name} ({kind} attention): {target} {refused.reason}, and the policy's "
                                 f"fallback {fallback.target} {again.reason}") from None
        extra = {**extra, "planned": target}
    ctx.record_call(site.block, kind, ran, a.parallel_config, site=site.name, **extra)
    if ctx.observer is not None:
        ctx.observer(site=site, kind=kind, call=a, out=out, ran=ran)
    return out


# opaque: which kernel a call runs depends on the block, the step and the call (see diffusers_backend)
_backend = diffusers_backend(_policy_attention, opaque=True)


def _run(call: _Call, kind: str, target: str, a: AttentionCall, sparsity=None):
    """Run ``target`` on the call (block-sparse with ``sparsity``, an fp4video method's): (output,
    the target that ran, extra record fields); :class:`_Refused` when the target cannot take it."""
    route, ctx = call.route, call.route.ctx
    ring = uses_ring(a.parallel_config)
    # stock attention cannot split replicated context tokens (fp4video's HunyuanVideo plan): its fp16
    # runs fp4video's unquantized attention there, as under ring (which merges partial results by their LSE)
    replicated = a.parallel_config is not None and kind == "joint" and route.replicated_context
    if target == "fp16" and not ring and not replicated:
        exact = ctx.fp16_exact
        if exact is None:
            return _stock(call, a), "fp16", {}
        why = exact.why_not(a)
        if why is None:
            return exact.run(a), "fp16", {"exact_backend": exact.name}
        # the stock backend is exact too: the same tier, recorded and counted
        ctx.fallbacks[f"{kind}: fp16 on {exact.name}: it {why}"] += 1
        return _stock(call, a), "fp16", {"exact_backend": "stock"}
    name = backend_of(target)
    if name is not None:
        backend = ctx.external.get(name)
        if backend is None:
            raise RuntimeError(f"backend {name!r} was not resolved at install (install the policy with fp4video.install)")
        why = backend.why_not(a)
        if why is not None:
            raise _Refused(why)
        try:
            return backend.run(a), target, {}
        except (ValueError, NotImplementedError) as e:  # a check inside the backend function
            raise _Refused(f"refused it ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    try:
        if a.unsupported_options():
            raise ValueError(f"fp4video's methods have no {', '.join(a.unsupported_options())} ({call.site.name})")
        mask = boolean_mask(a.attn_mask)
        extra = {}
        if sparsity is not None:
            selection = _selection(route, call, kind, sparsity, a, mask, target)
            extra = {"sparsity": sparsity.describe(), "density": selection.density()}
            if selection.check is not None and ctx.record:  # what its check measured (tensors until read back)
                extra.update(selection.check.summary())
        else:
            selection = None
        out = _fp4(route, call, kind, target, a.query, a.key, a.value, mask, a.scale, a.return_lse,
                   a.parallel_config, selection)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise _Refused(f"cannot take it ({e})", e) from None
    return out, target, extra


def current_selection(kind: str, sparsity, a: AttentionCall, mask, method: str = "mxattn"):
    """The :class:`fp4video.sparse.BlockSelection` ``sparsity`` gives the routed call in progress on
    this thread for ``method`` (what its policy would run: calibration measures sparse candidates on it).
    ValueError outside a routed call, or where the selection cannot apply."""
    stack = call_stack()
    if not stack:
        raise ValueError("a block-sparse selection is computed within a routed attention call only")
    call = stack[-1]
    return _selection(call.route, call, kind, sparsity, a, mask, method)


def _selection(route, call: _Call, kind: str, sparsity, a: AttentionCall, mask, method: str):
    """The :class:`fp4video.sparse.BlockSelection` of a block-sparse call: ``sparsity``'s rule on
    this call (the context tokens of joint attention global; a static window on the latent grid of
    the transformer's input). ValueError where it cannot apply (context parallelism, cross attention
    under a static window, a grid unknown)."""
    from ..attention import selection_for
    from ..sparse import DynamicSparsity, HybridSparsity, StaticSparsity

    if a.parallel_config is not None:
        raise ValueError("block-sparse attention does not run under context parallelism")
    sq, sk = a.query.shape[1], a.key.shape[1]
    grid = route.grid
    # joint attention (HunyuanVideo): the video tokens first, then the context's (as many as the
    # grid leaves, or the module's context input holds)
    n_video = sq
    if kind == "joint":
        n_video = grid[0] * grid[1] * grid[2] if grid is not None else sq - (call.context or 0)
    context = ((n_video, sq),) if 0 < n_video < sq else ()
    check = dict(floor=sparsity.floor, sinks=sparsity.sinks, check_rows=sparsity.check_rows)
    dynamic = static = None
    if sparsity.dynamic is not None:
        d = sparsity.dynamic
        dynamic = DynamicSparsity(tau=d.tau, neighbours=d.neighbours if sq == sk else None, global_tokens=context,
                                  sink_tiles=d.sink_tiles, min_similarity=d.min_similarity, topk=d.topk,
                                  estimate=d.estimate, estimate_rows=d.estimate_rows, **check)
    if sparsity.static is not None:
        if kind not in ("self", "joint") or sq != sk:
            raise ValueError(f"a static window applies to self and joint attention, not to {kind} attention")
        if grid is None or grid[0] * grid[1] * grid[2] != n_video:
            raise ValueError(f"a static window needs the latent grid of the call's {n_video} video tokens; the "
                             f"transformer's input gave {'none' if grid is None else '×'.join(map(str, grid))}")
        st = sparsity.static
        static = StaticSparsity(frames=grid[0], height=grid[1], width=grid[2], window=st.window,
                                text_tokens=sq - n_video, text_position="last", radial=st.radial, **check)
    if dynamic is not None and static is not None:
        rule = HybridSparsity(static=static, dynamic=dynamic, **check)
    else:
        rule = dynamic if dynamic is not None else static
    return selection_for(rule, a.query, a.key, layout="bshd", attn_mask=mask, scale=a.scale,
                         backend=route.ctx.backend, method=method)


def _stock(call, a: AttentionCall):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(a.query, a.key, a.value, **a.dispatch_kwargs(), backend=call.stock_backend)


def _fp4(route, call, kind, method, q, k, v, mask, scale, return_lse, parallel_config, selection=None):
    from ..attention import fp4_attention

    if parallel_config is None:
        return fp4_attention(q, k, v, method=method, layout="bshd", attn_mask=mask, scale=scale,
                             return_lse=return_lse, backend=route.ctx.backend, sparsity=selection)
    if kind == "joint" and route.replicated_context:
        from .parallel import joint_context_parallel_attention

        out = joint_context_parallel_attention(q, k, v, n_replicated=call.context, method=method,
                                               parallel_config=parallel_config, attn_mask=mask, backend=route.ctx.backend)
        if return_lse:
            raise NotImplementedError("the replicated-context split returns no LSE")
        return out
    from .parallel import context_parallel_attention

    return context_parallel_attention(q, k, v, method=method, parallel_config=parallel_config, attn_mask=mask,
                                      scale=scale, return_lse=return_lse, backend=route.ctx.backend)


def register_routing_backend():
    from .dispatcher import register_backend

    return register_backend(BACKEND, _backend)


def _pre_hook(route: _Route, site: Site):
    def hook(module, args, kwargs):
        from .dispatcher import active_backend, set_active_backend

        hidden = kwargs.get("hidden_states", args[0] if args else None)
        context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
        if isinstance(context, (tuple, list)):  # Cosmos 2.5: (text, image) contexts
            context = context[0] if context else None

        def tokens(x):
            return int(x.shape[1]) if torch.is_tensor(x) and x.dim() >= 2 else None

        saved = route.original.get(id(site.processor))
        if saved is None or not route.active:  # a processor set after install: not routed
            return
        call = _Call(site, route, tokens(hidden), tokens(context))
        _, backend, _, by_name = saved
        if by_name:
            call.stock_backend = backend
        else:  # it dispatches on the process-wide backend: ours while this module runs
            call.stock_backend = call.active_before = active_backend()
            set_active_backend(route.member)
        changed = None
        rope = route.rope_sites.get(site.name)
        processor = getattr(module, "processor", None)
        # the tables go to the dispatch only where this call reaches it: the module still has a processor of
        # the class decided at install (a processor set on it since may use them otherwise), and that
        # processor still names fp4video's backend (set_attention_backend may have pointed it elsewhere)
        if rope is not None and type(processor) is rope[2] and getattr(processor, "_attention_backend", None) is \
                route.member:
            style, keyword, _ = rope
            rotary = kwargs.get(keyword, args[3] if len(args) > 3 and style == "wan" else None)
            if rotary is not None and deferrable(style, processor, hidden, context, rotary):
                call.rope = (style, *rotary)
                if keyword in kwargs:
                    changed = (args, {**kwargs, keyword: None})
                else:
                    changed = (args[:3] + (None,) + args[4:], kwargs)
        call_stack().append(call)
        return changed

    return hook


def _pop_call(route: _Route, site: Site) -> _Call | None:
    """Take this module's call off the stack: the innermost one of this route and site (and any
    above it, left by a module whose call ended without its hook), None when there is none."""
    stack = call_stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].route is route and stack[i].site is site:
            call = stack[i]
            del stack[i:]
            return call
    return None


def _post_hook(route: _Route, site: Site):
    def hook(module, args, kwargs, output):
        call = _pop_call(route, site)
        if call is not None and call.active_before is not None:
            from .dispatcher import set_active_backend

            set_active_backend(call.active_before)
        if call is not None and call.attended == 0:
            _record_skipped(route, site)  # a cache returned this module's output without attending
        return None

    return hook


def _added_key_hook(call_site: Site):
    def hook(module, args, output):
        stack = call_stack()
        if stack and stack[-1].site is call_site and torch.is_tensor(output):
            stack[-1].added_keys.add(output.untyped_storage().data_ptr())

    return hook


def _record_skipped(route: _Route, site: Site) -> None:
    route.attended.add(site.name)  # once per forward
    route.ctx.record_call(site.block, None, "skipped", site=site.name)


def patch_sizes(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(t, h, w): the patch sizes a video transformer's config gives (Wan's ``patch_size`` (t, h, w);
    HunyuanVideo's ``patch_size`` and ``patch_size_t``), None where it gives none: then the latent
    grid of its input is never known."""
    config = getattr(model, "config", None)
    patch = getattr(config, "patch_size", None)
    if isinstance(patch, (tuple, list)) and len(patch) == 3:
        return tuple(patch)
    if isinstance(patch, int):
        return getattr(config, "patch_size_t", 1) or 1, patch, patch
    return None


def latent_grid(model: torch.nn.Module, hidden_states) -> tuple[int, int, int] | None:
    """(frames, height, width) of the tokens a video transformer makes of its 5-D input latents
    (B, C, F, H, W), from its patch sizes (:func:`patch_sizes`); None for other inputs."""
    patch = patch_sizes(model)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 5 or patch is None:
        return None
    pt, ph, pw = patch
    f, h, w = hidden_states.shape[2:]
    return f // pt, h // ph, w // pw


def _model_pre_hook(route: _Route):
    def hook(module, args, kwargs):
        route.attended = set()
        parallel = getattr(module, "_parallel_config", None)
        route.replicated_context = parallel is not None and getattr(module, "_cp_plan", None) is None
        route.grid = latent_grid(module, kwargs.get("hidden_states", args[0] if args else None))

    return hook


def _model_post_hook(route: _Route):
    def hook(module, args, output):
        _drop_calls(route)  # none of this model's module calls outlives its forward
        for site in route.sites:
            if site.name not in route.attended:
                _record_skipped(route, site)  # a cache skipped its whole block
        return None

    return hook


def _drop_calls(route: _Route) -> None:
    """Remove this thread's calls of ``route`` from the stack."""
    stack = call_stack()
    stack[:] = [c for c in stack if c.route is not route]


def is_routed(processor) -> bool:
    """Whether ``processor`` is routed through the policy backend now (by any installation)."""
    return id(processor) in _ROUTED


def route(model: torch.nn.Module, sites: list[Site], ctx) -> _Route:
    """Route ``sites`` (routable, checked by the caller) of ``model`` through the policy backend.
    A processor shared with a model routed already keeps the stock backend saved then."""
    from .sites import names_its_backend

    member = register_routing_backend()
    r = _Route(model, sites, ctx, {}, [], member=member)
    procs = {}
    for site in sites:
        procs.setdefault(id(site.processor), site.processor)
    with _routed_lock:
        for key, proc in procs.items():
            by_name = names_its_backend(proc)
            if by_name:
                saved = _ROUTED.get(key)
                if saved is None:
                    saved = _ROUTED[key] = [proc, getattr(proc, "_attention_backend", None),
                                            "_attention_backend" in vars(proc), 0]
                saved[3] += 1
                r.original[key] = (proc, saved[1], saved[2], True)
                proc._attention_backend = member
            else:
                r.original[key] = (proc, None, False, False)
    r.rope_sites = {site.name: (*rope, type(site.processor)) for site in sites
                    if (rope := defers(site.processor, site.module))}
    for site in sites:
        m = site.module
        r.handles.append(m.register_forward_pre_hook(_pre_hook(r, site), with_kwargs=True))
        r.handles.append(m.register_forward_hook(_post_hook(r, site), with_kwargs=True, always_call=True))
        for name in ADDED_KEY_MODULES:
            sub = getattr(m, name, None)
            if isinstance(sub, torch.nn.Module):
                r.handles.append(sub.register_forward_hook(_added_key_hook(site)))
    r.handles.append(model.register_forward_pre_hook(_model_pre_hook(r), with_kwargs=True))
    r.handles.append(model.register_forward_hook(_model_post_hook(r), always_call=True))
    return r


def unroute(r: _Route) -> None:
    """Undo :func:`route`: its hooks removed, each processor's stock backend back once no route
    uses it, no call of this route left on this thread's stack. Calling it again does nothing."""
    if not r.active:
        return
    r.active = False
    for h in r.handles:
        h.remove()
    with _routed_lock:
        for key, (proc, _, _, by_name) in r.original.items():
            saved = _ROUTED.get(key) if by_name else None
            if saved is None:
                continue
            saved[3] -= 1
            if saved[3] > 0:
                continue
            del _ROUTED[key]
            if saved[2]:
                proc._attention_backend = saved[1]
            elif "_attention_backend" in vars(proc):
                del proc._attention_backend  # back to the class attribute
    _drop_calls(r)
