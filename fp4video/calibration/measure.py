"""Measuring every candidate at every site on the stock run's own inputs.

The pipeline runs with the FP16 policy (stock attention: its output is the stock output). After
each routed call an observer runs each candidate on that call's very inputs and keeps, per site,
only statistics: the worst head's relative L2 error and cosine against the stock output. One
sample of inputs per distinct shape is kept for timing. A block-sparse candidate runs on the
selection the installed policy would compute for the call (the routing's own), and its density is
kept with its error. For a sample of sites and steps the
transformer forward is replayed with that one site on a candidate, which measures how the site's
error carries to the transformer's output.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

import torch

from ..integration.dispatcher import AttentionCall
from ..integration.policy import backend_of
from ..integration.routing import boolean_mask
from .plan import SiteStats, is_exact_target, split_target

__all__ = ["Measurer", "head_errors", "run_target"]

#: Heads compared at a time (bounds the fp32 copies the comparison makes).
HEAD_CHUNK = 8


def head_errors(out: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(worst head's relative L2 error, worst head's cosine) of ``out`` against ``exact``, both
    (B, S, H, D); a head whose exact output is zero counts its error against 1 (absolute)."""
    worst_rel, worst_cos = 0.0, 1.0
    for h in range(0, exact.shape[2], HEAD_CHUNK):
        o, e = out[:, :, h:h + HEAD_CHUNK].float(), exact[:, :, h:h + HEAD_CHUNK].float()
        diff = (o - e).pow(2).sum(dim=(1, 3))
        norm = e.pow(2).sum(dim=(1, 3))
        rel = (diff / torch.where(norm > 0, norm, torch.ones_like(norm))).sqrt()
        dot = (o * e).sum(dim=(1, 3))
        cos = dot / (o.pow(2).sum(dim=(1, 3)).sqrt() * norm.sqrt()).clamp_min(1e-30)
        cos = torch.where((norm == 0) & (o.pow(2).sum(dim=(1, 3)) == 0), torch.ones_like(cos), cos)
        r, c = float(rel.max()), float(cos.min())
        if not math.isnan(worst_rel):  # a NaN head stays the worst
            worst_rel = r if not r <= worst_rel else worst_rel
        if not math.isnan(worst_cos):
            worst_cos = c if not c >= worst_cos else worst_cos
    return worst_rel, worst_cos


def run_target(target: str, call: AttentionCall, ctx, kind: str | None = None, density: list | None = None):
    """``target``'s output for ``call`` (B, S, H, D), or a string saying why it cannot take it. A
    block-sparse target runs within a routed call (``kind`` its kind) on the selection the routing
    computes for it; (its density, the least kept mass of a query tile) is appended to ``density``."""
    base, sparsity = split_target(target)
    if sparsity is not None:
        return _run_sparse(base, sparsity, call, ctx, kind, density)
    name = backend_of(target)
    if name is not None:
        backend = ctx.external[name]
        why = backend.why_not(call)
        if why is not None:
            return why
        try:
            return backend.run(call)
        except (ValueError, NotImplementedError) as e:
            return str(e).splitlines()[0] if str(e) else type(e).__name__
    from ..attention import fp4_attention

    if call.unsupported_options():
        return f"has no {', '.join(call.unsupported_options())}"
    if call.parallel_config is not None:
        return "calibration runs on one GPU"
    try:
        return fp4_attention(call.query, call.key, call.value, method=target, layout="bshd",
                             attn_mask=boolean_mask(call.attn_mask), scale=call.scale, backend=ctx.backend)
    except (ValueError, TypeError, NotImplementedError) as e:
        return str(e).splitlines()[0]


