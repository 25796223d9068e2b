#!/usr/bin/env python3
"""The e4m3 attention loop (MXFP4 and FP8-P·V methods on Hopper) under several launch variants,
the loop alone on one pre-pass output, beside cuDNN SDPA timed in the same process (GPU).

For each method: the default launch, then each variant — P̂·V̂ left in flight into the next tile
(``fresh_pv=False``), other BLOCK_M × warps × stages, pointer loads instead of TMA — with its
output against the default's (max |diff|, bit-equal or not) and its median time. A markdown
table goes to stdout.

    python tools/e4m3_loop_variants.py --seq 75600 --methods mxattn-pv8 fp8 mxattn
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4video import METHODS
from fp4video.kernels.dispatch import prepare, run_loop
from fp4video.kernels.loop_e4m3 import attention_e4m3
from fp4video.kernels.plan import plan

#: name -> attention_e4m3 keyword arguments (the default launch first; ``tma``: the plan's TMA form)
VARIANTS = {
    "default (TMA, 64×4×2, fresh P̂·V̂)": {},
    "P̂·V̂ in flight": {"fresh_pv": False},
    "TMA 64×4×3": {"block_m": 64, "num_warps": 4, "num_stages": 3},
    "TMA 64×4×3, P̂·V̂ in flight": {"block_m": 64, "num_warps": 4, "num_stages": 3, "fresh_pv": False},
    "TMA 128×8×2": {"block_m": 128, "num_warps": 8, "num_stages": 2},
    "TMA 128×8×3": {"block_m": 128, "num_warps": 8, "num_stages": 3},
    "pointer 64×4×3": {"tma": False, "block_m": 64, "num_warps": 4, "num_stages": 3},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=75600)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--methods", nargs="+", default=["mxattn-pv8", "fp8", "mxattn"])
    ap.add_argument("--rep-ms", type=int, default=1500)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    k = k + 0.5 * torch.randn(1, args.heads, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # a K mean
    bench = lambda fn: triton.testing.do_bench(fn, warmup=200, rep=args.rep_ms, return_mode="median")  # noqa: E731
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B=1 H={args.heads} S={args.seq} D=128; cuDNN SDPA {t_ref:.2f} ms\n")
    print("| method | variant | loop ms | × cuDNN | max abs diff to default | bit-equal |\n| --- | --- | --- | --- | --- | --- |")
    for m in args.methods:
        recipe = METHODS[m]
        call_plan = plan(recipe, q)
        if call_plan.loop != "e4m3":
            print(f"| {m} | runs {call_plan.module}, not the e4m3 loop | | | | |")
            continue
        operands = {tma: prepare(q, k, v, recipe, None, call_plan.replace(tma=tma, key_order="tile" if tma else "key"))
                    for tma in (True, False)}
        base = None
        for name, kw in VARIANTS.items():
            kw = dict(kw)
            tma = kw.pop("tma", True)
            variant = call_plan.replace(tma=tma, key_order="tile" if tma else "key")
            try:
                if "fresh_pv" in kw:  # a launch option of the e4m3 loop alone
                    run = lambda: attention_e4m3(operands[tma], None, variant, recipe=recipe,  # noqa: E731
                                                 scale=128**-0.5, out_dtype=q.dtype, dv=128, exact=False, **kw)
                else:
                    run = lambda: run_loop(variant, operands[tma], None, recipe=recipe,  # noqa: E731
                                           scale=128**-0.5, out_dtype=q.dtype, dv=128, exact=False, **kw)
                out, lse = run()
                t = bench(run)
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"| {m} | {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
                continue
            if base is None:
                base = (out, lse)
            diff = (out.float() - base[0].float()).abs().max().item()
            equal = torch.equal(out, base[0]) and torch.equal(lse, base[1])
            print(f"| {m} | {name} | {t:.2f} | {t_ref / t:.3f} | {diff:.2e} | {'yes' if equal else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
