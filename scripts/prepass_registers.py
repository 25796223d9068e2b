#!/usr/bin/env python3
"""Registers, spills and shared memory of the e4m3 pre-pass's row launches (Q, and K per key
tile), compiled offline for sm_90 as ``_PrePass`` launches them for bf16 inputs at head dim 128
(no GPU needed), and how many programs of each fit an H200 SM: what bounds their occupancy.

    python scripts/prepass_registers.py [--set TILE_WARPS=8 TILE_MAX_REGISTERS=128 ...]

A memory-bound launch wants many warps per SM; ptxas gives these up to 255 registers per thread
unless ``ROW_MAX_REGISTERS`` / ``TILE_MAX_REGISTERS`` cap them (then it may spill).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REGISTERS_PER_SM, SHARED_PER_SM, SHARED_RESERVED = 65536, 228 * 1024, 1024  # H200 (sm_90)


def compile_rows(out_mode: int, block_s: int, warps: int, stages: int, per_program: int, cap: int | None):
    """The ``_prepass_rows`` launch for MXFP4 (UOS) with the Hadamard rotation in bf16, compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4video.kernels.prepass import _prepass_rows as fn

    consts = dict(HAS_ALIVE=False, SMOOTH=False, ROTATE=True, ROT_PRECISION="bf16", ROT_PARTS=1, FMT=1, QB=32,
                  OCP=False, QMAX=7.25, D=128, BLOCK_S=block_s, OUT=out_mode, BLOCKS_PER_PROGRAM=per_program)
    names = fn.arg_names
    ptr = {"X": "*bf16", "Alive": "*i8", "Mean": "*fp32", "Hm": "*bf16", "Out": "*fp8e4nv", "Fac": "*fp32"}
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n == "h_norm" else "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or n in ("sxb", "sxh", "sxs", "sob", "soh", "sos")]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def programs_per_sm(regs: int, warps: int, shared: int) -> int:
    per_thread = -(-regs // 8) * 8  # allocated 8 at a time
    by_regs = REGISTERS_PER_SM // (per_thread * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_regs, by_shared)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", nargs="+", default=[], metavar="OPTION=VALUE",
                    help="launch options of _PrePass (integers, True, False, None), as prepass_bandwidth.py --set takes them")
    args = ap.parse_args(argv)
    import triton

    from fp4video.kernels import prepass as pp

    from count_loop_instructions import ptxas_report
    from prepass_bandwidth import set_launch_options

    try:
        set_launch_options(pp._PrePass, args.set)
    except ValueError as e:
        ap.error(str(e))
    P = pp._PrePass
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    launches = {
        "Q: rotate, quantize, e4m3 per row": (pp.FP8_ROW, P.BLOCK_S, P.Q_WARPS, P.ROW_STAGES, P.ROW_MAX_REGISTERS),
        "K: rotate, quantize, e4m3 per key tile": (pp.FP8_TILE_ORDERED, pp.KEY_TILE, P.TILE_WARPS, P.TILE_STAGES,
                                                   P.TILE_MAX_REGISTERS),
    }
    print(f"Triton {triton.__version__}, sm_90 (offline), bf16 inputs, head dim 128, "
          f"{P.BLOCKS_PER_PROGRAM} row blocks per program" + (f"; {' '.join(args.set)}" if args.set else ""))
    print("\n| launch | warps | stages | register cap | registers | spill stores (B) | shared (B) | programs per SM "
          "| warps per SM |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (mode, block_s, warps, stages, cap) in launches.items():
        kernel = compile_rows(mode, block_s, warps, stages, P.BLOCKS_PER_PROGRAM, cap)
        with tempfile.TemporaryDirectory() as tmp:
            report = ptxas_report(kernel.asm["ptx"], bin_dir, tmp)
        if report is None:
            raise SystemExit(f"error: no ptxas in {bin_dir} took the pre-pass PTX")
        regs, spills, _ = report
        n = programs_per_sm(regs, warps, kernel.metadata.shared)
        print(f"| {name} | {warps} | {stages} | {cap or 'none'} | {regs} | {spills} | {kernel.metadata.shared} | {n} "
              f"| {n * warps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
