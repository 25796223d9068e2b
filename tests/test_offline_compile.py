"""The kernels compiled offline for GPUs this machine does not have: the Blackwell loop's native FP4
MMAs (sm_100, sm_120)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT

from fp4video import METHODS

pytest.importorskip("triton")

#: a kernel with nothing of fp4video in it: whether this Triton compiles for sm_{arch} at all
TOOLCHAIN = """
import triton
import triton.language as tl
from fp4video.kernels.offline import compile_kernel

@triton.jit
def twice(X, Y, N: tl.constexpr):
    tl.store(Y + tl.arange(0, N), tl.load(X + tl.arange(0, N)) * 2)

compile_kernel(twice, dict(N=128), dict(X="*fp32", Y="*fp32"), {{}}, arch={arch}, num_warps=4)
"""


@functools.cache
def toolchain_missing(arch: int) -> str | None:
    """Why this Triton cannot compile any kernel for sm_{arch} (no ptxas for it, ...), or None."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:  # (jit reads its source file)
        f.write(TOOLCHAIN.format(arch=arch))
    try:
        run = subprocess.run([sys.executable, f.name], capture_output=True, text=True, env=env, timeout=300)
    finally:
        os.unlink(f.name)
    return None if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1]


def compiled(run: subprocess.CompletedProcess, arch: int) -> None:
    """Skips where this Triton compiles nothing for sm_{arch}; fails where it compiles a trivial
    kernel there but not this one (a fault of the kernel or of the test's arguments)."""
    if run.returncode == 0:
        return
    if (why := toolchain_missing(arch)) is not None:
        pytest.skip(f"this Triton cannot compile for sm_{arch}: {why}")
    pytest.fail(f"this Triton compiles for sm_{arch}, but not this kernel: {run.stderr[-2000:]}")

#: compiles the dot_scaled loop (head dim 128, a key-padding mask; MXFP4 with UOS + PNQ, or NVFP4 with
#: two-level P, {nv}) for sm_{arch} as the dispatch runs it there, and prints its PTX: on sm_100 the
#: warp-specialized loop (codes and block scales by TMA, two-lane fp32 arithmetic), on sm_120 the
#: pointer-load loop with K̂ in the quad key order
SCALED_PTX = """
import sys
sys.path.insert(0, {tools!r})
from offline_compile import compile_kernel
from fp4video import METHODS
from fp4video.kernels.loop_scaled import TMA_LAUNCH, kernel
from fp4video.kernels.plan import Plan
tma = {arch} == 100
plan = Plan("scaled", "packed", "sm_{arch}", tma=tma, warp_specialized=tma, key_order="key" if tma else "quad")
fn, consts = kernel(plan, METHODS["sage3" if {nv} else "mxattn"], ({arch} // 10, {arch} % 10), d=128, dv_pad=128,
                    block_m=128, has_mask=True, sc_tma=tma)
codes = "tensordesc<u8[128, 64]>" if tma else "*u8"
scales = f"tensordesc<{{'fp8e4nv' if {nv} else 'u8'}}[1, {{4 if {nv} else 2}}, 256]>" if tma else "*u8"  # (chunks)
ptr = dict(Q4="*u8", QS="*u8", K4=codes, KS=scales, V4T=codes, VS=scales, GQK="*fp32", GV="*fp32", KeyMask="*i8",
           KIdx="*i32", KCnt="*i32", Out="*bf16", Lse="*fp32")
ints = dict(sqs=64, sks=64, svd=2048, svsd=128, SQ=4096, SK_PAD=4096)  # 16-divisible, as real launches are
if {nv}:  # rows of codes then E4M3 scale bytes (K̂'s and V̂ᵀ's padded to 16 bytes)
    ints.update(sqs=72, sks=80, svd=2304, svsd=2304)
print(compile_kernel(fn, consts, ptr, ints, arch={arch}, floats=("scale_log2",),
                     num_warps=TMA_LAUNCH["nv" if {nv} else "mx"].num_warps if tma else 8,
                     num_stages=2, enable_fp_fusion=False).asm["ptx"])
"""


