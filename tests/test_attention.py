"""fp4_attention and the reference backend: fp64 oracles, exact identities (PNQ, masks, the tiled vs.
materialized variants), layouts, dtypes and input validation."""

from __future__ import annotations

import math

import pytest
import torch

from fp4video import METHODS, AttentionRecipe, fp4_attention
from fp4video.metrics import cossim
from fp4video.reference import KEY_TILE, attention_materialized, attention_tiled, prepare_qkv

QUANTIZED = [m for m in METHODS if m != "fp16"]


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sdpa64(q, k, v, mask=None, scale=None):
    """fp64 reference with an explicit softmax (SDPA's bool-mask convention: True = attend)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


# --- the unquantized path is exact attention -----------------------------------------------------


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 300), (257, 129), (128, 128)])
def test_fp16_method_equals_fp64_attention(sq, sk):
    q, k, v = rand(2, 3, sq, 64, seed=1), rand(2, 3, sk, 64, seed=2), rand(2, 3, sk, 64, seed=3)
    out, lse = fp4_attention(q, k, v, method="fp16", return_lse=True)
    ref, ref_lse = sdpa64(q, k, v)
    assert (out.double() - ref).abs().max() < 2e-6
    assert (lse.double() - ref_lse).abs().max() < 2e-5


@pytest.mark.parametrize("method", QUANTIZED)
def test_quantized_methods_are_close_but_not_exact(method):
    q, k, v = rand(1, 2, 200, 128, seed=4), rand(1, 2, 333, 128, seed=5), rand(1, 2, 333, 128, seed=6)
    out = fp4_attention(q, k, v, method=method)
    ref, _ = sdpa64(q, k, v)
    c = cossim(out, ref)
    assert 0.9 < c < 0.99999, f"{method}: cosine {c}"


def test_lse_is_consistent_with_output_under_pnq():
    """LSE = m + log ℓ with ℓ the (quantized) row sum the kernel used: exp(lse - s) weights times
    V reproduce the output."""
    q, k, v = rand(1, 1, 16, 64, seed=7), rand(1, 1, 256, 64, seed=8), rand(1, 1, 256, 64, seed=9)
    recipe = METHODS["mxattn"]
    qh, kh, vh = prepare_qkv(q, k, v, recipe)
    out, lse = attention_materialized(qh, kh, vh, scale=1 / 8, recipe=recipe)
    from fp4video.reference import quantize_p

    s = qh @ kh.transpose(-1, -2) / 8
    m = s.amax(-1, keepdim=True)
    p_hat = quantize_p(torch.exp(s - m), recipe)
    assert torch.allclose(lse, (m.squeeze(-1) + torch.log(p_hat.sum(-1))), atol=1e-6)


# --- PNQ: weights sum to one ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_v_all_ones_mxattn_returns_ones(dtype):
    q, k = rand(1, 2, 100, 128, seed=10, dtype=dtype), rand(1, 2, 700, 128, seed=11, dtype=dtype)
    v = torch.ones(1, 2, 700, 128, dtype=dtype)
    out = fp4_attention(q, k, v, method="mxattn")
    eps = torch.finfo(dtype).eps
    assert out.dtype == dtype
    assert (out.float() - 1).abs().max() <= eps, "PNQ: the induced weights must sum to one"
    ocp = fp4_attention(q, k, v, method="mxfp4-ocp").float()
    assert (ocp - 1).abs().max() > max(0.01, 4 * eps), "direct quantization with an exact row sum is not normalized"
    assert ocp.mean() < 1  # and it is biased low (rounding/zeroing of small P), as MXAttention Fig. 7


# --- tiled vs materialized -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_tiled_equals_materialized_when_max_is_in_first_tile(method):
    """If every row's maximum lies in the first key tile, the running max never changes and the
    online softmax quantizes exactly the same P̃ tiles as the whole-P variant."""
    recipe = METHODS[method]
    q, k, v = rand(1, 2, 64, 64, seed=12), rand(1, 2, 3 * KEY_TILE, 64, seed=13), rand(1, 2, 3 * KEY_TILE, 64, seed=14)
    u = torch.nn.functional.normalize(rand(64, seed=51), dim=0)
    q = q - (q @ u)[..., None] * u + 3 * u  # every query has the same component along u ...
    k = k.clone()
    k[..., 0, :] = 30 * u  # ... so key 0's logit (90) dominates every row
    qh, kh, vh = prepare_qkv(q, k, v, recipe)
    s = qh @ kh.transpose(-1, -2)
    assert (s.argmax(-1) < KEY_TILE).all()
    a, la = attention_tiled(qh, kh, vh, scale=0.125, recipe=recipe)
    b, lb = attention_materialized(qh, kh, vh, scale=0.125, recipe=recipe)
    per_tile = recipe.p_scale.value == "two_level" or getattr(recipe.pv_format, "value", None) == "e4m3"
    if per_tile:  # a P scale per row of each tile vs per row of the whole P: different by design
        assert cossim(a, b) > 0.999
    else:
        assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5


@pytest.mark.parametrize("method", QUANTIZED)
def test_tiled_and_materialized_agree_within_their_own_error(method):
    """In general the two round P differently (P̃ is scaled by exp(m_final - m_running) in early
    tiles). Both are unbiased views of the same method: their difference is no larger than each
    one's distance to exact attention."""
    recipe = METHODS[method]
    q, k, v = rand(1, 2, 128, 64, seed=15), rand(1, 2, 512, 64, seed=16), rand(1, 2, 512, 64, seed=17)
    qh, kh, vh = prepare_qkv(q, k, v, recipe)
    a, _ = attention_tiled(qh, kh, vh, scale=0.125, recipe=recipe)
    b, _ = attention_materialized(qh, kh, vh, scale=0.125, recipe=recipe)
    ref, _ = sdpa64(q, k, v, scale=0.125)
    err_a, err_b, diff = (a.double() - ref).norm(), (b.double() - ref).norm(), (a - b).double().norm()
    assert diff < 1.5 * max(err_a, err_b)
    assert abs(err_a - err_b) < 0.25 * max(err_a, err_b)


