"""Block-sparse selection on LEARNED attention: the self-attention q, k, v of the project's trained test
model (fp4video.testmodel), captured once per module, against the exact fp64 attention of every row.

(a) the shipped dynamic rule (sampled τ 0.9, sinks, floor 0.9) saves work (density < 1 on some heads)
and every query tile keeps the floor on the mean of ALL its rows, measured exactly (every row, every
key), under the default check (10 rows per tile); with every row checked, the check's estimate is each
tile's exact mean; single rows still fall under the floor (a strict xfail: the floor is on a tile's
mean, docs/sparse-learned.md). (b) the oracle bounds every selection of the suite, per query tile.
(c) each call's check reports the exact kept mass of the rows it read. (d) the check's bound on the
rows it did not read holds on measure-only selections. The harness's pieces (the per-tile cosines,
the structure measures) are checked on synthetic heads, where the answer is known."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fp4video.attention import selection_for
from fp4video.harness.video_heads import (VideoGrid, attention_structure, capture_self_attention, exact_block_mass,
                                          key_tile_partials, oracle_selection, partial_row_cosines, selection_quality,
                                          video_heads)
from fp4video.sparse import CHECK_ROWS, DynamicSparsity, StaticSparsity

ROOT = Path(__file__).resolve().parents[1]
FLOOR = 0.9
#: the dynamic rule with the package's default rows (4 to estimate, 10 to check)
DEFAULT = DynamicSparsity(0.9, estimate="sampled", sinks=True, floor=FLOOR)
#: configs/wan22_mxattn_pv8_dynamic.yaml's selection: 2 estimate rows (a cheaper call; the repair makes
#: up what the coarser estimate misses)
SHIPPED = DynamicSparsity(0.9, estimate="sampled", estimate_rows=2, sinks=True, floor=FLOOR)


def test_shipped_is_the_dynamic_configs_selection():
    from fp4video.integration.config import load_config

    policy = load_config(ROOT / "configs" / "wan22_mxattn_pv8_dynamic.yaml").policy
    sp = next(r.sparsity for r in policy.rules if r.sparsity is not None)
    from fp4video.sparse import check_rows_for

    d = sp.dynamic
    assert (d.tau, d.estimate, d.estimate_rows, sp.sinks, sp.floor, check_rows_for(sp.floor, sp.check_rows)) == (
        SHIPPED.tau, SHIPPED.estimate, SHIPPED.estimate_rows, SHIPPED.sinks, SHIPPED.floor, SHIPPED.check_rows)
#: a check reads fp32 row masses; the references are fp64 over the same inputs
FP32_MASS = 1e-5


def _suite():
    """scripts/sparse_selection_suite.py as a module (its rule list and measures)."""
    spec = importlib.util.spec_from_file_location("sparse_selection_suite", ROOT / "scripts" / "sparse_selection_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def calls():
    """One held-out caption's conditional self-attention calls, every block, at both steps of a 2-step
    schedule (early and late; TEST_MODEL_CALL's 16 steps otherwise: the same weights, fewer forwards)."""
    from fp4video.testmodel import HELD_OUT, TEST_MODEL_CALL, test_model_pipeline

    pipe = test_model_pipeline()
    call = {**TEST_MODEL_CALL, "num_inference_steps": 2}
    with torch.no_grad():
        captured = capture_self_attention(pipe, [HELD_OUT[0].caption], steps=(0, 1), call=call, branches=("cond",))
    return captured


@pytest.fixture(scope="module")
def masses(calls):
    """Every row's exact fp64 softmax mass on each key tile of 128, per call."""
    return [exact_block_mass(c.q, c.k, scale=c.scale) for c in calls]


def _row_kept(mass, tiles, query_tile):
    """(B, H, Sq) fp64: each row's exact mass on the key tiles its query tile visits."""
    b, h, sq, _ = mass.shape
    keep = tiles.expand(b, h, *tiles.shape[2:]).repeat_interleave(query_tile, dim=2)[:, :, :sq]
    return (mass * keep).sum(-1)


@pytest.mark.slow
def test_the_capture_holds_every_blocks_self_attention_on_the_latent_grid(calls):
    from fp4video.testmodel import WEIGHTS

    blocks = json.loads((WEIGHTS / "transformer" / "config.json").read_text())["num_layers"]
    assert sorted((c.step, c.block) for c in calls) == [(s, b) for s in (0, 1) for b in range(blocks)]
    for c in calls:
        assert c.grid == (8, 16, 16) and c.branch == "cond"
        assert c.q.shape == c.k.shape == c.v.shape == (1, 4, 2048, 64) and c.q.dtype == torch.float32
        assert torch.isfinite(c.q).all() and torch.isfinite(c.k).all()
    # distinct inputs per block and step (not one tensor captured over and over)
    assert len({(float(c.q.double().sum()), float(c.k.double().sum())) for c in calls}) == len(calls)


def _tile_mean(kept, query_tile):
    """(B, H, nq): the mean over each query tile's rows of ``kept`` (B, H, Sq)."""
    b, h, sq = kept.shape
    nq = -(-sq // query_tile)
    pad = torch.nn.functional.pad(kept, (0, nq * query_tile - sq), value=float("nan"))
    return pad.reshape(b, h, nq, query_tile).nanmean(-1)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [DEFAULT, SHIPPED], ids=["default rows", "the shipped config's rows"])
def test_the_shipped_rule_saves_work_and_every_query_tile_keeps_the_floor_on_every_row(calls, masses, rule):
    """(a) Regression, the floor on unread rows: τ 0.9 on learned attention visits fewer than all tiles
    on some heads, and after repair every query tile's mean over ALL its rows of their exact (fp64,
    every key) kept mass is at least the floor (it was 0.78 with 2 checked rows per tile, 10% of
    query tiles under the floor); the check's own bound says so too."""
    densities = []
    for c, mass in zip(calls, masses):
        sel = selection_for(rule, c.q, c.k, scale=c.scale)
        densities += sel.density_per_head().flatten().tolist()
        tile = _tile_mean(_row_kept(mass, sel.tiles, sel.query_tile), sel.query_tile)
        worst = float(tile.min())
        assert worst >= FLOOR, f"{c.label}: a query tile keeps {worst:.4f} of its rows' mass < floor {FLOOR}"
        assert float(sel.check.unseen.min()) >= FLOOR - 1e-6
    assert min(densities) < 0.9, f"no head under density 0.9: {densities}"
    assert sum(d < 1 for d in densities) >= len(densities) // 2, densities


@pytest.mark.slow
def test_with_every_row_checked_the_check_is_each_tiles_exact_mean_and_work_is_still_saved(calls, masses):
    """(a) a check that reads all 128 rows of a tile knows its exact mean (no bound left): the repaired
    tiles keep the floor on it, and the selection still skips tiles on some heads."""
    rule = DynamicSparsity(0.9, estimate="sampled", sinks=True, floor=FLOOR, check_rows=128)
    densities = []
    for c, mass in zip(calls, masses):
        sel = selection_for(rule, c.q, c.k, scale=c.scale)
        densities += sel.density_per_head().flatten().tolist()
        tile = _tile_mean(_row_kept(mass, sel.tiles, sel.query_tile), sel.query_tile)
        err = float((sel.check.kept.double() - tile).abs().max())
        assert err <= FP32_MASS, f"{c.label}: the check's mean is off the exact mean by {err:.2e}"
        assert torch.equal(sel.check.unseen, sel.check.kept)
        assert float(tile.min()) >= FLOOR - FP32_MASS, f"{c.label}: a tile keeps {float(tile.min()):.4f}"
    assert min(densities) < 0.9, f"no head under density 0.9: {densities}"


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the floor holds on each query tile's mean over its rows, not on each single row: on "
                   "learned attention some rows of a tile attend elsewhere and keep far less (docs/sparse-learned.md); "
                   "this test passing means every single row keeps it: update the doc")
