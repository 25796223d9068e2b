#!/usr/bin/env python3
"""Sweep the Triton attention kernel's launch configuration (BLOCK_M, warps, stages) per method,
timing the whole call (pre-pass included) against cuDNN SDPA in the same process.

    python tools/sweep_kernel_configs.py [--seq 32760] [--methods fp16 mxattn sage3]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4video import METHODS
from fp4video.kernels.dispatch import prepare, run_loop
from fp4video.kernels.plan import plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32760)
    ap.add_argument("--methods", nargs="+", default=["fp16", "mxattn", "sage3"])
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 40, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_ref = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                        return_mode="median")
    print(f"cuDNN SDPA: {t_ref:.2f} ms")
    print("| method | BLOCK_M | warps | stages | ms | × cuDNN |\n| --- | --- | --- | --- | --- | --- |")
    for m in args.methods:
        recipe = METHODS[m]
        call_plan = plan(recipe, q, launch_given=True)  # (the Triton loops: the Gluon one takes no launch values)
        operands = prepare(q, k, v, recipe, None, call_plan)
        for bm, nw, ns in itertools.product((64, 128), (4, 8), (2, 3, 4) if call_plan.loop == "e4m3" else (1, 2, 3)):
            try:
                fn = lambda: run_loop(call_plan, operands, None, recipe=recipe, scale=128**-0.5,  # noqa: E731
                                      out_dtype=q.dtype, dv=128, block_m=bm, num_warps=nw, num_stages=ns)
                t = triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")
                print(f"| {m} | {bm} | {nw} | {ns} | {t:.2f} | {t_ref / t:.2f} |", flush=True)
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"| {m} | {bm} | {nw} | {ns} | failed: {type(e).__name__} | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
