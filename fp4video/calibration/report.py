"""A calibration's outputs: the policy YAML with its header, the JSON and markdown reports, the heatmap."""

from __future__ import annotations

import json
import math
import statistics
import textwrap

import torch

from .plan import Budget, is_exact_target, site_cost, split_target

__all__ = ["build_report", "policy_yaml", "render_files", "markdown", "heatmap", "heatmap_figure", "costs_phrase",
           "short_reason", "FILE_NAMES", "predicted_times", "spearman", "site_order", "shape_key", "model_summary",
           "input_labels", "linear_report"]


def _site_dict(key) -> dict:
    expert, block, kind, step = key
    return {"expert": expert, "block": block, "kind": kind, "step": step}


def predicted_times(plan: dict, stats: dict, cost_of, stock_seconds: dict, other_seconds: float) -> float:
    """Predicted seconds of the calibration run's forwards under ``plan``: the time outside
    attention plus each site's calls at their stock time × the target's relative cost (a
    block-sparse target's at the site's measured density)."""
    total = other_seconds
    for key, target in plan.items():
        s = stats[key]
        total += s.calls * stock_seconds[s.shape] * site_cost(cost_of, target, s)
    return total


def spearman(xs: list, ys: list) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None with fewer than 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else None


def site_order(key) -> tuple:
    """Sorts sites by expert, block (as a number), kind, step."""
    expert, block, kind, step = key
    return (str(expert), block, kind, -1 if step is None else step)


def shape_key(shape) -> str:
    return "x".join(map(str, shape))


def model_summary(pipe, name: str | None) -> dict:
    """The report's ``model``: its name and each transformer's class, blocks and parameters."""
    from ..integration.install import transformers_of, block_sites

    models = [{"expert": expert, "class": type(m).__name__,
               "blocks": 1 + max((s.block for s in block_sites(m)), default=-1),
               "parameters": sum(p.numel() for p in m.parameters())} for expert, m in transformers_of(pipe)]
    return {"name": name or type(pipe).__name__, "transformers": models}


def input_labels(prompts, what: str = "inputs") -> list:
    """Prompts as the report names them (a bare transformer's inputs as ``(what N)``)."""
    return [p if isinstance(p, str) else f"({what} {i + 1})" for i, p in enumerate(prompts)]


