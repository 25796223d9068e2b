"""Does a semantic-aware token permutation make content heads sparse? CPU evidence against exact fp64
attention.

    python scripts/sparse_permutation_study.py --out permutation       # CPU: synthetic heads + test model, ~6 minutes

A block-sparse call selects (query tile × key tile) blocks of 128 × 128 tokens in the tokens' own order.
On a head that attends by content (a query attends to keys with similar features anywhere in the clip)
the heavy keys of a query tile lie in every key tile, and no selection of few tiles keeps its mass.
Sparse VideoGen 2's semantic-aware permutation (Yang et al., 2025) clusters the keys (and the queries)
of each head by k-means on their features, orders the tokens cluster by cluster, selects blocks in that
order, runs block-sparse attention on the permuted tensors and puts the output rows back in place.
Attention is unchanged by a permutation of its keys (V permuted alike) and permutes its output rows with
the queries, so the only question is how much of each row's mass the tiles of the permuted order let a
selection keep. This script measures it:

- inputs: :func:`fp4video.harness.video_heads.video_heads` (every head kind, text tokens last), and the
  trained test model's self-attention (``--captions`` held-out captions at ``--steps``, conditional pass,
  ``--blocks``), captured by ``scripts/sparse_selection_suite.py``'s :func:`capture_learned`; its heads
  are grouped by :func:`fp4video.harness.video_heads.attention_structure`'s class;
- permutations: none; per head, k-means on the video tokens' K with C clusters (``--clusters``; Lloyd's
  iterations ``--iters`` from C tokens drawn with ``--seed``; torch on the CPU), tokens ordered cluster
  by cluster (clusters by the mean position of their tokens, tokens in a cluster in their own order);
  Q ordered by its own k-means (``Q k-means``) or by the K cluster each query attends to most by the
  centroids, ``argmax_c scale·q·c + log |c|`` (``Q → K centroid``, in K's cluster order). Text tokens
  stay in place (the dynamic rule's global tokens);
- measures, per head kind and permutation, from the exact fp64 attention of the permuted tensors: at
  each of ``--densities``, the oracle (each query tile's key tiles of largest exact mass, as many as the
  density gives) and its kept mass per query tile (min / 1% quantile / mean) and of the worst row; the
  dynamic rule (:func:`fp4video.sparse.dynamic_selection`, τ ``--tau``, pooled and sampled estimates,
  unchanged, on the permuted tensors): its density, kept mass and efficiency (kept / the oracle's at the
  same count per query tile); the clustering's FLOPs against one attention call's.

Writes ``suite.json``, ``suite.md`` and ``suite.png`` (oracle kept mass against density, a panel per head
kind, each permutation a line, the dynamic rule's points) into ``--out``, and the memory passes a
permutation adds at Wan 720p (:func:`wan_memory_cost`) into ``suite.md``.
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

from fp4video.harness.video_heads import (HEAD_KINDS, VideoGrid, attention_structure, exact_block_mass,
                                          oracle_selection, selection_quality, video_heads)
from fp4video.sparse import KEY_TILE, QUERY_TILE, dynamic_selection

DENSITIES = (0.1, 0.2, 0.3, 0.5)
CLUSTERS = (8, 16, 32)
ITERS = 10
TAU = 0.9
ESTIMATES = ("pooled", "sampled")
QUERY_MODES = ("Q k-means", "Q → K centroid")
#: the test model's step captured by default: the middle of TEST_MODEL_CALL's 16
LEARNED_STEP = 7


# --- the permutation --------------------------------------------------------------------------------------


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """(H, N) int64: each row of ``x`` (H, N, D) fp32's nearest (Euclidean) of ``centroids`` (H, C, D)."""
    dist = x.square().sum(-1, keepdim=True) - 2.0 * x @ centroids.transpose(-1, -2) + \
        centroids.square().sum(-1).unsqueeze(-2)
    return dist.argmin(dim=-1)


