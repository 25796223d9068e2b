"""What the block-sparse check costs, against a dense attention call: its pieces (the rows' placement,
their exact mass, the repair) for 2, 4, 8 and 10 (the default) rows per query tile, the shipped check
(covering rows, the bound's repair) and the previous one (strata rows, each row's own repair), at Wan
720p by default.

    PYTHONPATH=. python3 scripts/sparse_check_cost.py --out check-cost                 # the H200: B=1, H=40, 75,600 tokens, D=128, bf16
    PYTHONPATH=. python3 scripts/sparse_check_cost.py --out check-cost --graph         # + each check replayed from a CUDA graph
    PYTHONPATH=. python3 scripts/sparse_check_cost.py --out check-cost --rows 2 --sweep   # + the row-mass kernel's launch settings
    PYTHONPATH=. python3 scripts/sparse_check_cost.py --out check-cost --rows 2 --profile # + each check's kernels by time
    PYTHONPATH=. python3 scripts/sparse_check_cost.py --tokens 2048 --heads 2 --device cpu --out /tmp/c   # a tiny CPU run

The dense call is torch's ``scaled_dot_product_attention`` in the inputs' dtype (FlashAttention on the
H200) and, on a GPU, fp4video's ``--methods`` (dense, Triton). The checked selection is a uniform
random one at ``--density``. On the GPU the rows' exact mass runs the Triton kernel
(:mod:`fp4video.kernels.row_mass`) and the rows' placement its kernel (:mod:`fp4video.kernels.covering`),
on the CPU the references. Times are medians of ``--repeats``
calls after two warm-up calls (CUDA events on the GPU). Writes ``cost.md`` and ``cost.json`` into
``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from fp4video.calibration.costs import median_seconds
from fp4video.sparse import (BlockSelection, CHECK_ROWS, check_selection, covering_rows, sample_rows, sink_columns)


def bench(fn, repeats: int, device: torch.device) -> float:
    """The median milliseconds of ``fn()`` over ``repeats`` calls, after a warm-up call."""
    return 1e3 * median_seconds(fn, device, reps=repeats)


def graphed(fn, device: torch.device):
    """``fn`` captured once in a CUDA graph: a function that replays it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def designs_module():
    path = Path(__file__).resolve().parent / "sparse_repair_designs.py"
    spec = importlib.util.spec_from_file_location("sparse_repair_designs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def previous_check(sel: BlockSelection, q, k, rows: int, row_mass, floor: float, union_take):
    """The previous check with sinks and a floor: ``rows`` strata rows (the same for every head), the
    kept mass of their mean, sinks, and each row under the floor adding key tiles by its own mass
    until it keeps floor + ¼(1 − floor) (its leave-one-out estimate left out). Its sinks are today's
    (:func:`~fp4video.sparse.sink_columns`: the median over at most 64 query tiles), not the median
    over every query tile the previous check took."""
    b, h = q.shape[:2]
    index = sample_rows(q.shape[2], sel.query_tile, rows, device=q.device)
    mass = row_mass(q, k, index, key_tile=sel.key_tile)  # (B, H, nq, r, nk)
    total = mass.sum(-1, keepdim=True)
    share = torch.where(total > 0, mass / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    tiles = sel.tiles.expand(b, h, *sel.tiles.shape[2:])
    block = share.mean(-2)
    tiles = tiles | sink_columns(block / block.sum(-1, keepdim=True).clamp(min=1e-30)).unsqueeze(-2)
    return tiles | union_take(tiles, share, floor, 0.25).any(-2)


@torch.no_grad()  # no graph for a measurement, and the caller's grad mode back on return
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=75_600)
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, nargs="+", default=sorted({2, 4, 8, CHECK_ROWS}))
    p.add_argument("--density", type=float, default=0.3, help="the checked (random) selection's density")
    p.add_argument("--floor", type=float, default=0.9)
    p.add_argument("--methods", nargs="*", default=["mxattn-pv8"], help="fp4video's dense calls to compare (GPU)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--graph", action="store_true", help="also time each check replayed from a CUDA graph")
    p.add_argument("--sweep", action="store_true",
                   help="also time the row-mass kernel's launch settings (rows a program, warps, stages; GPU)")
    p.add_argument("--profile", action="store_true",
                   help="also write profile.md: each check's GPU kernels by time (torch.profiler), at the first --rows")
    args = p.parse_args(argv)
    for name in ("tokens", "heads", "head_dim", "batch", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if any(r < 1 for r in args.rows) or not 0 < args.density <= 1 or not 0 < args.floor <= 1:
        p.error("--rows must be >= 1, --density and --floor in (0, 1]")
    device = torch.device(args.device)
    if args.graph and device.type != "cuda":
        p.error("--graph needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    b, h, s, d = args.batch, args.heads, args.tokens, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, generator=g).to(dtype) for _ in range(3))
    if device.type == "cuda":
        from fp4video.kernels.covering import covering_rows as placement
        from fp4video.kernels.row_mass import row_block_mass as row_mass
        from fp4video.kernels.row_mass import row_shares as shares
    else:
        from fp4video.sparse import row_block_mass as row_mass
        from fp4video.sparse import row_shares as shares
        placement = covering_rows
    nq = nk = -(-s // 128)
    sel = BlockSelection(torch.rand(b, h, nq, nk, device=device, generator=g) < args.density, s, s)
    union_take = designs_module().union_take

    dense = {"SDPA": bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.repeats, device)}
    notes = []
    if device.type == "cuda":
        from fp4video import fp4_attention

        for method in args.methods:
            try:
                dense[method] = bench(lambda m=method: fp4_attention(q, k, v, method=m, backend="triton"), args.repeats,
                                      device)
            except Exception as e:  # a method the GPU cannot run is named, the others timed
                notes.append(f"{method}: not timed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    print(f"dense: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in dense.items()), file=sys.stderr)

    lines = []

    def record(piece, rows, fn, graph=False):
        ms = bench(fn, args.repeats, device)
        line = {"piece": piece, "rows": rows, "ms": ms, **{f"of {n}": ms / dense_ms for n, dense_ms in dense.items()}}
        if graph:
            line["graph_ms"] = bench(graphed(fn, device), args.repeats, device)
        lines.append(line)
        print(f"  {piece}, {rows} rows: {ms:.2f} ms", file=sys.stderr)
        (out / "cost.json").write_text(json.dumps({"settings": vars(args), "dense_ms": dense, "lines": lines}, indent=1))

    for r in args.rows:
        strata = sample_rows(s, 128, r, device=device)
        record("the rows' exact mass alone, strata rows (shared by the heads)", r, lambda: row_mass(q, k, strata))
        record("covering rows: the placement alone", r, lambda: placement(q, 128, r))
        if placement is not covering_rows:
            record("covering rows: the placement alone, torch ops (the reference)", r, lambda: covering_rows(q, 128, r))
        index, _ = placement(q, 128, r)
        flat = index.reshape(b, h, -1, 1)
        ar = torch.arange(flat.shape[2], device=device)
        record("the rows' exact mass alone, covering rows (gathered, per head)", r,
               lambda: row_mass(q.gather(2, flat.expand(b, h, flat.shape[2], d)), k, ar))
        record("the check, measure only", r, lambda: check_selection(sel, q, k, rows=r, row_mass=row_mass, placement=placement, shares=shares), args.graph)
        record("the check with sinks (the shipped sparse configs' check)", r,
               lambda: check_selection(sel, q, k, rows=r, sinks=True, row_mass=row_mass, placement=placement, shares=shares), args.graph)
        record(f"the check with sinks and floor {args.floor:g} (the bound's repair)", r,
               lambda: check_selection(sel, q, k, rows=r, sinks=True, floor=args.floor, row_mass=row_mass,
                                               placement=placement, shares=shares), args.graph)
        record(f"the previous check with sinks and floor {args.floor:g} (strata rows, each row's repair)", r,
               lambda: previous_check(sel, q, k, r, row_mass, args.floor, union_take), args.graph)

    if args.sweep and device.type == "cuda":  # the row-mass kernel's launch settings, on covering rows
        for r in args.rows:
            index, _ = placement(q, 128, r)
            flat = index.reshape(b, h, -1, 1)
            q_rows = q.gather(2, flat.expand(b, h, flat.shape[2], d)).contiguous()
            ar = torch.arange(flat.shape[2], device=device)
            for block_r in (64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        for splits in (1, None):
                            record(f"the rows' exact mass alone, {block_r} rows a program, {warps} warps, {stages} stages, "
                                   f"key tiles split {'by default' if splits is None else f'{splits} ways'}", r,
                                   lambda: row_mass(q_rows, k, ar, block_r=block_r, num_warps=warps, num_stages=stages,
                                                    splits=splits))

    if args.sweep and device.type == "cuda":  # the placement kernel's warps
        for r in args.rows:
            for warps in (2, 4, 8, 16):
                record(f"covering rows: the placement alone, {warps} warps", r,
                       lambda: placement(q, 128, r, num_warps=warps))

    if args.profile and device.type == "cuda":  # where each check's time goes, kernel by kernel
        from torch.profiler import ProfilerActivity, profile

        r = args.rows[0]
        tables = []
        for label, kw in (("measure only", {}), ("with sinks", {"sinks": True}),
                          (f"with sinks and floor {args.floor:g}", {"sinks": True, "floor": args.floor})):
            fn = lambda: check_selection(sel, q, k, rows=r, row_mass=row_mass, placement=placement, shares=shares, **kw)
            fn()
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize(device)
            tables.append(f"## The check {label}, {r} rows per tile (5 calls)\n\n```\n"
                          + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n```\n")
            (out / "profile.md").write_text("\n".join(tables))

    names = list(dense)
    head = ["piece", "rows per tile", "ms", *[f"of dense {n}" for n in names]] + (["CUDA graph ms"] if args.graph else [])
    md = [f"The check's cost: B={b} H={h} S={s} D={d} {args.dtype} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}; a random selection at density {args.density:g}; medians of {args.repeats} calls.", "",
          "Dense calls: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in dense.items()) + ".", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in lines:
        cells = [line["piece"], str(line["rows"]), f"{line['ms']:.2f}", *[f"{100 * line[f'of {n}']:.1f}%" for n in names]]
        if args.graph:
            cells.append(f"{line['graph_ms']:.2f}" if "graph_ms" in line else "–")
        md.append("| " + " | ".join(cells) + " |")
    md += [f"\nNot timed: {n}." for n in notes]
    (out / "cost.md").write_text("\n".join(md) + "\n")
    (out / "cost.json").write_text(json.dumps({"settings": vars(args), "dense_ms": dense, "lines": lines, "notes": notes},
                                              indent=1))
    print(f"written: {out / 'cost.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
