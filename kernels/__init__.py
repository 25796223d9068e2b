"""Fused Triton kernels for fp4video (installed as ``fp4video.kernels``).

They implement the numerics of :mod:`fp4video.reference` and import only torch, triton and
fp4video's numerics modules. Triton is optional: without it (or without a CUDA tensor, unless
``TRITON_INTERPRET=1``), :func:`supports` says why and ``backend="auto"`` runs the reference.
"""

from __future__ import annotations

import importlib.util

if __name__ == "kernels":
    # This folder is installed as ``fp4video.kernels``. It becomes a top-level ``kernels`` only when
    # a checkout's root is on sys.path (``python -m ...`` run from it), where it shadows Hugging
    # Face's ``kernels`` package, which transformers imports whenever that is installed: hand such an
    # import the installed package instead.
    import importlib.machinery
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # what the import statement returns
        _spec.loader.exec_module(_module)
    # else: none is installed, and this module loads as it is (version-less: transformers' probe then
    # counts Hugging Face's package as absent)

__all__ = ["supports", "triton_available"]


def triton_available() -> bool:
    """Whether Triton is installed (:func:`.plan.triton_available`; the submodules never import
    this package's own names, so no import cycle runs through it)."""
    from .plan import triton_available

    return triton_available()


def supports(recipe, q, mask=None) -> tuple[bool, str]:
    """Whether the fused kernels can run this call, and if not, why (for the error message):
    :func:`.plan.plan`, which also says how they run it."""
    from .plan import plan

    p = plan(recipe, q, mask=mask)
    return p.runnable, "" if p.runnable else p.reason
