"""A calibration's outputs: the policy YAML with its header, the JSON and markdown reports, the heatmap."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path

import torch

from .plan import Budget, is_exact_target, site_cost

__all__ = ["build_report", "policy_yaml", "write_all", "heatmap", "predicted_times", "spearman", "site_order",
           "model_summary", "input_labels"]


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
                   "density": {t: s.mean_density(t) for t in s.density},
                   "holdout": (_stats_dict(result.holdout_stats[k]) if k in result.holdout_stats else None)}
                  for k, s in sorted(stats.items(), key=lambda kv: site_order(kv[0]))],
    }


def _stats_dict(s) -> dict:
    return {"calls": s.calls, "rel_l2": s.rel_l2, "cosine": s.cosine, "refused": s.refused,
            "density": {t: s.mean_density(t) for t in s.density}}


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
        f"{r['prediction']['attention_speedup_vs_stock']:.3f}x",
        "# load: fp4video.Policy.model_validate(yaml.safe_load(open(path)))",
    ]
    body = yaml.safe_dump(result.policy.model_dump(mode="json", exclude_defaults=False, exclude_none=True),
                          sort_keys=False, width=120, default_flow_style=None)
    return "\n".join(header) + "\n" + body


def _fmt(x, spec=".4f"):
    return "" if x is None else format(x, spec)


def markdown(result) -> str:
    r = result.report
    p = r["prediction"]
    lines = [f"# Calibration of {r['model']['name']}", "",
             f"- device: {r['device']}; date: {r['date']}",
             f"- prompts: {'; '.join(r['prompts'])}; hold-out: {'; '.join(r['holdout_prompts']) or 'none'}",
             f"- budget: {r['budget_text']}" + (f" (chosen again from {r['replanned']['from']} on "
                                                 f"{r['replanned']['on']}; measured {r['date']})"
                                                 if r.get("replanned") else ""),
             f"- candidates: {', '.join(r['candidates'])}; costs: {r['costs']['source']}",
             f"- calibration: {r['calibration']['seconds']:.1f} s, {r['calibration']['peak_bytes'] / 2**20:.0f} MiB "
             f"({r['calibration']['what']}" + (f"; {r['calibration']['peak_over_start_bytes'] / 2**20:.0f} MiB over "
                                                "what was allocated before" if "peak_over_start_bytes" in
                                                r["calibration"] else "") + f"), {r['calibration']['sites']} sites",
             ""]
    for t, why in r["unavailable"].items():
        lines.append(f"- not a candidate: {t}: {why}")
    lines += ["", "## Chosen per site", "", "| target | sites |", "| --- | --- |"]
    lines += [f"| {t} | {n} |" for t, n in sorted(r["chosen"].items(), key=lambda kv: -kv[1])]
    lines += ["", "## Predicted step speed-up", "",
              f"Attention is {100 * (p['attention_share_of_stock_forward'] or 0):.0f}% of a stock forward on this "
              f"device. Calibrated policy: **{p['step_speedup_vs_stock']:.3f}× stock** for the step, "
              f"{_fmt(p['attention_speedup_vs_stock'], '.3f')}× for the attention alone.", "",
              "| single target everywhere | step × stock | attention × stock | calibrated step × it | "
              "sites over budget | worst rel. L2 |",
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
    return "\n".join(lines) + "\n"


def heatmap(result, path: Path) -> Path:
    """Per kind: the chosen target (blocks × steps) and the error of the cheapest candidate measured
    there (log10 relative L2), as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    stats, plan = result.stats, result.plan
    kinds = sorted({k[2] for k in plan})
    blocks = sorted({k[1] for k in plan})
    steps = sorted({k[3] for k in plan}, key=lambda s: -1 if s is None else s)
    chosen = set(plan.values())
    targets = [t for t in result.candidates if t in chosen]  # the colours: the targets chosen somewhere
    quantized = [t for t in result.candidates if not is_exact_target(t)]
    rel = result.report["costs"]["relative_to_stock"]
    mean_cost = {t: statistics.fmean([v for v in rel[t].values() if v is not None] or [math.inf]) for t in quantized}
    cheapest = min(quantized, key=mean_cost.get) if quantized else None
    fig, axes = plt.subplots(len(kinds), 2, squeeze=False,
                             figsize=(max(9.0, 2 + 0.3 * len(steps) * 2), max(3.0, 1.5 + 0.12 * len(blocks)) * len(kinds)))
    cmap = ListedColormap(plt.get_cmap("tab20" if len(targets) > 10 else "tab10").colors[:len(targets)])
    for row, kind in enumerate(kinds):
        tier = torch.full((len(blocks), len(steps)), float("nan"))
        err = torch.full((len(blocks), len(steps)), float("nan"))
        for (expert, block, k, step), target in plan.items():
            if k != kind:
                continue
            i, j = blocks.index(block), steps.index(step)
            tier[i, j] = targets.index(target)
            e = stats[(expert, block, k, step)].rel_l2.get(cheapest)
            if e is not None and e > 0:
                err[i, j] = math.log10(e)
        ax = axes[row][0]
        im = ax.imshow(tier.numpy(), cmap=cmap, vmin=-0.5, vmax=len(targets) - 0.5, aspect="auto", origin="lower")
        ax.set_title(f"{kind}: chosen")
        cb = fig.colorbar(im, ax=ax, ticks=range(len(targets)))
        cb.ax.set_yticklabels(targets, fontsize=7)
        ax = axes[row][1]
        im = ax.imshow(err.numpy(), cmap="magma", aspect="auto", origin="lower")
        ax.set_title(f"{kind}: log10 rel. L2 of {cheapest}")
        fig.colorbar(im, ax=ax)
        for ax in axes[row]:
            ax.set_xlabel("denoising step" if steps != [None] else "(one forward)")
            ax.set_ylabel("block")
            ax.set_xticks(range(len(steps)), [str(s) if s is not None else "-" for s in steps], fontsize=7)
            ax.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize=7)
    title = f"fp4video calibrate: {result.report['model']['name']}; budget: {result.report['budget_text']}"
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(result, out_dir: Path) -> dict:
    from ..eval.paired import json_ready

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"policy": out_dir / "policy.yaml", "json": out_dir / "report.json", "markdown": out_dir / "report.md",
             "heatmap": out_dir / "heatmap.png"}
    paths["policy"].write_text(policy_yaml(result))
    paths["json"].write_text(json.dumps(json_ready(result.report), indent=1))
    paths["markdown"].write_text(markdown(result))
    heatmap(result, paths["heatmap"])
    return paths
