"""The block-sparse check's kernels and the peers under torch.compile, probed at their edges: the
``row_shares`` kernel against an fp64 sum on odd shapes, broadcast selections, empty and non-finite
rows and the inputs it leaves to the reference; the row-mass kernel's rows that are not finite when
every key tile of the row has a masked key (one partial tile, or a key-padding mask); the check with
every GPU kernel (in the interpreter) against the independent fp64 check of
``test_review_sparse_check``; the check with the shares kernel against the check with the reference,
past ``SINK_QUERY_TILES`` query tiles; the sinks' query tiles for every tile count up to 2,000; a peer
standing in for SDPA inside compiled code (restored, counted, the calls it leaves still right); and,
on the GPU, offsets past 2³¹ elements."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from fp4video.eval.peers import Peer, sdpa_replaced_by
from fp4video.sparse import BlockSelection, check_selection, row_block_mass
from fp4video.sparse.check import SINK_QUERY_TILES, row_shares, sink_columns, sink_query_tiles

SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.fixture
def kernels(monkeypatch):
    """The GPU's row mass, placement and shares, run by Triton's interpreter on the CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fp4video.kernels.covering import covering_rows
    from fp4video.kernels.row_mass import row_block_mass as kernel_row_mass
    from fp4video.kernels.row_mass import row_shares as kernel_shares

    return dict(row_mass=kernel_row_mass, placement=covering_rows, shares=kernel_shares)


def _fp64_shares(mass, tiles):
    """(kept, total) in fp64: each row's sum over the visited tiles (a NaN elsewhere left out) and over all."""
    m = mass.double()
    visit = tiles.unsqueeze(-2).expand(m.shape)
    kept = torch.where(visit, m, 0.0).sum(-1)
    return kept, m.sum(-1)


def _mass(g, b, h, nq, r, nk):
    x = torch.rand(b, h, nq, r, nk, generator=g).pow(3)
    return x / x.sum(-1, keepdim=True).clamp(min=1e-30)


# --- row_shares -----------------------------------------------------------------------------------------


def test_row_shares_kernel_on_odd_shapes_and_broadcast_selections(kernels):
    """One tile, one row, one query tile, 255 / 256 / 257 / 513 key tiles (the kernel's 256-wide blocks and
    their partial last one), selections broadcast in every dim (stride 0), transposed and offset into their
    storage: each row's sums equal an fp64 sum."""
    kernel = kernels["shares"]
    g = torch.Generator().manual_seed(11)
    for b, h, nq, r, nk in ((1, 1, 1, 1, 1), (1, 1, 1, 1, 255), (2, 1, 3, 1, 256), (1, 2, 1, 3, 257),
                            (2, 2, 3, 2, 513)):
        mass = _mass(g, b, h, nq, r, nk)
        before = mass.clone()
        full = torch.rand(b, h, nq, nk, generator=g) < 0.4
        storage = torch.rand(3, b, h, nq, nk, generator=g) < 0.4
        for tiles in (full, full[:1, :1], full[..., :1, :], full[..., :1], full[:, :1, :, :1], full[0, 0],
                      full[0, 0, 0], torch.ones((), dtype=torch.bool).expand(1, 1, 1, 1), storage[2],
                      full.transpose(-1, -2).contiguous().transpose(-1, -2)):
            kept, total = kernel(mass, tiles)
            want_kept, want_total = _fp64_shares(mass, tiles)
            assert kept.shape == total.shape == (b, h, nq, r) and kept.dtype == torch.float32
            torch.testing.assert_close(kept.double(), want_kept, rtol=0, atol=1e-6)
            torch.testing.assert_close(total.double(), want_total, rtol=0, atol=1e-6)
        assert torch.equal(mass, before)


