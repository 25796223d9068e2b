"""Which loop runs where: the plan's ladder by architecture, Triton version and environment
overrides, and the launches that must fit each GPU's shared memory."""

from __future__ import annotations

import pytest
import torch

from fp4video import METHODS

pytest.importorskip("triton")
from conftest import rand  # noqa: E402


def test_nvfp4_kernel_choice(monkeypatch):
    """The Gluon ping-pong loop runs NVFP4 with FP4 P·V on Hopper at head dims 128 (its default
    shapes) unless the caller sets launch values; elsewhere — other architectures, the interpreter,
    other head dims, FP8 P·V — the Triton loop. Forcing it where it cannot run, or an unknown
    FP4VIDEO_NV_KERNEL, is an error naming the problem."""
    from fp4video.kernels.plan import plan_on

    monkeypatch.delenv("FP4VIDEO_NV_KERNEL", raising=False)
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    sage3 = METHODS["sage3"]
    assert plan_on(sage3, "sm_90").loop == "nvfp4_sm90"
    assert plan_on(sage3, "sm_90", launch_given=True).loop == "nvfp4"
    assert plan_on(sage3, "sm_90", head_dim=64).loop == "nvfp4"  # (not a default shape: forced only)
    assert plan_on(METHODS["sage3-pv8"], "sm_90").loop == "nvfp4"
    for arch in ("sm_89", "sm_80", "interpreter"):
        assert plan_on(sage3, arch).loop == "nvfp4", arch
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "sm90")
    assert plan_on(sage3, "sm_90", head_dim=64).loop == "nvfp4_sm90"
    with pytest.raises(ValueError, match="sm_90"):
        plan_on(sage3, "interpreter")
    with pytest.raises(ValueError, match="no launch options"):
        plan_on(sage3, "sm_90", launch_given=True)
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "triton")
    assert plan_on(sage3, "sm_90").loop == "nvfp4"
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "gluon")
    with pytest.raises(ValueError, match="must be 'scaled', 'sm90' or 'triton'"):
        plan_on(sage3, "sm_90")


