#!/usr/bin/env python3
"""The e4m3 pre-pass (MXFP4 methods on Hopper) against the copy bandwidth measured in the same run.

Each launch of :func:`fp4video.kernels.prepass.prepass_fp8` — Q (rotate, quantize, e4m3 per row),
K (the same, e4m3 per key tile), V's channel maxima, V (quantize, e4m3, transposed) — and the
whole pre-pass as the attention call runs it, timed alone (medians), and replayed from a CUDA
graph (GPU time without the CPU's launch work, which bounds short sequences). "× copy" is the
launch's achieved bandwidth (the bytes it must move: bf16 read, e4m3 written; the maxima pass reads only)
over that of a bf16 copy of Q timed in the same process. ``--sweep`` also times the launch
options of ``PrepassLaunch`` (row blocks per program, persistent launches, pipelining stages, warps, V
channels and maxima tiles per program, V's f16-pair and tensor-core paths), ``--plot`` draws the
table. Markdown to stdout (docs/history.md keeps its runs).

    python tools/prepass_bandwidth.py --seqs 32760 75600 [--sweep [Q K V]] [--set OPTION=VALUE ...] [--plot PNG]
    python tools/prepass_bandwidth.py --replot docs/history.md --section "c05e83c" --plot PNG   # no GPU
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch


def launch_options(items):
    """The pre-pass's launch settings (:class:`fp4video.kernels.prepass.PrepassLaunch`) with
    ``OPTION=VALUE`` items applied (integers or None); ValueError naming the item for anything else."""
    import dataclasses

    from fp4video.kernels.prepass import PREPASS_LAUNCH

    fields = {f.name for f in dataclasses.fields(PREPASS_LAUNCH)}
    changes = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in fields or not text:
            raise ValueError(f"--set {item}: not OPTION=VALUE with OPTION a launch option of PrepassLaunch "
                             f"({', '.join(sorted(fields))})")
        if text != "None" and not text.lstrip("-").isdigit():
            raise ValueError(f"--set {item}: the value must be an integer or None")
        changes[name] = None if text == "None" else int(text)
    return dataclasses.replace(PREPASS_LAUNCH, **changes)


def bench(fn, rep_ms: int = 200) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def launches(run, q, k, v):
    """Name -> (bytes per element of Q it must move, a call of that launch alone)."""
    from fp4video import METHODS
    from fp4video.kernels import prepass as pp
    from fp4video.kernels.plan import plan

    tiled = plan(METHODS["mxattn"], q).tma  # K̂ stored as the loop reads it: in tile key order where it copies tiles by TMA
    ops = run.run_fp8(tiled)
    q8, q_fac, k8, k_fac, v8, v_fac = ops.q8, ops.q_fac, ops.k8, ops.k_fac, ops.v8t, ops.v_fac
    k_mode = pp.FP8_TILE_ORDERED if tiled else pp.FP8_TILE
    v_amax = torch.zeros_like(v_fac, dtype=torch.int32)
    run.values(pp.FP8_AMAX, v8, amax=v_amax)
    sq, sk = q.shape[-2], k.shape[-2]
    return {
        "Q: rotate, quantize, e4m3 per row": (3, lambda: run.rows(q, sq, False, pp.FP8_ROW, q8, fac=q_fac)),
        "K: rotate, quantize, e4m3 per key tile": (3, lambda: run.rows(k, sk, True, k_mode, k8, fac=k_fac)),
        "V: channel maxima (read only)": (2, lambda: run.values(pp.FP8_AMAX, v8, amax=v_amax)),
        "V: quantize, e4m3, transposed": (3, lambda: run.values(pp.FP8_HEAD, v8, amax=v_amax, fac=v_fac)),
    }


#: launch options swept by --sweep: (launch name prefix, fields of PrepassLaunch, values)
SWEEP = [
    ("Q", {"q8_programs_per_sm": (None,), "blocks_per_program": (1, 8, 16), "q8_stages": (1, 2), "row_warps": (4, 8)}),
    ("Q", {"q8_programs_per_sm": (None, 2, 3), "q8_stages": (2, 3)}),
    ("K", {"blocks_per_program": (1, 8), "tile_warps": (4, 8), "tile_stages": (1, 2)}),
    ("K", {"tile_programs_per_sm": (None, 1, 2), "tile_warps": (4, 8)}),
    ("V: channel maxima", {"v_warps": (4, 8), "v_channels": (64, 128)}),
    ("V: channel maxima", {"v_tiles_amax": (1, 2, 4, 8), "v_stages": (1, 3)}),
    ("V: quantize", {"v_channels_mma": (64, 128), "v_tiles_mma": (1, 2, 4), "v_stages": (2, 3)}),
]


def plot(rows, path, title: str) -> None:
    """Bars of × copy per launch and sequence length (rows: (S, launch, ms, × copy))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[1] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    width = 0.8 / len(seqs)
    for i, s in enumerate(seqs):
        vals = [next((r[3] for r in rows if r[0] == s and r[1] == nm), 0.0) for nm in names]
        bars = ax.barh([j + i * width for j in range(len(names))], vals, height=width, label=f"S = {s}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axvline(0.7, color="k", ls="--", lw=1, label="0.7× (the aim)")
    ax.set_yticks([j + width * (len(seqs) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("achieved bandwidth / bf16 copy bandwidth (same run)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def parse_tables(text: str, section: str | None = None):
    """(S, launch, ms, × copy) rows of this script's launch tables in a markdown text (its own
    output, or docs/history.md where it is kept): for ``--replot``. ``section``: only the tables
    under a heading containing that text (docs/history.md keeps one run's tables per section)."""
    import re

    rows, s, heading, in_code = [], None, "", False
    for line in text.splitlines():
        if line.startswith("```"):  # (a "#" inside a code block is a shell comment, not a heading)
            in_code = not in_code
            continue
        m = re.match(r"S = (\d+): bf16 copy", line)
        if m and not in_code:
            s = int(m.group(1)) if section is None or section in heading else None
            continue
        if line.startswith("#") and not in_code:  # a new section: its tables belong to no S until the next "S = "
            s, heading = None, line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if s is None or len(cells) != 4 or not cells[0].startswith(("Q:", "K:", "V:", "whole")):
            continue
        try:  # (the --sweep tables have an options column: not these)
            rows.append((s, cells[0], float(cells[1]), float(cells[3])))
        except ValueError:
            continue
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32760, 75600])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--method", default="mxattn", help="an MXFP4 method (the e4m3 pre-pass)")
    ap.add_argument("--sweep", nargs="*", metavar="LAUNCH",
                    help="also time the launch options (of the launches whose names start with LAUNCH: Q, K, V; all "
                         "when none is given)")
    ap.add_argument("--set", nargs="+", default=[], metavar="OPTION=VALUE",
                    help="launch options of PrepassLaunch for the whole run (e.g. tile_warps=8 q8_programs_per_sm=None; "
                         "values: integers, None)")
    ap.add_argument("--plot", help="write a bar chart of × copy bandwidth per launch (png)")
    ap.add_argument("--section", metavar="TEXT", help="--replot: only the tables under a heading containing TEXT")
    ap.add_argument("--replot", metavar="MARKDOWN",
                    help="no GPU: draw --plot from the launch tables kept in a markdown file (this script's output)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.sweep or [] if not any(p.startswith(n) for p, _ in SWEEP)]
    if unknown:
        ap.error(f"--sweep {' '.join(unknown)}: no launch of that name (launches: Q, K, V: channel maxima, V: quantize)")
    if args.replot:
        from pathlib import Path

        rows = parse_tables(Path(args.replot).read_text(), args.section)
        if not rows or not args.plot:
            where = f" under a heading containing {args.section!r}" if args.section else ""
            print(f"error: --replot needs --plot and launch tables in {args.replot}{where}", file=sys.stderr)
            return 2
        plot(rows, args.plot, "e4m3 pre-pass against the copy bandwidth (tables in " + Path(args.replot).name + ")")
        return 0
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from fp4video import METHODS
    import dataclasses

    from fp4video.kernels import prepass as pp
    from fp4video.kernels.plan import plan

    try:
        launch = launch_options(args.set)
    except ValueError as e:
        ap.error(str(e))
    if args.set:
        print(f"launch options: {' '.join(args.set)}")
    recipe = METHODS[args.method]
    if recipe.qk_format is None or recipe.qk_format.name != "MXFP4":
        print(f"error: {args.method} has no e4m3 pre-pass (MXFP4 methods only)", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []  # (S, launch, ms, × copy)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, method {args.method}, H={args.heads}, D=128")
    for s in args.seqs:
        q, k, v = (torch.randn(1, args.heads, s, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        n = q.numel()
        copy = torch.empty_like(q)
        t_copy = bench(lambda: copy.copy_(q))
        gbps = 2 * n * 2 / t_copy / 1e6
        print(f"\nS = {s}: bf16 copy of Q {t_copy:.3f} ms = {gbps:.0f} GB/s\n")
        print("| launch | ms | GB/s | × copy |\n| --- | --- | --- | --- |")
        run = pp.PrePass(q, k, v, recipe, None, launch=launch)
        total_bytes = 0
        for name, (per_elem, fn) in launches(run, q, k, v).items():
            t = bench(fn)
            total_bytes += per_elem * n
            rows.append((s, name, t, per_elem * n / t / 1e6 / gbps))
            print(f"| {name} | {t:.3f} | {per_elem * n / t / 1e6:.0f} | {rows[-1][3]:.2f} |", flush=True)
        def prepare():  # the whole e4m3 pre-pass, as the attention call runs it
            pp.prepass_fp8(q, k, v, recipe, None, k_tile_order=plan(recipe, q).tma, launch=launch)

        t = bench(prepare)
        rows.append((s, "whole pre-pass (as the attention call runs it)", t, total_bytes / t / 1e6 / gbps))
        print(f"| whole pre-pass (as the attention call runs it) | {t:.3f} | {total_bytes / t / 1e6:.0f} | "
              f"{rows[-1][3]:.2f} |", flush=True)
        # the same calls replayed from a CUDA graph: GPU time only, without the CPU's work of
        # launching four kernels (which bounds the line above at short sequences)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            prepare()
            with torch.cuda.graph(graph):
                prepare()
        torch.cuda.synchronize()
        t = bench(graph.replay)
        rows.append((s, "whole pre-pass, replayed from a CUDA graph", t, total_bytes / t / 1e6 / gbps))
        print(f"| whole pre-pass, replayed from a CUDA graph | {t:.3f} | {total_bytes / t / 1e6:.0f} | "
              f"{rows[-1][3]:.2f} |", flush=True)
        if args.sweep is not None:
            print("\n| launch | options | ms | × copy |\n| --- | --- | --- | --- |")
            for prefix, grid in [(p, g) for p, g in SWEEP if not args.sweep or p.startswith(tuple(args.sweep))]:
                for values in itertools.product(*grid.values()):
                    opts = dict(zip(grid, values))
                    run = pp.PrePass(q, k, v, recipe, None, launch=dataclasses.replace(launch, **opts))
                    name, (per_elem, fn) = next((nm, lf) for nm, lf in launches(run, q, k, v).items()
                                                if nm.startswith(prefix))
                    try:
                        t = bench(fn)
                        print(f"| {name} | {opts} | {t:.3f} | {per_elem * n / t / 1e6 / gbps:.2f} |", flush=True)
                    except Exception as e:  # noqa: BLE001  (out of resources: report, go on)
                        print(f"| {name} | {opts} | failed: {type(e).__name__} | |", flush=True)
    if args.plot:
        plot(rows, args.plot, f"e4m3 pre-pass, {torch.cuda.get_device_name()}, H={args.heads}, D=128")
    return 0


if __name__ == "__main__":
    sys.exit(main())
