"""Every block-sparse call measures what it drops, and repairs it: sampled rows, the check's rows that
cover each tile's queries (k-center greedy against a brute force), their exact mass (reference
against fp64; the GPU kernel in the interpreter against the reference, row by row), the check's kept
mass against the exact kept mass of the same rows, its confidence bound (Student's t against scipy),
sinks, the floor's repair (the fewest tiles that bring the bound to the floor, against a brute
force), the top-k share, the sampled estimate, rules checked when built, scale invariance,
determinism, and no read-back while checking."""

from __future__ import annotations

import math

import pytest
import torch

from fp4video import fp4_attention
from fp4video.harness.video_heads import VideoGrid, exact_block_mass, selection_quality, video_heads
from fp4video.sparse import (
    BlockSelection,
    DynamicSparsity,
    HybridSparsity,
    StaticSparsity,
    check_selection,
    covering_rows,
    dynamic_selection,
    resolve_sparsity,
    row_block_mass,
    sample_rows,
    student_t_quantile,
)
from fp4video.sparse.check import CHECK_CONFIDENCE, CHECK_ROWS, row_shares

GRID = VideoGrid(4, 16, 32, text=32)  # 2,080 tokens: 17 query tiles


@pytest.fixture(scope="module")
def heads():
    return video_heads(GRID, seed=0)


@pytest.fixture(scope="module")
def rows_mass(heads):
    q, k, _ = heads
    return exact_block_mass(q, k)


def _fp64_row_mass(q, k, rows, mask=None, key_tile=128):
    """Independent: the full fp64 softmax of every row, then the sampled rows' tile sums."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    nk = -(-k.shape[2] // key_tile)
    p = torch.nn.functional.pad(p, (0, nk * key_tile - k.shape[2]))
    tiles = p.reshape(*p.shape[:-1], nk, key_tile).sum(-1)
    return tiles[:, :, rows.reshape(-1)].reshape(*p.shape[:2], *rows.shape, nk)


# --- sampled rows --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,per_tile", [(300, 2), (128, 4), (1000, 3), (5, 2), (129, 8)])
def test_sample_rows_one_per_stratum_of_each_tile(sq, per_tile):
    rows = sample_rows(sq, 128, per_tile, seed=7)
    nq = -(-sq // 128)
    assert rows.shape == (nq, per_tile) and rows.dtype == torch.int64
    for i in range(nq):
        length = min(128, sq - i * 128)
        for j in range(per_tile):
            lo, hi = j * length // per_tile, (j + 1) * length // per_tile
            r = int(rows[i, j]) - i * 128
            assert 0 <= r < length and (lo <= r < max(hi, lo + 1) or length < per_tile), (i, j, r, lo, hi)
    assert torch.equal(rows, sample_rows(sq, 128, per_tile, seed=7))  # fixed per seed


def test_sample_rows_move_with_the_seed():
    assert not torch.equal(sample_rows(4096, 128, 2, seed=0), sample_rows(4096, 128, 2, seed=1))


# --- exact mass of sampled rows ------------------------------------------------------------------------


def test_row_block_mass_equals_fp64_softmax_with_masks_and_dead_rows():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 300, 64, generator=g) * 2, torch.randn(2, 3, 333, 64, generator=g) * 2
    rows = sample_rows(300, 128, 3, seed=1)
    mask = torch.rand(2, 1, 300, 333, generator=g) > 0.3
    mask[1, :, rows[1, 0]] = False  # a sampled row that sees no key: zeros
    got = row_block_mass(q, k, rows, attn_mask=mask, rows_at_once=5)
    want = _fp64_row_mass(q, k, rows, mask)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    assert got[1, :, 1, 0].abs().max() == 0
    torch.testing.assert_close(got.sum(-1)[0], torch.ones_like(got.sum(-1)[0]), rtol=0, atol=1e-5)


def test_row_block_mass_is_nan_for_rows_with_an_infinite_logit():
    q, k = torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32)
    k[0, 1, 5] = math.inf
    got = row_block_mass(q, k, sample_rows(200, 128, 2))
    assert torch.isnan(got[0, 1]).all() and torch.isfinite(got[0, 0]).all()


@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_row_mass_kernel_equals_the_reference_per_row(d, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fp4video.kernels.row_mass import row_block_mass as kernel

    g = torch.Generator().manual_seed(d)
    q, k = torch.randn(2, 2, 333, d, generator=g) * 3, torch.randn(2, 2, 300, d, generator=g) * 3
    rows = sample_rows(333, 128, 2, seed=d)
    pad = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    pad[1, ..., 170:] = False
    pad[0, ..., :] = False  # batch entry 0 sees no key: zeros
    for mask in (None, pad):
        want = row_block_mass(q, k, rows, attn_mask=mask)
        # the launch settings a tuning sweep tries, and key tiles split over 2 or 3 programs (the
        # partial last tile in a program of its own, or after a whole one): the same values
        for block_r, splits in ((None, None), (64, None), (128, None), (64, 2), (128, 3), (64, 9)):
            got = kernel(q, k, rows, attn_mask=mask, block_r=block_r, splits=splits)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="block_r must be 64 or 128"):
        kernel(q, k, rows, block_r=32)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        kernel(q, k, rows, splits=0)
    k[1, 0, 3] = math.nan
    got = kernel(q, k, rows)
    assert torch.isnan(got[1, 0]).all() and torch.isfinite(got[0]).all() and torch.isfinite(got[1, 1]).all()


def _shares_inputs(g, b=2, h=3, nq=5, r=3, nk=300):
    """Rows' masses (softmax-like, some rows NaN or empty) and a selection with broadcast dims."""
    mass = torch.rand(b, h, nq, r, nk, generator=g).pow(4)
    mass = mass / mass.sum(-1, keepdim=True)
    mass[0, 1, 2, 1] = 0.0  # a row that sees no key
    mass[1, 0, 3, 0, min(7, nk - 1)] = math.nan  # a row that is not finite
    tiles = torch.rand(1, h, nq, nk, generator=g) < 0.3
    return mass, tiles


