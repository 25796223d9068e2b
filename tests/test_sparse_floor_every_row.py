"""The floor on every row: after the check's repair, no query tile of the selection suite's inputs keeps
less than the floor on the mean over ALL its rows (each row's exact kept mass, fp64, every key), not
only on the rows the check read; the repair designs' script reports each design's miss rate measured
on every row; the check's cost script runs; the check reads nothing back to the host."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from fp4video.harness.video_heads import VideoGrid, exact_block_mass, video_heads
from fp4video.sparse import CHECK_ROWS, BlockSelection, DynamicSparsity, check_selection, covering_rows, resolve_sparsity

ROOT = Path(__file__).resolve().parents[1]
#: the selection suite's default synthetic grid (scripts/sparse_selection_suite.py)
GRID = VideoGrid(4, 16, 32, text=32, text_position="last")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def suite_inputs():
    q, k, _ = video_heads(GRID, dim=64, seed=0)
    return q, k, exact_block_mass(q, k)


def _tile_means(mass, tiles, query_tile):
    """(B, H, nq): each query tile's mean over all its rows of their exact kept mass."""
    b, h, sq, _ = mass.shape
    rows = (mass * tiles.expand(b, h, *tiles.shape[2:]).repeat_interleave(query_tile, dim=2)[:, :, :sq]).sum(-1)
    nq = tiles.shape[2]
    pad = torch.nn.functional.pad(rows, (0, nq * query_tile - sq), value=math.nan)
    return pad.reshape(b, h, nq, query_tile).nanmean(-1)


def test_the_floor_holds_on_the_mean_of_every_row_of_each_query_tile_of_the_synthetic_suite(suite_inputs):
    """Regression, the floor on unread rows: every rule of the suite with a floor (sampled τ with sinks,
    SpargeAttn's top-k on 64-row tiles, radial windows with sinks), on every head kind: each query
    tile (of the rule's own size) keeps at least the floor of the mean over all its rows. The check
    that repaired by 2 rows per tile left content-head tiles under it (0.895 at τ 0.9)."""
    q, k, mass = suite_inputs
    rules = [(label, rule) for _, label, rule in _script("sparse_selection_suite").fp4video_rules(GRID)
             if getattr(rule, "floor", None) is not None]
    assert len(rules) >= 10
    for label, rule in rules:
        sel = resolve_sparsity(rule, q, k)
        tile = _tile_means(mass, sel.tiles, sel.query_tile)
        worst = float(tile.min())
        assert worst >= rule.floor - 1e-6, f"{label}: a query tile keeps {worst:.4f} < floor {rule.floor}"
        assert float(sel.density()) < 1, label


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_shipped_dynamic_configs_fewer_estimate_rows_keep_the_floor_on_every_row(suite_inputs, seed):
    """configs/wan22_mxattn_pv8_dynamic.yaml estimates from 2 rows per query tile (the package's
    default: 4): on every head kind of the suite, under several row draws, every query tile still
    keeps the floor on the mean over all its rows (the repair makes up the coarser estimate)."""
    q, k, mass = suite_inputs
    text = ((GRID.video, GRID.tokens),)
    rule = DynamicSparsity(0.9, estimate="sampled", estimate_rows=2, sinks=True, floor=0.9,
                           global_tokens=text, seed=seed)
    sel = resolve_sparsity(rule, q, k)
    tile = _tile_means(mass, sel.tiles, sel.query_tile)
    assert float(tile.min()) >= 0.9 - 1e-4, f"seed {seed}: a query tile keeps {float(tile.min()):.4f}"
    assert float(sel.density()) < 1


def test_the_repair_designs_report_their_miss_rate_measured_on_every_row(suite_inputs):
    """scripts/sparse_repair_designs.py: each design's miss rate is its count of query tiles under the
    floor (every row) over all tiles; the shipped check's line is what the package's rule gives on the
    same inputs (measured here independently); the previous check's line shows its miss."""
    designs = _script("sparse_repair_designs")
    q, k, mass = suite_inputs
    text = ((GRID.video, GRID.tokens),)
    lines = {r["design"]: r for r in designs.evaluate([{"q": q, "k": k, "scale": None, "mass": mass, "text": text}])}
    for r in lines.values():
        if "under" in r:
            assert r["miss_rate"] == r["under"] / r["tiles"] and r["tiles"] == q.shape[1] * 17
            assert r["kept_min"] <= r["kept_q01"] <= r["kept_mean"] <= 1 and 0 < r["density"] <= 1
    shipped = DynamicSparsity(designs.TAU, estimate="sampled", sinks=True, floor=designs.FLOOR, global_tokens=text)
    sel = resolve_sparsity(shipped, q, k)
    tile = _tile_means(mass, sel.tiles, 128)
    mine = lines[f"covering {CHECK_ROWS}, bound 99% (the check)"]
    assert mine["under"] == int((tile < designs.FLOOR - 1e-4).sum()) == 0
    assert abs(mine["density"] - float(sel.density_per_head().mean())) < 1e-6
    assert abs(mine["kept_min"] - float(tile.min())) < 1e-5
    assert lines["strata 2, union +¼ (the previous check)"]["under"] >= 1
    oracle = lines["oracle (exact tile mass, every row)"]["density"]
    assert all(oracle <= r["density"] + 1e-9 for r in lines.values() if r.get("under") == 0)


def test_the_check_cost_script_runs_at_a_tiny_size(tmp_path):
    """scripts/sparse_check_cost.py on the CPU at 1,024 tokens: every piece (seven, the sinks-only
    check among them) timed for 2, 4, 8 rows and the check's default, against the dense call, in a
    markdown table."""
    _script("sparse_check_cost").main(["--tokens", "1024", "--heads", "2", "--device", "cpu", "--repeats", "1",
                                       "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cost.json").read_text())
    rows = sorted({2, 4, 8, CHECK_ROWS})
    assert [line["rows"] for line in result["lines"]] == [r for r in rows for _ in range(7)]
    assert all(line["ms"] > 0 and line["of SDPA"] > 0 for line in result["lines"])
    table = (tmp_path / "cost.md").read_text()
    assert f"| the check with sinks and floor 0.9 (the bound's repair) | {CHECK_ROWS} |" in table and "of dense SDPA" in table
    assert f"| the check with sinks (the shipped sparse configs' check) | {CHECK_ROWS} |" in table


def test_the_check_and_its_rows_read_nothing_back(monkeypatch):
    """Tensor operations only (a CUDA graph captures them): covering rows, the exact mass of rows that
    differ per head, a per-row mask, a partial tile, sinks and the repair, with every read-back raising."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 333, 32, generator=g), torch.randn(1, 2, 333, 32, generator=g)
    mask = torch.rand(1, 1, 333, 333, generator=g) > 0.2
    sel = BlockSelection(torch.rand(1, 2, 3, 3, generator=g) < 0.4, 333, 333)
    for name in ("item", "tolist", "nonzero", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **kw: (_ for _ in ()).throw(AssertionError("read-back")))
    covering_rows(q, 128, 8)
    checked = check_selection(sel, q, k, attn_mask=mask, floor=0.9, sinks=True)
    checked.check.summary()
    monkeypatch.undo()
    assert float(checked.check.unseen.min()) >= 0.9 - 1e-6
