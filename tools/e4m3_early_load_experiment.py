#!/usr/bin/env python3
"""The e4m3 loop with its loads issued a step ahead (``tools/e4m3_early_load_kernel.py``, an
experiment) against the shipped Triton loop on the same pre-pass output:

    python tools/e4m3_early_load_experiment.py offline [--early 0|1|2|3] [--mask]   # no GPU: SASS per element, registers
    python tools/e4m3_early_load_experiment.py check                       # GPU: bit equality, per row
    python tools/e4m3_early_load_experiment.py speed [--seqs 75600]        # GPU: the loop alone beside cuDNN

``offline`` compiles the kernel for sm_90 (three CTAs an SM: at most 168 registers) and prints its
key loop's SASS instructions per element of S, where in the loop the TMA copies and the K̂ factor
load sit, and ptxas's registers and spills. ``check`` compares outputs and LSE with the shipped loop
on small shapes (masks, partial tiles, sharp rows, a V outlier channel). ``speed`` times, in one
process, cuDNN SDPA, the shipped loop and this kernel with the loads early and late (the shipped
order), at Wan sizes (B = 1, H = 40, D = 128), twice each in alternation.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

SCALE = 128 ** -0.5


def offline(a) -> int:
    import triton
    from count_loop_instructions import WAN_480P_INTS
    from offline_compile import compile_kernel
    from triton.experimental.gluon import language as gl

    from e4m3_early_load_kernel import KERNEL
    from fp4video.kernels.loop_e4m3 import TILE_EXP_FLOOR, TMA_REGISTER_BUDGET
    from fp4video.kernels.offline import ptxas_report, sass_mma_loop

    desc = f"tensordesc<fp8e4nv[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)!r}>"
    ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "Kd": desc, "KFac": "*fp32", "Vd": desc, "VFac": "*fp32",
           "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
    consts = dict(HAS_MASK=a.mask, OCP=False, QMAX=7.25, PNQ=True, P_E4M3=True, D=128, BLOCK_DV=128, BLOCK_N=128,
                  EXP_FLOOR=TILE_EXP_FLOOR, EARLY=a.early)
    kernel = compile_kernel(KERNEL, consts, ptr, dict(WAN_480P_INTS, smb=32760 if a.mask else 1), arch=90,
                            floats=("scale_log2",), gluon=True, num_warps=4, enable_fp_fusion=False,
                            maxnreg=TMA_REGISTER_BUDGET)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        loop, body = sass_mma_loop(kernel, nvdisasm, tmp)
        report = ptxas_report(kernel.asm["ptx"], os.path.dirname(nvdisasm), tmp)
    units = collections.Counter()
    for op, n in loop.items():
        units[op.split(".")[0]] += n
    print(f"Triton {triton.__version__}, sm_90, EARLY={a.early}{', masked' if a.mask else ''}: "
          f"{sum(loop.values()) / 64:.2f} SASS instructions per element of S; ptxas (registers, spill bytes, "
          f"serialization codes) {report}; {kernel.metadata.shared} bytes of shared memory")
    print("  " + ", ".join(f"{op} {n / 64:.2f}" for op, n in units.most_common(12)))
    insns = [ln for ln in body if re.match(r"\s*/\*[0-9a-f]+\*/\s+\S", ln)]
    where = [f"{i}: {ln.split(';')[0].split('*/')[-1].strip()}" for i, ln in enumerate(insns)
             if re.search(r"UTMALDG|LDG|LDGSTS|SYNCS|QGMMA.*gsb0|WARPGROUP.DEPBAR|BAR.SYNC", ln)]
    print(f"  the loop's {len(insns)} instructions; loads, waits and barriers at:\n    " + "\n    ".join(where))
    return 0


def _inputs(s, g, heads=3, batch=2):
    import torch

    q, k, v = (torch.randn(batch, heads, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q[:, :, :5] *= 8  # sharp rows
    k = k + 0.5
    v[:, :, :, 7] *= 30  # an outlier channel
    return q, k, v


def check(a) -> int:
    import torch

    from e4m3_early_load_kernel import attention_e4m3_early
    from fp4video import METHODS
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(1000, False), (300, True), (4096, False), (77, False), (128, False), (2048, True), (5000, False)]
    bad = 0
    for m in a.methods:
        r = METHODS[m]
        for s, masked in cases:
            q, k, v = _inputs(s, g)
            ka = None
            if masked:
                ka = torch.ones(2, s, dtype=torch.bool, device="cuda")
                ka[0, s - 37:] = False
                ka[1, :50] = False
            _, t = prepare(q, k, v, r, ka)
            o0, l0 = attention_e4m3(*t, ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True)
            for early in (3, 1, 0):
                o = torch.full_like(o0, float("nan"))  # poisoned: a row left unwritten shows
                o, lse = attention_e4m3_early(*t[:-1], ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128,
                                              early=early)
                x, y = o.float().flatten(0, 2), o0.float().flatten(0, 2)
                cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
                same = torch.equal(o, o0) and torch.equal(lse, l0)
                rows_diff = ((x != y).any(-1) | (lse.flatten() != l0.flatten())).sum().item()
                bad += not same
                print(f"{m} S={s} mask={masked} EARLY={early}: bit-equal {same}; rows differing "
                      f"{rows_diff}/{x.shape[0]}; finite {o.isfinite().all().item()}; worst-row cosine "
                      f"{cos.min().item():.6f}", flush=True)
    print(f"{bad} runs differ from the shipped loop")
    return 0


def speed(a) -> int:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from e4m3_early_load_kernel import attention_e4m3_early
    from fp4video import METHODS
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3

    def bench(f):
        return triton.testing.do_bench(f, warmup=50, rep=a.rep_ms, return_mode="median")

    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    for s in a.seqs:
        q, k, v = (torch.randn(1, 40, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        k = k + 0.5 * torch.randn(1, 40, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # a K mean
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"\nS={s}, H=40: cuDNN SDPA {t_cudnn:.2f} ms\n\n| method | loop | ms (two runs) | × cuDNN | × shipped |"
              "\n| --- | --- | --- | --- | --- |", flush=True)
        for m in a.methods:
            r = METHODS[m]
            _, t = prepare(q, k, v, r, None)
            runs = {"shipped (Triton)": lambda: attention_e4m3(*t, None, recipe=r, scale=SCALE, out_dtype=q.dtype,
                                                               dv=128, tma=True),
                    **{f"Gluon, EARLY={e}": (lambda e=e: attention_e4m3_early(*t[:-1], None, recipe=r, scale=SCALE,
                                                                             out_dtype=q.dtype, dv=128, early=e))
                       for e in (3, 1, 0)}}
            times = collections.defaultdict(list)
            for _ in range(2):
                for name, fn in runs.items():
                    times[name].append(bench(fn))
            base = min(times["shipped (Triton)"])
            for name, ts in times.items():
                print(f"| {m} | {name} | {ts[0]:.2f} / {ts[1]:.2f} | {t_cudnn / min(ts):.3f} | {base / min(ts):.3f} |",
                      flush=True)
            del t
        del q, k, v
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["offline", "check", "speed"])
    ap.add_argument("--methods", nargs="+", default=["mxattn-pv8", "fp8"])
    ap.add_argument("--seqs", nargs="+", type=int, default=[75600])
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--early", type=int, default=1, choices=[0, 1, 2, 3],
                    help="offline: 1 TMA at the step's top, K̂ factor at its end; 2 both at the top; 3 tile j+2's TMA at "
                         "step j's end; 0 both at the end")
    ap.add_argument("--mask", action="store_true", help="offline: with a key-padding mask")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return {"offline": offline, "check": check, "speed": speed}[a.part](a)


if __name__ == "__main__":
    sys.exit(main())
