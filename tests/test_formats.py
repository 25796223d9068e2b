"""fp4video.formats against independent references: brute-force enumeration in fp64 / exact
fractions, torch's own float8 casts, and torchao's MX reference where its rounding matches."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4video import formats as F

# --- independent oracles (no code shared with fp4video.formats) ---------------------------------

E2M1_CODES = [  # (code, value): all 16 codes, OCP MX v1.0 table 5
    (0b0000, 0.0), (0b0001, 0.5), (0b0010, 1.0), (0b0011, 1.5),
    (0b0100, 2.0), (0b0101, 3.0), (0b0110, 4.0), (0b0111, 6.0),
    (0b1000, -0.0), (0b1001, -0.5), (0b1010, -1.0), (0b1011, -1.5),
    (0b1100, -2.0), (0b1101, -3.0), (0b1110, -4.0), (0b1111, -6.0),
]


def nearest_even(x: float, grid_codes: list[tuple[int, float]]) -> float:
    """Nearest grid value; at a tie the one whose code is even (its mantissa LSB is 0)."""
    best = None
    for code, val in grid_codes:
        d = abs(Fraction(x) - Fraction(val))
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0 and best[1] % 2 == 1):
            best = (d, code, val)
    return best[2]


POS_E2M1 = [(c, v) for c, v in E2M1_CODES if c < 8]


def oracle_e2m1(x: float) -> float:
    a = min(abs(x), 6.0)  # saturate
    return math.copysign(nearest_even(a, POS_E2M1), x)


def oracle_mx_exponent(amax: float, rule: str) -> int:
    """Exact, with Fractions: floor(log2 amax) - 2, or the least e with amax <= Q * 2^e."""
    if amax == 0:
        return 0
    a = Fraction(amax)
    if rule == "ocp":
        e = 0
        while Fraction(2) ** (e + 1) <= a:
            e += 1
        while Fraction(2) ** e > a:
            e -= 1
        return e - 2
    q = {"tfs": Fraction(6), "uos": Fraction(29, 4)}[rule]
    e = -200
    while a > q * Fraction(2) ** e:
        e += 1
    return e


def oracle_mxfp4(block: list[float], rule: str) -> list[float]:
    amax = max(abs(v) for v in block)
    e = max(-127, min(127, oracle_mx_exponent(amax, rule)))
    return [oracle_e2m1(v / 2.0**e) * 2.0**e for v in block]


# --- E2M1 ----------------------------------------------------------------------------------------


def test_e2m1_values_table_matches_codes():
    assert list(F.E2M1_VALUES) == [v for c, v in POS_E2M1]


def test_decode_every_e2m1_code():
    codes = torch.tensor([c for c, _ in E2M1_CODES], dtype=torch.uint8)
    got = F.decode_e2m1(codes)
    want = torch.tensor([v for _, v in E2M1_CODES])
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 keeps its sign


def test_e2m1_codes_roundtrip_every_value():
    vals = torch.tensor([v for _, v in E2M1_CODES])
    assert torch.equal(F.e2m1_codes(vals), torch.tensor([c for c, _ in E2M1_CODES], dtype=torch.uint8))


@pytest.mark.parametrize(
    "x, want",
    [  # every tie, each resolved to the code with an even mantissa bit
        (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
        (-0.25, -0.0), (-0.75, -1.0), (-5.0, -4.0),
    ],
)
def test_round_e2m1_ties_to_even(x, want):
    got = F.round_e2m1(torch.tensor([x]))
    assert got.item() == want and math.copysign(1, got.item()) == math.copysign(1, want)


@pytest.mark.parametrize("x, want", [(6.0, 6.0), (6.9, 6.0), (7.0, 6.0), (8.0, 6.0), (1e30, 6.0), (-1e30, -6.0)])
def test_round_e2m1_saturates(x, want):
    assert F.round_e2m1(torch.tensor([x])).item() == want


def test_round_e2m1_dense_sweep_matches_oracle():
    # every multiple of 1/64 in [-8, 8] (all ties included) plus the points just beside them
    base = torch.arange(-512, 513, dtype=torch.float64) / 64
    xs = torch.cat([base, base + 1e-9, base - 1e-9])
    got = F.round_e2m1(xs)
    want = torch.tensor([oracle_e2m1(float(x)) for x in xs], dtype=torch.float64)
    assert torch.equal(got, want)


def test_round_e2m1_keeps_nan():
    assert torch.isnan(F.round_e2m1(torch.tensor([float("nan")]))).all()


# --- E4M3 ----------------------------------------------------------------------------------------


def test_e4m3_values_match_torch_bit_patterns():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    want = torch.unique(every[torch.isfinite(every) & (every >= 0)])
    assert torch.equal(F.e4m3_values(), want)


def test_e4m3_counts_of_source_000():
    v = F.e4m3_values()
    assert v.numel() == 127 and v.max().item() == 448.0
    assert int((v <= 1 / 6).sum()) == 35  # a post-softmax block scale max(P)/6 lies in [0, 0.167]
    assert v[1].item() == 2.0**-9  # smallest subnormal


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's cast (round to nearest even) after clamping: torch gives NaN above 448."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def test_round_e4m3_every_value_and_midpoint():
    v = F.e4m3_values().double()
    mids = (v[1:] + v[:-1]) / 2  # every tie between neighbours
    xs = torch.cat([v, -v, mids, -mids, mids + 1e-12, mids - 1e-12]).float()
    assert torch.equal(F.round_e4m3(xs), _torch_e4m3(xs))


def test_round_e4m3_random_wide_range():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 12, (200_000,), generator=g).float())
    assert torch.equal(F.round_e4m3(xs), _torch_e4m3(xs))


@pytest.mark.parametrize("x, want", [(448.0, 448.0), (464.0, 448.0), (1e9, 448.0), (float("inf"), 448.0),
                                     (-1e9, -448.0), (2.0**-10, 0.0), (1.5 * 2.0**-10, 2.0**-9)])
def test_round_e4m3_edges(x, want):
    assert F.round_e4m3(torch.tensor([x])).item() == want


# --- nibble packing ------------------------------------------------------------------------------


def test_pack_low_nibble_first():
    codes = torch.tensor([0x1, 0xF, 0x7, 0x8], dtype=torch.uint8)
    assert F.pack_nibbles(codes).tolist() == [0xF1, 0x87]
    assert torch.equal(F.unpack_nibbles(F.pack_nibbles(codes)), codes)


# --- MXFP4 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["ocp", "tfs", "uos"])
def test_mx_exponent_matches_exact_oracle(rule):
    g = torch.Generator().manual_seed(1)
    amax = torch.cat([
        torch.rand(3000, generator=g) * torch.exp2(torch.randint(-30, 30, (3000,), generator=g).float()),
        # boundaries: exact powers of two times Q, and their float neighbours
        torch.tensor([6.0, 7.25, 8.0, 4.0, 3.625, 12.0, 14.5, 1.0, 2.0**-20 * 7.25]),
        torch.nextafter(torch.tensor([6.0, 7.25, 8.0, 14.5]), torch.tensor(0.0)),
        torch.nextafter(torch.tensor([6.0, 7.25, 8.0, 14.5]), torch.tensor(100.0)),
    ])
    got = F.mx_exponent(amax, rule)
    want = torch.tensor([oracle_mx_exponent(float(a), rule) for a in amax], dtype=torch.int32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rule, lo, hi", [("ocp", 4, 8), ("tfs", 3, 6), ("uos", 3.625, 7.25)])
def test_normalized_block_max_ranges(rule, lo, hi):
    """MXAttention Table 1: where each rule puts the normalized block maximum."""
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(2)) * 1000 + 1e-3
    x = amax.double() / torch.exp2(F.mx_exponent(amax, rule).double())
    if rule == "ocp":
        assert x.min() >= lo and x.max() < hi
    else:
        assert x.min() > lo and x.max() <= hi


@pytest.mark.parametrize("rule", ["ocp", "tfs", "uos"])
def test_mxfp4_matches_blockwise_oracle(rule):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g) * torch.exp2(torch.randint(-8, 8, (6, 1), generator=g).float())
    got = F.quantize(x, "mxfp4", scale_rule=rule).dequantize()
    want = torch.tensor([oracle_mxfp4(row[i:i + 32].tolist(), rule) for row in x for i in (0, 32)]).reshape(6, 64)
    assert torch.equal(got, want), f"shape {tuple(x.shape)}, rule {rule}"


def test_mxfp4_along_dim0_equals_transposed():
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(4))
    a = F.quantize(x, "mxfp4", scale_rule="uos", dim=0).dequantize()
    b = F.quantize(x.T.contiguous(), "mxfp4", scale_rule="uos", dim=-1).dequantize().T
    assert a.shape == x.shape and torch.equal(a, b)


def test_qtensor_layout_and_storage():
    x = torch.randn(3, 64, 7)
    qt = F.quantize(x, "mxfp4", dim=1)
    assert qt.codes.dtype == torch.uint8 and qt.codes.shape == (3, 7, 32)
    assert qt.scales.dtype == torch.uint8 and qt.scales.shape == (3, 7, 2)
    assert qt.dequantize().dtype == torch.float32 and qt.dequantize().shape == x.shape
    nv = F.quantize(x, "nvfp4", dim=1)
    assert nv.scales.dtype == torch.float8_e4m3fn and nv.scales.shape == (3, 7, 4)


def test_zero_block_has_scale_one_and_zero_elements():
    x = torch.zeros(2, 32)
    x[1] = torch.linspace(-1, 1, 32)
    for fmt in ("mxfp4", "nvfp4"):
        qt = F.quantize(x, fmt)
        assert qt.scale_values()[0].eq(1).all(), fmt
        assert qt.dequantize()[0].eq(0).all(), fmt


def test_tiny_and_huge_blocks():
    tiny = torch.full((1, 32), 1e-40)  # fp32 subnormal
    huge = torch.full((1, 32), 3e38)
    for rule in ("ocp", "uos"):
        assert torch.isfinite(F.quantize(tiny, "mxfp4", scale_rule=rule).dequantize()).all()
        dq = F.quantize(huge, "mxfp4", scale_rule=rule).dequantize()
        assert torch.isfinite(dq).all() and (dq - huge).abs().div(huge).max() < 0.25
    # NVFP4: amax/6 below half the smallest E4M3 subnormal -> scale 0 -> the block quantizes to 0
    assert F.quantize(torch.full((1, 16), 1e-4), "nvfp4").dequantize().eq(0).all()


def test_uos_keeps_exp0_exact():
    """MXAttention App. J: the tile holding the row max contributes exp(0) = 1, exact under UOS."""
    p = torch.rand(4, 32) * 0.9
    p[:, 5] = 1.0
    assert (F.quantize(p, "mxfp4", scale_rule="uos").dequantize()[:, 5] == 1.0).all()


# --- NVFP4 -----------------------------------------------------------------------------------------


def oracle_nvfp4(block: list[float], g: float = 1.0) -> list[float]:
    amax = max(abs(v) for v in block)
    if amax == 0:
        return [0.0] * len(block)
    s = _torch_e4m3(torch.tensor([amax], dtype=torch.float32) / 6.0 / g).item()
    if s == 0:
        return [0.0] * len(block)
    scale = torch.tensor(s, dtype=torch.float32) * g
    return [oracle_e2m1(float(torch.tensor(v, dtype=torch.float32) / scale)) * float(scale) for v in block]


@pytest.mark.parametrize("g", [None, 0.01, 3.0])
def test_nvfp4_matches_blockwise_oracle(g):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 32, generator=gen) * torch.exp2(torch.randint(-10, 6, (8, 1), generator=gen).float())
    got = F.quantize(x, "nvfp4", global_scale=g).dequantize()
    want = torch.tensor([oracle_nvfp4(r[i:i + 16].tolist(), g or 1.0) for r in x for i in (0, 16)]).reshape(8, 32)
    assert torch.allclose(got, want, rtol=0, atol=0), f"g={g}"


# --- errors ------------------------------------------------------------------------------------------


def test_non_multiple_dim_names_shape_and_block():
    with pytest.raises(ValueError, match=r"\(4, 40\).*block size 32"):
        F.quantize(torch.randn(4, 40), "mxfp4")
    with pytest.raises(ValueError, match="block size 16"):
        F.quantize(torch.randn(24, 4), "nvfp4", dim=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_raise(bad):
    x = torch.randn(2, 32)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=r"holds 1 NaN/Inf value\(s\), the first at index \(1, 3\)"):
        F.quantize(x, "mxfp4")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        F.quantize(torch.randn(32), "fp4")
    with pytest.raises(ValueError, match="unknown MXFP4 scale rule 'round'"):
        F.quantize(torch.randn(32), "mxfp4", scale_rule="round")
    with pytest.raises(ValueError, match="global_scale applies to nvfp4"):
        F.quantize(torch.randn(32), "mxfp4", global_scale=2.0)
    with pytest.raises(ValueError, match="scale_rule applies to mxfp4"):
        F.quantize(torch.randn(32), "nvfp4", scale_rule="uos")
    with pytest.raises(TypeError, match="floating-point"):
        F.quantize(torch.arange(32), "mxfp4")


def test_input_not_modified():
    x = torch.randn(4, 64)
    before = x.clone()
    F.quantize(x, "nvfp4")
    F.quantize_dequantize(x, "mxfp4", scale_rule="uos")
    assert torch.equal(x, before)


# --- torchao (independent implementation) ----------------------------------------------------------


def _torchao_to_mx():
    try:
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"torchao MX reference unavailable: {e}")
    return to_mx, ScaleCalculationMode


def test_mxfp4_ocp_matches_torchao_floor():
    """torchao's FLOOR mode is the OCP rule; its fp32->e2m1 cast rounds to nearest even."""
    to_mx, mode = _torchao_to_mx()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g).float())
    scale_e8m0, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode.FLOOR)
    codes = F.unpack_nibbles(data.view(torch.uint8))
    ref = (F.decode_e2m1(codes).reshape(64, 4, 32) * torch.exp2(scale_e8m0.view(torch.uint8).float() - 127).reshape(64, 4, 1))
    ours = F.quantize(x, "mxfp4", scale_rule="ocp")
    assert torch.equal(ours.dequantize(), ref.reshape(64, 128))
    assert torch.equal(ours.codes, data.view(torch.uint8).reshape(ours.codes.shape))
    assert torch.equal(ours.scales, scale_e8m0.view(torch.uint8).reshape(ours.scales.shape))