def test_row_shares_kernel_on_empty_non_finite_and_left_to_the_reference(kernels):
    """Empty tensors (no batch entry, query tile, row or key tile): zero-filled sums of the right shape. A
    row with a NaN or Inf: NaN / Inf in its total, and in its kept sum only where a visited tile has it;
    a row of zeros sums to 0. fp16, fp64 and non-contiguous masses run the reference."""
    kernel = kernels["shares"]
    for shape in ((0, 2, 3, 2, 5), (1, 2, 0, 2, 5), (1, 2, 3, 0, 5), (1, 2, 3, 2, 0)):
        mass = torch.rand(shape)
        tiles = torch.ones(shape[0], shape[1], shape[2], shape[4], dtype=torch.bool)
        kept, total = kernel(mass, tiles)
        assert kept.shape == total.shape == shape[:4] and not kept.any() and not total.any()
    g = torch.Generator().manual_seed(12)
    mass = _mass(g, 1, 2, 2, 3, 300)
    mass[0, 0, 0, 0, 3] = math.nan  # on a visited tile
    mass[0, 0, 0, 1, 4] = math.nan  # on a tile not visited
    mass[0, 0, 1, 0, 299] = math.inf  # the last block's tile, visited
    mass[0, 1, 0, 2] = 0.0
    tiles = torch.zeros(1, 1, 2, 300, dtype=torch.bool)
    tiles[..., 3] = tiles[..., 299] = True
    kept, total = kernel(mass, tiles)
    want_kept, want_total = _fp64_shares(mass, tiles)
    torch.testing.assert_close(kept.double(), want_kept, rtol=0, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(total.double(), want_total, rtol=0, atol=1e-6, equal_nan=True)
    assert math.isnan(kept[0, 0, 0, 0]) and math.isfinite(kept[0, 0, 0, 1]) and math.isnan(total[0, 0, 0, 1])
    assert kept[0, 0, 1, 0] == math.inf and kept[0, 1, 0, 2] == 0 and total[0, 1, 0, 2] == 0
    base = _mass(g, 2, 2, 3, 2, 9)
    tiles = torch.rand(2, 2, 3, 9, generator=g) < 0.5
    for mass in (base.half(), base.double(), base.transpose(0, 1).contiguous().transpose(0, 1)):
        got, want = kernel(mass, tiles), row_shares(mass, tiles)
        for a, w in zip(got, want):
            assert a.dtype == w.dtype and torch.equal(a, w)


# --- the row-mass kernel's rows that are not finite -------------------------------------------------------


def test_row_mass_kernel_keeps_a_nan_row_nan_when_every_key_tile_has_a_masked_key(kernels):
    """A query row with a NaN has NaN mass on every key tile (the reference's, and the check's way of
    knowing the row is not finite), also when each of its key tiles holds a key the kernel masks: the
    padding of a single partial tile, or a key-padding mask with a dead key in every tile. The kernel's
    tile maximum skips the NaN logits there (the masked key's -inf wins), so the tile looked like one
    without a live key and the row's mass came out 0: a row that sees no key."""
    kernel = kernels["row_mass"]
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 4, 16, generator=g)
    q[0, 1, 2, 5] = math.nan
    rows = torch.arange(4)
    k = torch.randn(1, 2, 100, 16, generator=g)
    one_tile = kernel(q, k[:, :, :37], rows, key_tile=64)  # one partial tile
    dead = torch.ones(1, 1, 1, 100, dtype=torch.bool)
    dead[..., ::16] = False  # a dead key in every tile of 16
    masked = kernel(q, k, rows, key_tile=16, attn_mask=dead)
    for got, want in ((one_tile, row_block_mass(q, k[:, :, :37], rows, key_tile=64)),
                      (masked, row_block_mass(q, k, rows, key_tile=16, attn_mask=dead))):
        assert torch.isnan(want[0, 1, 2]).all() and torch.isfinite(want[0, 0]).all()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), "a NaN row's mass is not NaN"
        torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), rtol=0, atol=1e-6)


