#!/usr/bin/env python3
"""Time fp4video's Triton attention against cuDNN / flash SDPA in one run, on one GPU.

    python scripts/bench_kernel.py [--seqs 8192 32760] [--methods mxattn sage3 ...] [--out bench.md]

Prints TFLOP/s (4·B·H·S²·D, non-causal forward) and the ratio to cuDNN SDPA measured in the
same process, with the fused pre-pass (smoothing, rotation, quantization) and the attention loop also timed
separately, and the
cosine of each output to cuDNN's. Medians of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4video import METHODS, fp4_attention
from fp4video.metrics import cossim
from fp4video.kernels.attention_fwd import attention_prepared, work_dtype
from fp4video.kernels.prepass import prepass


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32760])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["fp16", "mxattn", "mxattn-sk", "sage3", "nvfp4", "mxfp4-ocp"])
    ap.add_argument("--out", default=None, help="append markdown rows here")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    stamp = datetime.date.today().isoformat()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    rows = []
    for s in args.seqs:
        shape = (1, args.heads, s, args.head_dim)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            t_flash = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        rows.append((s, "cuDNN SDPA bf16", t_cudnn, None, None, 1.0, None))
        rows.append((s, "flash SDPA bf16", t_flash, None, None, t_cudnn / t_flash, cossim(flash.float(), ref.float())))
        for m in args.methods:
            recipe = METHODS[m]
            out = fp4_attention(q, k, v, method=m, backend="triton")
            t_total = bench(lambda: fp4_attention(q, k, v, method=m, backend="triton"), rep=100)
            t_pre = None
            if recipe.quantized:
                t_pre = bench(lambda: prepass(q, k, v, recipe, None, work_dtype(q)), rep=100)
                qh, kh, vh = prepass(q, k, v, recipe, None, work_dtype(q))
            else:
                qh, kh, vh = q, k, v
            t_loop = bench(lambda: attention_prepared(qh, kh, vh, None, recipe=recipe, scale=args.head_dim**-0.5,
                                                      out_dtype=q.dtype), rep=100)
            rows.append((s, f"fp4video {m}", t_total, t_pre, t_loop, t_cudnn / t_total,
                         cossim(out.float(), ref.float())))
            print(f"  S={s} {m}: {t_total:.2f} ms", file=sys.stderr, flush=True)
            del qh, kh, vh
        del q, k, v, ref
        torch.cuda.empty_cache()
    header = f"{name}, {versions}, {stamp}, B=1 H={args.heads} D={args.head_dim}, bf16"
    lines = [f"### {header}", "", "| S | kernel | ms (total) | TFLOP/s | pre-pass ms | loop ms | × cuDNN | cosine to cuDNN |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s, what, t, pre, loop, ratio, cos in rows:
        flops = 4 * args.heads * s * s * args.head_dim
        lines.append(f"| {s} | {what} | {t:.2f} | {flops / t / 1e9:.0f} | {'' if pre is None else f'{pre:.2f}'} | "
                     f"{'' if loop is None else f'{loop:.2f}'} | "
                     f"{ratio:.2f} | {'(reference)' if cos is None else f'{cos:.5f}'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
