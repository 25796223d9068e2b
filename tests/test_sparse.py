"""Block-sparse attention (fp4video.sparse and the reference's key_tiles): full density is the dense
call bit for bit; a selection is the dense loop with the dropped tiles masked out; the dynamic
selection's estimate against the exact fp64 block mass, its τ rule and its always-kept tiles; the
static window against a per-token brute force; no read-back to the host while selecting; errors."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from fp4video import METHODS, fp4_attention
from fp4video.reference import KEY_TILE, attention_tiled, key_alive_from_mask, prepare_qkv
from fp4video.sparse import (
    BlockSelection,
    DynamicSparsity,
    StaticSparsity,
    dynamic_selection,
    estimate_block_mass,
    static_selection,
    static_token_window,
)

ROOT = Path(__file__).resolve().parents[1]


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def random_selection(b, h, sq, sk, seed, density=0.5, query_tile=128, key_tile=KEY_TILE):
    g = torch.Generator().manual_seed(seed)
    nq, nk = -(-sq // query_tile), -(-sk // key_tile)
    return BlockSelection(torch.rand(b, h, nq, nk, generator=g) < density, sq, sk, query_tile, key_tile)


def local_inputs(n=512, heads=2, dim=64, width=8.0, seed=0, k_mean=3.0, amplitude=6.0):
    """Q and K whose logits peak at nearby positions of a 1-D sequence (a Gaussian kernel of
    ``width`` tokens through random Fourier features, ``amplitude``²/8 nats high) plus a mean common
    to all keys."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    w = torch.randn(heads, 1, dim // 2, generator=g, dtype=torch.float64) / width
    phase = pos * w
    feat = torch.cat([torch.cos(phase), torch.sin(phase)], -1) * math.sqrt(2.0 / dim) * amplitude
    q = feat + 0.05 * torch.randn(heads, n, dim, generator=g, dtype=torch.float64)
    k = feat + k_mean * torch.randn(heads, 1, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    return q[None].float(), k[None].float()


def exact_block_mass(q, k, query_tile, key_tile, scale=None):
    """(B, H, nq, nk) fp64: the mean over a query tile's rows of the exact softmax weight on each key tile."""
    scale = scale or 1 / math.sqrt(q.shape[-1])
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1)
    b, h, sq, sk = p.shape
    nq, nk = -(-sq // query_tile), -(-sk // key_tile)
    p = torch.nn.functional.pad(p, (0, nk * key_tile - sk))
    per_key_tile = p.reshape(b, h, sq, nk, key_tile).sum(-1)
    rows = torch.arange(sq) // query_tile
    return torch.stack([per_key_tile[:, :, rows == i].mean(-2) for i in range(nq)], dim=2)


# --- full density is the dense call, bit for bit -----------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_full_density_is_bit_equal_to_dense(method):
    b, h, sq, sk = 2, 2, 200, 300  # odd lengths: partial query and key tiles
    q, k, v = rand(b, h, sq, 64, seed=1), rand(b, h, sk, 64, seed=2), rand(b, h, sk, 48, seed=3)
    mask = rand(b, 1, 1, sk, seed=4) > -1.0  # a key-padding mask
    dense = fp4_attention(q, k, v, method=method, attn_mask=mask, backend="reference", return_lse=True)
    for sel in (BlockSelection.dense(sq, sk), BlockSelection.dense(sq, sk, batch=b, heads=h, query_tile=64,
                                                                    key_tile=256)):
        out = fp4_attention(q, k, v, method=method, attn_mask=mask, backend="reference", return_lse=True,
                            sparsity=sel)
        assert torch.equal(out[0], dense[0]) and torch.equal(out[1], dense[1]), method


@pytest.mark.parametrize("method", ["fp16", "sage3", "fp8"])
def test_full_density_bit_equal_in_bshd_with_a_full_mask_and_tau_one(method):
    b, h, sq, sk = 1, 3, 130, 130
    q, k, v = (rand(b, sq, h, 32, seed=s) for s in (5, 6, 7))
    mask = rand(b, h, sq, sk, seed=8) > 0.5
    dense = fp4_attention(q, k, v, method=method, layout="bshd", attn_mask=mask, backend="reference", return_lse=True)
    out = fp4_attention(q, k, v, method=method, layout="bshd", attn_mask=mask, backend="reference", return_lse=True,
                        sparsity=DynamicSparsity(tau=1.0))
    assert torch.equal(out[0], dense[0]) and torch.equal(out[1], dense[1])


# --- a selection is the dense loop with the dropped tiles masked out ----------------------------------


def test_fp16_selection_equals_dense_with_a_key_mask_removing_the_dropped_tiles():
    b, h, sq, sk = 2, 2, 300, 400
    q, k, v = rand(b, h, sq, 64, seed=10), rand(b, h, sk, 64, seed=11), rand(b, h, sk, 64, seed=12)
    user = rand(b, 1, sq, sk, seed=13) > -1.5
    sel = random_selection(b, h, sq, sk, seed=14)
    out, lse = fp4_attention(q, k, v, method="fp16", attn_mask=user, sparsity=sel, backend="reference",
                             return_lse=True)
    both = user & sel.token_mask()
    ref, ref_lse = fp4_attention(q, k, v, method="fp16", attn_mask=both, backend="reference", return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    # and against fp64 attention with that mask (rows that see nothing: zeros, -inf)
    s = (q.double() @ k.double().transpose(-1, -2)) / 8
    s = s.masked_fill(~both, -math.inf)
    seen = both.any(-1)
    p = torch.where(seen[..., None], torch.softmax(s, -1), 0.0).nan_to_num()
    assert (out.double() - p @ v.double()).abs().max() < 2e-6
    assert torch.equal(torch.isinf(lse), ~seen) and (lse.double() - torch.logsumexp(s, -1))[seen].abs().max() < 2e-5


@pytest.mark.parametrize("method", [m for m in METHODS if m != "fp16"])
def test_quantized_selection_equals_the_dense_loop_masked_on_the_same_prepass(method):
    """The pre-pass is the dense one (K's mean and every scale over all live keys); the loop is the
    dense loop with the dropped tiles' logits at -inf: bit for bit."""
    recipe = METHODS[method]
    b, h, sq, sk = 1, 2, 260, 390
    q, k, v = rand(b, h, sq, 64, seed=20), rand(b, h, sk, 64, seed=21), rand(b, h, sk, 64, seed=22)
    sel = random_selection(b, h, sq, sk, seed=23, density=0.4)
    qh, kh, vh = prepare_qkv(q, k, v, recipe)
    sparse = attention_tiled(qh, kh, vh, scale=0.125, recipe=recipe, sk=sk, key_tiles=sel.tiles, query_tile=128)
    masked = attention_tiled(qh, kh, vh, scale=0.125, recipe=recipe, sk=sk, mask=sel.token_mask())
    assert torch.equal(sparse[0], masked[0]) and torch.equal(sparse[1], masked[1])


def test_rows_that_visit_no_live_key_give_zeros_and_minus_inf():
    q, k, v = rand(1, 1, 256, 64, seed=30), rand(1, 1, 256, 64, seed=31), rand(1, 1, 256, 64, seed=32)
    tiles = torch.tensor([[True, False], [False, True]])[None, None]  # query tile 0 visits key tile 0 only
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)
    mask[..., :128] = False  # ... whose keys are all masked
    for method in ("fp16", "mxattn", "sage3"):
        out, lse = fp4_attention(q, k, v, method=method, attn_mask=mask, sparsity=BlockSelection(tiles, 256, 256),
                                 backend="reference", return_lse=True)
        assert (out[..., :128, :] == 0).all() and torch.isneginf(lse[..., :128]).all()
        assert torch.isfinite(lse[..., 128:]).all() and out[..., 128:, :].abs().sum() > 0


def test_a_selection_is_layout_independent_and_auto_runs_it_on_the_reference_off_the_gpu():
    q, k, v = (rand(2, 2, 300, 64, seed=s) for s in (40, 41, 42))
    sel = random_selection(2, 2, 300, 300, seed=43)
    ref = fp4_attention(q, k, v, method="mxattn", sparsity=sel, backend="reference")
    auto = fp4_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), method="mxattn", layout="bshd",
                         sparsity=sel)  # CPU tensors: "auto" never picks the interpreter
    assert torch.equal(auto.transpose(1, 2), ref)


