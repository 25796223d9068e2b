"""The attention loops keep the reference's guarantees on inputs an adversary picks: dead keys
(a key-padding mask, keys past Sk) never leak, whatever the live values (zero or ~1e-30 heads,
NaN / Inf in a dead key's V); rows whose logits reach 1e9 nats keep their softmax; masks broadcast
over batches or keys give the reference's result row by row, and masks the loops cannot run are
refused with the reason. Every loop the CPU interpreter reaches is run (the dispatch's default
loops and the ones its FP4VIDEO_* overrides pick), each against the reference backend row by row
and against an fp64 attention written here; the ``gpu`` twins run the H200's own loops (the e4m3
loop by TMA, the Gluon NVFP4 loop, the bf16 loop) on bf16 inputs."""

from __future__ import annotations

import math

import pytest
import torch

from fp4video import METHODS, fp4_attention
from fp4video.metrics import row_cosine

pytest.importorskip("triton")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import HAS_CUDA, rand  # noqa: E402

#: the property tests' settings: reproducible examples, no deadline (the interpreter is slow), the
#: loop-selecting fixture shared by the examples (it resets the environment each time)
PROPERTY = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
INTERPRETER_ONLY = pytest.mark.skipif(HAS_CUDA, reason="interpreter test; its gpu twin covers CUDA")

#: every loop the CPU interpreter reaches: (the environment that picks it, the loop module the
#: dispatch then names, the methods run on it)
LOOPS = {
    "bf16": ({}, "loop_bf16", ("fp16",)),
    "bf16-mxfp4": ({"FP4VIDEO_MX_KERNEL": "bf16"}, "loop_bf16", ("mxattn", "mxfp4-ocp")),
    "e4m3": ({}, "loop_e4m3", ("mxattn", "mxfp4-ocp", "mxattn-sk", "fp8", "mxattn-pv8")),
    "scaled-mxfp4": ({"FP4VIDEO_MX_KERNEL": "scaled"}, "loop_scaled", ("mxattn", "mxfp4-ocp", "mxattn-pv8")),
    "nvfp4": ({}, "loop_nvfp4", ("nvfp4", "sage3", "sage3-hpnq", "sage3-pv8")),
    "scaled-nvfp4": ({"FP4VIDEO_NV_KERNEL": "scaled"}, "loop_scaled", ("nvfp4", "sage3", "sage3-pv8")),
}
EVERY_PAIR = [(loop, m) for loop in LOOPS for m in LOOPS[loop][2]]


def one_each(*fast):
    """One (loop, method) a loop; those not in ``fast`` marked slow (the interpreter takes seconds a
    call: the fast ones are the pairs where the class showed)."""
    pairs = [(loop, LOOPS[loop][2][i % len(LOOPS[loop][2])]) for i, loop in enumerate(LOOPS)]
    return [pytest.param(*pair, marks=() if pair in fast else pytest.mark.slow) for pair in pairs]



@pytest.fixture
def use_loop(monkeypatch, request):
    """``use_loop(name)``: set the loop's environment (the NVFP4 dot_scaled loop with the
    interpreter's E4M3 scale decoding of conftest's ``e4m3_dot_scaled``)."""

    def use(name):
        monkeypatch.delenv("FP4VIDEO_MX_KERNEL", raising=False)
        monkeypatch.delenv("FP4VIDEO_NV_KERNEL", raising=False)
        env = LOOPS[name][0]
        if env.get("FP4VIDEO_NV_KERNEL") == "scaled":
            request.getfixturevalue("e4m3_dot_scaled")
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return use


def running_plan(q, k, v, method, mask):
    """The plan the dispatch runs this call with: the call's plan (:func:`fp4video.kernels.plan.plan`),
    or its fallback where the pre-pass finds V's channels wider than the e4m3 loop's window (the
    call's own check, :func:`fp4video.kernels.dispatch.prepare_checked`, on the pre-pass's output)."""
    from fp4video.kernels import dispatch
    from fp4video.kernels.plan import plan

    alive = dispatch.key_padding(mask, q.shape[0], k.shape[-2])
    call_plan = plan(METHODS[method], q, v, mask)
    assert call_plan.runnable, (method, call_plan.reason)
    return dispatch.prepare_checked(q, k, v, METHODS[method], alive, call_plan, None, None, None)[0]


