"""``fp4video bench sparse``: block-sparse attention's time against its density, on a GPU.

One process, one set of inputs (B=1, random bf16 Q/K/V): the best bf16 attention installed (cuDNN,
flash and default SDPA), the installed peers (FlashAttention-3 bf16 and FP8, SageAttention2), each
method dense, then each method block-sparse at every density (a random selection with the same
number of key tiles in every query tile's list, its own diagonal tile among them: a loop's time
follows how many tiles it visits, not which), the whole call timed (selection lists, pre-pass and
loop). Then the selections' own cost at that size: the dynamic one (:func:`fp4video.sparse.dynamic_selection`)
and the static window (:func:`fp4video.sparse.static_selection`, on the latent grid given), each
against the dense call of the first method. A plot of time against density with the peers as
horizontal lines.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass

from .bench_shared import RATIO_PEERS, RATIO_TITLES, run_header, uniform_selection

#: the densities timed by default (the share of (query tile, key tile) pairs visited)
DENSITIES = (0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class SparseTiming:
    """One row: ``kernel`` at ``density`` (1.0 and ``dense``: the dense call), median ms, × the same
    method's dense time (None for peers), × the best bf16 of the run and × each peer timed."""

    kernel: str
    density: float
    dense: bool
    ms: float
    of_dense: float | None
    x_best_bf16: float
    x_peers: dict


