"""Selection rules: what a policy or a call names (:class:`DynamicSparsity`, :class:`StaticSparsity`,
:class:`HybridSparsity`), each computed per call and checked (:func:`resolve_sparsity`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .check import check_options, check_rows_for, check_selection, row_shares
from .dynamic import ESTIMATE_ROWS, check_dynamic_options, check_global_tokens, dynamic_selection
from .estimate import MIN_SIMILARITY, check_qk, covering_rows, row_block_mass, tile_pool
from .selection import KEY_TILE, QUERY_TILE, BlockSelection, positive_int
from .static import check_grid, static_selection

__all__ = ["DynamicSparsity", "StaticSparsity", "HybridSparsity", "resolve_sparsity"]


@dataclass(frozen=True)
class _Checked:
    """The check every rule's calls run (:func:`fp4video.sparse.check_selection`): ``check_rows``
    rows per query tile (None: 10 with a floor, 2 without), spread over its queries, measure the kept
    mass; ``sinks`` makes key tiles heavy for most query tiles global; ``floor`` repairs query tiles whose bound is under it. The
    check's rows follow the queries alone (no seed)."""

    def _check_fields(self):
        check_options(floor=self.floor, sinks=self.sinks, rows=self.check_rows)
        object.__setattr__(self, "check_rows", check_rows_for(self.floor, self.check_rows))

    def checked(self, sel: BlockSelection, q, k, *, scale, attn_mask, row_mass,
                placement=covering_rows, shares=row_shares) -> BlockSelection:
        return check_selection(sel, q, k, scale=scale, attn_mask=attn_mask, floor=self.floor, sinks=self.sinks,
                               rows=self.check_rows, row_mass=row_mass, placement=placement, shares=shares)


@dataclass(frozen=True)
class DynamicSparsity(_Checked):
    """A dynamic selection rule (:func:`~fp4video.sparse.dynamic_selection`'s arguments), applied to
    each call's Q and K, then checked: ``floor`` (None: measure only), ``sinks``, ``check_rows``
    (:func:`~fp4video.sparse.check_selection`); ``seed`` picks the ``sampled`` estimate's rows (the
    ``covering`` estimate's follow the queries). Every
    option is checked here, when the rule is built."""

    tau: float | None = None
    neighbours: int | None = 0
    global_tokens: tuple = ()
    sink_tiles: int = 0
    min_similarity: float = MIN_SIMILARITY
    query_tile: int = QUERY_TILE
    key_tile: int = KEY_TILE
    topk: float = 0.0
    estimate: str = "pooled"
    estimate_rows: int = ESTIMATE_ROWS
    floor: float | None = None
    sinks: bool = False
    check_rows: int | None = None
    seed: int = 0

    def __post_init__(self):
        check_dynamic_options(tau=self.tau, neighbours=self.neighbours, sink_tiles=self.sink_tiles,
                              min_similarity=self.min_similarity, topk=self.topk, estimate=self.estimate,
                              estimate_rows=self.estimate_rows, seed=self.seed, query_tile=self.query_tile,
                              key_tile=self.key_tile)
        self._check_fields()
        object.__setattr__(self, "global_tokens", check_global_tokens(self.global_tokens))

    def select(self, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, pool=tile_pool, row_mass=row_block_mass,
               placement=covering_rows) -> BlockSelection:
        """The rule's own selection (unchecked)."""
        return dynamic_selection(q, k, tau=self.tau, scale=scale, attn_mask=attn_mask, neighbours=self.neighbours,
                                 global_tokens=self.global_tokens, sink_tiles=self.sink_tiles,
                                 min_similarity=self.min_similarity, topk=self.topk, estimate=self.estimate,
                                 estimate_rows=self.estimate_rows, seed=self.seed, query_tile=self.query_tile,
                                 key_tile=self.key_tile, pool=pool, row_mass=row_mass, placement=placement)


@dataclass(frozen=True)
class StaticSparsity(_Checked):
    """A static selection rule (:func:`~fp4video.sparse.static_selection`'s arguments): the same tiles
    for every call over this latent grid, computed once per device (the calls share the bitmap: do
    not write to it), then checked per call as :class:`DynamicSparsity` is (``sinks``: Radial
    Attention's window with the sinks it misses added back)."""

    frames: int
    height: int
    width: int
    window: tuple = (1, 8, 8)
    text_tokens: int = 0
    text_position: str = "first"
    radial: bool = False
    query_tile: int = QUERY_TILE
    key_tile: int = KEY_TILE
    floor: float | None = None
    sinks: bool = False
    check_rows: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "window", check_grid(self.frames, self.height, self.width, self.window,
                                                      self.text_tokens, self.text_position, self.radial))
        positive_int(self.query_tile, "query_tile"), positive_int(self.key_tile, "key_tile")
        self._check_fields()

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width + self.text_tokens

    def select(self, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, **_readers) -> BlockSelection:
        """The selection for a self-attention call over this grid (``scale`` and ``attn_mask`` play no
        part; unchecked)."""
        check_qk(q, k)
        if not q.shape[2] == k.shape[2] == self.tokens:
            raise ValueError(f"a static window over {self.frames}×{self.height}×{self.width} latent tokens "
                             f"+ {self.text_tokens} text tokens needs Sq = Sk = {self.tokens}, got "
                             f"{q.shape[2]} and {k.shape[2]}")
        return _static_for(self, str(q.device))


