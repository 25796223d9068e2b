#!/usr/bin/env python3
"""Lab: the e4m3 loop with a wider key tile (BLOCK_N 256 instead of the shipped 128).

FlashAttention-3 FP8 runs 128 query rows against 224 keys a step; fp4video's e4m3 loop runs 64
rows against 128. The costs paid once a key tile (the accumulator's rescale-and-add, the row
statistics, the loop's bookkeeping) halve per element of S at 256 keys. Two parts:

    python tools/e4m3_wide_tile_experiment.py offline   # SASS per element of S, registers, shared memory
    python tools/e4m3_wide_tile_experiment.py speed --seq 75600 --methods mxattn-pv8 fp8 mxattn   # GPU

``offline`` compiles the shipped kernel (``loop_e4m3.KERNEL``) for sm_90 without a GPU at each
(BLOCK_N, BLOCK_M, warps, stages). ``speed`` times, beside cuDNN SDPA and the shipped launch in
the same process, the same kernel at 256 keys on e4m3 operands re-padded to whole 256-key tiles,
with K̂'s factor taken from every other 128-key tile: what is timed is the schedule, not the
values (a 256-key tile would need its own key order and P shift per 256 keys in the reference).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

#: (BLOCK_N, BLOCK_M, warps, stages[, maxnreg]); the shipped launch first
CONFIGS = [(128, 64, 4, 2), (256, 64, 4, 1), (256, 64, 4, 2), (256, 128, 8, 2), (256, 128, 8, 1)]


def offline(args) -> int:
    import triton
    from count_loop_instructions import WAN_480P_INTS
    from offline_compile import compile_kernel

    from fp4video.formats import ScaleRule
    from fp4video.kernels.loop_e4m3 import KERNEL, TILE_EXP_FLOOR
    from fp4video.kernels.offline import ptxas_report, sass_mma_loop

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    print(f"Triton {triton.__version__}, sm_90, e4m3 loop ({'P in E4M3' if args.pv8 else 'P in FP4'}), head dim 128")
    print("| BLOCK_N × BLOCK_M × warps × stages | SASS / element of S | registers, spill bytes | shared memory | "
          "largest opcodes per element |\n| --- | --- | --- | --- | --- |")
    for bn, bm, warps, stages in CONFIGS:
        ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "K8": f"tensordesc<fp8e4nv[{bn}, 128]>", "KFac": "*fp32",
               "V8T": f"tensordesc<fp8e4nv[128, {bn}]>", "VFac": "*fp32", "KeyMask": "*i8", "Out": "*bf16",
               "Lse": "*fp32"}
        consts = dict(HAS_MASK=False, OCP=False, QMAX=ScaleRule.UOS.qmax, PNQ=True, D=128, BLOCK_DV=128,
                      BLOCK_M=bm, BLOCK_N=bn, QB=32, EXP_FLOOR=TILE_EXP_FLOOR, TMA=True, K_TILE_ORDER=True,
                      ASM=True, FRESH_PV=True, P_E4M3=args.pv8)
        kernel = compile_kernel(KERNEL, consts, ptr, dict(WAN_480P_INTS), arch=90, floats=("scale_log2",),
                                num_warps=warps, num_stages=stages, enable_fp_fusion=False)
        with tempfile.TemporaryDirectory() as tmp:
            loop, _ = sass_mma_loop(kernel, nvdisasm, tmp)
            report = ptxas_report(kernel.asm["ptx"], os.path.dirname(nvdisasm), tmp)
        per_thread = bm * bn / (warps * 32)
        units = collections.Counter()
        for op, n in loop.items():
            units[op.split(".")[0]] += n
        top = ", ".join(f"{op} {n / per_thread:.2f}" for op, n in units.most_common(6))
        regs = f"{report[0]}, {report[1]}" if report else "no ptxas"
        print(f"| {bn} × {bm} × {warps} × {stages} | {sum(loop.values()) / per_thread:.2f} | {regs} | "
              f"{kernel.metadata.shared} | {top} |", flush=True)
    return 0


def speed(args) -> int:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp4video import METHODS
    from fp4video.formats import Format, ScaleRule
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.key_order import LANE_BLOCK
    from fp4video.kernels.loop_e4m3 import KERNEL, TILE_EXP_FLOOR, attention_e4m3
    from fp4video.kernels.tiles import LOG2E, key_mask, outputs
    from fp4video.recipe import RowSum

    s, h = args.seq, args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    k = k + 0.5 * torch.randn(1, h, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # a K mean
    bench = lambda fn: triton.testing.do_bench(fn, warmup=100, rep=args.rep_ms, return_mode="median")  # noqa: E731
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; B=1 H={h} "
          f"S={s} D=128; cuDNN SDPA {t_ref:.2f} ms\n")
    print("| method | BLOCK_N × BLOCK_M × warps × stages | loop ms | × cuDNN |\n| --- | --- | --- | --- |")

    def wide_launch(tensors, recipe, bn, bm, warps, stages):
        q8, q_fac, k8, k_fac, v8t, v_fac = tensors[:6]
        b, hh, sq, d = q8.shape
        dvp, sk_pad = v8t.shape[-2], -(-s // bn) * bn
        k8w = torch.zeros(b, hh, sk_pad, d, device="cuda", dtype=k8.dtype)
        k8w[:, :, :k8.shape[2]] = k8
        v8w = torch.zeros(b, hh, dvp, sk_pad, device="cuda", dtype=v8t.dtype)
        v8w[..., :v8t.shape[-1]] = v8t
        kf = k_fac[..., ::bn // 128].contiguous()  # one factor per 256 keys: the schedule, not the values
        out, lse = outputs(q8.shape, 128, q8.device, torch.bfloat16)
        km = key_mask(None, q8.device)
        kt = TensorDescriptor.from_tensor(k8w.reshape(b * hh * sk_pad, d), [bn, d])
        vt = TensorDescriptor.from_tensor(v8w.reshape(b * hh * dvp, sk_pad), [dvp, bn])

        def run():
            KERNEL[(triton.cdiv(sq, bm), b * hh)](
                q8, q_fac, kt, kf, vt, v_fac, km, out, lse, hh, sq, s, 128,
                *q8.stride()[:3], *k8w.stride()[:3], *v8w.stride()[:3], km.stride(0), km.stride(1), sk_pad,
                *out.stride(), *lse.stride(), 128 ** -0.5 * LOG2E,
                HAS_MASK=False, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
                PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d, BLOCK_DV=dvp, BLOCK_M=bm, BLOCK_N=bn, QB=LANE_BLOCK,
                EXP_FLOOR=TILE_EXP_FLOOR, TMA=True, K_TILE_ORDER=True, P_E4M3=recipe.pv_format is Format.E4M3,
                ASM=True, FRESH_PV=True, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
            return out

        return run

    for m in args.methods:
        recipe = METHODS[m]
        path, tensors = prepare(q, k, v, recipe, None)
        if path != "fp8":
            print(f"| {m} | runs the {path!r} loop, not the e4m3 one | | |")
            continue
        for cfg in CONFIGS:
            if cfg == CONFIGS[0]:  # the shipped launch, as the dispatch calls it
                run = lambda: attention_e4m3(*tensors, None, recipe=recipe, scale=128 ** -0.5,  # noqa: E731
                                             out_dtype=q.dtype, dv=128)
            else:
                run = wide_launch(tensors, recipe, *cfg)
            try:
                run()
                t = bench(run)
            except Exception as e:  # out of shared memory / registers: report and go on
                print(f"| {m} | {' × '.join(map(str, cfg))} | failed: {type(e).__name__}: {str(e)[:80]} | |")
                continue
            print(f"| {m} | {' × '.join(map(str, cfg))} | {t:.2f} | {t_ref / t:.3f} |", flush=True)
        del tensors
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    off = sub.add_parser("offline", help="compile for sm_90 without a GPU: instructions per element, registers")
    off.add_argument("--fp4-p", dest="pv8", action="store_false", help="P in FP4 (mxattn) instead of E4M3")
    sp = sub.add_parser("speed", help="time the launches on the GPU beside cuDNN SDPA")
    sp.add_argument("--seq", type=int, default=75600)
    sp.add_argument("--heads", type=int, default=40)
    sp.add_argument("--methods", nargs="+", default=["mxattn-pv8", "fp8", "mxattn"])
    sp.add_argument("--rep-ms", type=int, default=1500)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return offline(args) if args.part == "offline" else speed(args)


if __name__ == "__main__":
    sys.exit(main())
