"""The block-sparse loops (the e4m3 loop in both its forms, the bf16 loop and the dot_scaled loop in
its variant forms) against the reference on the same selection, row by row: masks, odd lengths,
both layouts, query tiles of 64 and 128 rows; full density is the dense kernel bit for bit; a
visited tile set is the dense loop with the other tiles' keys masked out, on the same operands;
the dot_scaled loop's TMA and quad-key-order forms are its pointer-load form on a selection; rows
that visit no live key; the loops that take no selection refuse it by name. CPU: the Triton interpreter (small shapes); GPU (marker ``gpu``): bf16
at realistic sizes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fp4video import fp4_attention
from fp4video.sparse import BlockSelection, DynamicSparsity, StaticSparsity

pytest.importorskip("triton")
from conftest import rand  # noqa: E402
from test_trust_kernels import assert_rows_match  # noqa: E402

#: every loop that takes a selection, by the method and environment that run it
SPARSE_FORMS = {
    "e4m3 TMA (mxattn)": ("mxattn", {}),
    "e4m3 pointer loads (mxattn-pv8)": ("mxattn-pv8", {"FP4VIDEO_MX_TMA": "0"}),
    "e4m3 (fp8)": ("fp8", {}),
    "bf16 (mxattn)": ("mxattn", {"FP4VIDEO_MX_KERNEL": "bf16"}),
    "bf16 (fp16)": ("fp16", {}),
    # the dot_scaled loop where Triton emulates dot_scaled (the interpreter): pointer loads
    "scaled (mxattn)": ("mxattn", {"FP4VIDEO_MX_KERNEL": "scaled"}),
    "scaled (sage3)": ("sage3", {"FP4VIDEO_NV_KERNEL": "scaled"}),
    "scaled FP8 P·V (mxattn-pv8)": ("mxattn-pv8", {"FP4VIDEO_MX_KERNEL": "scaled"}),
}


def set_form(form, monkeypatch, request):
    """The method of ``form`` (:data:`SPARSE_FORMS`) with its environment; the NVFP4 dot_scaled loop
    with the interpreter's E4M3 scale decoding (the ``e4m3_dot_scaled`` fixture)."""
    method, env = SPARSE_FORMS[form]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if env.get("FP4VIDEO_NV_KERNEL") == "scaled":
        request.getfixturevalue("e4m3_dot_scaled")
    return method


