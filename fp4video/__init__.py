"""fp4video: 4-bit microscaling (MXFP4 / NVFP4) attention for video diffusion transformers.

Public API::

    from fp4video import fp4_attention, METHODS, AttentionRecipe
    out = fp4_attention(q, k, v, method="mxattn", layout="bshd")
    fp4video.install(pipe, policy)          # diffusers video pipelines: a precision policy per site
    result = fp4video.calibrate(pipe, prompts, budget=0.1)   # the cheapest attention per site
    fp4video.register_attention_backends()  # then pipe.transformer.set_attention_backend("fp4video_mxattn")
"""

from .attention import fp4_attention
from .formats import QTensor, quantize, quantize_dequantize
from .recipe import METHODS, AttentionRecipe, get_recipe


def __getattr__(name):
    # the diffusers integration is imported on first use (diffusers is heavy to import)
    if name in ("FP4Processor", "install", "uninstall", "Policy"):
        from . import integration

        return getattr(integration, name)
    if name == "calibrate":  # imported on first use too (it imports the integration)
        from .calibration import calibrate

        return calibrate
    if name in ("register_attention_backends", "reset_attention_backend"):  # diffusers' set_attention_backend
        from .integration import dispatcher

        return getattr(dispatcher, name)
    raise AttributeError(f"module 'fp4video' has no attribute {name!r}")

__version__ = "0.1.0"

__all__ = ["fp4_attention", "FP4Processor", "install", "uninstall", "Policy", "calibrate", "register_attention_backends",
           "reset_attention_backend", "METHODS", "AttentionRecipe", "get_recipe", "quantize", "quantize_dequantize",
           "QTensor"]