def test_launches_fit_the_shared_memory_of_the_gpu(monkeypatch):
    """Software-pipelining stages that need more shared memory than the GPU gives a program are
    dropped, by each architecture's own offline-compiled figures: on H100/H200 every launch as
    configured; on B200 (sm_100, 227 KB) the NVFP4 loop at 2 stages (3 need 233,504 B there, 1 KB
    more than a block may have); on sm_120 (99 KB) the e4m3 loop keeps 3 stages (80 KB there) and
    the NVFP4 and bf16 loops 2 (96 KB); on A100 (sm_80: sm_90's figures) the NVFP4 and bf16 loops
    2; on Ada (99 KB) the e4m3 loop 2, the NVFP4 and bf16 loops and the row pre-pass 1. Unnamed
    architectures take their family's table (sm_103 sm_100's, sm_121 sm_120's, older sm_90's).
    Without the device property (older torch) the capability decides; the interpreter: no limit."""
    from types import SimpleNamespace

    from fp4video.kernels import launch, loop_bf16, loop_e4m3, loop_nvfp4
    from fp4video.kernels import prepass as pp

    def stages(arch, limit):
        fit = launch.stages_that_fit
        return (fit(arch, limit, loop_e4m3.POINTER_LAUNCH.num_stages, loop_e4m3.POINTER_LAUNCH.shared_memory),
                fit(arch, limit, loop_nvfp4.LAUNCH.num_stages, loop_nvfp4.LAUNCH.shared_memory),
                fit(arch, limit, pp.PREPASS_LAUNCH.row_stages, pp.ROW_SHARED_MEMORY),
                fit(arch, limit, loop_bf16.LAUNCH.num_stages, loop_bf16.LAUNCH.shared_memory),
                fit(arch, limit, pp.PREPASS_LAUNCH.v_stages, pp.V_SHARED_MEMORY))

    limits = launch.SHARED_MEMORY_LIMIT
    assert stages("sm_90", limits["sm_90"]) == (3, 3, 2, 3, 3)
    assert stages("sm_100", limits["sm_100"]) == (3, 2, 2, 3, 3)
    assert stages("sm_120", limits["sm_120"]) == (3, 2, 1, 2, 3)
    assert stages("sm_80", (164 << 10) - 1024) == (3, 2, 2, 2, 3)
    assert stages("sm_89", (100 << 10) - 1024) == (2, 1, 1, 1, 3)
    assert stages("sm_103", limits["sm_100"]) == stages("sm_100", limits["sm_100"])
    assert stages("sm_121", limits["sm_120"]) == stages("sm_120", limits["sm_120"])
    assert [launch.table_arch(a) for a in ("sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121", "sm_89", None)] == \
        ["sm_90", "sm_100", "sm_100", "sm_100", "sm_120", "sm_120", "sm_90", "sm_90"]
    tma = loop_e4m3.TMA_LAUNCH  # its 2 stages (74 KB at most) fit everywhere
    assert all(launch.stages_that_fit(a, limits[a], tma.num_stages, tma.shared_memory) == 2 for a in limits)
    # the device path: the property, else the capability; the interpreter has no limit
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(shared_memory_per_multiprocessor=228 << 10))
    assert launch.shared_memory_per_block(cuda) == limits["sm_100"]
    assert loop_nvfp4.LAUNCH.resolve(cuda)[2] == 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace())
    for cap, want in (((8, 9), (100 << 10) - 1024), ((9, 0), (228 << 10) - 1024), ((8, 0), (164 << 10) - 1024)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert launch.shared_memory_per_block(cuda) == want, cap
    assert loop_nvfp4.LAUNCH.resolve(torch.device("cpu"))[2] == 3
    # rows and warps by architecture: the e4m3 loop takes 128 rows and 8 warps on consumer Blackwell
    # (sm_12x), 64 and 4 elsewhere; a caller's explicit values first
    for cap, shape in (((12, 0), (128, 8)), ((12, 1), (128, 8)), ((9, 0), (64, 4)), ((10, 0), (64, 4))):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert tma.resolve(cuda)[:2] == shape, cap
    assert tma.resolve(cuda, block_m=32, num_warps=2)[:2] == (32, 2)
    assert tma.shape(None) == (64, 4) and tma.resolve(torch.device("cpu"))[:2] == (64, 4)


def test_native_fp4_loop_only_where_it_was_compiled(monkeypatch):
    """The MXFP4 methods take the native-FP4 loop on sm_100 and sm_120 (compiled and read offline),
    the e4m3 loop on every other sm_89+ GPU — the Blackwell-generation ones not named too (sm_103,
    sm_110, sm_121) — and the bf16 loop before sm_89; ``mxattn-pv8`` (MXFP4 Q·K, FP8 P·V) follows
    them (the dot_scaled loop with FP8 P·V), ``fp8`` (E4M3 Q·K) the e4m3 loop everywhere."""
    from fp4video.kernels import plan

    monkeypatch.delenv("FP4VIDEO_MX_KERNEL", raising=False)
    want = {"sm_80": "bf16", "sm_89": "e4m3", "sm_90": "e4m3", "sm_100": "scaled", "sm_103": "e4m3",
            "sm_110": "e4m3", "sm_120": "scaled", "sm_121": "e4m3"}
    monkeypatch.setattr(plan, "triton_version", lambda: (3, 9))
    for arch, loop in want.items():
        assert plan.plan_on(METHODS["mxattn"], arch).loop == loop, arch
        # mxattn-pv8: its Q·K on the native FP4 MMA where mxattn's runs, else the e4m3 loop
        assert plan.plan_on(METHODS["mxattn-pv8"], arch).loop == (None if arch == "sm_80" else
                                                                 "scaled" if loop == "scaled" else "e4m3"), arch
        assert plan.plan_on(METHODS["fp8"], arch).loop == (None if arch == "sm_80" else "e4m3"), arch
    assert "sm_89+" in plan.plan_on(METHODS["fp8"], "sm_80").reason
    # Triton 3.6 to 3.8 cannot compile the native loop for sm_100 (offline compiles): the e4m3 loop
    # there; sm_120's compiles from 3.6
    for version, on_100, on_120 in (((3, 8), "e4m3", "scaled"), ((3, 6), "e4m3", "scaled"), ((3, 5), "e4m3", "e4m3")):
        monkeypatch.setattr(plan, "triton_version", lambda v=version: v)
        for arch, loop in (("sm_100", on_100), ("sm_120", on_120)):
            assert plan.plan_on(METHODS["mxattn"], arch).loop == loop, (version, arch)
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    assert plan.plan_on(METHODS["mxattn"], "sm_90").loop == "scaled"  # the override tries it anywhere
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "bf16")
    assert plan.plan_on(METHODS["mxattn"], "sm_90").loop == "bf16"