def test_with_the_default_check_every_single_row_keeps_the_floor(calls, masses):
    """(a) every single row, not only each tile's mean, keeps the floor under the shipped rule."""
    for c, mass in zip(calls, masses):
        sel = selection_for(SHIPPED, c.q, c.k, scale=c.scale)
        worst = float(_row_kept(mass, sel.tiles, sel.query_tile).min())
        assert worst >= FLOOR - FP32_MASS, f"{c.label}: a row keeps {worst:.4f} < floor {FLOOR}"


@pytest.mark.slow
def test_the_oracle_bounds_every_selection_of_the_suite(calls, masses):
    """(b) per query tile, no selection keeps more exact mass than the oracle (the key tiles of
    largest exact block mass) at its own count of key tiles, on each selection's own query tiles;
    selection_quality's efficiency is at most 1. The selections are the suite's --test-model list."""
    rules = _suite().test_model_rules(calls[0].grid)
    assert len(rules) >= 20
    worst = 0.0
    for c, mass in zip(calls, masses):
        if (c.step, c.block) not in ((0, 2), (1, 1)):  # two calls: every selection on each takes a while
            continue
        for family, label, rule in rules:
            sel = selection_for(rule, c.q, c.k, scale=c.scale)
            qt = sel.query_tile
            tiles = sel.tiles.expand(1, c.q.shape[1], *sel.tiles.shape[2:])
            counts = tiles.sum(-1)
            oracle = oracle_selection(mass, counts, qt)
            assert torch.equal(oracle.sum(-1), counts), label  # the oracle visits as many tiles
            block = torch.stack([mass[:, :, i * qt:(i + 1) * qt].mean(2) for i in range(tiles.shape[2])], dim=2)
            kept, best = (block * tiles).sum(-1), (block * oracle).sum(-1)
            excess = float((kept - best).max())
            worst = max(worst, excess)
            assert excess <= 1e-12, f"{c.label}, {label}: a query tile keeps {excess:.2e} more than the oracle"
            quality = selection_quality(mass, tiles, qt, report_tile=qt)
            assert quality["efficiency"] <= 1 + 1e-12, (label, quality["efficiency"])
    assert worst <= 1e-12


