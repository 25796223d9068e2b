"""Launch settings: frozen objects, each with the reason it was chosen, and the shared-memory
limits that decide how many software-pipelining stages fit a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class LoopLaunch:
    """How one attention loop is launched: rows per program, warps, pipelining stages (at most:
    fewer where they do not fit, :meth:`resolve`), the shared memory each number of stages needs
    (offline sm_90 compiles, head dim 128), a register cap (None: ptxas decides) and why."""

    block_m: int
    num_warps: int
    num_stages: int
    shared_memory: dict[int, int] = field(default_factory=dict, hash=False, compare=False)
    max_registers: int | None = None
    reason: str = ""

    def resolve(self, device: torch.device, block_m=None, num_warps=None, num_stages=None) -> tuple[int, int, int]:
        """(block_m, num_warps, num_stages) for this device, a caller's explicit values first."""
        stages = num_stages or fitting_stages(device, self.num_stages, self.shared_memory)
        return block_m or self.block_m, num_warps or self.num_warps, stages


def tma_unsupported_reason(device: torch.device) -> str | None:
    """Why a loop cannot read its tiles by TMA on this device, or None: TMA needs sm_90+ (Hopper's
    bulk tensor copies; Ada, sm_89, has none) and a Triton with host tensor descriptors (3.3+)."""
    if device.type != "cuda":
        return f"not a CUDA device ({device})"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"sm_{cap[0]}{cap[1]} has no TMA (sm_90+)"
    import importlib.util

    if importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
        return "this Triton has no host tensor descriptors (3.3+)"
    return None