def build_report(result, *, model: dict, prompts: list, holdout: list, budget: Budget, costs, cost_of,
                 measurements: dict, pairs, unavailable, calibration: dict, device_name, fp16_exact, date) -> dict:
    """The report as a JSON-ready dict. ``measurements`` holds what the prediction needs:
    ``shapes`` (each distinct call shape: ``shape``, ``masked``, ``calls`` in the calibration
    forwards, ``stock_seconds``), ``forward_seconds`` (those forwards' total, observers excluded) and
    ``forwards``; ``calibration`` its time and memory. With the sites' statistics it is enough to
    choose again at another budget (:func:`~fp4video.calibration.replan`)."""
    stats, plan = result.stats, result.plan
    stock_seconds = {}
    attention_stock = 0.0
    for row in measurements["shapes"]:
        stock_seconds.setdefault(tuple(row["shape"]), row["stock_seconds"])
        attention_stock += row["calls"] * row["stock_seconds"]
    forward_seconds, forwards = measurements["forward_seconds"], measurements["forwards"]
    other = max(forward_seconds - attention_stock, 0.0)
    t_stock = other + attention_stock
    t_plan = predicted_times(plan, stats, cost_of, stock_seconds, other)
    a_plan = predicted_times(plan, stats, cost_of, stock_seconds, 0.0)
    uniform = {}
    for target in result.candidates:
        up = result.uniform_plan(target)
        t = predicted_times(up, stats, cost_of, stock_seconds, other)
        a = predicted_times(up, stats, cost_of, stock_seconds, 0.0)
        over = [k for k, tt in up.items() if not stats[k].meets(tt, budget)]
        refused = sum(target in s.refused for s in stats.values())
        uniform[target] = {"predicted_step_speedup_vs_stock": t_stock / t, "calibrated_speedup_vs_it": t / t_plan,
                           "predicted_attention_speedup_vs_stock": attention_stock / a if a else None,
                           "sites_over_budget": len(over), "sites_refused_kept_fp16": refused,
                           "worst_rel_l2": max((stats[k].rel_l2.get(tt, 0.0) for k, tt in up.items()
                                                if tt != "fp16"), default=0.0)}
    chosen_counts = {}
    for t in plan.values():
        chosen_counts[t] = chosen_counts.get(t, 0) + 1
    hold = {}
    if result.holdout_stats:
        over, ratios, missing = [], [], 0
        for key, target in plan.items():
            h = result.holdout_stats.get(key)
            if h is None or is_exact_target(target):
                missing += h is None
                continue
            if not h.meets(target, budget):
                over.append(key)
            cal = stats[key].rel_l2.get(target)
            if cal and target in h.rel_l2:
                ratios.append(h.rel_l2[target] / cal)
        hold = {"prompts": holdout,
                "quantized_sites": sum(not is_exact_target(t) for t in plan.values()),
                "sites_over_budget": len(over), "over_budget": [_site_dict(k) for k in over],
                "median_error_ratio_holdout_to_calibration": statistics.median(ratios) if ratios else None,
                "max_error_ratio_holdout_to_calibration": max(ratios) if ratios else None,
                "sites_not_seen": missing}
    prop = {"target": pairs[0][1] if pairs else None, "pairs": [
        {**_site_dict(k), "attention_rel_l2": a, "output_rel_l2": o} for k, _, a, o in pairs]}
    if pairs:
        a = [p[2] for p in pairs]
        o = [p[3] for p in pairs]
        prop["spearman"] = spearman(a, o)
        gains = [oo / aa for aa, oo in zip(a, o) if aa > 0]
        prop["median_gain_output_per_attention"] = statistics.median(gains) if gains else None
        prop["gain_spread_max_over_min"] = (max(gains) / min(gains)) if gains and min(gains) > 0 else None
    linear = {}
    if getattr(result, "linear", None) is not None:
        summary, sites = linear_report(result.linear)
        linear = {"linear": summary, "linear_sites": sites}
    return {
        "model": model,
        "prompts": prompts,
        "holdout_prompts": holdout,
        "budget": budget.model_dump(), "budget_text": budget.describe(),
        "date": date, "device": device_name,
        "num_steps": result.num_steps,
        "candidates": result.candidates, "unavailable": unavailable, "fp16_backend": result.policy.fp16_backend,
        "fp16_exact_backend": fp16_exact,
        "costs": {"source": str(costs), "relative_to_stock": {
            t: {shape_key(shape): cost_of(t, shape) for shape in stock_seconds} for t in result.candidates}},
        "chosen": chosen_counts,
        "prediction": {
            "attention_share_of_stock_forward": attention_stock / t_stock if t_stock else None,
            "step_speedup_vs_stock": t_stock / t_plan,
            "attention_speedup_vs_stock": attention_stock / a_plan if a_plan else None,
            "vs_single_target": uniform,
            "measured_stock_forward_seconds": forward_seconds / max(forwards, 1),
        },
        "holdout": hold,
        "propagation": prop,
        "calibration": {**calibration, "sites": len(stats),
                        "statistics_kept": sum(len(s.rel_l2) for s in stats.values()) * 2},
        "measurements": measurements,
        "sites": [{**_site_dict(k), "calls": s.calls, "shape": list(s.shape), "chosen": plan[k],
                   "rel_l2": s.rel_l2, "cosine": s.cosine, "refused": s.refused,
                   "density": {t: s.mean_density(t) for t in s.density}, "kept": dict(s.kept),
                   "holdout": (_stats_dict(result.holdout_stats[k]) if k in result.holdout_stats else None)}
                  for k, s in sorted(stats.items(), key=lambda kv: site_order(kv[0]))],
        **linear,
    }


