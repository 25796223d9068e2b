"""Which loop runs where: the dispatch's architecture choices and environment overrides, and the
launches that must fit each GPU's shared memory."""

from __future__ import annotations

import pytest
import torch

from fp4video import METHODS

pytest.importorskip("triton")
from conftest import rand  # noqa: E402


def test_nvfp4_kernel_choice_without_hopper(monkeypatch):
    """Where the ping-pong kernel cannot run (here: CPU tensors), the Triton loop runs; forcing it
    there, or an unknown FP4VIDEO_NV_KERNEL, is an error naming the problem."""
    from fp4video.kernels.dispatch import nv_kernel as choose

    x = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("FP4VIDEO_NV_KERNEL", raising=False)
    assert choose(x, x, launch_given=False) == "triton"
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "sm90")
    with pytest.raises(ValueError, match="sm_90"):
        choose(x, x, launch_given=False)
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "gluon")
    with pytest.raises(ValueError, match="must be 'sm90' or 'triton'"):
        choose(x, x, launch_given=False)


def test_launches_fit_the_shared_memory_of_the_gpu(monkeypatch):
    """Software-pipelining stages that need more shared memory than the GPU gives a program are
    dropped: on H100/H200 (228 KB per SM) every launch as configured; on A100 (164 KB) the NVFP4
    loop with 2 stages (160 KB; 3 take 224 KB); on ~100 KB GPUs (Ada, sm_86: 99 KB per block)
    the e4m3 loop with 2 (74 KB; 3 take 106.5 KB), the NVFP4 loop, the row pre-pass and the bf16
    loop of older GPUs (160 KB at 3) with 1; the tensor-core V pre-pass (90 KB at 3) fits everywhere.
    Without the device property (older torch) the capability decides; the interpreter: no limit."""
    from types import SimpleNamespace

    from fp4video.kernels import launch, loop_bf16, loop_e4m3, loop_nvfp4
    from fp4video.kernels import prepass as pp

    cuda = torch.device("cuda", 0)

    def stages(dev):
        return (loop_e4m3.POINTER_LAUNCH.resolve(dev)[2], loop_nvfp4.LAUNCH.resolve(dev)[2],
                launch.fitting_stages(dev, pp.PREPASS_LAUNCH.row_stages, pp.ROW_SHARED_MEMORY),
                loop_bf16.LAUNCH.resolve(dev)[2],
                launch.fitting_stages(dev, pp.PREPASS_LAUNCH.v_stages, pp.V_SHARED_MEMORY))

    for per_sm, want in ((228 << 10, (3, 3, 2, 3, 3)), (164 << 10, (3, 2, 2, 3, 3)), (100 << 10, (2, 1, 1, 1, 3))):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None, n=per_sm: SimpleNamespace(shared_memory_per_multiprocessor=n))
        assert launch.shared_memory_per_block(cuda) == per_sm - 1024
        assert stages(cuda) == want, per_sm
        tma = loop_e4m3.TMA_LAUNCH  # its 2 stages (74 KB) fit everywhere
        assert tma.resolve(cuda) == (tma.block_m, tma.num_warps, tma.num_stages)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace())
    for cap, want in (((8, 9), (2, 1, 1, 1, 3)), ((9, 0), (3, 3, 2, 3, 3)), ((8, 0), (3, 2, 2, 3, 3))):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert stages(cuda) == want, cap
    assert stages(torch.device("cpu")) == (3, 3, 2, 3, 3)