def random_selection(b, h, sq, sk, seed, density=0.5, query_tile=128):
    g = torch.Generator().manual_seed(seed)
    tiles = torch.rand(b, h, -(-sq // query_tile), -(-sk // 128), generator=g) < density
    return BlockSelection(tiles, sq, sk, query_tile, 128)


def both(q, k, v, method, selection, mask=None, layout="bhsd"):
    a, la = fp4_attention(q, k, v, method=method, attn_mask=mask, layout=layout, sparsity=selection, return_lse=True,
                          backend="reference")
    b, lb = fp4_attention(q, k, v, method=method, attn_mask=mask, layout=layout, sparsity=selection, return_lse=True,
                          backend="triton")
    return a, la, b, lb


def interpreter_only():
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers this on CUDA")


@pytest.mark.parametrize("form", list(SPARSE_FORMS))
def test_sparse_loop_matches_the_reference_row_by_row_interpreter(form, monkeypatch, request):
    """Odd lengths (a partial last key tile, visited or not), a key-padding mask, two query tiles."""
    interpreter_only()
    method = set_form(form, monkeypatch, request)
    q, k, v = rand(1, 2, 200, 64, seed=1), rand(1, 2, 390, 64, seed=2), rand(1, 2, 390, 64, seed=3)
    mask = rand(1, 1, 1, 390, seed=4) > -0.8
    sel = random_selection(1, 2, 200, 390, seed=5)
    sel.tiles[0, 0, 1, -1] = sel.tiles[0, 1, 0, -1] = True  # the partial tile, visited and not
    sel.tiles[0, 0, 0, -1] = False
    a, la, b, lb = both(q, k, v, method, sel, mask)
    # FP8 methods: a logit a rounding apart in the two products' summation orders may move one P
    # value by an e4m3 step (the dense loop's tolerance, tests/test_loops.py)
    assert_rows_match(a, la, b, lb, cos=0.99999, atol=1e-5 if method != "fp8" else 2e-2, what=form)


@pytest.mark.parametrize("method", ["mxattn", "fp16"])
def test_sparse_bshd_query_tiles_of_64_and_a_broadcast_selection_interpreter(method):
    interpreter_only()
    q, k, v = rand(1, 150, 2, 40, seed=6), rand(1, 300, 2, 40, seed=7), rand(1, 300, 2, 24, seed=8)
    g = torch.Generator().manual_seed(9)
    sel = BlockSelection(torch.rand(1, 1, 3, 3, generator=g) < 0.6, 150, 300, 64, 128)  # one bitmap, every head
    a, la, b, lb = both(q, k, v, method, sel, layout="bshd")
    assert b.shape == (1, 150, 2, 24)
    assert_rows_match(a, la, b, lb, what=method)


@pytest.mark.parametrize("form", ["e4m3 TMA (mxattn)", "bf16 (fp16)", "scaled (sage3)"])
def test_full_density_is_the_dense_kernel_bit_for_bit_interpreter(form, monkeypatch, request):
    interpreter_only()
    method = set_form(form, monkeypatch, request)
    q, k, v = rand(1, 2, 130, 64, seed=10), rand(1, 2, 300, 64, seed=11), rand(1, 2, 300, 64, seed=12)
    mask = rand(1, 1, 1, 300, seed=13) > -1.0
    dense = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton")
    full = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton",
                         sparsity=BlockSelection.dense(130, 300))
    assert all(torch.equal(x, y) for x, y in zip(dense, full)), form


@pytest.mark.parametrize("form", ["e4m3 TMA (mxattn)", "e4m3 pointer loads (mxattn-pv8)", "bf16 (mxattn)",
                                  "scaled (mxattn)", "scaled (sage3)", "scaled FP8 P·V (mxattn-pv8)"])
def test_a_selection_is_the_dense_loop_with_the_other_tiles_masked_interpreter(form, monkeypatch, request):
    """One query tile: visiting key tiles J equals the dense loop on the same operands with every key
    outside J masked. The bf16 loop and the dot_scaled loop with FP4 P·V bit for bit (a dead tile
    leaves the running max, sum and accumulator as they are); the e4m3 loop and the dot_scaled
    loop's FP8-P·V form to fp32 rounding (a dead tile moves its units 2^k to the floor's, and the
    next tile's rescale exponent, a fraction plus that integer, rounds differently)."""
    interpreter_only()
    from fp4video.formats import Format
    from fp4video.kernels import dispatch
    from fp4video.kernels.plan import plan
    from fp4video.kernels.operands import KeyTileLists
    from fp4video.recipe import get_recipe

    method = set_form(form, monkeypatch, request)
    recipe = get_recipe(method)
    q, k, v = rand(1, 2, 100, 64, seed=14), rand(1, 2, 520, 64, seed=15), rand(1, 2, 520, 64, seed=16)
    tiles = torch.tensor([True, False, True, False, True]).expand(1, 2, 1, 5).clone()
    tiles[0, 1] = torch.tensor([False, True, True, False, False])
    run = plan(recipe, q, v)
    ops = dispatch.prepare(q, k, v, recipe, None, run)
    args = dict(recipe=recipe, scale=0.125, out_dtype=torch.float32, dv=64)
    sparse = dispatch.run_loop(run, ops, None, visit=KeyTileLists.from_bitmap(tiles, 128, 1, 2, 100, 520), **args)
    for h in range(2):
        alive = tiles[0, h, 0].repeat_interleave(128)[:520][None]
        dense = dispatch.run_loop(run, ops, alive, **args)
        exact = run.loop == "bf16" or (run.loop == "scaled" and recipe.pv_format is not Format.E4M3)
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sparse[0][:, h], dense[0][:, h], **tol, msg=f"{form}, head {h}")
        torch.testing.assert_close(sparse[1][:, h], dense[1][:, h], **tol, msg=f"{form}, head {h}")


