"""The measuring run of :func:`calibrate`, step by step: the settings checked
(:class:`Settings`), the external candidates resolved, the pipeline run on the prompts with stock
attention while the observer measures every candidate at every site (:mod:`.measure`), the
candidates' costs (:mod:`.costs`), the plan chosen (:mod:`.plan`), and the result with its report
(:mod:`.report`)."""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..integration.policy import Policy, backend_of
from .candidates import DEFAULT_CANDIDATES, OPTIONAL_BACKENDS, as_budget, as_target, check_match, sparse_targets
from .plan import DEFAULT_RELATIVE_COST, Budget, choose, is_exact_target, policy_for
from .result import FALLBACK, Calibration

__all__ = ["calibrate", "Settings", "Measured"]

#: The largest seed torch's generator takes (64 bits, unsigned).
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class Settings:
    """What one calibration run is asked, checked and put in order (:meth:`of`): the inputs, the
    budget, every candidate to try, where the costs come from and how the run goes."""

    prompts: tuple
    holdout: tuple
    bare: bool  # a bare transformer: inputs are dicts of its forward's keyword arguments, no steps
    budget: Budget
    targets: tuple  # every candidate to try, fp16 first
    optional: frozenset  # those tried only where they run (reported where they do not)
    costs: object  # "table", "measure" or the Path of a `bench kernel` table
    call: object
    fp16_backend: str
    backend: str
    propagation: int
    seed: int
    progress: bool
    model_name: str | None
    linear: tuple = ()  # linear methods to measure ((): the linear layers are not calibrated)
    linear_rows: int = 256
    linear_compile: bool = False

    @classmethod
    def of(cls, pipe, prompts, *, holdout, budget, candidates, costs, call, fp16_backend, backend, propagation, seed,
           progress, model_name, sparse, linear=None, linear_rows=256, linear_compile=False) -> "Settings":
        """The settings of :func:`calibrate`'s arguments; a one-line ValueError or TypeError naming
        the argument that cannot be used, before anything runs."""
        from ..integration.backends import EXACT_PREFERENCE

        budget = as_budget(budget)
        check_match(budget)
        if fp16_backend not in ("stock", "fastest"):
            Policy(method="fp16", fp16_backend=fp16_backend)  # an unknown or quantizing backend: refused now
        prompts, holdout = list(prompts), list(holdout)
        if not prompts:
            raise ValueError("calibrate needs at least one prompt")
        bare = isinstance(pipe, torch.nn.Module)
        for p in prompts + holdout:
            if bare and not isinstance(p, dict):
                raise TypeError(f"a bare transformer calibrates on dicts of its forward's arguments, got "
                                f"{type(p).__name__}")
            if not bare and not isinstance(p, str):
                raise TypeError(f"prompts are strings, got {type(p).__name__} {p!r:.40}")
        if costs not in ("table", "measure"):
            costs = Path(costs)
            if not costs.is_file():
                raise FileNotFoundError(f"{costs}: no such cost table (a `fp4video bench kernel --out` file)")
        if not isinstance(propagation, int) or isinstance(propagation, bool) or propagation < 0:
            raise ValueError(f"propagation must be a whole number ≥ 0, got {propagation!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
            raise ValueError(f"seed must be a whole number from 0 to 2**64 - 1, got {seed!r}")
        named = list(map(as_target, candidates)) if candidates is not None else []
        targets = ["fp16", *(named if candidates is not None else DEFAULT_CANDIDATES)]
        if candidates is None:
            targets += [f"backend:{b}" for b in OPTIONAL_BACKENDS]
        if fp16_backend == "fastest":  # the FP16 tier per site: stock or the fastest exact backend there
            targets += [f"backend:{b}" for b in EXACT_PREFERENCE if b != "native"]
        targets = list(dict.fromkeys(targets))
        optional = frozenset(targets) - set(named)  # tried where they run, listed as unavailable elsewhere
        targets = list(dict.fromkeys(targets + sparse_targets(sparse, targets)))
        linear = _linear_methods(linear)
        if isinstance(linear_rows, bool) or not isinstance(linear_rows, int) or linear_rows < 1:
            raise ValueError(f"linear_rows must be a whole number >= 1 (input rows sampled per linear call), got "
                             f"{linear_rows!r}")
        if not isinstance(linear_compile, bool):
            raise TypeError(f"linear_compile must be True or False, got {linear_compile!r}")
        return cls(prompts=tuple(prompts), holdout=tuple(holdout), bare=bare, budget=budget, targets=tuple(targets),
                   optional=optional, costs=costs, call=call, fp16_backend=fp16_backend, backend=backend,
                   propagation=propagation, seed=seed, progress=progress, model_name=model_name, linear=linear,
                   linear_rows=linear_rows, linear_compile=linear_compile)


def _linear_methods(linear) -> tuple:
    """``calibrate``'s ``linear=``: None (not calibrated), a method name or a list of them."""
    from ..integration.linear import METHODS

    if linear is None:
        return ()
    if not isinstance(linear, (str, list, tuple)):
        raise ValueError(f"linear must be a method name or a list of them (of {', '.join(METHODS)}), got {linear!r}")
    methods = [linear] if isinstance(linear, str) else list(linear)
    for m in methods:
        if not isinstance(m, str) or m not in METHODS:
            raise ValueError(f"unknown linear method {m!r}; allowed: {', '.join(METHODS)}")
    if not methods:
        raise ValueError(f"linear names no method; give one or more of {', '.join(METHODS)}, or leave it out")
    return tuple(dict.fromkeys(["bf16", *methods]))


@dataclass
class Measured:
    """What the measuring run found: per site the calibration prompts' statistics and the hold-out
    prompts', one input sample and the call count of each shape, the stock forwards' time (the
    observer's own excluded), the propagation pairs and the schedule's step count."""

    stats: dict
    holdout_stats: dict
    samples: dict
    calls_by_shape: dict
    forward_seconds: float
    forwards: int
    pairs: list
    num_steps: int | None
    unavailable: dict = field(default_factory=dict)
    linear: object = None  # the LinearObserver (its per-site statistics), when linear layers are calibrated


def calibrate(pipe, prompts, *, holdout=(), budget=0.1, candidates=None, costs="table", call=None,
              fp16_backend: str = "stock", backend: str = "auto", propagation: int = 8, seed: int = 0,
              progress: bool = True, model_name: str | None = None, sparse=None, linear=None, linear_rows: int = 256,
              linear_compile: bool = False) -> Calibration:
    """Calibrate ``pipe`` (a diffusers video pipeline, or a bare transformer) on ``prompts``.

    Args:
        prompts: prompts to calibrate on (for a bare transformer: dicts of its forward's keyword
            arguments, one forward each).
        holdout: prompts (or input dicts) the plan is checked on, not chosen from.
        budget: the largest relative L2 error of a site's attention output (worst head, worst
            call), or a :class:`~fp4video.calibration.plan.Budget`.
        candidates: targets to choose from: fp4video method names, ``"backend:<name>"`` and
            block-sparse methods (``"mxattn-pv8+dynamic:0.9"``); default
            :data:`~fp4video.calibration.candidates.DEFAULT_CANDIDATES` plus every
            :data:`~fp4video.calibration.candidates.OPTIONAL_BACKENDS` that runs here.
        sparse: block-sparse candidates besides: None (none), True
            (:data:`~fp4video.calibration.candidates.DEFAULT_SPARSE`) or a list of selections
            (``"dynamic:0.9"``, ``"static:1,8,8,radial"``) for the fastest method candidate, or whole
            candidate names. Each is measured on the selection each call would get (a static window
            where the call's latent grid is known; refused elsewhere) and costs its method's time ×
            :func:`~fp4video.calibration.plan.sparse_time` of its mean density.
        costs: ``"table"`` (H200 relative times), ``"measure"`` (timed on this device at the
            sites' shapes) or the path of a ``fp4video bench kernel`` markdown table.
        call: the pipeline's keyword arguments besides the prompt (a dict), or a function
            ``prompt -> kwargs``; ``output_type`` defaults to ``"latent"`` and the generator is
            seeded with ``seed`` per prompt.
        fp16_backend: the calibrated policy's FP16 tier: ``stock``, an exact backend's name, or
            ``fastest``: per site, stock attention or the exact backend installed that is cheapest
            there (each exact backend of :data:`~fp4video.integration.backends.EXACT_PREFERENCE`
            becomes a candidate; the policy names them by rules).
        backend: fp4video's kernels (``auto``, ``reference``, ``triton``).
        propagation: how many (site, step) pairs to replay with that one site quantized, measuring
            the transformer output's error (0: none).
        progress: show progress bars (the pipeline's own too: without, it is off during the run and
            restored after).
        linear: linear methods to calibrate too (``"fp8-rowwise"``, a list of
            :data:`~fp4video.integration.linear.METHODS`): every linear layer inside the blocks is
            measured in the same forwards (:mod:`.linear`), and per linear site (expert, block,
            kind) the method within the same budget that saves the most time is chosen
            (``result.linear_policy``, a :class:`~fp4video.integration.linear.LinearPolicy`).
        linear_rows: input rows (tokens) sampled per linear call.
        linear_compile: time the linear methods under ``torch.compile`` (the policy's ``compile``).
    """
    from ..integration import install, uninstall
    from ..integration.backends import resolve
    from .costs import cost_function, stock_and_candidate_times

    settings = Settings.of(pipe, prompts, holdout=holdout, budget=budget, candidates=candidates, costs=costs,
                           call=call, fp16_backend=fp16_backend, backend=backend, propagation=propagation, seed=seed,
                           progress=progress, model_name=model_name, sparse=sparse, linear=linear,
                           linear_rows=linear_rows, linear_compile=linear_compile)
    device, dtype = _device_of(pipe)
    forms = {}
    if settings.linear:
        from .linear import check_linear_methods

        _, forms = check_linear_methods(settings.linear, device)
    start_bytes = _start_memory(device)
    t_start = time.perf_counter()
    # the measuring installation: stock attention (fp16 on the stock backend) with the observer
    ctx = install(pipe, Policy(method="fp16"), backend=settings.backend, record=False)
    try:
        targets, unavailable = _resolve_external(ctx, settings, device, dtype)
        measured = _measure(pipe, ctx, settings, targets, forms)
        fp16_exact = None  # "fp16" is stock attention, or this exact backend
        if settings.fp16_backend not in ("stock", "fastest"):
            fp16_exact = resolve(settings.fp16_backend, device=device, dtype=dtype)
        times = stock_and_candidate_times(measured.samples, targets, ctx, fp16_exact,
                                          measure=(settings.costs == "measure"), progress=settings.progress)
        cost_of = cost_function(settings.costs, times, fp16_exact)
        _drop_uncosted(targets, unavailable, settings, measured.stats, cost_of)
    finally:
        uninstall(pipe)
    if not measured.stats:
        raise ValueError("no attention call went through fp4video's routing during the calibration run")
    linear = _linear(pipe, settings, measured.linear, forms) if settings.linear else None
    plan = choose(measured.stats, targets, cost_of, settings.budget)
    # under "fastest" the plan names each site's exact backend; elsewhere "fp16" is stock
    policy = policy_for(plan, num_steps=measured.num_steps,
                        fp16_backend="stock" if settings.fp16_backend == "fastest" else settings.fp16_backend,
                        fallback=FALLBACK)
    seconds = time.perf_counter() - t_start
    result = Calibration(policy=policy, plan=plan, stats=measured.stats, holdout_stats=measured.holdout_stats,
                         report={}, num_steps=measured.num_steps, candidates=targets, linear=linear)
    result.report = _report(result, pipe, settings, measured, times, cost_of, unavailable, fp16_exact,
                            calibration={"seconds": seconds, **_peak_memory(device, start_bytes)},
                            device_name=_device_name(device))
    return result


def _linear(pipe, settings: Settings, observer, forms: dict):
    """The linear layers' times, plan and policy from what ``observer`` measured
    (:class:`~fp4video.calibration.result.LinearCalibration`); the policy checked against the
    pipeline's own layers (``plan_linear`` gives each its site's method)."""
    from .linear import choose_linear, linear_policy_for, linear_times, verify_linear_policy
    from .result import LinearCalibration

    linear_times(observer, compile=settings.linear_compile)
    plan = choose_linear(observer.stats, list(settings.linear), settings.budget.rel_l2)
    policy = linear_policy_for(plan, observer.unmeasured, compile=settings.linear_compile)
    verify_linear_policy(pipe, policy, plan)
    return LinearCalibration(policy=policy, plan=plan, stats=observer.stats, methods=list(settings.linear),
                             forms=forms, rows=settings.linear_rows, compile=settings.linear_compile,
                             unmeasured=list(observer.unmeasured))


def _resolve_external(ctx, settings: Settings, device, dtype) -> tuple[list, dict]:
    """(the candidates that run here, {candidate: why not} of the optional ones that do not): each
    external backend resolved on the model's device and dtype into ``ctx.external``."""
    from ..integration.backends import BackendUnavailable, resolve

    targets, unavailable = list(settings.targets), {}
    for t in list(targets):
        name = backend_of(t)
        if name is None:
            continue
        try:
            ctx.external[name] = resolve(name, device=device, dtype=dtype)
        except BackendUnavailable as e:
            if t not in settings.optional:
                raise
            unavailable[t] = str(e)
            targets.remove(t)
    match = settings.budget.match
    if match is not None and match not in targets:
        raise ValueError(f"the budget matches {match}, which is not a candidate here"
                         + (f": {unavailable[match]}" if match in unavailable else ""))
    return targets, unavailable


@contextlib.contextmanager
def _pipeline_progress(pipe, show: bool):
    """The pipeline's own progress bar (diffusers' tqdm over the denoising steps) off within the
    block unless ``show``, and its configuration as it was afterwards."""
    setter = getattr(pipe, "set_progress_bar_config", None)
    if show or setter is None:
        yield
        return
    from ..integration.diffusers_api import progress_bar_config

    before = progress_bar_config(pipe)  # put back through the public setter
    setter(**{**before, "disable": True})
    try:
        yield
    finally:
        setter(**before)


def _measure(pipe, ctx, settings: Settings, targets: list, forms: dict | None = None) -> Measured:
    """Run the prompts (then the hold-out prompts) with the observer measuring every candidate (and,
    with ``settings.linear``, every linear layer inside the blocks under each method, measured as
    ``forms`` says)."""
    from tqdm import tqdm

    from ..integration.install import transformers_of
    from .measure import Measurer

    quantized = [t for t in targets if not is_exact_target(t)]
    prop_target = None
    if settings.propagation and quantized:  # the cheapest by the table where it knows them (else the last)
        known = [t for t in quantized if t in DEFAULT_RELATIVE_COST]
        prop_target = min(known, key=DEFAULT_RELATIVE_COST.get) if known else quantized[-1]
    measurer = Measurer(ctx, targets, propagation=settings.propagation, propagation_target=prop_target,
                        seed=settings.seed)
    ctx.observer = measurer
    measurer.attach(transformers_of(pipe))
    linear, holding_out = None, []
    if settings.linear:  # the linear layers, in the same forwards (not the replays, not the hold-out prompts)
        from .linear import LinearObserver

        def excluded(seconds):
            measurer.observer_seconds += seconds

        linear = LinearObserver(pipe, list(settings.linear), forms, rows=settings.linear_rows, seed=settings.seed,
                                active=lambda: measurer.enabled and not measurer.replaying and not holding_out,
                                excluded=excluded)
        linear.attach()
    try:
        with _pipeline_progress(pipe, settings.progress):
            for i, p in enumerate(tqdm(settings.prompts, desc="calibrate", unit="prompt",
                                       disable=not settings.progress)):
                measurer.run_index = i
                _run_once(pipe, p, settings)
            stats = measurer.stats
            out = Measured(stats=stats, holdout_stats={}, samples=measurer.samples,
                           calls_by_shape=dict(measurer.calls_by_shape), forward_seconds=measurer.forward_seconds,
                           forwards=measurer.forwards, pairs=measurer.pairs, num_steps=None, linear=linear)
            holding_out.append(True)
            if settings.holdout:
                measurer.stats, measurer.propagation = {}, 0
                for i, p in enumerate(tqdm(settings.holdout, desc="hold-out", unit="prompt",
                                           disable=not settings.progress)):
                    measurer.run_index = len(settings.prompts) + i
                    _run_once(pipe, p, settings)
                out.holdout_stats = measurer.stats
    finally:
        measurer.detach()
        if linear is not None:
            linear.detach()
        ctx.observer = None
    out.num_steps = None if settings.bare else _one_schedule(measurer.num_steps_seen)
    return out


def _one_schedule(seen: set) -> int | None:
    """The step count of the run's schedule (None: no step was known, e.g. a schedule shorter than
    its scheduler's order); a run whose prompts ran schedules of different lengths is refused (a
    policy's steps are fractions of one schedule)."""
    counts = sorted(n for n in seen if n is not None)
    if len(counts) > 1:
        raise ValueError(f"the prompts ran schedules of {', '.join(map(str, counts))} denoising steps: a calibrated "
                         "policy's steps are fractions of one schedule; give every prompt the same steps")
    return counts[0] if counts and counts[0] >= 1 else None


def _drop_uncosted(targets: list, unavailable: dict, settings: Settings, stats: dict, cost_of) -> None:
    """Optional candidates the cost source has no time for leave ``targets`` (listed in
    ``unavailable``); a named one without a cost is an error."""
    shapes = {s.shape for s in stats.values()}
    missing = sorted({t for t in targets for shape in shapes if cost_of(t, shape) is None})
    for t in [t for t in missing if t in settings.optional]:  # installed, but the cost source has no time for it
        unavailable[t] = f"no time for it in the {settings.costs} cost source (--costs measure times it here)"
        targets.remove(t)
        missing.remove(t)
    if missing:
        raise ValueError(f"no cost for {', '.join(missing)} in the {settings.costs} cost source: give --costs measure, "
                         "a `bench kernel` table that has them, or leave them out of the candidates")


def _report(result: Calibration, pipe, settings: Settings, measured: Measured, times: dict, cost_of, unavailable,
            fp16_exact, *, calibration: dict, device_name: str) -> dict:
    from .report import build_report, input_labels, model_summary

    shapes = measured.calls_by_shape.items()
    measurements = {"shapes": [{"shape": list(shape[:4]), "masked": bool(shape[4]), "calls": n,
                                "stock_seconds": times[shape]["stock"]} for shape, n in shapes],
                    "forward_seconds": measured.forward_seconds, "forwards": measured.forwards}
    return build_report(
        result, model=model_summary(pipe, settings.model_name), prompts=input_labels(settings.prompts),
        holdout=input_labels(settings.holdout, "hold-out inputs"), budget=settings.budget, costs=settings.costs,
        cost_of=cost_of, measurements=measurements, pairs=measured.pairs, unavailable=unavailable,
        calibration=calibration, device_name=device_name, fp16_exact=None if fp16_exact is None else fp16_exact.name,
        date=datetime.date.today().isoformat())


def _run_once(pipe, prompt, settings: Settings):
    with torch.no_grad():
        if settings.bare:
            return pipe(**prompt)
        call = settings.call
        kw = call(prompt) if callable(call) else dict(call or {})
        kw.setdefault("output_type", "latent")
        kw["prompt"] = prompt
        kw.setdefault("generator", torch.Generator(device="cpu").manual_seed(settings.seed))
        return pipe(**kw)


def _device_of(pipe):
    from ..integration.install import model_place, transformers_of

    return model_place(transformers_of(pipe)[0][1])


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def _start_memory(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_memory(device, start_bytes: int) -> dict:
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        return {"peak_bytes": peak, "what": "peak CUDA memory allocated (the model's included)",
                "peak_over_start_bytes": peak - start_bytes}
    import resource

    return {"peak_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "what": "peak resident memory of the process (CPU)"}

