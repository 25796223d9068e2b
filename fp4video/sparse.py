"""Block-sparse attention: which key tiles each query tile visits.

A selection is a bool bitmap ``tiles`` (B|1, H|1, n_query_tiles, n_key_tiles) over tiles of
``query_tile`` query rows and ``key_tile`` keys (:class:`BlockSelection`). The reference
(:func:`fp4video.reference.attention_tiled` with ``key_tiles=``) computes a method's exact numerics
over the visited tiles only; a block-sparse kernel honours the same bitmap (the contract is
:class:`BlockSelection`'s docstring). Two ways to choose the tiles, one definition of each:

**Dynamic** (:func:`dynamic_selection`), the design of SpargeAttn (Zhang et al., "SpargeAttn:
Accurate Sparse Attention Accelerating Any Model Inference", ICML 2025): Q and K are mean-pooled
per tile; the softmax of the pooled logits, each key tile weighted by how many keys it holds for
the tile's queries, estimates the attention mass of every (query tile, key tile) block. Each query
tile keeps its always-kept tiles, then key tiles in descending order of estimated mass until a
share τ of its estimated mass is kept (SpargeAttn's cumulative "TopCdf" rule). As in SpargeAttn,
a tile whose tokens point in too many directions for their mean to stand for them (mean pairwise
cosine below ``min_similarity``) is not estimated but kept: a query tile visits every key tile, a
key tile is visited by every query tile. Always kept besides: the tiles holding a query tile's own
tokens and their neighbours (video attention is local: Sparse VideoGen's spatial heads, Radial
Attention's diagonal band), global tokens such as the text of joint attention, and leading sink
tiles (SpargeAttn's ``attention_sink``).

**Static** (:func:`static_selection`): a spatio-temporal window on the latent grid (frames ×
height × width, flattened frame-major as Wan and HunyuanVideo flatten their latents), optionally
narrowing with frame distance as in Radial Attention (Li et al., "Radial Attention: O(n log n)
Sparse Attention with Energy Decay for Long Video Generation", 2025): the spatial window halves
each time the frame distance doubles. Text tokens, first or last, are global.

Both are computed with tensor operations only: no value is read back to the host, so a CUDA graph
can capture the selection with the call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .reference import KEY_TILE

__all__ = [
    "QUERY_TILE",
    "KEY_TILE",
    "MIN_SIMILARITY",
    "BlockSelection",
    "tile_lists",
    "BlockEstimate",
    "estimate_block_mass",
    "tile_pool",
    "dynamic_selection",
    "static_selection",
    "static_token_window",
    "DynamicSparsity",
    "StaticSparsity",
    "resolve_sparsity",
]

#: Query rows per tile of a selection: a multiple of every loop's rows per program (64 or 128), so a
#: program reads one bitmap row.
QUERY_TILE = 128
#: The default floor on a tile's mean pairwise cosine (SpargeAttn's self-similarity, K taken
#: without its mean over the live keys) under which the tile is kept instead of estimated: the
#: default of SpargeAttn's block-map function. 128 tokens in random directions score about 1/128,
#: smooth video tokens far above; SpargeAttn's attention entry points default to 0.6 and it tunes
#: the floor per head, as a calibration should per site.
MIN_SIMILARITY = 0.1


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _tiles(n: int, tile: int) -> int:
    return -(-n // tile)


@dataclass(frozen=True, eq=False)
class BlockSelection:
    """Which key tiles each query tile visits.

    ``tiles``: bool (B|1, H|1, ceil(sq / query_tile), ceil(sk / key_tile)), True = visit; a
    batch or head dim of 1 applies to every batch entry or head. ``sq``/``sk``: the query and key
    counts it was made for. ``estimated_mass`` (dynamic selections): (B|1, H|1, n_query_tiles)
    fp32, the share of its estimated mass each query tile keeps (1 where it keeps every tile).

    The contract a block-sparse loop honours: the program of batch b, head h and rows
    [r0, r0 + BLOCK_M) (``query_tile % BLOCK_M == 0``, so the rows lie in one query tile
    i = r0 // query_tile) visits the key tiles j with ``tiles[b, h, i, j]`` (indices of size 1
    read as 0), in ascending j, and no other: each is ``key_tile / BLOCK_N`` tiles of the loop
    (:meth:`for_tiles` re-tiles a selection to a smaller query or key tile). A tile not visited
    leaves the running max, the row sum and the accumulator as they are; masks apply within
    visited tiles as in a dense call; a row that visits no live key gives zeros and LSE -inf. The
    pre-pass (K's mean, block and tensor scales) is the dense one, over every live key. With every
    tile visited the call is bit for bit the dense call. :meth:`tile_lists` gives the same
    selection as per-row lists of key-tile indices.
    """

    tiles: torch.Tensor
    sq: int
    sk: int
    query_tile: int = QUERY_TILE
    key_tile: int = KEY_TILE
    estimated_mass: torch.Tensor | None = None

    def __post_init__(self):
        t = self.tiles
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise TypeError(f"BlockSelection.tiles must be a bool tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        for name in ("sq", "sk", "query_tile", "key_tile"):
            _positive_int(getattr(self, name), f"BlockSelection.{name}")
        want = (_tiles(self.sq, self.query_tile), _tiles(self.sk, self.key_tile))
        if t.dim() != 4 or tuple(t.shape[-2:]) != want:
            raise ValueError(f"BlockSelection.tiles has shape {tuple(t.shape)}, expected (B|1, H|1, {want[0]}, "
                             f"{want[1]}) for {self.sq} queries in tiles of {self.query_tile} and {self.sk} keys in "
                             f"tiles of {self.key_tile}")
        e = self.estimated_mass
        if e is not None and (not isinstance(e, torch.Tensor) or tuple(e.shape) != tuple(t.shape[:3])):
            raise ValueError(f"BlockSelection.estimated_mass must be a tensor of shape {tuple(t.shape[:3])}, got "
                             f"{tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__}")

    @property
    def n_query_tiles(self) -> int:
        return self.tiles.shape[-2]

    @property
    def n_key_tiles(self) -> int:
        return self.tiles.shape[-1]

    @classmethod
    def dense(cls, sq: int, sk: int, *, batch: int = 1, heads: int = 1, query_tile: int = QUERY_TILE,
              key_tile: int = KEY_TILE, device=None) -> "BlockSelection":
        """Every tile visited (density 1)."""
        _positive_int(query_tile, "query_tile"), _positive_int(key_tile, "key_tile")
        shape = (batch, heads, _tiles(sq, query_tile), _tiles(sk, key_tile))
        return cls(torch.ones(shape, dtype=torch.bool, device=device), sq, sk, query_tile, key_tile)

    def density(self) -> torch.Tensor:
        """The share of (query tile, key tile) pairs visited, over every batch entry and head:
        what a block-sparse loop's time follows. A 0-d fp32 tensor on the selection's device (no
        read-back; ``float()`` it to print)."""
        return self.tiles.float().mean()

    def density_per_head(self) -> torch.Tensor:
        """(B|1, H|1) fp32: :meth:`density` of each batch entry and head."""
        return self.tiles.float().mean(dim=(-2, -1))

    def expand(self, batch: int, heads: int) -> "BlockSelection":
        """The selection for a call of ``batch`` × ``heads`` (a view; its dims must be 1 or equal)."""
        b, h = self.tiles.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"a selection for (B, H) = ({b}, {h}) does not apply to ({batch}, {heads})")
        shape = (batch, heads, *self.tiles.shape[2:])
        est = None if self.estimated_mass is None else self.estimated_mass.expand(shape[:3])
        return BlockSelection(self.tiles.expand(shape), self.sq, self.sk, self.query_tile, self.key_tile, est)

    def for_tiles(self, query_tile: int, key_tile: int) -> "BlockSelection":
        """The same selection over smaller tiles that divide these (a loop's BLOCK_M rows, its key
        tile): every sub-tile visits what its tile visits."""
        _positive_int(query_tile, "query_tile"), _positive_int(key_tile, "key_tile")
        if self.query_tile % query_tile or self.key_tile % key_tile:
            raise ValueError(f"tiles of {query_tile} queries × {key_tile} keys do not divide the selection's "
                             f"{self.query_tile} × {self.key_tile}")
        nq, nk = _tiles(self.sq, query_tile), _tiles(self.sk, key_tile)
        t = self.tiles.repeat_interleave(self.query_tile // query_tile, dim=-2)[..., :nq, :]
        t = t.repeat_interleave(self.key_tile // key_tile, dim=-1)[..., :nk]
        est = None
        if self.estimated_mass is not None:
            est = self.estimated_mass.repeat_interleave(self.query_tile // query_tile, dim=-1)[..., :nq]
        return BlockSelection(t, self.sq, self.sk, query_tile, key_tile, est)

    def token_mask(self) -> torch.Tensor:
        """(B|1, H|1, sq, sk) bool: True where the query's tile visits the key's tile (for tests and
        small calls: it holds sq × sk values per head)."""
        t = self.tiles.repeat_interleave(self.query_tile, dim=-2)[..., : self.sq, :]
        return t.repeat_interleave(self.key_tile, dim=-1)[..., : self.sk]

    def tile_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The selection as lists (:func:`tile_lists`)."""
        return tile_lists(self.tiles)

    def check_call(self, batch: int, heads: int, sq: int, sk: int, device) -> None:
        """ValueError unless the selection applies to a call of this shape on ``device``."""
        b, h = self.tiles.shape[:2]
        if b not in (1, batch) or h not in (1, heads):
            raise ValueError(f"sparsity: the selection is for (B, H) = ({b}, {h}), the call has ({batch}, {heads})")
        if (self.sq, self.sk) != (sq, sk):
            raise ValueError(f"sparsity: the selection is for {self.sq} queries and {self.sk} keys, the call has "
                             f"{sq} and {sk}")
        if self.tiles.device != torch.device(device):
            raise ValueError(f"sparsity: the selection is on {self.tiles.device}, q on {device}")


def tile_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection bitmap ``tiles`` (..., nq, nk) as lists: ``(index, count)``, ``index`` int32
    (..., nq, nk) holding each query tile's visited key tiles in ascending order, then the others
    (ascending); ``count`` int32 (..., nq) how many it visits. A block-sparse loop reads
    ``index[..., i, :count[..., i]]``. Tensor operations only (a cumulative sum and a scatter, no
    sort, nothing read back)."""
    n = tiles.shape[-1]
    kept = tiles.to(torch.int32)
    count = kept.sum(dim=-1, dtype=torch.int32)
    before = kept.cumsum(dim=-1, dtype=torch.int32)  # visited tiles up to and including j
    # visited tile j goes to position (visited before it); an unvisited one after every visited one
    j = torch.arange(1, n + 1, device=tiles.device, dtype=torch.int32)
    position = torch.where(tiles, before - 1, count.unsqueeze(-1) + (j - before) - 1)
    index = torch.empty_like(position)
    index.scatter_(-1, position.long(), (j - 1).expand_as(position).contiguous())
    return index, count


# --- dynamic: estimated block mass from pooled Q and K -------------------------------------------------


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


def _check_qk(q, k):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a 4-D (B, H, S, D) float tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.device != k.device:
        raise ValueError(f"q {tuple(q.shape)} on {q.device} and k {tuple(k.shape)} on {k.device} must share B, H, "
                         "the head dim and the device")


def _check_mask(mask, q, k):
    if mask is None:
        return None
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}")
    if mask.dim() != 4 or any(m not in (1, n) for m, n in zip(mask.shape, (b, h, sq, sk))):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Sk) = {(b, h, sq, sk)}")
    return mask


def _tile_sums(x: torch.Tensor, dim: int, tile: int) -> torch.Tensor:
    """``x`` summed over consecutive runs of ``tile`` entries along ``dim`` (zero-padded), fp32; a
    dim of size 1 (broadcast) stays 1."""
    n = x.shape[dim]
    if n == 1:
        return x.float()
    dim = dim % x.dim()
    pad = _tiles(n, tile) * tile - n
    if pad:
        widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
        x = torch.nn.functional.pad(x, widths)
    return x.reshape(*x.shape[:dim], -1, tile, *x.shape[dim + 1:]).sum(dim + 1, dtype=torch.float32)


def _tile_counts(n: int, tile: int, device) -> torch.Tensor:
    """(ceil(n / tile),) fp32: how many of the n tokens each tile holds."""
    starts = torch.arange(_tiles(n, tile), device=device) * tile
    return (n - starts).clamp(max=tile).float()


def tile_pool(x: torch.Tensor, tile: int, *, weight: torch.Tensor | None = None, center: torch.Tensor | None = None,
              sums: bool = True, units: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the dynamic selection reads of Q or K, per tile of ``tile`` consecutive tokens: ``(sums,
    unit_sums)``, each (B, H, n_tiles, D) fp32 (None where not asked for). ``sums``: the tokens' sum,
    ``Σ w·x``; ``unit_sums``: the sum of their directions less ``center`` (B|1, H|1, 1, D), ``Σ w·(x −
    c)/‖x − c‖`` (a zero vector has none and adds 0). ``weight`` (B|1, H|1, S) 0/1 or None (all 1).
    ``x``: (B, H, S, D), any float dtype and strides, read as fp32 (tokens of weight 0 are not read:
    they may hold anything); never modified.
    :func:`fp4video.kernels.pooling.tile_pool` computes the same in one pass over ``x`` on the GPU."""
    xf = x.float()
    w = None if weight is None else weight.to(torch.float32).expand(*x.shape[:3]).unsqueeze(-1)
    total = None
    if sums:
        total = _tile_sums(xf if w is None else torch.where(w > 0, xf, 0.0), -2, tile)
    unit_total = None
    if units:
        c = xf if center is None else xf - center
        unit = c / torch.linalg.vector_norm(c, dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        unit_total = _tile_sums(unit if w is None else torch.where(w > 0, unit, 0.0), -2, tile)
    return total, unit_total


def _similarity(unit_sums: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(B, H, n_tiles): each tile's mean pairwise cosine (self pairs included), SpargeAttn's
    ``‖Σ x̂‖² / n²``, from :func:`tile_pool`'s unit sums and the tiles' token counts; NaN for a tile
    without tokens."""
    return unit_sums.square().sum(-1) / count.square()


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
    _check_qk(q, k)
    mask = _check_mask(attn_mask, q, k)
    query_tile, key_tile = _positive_int(query_tile, "query_tile"), _positive_int(key_tile, "key_tile")
    if not isinstance(min_similarity, (int, float)) or isinstance(min_similarity, bool) or not \
            -1.0 <= min_similarity <= 1.0:
        raise ValueError(f"min_similarity must be a number in [-1, 1] (a cosine), got {min_similarity!r}")
    sq, sk, d = q.shape[2], k.shape[2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    dev = q.device
    if mask is not None:  # a mask broadcast over keys says the same for each of them
        mask = mask.expand(*mask.shape[:-1], sk)

    alive = None if mask is None else mask.any(dim=-2)  # (B|1, H|1, Sk)
    live = None if alive is None else alive.float()

    q_sum, q_units = pool(q, query_tile)
    q_bar = q_sum / _tile_counts(sq, query_tile, dev)[:, None]
    if live is None:
        k_count = _tile_counts(sk, key_tile, dev).expand(*k.shape[:2], -1)
    else:
        k_count = _tile_sums(live.expand(*k.shape[:2], sk), -1, key_tile)
    k_sum, _ = pool(k, key_tile, weight=live, units=False)
    k_bar = k_sum / k_count.clamp(min=1).unsqueeze(-1)
    # K's mean over the live keys: a large common mean would make every K tile look alike
    k_mean = k_sum.sum(-2, keepdim=True) / k_count.sum(-1).clamp(min=1)[..., None, None]
    _, k_units = pool(k, key_tile, weight=live, center=k_mean, sums=False)

    # keys seen per (query tile, key tile), averaged over the tile's queries
    if mask is None:
        keys = _tile_counts(sk, key_tile, dev).reshape(1, 1, 1, -1)
    else:
        seen = _tile_sums(mask, -1, key_tile)  # (B|1, H|1, Sq|1, nk)
        keys = seen if mask.shape[-2] == 1 else _tile_sums(seen, -2, query_tile) / _tile_counts(
            sq, query_tile, dev)[:, None]

    q_sim = _similarity(q_units, _tile_counts(sq, query_tile, dev))
    k_sim = _similarity(k_units, k_count)
    q_similar = q_sim >= min_similarity
    k_similar = (k_sim >= min_similarity) | (k_count == 0)  # a tile without live keys has nothing to keep

    logits = (q_bar * scale) @ k_bar.transpose(-1, -2) + torch.log(keys)
    logits = logits.masked_fill(~k_similar.unsqueeze(-2), -math.inf)
    return BlockEstimate(torch.softmax(logits, dim=-1), q_similar, k_similar, keys)


def _always_kept(sq: int, sk: int, query_tile: int, key_tile: int, neighbours, global_tokens,
                 sink_tiles: int, device) -> torch.Tensor:
    """(1, 1, nq, nk) bool: the tiles kept whatever the estimate (neighbourhood, global, sinks)."""
    nq, nk = _tiles(sq, query_tile), _tiles(sk, key_tile)
    q_lo = torch.arange(nq, device=device) * query_tile
    q_hi = (q_lo + query_tile).clamp(max=sq)
    k_lo = torch.arange(nk, device=device) * key_tile
    k_hi = (k_lo + key_tile).clamp(max=sk)
    keep = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if neighbours is not None:  # key tiles within `neighbours` tiles of the query tile's own tokens
        reach = neighbours * key_tile
        keep |= (k_lo[None, :] < q_hi[:, None] + reach) & (k_hi[None, :] > q_lo[:, None] - reach)
    for start, stop in global_tokens:
        keep |= ((k_lo < stop) & (k_hi > start))[None, :]  # every query sees global keys
        keep |= ((q_lo < stop) & (q_hi > start))[:, None]  # global queries see every key
    keep[:, :sink_tiles] = True
    return keep[None, None]


def _check_global_tokens(global_tokens, n: int | None = None) -> tuple[tuple[int, int], ...]:
    """``global_tokens`` as a tuple of (start, stop) ranges within ``n`` tokens (any n when None)."""
    try:
        items = list(global_tokens)
    except TypeError:
        raise ValueError(f"global_tokens must be a sequence of (start, stop) token ranges, got {global_tokens!r}") from None
    ranges = []
    for r in items:
        ok = isinstance(r, (tuple, list)) and len(r) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in r) and 0 <= r[0] < r[1]
        if not ok or (n is not None and r[1] > n):
            raise ValueError(f"global_tokens: {r!r} is not a (start, stop) range with 0 <= start < stop"
                             f"{'' if n is None else f' <= {n} (the tokens of the call)'}")
        ranges.append((r[0], r[1]))
    return tuple(ranges)


def dynamic_selection(q: torch.Tensor, k: torch.Tensor, *, tau: float, scale: float | None = None,
                      attn_mask: torch.Tensor | None = None, neighbours: int | None = 0,
                      global_tokens=(), sink_tiles: int = 0, min_similarity: float = MIN_SIMILARITY,
                      query_tile: int = QUERY_TILE, key_tile: int = KEY_TILE, pool=tile_pool) -> BlockSelection:
    """The dynamic selection (SpargeAttn's design; see the module docstring) for a call on ``q``
    (B, H, Sq, D) and ``k`` (B, H, Sk, D) with ``scale`` and ``attn_mask`` as the call's.

    Each query tile keeps, first, its always-kept tiles: ``neighbours`` (None: none; 0: the key
    tiles holding its own tokens; r: those within r key tiles of them; needs Sq == Sk), the key
    tiles holding ``global_tokens`` ((start, stop) token ranges; a query tile holding one keeps
    every key tile), the first ``sink_tiles`` key tiles, every key tile when the query tile is not
    self-similar, and every key tile that is not (:func:`estimate_block_mass`). Then, while its kept
    estimated mass is below ``tau``, the key tile of largest estimated mass it does not keep yet;
    ``tau`` >= 1 keeps every tile. A query tile whose estimate is not finite (no key visible, NaN
    or Inf inputs) keeps every tile. A larger ``tau`` keeps a superset. ``pool``: how Q and K are
    read (:func:`estimate_block_mass`).
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be a number in (0, 1], the share of estimated mass each query tile keeps; got {tau!r}")
    _check_qk(q, k)
    sq, sk = q.shape[2], k.shape[2]
    if neighbours is not None:
        if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
            raise ValueError(f"neighbours must be None or an int >= 0 (key tiles either side), got {neighbours!r}")
        if sq != sk:
            raise ValueError(f"neighbours needs self-attention (Sq == Sk), got Sq {sq} and Sk {sk}; pass "
                             "neighbours=None for cross-attention")
    if isinstance(sink_tiles, bool) or not isinstance(sink_tiles, int) or sink_tiles < 0:
        raise ValueError(f"sink_tiles must be an int >= 0, got {sink_tiles!r}")
    ranges = _check_global_tokens(global_tokens, max(sq, sk))
    est = estimate_block_mass(q, k, scale=scale, attn_mask=attn_mask, query_tile=query_tile, key_tile=key_tile,
                              min_similarity=min_similarity, pool=pool)
    mass = est.mass
    unknown = ~torch.isfinite(mass).all(dim=-1, keepdim=True)  # (B, H, nq, 1)
    mass = torch.where(torch.isfinite(mass), mass, 0.0)
    forced = (_always_kept(sq, sk, query_tile, key_tile, neighbours, ranges, sink_tiles, q.device)
              | ~est.k_similar.unsqueeze(-2) | ~est.q_similar.unsqueeze(-1) | unknown)
    if tau >= 1:
        tiles = torch.ones_like(forced)
    else:
        kept = (mass * forced).sum(dim=-1, keepdim=True)
        free, order = torch.where(forced, -1.0, mass).sort(dim=-1, descending=True, stable=True)
        free = free.clamp(min=0)
        before = torch.cat([torch.zeros_like(free[..., :1]), free.cumsum(dim=-1)[..., :-1]], dim=-1)
        take = torch.zeros_like(forced).scatter(-1, order, kept + before < tau)
        tiles = forced | take
    share = torch.where(unknown.squeeze(-1), 1.0, (mass * tiles).sum(dim=-1))
    return BlockSelection(tiles, sq, sk, query_tile, key_tile, share)


# --- static: a spatio-temporal window on the latent grid ----------------------------------------------


def _check_grid(frames, height, width, window, text_tokens, text_position, radial):
    for name, v in (("frames", frames), ("height", height), ("width", width)):
        _positive_int(v, name)
    try:
        w = tuple(window)
    except TypeError:
        w = ()
    if len(w) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in w):
        raise ValueError(f"window must be three ints >= 0 (frames, rows, columns either side), got {window!r}")
    if isinstance(text_tokens, bool) or not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    if text_position not in ("first", "last"):
        raise ValueError(f"text_position must be 'first' or 'last', got {text_position!r}")
    if not isinstance(radial, bool):
        raise ValueError(f"radial must be a bool, got {radial!r}")
    return w


def _spatial_radius(radius: int, distance: int, radial: bool) -> int:
    """The spatial half-width at a frame distance: halved each time the distance doubles (radial)."""
    return radius >> max(distance, 1).bit_length() - 1 if radial else radius


def static_selection(frames: int, height: int, width: int, *, window=(1, 8, 8), text_tokens: int = 0,
                     text_position: str = "first", radial: bool = False, query_tile: int = QUERY_TILE,
                     key_tile: int = KEY_TILE, device=None, query_tiles_at_once: int = 64) -> BlockSelection:
    """The static selection of self-attention over a latent video of ``frames`` × ``height`` ×
    ``width`` tokens flattened frame-major (token ``(f·height + y)·width + x``), with
    ``text_tokens`` more ``text_position`` ``"first"`` or ``"last"`` (joint attention). (1, 1, nq, nk).

    Video token (f, y, x) sees video token (f', y', x') when ``|f − f'| <= window[0]``, ``|y − y'|
    <= r_y`` and ``|x − x'| <= r_x`` with ``(r_y, r_x) = window[1:]``, or with ``radial`` those halved
    each time the frame distance d doubles (``r >> floor(log2 d)`` for d >= 1, Radial Attention's
    energy decay); text tokens see and are seen by every token (:func:`static_token_window` is this
    per token). A query tile visits a key tile when one of its tokens sees one of the key tile's.
    ``query_tiles_at_once`` bounds the memory (that many × frames·height·width values).
    """
    w = _check_grid(frames, height, width, window, text_tokens, text_position, radial)
    query_tile, key_tile = _positive_int(query_tile, "query_tile"), _positive_int(key_tile, "key_tile")
    _positive_int(query_tiles_at_once, "query_tiles_at_once")
    video = frames * height * width
    n = video + text_tokens
    nq, nk = _tiles(n, query_tile), _tiles(n, key_tile)
    first = text_position == "first"
    offset = text_tokens if first else 0
    pos = torch.arange(video, device=device) + offset
    q_tile = (pos // query_tile).reshape(frames, height, width)
    tiles = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    wf = min(w[0], frames - 1)
    for i0 in range(0, nq, query_tiles_at_once):
        ids = torch.arange(i0, min(i0 + query_tiles_at_once, nq), device=device)
        occ = (q_tile == ids[:, None, None, None]).float()  # (n, F, H, W): the tiles' own video tokens
        reach = torch.zeros_like(occ)
        for dist in range(wf + 1):
            ry = min(_spatial_radius(w[1], dist, radial), height - 1)
            rx = min(_spatial_radius(w[2], dist, radial), width - 1)
            grown = torch.nn.functional.max_pool2d(occ.reshape(-1, 1, height, width), (2 * ry + 1, 2 * rx + 1),
                                                   stride=1, padding=(ry, rx)).reshape(occ.shape)
            if dist == 0:
                reach = torch.maximum(reach, grown)
            else:  # key frame f' = f ± dist
                reach[:, dist:] = torch.maximum(reach[:, dist:], grown[:, :-dist])
                reach[:, :-dist] = torch.maximum(reach[:, :-dist], grown[:, dist:])
        keys = torch.nn.functional.pad(reach.reshape(len(ids), -1), (offset, n - video - offset))  # (n_ids, n)
        tiles[i0 : i0 + len(ids)] = _tile_sums(keys, -1, key_tile) > 0
    if text_tokens:  # text rows and columns: every tile holding a text token
        text = (0, text_tokens) if first else (video, n)
        tiles |= _always_kept(n, n, query_tile, key_tile, None, (text,), 0, device)[0, 0]
    return BlockSelection(tiles[None, None], n, n, query_tile, key_tile)


def static_token_window(frames: int, height: int, width: int, *, window=(1, 8, 8), text_tokens: int = 0,
                        text_position: str = "first", radial: bool = False, device=None) -> torch.Tensor:
    """(n, n) bool, the window of :func:`static_selection` token by token (True = the query token
    sees the key token): for tests and small grids (n² values)."""
    w = _check_grid(frames, height, width, window, text_tokens, text_position, radial)
    video = frames * height * width
    n = video + text_tokens
    idx = torch.arange(video, device=device)
    f, y, x = idx // (height * width), idx // width % height, idx % width
    df = (f[:, None] - f[None, :]).abs()
    band = sum((df >= 2**e).long() for e in range(1, max(frames, 2).bit_length()))  # floor(log2 d), d >= 1
    ry = torch.as_tensor(w[1], device=device) >> band if radial else w[1]
    rx = torch.as_tensor(w[2], device=device) >> band if radial else w[2]
    sees = (df <= w[0]) & ((y[:, None] - y[None, :]).abs() <= ry) & ((x[:, None] - x[None, :]).abs() <= rx)
    out = torch.ones(n, n, dtype=torch.bool, device=device)
    lo = text_tokens if text_position == "first" else 0
    out[lo : lo + video, lo : lo + video] = sees
    return out


# --- specifications: a selection rule, applied per call ----------------------------------------------


@dataclass(frozen=True)
class DynamicSparsity:
    """A dynamic selection rule (:func:`dynamic_selection`'s arguments), applied to each call's Q and K."""

    tau: float
    neighbours: int | None = 0
    global_tokens: tuple = ()
    sink_tiles: int = 0
    min_similarity: float = MIN_SIMILARITY
    query_tile: int = QUERY_TILE
    key_tile: int = KEY_TILE

    def __post_init__(self):
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau must be a number in (0, 1], got {self.tau!r}")
        object.__setattr__(self, "global_tokens", _check_global_tokens(self.global_tokens))

    def select(self, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, pool=tile_pool) -> BlockSelection:
        return dynamic_selection(q, k, tau=self.tau, scale=scale, attn_mask=attn_mask, neighbours=self.neighbours,
                                 global_tokens=self.global_tokens, sink_tiles=self.sink_tiles,
                                 min_similarity=self.min_similarity, query_tile=self.query_tile,
                                 key_tile=self.key_tile, pool=pool)


@dataclass(frozen=True)
class StaticSparsity:
    """A static selection rule (:func:`static_selection`'s arguments): the same tiles for every call
    over this latent grid, computed once per device (the calls share the bitmap: do not write to it)."""

    frames: int
    height: int
    width: int
    window: tuple = (1, 8, 8)
    text_tokens: int = 0
    text_position: str = "first"
    radial: bool = False
    query_tile: int = QUERY_TILE
    key_tile: int = KEY_TILE

    def __post_init__(self):
        object.__setattr__(self, "window", _check_grid(self.frames, self.height, self.width, self.window,
                                                       self.text_tokens, self.text_position, self.radial))

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width + self.text_tokens

    def select(self, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None) -> BlockSelection:
        """The selection for a self-attention call over this grid (``scale`` and ``attn_mask`` play no part)."""
        _check_qk(q, k)
        if not q.shape[2] == k.shape[2] == self.tokens:
            raise ValueError(f"a static window over {self.frames}×{self.height}×{self.width} latent tokens "
                             f"+ {self.text_tokens} text tokens needs Sq = Sk = {self.tokens}, got "
                             f"{q.shape[2]} and {k.shape[2]}")
        return _static_for(self, str(q.device))


@functools.lru_cache(maxsize=16)
def _static_for(rule: StaticSparsity, device: str) -> BlockSelection:
    """A static rule's selection on a device, computed once: every call over the grid uses the same
    bitmap (a loop only reads it)."""
    return static_selection(rule.frames, rule.height, rule.width, window=rule.window, text_tokens=rule.text_tokens,
                            text_position=rule.text_position, radial=rule.radial, query_tile=rule.query_tile,
                            key_tile=rule.key_tile, device=device)


def resolve_sparsity(sparsity, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                     attn_mask: torch.Tensor | None = None, pool=tile_pool) -> BlockSelection:
    """The selection a call on ``q``, ``k`` (B, H, S, D) uses: ``sparsity`` itself when it is a
    :class:`BlockSelection` (checked against the call), else the selection its ``select`` computes
    (a :class:`DynamicSparsity` reads Q and K through ``pool``: :func:`tile_pool`'s contract)."""
    if isinstance(sparsity, BlockSelection):
        sel = sparsity
    elif isinstance(sparsity, DynamicSparsity):
        sel = sparsity.select(q, k, scale=scale, attn_mask=attn_mask, pool=pool)
    elif isinstance(sparsity, StaticSparsity) or callable(getattr(sparsity, "select", None)):
        sel = sparsity.select(q, k, scale=scale, attn_mask=attn_mask)
        if not isinstance(sel, BlockSelection):
            raise TypeError(f"sparsity.select returned {type(sel).__name__}, not a BlockSelection")
    else:
        raise TypeError(f"sparsity must be a BlockSelection, a DynamicSparsity or a StaticSparsity, got "
                        f"{type(sparsity).__name__}")
    sel.check_call(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return sel
