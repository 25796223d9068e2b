"""Shared test set-up. Without a GPU, Triton kernels run under Triton's CPU interpreter (set before
any kernel is defined). GPU tests (marker ``gpu``) run on a CUDA machine: ``python -m pytest -m gpu``.
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


def rand(*shape, seed, device="cpu", dtype=torch.float32):
    """Seeded standard-normal values (drawn on the CPU, so every device sees the same)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


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
