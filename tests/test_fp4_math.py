"""The arithmetic contracts of the kernels' FP4 device functions (:mod:`fp4video.kernels.fp4_math`),
each against an exact reference: correctly rounded divisions for every fp32 mantissa, E2M1 and
E4M3 rounding at every scale, MXFP4 block exponents, the e4m3 shift. CPU: the Triton interpreter;
GPU tests run the inline-PTX forms."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4video.kernels.fp4_math import (  # noqa: E402
    const_div_from, const_div_rn, div6_rn, div_const_rn, e2m1_times_scale, e4m3_bits, fake_quant_rows,
    fp8_shift_from_raw_max, mx_block_exponent, newton_recip, nvfp4_block_scale, recip_rn_few_bits,
    round_e2m1_at_scale, round_e2m1_f16x2_odd, round_e2m1_signed)
from fp4video.kernels.loop_nvfp4 import RCP_P_RANGE  # noqa: E402
from fp4video.kernels.loop_scaled_sm100 import chunk_scales  # noqa: E402
from fp4video.kernels.scaled_math import packed_p  # noqa: E402
from fp4video.reference import TWO_LEVEL_P_RANGE as _P_RANGE  # noqa: E402

P_RANGE = tl.constexpr(_P_RANGE)  # a jit function reads only constexpr globals


@triton.jit
def _round_at_scale_kernel(P, U, Out, N: tl.constexpr, SIGNED: tl.constexpr):
    i = tl.arange(0, N)
    if SIGNED:
        tl.store(Out + i, round_e2m1_signed(tl.load(P + i), tl.load(U + i)))
    else:
        tl.store(Out + i, round_e2m1_at_scale(tl.load(P + i), tl.load(U + i)))



@triton.jit
def _division_kernel(A, Y0, Out, WHICH: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(A + i)
    if WHICH == 0:
        r = div6_rn(a)
    elif WHICH == 1:
        r = div_const_rn(a, P_RANGE, RCP_P_RANGE)
    elif WHICH == 2:
        r = const_div_rn(P_RANGE, a, FAST)
    else:
        r = const_div_from(P_RANGE, a, tl.load(Y0 + i))
    tl.store(Out + i, r)


@triton.jit
def _newton_kernel(S, R0, Out, RECIP: tl.constexpr, FAST: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    s = tl.load(S + i)
    tl.store(Out + i, recip_rn_few_bits(s, FAST) if RECIP else newton_recip(s, tl.load(R0 + i)))


def test_divisions_without_div_rn_are_correctly_rounded_for_every_mantissa():
    """The NVFP4 loop's divisions without a division instruction — a / 6 (block scales),
    a / (448·6) and (448·6) / b (SageAttention3's two-level row factor) — equal fp64 division
    rounded to fp32 for all 2^23 fp32 mantissas (one binade; powers of two scale the whole
    computation exactly), (448·6) / b also from reciprocal estimates up to 4 ulp off (the GPU's
    approximate division is within 2). fp64 then fp32 is a double rounding that cannot err here:
    none of these quotients lies within 2^-53 of an fp32 rounding boundary."""
    import numpy as np

    from fp4video.reference import TWO_LEVEL_P_RANGE as C

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = 1 << 16
    a = ((torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32))  # [1, 2)
    a64 = a.numpy().astype(np.float64)
    want = {0: a64 / 6.0, 1: a64 / C, 2: C / a64}
    recip = torch.from_numpy((1.0 / a64).astype(np.float32))
    cases = [(w, 0) for w in (0, 1, 2)] + [(3, k) for k in (-4, -2, -1, 1, 2, 4)]
    for which, k in cases:
        y0 = (recip.view(torch.int32) + k).view(torch.float32)
        out = torch.empty(len(a), device=dev)
        _division_kernel[(len(a) // block,)](a.to(dev), y0.to(dev), out, WHICH=which, FAST=dev == "cuda", BLOCK=block)
        expect = torch.from_numpy(want[min(which, 2)].astype(np.float32))
        bad = (out.cpu() != expect).nonzero()[:, 0]
        assert len(bad) == 0, f"case {which} (start {k:+d} ulp): {len(bad)} wrong, e.g. a={a[bad[:3]].tolist()}"


def test_recip_of_e4m3_values_is_correctly_rounded():
    """rn(1/s) for every positive E4M3 value s (the NVFP4 block scales), from start points up to
    4 ulp off (the GPU's approximate division is within 2), and as compiled (recip_rn_few_bits)."""
    import numpy as np

    from fp4video.formats import e4m3_values

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = e4m3_values().float()
    s = s[s > 0]
    want = torch.from_numpy((1.0 / s.numpy().astype(np.float64)).astype(np.float32))
    n = 1 << (len(s) - 1).bit_length()
    pad = lambda x: torch.cat([x, torch.ones(n - len(x))]).to(dev)  # noqa: E731
    for k in range(-4, 5):
        r0 = (want.view(torch.int32) + k).view(torch.float32)
        out = torch.empty(n, device=dev)
        _newton_kernel[(1,)](pad(s), pad(r0), out, RECIP=False, FAST=False, N=n)
        assert torch.equal(out[: len(s)].cpu(), want), k
    out = torch.empty(n, device=dev)
    _newton_kernel[(1,)](pad(s), pad(s), out, RECIP=True, FAST=dev == "cuda", N=n)
    assert torch.equal(out[: len(s)].cpu(), want)


@triton.jit
def _e4m3_bits_kernel(X, Out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, e4m3_bits(tl.load(X + i)))


def test_e4m3_bits_of_every_nonnegative_e4m3_value():
    """The NVFP4 scale bytes the pre-pass and the native loop write: for every E4M3 value >= 0
    (zero, the seven subnormals, every normal up to 448), the byte torch stores for it."""
    from fp4video.formats import e4m3_values

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s = e4m3_values().float()
    s = torch.unique(s[s >= 0])
    n = 1 << (len(s) - 1).bit_length()
    x = torch.cat([s, torch.zeros(n - len(s))]).to(dev)
    out = torch.empty(n, dtype=torch.uint8, device=dev)
    _e4m3_bits_kernel[(1,)](x, out, N=n)
    assert torch.equal(out[: len(s)].cpu(), s.to(torch.float8_e4m3fn).view(torch.uint8))


def e2m1_rounding_cases(n_random: int, exponents):
    """Inputs of the E2M1 rounding tests: multiples a of units 2^e — every grid point, tie and
    saturating value, their float neighbours and ``n_random`` values in [0, 7.25) — for each e of
    ``exponents``; returns (a, e, unit, p = a · unit, exact: the units are powers of two)."""
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6.5, 7, 7.25, 8, 9])
    a = torch.cat([grid, torch.nextafter(grid, torch.tensor(-1.0)).clamp(min=0), torch.nextafter(grid, torch.tensor(99.0)),
                   torch.rand(n_random, generator=torch.Generator().manual_seed(0)) * 7.25])
    e = torch.tensor(list(exponents))
    a, e = a.repeat(len(e)), e.repeat_interleave(len(a))
    unit = torch.ldexp(torch.ones_like(a), e)
    return a, e, unit, a * unit


