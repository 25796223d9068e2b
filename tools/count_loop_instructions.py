#!/usr/bin/env python3
"""Instructions per element of S in the attention loops, read from their sm_90 code, compiled
offline (no GPU needed): the ALU budget docs/history.md discusses.

    python tools/count_loop_instructions.py [--ocp] [--pointer-loads] [--mask] [--pv-into-acc] [--max-registers N] [--pv8]
    python tools/count_loop_instructions.py --kernel nvfp4 [--no-two-level | --pv8]
    python tools/count_loop_instructions.py --kernel nvfp4-sm90 [--no-two-level]

Compiles ``_e4m3_attn_fwd`` (the e4m3 MXFP4 loop), ``_nv_attn_fwd`` (the bf16 NVFP4 loop) or
``_nv_attn_fwd_sm90`` (the ping-pong Gluon NVFP4 loop: one warpgroup's partition is counted) as
it is launched on Hopper (its ``LAUNCH``: 128 rows and 8 warps, or for the e4m3 loop 64 rows and
4 warps, K̂/V̂ᵀ tiles by TMA, P rounded on f16 pairs, P̂·V̂ in a fresh accumulator, with a mask
at most 168 registers; its stages, no FMA contraction, head dim 128, no mask unless asked),
disassembles the cubin with the
nvdisasm that ships with Triton and takes the main loop: the code from the label that a later
conditional branch jumps back to, up to that branch, containing the MMAs. Its instruction count
divided by the elements of S each thread owns per key tile (128 × 128 / 256 = 64 × 128 / 128 =
64) is the count per element. Also prints the PTX count of the same loop body (what Triton
emits, before ptxas) and ptxas's register and spill report, and whether ptxas serialized the
MMAs (its warnings C7512 / C7513: each MMA then waits for the previous one).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile

PER_THREAD = 64  # elements of one tile of S per thread: 128 × 128 over 8 warps, or 64 × 128 over 4

#: the integer arguments of a Wan-480p launch (B = 1, H = 40, S = 32,760, D = 128; K̂/V̂ᵀ padded to
#: 32,768 keys, no mask: a 1 × 1 dummy), by name across the kernels compiled here
_S, _SP = 32760, 32768
WAN_480P_INTS = dict(H=40, SQ=_S, SK=_S, SK_PAD=_SP, DV=128, sqb=40 * _S * 128, sqh=_S * 128, sqs=128,
                     skb=40 * _SP * 128, skh=_SP * 128, sks=128, svb=40 * 128 * _SP, svh=128 * _SP, svs=128,
                     svd=_SP, smb=1, sms=1, sob=40 * _S * 128, soh=_S * 128, sos=128, sod=1,
                     slb=40 * _S, slh=_S, sls=1)


def compile_loop_kernel(args):
    from offline_compile import compile_kernel

    from fp4video.formats import ScaleRule
    from fp4video.reference import TWO_LEVEL_P_RANGE

    gluon = False
    if args.kernel == "nvfp4":
        from fp4video.kernels.loop_nvfp4 import LAUNCH, KERNEL as fn

        ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
        consts = dict(HAS_MASK=False, TWO_LEVEL=not args.no_two_level, P_RANGE=TWO_LEVEL_P_RANGE, PNQ=False,
                      IEEE=False, FAST_RCP=True, HW_E4M3=True, D=128, BLOCK_DV=128, DV_PAD=False, BLOCK_M=128, BLOCK_N=128,
                      P_E4M3=args.pv8)
        stages, warps, max_registers = LAUNCH.num_stages, LAUNCH.num_warps, None
    elif args.kernel == "nvfp4-sm90":
        from triton.experimental.gluon import language as gl

        from fp4video.kernels.loop_nvfp4_sm90 import CONSUMER_REGS, NUM_BUFFERS, KERNEL as fn

        gluon = True
        desc = f"tensordesc<bf16[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)!r}>"
        ptr = {"Q": "*bf16", "Kd": desc, "Vd": desc, "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
        consts = dict(HAS_MASK=False, TWO_LEVEL=not args.no_two_level, P_RANGE=TWO_LEVEL_P_RANGE, PNQ=False,
                      D=128, BLOCK_DV=128, BLOCK_M=128, BLOCK_N=128, NUM_BUF=NUM_BUFFERS,
                      CONSUMER_REGS=CONSUMER_REGS)
        stages, warps, max_registers = 1, 4, None  # its own buffering; one warpgroup here, the other in a partition
    else:
        from fp4video.kernels.loop_e4m3 import (POINTER_LAUNCH, TILE_EXP_FLOOR, TMA_LAUNCH, TMA_REGISTER_BUDGET,
                                                KERNEL as fn)

        tma = not args.pointer_loads
        ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "K8": "*fp8e4nv", "KFac": "*fp32", "V8T": "*fp8e4nv",
               "VFac": "*fp32", "KeyMask": "*i8", "KIdx": "*i32", "KCnt": "*i32", "Out": "*bf16", "Lse": "*fp32"}
        if tma:  # K̂ (rows in tile key order) and V̂ᵀ as TMA tensor descriptors of 128 × 128 boxes
            ptr["K8"] = ptr["V8T"] = "tensordesc<fp8e4nv[128, 128]>"
        launch = TMA_LAUNCH if tma else POINTER_LAUNCH
        rule = ScaleRule.OCP if args.ocp else ScaleRule.UOS
        consts = dict(HAS_MASK=args.mask, OCP=args.ocp, QMAX=rule.qmax, PNQ=True, D=128, BLOCK_DV=128,
                      BLOCK_M=launch.block_m, BLOCK_N=128, QB=32, EXP_FLOOR=TILE_EXP_FLOOR, TMA=tma, K_TILE_ORDER=tma,
                      ASM=True, FRESH_PV=tma and not args.pv_into_acc, P_E4M3=args.pv8, EXACT=args.exact,
                      SPARSE=args.sparse, QT=128)
        stages, warps = launch.num_stages, launch.num_warps
        max_registers = args.max_registers
        if max_registers is None and tma and (args.mask or args.sparse):  # as masked, sparse TMA loops launch
            max_registers = TMA_REGISTER_BUDGET
    ints = dict(WAN_480P_INTS, smb=_S if args.mask else 1)  # the mask: (B, S) int8
    options = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if max_registers:  # as the launch caps them (ptxas spills past the cap)
        options["maxnreg"] = max_registers
    try:
        return compile_kernel(fn, consts, ptr, ints, arch=90, floats=("scale_log2",), gluon=gluon, **options)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


from fp4video.kernels.offline import loop_opcodes, ptxas_report, sass_mma_loop  # noqa: E402


def ptxas_registers(ptx: str, bin_dir: str, tmp: str) -> str:
    """:func:`ptxas_report` as this script prints it."""
    report = ptxas_report(ptx, bin_dir, tmp)
    if report is None:
        return "registers: no ptxas here took this PTX"
    regs, spills, codes = report
    serialized = f"; MMAs SERIALIZED by ptxas ({', '.join(codes)})" if codes else ""
    return f"{regs} registers, {spills} bytes spill stores{serialized}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["mx", "nvfp4", "nvfp4-sm90"], default="mx",
                    help="mx: the e4m3 MXFP4 loop (default); nvfp4: the bf16 NVFP4 loop (sage3's two-level P); "
                         "nvfp4-sm90: the ping-pong Gluon NVFP4 loop")
    ap.add_argument("--no-two-level", action="store_true", help="nvfp4: plain NVFP4 P (the nvfp4 method)")
    ap.add_argument("--ocp", action="store_true", help="OCP scale rule instead of UOS")
    ap.add_argument("--pointer-loads", action="store_true",
                    help="mx: the loop as GPUs without TMA run it (K̂/V̂ᵀ tiles by pointer loads, 3 stages, no register "
                         "cap); default: as Hopper runs it (TMA, 2 stages; masked: at most 168 registers)")
    ap.add_argument("--mask", action="store_true", help="mx: with a key-padding mask")
    ap.add_argument("--sparse", action="store_true", help="mx: the block-sparse form (key tiles from a list)")
    ap.add_argument("--pv-into-acc", action="store_true",
                    help="mx: P̂·V̂ accumulated into the rescaled accumulator, awaited in the next tile (the TMA "
                         "loop's default is a fresh accumulator, FRESH_PV)")
    ap.add_argument("--exact", action="store_true",
                    help="mx: the e4m3 loop's exact exponents (calls past its fast logit bound) instead of the fused form")
    ap.add_argument("--max-registers", type=int, help="mx: cap the registers per thread (maxnreg)")
    ap.add_argument("--pv8", action="store_true", help="mx / nvfp4: P̃ in E4M3 (the FP8-P·V methods) instead of FP4")
    ap.add_argument("--top", type=int, default=16, help="opcodes to list")
    args = ap.parse_args(argv)

    import triton

    kernel = compile_loop_kernel(args)
    ptx_loop, _ = loop_opcodes(kernel.asm["ptx"].splitlines(), r"^(\$L__BB\d+_\d+):", r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)",
                            r"^\s*(?:@%?!?\w+\s+)?([a-z][\w.]*)", lambda op: op.startswith("wgmma.mma"))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        sass_loop, sass_body = sass_mma_loop(kernel, nvdisasm, tmp)
        registers = ptxas_registers(kernel.asm["ptx"], os.path.dirname(nvdisasm), tmp)
    n_sass, n_ptx = sum(sass_loop.values()), sum(ptx_loop.values())
    print(f"Triton {triton.__version__}, sm_90, main loop of {kernel.name}: "
          f"{n_sass / PER_THREAD:.1f} SASS instructions per element of S ({n_sass} per thread per key tile), "
          f"{n_ptx / PER_THREAD:.1f} in PTX; {registers}; {kernel.metadata.shared} bytes of shared memory")
    waits = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d+)", "\n".join(sass_body)))
    print("MMA waits in the loop (groups left in flight: count): "
          + (", ".join(f"{int(k, 16)}: {n}" for k, n in sorted(waits.items())) or "none"))
    # what runs while an MMA group is still in flight: the instructions between a wait that leaves
    # groups outstanding and the next wait (ptxas may move a wait: this reads the final code)
    insns = [ln for ln in sass_body if re.match(r"\s*/\*[0-9a-f]+\*/\s+\S", ln)]
    marks = [(i, int(m.group(1), 16)) for i, ln in enumerate(insns)
             if (m := re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d+)", ln))]
    overlap = [b - a - 1 for (a, left), (b, _) in zip(marks, marks[1:]) if left > 0]
    if overlap:
        print(f"instructions issued while an MMA group is in flight (after a wait leaving one): {overlap} "
              f"of {len(insns)} in the loop")
    by_unit = collections.Counter()
    for op, n in sass_loop.items():
        by_unit[op.split(".")[0]] += n
    for op, n in by_unit.most_common(args.top):
        print(f"  {n / PER_THREAD:5.2f}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
