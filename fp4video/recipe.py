"""Attention quantization recipes: the individual switches, and the named methods built from them.

A method name (``"mxattn"``, ``"sage3"``, ...) is a preset :class:`AttentionRecipe`; any switch
can be changed one by one with :meth:`AttentionRecipe.replace`. Where each switch comes from:

==================  ==============================================================  ==========
switch              what it does                                                    source
==================  ==============================================================  ==========
``qk_format``       format of Q and K: FP4 blocks along the head dim, or ``e4m3``   both
                    (FP8, a power-of-two scale per query row and per key tile)
``pv_format``       format of V and of the softmax tile: FP4 blocks along tokens    both
                    / keys, or ``e4m3`` (FP8, a power-of-two scale per V channel
                    and per row of each key tile of P̃)
``scale_rule``      MXFP4 block-exponent rule: ``ocp``, ``tfs``, ``uos`` (7.25)     MXAttention
``hadamard``        fixed orthonormal Sylvester-Hadamard rotation of Q and K        MXAttention
``smooth_k``        subtract K's per-channel mean over tokens (exact)               SageAttn3
``p_scale``         ``direct`` block scales of P̃, or ``two_level`` (per-row FP32    SageAttn3
                    pre-scale into [0, 448·6], then E4M3 block scales)
``row_sum``         ``exact`` (sum of the unquantized P̃) or ``quantized`` (PNQ:      MXAttention
                    the row sum accumulates the same quantized tile that meets V)
``tensor_scale``    NVFP4 only: an FP32 power-of-two scale per head of Q, K and V     NVFP4
                    (:func:`fp4video.formats.nvfp4_tensor_scale`), so block scales
                    cover any range (on by default)
==================  ==============================================================  ==========
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass

from .formats import Format, ScaleRule, parse_enum

__all__ = ["AttentionRecipe", "PScale", "RowSum", "METHODS", "get_recipe"]


class PScale(str, enum.Enum):
    DIRECT = "direct"
    TWO_LEVEL = "two_level"


class RowSum(str, enum.Enum):
    EXACT = "exact"
    QUANTIZED = "quantized"  # Pre-Normalization Quantization


@dataclass(frozen=True)
class AttentionRecipe:
    """What is quantized, and how. ``None`` formats mean "keep full precision"."""

    qk_format: Format | None = None
    pv_format: Format | None = None
    scale_rule: ScaleRule = ScaleRule.OCP
    hadamard: bool = False
    smooth_k: bool = False
    p_scale: PScale = PScale.DIRECT
    row_sum: RowSum = RowSum.EXACT
    tensor_scale: bool = True
    name: str = "custom"

    def __post_init__(self):
        # coerce strings to enums at the boundary; errors name the field and allowed values
        def fmt(v, field):
            if v is None or v == "none":
                return None
            return parse_enum(Format, v, f"{field}")

        object.__setattr__(self, "qk_format", fmt(self.qk_format, "qk_format"))
        object.__setattr__(self, "pv_format", fmt(self.pv_format, "pv_format"))
        object.__setattr__(self, "scale_rule", parse_enum(ScaleRule, self.scale_rule, "scale_rule"))
        object.__setattr__(self, "p_scale", parse_enum(PScale, self.p_scale, "p_scale"))
        object.__setattr__(self, "row_sum", parse_enum(RowSum, self.row_sum, "row_sum"))
        for flag in ("hadamard", "smooth_k", "tensor_scale"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.p_scale is PScale.TWO_LEVEL and self.pv_format is not Format.NVFP4:
            raise ValueError(
                "p_scale='two_level' needs pv_format='nvfp4': MXFP4's power-of-two scales already "
                "cover P's range, so a per-row pre-scale would change nothing"
            )
        if self.row_sum is RowSum.QUANTIZED and self.pv_format is None:
            raise ValueError("row_sum='quantized' (PNQ) needs a quantized P (pv_format set)")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        spec = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fields.items()}
        object.__setattr__(self, "_spec", json.dumps(spec, sort_keys=True))

    @property
    def quantized(self) -> bool:
        return self.qk_format is not None or self.pv_format is not None

    def replace(self, **changes) -> "AttentionRecipe":
        changes.setdefault("name", "custom")
        return dataclasses.replace(self, **changes)

    def to_spec(self) -> str:
        """The recipe as a JSON string (custom-op arguments must be plain values); computed once
        at construction, so that torch.compile reads a constant instead of tracing json."""
        return self._spec

    @classmethod
    def from_spec(cls, spec: str) -> "AttentionRecipe":
        return cls(**json.loads(spec))

    def describe(self) -> str:
        parts = [
            f"QK={self.qk_format.value if self.qk_format else 'full'}",
            f"PV={self.pv_format.value if self.pv_format else 'full'}",
        ]
        if Format.MXFP4 in (self.qk_format, self.pv_format):
            parts.append(f"rule={self.scale_rule.value}")

        if Format.NVFP4 in (self.qk_format, self.pv_format) and not self.tensor_scale:
            parts.append("no-tensor-scale")
        if self.hadamard:
            parts.append("hadamard")
        if self.smooth_k:
            parts.append("smooth-K")
        if self.pv_format is not None:
            parts.append(f"P-scale={self.p_scale.value}")
            parts.append("PNQ" if self.row_sum is RowSum.QUANTIZED else "rowsum=exact")
        return " ".join(parts)


_MX, _NV, _F8 = Format.MXFP4, Format.NVFP4, Format.E4M3

METHODS: dict[str, AttentionRecipe] = {
    r.name: r
    for r in [
        AttentionRecipe(name="fp16"),
        # the MXAttention paper's "MXFP4 (OCP)" baseline: direct P quantization, exact row sum
        AttentionRecipe(name="mxfp4-ocp", qk_format=_MX, pv_format=_MX, scale_rule="ocp"),
        AttentionRecipe(name="nvfp4", qk_format=_NV, pv_format=_NV),
        AttentionRecipe(name="sage3", qk_format=_NV, pv_format=_NV, smooth_k=True, p_scale="two_level"),
        AttentionRecipe(
            name="mxattn", qk_format=_MX, pv_format=_MX, scale_rule="uos", hadamard=True, row_sum="quantized"
        ),
        # MXAttention's sequential ablation (Table 3): full -> w/o UOS -> w/o PNQ and UOS -> OCP
        AttentionRecipe(
            name="mxattn-no-uos", qk_format=_MX, pv_format=_MX, scale_rule="ocp", hadamard=True, row_sum="quantized"
        ),
        AttentionRecipe(name="mxattn-no-pnq-uos", qk_format=_MX, pv_format=_MX, scale_rule="ocp", hadamard=True),
        # Neither paper's, chosen from the op-level measurements (docs/accuracy.md, "Combinations of our own";
        # `fp4video accuracy` recomputes them): MXAttention plus SageAttention's K smoothing.
        # The Hadamard rotation turns a per-channel K mean into a few huge channels; removing
        # the mean first (exact, free in the pre-pass) lets the rotation do its job.
        AttentionRecipe(
            name="mxattn-sk",
            qk_format=_MX,
            pv_format=_MX,
            scale_rule="uos",
            hadamard=True,
            smooth_k=True,
            row_sum="quantized",
        ),
        # SageAttention3's NVFP4 recipe plus MXAttention's Hadamard rotation and PNQ.
        AttentionRecipe(
            name="sage3-hpnq",
            qk_format=_NV,
            pv_format=_NV,
            smooth_k=True,
            p_scale="two_level",
            hadamard=True,
            row_sum="quantized",
        ),
        # FP4 Q·K with FP8 P·V: the FP4 attention kernels that report speed-ups on Blackwell keep
        # P·V in FP8 (P's FP4 rounding bounds the loop), and it removes most of P·V's error.
        # P̃ per row and key tile and V per channel in E4M3 with power-of-two scales; PNQ row sums.
        AttentionRecipe(
            name="mxattn-pv8", qk_format=_MX, pv_format=_F8, scale_rule="uos", hadamard=True, row_sum="quantized"
        ),
        AttentionRecipe(name="sage3-pv8", qk_format=_NV, pv_format=_F8, smooth_k=True, row_sum="quantized"),
        # The FP8 tier (close to SageAttention2 / FlashAttention-3 FP8): Q per row and K per key tile
        # in E4M3 with power-of-two scales, K smoothed; P̃ and V as above. The Hadamard rotation
        # spreads Q/K outlier channels over the head dim before the rounding: E4M3's 3-bit mantissa
        # errs in proportion to each product q_c·k_c, so a few large channels otherwise move large
        # logits by several nats (FlashAttention-3's "incoherent processing" does the same).
        AttentionRecipe(name="fp8", qk_format=_F8, pv_format=_F8, smooth_k=True, hadamard=True, row_sum="quantized"),
    ]
}


def get_recipe(method: str | AttentionRecipe) -> AttentionRecipe:
    """The recipe for a method name (or the recipe itself)."""
    if isinstance(method, AttentionRecipe):
        return method
    try:
        return METHODS[method]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}") from None