@pytest.mark.parametrize("signed", [False, True])
def test_round_e2m1_at_scale_matches_reference_rounding(signed):
    """The magic-number rounding equals formats.round_e2m1(p / 2^e) · 2^e for every grid point,
    every tie, their float neighbours and random values, over 40 binades of the unit (compiled
    on a GPU, interpreted on the CPU); signed: round_e2m1_signed of ±p gives ±that."""
    from fp4video.formats import round_e2m1

    dev = "cuda" if torch.cuda.is_available() else "cpu"

    a, e, unit, p = e2m1_rounding_cases(1024, range(-30, 10))
    n = 1 << (len(p) - 1).bit_length()
    pad = lambda x: torch.nn.functional.pad(x, (0, n - len(x)), value=1.0)  # noqa: E731
    want = round_e2m1(a) * unit
    if signed:  # every value with both signs
        p, unit, want, a, e = torch.cat([p, -p]), unit.repeat(2), torch.cat([want, -want]), a.repeat(2), e.repeat(2)
        n = 1 << (len(p) - 1).bit_length()
    out = torch.empty(n, device=dev)
    _round_at_scale_kernel[(1,)](pad(p).to(dev), pad(unit).to(dev), out, N=n, SIGNED=signed)
    bad = (out[: len(p)].cpu() != want).nonzero()[:5, 0]
    assert len(bad) == 0, [(a[i].item(), e[i].item(), out[i].item() / unit[i].item()) for i in bad]