# --- masks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_key_padding_equals_attention_over_kept_keys(method):
    """Kept keys a multiple of the tile: masking the tail equals dropping it, bit for bit."""
    q = rand(2, 2, 50, 64, seed=18)
    k, v = rand(2, 2, 3 * KEY_TILE + 40, 64, seed=19), rand(2, 2, 3 * KEY_TILE + 40, 64, seed=20)
    keep = 2 * KEY_TILE
    mask = torch.zeros(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[..., :keep] = True
    masked = fp4_attention(q, k, v, method=method, attn_mask=mask)
    dropped = fp4_attention(q, k[:, :, :keep], v[:, :, :keep], method=method)
    assert torch.equal(masked, dropped)


@pytest.mark.parametrize("method", list(METHODS))
def test_masked_keys_contribute_nothing(method):
    """Changing K/V at masked positions (to huge values) changes no output bit."""
    q, k, v = rand(1, 2, 40, 64, seed=21), rand(1, 2, 300, 64, seed=22), rand(1, 2, 300, 64, seed=23)
    g = torch.Generator().manual_seed(24)
    mask = torch.rand(1, 1, 1, 300, generator=g) > 0.3
    k2, v2 = k.clone(), v.clone()
    k2[..., ~mask[0, 0, 0], :] = 1e4
    v2[..., ~mask[0, 0, 0], :] = -1e4
    a = fp4_attention(q, k, v, method=method, attn_mask=mask)
    b = fp4_attention(q, k2, v2, method=method, attn_mask=mask)
    assert torch.equal(a, b)


def test_full_mask_matches_fp64_and_empty_rows_are_zero():
    q, k, v = rand(1, 2, 33, 64, seed=25), rand(1, 2, 150, 64, seed=26), rand(1, 2, 150, 64, seed=27)
    mask = torch.rand(1, 2, 33, 150, generator=torch.Generator().manual_seed(28)) > 0.5
    mask[0, 1, 3] = False  # a query that sees nothing
    out, lse = fp4_attention(q, k, v, method="fp16", attn_mask=mask, return_lse=True)
    ref, ref_lse = sdpa64(q, k, v, mask)
    live = mask.any(-1)
    assert (out.double() - torch.nan_to_num(ref))[live].abs().max() < 2e-6
    assert out[0, 1, 3].eq(0).all() and lse[0, 1, 3] == -math.inf
    assert (lse.double() - ref_lse)[live].abs().max() < 2e-5
    for m in QUANTIZED:
        o = fp4_attention(q, k, v, method=m, attn_mask=mask)
        assert torch.isfinite(o).all() and o[0, 1, 3].eq(0).all()
        assert cossim(o[live], ref[live]) > 0.9


# --- layouts, dtypes, shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["mxattn", "sage3"])
def test_bshd_equals_bhsd(method):
    q, k, v = rand(2, 3, 70, 64, seed=29), rand(2, 3, 90, 64, seed=30), rand(2, 3, 90, 64, seed=31)
    mask = torch.rand(2, 1, 1, 90, generator=torch.Generator().manual_seed(32)) > 0.2
    a, la = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True)
    b, lb = fp4_attention(*(t.transpose(1, 2) for t in (q, k, v)), method=method, layout="bshd",
                          attn_mask=mask, return_lse=True)
    assert b.shape == (2, 70, 3, 64) and lb.shape == (2, 70, 3)
    assert torch.equal(a, b.transpose(1, 2)) and torch.equal(la, lb.transpose(1, 2))


