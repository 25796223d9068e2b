"""Every block-sparse call measures what its selection drops, and can repair it: the exact attention
mass of a few sampled query rows per tile (:func:`~fp4video.sparse.estimate.row_block_mass`) tells
each query tile's kept share; key tiles heavy for most query tiles become global (sinks); a query
tile under the floor gets key tiles by those rows' exact mass until it reaches the floor."""

from __future__ import annotations

import math

import torch

from .dynamic import cumulative_take
from .estimate import check_qk, row_block_mass, sample_rows
from .selection import BlockSelection, SelectionCheck, number_in, positive_int

__all__ = ["CHECK_ROWS", "SINK_MASS", "SINK_RATIO", "FLOOR_MARGIN", "check_selection", "sink_columns", "check_options"]

#: Sampled query rows per tile a call's check reads by default: 2 of 128 rows cost about 1/64 of
#: the dense call's Q·Kᵀ and none of its P·V.
CHECK_ROWS = 2
#: A key tile is a sink when, at the median query tile, it holds at least this share of the sampled
#: rows' mass, and ``SINK_RATIO`` times what the median key tile holds there: heavy for most query
#: tiles (not only its neighbours) and far above the rest (not a uniform row).
SINK_MASS = 0.02
SINK_RATIO = 8.0
#: A repaired row aims this share of the way from the floor to 1 above it: the tile's other rows
#: (not sampled) keep a little less or more than its sampled ones, and the margin covers the
#: difference on smooth heads (measured: the suite's miss rate).
FLOOR_MARGIN = 0.25


def check_options(*, floor, sinks, rows, seed) -> None:
    """One-line ValueErrors for a check's options."""
    if floor is not None:
        number_in(floor, "floor", 0.0, 1.0, "the share of its exact attention mass a query tile keeps at least")
    if not isinstance(sinks, bool):
        raise ValueError(f"sinks must be true or false, got {sinks!r}")
    positive_int(rows, "check_rows")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def sink_columns(block: torch.Tensor) -> torch.Tensor:
    """(…, nk) bool: the key tiles that hold, at the median query tile, at least ``SINK_MASS`` of the
    mass ``block`` (…, nq, nk; rows summing to 1 or 0) and ``SINK_RATIO`` times the median key tile's."""
    typical = block.median(dim=-2).values
    return typical >= torch.clamp(typical.median(dim=-1, keepdim=True).values * SINK_RATIO, min=SINK_MASS)