@pytest.mark.parametrize("method", ["mxattn", "sage3", "mxattn-pv8"])
def test_scaled_loop_forms_take_a_selection_interpreter(method, monkeypatch, e4m3_dot_scaled):
    """The dot_scaled loop's variant forms on one selection (query tiles of 64 rows, a partial last
    key tile visited by one query tile and not by another, a key-padding mask, head dim 128, whose
    block scales the TMA forms read as chunks): sm_100's TMA loop (in key order, and the
    warp-specialized one, which the interpreter runs in order) is the pointer-load loop bit for
    bit, as dense; sm_120's quad key order (FP4 P·V) is it to the order of the row sums' additions.
    At full density every form is its dense launch bit for bit."""
    interpreter_only()
    from fp4video.formats import Format
    from fp4video.kernels import dispatch
    from fp4video.kernels.loop_scaled import attention_packed, variant
    from fp4video.kernels.operands import KeyTileLists
    from fp4video.kernels.plan import plan
    from fp4video.recipe import get_recipe

    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    recipe = get_recipe(method)
    q, k, v = rand(1, 2, 130, 128, seed=40), rand(1, 2, 330, 128, seed=41), rand(1, 2, 330, 128, seed=42)
    alive = dispatch.key_padding(rand(1, 1, 1, 330, seed=43) > -0.8, 1, 330)
    base = plan(recipe, q, v)
    assert base.loop == "scaled", base
    pointer = base.replace(tma=False, warp_specialized=False, key_order="key")
    forms = {"pointer": pointer, "tma": pointer.replace(tma=True), "ws": pointer.replace(tma=True, warp_specialized=True)}
    if recipe.pv_format is not Format.E4M3:  # the quad key order is the FP4-P·V loop's
        forms["quad"] = pointer.replace(key_order="quad")
    assert {variant(f).__name__.rsplit(".", 1)[-1] for f in forms.values()} == (
        {"loop_scaled_pointer", "loop_scaled_sm100"} | ({"loop_scaled_sm120"} if "quad" in forms else set()))
    # three query tiles of 64 rows by three key tiles (the last one partial, visited and not); head 1's
    # second query tile visits nothing
    tiles = torch.tensor([[[1, 0, 1], [0, 1, 0], [1, 1, 0]], [[0, 1, 1], [0, 0, 0], [1, 0, 1]]], dtype=torch.bool)[None]
    lists = KeyTileLists.from_bitmap(tiles, 64, 1, 2, 130, 330)
    full = KeyTileLists.from_bitmap(torch.ones(1, 1, 2, 3, dtype=torch.bool), 128, 1, 2, 130, 330)
    args = dict(recipe=recipe, scale=128**-0.5, out_dtype=torch.float32, dv=128)
    want = None
    for name, form in forms.items():
        ops = dispatch.prepare(q, k, v, recipe, alive, form)
        got = attention_packed(ops, alive, form, visit=lists, **args)
        if want is None:
            want = got
            assert torch.isfinite(got[0]).all() and (got[0][:, 1, 64:128] == 0).all()
            assert torch.equal(got[1] == -math.inf, torch.arange(130).expand(1, 2, 130).ge(64)
                               & torch.arange(130).lt(128) & torch.tensor([False, True])[:, None])
        elif name == "quad":
            torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-6, msg=f"{method}, {name}")
            torch.testing.assert_close(got[1], want[1], rtol=2e-7, atol=1e-6, msg=f"{method}, {name}")
        else:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (method, name)
        dense = attention_packed(ops, alive, form, **args)
        sparse = attention_packed(ops, alive, form, visit=full, **args)
        assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1]), (method, name, "full density")


def test_rows_that_visit_no_live_key_give_zeros_and_minus_inf_interpreter():
    interpreter_only()
    q, k, v = rand(1, 1, 256, 64, seed=17), rand(1, 1, 256, 64, seed=18), rand(1, 1, 256, 64, seed=19)
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)
    mask[..., 128:] = False  # the second key tile is dead
    tiles = torch.tensor([[[[True, True], [False, True]]]])  # query tile 1 visits only the dead tile
    for method in ("mxattn", "fp16"):
        out, lse = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton",
                                 sparsity=BlockSelection(tiles, 256, 256))
        assert torch.equal(out[:, :, 128:], torch.zeros_like(out[:, :, 128:])), method
        assert (lse[:, :, 128:] == -math.inf).all() and torch.isfinite(lse[:, :, :128]).all(), method


