"""`fp4video accuracy`: run both documents' op-level experiments, print tables with the published
values beside ours, write PNG plots and a JSON summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..attention import fp4_attention
from ..metrics import compare
from ..recipe import METHODS
from . import mxattention, robustness, sageattention3

#: Data sets on which our own combinations are judged against the published methods.
COMBINATION_DATA = ("SageAttention3 t=1", "SageAttention3 t=4", "outlier channels")
COMBINATION_METHODS = ("mxfp4-ocp", "mxattn", "mxattn-sk", "nvfp4", "sage3", "sage3-hpnq")


def _sa3_as_bhsd(x, t=1.0):
    return (x.q * t).float()[None, None], x.k.float()[None, None], x.v.float()[None, None]


def method_table(seed: int) -> dict:
    """Every fp4video method (online-softmax reference, unnormalized P̃ tiles) on the SageAttention3 harness's data."""
    x = sageattention3.make_inputs(seed)
    q, k, v = _sa3_as_bhsd(x)
    ref = sageattention3.exact_attention(x)[1][None, None]
    return {m: compare(fp4_attention(q, k, v, method=m, backend="reference"), ref) for m in METHODS}


def combination_table(seed: int) -> dict:
    x = sageattention3.make_inputs(seed)
    sets = {
        "SageAttention3 t=1": _sa3_as_bhsd(x, 1.0),
        "SageAttention3 t=4": _sa3_as_bhsd(x, 4.0),
        "outlier channels": mxattention.outlier_inputs(seed),
    }
    out = {}
    for name, (q, k, v) in sets.items():
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        out[name] = {m: compare(fp4_attention(q, k, v, method=m, backend="reference"), ref) for m in COMBINATION_METHODS}
    return out


def run_all(seed: int = 0, progress=None) -> dict:
    step = progress or (lambda *_: None)
    sa3 = sageattention3.run(seed, progress=step)
    mxa = mxattention.run(seed, progress=step)
    step("fp4video methods")
    methods = method_table(seed)
    combos = combination_table(seed)
    step("robustness")
    robust = robustness.robustness_table(list(METHODS), seed)
    step("accuracy cliffs")
    cliffs = robustness.cliff_table(list(METHODS), seed)
    return {"seed": seed, "sageattention3": sa3, "mxattention": mxa, "methods": methods, "combinations": combos,
            "robustness": robust, "robustness_cliffs": cliffs}


def summary_json(r: dict) -> dict:
    """The stable JSON contract of ``fp4video accuracy --json`` (plus the full detail)."""
    sa3, mxa = r["sageattention3"], r["mxattention"]
    detail = {k: v for k, v in mxa.items() if not k.startswith("_")}
    detail["pnq"] = {  # a new dict: the row-sum tensors stay in r for the plots
        key: ({k: v for k, v in val.items() if k != "row_sums"} if isinstance(val, dict) else val)
        for key, val in mxa["pnq"].items()
    }
    return {
        "seed": r["seed"],
        "e4m3": sa3["e4m3"],
        "uos": {
            "qmax_star": mxa["uos"]["qmax_star"],
            "ocp_overflow_probability": mxa["uos"]["ocp_overflow_probability"],
            "objective_minimizers": mxa["uos"]["objective_minimizers"],
        },
        "methods": r["methods"],
        "entropy_sweep": [
            {"norm_entropy": e["norm_entropy"], "two_level": e["two_level"], "direct": e["direct"],
             "temperature": e["temperature"]}
            for e in sa3["entropy_sweep"]
        ],
        "sageattention3": sa3,
        "mxattention": detail,
        "combinations": r["combinations"],
        "robustness": r["robustness"],
        "robustness_cliffs": r.get("robustness_cliffs", {}),
    }


# --- tables ------------------------------------------------------------------------------------


def _table(title, header, rows):
    """One table as data: rendered for the terminal (:func:`render_rich`) and as markdown
    (:func:`render_markdown`) from the same rows."""
    return {"title": title, "header": list(header), "rows": [[str(c) for c in row] for row in rows]}