@pytest.mark.slow
def test_each_check_reports_the_exact_kept_mass_of_the_rows_it_read(calls, masses):
    """(c) the check's kept mass per query tile is the mean of its checked rows' exact kept shares,
    weighted by the rows each stands for (within fp32 row masses: 1e-5), and its summary (min, 1%
    quantile, mean) is that of those exact values (an order statistic moves no more than the values do)."""
    rules = [SHIPPED, DynamicSparsity(0.8), DynamicSparsity(None, topk=0.2, estimate="sampled", query_tile=64)]
    for c, mass in zip(calls, masses):
        for rule in rules:
            sel = selection_for(rule, c.q, c.k, scale=c.scale)
            qt, check = sel.query_tile, sel.check
            b, h, _, nk = mass.shape
            read = mass.gather(2, check.sampled.reshape(b, h, -1, 1).expand(b, h, check.sampled[0, 0].numel(), nk))
            read = read.reshape(*check.sampled.shape, nk)
            tiles = sel.tiles.expand(b, h, *sel.tiles.shape[2:])
            exact = ((read * tiles.unsqueeze(-2)).sum(-1) * check.weight.double()).sum(-1)  # (1, H, nq)
            err = float((check.kept.double() - exact).abs().max())
            assert err <= FP32_MASS, f"{c.label}, {rule}: check off by {err:.2e}"
            summary = {k: float(v) for k, v in check.summary().items()}
            flat = exact.flatten().sort().values
            q01 = float(flat[int((flat.numel() - 1) * 0.01)])
            assert abs(summary["kept_min"] - float(flat[0])) <= FP32_MASS
            assert abs(summary["kept_q01"] - q01) <= FP32_MASS
            assert abs(summary["kept_mean"] - float(flat.mean())) <= FP32_MASS


@pytest.mark.slow
def test_the_suites_learned_measures_and_report_on_one_call(calls, tmp_path):
    """The suite's --test-model path on one captured call and two selections: its rows, aggregates,
    table and plot (the whole run takes minutes)."""
    suite = _suite()
    rules = [r for r in suite.test_model_rules(calls[0].grid) if r[1] in ("sampled τ=0.9 sinks floor=0.9",
                                                                          "window [2, 5, 5] (64-row tiles)")]
    assert len(rules) == 2
    c = calls[-1]
    rows, raw = suite.measure_call(c, rules)
    assert len(rows) == 2 * c.q.shape[1]
    for r in rows:
        assert 0 < r["density"] <= 1 and 0 <= r["kept_min"] <= r["kept_mean"] <= 1 and r["efficiency"] <= 1 + 1e-12
        assert r["row_cos_min"] <= r["row_cos_q001"] <= 1 and r["check_error"] <= FP32_MASS
    assert rows[0]["miss_rate"] is not None and "miss_rate" not in rows[-1]
    structure = [{"caption": 0, "step": c.step, "branch": c.branch, "block": c.block, "head": h, **s}
                 for h, s in enumerate(attention_structure(c.q, c.k, c.grid, windows=suite.LEARNED_WINDOWS))]
    result = {"settings": {"captions": ["x"], "steps": [c.step], "branches": ["cond"], "call": {"num_inference_steps": 2},
                           "grid": list(c.grid), "heads": 4, "head_dim": 64, "calls": 1, "repeats_left_out": 0},
              "all": suite.aggregate(rows, raw), "per_block": {c.block: suite.aggregate(rows, raw)},
              "structure": structure}
    assert [a["selection"] for a in result["all"]] == [r[1] for r in rules]
    text = suite.learned_markdown(result)
    assert "sampled τ=0.9 sinks floor=0.9" in text and "head classes" in text
    suite.learned_plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


