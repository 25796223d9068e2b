"""Every block-sparse call measures what its selection drops, and can repair it: a few query rows per
tile, spread over the tile's queries (:func:`~fp4video.sparse.estimate.covering_rows`), get their
exact attention mass (:func:`~fp4video.sparse.estimate.row_block_mass`); weighted by the rows each
stands for, they estimate each query tile's kept share (the mean over all its rows) and a lower
confidence bound on it. Key tiles heavy for most query tiles become global (sinks); a query tile
whose bound is under the floor gets key tiles, in descending estimated mass, until the bound reaches
the floor."""

from __future__ import annotations

import math

import torch

from .estimate import check_mask, check_qk, covering_rows, head_rows_mass, row_block_mass, tile_counts
from .selection import BlockSelection, SelectionCheck, number_in, positive_int

__all__ = ["CHECK_ROWS", "MEASURE_ROWS", "check_rows_for", "CHECK_CONFIDENCE", "SINK_MASS", "SINK_RATIO",
           "SINK_QUERY_TILES", "sink_query_tiles",
           "check_selection", "sink_columns", "check_options", "student_t_quantile", "row_shares"]

#: Query rows per tile a check with a floor reads by default: fewer rows leave groups of a tile's rows that
#: no checked row stands for and widen the bound (more density); with 10, every query tile of the
#: synthetic selection suite and all but 6 of 9,888 of the trained test model's keep the floor on the
#: mean of all their rows (docs/sparse-learned.md).
CHECK_ROWS = 10
#: Query rows per tile a check without a floor reads by default: it measures and finds sinks, and
#: repairs nothing, so the bound's width adds no tiles; the check's cost grows with its rows
#: (BENCHMARKS.md: the check's cost).
MEASURE_ROWS = 2
#: The one-sided confidence of the bound a repaired tile's mean kept mass must reach the floor with.
CHECK_CONFIDENCE = 0.99
#: A key tile is a sink when, at the median query tile, it holds at least this share of the checked
#: rows' mass, and ``SINK_RATIO`` times what the median key tile holds there: heavy for most query
#: tiles (not only its neighbours) and far above the rest (not a uniform row).
SINK_MASS = 0.02
SINK_RATIO = 8.0
#: The median over query tiles reads at most this many, one from each of as many equal runs of the
#: query tiles, at offsets that follow the golden ratio (no period, so a frame's period of query tiles
#: cannot alias with it): a sink is heavy for most query tiles, which a spread sample shows as well, and
#: the median of every tile's mass took a sixth of a Wan 720p check's time on the GPU (BENCHMARKS.md:
#: the check's cost).
SINK_QUERY_TILES = 64


def check_options(*, floor, sinks, rows) -> None:
    """One-line ValueErrors for a check's options (``rows`` None: :func:`check_rows_for`'s default)."""
    if floor is not None:
        number_in(floor, "floor", 0.0, 1.0, "the share of its exact attention mass a query tile keeps at least")
    if not isinstance(sinks, bool):
        raise ValueError(f"sinks must be true or false, got {sinks!r}")
    if rows is not None:
        positive_int(rows, "check_rows")


def check_rows_for(floor: float | None, rows: int | None) -> int:
    """The rows per query tile a check reads: ``rows`` when given, else :data:`CHECK_ROWS` with a
    floor (the bound it repairs to narrows with rows) and :data:`MEASURE_ROWS` without one."""
    if rows is not None:
        return rows
    return CHECK_ROWS if floor is not None and floor > 0 else MEASURE_ROWS


