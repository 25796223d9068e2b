#!/usr/bin/env python3
"""Whole ``fp4_attention`` calls with the fp4video of one source tree (GPU): run once per tree, one
after another on the same machine, to compare revisions call for call — time, accuracy and bits.

    git archive 103f7f5 kernels fp4video | tar -x -C /tmp/base && ln -s ../kernels /tmp/base/fp4video/kernels
    python tools/time_source_trees.py /tmp/base mxattn-pv8,fp8
    python tools/time_source_trees.py . mxattn-pv8,fp8,fp8-nohad     # this checkout (its fp4video/kernels link)
    python tools/time_source_trees.py . all --shapes wan720,hunyuan720 --no-time   # digests only

For each shape and method: the median time (``triton.testing.do_bench``), the cosine to fp32 SDPA on
4 heads, and a digest of the output's and the LSE's bits (equal digests: equal bits, across trees and
processes on the same GPU); then SDPA's time in the same process. ``fp8-nohad``: ``fp8`` without its
Hadamard rotation; ``all``: every method. Shapes, bf16 random with a per-channel mean in K:
``wan720`` B=1, H=40, S=75,600, D=128; ``hunyuan720`` B=1, H=24, 118,800 video and 256 text tokens,
D=128, the last 200 text tokens masked (a key-padding mask, as HunyuanVideo's joint attention).
"""

import argparse
import os
import sys

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("root", help="a source tree holding fp4video/ (with its kernels)")
ap.add_argument("methods", help="comma-separated method names, or 'all'")
ap.add_argument("--shapes", default="wan720", help="comma-separated: wan720, hunyuan720")
ap.add_argument("--no-time", action="store_true", help="digests and cosines only")
args = ap.parse_args()
sys.path.insert(0, args.root)

import torch  # noqa: E402
import triton  # noqa: E402

from fp4video import METHODS, fp4_attention  # noqa: E402

SHAPES = {"wan720": (40, 75600, 0), "hunyuan720": (24, 118800 + 256, 200)}


def digest(t: torch.Tensor) -> str:
    """64 bits that change with any bit of ``t``: its words times fixed pseudo-random odd weights,
    summed modulo 2^64 (integer sums: independent of the reduction order)."""
    words = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).flatten().to(torch.int64)
    g = torch.Generator(device=t.device).manual_seed(1234)
    w = torch.randint(-(2**62), 2**62, words.shape, device=t.device, generator=g, dtype=torch.int64) | 1
    return f"{(words * w).sum().item() & (2**64 - 1):016x}"


tree = os.path.basename(os.path.abspath(args.root))
names = list(METHODS) if args.methods == "all" else args.methods.split(",")
for shape in args.shapes.split(","):
    h, s, padded = SHAPES[shape]
    torch.manual_seed(0)
    q = torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn(1, h, s, 128, device="cuda") + 2.0 * torch.randn(1, h, 1, 128, device="cuda")).bfloat16()
    v = torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16)
    mask = None
    if padded:
        mask = torch.ones(1, 1, 1, s, device="cuda", dtype=torch.bool)
        mask[..., s - padded:] = False
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :4].float(), k[:, :4].float(), v[:, :4].float(),
                                                           attn_mask=mask)
    for name in names:
        recipe = METHODS["fp8"].replace(hadamard=False) if name == "fp8-nohad" else name
        call = lambda: fp4_attention(q, k, v, method=recipe, attn_mask=mask, return_lse=True)  # noqa: E731
        out, lse = call()
        cos = torch.nn.functional.cosine_similarity(out[:, :4].float().flatten(), ref.flatten(), dim=0).item()
        ms = float("nan") if args.no_time else triton.testing.do_bench(call, warmup=200, rep=1000, return_mode="median")
        print(f"{tree} {shape} {name:18s} {ms:8.2f} ms  cos {cos:.5f}  out {digest(out)}  lse {digest(lse)}", flush=True)
        out = lse = None
    if not args.no_time:
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        print(f"{tree} {shape} sdpa {triton.testing.do_bench(sdpa, warmup=200, rep=1000, return_mode='median'):.2f} ms",
              flush=True)
    q = k = v = ref = mask = None
    torch.cuda.empty_cache()
