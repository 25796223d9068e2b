"""What ``bench kernel`` (:mod:`.bench`) and ``bench sparse`` (:mod:`.bench_sparse`) share: the
header naming the run's GPU and versions, the peers every row is compared with, and the random
selection of a given density both time. Both import it; it imports neither."""

from __future__ import annotations

import datetime

#: The peers every row is also compared with (× their time), in the tables' column order.
RATIO_PEERS = ("SageAttention2 sageattn (INT8 QK, FP8 PV)", "FlashAttention-3 FP8 (cast included)")
RATIO_TITLES = ("× SageAttention2", "× FA3 FP8 (cast incl.)")


def run_header(what: str) -> str:
    """``### <what>: <GPU>, torch <version>, triton <version>, <date>``: a table's first line."""
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (f"### {what}: {device}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}")


def uniform_selection(heads: int, sq: int, sk: int, density: float, seed: int = 0):
    """A :class:`fp4video.sparse.BlockSelection` on the GPU visiting round(density · n_key_tiles)
    key tiles (at least one) in every query tile's list, the tile on its diagonal among them, the
    others drawn at random."""
    import torch

    from ..sparse import KEY_TILE, QUERY_TILE, BlockSelection

    nq, nk = -(-sq // QUERY_TILE), -(-sk // KEY_TILE)
    keep = max(1, round(density * nk))
    g = torch.Generator(device="cuda").manual_seed(seed)
    score = torch.rand(1, heads, nq, nk, device="cuda", generator=g)
    diagonal = (torch.arange(nq, device="cuda") * QUERY_TILE // KEY_TILE).clamp(max=nk - 1)
    score[..., torch.arange(nq, device="cuda"), diagonal] = 2.0  # always kept
    kept = score.topk(keep, dim=-1).indices
    tiles = torch.zeros(1, heads, nq, nk, dtype=torch.bool, device="cuda").scatter_(-1, kept, True)
    return BlockSelection(tiles, sq, sk)