def bench_sparse(args) -> tuple[str, list[SparseTiming]]:
    """The markdown table and its rows (see the module's docstring)."""
    import contextlib

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import fp4_attention
    from ..attention import selection_for
    from ..eval.peers import find_peers, find_sparse_peers
    from ..kernels.operands import KeyTileLists
    from ..sparse import DynamicSparsity, StaticSparsity

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median")

    s, h, d = args.seq, args.heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    base = []  # (name, precision, ms)
    for name, backend in (("cuDNN SDPA bf16", SDPBackend.CUDNN_ATTENTION), ("flash SDPA bf16", SDPBackend.FLASH_ATTENTION),
                          ("SDPA default dispatch bf16", None)):
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                sdpa(q, k, v)
                base.append((name, "bf16", bench(lambda: sdpa(q, k, v))))
        except RuntimeError as e:
            print(f"  {name}: not available ({str(e).splitlines()[0][:80]})", file=sys.stderr)
    notes = []
    for p in find_peers():
        if p.fn is None:
            notes.append(f"{p.name}: {p.missing}")
            continue
        try:
            a = p.args(q, k, v)
            p.fn(*a)
            base.append((p.name, p.precision, bench(lambda: p.fn(*a))))
        except Exception as e:  # a peer's build that cannot run this shape: say so, keep going
            notes.append(f"{p.name}: failed ({type(e).__name__})")
        a = None
    best = min((ms for _, precision, ms in base if precision == "bf16"), default=None)
    peer_ms = {name: ms for name, _, ms in base}

    def row(kernel, density, dense, ms, of_dense):
        return SparseTiming(kernel, density, dense, ms, of_dense, (best or ms) / ms,
                            {p: peer_ms[p] / ms if p in peer_ms else None for p in RATIO_PEERS})

    rows = [row(name, 1.0, True, ms, None) for name, _, ms in base]
    peer_lines = []
    dense_ms = {}
    for m in args.methods:
        fp4_attention(q, k, v, method=m, backend="triton")
        dense_ms[m] = bench(lambda: fp4_attention(q, k, v, method=m, backend="triton"))
        rows.append(row(f"fp4video {m} dense", 1.0, True, dense_ms[m], 1.0))
        print(f"  {m} dense: {dense_ms[m]:.2f} ms", file=sys.stderr, flush=True)
        for density in args.densities:
            sel = uniform_selection(h, s, s, density)
            fp4_attention(q, k, v, method=m, backend="triton", sparsity=sel)
            ms = bench(lambda: fp4_attention(q, k, v, method=m, backend="triton", sparsity=sel))
            rows.append(row(f"fp4video {m}", float(sel.density()), False, ms, ms / dense_ms[m]))
            print(f"  {m} density {float(sel.density()):.3f}: {ms:.2f} ms", file=sys.stderr, flush=True)
    for density in args.densities:  # the sparse peers on the very same tiles
        sel = uniform_selection(h, s, s, density)
        for p in find_sparse_peers():
            if p.fn is None:
                notes.append(f"{p.name}: {p.missing}")
                break
            try:
                p.fn(q, k, v, sel.tiles)
                ms = bench(lambda: p.fn(q, k, v, sel.tiles))
            except Exception as e:  # a peer's build that cannot run this shape: say so, keep going
                notes.append(f"{p.name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})")
                continue
            ours = {r.kernel: r.ms for r in rows if not r.dense and abs(r.density - float(sel.density())) < 1e-9}
            rows.append(row(p.name, float(sel.density()), False, ms, None))
            versus = ", ".join(f"{name.removeprefix('fp4video ')} {ms / t:.2f}×" for name, t in ours.items())
            peer_lines.append(f"| {float(sel.density()):.3f} | {ms:.2f} | {versus} |")
            print(f"  {p.name} density {float(sel.density()):.3f}: {ms:.2f} ms", file=sys.stderr, flush=True)
    # the selections' own cost at this size, against the first method's dense call
    first = args.methods[0]
    frames, height, width = args.grid
    costs = []
    if frames * height * width == s:
        static = StaticSparsity(frames=frames, height=height, width=width, window=tuple(args.window), radial=True)
        costs.append((f"static window {tuple(args.window)}, radial", static))
    else:
        notes.append(f"static selection: the grid {frames}×{height}×{width} does not hold {s} tokens")
    if frames * height * width == s:
        costs.append((f"static window {tuple(args.window)}, radial, sinks", StaticSparsity(
            frames=frames, height=height, width=width, window=tuple(args.window), radial=True, sinks=True)))
    costs.append((f"dynamic τ={args.tau}", DynamicSparsity(tau=args.tau)))
    costs.append((f"dynamic τ={args.tau}, sampled", DynamicSparsity(tau=args.tau, estimate="sampled")))
    costs.append((f"dynamic τ={args.tau}, sampled, sinks, floor 0.9", DynamicSparsity(
        tau=args.tau, estimate="sampled", sinks=True, floor=0.9)))
    cost_lines = []
    for name, rule in costs:
        sel = selection_for(rule, q, k, backend="triton", method=first)
        ms = bench(lambda: selection_for(rule, q, k, backend="triton", method=first))
        lists_ms = bench(lambda: KeyTileLists.from_bitmap(sel.tiles, sel.query_tile, 1, h, s, s))
        call = bench(lambda: fp4_attention(q, k, v, method=first, backend="triton", sparsity=rule))
        given = bench(lambda: fp4_attention(q, k, v, method=first, backend="triton", sparsity=sel))
        cost_lines.append(f"| {name} | {float(sel.density()):.3f} | {ms:.2f} | {call:.2f} | {given:.2f} | "
                          f"{100 * (call - given) / dense_ms[first]:.1f}% | {lists_ms:.2f} | {dense_ms[first] / call:.2f} |")
    # the check every rule's call runs, alone: sampled rows' exact mass (the kernel), kept mass, and with
    # sinks and a floor the repair; against the dense call
    from ..kernels.covering import covering_rows
    from ..kernels.row_mass import row_block_mass, row_shares
    from ..sparse import CHECK_ROWS, check_rows_for, check_selection

    sel = uniform_selection(h, s, s, 0.3)
    check_lines = []
    kernels = dict(row_mass=row_block_mass, placement=covering_rows, shares=row_shares)
    for name, extra in (("measure", {}), ("measure, sinks, floor 0.9", dict(sinks=True, floor=0.9))):
        check_selection(sel, q, k, **kernels, **extra)
        ms = bench(lambda: check_selection(sel, q, k, **kernels, **extra))
        rows_read = check_rows_for(extra.get("floor"), None)
        check_lines.append(f"| {name} | {rows_read} | {ms:.2f} | {100 * ms / dense_ms[first]:.1f}% |")
    from ..sparse import sample_rows

    rows_ = sample_rows(s, 128, CHECK_ROWS, device="cuda")
    kernel_ms = bench(lambda: row_block_mass(q, k, rows_))
    check_lines.append(f"| the rows' exact mass alone (kernel) | {CHECK_ROWS} | {kernel_ms:.2f} | "
                       f"{100 * kernel_ms / dense_ms[first]:.1f}% |")
    table = format_sparse_table(run_header(f"bench sparse, B=1 H={h} S={s} D={d}, bf16"), rows)
    if peer_lines:
        table += ("\nThe block-sparse peer on the same tiles (ms), and each fp4video method's speed against it:\n\n"
                  "| density | SpargeAttn same tiles ms | × SpargeAttn |\n| --- | --- | --- |\n" + "\n".join(peer_lines) + "\n")
    table += ("\nThe check every rule's call runs (a random selection at density 0.3), against the dense `" + first
              + "` call:\n\n| check | sampled rows per query tile | ms | of the dense call |\n| --- | --- | --- | --- |\n"
              + "\n".join(check_lines) + "\n")
    table += ("\nSelections at this size, against the dense `" + first + "` call. The selection alone is timed "
              "with the GPU idle between calls (its many small launches bound it); inside a call its cost is the "
              "call with the rule less the call on the selection computed beforehand:\n\n"
              "| selection | density | selection alone ms | call with the rule ms | call on the selection ms | "
              "selection's cost in the call, of the dense call | lists ms | × dense |\n|" + " --- |" * 8 + "\n"
              + "\n".join(cost_lines) + "\n")
    table += "".join(f"\nNot timed: {n}." for n in notes)
    return table, rows


