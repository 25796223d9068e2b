"""The sparse check's row placement on the GPU: :func:`fp4video.sparse.covering_rows` fused into one
program per (batch entry, head, query tile).

A program loads its tile's queries once (at most 128 × D values of the default tile), their squared
norms, then runs the greedy steps on them in registers: per step the distance of every row of the
tile to the row just chosen (‖x‖² − 2 x·s + ‖s‖², the reference's formula: the dot product summed
in fp32 and rounded to ``q``'s dtype, as the reference's matmul in that dtype returns it), the
running distance to the nearest chosen row and which chosen row that is. It writes the chosen rows
and each one's share of the tile's rows. The reference's tensor operations instead make a pass over
(B, H, nq, 128) tensors per step.

Where the results can differ from the reference: the sums (squared norms, dot products, the tile's
mean with one row per tile) run in another order, so a distance can differ in its last fp32 bit
(or, for 16-bit queries, a dot product that lies at a rounding boundary of its dtype by one unit of
that dtype). Two rows whose distances are that close can then swap places in an argmax (the next
farthest row), an argmin (the row nearest the mean; a row's nearest chosen row) or a tie that only
one side sees as a tie (broken to the first row or the first chosen on both sides). Exact ties
(equal values in both, e.g. repeated or small-integer queries, non-finite queries) are broken the
same way, so only near-ties within rounding can differ; on continuous random queries that has
probability zero in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4video.sparse import covering_rows as reference_covering_rows
from fp4video.sparse.selection import n_tiles

from .plan import interpreting
from .tiles import next_pow2, round_bf16

__all__ = ["covering_rows", "MAX_TILE_VALUES"]

#: the most values (rows × head dim, each padded to a power of two) a program holds in registers;
#: a larger tile runs the reference
MAX_TILE_VALUES = 128 * 256

#: how the kernel rounds its fp32 dot products: as q's dtype does (the reference's matmul output)
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _covering_kernel(Q, Rows, Weight, H, SQ, D, n_query_tiles, per_tile, tile,
                     sqb, sqh, sqs, sqd,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ONE: tl.constexpr, ROUND: tl.constexpr):
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = t * tile
    length = tl.minimum(SQ - start, tile)
    r = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    valid = r < length
    base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + start.to(tl.int64) * sqs
    # rows past the tile hold 0, as the reference's padding; the tile stays in q's dtype (16-bit
    # queries take half the registers: more programs run at once) and is widened where it is used
    x = tl.load(base + r[:, None] * sqs + d[None, :] * sqd, mask=valid[:, None] & (d[None, :] < D), other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
    norm2 = norm * norm  # (the reference squares the fp32 norm)
    out = (bh.to(tl.int64) * n_query_tiles + t) * per_tile
    inf = float("inf")
    if ONE:  # the row nearest the tile's mean (non-finite distances count as infinite)
        mean = tl.div_rn(tl.sum(xf, axis=0), length.to(tl.float32))
        diff = xf - mean[None, :]
        to_mean = tl.sqrt_rn(tl.sum(diff * diff, axis=1))
        to_mean = tl.where(valid & (to_mean < inf), to_mean, inf)
        first = tl.argmin(to_mean, axis=0)
    else:
        first = 0
    nearest = tl.full([BLOCK_T], inf, tl.float32)  # each row's distance to the nearest chosen (-2: chosen)
    owner_d = tl.full([BLOCK_T], inf, tl.float32)  # the same, chosen rows included
    owner = tl.zeros([BLOCK_T], dtype=tl.int32)  # which chosen row that is (the first of equals)
    for step in range(0, per_tile):
        # the row farthest from every chosen one (a chosen or padding row: never; none left: row 0)
        far = tl.argmax(tl.where(valid & (nearest > -1.0), nearest, -1.0), axis=0)
        s = tl.where(step == 0, first, tl.where(step == 1, length - 1, far))
        xs = tl.load(base + s.to(tl.int64) * sqs + d * sqd, mask=d < D, other=0.0).to(tl.float32)
        dot = tl.sum(x.to(tl.float32) * xs[None, :], axis=1)  # exact products, summed in fp32
        if ROUND == 1:
            dot = round_bf16(dot)
        elif ROUND == 2:
            dot = dot.to(tl.float16).to(tl.float32)
        s2 = tl.sum(tl.where(r == s, norm2, 0.0), axis=0)
        raw = norm2 - 2.0 * dot + s2
        dist = tl.where(raw < 0.0, 0.0, raw)  # clamped at 0; NaN stays NaN (then infinite)
        dist = tl.where(dist < inf, dist, inf)
        nearest = tl.where(r == s, -2.0, tl.minimum(nearest, dist))
        closer = dist < owner_d
        owner_d = tl.where(closer, dist, owner_d)
        owner = tl.where(closer, step, owner)
        tl.store(Rows + out + step, (start + s).to(tl.int64))
    for j in range(0, per_tile):
        count = tl.sum(tl.where(valid & (owner == j), 1.0, 0.0), axis=0)
        tl.store(Weight + out + j, tl.div_rn(count, length.to(tl.float32)))


def covering_rows(q: torch.Tensor, query_tile: int, per_tile: int, *,
                  num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp4video.sparse.covering_rows` in one kernel launch: the same contract (``(rows,
    weight)``, each (B, H, n_query_tiles, per_tile); ``rows`` int64 indices of Sq, ``weight`` fp32
    summing to 1 per tile; a tile shorter than ``per_tile`` repeats rows weighing 0; non-finite
    queries count as farthest; ``q`` never modified; nothing read back to the host) and the same
    values but where two distances lie within rounding of each other (the module's docstring says
    where). Runs the reference where the kernel cannot: invalid arguments (its errors), tensors
    neither on CUDA nor under ``TRITON_INTERPRET=1``, dtypes other than fp32 / bf16 / fp16, empty
    tensors, and tiles of more than :data:`MAX_TILE_VALUES` values (rows × head dim, padded to powers
    of two). ``num_warps``: the launch's warps per program (default: 4 up to 128 × 128 values, the
    fastest of a sweep at Wan 720p (BENCHMARKS.md), 8 above), for tuning."""
    if not _runs(q, query_tile, per_tile):
        return reference_covering_rows(q, query_tile, per_tile)
    b, h, sq, d = q.shape
    nq = n_tiles(sq, query_tile)
    rows = torch.empty(b, h, nq, per_tile, device=q.device, dtype=torch.int64)
    weight = torch.empty(b, h, nq, per_tile, device=q.device, dtype=torch.float32)
    block_t, block_d = next_pow2(query_tile), next_pow2(d)
    _covering_kernel[(nq, b * h)](
        q, rows, weight, h, sq, d, nq, per_tile, query_tile, *q.stride(),
        BLOCK_T=block_t, BLOCK_D=block_d, ONE=per_tile == 1, ROUND=_ROUNDING[q.dtype],
        num_warps=num_warps or (4 if block_t * block_d <= 128 * 128 else 8),
    )
    return rows, weight


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _runs(q, query_tile, per_tile) -> bool:
    """Whether the kernel runs this call (else the reference: it also raises on bad arguments)."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.dtype in _ROUNDING):
        return False
    if not (_positive(query_tile) and _positive(per_tile)) or q.numel() == 0:
        return False
    if not (q.is_cuda or (interpreting() and q.device.type == "cpu")):
        return False
    return next_pow2(query_tile) * next_pow2(q.shape[-1]) <= MAX_TILE_VALUES