def test_nvfp4_methods_take_the_native_loop_where_it_compiles(monkeypatch):
    """NVFP4 Q·K and P·V (nvfp4, sage3, sage3-hpnq) run the dot_scaled loop with E4M3 block-16
    scales where the MXFP4 methods run theirs (sm_100 with Triton 3.9+, sm_120 with 3.6+), the
    NVFP4 bf16 loops elsewhere (the interpreter included, unless asked); sage3-pv8 (FP8 P·V) too;
    ``FP4VIDEO_NV_KERNEL=scaled`` asks for it anywhere, ``=triton`` / ``=sm90`` never."""
    from fp4video.kernels import plan

    monkeypatch.delenv("FP4VIDEO_NV_KERNEL", raising=False)
    monkeypatch.setattr(plan, "triton_version", lambda: (3, 9))

    def scaled(method, arch):
        return plan.plan_on(METHODS[method], arch).loop == "scaled"

    for arch, want in (("sm_100", True), ("sm_120", True), ("sm_90", False), ("sm_103", False), ("sm_121", False),
                       ("interpreter", False)):
        for method in ("nvfp4", "sage3", "sage3-hpnq"):
            assert scaled(method, arch) is want, (method, arch)
        assert scaled("sage3-pv8", arch) is want  # its Q·K native, P·V on FP8 MMAs
    assert not scaled("mxattn", "sm_90")
    monkeypatch.setattr(plan, "triton_version", lambda: (3, 6))
    assert not scaled("sage3", "sm_100") and scaled("sage3", "sm_120")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    with pytest.raises(ValueError, match=r"Triton 3\.6 cannot compile the NVFP4 dot_scaled loop for sm_90 \(Triton 3\.8\+"):
        scaled("sage3", "sm_90")
    with pytest.raises(ValueError, match=r"for sm_100 \(Triton 3\.9\+"):
        scaled("sage3", "sm_100")
    monkeypatch.setattr(plan, "triton_version", lambda: (3, 9))
    assert scaled("sage3", "sm_90") and scaled("sage3", "sm_100")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "triton")
    assert plan.plan_on(METHODS["sage3"], "sm_100").loop == "nvfp4"
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "sm90")  # the Gluon loop, which runs on Hopper only
    with pytest.raises(ValueError, match="FP4VIDEO_NV_KERNEL=sm90: it runs on sm_90"):
        plan.plan_on(METHODS["sage3"], "sm_100")


def test_forcing_the_nvfp4_dot_scaled_loop_in_the_interpreter_is_refused(monkeypatch):
    """Triton's interpreter reads E4M3 scales as E8M0: asked to run the native NVFP4 loop there
    (without the tests' decoding fixture), the dispatch refuses rather than compute wrong products."""
    pytest.importorskip("triton")
    from fp4video.kernels.interpreter import interpreter_reads_e4m3_scales
    from fp4video.kernels.plan import plan_on

    if torch.cuda.is_available() or interpreter_reads_e4m3_scales():
        pytest.skip("needs the CPU interpreter as Triton ships it")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    with pytest.raises(ValueError, match="interpreter reads dot_scaled's E4M3 scales as E8M0"):
        plan_on(METHODS["nvfp4"], "interpreter")


