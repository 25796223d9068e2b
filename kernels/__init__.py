"""Fused Triton kernels for fp4video (installed as ``fp4video.kernels``).

They implement the numerics of :mod:`fp4video.reference` and import only torch, triton and
fp4video's numerics modules. Triton is optional: without it (or without a CUDA tensor, unless
``TRITON_INTERPRET=1``), :func:`supports` says why and ``backend="auto"`` runs the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

__all__ = ["supports", "attention", "triton_available"]


#: looked up once at import: torch.compile cannot trace importlib (a graph break inside
#: fp4_attention's backend choice, found on the H200)
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def supports(recipe, q, mask=None) -> tuple[bool, str]:
    """Whether the fused kernel can run this call, and if not, why (for the error message)."""
    if not triton_available():
        return False, "Triton is not installed (pip install 'fp4video[triton]')"
    from .dispatch import supports as _supports

    return _supports(recipe, q, mask)


def attention(q, k, v, *, recipe, mask, scale):
    """Through the ``fp4video::attention`` custom op (torch.compile / CUDA graphs see one opaque op)."""
    ok, why = supports(recipe, q, mask)
    if not ok:
        raise NotImplementedError(why)
    from .dispatch import key_padding
    from .ops import attention_op

    return attention_op(q, k, v, key_padding(mask, q.shape[0], k.shape[-2]), recipe.to_spec(), scale)


#: modules renamed on 2026-12-01 (old name -> new), still reachable as attributes of the package
RENAMED = {"attention_fwd": "dispatch", "attention_nvfp4": "loop_nvfp4", "attention_nvfp4_sm90": "loop_nvfp4_sm90",
           "attention_scaled": "loop_scaled"}


def __getattr__(name):
    if name in RENAMED:
        warnings.warn(f"fp4video.kernels.{name} is now fp4video.kernels.{RENAMED[name]}", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(f"{__name__}.{RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