def test_rules_run_on_the_kernels_and_inputs_stay_unmodified_interpreter():
    interpreter_only()
    q, k, v = rand(1, 2, 256, 64, seed=20), rand(1, 2, 256, 64, seed=21), rand(1, 2, 256, 64, seed=22)
    before = [t.clone() for t in (q, k, v)]
    for rule in (DynamicSparsity(tau=0.5), StaticSparsity(frames=4, height=8, width=8, window=(1, 2, 2))):
        a = fp4_attention(q, k, v, method="mxattn", sparsity=rule, backend="reference")
        b = fp4_attention(q, k, v, method="mxattn", sparsity=rule, backend="triton")
        assert torch.allclose(a, b, atol=1e-5), rule
    assert all(torch.equal(x, y) for x, y in zip(before, (q, k, v)))


@pytest.mark.parametrize("tile", [128, 96])
def test_the_kernels_pooling_is_the_reference_pooling(tile, device):
    """Every option of :func:`fp4video.sparse.tile_pool` (a partial last tile, a weight whose dead
    tokens hold NaN and are not read, a centre, bshd views) to fp32 rounding."""
    from fp4video.kernels.pooling import tile_pool as kernel_pool
    from fp4video.sparse import tile_pool

    x = rand(2, 300, 3, 40, seed=30, device=device, dtype=torch.bfloat16).transpose(1, 2)
    weight = (rand(2, 1, 300, seed=31, device=device) > -0.5).float()
    poisoned = torch.where(weight[..., None] > 0, x, float("nan"))
    center = rand(2, 3, 1, 40, seed=32, device=device)
    for kw in ({}, dict(weight=weight), dict(weight=weight, center=center, sums=False), dict(center=center)):
        xs = poisoned if "weight" in kw else x
        for want, got in zip(tile_pool(xs, tile, **kw), kernel_pool(xs, tile, **kw)):
            assert (want is None) == (got is None), kw
            if want is not None:
                assert torch.isfinite(got).all() and (want - got).abs().max() < 1e-4, kw


def test_the_dynamic_selection_through_the_kernels_pooling_is_the_reference_selection(device):
    from fp4video.kernels.pooling import tile_pool as kernel_pool
    from fp4video.sparse import dynamic_selection
    from test_sparse import local_inputs

    q, k = local_inputs(n=1024, heads=2, dim=64)
    q, k = q.to(device), k.to(device)
    mask = torch.ones(1, 1, 1, 1024, dtype=torch.bool, device=device)
    mask[..., -100:] = False
    for tau in (0.5, 0.9):
        want = dynamic_selection(q, k, tau=tau, attn_mask=mask, query_tile=64, key_tile=128)
        got = dynamic_selection(q, k, tau=tau, attn_mask=mask, query_tile=64, key_tile=128, pool=kernel_pool)
        assert torch.equal(want.tiles, got.tiles) and 0 < float(got.density()) < 1, tau


def test_loops_without_a_selection_refuse_it_by_name(monkeypatch):
    from fp4video.kernels.plan import SPARSE_LOOPS, plan_on
    from fp4video.recipe import get_recipe

    # Blackwell's dot_scaled loop takes a selection, in every form (where this Triton compiles it)
    for arch in ("sm_100", "sm_120"):
        for method in ("mxattn", "sage3", "mxattn-pv8"):
            on = plan_on(get_recipe(method), arch)
            assert on.loop != "scaled" or on.sparse_reason is None, (method, arch, on.sparse_reason)
    # sage3 on Hopper plans an NVFP4 loop on bf16 tensor cores, which takes none
    hopper = plan_on(get_recipe("sage3"), "sm_90")
    assert hopper.loop not in SPARSE_LOOPS and re.search("loop_nvfp4.*takes no key-tile selection", hopper.sparse_reason)
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "triton")  # that loop on this device too (Blackwell included)
    q = k = v = rand(1, 1, 64, 64, seed=23)
    sel = BlockSelection.dense(64, 64)
    with pytest.raises(NotImplementedError, match="loop_nvfp4.*takes no key-tile selection"):
        fp4_attention(q, k, v, method="sage3", sparsity=sel, backend="triton")
    # "auto" runs such a call on the reference, where the selection applies as well
    a = fp4_attention(q, k, v, method="sage3", sparsity=sel, backend="auto")
    assert torch.equal(a, fp4_attention(q, k, v, method="sage3", sparsity=sel, backend="reference"))