# --- the dynamic selection ---------------------------------------------------------------------------


def test_estimated_block_mass_orders_tiles_as_the_exact_mass_does():
    q, k = local_inputs()
    est = estimate_block_mass(q, k, query_tile=32, key_tile=32)
    exact = exact_block_mass(q, k, 32, 32)
    assert est.q_similar.all() and est.k_similar.all()
    assert torch.allclose(est.mass.sum(-1), torch.ones(()), atol=1e-5)
    # each query tile's heaviest key tile
    assert torch.equal(est.mass.argmax(-1), exact.argmax(-1))
    # within a query tile, two key tiles whose exact masses differ by more than 2x (both > 1e-4) are
    # ordered the same way by the estimate
    e, x = est.mass.double().flatten(0, 2), exact.flatten(0, 2)
    pair = (x[:, :, None] > 1e-4) & (x[:, None, :] > 2 * x[:, :, None])
    agree = (e[:, None, :] > e[:, :, None])[pair]
    assert pair.sum() > 100 and agree.float().mean() > 0.98, agree.float().mean()


def test_estimated_mass_tracks_the_true_kept_mass():
    """Mean pooling misses the spread of the logits within a tile (Jensen's gap), so the estimate
    errs most at small τ; it converges on the true kept mass as τ grows."""
    q, k = local_inputs(width=8.0)
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / 8, -1)
    for tau, err in ((0.5, 0.25), (0.8, 0.1), (0.95, 0.02)):
        sel = dynamic_selection(q, k, tau=tau, query_tile=32, key_tile=32)
        true = (p * sel.token_mask()).sum(-1).reshape(1, 2, -1, 32).mean(-1)
        assert (sel.estimated_mass >= tau - 1e-6).all()
        assert (sel.estimated_mass.double() - true).abs().mean() < err, tau


