"""The order in which the attention loops hold the keys of a tile: one definition, used by every
loop, the pre-pass that stores K̂ and V̂ in it, and the tests that read them back.

Hopper's MMA gives each lane of a quad the columns 8j + 2t + {0, 1} of its rows (t: the lane in
the quad). Loading keys QB·t + 2j + {0, 1} there puts every P-quantization block (QB consecutive
keys) in one lane: block maxima, scales and rounding units are computed once per lane, with no
cross-lane reduction. In general column c = 2·NB·j + 2·t + e of a tile holds key QB·t + 2·j + e
(NB = BLOCK_N // QB blocks per tile): :func:`mma_key_order`. Everything else here is derived from
it: its inverse (:func:`tile_key_position`, where the pre-pass stores a key), the relabelling
that makes P̂ the A operand of Hopper's 8-bit MMA (:func:`as_mma_operand`), and the host-side
permutations, computed by evaluating the same jit functions' Python bodies on torch tensors.
Reading the pre-pass's operands back in key order is the tests' business (tests/key_order_reference.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fp4video.reference import KEY_TILE

#: P-quantization block of the loops' lane layout (keys per lane and block)
LANE_BLOCK = 32


@triton.jit
def mma_key_order(cols, NB: tl.constexpr, QB: tl.constexpr):
    """The key (within its tile) that column ``cols`` of an S tile holds: c = 2·NB·j + 2·t + e
    holds key QB·t + 2·j + e (NB = BLOCK_N // QB blocks per tile)."""
    return QB * ((cols // 2) % NB) + 2 * (cols // (2 * NB)) + cols % 2


@triton.jit
def tile_key_position(keys, TILE: tl.constexpr):
    """Where key ``keys`` is stored when each tile of 128 keys is in :func:`mma_key_order` with
    QB = 32 (row 8j + 2t + e of a tile holds key 32t + 2j + e): the inverse of that order, so a
    loop reading a tile's rows in storage order gets the keys in the order its MMA wants."""
    tl.static_assert(TILE == 128, "the key order of 128-key tiles")
    k = keys % TILE
    return keys - k + 8 * ((k % 32) // 2) + 2 * (k // 32) + k % 2


@triton.jit
def operand_column(slots):
    """The S-tile column whose value :func:`as_mma_operand` puts in operand slot ``slots``: within
    each 32-key slice, slot 16a + 4t + 2b + e takes column 16a + 8b + 2t + e."""
    kk = slots % 32
    return slots - kk + 16 * ((kk // 16) % 2) + 8 * ((kk // 2) % 2) + 2 * ((kk // 4) % 4) + kk % 2


@triton.jit
def as_mma_operand(p8, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P̂ (e4m3, laid out as the Q̂·K̂ᵀ accumulator) with its columns relabelled so that it is
    already where Hopper's 8-bit MMA wants its A operand: no data moves.

    Within each 32-key slice of the MMA's reduction, lane t of a quad holds the accumulator's
    columns 8b + 2t + e (b < 4, e < 2) but feeds the A operand's k = 4t + u and 16 + 4t + u
    (u < 4). Relabelling column 16a + 8b + 2t + e as k = 16a + 4t + 2b + e (a swap of two index
    digits, free in registers; :func:`operand_column` is its map) makes every lane's values its
    own operand slots; Triton otherwise exchanges them between lanes. P̂·V̂ then needs V̂'s rows in
    the same relabelled order, which the pre-pass stores (:func:`v8t_key_order`).
    """
    x = tl.reshape(p8, (BLOCK_M, BLOCK_N // 32, 2, 2, 4, 2))  # column digits (slice, a, b, t, e)
    return tl.reshape(tl.permute(x, (0, 1, 2, 4, 3, 5)), (BLOCK_M, BLOCK_N))  # -> (slice, a, t, b, e)


@triton.jit
def quad_key_order(rows):
    """The key that stored row ``rows`` of K̂ holds in the quad key order of consumer Blackwell's
    dot_scaled loop: within each 32 keys, row 8j + 2t + e holds key 8t + 2j + e (its own inverse).

    ``mma.sync``'s accumulator gives lane t of a quad the columns 8j + 2t + e of each 32; its FP4
    A operand wants lane t to hold 8 consecutive keys, 8t … 8t + 7. With K̂'s rows so ordered, the
    lane's columns of S are those keys, and P's packed codes, relabelled from byte 4j + t to byte
    4t + j (in :mod:`.loop_scaled_sm120`'s loop: two index digits swap, no data moves), are in
    key order where the MMA wants them — no byte-wise exchange through shared memory. MXFP4's P blocks of 32 keys are
    whole groups; NVFP4's of 16 are the columns of one t // 2."""
    k = rows % 32
    return rows - k + 8 * ((k // 2) % 4) + 2 * (k // 8) + k % 2


def _whole_tiles(n: int) -> torch.Tensor:
    if n % KEY_TILE:
        raise ValueError(f"whole tiles of {KEY_TILE} keys, got n={n}")
    return torch.arange(n)


def tile_key_order(n: int) -> torch.Tensor:
    """The key each of ``n`` stored rows holds when tiles are stored in the loops' key order
    (:func:`mma_key_order`, QB = 32): the pre-pass's K̂/V̂ rows of the NVFP4 loops and K̂ of the
    TMA e4m3 loop (n: a multiple of 128; keys past Sk are padding)."""
    r = _whole_tiles(n)
    return r - r % KEY_TILE + mma_key_order.fn(r % KEY_TILE, KEY_TILE // LANE_BLOCK, LANE_BLOCK)


def v8t_key_order(n: int) -> torch.Tensor:
    """The token each of the ``n`` stored columns of the e4m3 pre-pass's V̂ᵀ holds: the order in
    which the e4m3 loop's P̂ operand holds the keys (:func:`mma_key_order` composed with
    :func:`as_mma_operand`'s relabelling), tile by tile."""
    k = _whole_tiles(n)
    c = operand_column.fn(k % KEY_TILE)
    return k - k % KEY_TILE + mma_key_order.fn(c, KEY_TILE // LANE_BLOCK, LANE_BLOCK)


@functools.lru_cache(maxsize=8)
def key_order_matrix(device: torch.device, dtype: torch.dtype, in_order: bool = False) -> torch.Tensor:
    """Π (128 × 128, 0/1): column c has its one in row ``mma_key_order(c)``, so that Vᵀ·Π holds
    token mma_key_order(c) of a key tile in column c (the pre-pass's tensor-core transposition of
    V); ``in_order``: the identity (tokens in order, for the dot_scaled loop's V̂ᵀ). Built once per
    device, dtype and order; shared: read it, never write it."""
    rows = torch.arange(KEY_TILE) if in_order else tile_key_order(KEY_TILE)
    pi = torch.zeros(KEY_TILE, KEY_TILE, dtype=dtype)
    pi[rows, torch.arange(KEY_TILE)] = 1
    return pi.to(device)