def kmeans(x: torch.Tensor, clusters: int, *, iters: int = ITERS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per head: ``(labels (H, N) int64, centroids (H, C, D) fp32)`` of ``x`` (H, N, D),
    computed in fp32. The first centroids are k-means++'s (Arthur and Vassilvitskii, 2007: a row drawn
    at random, then each next one drawn with probability proportional to its squared distance to the
    nearest chosen; a generator seeded ``seed``): a random draw often takes two rows of one cluster and
    Lloyd's iterations then leave two clusters merged. Each of ``iters`` iterations assigns every row
    to its nearest centroid and moves each centroid to the mean of its rows (a centroid left without
    rows stays where it is). ``x`` is never modified."""
    h, n, d = x.shape
    if isinstance(clusters, bool) or not isinstance(clusters, int) or not 1 <= clusters <= n:
        raise ValueError(f"clusters must be an int in [1, {n}] (the rows clustered), got {clusters!r}")
    xf = x.float()
    gen = torch.Generator().manual_seed(seed)
    picks = [torch.randint(n, (h,), generator=gen)]
    nearest = torch.full((h, n), torch.inf)
    for _ in range(1, clusters):
        last = xf.gather(1, picks[-1][:, None, None].expand(h, 1, d))
        nearest = torch.minimum(nearest, (xf - last).square().sum(-1))
        weight = torch.where(nearest.sum(-1, keepdim=True) > 0, nearest, 1.0)  # every row equal: draw any
        picks.append(torch.multinomial(weight, 1, generator=gen).squeeze(-1))
    start = torch.stack(picks, dim=-1)  # (H, C)
    centroids = xf.gather(1, start.unsqueeze(-1).expand(h, clusters, d)).clone()
    for _ in range(iters):
        labels = assign(xf, centroids)
        sums = torch.zeros(h, clusters, d).scatter_add_(1, labels.unsqueeze(-1).expand(h, n, d), xf)
        counts = torch.zeros(h, clusters).scatter_add_(1, labels, torch.ones(h, n))
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)
    return assign(xf, centroids), centroids


def cluster_rank(labels: torch.Tensor, clusters: int) -> torch.Tensor:
    """(H, C) int64: each cluster's place when clusters are ordered by the mean position of their tokens
    (``labels`` (H, N)): neighbouring regions of a spatial head's clusters stay neighbours. A cluster
    without tokens goes last."""
    h, n = labels.shape
    pos = torch.arange(n, dtype=torch.float64).expand(h, n)
    total = torch.zeros(h, clusters, dtype=torch.float64).scatter_add_(1, labels, pos)
    count = torch.zeros(h, clusters, dtype=torch.float64).scatter_add_(1, labels, torch.ones(h, n, dtype=torch.float64))
    mean = torch.where(count > 0, total / count.clamp(min=1), math.inf)
    order = mean.argsort(dim=-1, stable=True)
    return torch.empty_like(order).scatter_(-1, order, torch.arange(clusters).expand(h, clusters).contiguous())


def grouped_order(labels: torch.Tensor, rank: torch.Tensor, tokens: int) -> torch.Tensor:
    """(H, tokens) int64 permutation: position i of the permuted tensor holds token ``perm[h, i]``. The
    ``labels.shape[1]`` labelled tokens (first) are ordered cluster by cluster in ``rank``'s order
    (each cluster's tokens in their own order); the tokens after them (text) stay in place."""
    h, n = labels.shape
    perm = rank.gather(1, labels).argsort(dim=-1, stable=True)
    rest = torch.arange(n, tokens).expand(h, tokens - n)
    return torch.cat([perm, rest], dim=-1)


def groups_in_order(labels: torch.Tensor, rank: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """(H, S) int64: the cluster place (``rank``) of the token at each position of the permuted order
    ``perm`` (H, S); the unlabelled tokens after the ``labels.shape[1]`` labelled ones form one more
    group."""
    h, n = labels.shape
    c = rank.shape[1]
    ranks = torch.cat([rank.gather(1, labels), torch.full((h, perm.shape[1] - n), c)], dim=-1)
    return ranks.gather(1, perm)


def permutations(q: torch.Tensor, k: torch.Tensor, video: int, *, clusters=CLUSTERS, iters: int = ITERS, seed: int = 0,
                 scale: float | None = None) -> list[dict]:
    """Every permutation of the study for one call (``q``, ``k`` (1, H, S, D); its first ``video`` tokens
    are permuted, the rest stay): ``{"name", "clusters", "query_mode", "key" (H, S), "query" (H, S),
    "groups" (H, S), "flops"}``: ``key`` and ``query`` the orders (position i holds token ``perm[h, i]``),
    ``groups`` the query cluster at each position of the query order (:func:`aligned_tiles`), ``flops``
    the clustering's multiply-adds × 2 per head: k-means++'s seeding (tokens × D per centroid: one
    pass's worth), Lloyd's assignments and the last one, (iters + 2) × tokens × C × D, for K and, by
    ``Q k-means``, for Q; ``Q → K centroid`` one assignment more. The first is ``none`` (the identity)."""
    h, s, d = q.shape[1:]
    scale = 1 / math.sqrt(d) if scale is None else scale
    ident = torch.arange(s).expand(h, s)
    out = [{"name": "none", "clusters": 0, "query_mode": "none", "key": ident, "query": ident,
            "groups": torch.zeros(h, s, dtype=torch.long), "flops": 0.0}]
    for c in clusters:
        k_labels, k_centroids = kmeans(k[0, :, :video], c, iters=iters, seed=seed)
        k_rank = cluster_rank(k_labels, c)
        key = grouped_order(k_labels, k_rank, s)
        pass_flops = 2.0 * video * c * d
        q_labels, _ = kmeans(q[0, :, :video], c, iters=iters, seed=seed + 1)
        q_rank = cluster_rank(q_labels, c)
        own = grouped_order(q_labels, q_rank, s)
        sizes = torch.zeros(h, c).scatter_add_(1, k_labels, torch.ones(h, video))
        logits = scale * q[0, :, :video].float() @ k_centroids.transpose(-1, -2) + sizes.log().unsqueeze(-2)
        nearest = logits.argmax(dim=-1)
        to_key = grouped_order(nearest, k_rank, s)
        out.append({"name": f"K k-means C={c}, Q k-means", "clusters": c, "query_mode": QUERY_MODES[0], "key": key,
                    "query": own, "groups": groups_in_order(q_labels, q_rank, own),
                    "flops": 2 * (iters + 2) * pass_flops})
        out.append({"name": f"K k-means C={c}, Q → K centroid", "clusters": c, "query_mode": QUERY_MODES[1],
                    "key": key, "query": to_key, "groups": groups_in_order(nearest, k_rank, to_key),
                    "flops": (iters + 3) * pass_flops})
    return out


def permute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x`` (1, H, S, D) with its tokens in ``perm`` (H, S)'s order (a new tensor)."""
    return x.gather(2, perm[None, :, :, None].expand_as(x))


# --- the measures ----------------------------------------------------------------------------------------


def aligned_tiles(groups: torch.Tensor, tile: int = QUERY_TILE) -> torch.Tensor:
    """(S,) int64: the query tile of each position when every group (``groups`` (S,), contiguous runs)
    starts a new tile and a tile holds at most ``tile`` rows: the query tiles of a kernel that pads
    each query cluster to whole tiles, so that no tile mixes clusters."""
    s = groups.shape[0]
    pos = torch.arange(s)
    change = torch.ones(s, dtype=torch.bool)
    change[1:] = groups[1:] != groups[:-1]
    start = torch.where(change, pos, 0).cummax(dim=0).values
    new = change | ((pos - start) % tile == 0)
    return new.long().cumsum(0) - 1


def aligned_oracle(mass: torch.Tensor, tile_id: torch.Tensor, count: int) -> dict:
    """The oracle on cluster-aligned query tiles (:func:`aligned_tiles`): ``mass`` (S, nk) fp64, every
    row's exact mass per key tile; each tile keeps its ``count`` key tiles of largest mean mass.
    ``{"tile_kept" (T,), "row_min", "tiles" T}``."""
    t = int(tile_id.max()) + 1
    rows = torch.zeros(t, dtype=mass.dtype).scatter_add_(0, tile_id, torch.ones_like(tile_id, dtype=mass.dtype))
    block = torch.zeros(t, mass.shape[1], dtype=mass.dtype).index_add_(0, tile_id, mass) / rows[:, None]
    keep = torch.zeros_like(block, dtype=torch.bool).scatter_(
        1, block.argsort(dim=-1, descending=True, stable=True)[:, :count], True)
    row_kept = (mass * keep[tile_id]).sum(-1)
    tile_kept = torch.zeros(t, dtype=mass.dtype).scatter_add_(0, tile_id, row_kept) / rows
    return {"tile_kept": tile_kept, "row_min": float(row_kept.min()), "tiles": t}


def tile_counts(density: float, nq: int, nk: int) -> torch.Tensor:
    """(1, 1, nq): key tiles per query tile at ``density`` (rounded, at least 1)."""
    return torch.full((1, 1, nq), max(1, round(density * nk)), dtype=torch.long)


def measure(q, k, perms, *, scale=None, densities=DENSITIES, tau=TAU, global_tokens=(), video: int | None = None) -> list[dict]:
    """Per head and permutation of ``perms`` (:func:`permutations`), from the exact fp64 attention of
    the permuted ``q``, ``k`` (1, H, S, D): ``{"head", "permutation", "oracle": {density: per-tile kept
    (nq,), worst row, density}, "dynamic": {estimate: per-tile kept, worst row, density, oracle mean at the
    same count}}``. Each call on the permuted tensors is the public rule's, unchanged. Measured on the
    query tiles of the first ``video`` rows (None: every row): text queries come last, attend broadly
    and see every key tile as global tokens."""
    heads, s = q.shape[1], q.shape[2]
    video = s if video is None else video
    nq, nk = -(-s // QUERY_TILE), -(-s // KEY_TILE)
    nv = -(-video // QUERY_TILE)
    by_key: dict = {}
    rows = []
    for p in perms:
        key_id = id(p["key"])  # the two query modes of a clustering share K's order
        kp = permute(k, p["key"])
        if key_id not in by_key:  # every row's mass per key tile depends on K's order only
            by_key = {key_id: exact_block_mass(q, kp, scale=scale)}
        mass = by_key[key_id].gather(2, p["query"][None, :, :, None].expand(1, heads, s, nk))
        qp = permute(q, p["query"])
        sels = {e: dynamic_selection(qp, kp, tau=tau, scale=scale, estimate=e, global_tokens=global_tokens).tiles
                for e in ESTIMATES}
        oracles = {d: oracle_selection(mass, tile_counts(d, nq, nk)) for d in densities}
        for h in range(heads):
            row = {"head": h, "permutation": p["name"], "clusters": p["clusters"], "query_mode": p["query_mode"],
                   "flops": p["flops"], "oracle": {}, "aligned": {}, "dynamic": {}}
            m = mass[:, h:h + 1, :video]
            tile_id = aligned_tiles(p["groups"][h, :video])
            for d, tiles in oracles.items():
                qual = selection_quality(m, tiles[:, h:h + 1, :nv])
                row["oracle"][d] = {"tile_kept": qual["tile_kept"].flatten(), "row_min": qual["row_min"],
                                    "density": qual["density"]}
                row["aligned"][d] = aligned_oracle(m[0, 0], tile_id, int(tile_counts(d, nq, nk)[0, 0, 0]))
                row["aligned"][d]["overhead"] = row["aligned"][d]["tiles"] / nv
            for e, tiles in sels.items():
                t = (tiles[:, h:h + 1] if tiles.shape[1] > 1 else tiles)[:, :, :nv]
                qual = selection_quality(m, t)
                row["dynamic"][e] = {"tile_kept": qual["tile_kept"].flatten(), "row_min": qual["row_min"],
                                     "density": qual["density"], "oracle_mean": qual["oracle_mean"]}
            rows.append(row)
    return rows


def spread(tile_kept: list[torch.Tensor]) -> dict:
    """min / 1% quantile / mean of the query tiles' kept mass, pooled over heads."""
    t = torch.cat(tile_kept).double()
    return {"min": float(t.min()), "q01": float(torch.quantile(t, 0.01)), "mean": float(t.mean())}


def summarize(rows: list[dict], kind_of, attention_flops: float) -> list[dict]:
    """One line per (head kind, permutation) over ``rows`` (:func:`measure`'s, ``kind_of(row)`` naming the
    kind): the oracle's and the dynamic rule's kept mass, pooled over the kind's heads."""
    out = []
    groups: dict = {}
    for r in rows:
        groups.setdefault((kind_of(r), r["permutation"]), []).append(r)
    for (kind, name), rs in groups.items():
        line = {"kind": kind, "permutation": name, "clusters": rs[0]["clusters"], "query_mode": rs[0]["query_mode"],
                "heads": len(rs), "flops_ratio": rs[0]["flops"] / attention_flops, "oracle": {}, "aligned": {},
                "dynamic": {}}
        for d in rs[0]["oracle"]:
            o = [r["oracle"][d] for r in rs]
            line["oracle"][str(d)] = {**spread([x["tile_kept"] for x in o]), "row_min": min(x["row_min"] for x in o),
                                      "density": sum(x["density"] for x in o) / len(o)}
        for d in rs[0]["aligned"]:
            o = [r["aligned"][d] for r in rs]
            line["aligned"][str(d)] = {**spread([x["tile_kept"] for x in o]), "row_min": min(x["row_min"] for x in o),
                                       "overhead": sum(x["overhead"] for x in o) / len(o)}
        for e in rs[0]["dynamic"]:
            o = [r["dynamic"][e] for r in rs]
            kept = spread([x["tile_kept"] for x in o])
            oracle_mean = sum(x["oracle_mean"] for x in o) / len(o)
            line["dynamic"][e] = {**kept, "row_min": min(x["row_min"] for x in o),
                                  "density": sum(x["density"] for x in o) / len(o),
                                  "efficiency": kept["mean"] / oracle_mean if oracle_mean > 0 else math.nan}
        out.append(line)
    return out


def attention_flops(tokens: int, dim: int) -> float:
    """One head's dense attention FLOPs: Q·Kᵀ and P·V, 2 × tokens² × D multiply-adds, 2 FLOPs each."""
    return 4.0 * tokens * tokens * dim


def wan_memory_cost(*, tokens: int = 75_600, heads: int = 40, dim: int = 128, element_bytes: int = 2,
                    bandwidth: float = 4e12, iters: int = ITERS, clusters: int = 32) -> dict:
    """What a standalone permutation moves at Wan 720p (B=1, bf16 by default), in bytes and in ms at
    ``bandwidth`` bytes/s: the gather of Q, K and V into the permuted order (each read and written), the
    output's un-permute (read and written), the permutation indices (int32, Q's and K's, written then
    read), and the k-means: each Lloyd iteration reads K and Q once (the assignment is a (tokens × D) ·
    (D × C) product, memory-bound at small C), ``iters`` + 1 passes each; k-means++'s seeding reads them
    once per centroid (``clusters`` passes each; a warm start from the previous step's centroids skips
    it). Also the k-means FLOPs against one attention call's."""
    tensor = tokens * heads * dim * element_bytes
    pieces = {
        "gather Q, K, V": 6 * tensor,
        "un-permute O": 2 * tensor,
        "indices": 4 * tokens * heads * 4,
        f"k-means on K and Q ({iters} iterations)": 2 * (iters + 1) * tensor,
        f"k-means++ seeding of K and Q ({clusters} clusters)": 2 * clusters * tensor,
    }
    ms = {name: b / bandwidth * 1e3 for name, b in pieces.items()}
    kmeans_flops = 2 * (iters + 2) * 2.0 * tokens * clusters * dim * heads
    return {"tokens": tokens, "heads": heads, "dim": dim, "element_bytes": element_bytes, "bandwidth": bandwidth,
            "bytes": pieces, "ms": ms, "kmeans_flops_ratio": kmeans_flops / (attention_flops(tokens, dim) * heads)}


# --- the inputs ------------------------------------------------------------------------------------------


def suite_module():
    """scripts/sparse_selection_suite.py as a module (its capture of the test model's attention)."""
    path = Path(__file__).resolve().parent / "sparse_selection_suite.py"
    spec = importlib.util.spec_from_file_location("sparse_selection_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_synthetic(args, log) -> tuple[list[dict], dict]:
    grid = VideoGrid(args.frames, args.height, args.width, text=args.text, text_position="last")
    q, k, _ = video_heads(grid, HEAD_KINDS, dim=args.head_dim, seed=args.seed)
    t0 = time.perf_counter()
    perms = permutations(q, k, grid.video, clusters=args.clusters, iters=args.iters, seed=args.seed)
    text = ((grid.video, grid.tokens),) if grid.text else ()
    rows = measure(q, k, perms, densities=args.densities, tau=args.tau, global_tokens=text, video=grid.video)
    log(f"synthetic: {grid.tokens} tokens ({grid.frames}×{grid.height}×{grid.width} + {grid.text} text), "
        f"D={args.head_dim}, {len(HEAD_KINDS)} heads: {time.perf_counter() - t0:.0f} s")
    lines = summarize(rows, lambda r: HEAD_KINDS[r["head"]], attention_flops(grid.tokens, args.head_dim))
    settings = {"grid": [grid.frames, grid.height, grid.width], "text": grid.text, "tokens": grid.tokens,
                "head_dim": args.head_dim, "seed": args.seed}
    return lines, settings


def run_learned(args, log) -> tuple[list[dict], dict]:
    suite = suite_module()
    t0 = time.perf_counter()
    capture = argparse.Namespace(num_inference_steps=None, steps=args.steps, model=args.model, captions=args.captions,
                                 branches=["cond"])
    calls, _, captions, _ = suite.capture_learned(capture)
    calls = [c for c in calls if args.blocks is None or c.block in args.blocks]
    log(f"test model: captured {len(calls)} calls in {time.perf_counter() - t0:.0f} s")
    rows = []
    for c in calls:
        t = time.perf_counter()
        classes = [s["class"] for s in attention_structure(c.q, c.k, c.grid, scale=c.scale)]
        perms = permutations(c.q, c.k, c.q.shape[2], clusters=args.clusters, iters=args.iters, seed=args.seed,
                             scale=c.scale)
        for r in measure(c.q, c.k, perms, scale=c.scale, densities=args.densities, tau=args.tau):
            r["kind"] = f"learned {classes[r['head']]}"
            rows.append(r)
        log(f"  {c.label}: {time.perf_counter() - t:.0f} s ({', '.join(classes)})")
    s, d = calls[0].q.shape[2], calls[0].q.shape[3]
    lines = summarize(rows, lambda r: r["kind"], attention_flops(s, d))
    lines += [dict(x, kind="learned, every head") for x in summarize(rows, lambda r: "all", attention_flops(s, d))]
    settings = {"captions": captions, "steps": args.steps, "branch": "cond", "blocks": sorted({c.block for c in calls}),
                "calls": len(calls), "heads": calls[0].q.shape[1], "grid": list(calls[0].grid), "tokens": s,
                "head_dim": d}
    return lines, settings


# --- the report ------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    st = result["settings"]
    lines = ["# Semantic-aware permutation against the tokens' own order", "",
             f"Exact fp64 attention; tiles of {QUERY_TILE} queries × {KEY_TILE} keys; k-means of {st['iters']} Lloyd "
             f"iterations (seed {st['seed']}); dynamic rule τ {st['tau']} (`fp4video.sparse.dynamic_selection`, "
             "defaults otherwise). Oracle: each query tile's key tiles of largest exact mass, as many as the "
             "density gives (rounded, at least 1). Kept mass per query tile: min / 1% quantile / mean over the "
             "kind's query tiles; worst row: the least any single row keeps. Clustering cost: FLOPs against one "
             "dense attention call of the same head.", ""]
    for source, title in (("synthetic", "Synthetic video heads"), ("learned", "The test model's self-attention")):
        if source not in result:
            continue
        s = result[source]["settings"]
        if source == "synthetic":
            lines += [f"## {title}", "", f"Grid {'×'.join(map(str, s['grid']))} + {s['text']} text tokens (last, kept "
                      f"in place) = {s['tokens']}, D = {s['head_dim']}, one head per kind; measured on the video "
                      "query tiles.", ""]
        else:
            lines += [f"## {title}", "", f"{s['calls']} calls (captions {len(s['captions'])}, step(s) {s['steps']}, "
                      f"conditional pass, blocks {s['blocks']}) × {s['heads']} heads, {'×'.join(map(str, s['grid']))} "
                      f"grid = {s['tokens']} tokens, D = {s['head_dim']}; heads grouped by their attention's class.", ""]
        lines += table(result[source]["lines"], st["densities"]), ""
    cost = result["wan_cost"]
    lines += ["## What a standalone permutation moves at Wan 720p", "",
              f"B = 1, H = {cost['heads']}, {cost['tokens']:,} tokens, D = {cost['dim']}, {cost['element_bytes']}-byte "
              f"elements, {cost['bandwidth'] / 1e12:.0f} TB/s.", "", "| pass | GB | ms |", "|---|---|---|"]
    for name, b in cost["bytes"].items():
        lines.append(f"| {name} | {b / 1e9:.2f} | {cost['ms'][name]:.2f} |")
    lines += [f"| total | {sum(cost['bytes'].values()) / 1e9:.2f} | {sum(cost['ms'].values()):.2f} |", "",
              f"k-means FLOPs (C = {st['wan_clusters']}) against one dense attention call: "
              f"{cost['kmeans_flops_ratio']:.2e}.", ""]
    return "\n".join(lines) + "\n"


def table(lines: list[dict], densities) -> str:
    """Three tables: the oracle on the kernels' 128-row query tiles, the oracle on cluster-aligned query
    tiles, and the dynamic rule with the clustering's cost."""
    def kept(o):
        return f"{o['min']:.3f} / {o['q01']:.3f} / {o['mean']:.3f} ({o['row_min']:.3f})"

    out = []
    head = ["kind", "permutation"] + [f"at {d}" for d in densities]
    out += ["Oracle on 128-row query tiles: kept mass per query tile min / 1% / mean (worst row).", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join([r["kind"], r["permutation"]] + [kept(r["oracle"][str(d)]) for d in densities]) + " |"
            for r in lines]
    head = ["kind", "permutation", "query tiles × 128-row tiles"] + [f"at {d}" for d in densities]
    out += ["", "Oracle on cluster-aligned query tiles (each query cluster padded to whole tiles: no tile mixes "
            "clusters; the extra tiles cost their share of compute): kept mass per query tile min / 1% / mean "
            "(worst row).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in lines:
        a = r["aligned"]
        out.append("| " + " | ".join([r["kind"], r["permutation"], f"{a[str(densities[0])]['overhead']:.3f}"]
                                     + [kept(a[str(d)]) for d in densities]) + " |")
    head = ["kind", "permutation"] + [f"{e} τ: density, kept min / 1% / mean (worst row), efficiency" for e in ESTIMATES] \
        + ["clustering / attention FLOPs"]
    out += ["", "The dynamic rule on the permuted tensors (efficiency: kept / the oracle's at the same count).", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in lines:
        cells = [r["kind"], r["permutation"]]
        for e in ESTIMATES:
            x = r["dynamic"][e]
            cells.append(f"{x['density']:.3f}, {kept(x)}, {x['efficiency']:.3f}")
        cells.append("–" if not r["clusters"] else f"{r['flops_ratio']:.4f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [r for source in ("synthetic", "learned") if source in result for r in result[source]["lines"]]
    kinds = list(dict.fromkeys(r["kind"] for r in lines))
    names = list(dict.fromkeys(r["permutation"] for r in lines))
    cols = 4
    fig, axes = plt.subplots(-(-len(kinds) // cols), cols, figsize=(4.4 * cols, 3.9 * -(-len(kinds) // cols)),
                             squeeze=False)
    colours = plt.get_cmap("viridis")
    sizes = sorted({r["clusters"] for r in lines if r["clusters"]})

    def style(r):
        if not r["clusters"]:
            return dict(color="black", lw=2.2, ls="-")
        return dict(color=colours(0.1 + 0.75 * sizes.index(r["clusters"]) / max(1, len(sizes) - 1)), lw=1.3,
                    ls="-" if r["query_mode"] == QUERY_MODES[1] else "--")

    for ax, kind in zip(axes.flat, kinds):
        for name in names:
            r = next((x for x in lines if x["kind"] == kind and x["permutation"] == name), None)
            if r is None:
                continue
            pts = sorted((o["density"], o["mean"]) for o in r["oracle"].values())
            ax.plot(*zip(*pts), marker="o", ms=3, label=name, **style(r))
            for e, marker in zip(ESTIMATES, ("^", "s")):
                x = r["dynamic"][e]
                ax.scatter([x["density"]], [x["mean"]], marker=marker, s=26, color=style(r)["color"], zorder=3,
                           facecolors="none" if e == "sampled" else None)
        ax.set_title(kind)
        ax.set_xlabel("density")
        ax.set_ylabel("kept mass, mean over query tiles")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    spare = list(axes.flat)[len(kinds):]
    for ax in spare:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    handles += [plt.Line2D([], [], marker="^", ls="", color="grey"),
                plt.Line2D([], [], marker="s", ls="", color="grey", mfc="none")]
    labels += [f"pooled τ {result['settings']['tau']} (dynamic rule)", f"sampled τ {result['settings']['tau']}"]
    (spare[0] if spare else fig).legend(handles, labels, loc="center", fontsize=7)
    fig.suptitle("Oracle kept mass against density: tokens' own order (black) and k-means permutations "
                 "(solid: Q → K centroid, dashed: Q k-means)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@torch.no_grad()  # no graph for a measurement, and the caller's grad mode back on return
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="permutation")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--text", type=int, default=32, help="text tokens (last)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clusters", type=int, nargs="+", default=list(CLUSTERS))
    p.add_argument("--iters", type=int, default=ITERS, help="Lloyd's iterations")
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    p.add_argument("--tau", type=float, default=TAU, help="the dynamic rule's cumulative share")
    p.add_argument("--no-test-model", action="store_true", help="the synthetic heads only")
    p.add_argument("--model", default=None, help="a test-model pipeline folder or pack (default: the shipped weights)")
    p.add_argument("--captions", type=int, default=2)
    p.add_argument("--steps", type=int, nargs="+", default=[LEARNED_STEP])
    p.add_argument("--blocks", type=int, nargs="+", default=None, help="test-model blocks (default: every block)")
    args = p.parse_args(argv)
    for name in ("frames", "height", "width", "head_dim", "iters", "captions"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.text < 0:
        p.error(f"--text must be at least 0, got {args.text}")
    if any(c < 1 or c > args.frames * args.height * args.width for c in args.clusters):
        p.error(f"--clusters {args.clusters}: each must be in [1, the video tokens {args.frames * args.height * args.width}]")
    if any(not 0 < d <= 1 for d in args.densities):
        p.error(f"--densities {args.densities}: each must be in (0, 1]")
    if not 0 < args.tau <= 1:
        p.error(f"--tau must be in (0, 1], got {args.tau}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    result = {"settings": {"clusters": args.clusters, "iters": args.iters, "seed": args.seed, "tau": args.tau,
                           "densities": args.densities, "wan_clusters": max(args.clusters), "seconds": None}}
    lines, settings = run_synthetic(args, log)
    result["synthetic"] = {"settings": settings, "lines": lines}
    if not args.no_test_model:
        lines, settings = run_learned(args, log)
        result["learned"] = {"settings": settings, "lines": lines}
    result["wan_cost"] = wan_memory_cost(iters=args.iters, clusters=max(args.clusters))
    result["settings"]["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "suite.json").write_text(json.dumps(result, indent=1))
    (out / "suite.md").write_text(markdown(result))
    plot(result, out / "suite.png")
    log(f"written: {out} ({result['settings']['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
