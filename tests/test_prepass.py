"""The fused pre-pass against the reference's prepared Q̂, K̂, V̂: every output form (work dtype, tile
key order, e4m3 with power-of-two factors, packed E2M1 with E8M0 scales), e4m3's window, and the
launch forms that must change no bit."""

from __future__ import annotations

import pytest
import torch

from fp4video import METHODS
from fp4video.metrics import cossim

pytest.importorskip("triton")
from conftest import rand  # noqa: E402


_LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _unpack(codes, scales, block=32):
    """Independent decode of packed E2M1 (low nibble first) with E8M0 scales, on the CPU."""
    codes, scales = codes.cpu(), scales.cpu()
    vals = torch.stack([_LUT[(codes & 15).long()], _LUT[(codes >> 4).long()]], -1).flatten(-2)
    return vals * torch.ldexp(torch.ones(scales.shape), scales.long() - 127).repeat_interleave(block, -1)


FP4_METHODS = [m for m in METHODS if METHODS[m].quantized and "e4m3" not in (
    getattr(METHODS[m].qk_format, "value", None), getattr(METHODS[m].pv_format, "value", None))]


@pytest.mark.parametrize("method", FP4_METHODS)
def test_prepass_matches_reference_prepare(method, device):
    """The fused pre-pass writes the reference's dequantized Q̂, K̂, V̂: bit for bit without the
    rotation; with it, the fp32 dot's summation order may move a value across a rounding
    boundary, so a few elements (< 0.5%) may differ by one grid step."""
    from fp4video.kernels.prepass import prepass
    from fp4video.reference import prepare_qkv

    dev = device
    work = torch.bfloat16 if dev == "cuda" else torch.float32
    recipe = METHODS[method]
    q, k, v = rand(2, 2, 45, 80, seed=13, device=dev), rand(2, 2, 150, 80, seed=14, device=dev), \
        rand(2, 2, 150, 48, seed=15, device=dev)
    alive = rand(2, 150, seed=16, device=dev) > -1.0
    ref = prepare_qkv(q, k, v, recipe, key_alive=alive[:, None, :])
    got = prepass(q, k, v, recipe, alive, work)
    for name, r, g in zip("qkv", ref, (got.q, got.k, got.v)):
        r = r[..., : g.shape[-2], : r.shape[-1]]
        g = g[..., : r.shape[-1]].float()
        assert g.shape == r.shape, name
        if recipe.hadamard:
            assert (g != r).float().mean() < 5e-3, f"{method} {name}"
            assert cossim(g, r) > 0.9999
        else:
            assert torch.equal(g, r), f"{method} {name}: {(g != r).sum()} elements differ"


@pytest.mark.parametrize("masked", [False, True])
def test_prepass_tiles_stores_keys_in_the_loops_order(masked):
    """prepass_tiles (the NVFP4 loops' input) writes K̂ and V̂ rows in tile key order, padded with
    zero rows to whole 128-key tiles: row 8j + 2t + e of a tile holds key 32t + 2j + e (the order
    key_order.mma_key_order gives the loop's columns), each row the plain pre-pass's."""
    from fp4video.kernels.key_order import tile_key_order
    from fp4video.kernels.prepass import prepass, prepass_tiles

    recipe = METHODS["sage3"]
    q, k, v = rand(1, 2, 40, 64, seed=21), rand(1, 2, 300, 64, seed=22), rand(1, 2, 300, 32, seed=23)
    alive = (torch.arange(300) % 5 != 1)[None, :] if masked else None
    plain = prepass(q, k, v, recipe, alive, torch.float32)
    tiles = prepass_tiles(q, k, v, recipe, alive, torch.float32)
    assert torch.equal(tiles.q, plain.q) and tiles.sk == 300
    keys = tile_key_order(384)
    assert sorted(keys.tolist()) == list(range(384)) and keys[:10].tolist() == [0, 1, 32, 33, 64, 65, 96, 97, 2, 3]
    for got, want in ((tiles.k, plain.k), (tiles.v, plain.v)):
        assert got.shape[-2] == 384
        real = keys < 300
        assert torch.equal(got[:, :, real], want[:, :, keys[real]])
        assert not got[:, :, ~real].any()  # the padding: zero rows


