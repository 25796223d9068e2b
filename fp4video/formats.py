"""FP4 microscaling formats: E2M1 elements, E8M0 (MXFP4) and E4M3 (NVFP4) block scales.

This module is the single definition of the numbers fp4video computes with. Everything else
(the reference attention, the Triton kernels, the accuracy harness) calls these functions or
is tested bit-for-bit against them.

Specs:
- E2M1, E8M0, MXFP4 (block 32): OCP Microscaling Formats (MX) v1.0, sections 5.3.3 and 5.4.
- E4M3 ("E4M3FN": bias 7, subnormals, no infinities, max 448): OCP 8-bit Floating Point v1.0.
- NVFP4 (block 16, E4M3 block scale, optional FP32 tensor scale): NVIDIA's NVFP4 description.

Rounding is round-to-nearest, ties-to-even, saturating at the format's largest finite value,
everywhere. Scale rules for MXFP4 (``e`` is the power-of-two exponent of a block's scale):

- ``"ocp"``: ``e = floor(log2 amax) - 2`` (OCP MX v1.0, 6.3); the block max lands in [4, 8).
- ``"tfs"``: ``e = ceil(log2(amax / 6))`` (truncation-free scaling); the max lands in (3, 6].
- ``"uos"``: ``e = ceil(log2(amax / 7.25))`` (MXAttention's Universal Optimal Scaling); the
  max lands in (3.625, 7.25].
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "E2M1_VALUES",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "E8M0_BIAS",
    "UOS_QMAX",
    "MX_BLOCK",
    "NV_BLOCK",
    "Format",
    "ScaleRule",
    "QTensor",
    "round_e2m1",
    "round_e4m3",
    "e4m3_pow2_quantize_dequantize",
    "E4M3_POW2_TOP",
    "e4m3_values",
    "e2m1_codes",
    "decode_e2m1",
    "pack_nibbles",
    "unpack_nibbles",
    "mx_exponent",
    "block_scales",
    "NVFP4_TENSOR_RANGE",
    "nvfp4_tensor_scale",
    "quantize",
    "quantize_dequantize",
    "int8_quantize_dequantize",
    "float8_quantize_dequantize",
    "float8_linear",
]

# --- constants -----------------------------------------------------------------------------

#: Non-negative E2M1 magnitudes; the index is the 3-bit magnitude code (OCP MX v1.0, 5.3.3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0  # 0b0111 = 1.5 * 2^2
E4M3_MAX = 448.0  # 0b0_1111_110 = 1.75 * 2^8
E4M3_MIN_SUBNORMAL = 2.0**-9  # 0b0_0000_001
E4M3_MIN_NORMAL_EXP = -6  # bias 7: exponent field 1 is 2^-6
E8M0_BIAS = 127  # E8M0 code 255 is NaN; codes 0..254 are 2^-127 .. 2^127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
UOS_QMAX = 7.25  # = 29/4, MXAttention eq. (33)
MX_BLOCK = 32
NV_BLOCK = 16


#: E4M3 with power-of-two group scales: a group's largest magnitude is scaled into [2^7, 2^8)
E4M3_POW2_TOP = 7


class Format(str, enum.Enum):
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    #: FP8 (E4M3) with one power-of-two scale per scaling group (:func:`e4m3_pow2_quantize_dequantize`):
    #: not a block format; the attention recipes say which groups (rows, key tiles, channels)
    E4M3 = "e4m3"

    @property
    def block(self) -> int:
        """Elements per block along the blocked dim (1 for E4M3: no blocks, nothing to pad)."""
        return {Format.MXFP4: MX_BLOCK, Format.NVFP4: NV_BLOCK}.get(self, 1)

    @property
    def fp4(self) -> bool:
        return self is not Format.E4M3


class ScaleRule(str, enum.Enum):
    OCP = "ocp"
    TFS = "tfs"
    UOS = "uos"

    @property
    def qmax(self) -> float:
        """The boundary ``Q`` with ``amax / 2^e`` in ``(Q/2, Q]`` (OCP: [4, 8), i.e. Q = 8)."""
        return {ScaleRule.OCP: 8.0, ScaleRule.TFS: 6.0, ScaleRule.UOS: UOS_QMAX}[self]


def parse_enum(enum_cls, value, what):
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"unknown {what} {value!r}; allowed: {allowed}") from None


# --- element rounding ----------------------------------------------------------------------


_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))


def _float_work(x: torch.Tensor) -> torch.Tensor:
    """fp32 (or fp64 when given fp64): every fp16/bf16/fp32 value is exact in fp32."""
    if not torch.is_floating_point(x):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    return x.double() if x.dtype == torch.float64 else x.float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round onto ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}: nearest, ties to even, saturating at ±6.

    The grid has step 0.5 below 2, step 1 in [2, 4) and step 2 from 4; inside each binade
    ``torch.round`` (half to even) on the scaled value picks the code with an even mantissa
    bit at a tie (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    Returns fp32 (fp64 for fp64 input). NaN propagates.
    """
    xf = _float_work(x)
    a = xf.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(xf.dtype)
    r = torch.clamp(torch.round(a / step) * step, max=E2M1_MAX)
    return torch.copysign(r, xf)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round onto OCP E4M3 (bias 7, subnormals from 2^-9, max 448): ties to even, saturating.

    Returns fp32 (fp64 for fp64 input) holding E4M3 values exactly. NaN propagates; ±inf
    saturates to ±448.
    """
    xf = _float_work(x)
    a = xf.abs()
    # exponent of the binade, floor(log2 a), exact through frexp; subnormals share 2^-6's step
    _, exp = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e = torch.clamp(exp - 1, min=E4M3_MIN_NORMAL_EXP)
    quantum = torch.ldexp(torch.ones_like(a), e - 3)  # 3 mantissa bits
    r = torch.round(a / quantum) * quantum
    r = torch.where(torch.isinf(a), torch.full_like(a, E4M3_MAX), r)
    r = torch.clamp(r, max=E4M3_MAX)
    return torch.copysign(r, xf)


def e4m3_pow2_quantize_dequantize(x: torch.Tensor, dim) -> torch.Tensor:
    """E4M3 with one power-of-two scale per group (the elements sharing all indices but ``dim``,
    an int or a tuple of ints): ``round_e4m3(x · 2^c) · 2^-c`` with ``c = 7 − ⌊log2 amax⌋`` (at most
    126), so the group's largest magnitude lands in [128, 256) and values down to 2^-16 of it stay
    nonzero (E4M3's subnormals end at 2^-9). All-zero groups stay zero. The scale is exact (a power
    of two), so it folds into the kernels' accumulators. Returns fp32 (fp64 for fp64 input)."""
    xf = _float_work(x)
    amax = xf.abs().amax(dim=dim, keepdim=True)
    _, exp = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))  # amax = m·2^exp, m in [0.5, 1)
    c = torch.clamp(E4M3_POW2_TOP + 1 - exp, max=126)
    xd = xf.double()  # 2^c up to 2^126 and x·2^c stay exact in fp64
    return torch.ldexp(round_e4m3(torch.ldexp(xd, c)), -c).to(xf.dtype)