@dataclass(frozen=True)
class HybridSparsity(_Checked):
    """A static window and a dynamic selection together (each query tile visits what either keeps),
    then checked: the window's locality with the dynamic rule's reach (e.g. content heads). The two
    rules' own check fields are not used; this rule's are. Their tiles must be the same."""

    static: StaticSparsity = None
    dynamic: DynamicSparsity = None
    floor: float | None = None
    sinks: bool = False
    check_rows: int | None = None

    def __post_init__(self):
        if not isinstance(self.static, StaticSparsity) or not isinstance(self.dynamic, DynamicSparsity):
            raise TypeError(f"HybridSparsity takes a StaticSparsity and a DynamicSparsity, got "
                            f"{type(self.static).__name__} and {type(self.dynamic).__name__}")
        if (self.static.query_tile, self.static.key_tile) != (self.dynamic.query_tile, self.dynamic.key_tile):
            raise ValueError("HybridSparsity: the static and dynamic rules must use the same query and key tiles")
        self._check_fields()

    def select(self, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
               attn_mask: torch.Tensor | None = None, pool=tile_pool, row_mass=row_block_mass,
               placement=covering_rows) -> BlockSelection:
        """Both rules' tiles (unchecked)."""
        window = self.static.select(q, k)
        dyn = self.dynamic.select(q, k, scale=scale, attn_mask=attn_mask, pool=pool, row_mass=row_mass,
                                  placement=placement)
        return BlockSelection(window.tiles | dyn.tiles, dyn.sq, dyn.sk, dyn.query_tile, dyn.key_tile)


@functools.lru_cache(maxsize=16)
def _static_for(rule: StaticSparsity, device: str) -> BlockSelection:
    """A static rule's selection on a device, computed once: every call over the grid uses the same
    bitmap (a loop only reads it)."""
    return static_selection(rule.frames, rule.height, rule.width, window=rule.window, text_tokens=rule.text_tokens,
                            text_position=rule.text_position, radial=rule.radial, query_tile=rule.query_tile,
                            key_tile=rule.key_tile, device=device)


RULES = (DynamicSparsity, StaticSparsity, HybridSparsity)


def resolve_sparsity(sparsity, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                     attn_mask: torch.Tensor | None = None, pool=tile_pool, row_mass=row_block_mass,
                     placement=covering_rows, shares=row_shares) -> BlockSelection:
    """The selection a call on ``q``, ``k`` (B, H, S, D) uses: ``sparsity`` itself when it is a
    :class:`BlockSelection` (checked against the call's shape, run as given), else its rule's
    selection (Q and K read through ``pool``, ``row_mass``, ``placement`` and ``shares``:
    :func:`~fp4video.sparse.tile_pool`'s, :func:`~fp4video.sparse.row_block_mass`'s,
    :func:`~fp4video.sparse.covering_rows`'s and :func:`~fp4video.sparse.row_shares`'s contracts) measured and repaired by the rule's check
    (:func:`~fp4video.sparse.check_selection`); an object with a ``select(q, k, scale=, attn_mask=)``
    method returning a :class:`BlockSelection` is run as it returns."""
    if isinstance(sparsity, BlockSelection):
        sel = sparsity
    elif isinstance(sparsity, RULES):
        sel = sparsity.select(q, k, scale=scale, attn_mask=attn_mask, pool=pool, row_mass=row_mass,
                              placement=placement)
        sel.check_call(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        sel = sparsity.checked(sel, q, k, scale=scale, attn_mask=attn_mask, row_mass=row_mass, placement=placement,
                             shares=shares)
    elif callable(getattr(sparsity, "select", None)):
        sel = sparsity.select(q, k, scale=scale, attn_mask=attn_mask)
        if not isinstance(sel, BlockSelection):
            raise TypeError(f"sparsity.select returned {type(sel).__name__}, not a BlockSelection")
    else:
        raise TypeError(f"sparsity must be a BlockSelection, a DynamicSparsity, a StaticSparsity or a HybridSparsity, "
                        f"got {type(sparsity).__name__}")
    sel.check_call(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return sel