def linear_report(lin) -> tuple[dict, list]:
    """(the report's ``linear`` summary, its ``linear_sites``) of a
    :class:`~fp4video.calibration.result.LinearCalibration`."""
    from .linear import LINEAR_TABLE_SOURCE, REFERENCE

    chosen: dict = {}
    for m in lin.plan.values():
        chosen[m] = chosen.get(m, 0) + 1
    saved = sum(lin.stats[k].time_saved_ms.get(m) or 0.0 for k, m in lin.plan.items() if m != "bf16")
    summary = {
        "methods": list(lin.methods), "measured_by": dict(lin.forms), "reference": REFERENCE,
        "rows_per_call": lin.rows, "compile": lin.compile,
        "time_model": _linear_time_model(lin, LINEAR_TABLE_SOURCE),
        "unmeasured": [{"expert": e, "block": b, "kind": k} for e, b, k in lin.unmeasured],
        "policy": lin.policy.model_dump(mode="json", exclude_defaults=True),
        "chosen": chosen, "saved_ms_per_forward": saved,
    }
    sites = []
    for key in sorted(lin.stats, key=lambda k: (str(k[0]), k[1], k[2])):
        st = lin.stats[key]
        expert, block, kind = key
        sites.append({"expert": expert, "block": block, "kind": kind, "layers": list(st.layers), "calls": st.calls,
                      "rel_l2": {"bf16": 0.0, **st.rel_l2}, "worst_layer": dict(st.worst_layer),
                      "refused": dict(st.refused),
                      "time_saved_ms": {m: st.time_saved_ms.get(m) for m in lin.methods if m != "bf16"},
                      "time_source": {m: st.time_source.get(m, "none") for m in lin.methods if m != "bf16"},
                      "chosen": lin.plan[key]})
    return summary, sites


def _linear_time_model(lin, table_source: str) -> str:
    """Where the linear sites' times come from, in words (the sources their methods used)."""
    sources = {src for st in lin.stats.values() for src in st.time_source.values()}
    parts = []
    if "measured" in sources:
        parts.append("measured: torchao's layer timed on this CUDA device at each call's shape, bf16 and the method"
                     + (", both compiled" if lin.compile else ", eager"))
    if "table" in sources:
        parts.append("table: " + table_source + (" (compiled times)" if lin.compile else " (eager times)"))
    if "none" in sources:
        parts.append("none: no time for the method here (an emulated method the table has no time for, or a layer "
                     "it refuses): never chosen")
    return "; ".join(parts) or "no method measured"


def _stats_dict(s) -> dict:
    return {"calls": s.calls, "rel_l2": s.rel_l2, "cosine": s.cosine, "refused": s.refused,
            "density": {t: s.mean_density(t) for t in s.density}, "kept": dict(s.kept)}


def policy_yaml(result) -> str:
    """The policy as YAML, headed by comments saying how it was found."""
    import yaml

    r = result.report
    header = [
        "# Calibrated by fp4video calibrate: the cheapest attention per site within the budget.",
        f"# model: {r['model']['name']} ({', '.join(m['class'] + (' ' + m['expert'] if m['expert'] else '') for m in r['model']['transformers'])})",
        f"# prompts: {'; '.join(r['prompts'])}",
        f"# hold-out prompts: {'; '.join(r['holdout_prompts']) or 'none'}",
        f"# budget: {r['budget_text']}" + (f" (chosen again from {r['replanned']['from']})" if r.get("replanned") else ""),
        f"# steps: {r['num_steps'] if r['num_steps'] is not None else 'unknown (a bare transformer: per block and kind)'}",
        f"# candidates: {', '.join(r['candidates'])}; costs: {r['costs']['source']}",
        f"# date: {r['date']}; device: {r['device']}",
        f"# predicted speed-up vs stock attention: step {r['prediction']['step_speedup_vs_stock']:.3f}x, attention "
        f"{_fmt(r['prediction']['attention_speedup_vs_stock'], '.3f') or 'n/a'}x (costs: {r['costs']['source']})",
        "# load: fp4video.Policy.model_validate(yaml.safe_load(open(path)))",
    ]
    body = yaml.safe_dump(result.policy.model_dump(mode="json", exclude_defaults=False, exclude_none=True),
                          sort_keys=False, width=120, default_flow_style=None)
    return "\n".join(header) + "\n" + body


