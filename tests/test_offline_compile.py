"""The kernels compiled offline for GPUs this machine does not have: the Blackwell loop's native FP4
MMAs (sm_100, sm_120)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("triton")

#: compiles the dot_scaled loop (head dim 128, UOS + PNQ, a key-padding mask) for sm_{arch} and prints its PTX
SCALED_PTX = """
import sys
sys.path.insert(0, {tools!r})
from offline_compile import compile_kernel
from fp4video.formats import ScaleRule
from fp4video.kernels.loop_scaled import _mx_scaled_attn_fwd as fn
ptr = dict(Q4="*u8", QS="*u8", K4="*u8", KS="*u8", V4T="*u8", VS="*u8", KeyMask="*i8", Out="*bf16", Lse="*fp32")
consts = dict(HAS_MASK=True, OCP=False, QMAX=ScaleRule.UOS.qmax, PNQ=True, D=128, BLOCK_DV=128, BLOCK_M=128,
              BLOCK_N=128, QB=32)
ints = dict(sqs=64, sks=64, svd=2048, svsd=128, SQ=4096, SK_PAD=4096)  # 16-divisible, as real launches are
print(compile_kernel(fn, consts, ptr, ints, arch={arch}, floats=("scale_log2",), num_warps=8, num_stages=2).asm["ptx"])
"""


@pytest.mark.parametrize("arch, instruction", [(100, "tcgen05.mma"), (120, "mma.sync")])
def test_scaled_kernel_compiles_to_native_fp4_mma(arch, instruction):
    """The Blackwell check without a Blackwell GPU: compile the dot_scaled kernel for sm_100 /
    sm_120 and read the PTX: both matrix products use the native MXFP4 MMA (E2M1 operands, UE8M0
    block-32 scales), and no bf16 MMA (the emulation) is left."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    code = SCALED_PTX.format(tools=str(ROOT / "tools"), arch=arch)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0:
        pytest.skip(f"this Triton cannot compile for sm_{arch}: {run.stderr.strip().splitlines()[-1:]}")
    ptx = run.stdout
    mmas = re.findall(rf"{re.escape(instruction)}[.\w:]*", ptx)
    assert len(mmas) >= 2 and all("kind::mxf4" in m and "block_scale" in m for m in mmas), sorted(set(mmas))
    assert not re.search(r"(wgmma|mma)[.\w]*\.bf16", ptx), "an MMA fell back to bf16 (emulation)"
