"""Trust in the numerics of fp4_attention, class by class, against fp64 attention written here:

- every mask shape broadcastable to (B, H, Sq, Sk) gives what the fully expanded mask gives, on
  every method (K smoothing's mean counts the live keys, key tiles slice a key-broadcast mask);
- finite input gives finite output within the stated range (``LOGIT_BOUND`` on the logits; any
  finite V, Q and K magnitude through exact power-of-two rescaling), and a clear error beyond it;
- ``scale`` is any real scalar (numpy numbers, 0-d tensors, ...), nothing else;
- a head's LSE is bit for bit the same in a batched call and in a call for that head or batch alone.
"""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fp4video import METHODS, fp4_attention
from fp4video.metrics import cossim, row_cosine
from fp4video.reference import LOGIT_BOUND, smoothing_lse_shift

ALL = list(METHODS)
SMOOTH_K = [m for m in ALL if METHODS[m].smooth_k]
FAST = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def attention64(q, k, v, mask=None, scale=None):
    """fp64 attention with an explicit softmax; (out, lse); rows that see no key: zeros, -inf."""
    s = (q.double() @ k.double().transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v.double(), lse


# --- masks broadcast over any dims ---------------------------------------------------------------------


def test_broadcast_key_masks_count_live_keys_in_k_mean():
    """An all-True mask of shape (1, 1, 1, 1) or (1, 1, Sq, 1) covers every key: K smoothing's mean
    must divide by the live key count, not by the mask's key dim of 1 (which made K's "mean" its
    sum: sage3 fell from cosine 0.98 to 0.4-0.6 against fp64)."""
    q, k, v = rand(1, 2, 16, 64, seed=1), rand(1, 2, 100, 64, seed=2) + 3.0, rand(1, 2, 100, 64, seed=3)
    ref, _ = attention64(q, k, v)
    for method in ("sage3", "mxattn-sk", "fp8"):
        want = fp4_attention(q, k, v, method=method, backend="reference")
        assert cossim(want, ref) > 0.9
        for shape in ((1, 1, 1, 1), (1, 1, 16, 1), (1, 2, 1, 1)):
            got = fp4_attention(q, k, v, method=method, attn_mask=torch.ones(shape, dtype=torch.bool),
                                backend="reference")
            assert torch.equal(got, want), f"{method}, mask {shape}: cosine {cossim(got, ref):.3f} to fp64"


@pytest.mark.parametrize("method", ["fp16", "mxattn", "sage3"])
def test_key_broadcast_mask_over_several_key_tiles(method):
    """A mask whose key dim is 1 with Sk a multiple of the key tile above it: key tiles sliced the
    size-1 dim to nothing (a shape error instead of an output)."""
    q, k, v = rand(1, 2, 8, 64, seed=4), rand(1, 2, 256, 64, seed=5), rand(1, 2, 256, 64, seed=6)
    for shape in ((1, 1, 1, 1), (1, 2, 8, 1)):
        got = fp4_attention(q, k, v, method=method, attn_mask=torch.ones(shape, dtype=torch.bool),
                            backend="reference")
        assert torch.equal(got, fp4_attention(q, k, v, method=method, backend="reference"))


#: every broadcast pattern of a (B, H, Sq, Sk) mask: each dim full or 1
PATTERNS = [tuple((i >> j) & 1 for j in range(4)) for i in range(16)]


@FAST
@given(pattern=st.sampled_from(PATTERNS), method=st.sampled_from(ALL), seed=st.integers(0, 10_000),
       sk=st.sampled_from([40, 256]), density=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_every_broadcast_mask_equals_its_expanded_mask(pattern, method, seed, sk, density):
    """For all 16 broadcast patterns and every method, a mask gives bit for bit the output and LSE
    of the same mask expanded to (B, H, Sq, Sk); the fp16 method also equals fp64 attention."""
    b, h, sq = 2, 2, 8
    full = (b, h, sq, sk)
    shape = tuple(n if keep else 1 for keep, n in zip(pattern, full))
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
    q, k, v = rand(b, h, sq, 64, seed=seed + 1), rand(b, h, sk, 64, seed=seed + 2) + 2.0, rand(b, h, sk, 64, seed=seed + 3)
    got, lse = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference")
    want, lse_want = fp4_attention(q, k, v, method=method, attn_mask=mask.expand(full).contiguous(),
                                   return_lse=True, backend="reference")
    assert torch.equal(got, want) and torch.equal(lse, lse_want), f"{method}, mask {shape}"
    if method == "fp16":
        ref, ref_lse = attention64(q, k, v, mask.expand(full))
        assert float((got.double() - ref).abs().max()) < 2e-6
        live = torch.isfinite(ref_lse)
        assert torch.equal(live, torch.isfinite(lse))
        assert float((lse.double() - ref_lse)[live].abs().amax()) < 2e-5 if live.any() else True


# --- finite input, finite output: the range ------------------------------------------------------------


def _winner_inputs(dtype=torch.float32, sq=16, sk=160, d=64):
    """Each query equal to one key: that key's logit exceeds every other by a wide margin, so even
    at huge logits (one-hot attention) every method picks it and the fp64 result is known."""
    k, v = rand(1, 2, sk, d, seed=7), rand(1, 2, sk, d, seed=8)
    pick = torch.randperm(sk, generator=torch.Generator().manual_seed(9))[:sq]
    return k[:, :, pick].clone().to(dtype), k.to(dtype), v.to(dtype)


def _logit_estimate(q, k, scale):
    """What the guarantee bounds: scale · D · max|q| · max|k| over a head, largest over heads (fp64)."""
    aq = q.double().abs().amax(dim=(-2, -1))
    ak = k.double().abs().amax(dim=(-2, -1))
    return float((aq * ak).max()) * q.shape[-1] * scale


#: one method per kernel loop the interpreter runs (bf16, e4m3, NVFP4; e4m3 Q·K)
LOOPS = ["fp16", "mxattn", "sage3", "fp8"]


@pytest.mark.parametrize("method, backend", [(m, "reference") for m in ALL] + [(m, "triton") for m in LOOPS])
def test_logit_bound_outside_raises_naming_the_inputs_and_the_bound(method, backend):
    """Just beyond LOGIT_BOUND (and far beyond: Q and K × 1e19, scale = 1e38) the call raises a
    one-line ValueError naming q, k, scale and the bound, instead of NaN outputs or a quantize error
    blaming a finite input for a NaN/Inf."""
    q, k, v = _winner_inputs()
    scale = LOGIT_BOUND / _logit_estimate(q, k, 1.0)
    for qq, kk, s in ((q, k, scale * 1.001), (q * 1e19, k * 1e19, 0.125), (q, k, 1e38)):
        with pytest.raises(ValueError, match=r"^q, k and scale: .*2\^64") as e:
            fp4_attention(qq, kk, v, method=method, scale=s, backend=backend)
        assert "\n" not in str(e.value) and "quantize" not in str(e.value)


@pytest.mark.parametrize("method, backend", [(m, "reference") for m in ALL] + [(m, "triton") for m in LOOPS])
def test_logit_bound_inside_is_finite_and_accurate(method, backend):
    """Just inside LOGIT_BOUND (logits ~2^58 nats, one-hot attention): finite output and LSE,
    every row the fp64 result (its winner's V, up to V's own quantization), the LSE the fp64 one."""
    q, k, v = _winner_inputs()
    scale = LOGIT_BOUND / _logit_estimate(q, k, 1.0) * 0.999
    out, lse = fp4_attention(q, k, v, method=method, scale=scale, return_lse=True, backend=backend)
    ref, ref_lse = attention64(q, k, v, scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert float(row_cosine(out, ref).min()) > (0.999999 if method == "fp16" else 0.95)
    # the LSE is the winner's logit: exact for fp16, for the others as far off as their quantized Q·K
    # (FP4 Q and K both rounded: up to ~13% of a self-dot product here)
    assert float(((lse.double() - ref_lse) / ref_lse.abs()).abs().max()) < (1e-6 if method == "fp16" else 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ALL)
def test_v_near_the_dtype_maximum_gives_a_finite_accurate_output(method, dtype):
    """V of ±3e38 across keys: the output (a convex combination of V) is representable, but the
    unnormalized accumulator sums up to Sk such terms and overflowed (NaN on every method). V is
    now computed as V · 2^-s and the output scaled back: exact, so V · 2^100 gives the output of V
    times 2^100 bit for bit."""
    q, k, v = rand(1, 2, 16, 64, seed=10, dtype=dtype), rand(1, 2, 200, 64, seed=11, dtype=dtype), \
        rand(1, 2, 200, 64, seed=12, dtype=dtype)
    big = torch.where(v > 0, 3e38, -3e38).to(dtype)
    out = fp4_attention(q, k, big, method=method, backend="reference")
    assert torch.isfinite(out).all()
    exact = 0.999999 if dtype == torch.float32 else 0.9999  # (fp16: the output's own rounding)
    assert cossim(out, attention64(q, k, big)[0]) > (exact if method == "fp16" else 0.95)
    base = fp4_attention(q, k, v, method=method, backend="reference")
    assert torch.equal(fp4_attention(q, k, v * 2.0**100, method=method, backend="reference"), base * 2.0**100)


@pytest.mark.parametrize("method", ALL)
def test_q_and_k_rescaling_is_exact(method):
    """Q × 2^70 with K × 2^-70 has the same logits: computed through exact power-of-two rescaling
    (Q's magnitude would overflow the rotation and the fp32 dot products), output and LSE are bit
    for bit those of the unscaled inputs."""
    q, k, v = rand(1, 2, 16, 64, seed=13), rand(1, 2, 150, 64, seed=14) + 1.0, rand(1, 2, 150, 64, seed=15)
    want, lse_want = fp4_attention(q, k, v, method=method, return_lse=True, backend="reference")
    got, lse = fp4_attention(q * 2.0**70, k * 2.0**-70, v, method=method, return_lse=True, backend="reference")
    assert torch.equal(got, want) and torch.equal(lse, lse_want)


@pytest.mark.parametrize("method", ["fp16", "mxattn", "sage3"])
def test_kernels_rescale_v_and_qk_as_the_reference_does(method):
    """The kernels read the ranges back with the NaN/Inf check and rescale as the reference does:
    V of ±3e38 finite and per row as the reference's; Q × 2^70, K × 2^-70 as the unscaled call."""
    q, k, v = rand(1, 2, 16, 64, seed=16), rand(1, 2, 128, 64, seed=17), rand(1, 2, 128, 64, seed=18)
    big = torch.where(v > 0, 3e38, -3e38)
    out = fp4_attention(q, k, big, method=method, backend="triton")
    assert torch.isfinite(out).all()
    assert float(row_cosine(out, fp4_attention(q, k, big, method=method, backend="reference")).min()) > 0.999
    want = fp4_attention(q, k, v, method=method, backend="triton")
    assert torch.equal(fp4_attention(q * 2.0**70, k * 2.0**-70, v, method=method, backend="triton"), want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("method", ["fp16", "mxattn", "sage3", "fp8"])
@pytest.mark.parametrize("log_q, log_k, log_scale", [(-100, -100, 200), (100, 100, -200), (124, -131, 7),
                                                     (-131, 124, 7), (0, 0, 90)])
def test_scales_beyond_fp32_move_into_q_and_k(method, backend, log_q, log_k, log_scale):
    """A scale fp32 cannot hold (or whose product with the rescaled Q·K overflows it), with Q and K
    whose logits stay ordinary: Q·2^a, K·2^b, scale·2^c with a + b + c = 0 are the same logits, and
    the call gives what the unscaled call gives (the scale moves into Q and K by exact powers of two;
    a subnormal K included). ``(0, 0, 90)``: ordinary Q and K, a scale of 2^90 — logits of ~2^90
    nats are beyond the bound and refused."""
    q, k, v = rand(1, 2, 16, 64, seed=19), rand(1, 2, 130, 64, seed=20), rand(1, 2, 130, 64, seed=21)
    scale = math.ldexp(64**-0.5, log_scale)
    if log_q + log_k + log_scale:
        with pytest.raises(ValueError, match="q, k and scale"):
            fp4_attention(q, k, v, method=method, scale=scale, backend=backend)
        return
    want, lse_want = fp4_attention(q, k, v, method=method, return_lse=True, backend=backend)
    got, lse = fp4_attention(q * 2.0**log_q, k * 2.0**log_k, v, method=method, scale=scale, return_lse=True,
                             backend=backend)
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    assert float(row_cosine(got, want).min()) > 0.99999 and float((lse - lse_want).abs().max()) < 1e-4


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("method", ["fp16", "mxattn", "fp8"])
def test_zero_q_with_any_scale_attends_uniformly(method, backend):
    """Q of zeros: every logit is 0 whatever the scale, even one fp32 cannot hold (1e300): the
    output is V's mean over the keys (up to V's own quantization) and the LSE log(Sk)."""
    q, v = torch.zeros(1, 2, 8, 64), rand(1, 2, 130, 64, seed=22)
    out, lse = fp4_attention(q, rand(1, 2, 130, 64, seed=23), v, method=method, scale=1e300, return_lse=True,
                             backend=backend)
    assert torch.isfinite(out).all() and torch.allclose(lse, torch.full_like(lse, math.log(130)), atol=1e-5)
    assert float(row_cosine(out, v.double().mean(-2, keepdim=True).expand_as(out)).min()) > 0.99


@pytest.mark.parametrize("method", ["fp8"])
def test_fp8_tier_keeps_cosine_098_on_every_robustness_input(method):
    """The FP8 tier is what users place where FP4 is not good enough: on every input of the
    robustness table (outlier channels ×30, sinks, sharp attention, K/V means, V outliers, all at
    once) its cosine to fp64 stays at 0.98 or above (the Hadamard rotation of Q and K before the
    E4M3 rounding: without it, 0.898 on outlier channels and 0.780 on all of them)."""
    from fp4video.harness.robustness import DISTRIBUTIONS, make_inputs

    for name, sharp in DISTRIBUTIONS.items():
        q, k, v = make_inputs(sharp, seed=0)
        out = fp4_attention(q, k, v, method=method, backend="reference")
        assert cossim(out, attention64(q, k, v)[0]) >= 0.98, name


@FAST
@example(method="mxattn", log_v=127, log_qk=100, seed=0)
@example(method="fp16", log_v=127, log_qk=0, seed=1)
@given(method=st.sampled_from(ALL), log_v=st.sampled_from([-20, 0, 60, 64, 100, 127]),
       log_qk=st.sampled_from([0, 40, 56, 60, 100]), seed=st.integers(0, 1000))
def test_finite_inputs_within_the_bound_give_finite_outputs(method, log_v, log_qk, seed):
    """Q × 2^a with K × 2^-a (same logits) and V × 2^c over the whole fp32 range: finite output and
    LSE, as close to fp64 as the unscaled call."""
    q, k, v = rand(1, 1, 8, 64, seed=seed), rand(1, 1, 300, 64, seed=seed + 1), rand(1, 1, 300, 64, seed=seed + 2)
    v = v.sign() * (1 + v.abs().clamp(max=4) / 4) * 2.0 ** (log_v - 1)  # |v| in [2^(log_v-1), 2^log_v]
    out, lse = fp4_attention(q * 2.0**log_qk, k * 2.0**-log_qk, v, method=method, return_lse=True,
                             backend="reference")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, _ = attention64(q, k, v)
    assert cossim(out, ref) > (0.999999 if method == "fp16" else 0.9)


# --- scale: any real scalar ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [np.float32(0.1), np.float64(0.1), torch.tensor(0.1), torch.tensor(0.1).double(),
                                   torch.tensor(0.1, dtype=torch.bfloat16), Fraction(1, 10), Decimal("0.1"), 1,
                                   np.int64(1), torch.tensor(2)])
def test_scale_accepts_any_real_scalar(scale):
    """numpy scalars and 0-d tensors were refused as "not a positive finite number"."""
    q, k, v = rand(1, 1, 8, 64, seed=19), rand(1, 1, 32, 64, seed=20), rand(1, 1, 32, 64, seed=21)
    got = fp4_attention(q, k, v, method="fp16", scale=scale)
    assert torch.equal(got, fp4_attention(q, k, v, method="fp16", scale=float(scale)))
    assert float((got.double() - attention64(q, k, v, scale=float(scale))[0]).abs().max()) < 1e-5


@pytest.mark.parametrize("scale, exc, match", [
    (True, TypeError, "real number"), (np.bool_(True), TypeError, "real number"),
    (torch.tensor(True), TypeError, "real number"), (1j, TypeError, "real number"),
    (complex(0.1, 0), TypeError, "real number"), (np.complex64(0.1), TypeError, "real number"),
    (torch.tensor(0.1 + 0j), TypeError, "real number"), ("0.1", TypeError, "real number"),
    (torch.tensor([0.1]), ValueError, "0-d tensor"), (float("nan"), ValueError, "positive finite"),
    (float("inf"), ValueError, "positive finite"), (np.float32("inf"), ValueError, "positive finite"),
    (0.0, ValueError, "positive finite"), (-0.1, ValueError, "positive finite"),
    (torch.tensor(-1.0), ValueError, "positive finite"),
])
def test_scale_refuses_what_is_not_a_positive_finite_real(scale, exc, match):
    q, k, v = rand(1, 1, 8, 64, seed=22), rand(1, 1, 32, 64, seed=23), rand(1, 1, 32, 64, seed=24)
    with pytest.raises(exc, match=f"^scale.*{match}") as e:
        fp4_attention(q, k, v, scale=scale)
    assert "\n" not in str(e.value)


@FAST
@given(value=st.floats(min_value=1e-30, max_value=1e3, allow_nan=False, allow_infinity=False),
       wrap=st.sampled_from([float, np.float32, np.float64, torch.tensor, lambda x: torch.tensor(x).double()]))
def test_scale_wrappers_give_the_float_result(value, wrap):
    q, k, v = rand(1, 1, 4, 32, seed=25), rand(1, 1, 16, 32, seed=26), rand(1, 1, 16, 32, seed=27)
    s = wrap(value)
    assert torch.equal(fp4_attention(q, k, v, method="mxattn", scale=s),
                       fp4_attention(q, k, v, method="mxattn", scale=float(s)))


# --- the LSE does not depend on the batch ------------------------------------------------------------------


@pytest.mark.parametrize("method", SMOOTH_K)
def test_smooth_k_lse_is_bit_equal_batched_and_per_head(method):
    """K smoothing's LSE shift was a batched matmul whose rounding depends on the batch: the LSE of
    a head differed (by up to ~1e-5) between a batched call and a call for that head or batch."""
    q, k, v = rand(2, 3, 24, 64, seed=28) * 3, rand(2, 3, 150, 64, seed=29) + 2.0, rand(2, 3, 150, 64, seed=30)
    out, lse = fp4_attention(q, k, v, method=method, return_lse=True, backend="reference")
    for b in range(2):
        ob, lb = fp4_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], method=method, return_lse=True, backend="reference")
        assert torch.equal(ob[0], out[b]) and torch.equal(lb[0], lse[b]), f"batch {b}"
        for h in range(3):
            s = (slice(b, b + 1), slice(h, h + 1))
            oh, lh = fp4_attention(q[s], k[s], v[s], method=method, return_lse=True, backend="reference")
            assert torch.equal(oh[0, 0], out[b, h]) and torch.equal(lh[0, 0], lse[b, h]), f"head ({b}, {h})"


