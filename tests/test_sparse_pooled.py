"""The repair designs with a pooled within-tile variance (scripts/sparse_repair_designs.py): the tiles each
adds are the shortest prefix of the estimated order whose bound — the tile's weighted mean less
t·s·√((1 − n/L)/n), with s² the rows' variance pooled over the head's query tiles or a band of them
(or the larger of that and the tile's own) at the same prefix, t with the band's pooled degrees of
freedom — reaches the floor; checked against a loop over tiles and prefixes in fp64 with scipy's t
quantile."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def designs():
    path = ROOT / "scripts" / "sparse_repair_designs.py"
    spec = importlib.util.spec_from_file_location("sparse_repair_designs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(seed, b=1, h=2, nq=7, r=3, nk=9, sq=7 * 128 - 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, nq, r, nk, generator=g, dtype=torch.float64) * 2.0
    share = torch.softmax(logits, dim=-1)
    weight = torch.rand(b, h, nq, r, generator=g, dtype=torch.float64) + 0.2
    weight = weight / weight.sum(-1, keepdim=True)
    tiles = torch.rand(b, h, nq, nk, generator=g) < 0.3
    length = torch.clamp(sq - torch.arange(nq) * 128, max=128).to(torch.float64)
    return tiles, share, weight, length


def _reference(tiles, share, weight, length, how, confidence, scope, floor):
    """Loops: each tile's free key tiles in descending weighted mass, its rows' kept share after each
    prefix, the pooled variance over the band at the same prefix index, the first prefix whose bound
    reaches the floor."""
    b, h, nq, r, nk = share.shape
    out = tiles.clone()
    band = nq if scope == "head" else scope
    for bi in range(b):
        for hi in range(h):
            curves = []  # per tile: (free tiles in order, per prefix (mean, own variance, m(1 − m)))
            for j in range(nq):
                w = weight[bi, hi, j].tolist()
                s = share[bi, hi, j]
                block = [sum(w[i] * float(s[i, c]) for i in range(r)) for c in range(nk)]
                free = sorted((c for c in range(nk) if not tiles[bi, hi, j, c]), key=lambda c: -block[c])
                kept = [sum(float(s[i, c]) for c in range(nk) if tiles[bi, hi, j, c]) for i in range(r)]
                points = []
                for p in range(nk + 1):
                    if 1 <= p <= len(free):
                        kept = [kept[i] + float(s[i, free[p - 1]]) for i in range(r)]
                    mean = sum(w[i] * kept[i] for i in range(r))
                    var = sum(w[i] * (kept[i] - mean) ** 2 for i in range(r)) * r / (r - 1)
                    points.append((mean, var, max(mean * (1 - mean), 0.0)))
                curves.append((free, points))
            for j in range(nq):
                members = [i for i in range(nq) if i // band == j // band]
                t = stats.t.ppf(confidence, len(members) * (r - 1))
                n = min(float(length[j]), r)
                spread = math.sqrt(max(1 - n / float(length[j]), 0.0) / n)
                free, points = curves[j]
                count = len(free)
                for p, (mean, own, top) in enumerate(points):
                    if how == "dispersion-max":
                        var_sum = sum(curves[i][1][p][1] for i in members)
                        top_sum = sum(curves[i][1][p][2] for i in members)
                        pooled = var_sum / max(top_sum, 1e-12) * top
                    else:
                        pooled = sum(curves[i][1][p][1] for i in members) / len(members)
                    var = pooled if how == "pooled" else max(pooled, own)
                    if mean - t * math.sqrt(var) * spread >= floor:
                        count = p
                        break
                for c in free[:count]:
                    out[bi, hi, j, c] = True
    return out


@pytest.mark.parametrize("how,scope", [("pooled", "head"), ("pooled-max", "head"), ("pooled-max", 2), ("pooled", 4),
                                       ("dispersion-max", 2)])
def test_the_pooled_repair_takes_the_shortest_prefix_whose_pooled_bound_reaches_the_floor(designs, how, scope):
    """Per design and seed: the script's vectorised repair equals the loop reference tile for tile, and
    adds tiles (the floor is reachable on some tiles and not on others at these inputs)."""
    for seed in range(3):
        tiles, share, weight, length = _inputs(seed)
        got = designs.repair(tiles, share, weight, how, (0.99, scope), length)
        want = _reference(tiles, share, weight, length, how, 0.99, scope, designs.FLOOR)
        assert torch.equal(got, want), f"{how} {scope} seed {seed}"
        assert bool((got & ~tiles).any()) and bool((got | tiles).equal(got))


def test_pooling_dilutes_one_tiles_variance_over_the_head_and_the_max_keeps_it(designs):
    """A head of 8 query tiles, 2 rows each: in tile 0 the rows disagree (0.99 and 0.6 of their mass on
    the visited key tile), in the others they agree. The own-rows bound (t with 1 dof, 31.8) makes
    tile 0 dense; pooled over the head its variance is an eighth (2 more tiles); max(pooled, own)
    keeps its own (3 more); the other tiles' rows agree, so their pooled variance is the larger."""
    b, h, nq, r, nk = 1, 1, 8, 2, 6
    share = torch.zeros(b, h, nq, r, nk, dtype=torch.float64)
    share[..., 0], share[..., 1:] = 0.95, 0.01
    share[0, 0, 0, 0] = torch.tensor([0.99] + [0.002] * 5, dtype=torch.float64)
    share[0, 0, 0, 1] = torch.tensor([0.6, 0.3] + [0.025] * 4, dtype=torch.float64)
    weight = torch.full((b, h, nq, r), 0.5, dtype=torch.float64)
    tiles = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    tiles[..., 0] = True
    length = torch.full((nq,), 128.0, dtype=torch.float64)
    own = designs.repair(tiles, share, weight, "bound", 0.99, length)
    pooled = designs.repair(tiles, share, weight, "pooled", (0.99, "head"), length)
    both = designs.repair(tiles, share, weight, "pooled-max", (0.99, "head"), length)
    assert [int(x[0, 0, 0].sum()) for x in (own, pooled, both)] == [6, 3, 4]
    assert torch.equal(pooled[0, 0, 1:], both[0, 0, 1:])