def render_rich(spec):
    from rich.table import Table

    t = Table(title=spec["title"], title_justify="left")
    for i, h in enumerate(spec["header"]):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in spec["rows"]:
        t.add_row(*row)
    return t


def render_markdown(specs) -> str:
    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    parts = []
    for spec in specs:
        parts.append("\n".join([f"**{spec['title']}**", "", line(spec["header"]),
                                 "|" + "|".join(" --- " for _ in spec["header"]) + "|",
                                 *(line(r) for r in spec["rows"])]))
    return "\n\n".join(parts) + "\n"


def _pct(x):
    return f"{x:.2f}"


def tables(r: dict) -> list[dict]:
    """Every table of the report, as :func:`_table` specs (published values beside ours)."""
    s0, s1 = r["sageattention3"], r["mxattention"]
    pub0, pub1 = sageattention3.PUBLISHED, mxattention.PUBLISHED
    out = []
    fmt_rows = [
        ("NVFP4 (1x16, E4M3), smooth-K, two-level P", _pct(s0["formats"]["nvfp4"]), pub0["nvfp4"]),
        ("MXFP4 (1x32, E8M0, OCP rule), smooth-K", _pct(s0["formats"]["mxfp4"]), pub0["mxfp4"]),
        ("NVFP4, direct P scale", _pct(s0["p_scale"]["direct"]), pub0["nvfp4_direct"]),
        ("NVFP4, smooth-K off", _pct(s0["smooth_k"]["off"]), pub0["smooth_k_off"]),
        ("INT8 QK (smooth-K), full-precision PV", f"{s0['int8_qk_fp16_pv']:.3f}", pub0["int8_qk_fp16_pv"]),
    ]
    out.append(_table("SageAttention3 — output CosSim % (1024x128 Gaussian, K mean, normalized P)",
                      ["configuration", "ours", "published"], fmt_rows))
    out.append(_table(
        "SageAttention3 — temperature sweep, CosSim % (NVFP4, smooth-K)",
        ["norm. entropy", "temperature", "two-level", "published", "direct", "published"],
        [(f"{e['norm_entropy']:.3f}", f"{e['temperature']:.2f}", _pct(100 * e["two_level"]),
          _pct(100 * e["published_two_level"]), _pct(100 * e["direct"]), _pct(100 * e["published_direct"]))
         for e in s0["entropy_sweep"]]))
    split_rows = []
    for t, row in s0["split"].items():
        p = pub0["qk_only"][int(t)]
        split_rows.append((f"t={t}", f"{row['max_s']:.2f} ({p['max_s']})", f"{row['mean_ds']:.3f} ({p['mean_ds']})",
                           f"{row['p_rel_l1']:.3f} ({p['p_rel_l1']})", f"{row['cos']:.2f} ({p['cos']})",
                           f"{row['pv_only_cos']:.2f} ({pub0['pv_only']})"))
    out.append(_table("SageAttention3 — error split, ours (published)",
                      ["", "max|S|", "mean|dS|", "P rel-L1", "Q/K-only CosSim", "P/V-only CosSim"], split_rows))
    out.append(_table("SageAttention3 — counts, ours (published)", ["quantity", "ours", "published"], [
        ("E4M3 distinct non-negative", s0["e4m3"]["distinct_nonneg"], pub0["e4m3"]["distinct_nonneg"]),
        ("... of them in [0, 1/6]", s0["e4m3"]["in_p_range"], pub0["e4m3"]["in_p_range"]),
        ("score rel-L1, no smoothing", f"{s0['smooth_k']['s_rel_l1_no_smooth']:.4f}", pub0["s_rel_l1"]["no_smooth"]),
        ("score rel-L1, smooth-K", f"{s0['smooth_k']['s_rel_l1_smooth']:.4f}", pub0["s_rel_l1"]["smooth"]),
        ("distinct |P̂|, direct (whole matrix)", s0["distinct_p"]["direct"], pub0["distinct_p"]["direct"]),
        ("distinct |P̂|, two-level (whole matrix)", s0["distinct_p"]["two_level"], pub0["distinct_p"]["two_level"]),
    ]))
    u = s1["uos"]
    uos_rows = [("root of Δ(q) = E(q) − 8E(q/2)", u["qmax_star_fraction"], "29/4")]
    uos_rows += [(f"argmin J(q), {name}", f"{q:.2f}", "7.25") for name, q in u["objective_minimizers"].items()]
    for dist, m in s1["mse_sweep"].items():
        uos_rows.append((f"MSE optimum, {dist} (8 tensors)", f"{m['pooled_optimum']:.2f} "
                         f"[{min(m['optima']):.2f}–{max(m['optima']):.2f}]", "7.20–7.25 (Table 4)"))
    o = s1["ocp_overflow"]
    uos_rows.append(("P(OCP max in [7,8)), analytic", f"{o['analytic']:.4f}", f"{pub1['ocp_overflow_probability']:.4f}"))
    uos_rows.append(("  ... log-uniform maxima (MC)", f"{o['log_uniform_maxima']:.4f}", ""))
    uos_rows.append(("  ... Gaussian 32-blocks", f"{o['gaussian_blocks']:.4f}", ""))
    out.append(_table("MXAttention — Universal Optimal Scaling", ["quantity", "ours", "published"], uos_rows))
    pn = s1["pnq"]
    pnq_rows = []
    for rule in ("ocp", "uos"):
        s = pn[rule]
        c = s["components"]
        pnq_rows.append((f"direct, {rule}", f"{s['mean_row_sum']:.4f}", f"{100 * s['share_under']:.1f}%",
                         f"{c['zeroing']:+.4f}", f"{c['saturation']:+.4f}", f"{c['down']:+.4f}", f"{c['up']:+.4f}",
                         f"{s['pnq_max_abs_dev']:.1e}"))
    pc = pub1["row_sum_components"]
    pnq_rows.append(("published (real tensors)", f"{pub1['mean_row_sum_direct']}", "",
                     f"{pc['zeroing']:+.4f}", f"{pc['saturation']:+.4f}", f"{pc['down']:+.4f}", f"{pc['up']:+.4f}", "0"))
    out.append(_table(f"MXAttention — PNQ: row sums of MXFP4 P (entropy {pn['norm_entropy']:.2f})",
                      ["P quantization", "mean row sum", "rows < 1", "zeroing", "saturation", "down", "up",
                       "PNQ max|Σ−1|"], pnq_rows))
    ab = s1["ablation"]
    out.append(_table(f"MXAttention — sequential ablation, outlier-channel inputs (entropy {ab['norm_entropy']:.2f})",
                      ["method", "CosSim %", "rel-L1", "RMSE", "switches"],
                      [(m, f"{100 * v['cossim']:.3f}", f"{v['rel_l1']:.4f}", f"{v['rmse']:.4f}", ab["recipes"][m])
                       for m, v in ab["methods"].items()]))
    out.append(_table("fp4video methods — online-softmax reference on the SageAttention3 harness's data (t=1)",
                      ["method", "CosSim %", "rel-L1", "RMSE", "switches"],
                      [(m, f"{100 * v['cossim']:.2f}", f"{v['rel_l1']:.4f}", f"{v['rmse']:.4f}", METHODS[m].describe())
                       for m, v in r["methods"].items()]))
    combos = r["combinations"]
    out.append(_table("Combinations of our own — CosSim % / rel-L1",
                      ["method", *combos.keys()],
                      [(m, *[f"{100 * combos[d][m]['cossim']:.2f} / {combos[d][m]['rel_l1']:.3f}" for d in combos])
                       for m in COMBINATION_METHODS]))
    rob = r["robustness"]
    out.append(_table("Robustness — CosSim % / worst-row CosSim % against fp64 (fp4video.harness.robustness)",
                      ["method", *rob.keys()],
                      [(m, *[f"{100 * rob[d][m]['cossim']:.2f} / {100 * rob[d][m]['worst_row_cossim']:.1f}"
                             for d in rob]) for m in METHODS]))
    out.append(_table("Robustness — rel-L1 against fp64, the same inputs",
                      ["method", *rob.keys()],
                      [(m, *[f"{rob[d][m]['rel_l1']:.4f}" for d in rob]) for m in METHODS]))
    cliffs = r.get("robustness_cliffs")
    if cliffs:
        size = robustness.CLIFF_SIZE
        out.append(_table(f"Accuracy cliffs — CosSim % / worst-row CosSim % against fp64, inputs far past the table's "
                          f"ranges (Sq={size['sq']}, Sk={size['sk']}; fp4video.harness.robustness.CLIFFS)",
                          ["method", *cliffs.keys()],
                          [(m, *[f"{100 * cliffs[d][m]['cossim']:.2f} / {100 * cliffs[d][m]['worst_row_cossim']:.1f}"
                                 for d in cliffs]) for m in METHODS]))
    return out


