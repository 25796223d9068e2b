#!/usr/bin/env python3
"""Hardware counters of the attention loops (GPU, Nsight Compute): where their cycles go.

Two steps. ``run`` calls each kernel once, so that ``ncu`` profiles one launch per method (the
first call compiles the kernel, which launches nothing else that matches ``-k``); ``summarize`` turns ncu's raw CSV into a markdown table:
issue-slot use, tensor-pipe activity and the warp stall reasons per issued instruction.

    ncu --clock-control none -k 'regex:_nv_attn_fwd|_mx_fp8_attn_fwd|cudnn' \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats -o prof \\
        python3 scripts/profile_attention.py run --seq 16384 --heads 16 sage3 nvfp4 sage3-triton mxattn cudnn
    ncu -i prof.ncu-rep --page raw --csv > raw.csv
    python3 scripts/profile_attention.py summarize raw.csv

``NAME-triton`` forces the Triton NVFP4 loop (``FP4VIDEO_NV_KERNEL=triton``); ``cudnn`` is
PyTorch's cuDNN SDPA. ``--clock-control none`` leaves the clocks as they are (the project's
measuring rule); ncu then warns that results may vary from run to run.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

#: the stall reasons reported (ncu's smsp__average_warps_issue_stalled_<reason>_per_issue_active)
STALLS = ("selected", "barrier", "wait", "not_selected", "no_instruction", "dispatch_stall", "short_scoreboard",
          "gmma", "mio_throttle", "long_scoreboard", "math_pipe_throttle")


def run(args) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import fp4_attention

    if not torch.cuda.is_available():
        raise SystemExit("error: profiling needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))

    def call(name: str):
        if name == "cudnn":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        previous = os.environ.get("FP4VIDEO_NV_KERNEL")
        if name.endswith("-triton"):
            os.environ["FP4VIDEO_NV_KERNEL"] = "triton"
        try:
            return fp4_attention(q, k, v, method=name.removesuffix("-triton"), backend="triton")
        finally:
            if previous is None:
                os.environ.pop("FP4VIDEO_NV_KERNEL", None)
            else:
                os.environ["FP4VIDEO_NV_KERNEL"] = previous

    for name in args.kernels:  # one launch each (its first call compiles it, which launches nothing)
        call(name)
        torch.cuda.synchronize()
        print(f"profiled {name}", file=sys.stderr)
    return 0


def summarize(args) -> int:
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}

    def value(row, metric):
        i = col.get(metric)
        return float(row[i].replace(",", "")) if i is not None and row[i] not in ("", "n/a") else float("nan")

    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    print("| kernel | ms | issue slots busy % | tensor pipe active % | warp cycles per issue (these reasons) | "
          + " | ".join(s.replace("_", " ") for s in STALLS) + " |")
    print("| --- " * (5 + len(STALLS)) + "|")
    for row in data:
        name = row[col["Kernel Name"]][:40]
        duration = "gpu__time_duration.sum"
        ms = value(row, duration) / {"ns": 1e6, "us": 1e3, "usecond": 1e3, "nsecond": 1e6}.get(units[col[duration]], 1.0)
        cycles = sum(x for s in STALLS if (x := value(row, stall.format(s))) == x)  # reasons ncu reported
        print(f"| {name} | {ms:.2f} | {value(row, 'sm__issue_active.avg.pct_of_peak_sustained_elapsed'):.1f} | "
              f"{value(row, 'sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active'):.1f} | {cycles:.2f} | "
              + " | ".join(f"{value(row, stall.format(s)):.2f}" for s in STALLS) + " |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one launch of each kernel (run under ncu)")
    r.add_argument("kernels", nargs="+", help="fp4video methods, NAME-triton (the Triton NVFP4 loop) or cudnn")
    r.add_argument("--seq", type=int, default=16384)
    r.add_argument("--heads", type=int, default=16)
    s = sub.add_parser("summarize", help="markdown table from `ncu -i REP --page raw --csv`")
    s.add_argument("csv")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
