#!/usr/bin/env python3
"""Instructions per element of S in the e4m3 MXFP4 attention loop, read from its sm_90 PTX,
compiled offline (no GPU needed): the ALU budget BENCHMARKS.md discusses.

    python scripts/count_loop_instructions.py [--no-quantize-p] [--ocp]

Compiles ``_mx_fp8_attn_fwd`` as it is launched on Hopper (BLOCK_M 128, 8 warps, 3 stages, no FMA
contraction, head dim 128, no mask), takes the largest basic block of the PTX (the main loop over
full key tiles) and divides its instruction count by the elements of S each thread owns
(128 × 128 / 256 = 64). Counts are per thread, so per element of S.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-quantize-p", action="store_true", help="the floor variant: P only cast to e4m3")
    ap.add_argument("--ocp", action="store_true", help="OCP scale rule instead of UOS")
    ap.add_argument("--precise", action="store_true", help="max_num_imprecise_acc=32 on both MMAs (PRECISE_QK/PV)")
    ap.add_argument("--top", type=int, default=14, help="opcodes to list")
    args = ap.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4video.kernels.attention_fwd import TILE_EXP_FLOOR, _mx_fp8_attn_fwd as fn

    names = fn.arg_names
    ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "K8": "*fp8e4nv", "KFac": "*fp32", "V8T": "*fp8e4nv", "VFac": "*fp32",
           "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
    consts = dict(HAS_MASK=False, OCP=args.ocp, QMAX=7.25, PNQ=True, D=128, BLOCK_DV=128, BLOCK_M=128, BLOCK_N=128,
                  QB=32, EXP_FLOOR=TILE_EXP_FLOOR, QUANTIZE_P=not args.no_quantize_p,
                  PRECISE_QK=args.precise, PRECISE_PV=args.precise)
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
    # as Triton specializes a Wan-480p launch (S = 32,760, H = 40): pointers, and every stride that
    # is a multiple of 16 there, are marked 16-divisible
    aligned = [n for n in names if sig[n].startswith("*") or n in (
        "sqb", "sqh", "sqs", "skb", "skh", "sks", "svb", "svh", "svd", "sob", "soh", "sos", "slb", "SK_PAD")]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=8, num_stages=3, enable_fp_fusion=False)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    blocks = re.split(r"\n\$L__BB\d+_\d+:", ptx)[1:]
    counts = []
    for body in blocks:
        ops = collections.Counter()
        for line in body.splitlines():
            line = line.strip()
            if not line or line.startswith(("//", "{", "}", ".", "$")):
                continue
            if line.startswith("@"):
                line = line.split(None, 1)[1]
            ops[line.split()[0].rstrip(";")] += 1
        counts.append(ops)
    # the main loop: the largest block that issues the MMAs and loads its tiles asynchronously
    loop = max((c for c in counts if c["cp.async.cg.shared.global"] and any(k.startswith("wgmma.mma") for k in c)),
               key=lambda c: sum(c.values()))
    per_thread = 128 * 128 // (8 * 32)
    print(f"Triton {triton.__version__}, sm_90, main loop: {sum(loop.values())} instructions per thread per key "
          f"tile = {sum(loop.values()) / per_thread:.1f} per element of S")
    for op, n in loop.most_common(args.top):
        print(f"  {n / per_thread:5.2f}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
