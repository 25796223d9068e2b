"""``fp4video vbench-weights``: check (and place) the weight files VBench's three dimensions read."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("vbench-weights", help="check / place VBench's weight files", description=__doc__)
    p.add_argument("--from", dest="source", type=Path, help="copy the files found in this folder into place")
    p.add_argument("--cache-dir", type=Path, help="VBENCH_CACHE_DIR (default: $VBENCH_CACHE_DIR or ~/.cache/vbench)")
    p.add_argument("--torch-home", type=Path, help="TORCH_HOME (default: $TORCH_HOME or ~/.cache/torch)")
    return p


def run(args) -> int:
    from ..eval.vbench_driver import place_weights, weight_status

    if args.source:
        if not args.source.is_dir():
            raise UsageError(f"--from {args.source}: no such folder")
        for path in place_weights(args.source, args.cache_dir, args.torch_home):
            print(f"placed {path}")
    status = weight_status(args.cache_dir, args.torch_home)
    for w in status:
        print(f"{'present' if w['present'] else 'MISSING'}  {w['dimension']:<20} {w['file']:<40} {w['path']}")
    missing = sum(not w["present"] for w in status)
    print(f"{len(status) - missing} of {len(status)} present" + ("" if not missing else
          "; VBench cannot run offline until the missing files are placed"))
    return 0 if not missing else 1