@triton.jit
def _packed_p_kernel(X, Codes, Pairs, N: tl.constexpr, HW: tl.constexpr):
    rows = tl.arange(0, 16)
    cols = tl.arange(0, N)
    half = tl.arange(0, N // 2)
    packed, pairs = packed_p(tl.load(X + rows[:, None] * N + cols[None, :]), HW)
    tl.store(Codes + rows[:, None] * (N // 2) + half[None, :], packed)
    tl.store(Pairs + rows[:, None] * (N // 2) + half[None, :], pairs)


@triton.jit
def _chunk_read_back_kernel(desc, out, R: tl.constexpr, C: tl.constexpr):
    t = tl.program_id(0)
    sc = chunk_scales(desc, t, R, C)
    rows, cols = tl.arange(0, R), tl.arange(0, C)
    tl.store(out + t * R * C + rows[:, None] * C + cols[None, :], sc)


def test_chunk_scales_read_back_in_the_kernel():
    check_chunk_scales_read_back("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_chunk_scales_read_back_in_the_kernel_gpu():
    check_chunk_scales_read_back("cuda")


def check_chunk_scales_read_back(dev):
    """What the sm_100 loop reads (``loop_scaled_sm100.chunk_scales``: a TMA box of ``scale_chunks``'
    layout, then the reshape / permute Triton turns into ``tcgen05.cp``) is each tile's (R, C)
    scales as they were: for K̂'s shape (128 keys × 4 or 8 scales) and V̂ᵀ's (128 or 256 channels
    × 4), uint8 and E4M3 bytes (interpreted on the CPU, compiled on a GPU)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fp4video.kernels.loop_scaled import scale_chunks

    if dev == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    for rows, cols, e4m3 in ((128, 4, False), (128, 8, True), (256, 4, False)):
        tiles = torch.randint(0, 120, (3, rows, cols), dtype=torch.uint8)  # (E4M3 bytes below NaN's)
        chunks = scale_chunks(tiles).to(dev)
        if e4m3:
            chunks = chunks.view(torch.float8_e4m3fn)
        out = torch.zeros(3, rows, cols, dtype=chunks.dtype, device=dev)
        _chunk_read_back_kernel[(3,)](TensorDescriptor.from_tensor(chunks, [1, *chunks.shape[1:]]), out, R=rows, C=cols)
        assert torch.equal(out.view(torch.uint8).cpu(), tiles), (rows, cols, e4m3)


def test_p_codes_and_pair_sums_are_the_reference_e2m1_rounding():
    """The native loop's P: values in units of their block scale rounded to E2M1 (ties to even,
    saturating at 6 — the contract of Blackwell's ``cvt.rn.satfinite.e2m1x2.f32``, which the loop
    uses on sm_100+; here its fp32 form, compiled on a GPU, interpreted on the CPU), packed two codes
    per byte with the first of each pair in the low nibble, and the pair sums PNQ adds: for every
    grid point, tie and saturating value, their float neighbours and random values, against
    fp4video.formats' rounding, codes and packing."""
    from fp4video.formats import e2m1_codes, pack_nibbles, round_e2m1

    a, _, _, _ = e2m1_rounding_cases(1024, [0])
    n_cols = 128
    x = torch.nn.functional.pad(a, (0, (-len(a)) % (16 * n_cols)), value=0.0).reshape(-1, 16, n_cols)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for chunk in x:
        codes = torch.empty(16, n_cols // 2, dtype=torch.uint8, device=dev)
        pairs = torch.empty(16, n_cols // 2, device=dev)
        _packed_p_kernel[(1,)](chunk.contiguous().to(dev), codes, pairs, N=n_cols, HW=False)
        q = round_e2m1(chunk)
        assert torch.equal(codes.cpu(), pack_nibbles(e2m1_codes(q)))
        assert torch.equal(pairs.cpu(), q.reshape(16, -1, 2).sum(-1))


@triton.jit
def _round_f16_pairs_kernel(P, U, Out, N: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    u = tl.load(U + i)
    tl.store(Out + i, round_e2m1_f16x2_odd(tl.load(P + i), u.to(tl.float16), (u * 6.0).to(tl.float16), ASM))


def test_round_e2m1_on_f16_pairs_matches_reference_rounding():
    check_round_e2m1_on_f16_pairs("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_round_e2m1_on_f16_pairs_gpu():
    check_round_e2m1_on_f16_pairs("cuda")


def check_round_e2m1_on_f16_pairs(dev):
    """The e4m3 loop's P rounding on f16 pairs (round to odd into f16, then the magic number):
    equal to formats.round_e2m1(p / unit) · unit for every grid point, their float neighbours,
    values that saturate and random values, over the units the loop uses (2^-11 to 2^4); at an
    exact tie it rounds up (the one documented difference: 1.25 -> 1.5, 2.5 -> 3, 5 -> 6 and
    0.25 -> 0.5 instead of to even). In the interpreter its fp32 stand-in; on a GPU the inline
    PTX, against the reference and against the stand-in on 2^22 random fp32 values."""
    from fp4video.formats import round_e2m1

    a, e, unit, p = e2m1_rounding_cases(2048, range(-11, 5))
    ties_up = torch.isin(a, torch.tensor([0.25, 1.25, 2.5, 5.0]))
    want = torch.where(ties_up, round_e2m1(a + 0.25 * torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))),
                       round_e2m1(a)) * unit
    n = 1 << (len(p) - 1).bit_length()
    pad = lambda x: torch.nn.functional.pad(x, (0, n - len(x)), value=1.0).to(dev)  # noqa: E731
    out = torch.full((n,), float("nan"), dtype=torch.float16, device=dev)
    _round_f16_pairs_kernel[(1,)](pad(p), pad(unit), out, N=n, ASM=dev == "cuda")
    bad = (out[: len(p)].float().cpu() != want).nonzero()[:5, 0]
    assert len(bad) == 0, [(a[i].item(), e[i].item(), out[i].item() / unit[i].item()) for i in bad]
    if dev == "cuda":  # the PTX against its stand-in, bit for bit, on random exponents and mantissas
        g = torch.Generator().manual_seed(1)
        e = torch.randint(-11, 5, (1 << 22,), generator=g)
        unit = torch.ldexp(torch.ones(1 << 22), e)
        p = torch.rand(1 << 22, generator=g) * 7.5 * unit
        outs = []
        for asm in (True, False):
            outs.append(torch.full((1 << 22,), float("nan"), dtype=torch.float16, device=dev))
            _round_f16_pairs_kernel[(1 << 12,)](p.to(dev), unit.to(dev), outs[-1], N=1 << 10, ASM=asm)
        assert torch.equal(outs[0], outs[1])


@triton.jit
def _times_scale_kernel(X, S, Out, N: tl.constexpr, PACKED: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, e2m1_times_scale(tl.load(X + i), tl.load(S + i), Out.dtype.element_ty, PACKED))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_e2m1_times_scale_matches_reference(dtype):
    """round_e2m1(x) · s in bf16 / fp16 / fp32 (the NVFP4 loop's P̂) equals the fp64 reference
    (formats.round_e2m1, saturating at 6) rounded to the output dtype — which it must match bit
    for bit, the product being exact — for every E4M3 scale s (and 0, a dead block) times grid
    points, ties, their float neighbours, values that saturate and random values. On a GPU this
    is the packed path (min / fma on 16-bit pairs), in the interpreter the fp32 one."""
    from fp4video.formats import e4m3_values, round_e2m1

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6.4, 7, 8, 9, 11.9])
    x = torch.cat([grid, torch.nextafter(grid, torch.tensor(-1.0)).clamp(min=0), torch.nextafter(grid, torch.tensor(99.0)),
                   torch.rand(200, generator=torch.Generator().manual_seed(0)) * 9])
    s = e4m3_values().float()
    s = torch.cat([s[s > 0], torch.zeros(1)])
    x, s = x.repeat(len(s)), s.repeat_interleave(len(x))
    n = 1 << (len(x) - 1).bit_length()
    pad = lambda t: torch.nn.functional.pad(t, (0, n - len(t))).to(dev)  # noqa: E731
    out = torch.full((n,), float("nan"), dtype=dtype, device=dev)
    _times_scale_kernel[(1,)](pad(x), pad(s), out, N=n, PACKED=dev == "cuda")
    want = (round_e2m1(x.double()) * s.double()).to(dtype)
    assert torch.equal(want.double(), round_e2m1(x.double()) * s.double())  # the product is exact
    bad = (out[: len(x)].cpu() != want).nonzero()[:5, 0]
    assert len(bad) == 0, [(x[i].item(), s[i].item(), out[i].item(), want[i].item()) for i in bad]


@triton.jit
def _block_scale_kernel(A, Out, N: tl.constexpr, HW: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, nvfp4_block_scale(tl.load(A + i), HW))


@pytest.mark.parametrize("hw", [False, True])
def test_nvfp4_block_scale_matches_reference(hw):
    """The NVFP4 block scale round_e4m3(rn(amax / 6)) — in fp32 arithmetic, and (hw, GPU only)
    by the hardware's E4M3 conversion — equals formats.round_e4m3 of the fp32 quotient for 6·v
    and 6·(midpoints of consecutive E4M3 values v), their float neighbours, subnormal scales, the
    saturation at 448, values that round to 0 and random values over 40 binades."""
    from fp4video.formats import e4m3_values, round_e4m3

    if hw and not torch.cuda.is_available():
        pytest.skip("the hardware E4M3 conversion needs a CUDA GPU (sm_89+)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    v = e4m3_values().double()
    v = v[v >= 0]
    mids = (v[1:] + v[:-1]) / 2
    a = (torch.cat([v, mids, torch.tensor([464.0, 480.0, 1e4, 2.0 ** -11, 2.0 ** -10])]) * 6).float()
    a = torch.cat([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(1e30)),
                   torch.exp2(torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 40 - 30)])
    n = 1 << (len(a) - 1).bit_length()
    out = torch.full((n,), float("nan"), device=dev)
    _block_scale_kernel[(1,)](torch.nn.functional.pad(a, (0, n - len(a))).to(dev), out, N=n, HW=hw)
    want = round_e4m3((a.double() / 6).float())  # fp64 then fp32: correctly rounded for a quotient
    bad = (out[: len(a)].cpu() != want).nonzero()[:5, 0]
    assert len(bad) == 0, [(a[i].item(), out[i].item(), want[i].item()) for i in bad]


@triton.jit
def _block_exponent_kernel(A, Out, N: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, mx_block_exponent(tl.load(A + i), OCP, QMAX))


@pytest.mark.parametrize("rule", ["ocp", "tfs", "uos", 5.0, 6.5, 8.0, 12.0, 3.0])
def test_mx_block_exponent_matches_reference(rule):
    """The in-kernel block exponent (two integer operations on the bits) equals
    formats.mx_exponent (exact fp64 ceiling) for every rule and other Qmax values, at each
    boundary Q·2^e, its float neighbours, random values and subnormals (both clamped to the
    kernels' [-126, 126])."""
    from fp4video.formats import ScaleRule, mx_exponent

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qmax = ScaleRule(rule).qmax if isinstance(rule, str) else rule
    e = torch.arange(-128, 120, 7, dtype=torch.float64)
    edges = torch.cat([torch.ldexp(torch.full_like(e, qmax), e.int()), torch.ldexp(torch.full_like(e, 1.0), e.int())]).float()
    a = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e38)),
                   torch.rand(2000, generator=torch.Generator().manual_seed(3)).mul(60).sub(30).exp2(),
                   torch.tensor([1e-45, 1e-40, 5e-39])])
    a = a[(a > 0) & torch.isfinite(a)]
    n = 1 << (len(a) - 1).bit_length()
    a = torch.nn.functional.pad(a, (0, n - len(a)), value=1.0)
    out = torch.empty(n, dtype=torch.int32, device=dev)
    _block_exponent_kernel[(1,)](a.to(dev), out, N=n, OCP=rule == "ocp", QMAX=qmax)
    want = mx_exponent(a, rule).clamp(-126, 126)
    got = out.cpu().clamp(-126, 126)
    bad = (got != want).nonzero()[:5, 0]
    assert len(bad) == 0, [(a[i].item(), got[i].item(), want[i].item()) for i in bad]


@triton.jit
def fp8_shift(amax):
    """Exponent c that moves E2M1 × power-of-two values with largest magnitude ``amax`` into e4m3,
    from their binade E: scaled by 2^(8 - E), the largest is at most 1.5·2^8 = 384 < 448. The
    reference the pre-pass's shift from the raw maximum is checked against (amax = 0 gives the
    largest shift: nothing to scale)."""
    e0 = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.minimum(tl.maximum(8 - e0, -126), 126)


@triton.jit
def _shift_kernel(A, Raw, Quantized, N: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr):
    i = tl.arange(0, N)
    amax = tl.load(A + i)
    tl.store(Raw + i, fp8_shift_from_raw_max(amax, OCP, QMAX))
    # a block of 32 holding amax and smaller values: its largest quantized value
    block = amax[:, None] * (1.0 - tl.arange(0, 32)[None, :] / 64.0)
    q = fake_quant_rows(block, N, 32, 1, 32, OCP, QMAX, True)
    tl.store(Quantized + i, fp8_shift(tl.max(tl.abs(q), axis=1)))


@pytest.mark.parametrize("rule", ["uos", "ocp"])
def test_fp8_shift_from_raw_max_equals_shift_of_quantized_max(rule):
    """The V pre-pass takes its e4m3 shift from the channel's largest |v| before quantization;
    it equals the shift of the largest quantized value, for every rounding boundary of both scale
    rules, their float neighbours, zero and subnormals, up to 2^100 (the in-kernel rounding's
    magic number 2^22 times the value's binade must stay finite: values below 2^105)."""
    from fp4video.formats import ScaleRule

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    r = ScaleRule(rule)
    m = torch.tensor([1.0, 3.5, 3.625, 4.0, 5.0, 6.0, 7.0, 7.25, 7.5])
    e = torch.arange(-140, 100, 3)
    a = torch.ldexp(m.repeat(len(e)), e.repeat_interleave(len(m)))
    a = torch.cat([a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(1e38)),
                   torch.tensor([0.0, 1e-45, 1e-40])])
    n = 1 << (len(a) - 1).bit_length()
    a = torch.nn.functional.pad(a, (0, n - len(a)), value=1.0).to(dev)
    raw, quantized = (torch.empty(n, dtype=torch.int32, device=dev) for _ in range(2))
    _shift_kernel[(1,)](a, raw, quantized, N=n, OCP=r is ScaleRule.OCP, QMAX=r.qmax)
    bad = (raw != quantized).nonzero()[:5, 0]
    assert len(bad) == 0, [(a[i].item(), raw[i].item(), quantized[i].item()) for i in bad]