def _fmt(x, spec=".4f"):
    return "" if x is None else format(x, spec)


def costs_phrase(source: str) -> str:
    """Where a report's relative costs come from, in words."""
    if source == "table":
        return "the H200 cost table (times relative to stock measured on an H200 at Wan2.2 720p, not on this device)"
    if source == "measure":
        return "timings on this device at the sites' own shapes"
    return f"the `fp4video bench kernel` table {source}"


def short_reason(why: str) -> str:
    """A candidate's reason for not being measured, short: ``not installed`` for a backend that is not."""
    return "not installed" if "is not installed" in why else why


def markdown(result) -> str:
    r = result.report
    p = r["prediction"]
    source = r["costs"]["source"]
    lines = [f"# Calibration of {r['model']['name']}", "",
             f"- device: {r['device']}; date: {r['date']}",
             f"- prompts: {'; '.join(r['prompts'])}; hold-out: {'; '.join(r['holdout_prompts']) or 'none'}",
             f"- budget: {r['budget_text']}" + (f" (chosen again from {r['replanned']['from']} on "
                                                 f"{r['replanned']['on']}; measured {r['date']})"
                                                 if r.get("replanned") else ""),
             f"- candidates measured: {', '.join(r['candidates'])}; costs: {costs_phrase(source)}",
             f"- calibration: {r['calibration']['seconds']:.1f} s, {r['calibration']['peak_bytes'] / 2**20:.0f} MiB "
             f"({r['calibration']['what']}" + (f"; {r['calibration']['peak_over_start_bytes'] / 2**20:.0f} MiB over "
                                                "what was allocated before" if "peak_over_start_bytes" in
                                                r["calibration"] else "") + f"), {r['calibration']['sites']} sites"]
    lines += ["", "## Chosen per site", "", "| target | sites |", "| --- | --- |"]
    lines += [f"| {t} | {n} |" for t, n in sorted(r["chosen"].items(), key=lambda kv: -kv[1])]
    lines += ["", "## Predicted speed-up of the denoising step against stock attention", "",
              "Predicted, not measured: the time of a stock forward outside attention (measured here) plus each "
              "site's calls at their stock attention time (measured here) × the candidate's time relative to "
              f"stock, from {costs_phrase(source)}."
              + (" The speed-ups below are therefore what this plan would gain where those relative times hold; "
                 "`--costs measure` times the candidates on this device instead." if source == "table" else ""), "",
              f"Attention is {100 * (p['attention_share_of_stock_forward'] or 0):.0f}% of a stock forward on this "
              f"device. Calibrated policy: the denoising step **{p['step_speedup_vs_stock']:.3f}×** as fast as "
              f"stock, the attention alone {_fmt(p['attention_speedup_vs_stock'], '.3f') or 'n/a'}×.", "",
              "| one candidate at every site | step speed-up vs stock (predicted) | attention speed-up vs stock "
              "(predicted) | calibrated policy's step speed-up vs this | sites over budget | worst rel. L2 |",
              "| --- | --- | --- | --- | --- | --- |"]
    for t, u in p["vs_single_target"].items():
        lines.append(f"| {t} | {u['predicted_step_speedup_vs_stock']:.3f} | "
                     f"{_fmt(u['predicted_attention_speedup_vs_stock'], '.3f')} | {u['calibrated_speedup_vs_it']:.3f} | "
                     f"{u['sites_over_budget']} | {u['worst_rel_l2']:.4f} |")
    h = r["holdout"]
    if h:
        lines += ["", "## Hold-out prompts", "",
                  f"{h['sites_over_budget']} of {h['quantized_sites']} quantized sites exceed the budget on the "
                  f"hold-out prompts; their error is {_fmt(h['median_error_ratio_holdout_to_calibration'], '.2f') or 'n/a'}× "
                  f"the calibration's (median), at most {_fmt(h['max_error_ratio_holdout_to_calibration'], '.2f') or 'n/a'}×."]
    pr = r["propagation"]
    if pr["pairs"]:
        rho = pr.get("spearman")
        lines += ["", "## From a site's error to the transformer's output", "",
                  f"{len(pr['pairs'])} (site, step) pairs replayed with that one site on {pr['target']}: "
                  f"Spearman rank correlation between the attention error and the transformer output's error "
                  f"{_fmt(rho, '.2f') or 'n/a'}; the output error is {_fmt(pr['median_gain_output_per_attention'], '.3f')}× "
                  f"the attention error (median), varying {_fmt(pr['gain_spread_max_over_min'], '.1f')}× between "
                  "sites: " + ("the per-site error ranks sites as their effect on the output does."
                               if rho is not None and rho >= 0.7 else
                               "the per-site error is a partial guide to the output's; read the budget with care."),
                  "", "| expert | block | kind | step | attention rel. L2 | output rel. L2 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {q['expert']} | {q['block']} | {q['kind']} | {q['step']} | {q['attention_rel_l2']:.4f} | "
                  f"{q['output_rel_l2']:.5f} |" for q in pr["pairs"]]
    lines += ["", "## Sites", "", "| expert | block | kind | step | chosen | " +
              " | ".join(f"{t} rel. L2" for t in result.candidates if t != "fp16") + " |",
              "|" + " --- |" * (5 + len(result.candidates) - 1)]
    for s in r["sites"]:
        cells = ["refused" if t in s["refused"] else "exact" if is_exact_target(t) else _fmt(s["rel_l2"].get(t))
                 for t in result.candidates if t != "fp16"]
        lines.append(f"| {s['expert']} | {s['block']} | {s['kind']} | {s['step']} | {s['chosen']} | " + " | ".join(cells) + " |")
    sparse = [t for t in result.candidates if split_target(t)[1] is not None]
    if sparse:
        lines += ["", "## Block-sparse candidates: density and exact mass kept", "",
                  "Per site, each selection's mean density and the least exact attention mass any query tile kept "
                  "by its check (sampled rows, worst call); a selection is admitted only where that is at least "
                  f"{r['budget'].get('min_kept', 0.9):g} (the budget's `min_kept`).", "",
                  "| expert | block | kind | step | " + " | ".join(f"{t} density / kept" for t in sparse) + " |",
                  "|" + " --- |" * (4 + len(sparse))]
        for s in r["sites"]:
            cells = ["refused" if t in s["refused"] else
                     f"{_fmt(s['density'].get(t), '.3f')} / {_fmt(s.get('kept', {}).get(t), '.3f')}" for t in sparse]
            lines.append(f"| {s['expert']} | {s['block']} | {s['kind']} | {s['step']} | " + " | ".join(cells) + " |")
    lines += _linear_markdown(r)
    if r["unavailable"]:
        lines += ["", "## Not measured", ""]
        lines += [f"- {t} ({short_reason(why)})" for t, why in r["unavailable"].items()]
        lines += ["", "(each one's full reason: report.json, `unavailable`)"]
    return "\n".join(lines) + "\n"