def student_t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t distribution with ``dof`` (an int >= 1)
    degrees of freedom: its distribution function in closed form for integer degrees of freedom
    (Abramowitz & Stegun 26.7.3 and 26.7.4), inverted by bisection. A host-side constant."""
    if not 0.5 <= p < 1 or isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"student_t_quantile needs 0.5 <= p < 1 and an int dof >= 1, got p={p!r}, dof={dof!r}")

    def cdf(t: float) -> float:
        theta = math.atan(t / math.sqrt(dof))
        c2 = math.cos(theta) ** 2
        series, term = 1.0, 1.0
        if dof % 2:
            for i in range(1, (dof - 3) // 2 + 1):
                term *= 2 * i / (2 * i + 1) * c2
                series += term
            a = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * series if dof > 1 else 0.0))
        else:
            for i in range(1, (dof - 2) // 2 + 1):
                term *= (2 * i - 1) / (2 * i) * c2
                series += term
            a = math.sin(theta) * series
        return (1 + a) / 2

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return hi


def sink_query_tiles(nq: int, device=None) -> torch.Tensor:
    """(min(nq, SINK_QUERY_TILES),) int64, increasing: the query tiles whose median finds the sinks, one
    from each of that many equal runs of the ``nq`` tiles, at the fraction ``frac(i·φ)`` of run ``i``
    (φ the golden ratio's conjugate). Computed on ``device`` (nothing is copied from the host)."""
    m = min(nq, SINK_QUERY_TILES)
    i = torch.arange(m, device=device)
    lo, hi = i * nq // m, (i + 1) * nq // m  # run i: [lo, hi), at least one tile
    return lo + (torch.frac(i.double() * 0.6180339887498949) * (hi - lo)).long()


def sink_columns(block: torch.Tensor) -> torch.Tensor:
    """(…, nk) bool: the key tiles that hold, at the median query tile, at least ``SINK_MASS`` of the
    mass ``block`` (…, nq, nk; rows summing to 1 or 0) and ``SINK_RATIO`` times the median key tile's.
    The median runs over :func:`sink_query_tiles` (every query tile up to ``SINK_QUERY_TILES``)."""
    nq = block.shape[-2]
    if nq > SINK_QUERY_TILES:
        block = block.index_select(-2, sink_query_tiles(nq, block.device))
    # (the median over the last dim of a contiguous copy: a GPU's median over a strided dim is slower)
    typical = block.transpose(-1, -2).contiguous().median(dim=-1).values
    return typical >= torch.clamp(typical.median(dim=-1, keepdim=True).values * SINK_RATIO, min=SINK_MASS)


def row_shares(mass: torch.Tensor, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept, total)``, each (B, H, nq, r): each checked row's mass ``mass`` (B, H, nq, r, nk) summed
    over the key tiles its query tile visits (``tiles``, bool, broadcastable to (B, H, nq, nk)) and
    over every key tile (a NaN on a tile it does not visit is left out of ``kept``, not of ``total``).
    :func:`fp4video.kernels.row_mass.row_shares` computes the same in one pass on the GPU."""
    return torch.where(tiles.unsqueeze(-2), mass, 0.0).sum(dim=-1), mass.sum(dim=-1)


def _estimate(kept: torch.Tensor, weight: torch.Tensor, spread: torch.Tensor, t: float):
    """(mean, bound) over the checked rows' dim -2 of ``kept`` (…, r, m) weighted by ``weight`` (…, r):
    the tile's estimated mean and its lower confidence bound ``max(0, mean − t·s·spread)`` (``s``:
    the rows' weighted standard deviation; ``spread`` (…, 1): the finite-population standard error's factor)."""
    w = weight.unsqueeze(-1)
    mean = (kept * w).sum(dim=-2)
    if t == 0:
        return mean, mean
    r = kept.shape[-2]
    var = ((kept - mean.unsqueeze(-2)).square() * w).sum(dim=-2) * (r / (r - 1))
    return mean, (mean - t * var.clamp(min=0).sqrt() * spread).clamp(min=0)  # a share is never negative


def check_selection(sel: BlockSelection, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                    attn_mask: torch.Tensor | None = None, floor: float | None = None, sinks: bool = False,
                    rows: int | None = None, row_mass=row_block_mass, placement=covering_rows,
                    shares=row_shares) -> BlockSelection:
    """``sel`` measured (and with ``sinks`` / ``floor``, repaired) on the call's ``q`` (B, H, Sq, D),
    ``k`` (B, H, Sk, D), ``scale`` and ``attn_mask``: a new selection carrying a
    :class:`~fp4video.sparse.selection.SelectionCheck`.

    ``rows`` query rows per tile (None: :func:`check_rows_for`'s default), spread over the tile's
    queries (:func:`covering_rows`: the tile's first and last rows, then each the farthest from those
    chosen), get their exact softmax mass on
    every key tile (``row_mass``). Each stands for the tile's rows nearest to it (its ``weight``); a
    query tile's kept share is the weighted mean of its rows' shares on the tiles it visits (a row
    that sees no key keeps all of nothing: 1), an estimate of the mean over all its rows. Its bound
    is that mean less ``t·s·√((1 − n/L)/n)`` (``s`` the rows' weighted standard deviation, ``n`` the
    rows, ``L`` the tile's rows, ``t`` Student's ``CHECK_CONFIDENCE`` quantile with n − 1 degrees of
    freedom; 0 with one row): a one-sided confidence bound on the tile's mean, with the spread of the
    checked rows standing for that of the rows they stand for. With ``sinks``, the key tiles
    :func:`sink_columns` finds in the rows' weighted block mass are visited by every query tile. With
    ``floor``, a query tile whose bound is under it visits more key tiles, in descending order of the
    rows' weighted exact mass on them (the oracle's order, estimated), the fewest that bring the bound
    to the floor. ``row_mass``, ``placement`` and ``shares``: :func:`row_block_mass`,
    :func:`covering_rows` and :func:`row_shares` or implementations of them (the GPU's kernels). A
    query tile whose rows' mass is not finite (NaN or Inf in Q or K) visits every key tile. The check's ``unseen`` is the bound under the selection the call runs. Nothing is read back
    to the host."""
    check_options(floor=floor, sinks=sinks, rows=rows)
    rows = check_rows_for(floor, rows)
    check_qk(q, k)
    mask = check_mask(attn_mask, q, k)
    b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    sel.check_call(b, h, sq, sk, q.device)
    nq, nk = sel.n_query_tiles, sel.n_key_tiles
    index, weight = placement(q, sel.query_tile, rows)  # (B, H, nq, r): different rows per head
    mass = head_rows_mass(q, k, index, scale=scale, attn_mask=mask, key_tile=sel.key_tile, row_mass=row_mass)
    before = sel.tiles.expand(b, h, nq, nk)
    # (B, H, nq, r): each row's mass on the rule's tiles, and on all (1 for a row that sees keys, 0 for
    # one that sees none, NaN)
    kept_rows, total = shares(mass, before)
    sees = total > 0
    unknown = ~torch.isfinite(total).all(dim=-1)  # (B, H, nq): a row's mass is NaN
    # a row's share of its mass on a tile is its mass there times ``inv`` (0: a row that sees no key or
    # is not finite); the shares are formed only where a repair needs them
    inv = torch.where(sees & torch.isfinite(total), 1 / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    length = tile_counts(sq, sel.query_tile, q.device)  # (nq,)
    n = length.clamp(max=rows)
    spread = ((1 - n / length).clamp(min=0) / n).sqrt().unsqueeze(-1)  # (nq, 1): all rows read: exact
    t = student_t_quantile(CHECK_CONFIDENCE, rows - 1) if rows > 1 else 0.0
    nan = torch.full((), math.nan, device=q.device)

    def measured(kept_rows):
        """(kept, bound), each (B, H, nq), of the rows' mass ``kept_rows`` on a selection; NaN where the
        rows are not finite."""
        row = torch.where(sees, kept_rows * inv, 1.0)
        mean, bound = _estimate(row.unsqueeze(-1), weight, spread, t)
        return torch.where(unknown, nan, mean.squeeze(-1)), torch.where(unknown, nan, bound.squeeze(-1))

    kept_before, bound_before = measured(kept_rows)
    tiles = before
    repair = floor is not None and floor > 0
    if sinks or repair:
        # (B, H, nq, nk): the rows' weighted block mass (a row that is not finite weighs 0: nansum)
        block = (mass * (weight * inv).unsqueeze(-1)).nansum(dim=-2)
        block_sum = block.sum(dim=-1, keepdim=True)
        block = torch.where(block_sum > 0, block / block_sum.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
        if sinks:
            tiles = tiles | sink_columns(block).unsqueeze(-2)
        if repair:
            share = torch.where(inv.unsqueeze(-1) > 0, mass * inv.unsqueeze(-1), 0.0)
            tiles = tiles | _repair(tiles, share, sees, weight, spread, t, block, floor) | unknown.unsqueeze(-1)
    if tiles is before:  # measured only: the rule's own bitmap (a static one is shared) runs as it is
        check = SelectionCheck(kept_before, kept_before, torch.zeros(kept_before.shape, dtype=torch.bool,
                               device=q.device), sel.density(), floor, rows, bound_before, index, weight)
        return BlockSelection(sel.tiles, sq, sk, sel.query_tile, sel.key_tile, sel.estimated_mass, check)
    est = None if sel.estimated_mass is None else sel.estimated_mass.expand(b, h, nq)
    kept, bound = measured(shares(mass, tiles)[0])
    check = SelectionCheck(kept, kept_before, (tiles & ~before).any(dim=-1), sel.density(), floor, rows, bound,
                           index, weight)
    return BlockSelection(tiles, sq, sk, sel.query_tile, sel.key_tile, est, check)


def _repair(tiles, share, sees, weight, spread, t, block, floor) -> torch.Tensor:
    """(B, H, nq, nk) bool: the key tiles a query tile adds so that its bound reaches ``floor``: not
    visited yet, in descending ``block`` mass, the shortest prefix after which the bound of the
    checked rows' ``share`` (B, H, nq, r, nk) is at least ``floor`` (all of them if none is)."""
    have = torch.where(sees, (share * tiles.unsqueeze(-2)).sum(dim=-1), 1.0)  # (B, H, nq, r)
    free, order = torch.where(tiles, -1.0, block).sort(dim=-1, descending=True, stable=True)
    gained = share.gather(-1, order.unsqueeze(-2).expand(share.shape))
    gained = torch.where(tiles.gather(-1, order).unsqueeze(-2), 0.0, gained)
    # each row's kept share after the first 0, 1, …, nk free tiles of the order
    kept = torch.cat([have.unsqueeze(-1), have.unsqueeze(-1) + gained.cumsum(dim=-1)], dim=-1)
    _, bound = _estimate(kept, weight, spread, t)  # (B, H, nq, nk + 1)
    enough = bound >= floor
    enough[..., -1] = True  # every tile: the whole row (its fp32 sum may round under the floor)
    count = enough.to(torch.int8).argmax(dim=-1, keepdim=True)  # the first prefix that reaches it
    take = (torch.arange(free.shape[-1], device=free.device) < count) & (free >= 0)
    return torch.zeros_like(tiles).scatter(-1, order, take)
