"""``fp4video.calibrate``: find where a model needs precision, and the cheapest attention per site.

    import fp4video
    result = fp4video.calibrate(pipe, ["a cat on the grass", "a city at night"],
                                holdout=["a dog running"], budget=0.1,
                                call=dict(height=480, width=832, num_frames=81, num_inference_steps=40))
    result.write("calib/")              # policy.yaml, report.json, report.md, heatmap.png
    fp4video.install(pipe, result.policy)

The pipeline runs on the prompts with stock attention. At every site (expert × block × kind ×
denoising step) each candidate (fp4video methods and the external backends installed) runs on
the very inputs of each stock call and is compared with its output (worst head's relative L2 and
cosine); only these statistics are kept. Per site the cheapest candidate within the budget
(:class:`~fp4video.calibration.plan.Budget`, unit documented there) is chosen, and the result is a
:class:`~fp4video.integration.Policy` routing exactly that plan. The report predicts the step's
speed-up against stock and against each candidate alone, checks the plan on hold-out prompts, and
measures for a sample of sites how their error carries to the transformer's output.

Block-sparse candidates (``sparse=``: a method run on a dynamic or static selection of key tiles,
:mod:`fp4video.sparse`) are measured the same way on the selection each call would get, and cost
their method's time × :func:`~fp4video.calibration.plan.sparse_time` of their measured density at
the site; the policy names the chosen ones with ``sparsity:``.

A bare transformer calibrates too: ``calibrate(transformer, [inputs, ...])`` with each input a
dict of the transformer's keyword arguments (one forward each; no denoising step is known, so the
policy is per block and kind).

:func:`replan` chooses again from a written ``report.json`` at another budget or among fewer
candidates, measuring nothing.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..integration.policy import Policy, backend_of
from .plan import (DEFAULT_RELATIVE_COST, Budget, SiteStats, choose, costs_from_table, is_exact_target, nearest,
                   plan_of_policy, policy_for, sparse_target, split_target)

__all__ = ["calibrate", "replan", "Calibration", "Budget", "DEFAULT_CANDIDATES", "OPTIONAL_BACKENDS", "DEFAULT_SPARSE"]

#: fp4video's methods a calibration tries by default (fp16 is always a candidate).
DEFAULT_CANDIDATES = ("fp16", "fp8", "mxattn-pv8", "mxattn")

#: The block-sparse selections ``sparse=True`` tries on the fastest method candidate: the dynamic
#: selection at τ 0.9 and 0.95, and the static window of ``configs/wan22_mxattn_pv8_sparse.yaml``
#: (radial; it applies where the latent grid is known: self and joint attention of a video
#: transformer's input).
DEFAULT_SPARSE = ("dynamic:0.9", "dynamic:0.95", "static:4,45,80,radial")

#: Quantized external backends tried by default where they run (each refused one is reported).
OPTIONAL_BACKENDS = ("fa3_fp8", "sage", "_sage_qk_int8_pv_fp8_cuda_sm90", "sage3_blackwell", "flashinfer_nvfp4_sm120")


@dataclass
class Calibration:
    """What :func:`calibrate` found: ``policy`` (install it), ``plan`` ({site: target}),
    ``stats`` ({site: :class:`SiteStats`}, calibration prompts), ``holdout_stats`` (hold-out
    prompts), ``report`` (a JSON-ready dict). Sites are (expert, block, kind, step) tuples."""

    policy: Policy
    plan: dict
    stats: dict
    holdout_stats: dict
    report: dict
    num_steps: int | None = None
    candidates: list = field(default_factory=list)

    def policy_yaml(self) -> str:
        from .report import policy_yaml

        return policy_yaml(self)

    def write(self, out_dir) -> dict:
        """Write ``policy.yaml``, ``report.json``, ``report.md`` and ``heatmap.png`` in ``out_dir``;
        returns {what: path}."""
        from .report import write_all

        return write_all(self, Path(out_dir))

    def uniform_plan(self, target: str) -> dict:
        """{site: target} of ``target`` everywhere (the FP16 tier where it refused a call)."""
        return {k: target if target not in s.refused else "fp16" for k, s in self.stats.items()}


#: What a calibrated policy does with a call its chosen backend cannot take (a mask or an LSE request
#: the calibration run never made): stock attention, recorded with the target it planned.
FALLBACK = "stock"


def _check_match(budget: Budget) -> None:
    if budget.match is None:
        return
    if is_exact_target(_as_target(budget.match)):
        raise ValueError(f"the budget matches {budget.match}, an exact backend: it has no error to match (every "
                         "candidate would have to be exact); give a relative L2 budget instead")


def _as_budget(budget) -> Budget:
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a number (relative L2 per site) or a Budget, got {type(budget).__name__}")
    return Budget(rel_l2=float(budget))


def _as_target(c) -> str:
    from ..recipe import METHODS

    if not isinstance(c, str):
        raise TypeError(f"a candidate is a method name or 'backend:<name>', got {type(c).__name__} {c!r:.40}")
    if c in METHODS:
        return c
    base, sparsity = split_target(c) if backend_of(c) is None else (c, None)
    if sparsity is not None:
        if base not in METHODS or base == "fp16":
            raise ValueError(f"block-sparse candidate {c!r}: {base!r} is not one of fp4video's quantized methods")
        return sparse_target(base, sparsity)
    if backend_of(c) is not None:
        from ..integration.backends import check_backend_name

        check_backend_name(backend_of(c))
        return c
    raise ValueError(f"unknown candidate {c!r}: give an fp4video method ({', '.join(METHODS)}) or 'backend:<name>'")


def sparse_targets(sparse, targets: list) -> list:
    """The block-sparse candidates ``sparse`` names: None or False none; True
    :data:`DEFAULT_SPARSE`; else a list of specs (``dynamic:0.9``, ``static:1,8,8,radial``) for the
    fastest fp4video method among ``targets`` (by :data:`DEFAULT_RELATIVE_COST`) or whole candidate
    names (``mxattn+dynamic:0.95``)."""
    if sparse is None or sparse is False:
        return []
    specs = DEFAULT_SPARSE if sparse is True else [sparse] if isinstance(sparse, str) else list(sparse)
    methods = [t for t in targets if backend_of(t) is None and t != "fp16" and split_target(t)[1] is None]
    fastest = min(methods, key=lambda t: DEFAULT_RELATIVE_COST.get(t, math.inf)) if methods else None
    out = []
    for spec in specs:
        if not isinstance(spec, str):
            raise TypeError(f"a sparse candidate is a string (dynamic:0.9, static:1,8,8 or method+dynamic:0.9), got "
                            f"{type(spec).__name__} {spec!r:.40}")
        if "+" in spec:
            out.append(_as_target(spec))
        elif fastest is None:
            raise ValueError(f"sparse candidate {spec!r}: no fp4video method among the candidates to run it")
        else:
            out.append(sparse_target(fastest, spec))
    return out


def _device_of(pipe):
    from ..integration.install import transformers_of

    model = transformers_of(pipe)[0][1]
    p = next(model.parameters())
    return p.device, p.dtype


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def calibrate(pipe, prompts, *, holdout=(), budget=0.1, candidates=None, costs="table", call=None,
              fp16_backend: str = "stock", backend: str = "auto", propagation: int = 8, seed: int = 0,
              progress: bool = True, model_name: str | None = None, sparse=None) -> Calibration:
    """Calibrate ``pipe`` (a diffusers video pipeline, or a bare transformer) on ``prompts``.

    Args:
        prompts: prompts to calibrate on (for a bare transformer: dicts of its forward's keyword
            arguments, one forward each).
        holdout: prompts (or input dicts) the plan is checked on, not chosen from.
        budget: the largest relative L2 error of a site's attention output (worst head, worst
            call), or a :class:`Budget`.
        candidates: targets to choose from: fp4video method names, ``"backend:<name>"`` and
            block-sparse methods (``"mxattn-pv8+dynamic:0.9"``); default :data:`DEFAULT_CANDIDATES`
            plus every :data:`OPTIONAL_BACKENDS` that runs here.
        sparse: block-sparse candidates besides: None (none), True (:data:`DEFAULT_SPARSE`) or a
            list of selections (``"dynamic:0.9"``, ``"static:1,8,8,radial"``) for the fastest method
            candidate, or whole candidate names. Each is measured on the selection each call would
            get (a static window where the call's latent grid is known; refused elsewhere) and costs
            its method's time × :func:`~fp4video.calibration.plan.sparse_time` of its mean density.
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
        progress: show progress bars.
    """
    from tqdm import tqdm

    from ..integration import install, uninstall
    from ..integration.backends import EXACT_PREFERENCE, BackendUnavailable, resolve
    from ..integration.install import transformers_of
    from .measure import Measurer

    budget = _as_budget(budget)
    prompts, holdout = list(prompts), list(holdout)
    _check_match(budget)
    if fp16_backend not in ("stock", "fastest"):
        Policy(method="fp16", fp16_backend=fp16_backend)  # an unknown or quantizing backend: refused now
    if not prompts:
        raise ValueError("calibrate needs at least one prompt")
    bare = isinstance(pipe, torch.nn.Module)
    for p in prompts + holdout:
        if bare and not isinstance(p, dict):
            raise TypeError(f"a bare transformer calibrates on dicts of its forward's arguments, got {type(p).__name__}")
        if not bare and not isinstance(p, str):
            raise TypeError(f"prompts are strings, got {type(p).__name__} {p!r:.40}")
    if costs not in ("table", "measure"):
        costs = Path(costs)
        if not costs.is_file():
            raise FileNotFoundError(f"{costs}: no such cost table (a `fp4video bench kernel --out` file)")
    if not isinstance(propagation, int) or isinstance(propagation, bool) or propagation < 0:
        raise ValueError(f"propagation must be a whole number ≥ 0, got {propagation!r}")
    device, dtype = _device_of(pipe)
    named = list(map(_as_target, candidates)) if candidates is not None else []
    targets = ["fp16", *(named if candidates is not None else DEFAULT_CANDIDATES)]
    if candidates is None:
        targets += [f"backend:{b}" for b in OPTIONAL_BACKENDS]
    if fp16_backend == "fastest":  # the FP16 tier per site: stock or the fastest exact backend there
        targets += [f"backend:{b}" for b in EXACT_PREFERENCE if b != "native"]
    targets = list(dict.fromkeys(targets))
    optional = set(targets) - set(named)  # tried where they run, listed as unavailable elsewhere
    targets = list(dict.fromkeys(targets + sparse_targets(sparse, targets)))
    start_bytes = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    t_start = time.perf_counter()

    # the measuring installation: stock attention (fp16 on the stock backend) with the observer
    ctx = install(pipe, Policy(method="fp16"), backend=backend, record=False)
    unavailable = {}
    try:
        for t in list(targets):
            name = backend_of(t)
            if name is None:
                continue
            try:
                ctx.external[name] = resolve(name, device=device, dtype=dtype)
            except BackendUnavailable as e:
                if t not in optional:
                    raise
                unavailable[t] = str(e)
                targets.remove(t)
        if budget.match is not None and budget.match not in targets:
            raise ValueError(f"the budget matches {budget.match}, which is not a candidate here"
                             + (f": {unavailable[budget.match]}" if budget.match in unavailable else ""))
        quantized = [t for t in targets if not is_exact_target(t)]
        cost_of = None
        prop_target = None
        if propagation and quantized:  # the cheapest by the table where it knows them (else the last)
            known = [t for t in quantized if t in DEFAULT_RELATIVE_COST]
            prop_target = min(known, key=DEFAULT_RELATIVE_COST.get) if known else quantized[-1]
        measurer = Measurer(ctx, targets, propagation=propagation, propagation_target=prop_target, seed=seed)
        ctx.observer = measurer
        models = transformers_of(pipe)
        measurer.attach(models)
        try:
            for i, p in enumerate(tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress)):
                measurer.run_index = i
                _run_once(pipe, p, call, seed, bare)
            stats, samples, calls_by_shape = measurer.stats, measurer.samples, dict(measurer.calls_by_shape)
            fwd_seconds, forwards, pairs = measurer.forward_seconds, measurer.forwards, measurer.pairs
            holdout_stats = {}
            if holdout:
                measurer.stats, measurer.propagation = {}, 0
                for i, p in enumerate(tqdm(holdout, desc="hold-out", unit="prompt", disable=not progress)):
                    measurer.run_index = len(prompts) + i
                    _run_once(pipe, p, call, seed, bare)
                holdout_stats = measurer.stats
        finally:
            measurer.detach()
            ctx.observer = None
        num_steps = None if bare else _num_steps(pipe)
        fp16_exact = None  # "fp16" is stock attention, or this exact backend
        if fp16_backend not in ("stock", "fastest"):
            fp16_exact = resolve(fp16_backend, device=device, dtype=dtype)
        times = _stock_and_candidate_times(samples, targets, ctx, fp16_exact, measure=(costs == "measure"),
                                           progress=progress)
        cost_of = _cost_function(costs, times, fp16_exact)
        missing = sorted({t for t in targets if cost_of(t, next(iter(stats.values())).shape) is None}) if stats else []
        for t in [t for t in missing if t in optional]:  # installed, but the cost source has no time for it
            unavailable[t] = f"no time for it in the {costs} cost source (--costs measure times it here)"
            targets.remove(t)
            missing.remove(t)
        if missing:
            raise ValueError(f"no cost for {', '.join(missing)} in the {costs} cost source: give --costs measure, a "
                             "`bench kernel` table that has them, or leave them out of the candidates")
    finally:
        uninstall(pipe)
    if not stats:
        raise ValueError("no attention call went through fp4video's routing during the calibration run")
    plan = choose(stats, targets, cost_of, budget)
    # under "fastest" the plan names each site's exact backend; elsewhere "fp16" is stock
    policy = policy_for(plan, num_steps=num_steps, fp16_backend="stock" if fp16_backend == "fastest" else fp16_backend,
                        fallback=FALLBACK)
    seconds = time.perf_counter() - t_start
    from .report import build_report, input_labels, model_summary

    result = Calibration(policy=policy, plan=plan, stats=stats, holdout_stats=holdout_stats, report={},
                         num_steps=num_steps, candidates=targets)
    measurements = {"shapes": [{"shape": list(shape[:4]), "masked": bool(shape[4]), "calls": n,
                                "stock_seconds": times[shape]["stock"]} for shape, n in calls_by_shape.items()],
                    "forward_seconds": fwd_seconds, "forwards": forwards}
    result.report = build_report(
        result, model=model_summary(pipe, model_name), prompts=input_labels(prompts), holdout=input_labels(holdout, "hold-out inputs"),
        budget=budget, costs=costs, cost_of=cost_of, measurements=measurements, pairs=pairs, unavailable=unavailable,
        calibration={"seconds": seconds, **_peak_memory(device, start_bytes)}, device_name=_device_name(device),
        fp16_exact=None if fp16_exact is None else fp16_exact.name, date=datetime.date.today().isoformat())
    return result


def _number(x):
    return float(x) if isinstance(x, str) else x  # non-finite floats are spelled as strings in report.json


def _stats_of(d: dict, shape) -> SiteStats:
    s = SiteStats(calls=d["calls"], shape=shape, refused=dict(d["refused"]))
    s.rel_l2 = {t: _number(v) for t, v in d["rel_l2"].items()}
    s.cosine = {t: _number(v) for t, v in d["cosine"].items()}
    s.density = {t: [_number(v), 1] for t, v in d["density"].items() if v is not None}
    return s


def replan(report, *, budget=None, candidates=None) -> Calibration:
    """Choose again from a calibration's report (the path of its ``report.json``, or the dict)
    at another ``budget`` or among fewer ``candidates``, without measuring anything: the report
    holds every site's statistics, the candidates' costs and the measured forward. The new report
    keeps the measurement's date, device and cost, and says where it was re-chosen from."""
    import json

    from .report import build_report, shape_key

    source = None
    if not isinstance(report, dict):
        source = Path(report)
        if source.is_dir():
            source = source / "report.json"
        if not source.is_file():
            raise FileNotFoundError(f"{source}: no such calibration report (a `fp4video calibrate --out` folder's "
                                    "report.json)")
        report = json.loads(source.read_text())
    if "measurements" not in report:
        raise ValueError("this report has no measurements section (written by an older fp4video): calibrate again")
    budget = Budget(**report["budget"]) if budget is None else _as_budget(budget)
    _check_match(budget)
    measured = report["candidates"]
    targets = measured if candidates is None else list(dict.fromkeys(["fp16", *map(_as_target, candidates)]))
    unknown = [t for t in targets if t not in measured]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not measured in this calibration (its candidates: "
                         f"{', '.join(measured)})")
    stats, holdout_stats = {}, {}
    for site in report["sites"]:
        key = (site["expert"], site["block"], site["kind"], site["step"])
        stats[key] = _stats_of(site, tuple(site["shape"]))
        if site.get("holdout") is not None:
            holdout_stats[key] = _stats_of(site["holdout"], tuple(site["shape"]))
    if budget.match is not None and not any(budget.match in s.rel_l2 for s in stats.values()):
        raise ValueError(f"the budget matches {budget.match}, whose error this calibration never measured")
    table = {t: {shape: _number(v) for shape, v in row.items()}
             for t, row in report["costs"]["relative_to_stock"].items()}
    for t in list(table):  # a block-sparse candidate's row is its method's dense cost
        table.setdefault(split_target(t)[0], table[t])

    def cost_of(target, shape):
        return table.get(target, {}).get(shape_key(shape))

    plan = choose(stats, targets, cost_of, budget)
    policy = policy_for(plan, num_steps=report["num_steps"], fp16_backend=report["fp16_backend"], fallback=FALLBACK)
    result = Calibration(policy=policy, plan=plan, stats=stats, holdout_stats=holdout_stats, report={},
                         num_steps=report["num_steps"], candidates=targets)
    pairs = [((q["expert"], q["block"], q["kind"], q["step"]), report["propagation"]["target"],
              _number(q["attention_rel_l2"]), _number(q["output_rel_l2"])) for q in report["propagation"]["pairs"]]
    calibration = {k: v for k, v in report["calibration"].items() if k not in ("sites", "statistics_kept")}
    unavailable = {**report["unavailable"], **{t: "left out when re-chosen" for t in measured if t not in targets}}
    result.report = build_report(
        result, model=report["model"], prompts=report["prompts"], holdout=report["holdout_prompts"], budget=budget,
        costs=report["costs"]["source"], cost_of=cost_of, measurements=report["measurements"], pairs=pairs,
        unavailable=unavailable, calibration=calibration, device_name=report["device"],
        fp16_exact=report["fp16_exact_backend"], date=report["date"])
    measured_budget = report.get("replanned", {}).get("measured_budget", report["budget"])  # chained: the first
    result.report["replanned"] = {"from": str(source) if source is not None else "(a report dict)",
                                  "on": datetime.date.today().isoformat(), "measured_budget": measured_budget}
    return result


def _run_once(pipe, prompt, call, seed: int, bare: bool):
    with torch.no_grad():
        if bare:
            return pipe(**prompt)
        kw = call(prompt) if callable(call) else dict(call or {})
        kw.setdefault("output_type", "latent")
        kw["prompt"] = prompt
        kw.setdefault("generator", torch.Generator(device="cpu").manual_seed(seed))
        return pipe(**kw)


def _num_steps(pipe) -> int | None:
    scheduler = getattr(pipe, "scheduler", None)
    timesteps = getattr(scheduler, "timesteps", None)
    if timesteps is None:
        return None
    return len(timesteps) // getattr(scheduler, "order", 1)


def _median_seconds(fn, device, reps: int = 3) -> float:
    fn()  # warm-up (and compilation)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _stock_and_candidate_times(samples, targets, ctx, fp16_exact, *, measure: bool, progress: bool) -> dict:
    """{shape: {"stock": s, target: s, ...}}: diffusers' active (stock) attention timed on each
    sample; with ``measure`` each candidate too (fp16 on its exact backend where one is set)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from tqdm import tqdm

    from .measure import run_target

    out = {}
    with torch.no_grad():
        for shape, a in tqdm(samples.items(), desc="timing", unit="shape", disable=not progress, leave=False):
            device = a.query.device
            row = {"stock": _median_seconds(lambda: dispatch_attention_fn(a.query, a.key, a.value,
                                                                          attn_mask=a.attn_mask, scale=a.scale), device)}
            if measure:
                for t in targets:
                    if t == "fp16":
                        if fp16_exact is not None and fp16_exact.why_not(a) is None:
                            row[t] = _median_seconds(lambda: fp16_exact.run(a), device)
                        else:
                            row[t] = row["stock"]
                        continue
                    if split_target(t)[1] is not None:
                        continue  # block-sparse: its method's time × its density's share (_cost_function)
                    if isinstance(run_target(t, a, ctx), str):
                        continue  # it cannot take these calls: never chosen for them
                    row[t] = _median_seconds(lambda t=t: run_target(t, a, ctx), device)
            out[shape] = row
    return out


def _cost_function(costs, times, fp16_exact):
    """cost(target, site shape) -> time relative to stock attention (None: unknown); a block-sparse
    candidate's is its method's dense one (:func:`~fp4video.calibration.plan.site_cost` scales it
    by the density measured at each site)."""
    by_shape = {shape[:4]: row for shape, row in times.items()}
    if costs == "measure":
        def cost(target, shape):
            target = split_target(target)[0]
            row = by_shape.get(shape)
            if row is None or target not in row:
                return math.inf if row is not None else None
            return row[target] / row["stock"]
        return cost
    if costs == "table":
        table = dict(DEFAULT_RELATIVE_COST)
    else:
        points = costs_from_table(Path(costs).read_text())
        table = None

    def cost(target, shape):
        target = split_target(target)[0]
        t = f"backend:{fp16_exact.name}" if target == "fp16" and fp16_exact is not None else target
        if table is not None:
            return table.get(t, 1.0 if t == "fp16" else None)
        seq = math.isqrt(shape[0] * shape[1])
        if t not in points:
            return 1.0 if t == "fp16" else None
        return nearest(points[t], seq)

    return cost


def _peak_memory(device, start_bytes: int) -> dict:
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        return {"peak_bytes": peak, "what": "peak CUDA memory allocated (the model's included)",
                "peak_over_start_bytes": peak - start_bytes}
    import resource

    return {"peak_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "what": "peak resident memory of the process (CPU)"}


__all__ += ["plan_of_policy", "SiteStats"]