# --- the harness's pieces on synthetic heads (fast) -----------------------------------------------------


def test_per_tile_partials_give_the_cosines_of_attention_over_the_kept_keys():
    grid = VideoGrid(2, 8, 16, text=0)  # 256 tokens, 2 query tiles
    q, k, v = video_heads(grid, ("spatial", "content", "random"), dim=32, seed=3)
    parts = key_tile_partials(q, k, v)
    assert torch.equal(parts.mass, exact_block_mass(q, k))
    gen = torch.Generator().manual_seed(0)
    for query_tile in (128, 64):
        tiles = torch.rand(1, 3, 256 // query_tile, 2, generator=gen) < 0.6
        cos, whole = partial_row_cosines(parts, tiles, query_tile)
        direct = selection_quality(parts.mass, tiles, query_tile, q=q, k=k, v=v, report_tile=query_tile)
        assert abs(float(whole) - direct["cosine"]) < 1e-12
        assert abs(float(cos.min()) - direct["row_cos_min"]) < 1e-12
    everything = partial_row_cosines(parts, torch.ones(1, 1, 2, 2, dtype=torch.bool), 128)
    assert float(everything[0].min()) > 1 - 1e-12 and abs(float(everything[1]) - 1) < 1e-12


def test_attention_structure_names_synthetic_heads_by_their_kind():
    grid = VideoGrid(8, 8, 8)
    q, k, _ = video_heads(grid, ("spatial", "temporal", "diffuse"), dim=64, seed=1)
    s = attention_structure(q, k, (8, 8, 8), windows=[(1, 2, 2), (7, 32, 32)])
    assert [h["class"] for h in s] == ["spatial", "temporal", "diffuse"]
    assert all(abs(h["window [7, 32, 32]"] - 1) < 1e-9 for h in s)  # radial, yet over the whole grid: all
    assert s[0]["local"] > 0.5 and s[1]["temporal"] > 0.5 and s[2]["entropy"] > 0.95
    assert s[0]["window [1, 2, 2]"] > s[2]["window [1, 2, 2]"]
    with pytest.raises(ValueError, match="8×8×8"):
        attention_structure(q[:, :, :100], k, (8, 8, 8))


@pytest.mark.slow
def test_the_checks_bound_holds_for_the_rows_it_did_not_read_on_learned_attention(calls, masses):
    """(d) On selections the check only measures (no floor), its bound (``unseen``) is at most the exact
    mean over every row of the tile on at least 99% of query tiles over the captured calls (a one-sided
    99% bound), with the 2 rows a check without a floor reads and with 10; with 10 it is also
    informative: on average within 0.15 of the check's estimate. Under the shipped rule, no tile's
    bound and no tile's exact mean is under the floor."""
    grid = calls[0].grid
    over = total = 0
    gaps = []
    for c, mass in zip(calls, masses):
        for rows in (None, CHECK_ROWS):
            rules = [DynamicSparsity(0.8, estimate="sampled", check_rows=rows), DynamicSparsity(0.9, check_rows=rows),
                     DynamicSparsity(None, topk=0.2, check_rows=rows),
                     StaticSparsity(*grid, window=(1, 3, 3), radial=True, check_rows=rows)]
            for rule in rules:
                sel = selection_for(rule, c.q, c.k, scale=c.scale)
                tile = _tile_mean(_row_kept(mass, sel.tiles, sel.query_tile), sel.query_tile)
                over += int((sel.check.unseen.double() > tile + 1e-6).sum())
                total += tile.numel()
                if rows == CHECK_ROWS:
                    gaps.append((sel.check.kept - sel.check.unseen).flatten())
        shipped = selection_for(SHIPPED, c.q, c.k, scale=c.scale)
        assert float(shipped.check.summary()["unseen_under_floor"]) == 0
    assert over <= 0.01 * total, f"the bound is over the exact mean on {over} of {total} query tiles"
    assert float(torch.cat(gaps).mean()) <= 0.15
