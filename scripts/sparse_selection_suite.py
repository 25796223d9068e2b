"""Which key tiles to skip, judged against the truth: fp4video's selections beside the oracle and
SpargeAttn's on video-structured heads.

    python scripts/sparse_selection_suite.py --out sparse-suite                 # CPU: a small grid, ~2 minutes
    python scripts/sparse_selection_suite.py --device cuda --frames 13 --height 30 --width 32 --head-dim 128 \\
        --out sparse-suite                                                   # the 12,480-token grid on a GPU

Inputs: :func:`fp4video.harness.video_heads.video_heads` (spatial, temporal, content, sinks, diffuse,
text and random heads on a latent grid, text tokens last). For every selection, per head kind, from
the exact fp64 attention: its density, the true kept mass per query tile of 128 rows (min, 1%
quantile, mean) and of the worst row, the oracle's kept mass at the same number of key tiles per
query tile (selection efficiency = kept / oracle), and the cosine of fp64 attention over the kept
tiles to dense fp64 attention (whole output, worst row, 0.1% row). Rules with a floor also give
their check's miss rate: query tiles under the floor (measured on every row) that the sampled rows
did not see. SpargeAttn (``spas_sage_attn``, where installed; or its selection code alone from
``--sparge-src``, the source folder) adds its top-k selection at each fp4video selection's density
and its cdf selection at several thresholds, on its own 64-query × 128-key blocks.

Writes ``suite.json``, ``suite.md`` and ``suite.png`` (worst-row cosine against density, a panel per
head kind) into ``--out``, results as they come.

``--test-model``: the same measures on LEARNED attention, the self-attention q, k, v of the project's
trained test model (:mod:`fp4video.testmodel`: Wan's architecture, 6 blocks × 4 heads of 64, 2,048 video
tokens on an 8 × 16 × 16 latent grid) captured for ``--captions`` held-out captions at the denoising
``--steps`` (early, middle, late of ``TEST_MODEL_CALL``'s 16), every block, both guidance passes
(a call equal to one already captured, block 0's unconditional pass, is counted once)::

    python scripts/sparse_selection_suite.py --test-model --out sparse-learned      # CPU, about a quarter of an hour

Per call and head, every selection of :func:`test_model_rules` (128-row query tiles, and 64 where
the rule takes them; key tiles of 128, the kernels') against the oracle at the same number of key tiles
per query tile, measured on its own query tiles: density, true kept mass (min / 1% / mean over query
tiles, worst row), efficiency, cosine to dense fp64 (whole, worst row, 0.1% row) and the oracle's
worst-row cosine; rules with a check also give the check's own kept minimum (its sampled rows) and
how far it is from the exact mass of those rows, and with a floor the miss rate. Per block, the
attention's structure (:func:`fp4video.harness.video_heads.attention_structure`: mass inside the
radial windows, entropy, head classes). Writes ``suite.json``, ``suite.md`` and ``suite.png`` (worst-row
cosine against density, a panel per block and one of every call, the oracle beside each selection).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from fp4video.attention import selection_for
from fp4video.harness.video_heads import (HEAD_CLASSES, HEAD_KINDS, VideoGrid, attention_structure, capture_self_attention,
                                          exact_block_mass, key_tile_partials, oracle_selection, partial_row_cosines,
                                          selection_quality, video_heads)
from fp4video.sparse import DynamicSparsity, HybridSparsity, StaticSparsity


def fp4video_rules(grid: VideoGrid) -> list[tuple[str, str, object]]:
    """(family, label, rule) for every fp4video selection timed here."""
    g = dict(frames=grid.frames, height=grid.height, width=grid.width, text_tokens=grid.text, text_position="last")
    text = ((grid.video, grid.tokens),) if grid.text else ()
    rules = []
    for tau in (0.5, 0.8, 0.9, 0.95):
        rules.append(("pooled τ", f"pooled τ={tau}", DynamicSparsity(tau, global_tokens=text)))
    for tau in (0.5, 0.8, 0.9, 0.95, 0.98):
        rules.append(("sampled τ", f"sampled τ={tau}", DynamicSparsity(tau, estimate="sampled", global_tokens=text)))
    for tau in (0.5, 0.8, 0.9, 0.95, 0.98):  # rows placed on each head's queries, as the check's
        rules.append(("covering τ", f"covering τ={tau}", DynamicSparsity(tau, estimate="covering", global_tokens=text)))
    for tau in (0.8, 0.9, 0.95):
        rules.append(("covering τ + sinks", f"covering τ={tau} sinks",
                      DynamicSparsity(tau, estimate="covering", global_tokens=text, sinks=True)))
    for tau in (0.8, 0.9, 0.95):
        rules.append(("sampled τ + sinks + floor 0.9", f"sampled τ={tau} sinks floor=0.9",
                      DynamicSparsity(tau, estimate="sampled", global_tokens=text, sinks=True, floor=0.9)))
    for topk in (0.05, 0.1, 0.2, 0.4, 0.6, 0.8):  # SpargeAttn's top-k on 64-row tiles, then the check
        rules.append(("pooled top-k, 64-row tiles + sinks + floor 0.9", f"pooled top-k {topk} (64) sinks floor=0.9",
                      DynamicSparsity(None, topk=topk, min_similarity=-1.0, query_tile=64, global_tokens=text,
                                      sinks=True, floor=0.9)))
    for topk in (0.1, 0.2, 0.3):
        rules.append(("sampled top-k", f"sampled top-k {topk}", DynamicSparsity(None, topk=topk, estimate="sampled",
                                                                                global_tokens=text)))
    windows = [(1, 3, 4), (2, 6, 8), (4, 12, 16)]
    for w in windows:
        rules.append(("window", f"window {list(w)}", StaticSparsity(**g, window=w, radial=True)))
        rules.append(("window + sinks", f"window {list(w)} + sinks", StaticSparsity(**g, window=w, radial=True,
                                                                                   sinks=True)))
        rules.append(("window + sinks + floor 0.9", f"window {list(w)} + sinks, floor 0.9",
                      StaticSparsity(**g, window=w, radial=True, sinks=True, floor=0.9)))
    for w in windows[:2]:
        rules.append(("hybrid window ∪ sampled τ 0.8", f"window {list(w)} ∪ sampled τ=0.8",
                      HybridSparsity(static=StaticSparsity(**g, window=w, radial=True),
                                     dynamic=DynamicSparsity(0.8, estimate="sampled", global_tokens=text))))
    return rules


def sparge_select(src: str | None):
    """SpargeAttn's selection (:func:`fp4video.eval.peers.sparge_selection`) where installed; else,
    with ``src`` (its source folder), its selection code alone (Triton, no build); else None."""
    from fp4video.eval.peers import sparge_selection

    try:
        import spas_sage_attn.utils  # noqa: F401

        return sparge_selection
    except Exception:
        if not src:
            return None
    spec = importlib.util.spec_from_file_location("spas_sage_attn.utils", Path(src) / "spas_sage_attn" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["spas_sage_attn"] = type(sys)("spas_sage_attn")
    sys.modules["spas_sage_attn.utils"] = module
    return sparge_selection


def miss_rate(quality: dict, floor: float) -> float:
    """The share of query tiles whose true kept mass (every row) is under the floor."""
    return float((quality["tile_kept"] < floor - 1e-4).float().mean())


def run(args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = VideoGrid(args.frames, args.height, args.width, text=args.text, text_position="last")
    dev = torch.device(args.device)
    q, k, v = (t.to(dev) for t in video_heads(grid, HEAD_KINDS, dim=args.head_dim, seed=args.seed))
    print(f"{grid.tokens} tokens ({grid.frames}×{grid.height}×{grid.width} + {grid.text} text), D={args.head_dim}, "
          f"{len(HEAD_KINDS)} heads on {dev}", file=sys.stderr)
    t0 = time.perf_counter()
    rows_mass = exact_block_mass(q, k)
    print(f"exact block mass: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sparge = sparge_select(args.sparge_src) if dev.type == "cuda" else None
    results = []

    def record(family, label, tiles, query_tile, h, extra=None):
        quality = selection_quality(rows_mass[:, h:h + 1], tiles, query_tile, q=q[:, h:h + 1], k=k[:, h:h + 1],
                                    v=v[:, h:h + 1])
        row = {"head": HEAD_KINDS[h], "family": family, "selection": label,
               **{key: val for key, val in quality.items() if key != "tile_kept"}, **(extra or {})}
        if extra and extra.get("floor") is not None:
            row["miss_rate"] = miss_rate(quality, extra["floor"])
        results.append(row)
        return quality

    for family, label, rule in fp4video_rules(grid):
        sel = selection_for(rule, q, k, layout="bhsd")
        summary = {key: float(val) for key, val in sel.check.summary().items()}
        for h in range(len(HEAD_KINDS)):
            tiles = sel.tiles[:, h:h + 1] if sel.tiles.shape[1] > 1 else sel.tiles
            record(family, label, tiles, sel.query_tile, h,
                   {"floor": getattr(rule, "floor", None), "checked_kept_min": summary["kept_min"]})
            if sparge is not None and family in ("sampled τ", "covering τ", "pooled τ", "window"):
                density = float(tiles.float().mean())
                share = max(density, 1.0 / tiles.shape[-1])
                record("SpargeAttn top-k", f"SpargeAttn top-k {share:.3f} (at {label})",
                       sparge(q[:, h:h + 1], k[:, h:h + 1], topk=share), 64, h)
        print(f"  {label}", file=sys.stderr)
        (out / "suite.json").write_text(json.dumps(results, indent=1))
    if sparge is not None:
        for cdf in (0.8, 0.9, 0.95, 0.98):
            for h in range(len(HEAD_KINDS)):
                record("SpargeAttn cdf", f"SpargeAttn cdf {cdf}", sparge(q[:, h:h + 1], k[:, h:h + 1], cdf=cdf), 64, h)
    (out / "suite.json").write_text(json.dumps(results, indent=1))
    (out / "suite.md").write_text(markdown(results, grid, args))
    plot(results, out / "suite.png", f"{grid.tokens} tokens, D={args.head_dim}")
    return results


def markdown(rows, grid, args) -> str:
    head = ["head", "selection", "density", "kept min / 1% / mean", "efficiency", "worst row kept",
            "cosine", "worst-row cos", "0.1% row cos", "miss rate"]
    lines = [f"Grid {grid.frames}×{grid.height}×{grid.width} + {grid.text} text tokens, D={args.head_dim}, seed "
             f"{args.seed}; exact fp64 attention over each selection's tiles.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["head"], r["selection"], f"{r['density']:.3f}", f"{r['kept_min']:.3f} / {r['kept_q01']:.3f} / "
            f"{r['kept_mean']:.3f}", f"{r['efficiency']:.3f}", f"{r['row_min']:.3f}", f"{r['cosine']:.5f}",
            f"{r['row_cos_min']:.4f}", f"{r['row_cos_q001']:.4f}",
            "–" if r.get("miss_rate") is None else f"{r['miss_rate']:.3f}"]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(dict.fromkeys(r["head"] for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(2, (len(heads) + 1) // 2, figsize=(4.2 * ((len(heads) + 1) // 2), 7.5), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, head in zip(axes.flat, heads):
        for i, fam in enumerate(families):
            pts = sorted((r["density"], r["row_cos_min"]) for r in rows if r["head"] == head and r["family"] == fam)
            if pts:
                marker = "x" if fam.startswith("SpargeAttn") else "o"
                ax.plot(*zip(*pts), marker=marker, ms=4, lw=1, color=colours(i % 10), label=fam)
        ax.set_title(head)
        ax.set_xlabel("density")
        ax.set_ylabel("worst-row cosine to dense fp64")
        ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(heads):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=8)
    fig.suptitle(f"Selections against the truth ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- learned attention: the trained test model ------------------------------------------------------------

#: The denoising steps captured by default: early, middle and late of TEST_MODEL_CALL's 16.
LEARNED_STEPS = (0, 7, 15)
#: Radial windows (frames, rows, columns either side) on the 8 × 16 × 16 grid, narrowest first
#: (scripts/test_model_quality.py's), and the rules' floor.
LEARNED_WINDOWS = ((1, 3, 3), (2, 5, 5), (3, 8, 8))
FLOOR = 0.9


def test_model_rules(grid: tuple) -> list[tuple[str, str, object]]:
    """(family, label, rule) for every selection measured on learned self-attention over ``grid``
    (frames, height, width; no text tokens: Wan's text is in its cross-attention). Each is measured
    on its own query tiles (128 rows, or 64 where the family says so)."""
    g = dict(frames=grid[0], height=grid[1], width=grid[2], radial=True)
    rules = []
    for qt in (128, 64):
        tile = "" if qt == 128 else " (64-row tiles)"
        for tau in ((0.8, 0.9, 0.95) if qt == 128 else (0.9,)):
            rules.append((f"pooled τ{tile}", f"pooled τ={tau}{tile}", DynamicSparsity(tau, query_tile=qt)))
        for tau in ((0.8, 0.9, 0.95) if qt == 128 else ()):
            rules.append((f"sampled τ{tile}", f"sampled τ={tau}{tile}", DynamicSparsity(tau, estimate="sampled",
                                                                                      query_tile=qt)))
        for tau in ((0.8, 0.9, 0.95) if qt == 128 else ()):
            rules.append((f"covering τ{tile}", f"covering τ={tau}{tile}", DynamicSparsity(tau, estimate="covering",
                                                                                        query_tile=qt)))
        for tau in ((0.8, 0.9) if qt == 128 else ()):
            rules.append((f"covering τ + sinks + floor {FLOOR}{tile}", f"covering τ={tau} sinks floor={FLOOR}{tile}",
                          DynamicSparsity(tau, estimate="covering", sinks=True, floor=FLOOR, query_tile=qt)))
        for tau in ((0.8, 0.9, 0.95) if qt == 128 else (0.9,)):
            rules.append((f"sampled τ + sinks + floor {FLOOR}{tile}", f"sampled τ={tau} sinks floor={FLOOR}{tile}",
                          DynamicSparsity(tau, estimate="sampled", sinks=True, floor=FLOOR, query_tile=qt)))
        for topk in ((0.1, 0.2, 0.4) if qt == 128 else (0.2,)):
            rules.append((f"pooled top-k{tile}", f"pooled top-k {topk}{tile}",
                          DynamicSparsity(None, topk=topk, min_similarity=-1.0, query_tile=qt)))
        for topk in ((0.1, 0.2, 0.3) if qt == 128 else ()):
            rules.append((f"sampled top-k{tile}", f"sampled top-k {topk}{tile}",
                          DynamicSparsity(None, topk=topk, estimate="sampled", query_tile=qt)))
        for w in (LEARNED_WINDOWS if qt == 128 else LEARNED_WINDOWS[:2]):
            rules.append((f"window{tile}", f"window {list(w)}{tile}", StaticSparsity(**g, window=w, query_tile=qt)))
            rules.append((f"window + sinks{tile}", f"window {list(w)} + sinks{tile}",
                          StaticSparsity(**g, window=w, sinks=True, query_tile=qt)))
    return rules


def capture_learned(args):
    """The captured calls (:func:`capture_self_attention`) of the held-out captions, and how many
    captured calls repeated one already kept (block 0's unconditional pass: its input holds no text)."""
    from fp4video.testmodel import HELD_OUT, TEST_MODEL_CALL, test_model_pipeline

    call = dict(TEST_MODEL_CALL)
    if args.num_inference_steps is not None:
        call["num_inference_steps"] = args.num_inference_steps
    bad = [s for s in args.steps if not 0 <= s < call["num_inference_steps"]]
    if bad:
        raise SystemExit(f"--steps {bad}: outside the schedule's {call['num_inference_steps']} steps")
    pipe = test_model_pipeline(path=args.model)
    captions = [spec.caption for spec in HELD_OUT[:args.captions]]
    calls = capture_self_attention(pipe, captions, steps=args.steps, call=call, branches=tuple(args.branches))
    kept, repeats = [], 0
    for c in calls:
        if any((o.caption, o.step, o.block) == (c.caption, c.step, c.block) and torch.equal(o.q, c.q)
               and torch.equal(o.k, c.k) and torch.equal(o.v, c.v) for o in kept):
            repeats += 1
            continue
        kept.append(c)
    return kept, repeats, captions, call


def measure_call(c, rules) -> tuple[list[dict], dict]:
    """Per head of captured call ``c``, every rule's measures against the exact attention (rows of
    :func:`run_learned`'s JSON), and {label: [per head: (per-row cosines, per-tile kept mass, the
    oracle's per-row cosines)]} for the aggregates."""
    parts = key_tile_partials(c.q, c.k, c.v, scale=c.scale)
    heads = c.q.shape[1]
    rows, raw = [], {}
    for family, label, rule in rules:
        sel = selection_for(rule, c.q, c.k, scale=c.scale, layout="bhsd")
        qt = sel.query_tile
        tiles = sel.tiles.expand(1, heads, *sel.tiles.shape[2:])
        cos, whole = _per_head(parts, tiles, qt)
        counts = tiles.sum(-1)
        oracle = oracle_selection(parts.mass, counts, qt)
        oracle_cos, _ = _per_head(parts, oracle, qt)
        check = sel.check
        # the check's kept mass against the exact mass of the very rows it read, weighted as it weighs them
        nk = parts.mass.shape[-1]
        read = parts.mass.gather(2, check.sampled.reshape(1, heads, -1, 1).expand(1, heads, check.sampled[0, 0].numel(), nk))
        read = read.reshape(*check.sampled.shape, nk)
        exact_sampled = ((read * tiles.unsqueeze(-2).double()).sum(-1) * check.weight.double()).sum(-1)  # (1, H, nq)
        check_error = (check.kept.double() - exact_sampled).abs()
        raw[label] = []
        for h in range(heads):
            q = selection_quality(parts.mass[:, h:h + 1], tiles[:, h:h + 1], qt, report_tile=qt)
            row = {"caption": c.caption, "step": c.step, "branch": c.branch, "block": c.block, "head": h,
                   "family": family, "selection": label, "query_tile": qt,
                   **{k: v for k, v in q.items() if k != "tile_kept"},
                   "cosine": float(whole[h]), "row_cos_min": float(cos[0, h].min()),
                   "row_cos_q001": float(torch.quantile(cos[0, h], 0.001)),
                   "oracle_row_cos_min": float(oracle_cos[0, h].min()),
                   "checked_kept_min": float(check.kept[0, h].min()), "check_error": float(check_error[0, h].max()),
                   "call_density_before": float(check.density_before),
                   "repaired": float(check.repaired[0, h].float().mean())}
            if getattr(rule, "floor", None) is not None:
                row["miss_rate"] = float((q["tile_kept"] < rule.floor - 1e-4).float().mean())
            rows.append(row)
            raw[label].append((cos[0, h].float(), q["tile_kept"].flatten().float(), oracle_cos[0, h].float()))
    return rows, raw


def _per_head(parts, tiles, qt):
    """(per-row cosines (1, H, Sq), per-head whole-output cosines (H,)) of a selection."""
    heads = tiles.shape[1]
    cos = []
    whole = []
    for h in range(heads):
        part = type(parts)(parts.mass[:, h:h + 1], parts.out[:, h:h + 1])
        c, w = partial_row_cosines(part, tiles[:, h:h + 1], qt)
        cos.append(c)
        whole.append(float(w))
    return torch.cat(cos, dim=1), torch.tensor(whole)


def aggregate(rows: list[dict], raw: dict, key=lambda r: True) -> list[dict]:
    """One line per selection over the rows ``key`` picks: density (mean), kept min / 1% / mean over
    every query tile, worst row, efficiency (kept mean / oracle mean), cosines (mean of whole outputs,
    worst row, 0.1% quantile of rows), the oracle's worst row, and for rules with a check and a floor,
    the check's own minimum, its largest error and the miss rate."""
    out = []
    labels = list(dict.fromkeys(r["selection"] for r in rows))
    for label in labels:
        mine = [r for r in rows if r["selection"] == label]  # in the order of raw[label]
        ids = [i for i, r in enumerate(mine) if key(r)]
        if not ids:
            continue
        sel = [mine[i] for i in ids]
        cos, tk, oc = (torch.cat([raw[label][i][j] for i in ids]).double() for j in range(3))
        line = {"selection": label, "family": sel[0]["family"], "query_tile": sel[0]["query_tile"], "heads": len(sel),
                "density": sum(r["density"] for r in sel) / len(sel),
                "density_min": min(r["density"] for r in sel), "density_max": max(r["density"] for r in sel),
                "kept_min": float(tk.min()), "kept_q01": float(torch.quantile(tk, 0.01)), "kept_mean": float(tk.mean()),
                "row_min": min(r["row_min"] for r in sel),
                "efficiency": sum(r["kept_mean"] for r in sel) / sum(r["oracle_mean"] for r in sel),
                "efficiency_max": max(r["efficiency"] for r in sel),
                "cosine": sum(r["cosine"] for r in sel) / len(sel), "row_cos_min": float(cos.min()),
                "row_cos_q001": float(torch.quantile(cos, 0.001)), "oracle_row_cos_min": float(oc.min()),
                "oracle_row_cos_q001": float(torch.quantile(oc, 0.001)),
                "checked_kept_min": min(r["checked_kept_min"] for r in sel),
                "check_error": max(r["check_error"] for r in sel)}
        if "miss_rate" in sel[0]:
            line["miss_rate"] = float((tk < FLOOR - 1e-4).double().mean())
        out.append(line)
    return out


@torch.no_grad()  # no graph for a measurement, and the caller's grad mode back on return
def run_learned(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    calls, repeats, captions, call = capture_learned(args)
    capture_s = time.perf_counter() - t0
    grid = calls[0].grid
    print(f"captured {len(calls)} self-attention calls ({repeats} repeats left out) of {len(captions)} captions at steps "
          f"{args.steps} in {capture_s:.0f} s; grid {grid}, {calls[0].q.shape[1]} heads × {calls[0].q.shape[-1]}",
          file=sys.stderr)
    rules = test_model_rules(grid)
    rows, structure = [], []
    raw: dict = {label: [] for _, label, _ in rules}
    for n, c in enumerate(calls):
        t = time.perf_counter()
        for h, s in enumerate(attention_structure(c.q, c.k, c.grid, windows=LEARNED_WINDOWS, scale=c.scale)):
            structure.append({"caption": c.caption, "step": c.step, "branch": c.branch, "block": c.block, "head": h, **s})
        call_rows, call_raw = measure_call(c, rules)
        rows += call_rows
        for label, per_head in call_raw.items():
            raw[label] += per_head
        print(f"  [{n + 1}/{len(calls)}] {c.label}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    result = {
        "settings": {"captions": captions, "steps": args.steps, "branches": args.branches, "call": call,
                     "model": args.model or "shipped", "grid": list(grid), "heads": calls[0].q.shape[1],
                     "head_dim": calls[0].q.shape[-1], "calls": len(calls), "repeats_left_out": repeats,
                     "capture_seconds": round(capture_s, 1), "seconds": None},
        "all": aggregate(rows, raw),
        "per_block": {b: aggregate(rows, raw, key=lambda r, b=b: r["block"] == b) for b in sorted({c.block for c in calls})},
        "per_step": {s: aggregate(rows, raw, key=lambda r, s=s: r["step"] == s) for s in sorted({c.step for c in calls})},
        "structure": structure, "rows": rows}
    result["settings"]["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "suite.json").write_text(json.dumps(result, indent=1))
    (out / "suite.md").write_text(learned_markdown(result))
    learned_plot(result, out / "suite.png")
    print(f"written: {out} ({result['settings']['seconds']:.0f} s)", file=sys.stderr)
    return result


def learned_markdown(result: dict) -> str:
    st = result["settings"]
    lines = [f"Learned self-attention of the fp4video test model: {st['calls']} calls ({len(st['captions'])} held-out "
             f"captions × steps {st['steps']} of {st['call']['num_inference_steps']} × {len(result['per_block'])} "
             f"blocks × {'/'.join(st['branches'])}; {st['repeats_left_out']} repeated calls left out) × {st['heads']} "
             f"heads of {st['head_dim']}, {'×'.join(map(str, st['grid']))} latent grid (frame-major); exact fp64 "
             "attention; key tiles of 128; every measure on the selection's own query tiles.", ""]
    head = ["selection", "density (min–max)", "kept min / 1% / mean", "efficiency (max)", "worst row kept", "cosine",
            "worst-row cos", "0.1% row cos", "oracle worst-row cos", "check's kept min", "miss rate"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["all"]:
        lines.append("| " + " | ".join([
            r["selection"], f"{r['density']:.3f} ({r['density_min']:.2f}–{r['density_max']:.2f})",
            f"{r['kept_min']:.3f} / {r['kept_q01']:.3f} / {r['kept_mean']:.3f}",
            f"{r['efficiency']:.3f} ({r['efficiency_max']:.3f})", f"{r['row_min']:.3f}", f"{r['cosine']:.5f}",
            f"{r['row_cos_min']:.4f}", f"{r['row_cos_q001']:.4f}", f"{r['oracle_row_cos_min']:.4f}",
            f"{r['checked_kept_min']:.3f}", "–" if r.get("miss_rate") is None else f"{r['miss_rate']:.3f}"]) + " |")
    blocks = list(result["per_block"])
    lines += ["", "Per block: density / kept min (query tiles) / worst-row cosine.", "",
              "| selection | " + " | ".join(f"block {b}" for b in blocks) + " |", "|" + "---|" * (len(blocks) + 1)]
    by_block = {b: {r["selection"]: r for r in result["per_block"][b]} for b in blocks}
    for r in result["all"]:
        cells = []
        for b in blocks:
            x = by_block[b][r["selection"]]
            cells.append(f"{x['density']:.2f} / {x['kept_min']:.3f} / {x['row_cos_min']:.3f}")
        lines.append(f"| {r['selection']} | " + " | ".join(cells) + " |")
    lines += ["", structure_markdown(result["structure"])]
    return "\n".join(lines) + "\n"


def structure_markdown(structure: list[dict]) -> str:
    """Per block, the mean over calls and heads of each structure measure, and the head classes."""
    windows = [k for k in structure[0] if k.startswith("window")]
    steps = sorted({s["step"] for s in structure})
    head = ["block", *[f"mass in {w}" for w in windows], "entropy" + " (steps " + " / ".join(map(str, steps)) + ")",
            "same frame", "local (±2, same frame)", "temporal (±1, other frames)", "top-8 keys", "head classes"]
    lines = ["Attention structure per block (mean over calls and heads; exact fp64; classes over (call, head) pairs: "
             + ", ".join(HEAD_CLASSES) + ").", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sorted({s["block"] for s in structure}):
        rows = [s for s in structure if s["block"] == b]
        mean = lambda key, rs=rows: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        ent = [mean("entropy", [r for r in rows if r["step"] == st]) for st in steps]
        classes = {c: sum(r["class"] == c for r in rows) for c in HEAD_CLASSES}
        per_head = []
        for h in sorted({r["head"] for r in rows}):
            hr = [r["class"] for r in rows if r["head"] == h]
            per_head.append(max(set(hr), key=hr.count))
        lines.append("| " + " | ".join([
            str(b), *[f"{mean(w):.3f}" for w in windows], f"{mean('entropy'):.2f} (" + " / ".join(f"{e:.2f}" for e in ent) + ")",
            f"{mean('same_frame'):.3f}", f"{mean('local'):.3f}", f"{mean('temporal'):.3f}", f"{mean('top8_keys'):.3f}",
            ", ".join(f"{c} {n}" for c, n in classes.items() if n) + f" (per head, most often: {', '.join(per_head)})"]) + " |")
    return "\n".join(lines)


def learned_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"block {b}", result["per_block"][b]) for b in result["per_block"]] + [("every call", result["all"])]
    families = list(dict.fromkeys(r["family"] for r in result["all"]))
    tile64 = " (64-row tiles)"
    bases = list(dict.fromkeys(f.replace(tile64, "") for f in families))  # a family's 64-row form: its colour, dashed
    colours = plt.get_cmap("tab10")
    cols = 3
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5.0 * cols, 4.2 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels):
        for i, fam in enumerate(families):
            pts = sorted((r["density"], r["row_cos_min"]) for r in lines if r["family"] == fam)
            if pts:
                small = fam.endswith(tile64)
                ax.plot(*zip(*pts), marker="s" if small else "o", ms=4, lw=1, ls="--" if small else "-",
                        mfc="none" if small else None, color=colours(bases.index(fam.replace(tile64, "")) % 10),
                        label=fam)
        ax.scatter([r["density"] for r in lines], [r["oracle_row_cos_min"] for r in lines], marker="x", s=18,
                   color="black", label="oracle at each selection's count", zorder=3)
        ax.set_title(title)
        ax.set_xlabel("density")
        ax.set_ylabel("worst-row cosine to dense fp64")
        ax.set_xlim(0, 1.02)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    spare = list(axes.flat)[len(panels):]
    (spare[0] if spare else fig).legend(handles, labels, loc="center", fontsize=8)
    st = result["settings"]
    fig.suptitle(f"Selections on the test model's learned self-attention ({st['calls']} calls × {st['heads']} heads, "
                 f"{'×'.join(map(str, st['grid']))} grid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--text", type=int, default=32, help="text tokens (last)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sparge-src", default=None, help="SpargeAttn's source folder, for its selection alone")
    p.add_argument("--out", default="sparse-suite")
    learned = p.add_argument_group("learned attention (--test-model)")
    learned.add_argument("--test-model", action="store_true",
                         help="measure on the trained test model's self-attention instead of the synthetic heads")
    learned.add_argument("--model", default=None, help="a test-model pipeline folder or pack (default: the shipped weights)")
    learned.add_argument("--captions", type=int, default=2, help="held-out captions (HELD_OUT's first ones)")
    learned.add_argument("--steps", type=int, nargs="+", default=list(LEARNED_STEPS),
                         help="denoising steps to capture (indices into the schedule)")
    learned.add_argument("--num-inference-steps", type=int, default=None, help="default: TEST_MODEL_CALL's")
    learned.add_argument("--branches", nargs="+", default=["cond", "uncond"], choices=["cond", "uncond"],
                         help="classifier-free guidance's passes to capture")
    args = p.parse_args(argv)
    if args.test_model:
        if args.captions < 1:
            p.error(f"--captions must be at least 1, got {args.captions}")
        run_learned(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
