"""Which loop runs a call: one ladder, :func:`plan_on`, that reads the architecture, the recipe's
formats, the installed Triton and the environment overrides, and returns a frozen :class:`Plan` —
the loop, the pre-pass's operand layout and the launch form. The call (:func:`.dispatch.attention`),
``fp4video check`` and the offline report all read the same plan.

Every environment override of the kernels is read here:

======================  ==================================  ===============================================
variable                values                              effect
======================  ==================================  ===============================================
``FP4VIDEO_MX_KERNEL``  ``scaled`` | ``fp8`` | ``bf16``     the MXFP4 loop (default: ``scaled`` on sm_100
                                                            and sm_120, ``fp8`` on other sm_89+ GPUs and
                                                            in the interpreter, else ``bf16``)
``FP4VIDEO_MX_TMA``     ``0`` | ``1``                       the e4m3 loop's tiles (and on sm_100 the
                                                            dot_scaled loop's codes, which then also runs
                                                            without warp specialization) by pointer loads
                                                            (0), or TMA required (1; an error where it
                                                            cannot run)
``FP4VIDEO_NV_KERNEL``  ``scaled`` | ``sm90`` | ``triton``  the NVFP4 loop (default: ``scaled`` — native
                                                            FP4 MMAs — on sm_100 and sm_120, ``sm90`` on
                                                            Hopper at head dims 128, else ``triton``)
======================  ==================================  ===============================================

The loops, one module each: ``loop_e4m3`` (MXFP4 and FP8 on e4m3 tensor cores, sm_89+),
``loop_scaled`` (``tl.dot_scaled``: Blackwell's native FP4 MMAs; a kernel module per variant), ``loop_nvfp4`` and
``loop_nvfp4_sm90`` (NVFP4 on bf16 tensor cores; the Gluon ping-pong on Hopper), ``loop_bf16``
(``fp16``, and MXFP4 where nothing faster runs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

import torch

from fp4video.formats import Format
from fp4video.recipe import AttentionRecipe
from fp4video.reference import qk_padded_dim

from .launch import arch_capability, device_arch

__all__ = ["Plan", "plan", "plan_on", "ENVIRONMENT", "NATIVE_FP4_MIN_TRITON", "NV_EMULATED_MIN_TRITON",
           "interpreting", "triton_version"]

#: every environment variable the kernels read, with the values each accepts
ENVIRONMENT = {
    "FP4VIDEO_MX_KERNEL": ("scaled", "fp8", "bf16"),
    "FP4VIDEO_MX_TMA": ("0", "1"),
    "FP4VIDEO_NV_KERNEL": ("scaled", "sm90", "triton"),
}

#: Architectures whose native FP4 MMAs the ``scaled`` loop is compiled for and checked offline
#: (``tests/test_offline_compile.py``: ``tcgen05.mma kind::mxf4`` / ``kind::mxf4nvf4 … block16`` on
#: sm_100, ``mma.sync kind::mxf4nvf4`` on sm_120), with the oldest Triton that compiles it there:
#: Triton 3.6, 3.7 and 3.8 fail on sm_100 (``'ttng.tmem_alloc' op uninitialized alloc must have a
#: mutable memdesc type``; the NVFP4 form also in ``TritonGPUAccelerateMatmul``), 3.9 compiles it;
#: on sm_120 3.6 to 3.9 all do. Other Blackwell-generation GPUs (sm_103, sm_110, sm_121), and these
#: with an older Triton, run the e4m3 loop (MXFP4; its FP8 MMAs every sm_89+ GPU has) or the bf16
#: NVFP4 loop until the native loop is checked there (``FP4VIDEO_MX_KERNEL=scaled`` /
#: ``FP4VIDEO_NV_KERNEL=scaled`` try it).
NATIVE_FP4_MIN_TRITON = {"sm_100": (3, 9), "sm_120": (3, 6)}

#: The oldest Triton that compiles the NVFP4 form of the dot_scaled loop where Triton emulates
#: ``dot_scaled`` (off Blackwell: sm_90 checked; 3.6 and 3.7 fail in ``TritonGPUAccelerateMatmul``)
NV_EMULATED_MIN_TRITON = (3, 8)

#: compute-capability majors whose dot_scaled loop runs warp-specialized by TMA (datacenter
#: Blackwell's ``tcgen05`` MMAs, which Triton splits into load, MMA, correction and softmax
#: partitions; consumer Blackwell's ``mma.sync`` loop gets no MMA partition and keeps pointer loads)
WS_MAJORS = (10, 11)

#: (head dim, value head dim) the Gluon NVFP4 loop runs by default on Hopper: the shapes the GPU
#: tests check against the Triton loop element for element; others take the Triton loop unless
#: ``FP4VIDEO_NV_KERNEL=sm90``
SM90_DEFAULT_SHAPES = {(128, 128)}

LOOPS = ("e4m3", "scaled", "nvfp4", "nvfp4_sm90", "bf16")
OPERANDS = ("fp8", "packed", "tiles", "work", "inputs")
KEY_ORDERS = ("key", "tile", "quad")


@dataclass(frozen=True)
class Plan:
    """How the kernels run one kind of call.

    ``loop``: the loop (``kernels/loop_<loop>.py``), None where the kernels cannot run the call
    (``reason`` says why). ``operands``: what the pre-pass hands it — ``"fp8"`` (E4M3 codes with
    power-of-two factors), ``"packed"`` (E2M1 codes with block scales), ``"tiles"`` (16-bit values,
    K̂ and V̂ in tile key order), ``"work"`` (16-bit values), ``"inputs"`` (the inputs themselves, in
    ``work_dtype`` where one is given).
    ``tma``: K̂/V̂ tiles by TMA; ``warp_specialized``: the dot_scaled loop's partitioned form;
    ``key_order``: K̂'s rows in key order, in ``"tile"`` key order (TMA boxes of the e4m3 loop) or
    in the ``"quad"`` order (consumer Blackwell's dot_scaled loop). ``v_window``: the loop is exact
    only while V's channels fit the e4m3 window — the call reads that back with its checks and runs
    :attr:`fallback` where they do not. ``work_dtype``: the dtype of ``"work"`` and ``"tiles"``
    operands (bf16; fp32 in the interpreter, which has no bf16 matmul).
    """

    loop: str | None
    operands: str | None = None
    arch: str | None = None
    tma: bool = False
    warp_specialized: bool = False
    key_order: str = "key"
    v_window: bool = False
    work_dtype: torch.dtype | None = None
    reason: str = ""

    def __post_init__(self):
        if self.loop is not None and (self.loop not in LOOPS or self.operands not in OPERANDS
                                      or self.key_order not in KEY_ORDERS):
            raise ValueError(f"not a plan: loop {self.loop!r}, operands {self.operands!r}, key order "
                             f"{self.key_order!r} (loops {LOOPS}, operands {OPERANDS}, key orders {KEY_ORDERS})")

    @property
    def runnable(self) -> bool:
        return self.loop is not None

    @property
    def fallback(self) -> Plan | None:
        """The plan where V's channels span wider than the e4m3 window (``v_window``): the bf16
        loop on 16-bit operands, exact at any span."""
        if not self.v_window:
            return None
        return Plan("bf16", "work", self.arch, work_dtype=self.work_dtype,
                    reason="V's channels span more binades than the e4m3 loop's window: the bf16 loop, exact")

    @property
    def module(self) -> str | None:
        """The loop's module name in ``kernels/``."""
        return None if self.loop is None else f"loop_{self.loop}"

    def form(self) -> str:
        """The loop and its form, e.g. ``loop_e4m3 (TMA, K̂ in tile key order)`` (``none``: no loop)."""
        if self.loop is None:
            return "none"
        form = [w for w, on in (("warp-specialized", self.warp_specialized), ("TMA", self.tma),
                                (f"K̂ in {self.key_order} key order", self.key_order != "key")) if on]
        return self.module + (f" ({', '.join(form)})" if form else "")

    def describe(self) -> str:
        """One line: the loop, its form and why."""
        return self.form() + (f": {self.reason}" if self.reason else "")

    @property
    def sparse_reason(self) -> str | None:
        """Why this plan's loop cannot run a block-sparse call (None: it can, and so can its fallback)."""
        if self.loop is None:
            return self.reason
        if self.loop not in SPARSE_LOOPS:
            return f"the {self.module} loop takes no key-tile selection (block-sparse loops: " \
                   f"{', '.join(sorted(SPARSE_LOOPS))})"
        return None

    def replace(self, **changes) -> Plan:
        """A copy with ``changes`` (tests and tools run a loop's other forms this way)."""
        return dataclasses.replace(self, **changes)


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _env(name: str) -> str | None:
    """The override ``name`` if set (checked against :data:`ENVIRONMENT`), else None."""
    value = os.environ.get(name) or None
    if value is not None and value not in ENVIRONMENT[name]:
        *rest, last = (repr(v) for v in ENVIRONMENT[name])
        raise ValueError(f"{name} must be {', '.join(rest)} or {last}, got {value!r}")
    return value


def tma_reason(arch: str | None) -> str | None:
    """Why a loop cannot read its tiles by TMA on ``arch``, or None: TMA needs sm_90+ (Hopper's bulk
    tensor copies; Ada, sm_89, has none) and a Triton with host tensor descriptors (3.3+)."""
    if arch is None or not arch.startswith("sm_"):
        return "not a CUDA device"
    if arch_capability(arch) < (9, 0):
        return f"{arch} has no TMA (sm_90+)"
    import importlib.util

    if importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
        return "this Triton has no host tensor descriptors (3.3+)"
    return None


def pointer_loop_reason(arch: str | None, recipe: AttentionRecipe, loop: str = "the pointer-load e4m3 loop") -> str | None:
    """Why a pointer-load loop must not run this recipe on ``arch``, or None. On Hopper (sm_90) the
    loop's P̂·V̂ is an asynchronous warpgroup MMA reading P̂ from registers, which Triton does not
    keep reserved until the MMA completes; with P̂ in E4M3 (the FP8-P·V methods) the registers are
    reused under it, and rows come out wrong (zeros or off, different rows run to run); the TMA loop
    is right (``tests/test_loops.py``), and the dot_scaled loop's FP8-P·V form has the same fault.
    Elsewhere the loops' MMAs do not read P̂ asynchronously from registers (Ada's and consumer
    Blackwell's ``mma.sync`` is synchronous; datacenter Blackwell's ``tcgen05`` reads memory)."""
    if recipe.pv_format is not Format.E4M3 or arch is None or not arch.startswith("sm_"):
        return None
    if arch_capability(arch)[0] == 9:
        return (f"on Hopper {loop} computes wrong rows for the FP8-P·V methods (an asynchronous "
                "MMA's register operand is not kept reserved); they run the e4m3 loop by TMA there")
    return None


def _native_fp4(arch: str | None, version: tuple[int, int]) -> bool:
    return arch in NATIVE_FP4_MIN_TRITON and version >= NATIVE_FP4_MIN_TRITON[arch]


def gluon_reason(arch: str | None, dtype: torch.dtype, d: int, dv: int) -> str | None:
    """Why the Gluon NVFP4 loop cannot run these pre-pass outputs (head dims ``d`` padded, ``dv``),
    or None: it is built for Hopper (sm_90), bf16 operands, head dims 64 and 128 and a power-of-two
    value head dim up to 128, with a Triton that has Gluon's Hopper API (3.5+)."""
    if arch != "sm_90":
        return f"it runs on sm_90 (Hopper) GPUs only, not {arch or 'the CPU'}"
    if dtype != torch.bfloat16:
        return f"it takes bf16 operands, got {dtype}"
    if d not in (64, 128):
        return f"it takes head dims 64 and 128, got {d}"
    if dv < 16 or dv & (dv - 1) or dv > 128:
        return f"it takes a power-of-two value head dim in [16, 128], got {dv}"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return "this Triton has no Gluon Hopper API (3.5+)"
    return None


#: looked up once at import: torch.compile cannot trace importlib (a graph break inside
#: fp4_attention's backend choice)
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether Triton is installed (looked up once, when this module is imported)."""
    return _TRITON_AVAILABLE


def plan(recipe: AttentionRecipe, q: torch.Tensor, v: torch.Tensor | None = None, mask: torch.Tensor | None = None,
         *, launch_given: bool = False) -> Plan:
    """The plan for a call on ``q``'s device and head dims (``v``: the value head dim, default
    q's), with its mask (key-padding masks ``(B|1, 1, 1, Sk|1)`` only). ``launch_given``: the caller
    sets the Triton loops' launch values (``block_m``, ...), which the Gluon loop does not take."""
    if not triton_available():
        return Plan(None, reason="Triton is not installed (pip install 'fp4video[triton]')")
    if not (q.is_cuda or interpreting()):
        return Plan(None, reason="the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        # (B|1, 1, 1, Sk|1): one key-padding row per batch, which is what the loops' key_alive (B, Sk) holds
        return Plan(None, reason=f"the Triton kernels take key-padding masks (B or 1, 1, 1, Sk or 1) only; this mask "
                                 f"of shape {tuple(mask.shape)} varies over heads or queries")
    arch = device_arch(q.device) if q.is_cuda else "interpreter"
    return plan_on(recipe, arch, head_dim=q.shape[-1], value_dim=(q if v is None else v).shape[-1], dtype=q.dtype,
                   launch_given=launch_given)


def plan_on(recipe: AttentionRecipe, arch: str | None, *, head_dim: int = 128, value_dim: int | None = None,
            dtype: torch.dtype = torch.bfloat16, launch_given: bool = False) -> Plan:
    """The plan on ``arch`` (``"sm_90"``, ``"sm_100"``, ...; ``"interpreter"``: Triton's CPU
    interpreter) with the installed Triton and the environment's overrides."""
    key = (recipe, arch, head_dim, head_dim if value_dim is None else value_dim, dtype, launch_given, triton_version(),
           tuple(_env(name) for name in ENVIRONMENT))
    if arch == "interpreter":  # (not kept: the interpreter's dot_scaled is probed, and tests patch it)
        return _ladder(*key)
    found = _PLANS.get(key)  # (a dict, not functools' cache: torch.compile traces through it as it is)
    if found is None:
        found = _PLANS[key] = _ladder(*key)
    return found


#: plans made so far, by every input of the ladder
_PLANS: dict[tuple, Plan] = {}
#: the loops that visit a block-sparse call's key tiles only (:class:`.operands.KeyTileLists`)
SPARSE_LOOPS = frozenset({"e4m3", "bf16", "scaled"})


def _ladder(recipe: AttentionRecipe, arch: str | None, d: int, dv: int, dtype: torch.dtype, launch_given: bool,
            version: tuple[int, int], overrides: tuple) -> Plan:
    mx_forced, tma_forced, nv_forced = overrides
    gpu = arch is not None and arch.startswith("sm_")
    fp8_cores = arch == "interpreter" or (gpu and arch_capability(arch) >= (8, 9))
    native = _native_fp4(arch, version)
    work = torch.bfloat16 if gpu else torch.float32  # the interpreter has no bf16 matmul
    qk, pv = recipe.qk_format, recipe.pv_format
    base = dict(arch=arch, work_dtype=work)
    version_text = ".".join(map(str, version))

    def e4m3(reason: str) -> Plan:
        """The e4m3 loop: by TMA where it can (K̂ stored in tile key order), else by pointer loads."""
        no_tma = tma_reason(arch)
        if tma_forced == "1" and no_tma:
            raise ValueError(f"FP4VIDEO_MX_TMA=1, but the e4m3 loop cannot copy tiles by TMA here: {no_tma}")
        tma = tma_forced != "0" and no_tma is None
        if not tma and (why := pointer_loop_reason(arch, recipe)):
            raise ValueError(f"{recipe.name} cannot run here ({'FP4VIDEO_MX_TMA=0' if tma_forced == '0' else no_tma}): "
                             f"{why}")
        return Plan("e4m3", "fp8", tma=tma, key_order="tile" if tma else "key", v_window=pv is not Format.E4M3,
                    reason=reason, **base)

    def scaled(reason: str) -> Plan:
        """The dot_scaled loop: warp-specialized by TMA on datacenter Blackwell, K̂ in the quad key
        order on consumer Blackwell (FP4 P·V), pointer loads in key order elsewhere."""
        ws = gpu and arch_capability(arch)[0] in WS_MAJORS and tma_forced != "0" and tma_reason(arch) is None
        quad = pv is not Format.E4M3 and gpu and arch_capability(arch)[0] == 12
        return Plan("scaled", "packed", tma=ws, warp_specialized=ws, key_order="quad" if quad else "key",
                    reason=reason, **base)

    # 1. MXFP4 Q·K with FP8 P·V (mxattn-pv8): Q·K on the native FP4 MMAs where they run
    if qk is Format.MXFP4 and pv is Format.E4M3:
        if mx_forced == "scaled" or native:
            return scaled("FP4 Q·K on native FP4 MMAs" if native else "FP4VIDEO_MX_KERNEL=scaled")
        if fp8_cores:
            return e4m3("FP4 values exact on e4m3 tensor cores")
        return Plan(None, reason=f"{recipe.name}: its E4M3 (FP8) operands run on e4m3 tensor cores (sm_89+), not on "
                                 f"{arch or 'this device'}")
    # 2. E4M3 Q·K and P·V (fp8): the e4m3 loop on every sm_89+ GPU
    if qk is Format.E4M3 and pv is Format.E4M3:
        if fp8_cores:
            return e4m3("E4M3 operands on e4m3 tensor cores")
        return Plan(None, reason=f"{recipe.name}: its E4M3 (FP8) operands run on e4m3 tensor cores (sm_89+), not on "
                                 f"{arch or 'this device'}")
    # 3. MXFP4 Q·K and P·V: native FP4 MMAs, else e4m3 tensor cores, else bf16
    if qk is Format.MXFP4 and pv is Format.MXFP4:
        if mx_forced == "scaled":
            return scaled("FP4VIDEO_MX_KERNEL=scaled")
        if mx_forced == "fp8":
            return e4m3("FP4VIDEO_MX_KERNEL=fp8")
        if mx_forced == "bf16":
            return Plan("bf16", "work", reason="FP4VIDEO_MX_KERNEL=bf16", **base)
        if native:
            return scaled("native FP4 MMAs")
        if fp8_cores:
            return e4m3("FP4 values exact on e4m3 tensor cores")
        return Plan("bf16", "work", reason="no FP8 or FP4 tensor cores: FP4 values on bf16 tensor cores", **base)
    # 4. NVFP4 Q·K (nvfp4, sage3, sage3-hpnq; sage3-pv8): native FP4 MMAs, else the 16-bit NVFP4 loops
    if qk is Format.NVFP4 and pv in (Format.NVFP4, Format.E4M3):
        if nv_forced == "scaled":
            if arch == "interpreter":
                from .interpreter import interpreter_reads_e4m3_scales

                if not interpreter_reads_e4m3_scales():
                    raise ValueError("FP4VIDEO_NV_KERNEL=scaled: Triton's CPU interpreter reads dot_scaled's E4M3 "
                                     "scales as E8M0, so the NVFP4 loop would compute wrong products here; unset it")
            else:
                need = NATIVE_FP4_MIN_TRITON.get(arch, NV_EMULATED_MIN_TRITON)
                if arch is not None and version < need:
                    raise ValueError(f"FP4VIDEO_NV_KERNEL=scaled: Triton {version_text} cannot compile the NVFP4 "
                                     f"dot_scaled loop for {arch} (Triton {'.'.join(map(str, need))}+ can); unset it")
            return scaled("FP4VIDEO_NV_KERNEL=scaled")
        if nv_forced is None and native:
            return scaled("native FP4 MMAs (NVFP4)")
        tiles = dict(operands="tiles", **base)
        if pv is Format.E4M3:  # (``sm90`` chooses among the FP4-P·V loops: the Gluon loop has no FP8 P·V)
            return Plan("nvfp4", reason="NVFP4 values on bf16 tensor cores, FP8 P·V", **tiles)
        d_pad = max(16, 1 << (qk_padded_dim(d, recipe) - 1).bit_length())  # the pre-pass's padded head dim
        why_not = gluon_reason(arch, work, d_pad, dv)
        if nv_forced == "sm90":
            if why_not or launch_given:
                raise ValueError(f"FP4VIDEO_NV_KERNEL=sm90: {why_not or 'it takes no launch options (block_m, ...)'}")
            return Plan("nvfp4_sm90", reason="FP4VIDEO_NV_KERNEL=sm90", **tiles)
        if nv_forced is None and why_not is None and not launch_given and (d_pad, dv) in SM90_DEFAULT_SHAPES:
            return Plan("nvfp4_sm90", reason="NVFP4 on Hopper: the Gluon ping-pong loop", **tiles)
        return Plan("nvfp4", reason="NVFP4 values on bf16 tensor cores", **tiles)
    # 5. everything else: 16-bit values on the bf16 loop
    if recipe.quantized:
        return Plan("bf16", "work", reason="FP4 values on bf16 tensor cores", **base)
    if not gpu and dtype != torch.float32:  # the interpreter's 16-bit dots are wrong: fp32 (exact)
        return Plan("bf16", "inputs", arch, work_dtype=torch.float32, reason="unquantized: the inputs in fp32 "
                                                                             "(the interpreter's 16-bit dots are wrong)")
    return Plan("bf16", "inputs", arch, reason="unquantized: the inputs as they are, any strides")
