#!/usr/bin/env python3
"""How often MXFP4 values fall outside e4m3's exact window on the e4m3 kernel path.

The e4m3 path stores E2M1 × 2^e exactly while a block's scale is within 2^16 of the largest value
binade of its group (query row, key tile of K, V channel) and, for P̃, within 2^12 of the largest block
scale of its row in one key tile (the loop rounds P on f16 pairs, which puts the largest P̂ at 96).
This script measures, on the SageAttention3 harness's data (temperatures 1 and 4), an
outlier-channel variant and Gaussian inputs:

- Q̂, K̂, V̂: the fraction of elements where the e4m3 pre-pass differs from the reference's
  dequantized values (CPU: Triton interpreter);
- P̃: the fraction of nonzero P blocks below their tile's window and the share of the row's P̂
  mass they carry (from the reference's own online-softmax tiles).

    python tools/fp8_window_report.py [--p-window 12]       # CPU, about a minute
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from fp4video import METHODS  # noqa: E402
from fp4video.formats import mx_exponent  # noqa: E402
from fp4video.harness import sageattention3  # noqa: E402
from fp4video.reference import KEY_TILE, prepare_qkv, quantize_p  # noqa: E402

P_WINDOW = 12  # block scales more than 2^12 below the tile's largest lose bits in e4m3


def datasets():
    x = sageattention3.make_inputs(0)
    yield "SageAttention3 harness, t = 1", x.q, x.k, x.v
    yield "SageAttention3 harness, t = 4", 4 * x.q, x.k, x.v
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1024, 128, generator=g, dtype=torch.float64) for _ in range(3))
    k[:, :4] *= 30.0  # a few outlier channels, as in activations with massive channels
    yield "outlier channels (4 of 128 ×30)", q, k, v
    yield "Gaussian", *(torch.randn(1024, 128, generator=g, dtype=torch.float64) for _ in range(3))


def p_window(qh, kh, recipe, scale, window=P_WINDOW):
    s = (qh @ kh.T) * scale
    m = torch.full((s.shape[0],), float("-inf"), dtype=s.dtype)
    blocks = outside = 0
    mass = mass_out = 0.0
    for j in range(0, s.shape[1], KEY_TILE):
        t = s[:, j: j + KEY_TILE]
        m = torch.maximum(m, t.amax(-1))
        p = torch.exp(t - m[:, None]).float()
        amax = p.view(p.shape[0], -1, 32).amax(-1)
        e = mx_exponent(amax, recipe.scale_rule)
        live = amax > 0
        e_tile = torch.where(live, e, -10**6).amax(-1, keepdim=True)
        out = live & (e < e_tile - window)
        p_hat = quantize_p(p, recipe).view(p.shape[0], -1, 32).sum(-1)
        blocks += int(live.sum())
        outside += int(out.sum())
        mass += float(p_hat.sum())
        mass_out += float(p_hat[out].sum())
    return outside / blocks, mass_out / mass


def main(argv=None) -> int:
    import argparse

    from fp4video.kernels.key_order import v8t_key_order
    from fp4video.kernels.prepass import prepass_fp8

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p-window", type=int, default=P_WINDOW, help="binades of P's window (12)")
    args = ap.parse_args(argv)

    print(f"| data | method | Q̂ K̂ V̂ elements off the reference | P blocks outside the 2^{args.p_window} window "
          "| their share of P̂ mass |")
    print("| --- | --- | --- | --- | --- |")
    for name, q, k, v in datasets():
        for method in ("mxattn", "mxfp4-ocp"):
            recipe = METHODS[method]
            qb, kb, vb = (t.float()[None, None] for t in (q, k, v))
            rq, rk, rv = prepare_qkv(qb, kb, vb, recipe)
            ops = prepass_fp8(qb, kb, vb, recipe, None)
            n = q.shape[0]
            k_fac = ops.k_fac.repeat_interleave(KEY_TILE, dim=-1)[..., :n]  # one factor per key tile
            v8t = ops.v8t[..., v8t_key_order(ops.v8t.shape[-1]).argsort()]  # V̂ᵀ's tokens back in order
            got = (ops.q8.float() * ops.q_fac[..., None], ops.k8.float() * k_fac[..., None],
                   v8t.float().transpose(-1, -2)[..., :n, :] * ops.v_fac[..., None, :])
            off = sum(int((g[..., :n, :128] != r[..., :n, :128]).sum()) for g, r in zip(got, (rq, rk, rv)))
            frac_blocks, frac_mass = p_window(rq[0, 0, :n].double(), rk[0, 0, :n].double(), recipe, 128**-0.5, args.p_window)
            print(f"| {name} | {method} | {off / (3 * n * 128):.2e} | {frac_blocks:.2e} | {frac_mass:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
