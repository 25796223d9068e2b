#!/usr/bin/env python3
"""Whole ``fp4_attention`` calls at Wan 720p with the fp4video of one source tree (GPU): run once
per tree, one after another on the same machine, to compare revisions call for call.

    git archive 103f7f5 kernels fp4video | tar -x -C /tmp/base && ln -s ../kernels /tmp/base/fp4video/kernels
    python tools/time_source_trees.py /tmp/base mxattn-pv8,fp8
    python tools/time_source_trees.py . mxattn-pv8,fp8,fp8-nohad     # this checkout (its fp4video/kernels link)

Prints each method's median time (``triton.testing.do_bench``) and cosine to fp32 SDPA on 4 heads,
then SDPA's time in the same process. ``fp8-nohad``: ``fp8`` without its Hadamard rotation.
Inputs: B=1, H=40, S=75,600, D=128, bf16 random, K with a per-channel mean.
"""

import os
import sys

root = sys.argv[1]
sys.path.insert(0, root)

import torch  # noqa: E402
import triton  # noqa: E402

from fp4video import METHODS, fp4_attention  # noqa: E402

torch.manual_seed(0)
B, H, S, D = 1, 40, 75600, 128
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
k = (torch.randn(B, H, S, D, device="cuda") + 2.0 * torch.randn(B, H, 1, D, device="cuda")).bfloat16()
v = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
ref = torch.nn.functional.scaled_dot_product_attention(q[:, :4].float(), k[:, :4].float(), v[:, :4].float())
tree = os.path.basename(os.path.abspath(root))
for name in sys.argv[2].split(","):
    recipe = METHODS["fp8"].replace(hadamard=False) if name == "fp8-nohad" else name
    call = lambda: fp4_attention(q, k, v, method=recipe)  # noqa: E731
    out = call()
    cos = torch.nn.functional.cosine_similarity(out[:, :4].float().flatten(), ref.flatten(), dim=0).item()
    ms = triton.testing.do_bench(call, warmup=200, rep=1000, return_mode="median")
    print(f"{tree} {name:10s} {ms:8.2f} ms  cos {cos:.5f}", flush=True)
sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
print(f"{tree} sdpa {triton.testing.do_bench(sdpa, warmup=200, rep=1000, return_mode='median'):.2f} ms", flush=True)