def _linear_markdown(r: dict) -> list:
    """The report's linear-layer section (none without ``linear``)."""
    lin = r.get("linear")
    if not lin:
        return []
    import yaml

    methods = [m for m in lin["methods"] if m != "bf16"]
    measured = "; ".join(f"{m}: {lin['measured_by'][m]}" for m in methods)
    out = ["", "## Linear layers", "",
           f"Per linear site (expert, block, kind of linear layer), the worst relative L2 error of a layer's output "
           f"over its calls, on up to {lin['rows_per_call']} sampled input rows per call, against {lin['reference']}; "
           f"measured as: {measured}. Layers outside the blocks are not measured and stay bf16.", "",
           f"Time saved: milliseconds per forward, summed over the site's layers ({lin['time_model']}). The budget "
           f"({r['budget']['rel_l2']:g}) is the attention sites'; per site the method within it that saves the most "
           "time is chosen, bf16 where none saves any.", "",
           "Chosen: " + ", ".join(f"{m} {n}" for m, n in lin["chosen"].items()) + f" sites; predicted saving "
           f"{lin['saved_ms_per_forward']:.3f} ms per forward.", "",
           "| expert | block | kind | layers | chosen | " + " | ".join(f"{m} rel. L2 | {m} saved ms" for m in methods)
           + " |", "|" + " --- |" * (5 + 2 * len(methods))]
    for s in r.get("linear_sites", []):
        cells = []
        for m in methods:
            err = "refused" if m in s["refused"] else _fmt(s["rel_l2"].get(m))
            saved = s["time_saved_ms"].get(m)
            cells += [err, "—" if saved is None else f"{saved:.3f} ({s['time_source'][m]})"]
        out.append(f"| {s['expert']} | {s['block']} | {s['kind']} | {len(s['layers'])} | {s['chosen']} | "
                   + " | ".join(cells) + " |")
    refused = {m: why for s in r.get("linear_sites", []) for m, why in s["refused"].items()}
    if refused:
        out += ["", "Refused (a layer of the site the method cannot take), e.g.: "
                + "; ".join(f"{m}: {why}" for m, why in refused.items())]
    policy = yaml.safe_dump(lin["policy"], sort_keys=False, width=120, default_flow_style=None).strip()
    out += ["", "The run config's `linear:` section:", "", "```yaml",
            policy if policy != "{}" else "{}  # bf16 everywhere", "```"]
    return out


