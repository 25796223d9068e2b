"""The loops' key order (:mod:`fp4video.kernels.key_order`): one definition, and its inverse, the
MMA operand relabelling and the host permutations derived from it agree, on the host and in the
kernels (interpreter or GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4video.kernels.key_order import (as_mma_operand, key_order_matrix, mma_key_order, operand_column,  # noqa: E402
                                        tile_key_order, tile_key_position, v8t_key_order)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _orders_kernel(Order, Position, Operand, Relabelled):
    cols = tl.arange(0, 128)
    tl.store(Order + cols, mma_key_order(cols, 4, 32))
    tl.store(Position + cols, tile_key_position(cols, 128))
    tl.store(Operand + cols, operand_column(cols))
    # the relabelling as_mma_operand applies, read off a row of column indices
    row = tl.reshape(as_mma_operand(tl.reshape(cols, (1, 128)), 1, 128), (128,))
    tl.store(Relabelled + cols, row)


def _kernel_orders():
    outs = [torch.empty(128, dtype=torch.int32, device=DEV) for _ in range(4)]
    _orders_kernel[(1,)](*outs)
    return [o.cpu().long() for o in outs]


def test_the_kernels_key_order_is_the_hosts():
    """In a kernel, mma_key_order is the host's tile_key_order, tile_key_position its inverse, and
    as_mma_operand puts column operand_column(k) in slot k."""
    order, position, operand, relabelled = _kernel_orders()
    assert torch.equal(order, tile_key_order(128))
    assert torch.equal(position[order], torch.arange(128))  # the inverse
    assert torch.equal(relabelled, operand)
    assert sorted(operand.tolist()) == list(range(128))


def test_tile_key_order_puts_each_p_block_in_one_lane():
    """Column 8j + 2t + e of a tile holds key 32t + 2j + e: the columns lane t of an MMA quad holds
    (8j + 2t + {0, 1}) are exactly the 32 keys of P block t; tiles repeat, shifted by 128."""
    order = tile_key_order(384)
    assert order[:10].tolist() == [0, 1, 32, 33, 64, 65, 96, 97, 2, 3]
    for tile in range(3):
        cols = torch.arange(128) + 128 * tile
        lane = (torch.arange(128) // 2) % 4
        for t in range(4):
            assert torch.equal(order[cols[lane == t]].sort().values, 128 * tile + 32 * t + torch.arange(32))
    with pytest.raises(ValueError, match="whole tiles of 128"):
        tile_key_order(100)


def test_v8t_key_order_puts_each_p_block_in_one_lane():
    """The stored order of the e4m3 V̂ᵀ: a permutation of every 128-token tile in which the
    operand slots of lane t of an MMA quad (k = 4t + u and 16 + 4t + u of each 32-key slice,
    u < 4) hold exactly the 32 consecutive tokens of P block t."""
    order = v8t_key_order(384)
    for tile in range(3):
        cols = torch.arange(128) + 128 * tile
        assert torch.equal(order[cols].sort().values, cols)
        lane = (torch.arange(128) // 4) % 4
        for t in range(4):
            assert torch.equal(order[cols[lane == t]].sort().values, 128 * tile + 32 * t + torch.arange(32))
    assert order[:8].tolist() == [0, 1, 2, 3, 32, 33, 34, 35]
    assert order[16:18].tolist() == [4, 5] and order[32:34].tolist() == [8, 9]


def test_key_order_matrix_moves_each_token_to_its_column():
    """Vᵀ·Π puts token mma_key_order(c) of a tile in column c."""
    pi = key_order_matrix(torch.device("cpu"), torch.float32)
    tokens = torch.arange(128, dtype=torch.float32)[None]
    assert torch.equal((tokens @ pi)[0].long(), tile_key_order(128))
