"""What Triton's CPU interpreter computes differently from a GPU, probed at run time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_scaled_probe(A, S, Out):
    """One 16 × 64 by 64 × 16 NVFP4 product: every code 2 (the value 1.0), every E4M3 scale byte
    0x38 (1.0): each output is 64."""
    rows, half, groups = tl.arange(0, 16), tl.arange(0, 32), tl.arange(0, 4)
    a = tl.load(A + rows[:, None] * 32 + half[None, :])
    s = tl.load(S + rows[:, None] * 4 + groups[None, :]).to(tl.float8e4nv, bitcast=True)
    tl.store(Out + rows[:, None] * 16 + rows[None, :], tl.dot_scaled(a, s, "e2m1", tl.trans(a), s, "e2m1"))


def interpreter_reads_e4m3_scales() -> bool:
    """Whether Triton's CPU interpreter computes ``tl.dot_scaled`` with E4M3 scales as the GPU does
    (Triton 3.9's decodes every scale as E8M0: an NVFP4 product then comes out wrong). Runs one
    tiny product; call it only under ``TRITON_INTERPRET=1``."""
    a = torch.full((16, 32), 0x22, dtype=torch.uint8)  # two codes 2 (1.0) per byte
    s = torch.full((16, 4), 0x38, dtype=torch.uint8)  # E4M3 1.0
    out = torch.zeros(16, 16)
    try:
        _e4m3_scaled_probe[(1,)](a, s, out)
    except Exception:  # an interpreter without dot_scaled
        return False
    return bool((out == 64.0).all())
