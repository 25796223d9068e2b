#!/usr/bin/env python3
"""Prompt × method sweep producing MXAttention-style Table 2 and Table 3 (markdown + JSON + plots).

    python scripts/sweep_tables.py --out sweep-tiny                       # embedded tiny default, CPU
    python scripts/sweep_tables.py --config configs/wan22_mxattn.yaml --model /models/Wan2.2 \\
        --prompts-file prompts.txt --out sweep-wan22 --vbench-python .vbench-venv/bin/python

FP16 videos come first, every method uses the same prompts and seed; rerunning skips videos that
already exist (mp4 + sidecar), so an interrupted sweep resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp4video.eval.sweep import run_sweep
from fp4video.integration.config import DEFAULT_CONFIG, load_config
from fp4video.integration.pipelines import embedded_sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path)
    ap.add_argument("--model", help='"test", "tiny", a folder or a hub id (overrides the config)')
    ap.add_argument("--prompts-file", type=Path, help="one prompt per line (overrides the config)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--frames", type=int)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vbench-python", help="VBench environment's python: adds the three VBench columns")
    args = ap.parse_args(argv)
    cfg = load_config(args.config) if args.config else DEFAULT_CONFIG
    changes = {}
    if args.model:
        changes["model"] = args.model
    changes.update(embedded_sizes(changes.get("model", cfg.model), cfg.family))  # an embedded model's own sizes
    if args.prompts_file:
        changes["prompts"] = [p.strip() for p in args.prompts_file.read_text().splitlines() if p.strip()]
    for k in ("steps", "frames"):
        if getattr(args, k):
            changes[k] = getattr(args, k)
    cfg = type(cfg).model_validate({**cfg.model_dump(), **changes})
    from fp4video.integration.pipelines import FrameCountError

    try:
        result = run_sweep(cfg, args.out, vbench_python=args.vbench_python)
    except FrameCountError as e:  # a frame count the pipeline cannot take: one line, as argparse says its own
        ap.error(str(e))
    print((args.out / "tables.md").read_text())
    print(f"wrote {args.out / 'tables.md'}, tables.json, methods.png, similarity_over_frames.png "
          f"({len(result['table2']) + len(result['table3'])} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
