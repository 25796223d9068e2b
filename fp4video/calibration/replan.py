"""Choosing again from a written report, measuring nothing: ``report.json`` holds every site's
statistics, every candidate's cost at each measured shape and the measured forward, which is all a
choice at another budget, or among fewer candidates, needs. The report is validated first
(:mod:`~fp4video.calibration.schema`): a number out of its range is refused, never believed."""

from __future__ import annotations

import datetime
from pathlib import Path

from .candidates import as_budget, as_target, check_match
from .plan import SiteStats, choose, policy_for, split_target
from .report import build_report, shape_key
from .result import FALLBACK, Calibration
from .schema import CalibrationReport, ReportError, load_report, validate_report

__all__ = ["replan", "read_report"]


def read_report(report) -> tuple[CalibrationReport, Path | None]:
    """(the validated report, the file it came from or None) from a report's path (its file or
    its ``--out`` folder), its dict or a :class:`CalibrationReport`. A file that is not there is a
    FileNotFoundError; a report that cannot be chosen from a :class:`ReportError` (a ValueError)
    naming the file, the field and the reason."""
    if isinstance(report, CalibrationReport):
        return report, None
    if isinstance(report, dict):
        return validate_report(report), None
    source = Path(report)
    if source.is_dir():
        source = source / "report.json"
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such calibration report (a `fp4video calibrate --out` folder's "
                                "report.json)")
    try:
        return load_report(source), source
    except ReportError as e:
        raise ReportError(f"{source}: {e}") from None


def _stats_of(s, shape: tuple) -> SiteStats:
    out = SiteStats(calls=s.calls, shape=shape, refused=dict(s.refused))
    out.rel_l2, out.cosine = dict(s.rel_l2), dict(s.cosine)
    out.density = {t: [v, 1] for t, v in s.density.items() if v is not None}
    out.kept = dict(s.kept)
    return out


def _linear_again(r: CalibrationReport, budget):
    """The linear layers chosen again at ``budget`` from the report's ``linear_sites`` (None: the
    report has none)."""
    if r.linear is None:
        return None
    from .linear import LinearSiteStats, choose_linear, linear_policy_for
    from .result import LinearCalibration

    stats = {}
    for s in r.linear_sites:
        st = LinearSiteStats(calls=s.calls, refused=dict(s.refused), worst_layer=dict(s.worst_layer))
        st.layers = {name: None for name in s.layers}
        st.rel_l2 = {m: v for m, v in s.rel_l2.items() if m != "bf16"}
        st.time_saved_ms, st.time_source = dict(s.time_saved_ms), dict(s.time_source)
        stats[(s.expert, s.block, s.kind)] = st
    lin = r.linear
    plan = choose_linear(stats, list(lin.methods), budget.rel_l2)
    unmeasured = [(u.expert, u.block, u.kind) for u in lin.unmeasured]
    policy = linear_policy_for(plan, unmeasured, compile=lin.compile)
    return LinearCalibration(policy=policy, plan=plan, stats=stats, methods=list(lin.methods),
                             forms=dict(lin.measured_by), rows=lin.rows_per_call, compile=lin.compile,
                             unmeasured=unmeasured)


def replan(report, *, budget=None, candidates=None) -> Calibration:
    """Choose again from a calibration's report (the path of its ``report.json`` or its folder,
    the dict, or a :class:`~fp4video.calibration.schema.CalibrationReport`) at another ``budget``
    or among fewer ``candidates``, without measuring anything. The new report keeps the
    measurement's date, device and cost, and says where it was re-chosen from."""
    r, source = read_report(report)
    budget = r.budget if budget is None else as_budget(budget)
    check_match(budget)
    measured = list(r.candidates)
    targets = measured if candidates is None else list(dict.fromkeys(["fp16", *map(as_target, candidates)]))
    unknown = [t for t in targets if t not in measured]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not measured in this calibration (its candidates: "
                         f"{', '.join(measured)})")
    stats, holdout_stats = {}, {}
    for site in r.sites:
        key = (site.expert, site.block, site.kind, site.step)
        stats[key] = _stats_of(site, tuple(site.shape))
        if site.holdout is not None:
            holdout_stats[key] = _stats_of(site.holdout, tuple(site.shape))
    if budget.match is not None and not any(budget.match in s.rel_l2 for s in stats.values()):
        raise ValueError(f"the budget matches {budget.match}, whose error this calibration never measured")
    table = {t: dict(row) for t, row in r.costs.relative_to_stock.items()}
    for t in list(table):  # a block-sparse candidate's row is its method's dense cost
        table.setdefault(split_target(t)[0], table[t])

    def cost_of(target, shape):
        return table.get(target, {}).get(shape_key(shape))

    plan = choose(stats, targets, cost_of, budget)
    policy = policy_for(plan, num_steps=r.num_steps, fp16_backend=r.fp16_backend, fallback=FALLBACK)
    result = Calibration(policy=policy, plan=plan, stats=stats, holdout_stats=holdout_stats, report={},
                         num_steps=r.num_steps, candidates=targets, linear=_linear_again(r, budget))
    pairs = [((q.expert, q.block, q.kind, q.step), r.propagation.target, q.attention_rel_l2, q.output_rel_l2)
             for q in r.propagation.pairs]
    calibration = r.calibration.model_dump(exclude={"sites", "statistics_kept"}, exclude_none=True)
    unavailable = {**r.unavailable, **{t: "left out when re-chosen" for t in measured if t not in targets}}
    result.report = build_report(
        result, model=r.model.model_dump(by_alias=True), prompts=list(r.prompts), holdout=list(r.holdout_prompts),
        budget=budget, costs=r.costs.source, cost_of=cost_of, measurements=r.measurements.model_dump(), pairs=pairs,
        unavailable=unavailable, calibration=calibration, device_name=r.device, fp16_exact=r.fp16_exact_backend,
        date=r.date)
    # chained re-plans keep the first measurement's budget
    measured_budget = (r.replanned.measured_budget if r.replanned is not None else r.budget).model_dump()
    result.report["replanned"] = {"from": str(source) if source is not None else "(a report dict)",
                                  "on": datetime.date.today().isoformat(), "measured_budget": measured_budget}
    return result
