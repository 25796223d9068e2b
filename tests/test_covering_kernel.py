"""The sparse check's row placement kernel (:mod:`fp4video.kernels.covering`) against the reference
:func:`fp4video.sparse.covering_rows` and against k-center greedy itself, in fp64 from the inputs'
values: the same rows and weights tile by tile on random queries (whole and partial tiles, tiles
shorter than the rows per tile, query tiles and head dims that are not powers of two, strided
queries); the same tie-breaking where ties are exact (small-integer queries, whose distances every
summation order computes exactly: in 16-bit dtypes the dot products' rounding to nearest even makes
many of them equal); picks that are valid greedy picks up to rounding where ties are near (points
on a circle); non-finite queries chosen as the reference chooses them; ``q`` never modified; the
reference where the kernel cannot run. The ``gpu`` twin compares large 16-bit inputs, where the
summation order may round a dot product the other way: every pick valid, nearly every tile equal,
nothing read back to the host, a CUDA graph replays it."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fp4video.sparse import covering_rows as reference

pytest.importorskip("triton")
from fp4video.kernels import covering  # noqa: E402

from conftest import HAS_CUDA, rand  # noqa: E402

#: the unit roundoff of the dot products' dtype (the reference's matmul output); fp32's rounding is
#: covered by the summation term of :func:`assert_greedy_covering`
UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture
def kernel(monkeypatch):
    """The kernel's ``covering_rows`` with its fall-back to the reference taken away: a call it
    would hand to the reference fails instead (these tests compare the kernel, not the reference
    with itself)."""

    def no_fallback(*args, **kwargs):
        raise AssertionError("the kernel handed this call to the reference")

    monkeypatch.setattr(covering, "reference_covering_rows", no_fallback)
    return covering.covering_rows


def tiles(q: torch.Tensor, query_tile: int):
    """(x (B, H, nq, L, D) fp64 zero-padded, length (nq,), valid (nq, L)) of ``q`` on the CPU."""
    b, h, sq, d = q.shape
    nq = -(-sq // query_tile)
    x = torch.nn.functional.pad(q.detach().cpu().double(), (0, 0, 0, nq * query_tile - sq))
    length = (sq - torch.arange(nq) * query_tile).clamp(max=query_tile)
    return x.reshape(b, h, nq, query_tile, d), length, torch.arange(query_tile)[None, :] < length[:, None]


def assert_contract(q, query_tile, per_tile, rows, weight):
    b, h, sq, _ = q.shape
    nq = -(-sq // query_tile)
    assert rows.shape == weight.shape == (b, h, nq, per_tile)
    assert rows.dtype == torch.int64 and weight.dtype == torch.float32
    assert rows.device == weight.device == q.device
    start = (torch.arange(nq, device=q.device) * query_tile)[:, None]
    assert ((rows >= start) & (rows < (start + query_tile).clamp(max=sq))).all()  # in its own tile
    assert (weight >= 0).all()
    torch.testing.assert_close(weight.sum(-1), torch.ones(b, h, nq, device=q.device), rtol=0, atol=1e-6)


def assert_greedy_covering(q, query_tile, per_tile, rows, weight):
    """Every tile of finite queries has k-center greedy's picks and weights up to the rounding of
    the distances ``‖x‖² − 2 x·s + ‖s‖²`` (dot in q's dtype, the rest in fp32), worked out in fp64
    from q's values: with one row, a row nearest the tile's mean; else its first and last rows, then
    each a row not yet chosen whose distance to the nearest chosen one is the largest (the first row
    again when none is left); each weight between the share of rows nearest to that chosen row alone
    and the share of rows it may be nearest to, a repeated row weighing 0."""
    x, length, valid = tiles(q, query_tile)
    rows, weight = rows.cpu(), weight.cpu().double()
    b, h, nq, big_l, d = x.shape
    off = rows - (torch.arange(nq) * query_tile)[:, None]  # (B, H, nq, r) offsets in the tile
    finite = torch.where(valid[..., None], x, 0.0).isfinite().all(-1).all(-1)  # (B, H, nq)
    x = torch.where(finite[..., None, None], x, 0.0)
    c = x.gather(3, off[..., None].expand(b, h, nq, per_tile, d))  # the chosen rows' queries
    n2, c2 = x.square().sum(-1), c.square().sum(-1)
    dot = x @ c.transpose(-1, -2)  # (B, H, nq, L, r)
    dist = (n2[..., None] - 2 * dot + c2[..., None, :]).clamp(min=0)
    err = 4 * UNIT[q.dtype] * dot.abs() + 2.0**-16 * (n2[..., None] + c2[..., None, :] + 2 * dot.abs())
    lo, hi = dist - err, dist + err
    if per_tile == 1:
        mean = (x * valid[..., None]).sum(-2, keepdim=True) / length[:, None, None]
        to_mean = (x - mean).square().sum(-1).sqrt()
        slack = 2.0**-16 * (n2.sqrt() + mean.square().sum(-1).sqrt())
        best = torch.where(valid, to_mean + slack, math.inf).amin(-1)
        picked = (to_mean - slack).gather(-1, off[..., :1]).squeeze(-1)
        assert (picked <= best)[finite].all(), "a pick farther from the mean than the nearest row"
    else:
        assert (off[..., 0] == 0).all() and (off[..., 1] == length - 1).all(), "the tile's first and last rows"
        for k in range(2, per_tile):
            lo_k, hi_k = lo[..., :k].amin(-1), hi[..., :k].amin(-1)  # (B, H, nq, L)
            chosen = torch.zeros(b, h, nq, big_l, dtype=torch.bool).scatter(-1, off[..., :k], True)
            left = valid & ~chosen
            pick = off[..., k : k + 1]
            far = hi_k.gather(-1, pick).squeeze(-1) >= torch.where(left, lo_k, -math.inf).amax(-1)
            ok = torch.where(left.any(-1), left.gather(-1, pick).squeeze(-1) & far, pick.squeeze(-1) == 0)
            assert ok[finite].all(), f"pick {k} is not the farthest row up to rounding"
    r = torch.arange(per_tile)
    repeat = ((off[..., :, None] == off[..., None, :]) & (r[:, None] > r[None, :])).any(-1)  # (B, H, nq, r)
    assert (weight[repeat] == 0).all(), "a repeated row weighs something"
    may = (lo <= hi.amin(-1, keepdim=True)) & ~repeat[..., None, :] & valid[..., None]  # (B, H, nq, L, r)
    only = may & (may.sum(-1, keepdim=True) == 1)
    low, high = only.sum(-2) / length[:, None], may.sum(-2) / length[:, None]
    assert ((weight >= low - 1e-6) & (weight <= high + 1e-6))[finite].all(), "a weight not its rows' share"


def formula(q, query_tile, per_tile):
    """The reference's result with its distances as its docstring states them: on CUDA, its matmuls
    with fp32 operands in fp32 (not TF32, which another test's training may have switched on in
    this process) and 16-bit operands summed in fp32 (no reduced-precision reductions)."""
    if not q.is_cuda:
        return reference(q, query_tile, per_tile)
    matmul = torch.backends.cuda.matmul
    flags = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    before = {flag: getattr(matmul, flag) for flag in flags}
    try:
        for flag in flags:
            setattr(matmul, flag, False)
        return reference(q, query_tile, per_tile)
    finally:
        for flag, value in before.items():
            setattr(matmul, flag, value)


def assert_same(got, want):
    """The same rows and weights (bit for bit), tile by tile."""
    assert torch.equal(got[0], want[0]), (got[0] != want[0]).nonzero()[:5].tolist()
    assert torch.equal(got[1], want[1]), (got[1] != want[1]).nonzero()[:5].tolist()


def test_the_greedy_check_rejects_picks_and_weights_greedy_would_not_give():
    """:func:`assert_greedy_covering` itself: the reference's picks pass; a third pick moved to the
    row nearest the chosen ones, a row's share moved to another chosen row, the row farthest from
    the mean as the one row: each fails."""
    q = rand(1, 1, 256, 32, seed=1)
    rows, weight = reference(q, 128, 4)
    assert_greedy_covering(q, 128, 4, rows, weight)
    x = q[0, 0, :128].double()
    to_first_two = torch.cdist(x, x[rows[0, 0, 0, :2]]).amin(-1)
    to_first_two[rows[0, 0, 0, :2]] = math.inf
    near = rows.clone()
    near[0, 0, 0, 2] = to_first_two.argmin()
    with pytest.raises(AssertionError, match="pick 2"):
        assert_greedy_covering(q, 128, 4, near, weight)
    moved = weight.clone()
    moved[0, 0, 1, 0] += 1 / 128
    moved[0, 0, 1, 1] -= 1 / 128
    with pytest.raises(AssertionError, match="share"):
        assert_greedy_covering(q, 128, 4, rows, moved)
    one, w1 = reference(q, 128, 1)
    to_mean = (q[0, 0, :128] - q[0, 0, :128].mean(0)).norm(dim=-1)
    far = one.clone()
    far[0, 0, 0, 0] = to_mean.argmax()
    with pytest.raises(AssertionError, match="mean"):
        assert_greedy_covering(q, 128, 1, far, w1)


# --- random queries: the reference's picks -------------------------------------------------------------


@pytest.mark.parametrize("query_tile", [128, 64])
@pytest.mark.parametrize("per_tile", [1, 2, 4, 10])
def test_kernel_placement_is_the_references_on_random_queries(query_tile, per_tile, kernel, device):
    """300 tokens: whole tiles and a partial last one (44 rows), queries around a common mean (as
    real queries are: the row nearest a partial tile's mean is then not the row nearest the origin).
    Distinct random queries have no two distances within fp32 rounding of each other: the same picks
    and weights."""
    q = rand(1, 2, 300, 64, seed=per_tile, device=device) * 2 + rand(1, 1, 1, 64, seed=99, device=device) * 3
    got = kernel(q, query_tile, per_tile)
    assert_contract(q, query_tile, per_tile, *got)
    assert_same(got, formula(q, query_tile, per_tile))
    assert_greedy_covering(q, query_tile, per_tile, *got)


@pytest.mark.parametrize("query_tile,d", [(100, 80), (128, 128), (32, 16)])
def test_tiles_and_head_dims_that_are_not_powers_of_two(query_tile, d, kernel, device):
    q = rand(2, 1, 250, d, seed=d, device=device)
    got = kernel(q, query_tile, 5)
    assert_contract(q, query_tile, 5, *got)
    assert_same(got, formula(q, query_tile, 5))


@pytest.mark.parametrize("sq", [257, 259])
@pytest.mark.parametrize("per_tile", [2, 4, 10])
def test_tiles_shorter_than_per_tile_repeat_the_first_row_weighing_nothing(sq, per_tile, kernel, device):
    """A last tile of 1 or 3 rows: its rows each chosen once, then the tile's first row again."""
    q = rand(1, 2, sq, 64, seed=sq, device=device)
    rows, weight = kernel(q, 128, per_tile)
    assert_same((rows, weight), formula(q, 128, per_tile))
    n = sq - 256
    last, w = rows[..., -1, :].cpu(), weight[..., -1, :].cpu()
    if per_tile >= n:
        assert sorted(set(last[0, 0, :n].tolist())) == list(range(256, sq)) and (last[..., n:] == 256).all()
        assert (w[..., n:] == 0).all() and torch.equal(w[..., :n].sort(-1).values.clone(), torch.full((1, 2, n), 1 / n))
    assert_greedy_covering(q, 128, per_tile, rows, weight)


def test_strided_queries_are_read_in_place_and_never_modified(kernel, device):
    """(B, S, H, D) queries seen as (B, H, S, D): the same result as the contiguous copy; q unchanged."""
    base = rand(1, 300, 3, 64, seed=7, device=device)
    q = base.transpose(1, 2)
    before = base.clone()
    got = kernel(q, 128, 4)
    assert torch.equal(base, before)
    assert_same(got, formula(q.contiguous(), 128, 4))


# --- ties --------------------------------------------------------------------------------------------


#: (dtype, largest |value|, common offset) of the small-integer queries
INTEGER_QUERIES = [(torch.float32, 2, 0), (torch.bfloat16, 60, 0), (torch.float16, 40, 0), (torch.bfloat16, 2, 30),
                   (torch.float16, 2, 30)]


@pytest.mark.parametrize("dtype,top,offset", INTEGER_QUERIES)
@pytest.mark.parametrize("per_tile", [1, 3, 10])
def test_exact_ties_are_broken_as_the_reference_breaks_them(dtype, top, offset, per_tile, kernel, device):
    """Small-integer queries: every sum is an integer below 2^24, computed exactly in any order, so
    the kernel's distances are the reference's bit for bit and only tie-breaking can differ. With
    values up to 2 (fp32) most distances tie; in 16 bits the dot products, to 115,200, are rounded to
    nearest even in q's dtype, which equates many (a truncating rounding, the CPU interpreter's
    cast, or none, gives other picks), most where the queries share an offset of 30 (dot products
    near 28,800, distances near 100: the rounding decides); in fp16 those of the rows of ±60s and
    50s overflow to ±inf, as the reference's. Repeated rows tie at distance 0."""
    g = torch.Generator().manual_seed(top + per_tile)
    q = torch.randint(-top, top + 1, (1, 2, 300, 32), generator=g).float() + offset
    q[:, :, 140], q[:, :, 30], q[:, 1, 100], q[:, 0, 230] = 60, 50, -60, 60
    q[:, :, 150:170] = q[:, :, 140:141]  # a run of equal queries
    q = q.to(device=device, dtype=dtype)
    got = kernel(q, 64, per_tile)
    assert_contract(q, 64, per_tile, *got)
    assert_same(got, formula(q, 64, per_tile))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_queries_round_their_dot_products_as_the_reference(dtype, kernel, device):
    """Random 16-bit queries: the dot products are rounded to q's dtype as the reference's matmul
    rounds them, so the picks agree but where another summation order rounds one of them the other
    way (one unit of q's dtype) and two distances lie that close: then both are valid greedy picks.
    At most 1 of the 32 tiles differs (in bf16 a truncating rounding changes about a quarter of
    them; in fp16 no rounding at all changes a few)."""
    q = rand(1, 2, 1024, 64, seed=11, device=device, dtype=dtype) * 2
    got = kernel(q, 64, 10)
    want = formula(q, 64, 10)
    assert_contract(q, 64, 10, *got)
    assert_greedy_covering(q, 64, 10, *got)
    differ = ((got[0] != want[0]) | (got[1] != want[1])).any(-1)
    assert differ.sum() <= 1, f"{int(differ.sum())} of {differ.numel()} tiles differ"


@pytest.mark.parametrize("per_tile", [1, 4, 10])
def test_near_ties_give_valid_greedy_picks(per_tile, kernel, device):
    """Queries on a circle (a regular 128-gon in a random plane of the head dim, plus its center):
    many distances agree up to rounding, where the kernel and the reference may order them either
    way; every pick is the farthest row up to that rounding and every weight its rows' share."""
    g = torch.Generator().manual_seed(per_tile)
    basis, _ = torch.linalg.qr(torch.randn(64, 2, generator=g, dtype=torch.float64))
    angle = 2 * math.pi * torch.arange(128, dtype=torch.float64) / 128
    circle = torch.stack([angle.cos(), angle.sin()], -1) @ basis.T * 3  # (128, 64)
    q = torch.cat([circle, circle[:1] * 0, circle.flip(0)]).float().reshape(1, 1, 257, 64).expand(1, 2, 257, 64)
    q = q.to(device)
    got = kernel(q, 128, per_tile)
    assert_contract(q, 128, per_tile, *got)
    assert_greedy_covering(q, 128, per_tile, *got)


# --- non-finite queries --------------------------------------------------------------------------------


@pytest.mark.parametrize("per_tile", [1, 2, 3, 10])
def test_non_finite_queries_are_chosen_as_the_reference_chooses_them(per_tile, kernel, device):
    """NaN, +Inf and -Inf rows count as farthest from everything (the first of them is the third
    pick of its tile); a tile of only non-finite rows; one row per tile: the reference's pick."""
    q = rand(1, 2, 300, 64, seed=3)
    q[0, 0, 20, 5] = math.nan
    q[0, 0, 90, 0] = math.inf
    q[0, 1, 150:160, 1] = -math.inf
    q[0, 1, 256:] = math.nan  # the whole last tile
    q = q.to(device)
    before = q.clone()
    got = kernel(q, 128, per_tile)
    torch.testing.assert_close(q, before, rtol=0, atol=0, equal_nan=True)
    assert_contract(q, 128, per_tile, *got)
    assert_same(got, formula(q, 128, per_tile))
    rows = got[0].cpu()
    if per_tile >= 3:
        assert rows[0, 0, 0, 2] == 20 and rows[0, 1, 1, 2] == 150
    if per_tile >= 4:
        assert rows[0, 0, 0, 3] == 90 and rows[0, 1, 1, 3] == 151


# --- where the kernel does not run ---------------------------------------------------------------------


def test_calls_the_kernel_cannot_run_are_the_references(monkeypatch, device):
    """Tiles larger than a program holds, empty tensors: handed to the reference (a call of it is
    seen); bad arguments get the reference's errors."""
    handed = []

    def spy(*args):
        handed.append(args[1:])
        return reference(*args)

    monkeypatch.setattr(covering, "reference_covering_rows", spy)
    q = rand(1, 2, 300, 64, seed=5, device=device)
    for args in ((q, 1024, 3), (q[:, :, :0], 128, 3), (q[:, :0], 128, 3)):
        assert_same(covering.covering_rows(*args), reference(*args))
    assert handed == [(1024, 3), (128, 3), (128, 3)]
    for args in ((q, 128, 0), (q, True, 2), (q[0], 128, 2), (q.int(), 128, 2)):
        with pytest.raises(ValueError) as want:
            reference(*args)
        with pytest.raises(ValueError, match=re.escape(str(want.value))):
            covering.covering_rows(*args)


# --- on the GPU -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_tile", [2, 10])
def test_kernel_placement_is_the_references_gpu(dtype, per_tile, kernel):
    """8 heads of 9,000 tokens (a partial last tile), D = 128: every pick and weight valid up to
    rounding; the summation order may round a dot product the other way (one unit of q's dtype)
    where two distances lie that close, so a few tiles may differ, no more than 1 in 100; nothing
    read back to the host (a sync raises); a CUDA graph replays it."""
    from test_sparse_loops import assert_graph_replays_eager

    q = rand(1, 8, 9000, 128, seed=per_tile, device="cuda", dtype=dtype) * 2
    got = kernel(q, 128, per_tile)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel(q, 128, per_tile)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = formula(q, 128, per_tile)
    assert_contract(q, 128, per_tile, *got)
    assert_greedy_covering(q, 128, per_tile, *got)
    differ = ((got[0] != want[0]) | (got[1] != want[1])).any(-1)
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} tiles differ"
    assert_graph_replays_eager(lambda: torch.stack([t.double() for t in kernel(q, 128, per_tile)]))


@pytest.mark.gpu
def test_ties_short_tiles_and_non_finite_queries_gpu(kernel):
    """The CPU interpreter's argmax and argmin take the first of equal values whatever the kernel
    asks; the GPU's take what it asks: the tests of exact ties, short tiles and non-finite queries,
    on CUDA."""
    for per_tile in (1, 3, 10):
        for dtype, top, offset in INTEGER_QUERIES:
            test_exact_ties_are_broken_as_the_reference_breaks_them(dtype, top, offset, per_tile, kernel, "cuda")
        test_non_finite_queries_are_chosen_as_the_reference_chooses_them(per_tile, kernel, "cuda")
        for sq in (257, 259):
            test_tiles_shorter_than_per_tile_repeat_the_first_row_weighing_nothing(sq, max(per_tile, 2), kernel, "cuda")