def _run_sparse(method: str, sparsity, call: AttentionCall, ctx, kind, density):
    from ..attention import fp4_attention
    from ..integration.routing import current_selection

    if kind is None:
        return "block-sparse candidates are measured within the routed calls only"
    if call.unsupported_options():
        return f"has no {', '.join(call.unsupported_options())}"
    try:
        mask = boolean_mask(call.attn_mask)
        selection = current_selection(kind, sparsity, call, mask, method)
        out = fp4_attention(call.query, call.key, call.value, method=method, layout="bshd", attn_mask=mask,
                            scale=call.scale, backend=ctx.backend, sparsity=selection)
    except (ValueError, TypeError, NotImplementedError) as e:
        return str(e).splitlines()[0]
    if density is not None:  # (its density, the least kept mass of a query tile by its check)
        kept = math.nan if selection.check is None else float(selection.check.summary()["kept_min"])
        density.append((float(selection.density()), kept))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Measurer:
    """The observer of one calibration pass (``ctx.observer``) and the transformers' hooks."""

    def __init__(self, ctx, candidates: list[str], *, propagation: int, propagation_target: str | None, seed: int):
        self.ctx = ctx
        # exact backends meet every budget: only whether they take each call is kept
        self.exact = [c for c in candidates if c != "fp16" and is_exact_target(c)]
        self.candidates = [c for c in candidates if c != "fp16" and c not in self.exact]
        self.stats: dict = {}
        self.samples: dict = {}  # shape -> AttentionCall (one per distinct shape, for timing)
        self.calls_by_shape: dict = defaultdict(int)
        self.forward_seconds = 0.0
        self.observer_seconds = 0.0
        self.forwards = 0
        self.propagation = propagation
        self.propagation_target = propagation_target
        self.rng = random.Random(seed)
        self.pairs: list = []  # (site key, target, attention rel L2 of that call, transformer output rel L2)
        self.last: dict = {}  # (expert, block, kind) -> {target: rel L2} of the current forward
        self.replaying = False
        self.enabled = True
        self.handles = []
        self._t0 = None
        self._replayed = set()
        self.run_index = 0  # which prompt's run is going on (replays happen in the first)
        self.num_steps_seen: set = set()  # the schedule lengths the observed calls knew (None: unknown)

    # --- the observer ----------------------------------------------------------------------------

    def __call__(self, *, site, kind, call: AttentionCall, out, ran):
        if self.replaying or not self.enabled or site.block < 0:
            return
        # the stock forward's queued work finishes on its own clock, not the observer's
        _sync(call.query.device)
        t0 = time.perf_counter()
        exact = out[0] if isinstance(out, (tuple, list)) else out
        ctx = self.ctx
        key = (ctx.expert, site.block, kind, ctx.step)
        self.num_steps_seen.add(ctx.num_steps)
        stats = self.stats.setdefault(key, SiteStats())
        q, k = call.query, call.key
        stats.calls += 1
        stats.shape = (int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), int(q.shape[3]))
        shape = stats.shape + (call.attn_mask is not None,)
        self.calls_by_shape[shape] += 1
        if shape not in self.samples:
            self.samples[shape] = AttentionCall(q.detach().clone(), k.detach().clone(), call.value.detach().clone(),
                                                None if call.attn_mask is None else call.attn_mask.clone(),
                                                scale=call.scale)
        for target in self.exact:
            why = ctx.external[backend_of(target)].why_not(call)
            if why is not None:
                stats.refused.setdefault(target, why)
        errors = {}
        with torch.no_grad():
            for target in self.candidates:
                density = []
                y = run_target(target, call, ctx, kind=kind, density=density)
                if isinstance(y, str):
                    stats.refused.setdefault(target, y)
                    continue
                rel, cos = head_errors(y, exact)
                del y
                stats.update(target, rel, cos)
                for d, kept in density:
                    stats.add_density(target, d)
                    stats.add_kept(target, kept)
                errors[target] = rel
        self.last[(ctx.expert, site.block, kind)] = errors
        _sync(q.device)
        self.observer_seconds += time.perf_counter() - t0

    # --- the transformers' hooks: forward time, and the replays that measure propagation ----------

    def attach(self, models) -> None:
        for expert, model in models:
            self.handles.append(model.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(model.register_forward_hook(self._post(model), with_kwargs=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module, args, kwargs):
        if self.replaying:
            return
        device = next(module.parameters()).device
        _sync(device)
        self.last = {}
        self._observer_at_start = self.observer_seconds
        self._t0 = time.perf_counter()

    def _post(self, model):
        def hook(module, args, kwargs, output):
            if self.replaying or self._t0 is None:
                return None
            device = next(module.parameters()).device
            _sync(device)
            self.forward_seconds += time.perf_counter() - self._t0 - (self.observer_seconds - self._observer_at_start)
            self.forwards += 1
            self._t0 = None
            if self.enabled and self.propagation > 0 and self.propagation_target is not None:
                self._replay(module, args, kwargs, output)
            return None

        return hook

    def _replay(self, module, args, kwargs, output):
        """Replay this forward with one site at a time on the propagation target: in the first run,
        at the first forward of each step, ``ceil(propagation / steps)`` sites drawn at random (a
        bare transformer: ``propagation`` sites of its first forward), until ``propagation`` pairs
        are measured."""
        import math

        ctx = self.ctx
        # a bare transformer's forwards know no step: all its pairs come from the first forward
        when = (ctx.expert, ctx.step) if ctx.num_steps else (ctx.expert, "forward", self.forwards)
        if self.run_index != 0 or when in self._replayed or len(self.pairs) >= self.propagation:
            return
        self._replayed.add(when)
        target = self.propagation_target
        options = sorted((k for k, errs in self.last.items() if target in errs), key=str)
        per_step = math.ceil(self.propagation / ctx.num_steps) if ctx.num_steps else self.propagation
        exact = _tensor_of(output)
        for site_key in self.rng.sample(options, min(per_step, len(options), self.propagation - len(self.pairs))):
            _, block, kind = site_key

            def override(site_name, b, k, block=block, kind=kind):
                return target if (b, k) == (block, kind) else None

            self.replaying = True
            previous, ctx.override = ctx.override, override
            calls_before = len(ctx.calls)
            try:
                with torch.no_grad():
                    replay = _tensor_of(module(*args, **kwargs))
            finally:
                ctx.override, self.replaying = previous, False
                del ctx.calls[calls_before:]  # the replay's calls are not the run's
            rel = float((replay.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-30))
            self.pairs.append(((ctx.expert, block, kind, ctx.step), target, self.last[site_key][target], rel))


def _tensor_of(output) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        return _tensor_of(output[0])
    sample = getattr(output, "sample", None)
    if torch.is_tensor(sample):
        return sample
    raise TypeError(f"cannot read the transformer's output from a {type(output).__name__}")