def test_tau_rule_is_monotonic_and_minimal():
    q, k = local_inputs(width=24.0, seed=1)
    prev = None
    for tau in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0):
        sel = dynamic_selection(q, k, tau=tau, neighbours=None, query_tile=32, key_tile=32)
        if prev is not None:
            assert (sel.tiles | ~prev.tiles).all() and sel.density() >= prev.density(), f"τ={tau} dropped a tile"
        est = estimate_block_mass(q, k, query_tile=32, key_tile=32).mass
        # minimal: without its lightest kept tile, a query tile holds less than τ
        lightest = torch.where(sel.tiles, est, math.inf).amin(-1)
        if tau < 1:
            assert ((est * sel.tiles).sum(-1) - lightest < tau).all()
        prev = sel
    assert prev.tiles.all()


def test_always_kept_tiles_are_kept():
    q, k = local_inputs(n=640, width=4.0, seed=2)
    k[0, 1, 320:352] = rand(32, 64, seed=50, scale=5.0)  # key tile 10 of head 1: random directions
    q[0, 0, 64:96] = rand(32, 64, seed=51, scale=5.0)  # query tile 2 of head 0
    sel = dynamic_selection(q, k, tau=1e-3, neighbours=1, global_tokens=((600, 610),), sink_tiles=2,
                            query_tile=32, key_tile=32)
    t = sel.tiles[0]
    nq = t.shape[-2]
    i = torch.arange(nq)
    for d in (-1, 0, 1):  # the neighbourhood
        j = (i + d).clamp(0, nq - 1)
        assert t[:, i, j].all()
    assert t[:, :, :2].all()  # sinks
    assert t[:, :, 18].all() and t[:, 18, :].all()  # global tokens 600-609 lie in tile 18
    assert t[1, :, 10].all() and not t[0, :, 10].all()  # the dissimilar key tile, in its head only
    assert t[0, 2, :].all() and not t[1, 2, :].all()  # the dissimilar query tile
    # besides those, a tiny τ keeps one tile at most per query tile
    est = estimate_block_mass(q, k, query_tile=32, key_tile=32)
    assert not est.k_similar[0, 1, 10] and not est.q_similar[0, 0, 2]


