#!/usr/bin/env python3
"""Block-sparse attention accuracy on inputs with video structure: per selection and method, the
estimated and the true kept mass, the density, and the cosine and worst-row cosine to fp64 dense
attention (markdown on stdout), and an accuracy-vs-density plot.

    python scripts/sparse_accuracy.py                                    # small grid, CPU, under 2 min
    python scripts/sparse_accuracy.py --frames 8 --height 16 --width 32 --taus 0.5 0.8 0.9 0.95 0.99 --json sparse.json

Inputs (:func:`video_inputs`): a latent video of frames × height × width tokens, flattened
frame-major, with ``--text`` text tokens first (joint attention). Each head's Q and K are a
RoPE-like positional code (cos/sin of the position at frequencies from fine to coarse: logits peak
at nearby tokens, so attention is spatio-temporally local) plus smooth content fields (Q's and K's
differ) plus noise, and K a mean common to all keys. Head kinds: ``local`` (sharp), ``wide``
(local plus content), ``sinks`` (as local, with a few sink keys that every query attends to) and
``diffuse`` (small logits). Text tokens are random. V is a smooth field plus noise. The ``random``
input (i.i.d. Gaussian Q, K, V) is the worst case: no structure for any selection to find.

Selections: ``dynamic τ`` (:func:`fp4video.sparse.dynamic_selection`: SpargeAttn's design, the
text as global tokens, neighbours 0) and ``static`` spatio-temporal windows
(:func:`fp4video.sparse.static_selection`, radii frames/rows/columns, ``radial``: halving with
frame distance). True kept mass: the share of each row's exact fp64 softmax weight on the kept
tiles (mean and worst row); estimated: the dynamic selection's own estimate (mean over query
tiles). Every method runs through ``fp4_attention(..., backend="reference", sparsity=...)``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from fp4video import fp4_attention
from fp4video.metrics import cossim, row_cosine
from fp4video.sparse import BlockSelection, dynamic_selection, static_selection

METHODS = ["fp16", "mxattn", "mxattn-pv8", "sage3", "fp8"]
HEAD_KINDS = ("local", "wide", "sinks", "diffuse")
#: the plot's smallest error (fp16 dense is exact to ~1e-13)
FLOOR = 1e-6


def _positions(frames: int, height: int, width: int) -> torch.Tensor:
    f, y, x = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([f, y, x], -1).reshape(-1, 3).double()


def _fourier(pos, n: int, periods, gen) -> torch.Tensor:
    """(S, 2n), rows of norm 1: cos and sin of the tokens' (f, y, x) at n frequencies (the axes in
    turn, periods log-spaced over ``periods`` tokens), each with a random phase."""
    axis = torch.arange(n) % 3
    per = torch.exp(torch.linspace(math.log(periods[0]), math.log(periods[1]), n, dtype=torch.float64))
    phase = pos[:, axis] * (2 * math.pi / per) + 2 * math.pi * torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.cat([torch.cos(phase), torch.sin(phase)], -1) / math.sqrt(n)


def _field(pos, dim: int, gen, periods=(12.0, 96.0), n: int = 24) -> torch.Tensor:
    """(S, dim): a smooth random vector field over the grid, rows of mean square norm 1."""
    x = _fourier(pos, n, periods, gen) @ (torch.randn(2 * n, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim))
    return x / x.norm(dim=-1).pow(2).mean().sqrt()


#: (positional amplitude, content amplitude) per head kind: the logits' scale
KIND = {"local": (12.0, 4.0), "wide": (8.0, 6.0), "sinks": (8.0, 4.0), "diffuse": (3.0, 3.0)}


def video_inputs(frames: int, height: int, width: int, *, text: int = 32, dim: int = 64, heads=HEAD_KINDS,
                 sinks: int = 4, seed: int = 0):
    """(q, k, v), each (1, H, text + frames·height·width, dim) fp32, text tokens first."""
    gen = torch.Generator().manual_seed(seed)
    pos = _positions(frames, height, width)
    n = pos.shape[0]
    qs, ks, vs = [], [], []
    for kind in heads:
        local, content = KIND[kind]
        r = _fourier(pos, dim // 2, (2.5, 40.0), gen) * local
        q = r + _field(pos, dim, gen) * content + 0.1 * torch.randn(n, dim, generator=gen, dtype=torch.float64)
        k = r + _field(pos, dim, gen) * content + 0.1 * torch.randn(n, dim, generator=gen, dtype=torch.float64)
        k = k + 2.0 * torch.randn(dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)
        if kind == "sinks":  # a shared query direction u; a few keys along it take a share of every row
            u = torch.randn(dim, generator=gen, dtype=torch.float64)
            u = u / u.norm()
            q = q + 2.0 * u
            idx = torch.randperm(n, generator=gen)[:sinks]
            k[idx] = 30.0 * u
        v = _field(pos, dim, gen) + 0.3 * torch.randn(n, dim, generator=gen, dtype=torch.float64)
        t = [torch.randn(text, dim, generator=gen, dtype=torch.float64) for _ in range(3)]
        qs.append(torch.cat([t[0], q])), ks.append(torch.cat([t[1], k])), vs.append(torch.cat([t[2], v]))
    return tuple(torch.stack(x)[None].float() for x in (qs, ks, vs))


def random_inputs(tokens: int, *, heads: int = 2, dim: int = 64, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, tokens, dim, generator=gen) for _ in range(3))


def _exact(q, k, v):
    """fp64 softmax weights P (B, H, S, S) and the dense output."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, dim=-1)
    return p, p @ v.double()


