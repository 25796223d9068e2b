"""fp4video: 4-bit microscaling (MXFP4 / NVFP4) attention for video diffusion transformers.

Public API::

    from fp4video import fp4_attention, METHODS, AttentionRecipe
    out = fp4_attention(q, k, v, method="mxattn", layout="bshd")
"""

from .attention import fp4_attention
from .formats import QTensor, quantize, quantize_dequantize
from .recipe import METHODS, AttentionRecipe, get_recipe

__version__ = "0.1.0"

__all__ = ["fp4_attention", "METHODS", "AttentionRecipe", "get_recipe", "quantize", "quantize_dequantize", "QTensor"]
