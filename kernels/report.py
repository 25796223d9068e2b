"""What a method's attention loop compiles to on a GPU architecture, read offline (no GPU needed):

    python -m fp4video.kernels.report --target sm_100 --method mxattn [--json]

The loop the dispatch picks on that architecture is compiled as it is launched there (its launch
table, head dim 128, no mask, a Wan-480p launch's sizes) and read back from Triton's IR, the PTX and
the SASS: the MMA kinds of Q·K and P·V (the first and the last MMA of the main loop in PTX),
SASS instructions per element of S in the main loop (PTX where no SASS can be had, saying so), the
spill loads and stores in it, ptxas's registers and spills, shared and tensor memory, warp
specialization and TMA. Of a loop that Triton warp-specialized, every partition's key loop counts,
each by its warps — they issue on the same SM: the softmax, the row statistics, the accumulator's
correction, the MMA issue, the TMA copies — and the softmax partition's loop is given apart.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import METHODS, PScale, RowSum
from fp4video.reference import TWO_LEVEL_P_RANGE

from .plan import plan_on
from .launch import SHARED_MEMORY_LIMIT, stages_that_fit
from .offline import (WAN_480P_INTS, compile_kernel, loop_opcodes, partition_issue, ptxas_report, sass_lines,
                      sass_loops, sass_mma_loop, tool_path, ttgir_partitions)

__all__ = ["LoopReport", "compile_loop", "loop_report", "TARGETS"]

TARGETS = ("sm_90", "sm_100", "sm_120")
_MMA_PTX = ("wgmma.mma_async", "tcgen05.mma", "mma.sync")
_MMA_PTX_RE = "(?:" + "|".join(map(re.escape, _MMA_PTX)) + r")[\w.:]*"  # an MMA instruction with its modifiers


@dataclass
class LoopReport:
    method: str
    target: str
    loop: str  # the loop module's kernel
    qk_mma_kind: str
    pv_mma_kind: str
    instructions_per_element: float  # of a warp-specialized loop: all partitions' loops, weighted by their warps
    instructions_source: str  # "SASS", "SASS, all partitions' loops", or "PTX (no SASS: ...)"
    softmax_partition_instructions_per_element: float | None  # a warp-specialized loop's softmax partition alone
    loop_local_accesses: int | None  # spill loads and stores a key tile issues in the key loops (per thread, summed)
    partitions: list | None  # a warp-specialized loop's partitions: role, warps, SASS per key tile, local accesses
    registers: int | None
    spill_bytes: int | None
    shared_memory_bytes: int
    tensor_memory_columns: int
    warp_specialized: bool
    tma: bool
    num_warps: int
    num_stages: int


def loop_kernel(method: str, arch: int, sparse: bool = False):
    """(name, jit fn, constexprs, pointer types, elements of S per thread per key tile, options, gluon)
    of the loop the dispatch runs ``method`` with on ``sm_{arch}`` (``sparse``: its block-sparse form)."""
    r = METHODS[method]
    qk, pv = r.qk_format, r.pv_format
    target = f"sm_{arch}"
    limit = SHARED_MEMORY_LIMIT[target]
    mx_common = dict(OCP=r.scale_rule is ScaleRule.OCP, QMAX=r.scale_rule.qmax, PNQ=r.row_sum is RowSum.QUANTIZED,
                     HAS_MASK=False, D=128, BLOCK_DV=128, BLOCK_N=128)
    plan = plan_on(r, target)  # the call's plan on that architecture
    if sparse and (why := plan.sparse_reason):
        raise ValueError(f"{method} on {target}: {why}")
    if plan.loop == "scaled":
        from .loop_scaled import LAUNCH, SCALE_CHUNK, TMA_LAUNCH, kernel, scale_chunks_fit, tma_launch_key, variant

        nv = qk is Format.NVFP4
        pv8 = pv is Format.E4M3  # FP8 P·V: V̂ᵀ e4m3 with its channel factors
        tma = plan.tma  # K̂ / V̂ᵀ codes by TMA where the loop is warp-specialized
        launch = TMA_LAUNCH[tma_launch_key(nv, pv8)] if tma else LAUNCH
        stages = stages_that_fit(target, limit, launch.num_stages, launch.shared_memory)
        codes = "tensordesc<u8[128, 64]>" if tma else "*u8"
        v8 = "tensordesc<fp8e4nv[128, 128]>" if tma else "*fp8e4nv"
        ptr = dict(Q4="*u8", QS="*u8", K4=codes, KS="*u8", V4T=v8 if pv8 else codes,
                   VS="*fp32" if pv8 else "*u8", GQK="*fp32", GV="*fp32", KeyMask="*i8", KIdx="*i32", KCnt="*i32",
                   Out="*bf16", Lse="*fp32")
        qb = 16 if nv else 32
        sc_tma = tma and scale_chunks_fit(128, qb, 128, pv8)
        if sc_tma:  # the block scales by TMA, one box of chunks (loop_scaled.scale_chunks) a key tile
            box = f"tensordesc<{'fp8e4nv' if nv else 'u8'}[1, {128 * (128 // qb) // SCALE_CHUNK[1]}, {SCALE_CHUNK[1]}]>"
            ptr["KS"] = box
            if not pv8:
                ptr["VS"] = box
        fn, consts = kernel(plan, r, (arch // 10, arch % 10), d=128, dv_pad=128, block_m=launch.block_m,
                            has_mask=False, sc_tma=sc_tma, sparse=sparse, query_tile=128)  # as the launch passes them
        return (f"{variant(plan).__name__.rsplit('.', 1)[-1]}.{fn.__name__}", fn, consts, ptr,
                launch.block_m * 128 // (launch.num_warps * 32),
                dict(num_warps=launch.num_warps, num_stages=stages, enable_fp_fusion=False), False)
    if plan.loop == "e4m3":
        from .key_order import LANE_BLOCK
        from .loop_e4m3 import TILE_EXP_FLOOR, TMA_LAUNCH, TMA_REGISTER_BUDGET, KERNEL as fn

        launch = TMA_LAUNCH  # every target here has TMA
        block_m, num_warps = launch.shape(target)
        stages = stages_that_fit(target, limit, launch.num_stages, launch.shared_memory)
        ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "K8": "tensordesc<fp8e4nv[128, 128]>", "KFac": "*fp32",
               "V8T": "tensordesc<fp8e4nv[128, 128]>", "VFac": "*fp32", "KeyMask": "*i8", "KIdx": "*i32",
               "KCnt": "*i32", "Out": "*bf16", "Lse": "*fp32"}
        consts = dict(mx_common, BLOCK_M=block_m, QB=LANE_BLOCK, EXP_FLOOR=TILE_EXP_FLOOR, TMA=True,
                      K_TILE_ORDER=True, ASM=True, FRESH_PV=True, P_E4M3=pv is Format.E4M3,
                      EXACT=False,  # the exponents' form calls within the fast logit bound run
                      SPARSE=sparse, QT=128)
        options = dict(num_warps=num_warps, num_stages=stages, enable_fp_fusion=False)
        if sparse and (block_m, num_warps) == (launch.block_m, launch.num_warps):  # as a sparse launch caps them
            options["maxnreg"] = TMA_REGISTER_BUDGET
        return ("loop_e4m3._e4m3_attn_fwd", fn, consts, ptr, block_m * 128 // (num_warps * 32), options, False)
    if plan.loop in ("nvfp4", "nvfp4_sm90"):
        nv = dict(HAS_MASK=False, TWO_LEVEL=r.p_scale is PScale.TWO_LEVEL, P_RANGE=TWO_LEVEL_P_RANGE,
                  PNQ=r.row_sum is RowSum.QUANTIZED, D=128, BLOCK_DV=128, BLOCK_N=128)
        if plan.loop == "nvfp4_sm90":
            from triton.experimental.gluon import language as gl

            from .loop_nvfp4_sm90 import CONSUMER_REGS, NUM_BUFFERS, KERNEL as fn

            desc = f"tensordesc<bf16[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)!r}>"
            ptr = {"Q": "*bf16", "Kd": desc, "Vd": desc, "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
            consts = dict(nv, BLOCK_M=128, NUM_BUF=NUM_BUFFERS, CONSUMER_REGS=CONSUMER_REGS)
            # one warpgroup of 64 rows is compiled; the other runs the same code in a partition
            return ("loop_nvfp4_sm90._nv_attn_fwd_sm90", fn, consts, ptr, 64,
                    dict(num_warps=4, num_stages=1, enable_fp_fusion=False), True)  # as launched
        from .loop_nvfp4 import LAUNCH, KERNEL as fn

        stages = stages_that_fit(target, limit, LAUNCH.num_stages, LAUNCH.shared_memory)
        ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
        consts = dict(nv, IEEE=False, FAST_RCP=True, HW_E4M3=True, DV_PAD=False, BLOCK_M=LAUNCH.block_m,
                      P_E4M3=pv is Format.E4M3)
        return ("loop_nvfp4._nv_attn_fwd", fn, consts, ptr, LAUNCH.block_m * 128 // (LAUNCH.num_warps * 32),
                dict(num_warps=LAUNCH.num_warps, num_stages=stages, enable_fp_fusion=False), False)
    from .loop_bf16 import LAUNCH, P_MX, P_NONE, KERNEL as fn

    stages = stages_that_fit(target, limit, LAUNCH.num_stages, LAUNCH.shared_memory)
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KeyMask": "*i8", "KIdx": "*i32", "KCnt": "*i32", "Out": "*bf16",
           "Lse": "*fp32"}
    consts = dict(HAS_MASK=False, P_MODE=(P_MX if pv is Format.MXFP4 else P_NONE).value, QB=32, OCP=r.scale_rule is ScaleRule.OCP,
                  QMAX=r.scale_rule.qmax, PNQ=r.row_sum is RowSum.QUANTIZED, IEEE=False, D=128, BLOCK_DV=128,
                  BLOCK_M=LAUNCH.block_m, BLOCK_N=128, SPARSE=sparse, QT=128)
    return ("loop_bf16._bf16_attn_fwd", fn, consts, ptr, LAUNCH.block_m * 128 // (LAUNCH.num_warps * 32),
            dict(num_warps=LAUNCH.num_warps, num_stages=stages), False)


def local_accesses(ops) -> int:
    """Local-memory loads and stores (ptxas's spills) among a loop's SASS opcodes."""
    return sum(n for op, n in ops.items() if op.split(".")[0] in ("LDL", "STL"))


def _mma_kind(instruction: str) -> str:
    """``mxf4``, ``mxf4nvf4``, ``f8f6f4``, ``e4m3``, ``bf16``, ... of one PTX MMA instruction."""
    m = re.search(r"kind::(\w+)", instruction)
    if m:
        return m.group(1)
    types = re.findall(r"\.(e4m3|e5m2|bf16|f16|tf32|e2m1)\b", instruction)
    return types[-1] if types else instruction


def _qk_pv_kinds(mmas: list[str], kernel_mmas: list[str], recipe) -> dict:
    """The MMA kinds of Q·K and P·V: the main loop's first and last MMA instructions', unless the
    kernel holds two kinds, one FP4 and the method's Q·K FP4 (the FP8-P·V methods on Blackwell,
    whose P·V the compiler may move ahead of Q·K or out of the loop's line into a branch target):
    then the FP4 kind is Q·K's and the other P·V's."""
    kinds = list(dict.fromkeys(_mma_kind(m) for m in kernel_mmas))
    qk, pv = _mma_kind(mmas[0]), _mma_kind(mmas[-1])
    fp4 = [k for k in kinds if k.startswith("mxf4")]
    if len(kinds) == 2 and len(fp4) == 1 and recipe.qk_format in (Format.MXFP4, Format.NVFP4):
        qk, pv = fp4[0], next(k for k in kinds if k != fp4[0])
    return dict(qk_mma_kind=qk, pv_mma_kind=pv)


def compile_loop(method: str, arch: int, sparse: bool = False):
    """(name, compiled kernel, constexprs, elements of S per thread per key tile, launch options,
    gluon) of the loop the dispatch runs ``method`` with on ``sm_{arch}``, compiled offline as it is
    launched there (head dim 128, no mask, a Wan-480p launch's sizes)."""
    name, fn, consts, ptr, per_thread, options, gluon = loop_kernel(method, arch, sparse)
    kernel = compile_kernel(fn, consts, ptr, dict(WAN_480P_INTS, smb=1), arch=arch, floats=("scale_log2", "scale"),
                            gluon=gluon, **options)
    return name, kernel, consts, per_thread, options, gluon


def loop_report(method: str, target: str, sparse: bool = False) -> LoopReport:
    """Compile ``method``'s loop for ``target`` (``sm_90`` / ``sm_100`` / ``sm_120``) and read it
    (``sparse``: its block-sparse form, key tiles from a list)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
    arch = int(target[3:])
    name, kernel, consts, per_thread, options, gluon = compile_loop(method, arch, sparse)
    kernel_mmas = re.findall(_MMA_PTX_RE, kernel.asm["ptx"])
    if not kernel_mmas:  # Triton compiles a kernel it cannot place (e.g. over 512 tensor-memory columns) to a trap
        raise RuntimeError(f"{method} on {target}: the compiled loop holds no MMA (Triton made it a trap; tensor "
                           f"memory {getattr(kernel.metadata, 'tmem_size', 0)} of 512 columns)")
    ptx_ops, ptx_body = loop_opcodes(kernel.asm["ptx"].splitlines(), r"^(\$L__BB\d+_\d+):",
                                     r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)", r"^\s*(?:@%?!?\w+\s+)?([a-z][\w.:]*)",
                                     lambda op: op.startswith(_MMA_PTX))
    mmas = [m.group(1) for line in ptx_body if (m := re.match(r"^\s*(?:@%?!?\w+\s+)?([a-z][\w.:]*)", line))
            and m.group(1).startswith(_MMA_PTX)]
    ws = bool(consts.get("WS"))
    if ws:  # the MMAs have a partition of their own: the softmax partition's loop (exp2) is the work
        ptx_ops, _ = loop_opcodes(kernel.asm["ptx"].splitlines(), r"^(\$L__BB\d+_\d+):",
                                  r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)", r"^\s*(?:@%?!?\w+\s+)?([a-z][\w.:]*)",
                                  lambda op: op.startswith("ex2"), most=True)
    ttgir = kernel.asm.get("ttgir", "")
    softmax, local, parts = None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            lines = sass_lines(kernel, tool_path("nvdisasm"), tmp)
            sass_ops, _ = sass_mma_loop(kernel, tool_path("nvdisasm"), tmp,
                                        (lambda op: op.startswith("MUFU.EX2")) if ws else (lambda op: "MMA" in op),
                                        most=ws, lines=lines)
            count, source = sum(sass_ops.values()), "SASS"
            local = local_accesses(sass_ops)
            if ws:  # every partition's loop issues on the same SM: their sum, each by its warps, is the work
                softmax = round(count / per_thread, 2)
                paired = partition_issue(sass_loops(lines),
                                         ttgir_partitions(ttgir, options["num_warps"]))
                if paired is None:  # the loops did not pair up with the partitions: the softmax loop alone, saying so
                    source = "SASS, the softmax partition's loop (the other partitions' loops not paired)"
                else:
                    count = sum(sum(ops.values()) * warps for _, warps, ops in paired) / options["num_warps"]
                    local = sum(local_accesses(ops) for _, _, ops in paired)
                    parts = [dict(role=role, warps=warps, instructions_per_tile=sum(ops.values()),
                                  local_accesses_per_tile=local_accesses(ops)) for role, warps, ops in paired]
                    source = "SASS, all partitions' loops"
        except (SystemExit, OSError, subprocess.CalledProcessError) as e:  # report PTX instead, saying why
            why = str(e) if isinstance(e, SystemExit) else f"nvdisasm failed ({type(e).__name__})"
            count, source = sum(ptx_ops.values()), f"PTX{', the softmax partition' if ws else ''} (no SASS: {why})"
        regs = ptxas_report(kernel.asm["ptx"], tool_path(""), tmp, arch=arch)
    return LoopReport(
        method=method, target=target, loop=name,
        **_qk_pv_kinds(mmas, kernel_mmas, METHODS[method]),
        instructions_per_element=round(count / per_thread, 2), instructions_source=source,
        softmax_partition_instructions_per_element=softmax, loop_local_accesses=local, partitions=parts,
        registers=None if regs is None else regs[0], spill_bytes=None if regs is None else regs[1],
        shared_memory_bytes=int(kernel.metadata.shared),
        tensor_memory_columns=int(getattr(kernel.metadata, "tmem_size", 0) or 0),
        warp_specialized="warp_specialize" in ttgir or gluon,
        tma=bool(re.search(r"async_tma|descriptor_load|descriptor_store", ttgir)),
        num_warps=options["num_warps"], num_stages=options["num_stages"])


#: the columns of :func:`markdown_row`
MARKDOWN_COLUMNS = ("method", "target", "loop", "Q·K MMA", "P·V MMA", "instructions / element of S",
                    "spill accesses / key tile in the loops", "registers (spilled B)", "shared memory B",
                    "tensor memory columns", "warp specialized", "TMA", "warps × stages")


def markdown_row(rep: LoopReport) -> str:
    """One Markdown table row of a report (:data:`MARKDOWN_COLUMNS`)."""
    count = f"{rep.instructions_per_element:.2f} {rep.instructions_source.split(',')[0].split(' ')[0]}"
    if rep.softmax_partition_instructions_per_element is not None and rep.partitions:
        count += f", all partitions ({rep.softmax_partition_instructions_per_element:.2f} softmax)"
    regs = "?" if rep.registers is None else f"{rep.registers} ({rep.spill_bytes})"
    cells = (rep.method, rep.target, rep.loop.split(".")[0], rep.qk_mma_kind, rep.pv_mma_kind, count,
             rep.loop_local_accesses, regs, rep.shared_memory_bytes, rep.tensor_memory_columns,
             "yes" if rep.warp_specialized else "no", "yes" if rep.tma else "no", f"{rep.num_warps} × {rep.num_stages}")
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4video.kernels.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, choices=TARGETS, help="GPU architecture to compile for")
    ap.add_argument("--method", required=True, nargs="+", choices=list(METHODS), metavar="METHOD",
                    help=f"one or more of: {', '.join(METHODS)}")
    ap.add_argument("--sparse", action="store_true", help="the loop's block-sparse form (key tiles from a list)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object per method instead of text")
    out.add_argument("--markdown", action="store_true",
                     help="a Markdown table, a row per method (BENCHMARKS.md's table of what the loops compile to)")
    args = ap.parse_args(argv)
    if args.markdown:
        print("| " + " | ".join(MARKDOWN_COLUMNS) + " |\n|" + " --- |" * len(MARKDOWN_COLUMNS))
    for method in args.method:
        rep = loop_report(method, args.target, args.sparse)
        if args.json:
            print(json.dumps(asdict(rep)))
            continue
        if args.markdown:
            print(markdown_row(rep), flush=True)
            continue
        regs = "ptxas took no PTX here" if rep.registers is None else f"{rep.registers} registers, {rep.spill_bytes} B spilled"
        print(f"{rep.method} on {rep.target}: {rep.loop} ({rep.num_warps} warps, {rep.num_stages} stages)\n"
              f"  Q·K MMA {rep.qk_mma_kind}, P·V MMA {rep.pv_mma_kind}; {rep.instructions_per_element} instructions "
              f"per element of S ({rep.instructions_source}); {rep.loop_local_accesses} spill accesses a key tile in "
              f"the loop; {regs}\n"
              f"  shared memory {rep.shared_memory_bytes} B, tensor memory {rep.tensor_memory_columns} columns, "
              f"warp specialized: {rep.warp_specialized}, TMA: {rep.tma}")
        for part in rep.partitions or []:
            print(f"  partition: {part['role']}, {part['warps']} warps, {part['instructions_per_tile']} SASS "
                  f"instructions and {part['local_accesses_per_tile']} spill accesses a key tile (per thread)")
        if rep.softmax_partition_instructions_per_element is not None:
            print(f"  the softmax partition's loop alone: {rep.softmax_partition_instructions_per_element} per element")
    return 0


if __name__ == "__main__":
    sys.exit(main())