@pytest.mark.parametrize("method", SMOOTH_K)
def test_smooth_k_lse_is_bit_equal_batched_and_per_head_on_the_kernels(method):
    q, k, v = rand(1, 2, 16, 64, seed=31) * 3, rand(1, 2, 96, 64, seed=32) + 2.0, rand(1, 2, 96, 64, seed=33)
    out, lse = fp4_attention(q, k, v, method=method, return_lse=True, backend="triton")
    for h in range(2):
        oh, lh = fp4_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], method=method, return_lse=True,
                               backend="triton")
        assert torch.equal(oh[0, 0], out[0, h]) and torch.equal(lh[0, 0], lse[0, h]), f"head {h}"


@FAST
@given(b=st.integers(1, 3), h=st.integers(1, 4), sq=st.integers(1, 40), d=st.integers(1, 130),
       seed=st.integers(0, 1000))
def test_smoothing_lse_shift_is_batch_independent(b, h, sq, d, seed):
    """Each head's shift equals the one computed for that head alone, and fp64 q·mean closely."""
    q, mean = rand(b, h, sq, d, seed=seed), rand(b, h, 1, d, seed=seed + 1)
    got = smoothing_lse_shift(q, mean, 0.3)
    for i in range(b):
        for j in range(h):
            assert torch.equal(smoothing_lse_shift(q[i:i + 1, j:j + 1], mean[i:i + 1, j:j + 1], 0.3)[0, 0], got[i, j])
    want = (q.double() * mean.double()).sum(-1) * 0.3
    assert float((got.double() - want).abs().max()) <= 1e-5 * (1 + float(want.abs().max()))