def e4m3_values() -> torch.Tensor:
    """The 127 distinct non-negative finite E4M3 magnitudes, ascending (fp32), from the bits."""
    codes = torch.arange(128, dtype=torch.int64)  # sign bit clear
    exp_field = codes >> 3
    mant = (codes & 7).double()
    normal = exp_field > 0
    value = torch.where(
        normal,
        (1 + mant / 8) * torch.exp2((exp_field - 7).double()),
        (mant / 8) * 2.0**E4M3_MIN_NORMAL_EXP,
    )
    finite = codes != 0x7F  # S.1111.111 is NaN
    return torch.unique(value[finite]).float()


# --- E2M1 codes and nibble packing --------------------------------------------------------


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, sign in bit 3) of tensors holding E2M1 values exactly."""
    a = values.abs().float()
    grid = torch.tensor(E2M1_VALUES, device=values.device)
    mag = torch.searchsorted(grid, a.contiguous())
    if mag.numel() and (mag.max() > 7 or not torch.equal(grid[mag.clamp(max=7)], a)):
        raise ValueError("e2m1_codes: input holds values that are not on the E2M1 grid")
    sign = torch.signbit(values.float()).to(torch.int64)
    return (sign << 3 | mag).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Values (fp32) of 4-bit E2M1 codes."""
    grid = torch.tensor(E2M1_VALUES, device=codes.device)
    c = codes.to(torch.int64)
    mag = grid[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim, two per byte, the first (even index) in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# --- block scales ----------------------------------------------------------------------------


def mx_exponent(amax: torch.Tensor, rule: str | ScaleRule | float) -> torch.Tensor:
    """E8M0 exponent (int32) per block maximum ``amax >= 0``.

    ``rule`` is a :class:`ScaleRule` or a number ``Q`` for the ceiling family
    ``e = ceil(log2(amax / Q))`` (used by the UOS sweeps over Q in [6, 8]). The ceiling is
    taken exactly: the smallest ``e`` with ``amax <= Q * 2^e``, checked in fp64 with ``ldexp``.
    Zero blocks get ``e = 0`` (scale 1); results are clamped to E8M0's [-127, 127].
    """
    a = amax.double()
    positive = a > 0
    safe = torch.where(positive, a, torch.ones_like(a))
    if isinstance(rule, (int, float)) and not isinstance(rule, bool):
        qmax = float(rule)
        if not (qmax > 0 and math.isfinite(qmax)):
            raise ValueError(f"Qmax must be a positive finite number, got {rule!r}")
        rule_enum = None
    else:
        rule_enum = parse_enum(ScaleRule, rule, "MXFP4 scale rule")
        qmax = rule_enum.qmax
    if rule_enum is ScaleRule.OCP:
        _, exp = torch.frexp(safe)
        e = (exp - 1) - 2  # floor(log2 amax) - emax(E2M1)
    else:
        e = torch.ceil(torch.log2(safe) - math.log2(qmax)).to(torch.int64)
        one = torch.ones_like(safe)
        # log2 is not exact: fix the (rare) off-by-one both ways with exact comparisons
        e = torch.where(safe > qmax * torch.ldexp(one, e), e + 1, e)
        e = torch.where(safe <= qmax * torch.ldexp(one, e - 1), e - 1, e)
    e = torch.where(positive, e, torch.zeros_like(e))
    return torch.clamp(e, E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def block_scales(
    amax: torch.Tensor,
    fmt: str | Format,
    *,
    scale_rule: str | ScaleRule | float | None = None,
    global_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scales for block maxima ``amax``.

    Returns ``(scale, scale_storage)``: ``scale`` is the fp32 factor the E2M1 elements are
    multiplied by (for NVFP4 including the global scale), ``scale_storage`` what is stored
    (uint8 E8M0 codes, or float8_e4m3fn). All-zero blocks get scale 1.
    """
    fmt = parse_enum(Format, fmt, "format")
    amax = amax.float()
    if fmt is Format.MXFP4:
        if global_scale is not None:
            raise ValueError("global_scale applies to nvfp4 only (MXFP4 has no tensor scale)")
        e = mx_exponent(amax, ScaleRule.OCP if scale_rule is None else scale_rule)
        scale = torch.ldexp(torch.ones_like(amax), e)
        return scale, (e + E8M0_BIAS).to(torch.uint8)
    if scale_rule is not None:
        raise ValueError(f"scale_rule applies to mxfp4 only, got scale_rule={scale_rule!r} for nvfp4")
    if isinstance(global_scale, torch.Tensor):  # one scale per slice (a head), broadcast over its blocks
        g = global_scale.float()
        if not bool(((g > 0) & torch.isfinite(g)).all()):
            raise ValueError("global_scale must hold positive finite numbers")
    else:
        g = 1.0 if global_scale is None else float(global_scale)
        if not (g > 0 and math.isfinite(g)):
            raise ValueError(f"global_scale must be a positive finite number, got {global_scale!r}")
    s_e4m3 = round_e4m3(amax / E2M1_MAX / g)  # fp32 divisions, then one rounding to E4M3
    s_e4m3 = torch.where(amax > 0, s_e4m3, torch.ones_like(s_e4m3))
    return s_e4m3 * g, s_e4m3.to(torch.float8_e4m3fn)


#: NVFP4's tensor scale maps a tensor's largest magnitude into (1344, 2688], the top of E4M3 × E2M1.
NVFP4_TENSOR_RANGE = E4M3_MAX * E2M1_MAX


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's FP32 tensor scale for tensors (slices) with largest magnitude ``amax >= 0``, as a
    power of two: ``g = 2^ceil(log2(amax / (448·6)))`` (1 for all-zero tensors; exponents kept in
    [-126, 126]). Block scales ``round_e4m3(block amax / 6 / g)`` then never exceed 448, whatever
    the tensor's range (without it, NVFP4 saturates above 2688 and flushes blocks whose maximum is
    below ~0.006). A power of two keeps every dequantized value ``e2m1 · e4m3 · g`` exact in
    bf16, and the division by g exact."""
    e = mx_exponent(amax, NVFP4_TENSOR_RANGE).clamp(-126, 126)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)


# --- block quantization ------------------------------------------------------------------------


def _check_blockable(x: torch.Tensor, dim: int, block: int) -> int:
    if not torch.is_floating_point(x):
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension")
    d = dim % x.dim() if -x.dim() <= dim < x.dim() else None
    if d is None:
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    if x.shape[d] % block:
        raise ValueError(
            f"dimension {d} of shape {tuple(x.shape)} has size {x.shape[d]}, "
            f"not a multiple of the block size {block}"
        )
    if x.numel():
        bad = ~torch.isfinite(x)
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"quantize: the input (shape {tuple(x.shape)}, {x.dtype}) holds {int(bad.sum())} NaN/Inf "
                f"value(s), the first at index {first}; FP4 formats encode finite numbers only"
            )
    return d


def _quantize_blocks(x, fmt, scale_rule, dim, global_scale):
    """Shared core: returns (elements (E2M1 values, fp32), scale fp32, scale storage, d, moved shape).

    Works on a view with ``dim`` moved last and split into ``(..., n_blocks, block)``.
    """
    fmt = parse_enum(Format, fmt, "format")
    if not fmt.fp4:
        raise ValueError(f"{fmt.value!r} is not a block format: e4m3_pow2_quantize_dequantize quantizes to E4M3 "
                         "with power-of-two group scales")
    if x.dtype in _FLOAT8:  # exact in fp32 (isfinite and the arithmetic below have no float8 kernels)
        x = x.float()
    d = _check_blockable(x, dim, fmt.block)
    xm = x.float().movedim(d, -1)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // fmt.block, fmt.block)
    amax = blocks.abs().amax(dim=-1)
    scale, storage = block_scales(amax, fmt, scale_rule=scale_rule, global_scale=global_scale)
    if fmt is Format.MXFP4:
        # dividing by a power of two is exact (ldexp), so rounding happens once, in round_e2m1
        scaled = torch.ldexp(blocks, -mx_exponent_from_storage(storage).unsqueeze(-1))
    else:
        nonzero = (scale > 0).unsqueeze(-1)
        scaled = torch.where(nonzero, blocks / torch.where(nonzero, scale.unsqueeze(-1), 1.0), 0.0)
    elements = round_e2m1(scaled)
    if fmt is Format.MXFP4 and elements.dtype == torch.float32:
        elements = _saturate_finite(elements, mx_exponent_from_storage(storage))
    return elements, scale, storage, d, xm.shape


def _saturate_finite(elements: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """E2M1 elements of blocks with exponent ``e`` saturated at the largest value whose product
    with 2^e is a finite fp32 number: 3 at e = 126 (4·2^126 = 2^128 overflows), 1.5 at e = 127.
    Only the UOS and TFS rules reach those exponents (for maxima above ~10^38), rounding up past
    the block maximum; below e = 126 nothing changes."""
    limit = torch.where(e >= 127, 1.5, torch.where(e >= 126, 3.0, E2M1_MAX)).unsqueeze(-1)
    return torch.maximum(torch.minimum(elements, limit), -limit)


def mx_exponent_from_storage(storage: torch.Tensor) -> torch.Tensor:
    return storage.to(torch.int32) - E8M0_BIAS


def quantize_dequantize(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    scale_rule: str | ScaleRule | float | None = None,
    dim: int = -1,
    global_scale: float | None = None,
) -> torch.Tensor:
    """``quantize(...).dequantize()`` without packing: fp32 values in x's shape ("fake quant")."""
    elements, scale, _, d, moved_shape = _quantize_blocks(x, fmt, scale_rule, dim, global_scale)
    return (elements * scale.unsqueeze(-1)).reshape(moved_shape).movedim(-1, d)


@dataclass(frozen=True)
class QTensor:
    """A block-quantized FP4 tensor.

    ``codes``: uint8, two E2M1 codes per byte (low nibble first) along the blocked dimension,
    stored with that dimension moved last: shape ``(*other dims, shape[dim] // 2)``.
    ``scales``: per block, ``(*other dims, shape[dim] // block)``; uint8 E8M0 codes for MXFP4,
    float8_e4m3fn for NVFP4 (multiply by ``global_scale`` to get the scale).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: Format
    block: int
    dim: int
    shape: tuple[int, ...]
    scale_rule: ScaleRule | float | None = None
    global_scale: float | None = None

    def scale_values(self) -> torch.Tensor:
        """fp32 scale per block."""
        if self.fmt is Format.MXFP4:
            return torch.ldexp(torch.ones(self.scales.shape), mx_exponent_from_storage(self.scales))
        g = 1.0 if self.global_scale is None else self.global_scale
        return self.scales.float() * g

    def elements(self) -> torch.Tensor:
        """E2M1 element values (fp32), blocked dim last, unscaled."""
        return decode_e2m1(unpack_nibbles(self.codes))

    def dequantize(self) -> torch.Tensor:
        """fp32 tensor of the original shape."""
        el = self.elements()
        el = el.reshape(*el.shape[:-1], el.shape[-1] // self.block, self.block)
        vals = (el * self.scale_values().to(el.device).unsqueeze(-1)).flatten(-2)
        return vals.movedim(-1, self.dim)


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    scale_rule: str | ScaleRule | float | None = None,
    dim: int = -1,
    global_scale: float | None = None,
) -> QTensor:
    """Block-quantize ``x`` along ``dim`` to MXFP4 (block 32, E8M0) or NVFP4 (block 16, E4M3).

    ``scale_rule`` (MXFP4 only): ``"ocp"`` (default), ``"tfs"``, ``"uos"``, or a number ``Q``
    for ``e = ceil(log2(amax / Q))``. ``global_scale`` (NVFP4 only): FP32 tensor scale ``g``;
    block scales are ``round_e4m3(amax / 6 / g) * g`` and a block whose scale rounds to zero
    quantizes to zero. Raises ``ValueError`` for a ``dim`` that is not a multiple of the block
    and for NaN/Inf input.
    """
    fmt = parse_enum(Format, fmt, "format")
    if isinstance(global_scale, torch.Tensor):
        raise TypeError("quantize takes one float global_scale; per-slice tensor scales: quantize_dequantize")
    elements, _, storage, d, _ = _quantize_blocks(x, fmt, scale_rule, dim, global_scale)
    codes = pack_nibbles(e2m1_codes(elements.flatten(-2)))
    rule = None
    if fmt is Format.MXFP4:
        rule = scale_rule if isinstance(scale_rule, (int, float)) else parse_enum(
            ScaleRule, scale_rule or "ocp", "MXFP4 scale rule")
    return QTensor(
        codes=codes,
        scales=storage,
        fmt=fmt,
        block=fmt.block,
        dim=d,
        shape=tuple(x.shape),
        scale_rule=rule,
        global_scale=global_scale,
    )


def int8_quantize_dequantize(x: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    """Symmetric INT8 with one FP32 scale ``amax / 127`` per vector along ``dim`` (round half to
    even). Not an FP4 format: the 8-bit QKᵀ reference of the SageAttention3 harness and of the INT8-QK recipe."""
    xf = x.float()
    amax = xf.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.clamp(torch.round(xf / scale), -127, 127) * scale


# --- float8 linear layers (torchao's dynamic float8 numerics, for measuring) -----------------------


def float8_quantize_dequantize(x: torch.Tensor, *, rowwise: bool, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` through torchao's dynamic float8 quantization (``Float8Tensor.from_hp`` on its torch
    path), dequantized, in fp32: one scale per row (``rowwise``: the last dim's amax; a weight's
    output channel, an activation's token) or per tensor, ``scale = amax / 448`` computed in
    ``x``'s own dtype (bf16 for a bf16 tensor, as torchao divides) then fp32; ``x / scale`` in fp32,
    clamped to ±448, cast to ``float8_e4m3fn`` (round to nearest even), times the scale.

    ``amax`` replaces the per-tensor amax (the whole activation's, when ``x`` holds a sample of its
    rows). A row (or tensor) of zeros dequantizes to zeros: its scale is taken as 1 (torchao's
    torch path divides 0 by 0 there). NaN propagates."""
    if not torch.is_floating_point(x):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if amax is None:
        amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    elif rowwise:
        raise ValueError("amax replaces the per-tensor amax only (rowwise scales come from each row)")
    scale = (amax.to(x.dtype) / E4M3_MAX).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q * scale


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rowwise: bool,
                  x_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The product of torchao's ``Float8DynamicActivationFloat8WeightConfig`` (``PerRow()`` with
    ``rowwise``, else ``PerTensor()``), emulated in fp32: ``x`` (..., K) and ``weight`` (N, K) each
    through :func:`float8_quantize_dequantize` (per token and per output channel, or per tensor;
    ``x_amax``: the whole activation's amax when ``x`` is a sample of its rows, per tensor only),
    an fp32 matmul, then the bias. ``torch._scaled_mm`` accumulates the same e4m3 products in fp32
    and applies both scales after; only the order of the fp32 roundings differs."""
    xq = float8_quantize_dequantize(x, rowwise=rowwise, amax=None if rowwise else x_amax)
    wq = float8_quantize_dequantize(weight, rowwise=rowwise)
    y = xq @ wq.T
    return y if bias is None else y + bias.float()