def format_sparse_table(header: str, rows: list[SparseTiming]) -> str:
    """The rows as markdown: kernel, density, ms, × dense of the same method, × best bf16, × each
    ratio peer."""
    lines = [header, "", "| kernel | density | ms (whole call) | × its dense time | × best bf16 | "
             + " | ".join(RATIO_TITLES) + " |", "|" + " --- |" * (5 + len(RATIO_TITLES))]
    for r in rows:
        peers = " | ".join("n/a" if r.x_peers.get(p) is None else f"{r.x_peers[p]:.2f}" for p in RATIO_PEERS)
        of = "" if r.of_dense is None else f"{r.of_dense:.3f}"
        lines.append(f"| {r.kernel} | {r.density:.3f} | {r.ms:.2f} | {of} | {r.x_best_bf16:.2f} | {peers} |")
    return "\n".join(lines) + "\n"


#: the dense rows drawn as reference lines: the peers a user would pick (the best bf16 is found in the run)
PLOTTED_PEERS = ("FlashAttention-3 bf16", "FlashAttention-3 FP8 (cast included)",
                 "SageAttention2 sageattn (INT8 QK, FP8 PV)")


def parse_sparse_table(text: str) -> list[SparseTiming]:
    """The rows of a ``bench sparse`` table read back from its markdown (ratios to peers dropped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("Selections"):  # the selections' table follows the timings
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] in ("kernel", "---") or not cells[1].replace(".", "", 1).isdigit():
            continue
        try:
            density, ms, best = float(cells[1]), float(cells[2]), float(cells[4])
        except ValueError:
            continue
        of = float(cells[3]) if cells[3] else None
        dense = of is None or cells[0].endswith(" dense")
        rows.append(SparseTiming(cells[0], density, dense, ms, of, best, {}))
    return rows


def plot_sparse(rows: list[SparseTiming], path: str, title: str) -> str:
    """Time against density, a line per method (its dense time at density 1 as a hollow marker),
    and as horizontal lines the best bf16 attention of the run and the peers of :data:`PLOTTED_PEERS`,
    labelled at the left (low densities lie far below them), apart from one another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    order = [r.kernel for r in rows]
    methods = sorted({r.kernel for r in rows if not r.dense}, key=order.index)
    for name in methods:
        pts = sorted((r.density, r.ms) for r in rows if r.kernel == name and not r.dense)
        line, = ax.plot(*zip(*pts), marker="o", label=name.removeprefix("fp4video ") + " block-sparse")
        dense = next((r.ms for r in rows if r.dense and r.kernel == f"{name} dense"), None)
        if dense is not None:
            ax.plot([1.0], [dense], marker="s", mfc="none", ms=8, color=line.get_color(), ls="none")
    bf16 = [r for r in rows if r.dense and not r.kernel.startswith("fp4video") and "bf16" in r.kernel]
    lines = [r for r in rows if r.dense and r.kernel in PLOTTED_PEERS]
    best = min(bf16, key=lambda r: r.ms, default=None)
    if best is not None and best not in lines:
        lines.append(best)
    top = max([r.ms for r in rows] + [1.0])
    placed = []
    for r in sorted(lines, key=lambda r: r.ms):
        ax.axhline(r.ms, ls=":", lw=1, color="0.45")
        y = r.ms
        while placed and y - placed[-1] < 0.045 * top:  # keep labels apart
            y = placed[-1] + 0.045 * top
        placed.append(y)
        name = r.kernel + (" (best bf16)" if r is best else "")
        ax.annotate(f"{name}: {r.ms:.0f} ms", (0.01, y), fontsize=7.5, color="0.25", va="bottom")
    ax.set_xlabel("density (share of query-tile × key-tile pairs visited)")
    ax.set_ylabel("ms per attention call (whole call)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, top * 1.08)
    ax.set_title(textwrap.fill(title, 90), fontsize=8.5)
    ax.legend(fontsize=8, loc="upper left", title="hollow squares: the dense call", title_fontsize=7.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
