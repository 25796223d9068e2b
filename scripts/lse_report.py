#!/usr/bin/env python3
"""Kernel vs reference on the GPU, with and without promoting the e4m3 MMAs' partial sums to fp32
every 32 products (``max_num_imprecise_acc=32`` on Q·K and/or P·V), and what that costs.

Hopper's fp8 MMA accumulates with reduced precision; the logits it returns differ slightly from
the reference's fp32 products, which can move a P block's scale decision. This prints, per
variant, the cosine of the outputs and the distribution of the LSE difference over all rows,
then the loop's time at a long sequence.

    python scripts/lse_report.py [--seq 4000] [--heads 4] [--method mxattn] [--time-seq 32760]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from fp4video import METHODS, fp4_attention
from fp4video.kernels.attention_fwd import attention_prepared, prepare
from fp4video.metrics import cossim

VARIANTS = [(False, False), (True, False), (False, True), (True, True)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4000)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--method", default="mxattn")
    ap.add_argument("--time-seq", type=int, default=32760, help="0: skip the timing")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: lse_report.py needs a CUDA GPU (the e4m3 MMA is what it measures)")
    recipe = METHODS[args.method]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    ref, lse_ref = fp4_attention(q, k, v, method=args.method, backend="reference", return_lse=True)
    prepared = prepare(q, k, v, recipe, None)
    print(f"{torch.cuda.get_device_name()}, {args.method}, S={args.seq}, H={args.heads}, D=128, "
          f"torch {torch.__version__}, triton {triton.__version__}\n")
    print("| Q·K promoted | P·V promoted | cosine to reference | max abs ΔLSE | 99.9th pct | 99th pct | rows with ΔLSE > 1e-2 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for pqk, ppv in VARIANTS:
        out, lse = attention_prepared(prepared, None, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128,
                                      precise_qk=pqk, precise_pv=ppv)
        d = (lse - lse_ref).abs().flatten().float()
        pct = torch.quantile(d, torch.tensor([0.999, 0.99], device=d.device))
        print(f"| {pqk} | {ppv} | {cossim(out.float(), ref.float()):.6f} | {d.max().item():.1e} | "
              f"{pct[0].item():.1e} | {pct[1].item():.1e} | {int((d > 1e-2).sum())} of {d.numel()} |", flush=True)
    if args.time_seq:
        del q, k, v, ref, prepared
        q, k, v = (torch.randn(1, 40, args.time_seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        prepared = prepare(q, k, v, recipe, None)
        print(f"\n| loop, S={args.time_seq}, H=40 | ms | × unpromoted |\n| --- | --- | --- |")
        base = None
        for pqk, ppv in VARIANTS:
            t = triton.testing.do_bench(lambda: attention_prepared(
                prepared, None, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128, precise_qk=pqk,
                precise_pv=ppv), warmup=20, rep=100, return_mode="median")
            base = base or t
            print(f"| Q·K {'promoted' if pqk else 'as is'}, P·V {'promoted' if ppv else 'as is'} | {t:.2f} | "
                  f"{base / t:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
