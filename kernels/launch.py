"""Launch limits shared by the kernels: how many software-pipelining stages fit a GPU's shared memory."""

from __future__ import annotations

import torch


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on this GPU: the SM's less the 1 KB CUDA keeps
    (H100/H200 227 KB, A100 163 KB, Ada and sm_86 99 KB); unlimited in the CPU interpreter."""
    if device.type != "cuda":
        return 1 << 30
    per_sm = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", None)
    if per_sm is None:  # older torch: by capability
        cap = torch.cuda.get_device_capability(device)
        per_sm = {(8, 0): 164 << 10, (9, 0): 228 << 10, (10, 0): 228 << 10}.get(cap, 100 << 10)
    return per_sm - (1 << 10)


def fitting_stages(device: torch.device, stages: int, need: dict[int, int]) -> int:
    """The most software-pipelining stages, up to ``stages``, whose shared memory ``need[s]`` (bytes,
    from offline sm_90 compiles at head dim 128; smaller head dims need less) fits this GPU."""
    limit = shared_memory_per_block(device)
    return max([s for s in range(1, stages + 1) if need.get(s, 0) <= limit] or [1])
