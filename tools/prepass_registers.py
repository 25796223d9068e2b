#!/usr/bin/env python3
"""Registers, spills and shared memory of the e4m3 pre-pass's row launches (Q, and K per key
tile), compiled offline for sm_90 as ``PrepassLaunch`` launches them for bf16 inputs at head dim 128
and Wan 480p's strides (no GPU needed), and how many programs of each fit an H200 SM: what bounds
their occupancy, and the SASS instructions per element of the loop over row blocks (the
arithmetic that bounds them: FMNMX, the block maxima and E2M1 clamps, apart).

    python tools/prepass_registers.py [--set TILE_WARPS=8 Q8_STAGES=2 ...]

The compile specializes the launch as Triton's launcher does (unit strides constant, multiples of
16 marked: ``offline_compile.launch_signature``); without that the loads go scalar and
the register counts are not those of the real launch (255 and spills instead of 120 / 198 and
none, Triton 3.6: checked against the compiled kernels on the H200, 2026-11-30).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REGISTERS_PER_SM, SHARED_PER_SM, SHARED_RESERVED = 65536, 228 * 1024, 1024  # H200 (sm_90)


def compile_rows(out_mode, block_s: int, warps: int, stages: int, per_program: int, persistent: bool):
    """The row pre-pass launch for MXFP4 (UOS) with the Hadamard rotation in bf16, compiled for sm_90;
    ``out_mode``: one of :mod:`fp4video.kernels.prepass`' ``OUT`` modes."""
    from offline_compile import compile_kernel

    from fp4video.formats import ScaleRule
    from fp4video.kernels import prepass as pp
    from fp4video.kernels.prepass import ROWS_KERNEL as fn

    consts = dict(HAS_ALIVE=False, SMOOTH=False, ROTATE=True, ROT_PRECISION="bf16", ROT_PARTS=1, FMT=pp.FMT_MXFP4.value, QB=32,
                  OCP=False, QMAX=ScaleRule.UOS.qmax, D=128, BLOCK_S=block_s, OUT=out_mode.value,
                  BLOCKS_PER_PROGRAM=per_program, PERSISTENT=persistent, TSCALE=False, HW_E4M3=True, QUAD=False)
    ptr = {"X": "*bf16", "Alive": "*i8", "Mean": "*fp32", "Hm": "*bf16", "Out": "*fp8e4nv", "Fac": "*fp32"}
    s, s_pad = 32760, 32768  # Wan 480p, H = 40; K̂ padded to whole key tiles; the unused Alive and Mean: 1 × 1
    ints = dict(H=40, S=s, D_IN=128, n_blocks=-(-s // block_s), n_heads=40, sxb=40 * s * 128, sxh=s * 128, sxs=128,
                sxd=1, sab=1, sas=1, smb=1, smh=1, sob=40 * s_pad * 128, soh=s_pad * 128, sos=128)
    return compile_kernel(fn, consts, ptr, ints, arch=90, floats=("h_norm",), num_warps=warps, num_stages=stages)


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    per_thread = -(-regs // 8) * 8  # allocated 8 at a time
    by_regs = REGISTERS_PER_SM // (per_thread * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_regs, by_shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", nargs="+", default=[], metavar="OPTION=VALUE",
                    help="launch options of PrepassLaunch (integers, None), as prepass_bandwidth.py --set takes them")
    args = ap.parse_args(argv)
    import triton

    from fp4video.kernels import prepass as pp

    from fp4video.kernels.offline import ptxas_report, sass_mma_loop
    from prepass_bandwidth import launch_options

    try:
        P = launch_options(args.set)
    except ValueError as e:
        ap.error(str(e))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    launches = {
        "Q: rotate, quantize, e4m3 per row": (pp.FP8_ROW, P.block_s, P.row_warps, P.q8_stages, P.q8_programs_per_sm),
        "K: rotate, quantize, e4m3 per key tile": (pp.FP8_TILE_ORDERED, pp.KEY_TILE, P.tile_warps, P.tile_stages,
                                                   P.tile_programs_per_sm),
    }
    print(f"Triton {triton.__version__}, sm_90 (offline), bf16 inputs, head dim 128, "
          f"{P.blocks_per_program} row blocks per program unless persistent" + (f"; {' '.join(args.set)}" if args.set else ""))
    print("\n| launch | warps | stages | persistent (programs per SM) | registers | spill stores (B) | shared (B) "
          "| programs per SM | warps per SM | SASS per element (FMNMX) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (mode, block_s, warps, stages, per_sm) in launches.items():
        kernel = compile_rows(mode, block_s, warps, stages, P.blocks_per_program, bool(per_sm))
        with tempfile.TemporaryDirectory() as tmp:
            report = ptxas_report(kernel.asm["ptx"], bin_dir, tmp)
            ops, _ = sass_mma_loop(kernel, os.path.join(bin_dir, "nvdisasm"), tmp)
        per_thread = block_s * 128 / (warps * 32)  # elements of a row block each thread quantizes
        fmnmx = sum(n for op, n in ops.items() if op.startswith("FMNMX"))
        if report is None:
            raise SystemExit(f"error: no ptxas in {bin_dir} took the pre-pass PTX")
        regs, spills, _ = report
        n = programs_per_sm(regs, warps, kernel.metadata.shared)
        if per_sm:  # the persistent grid's programs, where they fit
            n = min(n, per_sm)
        print(f"| {name} | {warps} | {stages} | {per_sm or 'no'} | {regs} | {spills} | {kernel.metadata.shared} | {n} "
              f"| {n * warps} | {sum(ops.values()) / per_thread:.1f} ({fmnmx / per_thread:.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
