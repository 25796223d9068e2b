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
from fp4video.harness.video_heads import HEAD_KINDS, VideoGrid, exact_block_mass, selection_quality, video_heads
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
    for tau in (0.8, 0.9, 0.95):
        rules.append(("sampled τ + sinks + floor 0.9", f"sampled τ={tau} sinks floor=0.9",
                      DynamicSparsity(tau, estimate="sampled", global_tokens=text, sinks=True, floor=0.9)))
    for topk in (0.05, 0.1, 0.2, 0.4, 0.6, 0.8):  # SpargeAttn's top-k on 64-row tiles, then the check
        rules.append(("pooled top-k, 64-row tiles + sinks + floor 0.9", f"pooled top-k {topk} (64) sinks floor=0.9",
                      DynamicSparsity(None, topk=topk, min_similarity=-1.0, query_tile=64, global_tokens=text,
                                      sinks=True, floor=0.9, check_rows=1)))
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
            if sparge is not None and family in ("sampled τ", "pooled τ", "window"):
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
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