# --- properties (hypothesis) ------------------------------------------------------------------------

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=32, max_size=32), st.integers(-20, 20), st.sampled_from(["ocp", "tfs", "uos"]))
def test_mxfp4_power_of_two_equivariance(vals, k, rule):
    """Power-of-two scales: quantizing 2^k·x gives exactly 2^k·quantize(x) (inside E8M0's range)."""
    x = torch.tensor(vals, dtype=torch.float32)
    a = F.quantize_dequantize(x * 2.0**k, "mxfp4", scale_rule=rule)
    b = F.quantize_dequantize(x, "mxfp4", scale_rule=rule) * 2.0**k
    assert torch.equal(a, b)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite, min_size=32, max_size=32), st.sampled_from(["ocp", "tfs", "uos"]))
def test_mxfp4_error_bound_and_sign(vals, rule):
    """|x − x̂| is at most half a grid step (2^(e-1) at the top), or the clip to 6·2^e; signs never flip."""
    x = torch.tensor(vals, dtype=torch.float32)
    dq = F.quantize_dequantize(x, "mxfp4", scale_rule=rule)
    e = F.mx_exponent(x.abs().amax(), rule).item()
    step = 2.0 ** e
    bound = torch.maximum(torch.full_like(x, step), x.abs() - 6 * step)
    assert ((dq - x).abs() <= bound + 1e-30).all()
    assert ((dq == 0) | (torch.sign(dq) == torch.sign(x))).all()
    assert torch.equal(F.round_e2m1(dq / step) * step, dq)  # every element on the scaled grid


