"""The dynamic selection: key tiles chosen per call from an estimate of each block's attention mass."""

from __future__ import annotations

import math

import torch

from .estimate import (MIN_SIMILARITY, check_mask, check_qk, covering_rows, estimate_block_mass, head_rows_mass,
                       row_block_mass, sample_rows, tile_pool)
from .selection import KEY_TILE, QUERY_TILE, BlockSelection, n_tiles, number_in

__all__ = ["ESTIMATES", "ESTIMATE_ROWS", "dynamic_selection", "always_kept", "check_global_tokens",
           "cumulative_take", "topk_take", "check_dynamic_options"]

#: How a dynamic selection estimates each block's mass: ``pooled`` (SpargeAttn's mean-pooled Q and
#: K, one pass over them), ``sampled`` (the exact mass of a few query rows per tile, MInference's
#: estimate from a few queries' exact attention: sees single heavy keys that pooling dilutes; the rows
#: one per equal run of the tile, the same in every head) or ``covering`` (the exact mass of a few rows
#: per tile placed on the queries themselves, per head, as the check places its rows
#: (:func:`~fp4video.sparse.covering_rows`: the tile's ends, then each the farthest from those chosen),
#: weighted by the rows each stands for: a tile whose queries belong to several objects has a row
#: near each, where rows placed by position can all land on one).
ESTIMATES = ("pooled", "sampled", "covering")
#: Query rows per tile the ``sampled`` and ``covering`` estimates read by default.
ESTIMATE_ROWS = 4
#: Added to the rule's seed for the estimate's rows, so that they are not the check's rows.
ESTIMATE_SEED_OFFSET = 7919


def always_kept(sq: int, sk: int, query_tile: int, key_tile: int, neighbours, global_tokens,
               sink_tiles: int, device) -> torch.Tensor:
    """(1, 1, nq, nk) bool: the tiles kept whatever the estimate (neighbourhood, global, sinks)."""
    nq, nk = n_tiles(sq, query_tile), n_tiles(sk, key_tile)
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


def check_global_tokens(global_tokens, n: int | None = None) -> tuple[tuple[int, int], ...]:
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


