"""check_selection on many small random calls against an independent fp64 computation of what it
measures: batch entries and heads (a broadcast (1, 1, nq, nk) selection and a full one), key-padding
masks that hide every key of a batch entry, per-row masks, NaN and Inf in Q or K, no floor and floors
of 0.5 and 0.9, sinks on and off, 1, 2, 3 or 10 checked rows, partial last tiles on both sides."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fp4video.sparse import BlockSelection, check_selection, row_block_mass
from fp4video.sparse.check import (CHECK_CONFIDENCE, SINK_MASS, SINK_QUERY_TILES, SINK_RATIO, sink_query_tiles,
                                   student_t_quantile)


def _unnormalized_row_mass(q, k, rows, **kwargs):
    """The reference's mass with each row scaled by 1/2, 1 or 3/2: the check reads each row's share of
    its own sum (another implementation's rows sum to 1 only to its rounding)."""
    mass = row_block_mass(q, k, rows, **kwargs)
    r = mass.shape[2]
    return mass * (0.5 + (torch.arange(r, device=mass.device) % 3) / 2).view(1, 1, r, 1)


def random_call(rng: random.Random, gen: torch.Generator, *, batch=(1, 2, 3), heads=(1, 2, 3), dims=(4, 8),
                tiles=(4, 8), bad=0.3, row_masks=True):
    """A random check call ``(sel, q, k, options)``: partial last tiles most of the time, sometimes a heavy
    key (sinks fire), a NaN or ±Inf in Q or K (probability ``bad`` each), a key-padding mask (a batch
    entry seeing no key) or, with ``row_masks``, a mask per query row; options of every kind."""
    b, h, d = rng.choice(batch), rng.choice(heads), rng.choice(dims)
    qt, kt = rng.choice(tiles), rng.choice(tiles)
    sq, sk = rng.randint(1, 5 * qt), rng.randint(1, 6 * kt)  # partial last tiles most of the time
    nq, nk = -(-sq // qt), -(-sk // kt)
    q = torch.randn(b, h, sq, d, generator=gen) * rng.choice([0.5, 2.0])
    k = torch.randn(b, h, sk, d, generator=gen) * rng.choice([0.5, 2.0])
    if rng.random() < 0.5:  # a heavy key: sinks fire
        k[..., rng.randrange(sk), :] = q.mean(dim=2) * 6
    for x, n in ((q, sq), (k, sk)):
        if rng.random() < bad:
            x[rng.randrange(b), rng.randrange(h), rng.randrange(n), rng.randrange(d)] = rng.choice(
                [math.nan, math.inf, -math.inf])
    mask = None
    r = rng.random()
    if r < 0.3:  # key padding; one batch entry sees no key
        mask = torch.rand(b, 1, 1, sk, generator=gen) < 0.7
        mask[rng.randrange(b)] = False
    elif r < 0.45 and row_masks:  # a mask per query row; one row sees no key
        mask = torch.rand(b, h, sq, sk, generator=gen) < 0.5
        mask[..., rng.randrange(sq), :] = False
    shape = (1, 1, nq, nk) if rng.random() < 0.5 else (b, h, nq, nk)
    tiles_ = torch.rand(shape, generator=gen) < rng.random()
    sel = BlockSelection(tiles_, sq, sk, qt, kt)
    options = dict(scale=rng.choice([None, 0.5]), attn_mask=mask, floor=rng.choice([None, 0.5, 0.9]),
                   sinks=rng.random() < 0.5, rows=rng.choice([1, 2, 3, 10]),
                   row_mass=row_block_mass if rng.random() < 0.6 else _unnormalized_row_mass)
    return sel, q, k, options


def _fp64_rows_mass(q, k, mask, scale, sampled, key_tile):
    """(B, H, nq, r, nk) fp64: the checked rows' softmax mass per key tile; 0 for a row that sees no
    key, NaN for a row with a NaN or +Inf logit on a key it sees."""
    b, h, nq, r = sampled.shape
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    flat = sampled.reshape(b, h, nq * r)
    rows = q.double().gather(2, flat.unsqueeze(-1).expand(b, h, nq * r, d))
    logits = rows @ k.double().transpose(-1, -2) * scale  # (B, H, nq·r, Sk)
    live = torch.ones_like(logits, dtype=torch.bool)
    if mask is not None:
        m = mask.expand(b, h, sq, sk)
        live = m.gather(2, flat.unsqueeze(-1).expand(b, h, nq * r, sk))
    bad = ((torch.isnan(logits) | (logits == math.inf)) & live).any(dim=-1, keepdim=True)
    logits = torch.where(live & ~torch.isnan(logits), logits, -math.inf)
    top = logits.amax(dim=-1, keepdim=True)
    p = torch.exp(logits - torch.where(top == -math.inf, 0.0, top))
    total = p.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, p / total, 0.0)
    p = torch.where(bad, math.nan, p)
    nk = -(-sk // key_tile)
    p = torch.nn.functional.pad(p, (0, nk * key_tile - sk)).reshape(b, h, nq * r, nk, key_tile).sum(-1)
    return p.reshape(b, h, nq, r, nk)


def _fp64_measure(mass, tiles, weight, sq, query_tile):
    """(kept, bound, unknown), each (B, H, nq): the weighted mean of the rows' kept shares (a row that
    sees no key keeps 1), the mean less Student's t times the rows' spread, and the query tiles with a
    row whose mass is not finite."""
    r = mass.shape[-2]
    unknown = torch.isnan(mass).any(dim=-1).any(dim=-1)
    total = mass.sum(dim=-1)
    row = torch.where(total > 0, (mass * tiles.unsqueeze(-2)).sum(dim=-1) / total, 1.0)
    w = weight.double()
    mean = (row * w).sum(dim=-1)
    if r == 1:
        return mean, mean, unknown
    nq = mass.shape[2]
    length = torch.tensor([min(query_tile, sq - i * query_tile) for i in range(nq)], dtype=torch.float64)
    n = length.clamp(max=r)
    var = ((row - mean.unsqueeze(-1)) ** 2 * w).sum(dim=-1) * r / (r - 1)
    t = student_t_quantile(CHECK_CONFIDENCE, r - 1)
    bound = (mean - t * var.sqrt() * ((1 - n / length).clamp(min=0) / n).sqrt()).clamp(min=0)
    return mean, bound, unknown


def _fp64_sinks(mass, weight):
    """(B, H, nk) bool and the margin of each key tile from the sink threshold: the key tiles holding,
    at the median query tile, SINK_MASS and SINK_RATIO times the median key tile's share of the
    rows' weighted mass (rows whose mass is not finite left out); the median over the query tiles
    that sink_query_tiles names when there are more than SINK_QUERY_TILES (an even spread of them)."""
    total = mass.sum(dim=-1, keepdim=True)
    share = torch.where(torch.isfinite(total) & (total > 0), mass / total, 0.0).nan_to_num(0.0)
    block = (share * weight.double().unsqueeze(-1)).sum(dim=-2)
    s = block.sum(dim=-1, keepdim=True)
    block = torch.where(s > 0, block / s, 0.0)
    if block.shape[-2] > SINK_QUERY_TILES:
        block = block[..., sink_query_tiles(block.shape[-2]), :]
    typical = block.median(dim=-2).values
    threshold = torch.clamp(typical.median(dim=-1, keepdim=True).values * SINK_RATIO, min=SINK_MASS)
    return typical >= threshold, (typical - threshold).abs()


def verify_check(check, sel, q, k, options):
    """Every field of the checked selection against the fp64 computation (raises AssertionError)."""
    q0, k0 = q.clone(), k.clone()
    out = check(sel, q, k, **options)
    assert torch.equal(q.nan_to_num(), q0.nan_to_num()) and torch.equal(k.nan_to_num(), k0.nan_to_num())
    c = out.check
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    nq, nk = sel.n_query_tiles, sel.n_key_tiles
    assert c.sampled.shape == c.weight.shape == (b, h, nq, options["rows"])
    assert c.floor == options["floor"] and c.rows == options["rows"]
    assert torch.equal(c.density_before, sel.density())
    mass = _fp64_rows_mass(q, k, options["attn_mask"], options.get("scale"), c.sampled, sel.key_tile)
    before = sel.tiles.expand(b, h, nq, nk)
    kept, bound, unknown = _fp64_measure(mass, before, c.weight, sq, sel.query_tile)
    assert c.kept_before.shape == (b, h, nq) and c.kept_before.dtype == torch.float32
    assert torch.equal(torch.isnan(c.kept_before), unknown)
    torch.testing.assert_close(c.kept_before.double()[~unknown], kept[~unknown], rtol=0, atol=2e-6)
    tiles = out.tiles.expand(b, h, nq, nk)
    assert not (before & ~tiles).any()  # sinks and the repair only add
    assert torch.equal(c.repaired, (tiles & ~before).any(dim=-1))
    floor, sinks = options["floor"], options["sinks"]
    if not sinks and not floor:
        assert out.tiles is sel.tiles and not c.repaired.any()
    kept, bound, unknown = _fp64_measure(mass, tiles, c.weight, sq, sel.query_tile)
    assert torch.equal(torch.isnan(c.kept), unknown) and torch.equal(torch.isnan(c.unseen), unknown)
    torch.testing.assert_close(c.kept.double()[~unknown], kept[~unknown], rtol=0, atol=2e-6)
    torch.testing.assert_close(c.unseen.double()[~unknown], bound[~unknown], rtol=0, atol=2e-5)
    if floor:
        assert tiles[unknown].all()  # rows that are not finite: every key tile
        assert ((bound >= floor - 1e-5) | tiles.all(dim=-1) | unknown).all()
    if sinks:
        found, margin = _fp64_sinks(mass, c.weight)
        clear = margin > 1e-5  # a tile at the very edge of the threshold may round either way in fp32
        assert not ((found & clear).unsqueeze(-2) & ~tiles).any(), "a sink some query tile does not visit"
        if not floor:
            added = (tiles & ~before).any(dim=-2)  # (B, H, nk): the columns sinks added
            assert not (added & ~found & clear).any(), "a column added that is not a sink"


@pytest.mark.parametrize("seed", range(4))
def test_check_selection_equals_an_fp64_measure_on_random_calls(seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(40):
        sel, q, k, options = random_call(rng, gen)
        verify_check(check_selection, sel, q, k, options)


def test_a_row_that_is_not_finite_weighs_nothing_in_the_sinks_block_mass():
    """A key tile every finite row puts most of its mass on is a sink even where most query tiles
    hold one row with a NaN query: that row weighs nothing, its tile's finite rows still count."""
    gen = torch.Generator().manual_seed(0)
    d, sq, sk = 8, 64, 64
    u = torch.full((d,), 2.0)
    q = (torch.randn(1, 1, sq, d, generator=gen) * 0.3 + u).contiguous()
    k = torch.randn(1, 1, sk, d, generator=gen) * 0.3
    k[0, 0, 0] = 4 * u  # key 0 takes nearly all of every row's mass
    for i in range(5):  # the last row of 5 of the 8 query tiles is NaN (a checked row: the tile's last)
        q[0, 0, 8 * i + 7, 0] = math.nan
    tiles = torch.eye(8, dtype=torch.bool).view(1, 1, 8, 8)  # the diagonal: key tile 0 only for query tile 0
    sel = BlockSelection(tiles, sq, sk, 8, 8)
    out = check_selection(sel, q, k, sinks=True, rows=2)
    assert torch.equal(torch.isnan(out.check.kept[0, 0]), torch.arange(8) < 5)
    assert out.tiles[0, 0, :, 0].all()  # every query tile visits the sink
    assert torch.equal(out.tiles[0, 0, :, 1:], tiles[0, 0, :, 1:])  # and nothing else is added
