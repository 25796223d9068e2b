"""``fp4video eval``: similarity of candidate videos to their FP16 references (cosine, SSIM, PSNR
per frame, then averaged), optionally with VBench's three quality dimensions."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .common import UsageError, check_output_dir, check_output_file

EXAMPLES = """examples:
  fp4video eval --reference fp16.mp4 --candidate mxattn.mp4
  fp4video eval --reference videos/fp16 --candidate videos/mxattn --out results.json
  fp4video eval --reference videos/fp16 --candidate videos/mxattn --vbench --vbench-python .vbench-venv/bin/python
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="paired Cosine/SSIM/PSNR against the FP16 video (+ VBench)", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, required=True, help="FP16 mp4, or a folder of them")
    p.add_argument("--candidate", type=Path, required=True, help="quantized mp4, or a folder paired by file name")
    p.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    p.add_argument("--vbench", action="store_true", help="also score the candidates with VBench (its own venv)")
    p.add_argument("--vbench-python", default=".vbench-venv/bin/python",
                   help="Python of VBench's environment (scripts/setup_vbench_env.sh builds it)")
    return p


def summary_line(result: dict) -> str:
    """One line: cosine with 6 digits (methods differ in the 4th), SSIM, PSNR over the differing
    frames (``inf`` when every frame is identical)."""
    same, frames = result["identical_frames"], result["frames"]
    value = float(result["psnr"])  # a float, or "inf" as the JSON holds it
    if math.isinf(value):
        psnr = "psnr inf (every frame identical)"
    else:
        psnr = f"psnr {value:.2f} dB"
        if same:
            psnr += f" over the {frames - same} differing frames ({same} identical)"
    return (f"cosine {result['cosine']:.6f}  ssim {result['ssim']:.6f}  {psnr}  "
            f"({len(result['videos'])} video(s), {frames} frames; cosine on {result['cosine_range']})")


def run(args) -> int:
    """Outputs are checked before any video is read; the JSON goes out whole (atomic rename),
    with PSNR infinities as the string "inf" (standard JSON has no infinity)."""
    from ..eval import evaluate_paths, json_ready
    from ..integration.media import write_text_atomic

    if args.out is not None:
        check_output_file(args.out, "--out")
    vbench_dir = (args.out.parent if args.out else Path(".")) / "vbench-out"
    if args.vbench:
        check_output_dir(vbench_dir, "--out (VBench's folder beside it)")
    result = evaluate_paths(args.reference, args.candidate, progress=True)
    if args.vbench:
        from ..eval.vbench_driver import run_vbench

        folder = args.candidate if args.candidate.is_dir() else args.candidate.parent
        try:
            result["vbench"] = run_vbench(folder, python=args.vbench_python, out_dir=vbench_dir)
        except RuntimeError as e:
            raise UsageError(f"--vbench: {e}") from None
    text = json.dumps(json_ready(result), indent=1, allow_nan=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, text)
    else:
        print(text)
    print(summary_line(result), file=sys.stderr)
    return 0
