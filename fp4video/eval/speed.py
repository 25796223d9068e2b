"""Speed tables as plots: the markdown tables ``fp4video bench kernel`` writes, read back and drawn.

The markdown (what ``--out`` appends and ``BENCHMARKS.md`` holds) is the one record of a run;
:func:`parse_kernel_tables` reads it, so a plot can always be redrawn from the committed numbers;
:func:`speed_accuracy_plot` sets it against the ``fp4video accuracy`` report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HEADER = re.compile(r"^### bench kernel, (?P<what>[^:]*): (?P<where>.*)$")
_ROW = re.compile(r"^\| (?P<s>\d+) \| (?P<kernel>[^|]+?) \| (?P<ms>[\d.]+) \| \d+ \| [^|]* \| [^|]* \| "
                  r"(?P<ratio>[\d.]+) \|(?P<rest>( [^|]* \|)+)$")


@dataclass(frozen=True)
class KernelRow:
    seq: int
    kernel: str  # e.g. "fp4video mxattn", "cuDNN SDPA bf16 (best bf16)"
    ms: float
    ratio: float  # × the best (bf16) baseline of the same run
    #: × each peer column (None: "n/a"), cosine to fp32 (empty in tables without those columns).
    x_peers: tuple[float | None, ...] = ()
    cos_fp32: float | None = None
    #: Mean SM clock (MHz) and the share of the timing at the power cap (None: not sampled, or a
    #: table without those columns).
    mhz: float | None = None
    capped: float | None = None


@dataclass(frozen=True)
class KernelTable:
    title: str  # e.g. "B=1 H=40 D=128, bf16"
    where: str  # GPU, versions, date
    rows: tuple[KernelRow, ...]


def parse_kernel_tables(text: str) -> list[KernelTable]:
    """Every ``bench kernel`` table in ``text`` (markdown), in order. Raises ValueError when a
    table header has no rows under it (a truncated or hand-edited table)."""
    tables: list[KernelTable] = []
    title = where = None
    rows: list[KernelRow] = []

    def close():
        if title is not None:
            if not rows:
                raise ValueError(f"bench kernel table {title!r} ({where}) has no rows")
            tables.append(KernelTable(title, where, tuple(rows)))

    clocked = False  # the table's columns end with the SM clock and the power-cap share
    for line in text.splitlines():
        m = _HEADER.match(line.strip())
        if m:
            close()
            title, where, rows, clocked = m["what"], m["where"], [], False
            continue
        if line.strip().startswith("| S | kernel |"):
            clocked = line.rstrip().endswith("| SM MHz | power-capped |")
            continue
        m = _ROW.match(line.strip())
        if m and title is not None:
            rest = [c.strip() for c in m["rest"].split("|")[:-1]]  # (trailing cells may be empty)
            mhz = capped = None
            if clocked:
                mhz_cell, capped_cell = rest[-2:]
                rest = rest[:-2]
                mhz = float(mhz_cell) if mhz_cell else None
                capped = float(capped_cell.rstrip("%")) / 100 if capped_cell else None
            peers, cos = (), None
            if len(rest) >= 5:  # × peers..., cosine to fp32, worst row, cosine to best bf16
                peers = tuple(None if c == "n/a" else float(c) for c in rest[:-3])
                cos = float(rest[-3])
            rows.append(KernelRow(int(m["s"]), m["kernel"].strip(), float(m["ms"]), float(m["ratio"]), peers, cos,
                                  mhz, capped))
    close()
    return tables


def plot_kernel_tables(tables: list[KernelTable], path: Path, *, bar: float | None = None) -> Path:
    """One group of bars per (table, sequence length): each fp4video method's and each peer's speed
    as a multiple of the best bf16 attention measured in the same run (the line at 1), optionally a
    target line ``bar``. SDPA's rows are the baseline, not bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(t, s) for t in tables for s in dict.fromkeys(r.seq for r in t.rows)]
    kernels = [r.kernel.removesuffix(" (best bf16)") for t in tables for r in t.rows]
    methods = list(dict.fromkeys(k for k in kernels if "SDPA" not in k and "(best baseline)" not in k))
    if not groups or not any(m.startswith("fp4video ") for m in methods):
        raise ValueError("no fp4video rows to plot")
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(groups) + 4), 4.2))
    for i, method in enumerate(methods):
        xs, ys = [], []
        for g, (t, s) in enumerate(groups):
            hit = [r for r in t.rows if r.seq == s and r.kernel.removesuffix(" (best bf16)") == method]
            if hit:
                xs.append(g + (i - (len(methods) - 1) / 2) * width)
                ys.append(hit[0].ratio)
        peer = not method.startswith("fp4video ")  # peers hatched, so fp4video's own bars stand out
        bars = ax.bar(xs, ys, width, label=method.removeprefix("fp4video "), hatch="//" if peer else None,
                      alpha=0.6 if peer else 1.0)
        ax.bar_label(bars, fmt="%.2f", fontsize=6.5, padding=2, rotation=90)  # upright: neighbours never overlap
    ax.axhline(1.0, color="black", linewidth=1, label="fastest bf16 attention of the same run")
    if bar is not None:
        ax.axhline(bar, color="gray", linestyle="--", linewidth=1, label=f"target {bar:g}×")
    def label(t: KernelTable, s: int) -> str:
        h = re.search(r"H=(\d+)", t.title)
        return f"S={s:,}" + (f"\nH={h[1]}" if h else "") + (", masked" if "masked" in t.title else "")

    ax.set_xticks(range(len(groups)), [label(t, s) for t, s in groups])
    ax.set_ylabel("× fastest bf16 of the run (higher is faster)")
    wheres = sorted({t.where for t in tables})
    ax.set_title("attention speed, quantization included\n" + "; ".join(wheres), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars stay visible
    ax.set_ylim(0, max(1.25, max(r.ratio for t in tables for r in t.rows) * 1.22))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def speed_accuracy_plot(r: dict, bench_markdown: str, path: Path, seq: int | None = None) -> Path:
    """Accuracy (cosine to fp64 on Gaussian inputs, and on the worst robustness input) against
    measured kernel speed (× the best baseline of the same run), one point per method that has a
    ``bench kernel`` row at sequence length ``seq`` (default: the longest) in ``bench_markdown``;
    the last table with the method wins. Raises ValueError when no method has a speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..recipe import METHODS

    rows = [(row, t) for t in parse_kernel_tables(bench_markdown) for row in t.rows]
    seq = seq or max((row.seq for row, _ in rows), default=None)
    speed, where = {}, {}
    for row, t in rows:
        if row.seq == seq and row.kernel.startswith("fp4video "):
            speed[row.kernel.removeprefix("fp4video ")] = row.ratio
            where[row.kernel.removeprefix("fp4video ")] = t.where
    rob = r["robustness"]
    methods = [m for m in METHODS if m in speed and m in next(iter(rob.values()))]
    if not methods:
        raise ValueError(f"no fp4video method has a bench kernel row at S = {seq} in the given markdown")
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    for i, m in enumerate(methods):
        gauss = 100 * rob["gaussian"][m]["cossim"]
        worst = min(100 * rob[d][m]["cossim"] for d in rob)
        ax.plot([speed[m]] * 2, [worst, gauss], "-", color="0.7", zorder=1)
        ax.scatter([speed[m]], [gauss], color="tab:blue", zorder=2)
        ax.scatter([speed[m]], [worst], color="tab:red", marker="v", zorder=2)
        ax.annotate(m, (speed[m], gauss), textcoords="offset points", xytext=(4, 3 + 9 * (i % 3)), fontsize=8)
    ax.scatter([], [], color="tab:blue", label="Gaussian inputs")
    ax.scatter([], [], color="tab:red", marker="v", label="worst robustness input")
    ax.axvline(1.0, color="k", lw=1, label="best bf16 baseline (same run)")
    ax.set(xlabel=f"× best baseline at S = {seq} (pre-pass included)", ylabel="output CosSim to fp64 (%)",
           title="fp4video methods: accuracy against measured speed\n" + sorted(set(where.values()))[-1])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower center")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