def _assert_loop(name, q, k, v, method, mask):
    """The dispatch runs this call on the loop ``name`` stands for (not a fallback)."""
    assert running_plan(q, k, v, method, mask).module == LOOPS[name][1], (name, method)


def exact_attention(q, k, v, mask=None, scale=None):
    """fp64 softmax attention: (out, lse); rows that see no key give 0 and -inf. Dead keys are
    selected away; V's non-finite values (the tests put them at dead keys only) are read as 0."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    live = torch.ones_like(s, dtype=torch.bool) if mask is None else mask.expand_as(s)
    s = torch.where(live, s, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.where(live, torch.exp(s - m), 0.0)
    l_ = p.sum(-1, keepdim=True)
    out = torch.where(l_ > 0, (p @ torch.where(torch.isfinite(v), v, 0.0)) / l_.clamp(min=1e-300), 0.0)
    lse = torch.where(l_[..., 0] > 0, (m + torch.log(l_.clamp(min=1e-300)))[..., 0], -math.inf)
    return out, lse


def clear_rows(q, k, method, mask=None, scale=None, rel=1e-5):
    """(B, H, Sq) bool: rows whose answer fp32 rounding does not decide — the largest logit (of the
    reference's quantized Q̂·K̂ᵀ, in fp64) ahead of the next by more than ``rel`` of its magnitude,
    or logits small enough (< 1e3 nats) that rounding moves no weight much. In a row with two keys
    that close at 1e8 nats, one rounding of either logit picks the winner."""
    from fp4video.reference import prepare_qkv

    qh, kh, _ = prepare_qkv(q, k, k[..., :1], METHODS[method])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (qh.double() @ kh.double().transpose(-1, -2))[..., : k.shape[-2]] * scale
    if mask is not None:
        s = torch.where(mask.expand_as(s), s, -math.inf)
    top = s.topk(min(2, s.shape[-1]), dim=-1).values
    big = top[..., 0].abs()
    gap = (top[..., 0] - top[..., -1]) if s.shape[-1] > 1 else torch.full_like(big, math.inf)
    return (big < 1e3) | (gap > rel * big) | torch.isinf(big)


def assert_rows_match(want, lse_want, got, lse_got, rows=None, cos=0.99999, atol=1e-5, what=""):
    """The kernel's result equals the reference's row by row: finite outputs and LSEs where the
    reference's are, the same rows without a live key (0 and -inf), each row's cosine and largest
    difference within the tolerances of tests/test_loops.py, the LSE within 1e-5 nats plus two
    fp32 ulps of its magnitude (logits of 1e9 nats have ulps of 64)."""
    want, got = want.double(), got.double()
    assert torch.isfinite(got).all() and torch.equal(torch.isfinite(lse_got), torch.isfinite(lse_want)), what
    assert torch.equal(lse_got == -math.inf, lse_want == -math.inf), what
    if rows is None:
        rows = torch.ones_like(lse_want, dtype=torch.bool)
    cosines = row_cosine(want, got).reshape(rows.shape)[rows]
    diff = (want - got).abs().amax(-1)[rows]
    scale = want.abs().amax(-1)[rows].clamp(min=1.0)
    fin = torch.isfinite(lse_want) & rows
    dl = (lse_want - lse_got)[fin].abs()
    tol = 1e-5 + 2.5e-7 * lse_want[fin].abs()
    assert cosines.numel() == 0 or cosines.min() > cos, (what, cosines.min().item())
    assert diff.numel() == 0 or (diff / scale).max() < atol, (what, (diff / scale).max().item())
    assert dl.numel() == 0 or (dl <= tol).all(), (what, dl.max().item())


def run_both(q, k, v, method, mask=None, scale=None):
    a, la = fp4_attention(q, k, v, method=method, attn_mask=mask, scale=scale, return_lse=True, backend="reference")
    b, lb = fp4_attention(q, k, v, method=method, attn_mask=mask, scale=scale, return_lse=True, backend="triton")
    return a, la, b, lb


def assert_near_exact(got, q, k, v, mask, method, rows=None, scale=None):
    """Against fp64 attention of the unquantized inputs, row by row: the relative error
    ‖got - exact‖ / ‖exact‖ below 0.5 for the FP4 methods (their rounding of Q, K, V and P; a row
    scaled by 0.32, or zeros, is beyond it), below 1e-4 for ``fp16``; rows without a live key 0."""
    out, _ = exact_attention(q, k, v, mask, scale)
    got = got.double()
    err = (got - out).norm(dim=-1)
    ref = out.norm(dim=-1)
    if rows is not None:
        err, ref = err[rows], ref[rows]
    bound = 1e-4 if method == "fp16" else 0.5
    assert (err <= bound * ref + 1e-6).all(), (method, (err / ref.clamp(min=1e-30)).max().item())


# --- dead keys of zero and tiny heads ----------------------------------------------------------


def _zero_and_tiny_heads(seed, sk=150, kind=("zero", "tiny"), with_mask=True):
    """Two batches of four heads: one head of Q = K = 0, one of Q = K = ±1e-30 (fp32), one with Q
    alone 0, one ordinary; a padding mask per batch (the second batch's keys past 100 dead)."""
    q, k, v = rand(2, 4, 24, 64, seed=seed), rand(2, 4, sk, 64, seed=seed + 1), rand(2, 4, sk, 64, seed=seed + 2)
    for head, what in enumerate(kind):
        if what == "zero":
            q[:, head], k[:, head] = 0.0, 0.0
        else:
            q[:, head], k[:, head] = 1e-30 * q[:, head].sign(), 1e-30 * k[:, head].sign()
    q[:, 2] = 0.0
    mask = rand(2, 1, 1, sk, seed=seed + 3) > -0.5
    mask[1, ..., 100:] = False
    return q, k, v, (mask if with_mask else None)


@INTERPRETER_ONLY
@pytest.mark.parametrize("loop, method", one_each(("bf16-mxfp4", "mxfp4-ocp"), ("e4m3", "mxattn-sk"),
                                                  ("scaled-nvfp4", "sage3-pv8")))
def test_zero_and_tiny_heads_keep_dead_keys_out_in_every_loop(loop, method, use_loop):
    """A head whose Q and K are all zero (or fp32 values of 1e-30) has factors that multiply to
    below fp32's range (the e4m3 loop's Q̂ and K̂ power-of-two factors; the NVFP4 tensor scales):
    its logits are 0, and a masked logit of -inf times that 0 factor was NaN — ``mxfp4-ocp`` came
    back zeros with LSE -inf, the FP8-P·V methods scaled by 0.32, ``mxattn`` with another norm.
    The loops now scale first and select dead keys to -inf after: every row equals the
    reference's and the fp64 attention's (a uniform average of the live V)."""
    use_loop(loop)
    q, k, v, mask = _zero_and_tiny_heads(10)
    _assert_loop(loop, q, k, v, method, mask)
    a, la, b, lb = run_both(q, k, v, method, mask)
    assert_rows_match(a, la, b, lb, what=(loop, method))
    assert_near_exact(b, q, k, v, mask, method)


@INTERPRETER_ONLY
@pytest.mark.slow
@pytest.mark.parametrize("loop, method", EVERY_PAIR)
def test_zero_and_tiny_heads_keep_dead_keys_out_every_method(loop, method, use_loop):
    """The previous test for every method of every loop, with and without a mask."""
    use_loop(loop)
    for with_mask in (True, False):
        q, k, v, mask = _zero_and_tiny_heads(20, sk=130, with_mask=with_mask)
        a, la, b, lb = run_both(q, k, v, method, mask)
        assert_rows_match(a, la, b, lb, what=(loop, method, with_mask))
        assert_near_exact(b, q, k, v, mask, method)


@INTERPRETER_ONLY
@settings(**PROPERTY, max_examples=6)
@given(pair=st.sampled_from(EVERY_PAIR), seed=st.integers(0, 10_000), sk=st.integers(1, 260),
       heads=st.lists(st.sampled_from(["zero", "tiny", "q-zero", "k-zero", "plain"]), min_size=2, max_size=2),
       density=st.floats(0.0, 1.0))
def test_zero_and_tiny_heads_with_padding_masks_property(pair, seed, sk, heads, density, use_loop):
    """Heads of zeros or ±1e-30 (Q, K or both) under random key-padding masks (all dead to all
    live, per batch), any key count (one partial tile to several): the kernel equals the reference
    row by row, its outputs are finite, rows without a live key are 0 with LSE -inf."""
    loop, method = pair
    use_loop(loop)
    q, k, v = rand(2, 2, 8, 32, seed=seed), rand(2, 2, sk, 32, seed=seed + 1), rand(2, 2, sk, 32, seed=seed + 2)
    for h, what in enumerate(heads):
        if what in ("zero", "q-zero"):
            q[:, h] = 0.0
        if what in ("zero", "k-zero"):
            k[:, h] = 0.0
        if what == "tiny":
            q[:, h], k[:, h] = 1e-30 * q[:, h].sign(), 1e-30 * k[:, h].sign()
    mask = torch.rand(2, 1, 1, sk, generator=torch.Generator().manual_seed(seed)) < density
    a, la, b, lb = run_both(q, k, v, method, mask)
    assert_rows_match(a, la, b, lb, what=(loop, method, heads))
    assert_near_exact(b, q, k, v, mask, method)


# --- very large logits ----------------------------------------------------------------------------


@INTERPRETER_ONLY
@pytest.mark.parametrize("loop, method", one_each(("e4m3", "mxattn-sk"), ("scaled-mxfp4", "mxattn"),
                                                  ("nvfp4", "nvfp4")))
def test_rows_with_logits_of_1e8_nats_keep_their_softmax_in_every_loop(loop, method, use_loop):
    """fp16 Q = K = 4000 (every logit 1.3e8 nats, all tied) and randn × 1e4 (logits ~1e8 nats): the
    loops took exp2 of one fused ``qk · scale + (k - m)``, which keeps the product's rounding
    residual (up to half an ulp of m: 2^4 and more at 1e8) and drops the tile's shift k once |m|
    reaches 2^24, so P̃ left its block scales' range and rows came back as zeros with LSE -inf
    (MXFP4, NVFP4, FP8 P). Each exponent is now the exact difference of a rounded logit and the
    row maximum: every row equals the reference's."""
    use_loop(loop)
    q = torch.full((1, 2, 16, 64), 4000.0, dtype=torch.float16)
    k = torch.full((1, 2, 150, 64), 4000.0, dtype=torch.float16)
    v = rand(1, 2, 150, 64, seed=30, dtype=torch.float16)
    _assert_loop(loop, q, k, v, method, None)
    a, la, b, lb = run_both(q, k, v, method)
    assert la.abs().min() > 1e7
    assert_rows_match(a, la, b, lb, what=(loop, method, "fp16 4000"))
    q, k, v = rand(1, 2, 16, 64, seed=31) * 1e4, rand(1, 2, 150, 64, seed=32) * 1e4, rand(1, 2, 150, 64, seed=33)
    a, la, b, lb = run_both(q, k, v, method)
    rows = clear_rows(q, k, method)
    assert rows.float().mean() > 0.8
    assert_rows_match(a, la, b, lb, rows=rows, what=(loop, method, "randn 1e4"))


def _logits_of(log10_nats, seed, sk, d=64):
    """Q, K whose largest |logit| is about 10^log10_nats nats (fp32), and V."""
    q, k, v = rand(1, 2, 16, d, seed=seed), rand(1, 2, sk, d, seed=seed + 1), rand(1, 2, sk, d, seed=seed + 2)
    top = ((q.double() @ k.double().transpose(-1, -2)) * d**-0.5).abs().max()
    a = math.sqrt(10.0**log10_nats / float(top))
    return q * a, k * a, v


@INTERPRETER_ONLY
@settings(**PROPERTY, max_examples=8)
@given(pair=st.sampled_from(EVERY_PAIR), log10_nats=st.floats(-6.0, 9.0), seed=st.integers(0, 10_000),
       sk=st.integers(1, 260), masked=st.booleans())
def test_logits_from_1e_minus_6_to_1e9_nats_property(pair, log10_nats, seed, sk, masked, use_loop):
    """Logits whose largest magnitude is log-uniform from 1e-6 to 1e9 nats, masked or not, any key
    count: every row the fp32 rounding does not decide (:func:`clear_rows`) equals the reference's
    (the LSE to two ulps), and the outputs are finite."""
    loop, method = pair
    use_loop(loop)
    q, k, v = _logits_of(log10_nats, seed, sk, d=32)
    mask = (torch.rand(1, 1, 1, sk, generator=torch.Generator().manual_seed(seed)) > 0.3) if masked else None
    a, la, b, lb = run_both(q, k, v, method, mask)
    rows = clear_rows(q, k, method, mask)
    assert_rows_match(a, la, b, lb, rows=rows, what=(loop, method, log10_nats))
    if log10_nats < 2:  # (beyond, quantizing Q and K changes which key wins: the fp64 row is another)
        assert_near_exact(b, q, k, v, mask, method, rows=rows)


# --- NaN / Inf in a dead key's V ------------------------------------------------------------------


@INTERPRETER_ONLY
@pytest.mark.parametrize("loop, method", one_each(("bf16", "fp16")))
def test_nan_or_inf_in_a_dead_keys_v_is_selected_away_in_every_loop(loop, method, use_loop):
    """The ``fp16`` loop reads V as given and multiplied a dead key's V by its zero weight: a NaN
    or Inf there made the head NaN, where the reference and the quantized loops ignore dead keys
    (the documented NaN/Inf policy). A dead key's V row is now loaded as 0 (selected): every loop
    equals the reference, and a dead key's NaN / Inf in K is ignored alike."""
    use_loop(loop)
    q, k, v = rand(2, 2, 16, 64, seed=40), rand(2, 2, 150, 64, seed=41), rand(2, 2, 150, 64, seed=42)
    mask = rand(2, 1, 1, 150, seed=43) > -0.5
    dead = ~mask[:, 0, 0, :]
    v[dead[:, None, :, None].expand_as(v)] = float("nan")
    v[0, 1, dead[0].nonzero()[:1, 0]] = float("inf")
    k[1, 0, dead[1].nonzero()[:1, 0]] = float("-inf")
    _assert_loop(loop, q, k, torch.nan_to_num(v), method, mask)
    a, la, b, lb = run_both(q, k, v, method, mask)
    assert torch.isfinite(a).all()
    assert_rows_match(a, la, b, lb, what=(loop, method))
    assert_near_exact(b, q, torch.where(dead[:, None, :, None], 0.0, k), v, mask, method)


@INTERPRETER_ONLY
@settings(**PROPERTY, max_examples=5)
@given(pair=st.sampled_from(EVERY_PAIR), seed=st.integers(0, 10_000), sk=st.integers(2, 260),
       poison=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_nonfinite_values_at_dead_keys_property(pair, seed, sk, poison, use_loop):
    """NaN or ±Inf in the V (and K) rows of random dead keys: the kernel equals the reference row
    by row and stays finite."""
    loop, method = pair
    use_loop(loop)
    q, k, v = rand(1, 2, 8, 32, seed=seed), rand(1, 2, sk, 32, seed=seed + 1), rand(1, 2, sk, 32, seed=seed + 2)
    mask = torch.rand(1, 1, 1, sk, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[..., 0] = True
    dead = ~mask[0, 0, 0]
    v[:, :, dead] = poison
    k[:, 1, dead] = poison
    a, la, b, lb = run_both(q, k, v, method, mask)
    assert_rows_match(a, la, b, lb, what=(loop, method, poison))


# --- masks broadcast over batches and keys ------------------------------------------------------

#: masks the kernels run: one key-padding row per batch, broadcast over batches and/or keys
ACCEPTED = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, "sk"), (2, 1, 1, "sk")]
#: masks they cannot run (they vary over heads or queries)
REFUSED = [(1, 1, "sq", 1), (1, 2, 1, 1), (2, 2, 1, "sk"), (1, 1, "sq", "sk"), (2, 2, "sq", "sk")]


def _mask(shape, sq, sk, seed, density=0.6):
    dims = tuple(sq if d == "sq" else sk if d == "sk" else d for d in shape)
    return torch.rand(*dims, generator=torch.Generator().manual_seed(seed)) < density


@INTERPRETER_ONLY
@pytest.mark.parametrize("loop, method", [("e4m3", "mxattn-sk"), pytest.param("e4m3", "fp8", marks=pytest.mark.slow),
                                          pytest.param("nvfp4", "sage3", marks=pytest.mark.slow),
                                          pytest.param("bf16", "fp16", marks=pytest.mark.slow)])
def test_broadcast_key_masks_give_the_reference_result_per_row(loop, method, use_loop):
    """Masks broadcast over keys ((1, 1, 1, 1), (B, 1, 1, 1): all keys of a batch live or dead) and
    over batches are what ``supports`` sends to the kernels, which expand them to (B, Sk): every row
    equals the reference's — for the smooth-K methods (``mxattn-sk``, ``fp8``, ``sage3``) too, whose
    K mean must count every live key the broadcast mask covers (the reference counted one; rows 0.2
    apart, LSEs 3-5 nats)."""
    from fp4video.kernels import supports
    from fp4video.kernels.plan import plan

    use_loop(loop)
    q, k, v = rand(2, 2, 16, 64, seed=50), rand(2, 2, 150, 64, seed=51) + 0.5, rand(2, 2, 150, 64, seed=52)
    for mask in (torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.tensor([True, False]).reshape(2, 1, 1, 1),
                 torch.tensor([False, True]).reshape(2, 1, 1, 1), _mask((1, 1, 1, "sk"), 16, 150, 53)):
        ok, why = supports(METHODS[method], q, mask)  # (``why``: the plan's reason, how the kernels run it)
        assert ok, why
        assert plan(METHODS[method], q, v, mask).module == LOOPS[loop][1], (loop, method, tuple(mask.shape))
        a, la, b, lb = run_both(q, k, v, method, mask)
        assert_rows_match(a, la, b, lb, what=(loop, method, tuple(mask.shape)))
        assert_near_exact(b, q, k, v, mask, method)


@INTERPRETER_ONLY
@settings(**PROPERTY, max_examples=5)
@given(pair=st.sampled_from(EVERY_PAIR), shape=st.sampled_from(ACCEPTED), seed=st.integers(0, 10_000),
       sk=st.integers(1, 260), density=st.floats(0.0, 1.0))
def test_accepted_mask_shapes_match_the_reference_property(pair, shape, seed, sk, density, use_loop):
    """Every mask shape the kernels accept, with random live keys (none to all): row by row the
    reference's result, finite."""
    loop, method = pair
    use_loop(loop)
    q, k, v = rand(2, 2, 8, 32, seed=seed), rand(2, 2, sk, 32, seed=seed + 1) + 0.3, rand(2, 2, sk, 32, seed=seed + 2)
    mask = _mask(shape, 8, sk, seed, density)
    a, la, b, lb = run_both(q, k, v, method, mask)
    assert_rows_match(a, la, b, lb, what=(loop, method, shape))


@pytest.mark.parametrize("shape", REFUSED)
@pytest.mark.parametrize("method", ["mxattn", "sage3"])
def test_masks_varying_over_heads_or_queries_are_refused_with_the_reason(shape, method, device):
    """A mask the kernels cannot run (it varies over heads or queries, including one broadcast over
    keys per query, (1, 1, Sq, 1)) is refused by ``supports`` with its shape in the reason;
    ``backend="triton"`` raises that, ``backend="auto"`` gives the reference's result."""
    from fp4video.kernels import supports

    q, k, v = (rand(2, 2, n, 32, seed=60 + i, device=device) for i, n in enumerate((16, 150, 150)))
    mask = _mask(shape, 16, 150, 63).to(device)
    ok, why = supports(METHODS[method], q, mask)
    assert not ok and "varies over heads or queries" in why and str(tuple(mask.shape)) in why
    with pytest.raises(NotImplementedError, match="varies over heads or queries"):
        fp4_attention(q, k, v, method=method, attn_mask=mask, backend="triton")
    auto = fp4_attention(q, k, v, method=method, attn_mask=mask, backend="auto")
    assert torch.equal(auto, fp4_attention(q, k, v, method=method, attn_mask=mask, backend="reference"))


# --- GPU twins: the H200's loops ----------------------------------------------------------------

GPU_METHODS = ["fp16", "mxattn", "mxfp4-ocp", "mxattn-sk", "nvfp4", "sage3", "sage3-hpnq", "mxattn-pv8",
               "sage3-pv8", "fp8"]


def _gpu_rows_match(want, lse_want, got, lse_got, rows=None, what="", lse_rel=1e-6):
    """GPU tolerances (tests/test_loops.py's): every clear row's cosine above 0.99 and 99 % above
    0.999 (the GPU's exp2 moves an element across an E2M1 boundary now and then), LSE within 2e-2
    plus ``lse_rel`` of its magnitude (the MMAs sum the logits in another order: 1e-6, eight fp32
    ulps; E4M3 Q·K on Hopper's FP8 MMA, whose accumulator keeps fewer bits than fp32: 5e-4, seen
    1.4e-4 on the H200); finite wherever the reference is, the same dead rows."""
    assert torch.isfinite(got).all(), what
    assert torch.equal(lse_got == -math.inf, lse_want == -math.inf), what
    cos = row_cosine(want.float(), got.float()).reshape(lse_want.shape)
    if rows is not None:
        cos = cos[rows]
    assert cos.min() > 0.99 and (cos < 0.999).float().mean() < 0.01, (what, cos.min().item())
    fin = torch.isfinite(lse_want)
    tol = 2e-2 + lse_rel * lse_want[fin].abs()
    assert ((lse_want - lse_got)[fin].abs() <= tol).all(), (what, (lse_want - lse_got)[fin].abs().max().item())


def _hopper_loop(q, k, v, method, mask):
    """On sm_90, the loop the dispatch runs is one of the Hopper loops (e4m3 by TMA, Gluon NVFP4 at
    head dims 64 / 128, the NVFP4 Triton loop for FP8 P, bf16)."""
    if torch.cuda.get_device_capability()[0] != 9:
        return
    run = running_plan(q, k, v, method, mask)
    assert run.module in ("loop_e4m3", "loop_nvfp4_sm90", "loop_nvfp4", "loop_bf16"), (method, run.describe())
    assert run.loop != "e4m3" or run.tma, (method, run.describe())  # the e4m3 loop by TMA


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
def test_zero_and_tiny_heads_keep_dead_keys_out_gpu(method):
    """GPU twin of the zero / 1e-30 heads under padding masks (bf16 and fp32 inputs; the 1e-30
    heads in fp32)."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, mask = _zero_and_tiny_heads(70, sk=1531, kind=("zero", "tiny" if dtype == torch.float32 else "zero"))
        q, k, v, mask = q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), mask.cuda()
        _hopper_loop(q, k, v, method, mask)
        a, la, b, lb = run_both(q, k, v, method, mask)
        _gpu_rows_match(a, la, b, lb, what=(method, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
@pytest.mark.parametrize("log10_nats", [-6, -1, 2, 5, 8, 9])
def test_logits_from_1e_minus_6_to_1e9_nats_gpu(method, log10_nats):
    """GPU twin of the large-logit range (bf16 inputs, masked), and fp16 Q = K = 4000."""
    q, k, v = (t.cuda().bfloat16() for t in _logits_of(log10_nats, 80, 1531, d=128))
    mask = rand(1, 1, 1, 1531, seed=81, device="cuda") > -1.0
    _hopper_loop(q, k, v, method, mask)
    a, la, b, lb = run_both(q, k, v, method, mask)
    rel = 5e-4 if METHODS[method].qk_format is not None and METHODS[method].qk_format.value == "e4m3" else 1e-6
    _gpu_rows_match(a, la, b, lb, rows=clear_rows(q.cpu(), k.cpu(), method, mask.cpu()).cuda(),
                    what=(method, log10_nats), lse_rel=rel)
    if log10_nats == 8:
        q = torch.full((1, 4, 256, 128), 4000.0, dtype=torch.float16, device="cuda")
        v = rand(1, 4, 1000, 128, seed=82, device="cuda", dtype=torch.float16)
        a, la, b, lb = run_both(q, q[:, :, :1].expand(1, 4, 1000, 128), v, method)
        _gpu_rows_match(a, la, b, lb, what=(method, "fp16 4000"), lse_rel=rel)


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
def test_nan_or_inf_in_a_dead_keys_v_is_selected_away_gpu(method):
    """GPU twin: NaN / Inf in dead keys' V (and K) rows, bf16."""
    q, k, v = (rand(2, 4, n, 128, seed=90 + i) for i, n in enumerate((1000, 1531, 1531)))
    mask = rand(2, 1, 1, 1531, seed=93) > -0.5
    dead = ~mask[:, 0, 0, :]
    v[dead[:, None, :, None].expand_as(v)] = float("nan")
    v[0, 1, dead[0].nonzero()[:1, 0]] = float("inf")
    k[1, 0, dead[1].nonzero()[:1, 0]] = float("-inf")
    q, k, v, mask = q.cuda().bfloat16(), k.cuda().bfloat16(), v.cuda().bfloat16(), mask.cuda()
    a, la, b, lb = run_both(q, k, v, method, mask)
    _gpu_rows_match(a, la, b, lb, what=method)


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
@pytest.mark.parametrize("shape", ACCEPTED)
def test_broadcast_key_masks_give_the_reference_result_gpu(method, shape):
    """GPU twin: every accepted mask shape (random live keys, and all-live / all-dead broadcasts)."""
    q, k, v = (rand(2, 4, n, 128, seed=100 + i, device="cuda", dtype=torch.bfloat16) for i, n in
               enumerate((1000, 1531, 1531)))
    for density in (0.6, 1.0, 0.0):
        mask = _mask(shape, 1000, 1531, 103, density).cuda()
        a, la, b, lb = run_both(q, k + 0.5, v, method, mask)
        _gpu_rows_match(a, la, b, lb, what=(method, shape, density))


@INTERPRETER_ONLY
@pytest.mark.parametrize("method", ["mxattn", "mxattn-pv8"])
def test_e4m3_loop_exponent_forms_agree_within_the_fast_bound_and_the_exact_one_runs_beyond(method, monkeypatch):
    """The e4m3 loop has two forms of its exponents: the fast fused one for calls whose logit
    bound lies within ``FAST_LOGIT_BOUND`` nats, the exact one beyond. Within the bound, on ordinary
    and sharp rows (with a padding mask and a head of zeros), both equal the reference row by row;
    the dispatch picks the fast one there and the exact one for logits past the bound."""
    from fp4video.kernels import dispatch, loop_e4m3
    from fp4video.kernels.dispatch import key_padding, prepare, run_loop
    from fp4video.kernels.plan import plan

    q, k, v = (rand(1, 2, 130, 64, seed=s) for s in (1, 2, 3))
    q = q * torch.tensor([1.0, 6.0]).view(1, 2, 1, 1)  # a sharp head
    q[:, 1, :7], k[:, 1] = 0.0, torch.where(torch.arange(130).view(1, 130, 1) < 90, k[:, 1], 0.0)
    mask = torch.ones(1, 1, 1, 130, dtype=torch.bool)
    mask[..., 100:] = False
    want, lse_want = fp4_attention(q, k, v, method=method, attn_mask=mask, backend="reference", return_lse=True)
    alive = key_padding(mask, 1, 130)
    e4m3_plan = plan(METHODS[method], q, v, mask)
    assert e4m3_plan.loop == "e4m3", e4m3_plan
    prepared = prepare(q, k, v, METHODS[method], alive, e4m3_plan)
    forms = []
    for exact in (False, True):
        out, lse = run_loop(e4m3_plan, prepared, alive, recipe=METHODS[method], scale=64**-0.5, out_dtype=q.dtype,
                            dv=64, exact=exact)
        # per row as tests/test_loops.py bounds the loops (a P̃ element on a rounding boundary may flip)
        assert torch.isfinite(out).all() and torch.equal(torch.isinf(lse), torch.isinf(lse_want)), exact
        assert row_cosine(out.double(), want.double()).min() > 0.99999, exact
        fin = torch.isfinite(lse_want)
        assert (lse[fin] - lse_want[fin]).abs().max() < 1e-4, exact
        forms.append(out)
    assert row_cosine(forms[0].double(), forms[1].double()).min() > 0.99999

    seen = []
    real_e4m3, real_loop_function = loop_e4m3.attention_e4m3, dispatch.loop_function
    assert real_loop_function("e4m3") is real_e4m3

    def spy(*a, **kw):
        seen.append(kw["exact"])
        return real_e4m3(*a, **kw)

    monkeypatch.setattr(dispatch, "loop_function", lambda loop: spy if loop == "e4m3" else real_loop_function(loop))
    fp4_attention(q, k, v, method=method, attn_mask=mask, backend="triton")
    big = math.sqrt(4 * loop_e4m3.FAST_LOGIT_BOUND * 64**0.5 / 64)  # scale·D·max|q|·max|k| over the bound
    fp4_attention(q.clamp(-1, 1) * big, k.clamp(-1, 1) * big, v, method=method, attn_mask=mask, backend="triton")
    assert seen == [False, True]