def _columns(plan: dict) -> list:
    """The heatmap's columns: each (step, expert) the plan has, by step then expert."""
    return sorted({(k[3], k[0]) for k in plan}, key=lambda c: (-1 if c[0] is None else c[0], str(c[1])))


def _expert_spans(columns: list) -> list:
    """[(first column, last column, expert)] of the runs of consecutive columns with one expert."""
    spans = []
    for i, (_, expert) in enumerate(columns):
        if spans and spans[-1][2] == expert:
            spans[-1][1] = i
        else:
            spans.append([i, i, expert])
    return [tuple(s) for s in spans]


def heatmap(result, path):
    """:func:`heatmap_figure` as a PNG in ``path`` (a file name or a binary file); returns ``path``."""
    fig = heatmap_figure(result)  # (selects matplotlib's file-only backend first)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return path


def heatmap_figure(result):
    """The heatmap as a matplotlib figure: per kind, the chosen target over blocks × denoising steps
    (each step's expert named above, a line where it changes) and the relative L2 error of the
    cheapest candidate measured there (log scale); every error panel on one colour scale, centred
    on the budget (blue within it, red over it) and marked on the colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, TwoSlopeNorm

    stats, plan = result.stats, result.plan
    report = result.report
    kinds = sorted({k[2] for k in plan})
    blocks = sorted({k[1] for k in plan})
    columns = _columns(plan)
    spans = _expert_spans(columns)
    experts_named = any(c[1] is not None for c in columns)
    chosen = set(plan.values())
    targets = [t for t in result.candidates if t in chosen]  # the colours: the targets chosen somewhere
    quantized = [t for t in result.candidates if not is_exact_target(t)]
    rel = report["costs"]["relative_to_stock"]
    mean_cost = {t: statistics.fmean([v for v in rel[t].values() if v is not None] or [math.inf]) for t in quantized}
    cheapest = min(quantized, key=mean_cost.get) if quantized else None
    tiers, errors = {}, {}
    for kind in kinds:
        tier = torch.full((len(blocks), len(columns)), float("nan"))
        err = torch.full((len(blocks), len(columns)), float("nan"))
        for (expert, block, k, step), target in plan.items():
            if k != kind:
                continue
            i, j = blocks.index(block), columns.index((step, expert))
            tier[i, j] = targets.index(target)
            e = stats[(expert, block, k, step)].rel_l2.get(cheapest)
            if e is not None and e > 0 and math.isfinite(e):
                err[i, j] = math.log10(e)
        tiers[kind], errors[kind] = tier, err
    budget = math.log10(report["budget"]["rel_l2"])
    lin = _linear_panels(result)
    finite = torch.cat([e.flatten() for e in errors.values()] + [e.flatten() for e in lin["errors"].values()])
    finite = finite[~finite.isnan()]
    low = min(float(finite.min()) if len(finite) else budget, budget) - 0.1
    high = max(float(finite.max()) if len(finite) else budget, budget) + 0.1
    norm = TwoSlopeNorm(vmin=low, vcenter=budget, vmax=high)
    err_cmap = plt.get_cmap("coolwarm").with_extremes(bad="0.85")
    # each candidate keeps its colour whatever is chosen (a re-plan's map reads like the first's)
    palette = plt.get_cmap("tab20" if len(result.candidates) > 10 else "tab10").colors
    tier_cmap = ListedColormap([palette[result.candidates.index(t) % len(palette)] for t in targets]).with_extremes(
        bad="0.85")
    rows = len(kinds) + len(lin["kinds"])
    fig, axes = plt.subplots(rows, 2, squeeze=False, layout="constrained",
                             figsize=(max(10.0, 3 + 0.35 * len(columns) * 2),
                                      max(3.2, 1.7 + 0.13 * len(blocks)) * rows + 0.6))
    step_labels = [str(s) if s is not None else "-" for s, _ in columns]
    for row, kind in enumerate(kinds):
        tier_im = axes[row][0].imshow(tiers[kind].numpy(), cmap=tier_cmap, vmin=-0.5, vmax=len(targets) - 0.5,
                                      aspect="auto", origin="lower", interpolation="nearest")
        axes[row][0].set_title(f"{kind} attention: chosen per site", fontsize=9)
        err_im = axes[row][1].imshow(errors[kind].numpy(), cmap=err_cmap, norm=norm, aspect="auto", origin="lower",
                                     interpolation="nearest")
        axes[row][1].set_title(f"{kind} attention: error of {cheapest} (rel. L2)", fontsize=9)
        for ax in axes[row]:
            ax.set_xlabel("denoising step" if columns[0][0] is not None or len(columns) > 1 else "(one forward)",
                          fontsize=8)
            ax.set_ylabel("block", fontsize=8)
            ax.set_xticks(range(len(columns)), step_labels, fontsize=7)
            ax.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize=7)
            if experts_named:  # each step's expert above the panel, a line where the expert changes
                for first, _, _ in spans[1:]:
                    ax.axvline(first - 0.5, color="black", linewidth=1.5)
                top = ax.secondary_xaxis("top")
                top.set_xticks([(a + b) / 2 for a, b, _ in spans], [str(e) for _, _, e in spans], fontsize=8)
                top.tick_params(length=0)
    for row, kind in enumerate(lin["kinds"], start=len(kinds)):  # the linear sites: blocks × experts
        ax_c, ax_e = axes[row]
        ax_c.imshow(lin["chosen"][kind].numpy(), cmap=lin["cmap"], vmin=-0.5, vmax=len(lin["methods"]) - 0.5,
                    aspect="auto", origin="lower", interpolation="nearest")
        ax_c.set_title(f"{kind} linear layers: chosen per site", fontsize=9)
        for i, m in enumerate(lin["methods"]):  # their own legend: the methods are not attention targets
            ax_c.plot([], [], "s", color=lin["cmap"](i), label=m)
        ax_c.legend(fontsize=6, loc="upper right", framealpha=0.8)
        err_im = ax_e.imshow(lin["errors"][kind].numpy(), cmap=err_cmap, norm=norm, aspect="auto", origin="lower",
                             interpolation="nearest")
        ax_e.set_title(f"{kind} linear layers: error of {lin['shown']} (rel. L2, worst layer)", fontsize=9)
        for ax in (ax_c, ax_e):
            ax.set_xlabel("expert", fontsize=8)
            ax.set_ylabel("block", fontsize=8)
            ax.set_xticks(range(len(lin["experts"])), [str(e) if e is not None else "-" for e in lin["experts"]],
                          fontsize=7)
            ax.set_yticks(range(len(lin["blocks"])), [str(b) for b in lin["blocks"]], fontsize=7)
    cb = fig.colorbar(tier_im, ax=list(axes[:len(kinds), 0]), ticks=range(len(targets)), shrink=0.9)
    cb.ax.set_yticklabels(targets, fontsize=7)
    cb.set_label("chosen target", fontsize=8)
    # the colour bar reads in relative L2 (ticks at 1, 2, 5 × powers of ten), the budget marked on it
    nice = [m * 10.0 ** e for e in range(math.floor(low) - 1, math.ceil(high) + 1) for m in (1, 2, 5)]
    ticks = [math.log10(v) for v in nice if low <= math.log10(v) <= high and abs(math.log10(v) - budget) > 0.12]
    cb = fig.colorbar(err_im, ax=list(axes[:, 1]), shrink=0.9, ticks=sorted([*ticks, budget]))
    cb.ax.set_yticklabels([f"budget {10 ** t:g}" if t == budget else f"{10 ** t:g}" for t in sorted([*ticks, budget])],
                          fontsize=7)
    cb.ax.axhline(budget, color="black", linewidth=2)
    cb.set_label(f"relative L2 of {cheapest}" + (f" (linear: {lin['shown']})" if lin["kinds"] else "")
                 + ", log scale (one scale for every panel; red: over the budget)", fontsize=8)
    title = (f"fp4video calibrate: {report['model']['name']}; budget: {report['budget_text']}; grey: no such site")
    fig.suptitle(textwrap.fill(title, 120), fontsize=8)
    return fig


def _linear_panels(result) -> dict:
    """The heatmap's linear rows: per kind of linear layer, the chosen method's index and the log10
    error of the method shown (the one saving the most time over every site; else the first) over
    blocks × experts. Empty without linear sites."""
    from matplotlib.colors import ListedColormap

    lin = getattr(result, "linear", None)
    if lin is None or not lin.stats:
        return {"kinds": [], "errors": {}}
    import matplotlib.pyplot as plt

    methods = list(lin.methods)
    quantized = [m for m in methods if m != "bf16"]
    totals = {m: sum(s.time_saved_ms.get(m) or 0.0 for s in lin.stats.values()) for m in quantized}
    saving = [m for m in quantized if totals[m] > 0]
    shown = max(saving, key=lambda m: (totals[m], -quantized.index(m))) if saving else quantized[0] if quantized \
        else "bf16"
    kinds = sorted({k[2] for k in lin.stats})
    blocks = sorted({k[1] for k in lin.stats})
    experts = sorted({k[0] for k in lin.stats}, key=str)
    chosen, errors = {}, {}
    for kind in kinds:
        c = torch.full((len(blocks), len(experts)), float("nan"))
        e = torch.full((len(blocks), len(experts)), float("nan"))
        for (expert, block, k), st in lin.stats.items():
            if k != kind:
                continue
            i, j = blocks.index(block), experts.index(expert)
            c[i, j] = methods.index(lin.plan[(expert, block, k)])
            v = st.rel_l2.get(shown)
            if v is not None and v > 0 and math.isfinite(v):
                e[i, j] = math.log10(v)
        chosen[kind], errors[kind] = c, e
    palette = plt.get_cmap("Set2").colors
    cmap = ListedColormap([palette[i % len(palette)] for i in range(len(methods))]).with_extremes(bad="0.85")
    return {"kinds": kinds, "blocks": blocks, "experts": experts, "chosen": chosen, "errors": errors,
            "methods": methods, "shown": shown, "cmap": cmap}


#: The files of a calibration: {what: file name}.
FILE_NAMES = {"policy": "policy.yaml", "json": "report.json", "markdown": "report.md", "heatmap": "heatmap.png"}


def render_files(result) -> tuple[dict, dict]:
    """({file name: bytes}, {what: file name}): the calibration's files, made in memory (written as
    a set by :meth:`~fp4video.calibration.Calibration.write`)."""
    import io

    from ..eval.paired import json_ready

    png = io.BytesIO()
    heatmap(result, png)
    files = {FILE_NAMES["policy"]: policy_yaml(result).encode("utf-8"),
             FILE_NAMES["json"]: json.dumps(json_ready(result.report), indent=1).encode("utf-8"),
             FILE_NAMES["markdown"]: markdown(result).encode("utf-8"),
             FILE_NAMES["heatmap"]: png.getvalue()}
    return files, dict(FILE_NAMES)
