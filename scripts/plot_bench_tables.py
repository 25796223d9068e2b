#!/usr/bin/env python3
"""Draw the ``fp4video bench kernel`` tables of a markdown file (a run's ``--out`` file, or
BENCHMARKS.md with ``--first N``) as one PNG: each method's speed as a multiple of the best
baseline measured in the same run. ``--sparse``: the first ``fp4video bench sparse`` table instead
(time against density).

    python scripts/plot_bench_tables.py run.md --out docs/kernel-speed.png --bar 0.8
    python scripts/plot_bench_tables.py sparse-run.md --sparse --out docs/sparse-speed.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp4video.eval.speed import parse_kernel_tables, plot_kernel_tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("markdown", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--first", type=int, default=None, help="only the first N tables of the file")
    ap.add_argument("--bar", type=float, default=None, help="draw a target line (e.g. 0.8)")
    ap.add_argument("--sparse", action="store_true", help="a `bench sparse` table: time against density")
    args = ap.parse_args(argv)
    if args.sparse:
        from fp4video.cli.bench_sparse import parse_sparse_table, plot_sparse

        text = args.markdown.read_text()
        head = next((line for line in text.splitlines() if line.startswith("### bench sparse")), None)
        if head is None:
            print(f"error: no `bench sparse` table in {args.markdown}", file=sys.stderr)
            return 2
        table = text[text.index(head):]
        print(f"wrote {plot_sparse(parse_sparse_table(table.split(chr(10) + '### ')[0]), args.out, head[4:])}")
        return 0
    tables = parse_kernel_tables(args.markdown.read_text())
    if args.first is not None:
        tables = tables[: args.first]
    if not tables:
        print(f"error: no `bench kernel` tables in {args.markdown}", file=sys.stderr)
        return 2
    print(f"wrote {plot_kernel_tables(tables, args.out, bar=args.bar)} ({len(tables)} tables)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