def test_prepass_fp8_is_exact_and_in_e4m3_range(device):
    """q8·q_fac, k8·k_fac, v8·v_fac equal the reference's dequantized Q̂, K̂, V̂ (no rotation: bit
    for bit), and the scaled values use e4m3's range: largest at most 384, none saturated."""
    from fp4video.kernels.prepass import prepass_fp8
    from fp4video.reference import prepare_qkv
    from key_order_reference import k_fac_per_key, v8t_in_key_order

    dev = device
    recipe = METHODS["mxfp4-ocp"]
    q, k, v = rand(2, 2, 45, 80, seed=21, device=dev), rand(2, 2, 150, 80, seed=22, device=dev) * 40, \
        rand(2, 2, 150, 48, seed=23, device=dev) * 1e-3
    alive = rand(2, 150, seed=24, device=dev) > -1.0
    rq, rk, rv = prepare_qkv(q, k, v, recipe, key_alive=alive[:, None, :])
    ops = prepass_fp8(q, k, v, recipe, alive)
    q8, q_fac, k8, k_fac, v8, v_fac = ops.q8, ops.q_fac, ops.k8, ops.k_fac, ops.v8t, ops.v_fac
    assert ops.sk == 150 and not ops.k_tile_order and k8.shape[-2] == 150
    assert q8.dtype == k8.dtype == v8.dtype == torch.float8_e4m3fn
    got_q = q8.float() * q_fac[..., None]
    assert k_fac.shape == (2, 2, 2)  # one factor per key tile of 128
    got_k = k8.float() * k_fac_per_key(k_fac, 150)[..., None]
    got_v = v8t_in_key_order(v8).float().transpose(-1, -2)[..., :150, :] * v_fac[..., None, :]
    assert torch.equal(got_q[..., :80], rq[..., :45, :80]) and not got_q[..., 80:].any()
    assert torch.equal(got_k[..., :80], rk[..., :150, :80]) and not got_k[..., 80:].any()
    assert torch.equal(got_v[..., :48], rv[..., :150, :48]) and not got_v[..., 48:].any()
    assert v8.shape[-1] == 256 and not v8t_in_key_order(v8)[..., 150:].float().any()  # zeros to whole tiles
    for x in (q8, k8, v8):
        assert x.float().abs().max() <= 384
    for tile in (k8[..., :128, :], k8[..., 128:, :]):  # each key tile's largest value uses the top binade
        assert tile.float().abs().amax(dim=(-1, -2)).min() >= 256


def test_prepass_fp8_window_is_16_binades(device):
    """A block whose scale 2^e is 2^-16 of the binade of the head's largest value (6 = 1.5·2^2, so
    e = -14) stays exact in e4m3; one binade lower loses its smallest values (e4m3 subnormals end
    at 2^-9): the documented limit of the per-key-tile shift."""
    from fp4video.kernels.prepass import prepass_fp8

    dev = device
    recipe = METHODS["mxfp4-ocp"]
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4 + [0.5] * 4, device=dev)  # one block of 32
    for shift, exact in ((14, True), (15, False)):
        k = torch.zeros(1, 1, 2, 32, device=dev)
        k[0, 0, 0] = 6.0  # the key tile's largest value: 6 = 1.5·2^2
        k[0, 0, 1] = grid * 2.0 ** -shift  # block exponent -shift, smallest value 0.5·2^-shift
        q = v = torch.ones(1, 1, 2, 32, device=dev)
        ops = prepass_fp8(q, k, v, recipe, None)
        back = ops.k8[0, 0, 1].float() * ops.k_fac[0, 0, 0]
        assert torch.equal(back, k[0, 0, 1]) is exact, shift


@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp"])
def test_prepass_packed_equals_reference(method, device):
    """Packed codes and E8M0 scales decode (by a lookup table) to the reference's Q̂, K̂, V̂."""
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.reference import prepare_qkv

    dev = device
    recipe = METHODS[method]
    q, k, v = rand(2, 2, 45, 80, seed=60, device=dev), rand(2, 2, 150, 80, seed=61, device=dev) * 40, \
        rand(2, 2, 150, 48, seed=62, device=dev) * 1e-3
    alive = rand(2, 150, seed=63, device=dev) > -1.0
    rq, rk, rv = (t.cpu() for t in prepare_qkv(q, k, v, recipe, key_alive=alive[:, None, :]))
    ops = prepass_packed(q, k, v, recipe, alive)
    q4, q_sc, k4, k_sc, v4t, v_sc = ops.q4, ops.q_scale, ops.k4, ops.k_scale, ops.v, ops.v_scale
    assert not ops.quad_order and all(x is None for x in (ops.v_fac, ops.g_q, ops.g_k, ops.g_v))
    assert q4.dtype == k4.dtype == v4t.dtype == q_sc.dtype == torch.uint8
    gq, gk, gv = _unpack(q4, q_sc), _unpack(k4, k_sc), _unpack(v4t, v_sc).transpose(-1, -2)
    if recipe.hadamard and dev == "cuda":  # tensor-core rotation: summation order may move a boundary
        assert (gq[..., :80] != rq[..., :45, :80]).float().mean() < 5e-3
    else:
        assert torch.equal(gq[..., :80], rq[..., :45, :80]) and torch.equal(gk[..., :80], rk[..., :150, :80])
    assert torch.equal(gv[..., :150, :48], rv[..., :150, :48]) and not gv[..., 150:, :].any()