def test_tma_loop_where_the_gpu_has_tma(monkeypatch):
    """The e4m3 loop copies its tiles by TMA on sm_90 and later only (Ada, sm_89, has no TMA), and
    not in the CPU interpreter unless asked; the pre-pass stores K̂ in tile order exactly there.
    ``FP4VIDEO_MX_TMA=0`` turns it off; ``=1`` where it cannot run, or another value, is an error
    naming the problem."""
    from fp4video.kernels import dispatch as af

    monkeypatch.delenv("FP4VIDEO_MX_TMA", raising=False)
    cuda = torch.device("cuda", 0)
    for cap, want in (((8, 9), False), ((9, 0), True), ((10, 0), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert af.tma_loop(cuda) is want, cap
        monkeypatch.setenv("FP4VIDEO_MX_TMA", "0")
        assert af.tma_loop(cuda) is False
        monkeypatch.setenv("FP4VIDEO_MX_TMA", "1")
        if want:
            assert af.tma_loop(cuda) is True
        else:
            with pytest.raises(ValueError, match="sm_8.* has no TMA"):
                af.tma_loop(cuda)
        monkeypatch.delenv("FP4VIDEO_MX_TMA")
    monkeypatch.setenv("FP4VIDEO_MX_TMA", "yes")
    with pytest.raises(ValueError, match="FP4VIDEO_MX_TMA must be '0' or '1', got 'yes'"):
        af.tma_loop(cuda)
    monkeypatch.delenv("FP4VIDEO_MX_TMA")
    assert af.tma_loop(torch.device("cpu")) is False
    q = rand(1, 1, 8, 64, seed=44)
    prepared = af.prepare(q, q, q, METHODS["mxattn"], None)
    assert prepared[0] == "fp8" and prepared[1][-2:] == (8, False) and prepared[1][2].shape[-2] == 8


@pytest.mark.gpu
def test_hopper_keeps_the_measured_stages_gpu():
    """On the H200 (sm_90, 228 KB per SM) the shared-memory check leaves every launch as
    benchmarked: the e4m3 loop by TMA at 2 stages (by pointer loads at 3), the NVFP4 loop at 3,
    the row pre-pass at 2 (e4m3 Q at 3)."""
    from fp4video.kernels import dispatch, launch, loop_bf16, loop_e4m3, loop_nvfp4
    from fp4video.kernels.prepass import PREPASS_LAUNCH, ROW_SHARED_MEMORY, V_SHARED_MEMORY

    dev = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("a Hopper GPU")
    assert launch.shared_memory_per_block(dev) >= 227 * 1024
    assert dispatch.tma_loop(dev)
    for loop in (loop_e4m3.TMA_LAUNCH, loop_e4m3.POINTER_LAUNCH, loop_nvfp4.LAUNCH, loop_bf16.LAUNCH):
        assert loop.resolve(dev) == (loop.block_m, loop.num_warps, loop.num_stages), loop
    for stages, table in ((PREPASS_LAUNCH.row_stages, ROW_SHARED_MEMORY), (PREPASS_LAUNCH.q8_stages, ROW_SHARED_MEMORY),
                          (PREPASS_LAUNCH.v_stages, V_SHARED_MEMORY)):
        assert launch.fitting_stages(dev, stages, table) == stages


@pytest.mark.parametrize("name", ["FP4VIDEO_MX_KERNEL", "FP4VIDEO_MX_TMA", "FP4VIDEO_NV_KERNEL"])
def test_every_override_is_listed_and_checked(name, monkeypatch):
    """The dispatch's table lists every environment variable the kernels read (the architecture test
    checks that no other kernels module reads one), and a value it does not list is an error naming
    the variable and the values it takes."""
    from fp4video.kernels import dispatch

    assert name in dispatch.ENVIRONMENT and f"``{name}``" in dispatch.__doc__
    monkeypatch.setenv(name, "nonsense")
    x = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"{name} must be .* got 'nonsense'"):
        {"FP4VIDEO_MX_KERNEL": lambda: dispatch.mx_kernel(METHODS["mxattn"], x.device),
         "FP4VIDEO_MX_TMA": lambda: dispatch.tma_loop(x.device),
         "FP4VIDEO_NV_KERNEL": lambda: dispatch.nv_kernel(x, x, False)}[name]()