def check_selection(sel: BlockSelection, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                    attn_mask: torch.Tensor | None = None, floor: float | None = None, sinks: bool = False,
                    rows: int = 2, seed: int = 0, row_mass=row_block_mass) -> BlockSelection:
    """``sel`` measured (and with ``sinks`` / ``floor``, repaired) on the call's ``q`` (B, H, Sq, D),
    ``k`` (B, H, Sk, D), ``scale`` and ``attn_mask``: a new selection carrying a
    :class:`~fp4video.sparse.selection.SelectionCheck`.

    ``rows`` query rows per tile (:func:`sample_rows` from ``seed``) get their exact softmax mass on
    every key tile (``row_mass``); a query tile's kept share is the mean over its rows of the mass on
    the tiles it visits (a row that sees no key keeps all of nothing: 1). With ``sinks``, the key
    tiles :func:`sink_columns` finds in those rows' mean block mass are visited by every query tile.
    With ``floor``, each sampled row whose kept share is under it adds, in descending order of its
    own exact mass, the key tiles it needs to reach ``floor + FLOOR_MARGIN · (1 − floor)``; its query
    tile visits the union (so every sampled row, and the tile's mean over them, reaches the floor). The
    rows a repair read keep the floor by construction; what a row it did not read keeps is estimated by
    leaving each sampled row out: its kept share under the key tiles the tile's other sampled rows
    added (the check's ``unseen``). A query tile whose rows' mass is not finite (NaN or Inf in Q or K)
    visits every key tile. Nothing is read back to the host."""
    check_options(floor=floor, sinks=sinks, rows=rows, seed=seed)
    check_qk(q, k)
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    sel.check_call(b, h, sq, sk, q.device)
    sample = sample_rows(sq, sel.query_tile, rows, seed=seed, device=q.device)
    mass = row_mass(q, k, sample, scale=scale, attn_mask=attn_mask, key_tile=sel.key_tile)  # (B, H, nq, r, nk)
    total = mass.sum(dim=-1)  # 1 for a row that sees keys, 0 for one that sees none, NaN
    nan = torch.full((), math.nan, device=q.device)
    per_row = torch.where(total > 0, 1.0 / total.clamp(min=torch.finfo(torch.float32).tiny),
                          torch.where(total == 0, 0.0, nan))

    def kept_of(tiles):
        kept = (mass * tiles.unsqueeze(-2)).sum(dim=-1) * per_row
        return torch.where(total == 0, 1.0, kept).mean(dim=-1)  # (B, H, nq)

    before = sel.tiles.expand(b, h, *sel.tiles.shape[2:])
    kept_before = kept_of(before)
    block = mass.mean(dim=-2)  # (B, H, nq, nk): the sampled rows' mean block mass
    block_sum = block.sum(dim=-1, keepdim=True)
    unknown = ~torch.isfinite(block_sum)
    block = torch.where(block_sum > 0, block / block_sum.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    block = torch.where(unknown, 0.0, block)
    tiles = before
    if sinks:
        tiles = tiles | sink_columns(block).unsqueeze(-2)
    pre = tiles  # the selection before the repair
    unseen = None
    if floor is not None:
        # every sampled row of a tile under the floor gets, by its own exact mass, the key tiles it
        # needs to reach it (a tile's rows may attend to different places: their union is kept)
        share = torch.where((total > 0).unsqueeze(-1), mass * per_row.unsqueeze(-1), 0.0)
        share = torch.where(torch.isfinite(share), share, 0.0)
        visit = tiles.unsqueeze(-2).expand(share.shape)
        row_kept = (share * visit).sum(dim=-1, keepdim=True)
        need = (row_kept < floor) & (total > 0).unsqueeze(-1)  # a row that sees no key needs nothing
        add = cumulative_take(share, visit, min(floor + FLOOR_MARGIN * (1.0 - floor) + 1e-6, 1.0)) & need
        if rows > 1:
            # leave one out: each sampled row under the key tiles the *other* rows' repair added, i.e.
            # as a row the repair did not read: an honest estimate of what unsampled rows keep
            others = (add.sum(dim=-2, keepdim=True) - add.int()) > 0
            loo = (share * (visit | others)).sum(dim=-1)
            loo = torch.where(total > 0, loo, torch.where(total == 0, 1.0, nan))
            unseen = loo.mean(dim=-1)
        tiles = tiles | add.any(dim=-2) | unknown
    if tiles is before:  # measured only: the rule's own bitmap (a static one is shared) runs as it is
        check = SelectionCheck(kept_before, kept_before, torch.zeros(kept_before.shape, dtype=torch.bool,
                               device=q.device), sel.density(), floor, rows, kept_before)
        return BlockSelection(sel.tiles, sq, sk, sel.query_tile, sel.key_tile, sel.estimated_mass, check)
    est = None if sel.estimated_mass is None else sel.estimated_mass.expand(b, h, sel.n_query_tiles)
    kept = kept_of(tiles)
    # without a repair the sampled rows shaped nothing but the sinks: what they keep is what others keep;
    # a repair read by one row per tile leaves no other row to hold out: its pre-repair share stands in
    if unseen is None:
        unseen = kept if floor is None else kept_of(pre)
    check = SelectionCheck(kept, kept_before, (tiles & ~before).any(dim=-1), sel.density(), floor, rows,
                           torch.minimum(unseen, kept))
    return BlockSelection(tiles, sq, sk, sel.query_tile, sel.key_tile, est, check)
