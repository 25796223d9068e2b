"""Without a GPU, Triton kernels run under Triton's CPU interpreter (set before any kernel is
defined). GPU tests (marker ``gpu``) run on a CUDA machine: ``python -m pytest -m gpu``."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