def test_unknown_estimates_keep_the_row_dense():
    q, k = local_inputs(n=256)
    q = q.clone()
    q[0, 1, 5, 3] = float("nan")
    mask = torch.ones(1, 1, 256, 256, dtype=torch.bool)
    mask[..., 100:140, :] = False  # queries 100-139 see nothing
    sel = dynamic_selection(q, k, tau=0.5, attn_mask=mask, neighbours=None, query_tile=32, key_tile=32)
    assert sel.tiles[0, 1, 0].all() and not sel.tiles[0, 0, 0].all()  # the NaN's query tile only
    assert not sel.tiles[0, 0, 3].all()  # 100-127 are blind, 96-99 are not: estimated
    full_blind = torch.ones(1, 1, 256, 256, dtype=torch.bool)
    full_blind[..., 128:160, :] = False
    sel = dynamic_selection(q, k, tau=0.5, attn_mask=full_blind, neighbours=None, query_tile=32, key_tile=32)
    assert sel.tiles[0, :, 4].all()


def test_masks_weight_the_estimate_by_the_keys_each_tile_shows():
    q, k = local_inputs(n=256, width=1e6)  # flat logits: the estimate is the share of visible keys
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)
    mask[..., 32:56] = False  # key tile 1 shows 8 of its 32 keys
    est = estimate_block_mass(q, k, attn_mask=mask, query_tile=32, key_tile=32)
    expect = torch.tensor([32.0, 8, 32, 32, 32, 32, 32, 32]) / 232
    assert torch.allclose(est.mass, expect.expand_as(est.mass), atol=2e-3)


# --- the static window -------------------------------------------------------------------------------


def brute_force_window(frames, height, width, window, text, position, radial):
    """Token by token, with Python loops: the window's definition."""
    video = frames * height * width
    n = video + text
    out = torch.ones(n, n, dtype=torch.bool)
    lo = text if position == "first" else 0
    for a in range(video):
        fa, ya, xa = a // (height * width), a // width % height, a % width
        for c in range(video):
            fc, yc, xc = c // (height * width), c // width % height, c % width
            d = abs(fa - fc)
            shrink = int(math.floor(math.log2(d))) if (radial and d >= 1) else 0
            out[lo + a, lo + c] = d <= window[0] and abs(ya - yc) <= window[1] >> shrink and \
                abs(xa - xc) <= window[2] >> shrink
    return out