@pytest.mark.parametrize("nv", [False, True], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize("arch, instruction", [(100, "tcgen05.mma"), (120, "mma.sync")])
def test_scaled_kernel_compiles_to_native_fp4_mma(arch, instruction, nv):
    """The Blackwell check without a Blackwell GPU: compile the dot_scaled kernel for sm_100 /
    sm_120 and read the PTX: both matrix products use the native FP4 MMA — MXFP4's (E2M1 operands,
    UE8M0 block-32 scales: ``kind::mxf4`` / ``mxf4nvf4 … ue8m0``) or NVFP4's (UE4M3 block-16
    scales: ``kind::mxf4nvf4 … block16`` / ``scale_vec::4X … ue4m3``) — and no bf16 MMA (the
    emulation) is left; on sm_100 K̂'s and V̂ᵀ's block scales reach tensor memory by ``tcgen05.cp``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    code = SCALED_PTX.format(tools=str(ROOT / "tools"), arch=arch, nv=nv)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        from fp4video.kernels.plan import plan_on

        # where the plan runs this loop by default, it must compile; elsewhere (a Triton older
        # than NATIVE_FP4_MIN_TRITON says) a failure is what the plan already avoids
        default = plan_on(METHODS["sage3" if nv else "mxattn"], f"sm_{arch}").loop
        assert default != "scaled", f"the plan runs the native loop here, but it does not compile: {run.stderr[-2000:]}"
        pytest.skip(f"this Triton cannot compile for sm_{arch} (the dispatch does not use it): "
                    f"{run.stderr.strip().splitlines()[-1:]}")
    ptx = run.stdout
    mmas = re.findall(rf"{re.escape(instruction)}[.\w:]*", ptx)
    assert len(mmas) >= 2 and all("block_scale" in m for m in mmas), sorted(set(mmas))
    # block-16 E4M3 scales: ``block16`` or ``scale_vec::4X`` (four scales per 64 K: UE4M3 only)
    block16 = [("block16" in m or "scale_vec::4X" in m or "ue4m3" in m) for m in mmas]
    if nv:
        assert all("kind::mxf4nvf4" in m for m in mmas) and all(block16), sorted(set(mmas))
    else:
        assert all("kind::mxf4" in m for m in mmas) and not any(block16), sorted(set(mmas))
    assert not re.search(r"(wgmma|mma)[.\w]*\.bf16", ptx), "an MMA fell back to bf16 (emulation)"
    # P's E2M1 rounding and packing by the hardware conversion, and (PNQ: the MXFP4 form here)
    # its values back for the row sum: each pair's by the reverse conversion, and in sm_100's
    # warp-specialized loop each block's codes by table look-ups (prmt, dp4a)
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx
    assert ("cvt.rn.f16x2.e2m1x2" in ptx) is (not nv)
    assert ("dp4a.u32.u32" in ptx) is (not nv and arch == 100)
    # sm_100: K̂'s and V̂ᵀ's block scales copied from their TMA boxes into tensor memory; the exp2
    # arguments two lanes an instruction
    assert ("tcgen05.cp" in ptx) is (arch == 100)
    assert "fma.rn.f32x2" in ptx or arch != 100


#: compiles the e4m3 loop with FP8 P̂ (the FP8-P·V methods, pointer loads, a mask) for sm_{arch}
E4M3_PTX = """
import sys
sys.path.insert(0, {tools!r})
from offline_compile import compile_kernel
from fp4video.formats import ScaleRule
from fp4video.kernels.loop_e4m3 import TILE_EXP_FLOOR, KERNEL as fn
ptr = dict(Q8="*fp8e4nv", QFac="*fp32", K8="*fp8e4nv", KFac="*fp32", V8T="*fp8e4nv", VFac="*fp32", KeyMask="*i8",
           KIdx="*i32", KCnt="*i32", Out="*bf16", Lse="*fp32")
consts = dict(HAS_MASK=True, OCP=False, QMAX=ScaleRule.UOS.qmax, PNQ=True, D=128, BLOCK_DV=128, BLOCK_M=64,
              BLOCK_N=128, QB=32, EXP_FLOOR=TILE_EXP_FLOOR, TMA=False, K_TILE_ORDER=False, ASM=True, FRESH_PV=False,
              P_E4M3=True, EXACT=False, SPARSE=False, QT=128)
ints = dict(sqs=128, sks=128, svd=4096, SQ=4096, SK_PAD=4096)
print(compile_kernel(fn, consts, ptr, ints, arch={arch}, floats=("scale_log2",), num_warps=4, num_stages=2,
                     enable_fp_fusion=False).asm["ptx"])
"""


@pytest.mark.parametrize("arch, mma", [(90, r"wgmma\.mma_async[.\w]*\.e4m3\.e4m3"), (100, r"tcgen05\.mma[.\w:]*kind::f8f6f4"),
                                       (120, r"mma\.sync[.\w]*\.e4m3\.e4m3")])
def test_fp8_pv_loop_compiles_to_fp8_mmas(arch, mma):
    """The FP8-P·V methods' e4m3 loop, compiled for Hopper and both Blackwell families: both of its
    products on the FP8 MMAs (Q·K of the MXFP4 methods' e4m3-stored values, P̂·V̂), no bf16 MMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", E4M3_PTX.format(tools=str(ROOT / "tools"), arch=arch)],
                         capture_output=True, text=True, env=env, timeout=600)
    compiled(run, arch)
    assert len(re.findall(mma, run.stdout)) >= 2, sorted(set(re.findall(r"(?:tcgen05\.mma|mma\.sync|wgmma\.mma_async)[.\w:]*", run.stdout)))
    assert not re.search(r"(wgmma|mma)[.\w]*\.bf16", run.stdout), "an MMA fell back to bf16"


#: compiles a loop for sm_{arch} at the stage count its launch picks there and prints its shared memory
LAUNCH_SMEM = """
import sys
sys.path.insert(0, {tools!r})
from offline_compile import compile_kernel
from fp4video.formats import ScaleRule
from fp4video.kernels.launch import SHARED_MEMORY_LIMIT, stages_that_fit
from fp4video.reference import TWO_LEVEL_P_RANGE
arch = "sm_{arch}"
_S, _SP = 32760, 32768
ints = dict(H=40, SQ=_S, SK=_S, SK_PAD=_SP, DV=128, sqb=40 * _S * 128, sqh=_S * 128, sqs=128, skb=40 * _SP * 128,
            skh=_SP * 128, sks=128, svb=40 * 128 * _SP, svh=128 * _SP, svs=128, svd=_SP, smb=_S, sms=1,
            sob=40 * _S * 128, soh=_S * 128, sos=128, sod=1, slb=40 * _S, slh=_S, sls=1)  # Wan 480p, as launched
if {kernel!r}.startswith("scaled-tma-"):  # the warp-specialized loop of sm_100: the format's hungriest method
    from fp4video.kernels.loop_scaled import TMA_LAUNCH
    from fp4video.kernels.report import loop_kernel
    key = {kernel!r}[len("scaled-tma-"):]
    _, fn, consts, ptr, _, options, _ = loop_kernel({{"mx": "mxfp4-ocp", "nv": "sage3-hpnq", "nv-pv8": "sage3-pv8"}}[key], {arch})
    LAUNCH = TMA_LAUNCH[key]
    consts = dict(consts, HAS_MASK=True)
    from fp4video.kernels.offline import WAN_480P_INTS
    ints = dict(WAN_480P_INTS, smb=1)  # (as its table was compiled: the report's sizes)
    options = dict(enable_fp_fusion=False)
elif {kernel!r} == "nvfp4":
    from fp4video.kernels.loop_nvfp4 import LAUNCH, KERNEL as fn
    ptr = dict(Q="*bf16", K="*bf16", V="*bf16", KeyMask="*i8", Out="*bf16", Lse="*fp32")
    consts = dict(HAS_MASK=True, TWO_LEVEL=True, P_RANGE=TWO_LEVEL_P_RANGE, PNQ=False, IEEE=False, FAST_RCP=True,
                  HW_E4M3=True, D=128, BLOCK_DV=128, DV_PAD=False, BLOCK_M=128, BLOCK_N=128, P_E4M3=False)
    options = dict(enable_fp_fusion=False)
else:
    from fp4video.kernels.loop_e4m3 import POINTER_LAUNCH as LAUNCH, TILE_EXP_FLOOR, KERNEL as fn
    ptr = dict(Q8="*fp8e4nv", QFac="*fp32", K8="*fp8e4nv", KFac="*fp32", V8T="*fp8e4nv", VFac="*fp32", KeyMask="*i8",
               KIdx="*i32", KCnt="*i32", Out="*bf16", Lse="*fp32")
    consts = dict(HAS_MASK=True, OCP=False, QMAX=ScaleRule.UOS.qmax, PNQ=True, D=128, BLOCK_DV=128, BLOCK_M=64,
                  BLOCK_N=128, QB=32, EXP_FLOOR=TILE_EXP_FLOOR, TMA=False, K_TILE_ORDER=False, ASM=True,
                  FRESH_PV=False, P_E4M3=False, EXACT=False, SPARSE=False, QT=128)
    options = dict(enable_fp_fusion=False)
stages = stages_that_fit(arch, SHARED_MEMORY_LIMIT[arch], LAUNCH.num_stages, LAUNCH.shared_memory)
kernel = compile_kernel(fn, consts, ptr, ints, arch={arch}, floats=("scale_log2",), num_warps=LAUNCH.num_warps,
                        num_stages=stages, **options)
print(stages, kernel.metadata.shared, SHARED_MEMORY_LIMIT[arch], LAUNCH.shared_memory[arch][stages])
"""


@pytest.mark.parametrize("kernel, arch, stages", [("nvfp4", 100, 2), ("nvfp4", 120, 2), ("e4m3", 120, 3),
                                                  ("scaled-tma-mx", 100, 2), ("scaled-tma-nv", 100, 2),
                                                  ("scaled-tma-nv-pv8", 100, 2)])
def test_launch_fits_each_blackwell_architecture(kernel, arch, stages):
    """Each architecture's launch, compiled for it offline: the stage count its table picks, the
    shared memory the compiler allots within what a block may have there, and the table's figure
    the compiler's (so the table cannot drift from the kernel unnoticed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", LAUNCH_SMEM.format(tools=str(ROOT / "tools"), arch=arch, kernel=kernel)],
                         capture_output=True, text=True, env=env, timeout=600)
    compiled(run, arch)
    picked, shared, limit, table = map(int, run.stdout.split()[-4:])
    assert picked == stages and shared <= limit and shared == table, run.stdout


@pytest.mark.parametrize("method, target, qk, pv, specialized, tma", [
    ("mxattn", "sm_100", "mxf4", "mxf4", True, True), ("mxattn", "sm_120", "mxf4nvf4", "mxf4nvf4", False, False),
    ("mxattn-pv8", "sm_100", "mxf4", "f8f6f4", True, True), ("sage3-pv8", "sm_100", "mxf4nvf4", "f8f6f4", True, True),
    ("mxattn-pv8", "sm_120", "mxf4nvf4", "e4m3", False, False), ("fp8", "sm_100", "f8f6f4", "f8f6f4", False, True),
    ("sage3", "sm_90", "bf16", "bf16", True, True)])
def test_kernel_report_reads_the_compiled_loop(method, target, qk, pv, specialized, tma):
    """`python -m fp4video.kernels.report`: the loop the dispatch picks on the target, compiled for
    it, its MMA kinds read from the PTX, a SASS instruction count of its main loop (of a
    warp-specialized loop by Triton, every partition's loop by its warps — the softmax, the row
    statistics, the correction, the MMAs', the TMA copies' — and the softmax loop's apart), the
    spill accesses in those loops, its memory."""
    import json

    from fp4video.kernels.launch import SHARED_MEMORY_LIMIT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fp4video.kernels.report", "--target", target, "--method", method,
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    compiled(run, int(target[3:]))
    assert run.returncode == 0, run.stderr[-2000:]
    rep = json.loads(run.stdout.strip().splitlines()[0])
    assert (rep["qk_mma_kind"], rep["pv_mma_kind"], rep["warp_specialized"]) == (qk, pv, specialized), rep
    triton_ws = specialized and target != "sm_90"  # (sm_90's is the Gluon kernel: one warpgroup's loop)
    assert rep["instructions_source"] == ("SASS, all partitions' loops" if triton_ws else "SASS"), rep
    assert 4 < rep["instructions_per_element"] < 60 and rep["tma"] == tma, rep
    assert rep["loop_local_accesses"] >= 0, rep
    if triton_ws:  # every partition's key loop counted, each by its warps: more than the softmax loop alone
        roles = sorted(p["role"] for p in rep["partitions"])
        assert roles.count("mma") == 1 and roles.count("tma") == 1 and "vector" in roles, rep
        assert rep["instructions_per_element"] > rep["softmax_partition_instructions_per_element"] > 2, rep
        assert rep["loop_local_accesses"] == sum(p["local_accesses_per_tile"] for p in rep["partitions"]), rep
    else:
        assert rep["partitions"] is None and rep["softmax_partition_instructions_per_element"] is None, rep
    assert 0 < rep["shared_memory_bytes"] <= SHARED_MEMORY_LIMIT[target], rep
    assert (rep["tensor_memory_columns"] > 0) == (target == "sm_100"), rep


@pytest.mark.parametrize("method, target", [("mxattn", "sm_100"), ("sage3", "sm_100"), ("mxattn-pv8", "sm_100"),
                                            ("mxattn", "sm_120"), ("mxattn-pv8", "sm_120")])
def test_sparse_scaled_loop_compiles_as_the_dense_one(method, target):
    """`python -m fp4video.kernels.report --sparse`: the dot_scaled loop's block-sparse form (key
    tiles from a list) compiles where the dense one runs, with its MMA kinds, its warp
    specialization (sm_100: the TMA partition loads each listed tile's index) and no spill access
    in the key loops where the dense loop has none."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    reps = []
    for extra in ([], ["--sparse"]):
        run = subprocess.run([sys.executable, "-m", "fp4video.kernels.report", "--target", target, "--method", method,
                              "--json", *extra], capture_output=True, text=True, env=env, timeout=600)
        compiled(run, int(target[3:]))
        reps.append(json.loads(run.stdout.strip().splitlines()[0]))
    dense, sparse = reps
    if not dense["loop"].startswith("loop_scaled"):
        pytest.skip(f"the plan runs {dense['loop']} on {target} with this Triton")
    for key in ("loop", "qk_mma_kind", "pv_mma_kind", "warp_specialized", "tma", "num_warps", "num_stages"):
        assert sparse[key] == dense[key], (key, dense, sparse)
    assert sparse["loop_local_accesses"] == 0 or dense["loop_local_accesses"] > 0, (dense, sparse)
    if sparse["partitions"]:
        assert sorted(p["role"] for p in sparse["partitions"]) == sorted(p["role"] for p in dense["partitions"])


def test_partition_loops_pair_by_role():
    """The report's pairing of SASS key loops with a warp-specialized loop's partitions (TTGIR):
    by role (the MMA-issuing loop, the TMA-issuing loop, the rest), partitions with no key loop, or
    a key loop that only counts its phase, left out; no pairing where the counts per role differ or vector partitions differ in size."""
    import collections

    from fp4video.kernels.offline import loop_role, partition_issue, ttgir_partitions

    ttgir = """
    ttg.warp_specialize(%a) attributes {requestedRegisters = array<i32: 88, 24>}
    default {
      scf.for %i = ... {
        %x = math.exp2 %y
      } {tt.warp_specialize}
    }
    partition0(%b: i32) num_warps(4) {
      scf.for %i = ... {
        ttng.tc_gen5_mma %q, %k
      } {tt.disallow_acc_multi_buffer, tt.warp_specialize}
    }
    partition1(%b: i32) num_warps(2) {
      scf.for %i = ... {
        ttng.async_tma_copy_global_to_local %K
      } {tt.warp_specialize}
    }
    partition2(%b: i32) num_warps(4) {
      ttg.warp_return
    }
    partition3(%b: i32) num_warps(4) {
      %r = scf.for %i = ... iter_args(%p = %c1) -> (i32) : i32 {
        %q = arith.xori %p, %c1 : i32
        scf.yield %q : i32
      } {tt.warp_specialize}
      ttg.warp_return
    }
    """
    parts = ttgir_partitions(ttgir, 8)
    assert parts == [("vector", 8), ("mma", 4), ("tma", 2)]
    softmax = collections.Counter({"MUFU.EX2": 64, "FFMA": 64, "STL.64": 2})
    mma = collections.Counter({"UTCQMMA": 2, "UIADD3": 30})
    tma = collections.Counter({"UTMALDG.2D": 2, "UIADD3": 30})
    assert [loop_role(o) for o in (softmax, mma, tma)] == ["vector", "mma", "tma"]
    paired = partition_issue([mma, softmax, tma], parts)
    assert [(r, w) for r, w, _ in paired] == [("mma", 4), ("vector", 8), ("tma", 2)]
    assert partition_issue([softmax, tma], parts) is None  # the MMA loop missing
    assert partition_issue([softmax, softmax, mma, tma], parts + [("vector", 4)]) is None  # 8 and 4 warps: open


@pytest.mark.parametrize("method, most", [("mxattn", 8.1), ("mxfp4-ocp", 7.8), ("nvfp4", 8.45), ("sage3", 8.8),
                                          ("sage3-hpnq", 9.6), ("mxattn-pv8", 9.4)])
def test_sm100_partitions_keep_the_logits_with_the_softmax(method, most):
    """sm_100's warp-specialized loop, compiled offline: no partition's loop spills (the S tile or
    the accumulator), none hands S to another through shared memory (as Triton's partitioner did while the block maxima's exp2
    was one ``tl.exp2`` of more than 256 elements: 138-158 spill accesses a key tile in a 24-register
    partition and 113-189 KB of shared memory; and ``sage3-hpnq``'s scaled P̃, 118 KB, while its
    PNQ row sum was multiplied by the two-level factor the correction partition computes); the MMA
    partition is one warp (the block scales reach tensor memory by ``tcgen05.cp`` from their TMA
    boxes, not through four warps' registers); and the instructions over all partitions stay within
    what is reached with the exp2 arguments, NVFP4's block reciprocals and PNQ's block sums two lanes
    an instruction, PNQ's block sums by table look-ups, and the exponents as the loop runs them
    within the fast logit bound (MXFP4, single-level NVFP4 and FP8 P: a logit's difference from the
    row maximum, then the tile's shift, a multiply and two adds per element; two-level NVFP4 P: one
    FMA, two lanes an instruction)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fp4video.kernels.report", "--target", "sm_100", "--method", method,
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    compiled(run, 100)
    assert run.returncode == 0, run.stderr[-2000:]
    rep = json.loads(run.stdout.strip().splitlines()[0])
    assert rep["instructions_source"] == "SASS, all partitions' loops", rep
    assert rep["loop_local_accesses"] == 0 and all(p["local_accesses_per_tile"] == 0 for p in rep["partitions"]), rep
    assert rep["shared_memory_bytes"] < 66 * 1024, rep
    assert [p["warps"] for p in rep["partitions"] if p["role"] == "mma"] == [1], rep
    assert rep["instructions_per_element"] <= most, rep


#: SASS instructions per element of S (every partition's key loop, by its warps) that the FP4-P·V
#: loops of each Blackwell family may issue (the performance model's budgets), with no spill access in
#: the key loops
LOOP_BUDGETS = {"sm_100": 10.0, "sm_120": 16.0}


@pytest.mark.parametrize("target", ["sm_100", "sm_120"])
def test_nvfp4_two_level_loops_stay_within_the_blackwell_budgets(target):
    """``sage3`` and ``sage3-hpnq`` on the dot_scaled loop the dispatch runs on each Blackwell family,
    compiled offline as a call within the fast logit bound runs it: at most ``LOOP_BUDGETS``
    instructions per element of S and no spill access in the key loops (no partition's, on sm_100).
    With the exact exponents (a product, then the difference from the row maximum) on every call,
    ``sage3-hpnq`` issued 10.47 on sm_100 and 16.47 on sm_120, and ``sage3`` spilled 5 accesses a key
    tile on sm_120; the fused exponents (one FMA, :func:`fp4video.kernels.scaled_math.nv_p`) and, on
    sm_100, PNQ's block sums by table look-ups (:func:`fp4video.kernels.fp4_math.e2m1_block_sums_lut`)
    bring them back."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fp4video.kernels.report", "--target", target, "--method", "sage3",
                          "sage3-hpnq", "--json"], capture_output=True, text=True, env=env, timeout=600)
    compiled(run, int(target[3:]))
    reps = [json.loads(line) for line in run.stdout.strip().splitlines()]
    assert [r["method"] for r in reps] == ["sage3", "sage3-hpnq"], run.stdout
    for rep in reps:
        if not rep["loop"].startswith("loop_scaled"):
            pytest.skip(f"the plan runs {rep['loop']} on {target} with this Triton")
        assert rep["instructions_source"].startswith("SASS"), rep
        assert rep["instructions_per_element"] <= LOOP_BUDGETS[target], rep
        assert rep["loop_local_accesses"] == 0, rep
        assert all(p["local_accesses_per_tile"] == 0 for p in rep["partitions"] or []), rep


#: compiles a method's loop for sm_100 as the dispatch runs it and prints, for each inline asm of
#: PNQ's block sums (e2m1_block_sums_lut: its table look-ups, more than four bytes a call), its
#: packing and the layout definition of its operand, and whether the two-lane fp32 asm is there
BLOCK_SUM_LAYOUT = """
import re
from fp4video.kernels.report import compile_loop
ttgir = compile_loop({method!r}, 100)[1].asm["ttgir"]
for m in re.finditer(r'tt\\.elementwise_inline_asm "([^"]*)" \\{{[^}}]*packed_element = (\\d+)[^}}]*\\}} %\\w+ : tensor<[^,]*, (#\\w+)>', ttgir):
    if "prmt.b32" in m.group(1) and "dp4a" in m.group(1) and int(m.group(2)) > 4:
        print("BLOCK", m.group(2), re.search(rf"^{{m.group(3)}} = (.*)$", ttgir, re.M).group(1))
print("F32X2", "fma.rn.f32x2" in ttgir)
"""


def _column_bases(layout: str) -> tuple[list[int], list[int]]:
    """(columns of the register bases in order, columns of every other basis) of a 2-d TTGIR
    layout: a linear layout's bases, or a blocked layout's (order [1, 0]) written as such."""
    if layout.startswith("#ttg.linear"):
        bases = {k: [int(c) for c in re.findall(r"\[\d+, (\d+)\]", v)]
                 for k, v in re.findall(r"(\w+) = \[((?:\[\d+, \d+\](?:, )?)*)\]", layout)}
        return bases["register"], bases["lane"] + bases["warp"] + bases.get("block", [])
    per_thread = [int(x) for x in re.search(r"sizePerThread = \[(\d+), (\d+)\]", layout).groups()]
    assert re.search(r"order = \[1, 0\]", layout), layout
    lanes = [int(x) for x in re.search(r"threadsPerWarp = \[(\d+), (\d+)\]", layout).groups()]
    regs = [1 << i for i in range(per_thread[1].bit_length() - 1)]
    return regs, [per_thread[1] << i for i in range(lanes[1].bit_length() - 1)]


@pytest.mark.parametrize("method, pack", [("mxattn", 16), ("sage3-hpnq", 8)])
def test_sm100_block_sums_get_whole_blocks_in_order(method, pack):
    """PNQ's block sums on sm_100 (:func:`.fp4_math.e2m1_block_sums_lut`) add the codes of ``pack``
    consecutive bytes a call: that is a block only where the operand's layout gives each thread a
    block's bytes as its first registers, in key order (register bases 1, 2, 4, ... columns) and
    every other basis moves by whole blocks. Read off the compiled loop's TTGIR; the loop also
    computes its exp2 arguments two lanes an instruction (``fma.rn.f32x2``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", BLOCK_SUM_LAYOUT.format(method=method)], capture_output=True,
                         text=True, env=env, timeout=600)
    compiled(run, 100)
    assert run.returncode == 0, run.stderr[-2000:]
    found = [line.split(" ", 2) for line in run.stdout.splitlines() if line.startswith("BLOCK")]
    assert found and "F32X2 True" in run.stdout, run.stdout
    for _, packed, layout in found:
        assert int(packed) == pack, (packed, layout)
        regs, others = _column_bases(layout)
        steps = pack.bit_length() - 1
        assert regs[:steps] == [1 << i for i in range(steps)], layout
        assert all(c % pack == 0 for c in regs[steps:] + others), layout


def test_column_bases_reads_linear_and_blocked_layouts():
    """The layout reader of the test above, on the two spellings."""
    linear = ("#ttg.linear<{register = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]], lane = [[1, 0], [2, 0], [4, 0], "
              "[8, 0], [16, 0]], warp = [[32, 0], [64, 0], [0, 32]], block = []}>")
    assert _column_bases(linear) == ([1, 2, 4, 8, 16], [0, 0, 0, 0, 0, 0, 0, 32])
    blocked = "#ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [8, 1], order = [1, 0]}>"
    assert _column_bases(blocked) == ([1, 2, 4], [8, 16, 32])


#: compiles the Gluon NVFP4 loop the dispatch runs METHOD with on sm_90, masked or not, and prints
#: the local-memory accesses of each warpgroup's key loop (the partitions' SASS key loops that issue MMAs)
SM90_LOOP_SPILLS = """
import tempfile
from fp4video.kernels.offline import WAN_480P_INTS, compile_kernel, sass_lines, sass_loops, tool_path
from fp4video.kernels.report import local_accesses, loop_kernel
name, fn, consts, ptr, _, options, gluon = loop_kernel({method!r}, 90)
assert name == "loop_nvfp4_sm90._nv_attn_fwd_sm90" and gluon, name
ints = dict(WAN_480P_INTS, smb=WAN_480P_INTS["SK"] if {masked!r} else 1)
kernel = compile_kernel(fn, dict(consts, HAS_MASK={masked!r}), ptr, ints, arch=90, floats=("scale_log2",), gluon=True,
                        **options)
with tempfile.TemporaryDirectory() as tmp:
    lines = sass_lines(kernel, tool_path("nvdisasm"), tmp)
print("SPILLS", [local_accesses(ops) for ops in sass_loops(lines) if any("GMMA" in op for op in ops)])
"""


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("method", ["sage3", "nvfp4", "sage3-hpnq"])
def test_sm90_gluon_loop_is_spill_free_in_both_warpgroups(method, masked):
    """The Gluon NVFP4 loop the dispatch runs on Hopper, compiled offline as launched (head dim 128,
    with and without a key-padding mask): each warpgroup's key loop (one in the default partition,
    one in a worker) touches no local memory. On the H200 (Triton 3.6, 2026-12-03), warp-specialized
    Gluon e4m3 loops whose consumer partitions spilled (16-18 spill loads a key tile) computed wrong
    row sums — every output row right up to a scale, the LSE off — where the same structure without
    spills matched the Triton loop bit for bit (docs/history.md); a spill here is a reason to distrust
    the loop, not only a cost."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SM90_LOOP_SPILLS.format(method=method, masked=masked)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    spills = [int(n) for n in re.search(r"SPILLS \[(.*)\]", run.stdout).group(1).split(",")]
    # (a worker's loop may also be counted inside the loop that dispatches the partitions)
    assert len(spills) >= 2 and not any(spills), f"local-memory accesses per key tile in the MMA loops: {spills}"