@pytest.mark.parametrize("d", [40, 64, 80, 128, 160])
def test_head_dims_are_padded_exactly(d):
    """Zero-padding Q/K along D changes no logit: fp16 is exact for any D and FP4 stays close."""
    q, k, v = rand(1, 2, 64, d, seed=33), rand(1, 2, 96, d, seed=34), rand(1, 2, 96, d, seed=35)
    ref, _ = sdpa64(q, k, v)
    assert (fp4_attention(q, k, v, method="fp16").double() - ref).abs().max() < 2e-6
    for m in ("mxattn", "sage3"):
        assert cossim(fp4_attention(q, k, v, method=m), ref) > 0.95


def test_v_head_dim_may_differ():
    q, k, v = rand(1, 1, 10, 64, seed=36), rand(1, 1, 50, 64, seed=37), rand(1, 1, 50, 48, seed=38)
    assert fp4_attention(q, k, v, method="mxattn").shape == (1, 1, 10, 48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_dtype_and_inputs_untouched(dtype):
    q, k, v = (rand(1, 2, 64, 64, seed=s, dtype=dtype) for s in (39, 40, 41))
    before = [t.clone() for t in (q, k, v)]
    for m in METHODS:
        out = fp4_attention(q, k, v, method=m)
        assert out.dtype == dtype
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b)


def test_scale_argument_is_used():
    q, k, v = rand(1, 1, 8, 64, seed=42), rand(1, 1, 32, 64, seed=43), rand(1, 1, 32, 64, seed=44)
    ref, _ = sdpa64(q, k, v, scale=0.3)
    assert (fp4_attention(q, k, v, method="fp16", scale=0.3).double() - ref).abs().max() < 2e-6


def test_recipe_switches_one_by_one():
    q, k, v = rand(1, 1, 64, 64, seed=45), rand(1, 1, 256, 64, seed=46), rand(1, 1, 256, 64, seed=47)
    custom = METHODS["mxattn"].replace(scale_rule="tfs")
    assert custom.name == "custom" and custom.scale_rule.value == "tfs"
    a = fp4_attention(q, k, v, method=custom)
    b = fp4_attention(q, k, v, method="mxattn")
    assert not torch.equal(a, b)
    assert torch.equal(fp4_attention(q, k, v, method=AttentionRecipe(**{
        f: getattr(METHODS["sage3"], f) for f in ("qk_format", "pv_format", "smooth_k", "p_scale")})),
        fp4_attention(q, k, v, method="sage3"))


# --- errors --------------------------------------------------------------------------------------------


def _qkv(**kw):
    return rand(1, 2, 16, 64, seed=48), rand(1, 2, 32, 64, seed=49), rand(1, 2, 32, 64, seed=50)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(method="fp6"), ValueError, "unknown method 'fp6'"),
        (dict(layout="bsdh"), ValueError, "layout must be one of"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (dict(scale=-1.0), ValueError, "scale must be a positive"),
        (dict(scale=float("nan")), ValueError, "scale must be a positive"),
        (dict(attn_mask=torch.zeros(1, 1, 1, 32)), TypeError, "boolean"),
        (dict(attn_mask=torch.ones(1, 32, dtype=torch.bool)), ValueError, "must be 4-D"),
        (dict(attn_mask=torch.ones(1, 1, 1, 31, dtype=torch.bool)), ValueError, "does not broadcast"),
        (dict(attn_mask=torch.ones(3, 1, 1, 32, dtype=torch.bool)), ValueError, "does not broadcast"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fp4_attention(*_qkv(), **kwargs)


def test_bad_tensors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must be 4-D"):
        fp4_attention(q[0], k[0], v[0])
    with pytest.raises(TypeError, match="share a dtype"):
        fp4_attention(q.half(), k, v)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        fp4_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head counts differ"):
        fp4_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="head dims differ"):
        fp4_attention(q, k[..., :32], v)
    with pytest.raises(ValueError, match="sequence lengths differ"):
        fp4_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="batch sizes differ"):
        fp4_attention(q, torch.cat([k, k]), torch.cat([v, v]))


def test_triton_backend_error_is_clear_when_no_kernel_applies():
    q, k, v = _qkv()
    per_query_mask = torch.ones(1, 2, 16, 32, dtype=torch.bool)  # the kernel takes key padding only
    with pytest.raises(NotImplementedError, match="backend='triton' cannot run this call"):
        fp4_attention(q, k, v, backend="triton", attn_mask=per_query_mask)


def test_bad_recipes_are_rejected():
    with pytest.raises(ValueError, match="two_level.*nvfp4"):
        AttentionRecipe(qk_format="mxfp4", pv_format="mxfp4", p_scale="two_level")
    with pytest.raises(ValueError, match="PNQ.*needs a quantized P"):
        AttentionRecipe(qk_format="mxfp4", row_sum="quantized")
    with pytest.raises(ValueError, match="unknown scale_rule 'x'"):
        AttentionRecipe(scale_rule="x")