def evaluate(name, q, k, v, selections, methods, rows):
    p, ref = _exact(q, k, v)
    done = {}  # bitmap -> accuracy: a selection equal to an earlier one gives the same outputs
    for label, sel in selections:
        kept = (p * sel.token_mask()).sum(-1)  # (B, H, S): each row's exact weight on the kept tiles
        row = {"input": name, "selection": label, "density": float(sel.density()),
               "estimated": None if sel.estimated_mass is None else float(sel.estimated_mass.mean()),
               "true": float(kept.mean()), "true_worst": float(kept.min())}
        key = (tuple(sel.tiles.shape), tuple(sel.tiles.flatten().tolist()))
        if key not in done:
            done[key] = {}
            for m in methods:
                out = fp4_attention(q, k, v, method=m, backend="reference", sparsity=sel)
                done[key][m] = (cossim(out, ref), float(row_cosine(out, ref).min()))
        row.update(done[key])
        rows.append(row)
        print(f"  {name} {label}: density {row['density']:.3f}", file=sys.stderr)


def markdown(rows, methods) -> str:
    head = ["input", "selection", "density", "est. kept", "true kept", "true kept (worst row)"] + \
        [f"{m} cos (worst row)" for m in methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        est = "–" if r["estimated"] is None else f"{r['estimated']:.4f}"
        cells = [r["input"], r["selection"], f"{r['density']:.3f}", est, f"{r['true']:.4f}", f"{r['true_worst']:.4f}"]
        cells += [f"{r[m][0]:.5f} ({r[m][1]:.4f})" for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, methods, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = list(dict.fromkeys(r["input"] for r in rows))
    fig, axes = plt.subplots(len(inputs), 2, figsize=(12, 4.2 * len(inputs)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(inputs):
        for j, (which, label) in enumerate([(0, "1 − cosine to fp64 dense"), (1, "1 − worst-row cosine to fp64 dense")]):
            ax = axes[i][j]
            for c, m in enumerate(methods):
                pts = [r for r in rows if r["input"] == name]
                err = lambda r: max(1 - r[m][which], FLOOR)  # noqa: E731
                dyn = sorted((r["density"], err(r)) for r in pts if not r["selection"].startswith("static"))
                sta = [(r["density"], err(r)) for r in pts if r["selection"].startswith("static")]
                ax.plot(*zip(*dyn), "o-", color=colors[c % len(colors)], label=f"{m} (dynamic τ, dense)")
                if sta:
                    ax.plot(*zip(*sta), "s", color=colors[c % len(colors)], mfc="none", ms=8,
                            label=f"{m} (static windows)")
            ax.set_yscale("log")
            ax.set_ylim(FLOOR / 2, 2)
            ax.set_xlabel("density (share of key tiles visited)")
            ax.set_ylabel(f"{label} (log, floor {FLOOR:g})")
            ax.set_title(f"{name} inputs")
            ax.ticklabel_format(axis="x", useOffset=False, style="plain")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--height", type=int, default=8)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--text", type=int, default=32, help="text tokens before the video tokens (global)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.5, 0.9, 0.99])
    ap.add_argument("--windows", nargs="+", default=["1,4,4", "2,4,4"],
                    help="static windows: frames,rows,columns radii[,radial]")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--random-heads", type=int, default=1, help="heads of the random (worst-case) input; 0: none")
    ap.add_argument("--plot", type=Path, default=Path("sparse-accuracy.png"))
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    start = time.time()
    q, k, v = video_inputs(args.frames, args.height, args.width, text=args.text, dim=args.dim)
    n = q.shape[2]
    text = ((0, args.text),) if args.text else ()

    def selections(q, k):
        sels = [("dense", BlockSelection.dense(n, n))]
        sels += [(f"dynamic τ={t:g}", dynamic_selection(q, k, tau=t, global_tokens=text)) for t in args.taus]
        for w in args.windows:
            parts = w.split(",")
            radial = parts[-1] == "radial"
            if len(parts) != 3 + radial:
                ap.error(f"--windows: {w!r} is not frames,rows,columns[,radial]")
            sel = static_selection(args.frames, args.height, args.width, window=tuple(int(x) for x in parts[:3]),
                                   text_tokens=args.text, radial=radial)
            sels.append((f"static {'×'.join(parts[:3])}{' radial' if radial else ''}", sel))
        return sels

    rows = []
    evaluate("video", q, k, v, selections(q, k), args.methods, rows)
    if args.random_heads:
        qr, kr, vr = random_inputs(n, heads=args.random_heads, dim=args.dim)
        evaluate("random", qr, kr, vr, selections(qr, kr), args.methods, rows)
    heads = ", ".join(HEAD_KINDS)
    print(f"Inputs: {args.frames}×{args.height}×{args.width} latent tokens + {args.text} text tokens = {n} tokens, "
          f"head dim {args.dim}; video heads: {heads}; random: {args.random_heads} head(s) of i.i.d. Gaussians. "
          "Tiles of 128 queries × 128 keys. Cosine over the whole output (worst row in brackets) to fp64 dense "
          "attention.\n")
    print(markdown(rows, args.methods))
    title = (f"Block-sparse attention, {args.frames}×{args.height}×{args.width} (+{args.text} text) tokens, "
             "tiles 128 × 128")
    plot(rows, args.methods, args.plot, title)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {args.plot}{' and ' + str(args.json) if args.json else ''} ({time.time() - start:.0f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
