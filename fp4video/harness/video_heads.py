"""Video-structured attention inputs with known structure, and the exact measures a block-sparse
selection is judged by.

Real video DiT heads (Sparse VideoGen's study of Wan and HunyuanVideo; Radial Attention's energy
decay) are of a few kinds: **spatial** heads attend within a frame near the query, **temporal**
heads to the same place in other frames, **content** heads to tokens of the same object anywhere in
the clip, a few keys draw mass from every query (**sinks**), some heads are nearly uniform
(**diffuse**), and joint attention adds **text** tokens every video token reads. :func:`video_heads`
builds each kind on a latent grid (frames × height × width, flattened frame-major as Wan's and
HunyuanVideo's latents) from positional Fourier features (the logit between two tokens decays with
their space-time distance, each axis its own width) and object embeddings; :data:`HEAD_KINDS` names
them, ``random`` (i.i.d. Gaussian Q, K) is the worst case. :func:`exact_block_mass` and
:func:`selection_quality` give, in fp64, what a selection keeps of every row's true attention: the
oracle (each query tile's key tiles of largest exact block mass, at the selection's own count) is
the best any selection of that size can do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["HEAD_KINDS", "VideoGrid", "video_heads", "exact_attention", "exact_block_mass", "oracle_selection",
           "selection_quality"]

#: The head kinds :func:`video_heads` builds.
HEAD_KINDS = ("spatial", "temporal", "content", "sinks", "diffuse", "text", "random")


@dataclass(frozen=True)
class VideoGrid:
    """A latent video of ``frames`` × ``height`` × ``width`` tokens, ``text`` text tokens placed
    ``text_position`` (``first`` or ``last``)."""

    frames: int
    height: int
    width: int
    text: int = 0
    text_position: str = "last"

    @property
    def video(self) -> int:
        return self.frames * self.height * self.width

    @property
    def tokens(self) -> int:
        return self.video + self.text

    def positions(self) -> torch.Tensor:
        """(video, 3) fp64 (f, y, x) of the video tokens, frame-major."""
        f, y, x = torch.meshgrid(torch.arange(self.frames), torch.arange(self.height), torch.arange(self.width),
                                 indexing="ij")
        return torch.stack([f, y, x], -1).reshape(-1, 3).double()


def _fourier(pos: torch.Tensor, widths, n: int, gen) -> torch.Tensor:
    """(S, 2n) random Fourier features of a Gaussian kernel with per-axis ``widths`` (tokens):
    ``φ(p)·φ(p') ≈ exp(−Σ (p − p')² / 2w²)``, ``φ(p)·φ(p) = 1``."""
    omega = torch.randn(n, 3, generator=gen, dtype=torch.float64) / torch.tensor(widths, dtype=torch.float64)
    phase = pos @ omega.T + 2 * math.pi * torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.cat([torch.cos(phase), torch.sin(phase)], -1) / math.sqrt(n)


def _head(kind: str, grid: VideoGrid, dim: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K (video, dim) fp64 of one head of ``kind`` (scaled for a softmax scale of 1/sqrt(dim))."""
    pos = grid.positions()
    n = pos.shape[0]
    root = math.sqrt(math.sqrt(dim))  # q·k / sqrt(dim) = (root·a)·(root·b) / sqrt(dim) = a·b

    def noise(s):
        return s * torch.randn(n, dim, generator=gen, dtype=torch.float64)

    if kind == "random":
        return torch.randn(n, dim, generator=gen, dtype=torch.float64), torch.randn(n, dim, generator=gen,
                                                                                     dtype=torch.float64)
    if kind in ("spatial", "temporal", "sinks", "text"):
        widths = (0.6, 2.0, 2.0) if kind != "temporal" else (6.0, 0.7, 0.7)
        phi = _fourier(pos, widths, dim // 2, gen) * math.sqrt(14.0)  # logits up to 14 nats near the query
        q, k = phi * root + noise(0.05), phi * root + noise(0.05)
    elif kind == "content":
        # objects: blobs moving across the clip; a token of an object attends to the whole object
        objects = 5
        centre = torch.rand(objects, 2, generator=gen, dtype=torch.float64) * torch.tensor(
            [grid.height, grid.width], dtype=torch.float64)
        velocity = (torch.rand(objects, 2, generator=gen, dtype=torch.float64) - 0.5) * 2.0
        radius = max(grid.height, grid.width) / 6
        at = centre[None] + velocity[None] * pos[:, :1, None]  # (n, objects, 2) at each token's frame
        d = (pos[:, None, 1:] - at).norm(dim=-1)
        label = torch.where(d.min(-1).values <= radius, d.argmin(-1), objects)  # `objects`: background
        emb = torch.randn(objects + 1, dim, generator=gen, dtype=torch.float64)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        local = _fourier(pos, (0.6, 1.5, 1.5), dim // 2, gen) * math.sqrt(6.0)
        obj = emb[label] * math.sqrt(10.0) * (label < objects)[:, None]
        q = (obj + local) * root + noise(0.05)
        k = (obj + local) * root + noise(0.05)
    elif kind == "diffuse":
        q, k = noise(0.3), noise(0.3)
    else:
        raise ValueError(f"unknown head kind {kind!r}; allowed: {', '.join(HEAD_KINDS)}")
    if kind == "sinks":  # two keys along a direction every query shares take a large share of each row
        u = torch.randn(dim, generator=gen, dtype=torch.float64)
        u = u / u.norm()
        q = q + u * root * 2.0
        idx = torch.randperm(n, generator=gen)[:2]
        k[idx] = u * root * 6.0
    k = k + 1.5 * torch.randn(dim, generator=gen, dtype=torch.float64)  # a common K mean softmax ignores
    return q, k


def video_heads(grid: VideoGrid, kinds=HEAD_KINDS, *, dim: int = 64, seed: int = 0):
    """(q, k, v), each (1, len(kinds), grid.tokens, dim) fp32: one head per kind of :data:`HEAD_KINDS`.
    Text tokens (``grid.text``) are the same for every head: their keys draw a moderate share of every
    video row in ``text`` heads and little elsewhere; they attend broadly themselves."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks, vs = [], [], []
    n = grid.video
    first = grid.text_position == "first"
    for kind in kinds:
        q, k = _head(kind, grid, dim, gen)
        v = _fourier(grid.positions(), (2.0, 4.0, 4.0), dim // 2, gen) * math.sqrt(dim) + 0.3 * torch.randn(
            n, dim, generator=gen, dtype=torch.float64)
        if grid.text:
            t = grid.text
            tq = torch.randn(t, dim, generator=gen, dtype=torch.float64) * 0.3
            tk = torch.randn(t, dim, generator=gen, dtype=torch.float64)
            if kind == "text":  # video queries share a direction the text keys hold
                u = torch.randn(dim, generator=gen, dtype=torch.float64)
                u = u / u.norm()
                root = math.sqrt(math.sqrt(dim))
                q = q + u * root * 1.5
                tk = tk + u * root * 2.0
            tv = torch.randn(t, dim, generator=gen, dtype=torch.float64)
            join = (lambda a, b: torch.cat([b, a])) if first else (lambda a, b: torch.cat([a, b]))
            q, k, v = join(q, tq), join(k, tk), join(v, tv)
        qs.append(q), ks.append(k), vs.append(v)
    return tuple(torch.stack(x)[None].float() for x in (qs, ks, vs))


def exact_attention(q, k, v, *, scale: float | None = None, rows_at_once: int = 2048):
    """(B, H, Sq, Dv) fp64: the exact attention output, computed in chunks of rows (the weights are not
    kept: :func:`exact_block_mass` gives their tile sums)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = []
    kd, vd = k.double(), v.double()
    for r0 in range(0, q.shape[2], rows_at_once):
        p = torch.softmax((q[:, :, r0:r0 + rows_at_once].double() @ kd.transpose(-1, -2)) * scale, dim=-1)
        out.append(p @ vd)
    return torch.cat(out, dim=2)


def exact_block_mass(q, k, *, query_tile: int = 128, key_tile: int = 128, scale: float | None = None,
                     rows_at_once: int = 2048) -> torch.Tensor:
    """(B, H, Sq, nk) fp64: every query row's exact softmax weight on each key tile."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    sk = k.shape[2]
    nk = -(-sk // key_tile)
    kd = k.double()
    out = []
    for r0 in range(0, q.shape[2], rows_at_once):
        p = torch.softmax((q[:, :, r0:r0 + rows_at_once].double() @ kd.transpose(-1, -2)) * scale, dim=-1)
        p = torch.nn.functional.pad(p, (0, nk * key_tile - sk))
        out.append(p.reshape(*p.shape[:-1], nk, key_tile).sum(-1))
    return torch.cat(out, dim=2)


def _tile_mean(rows_mass: torch.Tensor, query_tile: int) -> torch.Tensor:
    """(B, H, nq, nk): the mean over each query tile's rows of ``rows_mass`` (B, H, Sq, nk)."""
    b, h, sq, nk = rows_mass.shape
    nq = -(-sq // query_tile)
    pad = torch.nn.functional.pad(rows_mass, (0, 0, 0, nq * query_tile - sq))
    counts = torch.clamp(sq - torch.arange(nq, device=rows_mass.device) * query_tile, max=query_tile).double()
    return pad.reshape(b, h, nq, query_tile, nk).sum(3) / counts[:, None]


def oracle_selection(rows_mass: torch.Tensor, counts: torch.Tensor, query_tile: int = 128) -> torch.Tensor:
    """(B, H, nq, nk) bool: per query tile, its ``counts`` (B|1, H|1, nq) key tiles of largest exact
    block mass (the mean of its rows' weight): the most any selection visiting that many keeps."""
    block = _tile_mean(rows_mass, query_tile)
    order = block.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(block.shape[-1], device=block.device).expand_as(order).contiguous())
    return rank < counts.expand(block.shape[:3]).unsqueeze(-1)


def selection_quality(rows_mass: torch.Tensor, tiles: torch.Tensor, query_tile: int = 128, *, v: torch.Tensor | None = None,
                      q: torch.Tensor | None = None, k: torch.Tensor | None = None, report_tile: int = 128) -> dict:
    """What a selection (bool ``tiles`` (B|1, H|1, nq, nk) over ``query_tile`` rows × 128 keys) keeps of
    the exact attention ``rows_mass`` (:func:`exact_block_mass`). Per query tile of ``report_tile`` rows,
    the mean over its rows of the kept weight (``tile_kept`` (B, H, n)), with its min / 1% quantile / mean
    (``kept_min``, ``kept_q01``, ``kept_mean``); the worst row (``row_min``); the oracle's kept mass at the
    same number of key tiles per query tile (``oracle_mean``, ``oracle_min``; for a selection of another
    query tile, its mean count per report tile) and ``efficiency`` = kept mean / oracle mean; ``density``.
    With ``q``, ``k``, ``v``: the fp64 attention over the kept keys against the dense one, row by row:
    ``cosine`` (whole output), ``row_cos_min`` and ``row_cos_q001`` (the 0.1% quantile)."""
    b, h, sq, nk = rows_mass.shape
    t = tiles.expand(b, h, *tiles.shape[2:])
    row_tiles = t.repeat_interleave(query_tile, dim=2)[:, :, :sq]
    row_kept = (rows_mass * row_tiles).sum(-1)
    tile_kept = _tile_mean(row_kept.unsqueeze(-1), report_tile).squeeze(-1)
    counts = _tile_mean(row_tiles.sum(-1, keepdim=True).double(), report_tile).squeeze(-1).round().long()
    oracle = oracle_selection(rows_mass, counts, report_tile)
    oracle_kept = _tile_mean((rows_mass * oracle.repeat_interleave(report_tile, dim=2)[:, :, :sq]).sum(-1, keepdim=True),
                             report_tile).squeeze(-1)
    flat = tile_kept.flatten()
    out = {
        "tile_kept": tile_kept,
        "kept_min": float(flat.min()),
        "kept_q01": float(torch.quantile(flat, 0.01)),
        "kept_mean": float(flat.mean()),
        "row_min": float(row_kept.min()),
        "oracle_mean": float(oracle_kept.mean()),
        "oracle_min": float(oracle_kept.min()),
        "efficiency": float(flat.mean() / oracle_kept.mean()),
        "density": float(t.float().mean()),
    }
    if v is not None:
        cos = _row_cosines(q, k, v, row_tiles)
        out.update(cosine=float(cos[1]), row_cos_min=float(cos[0].min()),
                   row_cos_q001=float(torch.quantile(cos[0].flatten(), 0.001)))
    return out


def _row_cosines(q, k, v, row_tiles, key_tile: int = 128, rows_at_once: int = 1024):
    """(per-row cosine (B, H, Sq), whole-output cosine) of fp64 attention over the kept key tiles
    (``row_tiles`` (B, H, Sq, nk)) against dense fp64 attention."""
    scale = 1 / math.sqrt(q.shape[-1])
    sk = k.shape[2]
    kd, vd = k.double(), v.double()
    cos, dot, na, nb = [], 0.0, 0.0, 0.0
    for r0 in range(0, q.shape[2], rows_at_once):
        s = (q[:, :, r0:r0 + rows_at_once].double() @ kd.transpose(-1, -2)) * scale
        dense = torch.softmax(s, dim=-1) @ vd
        keep = row_tiles[:, :, r0:r0 + rows_at_once].repeat_interleave(key_tile, dim=-1)[..., :sk]
        sparse = torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1).nan_to_num(0.0) @ vd
        cos.append(torch.nn.functional.cosine_similarity(sparse, dense, dim=-1))
        dot, na, nb = dot + (sparse * dense).sum(), na + sparse.square().sum(), nb + dense.square().sum()
    return torch.cat(cos, dim=2), dot / (na.sqrt() * nb.sqrt())