def test_the_gpu_check_marks_a_query_tile_with_a_nan_row_unknown_under_a_key_padding_mask(kernels):
    """The check on the GPU's kernels as on the reference's: a query tile whose checked row has a NaN
    query is unknown (its kept mass and bound NaN) and, with a floor, visits every key tile, also under a
    key-padding mask that leaves a dead key in every key tile."""
    g = torch.Generator().manual_seed(14)
    q, k = torch.randn(1, 1, 64, 16, generator=g), torch.randn(1, 1, 96, 16, generator=g)
    q[0, 0, 16, 3] = math.nan  # the first row of query tile 1: a checked row
    mask = torch.ones(1, 1, 1, 96, dtype=torch.bool)
    mask[..., 5::16] = False
    sel = BlockSelection(torch.eye(4, 6, dtype=torch.bool).view(1, 1, 4, 6), 64, 96, 16, 16)
    want = check_selection(sel, q, k, attn_mask=mask, floor=0.9, rows=2)
    got = check_selection(sel, q, k, attn_mask=mask, floor=0.9, rows=2, **kernels)
    assert torch.isnan(want.check.kept[0, 0, 1]) and want.tiles[0, 0, 1].all()
    for name in ("kept_before", "kept", "unseen"):
        assert torch.equal(torch.isnan(getattr(got.check, name)), torch.isnan(getattr(want.check, name))), name
    assert got.tiles[0, 0, 1].all(), "a query tile with a NaN row does not visit every key tile"


def test_the_gpu_check_equals_an_fp64_check_on_random_calls(kernels):
    """test_review_sparse_check's fp64 verification of every field, on the check that runs the GPU's
    three kernels (tiles of 16 and 32, the kernels' smallest), with NaN / Inf in Q or K and key-padding
    masks: random calls, seeded."""
    from test_review_sparse_check import random_call, verify_check

    check = functools.partial(check_selection, placement=kernels["placement"], shares=kernels["shares"])
    failed = []
    for seed in range(48):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        sel, q, k, options = random_call(rng, gen, batch=(1, 2), heads=(1, 2), dims=(8, 16), tiles=(16, 32),
                                         bad=0.4, row_masks=False)
        options["row_mass"] = kernels["row_mass"]
        try:
            verify_check(check, sel, q, k, options)
        except AssertionError:
            failed.append(seed)
    assert not failed, f"calls whose GPU check differs from the fp64 check: seeds {failed}"


# --- the check with the shares kernel, and the sinks' sample -------------------------------------------------


