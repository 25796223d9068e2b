"""Shared test set-up. Without a GPU, Triton kernels run under Triton's CPU interpreter (set before
any kernel is defined). GPU tests (marker ``gpu``) run on a CUDA machine: ``python -m pytest -m gpu -n 6 --dist load``.
Tests of the lab tools in ``tools/`` carry the marker ``tools``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT / "tools"))  # the lab tools' shared helpers (offline compiles)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers share the cores: each runs torch's CPU ops on its share of them, not on
    # all of them (spinning intra-op threads of one worker would take cores from the others), and so
    # do the processes its tests start (a test comparing a subprocess's floats with its own bit for
    # bit needs the same number of threads on both sides: the same summation order)
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


def rand(*shape, seed, device="cpu", dtype=torch.float32):
    """Seeded standard-normal values (drawn on the CPU, so every device sees the same)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.fixture(autouse=True)
def _grad_mode_is_left_as_found():
    """Autograd is on for the process between tests. A test (or a script's ``main`` it calls) that
    switches it off and leaves it off fails here, by name; a test that finds it off (a module
    fixture left it so) fails saying so; either way it is put back on for the tests after."""
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was off when this test started: a fixture or an earlier test switched it off for "
                    "the process (use torch.no_grad() as a context or decorator)", pytrace=False)
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd off for the process: use torch.no_grad() as a context or decorator",
                    pytrace=False)


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the GPU if there is one, else the CPU (interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def e4m3_dot_scaled(monkeypatch):
    """Triton's CPU interpreter decodes every ``tl.dot_scaled`` scale as E8M0 (an exponent byte);
    NVFP4's are E4M3 values, which Blackwell's ``kind::mxf4nvf4`` MMAs take as such. Within a test
    using this fixture the interpreter decodes E4M3 scale tensors as E4M3 (bit for bit: a table of
    all 256 bytes), so the native NVFP4 loop runs on the CPU as the GPU runs it. Skips where the
    interpreter has no ``dot_scaled`` of its own (Triton before 3.9)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    import numpy as np
    import triton.language as tl

    decode = getattr(interpreter, "_dot_scaled_scale_to_f32", None)
    if decode is None:
        pytest.skip("this Triton's interpreter has no dot_scaled to patch (Triton 3.9+ has)")
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()

    def scale_to_f32(handle, compute_type):
        if handle.dtype == tl.float8e4nv:
            return table[handle.data.view(np.uint8)]
        return decode(handle, compute_type)

    monkeypatch.setattr(interpreter, "_dot_scaled_scale_to_f32", scale_to_f32)
