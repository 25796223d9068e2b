"""``fp4video check``: every method's kernel against the reference on this GPU (random and sharp
inputs, every row, the LSE; a block-sparse call on a random selection where the method's loop takes
one, else why not), and one timing against SDPA and any installed peer; a table on screen
and a JSON report. Run it on a GPU this project has not run on
(Blackwell) and send the JSON back."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import UsageError, check_output_file

EXAMPLES = """examples:
  fp4video check                                  # every method; fp4video-check.json
  fp4video check --methods mxattn sage3 --out my-gpu.json
  TRITON_INTERPRET=1 fp4video check --device cpu --methods mxattn --small   # the code path on a CPU (slow)
"""


def add_parser(sub) -> argparse.ArgumentParser:
    from ..recipe import METHODS

    quantized = [m for m in METHODS if m != "fp16"]
    p = sub.add_parser("check", help="self-check on this GPU: kernels vs reference, and speed", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=quantized, choices=quantized, metavar="METHOD",
                   help="methods to check (default: every quantized method)")
    p.add_argument("--out", type=Path, default=Path("fp4video-check.json"), help="JSON report (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="CUDA device (default: %(default)s); cpu only under TRITON_INTERPRET=1")
    p.add_argument("--small", action="store_true", help="small shapes, no timing (the interpreter's CPU run)")
    return p


def run(args) -> int:
    import torch

    cpu = args.device.startswith("cpu")
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError("--device cpu runs the kernels only under TRITON_INTERPRET=1 (slow; use --small)")
    if not cpu and not torch.cuda.is_available():
        raise UsageError("fp4video check needs a CUDA GPU (or TRITON_INTERPRET=1 with --device cpu --small)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UsageError("fp4video check runs the Triton kernels: pip install 'fp4video[triton]'") from None
    check_output_file(args.out, "--out")  # written after the checks: checked first
    from tqdm import tqdm

    from ..eval.check import format_check, run_check
    from ..integration.media import write_text_atomic

    shapes = dict(heads=2, sq=64, sk=130, head_dim=64, timing_seq=None) if args.small or cpu else {}
    report = run_check(args.methods, device=args.device, progress=lambda it, what: tqdm(it, desc=what, leave=False),
                       **shapes)
    print(format_check(report))
    write_text_atomic(args.out, json.dumps(report, indent=1, allow_nan=False))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if report["ok"] else 1