def test_the_check_with_the_shares_kernel_equals_the_reference_past_the_sinks_sample(kernels):
    """check_selection with the shares kernel and with the reference's: the same tiles and kept masses to
    fp32 rounding, with 71 query tiles (more than SINK_QUERY_TILES: the sinks' median reads a sample),
    sinks, floors, a key-padding mask, one checked row, and selections of no tile and of every tile."""
    g = torch.Generator().manual_seed(15)
    sq = 9000
    q, k = torch.randn(1, 2, sq, 16, generator=g) + 1, torch.randn(1, 2, sq, 16, generator=g)
    k[:, :, 7] = 3.0  # a key every query reads (logit ~12 against ~N(0, 1.4)): a sink
    nq = -(-sq // 128)
    assert nq > SINK_QUERY_TILES
    mask = torch.ones(1, 1, 1, sq, dtype=torch.bool)
    mask[..., -700:] = False
    shapes = (torch.rand(1, 2, nq, nq, generator=g) < 0.3, torch.zeros(1, 1, nq, nq, dtype=torch.bool),
              torch.ones(1, 1, nq, nq, dtype=torch.bool))
    cases = ((0, {}), (0, {"sinks": True}), (0, {"sinks": True, "floor": 0.9, "attn_mask": mask}),
             (0, {"sinks": True, "floor": 0.5, "rows": 1}), (1, {"sinks": True}), (2, {"sinks": True, "floor": 0.9}))
    for which, kw in cases:
        sel = BlockSelection(shapes[which], sq, sq)
        want = check_selection(sel, q, k, **kw)
        got = check_selection(sel, q, k, shares=kernels["shares"], **kw)
        assert torch.equal(got.tiles.expand(want.tiles.shape), want.tiles), kw
        if kw.get("sinks") and which == 1:
            assert want.tiles[..., 0].all()  # the sink's key tile: found through the sample
        for name in ("kept", "kept_before", "unseen"):
            a, w = getattr(got.check, name), getattr(want.check, name)
            assert torch.equal(torch.isnan(a), torch.isnan(w))
            torch.testing.assert_close(a, w, rtol=0, atol=1e-5, equal_nan=True)


def test_sink_query_tiles_take_one_tile_of_each_equal_run_for_every_tile_count():
    """For every tile count from 1 to 2,000: min(nq, SINK_QUERY_TILES) tiles, strictly increasing, in
    range, exactly one in each run [⌊i·nq/m⌋, ⌊(i+1)·nq/m⌋); every tile up to SINK_QUERY_TILES; the same
    tiles call after call; made on the device asked for (a meta tensor: nothing computed on the host)."""
    for nq in range(1, 2001):
        idx = sink_query_tiles(nq)
        m = min(nq, SINK_QUERY_TILES)
        assert idx.dtype == torch.int64 and idx.shape == (m,)
        edges = [i * nq // m for i in range(m + 1)]
        got = idx.tolist()
        assert all(edges[i] <= got[i] < edges[i + 1] for i in range(m)), nq
        if nq <= SINK_QUERY_TILES:
            assert got == list(range(nq))
    assert torch.equal(sink_query_tiles(591), sink_query_tiles(591))
    assert sink_query_tiles(591, "meta").device.type == "meta"
    block = torch.rand(2, 3, 591, 40, device="meta")
    assert sink_columns(block).shape == (2, 3, 40)


def test_sinks_of_many_query_tiles_are_the_median_of_the_sampled_tiles():
    """Past SINK_QUERY_TILES, sink_columns decides as the full rule does on the sampled query tiles
    alone: an fp64 median of those tiles, thresholds as documented (SINK_MASS, SINK_RATIO × the median
    key tile)."""
    from fp4video.sparse.check import SINK_MASS, SINK_RATIO

    g = torch.Generator().manual_seed(16)
    for nq in (65, 200, 591, 1337):
        block = torch.rand(2, 2, nq, 30, generator=g).pow(6)
        heavy = torch.rand(2, 2, nq, generator=g) < 0.5  # a column heavy for about half the query tiles
        block[..., 4] = torch.where(heavy, 0.5, 0.0)
        block = block / block.sum(-1, keepdim=True)
        m = SINK_QUERY_TILES
        # run i is [⌊i·nq/m⌋, ⌊(i+1)·nq/m⌋); its tile sits at the fraction frac(i·φ) of it
        idx = [i * nq // m + int((i * 0.6180339887498949 % 1) * ((i + 1) * nq // m - i * nq // m)) for i in range(m)]
        typical = block.double()[..., idx, :].median(dim=-2).values
        want = typical >= torch.clamp(typical.median(dim=-1, keepdim=True).values * SINK_RATIO, min=SINK_MASS)
        assert torch.equal(sink_columns(block), want)


# --- a peer standing in for SDPA inside compiled code --------------------------------------------------------


def test_a_peer_inside_compiled_code_is_restored_and_leaves_other_calls_right():
    """A function compiled while the peer stands in runs SDPA again after the block (dynamo's guards see
    the swap), one compiled before runs the peer inside it; calls the peer does not take (a mask, another
    dtype) keep SDPA's values under compile and are counted once per call; an error inside a compiled
    call restores SDPA."""
    import torch._dynamo

    marker = []

    def fn(q, k, v):
        marker.append(1)
        return torch.full_like(q, 7.0)  # recognisable: not attention

    def block(x, mask=None):
        y = x * 2
        return torch.nn.functional.scaled_dot_product_attention(y, y, y, attn_mask=mask) + 1

    x = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(17))
    dense = SDPA(x * 2, x * 2, x * 2) + 1
    peer = Peer("stand-in", "bf16", fn)
    opts = dict(dtypes=(torch.float32,), devices=("cpu",))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend="eager")
        with sdpa_replaced_by(peer, **opts) as route:
            inside = compiled(x)
        after = compiled(x)
        assert torch.equal(inside, torch.full_like(x, 8.0)) and torch.allclose(after, dense, atol=1e-6)
        assert route.routed == 1 and len(marker) == 1
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="eager")
        before = compiled(x)
        with sdpa_replaced_by(peer, **opts) as route:
            inside = compiled(x)
        assert torch.allclose(before, dense, atol=1e-6) and torch.equal(inside, torch.full_like(x, 8.0))
        mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
        mask[..., -2:] = False
        with sdpa_replaced_by(peer, **opts) as route:
            masked = [compiled(x, mask) for _ in range(3)]
            wide = [compiled(x.double()) for _ in range(2)]
        assert route.routed == 0 and dict(route.left) == {"with a mask": 3, "in torch.float64": 2}
        for out in masked:
            torch.testing.assert_close(out, SDPA(x * 2, x * 2, x * 2, attn_mask=mask) + 1, rtol=0, atol=1e-6)
        for out in wide:
            torch.testing.assert_close(out, dense.double(), rtol=0, atol=1e-6)

        def broken(q, k, v):
            raise RuntimeError("this build cannot run these shapes")

        with pytest.raises(RuntimeError, match="cannot run"):
            with sdpa_replaced_by(Peer("broken", "bf16", broken), **opts):
                compiled(x)
        assert torch.nn.functional.scaled_dot_product_attention is SDPA
        torch.testing.assert_close(compiled(x), dense, rtol=0, atol=1e-6)
    finally:
        torch._dynamo.reset()


