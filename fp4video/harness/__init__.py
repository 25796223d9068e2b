"""The papers' experiments at op level: :mod:`.sageattention3` (SageAttention3's NVFP4 attention,
as the two-scale-factor article measures it), :mod:`.mxattention` (MXAttention's UOS, PNQ and
ablation), :mod:`.robustness` (sharp inputs) and :mod:`.report` (the ``fp4video accuracy`` CLI)."""

from __future__ import annotations

import importlib
import warnings

#: names these modules had before 2026-12-01 (after their input files), still importable
_RENAMED = {"source000": "sageattention3", "source001": "mxattention"}


def __getattr__(name):
    if name in _RENAMED:
        warnings.warn(f"fp4video.harness.{name} is now fp4video.harness.{_RENAMED[name]}", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(f"{__name__}.{_RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