def check_dynamic_options(*, tau, neighbours, sink_tiles, min_similarity, topk, estimate, estimate_rows, seed,
                          query_tile, key_tile) -> None:
    """One-line ValueErrors for a dynamic selection's options (each named), checked where a rule is
    built and where a selection is computed."""
    if tau is not None:
        number_in(tau, "tau", 0.0, 1.0, "the share of estimated mass each query tile keeps", lo_open=True)
    if neighbours is not None and (isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0):
        raise ValueError(f"neighbours must be None or an int >= 0 (key tiles either side), got {neighbours!r}")
    if isinstance(sink_tiles, bool) or not isinstance(sink_tiles, int) or sink_tiles < 0:
        raise ValueError(f"sink_tiles must be an int >= 0, got {sink_tiles!r}")
    number_in(min_similarity, "min_similarity", -1.0, 1.0, "a cosine")
    number_in(topk, "topk", 0.0, 1.0, "the share of key tiles each query tile keeps at least")
    if tau is None and topk == 0:
        raise ValueError("a dynamic selection needs tau (a cumulative share of estimated mass), topk (a share of key "
                         "tiles) or both")
    if estimate not in ESTIMATES:
        raise ValueError(f"estimate must be one of {', '.join(ESTIMATES)}, got {estimate!r}")
    for name, v in (("estimate_rows", estimate_rows), ("query_tile", query_tile), ("key_tile", key_tile)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def cumulative_take(mass: torch.Tensor, kept: torch.Tensor, share: float) -> torch.Tensor:
    """(…, nk) bool: the tiles SpargeAttn's cumulative rule adds to ``kept`` (bool, …, nk): while a
    row's mass on its kept tiles is below ``share``, the tile of largest ``mass`` (…, nk, finite,
    rows summing to 1) not kept yet. Ties go to the lower index."""
    have = (mass * kept).sum(dim=-1, keepdim=True)
    free, order = torch.where(kept, -1.0, mass).sort(dim=-1, descending=True, stable=True)
    free = free.clamp(min=0)
    before = torch.cat([torch.zeros_like(free[..., :1]), free.cumsum(dim=-1)[..., :-1]], dim=-1)
    return torch.zeros_like(kept).scatter(-1, order, have + before < share)


def topk_take(mass: torch.Tensor, count: int) -> torch.Tensor:
    """(…, nk) bool: each row's ``count`` tiles of largest ``mass`` (ties to the lower index)."""
    order = mass.sort(dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.zeros(mass.shape, dtype=torch.bool, device=mass.device).scatter(-1, order, True)


def dynamic_selection(q: torch.Tensor, k: torch.Tensor, *, tau: float | None, scale: float | None = None,
                      attn_mask: torch.Tensor | None = None, neighbours: int | None = 0,
                      global_tokens=(), sink_tiles: int = 0, min_similarity: float = MIN_SIMILARITY,
                      topk: float = 0.0, estimate: str = "pooled", estimate_rows: int = ESTIMATE_ROWS,
                      seed: int = 0, query_tile: int = QUERY_TILE, key_tile: int = KEY_TILE, pool=tile_pool,
                      row_mass=row_block_mass, placement=covering_rows) -> BlockSelection:
    """The dynamic selection for a call on ``q`` (B, H, Sq, D) and ``k`` (B, H, Sk, D) with ``scale``
    and ``attn_mask`` as the call's.

    Each query tile keeps, first, its always-kept tiles: ``neighbours`` (None: none; 0: the key
    tiles holding its own tokens; r: those within r key tiles of them; needs Sq == Sk), the key
    tiles holding ``global_tokens`` ((start, stop) token ranges; a query tile holding one keeps
    every key tile), the first ``sink_tiles`` key tiles, and with the ``pooled`` estimate every key
    tile when the query tile is not self-similar, and every key tile that is not
    (:func:`estimate_block_mass`). Then its ``topk`` share of the key tiles (rounded up) of largest
    estimated mass; then, while its kept estimated mass is below ``tau``, the key tile of largest
    estimated mass it does not keep yet (SpargeAttn's cumulative rule; ``tau`` None: top-k alone);
    ``tau`` >= 1 keeps every tile. A query tile whose estimate is not finite (no key visible, NaN or Inf inputs) keeps every
    tile. A larger ``tau`` or ``topk`` keeps a superset.

    ``estimate``: ``"pooled"`` (SpargeAttn's: Q and K read through ``pool``), ``"sampled"``: the
    exact mass of ``estimate_rows`` rows per query tile (:func:`sample_rows` from ``seed``, through
    ``row_mass``), averaged over the tile's rows, or ``"covering"``: the exact mass of
    ``estimate_rows`` rows per query tile and head placed by ``placement`` (:func:`covering_rows`'s
    contract; no seed), weighted by the share of the tile's rows each stands for.
    """
    check_dynamic_options(tau=tau, neighbours=neighbours, sink_tiles=sink_tiles, min_similarity=min_similarity,
                          topk=topk, estimate=estimate, estimate_rows=estimate_rows, seed=seed,
                          query_tile=query_tile, key_tile=key_tile)
    check_qk(q, k)
    sq, sk = q.shape[2], k.shape[2]
    if neighbours is not None and sq != sk:
        raise ValueError(f"neighbours needs self-attention (Sq == Sk), got Sq {sq} and Sk {sk}; pass "
                         "neighbours=None for cross-attention")
    ranges = check_global_tokens(global_tokens, max(sq, sk))
    forced = always_kept(sq, sk, query_tile, key_tile, neighbours, ranges, sink_tiles, q.device)
    if estimate == "pooled":
        est = estimate_block_mass(q, k, scale=scale, attn_mask=attn_mask, query_tile=query_tile, key_tile=key_tile,
                                  min_similarity=min_similarity, pool=pool)
        mass = est.mass
        forced = forced | ~est.k_similar.unsqueeze(-2) | ~est.q_similar.unsqueeze(-1)
    else:
        if estimate == "sampled":
            rows = sample_rows(sq, query_tile, estimate_rows, seed=seed + ESTIMATE_SEED_OFFSET, device=q.device)
            block = row_mass(q, k, rows, scale=scale, attn_mask=attn_mask, key_tile=key_tile).mean(dim=-2)
        else:  # covering: rows on the queries of each head, each weighted by the rows it stands for
            index, weight = placement(q, query_tile, estimate_rows)
            mass = head_rows_mass(q, k, index, scale=scale, attn_mask=check_mask(attn_mask, q, k),
                                  key_tile=key_tile, row_mass=row_mass)
            block = (mass * weight.unsqueeze(-1)).sum(dim=-2)  # a NaN row makes its tile NaN (unknown)
        total = block.sum(dim=-1, keepdim=True)
        mass = torch.where(total > 0, block / total, math.nan)  # rows that see no key: nothing to estimate
    unknown = ~torch.isfinite(mass).all(dim=-1, keepdim=True)  # (B, H, nq, 1)
    mass = torch.where(torch.isfinite(mass), mass, 0.0)
    forced = forced | unknown
    if tau is not None and tau >= 1:
        tiles = torch.ones_like(forced)
    else:
        tiles = forced
        if topk > 0:
            nk = n_tiles(sk, key_tile)
            tiles = tiles | topk_take(mass, min(math.ceil(topk * nk), nk))
        if tau is not None:
            tiles = tiles | cumulative_take(mass, tiles, tau)
    share = torch.where(unknown.squeeze(-1), 1.0, (mass * tiles).sum(dim=-1))
    return BlockSelection(tiles, sq, sk, query_tile, key_tile, share)
