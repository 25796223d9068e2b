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
from typing import NamedTuple

import torch

__all__ = ["HEAD_KINDS", "VideoGrid", "video_heads", "exact_attention", "exact_block_mass", "oracle_selection",
           "selection_quality", "KeyTilePartials", "key_tile_partials", "partial_row_cosines", "CapturedCall",
           "capture_self_attention", "HEAD_CLASSES", "attention_structure"]

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


# --- learned attention: the self-attention inputs of the project's trained test model ---------------------


@dataclass(frozen=True)
class CapturedCall:
    """One self-attention call of a video transformer: ``q``, ``k``, ``v`` (1, H, S, D) fp32 as the call
    received them (heads first), its softmax ``scale`` (None: 1/sqrt(D)), the latent ``grid`` (frames,
    height, width) its video tokens lie on frame-major, and where it ran: ``caption`` (index), ``step``
    (denoising step), ``branch`` (``cond`` or ``uncond``: classifier-free guidance's two passes,
    in the pipeline's order), ``block``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    grid: tuple
    caption: int
    step: int
    branch: str
    block: int

    @property
    def label(self) -> str:
        return f"caption {self.caption} step {self.step} {self.branch} block {self.block}"


def capture_self_attention(pipe, captions, *, steps, call: dict, seed: int = 1000, branches=("cond", "uncond"),
                           blocks=None) -> list[CapturedCall]:
    """The q, k, v of every self-attention call of ``pipe``'s transformer blocks (``blocks``: those
    indices, None: all) at the denoising ``steps`` (indices into the schedule of ``call``, the
    pipeline's keyword arguments) for each of ``captions`` (generator seeded ``seed + i``), in the
    ``branches`` asked for. The attention runs as the pipeline's own (fp4video installed with the
    ``fp16`` policy: stock attention, an observer reading each call's inputs); the pipeline stops
    after the last asked step and decodes nothing. The grid is the transformer's latent grid
    (:func:`fp4video.integration.routing.latent_grid`)."""
    from fp4video.integration import Policy, install, uninstall
    from fp4video.integration.routing import latent_grid

    steps = sorted(set(int(s) for s in steps))
    last = steps[-1]
    captured: list[CapturedCall] = []
    seen: dict = {}  # (step, block) -> calls so far: 0 is the conditional pass, 1 the unconditional
    state = {"caption": 0, "grid": None}
    model = pipe.transformer

    def grid_hook(module, args, kwargs):
        state["grid"] = latent_grid(module, kwargs.get("hidden_states", args[0] if args else None))

    def observer(*, site, kind, call, out, ran):
        ctx_step = ctx.step
        if kind != "self" or site.block < 0 or ctx_step not in steps or (blocks is not None and site.block not in blocks):
            return
        key = (ctx_step, site.block)
        n = seen.get(key, 0)
        seen[key] = n + 1
        branch = ("cond", "uncond")[n] if n < 2 else f"pass {n}"
        if branch not in branches:
            return
        q, k, v = (t.detach().float().transpose(1, 2).contiguous().clone() for t in (call.query, call.key, call.value))
        captured.append(CapturedCall(q, k, v, call.scale, state["grid"], state["caption"], ctx_step, branch,
                                     site.block))

    def stop_after_last(p, i, t, kwargs):
        if i >= last:
            p._interrupt = True
        return {}

    ctx = install(pipe, Policy(method="fp16"), record=False)
    handle = model.register_forward_pre_hook(grid_hook, with_kwargs=True)
    ctx.observer = observer
    try:
        for i, text in enumerate(captions):
            state["caption"] = i
            seen.clear()
            with torch.no_grad():
                pipe(prompt=text, generator=torch.Generator().manual_seed(seed + i), output_type="latent",
                     callback_on_step_end=stop_after_last, **call)
    finally:
        ctx.observer = None
        handle.remove()
        uninstall(pipe)
    return captured


# --- exact attention by key tile: every selection's output from one pass --------------------------------


class KeyTilePartials(NamedTuple):
    """The exact fp64 attention of a call split by key tile: ``mass`` (B, H, Sq, nk), every row's
    softmax weight on each key tile (:func:`exact_block_mass`), and ``out`` (B, H, Sq, nk, Dv), each
    key tile's share of the row's output, ``Σ_{j in tile} p_j·v_j`` (their sum over tiles is the
    dense output). Attention restricted to a set of key tiles is ``Σ out / Σ mass`` over the set:
    the softmax over those keys alone, exactly."""

    mass: torch.Tensor
    out: torch.Tensor


def key_tile_partials(q, k, v, *, key_tile: int = 128, scale: float | None = None,
                      rows_at_once: int = 512) -> KeyTilePartials:
    """:class:`KeyTilePartials` of ``q`` (B, H, Sq, D), ``k`` (B, H, Sk, D), ``v`` (B, H, Sk, Dv) in
    fp64: one dense pass, after which any selection's output costs ``nk`` additions per row (the
    selection suites evaluate dozens of selections per call)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    sk = k.shape[2]
    nk = -(-sk // key_tile)
    pad = nk * key_tile - sk
    kd = k.double()
    vd = torch.nn.functional.pad(v.double(), (0, 0, 0, pad)).reshape(*v.shape[:2], nk, key_tile, v.shape[-1])
    masses, outs = [], []
    for r0 in range(0, q.shape[2], rows_at_once):
        p = torch.softmax((q[:, :, r0:r0 + rows_at_once].double() @ kd.transpose(-1, -2)) * scale, dim=-1)
        p = torch.nn.functional.pad(p, (0, pad)).reshape(*p.shape[:-1], nk, key_tile)  # (B, H, r, nk, kt)
        masses.append(p.sum(-1))
        outs.append(torch.einsum("bhrnt,bhntd->bhrnd", p, vd))
    return KeyTilePartials(torch.cat(masses, dim=2), torch.cat(outs, dim=2))


def partial_row_cosines(partials: KeyTilePartials, tiles: torch.Tensor, query_tile: int = 128):
    """(per-row cosine (B, H, Sq), whole-output cosine) of fp64 attention over the key tiles a
    selection ``tiles`` (bool (B|1, H|1, nq, nk) over ``query_tile`` rows) keeps, against dense fp64
    attention: :func:`selection_quality`'s cosines, from :func:`key_tile_partials` (a row that keeps
    no key gives zeros, as there)."""
    mass, out = partials
    b, h, sq, nk = mass.shape
    keep = tiles.expand(b, h, *tiles.shape[2:]).repeat_interleave(query_tile, dim=2)[:, :, :sq].double()
    kept = (mass * keep).sum(-1, keepdim=True)
    sparse = torch.einsum("bhrn,bhrnd->bhrd", keep, out) / torch.where(kept > 0, kept, 1.0)
    dense = out.sum(-2)
    cos = torch.nn.functional.cosine_similarity(sparse, dense, dim=-1)
    whole = (sparse * dense).sum() / (sparse.square().sum().sqrt() * dense.square().sum().sqrt())
    return cos, whole


# --- what a learned head attends to ------------------------------------------------------------------------

#: The classes :func:`attention_structure` gives a head: ``temporal`` (≥ 0.3 of its mass on the same
#: place, ±1 row and column, in other frames; uniform attention puts about 0.03 there), ``spatial`` (≥
#: 0.3 in its own frame, 2.4× uniform attention's 1/8 on 8 frames), ``spatio-temporal`` (both),
#: ``diffuse`` (neither, and a mean row entropy ≥ 0.9 of the uniform row's), ``mixed`` (the rest:
#: content-like or broad within a few frames).
HEAD_CLASSES = ("spatial", "temporal", "spatio-temporal", "diffuse", "mixed")
LOCAL_SHARE = 0.3
DIFFUSE_ENTROPY = 0.9


def attention_structure(q, k, grid, *, windows=(), scale: float | None = None, rows_at_once: int = 512) -> list[dict]:
    """Per head of ``q``, ``k`` (1, H, S, D) self-attention over a latent ``grid`` (frames, height,
    width; S = frames·height·width, frame-major), from exact fp64 attention, the mean over rows of:
    ``entropy`` (the row's entropy / log S: 1 = uniform), ``same_frame`` (mass in the query's frame),
    ``local`` (in its frame within ±2 rows and columns), ``temporal`` (at its place ±1 row and column
    in other frames), ``top8_keys`` (on the 8 keys with the most mass over all rows: sinks), and per
    radial window of ``windows`` (frames, rows, columns either side: :func:`fp4video.sparse.
    static_token_window`) the mass inside it (``window [f, r, c]``); ``class``: one of
    :data:`HEAD_CLASSES`."""
    from fp4video.sparse import static_token_window

    frames, height, width = grid
    n = frames * height * width
    if q.shape[0] != 1 or q.shape[2] != n or k.shape[2] != n:
        raise ValueError(f"attention_structure takes (1, H, {n}, D) self-attention over the {frames}×{height}×{width} "
                         f"grid, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    idx = torch.arange(n)
    f, y, x = idx // (height * width), idx // width % height, idx % width
    masks = {}
    masks["same_frame"] = f[:, None] == f[None, :]
    near = lambda r: ((y[:, None] - y[None, :]).abs() <= r) & ((x[:, None] - x[None, :]).abs() <= r)  # noqa: E731
    masks["local"] = masks["same_frame"] & near(2)
    masks["temporal"] = ~masks["same_frame"] & near(1)
    for w in windows:
        masks[f"window {list(w)}"] = static_token_window(frames, height, width, window=tuple(w), radial=True)
    heads = q.shape[1]
    sums = {name: torch.zeros(heads, dtype=torch.float64) for name in ("entropy", *masks)}
    columns = torch.zeros(heads, n, dtype=torch.float64)
    kd = k[0].double()
    for r0 in range(0, n, rows_at_once):
        p = torch.softmax((q[0, :, r0:r0 + rows_at_once].double() @ kd.transpose(-1, -2)) * scale, dim=-1)
        sums["entropy"] -= (p * p.clamp(min=1e-300).log()).sum((-2, -1))
        for name, m in masks.items():
            sums[name] += (p * m[r0:r0 + rows_at_once]).sum((-2, -1))
        columns += p.sum(-2)
    top8 = columns.topk(8, dim=-1).values.sum(-1) / n  # the mean row's mass on those 8 keys
    out = []
    for hd in range(heads):
        row = {name: float(val[hd] / n) for name, val in sums.items()}
        row["entropy"] /= math.log(n)
        row["top8_keys"] = float(top8[hd])
        temporal, spatial = row["temporal"] >= LOCAL_SHARE, row["same_frame"] >= LOCAL_SHARE
        row["class"] = ("spatio-temporal" if temporal and spatial else "temporal" if temporal else "spatial" if spatial
                        else "diffuse" if row["entropy"] >= DIFFUSE_ENTROPY else "mixed")
        out.append(row)
    return out
