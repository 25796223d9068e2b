"""Launch settings: frozen objects, each with the reason for it, and the shared-memory
limits that decide how many software-pipelining stages fit a GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


#: The architectures fp4video's launch tables are compiled for (offline, Triton 3.9, head dim 128):
#: Hopper, datacenter Blackwell (B200 / GB200), consumer and workstation Blackwell (RTX 50, PRO 6000).
TABLE_ARCHS = ("sm_90", "sm_100", "sm_120")


def device_arch(device: torch.device) -> str | None:
    """``"sm_90"``, ``"sm_100"``, ... for a CUDA device; None elsewhere (the CPU interpreter)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def arch_capability(arch: str) -> tuple[int, int]:
    """(major, minor) of ``"sm_90"``, ``"sm_100"``, ``"sm_121"``, ... (the last digit is the minor)."""
    return int(arch[3:-1]), int(arch[-1])


def table_arch(arch: str | None) -> str:
    """The launch table an architecture uses: its own where fp4video has one (:data:`TABLE_ARCHS`);
    an architecture not named takes its family's (sm_10x and sm_11x — B300, Thor: 228 KB of shared
    memory per SM as sm_100 — sm_100's; sm_12x — DGX Spark's sm_121: ~100 KB — sm_120's), and
    everything else (Ampere, Ada, the interpreter) sm_90's, whose figures are what its kernels need."""
    if arch in TABLE_ARCHS:
        return arch
    major = arch_capability(arch)[0] if arch and arch.startswith("sm_") else 0
    return "sm_100" if major in (10, 11) else "sm_120" if major == 12 else "sm_90"


#: Shared memory per SM (bytes) by architecture (others: 100 KB, as Ada and sm_86).
SHARED_MEMORY_PER_SM = {"sm_80": 164 << 10, "sm_90": 228 << 10, "sm_100": 228 << 10, "sm_120": 100 << 10}


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on this GPU: the SM's less the 1 KB CUDA keeps
    (H100/H200 and B200 227 KB, A100 163 KB, Ada, sm_86 and sm_120 99 KB); unlimited in the CPU
    interpreter."""
    if device.type != "cuda":
        return 1 << 30
    per_sm = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", None)
    if per_sm is None:  # older torch: by architecture
        per_sm = SHARED_MEMORY_PER_SM.get(device_arch(device), 100 << 10)
    return per_sm - (1 << 10)


#: Shared memory one program may use (bytes) on each architecture of :data:`TABLE_ARCHS`: the SM's
#: less the 1 KB CUDA keeps.
SHARED_MEMORY_LIMIT = {arch: SHARED_MEMORY_PER_SM[arch] - (1 << 10) for arch in TABLE_ARCHS}


def stages_that_fit(arch: str | None, limit: int, stages: int, need: dict[str, dict[int, int]]) -> int:
    """The most software-pipelining stages, up to ``stages``, whose shared memory ``need[table][s]``
    (bytes, offline compiles for that architecture; :func:`table_arch` picks the table, sm_90's where
    a kernel has none for it; a stage count a table lacks is taken to fit) is within ``limit``."""
    table = need.get(table_arch(arch)) or need.get("sm_90", {})
    return max([s for s in range(1, stages + 1) if table.get(s, 0) <= limit] or [1])


def fitting_stages(device: torch.device, stages: int, need: dict[str, dict[int, int]]) -> int:
    """:func:`stages_that_fit` for this GPU."""
    return stages_that_fit(device_arch(device), shared_memory_per_block(device), stages, need)


@dataclass(frozen=True)
class LoopLaunch:
    """How one attention loop is launched: rows per program, warps (both may differ by
    architecture: ``shapes``), pipelining stages (at most: fewer where they do not fit,
    :meth:`resolve`), the shared memory each number of stages needs per architecture (offline
    compiles at head dim 128, :data:`TABLE_ARCHS`), a register cap (None: ptxas decides) and why."""

    block_m: int
    num_warps: int
    num_stages: int
    shared_memory: dict[str, dict[int, int]] = field(default_factory=dict, hash=False, compare=False)
    max_registers: int | None = None
    reason: str = ""
    #: (rows per program, warps) for the architectures (:func:`table_arch`'s tables) where they differ
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict, hash=False, compare=False)

    def shape(self, arch: str | None) -> tuple[int, int]:
        """(rows per program, warps) on ``arch`` (``"sm_120"``, ...; None: the CPU interpreter)."""
        return self.shapes.get(table_arch(arch), (self.block_m, self.num_warps))

    def resolve(self, device: torch.device, block_m=None, num_warps=None, num_stages=None) -> tuple[int, int, int]:
        """(block_m, num_warps, num_stages) for this device, a caller's explicit values first."""
        stages = num_stages or fitting_stages(device, self.num_stages, self.shared_memory)
        rows, warps = self.shape(device_arch(device))
        return block_m or rows, num_warps or warps, stages