# --- P's block sums by table look-ups (sm_100's warp-specialized loop) ----------------------------


def _lut_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Evaluate :func:`fp4video.kernels.fp4_math.block_sum_lut_asm`'s PTX with ``$k`` bound to the
    32-bit ``operands[k]``, each instruction as the PTX ISA defines it: ``prmt.b32`` (generic mode:
    selector nibble i, c's bits 4i..4i+3, picks byte i of d from the bytes of {b, a}, b's bytes
    numbered 4-7; its top bit replicates the picked byte's sign), ``shr.b32``, ``add.u32``
    (modulo 2^32), ``dp4a.u32.u32`` (c plus the products of a's and b's bytes), ``cvt.rn.f32.u32``,
    ``mul.f32``, ``mov.b32``. Any other instruction is refused, so a changed asm cannot pass by
    being skipped. Returns every ``$k`` after it (fp32 results as their bits)."""
    import re
    import struct

    regs = {f"${k}": v for k, v in operands.items()}

    def value(arg: str) -> int:
        if arg.startswith("0f"):  # an fp32 immediate, by its bits
            return int(arg[2:], 16)
        return int(arg, 0) if arg[0].isdigit() else regs[arg]

    def f32(bits: int) -> float:
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    def bits(x: float) -> int:
        return struct.unpack("<I", struct.pack("<f", x))[0]

    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm
    for stmt in filter(None, (s.strip() for s in body[1:-1].split(";"))):
        op, _, args = stmt.partition(" ")
        if op == ".reg":
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        x = [value(s) for s in src]
        if op == "mov.b32":
            out = x[0]
        elif op == "prmt.b32":
            pool = (x[1] << 32 | x[0]).to_bytes(8, "little")
            out = 0
            for i in range(4):
                nibble = (x[2] >> (4 * i)) & 0xF
                byte = pool[nibble & 7]
                out |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << (8 * i)
        elif op == "shr.b32":
            out = x[0] >> x[1]
        elif op == "add.u32":
            out = (x[0] + x[1]) & 0xFFFFFFFF
        elif op == "dp4a.u32.u32":
            out = (x[2] + sum(a * b for a, b in zip(x[0].to_bytes(4, "little"), x[1].to_bytes(4, "little")))) \
                & 0xFFFFFFFF
        elif op == "cvt.rn.f32.u32":
            out = bits(float(x[0]))  # (exact: the sums are far below 2^24)
        elif op == "mul.f32":
            out = bits(f32(x[0]) * f32(x[1]))  # (exact: a halving)
        else:
            raise NotImplementedError(f"PTX evaluator: {op}")
        regs[dst] = out
    assert not set(re.findall(r"\$\d+", asm)) - set(regs), asm
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def test_lut_block_sum_table_holds_the_doubled_e2m1_magnitudes():
    """The bytes ``prmt`` looks up (code c picks byte c of {HI, LO}) are E2M1's magnitudes doubled,
    in code order: 2 · (0, 0.5, 1, 1.5, 2, 3, 4, 6), as :mod:`fp4video.formats` lists them."""
    from fp4video.formats import E2M1_VALUES
    from fp4video.kernels.fp4_math import E2M1_DOUBLED_HI, E2M1_DOUBLED_LO

    table = (E2M1_DOUBLED_HI << 32 | E2M1_DOUBLED_LO).to_bytes(8, "little")
    assert [float(b) for b in table] == [2 * v for v in E2M1_VALUES]


@pytest.mark.parametrize("qb", [16, 32])
def test_lut_block_sum_asm_adds_every_code_of_its_block_once(qb):
    """:func:`fp4video.kernels.fp4_math.e2m1_block_sums_lut`'s PTX for blocks of 16 / 32 codes of
    values >= 0 (P's: no sign bit), evaluated instruction by instruction: its first output is the
    exact sum of the E2M1 values of all QB codes in its QB/8 input registers — every byte of two
    such codes in every position alone (each code counted once, at its own value), all codes 7
    (the largest sum: no carry between the looked-up bytes), and random blocks — and it reads
    exactly the inputs after its QB/2 outputs."""
    import re
    import struct

    from fp4video.formats import E2M1_VALUES
    from fp4video.kernels import fp4_math

    asm = {16: fp4_math.BLOCK_SUM_LUT_ASM_16, 32: fp4_math.BLOCK_SUM_LUT_ASM_32}[qb].value
    n_out, n_in = qb // 2, qb // 8
    assert sorted({int(k) for k in re.findall(r"\$(\d+)", asm)}) == list(range(n_out + n_in))
    codes = torch.randint(0, 8, (3000, qb), generator=torch.Generator().manual_seed(9)).tolist()
    blocks = [bytes(c[2 * i] | c[2 * i + 1] << 4 for i in range(qb // 2)) for c in codes]
    blocks.append(bytes([0x77] * (qb // 2)))
    for pos in range(qb // 2):
        for value in range(256):
            if value & 0x88 == 0:  # (the codes of values >= 0)
                blocks.append(bytes(value if i == pos else 0 for i in range(qb // 2)))
    for block in blocks:
        words = {n_out + w: int.from_bytes(block[4 * w:4 * w + 4], "little") for w in range(n_in)}
        out = _lut_ptx(asm, words)
        want = sum(E2M1_VALUES[b & 7] + E2M1_VALUES[b >> 4] for b in block)
        got = struct.unpack("<f", struct.pack("<I", out[0]))[0]
        assert got == want, (block.hex(), got, want)


def test_lut_ptx_evaluator_knows_its_instructions():
    """The evaluator refuses what it does not model, and reads ``prmt``'s sign-replicating selector
    as the ISA says (the codes the loops look up never set it)."""
    with pytest.raises(NotImplementedError):
        _lut_ptx("{ .reg .b32 x; max.u32 x, $1, $2; }", {1: 0, 2: 0})
    out = _lut_ptx("{ prmt.b32 $0, $1, $2, $3; }", {1: 0x80402010, 2: 0x08070605, 3: 0xB7A4})
    # bytes: b's first (0x05), a's third's sign (0x40: 0x00), b's last (0x08), a's last's sign (0x80: 0xFF)
    assert out[0] == 0xFF08_0005


from fp4video.kernels.fp4_math import e2m1_block_sums_lut  # noqa: E402


@triton.jit
def _lut_block_sums_kernel(Codes, Out, ROWS: tl.constexpr, COLS: tl.constexpr, QB: tl.constexpr):
    r, c = tl.arange(0, ROWS), tl.arange(0, COLS // 2)
    sums = e2m1_block_sums_lut(tl.load(Codes + r[:, None] * (COLS // 2) + c[None, :]), QB)
    b = tl.arange(0, COLS // QB)
    tl.store(Out + r[:, None] * (COLS // QB) + b[None, :], sums)


@pytest.mark.gpu
@pytest.mark.parametrize("qb", [16, 32])
def test_lut_block_sums_on_the_gpu(qb):
    """The look-up block sums compiled and run on this GPU (``prmt`` and ``dp4a``: every GPU since
    sm_61, no Blackwell needed): a (128, 64) tile of packed codes of values >= 0, 16 bytes a thread
    as Triton lays out a coalesced uint8 load (whole blocks, in order), every block's sum exact."""
    from fp4video.formats import E2M1_VALUES

    codes = torch.randint(0, 8, (128, 128), generator=torch.Generator().manual_seed(11))
    codes[0] = 7
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).cuda()
    out = torch.empty(128, 128 // qb, device="cuda")
    _lut_block_sums_kernel[(1,)](packed, out, ROWS=128, COLS=128, QB=qb, num_warps=4)
    want = torch.tensor(E2M1_VALUES)[codes].reshape(128, 128 // qb, qb).sum(-1)
    assert torch.equal(out.cpu(), want)