def tile_or(token_mask, query_tile, key_tile):
    n, m = token_mask.shape
    nq, nk = -(-n // query_tile), -(-m // key_tile)
    t = torch.nn.functional.pad(token_mask, (0, nk * key_tile - m, 0, nq * query_tile - n))
    return t.reshape(nq, query_tile, nk, key_tile).any(-1).any(1)


@pytest.mark.parametrize("frames, height, width, window, text, position, radial", [
    (5, 4, 6, (1, 1, 2), 0, "first", False),
    (9, 3, 5, (8, 2, 4), 7, "first", True),
    (6, 5, 4, (2, 0, 1), 5, "last", False),
    (8, 4, 4, (7, 3, 3), 3, "last", True),
])
def test_static_window_matches_the_per_token_brute_force(frames, height, width, window, text, position, radial):
    tokens = static_token_window(frames, height, width, window=window, text_tokens=text, text_position=position,
                                 radial=radial)
    assert torch.equal(tokens, brute_force_window(frames, height, width, window, text, position, radial))
    for qt, kt in ((16, 16), (32, 8), (7, 13)):
        sel = static_selection(frames, height, width, window=window, text_tokens=text, text_position=position,
                               radial=radial, query_tile=qt, key_tile=kt, query_tiles_at_once=3)
        assert sel.tiles.shape[:2] == (1, 1)
        assert torch.equal(sel.tiles[0, 0], tile_or(tokens, qt, kt)), (qt, kt)


def test_static_sparsity_in_a_call_is_the_token_window_rounded_to_tiles():
    spec = StaticSparsity(8, 8, 8, window=(0, 2, 2), text_tokens=10)
    q, k, v = (rand(1, 2, spec.tokens, 32, seed=s) for s in (60, 61, 62))
    out = fp4_attention(q, k, v, method="fp16", sparsity=spec, backend="reference")
    sel = spec.select(q, k)
    ref = fp4_attention(q, k, v, method="fp16", attn_mask=sel.token_mask(), backend="reference")
    assert torch.equal(out, ref) and sel.density() < 1


# --- the selection reads nothing back to the host ----------------------------------------------------


def test_selection_never_reads_values_back(monkeypatch):
    q, k = local_inputs(n=300)
    mask = rand(1, 2, 1, 300, seed=70) > -1.0
    specs = [DynamicSparsity(tau=0.8, neighbours=1, global_tokens=((0, 10),), sink_tiles=1, query_tile=32,
                             key_tile=32), DynamicSparsity(tau=1.0), StaticSparsity(3, 10, 10, window=(1, 2, 2),
                                                                                    text_tokens=0, radial=True)]

    def refuse(*args, **kwargs):
        raise AssertionError("read back to the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu",
                 "masked_select", "unique"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for name in ("nonzero", "masked_select", "unique", "argwhere"):
        monkeypatch.setattr(torch, name, refuse)
    sels = [s.select(q, k, scale=0.1, attn_mask=mask) for s in specs]
    sels.append(static_selection(2, 8, 8, window=(1, 1, 1), text_tokens=6, text_position="last", query_tile=16,
                                 key_tile=16))
    sels = [s.for_tiles(s.query_tile // 2, s.key_tile // 2) for s in sels]
    _ = [(s.density(), s.tile_lists(), s.token_mask()) for s in sels]
    monkeypatch.undo()
    assert sels[0].tiles.any() and sels[1].tiles.all()


# --- the selection's forms ---------------------------------------------------------------------------


def test_tile_lists_and_finer_tiles_describe_the_same_selection():
    sel = random_selection(2, 3, 300, 700, seed=80, density=0.3, key_tile=256)
    index, count = sel.tile_lists()
    for b in range(2):
        for h in range(3):
            for i in range(sel.n_query_tiles):
                visited = torch.nonzero(sel.tiles[b, h, i]).flatten()
                assert torch.equal(index[b, h, i, : count[b, h, i]].long(), visited)
    fine = sel.for_tiles(64, 128)
    assert torch.equal(fine.token_mask(), sel.token_mask()) and fine.tiles.shape[-2:] == (5, 6)
    assert torch.allclose(sel.density(), sel.tiles.float().mean())


# --- errors ------------------------------------------------------------------------------------------


def test_validation_errors():
    t = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="bool tensor"):
        BlockSelection(t.int(), 256, 384)
    with pytest.raises(ValueError, match=r"expected \(B\|1, H\|1, 3, 3\)"):
        BlockSelection(t, 257, 384)
    with pytest.raises(ValueError, match="query_tile must be a positive int"):
        BlockSelection(t, 256, 384, query_tile=0)
    with pytest.raises(ValueError, match="estimated_mass"):
        BlockSelection(t, 256, 384, estimated_mass=torch.ones(3))
    with pytest.raises(ValueError, match="do not divide"):
        BlockSelection(t, 256, 384).for_tiles(96, 128)
    q, k = local_inputs(n=256)
    with pytest.raises(ValueError, match="tau must be"):
        dynamic_selection(q, k, tau=0.0)
    with pytest.raises(ValueError, match="tau must be"):
        DynamicSparsity(tau=1.5)
    with pytest.raises(ValueError, match="neighbours needs self-attention"):
        dynamic_selection(q, k[:, :, :200], tau=0.5)
    with pytest.raises(ValueError, match="global_tokens"):
        dynamic_selection(q, k, tau=0.5, global_tokens=((10, 5),))
    with pytest.raises(ValueError, match="global_tokens"):
        DynamicSparsity(tau=0.5, global_tokens=(3,))
    with pytest.raises(ValueError, match="min_similarity"):
        estimate_block_mass(q, k, min_similarity=2.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        estimate_block_mass(q, k, attn_mask=torch.ones(1, 1, 3, 256, dtype=torch.bool))
    with pytest.raises(ValueError, match="window must be three ints"):
        static_selection(2, 4, 4, window=(1, 2))
    with pytest.raises(ValueError, match="text_position"):
        StaticSparsity(2, 4, 4, text_tokens=3, text_position="middle")
    with pytest.raises(ValueError, match="needs Sq = Sk = 32"):
        StaticSparsity(2, 4, 4, window=(1, 1, 1)).select(q, k)
    v = rand(1, 2, 256, 64, seed=90)
    with pytest.raises(ValueError, match="the call has 256 and 256"):
        fp4_attention(q, k, v, sparsity=BlockSelection.dense(128, 256), backend="reference")
    with pytest.raises(ValueError, match=r"\(B, H\) = \(1, 3\)"):
        fp4_attention(q, k, v, sparsity=BlockSelection.dense(256, 256, heads=3), backend="reference")
    with pytest.raises(ValueError, match="not a multiple of the loops' key tile"):
        fp4_attention(q, k, v, sparsity=BlockSelection.dense(256, 256, key_tile=64), backend="reference")
    with pytest.raises(TypeError, match="sparsity must be"):
        fp4_attention(q, k, v, sparsity=0.5, backend="reference")
    qh, kh, vh = prepare_qkv(q, k, v, METHODS["fp16"])
    with pytest.raises(ValueError, match="key_tiles has shape"):
        attention_tiled(qh, kh, vh, scale=0.1, recipe=METHODS["fp16"], key_tiles=t, query_tile=128)
    with pytest.raises(ValueError, match="query_tile must be a positive int"):
        attention_tiled(qh, kh, vh, scale=0.1, recipe=METHODS["fp16"], key_tiles=torch.ones(1, 1, 2, 2).bool())
    assert key_alive_from_mask(None) is None  # the reference's helpers stay as they were


def test_inputs_are_not_modified():
    q, k = local_inputs(n=256)
    v = rand(1, 2, 256, 64, seed=95)
    copies = [t.clone() for t in (q, k, v)]
    sel = dynamic_selection(q, k, tau=0.7)
    fp4_attention(q, k, v, method="sage3", sparsity=sel, backend="reference")
    fp4_attention(q, k, v, method="mxattn", sparsity=DynamicSparsity(tau=0.7), backend="reference")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies))


@pytest.mark.parametrize("path", sorted((ROOT / "fp4video" / "sparse").glob("*.py")), ids=lambda p: p.name)
def test_sparse_module_imports_only_torch_and_the_numerics(path):
    """The selections are numerics: torch, the reference's constants and their own modules only (the
    kernels are handed in as ``pool`` / ``row_mass``)."""
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add(("." * node.level) + (node.module or ""))
    own = {"." + p.stem for p in (ROOT / "fp4video" / "sparse").glob("*.py")}
    allowed = {"__future__", "functools", "math", "dataclasses", "typing", "torch", "..reference", "..formats",
               "..recipe"} | own
    assert mods <= allowed, mods - allowed