def test_tma_loop_where_the_gpu_has_tma(monkeypatch):
    """The e4m3 loop copies its tiles by TMA on sm_90 and later only (Ada, sm_89, has no TMA), and
    not in the CPU interpreter unless asked; the pre-pass stores K̂ in tile order exactly there.
    ``FP4VIDEO_MX_TMA=0`` turns it off; ``=1`` where it cannot run, or another value, is an error
    naming the problem."""
    from fp4video.kernels import dispatch
    from fp4video.kernels.operands import FP8Operands
    from fp4video.kernels.plan import plan, plan_on

    monkeypatch.delenv("FP4VIDEO_MX_TMA", raising=False)
    mxattn = METHODS["mxattn"]
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "fp8")  # (the e4m3 loop on Blackwell too)
    for arch, want in (("sm_89", False), ("sm_90", True), ("sm_100", True), ("sm_80", False)):
        got = plan_on(mxattn, arch)
        assert got.loop == "e4m3" and got.tma is want and got.key_order == ("tile" if want else "key"), arch
        monkeypatch.setenv("FP4VIDEO_MX_TMA", "0")
        assert plan_on(mxattn, arch).tma is False
        monkeypatch.setenv("FP4VIDEO_MX_TMA", "1")
        if want:
            assert plan_on(mxattn, arch).tma is True
        else:
            with pytest.raises(ValueError, match="sm_8.* has no TMA"):
                plan_on(mxattn, arch)
        monkeypatch.delenv("FP4VIDEO_MX_TMA")
    monkeypatch.setenv("FP4VIDEO_MX_TMA", "yes")
    with pytest.raises(ValueError, match="FP4VIDEO_MX_TMA must be '0' or '1', got 'yes'"):
        plan_on(mxattn, "sm_90")
    monkeypatch.delenv("FP4VIDEO_MX_TMA")
    # Hopper's pointer-load loop computes wrong rows for the FP8-P·V methods: TMA off is refused there
    monkeypatch.setenv("FP4VIDEO_MX_TMA", "0")
    with pytest.raises(ValueError, match="FP4VIDEO_MX_TMA=0.*asynchronous"):
        plan_on(METHODS["mxattn-pv8"], "sm_90")
    monkeypatch.delenv("FP4VIDEO_MX_TMA")
    assert plan_on(mxattn, "interpreter").tma is False
    q = rand(1, 1, 8, 64, seed=44)
    operands = dispatch.prepare(q, q, q, mxattn, None)
    assert plan(mxattn, q).loop == "e4m3" and isinstance(operands, FP8Operands)
    assert (operands.sk, operands.k_tile_order, operands.k8.shape[-2]) == (8, False, 8)


@pytest.mark.gpu
def test_hopper_keeps_the_measured_stages_gpu():
    """On the H200 (sm_90, 228 KB per SM) the shared-memory check leaves every launch as
    benchmarked: the e4m3 loop by TMA at 2 stages (by pointer loads at 3), the NVFP4 loop at 3,
    the row pre-pass at 2 (e4m3 Q at 3)."""
    from fp4video import METHODS
    from fp4video.kernels import launch, loop_bf16, loop_e4m3, loop_nvfp4
    from fp4video.kernels.plan import plan
    from fp4video.kernels.prepass import PREPASS_LAUNCH, ROW_SHARED_MEMORY, V_SHARED_MEMORY

    dev = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("a Hopper GPU")
    assert launch.shared_memory_per_block(dev) >= 227 * 1024
    assert plan(METHODS["mxattn"], torch.zeros(1, 1, 1, 128, device=dev)).tma
    for loop in (loop_e4m3.TMA_LAUNCH, loop_e4m3.POINTER_LAUNCH, loop_nvfp4.LAUNCH, loop_bf16.LAUNCH):
        assert loop.resolve(dev) == (loop.block_m, loop.num_warps, loop.num_stages), loop
    for stages, table in ((PREPASS_LAUNCH.row_stages, ROW_SHARED_MEMORY), (PREPASS_LAUNCH.q8_stages, ROW_SHARED_MEMORY),
                          (PREPASS_LAUNCH.v_stages, V_SHARED_MEMORY)):
        assert launch.fitting_stages(dev, stages, table) == stages


@pytest.mark.parametrize("name", ["FP4VIDEO_MX_KERNEL", "FP4VIDEO_MX_TMA", "FP4VIDEO_NV_KERNEL"])
def test_every_override_is_listed_and_checked(name, monkeypatch):
    """The plan's table lists every environment variable the kernels read (the architecture test
    checks that no other kernels module reads one), and a value it does not list is an error naming
    the variable and the values it takes."""
    from fp4video.kernels import plan

    assert name in plan.ENVIRONMENT and f"``{name}``" in plan.__doc__
    monkeypatch.setenv(name, "nonsense")
    for method in ("mxattn", "sage3", "fp16"):  # every plan reads every override
        with pytest.raises(ValueError, match=f"{name} must be .* got 'nonsense'"):
            plan.plan_on(METHODS[method], "sm_90")
