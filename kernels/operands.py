"""What the pre-pass hands a loop: one frozen record per operand layout, fields by name.

Shapes are (B, H, rows, columns); ``Sk_pad`` is Sk rounded up to whole key tiles of 128
(:data:`fp4video.reference.KEY_TILE`), ``Dv_pad`` the value head dim rounded up to a power of two
(at least 32). Every tensor is the pre-pass's own output: a loop reads it, never writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4video.reference import KEY_TILE
from fp4video.sparse import tile_lists

__all__ = ["WorkOperands", "TileOperands", "FP8Operands", "PackedOperands", "KeyTileLists"]


@dataclass(frozen=True, eq=False)
class WorkOperands:
    """Q̂, K̂, V̂ as 16-bit (or, in the interpreter, fp32) values, (B, H, S, D) views of any strides:
    the bf16 loop's operands (:func:`.prepass.prepass`), or the inputs themselves (``fp16``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True, eq=False)
class TileOperands:
    """Q̂ (B, H, Sq, D) and K̂, V̂ (B, H, Sk_pad, ·) as 16-bit values, K̂ and V̂ in tile key order
    with zero rows up to whole key tiles (:func:`.prepass.prepass_tiles`): the NVFP4 loops'
    operands, for ``sk`` keys."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sk: int


@dataclass(frozen=True, eq=False)
class FP8Operands:
    """E4M3 codes with power-of-two factors (:func:`.prepass.prepass_fp8`): the value is
    ``q8 · q_fac`` per query row (``q_fac`` (B, H, Sq)), ``k8 · k_fac`` per key tile (``k_fac`` (B,
    H, Sk_pad / 128)), ``v8t · v_fac`` per value channel (``v8t`` (B, H, Dv_pad, Sk_pad): V
    transposed, its tokens within each tile in the e4m3 loop's P̂ operand order; ``v_fac`` (B, H,
    Dv_pad)). ``k8`` is (B, H, Sk, D), or with ``k_tile_order`` (B, H, Sk_pad, D) in tile key order
    (what a TMA box copies). ``v_span``: V's channels' widest span in binades (B, H, Dv_pad) int, on
    the device, which says whether the e4m3 loop is exact here (None where V is E4M3 by definition)."""

    q8: torch.Tensor
    q_fac: torch.Tensor
    k8: torch.Tensor
    k_fac: torch.Tensor
    v8t: torch.Tensor
    v_fac: torch.Tensor
    sk: int
    k_tile_order: bool
    v_span: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PackedOperands:
    """E2M1 codes, two per byte (the first in the low nibble), as ``tl.dot_scaled`` and Blackwell's
    FP4 MMAs take them (:func:`.prepass.prepass_packed`).

    MXFP4 Q·K: ``q4`` (B, H, Sq, D/2), ``k4`` (B, H, Sk, D/2) with E8M0 scales ``q_scale``,
    ``k_scale`` (·, D/32, uint8, exponent + 127). NVFP4 Q·K: each row of ``q4``, ``k4`` holds its
    codes, then its E4M3 block-scale bytes (blocks of 16; K̂'s rows padded to 16 bytes), the scales
    None, and the heads' tensor scales ``g_q``, ``g_k`` (B, H) fp32.

    ``v`` is V transposed (B, H, Dv_pad, ·), its tokens padded to whole key tiles: FP4 P·V — MXFP4
    codes (Sk_pad/2) with ``v_scale`` (B, H, Dv_pad, Sk_pad/32), or NVFP4 rows of codes and scale
    bytes with ``g_v``; FP8 P·V — E4M3 values in key order with the channels' factors ``v_fac``
    (B, H, Dv_pad). ``quad_order``: K̂'s rows (and MXFP4 K scales) in the quad key order within each
    32 keys (:func:`.key_order.quad_key_order`; views of whole groups' rows)."""

    q4: torch.Tensor
    k4: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_fac: torch.Tensor | None = None
    g_q: torch.Tensor | None = None
    g_k: torch.Tensor | None = None
    g_v: torch.Tensor | None = None
    quad_order: bool = False


@dataclass(frozen=True, eq=False)
class KeyTileLists:
    """A block-sparse call's key tiles, as its loop reads them (:meth:`from_bitmap`):
    ``index`` int32 (B, H, n_query_tiles, n_key_tiles), each query tile's visited key tiles (of
    128 keys) in ascending order first; ``count`` int32 (B, H, n_query_tiles), how many it visits;
    ``query_tile`` the rows of a query tile (a multiple of the loop's rows per program)."""

    index: torch.Tensor
    count: torch.Tensor
    query_tile: int

    @classmethod
    def from_bitmap(cls, key_tiles: torch.Tensor, query_tile: int, b: int, h: int, sq: int, sk: int) -> KeyTileLists:
        """A selection bitmap (B|1, H|1, ceil(sq / query_tile), ceil(sk / 128)) bool as the lists
        (:func:`fp4video.sparse.tile_lists`, expanded to every batch entry and head)."""
        want = (-(-sq // query_tile), -(-sk // KEY_TILE))
        if key_tiles.dtype != torch.bool or key_tiles.dim() != 4 or tuple(key_tiles.shape[-2:]) != want or any(
                n not in (1, m) for n, m in zip(key_tiles.shape[:2], (b, h))):
            raise ValueError(f"key_tiles must be a bool (B|1, H|1, {want[0]}, {want[1]}) bitmap for {sq} queries in "
                             f"tiles of {query_tile} and {sk} keys in tiles of {KEY_TILE}, got {key_tiles.dtype} "
                             f"{tuple(key_tiles.shape)}")
        index, count = tile_lists(key_tiles.expand(b, h, *want))
        return cls(index, count, query_tile)

    @staticmethod
    def pointers(lists: KeyTileLists | None, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (index, count) arguments of a loop launch: the lists of a block-sparse call, or
        ``dummy`` twice (never read) for a dense one."""
        return (lists.index, lists.count) if lists is not None else (dummy, dummy)