def test_a_query_tile_below_given_rows_per_program_is_refused():
    interpreter_only()
    from fp4video.kernels import dispatch
    from fp4video.kernels.plan import plan
    from fp4video.kernels.operands import KeyTileLists
    from fp4video.recipe import get_recipe

    recipe = get_recipe("fp16")
    q = rand(1, 1, 64, 64, seed=24)
    run = plan(recipe, q, q)
    lists = KeyTileLists.from_bitmap(torch.ones(1, 1, 2, 1, dtype=torch.bool), 32, 1, 1, 64, 64)
    with pytest.raises(ValueError, match="query tile .32 rows. must be a multiple of the loop's 64 rows per program$"):
        dispatch.run_loop(run, dispatch.prepare(q, q, q, recipe, None, run), None, recipe=recipe, scale=0.125,
                          out_dtype=torch.float32, dv=64, visit=lists, block_m=64)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn", "mxattn-pv8", "fp8", "fp16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sparse_kernel_matches_reference_gpu(method, layout):
    shape_q, shape_k = (2, 8, 1000, 128), (2, 8, 1531, 128)
    if layout == "bshd":
        shape_q, shape_k = (2, 1000, 8, 128), (2, 1531, 8, 128)
    q, k, v = (rand(*s, seed=i, device="cuda", dtype=torch.bfloat16) for i, s in enumerate((shape_q, shape_k, shape_k)))
    mask = rand(2, 1, 1, 1531, seed=11, device="cuda") > -1.0
    sel = random_selection(2, 8, 1000, 1531, seed=12, density=0.3)
    sel = BlockSelection(sel.tiles.cuda(), 1000, 1531)
    a, la = fp4_attention(q, k, v, method=method, layout=layout, attn_mask=mask, return_lse=True, backend="reference",
                          sparsity=sel)
    poison = torch.full((256 << 20,), float("nan"), device="cuda")  # freed memory the kernel's outputs reuse
    del poison
    b, lb = fp4_attention(q, k, v, method=method, layout=layout, attn_mask=mask, return_lse=True, backend="triton",
                          sparsity=sel)
    if layout == "bshd":
        a, b, la, lb = a.transpose(1, 2), b.transpose(1, 2), la.transpose(1, 2), lb.transpose(1, 2)
    live = torch.isfinite(la)  # rows whose visited tiles hold a live key
    assert torch.equal(live, torch.isfinite(lb)) and torch.isfinite(b).all(), method
    assert (b[~live] == 0).all() and (la - lb)[live].abs().max() < 2e-2, method
    rows = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)[live]
    assert rows.min() >= 0.999, (method, rows.min().item())


@pytest.mark.gpu
def test_sparse_call_captures_in_a_cuda_graph_gpu():
    """The selection and the lists are tensor operations: nothing is read back, so a graph captures
    the whole call and replays it to the eager result."""
    q, k, v = (rand(1, 4, 2048, 128, seed=s, device="cuda", dtype=torch.bfloat16) for s in (30, 31, 32))
    rule = DynamicSparsity(tau=0.8)
    assert_graph_replays_eager(lambda: fp4_attention(q, k, v, method="mxattn-pv8", sparsity=rule, backend="triton"))


def assert_graph_replays_eager(call):
    """``call()`` captured in a CUDA graph (after a warm-up on a side stream, as CUDA graphs ask)
    replays to its eager result bit for bit: nothing in it reads back to the host."""
    eager = call()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