def _unpack_nv(rows, n, g):
    """Independent decode of NVFP4 rows as the native NVFP4 loop reads them: ``n`` values of packed
    E2M1 codes, then their E4M3 block-16 scale bytes, times the head's tensor scale ``g`` (B, H)."""
    rows = rows.cpu()
    codes, scales = rows[..., : n // 2], rows[..., n // 2:]
    vals = torch.stack([_LUT[(codes & 15).long()], _LUT[(codes >> 4).long()]], -1).flatten(-2)
    return vals * scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1) * g.cpu()[..., None, None]


@pytest.mark.parametrize("method", ["nvfp4", "sage3", "sage3-hpnq"])
def test_prepass_packed_nvfp4_equals_reference(method, device):
    """NVFP4 packed (codes, then E4M3 block-16 scale bytes, per row; the heads' tensor scales)
    decodes to the reference's Q̂, K̂ (smoothed for sage3, rotated for sage3-hpnq), V̂ᵀ: bit for bit
    (the rotation on the GPU: a few elements may sit one grid step over), V padded with zeros."""
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.reference import prepare_qkv

    dev = device
    recipe = METHODS[method]
    q, k, v = rand(2, 2, 45, 80, seed=70, device=dev) * 3, rand(2, 2, 150, 80, seed=71, device=dev) * 40 + 9, \
        rand(2, 2, 150, 48, seed=72, device=dev) * 1e-3
    alive = rand(2, 150, seed=73, device=dev) > -1.0
    rq, rk, rv = (t.cpu() for t in prepare_qkv(q, k, v, recipe, key_alive=alive[:, None, :]))
    ops = prepass_packed(q, k, v, recipe, alive)
    q4, k4, v4t, g_q, g_k, g_v = ops.q4, ops.k4, ops.v, ops.g_q, ops.g_k, ops.g_v
    assert all(x is None for x in (ops.q_scale, ops.k_scale, ops.v_scale, ops.v_fac))  # (the scales are in the rows)
    d, sk_pad = q4.shape[-1] * 16 // 9, 256  # (80 and 150, padded: 128 values a row, 2 key tiles)
    assert q4.dtype == k4.dtype == v4t.dtype == torch.uint8 and d == 128
    # K̂'s and V̂ᵀ's rows padded to whole 16 bytes for TMA copies: 64 + 8 -> 80 and 128 + 16 -> 144
    assert (k4.shape[-1], v4t.shape[-1]) == (80, 144) and k4.stride(-2) % 16 == 0 == v4t.stride(-2) % 16
    k4, v4t = k4[..., : d // 2 + d // 16], v4t[..., : sk_pad // 2 + sk_pad // 16]
    gq, gk = _unpack_nv(q4, d, g_q), _unpack_nv(k4, d, g_k)
    gv = _unpack_nv(v4t, sk_pad, g_v).transpose(-1, -2)
    dp = rq.shape[-1]
    if recipe.hadamard and dev == "cuda":
        assert (gq[..., :dp] != rq).float().mean() < 5e-3 and (gk[..., :dp] != rk[..., :150, :]).float().mean() < 5e-3
    else:
        assert torch.equal(gq[..., :dp], rq) and torch.equal(gk[..., :dp], rk[..., :150, :])
    assert torch.equal(gv[..., :150, :48], rv[..., :150, :48]) and not gv[..., 150:, :].any()
    assert not gq[..., dp:].any() and not gk[..., dp:].any()


@pytest.mark.parametrize("method", ["mxattn", "mxattn-sk"])
@pytest.mark.parametrize("k_tile_order", [False, True])
def test_prepass_row_launch_forms_change_nothing(method, k_tile_order, device):
    """The rotating Q/K launches loop over ``blocks_per_program`` row blocks per program (the Hadamard
    matrix read once), or, persistent (``q8_programs_per_sm``, Q's default, and
    ``tile_programs_per_sm``), a few programs stride over all heads' blocks: with 8 blocks per
    program, including programs whose last blocks lie past the end, and persistent with 3 and 2
    programs (the interpreter counts one SM; several heads and batches per program), the e4m3 outputs and
    factors equal those of one block per program, bit for bit; so do V's channel maxima read 4
    key tiles per program (``v_tiles_amax``; 9 tiles: the last program's last three lie past the end)."""
    import dataclasses

    from fp4video.kernels.prepass import PREPASS_LAUNCH, prepass_fp8

    dev = device
    q, k, v = rand(2, 2, 600, 64, seed=31, device=dev), rand(2, 2, 1100, 64, seed=32, device=dev) * 5, \
        rand(2, 2, 1100, 64, seed=33, device=dev)
    alive = rand(2, 1100, seed=34, device=dev) > -1.5
    outs = []
    one = {"q8_programs_per_sm": None, "v_tiles_amax": 1}
    for options in ({**one, "blocks_per_program": 1}, {**one, "blocks_per_program": 8},
                    {"q8_programs_per_sm": 3, "tile_programs_per_sm": 2, "v_tiles_amax": 4}):
        launch = dataclasses.replace(PREPASS_LAUNCH, **options)
        outs.append(prepass_fp8(q, k, v, METHODS[method], alive, k_tile_order, launch=launch))
    for one, other in ((outs[0], outs[1]), (outs[0], outs[2])):
        for name in ("q8", "q_fac", "k8", "k_fac", "v8t", "v_fac", "v_span"):
            a, b = getattr(one, name), getattr(other, name)
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


@pytest.mark.parametrize("method", ["mxfp4-ocp", "mxattn"])
@pytest.mark.parametrize("dv, tiles", [(48, 1), (128, 1), (128, 2)])
def test_prepass_v8t_equals_reference_for_every_v_dtype(method, dv, tiles, device):
    """The e4m3 V̂ᵀ times its channel factors is the reference's dequantized V̂, through both of the
    pre-pass's V paths: transposed by an MMA (Vᵀ·Π: bf16/fp16 V on the GPU, every V in the
    interpreter) and through stores (fp32 V on the GPU) — key tiles with a partial last one, dead
    keys, padded channels, block magnitudes over 2^-12 .. 2^6, one or two tiles per program (3
    tiles: the second program's second tile lies past the end and must not be written)."""
    import dataclasses

    from fp4video.kernels.prepass import PREPASS_LAUNCH, prepass_fp8
    from fp4video.reference import prepare_qkv
    from key_order_reference import v8t_in_key_order

    dev = device
    g = torch.Generator().manual_seed(9)
    v32 = torch.randn(2, 2, 300, dv, generator=g) * torch.exp2(torch.randint(-12, 6, (2, 2, 300, 1), generator=g))
    alive = (torch.arange(300, device=dev) % 7 != 3)[None].expand(2, -1)
    launch = dataclasses.replace(PREPASS_LAUNCH, v_tiles_mma=tiles)
    for dtype in ((torch.float32, torch.bfloat16) if dev == "cuda" else (torch.float32,)):
        v = v32.to(dev, dtype)
        q = k = torch.zeros(2, 2, 300, 64, device=dev, dtype=dtype)
        ops = prepass_fp8(q, k, v, METHODS[method], alive, launch=launch)
        v8, v_fac = ops.v8t, ops.v_fac
        want = prepare_qkv(q.float(), k.float(), v.float(), METHODS[method], key_alive=alive[:, None, :])[2]
        want = want[..., :300, :dv]  # (the reference pads V's tokens to whole tiles)
        got = v8t_in_key_order(v8).float().transpose(-1, -2)[..., :300, :] * v_fac[..., None, :]
        assert want.abs().amax() > 0
        assert torch.equal(got[..., :dv], want[..., :dv]), (dtype, (got[..., :dv] != want[..., :dv]).sum().item())
        assert not got[..., dv:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn", "mxattn-sk"])
def test_prepass_rotation_in_bf16_parts_is_exact_gpu(method):
    """The pre-pass rotates in as many bf16 MMAs as the input needs (bf16: one, fp16: two, fp32 or
    after K smoothing: three): the e4m3 outputs for bf16 and fp16 inputs equal those of the same
    values given in fp32, bit for bit."""
    from fp4video.kernels.prepass import prepass_fp8

    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = (rand(2, 3, 700, 128, seed=s, device="cuda", dtype=dtype) * 3 for s in (80, 81, 82))
        got = prepass_fp8(q, k, v, METHODS[method], None)
        want = prepass_fp8(q.float(), k.float(), v.float(), METHODS[method], None)
        for name in ("q8", "q_fac", "k8", "k_fac", "v8t", "v_fac", "v_span"):
            assert torch.equal(getattr(got, name).float(), getattr(want, name).float()), (dtype, name)


@pytest.mark.parametrize("method", ["fp8", "mxattn-pv8", "sage3-pv8"])
def test_e4m3_prepass_equals_reference(method, device):
    """The FP8 methods' pre-pass writes the reference's E4M3 values with their power-of-two scales:
    Q per row and K per key tile (``fp8``), V per channel, bit for bit (MXFP4 Q/K of
    ``mxattn-pv8`` as ``mxattn``'s, NVFP4 Q/K of ``sage3-pv8`` through the NVFP4 loops' tiles), and
    the dot_scaled loop's pre-pass of ``mxattn-pv8`` / ``sage3-pv8`` V̂ᵀ with its tokens in order;
    the work-dtype pre-pass refuses them."""
    from fp4video.kernels.key_order import tile_key_order
    from fp4video.kernels.prepass import prepass, prepass_fp8, prepass_tiles
    from fp4video.reference import prepare_qkv
    from key_order_reference import k_fac_per_key, v8t_in_key_order

    recipe = METHODS[method]
    g = torch.Generator().manual_seed(12)
    q, k = torch.randn(2, 2, 45, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g) * 7
    v = torch.randn(2, 2, 300, 48, generator=g) * torch.exp2(torch.randint(-8, 8, (1, 1, 1, 48), generator=g))
    q, k, v = (t.to(device) for t in (q, k, v))
    alive = (torch.arange(300, device=device) % 9 != 4)[None].expand(2, -1)
    rq, rk, rv = prepare_qkv(q, k, v, recipe, key_alive=alive[:, None, :])
    if recipe.qk_format.value == "nvfp4":
        vh = prepass_tiles(q, k, v, recipe, alive, torch.float32 if device == "cpu" else torch.bfloat16).v
        keys = tile_key_order(vh.shape[-2])
        got_v = torch.empty_like(vh.float())
        got_v[:, :, keys] = vh.float()
        assert torch.equal(got_v[..., :300, :], rv[..., :300, :48])
    else:
        ops = prepass_fp8(q, k, v, recipe, alive)
        q8, q_fac, k8, k_fac, v8, v_fac = ops.q8, ops.q_fac, ops.k8, ops.k_fac, ops.v8t, ops.v_fac
        assert ops.v_span is None  # (V is E4M3 by definition: no window to check)
        got_v = v8t_in_key_order(v8).float().transpose(-1, -2)[..., :300, :48] * v_fac[..., None, :48]
        assert torch.equal(got_v, rv[..., :300, :48])
        if recipe.qk_format.value == "e4m3":
            assert torch.equal(q8.float()[..., :64] * q_fac[..., None], rq[..., :45, :64])
            assert torch.equal(k8.float()[..., :300, :64] * k_fac_per_key(k_fac, 300)[..., None], rk[..., :300, :64])
    if recipe.qk_format.value != "e4m3":  # the dot_scaled loop's pre-pass writes V̂ᵀ with its tokens in order
        from fp4video.kernels.prepass import prepass_packed

        packed = prepass_packed(q, k, v, recipe, alive)
        v8p, v_facp = packed.v, packed.v_fac
        assert packed.v_scale is None and packed.g_v is None
        assert v8p.dtype == torch.float8_e4m3fn and v8p.shape[-1] == 384
        assert torch.equal(v8p.float().transpose(-1, -2)[..., :300, :48] * v_facp[..., None, :48], rv[..., :300, :48])
        assert not v8p[..., 300:].float().any() and not v8p[..., 48:, :].float().any()
    with pytest.raises(ValueError, match="E4M3"):
        prepass(q, k, v, recipe, alive, torch.float32)
