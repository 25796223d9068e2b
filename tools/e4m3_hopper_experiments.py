#!/usr/bin/env python3
"""Two e4m3-loop experiments on Hopper (GPU), each against the Triton e4m3 TMA loop on the same
pre-pass output, cuDNN SDPA timed in the same process:

- ``--part gluon``: :mod:`fp4video.kernels.loop_e4m3_sm90`, a Gluon loop of two 64-row warpgroups
  per CTA sharing TMA-loaded K̂ / V̂ᵀ tiles, FlashAttention-3-style overlap; schedules ``early``
  (tile j's Q̂·K̂ᵀ with tile j-1's P̂·V̂, tile j's softmax under P̂·V̂), ``late`` (P̂ to its MMA in
  the step that made it), ping-pong, fresh accumulators, 3 buffers;
- ``--part mma-sum``: PNQ's row sums of P̂ on the tensor cores (P̂ · ones, ``mma_sum=True``),
  uncapped or at 168 registers (three programs per SM).

Correctness: bit-equality / worst-row cosine / LSE against the Triton loop on small shapes
(masked, partial tiles), then the loop's time at each length.

    python tools/e4m3_hopper_experiments.py --part gluon --methods fp8 mxattn-pv8 --variants early late
    python tools/e4m3_hopper_experiments.py --part mma-sum --methods fp8 mxattn-pv8 mxattn
"""

from __future__ import annotations

import argparse

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4video import METHODS
from fp4video.kernels.dispatch import prepare
from fp4video.kernels.loop_e4m3 import attention_e4m3

GLUON = {"early": dict(late=False), "early-fresh": dict(late=False, fresh_pv=True),
         "early-no-overlap": dict(late=False, overlap=False), "early-pp": dict(late=False, ping_pong=True),
         "early-3buf": dict(late=False, num_buffers=3), "late": dict(), "late-fresh": dict(fresh_pv=True),
         "late-pp": dict(ping_pong=True), "late-sync": dict(sync=True),
         "late-pvu": dict(pv_under_softmax=True), "late-pvu-pp": dict(pv_under_softmax=True, ping_pong=True)}
MMA_SUM = {"mma-sum": dict(mma_sum=True), "mma-sum-168": dict(mma_sum=True, max_registers=168)}
SCALE = 128 ** -0.5


def row_cosines(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(0, -2), b.float().flatten(0, -2), dim=-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["gluon", "mma-sum"], required=True)
    ap.add_argument("--methods", nargs="+", default=["fp8", "mxattn-pv8"])
    ap.add_argument("--variants", nargs="+", help="default: all of the part's")
    ap.add_argument("--seqs", nargs="+", type=int, default=[75600])
    ap.add_argument("--heads", type=int, default=40)
    a = ap.parse_args(argv)
    table = GLUON if a.part == "gluon" else MMA_SUM
    variants = {n: table[n] for n in (a.variants or table)}
    if a.part == "gluon":
        from fp4video.kernels.loop_e4m3_sm90 import attention_e4m3_sm90

        def run(t, ka, r, kw):
            return attention_e4m3_sm90(*t[:-2], t[-2], ka, recipe=r, scale=SCALE, out_dtype=torch.bfloat16, dv=128, **kw)
    else:
        def run(t, ka, r, kw):
            return attention_e4m3(*t, ka, recipe=r, scale=SCALE, out_dtype=torch.bfloat16, dv=128, tma=True, **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    print("== correctness (against the Triton TMA loop; the in-place Gluon forms against its fresh_pv=False form)")
    for m in a.methods:
        r = METHODS[m]
        for s, masked in [(1000, False), (300, True), (4096, False), (77, False)]:
            q, k, v = (torch.randn(2, 2, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            q[:, :, :5] *= 8  # sharp rows
            k = k + 0.5
            ka = None
            if masked:
                ka = torch.ones(2, s, dtype=torch.bool, device="cuda")
                ka[0, s - 37:] = False
                ka[1, :50] = False
            _, t = prepare(q, k, v, r, ka)
            fresh, lse_ref = attention_e4m3(*t, ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True)
            in_place, _ = attention_e4m3(*t, ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True,
                                         fresh_pv=False)
            for name, kw in variants.items():
                out, lse = run(t, ka, r, kw)
                base = in_place if a.part == "gluon" and not kw.get("fresh_pv") else fresh
                c = row_cosines(out, base)
                rel = ((out.float() - base.float()).norm() / base.float().norm()).item()
                print(f"{m} S={s} mask={masked} {name}: finite {out.isfinite().all().item()} bit-equal "
                      f"{torch.equal(out, base)} rel-L2 {rel:.2e} worst-row cosine {c.min().item():.6f} rows below "
                      f"0.9999 {(c < 0.9999).float().mean().item():.4f} LSE max diff {(lse - lse_ref).abs().max().item():.3g}",
                      flush=True)
    bench = lambda f: triton.testing.do_bench(f, warmup=30, rep=800, return_mode="median")
    print(f"== speed (B=1, H={a.heads}, D=128, the loop alone)")
    for s in a.seqs:
        q, k, v = (torch.randn(1, a.heads, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"S={s}: cuDNN SDPA {t_cudnn:.2f} ms", flush=True)
        for m in a.methods:
            r = METHODS[m]
            _, t = prepare(q, k, v, r, None)
            t_pre = bench(lambda: prepare(q, k, v, r, None))
            t_loop = bench(lambda: attention_e4m3(*t, None, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True))
            print(f"  {m}: pre-pass {t_pre:.2f} ms, Triton loop {t_loop:.2f} ms ({t_cudnn / t_loop:.3f}× cuDNN, "
                  f"{t_cudnn / (t_loop + t_pre):.3f}× with the pre-pass)", flush=True)
            for name, kw in variants.items():
                tv = bench(lambda: run(t, None, r, kw))
                print(f"  {m} {name}: {tv:.2f} ms ({t_cudnn / tv:.3f}× cuDNN, {t_cudnn / (tv + t_pre):.3f}× with the "
                      f"pre-pass, {t_loop / tv:.3f}× the Triton loop)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