# --- plots --------------------------------------------------------------------------------------


def plots(r: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    s0, s1 = r["sageattention3"], r["mxattention"]
    paths = []

    def save(fig, name):
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    sw = s0["entropy_sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ent = [e["norm_entropy"] for e in sw]
    ax.plot(ent, [100 * e["two_level"] for e in sw], "o-", label="two-level P scale (ours)")
    ax.plot(ent, [100 * e["direct"] for e in sw], "s-", label="direct P scale (ours)")
    ax.plot(ent, [100 * e["published_two_level"] for e in sw], "o--", alpha=0.5, label="two-level (SageAttention3 article)")
    ax.plot(ent, [100 * e["published_direct"] for e in sw], "s--", alpha=0.5, label="direct (SageAttention3 article)")
    ax.set(xlabel="normalized attention entropy", ylabel="output CosSim (%)",
           title="NVFP4 attention vs. attention entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, "entropy_sweep.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pn = s1["pnq"]
    lo = min(float(pn[r_]["row_sums"].min()) for r_ in ("ocp", "uos"))
    bins = [lo + (1.02 - lo) * i / 60 for i in range(61)]
    for rule in ("ocp", "uos"):
        ax.hist(pn[rule]["row_sums"].numpy(), bins=bins, alpha=0.6, label=f"direct MXFP4 ({rule})")
    ax.axvline(1.0, color="k", lw=2, label="PNQ (exactly 1)")
    ax.set(xlabel="row sum of the attention weights", ylabel="rows",
           title=f"Row sums of quantized P (entropy {pn['norm_entropy']:.2f})")
    ax.legend()
    save(fig, "row_sum_histogram.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    curves = s1["_objective_curves"]
    for name, d in curves["densities"].items():
        c = d["curve"]
        m = min(c)
        ax.plot(curves["grid"], [v / m for v in c], label=name)
    ax.axvline(7.25, color="k", ls=":", label="Qmax = 7.25")
    ax.set(xlabel="Qmax", ylabel="J(Qmax) / min", title="UOS objective under several block-max densities")
    ax.legend(fontsize=8)
    save(fig, "uos_objective.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for dist, m in s1["mse_sweep"].items():
        ax.plot(mxattention.QMAX_SWEEP, m["relative_mse"], label=f"{dist} (min {m['pooled_optimum']:.2f})")
    ax.axvline(7.25, color="k", ls=":")
    ax.set(xlabel="Qmax", ylabel="MSE / MSE(7.25)", title="MXFP4 per-tensor MSE vs. scale boundary")
    ax.set_ylim(0.97, 1.2)
    ax.legend(fontsize=8)
    save(fig, "uos_mse_sweep.png")

    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    names = list(r["methods"])
    ax.bar(names, [100 * r["methods"][n]["cossim"] for n in names], color="tab:blue")
    ax.set(ylabel="output CosSim (%)", title="fp4video methods on the SageAttention3 harness's data (online softmax)")
    lo = min(100 * v["cossim"] for v in r["methods"].values())
    ax.set_ylim(math.floor(lo) - 1, 100.2)
    ax.tick_params(axis="x", rotation=35)
    for lbl in ax.get_xticklabels():
        lbl.set_ha("right")
    save(fig, "methods.png")
    return paths


def write_json(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=json_default))


def json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(type(o).__name__)
