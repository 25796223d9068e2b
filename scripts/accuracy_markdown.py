#!/usr/bin/env python3
"""Render the accuracy tables of README.md from `fp4video accuracy` output.

    fp4video accuracy --out accuracy-report
    python scripts/accuracy_markdown.py accuracy-report/accuracy.json > accuracy-tables.md
"""

from __future__ import annotations

import argparse
import json
import sys

from fp4video.harness import source000, source001
from fp4video.recipe import METHODS


def md(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json_file")
    args = ap.parse_args(argv)
    r = json.load(open(args.json_file))
    s0, s1, p0 = r["source000"], r["source001"], source000.PUBLISHED
    out = []
    out.append(md(["source 000 configuration (CosSim %)", "fp4video", "published"], [
        ("NVFP4, smooth-K, two-level P", f"{s0['formats']['nvfp4']:.2f}", p0["nvfp4"]),
        ("MXFP4 (OCP rule), smooth-K", f"{s0['formats']['mxfp4']:.2f}", p0["mxfp4"]),
        ("NVFP4, direct P scale", f"{s0['p_scale']['direct']:.2f}", p0["nvfp4_direct"]),
        ("NVFP4, smooth-K off", f"{s0['smooth_k']['off']:.2f}", p0["smooth_k_off"]),
        ("Q/K-only NVFP4, t=1 / t=16", f"{s0['split']['1']['cos']:.2f} / {s0['split']['16']['cos']:.2f}",
         f"{p0['qk_only'][1]['cos']} / {p0['qk_only'][16]['cos']}"),
        ("P/V-only NVFP4, t=1 / t=16", f"{s0['split']['1']['pv_only_cos']:.2f} / {s0['split']['16']['pv_only_cos']:.2f}",
         f"{p0['pv_only']} / {p0['pv_only']}"),
        ("INT8 QK + smooth-K, full PV", f"{s0['int8_qk_fp16_pv']:.3f}", p0["int8_qk_fp16_pv"]),
    ]))
    out.append(md(["norm. entropy", "two-level (ours / published)", "direct (ours / published)"], [
        (f"{e['norm_entropy']:.3f}", f"{100 * e['two_level']:.2f} / {100 * e['published_two_level']:.2f}",
         f"{100 * e['direct']:.2f} / {100 * e['published_direct']:.2f}") for e in s0["entropy_sweep"]]))
    u, o = s1["uos"], s1["ocp_overflow"]
    rows = [("root of Δ(q) = E(q) − 8E(q/2)", u["qmax_star_fraction"], "29/4")]
    rows += [(f"argmin J(q), density {k}", f"{v:.2f}", "7.25") for k, v in u["objective_minimizers"].items()]
    rows += [(f"per-tensor MSE optimum, {d}", f"{m['pooled_optimum']:.2f} (range {min(m['optima']):.2f}–{max(m['optima']):.2f})",
              "7.20–7.25 on real Q/K/V") for d, m in s1["mse_sweep"].items()]
    rows += [("OCP overflow P(max ∈ [7,8)): analytic / log-uniform MC / Gaussian blocks",
              f"{o['analytic']:.4f} / {o['log_uniform_maxima']:.4f} / {o['gaussian_blocks']:.4f}",
              f"{source001.PUBLISHED['ocp_overflow_probability']:.4f}")]
    out.append(md(["UOS", "fp4video", "published"], rows))
    pn = s1["pnq"]
    out.append(md(["P quantization (entropy %.2f)" % pn["norm_entropy"], "mean row sum", "rows < 1", "PNQ max abs(Σ−1)"], [
        (f"direct MXFP4, {k}", f"{pn[k]['mean_row_sum']:.4f}", f"{100 * pn[k]['share_under']:.1f}%",
         f"{pn[k]['pnq_max_abs_dev']:.1e}") for k in ("ocp", "uos")] + [
        ("published (real tensors)", source001.PUBLISHED["mean_row_sum_direct"], "", "0")]))
    ab = s1["ablation"]
    out.append(md(["ablation (outlier channels, entropy %.2f)" % ab["norm_entropy"], "CosSim %", "rel-L1", "RMSE"], [
        (m, f"{100 * v['cossim']:.3f}", f"{v['rel_l1']:.4f}", f"{v['rmse']:.4f}") for m, v in ab["methods"].items()]))
    out.append(md(["method", "CosSim %", "rel-L1", "RMSE", "switches"], [
        (m, f"{100 * v['cossim']:.2f}", f"{v['rel_l1']:.4f}", f"{v['rmse']:.4f}", METHODS[m].describe())
        for m, v in r["methods"].items()]))
    c = r["combinations"]
    out.append(md(["method (CosSim % / rel-L1)", *c], [
        (m, *[f"{100 * c[d][m]['cossim']:.2f} / {c[d][m]['rel_l1']:.3f}" for d in c]) for m in next(iter(c.values()))]))
    sys.stdout.write("\n\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
