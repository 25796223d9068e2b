"""What a selection reads of Q and K: the pooled estimate of every block's attention mass (mean-pooled
Q and K, SpargeAttn's), and the exact mass of sampled query rows (the check's, and the ``sampled``
estimate's: MInference's exact attention of a few queries)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .selection import KEY_TILE, QUERY_TILE, n_tiles, positive_int

__all__ = ["MIN_SIMILARITY", "BlockEstimate", "check_qk", "check_mask", "check_scale", "tile_sums", "tile_counts",
           "tile_pool", "estimate_block_mass", "sample_rows", "covering_rows", "row_block_mass", "head_rows_mass"]

#: The default floor on a tile's mean pairwise cosine (SpargeAttn's self-similarity, K taken
#: without its mean over the live keys) under which the tile is kept instead of estimated: the
#: default of SpargeAttn's block-map function. 128 tokens in random directions score about 1/128,
#: smooth video tokens far above; SpargeAttn's attention entry points default to 0.6 and it tunes
#: the floor per head, as a calibration should per site.
MIN_SIMILARITY = 0.1

class BlockEstimate(NamedTuple):
    """What :func:`estimate_block_mass` returns: ``mass`` (B, H, nq, nk) fp32, each query tile's
    estimated attention mass per key tile (rows sum to 1 over the estimated tiles; 0 at key tiles
    not estimated; NaN in a row with nothing to estimate); ``q_similar`` (B, H, nq) and
    ``k_similar`` (B, H, nk) bool, the tiles similar enough to be estimated; ``keys`` (B|1, H|1,
    nq|1, nk) fp32, the mean number of keys a query of the tile sees in each key tile."""

    mass: torch.Tensor
    q_similar: torch.Tensor
    k_similar: torch.Tensor
    keys: torch.Tensor




def check_qk(q, k):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a 4-D (B, H, S, D) float tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.device != k.device:
        raise ValueError(f"q {tuple(q.shape)} on {q.device} and k {tuple(k.shape)} on {k.device} must share B, H, "
                         "the head dim and the device")


def check_mask(mask, q, k):
    if mask is None:
        return None
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.dim() != 4 or any(m not in (1, n) for m, n in zip(mask.shape, (b, h, sq, sk))):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk) = {(b, h, sq, sk)}")
    return mask


def tile_sums(x: torch.Tensor, dim: int, tile: int) -> torch.Tensor:
    """``x`` summed over consecutive runs of ``tile`` entries along ``dim`` (zero-padded), fp32; a
    dim of size 1 (broadcast) stays 1."""
    n = x.shape[dim]
    if n == 1:
        return x.float()
    dim = dim % x.dim()
    pad = n_tiles(n, tile) * tile - n
    if pad:
        widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
        x = torch.nn.functional.pad(x, widths)
    return x.reshape(*x.shape[:dim], -1, tile, *x.shape[dim + 1:]).sum(dim + 1, dtype=torch.float32)


def tile_counts(n: int, tile: int, device) -> torch.Tensor:
    """(ceil(n / tile),) fp32: how many of the n tokens each tile holds."""
    starts = torch.arange(n_tiles(n, tile), device=device) * tile
    return (n - starts).clamp(max=tile).float()



def check_scale(scale, d: int) -> float:
    """The softmax scale: ``scale`` (a positive finite number), or 1/sqrt(d) when None."""
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return scale


def directions(x: torch.Tensor) -> torch.Tensor:
    """``x / ‖x‖`` along the last dim in fp32, computed as ``u / ‖u‖`` with ``u = x / max|x|``: the
    same directions at any magnitude (no square underflows or overflows); a zero vector has none
    and gives 0."""
    m = x.abs().amax(dim=-1, keepdim=True)
    u = torch.where(m > 0, x / torch.where(m > 0, m, 1.0), 0.0)
    return u / torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp(min=1.0)


def tile_pool(x: torch.Tensor, tile: int, *, weight: torch.Tensor | None = None, center: torch.Tensor | None = None,
              sums: bool = True, units: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the dynamic selection reads of Q or K, per tile of ``tile`` consecutive tokens: ``(sums,
    unit_sums)``, each (B, H, n_tiles, D) fp32 (None where not asked for). ``sums``: the tokens' sum,
    ``Σ w·x``; ``unit_sums``: the sum of their directions less ``center`` (B|1, H|1, 1, D), ``Σ w·(x −
    c)/‖x − c‖`` (:func:`directions`: the same at any magnitude; a zero vector adds 0). ``weight``
    (B|1, H|1, S) 0/1 or None (all 1). ``x``: (B, H, S, D), any float dtype and strides, read as fp32
    (tokens of weight 0 are not read: they may hold anything); never modified.
    :func:`fp4video.kernels.pooling.tile_pool` computes the same in one pass over ``x`` on the GPU."""
    xf = x.float()
    w = None if weight is None else weight.to(torch.float32).expand(*x.shape[:3]).unsqueeze(-1)
    total = None
    if sums:
        total = tile_sums(xf if w is None else torch.where(w > 0, xf, 0.0), -2, tile)
    unit_total = None
    if units:
        unit = directions(xf if center is None else xf - center)
        unit_total = tile_sums(unit if w is None else torch.where(w > 0, unit, 0.0), -2, tile)
    return total, unit_total


