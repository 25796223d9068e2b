"""The selection: a bitmap of the (query tile, key tile) blocks a block-sparse call visits, and what
the call's check measured of it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..reference import KEY_TILE

__all__ = ["QUERY_TILE", "KEY_TILE", "BlockSelection", "SelectionCheck", "tile_lists", "positive_int", "number_in", "n_tiles"]

#: Query rows per tile of a selection: a multiple of every loop's rows per program (64 or 128), so a
#: program reads one bitmap row.
QUERY_TILE = 128


def positive_int(value, name: str) -> int:
    """``value`` if it is an int >= 1 (not a bool), else a one-line ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def number_in(value, name: str, lo: float, hi: float, what: str, *, lo_open: bool = False) -> float:
    """``value`` as a float if it is a finite real number (not a bool) in [lo, hi] (``(lo, hi]`` with
    ``lo_open``), else a one-line ValueError naming ``name`` and saying ``what`` it is."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], {what}; got {value!r}")
    return float(value)


def n_tiles(n: int, tile: int) -> int:
    """How many tiles of ``tile`` hold ``n`` tokens."""
    return -(-n // tile)


@dataclass(frozen=True, eq=False)
class SelectionCheck:
    """What a block-sparse call measured of its selection (:func:`fp4video.sparse.check_selection`):
    the exact attention mass of a few checked query rows per tile, each standing for the tile's rows
    nearest to it. Every field is a tensor on the call's device (nothing is read back while the call
    runs); :meth:`summary` gives the numbers a record carries.

    ``kept``: (B, H, nq) fp32, each query tile's estimated kept share of its rows' exact softmax mass
    (the checked rows' shares weighted by ``weight``: an estimate of the mean over all its rows) under
    the selection the call runs; ``kept_before``: the same under the rule's own selection, before sinks
    and repair; ``repaired``: (B, H, nq) bool, the query tiles that sinks or the repair gave more key
    tiles; ``density_before``: 0-d, the rule's own density. ``floor``: the repair's floor (None:
    measured, not repaired); ``rows``: checked rows per query tile. ``unseen``: (B, H, nq) fp32, a
    lower confidence bound on the mean over all the tile's rows, the rows not read included (at most
    ``kept``; None: as ``kept``). ``sampled``: (B, H, nq, rows) int64, the checked query rows;
    ``weight``: (B, H, nq, rows) fp32, the share of its tile's rows each stands for (None for checks
    made without them)."""

    kept: torch.Tensor
    kept_before: torch.Tensor
    repaired: torch.Tensor
    density_before: torch.Tensor
    floor: float | None
    rows: int
    unseen: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    weight: torch.Tensor | None = None

    def summary(self) -> dict:
        """{name: 0-d fp32 tensor}: ``kept_min``, ``kept_q01`` (the 1% quantile over query tiles and
        heads), ``kept_mean`` after repair, ``kept_min_before``, ``repaired`` (the share of query tiles
        repaired), ``density_before``; and of the lower bound on every row's mean (``unseen``, the rows
        the check did not read included): ``unseen_min``, ``unseen_q01`` and ``unseen_under_floor``,
        the share of query tiles whose bound is under the floor (0 without one). Query tiles whose rows
        see no finite mass (NaN/Inf inputs) are left out of the statistics (such heads return NaN)."""
        kept_min, kept_q01, kept_mean, n = _spread(self.kept)
        unseen = self.kept if self.unseen is None else self.unseen
        unseen_min, unseen_q01, _, _ = _spread(unseen)
        u = unseen.reshape(-1)
        under = ((u < self.floor) & torch.isfinite(u)).sum() / n.clamp(min=1) if self.floor is not None else \
            torch.zeros((), device=u.device)
        before = self.kept_before.reshape(-1)
        return {
            "kept_min": kept_min,
            "kept_q01": kept_q01,
            "kept_mean": kept_mean,
            "kept_min_before": torch.where(torch.isfinite(before), before, 1.0).min(),
            "repaired": self.repaired.float().mean(),
            "density_before": self.density_before,
            "unseen_min": unseen_min,
            "unseen_q01": unseen_q01,
            "unseen_under_floor": under.float(),
        }


def _spread(values: torch.Tensor):
    """(min, 1% quantile, mean, count) over the finite entries of ``values``, as 0-d tensors (a sort
    and an index: nothing read back); 1 where none is finite."""
    v = values.reshape(-1)
    finite = torch.isfinite(v)
    valid = torch.where(finite, v, 1.0)
    n = finite.sum()
    ordered = torch.where(finite, v, float("inf")).sort().values
    index = ((n - 1).clamp(min=0).float() * 0.01).floor().long()
    q01 = torch.where(n > 0, ordered.gather(0, index.reshape(1)).reshape(()), torch.ones((), device=v.device))
    return valid.min(), q01, (valid * finite).sum() / n.clamp(min=1), n


@dataclass(frozen=True, eq=False)
class BlockSelection:
    """Which key tiles each query tile visits.

    ``tiles``: bool (B|1, H|1, ceil(sq / query_tile), ceil(sk / key_tile)), True = visit; a
    batch or head dim of 1 applies to every batch entry or head. ``sq``/``sk``: the query and key
    counts it was made for. ``estimated_mass`` (dynamic selections): (B|1, H|1, n_query_tiles)
    fp32, the share of its estimated mass each query tile keeps (1 where it keeps every tile).
    ``check`` (selections a rule computed): what the call measured of it (:class:`SelectionCheck`).

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
    check: SelectionCheck | None = None

    def __post_init__(self):
        t = self.tiles
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise TypeError(f"BlockSelection.tiles must be a bool tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        for name in ("sq", "sk", "query_tile", "key_tile"):
            positive_int(getattr(self, name), f"BlockSelection.{name}")
        want = (n_tiles(self.sq, self.query_tile), n_tiles(self.sk, self.key_tile))
        if t.dim() != 4 or tuple(t.shape[-2:]) != want:
            raise ValueError(f"BlockSelection.tiles has shape {tuple(t.shape)}, expected (B|1, H|1, {want[0]}, "
                             f"{want[1]}) for {self.sq} queries in tiles of {self.query_tile} and {self.sk} keys in "
                             f"tiles of {self.key_tile}")
        e = self.estimated_mass
        if e is not None and (not isinstance(e, torch.Tensor) or tuple(e.shape) != tuple(t.shape[:3])):
            raise ValueError(f"BlockSelection.estimated_mass must be a tensor of shape {tuple(t.shape[:3])}, got "
                             f"{tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__}")
        if self.check is not None and not isinstance(self.check, SelectionCheck):
            raise TypeError(f"BlockSelection.check must be a SelectionCheck, got {type(self.check).__name__}")

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
        positive_int(query_tile, "query_tile"), positive_int(key_tile, "key_tile")
        shape = (batch, heads, n_tiles(sq, query_tile), n_tiles(sk, key_tile))
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
        return BlockSelection(self.tiles.expand(shape), self.sq, self.sk, self.query_tile, self.key_tile, est,
                              self.check)

    def for_tiles(self, query_tile: int, key_tile: int) -> "BlockSelection":
        """The same selection over smaller tiles that divide these (a loop's BLOCK_M rows, its key
        tile): every sub-tile visits what its tile visits. The check stays that of the original tiles."""
        positive_int(query_tile, "query_tile"), positive_int(key_tile, "key_tile")
        if self.query_tile % query_tile or self.key_tile % key_tile:
            raise ValueError(f"tiles of {query_tile} queries × {key_tile} keys do not divide the selection's "
                             f"{self.query_tile} × {self.key_tile}")
        nq, nk = n_tiles(self.sq, query_tile), n_tiles(self.sk, key_tile)
        t = self.tiles.repeat_interleave(self.query_tile // query_tile, dim=-2)[..., :nq, :]
        t = t.repeat_interleave(self.key_tile // key_tile, dim=-1)[..., :nk]
        est = None
        if self.estimated_mass is not None:
            est = self.estimated_mass.repeat_interleave(self.query_tile // query_tile, dim=-1)[..., :nq]
        return BlockSelection(t, self.sq, self.sk, query_tile, key_tile, est, self.check)

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