# --- the same on the GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ALL)
def test_gpu_finite_output_range_on_both_sides_of_the_bound(method, device):
    """The kernels on CUDA: V of ±3e38 (bf16) finite and per row as the reference; Q × 2^70 with
    K × 2^-70 bit for bit the unscaled call; just beyond LOGIT_BOUND raises, just inside gives
    finite outputs whose rows are the fp64 result (one-hot attention at ~2^58-nat logits)."""
    g = torch.Generator().manual_seed(40)
    q, k, v = (torch.randn(1, 4, n, 128, generator=g).to(device, torch.bfloat16) for n in (300, 1000, 1000))
    big = torch.where(v > 0, 3e38, -3e38).to(torch.bfloat16)
    out = fp4_attention(q, k, big, method=method, backend="triton")
    assert torch.isfinite(out).all()
    assert float(row_cosine(out, fp4_attention(q, k, big, method=method, backend="reference")).min()) > 0.99
    want = fp4_attention(q, k, v, method=method, backend="triton")
    assert torch.equal(fp4_attention(q * 2.0**70, k * 2.0**-70, v, method=method, backend="triton"), want)
    pick = torch.randperm(1000, generator=g)[:300].to(device)
    qw = k[:, :, pick].clone()
    scale = LOGIT_BOUND / _logit_estimate(qw, k, 1.0)
    with pytest.raises(ValueError, match=r"^q, k and scale: .*2\^64"):
        fp4_attention(qw, k, v, method=method, scale=scale * 1.001, backend="triton")
    out, lse = fp4_attention(qw, k, v, method=method, scale=scale * 0.999, return_lse=True, backend="triton")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, _ = attention64(qw, k, v, scale=scale * 0.999)
    assert float(row_cosine(out, ref).min()) > (0.999 if method == "fp16" else 0.95)


@pytest.mark.gpu
@pytest.mark.parametrize("method", SMOOTH_K)
def test_gpu_smooth_k_output_and_lse_are_bit_equal_batched_and_per_head(method, device):
    """The kernels on the GPU: a batched call's output and LSE are bit for bit those of each batch
    and each head called alone (K's mean and the LSE shift are reduced per head, whatever the batch)."""
    q, k, v = (rand(2, 3, 200, 128, seed=40 + i, dtype=torch.bfloat16).to(device) for i in range(3))
    out, lse = fp4_attention(q, k, v, method=method, return_lse=True)
    for b in range(2):
        for h in range(3):
            o1, l1 = fp4_attention(q[b:b + 1, h:h + 1], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], method=method,
                                   return_lse=True)
            assert torch.equal(o1, out[b:b + 1, h:h + 1]) and torch.equal(l1, lse[b:b + 1, h:h + 1]), (b, h)
