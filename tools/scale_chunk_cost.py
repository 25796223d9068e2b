#!/usr/bin/env python3
"""What the block scales' chunk layout costs a call on datacenter Blackwell, measured on this GPU.

On sm_100 the dot_scaled loop reads K̂'s and V̂ᵀ's block scales by TMA from per-call copies in the
layout tensor memory takes them in (:func:`fp4video.kernels.loop_scaled.chunked_scales`). This
times that copy (medians of CUDA-event timings) beside the packed pre-pass it follows
(:func:`fp4video.kernels.prepass.prepass_packed`), per method and sequence length, B = 1, D = 128,
bf16 inputs. Any CUDA GPU runs it (the copy is torch's, the pre-pass Triton's); markdown to stdout
(docs/history.md keeps its runs).

    python tools/scale_chunk_cost.py --seqs 32760 75600 --heads 40 --methods mxattn sage3 mxattn-pv8
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _median_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32760, 75600])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--methods", nargs="+", default=["mxattn", "sage3", "mxattn-pv8"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from fp4video.formats import Format
    from fp4video.kernels.loop_scaled import chunked_scales
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.recipe import METHODS

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B=1 H={args.heads} D=128, bf16\n")
    print("| method | S | pre-pass ms | scale chunks ms | chunks / pre-pass | chunk bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for method in args.methods:
        recipe = METHODS[method]
        nv, pv8 = recipe.qk_format is Format.NVFP4, recipe.pv_format is Format.E4M3
        qb = 16 if nv else 32
        for s in args.seqs:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(1, args.heads, s, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
            ops = prepass_packed(q, k, v, recipe, None)
            k4, ks, v4t = ops.k4, ops.k_scale, ops.v
            vs = ops.v_fac if pv8 else ops.v_scale
            sk_pad = v4t.shape[-1] if pv8 else -(-s // 128) * 128 if nv else v4t.shape[-1] * 2
            t_pre = _median_ms(lambda: prepass_packed(q, k, v, recipe, None))
            t_chunk = _median_ms(lambda: chunked_scales(nv, pv8, 128, qb, sk_pad, k4, ks, v4t, vs))
            kc, vc = chunked_scales(nv, pv8, 128, qb, sk_pad, k4, ks, v4t, vs)
            nbytes = kc.numel() + (0 if vc is None else vc.numel())
            print(f"| {method} | {s} | {t_pre:.3f} | {t_chunk:.3f} | {t_chunk / t_pre:.2f} | {nbytes / 1e6:.1f} MB |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
