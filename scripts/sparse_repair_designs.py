"""The floor's repair, design by design, measured on every row: which checked rows, and which rule for
adding key tiles, keep every query tile's mean over ALL its rows at the floor, at what density.

    python scripts/sparse_repair_designs.py --out repair-designs                 # CPU, a few minutes
    python scripts/sparse_repair_designs.py --out repair-designs --held-out      # + other captions and grids

Each design is a placement of the checked rows (``strata``: one row at a seeded place in each of r
equal strata of the tile, the previous check's; ``ends``: r rows evenly spaced from the tile's first
to its last; ``covering``: :func:`fp4video.sparse.covering_rows`, k-center greedy on the queries from
the two ends, the shipped check's) and a repair (``union``: each checked row under the floor adds key
tiles by its own exact mass until it keeps ``floor + m·(1 − floor)``, the tile visits the union, the
previous check's with m = ¼; ``union-loo``: the same, the margin m raised per tile (0, ¼, ½, ¾, 1)
until each checked row, left out, keeps the floor under what the others added — a cross-validated
margin; ``mean``: key tiles in descending mean mass of the checked rows until their mean reaches
``floor + m·(1 − floor)``; ``bound``: the same order until a one-sided Student-t bound on the tile's
mean reaches the floor, :func:`fp4video.sparse.check_selection`'s: 10 covering rows, 99%; ``pooled``: the
same order and bound with the within-tile variance pooled over the query tiles of a (batch, head), or of
a band of consecutive query tiles (one-way ANOVA's pooled within-group variance, its t quantile with the
pooled degrees of freedom), re-estimated at every candidate prefix; ``pooled-max``: the larger of the
pooled and the tile's own variance; ``dispersion-max``: the variance as the pooled ratio of the rows'
variance to ``m·(1 − m)`` (the largest variance of shares with mean m, Bhatia–Davis) times the tile's
own ``m·(1 − m)``, or the tile's own variance if larger). A placement ``estimate`` reads no new rows:
the rule's own ``sampled`` estimate rows, equally weighted. Every design starts from
the same rule's own tiles and sinks (``sampled τ 0.9`` with ``sinks``, floor 0.9: the shipped rule),
and the checked rows' mass is their exact mass.

Inputs: the selection suite's synthetic heads (its default grid, 4 × 16 × 32 + 32 text tokens, seed
0) and the test model's learned self-attention as ``scripts/sparse_selection_suite.py --test-model``
captures it (2 held-out captions × steps 0, 7, 15 × both guidance passes). With ``--held-out``, also
other held-out captions (3rd–6th, steps 3 and 11 of 16) and the test model at other latent widths
(18, 32 and 26 tokens: 128 × 144, 64 × 256 and 96 × 208 pixels), and the synthetic heads on four other
grids and seeds. Per design and input set, from exact fp64 attention: density, each query tile's kept
mass on the mean of all its rows (min / 1% / mean), the miss rate (query tiles under the floor:
the checked rows' repair did not see them) and how many, the worst row; the oracle's density (the
fewest tiles, by exact tile mass, that bring every tile to the floor on top of the same rule's tiles).
Writes ``designs.json`` and ``designs.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from fp4video.harness.video_heads import HEAD_KINDS, VideoGrid, exact_block_mass, video_heads
from fp4video.sparse import (CHECK_CONFIDENCE, CHECK_ROWS, DynamicSparsity, covering_rows, sample_rows, sink_columns,
                             student_t_quantile)
from fp4video.sparse.dynamic import ESTIMATE_ROWS, ESTIMATE_SEED_OFFSET, cumulative_take

FLOOR = 0.9
TAU = 0.9
#: (label, placement, rows per tile, repair, its parameter: the margin m, or the bound's confidence)
DESIGNS = (
    ("strata 2, union +¼ (the previous check)", "strata", 2, "union", 0.25),
    ("strata 4, union +¼", "strata", 4, "union", 0.25),
    ("strata 8, union +¼", "strata", 8, "union", 0.25),
    ("strata 8, union", "strata", 8, "union", 0.0),
    ("ends 2, union +¼", "ends", 2, "union", 0.25),
    ("ends 4, union +¼", "ends", 4, "union", 0.25),
    ("ends 8, union", "ends", 8, "union", 0.0),
    ("strata 2, union, cross-validated margin", "strata", 2, "union-loo", None),
    ("strata 8, union, cross-validated margin", "strata", 8, "union-loo", None),
    ("strata 8, mean +½", "strata", 8, "mean", 0.5),
    ("strata 8, bound 99%", "strata", 8, "bound", 0.99),
    ("ends 8, bound 99%", "ends", 8, "bound", 0.99),
    ("covering 4, bound 99%", "covering", 4, "bound", 0.99),
    ("covering 6, bound 99%", "covering", 6, "bound", 0.99),
    ("covering 8, bound 90%", "covering", 8, "bound", 0.90),
    ("covering 8, bound 95%", "covering", 8, "bound", 0.95),
    ("covering 8, bound 99%", "covering", 8, "bound", 0.99),
    ("covering 10, bound 95%", "covering", 10, "bound", 0.95),
    (f"covering {CHECK_ROWS}, bound {100 * CHECK_CONFIDENCE:g}% (the check)", "covering", CHECK_ROWS, "bound",
     CHECK_CONFIDENCE),
    ("covering 12, bound 99%", "covering", 12, "bound", 0.99),
    # the within-tile variance pooled over a head's query tiles ("head") or bands of 2 or 4 of them
    ("covering 2, pooled per head 99%", "covering", 2, "pooled", (0.99, "head")),
    ("covering 2, max(pooled per head, own) 99%", "covering", 2, "pooled-max", (0.99, "head")),
    ("covering 2, max(pooled per 2 tiles, own) 99%", "covering", 2, "pooled-max", (0.99, 2)),
    ("covering 3, pooled per head 99%", "covering", 3, "pooled", (0.99, "head")),
    ("covering 3, max(pooled per head, own) 99%", "covering", 3, "pooled-max", (0.99, "head")),
    ("covering 3, max(pooled per 2 tiles, own) 99%", "covering", 3, "pooled-max", (0.99, 2)),
    ("covering 4, pooled per head 99%", "covering", 4, "pooled", (0.99, "head")),
    ("covering 4, max(pooled per head, own) 99%", "covering", 4, "pooled-max", (0.99, "head")),
    ("covering 4, pooled per 4 tiles 99%", "covering", 4, "pooled", (0.99, 4)),
    ("covering 4, max(pooled per 2 tiles, own) 99%", "covering", 4, "pooled-max", (0.99, 2)),
    ("covering 4, max(pooled m(1−m) ratio per 2 tiles, own) 99%", "covering", 4, "dispersion-max", (0.99, 2)),
    ("strata 4, pooled per head 99%", "strata", 4, "pooled", (0.99, "head")),
    ("strata 4, max(pooled per head, own) 99%", "strata", 4, "pooled-max", (0.99, "head")),
    ("covering 6, pooled per head 99%", "covering", 6, "pooled", (0.99, "head")),
    ("covering 6, max(pooled per 2 tiles, own) 99%", "covering", 6, "pooled-max", (0.99, 2)),
    ("covering 10, pooled per head 99%", "covering", 10, "pooled", (0.99, "head")),
    (f"the estimate's {ESTIMATE_ROWS} rows, max(pooled per head, own) 99%", "estimate", ESTIMATE_ROWS, "pooled-max",
     (0.99, "head")),
)


def placement(q: torch.Tensor, how: str, rows: int, query_tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (B, H, nq, r) int64, weight (B, H, nq, r)) of a design's checked rows (equal weights but
    for ``covering``'s)."""
    b, h, sq, _ = q.shape
    nq = -(-sq // query_tile)
    if how == "covering":
        return covering_rows(q, query_tile, rows)
    if how == "strata":
        r = sample_rows(sq, query_tile, rows)
    elif how == "estimate":  # the rows the rule's sampled estimate read (its default seed, 0)
        r = sample_rows(sq, query_tile, rows, seed=ESTIMATE_SEED_OFFSET)
    elif how == "ends":
        i = torch.arange(nq)[:, None]
        length = (sq - i * query_tile).clamp(max=query_tile)
        r = i * query_tile + (torch.arange(rows)[None, :] * (length - 1)) // max(rows - 1, 1)
    else:
        raise ValueError(f"unknown placement {how!r}")
    r = r.to(q.device).expand(b, h, nq, rows)
    return r, torch.full(r.shape, 1.0 / rows, device=q.device)


def union_take(tiles, share, floor, margin):
    """The tiles each checked row under ``floor`` adds, by its own mass, to keep floor + margin·(1 − floor)."""
    visit = tiles.unsqueeze(-2).expand(share.shape)
    need = (share * visit).sum(-1, keepdim=True) < floor
    return cumulative_take(share, visit, min(floor + margin * (1 - floor) + 1e-6, 1.0)) & need


def repair(tiles, share, weight, how, param, length):
    """``tiles`` (B, H, nq, nk) repaired by design ``how`` from the checked rows' ``share`` (B, H, nq, r, nk)."""
    r = share.shape[-2]
    if how == "union":
        return tiles | union_take(tiles, share, FLOOR, param).any(-2)
    if how == "union-loo":
        out, done = tiles, torch.zeros(tiles.shape[:3], dtype=torch.bool, device=tiles.device)
        visit = tiles.unsqueeze(-2).expand(share.shape)
        margins = (0.0, 0.25, 0.5, 0.75, 1.0)
        for m in margins:
            add = union_take(tiles, share, FLOOR, m)
            others = (add.sum(-2, keepdim=True) - add.int()) > 0
            left_out = (share * (visit | others)).sum(-1)  # each row under what the others added
            ok = (left_out >= FLOOR).all(-1) | (m == margins[-1])
            pick = ~done & ok
            out = torch.where(pick.unsqueeze(-1), tiles | add.any(-2), out)
            done = done | pick
        return out
    # mean and bound: key tiles in descending weighted mass of the checked rows
    block = (share * weight.unsqueeze(-1)).sum(-2)
    free, order = torch.where(tiles, -1.0, block).sort(dim=-1, descending=True, stable=True)
    visit = tiles.unsqueeze(-2)
    have = (share * visit).sum(-1)
    gained = torch.where(tiles.gather(-1, order).unsqueeze(-2), 0.0, share.gather(-1, order.unsqueeze(-2).expand(share.shape)))
    kept = torch.cat([have.unsqueeze(-1), have.unsqueeze(-1) + gained.cumsum(-1)], -1)  # (B, H, nq, r, nk + 1)
    w = weight.unsqueeze(-1)
    mean = (kept * w).sum(-2)
    if how == "mean":
        enough = mean >= FLOOR + param * (1 - FLOOR)
    elif how in ("bound", "pooled", "pooled-max", "dispersion-max"):
        n = length.clamp(max=r)
        spread = ((1 - n / length).clamp(min=0) / n).sqrt().unsqueeze(-1)
        var = ((kept - mean.unsqueeze(-2)).square() * w).sum(-2) * (r / (r - 1))  # (B, H, nq, nk + 1)
        if how == "bound":
            t = student_t_quantile(param, r - 1)
        else:
            confidence, scope = param
            band = var.shape[2] if scope == "head" else scope
            if how == "dispersion-max":  # the pooled share of the largest variance m·(1 − m)
                top = (mean * (1 - mean)).clamp(min=0)
                pooled = band_mean(var, band) / band_mean(top, band).clamp(min=1e-12) * top
            else:
                pooled = band_mean(var, band)
            var = pooled if how == "pooled" else torch.maximum(pooled, var)
            nq = var.shape[2]  # each band's t has its own degrees of freedom (the last band may be short)
            last = nq % band or band
            t = torch.full((nq, 1), student_t_quantile(confidence, band * (r - 1)), dtype=var.dtype, device=var.device)
            t[nq - last:] = student_t_quantile(confidence, last * (r - 1))
        enough = mean - t * var.clamp(min=0).sqrt() * spread >= FLOOR
    else:
        raise ValueError(f"unknown repair {how!r}")
    enough[..., -1] = True
    count = enough.to(torch.int8).argmax(-1, keepdim=True)
    take = (torch.arange(free.shape[-1], device=free.device) < count) & (free >= 0)
    return tiles | torch.zeros_like(tiles).scatter(-1, order, take)


def band_mean(x: torch.Tensor, band: int) -> torch.Tensor:
    """``x`` (B, H, nq, P) averaged over bands of ``band`` consecutive query tiles (dim 2; the last band
    may be shorter), each tile given its band's mean."""
    nq = x.shape[2]
    group = torch.arange(nq, device=x.device) // band
    count = torch.zeros(int(group[-1]) + 1, device=x.device).index_add(0, group, torch.ones(nq, device=x.device))
    total = torch.zeros(*x.shape[:2], count.numel(), x.shape[3], dtype=x.dtype, device=x.device).index_add(2, group, x)
    return (total / count[:, None]).index_select(2, group)


def tile_means(mass: torch.Tensor, tiles: torch.Tensor, query_tile: int = 128):
    """((B, H, nq) each query tile's mean over all its rows of their exact kept mass, (B, H, Sq) each row's)."""
    b, h, sq, _ = mass.shape
    rows = (mass * tiles.expand(b, h, *tiles.shape[2:]).repeat_interleave(query_tile, dim=2)[:, :, :sq]).sum(-1)
    nq = tiles.shape[2]
    pad = torch.nn.functional.pad(rows, (0, nq * query_tile - sq), value=math.nan)
    return pad.reshape(b, h, nq, query_tile).nanmean(-1), rows


def evaluate(inputs: list[dict]) -> list[dict]:
    """One line per design (and the oracle) over ``inputs`` ({q, k, scale, mass, text}): the measures
    of the module's docstring."""
    cache = []
    for c in inputs:  # the rule's own tiles, per input (the same for every design)
        rule = DynamicSparsity(TAU, estimate="sampled", global_tokens=c["text"])
        cache.append(rule.select(c["q"], c["k"], scale=c["scale"]).tiles)
    lines = []
    for label, how, rows, fix, param in DESIGNS:
        dens, kept, worst = [], [], 1.0
        for c, own in zip(inputs, cache):
            mass, q = c["mass"], c["q"]
            b, h, sq, nk = mass.shape
            index, weight = placement(q, how, rows)
            read = mass.gather(2, index.reshape(b, h, -1, 1).expand(b, h, index[0, 0].numel(), nk))
            share = read.reshape(*index.shape, nk).float()
            share = share / share.sum(-1, keepdim=True)
            base = own.expand(b, h, *own.shape[2:])
            block = (share * weight.unsqueeze(-1)).sum(-2)
            base = base | sink_columns(block / block.sum(-1, keepdim=True)).unsqueeze(-2)
            length = torch.clamp(sq - torch.arange(base.shape[2]) * 128, max=128).float()
            tiles = repair(base, share, weight, fix, param, length)
            tile, row = tile_means(mass, tiles)
            dens.append(tiles.float().mean((-1, -2)).flatten())
            kept.append(tile.flatten())
            worst = min(worst, float(row.min()))
        kept_all, d = torch.cat(kept), torch.cat(dens)
        under = int((kept_all < FLOOR - 1e-4).sum())
        lines.append({"design": label, "rows": rows, "density": float(d.mean()), "kept_min": float(kept_all.min()),
                      "kept_q01": float(torch.quantile(kept_all, 0.01)), "kept_mean": float(kept_all.mean()),
                      "miss_rate": under / kept_all.numel(), "under": under, "tiles": kept_all.numel(),
                      "row_min": worst})
    oracle = []
    for c, own in zip(inputs, cache):  # the fewest tiles by exact tile mass
        mass = c["mass"]
        b, h, sq, nk = mass.shape
        nq = own.shape[2]
        pad = torch.nn.functional.pad(mass, (0, 0, 0, nq * 128 - sq))
        block = (pad.reshape(b, h, nq, 128, nk).sum(3) / torch.clamp(sq - torch.arange(nq) * 128, max=128)[:, None]).float()
        base = own.expand(b, h, nq, nk)
        oracle.append((base | cumulative_take(block, base, FLOOR + 1e-6)).float().mean((-1, -2)).flatten())
    lines.append({"design": "oracle (exact tile mass, every row)", "rows": 128, "density": float(torch.cat(oracle).mean())})
    return lines


def synthetic_inputs(specs) -> list[dict]:
    out = []
    for frames, height, width, text, seed in specs:
        grid = VideoGrid(frames, height, width, text=text, text_position="last")
        q, k, _ = video_heads(grid, HEAD_KINDS, dim=64, seed=seed)
        out.append({"q": q, "k": k, "scale": None, "mass": exact_block_mass(q, k),
                    "text": ((grid.video, grid.tokens),) if text else ()})
    return out


def learned_inputs(calls) -> list[dict]:
    return [{"q": c.q, "k": c.k, "scale": c.scale, "mass": exact_block_mass(c.q, c.k, scale=c.scale), "text": ()}
            for c in calls]


def suite_module():
    path = Path(__file__).resolve().parent / "sparse_selection_suite.py"
    spec = importlib.util.spec_from_file_location("sparse_selection_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown(result: dict) -> str:
    lines = [f"The floor's repair by design (rule: sampled τ {TAU}, sinks, floor {FLOOR}); exact fp64 attention; "
             "kept = each query tile's mean over all its rows; miss rate = query tiles under the floor.", ""]
    for name, rows in result["sets"].items():
        lines += [f"**{name}** ({result['sizes'][name]})", "",
                  "| design | rows per tile | density | kept min / 1% / mean | miss rate (tiles) | worst row |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            if "kept_min" not in r:
                lines.append(f"| {r['design']} | – | {r['density']:.3f} | – | – | – |")
                continue
            lines.append(f"| {r['design']} | {r['rows']} | {r['density']:.3f} | {r['kept_min']:.3f} / {r['kept_q01']:.3f} / "
                         f"{r['kept_mean']:.3f} | {r['miss_rate']:.4f} ({r['under']} of {r['tiles']}) | {r['row_min']:.3f} |")
        lines.append("")
    return "\n".join(lines)


@torch.no_grad()  # no graph for a measurement, and the caller's grad mode back on return
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="repair-designs")
    p.add_argument("--held-out", action="store_true", help="also other captions, latent widths and synthetic grids")
    p.add_argument("--model", default=None, help="a test-model pipeline folder or pack (default: the shipped weights)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from fp4video.harness.video_heads import capture_self_attention
    from fp4video.testmodel import HELD_OUT, TEST_MODEL_CALL, test_model_pipeline

    suite = suite_module()
    sets, sizes = {}, {}

    def run(name, inputs, what):
        sets[name] = evaluate(inputs)
        sizes[name] = what
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        (out / "designs.json").write_text(json.dumps({"sets": sets, "sizes": sizes}, indent=1))

    run("synthetic suite", synthetic_inputs([(4, 16, 32, 32, 0)]), "4×16×32 + 32 text tokens, 7 head kinds, seed 0")
    learned = argparse.Namespace(num_inference_steps=None, steps=list(suite.LEARNED_STEPS), model=args.model, captions=2,
                                 branches=["cond", "uncond"])
    calls, _, _, _ = suite.capture_learned(learned)
    run("test model", learned_inputs(calls), f"{len(calls)} calls × 4 heads: the selection suite's --test-model capture")
    if args.held_out:
        pipe = test_model_pipeline(path=args.model)
        captions = [spec.caption for spec in HELD_OUT[2:6]]
        calls = capture_self_attention(pipe, captions, steps=(3, 11), call=dict(TEST_MODEL_CALL), branches=("cond",))
        run("test model, held-out captions", learned_inputs(calls), f"{len(calls)} calls: captions 3–6, steps 3 and 11")
        calls = []
        for height, width in ((128, 144), (64, 256), (96, 208)):
            calls += capture_self_attention(pipe, [HELD_OUT[6].caption], steps=(2, 12),
                                            call=dict(TEST_MODEL_CALL, height=height, width=width), branches=("cond",))
        run("test model, other latent grids", learned_inputs(calls),
            f"{len(calls)} calls: latent grids 8×16×18, 8×8×32, 8×12×26")
        run("synthetic, other grids", synthetic_inputs([(4, 16, 32, 32, 2), (4, 16, 32, 32, 3), (8, 16, 16, 0, 0),
                                                        (6, 12, 40, 16, 1), (13, 30, 32, 0, 0)]),
            "4×16×32+32 (seeds 2, 3), 8×16×16, 6×12×40+16 (seed 1), 13×30×32")
    result = {"sets": sets, "sizes": sizes, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "designs.json").write_text(json.dumps(result, indent=1))
    (out / "designs.md").write_text(markdown(result))
    print(f"written: {out} ({result['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