@settings(max_examples=150, deadline=None)
@given(st.lists(finite, min_size=16, max_size=16))
def test_nvfp4_roundtrip_through_storage(vals):
    x = torch.tensor(vals, dtype=torch.float32)
    qt = F.quantize(x, "nvfp4")
    assert torch.equal(qt.dequantize(), F.quantize_dequantize(x, "nvfp4"))
    assert torch.equal(qt.elements(), F.decode_e2m1(F.unpack_nibbles(qt.codes)))


def test_e4m3_pow2_groups_round_to_the_nearest_e4m3_value_at_their_scale():
    """e4m3_pow2_quantize_dequantize against an independent oracle: each group's largest magnitude
    scaled by a power of two into [128, 256), every element the nearest E4M3 value (ties to the
    even code) at that scale, read off the table of all 127 magnitudes; zero groups stay zero,
    tuple dims form one group."""
    from fp4video.formats import e4m3_pow2_quantize_dequantize, e4m3_values

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 40, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (6, 4, 1), generator=g))
    x[0, 0] = 0
    got = e4m3_pow2_quantize_dequantize(x, dim=-1)
    grid = e4m3_values().double()
    amax = x.abs().amax(-1, keepdim=True)
    c = 7 - torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
    scaled = x.abs() * torch.exp2(c)
    assert ((scaled.amax(-1) >= 128) & (scaled.amax(-1) < 256) | (amax[..., 0] == 0)).all()
    dist = (scaled[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    ties = (dist == best)
    codes = torch.arange(len(grid))
    pick = torch.where(ties, codes, len(grid) + 1)
    even = torch.where(ties & (codes % 2 == 0), codes, len(grid) + 1).amin(-1)  # ties: the even code
    idx = torch.where(ties.sum(-1) > 1, even, pick.amin(-1))
    want = torch.copysign(grid[idx] * torch.exp2(-c), x)
    assert torch.equal(got, torch.where(x == 0, torch.zeros_like(x), want))
    assert not got[0, 0].any()
    tiles = e4m3_pow2_quantize_dequantize(x, dim=(-2, -1))  # one scale per (4 × 40) group
    amax_t = x.abs().amax(dim=(-2, -1))
    assert torch.equal(tiles.abs().amax(dim=(-2, -1)) * torch.exp2(7 - torch.floor(torch.log2(torch.where(amax_t > 0, amax_t, 1.0)))) >= 128,
                       amax_t > 0)


def test_e4m3_is_not_a_block_format():
    from fp4video.formats import Format, quantize_dequantize

    assert Format("e4m3").block == 1 and not Format.E4M3.fp4
    with pytest.raises(ValueError, match="not a block format"):
        quantize_dequantize(torch.ones(32), "e4m3")