# --- on the GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_row_mass_kernel_offsets_past_2_to_the_31_elements_gpu():
    """Rows × key tiles past 2³¹ (a check of a clip of ~300k tokens at 40 heads and 10 rows per tile):
    the last row's mass equals the reference's. The kernels' (row · tiles) offsets in int32 wrap there.
    Needs ~26 GiB of GPU memory; run it alone (a wrapped offset may write outside the buffers)."""
    from fp4video.kernels.row_mass import row_block_mass as kernel

    nk, n_rows = 1 << 16, (1 << 15) + 1  # (n_rows − 1) · nk = 2³¹
    g = torch.Generator().manual_seed(18)
    q = torch.randn(1, 1, n_rows, 16, generator=g).cuda()
    k = torch.randn(1, 1, nk * 16, 16, generator=g).cuda()
    rows = torch.arange(n_rows, device="cuda")
    got = kernel(q, k, rows, key_tile=16)[0, 0, -1].clone()
    torch.cuda.synchronize()
    want = row_block_mass(q, k, rows[-1:], key_tile=16)[0, 0, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.gpu
def test_row_shares_kernel_offsets_past_2_to_the_31_elements_gpu():
    """Rows × key tiles past 2³¹ in row_shares: its offsets are int64 (the last rows' sums right)."""
    from fp4video.kernels.row_mass import row_shares as kernel

    nk, rows = 1 << 16, (1 << 15) + 1
    mass = torch.full((1, 1, rows, 1, nk), 1.0 / nk, device="cuda")
    mass[0, 0, -1, 0, :100] = 1.0
    tiles = torch.zeros(1, 1, rows, nk, dtype=torch.bool, device="cuda")
    tiles[0, 0, -1, :50] = True
    kept, total = kernel(mass, tiles)
    assert float(kept[0, 0, -1, 0]) == 50.0 and abs(float(total[0, 0, -1, 0]) - (100 + (nk - 100) / nk)) < 1e-3
    assert float(kept[0, 0, 0, 0]) == 0.0 and abs(float(total[0, 0, 0, 0]) - 1.0) < 1e-4