def _similarity(unit_sums: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(B, H, n_tiles): each tile's mean pairwise cosine (self pairs included), SpargeAttn's
    ``‖Σ x̂‖² / n²``, from :func:`tile_pool`'s unit sums and the tiles' token counts; NaN for a tile
    without tokens."""
    return unit_sums.square().sum(-1) / count.square()


def _pow2_normalized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x / 2^e, e)`` with e (B, H) int64 the exponent of each head's largest |x| (x: (B, H, n, D)):
    an exact rescaling that brings the head's largest value to [0.5, 1)."""
    top = x.abs().amax(dim=(-2, -1))
    e = torch.frexp(torch.where(torch.isfinite(top) & (top > 0), top, 1.0)).exponent.to(torch.int64)
    return torch.ldexp(x, -e[..., None, None].to(x.dtype)), e


def estimate_block_mass(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                        attn_mask: torch.Tensor | None = None, query_tile: int = QUERY_TILE,
                        key_tile: int = KEY_TILE, min_similarity: float = MIN_SIMILARITY,
                        pool=tile_pool) -> BlockEstimate:
    """The estimated attention mass of every (query tile, key tile) block, from mean-pooled Q and K.

    ``q`` (B, H, Sq, D), ``k`` (B, H, Sk, D), any float dtype (computed in fp32; never modified);
    ``scale`` the call's softmax scale (default 1/sqrt(D)); ``attn_mask`` bool broadcastable to
    (B, H, Sq, Sk), True = attend. Q is pooled over a tile's rows, K over its live keys (those
    some query sees). The estimate of query tile i is ``softmax_j(scale · q̄_i·k̄_j + log n_ij)``
    with n_ij the mean number of keys of tile j a query of tile i sees (a tile of n equal keys
    holds n times one key's mass), over the key tiles that are self-similar (SpargeAttn): the mean
    pairwise cosine of a query tile's rows, or of a key tile's live keys less K's mean over the live
    keys (softmax ignores that mean; a large common mean would make every K tile look alike), is
    at least ``min_similarity``. ``pool``: :func:`tile_pool` or an implementation of it (the GPU's,
    :func:`fp4video.kernels.pooling.tile_pool`): Q and K are read through it only.
    """
    check_qk(q, k)
    mask = check_mask(attn_mask, q, k)
    query_tile, key_tile = positive_int(query_tile, "query_tile"), positive_int(key_tile, "key_tile")
    if not isinstance(min_similarity, (int, float)) or isinstance(min_similarity, bool) or not \
            -1.0 <= min_similarity <= 1.0:
        raise ValueError(f"min_similarity must be a number in [-1, 1] (a cosine), got {min_similarity!r}")
    sq, sk, d = q.shape[2], k.shape[2], q.shape[-1]
    scale = check_scale(scale, d)
    dev = q.device
    if mask is not None:  # a mask broadcast over keys says the same for each of them
        mask = mask.expand(*mask.shape[:-1], sk)

    alive = None if mask is None else mask.any(dim=-2)  # (B|1, H|1, Sk)
    live = None if alive is None else alive.float()

    q_sum, q_units = pool(q, query_tile)
    q_bar = q_sum / tile_counts(sq, query_tile, dev)[:, None]
    if live is None:
        k_count = tile_counts(sk, key_tile, dev).expand(*k.shape[:2], -1)
    else:
        k_count = tile_sums(live.expand(*k.shape[:2], sk), -1, key_tile)
    k_sum, _ = pool(k, key_tile, weight=live, units=False)
    k_bar = k_sum / k_count.clamp(min=1).unsqueeze(-1)
    # K's mean over the live keys: a large common mean would make every K tile look alike
    k_mean = k_sum.sum(-2, keepdim=True) / k_count.sum(-1).clamp(min=1)[..., None, None]
    _, k_units = pool(k, key_tile, weight=live, center=k_mean, sums=False)

    # keys seen per (query tile, key tile), averaged over the tile's queries
    if mask is None:
        keys = tile_counts(sk, key_tile, dev).reshape(1, 1, 1, -1)
    else:
        seen = tile_sums(mask, -1, key_tile)  # (B|1, H|1, Sq|1, nk)
        keys = seen if mask.shape[-2] == 1 else tile_sums(seen, -2, query_tile) / tile_counts(
            sq, query_tile, dev)[:, None]

    q_sim = _similarity(q_units, tile_counts(sq, query_tile, dev))
    k_sim = _similarity(k_units, k_count)
    q_similar = q_sim >= min_similarity
    k_similar = (k_sim >= min_similarity) | (k_count == 0)  # a tile without live keys has nothing to keep

    # scale · q̄·k̄ at any magnitude of Q and K: the pooled vectors brought to [1, 2) by powers of two
    # (exact), their product scaled back in fp64 (no fp32 underflow or overflow on the way)
    q_unit, q_exp = _pow2_normalized(q_bar)
    k_unit, k_exp = _pow2_normalized(k_bar)
    factor = torch.ldexp(torch.full_like(q_exp, scale, dtype=torch.float64), q_exp + k_exp)
    logits = ((q_unit @ k_unit.transpose(-1, -2)).double() * factor[..., None, None]).float() + torch.log(keys)
    logits = logits.masked_fill(~k_similar.unsqueeze(-2), -math.inf)
    return BlockEstimate(torch.softmax(logits, dim=-1), q_similar, k_similar, keys)



# --- exact mass of sampled query rows -------------------------------------------------------------------

_HASH = 2**31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash step (every product stays below 2^62: no int64 overflow)."""
    x = (x ^ (x >> 15)) * 1103515245 % _HASH
    return (x ^ (x >> 13)) * 1274126177 % _HASH


def sample_rows(sq: int, query_tile: int, per_tile: int, *, seed: int = 0, device=None) -> torch.Tensor:
    """(n_query_tiles, per_tile) int64: ``per_tile`` query rows of each tile of ``query_tile`` rows,
    one in each of ``per_tile`` equal strata of the tile's rows (a partial last tile's strata are
    narrower; one shorter than ``per_tile`` rows repeats rows), at a place a hash of (``seed``, tile,
    stratum) picks: the same rows for the same arguments on every device and call. Made on
    ``device`` from ``arange`` alone (no copy from the host: a CUDA graph can capture it)."""
    positive_int(sq, "sq"), positive_int(query_tile, "query_tile"), positive_int(per_tile, "per_tile")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    i = torch.arange(n_tiles(sq, query_tile), device=device, dtype=torch.int64)[:, None]
    j = torch.arange(per_tile, device=device, dtype=torch.int64)[None, :]
    length = (sq - i * query_tile).clamp(max=query_tile)
    lo = j * length // per_tile
    width = ((j + 1) * length // per_tile - lo).clamp(min=1)
    h = _mix(_mix((i * 40503 + j) % _HASH ^ seed % _HASH) + 12345)
    return i * query_tile + torch.minimum(lo + h % width, length - 1)


def covering_rows(q: torch.Tensor, query_tile: int, per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, weight)``, each (B, H, n_query_tiles, per_tile): ``per_tile`` query rows of each tile of
    ``query_tile`` rows of ``q`` (B, H, Sq, D) that cover the tile's queries, and the share of the
    tile's rows each stands for. The rows are chosen by k-center greedy (farthest-point sampling,
    Gonzalez 1985) on the query vectors: first the tile's first and last rows (the two ends of its
    span of positions; with ``per_tile`` 1, the row nearest the tile's mean query), then, in turn, the
    row farthest (Euclidean) from every row chosen so far. A row's logits move by at most
    ``scale·‖Δq‖·‖k‖`` from a chosen row's, so rows near a chosen one attend alike; spreading the
    chosen rows over the queries leaves no group of rows far from all of them. ``weight``: the share
    of the tile's rows nearest to each chosen row (ties to the first chosen), summing to 1 per tile.
    A tile of fewer rows than ``per_tile`` repeats rows (the repeats weigh 0). A row whose query is not
    finite counts as farthest (it is chosen, and its mass marks the tile). ``rows`` holds indices of
    Sq, int64; ``weight`` is fp32. Tensor operations only, on ``q``'s device (a fixed number of
    steps: a CUDA graph captures it); the distances' dot products run in ``q``'s dtype, the rest in
    fp32; ``q`` is never modified."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        raise ValueError(f"q must be a 4-D (B, H, S, D) float tensor, got {getattr(q, 'dtype', type(q).__name__)} "
                         f"of shape {tuple(getattr(q, 'shape', ()))}")
    query_tile, per_tile = positive_int(query_tile, "query_tile"), positive_int(per_tile, "per_tile")
    b, h, sq, d = q.shape
    nq = n_tiles(sq, query_tile)
    dev = q.device
    pad = nq * query_tile - sq
    x = (torch.nn.functional.pad(q, (0, 0, 0, pad)) if pad else q).reshape(b, h, nq, query_tile, d)
    # (B, H, nq, L) in fp32 (an fp64 q's norms in fp64, then fp32: vector_norm does not narrow)
    norm2 = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    norm2 = norm2.float().square()
    length = tile_counts(sq, query_tile, dev).long()  # (nq,)
    offset = torch.arange(query_tile, device=dev)
    valid = offset[None, :] < length[:, None]  # (nq, L)

    def distance(s):
        """(B, H, nq, L) squared distance of every row of the tile to its row ``s`` (B, H, nq); +inf
        where it is not finite."""
        xs = x.gather(3, s[..., None, None].expand(b, h, nq, 1, d))
        dot = (x @ xs.transpose(-1, -2)).squeeze(-1).float()
        dist = (norm2 - 2.0 * dot + norm2.gather(-1, s.unsqueeze(-1))).clamp(min=0.0)
        return torch.where(torch.isfinite(dist), dist, math.inf)

    if per_tile == 1:
        mean = (x.float() * valid[..., None]).sum(dim=-2, keepdim=True) / length[:, None, None]
        to_mean = torch.linalg.vector_norm(x.float() - mean, dim=-1)
        to_mean = torch.where(torch.isfinite(to_mean), to_mean, math.inf)
        picks = [torch.where(valid, to_mean, math.inf).argmin(dim=-1)]
    else:
        picks = [torch.zeros(b, h, nq, dtype=torch.int64, device=dev), (length - 1).expand(b, h, nq)]
    nearest = torch.full((b, h, nq, query_tile), math.inf, device=dev)
    to_chosen = []
    for step in range(per_tile):
        if step >= len(picks):  # the row farthest from every chosen one (a chosen or padding row: never)
            picks.append(torch.where(valid & (nearest > -1), nearest, -1.0).argmax(dim=-1))
        s = picks[step]
        to_chosen.append(distance(s))
        nearest = torch.minimum(nearest, to_chosen[-1]).scatter(-1, s.unsqueeze(-1), -2.0)  # chosen: never again
    chosen = torch.stack(picks[:per_tile], dim=-1)  # (B, H, nq, r) offsets in the tile
    # each row stands with its nearest chosen row: the share of the tile each chosen row stands for
    owner = torch.stack(to_chosen, dim=-1).argmin(dim=-1)  # (B, H, nq, L)
    weight = torch.zeros(b, h, nq, per_tile, device=dev).scatter_add(
        -1, owner, valid.float().expand(b, h, nq, query_tile)) / length[:, None].float()
    rows = chosen + (torch.arange(nq, device=dev) * query_tile)[:, None]
    return rows, weight


def row_block_mass(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, scale: float | None = None,
                   attn_mask: torch.Tensor | None = None, key_tile: int = KEY_TILE,
                   rows_at_once: int = 1024) -> torch.Tensor:
    """(B, H, R..., n_key_tiles) fp32: for the query rows ``rows`` (any shape R..., int64 indices of
    Sq) of ``q`` (B, H, Sq, D), the exact softmax weight each key tile of ``k`` (B, H, Sk, D) holds:
    the softmax over every key of ``scale · q·k`` (fp32 logits of the inputs' values; ``scale``
    default 1/sqrt(D)), keys ``attn_mask`` (bool, broadcastable to (B, H, Sq, Sk), True = attend)
    hides left out, summed over each tile of ``key_tile`` keys. A row's weights sum to 1; a row that
    sees no key has 0 everywhere; a row with a NaN or +Inf logit has NaN (a -Inf logit weighs nothing). ``rows_at_once`` bounds the
    memory (that many × Sk fp32 logits per batch entry and head). Nothing is read back to the host.
    :func:`fp4video.kernels.row_mass.row_block_mass` computes the same on the GPU."""
    check_qk(q, k)
    mask = check_mask(attn_mask, q, k)
    key_tile = positive_int(key_tile, "key_tile")
    positive_int(rows_at_once, "rows_at_once")
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rows must be an integer tensor of query rows, got {getattr(rows, 'dtype', type(rows).__name__)}")
    scale = check_scale(scale, q.shape[-1])
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    flat = rows.reshape(-1).to(device=q.device, dtype=torch.int64)
    kf = k.float().transpose(-1, -2)
    out = []
    for r0 in range(0, flat.numel(), rows_at_once):
        idx = flat[r0 : r0 + rows_at_once]
        logits = (q.index_select(2, idx).float() @ kf) * scale  # (B, H, r, Sk)
        bad = torch.isnan(logits) | (logits == math.inf)  # (-inf weighs nothing, as a masked key)
        if mask is not None:
            m = mask if mask.shape[-2] == 1 else mask.index_select(2, idx)
            logits = logits.masked_fill(~m, -math.inf)
            bad = bad & m
        top = logits.amax(dim=-1, keepdim=True)
        p = torch.exp(logits - torch.where(top == -math.inf, 0.0, top))
        p = p / p.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        p = torch.where(bad.any(dim=-1, keepdim=True), math.nan, p)  # a NaN or +Inf logit: the row is NaN
        out.append(tile_sums(p, -1, key_tile))
    return torch.cat(out, dim=2).reshape(b, h, *rows.shape, n_tiles(sk, key_tile))


def head_rows_mass(q: torch.Tensor, k: torch.Tensor, index: torch.Tensor, *, scale: float | None = None,
                   attn_mask: torch.Tensor | None = None, key_tile: int = KEY_TILE,
                   row_mass=row_block_mass) -> torch.Tensor:
    """(B, H, nq, r, n_key_tiles) fp32: :func:`row_block_mass` of the query rows ``index`` (B, H, nq, r),
    different rows in each head (as :func:`covering_rows` places them): the rows are gathered from
    ``q``, and from ``attn_mask`` where it has a row per query, then read by ``row_mass`` (this
    function's contract or an implementation of it, e.g. the GPU's kernel). ``attn_mask`` is the
    checked bool mask (:func:`check_mask`) or None."""
    b, h, nq, r = index.shape
    sk = k.shape[2]
    flat = index.reshape(b, h, nq * r, 1)
    q_rows = q.gather(2, flat.expand(b, h, nq * r, q.shape[-1]))
    if attn_mask is not None and attn_mask.shape[-2] != 1:  # a mask per query row: the rows' own
        attn_mask = attn_mask.expand(b, h, q.shape[2], sk).gather(2, flat.expand(b, h, nq * r, sk))
    return row_mass(q_rows, k, torch.arange(nq * r, device=q.device), scale=scale, attn_mask=attn_mask,
                    key_tile=key_tile).reshape(b, h, nq, r, -1)