def test_row_shares_kernel_equals_the_reference_per_row(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fp4video.kernels.row_mass import row_shares as kernel

    g = torch.Generator().manual_seed(5)
    for nk in (1, 37, 300, 700):  # one tile, one partial block of tiles, several blocks
        mass, tiles = _shares_inputs(g, nk=nk)
        before = mass.clone()
        for t in (tiles, tiles.expand(2, 3, 5, nk), tiles[:, :1], torch.ones(1, 1, 1, 1, dtype=torch.bool)):
            kept, total = kernel(mass, t)
            want_kept, want_total = row_shares(mass, t)
            # per row, NaN where the reference's is (the NaN row's tile 7 is visited or not)
            torch.testing.assert_close(kept, want_kept, rtol=0, atol=1e-6, equal_nan=True)
            torch.testing.assert_close(total, want_total, rtol=0, atol=1e-6, equal_nan=True)
        assert torch.equal(mass.nan_to_num(-1), before.nan_to_num(-1))  # the caller's tensor untouched
    # the reference itself: each row's sum over its visited tiles, in fp64
    mass, tiles = _shares_inputs(g)
    kept, total = row_shares(mass, tiles)
    m64 = mass.double()
    want = (m64 * tiles.unsqueeze(-2)).nan_to_num(0).sum(-1)
    finite = torch.isfinite(m64).all(-1)
    torch.testing.assert_close(kept[finite].double(), want[finite], rtol=0, atol=1e-6)
    assert torch.isnan(total[~finite]).all() and (total[0, 1, 2, 1] == 0)


def test_the_check_with_the_shares_kernel_equals_the_reference_check(heads, monkeypatch):
    """check_selection with the GPU's row_shares (in the interpreter) measures and repairs as with the
    reference's: the same tiles, kept masses to fp32 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fp4video.kernels.row_mass import row_shares as kernel

    q, k, _ = heads
    nq = nk = -(-q.shape[2] // 128)
    sel = BlockSelection(torch.rand(1, q.shape[1], nq, nk, generator=torch.Generator().manual_seed(4)) < 0.3,
                         q.shape[2], k.shape[2])
    for kw in ({}, {"sinks": True}, {"sinks": True, "floor": 0.9}):
        want = check_selection(sel, q, k, **kw)
        got = check_selection(sel, q, k, shares=kernel, **kw)
        assert torch.equal(got.tiles, want.tiles)
        for name in ("kept", "kept_before", "unseen"):
            torch.testing.assert_close(getattr(got.check, name), getattr(want.check, name), rtol=0, atol=1e-5)


# --- the check ------------------------------------------------------------------------------------------
# --- the check ------------------------------------------------------------------------------------------


def _checked_rows_mass(rows_mass, sampled):
    """(B, H, nq, r, nk): the exact fp64 mass of the check's rows ``sampled`` (B, H, nq, r), per head."""
    b, h, _, nk = rows_mass.shape
    flat = sampled.reshape(b, h, -1, 1).expand(b, h, sampled[0, 0].numel(), nk)
    return rows_mass.gather(2, flat).reshape(*sampled.shape, nk)


def _tile_mean_kept(rows_mass, tiles, query_tile=128):
    """(B, H, nq) fp64: each query tile's mean over ALL its rows of their exact kept mass."""
    b, h, sq, _ = rows_mass.shape
    t = tiles.expand(b, h, *tiles.shape[2:])
    kept = (rows_mass * t.repeat_interleave(query_tile, dim=2)[:, :, :sq]).sum(-1)
    nq = t.shape[2]
    pad = torch.nn.functional.pad(kept, (0, nq * query_tile - sq), value=math.nan)
    return pad.reshape(b, h, nq, query_tile).nanmean(-1)


def test_check_measures_the_exact_kept_mass_of_its_rows(heads, rows_mass):
    """The check's kept mass per query tile is the weighted mean of its rows' exact (fp64) kept shares;
    with every row of a tile read, the exact mean over the tile, and its bound is that mean."""
    q, k, _ = heads
    sel = dynamic_selection(q, k, tau=0.5, estimate="sampled")
    checked = check_selection(sel, q, k, rows=3)
    check = checked.check
    assert check.sampled.shape == check.weight.shape == (1, q.shape[1], sel.n_query_tiles, 3)
    exact = _checked_rows_mass(rows_mass, check.sampled)
    want = ((exact * sel.tiles.unsqueeze(-2)).sum(-1) * check.weight.double()).sum(-1)
    torch.testing.assert_close(check.kept.double(), want, rtol=0, atol=1e-5)
    assert (check.unseen <= check.kept + 1e-6).all()
    assert torch.equal(checked.tiles, sel.tiles)  # no floor, no sinks: measured only
    dense = check_selection(BlockSelection.dense(q.shape[2], k.shape[2], device=q.device), q, k)
    assert torch.allclose(dense.check.kept, torch.ones(()), atol=1e-5)
    every = check_selection(sel, q, k, rows=128).check
    truth = _tile_mean_kept(rows_mass, sel.tiles)
    torch.testing.assert_close(every.kept.double(), truth, rtol=0, atol=1e-5)
    torch.testing.assert_close(every.unseen, every.kept, rtol=0, atol=0)  # every row read: no doubt left


def test_the_checks_bound_is_the_weighted_mean_less_students_t_spread(heads, rows_mass):
    """unseen = max(0, m − t·s·√((1 − n/L)/n)) with m, s the weighted mean and standard deviation (n/(n−1)) of
    the checked rows' exact kept shares, t Student's CHECK_CONFIDENCE quantile (n − 1 degrees of
    freedom); with one row, the row's share."""
    q, k, _ = heads
    sel = dynamic_selection(q, k, tau=0.6, estimate="sampled")
    for rows in (1, 4, 8):
        check = check_selection(sel, q, k, rows=rows).check
        kept = (_checked_rows_mass(rows_mass, check.sampled) * sel.tiles.unsqueeze(-2)).sum(-1)
        w = check.weight.double()
        m = (kept * w).sum(-1)
        length = torch.tensor([min(128, q.shape[2] - i * 128) for i in range(sel.n_query_tiles)], dtype=torch.float64)
        n = length.clamp(max=rows)
        if rows == 1:
            want = m
        else:
            s = ((kept - m.unsqueeze(-1)) ** 2 * w).sum(-1) * rows / (rows - 1)
            t = student_t_quantile(CHECK_CONFIDENCE, rows - 1)
            want = (m - t * s.sqrt() * ((1 - n / length).clamp(min=0) / n).sqrt()).clamp(min=0)
        torch.testing.assert_close(check.unseen.double(), want, rtol=0, atol=2e-5)


def test_student_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for dof in (1, 2, 3, 4, 7, 8, 15, 63, 127):
        for p in (0.5, 0.9, 0.95, 0.99, 0.999):
            assert abs(student_t_quantile(p, dof) - float(stats.t.ppf(p, dof))) <= 1e-9 * max(1.0, stats.t.ppf(p, dof))
    for bad in ((0.3, 3), (1.0, 3), (0.9, 0), (0.9, 2.5), (0.9, True)):
        with pytest.raises(ValueError, match="student_t_quantile"):
            student_t_quantile(*bad)


# --- the check's rows: k-center greedy over each tile's queries ------------------------------------------


def _greedy_reference(x, per_tile):
    """Independent k-center greedy on one tile's queries x (L, D), fp64, by full pairwise distances."""
    x = x.double()
    dist = torch.cdist(x, x)
    n = x.shape[0]
    if per_tile == 1:
        return [int((x - x.mean(0)).norm(dim=-1).argmin())]
    chosen = [0, n - 1][:per_tile] if n > 1 else [0, 0][:per_tile]
    while len(chosen) < per_tile:
        nearest = dist[:, chosen].min(dim=1).values
        nearest[chosen] = -1
        chosen.append(int(nearest.argmax()) if len(set(chosen)) < n else 0)
    return chosen


@pytest.mark.parametrize("sq,per_tile", [(300, 8), (128, 4), (256, 1), (133, 2), (261, 8)])
def test_covering_rows_are_k_center_greedy_per_tile_and_head(sq, per_tile):
    """First and last row of the tile, then each the row farthest from all chosen (brute force, fp64);
    weights: the share of the tile's rows nearest to each chosen row; a short tile repeats rows that
    weigh 0; different heads get their own rows; the same rows on every call."""
    g = torch.Generator().manual_seed(sq + per_tile)
    q = torch.randn(2, 3, sq, 16, generator=g)
    rows, weight = covering_rows(q, 128, per_tile)
    nq = -(-sq // 128)
    assert rows.shape == weight.shape == (2, 3, nq, per_tile) and rows.dtype == torch.int64
    for b in range(2):
        for h in range(3):
            for i in range(nq):
                lo, hi = i * 128, min(sq, (i + 1) * 128)
                x = q[b, h, lo:hi]
                want = _greedy_reference(x, per_tile)
                assert (rows[b, h, i] - lo).tolist() == want, (b, h, i)
                owner = torch.cdist(x.double(), x[want].double()).argmin(dim=1)
                share = torch.bincount(owner, minlength=per_tile).double() / (hi - lo)
                torch.testing.assert_close(weight[b, h, i].double(), share, rtol=0, atol=1e-6)
    if per_tile > 2:  # (two rows are the ends of every tile)
        assert not torch.equal(rows[0, 0], rows[0, 1])  # per head
    again = covering_rows(q, 128, per_tile)
    assert torch.equal(again[0], rows) and torch.equal(again[1], weight)
    short = covering_rows(q[:, :, :5], 128, 8)
    assert sorted(set(short[0][0, 0, 0].tolist())) == [0, 1, 2, 3, 4]
    torch.testing.assert_close(short[1].sum(-1), torch.ones(2, 3, 1))


def test_covering_rows_choose_a_row_whose_query_is_not_finite():
    q = torch.randn(1, 2, 256, 8)
    q[0, 1, 77] = math.nan
    q[0, 0, 200] = math.inf
    rows, weight = covering_rows(q, 128, 3)
    assert 77 in rows[0, 1, 0].tolist() and 200 in rows[0, 0, 1].tolist()
    assert torch.isfinite(weight).all()
    sel = check_selection(BlockSelection(torch.zeros(1, 1, 2, 2, dtype=torch.bool), 256, 256), q, torch.randn(1, 2, 256, 8),
                          floor=0.9)
    assert sel.tiles[0, 1, 0].all() and sel.tiles[0, 0, 1].all()  # the tile visits every key tile


def test_repair_brings_every_tiles_bound_to_the_floor_with_the_fewest_tiles(heads, rows_mass):
    """A window drops mass; the repair adds, per query tile, the shortest prefix of the key tiles it
    does not visit in descending weighted mass of its checked rows after which the bound reaches the
    floor (an independent fp64 search over prefixes); every tile's bound and estimate then reach it,
    and on these inputs so does the exact mean of every row of each tile."""
    q, k, _ = heads
    for floor in (0.5, 0.9, 0.99):
        rule = StaticSparsity(GRID.frames, GRID.height, GRID.width, window=(0, 2, 4), text_tokens=GRID.text,
                              text_position="last", floor=floor)
        sel = resolve_sparsity(rule, q, k)
        check = sel.check
        assert check.unseen.min() >= floor - 1e-6 and check.kept.min() >= floor - 1e-6
        assert check.kept_before.min() < floor  # the window alone drops mass here
        assert bool(check.repaired.any()) and float(sel.density()) > float(check.density_before)
        assert _tile_mean_kept(rows_mass, sel.tiles).min() >= floor, floor
        window = rule.select(q, k).tiles.expand_as(sel.tiles)
        mass = _checked_rows_mass(rows_mass, check.sampled)  # (1, H, nq, r, nk) fp64
        w = check.weight.double()
        r = check.rows
        t = student_t_quantile(CHECK_CONFIDENCE, r - 1)
        for h in range(q.shape[1]):
            for i in range(sel.n_query_tiles):
                length = min(128, q.shape[2] - i * 128)
                share = mass[0, h, i]
                order = torch.where(window[0, h, i], -1.0, (share * w[0, h, i, :, None]).sum(0)).argsort(
                    descending=True, stable=True)
                free = [int(j) for j in order if not window[0, h, i, j]]
                for count in range(len(free) + 1):
                    tiles = window[0, h, i].clone()
                    tiles[free[:count]] = True
                    kept = (share * tiles).sum(-1)
                    m = float((kept * w[0, h, i]).sum())
                    s = float((((kept - m) ** 2) * w[0, h, i]).sum() * r / (r - 1))
                    if m - t * math.sqrt(s * max(0.0, 1 - r / length) / r) >= floor:
                        break
                want = window[0, h, i].clone()
                want[free[:count]] = True
                # a prefix at the very edge of the floor may round either way in fp32
                assert torch.equal(sel.tiles[0, h, i], want) or abs(m - floor) < 1e-4, (floor, h, i)


def test_the_check_is_deterministic(heads):
    q, k, _ = heads
    rule = DynamicSparsity(0.8, estimate="sampled", sinks=True, floor=0.9)
    a, b = resolve_sparsity(rule, q, k), resolve_sparsity(rule, q, k)
    assert torch.equal(a.tiles, b.tiles) and torch.equal(a.check.sampled, b.check.sampled)
    assert torch.equal(a.check.kept, b.check.kept) and torch.equal(a.check.unseen, b.check.unseen)


def test_sinks_are_found_and_kept_by_every_query_tile(heads, rows_mass):
    q, k, _ = heads
    h = 3  # the sinks head
    window = dict(frames=GRID.frames, height=GRID.height, width=GRID.width, window=(0, 2, 4), text_tokens=GRID.text,
                  text_position="last")
    plain = resolve_sparsity(StaticSparsity(**window), q[:, h:h + 1], k[:, h:h + 1])
    with_sinks = resolve_sparsity(StaticSparsity(**window, sinks=True), q[:, h:h + 1], k[:, h:h + 1])
    a = selection_quality(rows_mass[:, h:h + 1], plain.tiles)
    b = selection_quality(rows_mass[:, h:h + 1], with_sinks.tiles)
    assert b["row_min"] > a["row_min"] + 0.2 and b["kept_min"] > 0.95 > a["kept_min"]
    added = with_sinks.tiles & ~plain.tiles.expand_as(with_sinks.tiles)
    assert added.any(dim=-2).sum() <= 2  # whole columns: the sink keys' tiles
    # a spatial head has no sinks: nothing is added
    spatial = resolve_sparsity(StaticSparsity(**window, sinks=True), q[:, :1], k[:, :1])
    assert torch.equal(spatial.tiles.expand(1, 1, -1, -1), plain.tiles.expand(1, 1, -1, -1))


def test_sinks_of_many_query_tiles_come_from_an_even_sample_of_them():
    """With more query tiles than SINK_QUERY_TILES the median reads one from each equal run of them:
    a key tile heavy for 80% of the query tiles is a sink and one heavy for 20% is not, also when the
    heavy tiles come with a period that divides the runs' length (a strided sample would see only one
    phase); up to SINK_QUERY_TILES query tiles, the median of all of them decides (here, one more heavy
    tile tips it)."""
    from fp4video.sparse.check import SINK_QUERY_TILES, sink_columns, sink_query_tiles

    for nq in (65, 100, 591, 5 * SINK_QUERY_TILES):
        idx = sink_query_tiles(nq)
        assert idx.numel() == SINK_QUERY_TILES and (idx.diff() > 0).all() and 0 <= idx[0] and idx[-1] < nq
        run = nq / SINK_QUERY_TILES  # one index in each run
        assert ((idx >= (torch.arange(SINK_QUERY_TILES) * run).floor()) &
                (idx < (torch.arange(1, SINK_QUERY_TILES + 1) * run).ceil())).all()
    assert torch.equal(sink_query_tiles(40), torch.arange(40))
    for nq in (500, 591, 5 * SINK_QUERY_TILES, 10 * SINK_QUERY_TILES):
        q = torch.arange(nq)
        block = torch.full((2, nq, 40), 0.5 / 38)
        block[0, :, 5] = torch.where(q % 5 != 0, 0.3, 0.0)  # heavy on 80% of query tiles
        block[0, :, 9] = torch.where(q % 5 == 0, 0.3, 0.0)  # heavy on 20%
        block = block / block.sum(-1, keepdim=True)
        sinks = sink_columns(block)
        assert sinks[0].nonzero().flatten().tolist() == [5] and not sinks[1].any()
    nq = SINK_QUERY_TILES
    block = torch.full((1, nq, 10), 0.01)
    block[0, : nq // 2 + 1, 3] = 0.5  # heavy on one more than half: the median is heavy
    assert sink_columns(block)[0].nonzero().flatten().tolist() == [3]
    block[0, nq // 2, 3] = 0.01  # on exactly half: torch's median (the lower middle) is not
    assert not sink_columns(block).any()


def test_topk_keeps_at_least_its_share_and_a_superset():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1024, 64, generator=g), torch.randn(1, 2, 1024, 64, generator=g)
    base = dynamic_selection(q, k, tau=None, topk=0.25, estimate="sampled", neighbours=None)
    assert (base.tiles.sum(-1) >= 2).all()
    more = dynamic_selection(q, k, tau=0.5, topk=0.25, estimate="sampled", neighbours=None)
    assert (more.tiles | ~base.tiles).all()


def test_sampled_estimate_is_near_the_oracle_on_spatial_and_temporal_heads(heads, rows_mass):
    q, k, _ = heads
    sel = dynamic_selection(q[:, :2], k[:, :2], tau=0.9, estimate="sampled")
    quality = selection_quality(rows_mass[:, :2], sel.tiles)
    assert quality["density"] < 0.5 and quality["efficiency"] >= 0.95


def test_covering_estimate_is_the_weighted_exact_mass_of_the_placed_rows(heads, rows_mass):
    """estimate="covering": each head's covering rows (the check's placement), their exact mass per key
    tile in fp64, weighted by the rows each stands for, normalized: the selection is the cumulative
    rule on that estimate (computed here independently of the package's row mass)."""
    from fp4video.sparse.dynamic import always_kept, cumulative_take

    q, k, _ = heads
    for rows, tau in ((4, 0.9), (3, 0.7), (1, 0.95)):
        sel = dynamic_selection(q, k, tau=tau, estimate="covering", estimate_rows=rows)
        index, weight = covering_rows(q, 128, rows)
        mass = _checked_rows_mass(rows_mass, index)  # fp64, each head's own rows
        block = (mass * weight.double().unsqueeze(-1)).sum(-2)
        block = block / block.sum(-1, keepdim=True)
        forced = always_kept(q.shape[2], k.shape[2], 128, 128, 0, (), 0, q.device)
        want = cumulative_take(block.float(), forced.expand(*block.shape), tau) | forced
        assert torch.equal(sel.tiles, want), (rows, tau)
    # a query tile with a NaN query is unknown: it keeps every key tile, the others are unchanged
    q2 = q.clone()
    q2[0, 1, 300] = math.nan
    sel2 = dynamic_selection(q2, k, tau=0.9, estimate="covering")
    base = dynamic_selection(q, k, tau=0.9, estimate="covering")
    assert sel2.tiles[0, 1, 300 // 128].all()
    others = torch.ones(sel2.tiles.shape[:3], dtype=torch.bool)
    others[0, 1, 300 // 128] = False
    assert torch.equal(sel2.tiles[others], base.tiles[others])


def test_covering_estimate_keeps_content_heads_worst_rows_where_strata_rows_miss_them(heads, rows_mass):
    """On a content head (tokens attend to their object anywhere in the clip, several objects in a
    query tile) rows placed on the queries see each object; rows placed by position can miss one.
    At τ 0.9 the covering estimate visits fewer tiles than the strata rows' at τ 0.95 and keeps more
    of the worst row's and the worst tile's exact mass; on spatial and temporal heads it keeps as much."""
    from fp4video.harness.video_heads import HEAD_KINDS

    q, k, _ = heads
    covering = dynamic_selection(q, k, tau=0.9, estimate="covering").tiles
    strata = dynamic_selection(q, k, tau=0.95, estimate="sampled").tiles
    c = HEAD_KINDS.index("content")
    got = selection_quality(rows_mass[:, c:c + 1], covering[:, c:c + 1])
    other = selection_quality(rows_mass[:, c:c + 1], strata[:, c:c + 1])
    assert got["density"] < other["density"]
    assert got["row_min"] > other["row_min"] + 0.1 and got["kept_min"] > other["kept_min"] + 0.02
    for kind in ("spatial", "temporal"):
        i = HEAD_KINDS.index(kind)
        at_tau = selection_quality(rows_mass[:, i:i + 1], dynamic_selection(q, k, tau=0.9, estimate="sampled").tiles[:, i:i + 1])
        mine = selection_quality(rows_mass[:, i:i + 1], covering[:, i:i + 1])
        assert mine["row_min"] >= at_tau["row_min"] - 1e-6 and mine["efficiency"] >= 0.95


def test_a_rule_reads_the_estimate_and_the_check_through_the_callers_placement(heads):
    """resolve_sparsity hands its placement (the GPU's kernel on a GPU) to the covering estimate as
    well as to the check: one placement per call site, no silent fall back to the reference."""
    q, k, _ = heads
    asked = []

    def placement(q_, tile, per_tile):
        asked.append(per_tile)
        return covering_rows(q_, tile, per_tile)

    rule = DynamicSparsity(tau=0.9, estimate="covering", estimate_rows=3, floor=0.9)
    sel = resolve_sparsity(rule, q, k, placement=placement)
    assert asked == [3, CHECK_ROWS]
    assert torch.equal(sel.tiles, resolve_sparsity(rule, q, k).tiles)


def test_hybrid_visits_what_either_rule_keeps(heads):
    q, k, _ = heads
    static = StaticSparsity(GRID.frames, GRID.height, GRID.width, window=(0, 2, 4), text_tokens=GRID.text,
                            text_position="last")
    dynamic = DynamicSparsity(tau=0.8, estimate="sampled")
    hybrid = resolve_sparsity(HybridSparsity(static=static, dynamic=dynamic), q, k)
    a, b = resolve_sparsity(static, q, k), resolve_sparsity(dynamic, q, k)
    assert torch.equal(hybrid.tiles, a.tiles | b.tiles)


def test_a_call_runs_the_repaired_selection(heads):
    """fp4_attention with a rule is the reference over the checked (repaired) selection."""
    q, k, v = (t[:, :2, :1024] for t in heads)
    rule = DynamicSparsity(tau=0.5, estimate="sampled", floor=0.95)
    sel = resolve_sparsity(rule, q, k)
    assert sel.check is not None
    a = fp4_attention(q, k, v, method="fp16", backend="reference", sparsity=rule)
    b = fp4_attention(q, k, v, method="fp16", backend="reference", sparsity=sel)
    assert torch.equal(a, b)


# --- regressions ------------------------------------------------------------------------------------------


def test_dynamic_selection_coherence_is_scale_invariant():
    """Tiles' self-similarity once depended on scale: Q/K at 1e-25 (fp32 squares underflow) counted as
    coherent and selected where the same inputs at 1 kept every tile."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1024, 64, generator=g), torch.randn(1, 2, 1024, 64, generator=g)
    for s in (1e-38, 1e-30, 1e-25, 1e-20, 1e-15, 1.0, 1e15):
        assert float(dynamic_selection(q * s, k * s, tau=0.5).density()) == 1.0, s  # random: never coherent
    from test_sparse import local_inputs

    q, k = local_inputs(n=1024, heads=2, width=16.0)
    want = dynamic_selection(q, k, tau=0.5)
    assert float(want.density()) < 1
    for s in (2.0**-100, 2.0**-60, 2.0**40):  # the same logits at another magnitude: the same tiles
        got = dynamic_selection(q * s, k * s, tau=0.5, scale=1 / (8 * s * s))
        assert torch.equal(got.tiles, want.tiles), s


@pytest.mark.parametrize("bad", [dict(neighbours=-1), dict(sink_tiles=-2), dict(min_similarity=math.nan),
                                 dict(query_tile=0), dict(key_tile=-128), dict(topk=1.5), dict(estimate="pooledd"),
                                 dict(floor=-0.1), dict(floor=math.nan), dict(sinks=1), dict(check_rows=0),
                                 dict(tau=None), dict(tau=True), dict(estimate_rows=0), dict(seed=-1)])
def test_dynamic_sparsity_checks_every_option_when_built(bad):
    """Options once waited for the first call to fail (neighbours=-1, sink_tiles=-2, min_similarity=nan,
    query_tile=0)."""
    args = {"tau": 0.9, **bad}
    name = next(iter(bad)) if next(iter(bad)) != "check_rows" else "check_rows"
    with pytest.raises(ValueError, match=name if name != "tau" or bad["tau"] is not None else "tau"):
        DynamicSparsity(**args)


def test_checking_reads_nothing_back(heads, monkeypatch):
    q, k, _ = heads
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **kw: (_ for _ in ()).throw(AssertionError("read-back")))
    for rule in (DynamicSparsity(0.9, floor=0.9, sinks=True), DynamicSparsity(0.9, topk=0.1, estimate="sampled",
                                                                             floor=0.8),
                 StaticSparsity(GRID.frames, GRID.height, GRID.width, text_tokens=GRID.text, text_position="last",
                                sinks=True, floor=0.9)):
        sel = resolve_sparsity(rule, q, k)
        sel.check.summary()


# --- on the GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_mass_kernel_equals_the_reference_gpu(dtype):
    from fp4video.kernels.row_mass import row_block_mass as kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 9000, 128, device="cuda", generator=g).to(dtype) * 2
    k = torch.randn(1, 8, 9100, 128, device="cuda", generator=g).to(dtype) * 2
    rows = sample_rows(9000, 128, 2, seed=3, device="cuda")
    pad = torch.ones(1, 1, 1, 9100, dtype=torch.bool, device="cuda")
    pad[..., 8000:] = False
    for mask in (None, pad):
        want = row_block_mass(q, k, rows, attn_mask=mask)
        for splits in (None, 1, 5, 71):  # the default, one program per row block, and uneven shares
            out = kernel(q, k, rows, attn_mask=mask, splits=splits)  # its tile statistics start
            assert torch.isfinite(out).all()  # uninitialized: a tile not written shows as garbage here or below
            torch.testing.assert_close(out, want, rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-5)


@pytest.mark.gpu
def test_row_shares_kernel_equals_the_reference_gpu():
    from fp4video.kernels.row_mass import row_shares as kernel

    g = torch.Generator().manual_seed(6)
    mass, tiles = _shares_inputs(g, b=2, h=40, nq=591, r=2, nk=591)  # Wan 720p's tiles, two batch entries
    mass, tiles = mass.cuda(), tiles.cuda()
    for t in (tiles, tiles.expand(2, 40, 591, 591).contiguous()):
        for got, want in zip(kernel(mass, t), row_shares(mass, t)):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6, equal_nan=True)


@pytest.mark.gpu
def test_checked_repaired_call_captures_in_a_cuda_graph_gpu():
    """The check, sinks and the repair are tensor operations: a graph captures the call with them."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 4, 4096, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    from test_sparse_loops import assert_graph_replays_eager

    rule = DynamicSparsity(tau=0.5, topk=0.1, estimate="sampled", sinks=True, floor=0.9)
    assert_graph_replays_eager(lambda: fp4_attention(q, k, v, method="mxattn-pv8", sparsity=rule, backend="triton"))


def test_a_check_without_a_floor_reads_fewer_rows_by_default(heads):
    """The rows a check reads: 10 per tile with a floor (its bound narrows with rows), 2 without
    (measuring and finding sinks repairs nothing), a given number as given; the same through
    check_selection, each rule and a policy's sparsity (null)."""
    from fp4video.integration.policy import Sparsity
    from fp4video.sparse import MEASURE_ROWS, StaticSparsity, check_rows_for

    assert (check_rows_for(None, None), check_rows_for(0.9, None), check_rows_for(None, 5)) == (MEASURE_ROWS, CHECK_ROWS, 5)
    assert check_rows_for(0.0, None) == MEASURE_ROWS  # a floor of 0 repairs nothing
    q, k, _ = heads
    sel = dynamic_selection(q, k, tau=0.5)
    assert check_selection(sel, q, k).check.rows == MEASURE_ROWS
    assert check_selection(sel, q, k, floor=0.9).check.rows == CHECK_ROWS
    assert check_selection(sel, q, k, rows=3).check.sampled.shape[-1] == 3
    assert DynamicSparsity(0.9).check_rows == MEASURE_ROWS
    assert DynamicSparsity(0.9, floor=0.9).check_rows == CHECK_ROWS
    assert StaticSparsity(frames=2, height=4, width=4, sinks=True).check_rows == MEASURE_ROWS
    assert DynamicSparsity(0.9, floor=0.9, check_rows=4).check_rows == 4
    assert Sparsity.model_validate({"dynamic": {"tau": 0.9}}).check_rows is None  # resolved by the rule it builds


def test_the_bound_is_never_negative_with_few_rows(heads):
    """With 2 rows the 99% Student-t quantile is 31.8 and the bound fell to −1.07 on a GPU run's
    summary: a share of attention mass is at least 0, so the bound is too."""
    q, k, _ = heads
    sel = dynamic_selection(q, k, tau=0.3)
    check = check_selection(sel, q, k, rows=2).check
    assert (check.unseen >= 0).all() and (check.unseen <= check.kept + 1e-6).all()
    assert check.summary()["unseen_min"] >= 0


def test_an_fp64_call_is_checked_like_any_other():
    """fp64 Q and K (a reference run) stopped in the check's row placement (torch's vector_norm
    refuses to narrow fp64 to fp32); they are checked as fp32 ones are."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g)
    rows32, weight32 = covering_rows(q, 128, 4)
    rows64, weight64 = covering_rows(q.double(), 128, 4)
    assert torch.equal(rows64, rows32) and torch.equal(weight64, weight32)
    sel = dynamic_selection(q, k, tau=0.5)
    want = check_selection(sel, q, k, floor=0.9).check.summary()
    got = check_selection(sel, q.double(), k.double(), floor=0.9).check.summary()
    assert abs(float(got["kept_min"]) - float(want["kept_min"])) < 1e-5
