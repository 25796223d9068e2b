"""Every attention loop against the reference: every method, masks, odd lengths, both layouts,
poisoned outputs; the e4m3 loop's per-tile shift and its TMA form; the NVFP4 Gluon loop against the
Triton one; the Blackwell loop. CPU: the Triton interpreter (small shapes); GPU (marker ``gpu``):
bf16 at realistic sizes."""

from __future__ import annotations

import pytest
import torch

from fp4video import METHODS, fp4_attention
from fp4video.metrics import cossim

pytest.importorskip("triton")
from conftest import rand  # noqa: E402

MX_METHODS = [m for m in METHODS if METHODS[m].qk_format is not None and METHODS[m].qk_format.value == "mxfp4"]


@pytest.mark.parametrize("method", list(METHODS))
def test_kernel_matches_reference_interpreter(method):
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers this on CUDA")
    q, k, v = rand(1, 2, 70, 64, seed=1), rand(1, 2, 200, 64, seed=2), rand(1, 2, 200, 64, seed=3)
    mask = rand(1, 1, 1, 200, seed=4) > -0.8
    a, la = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference")
    b, lb = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton")
    assert cossim(a, b) > 0.999999, method
    assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5


@pytest.mark.parametrize("method", ["mxattn", "sage3"])
def test_kernel_bshd_and_unpadded_head_dim_interpreter(method):
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    q, k, v = rand(1, 33, 2, 40, seed=5), rand(1, 130, 2, 40, seed=6), rand(1, 130, 2, 24, seed=7)
    a = fp4_attention(q, k, v, method=method, layout="bshd", backend="reference")
    b = fp4_attention(q, k, v, method=method, layout="bshd", backend="triton")
    assert b.shape == (1, 33, 2, 24) and (a - b).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_kernel_matches_reference_gpu(method, layout):
    dev = "cuda"
    shape_q, shape_k = ((2, 8, 1000, 128), (2, 8, 1531, 128))
    if layout == "bshd":
        shape_q, shape_k = (2, 1000, 8, 128), (2, 1531, 8, 128)
    q = rand(*shape_q, seed=8, device=dev, dtype=torch.bfloat16)
    k = rand(*shape_k, seed=9, device=dev, dtype=torch.bfloat16)
    v = rand(*shape_k, seed=10, device=dev, dtype=torch.bfloat16)
    mask = rand(2, 1, 1, 1531, seed=11, device=dev) > -1.0
    a, la = fp4_attention(q, k, v, method=method, layout=layout, attn_mask=mask, return_lse=True, backend="reference")
    poison = torch.full((256 << 20,), float("nan"), device=dev)  # freed memory the kernel's outputs reuse
    del poison
    b, lb = fp4_attention(q, k, v, method=method, layout=layout, attn_mask=mask, return_lse=True, backend="triton")
    assert torch.isfinite(b).all()
    assert cossim(a.float(), b.float()) >= 0.9999, method
    assert (la - lb).abs().max() < 2e-2, method


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp", "sage3", "fp16"])
def test_kernel_unmasked_odd_length_gpu(method):
    """No mask and Sk not a multiple of the key tile: the kernel's own tail masking."""
    q, k, v = (rand(1, 4, 1000, 128, seed=s, device="cuda", dtype=torch.bfloat16) for s in (30, 31, 32))
    k, v = k[:, :, :937], v[:, :, :937]
    a, la = fp4_attention(q, k, v, method=method, return_lse=True, backend="reference")
    b, lb = fp4_attention(q, k, v, method=method, return_lse=True, backend="triton")
    assert cossim(a.float(), b.float()) >= 0.9999 and (la - lb).abs().max() < 2e-2


@pytest.mark.gpu
def test_auto_picks_triton_on_gpu():
    from fp4video import kernels

    q = rand(1, 1, 64, 64, seed=12, device="cuda", dtype=torch.bfloat16)
    assert kernels.supports(METHODS["mxattn"], q)[0]


def test_nvfp4_loop_rejects_k_v_not_in_whole_tiles():
    """The NVFP4 loops read K̂/V̂ as prepass_tiles stores them (whole 128-key tiles): plain (B, H,
    Sk, D) tensors are refused with an error that says so, instead of reading past their end."""
    from fp4video.kernels.loop_nvfp4 import attention_nvfp4
    from fp4video.kernels.operands import TileOperands
    from fp4video.kernels.plan import plan_on
    from fp4video.kernels.prepass import prepass

    q, k, v = rand(1, 1, 20, 64, seed=31), rand(1, 1, 300, 64, seed=32), rand(1, 1, 300, 64, seed=33)
    work = prepass(q, k, v, METHODS["nvfp4"], None, torch.float32)
    nv_plan = plan_on(METHODS["nvfp4"], "interpreter")
    assert nv_plan.loop == "nvfp4" and nv_plan.operands == "tiles"
    with pytest.raises(ValueError, match="padded to whole tiles of 128 keys"):
        attention_nvfp4(TileOperands(work.q, work.k, work.v, 300), None, nv_plan, recipe=METHODS["nvfp4"],
                        scale=0.125, out_dtype=torch.float32, dv=64)


@pytest.mark.parametrize("method", ["mxfp4-ocp", "mxattn"])
def test_e4m3_loop_shifts_each_key_tile_by_its_own_largest_block(method, device):
    """The e4m3 loop quantizes P in units of 2^k per row and key tile, k from the tile's largest
    block exponent: a tile whose weights are all ~2^-20 of the row maximum
    (an earlier tile's) keeps every block exact, where a shift from the row maximum would flush
    them below e4m3's subnormals. V is zero on the dominant tile, so the output is that small
    tile's P̂·V̂ alone: it must match the reference (interpreter or GPU)."""
    dev = device
    g = torch.Generator().manual_seed(17)
    q = torch.randn(1, 1, 4, 64, generator=g)
    k = torch.randn(1, 1, 256, 64, generator=g)
    v = torch.randn(1, 1, 256, 64, generator=g)
    q[..., 0] = 4.0
    k[..., :128, 0] = 28.0  # logits of the first key tile 4·28/8 = 14 higher: the others weigh ~e^-14
    k[..., 128:, 0] = 0.0
    v[..., :128, :] = 0.0
    q, k, v = (t.to(dev) for t in (q, k, v))
    got = fp4_attention(q, k, v, method=method, backend="triton")
    want = fp4_attention(q, k, v, method=method, backend="reference")
    assert 0 < want.abs().max() < 1e-4  # the small tile's share
    assert cossim(got.double(), want.double()) >= 0.9999, cossim(got.double(), want.double())


@pytest.mark.parametrize("sk, masked", [(100, False), (128, True), (256, False), (300, True), (640, False),
                                        (1157, True)])
def test_e4m3_loop_by_tma_equals_pointer_loads(sk, masked):
    """K̂ stored in tile key order (what a TMA box copies) holds the same rows, zero-padded to whole
    tiles; the e4m3 loop reading it — by pointers or by TMA tensor descriptors — computes the same
    products in the same order as from K̂ in key order: equal bit for bit, for key counts below one
    tile, of exactly one tile, with a tail tile and under a key-padding mask (interpreter; the GPU
    twin below). 1157 keys: 10 tiles, so the pre-pass's second program of 8 tiles ends past the
    last one (its stores there must not reach the next head's rows)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test; test_e4m3_loop_by_tma_equals_pointer_loads_gpu covers CUDA")
    _check_tma_equals_pointer_loads("cpu", torch.float32, 1, 2, 70, sk, 64, masked)


@pytest.mark.gpu
@pytest.mark.parametrize("sk, d", [(1531, 128), (1890, 64), (128, 128)])
def test_e4m3_loop_by_tma_equals_pointer_loads_gpu(sk, d):
    """The same on the H200, where TMA is the default: bf16, two batches of 4 heads, a key-padding mask."""
    _check_tma_equals_pointer_loads("cuda", torch.bfloat16, 2, 4, 1000, sk, d, True)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn-pv8", "fp8"])
def test_fp8_pv_methods_on_hopper_run_the_tma_loop_row_for_row_gpu(method, monkeypatch):
    """The FP8-P·V methods on Hopper: the TMA loop equals the reference row by row (every row's
    cosine, not only the tensor's) and gives the same bits on every run (a race on P̂'s registers
    shows as rows that change run to run); the pointer-load loop, whose asynchronous MMA had its
    P̂ registers reused (wrong rows on the H200), is refused — directly and by FP4VIDEO_MX_TMA=0."""
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3
    from fp4video.kernels.plan import plan

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("a Hopper (sm_90) test")
    q, k, v = (rand(1, 4, 2000, 128, seed=60 + i).to("cuda", torch.bfloat16) for i in range(3))
    mask = (rand(1, 1, 1, 2000, seed=63) > -1.0).cuda()
    want = fp4_attention(q.float(), k.float(), v.float(), method=method, attn_mask=mask, backend="reference")
    runs = [fp4_attention(q, k, v, method=method, attn_mask=mask, backend="triton") for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    rows = torch.nn.functional.cosine_similarity(runs[0].double().flatten(0, 2), want.double().flatten(0, 2), dim=-1)
    assert rows.min() > 0.99 and (rows < 0.999).float().mean() < 0.01, (rows.min(), (rows < 0.999).float().mean())
    recipe = METHODS[method]
    tma_plan = plan(recipe, q, v, mask)
    assert tma_plan.loop == "e4m3" and tma_plan.tma and tma_plan.key_order == "tile", tma_plan
    ops = prepare(q, k, v, recipe, None, tma_plan)
    with pytest.raises(ValueError, match="pointer-load e4m3 loop computes wrong rows"):
        attention_e4m3(ops, None, tma_plan.replace(tma=False), recipe=recipe, scale=128**-0.5, out_dtype=q.dtype,
                       dv=128)
    monkeypatch.setenv("FP4VIDEO_MX_TMA", "0")
    with pytest.raises(ValueError, match=rf"{method} cannot run here \(FP4VIDEO_MX_TMA=0\)"):
        fp4_attention(q, k, v, method=method, backend="triton")


def _check_tma_equals_pointer_loads(dev, dt, b, h, sq, sk, d, masked):
    from fp4video.kernels.dispatch import key_padding
    from fp4video.kernels.loop_e4m3 import attention_e4m3
    from fp4video.kernels.plan import plan
    from fp4video.kernels.prepass import prepass_fp8
    from key_order_reference import k8_in_key_order

    q, k, v = rand(b, h, sq, d, seed=40), rand(b, h, sk, d, seed=41), rand(b, h, sk, d, seed=42)
    mask = (rand(b, 1, 1, sk, seed=43) > -0.8).to(dev) if masked else None
    q, k, v = (t.to(dev, dt) for t in (q, k, v))
    alive, recipe = key_padding(mask, b, sk), METHODS["mxattn"]
    plain = prepass_fp8(q, k, v, recipe, alive)
    tiled = prepass_fp8(q, k, v, recipe, alive, k_tile_order=True)
    sk_pad = -(-sk // 128) * 128
    assert (plain.sk, plain.k_tile_order, tiled.sk, tiled.k_tile_order) == (sk, False, sk, True)
    assert tiled.k8.shape[-2] == sk_pad and torch.equal(k8_in_key_order(tiled.k8, sk).float(), plain.k8.float())
    assert not k8_in_key_order(tiled.k8, sk_pad)[..., sk:, :].float().any()  # the padding rows are zero
    for name in ("q8", "q_fac", "k_fac", "v8t", "v_fac", "v_span"):  # Q̂, the factors, V̂ᵀ and its span are unchanged
        assert torch.equal(getattr(plain, name).float(), getattr(tiled, name).float()), name
    # the plan for these tensors' device, in each form: pointer loads (K̂ in key or tile order) or TMA
    base = plan(recipe, q, v, mask)
    assert base.loop == "e4m3" and base.operands == "fp8", base
    pointer, pointer_tiled, tma = (base.replace(tma=False, key_order="key"), base.replace(tma=False, key_order="tile"),
                                   base.replace(tma=True, key_order="tile"))

    def run(pre, form, **opts):
        return attention_e4m3(pre, alive, form, recipe=recipe, scale=d**-0.5, out_dtype=q.dtype, dv=d, **opts)

    ref = fp4_attention(q, k, v, method="mxattn", attn_mask=mask, backend="reference").float()
    for fresh_pv in (False, True):  # the pointer loop's default and the TMA loop's
        want = run(plain, pointer, fresh_pv=fresh_pv)
        for got in (run(tiled, pointer_tiled, fresh_pv=fresh_pv), run(tiled, tma, fresh_pv=fresh_pv)):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        assert cossim(want[0].float(), ref) > 0.9999
    with pytest.raises(ValueError, match="tile key order"):
        run(plain, tma)


def test_kernel_accuracy_equals_reference_on_the_sageattention3_harness(device):
    """The kernel's accuracy on the SageAttention3 harness equals the reference's within 0.01
    cosine points (MXFP4 methods on the e4m3 path, NVFP4 methods on their bf16 loop; CPU
    interpreter or the GPU)."""
    from fp4video.harness import sageattention3
    from fp4video.metrics import compare

    dev = device
    x = sageattention3.make_inputs(0, n=512)
    exact = sageattention3.exact_attention(x)[1].float()
    q, k, v = (t.float()[None, None].to(dev) for t in (x.q, x.k, x.v))
    for method in ("mxattn", "mxfp4-ocp", "sage3", "nvfp4"):
        ref = fp4_attention(q, k, v, method=method, backend="reference")
        got = fp4_attention(q, k, v, method=method, backend="triton")
        c_ref = 100 * compare(ref[0, 0].cpu(), exact)["cossim"]
        c_got = 100 * compare(got[0, 0].float().cpu(), exact)["cossim"]
        assert abs(c_got - c_ref) < 0.01, (method, c_ref, c_got)


@pytest.mark.parametrize("method", MX_METHODS)
def test_scaled_kernel_matches_reference_interpreter(method, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers this on CUDA")
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    q, k, v = rand(1, 2, 70, 64, seed=64), rand(1, 2, 200, 64, seed=65), rand(1, 2, 200, 40, seed=66)
    mask = rand(1, 1, 1, 200, seed=67) > -0.8
    for m in (None, mask):
        a, la = fp4_attention(q, k, v, method=method, attn_mask=m, return_lse=True, backend="reference")
        b, lb = fp4_attention(q, k, v, method=method, attn_mask=m, return_lse=True, backend="triton")
        assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5, method


def _check_scaled_tma_equals_pointer_loads(dev, dt, method, h, sq, sk, d, dv):
    """The dot_scaled loop with K̂ / V̂ᵀ codes by TMA descriptors (and, asked for, the
    warp-specialized loop) equals its pointer-load form bit for bit: the same tiles, the same
    products in the same order. Keys past SK in a TMA box (the next head's rows, or zeros past the
    last head) are masked like any key past SK."""
    from fp4video.kernels import dispatch
    from fp4video.kernels.loop_scaled import attention_packed
    from fp4video.kernels.plan import WS_MAJORS, plan

    q, k, v = (rand(2, h, n, c, seed=72 + i, device=dev, dtype=dt) for i, (n, c) in enumerate(((sq, d), (sk, d), (sk, dv))))
    mask = rand(2, 1, 1, sk, seed=75, device=dev) > -0.8
    recipe = METHODS[method]
    # the dot_scaled loop's forms, K̂ in key order: pointer loads, TMA, warp-specialized (TMA)
    base = plan(recipe, q, v)
    assert base.loop == "scaled" and base.operands == "packed", base
    pointer = base.replace(tma=False, warp_specialized=False, key_order="key")
    forms = [pointer.replace(tma=True), pointer.replace(tma=True, warp_specialized=True)]
    ws = dev == "cpu" or torch.cuda.get_device_capability(dev)[0] in WS_MAJORS  # (interpreted: the same loop in order)
    for m in (None, mask):
        alive = dispatch.key_padding(m, 2, sk)
        ops = dispatch.prepare(q, k, v, recipe, alive, pointer)

        def run(form):
            return attention_packed(ops, alive, form, recipe=recipe, scale=d**-0.5, out_dtype=q.dtype, dv=dv)

        want = run(pointer)
        for form in forms[:2 if ws else 1]:
            got = run(form)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (method, form.form(), m is not None)
    with pytest.raises(ValueError, match="reads K̂ / V̂ᵀ by TMA"):
        run(pointer.replace(warp_specialized=True))


@pytest.mark.parametrize("d, dv", [(64, 40), (128, 128)])
@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp", "nvfp4", "sage3", "sage3-hpnq", "mxattn-pv8", "sage3-pv8"])
def test_scaled_loop_by_tma_equals_pointer_loads(method, d, dv, monkeypatch, e4m3_dot_scaled):
    """Interpreter: two heads of 200 keys (a partial last tile whose TMA box reaches into the next
    head), 70 queries, with and without a key-padding mask; MXFP4 (codes and scales in their own
    tensors) and NVFP4 (rows of codes then scale bytes, padded to 16 bytes: the box takes the
    codes), with P·V in FP4 or (``-pv8``) in FP8 (V̂ᵀ's e4m3 rows by a box of a key tile's bytes).
    Head dims 64 / value 40 (padded to 64): the block scales by pointer loads; 128 / 128: by TMA in
    tensor memory's chunk layout (:func:`~fp4video.kernels.loop_scaled.scale_chunks`), as on
    datacenter Blackwell at the models' head dim."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU twin covers CUDA")
    from fp4video.kernels.loop_scaled import scale_chunks_fit

    qb = 16 if METHODS[method].qk_format.name == "NVFP4" else 32
    pv8 = METHODS[method].pv_format.name == "E4M3"
    # 64 / 40: MXFP4's 2 scales a key are not a chunk's 4, nor 64 padded channels its 128 rows (the
    # NVFP4-FP8-P·V form, 4 scales a key and no V̂ scales, takes chunks there too)
    assert scale_chunks_fit(d, qb, -(-dv // 64) * 64, pv8) == (d == 128 or (qb == 16 and pv8))
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    _check_scaled_tma_equals_pointer_loads("cpu", torch.float32, method, 2, 70, 200, d, dv)


def test_scale_chunks_layout():
    """:func:`~fp4video.kernels.loop_scaled.scale_chunks` puts scale (r, c) of a tile at the byte
    tensor memory's 32×128-bit scale copies read it from — ((g·C/4 + u)·32 + i)·16 + 4·j + w for
    r = 128·g + 32·j + i, c = 4·u + w — checked element by element against that formula, for one
    and two row groups and one and two scale groups; other shapes are refused."""
    from fp4video.kernels.loop_scaled import scale_chunks

    for rows, cols in ((128, 4), (128, 8), (256, 4), (256, 8)):
        tiles = torch.randint(0, 256, (3, rows, cols), dtype=torch.uint8)
        flat = scale_chunks(tiles).reshape(3, -1)
        assert flat.shape[1] == rows * cols
        for r in range(rows):
            g, j, i = r // 128, (r % 128) // 32, r % 32
            for c in range(cols):
                u, w = c // 4, c % 4
                at = ((g * (cols // 4) + u) * 32 + i) * 16 + 4 * j + w
                assert torch.equal(flat[:, at], tiles[:, r, c]), (rows, cols, r, c)
    for bad in ((3, 64, 4), (3, 128, 2)):
        with pytest.raises(ValueError, match="multiple of 128 rows"):
            scale_chunks(torch.zeros(bad, dtype=torch.uint8))


def test_scaled_plans_pick_their_variant_module():
    """The dot_scaled loop's variants are modules of their own over the shared math
    (``scaled_math``), none importing another: the plan's form picks one — sm_100's TMA loop
    (warp-specialized), sm_120's quad key order for FP4 P·V, the pointer-load loop in key order
    for sm_120's FP8-P·V methods, sm_100 without TMA, and where Triton emulates ``dot_scaled``."""
    import ast
    import inspect
    from pathlib import Path

    from fp4video.kernels import loop_scaled, loop_scaled_pointer, loop_scaled_sm100, loop_scaled_sm120
    from fp4video.kernels.plan import plan_on

    variants = {loop_scaled_sm100, loop_scaled_sm120, loop_scaled_pointer}
    names = {m.__name__.rsplit(".", 1)[-1] for m in variants} | {"loop_scaled"}
    for module in variants:
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
        assert "scaled_math" in imported and not imported & names, (module.__name__, imported)
    cases = [("mxattn", "sm_100", {}, loop_scaled_sm100), ("sage3-pv8", "sm_100", {}, loop_scaled_sm100),
             ("mxattn", "sm_120", {}, loop_scaled_sm120), ("sage3-hpnq", "sm_120", {}, loop_scaled_sm120),
             ("mxattn-pv8", "sm_120", {}, loop_scaled_pointer), ("sage3-pv8", "sm_120", {}, loop_scaled_pointer),
             ("mxattn", "sm_100", {"FP4VIDEO_MX_TMA": "0"}, loop_scaled_pointer),
             ("mxattn", "sm_90", {"FP4VIDEO_MX_KERNEL": "scaled"}, loop_scaled_pointer)]
    with pytest.MonkeyPatch.context() as mp:
        for method, arch, env, module in cases:
            for name in ("FP4VIDEO_MX_TMA", "FP4VIDEO_MX_KERNEL", "FP4VIDEO_NV_KERNEL"):
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            plan = plan_on(METHODS[method], arch)
            if plan.loop != "scaled":  # (a Triton that cannot compile the native loop there)
                continue
            assert loop_scaled.variant(plan) is module, (method, arch, env, plan.form())
            fn, consts = loop_scaled.kernel(plan, METHODS[method], (int(arch[3:-1]), int(arch[-1])), d=128,
                                            dv_pad=128, block_m=128, has_mask=False)
            params = inspect.signature(fn.fn).parameters.values()  # (the jit or the interpreted function's)
            assert fn is module.KERNEL and set(consts) == {p.name for p in params if "constexpr" in str(p.annotation)}


@pytest.mark.gpu
def test_scaled_loop_by_tma_equals_pointer_loads_gpu(monkeypatch):
    """The same on this GPU: on Hopper the dot_scaled loop is Triton's emulation (the TMA copies
    are real); on datacenter Blackwell the warp-specialized loop runs natively."""
    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    _check_scaled_tma_equals_pointer_loads("cuda", torch.bfloat16, "mxattn", 4, 1000, 1531, 128, 128)


@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp", "nvfp4", "sage3", "sage3-hpnq"])
def test_scaled_loop_quad_key_order_interpreter(method, monkeypatch, e4m3_dot_scaled):
    """Consumer Blackwell's form of the dot_scaled loop (``quad_order``): the pre-pass stores key r of
    K̂ (and its MXFP4 scales) in row quad_key_order(r) of whole 32-key groups, the loop relabels S
    and P's codes back — the same attention as the key-order loop (to the order of the row sums'
    additions) and as the reference, row by row: two heads of 200 keys (a partial last group and
    tile), 70 queries, value head dim 40, with and without a key-padding mask, sharp logits."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    from fp4video.kernels import dispatch
    from fp4video.kernels.checks import k_smoothing_mean, smoothing_lse_shift
    from fp4video.kernels.key_order import quad_key_order
    from fp4video.kernels.loop_scaled import attention_packed
    from fp4video.kernels.plan import plan, plan_on
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.metrics import row_cosine

    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    recipe = METHODS[method]
    q, k, v = rand(2, 2, 70, 64, seed=76), rand(2, 2, 200, 64, seed=77) + 0.3, rand(2, 2, 200, 40, seed=78)
    mask = rand(2, 1, 1, 200, seed=79) > -0.8
    key_plan = plan(recipe, q, v)
    assert key_plan.loop == "scaled" and key_plan.key_order == "key", key_plan  # (the interpreter's default: key order)
    for arch, quad_order in (("sm_120", True), ("sm_121", True), ("sm_100", False), ("sm_90", False)):
        on = plan_on(recipe, arch)
        assert on.loop == "scaled" and (on.key_order == "quad") is quad_order, (arch, on)
    quad_plan = key_plan.replace(key_order="quad")
    for qs, m in ((q, None), (q, mask), (q * 6, mask)):
        alive = dispatch.key_padding(m, 2, 200)
        plain = prepass_packed(qs, k, v, recipe, alive)
        quad = prepass_packed(qs, k, v, recipe, alive, quad_order=True)
        assert not plain.quad_order and quad.quad_order
        k_plain, k_quad = plain.k4, quad.k4
        whole = k_quad.as_strided((2, 2, 224, k_quad.shape[-1]), k_quad.stride())  # 7 whole groups of 32
        used = plain.q4.shape[-1]  # (NVFP4 rows: codes and scale bytes, then padding to 16 bytes)
        assert torch.equal(whole[:, :, quad_key_order.fn(torch.arange(200)), :used], k_plain[..., :used])
        run = dict(recipe=recipe, scale=64**-0.5, out_dtype=q.dtype, dv=40)
        a, la = attention_packed(plain, alive, key_plan, **run)
        b, lb = attention_packed(quad, alive, quad_plan, **run)
        torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-6)  # (the unquantized row sum: added in another order)
        torch.testing.assert_close(lb, la, rtol=2e-7, atol=1e-6)
        r, lr = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="reference")
        if recipe.smooth_k:  # (the loop's LSE is of the smoothed logits)
            lb = lb + smoothing_lse_shift(qs, k_smoothing_mean(k, alive), 64**-0.5)
        assert (r - b).abs().max() < 1e-5 and (lr - lb).abs().max() < 1e-5 and row_cosine(r, b).min() > 0.99999
    with pytest.raises(ValueError, match="quad key order"):
        attention_packed(quad, alive, quad_plan.replace(tma=True), **run)
    for ops, form in ((quad, key_plan), (plain, quad_plan)):  # operands prepared for another key order
        with pytest.raises(ValueError, match="prepare them with the plan"):
            attention_packed(ops, alive, form, **run)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp"])
def test_scaled_loop_quad_key_order_gpu(method, monkeypatch):
    """The quad key order compiled for this GPU (on Hopper the dot_scaled loop is Triton's emulation:
    the relabelling and the stored order, not sm_120's MMA): equal to the key-order loop and the
    reference, row by row, masked and not, a partial last group of 32 keys."""
    from fp4video.kernels import dispatch
    from fp4video.kernels.loop_scaled import attention_packed
    from fp4video.kernels.plan import plan
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.metrics import row_cosine

    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    recipe = METHODS[method]
    q, k, v = (rand(1, 4, n, 128, seed=s, device="cuda", dtype=torch.bfloat16) for s, n in ((96, 1000), (97, 1531), (98, 1531)))
    mask = rand(1, 1, 1, 1531, seed=99, device="cuda") > -1.0
    base = plan(recipe, q, v)
    assert base.loop == "scaled", base
    key_plan = base.replace(tma=False, warp_specialized=False, key_order="key")  # the pointer-load loop
    quad_plan = key_plan.replace(key_order="quad")
    for m in (None, mask):
        alive = dispatch.key_padding(m, 1, 1531)
        run = dict(recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128)
        a, la = attention_packed(prepass_packed(q, k, v, recipe, alive), alive, key_plan, **run)
        torch.full((64 << 20,), float("nan"), device="cuda")  # poison the memory the outputs reuse
        b, lb = attention_packed(prepass_packed(q, k, v, recipe, alive, quad_order=True), alive, quad_plan, **run)
        assert torch.isfinite(b).all() and torch.isfinite(lb).all()
        assert row_cosine(a.float(), b.float()).min() > 0.99999 and (la - lb).abs().max() < 1e-4, (method, m is not None)
        r = fp4_attention(q, k, v, method=method, attn_mask=m, backend="reference")
        # (the GPU's exp2 and torch's exp differ in the last bits: an element that close to an E2M1
        # rounding boundary may round to the other neighbour, which moves its row)
        rows = row_cosine(r.float(), b.float())
        assert cossim(r.float(), b.float()) >= 0.9999 and (rows < 0.999).float().mean() < 1e-3, \
            (method, m is not None, rows.min().item(), (rows < 0.999).sum().item())


NV_METHODS = [m for m in METHODS if METHODS[m].qk_format is not None and METHODS[m].qk_format.value == "nvfp4"
              and METHODS[m].pv_format is not None and METHODS[m].pv_format.value == "nvfp4"]


def test_interpreter_dot_scaled_takes_e4m3_scales(e4m3_dot_scaled):
    """The fixture's decoding: ``tl.dot_scaled`` of NVFP4 operands (packed codes, E4M3 block-16
    scales from :func:`fp4video.formats.quantize`) equals the product of their dequantized values."""
    import triton
    import triton.language as tl

    from fp4video.formats import quantize

    @triton.jit
    def product(A, AS, B, BS, O, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m, n, kk, g = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K // 2), tl.arange(0, K // 16)
        a = tl.load(A + m[:, None] * (K // 2) + kk[None, :])
        b = tl.load(B + n[:, None] * (K // 2) + kk[None, :])
        sa = tl.load(AS + m[:, None] * (K // 16) + g[None, :])
        sb = tl.load(BS + n[:, None] * (K // 16) + g[None, :])
        tl.store(O + m[:, None] * N + n[None, :], tl.dot_scaled(a, sa, "e2m1", tl.trans(b), sb, "e2m1"))

    qa, qb = quantize(rand(16, 64, seed=90) * 5, "nvfp4"), quantize(rand(16, 64, seed=91) / 7, "nvfp4")
    out = torch.empty(16, 16)
    product[(1,)](qa.codes, qa.scales, qb.codes, qb.scales, out, 16, 16, 64)
    assert torch.allclose(out, qa.dequantize() @ qb.dequantize().T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", NV_METHODS)
def test_scaled_nvfp4_kernel_matches_reference_interpreter(method, monkeypatch, e4m3_dot_scaled):
    """The native NVFP4 loop (``tl.dot_scaled`` with E4M3 block-16 scales: Blackwell's
    ``kind::mxf4nvf4``), run by the interpreter: equal to the reference and to the bf16 NVFP4 loop
    (same codes, same scales; fp32 sums in another order) on every row, with and without a
    key-padding mask, odd lengths, a value head dim that is not a power of two, and sharp logits."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers this on CUDA")
    from fp4video.kernels import dispatch
    from fp4video.kernels.operands import PackedOperands
    from fp4video.kernels.plan import plan
    from fp4video.metrics import row_cosine

    q, k, v = rand(1, 2, 70, 64, seed=80), rand(1, 2, 200, 64, seed=81) + 0.4, rand(1, 2, 200, 40, seed=82)
    mask = rand(1, 1, 1, 200, seed=83) > -0.8
    for qs, m in ((q, None), (q, mask), (q * 6, mask)):  # * 6: sharp softmax rows
        monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
        assert plan(METHODS[method], qs, v, m).loop == "scaled"  # the native loop runs
        assert isinstance(dispatch.prepare(qs, k, v, METHODS[method], None), PackedOperands)
        a, la = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="reference")
        b, lb = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="triton")
        monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "triton")
        c, lc = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="triton")
        assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5, method
        assert (b - c).abs().max() < 1e-5 and (lb - lc).abs().max() < 1e-5, method
        assert row_cosine(a, b).min() > 0.99999, method


@pytest.mark.parametrize("method", ["sage3", "sage3-hpnq"])
def test_scaled_nvfp4_exponent_forms_agree_within_the_fast_bound_and_the_exact_one_runs_beyond(
        method, monkeypatch, e4m3_dot_scaled):
    """The dot_scaled loop has two forms of two-level NVFP4 P's exponents (``scaled_math.nv_p``): the
    fused one (one FMA an exponent, what keeps sm_100 and sm_120 within their instruction budgets)
    for calls whose logit bound lies within ``FAST_LOGIT_BOUND`` nats, the exact one beyond. Within
    the bound — an ordinary head, a sharp one, a head of ±1e-30 values whose tensor scales multiply
    to below fp32's range (the fused factor is held at fp32's smallest normal: a masked product
    stays -inf, not NaN), a head whose rows all pick one key at ~1000 nats (each fused P̃ of a row
    carries exp2 of m's rounding residual, up to 2^-15 there: the two-level factor must carry it
    too, or ``sage3``'s row sum and P̂ part by it), a padding mask — both forms equal the reference
    row by row; each launch runs the form asked for (``sage3``'s row sum, of the unquantized P̃,
    shows the fused exponents in its bits); the dispatch runs the fused one there and the exact
    one for logits past the bound."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    import math

    from fp4video.kernels import dispatch, loop_scaled
    from fp4video.kernels.checks import k_smoothing_mean, smoothing_lse_shift
    from fp4video.kernels.loop_e4m3 import FAST_LOGIT_BOUND
    from fp4video.kernels.loop_scaled import attention_packed
    from fp4video.kernels.plan import plan
    from fp4video.kernels.prepass import prepass_packed
    from fp4video.metrics import row_cosine

    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    recipe = METHODS[method]
    q, k, v = rand(1, 4, 70, 64, seed=100), rand(1, 4, 200, 64, seed=101) + 0.4, rand(1, 4, 200, 40, seed=102)
    q[:, 1] *= 6.0  # sharp rows
    q[:, 2], k[:, 2] = 1e-30 * q[:, 2].sign(), 1e-30 * k[:, 2].sign()
    mask = rand(1, 1, 1, 200, seed=103) > -0.8
    mask[..., 37] = True
    unit = rand(64, seed=104)
    unit /= unit.norm()
    q[:, 3] = unit * 1000.0  # key 37 at ~1000 nats (K smoothed: ~ (4 + 4) · 1000 / 8), the others near 0
    k[:, 3] = 0.002 * k[:, 3] - 4.0 * unit
    k[:, 3, 37] = 4.0 * unit
    alive = dispatch.key_padding(mask, 1, 200)
    want, lse_want = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference")
    call_plan = plan(recipe, q, v, mask)
    assert call_plan.loop == "scaled", call_plan
    ops = prepass_packed(q, k, v, recipe, alive)
    shift = smoothing_lse_shift(q, k_smoothing_mean(k, alive), 64**-0.5)  # (the loop's LSE: of the smoothed logits)
    launched, real_kernel = [], loop_scaled.kernel

    def kernel_spy(*a, **kw):
        fn, consts = real_kernel(*a, **kw)
        launched.append(consts["EXACT"])
        return fn, consts

    monkeypatch.setattr(loop_scaled, "kernel", kernel_spy)
    forms = []
    for exact in (False, True):
        out, lse = attention_packed(ops, alive, call_plan, recipe=recipe, scale=64**-0.5, out_dtype=q.dtype, dv=40,
                                    exact=exact)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), exact
        # (the LSE to two ulps of its magnitude: ~1000 nats in the last head)
        assert (want - out).abs().max() < 1e-5, exact
        assert ((lse_want - (lse + shift)).abs() <= 1e-5 + 2.5e-7 * lse_want.abs()).all(), exact
        assert row_cosine(want, out).min() > 0.99999, exact
        forms.append(out)
    assert launched == [False, True]
    if recipe.row_sum.value == "exact":  # (PNQ's row sum, like P̂, is of the codes, which seldom move)
        assert not torch.equal(forms[0], forms[1])

    seen = []
    real_loop_function = dispatch.loop_function

    def spy(*a, **kw):
        seen.append(kw["exact"])
        return attention_packed(*a, **kw)

    monkeypatch.setattr(dispatch, "loop_function", lambda loop: spy if loop == "scaled" else real_loop_function(loop))
    fp4_attention(q[:, :1], k[:, :1], v[:, :1], method=method, attn_mask=mask, backend="triton")
    big = math.sqrt(4 * FAST_LOGIT_BOUND * 64**0.5 / 64)  # scale·D·max|q|·max|k| past the bound
    far = fp4_attention(q[:, :1].clamp(-1, 1) * big, k[:, :1].clamp(-1, 1) * big, v[:, :1], method=method,
                        attn_mask=mask, backend="triton")
    assert seen == [False, True] and torch.isfinite(far).all()


@pytest.mark.parametrize("method", ["mxattn-pv8", "sage3-pv8"])
def test_scaled_fp8_pv_kernel_matches_reference_interpreter(method, monkeypatch, e4m3_dot_scaled):
    """The FP8-P·V methods on the dot_scaled loop (Blackwell: Q·K on the native FP4 MMA — MXFP4 or
    NVFP4 — P̂·V̂ on the FP8 one), run by the interpreter: equal to the reference on every row, with
    and without a key-padding mask, odd lengths, a value head dim that is not a power of two,
    sharp logits; the identity V = 1 gives 1 (PNQ: the row sum is of the rounded P̂)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test; the GPU test covers this on CUDA")
    from fp4video.kernels import dispatch
    from fp4video.kernels.operands import PackedOperands
    from fp4video.kernels.plan import plan
    from fp4video.metrics import row_cosine

    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    q, k, v = rand(1, 2, 70, 64, seed=84), rand(1, 2, 200, 64, seed=85) + 0.4, rand(1, 2, 200, 40, seed=86)
    mask = rand(1, 1, 1, 200, seed=87) > -0.8
    assert plan(METHODS[method], q, v).loop == "scaled"
    assert isinstance(dispatch.prepare(q, k, v, METHODS[method], None), PackedOperands)
    for qs, m in ((q, None), (q, mask), (q * 6, mask)):
        a, la = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="reference")
        b, lb = fp4_attention(qs, k, v, method=method, attn_mask=m, return_lse=True, backend="triton")
        assert (a - b).abs().max() < 1e-5 and (la - lb).abs().max() < 1e-5, method
        assert row_cosine(a, b).min() > 0.99999, method
    ones = fp4_attention(q, k, torch.ones_like(v), method=method, attn_mask=mask, backend="triton")
    assert (ones - 1).abs().max() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mxattn", "mxfp4-ocp", *NV_METHODS, "mxattn-pv8", "sage3-pv8"])
def test_scaled_kernel_matches_reference_gpu(method, monkeypatch):
    """The dot_scaled kernel on this GPU (native FP4 on Blackwell, emulated by Triton on Hopper),
    MXFP4 and NVFP4 (where this Triton compiles the NVFP4 form for this GPU: 3.8+ emulated, 3.9+ on sm_100)."""
    from fp4video.kernels.plan import plan

    monkeypatch.setenv("FP4VIDEO_MX_KERNEL", "scaled")
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "scaled")
    q, k, v = (rand(1, 4, 1000, 128, seed=s, device="cuda", dtype=torch.bfloat16) for s in (68, 69, 70))
    mask = rand(1, 1, 1, 1000, seed=71, device="cuda") > -1.0
    try:  # (a Triton too old for the NVFP4 form here: FP4VIDEO_NV_KERNEL=scaled is refused)
        assert plan(METHODS[method], q, v, mask).loop == "scaled"
    except ValueError as e:
        pytest.skip(str(e))
    if METHODS[method].pv_format.value == "e4m3" and torch.cuda.get_device_capability()[0] == 9:
        # its asynchronous P̂·V̂ MMA had its register operand reused on the H200 (wrong rows): refused
        with pytest.raises(ValueError, match="dot_scaled loop's FP8-P·V form computes wrong rows"):
            fp4_attention(q, k, v, method=method, attn_mask=mask, backend="triton")
        return
    a, la = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference")
    b, lb = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton")
    assert cossim(a.float(), b.float()) >= 0.9999 and (la - lb).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["sage3", "nvfp4", "sage3-hpnq"])
def test_gluon_nvfp4_kernel_equals_triton_loop_gpu(method, monkeypatch):
    """The ping-pong Gluon NVFP4 kernel (attention_nvfp4_sm90, the default on Hopper) computes what
    the Triton NVFP4 loop computes, element for element — the same P̂ (one shared quantization
    function) through the same MMAs in the same order — for one key tile or several, a partial
    last tile or none, a key-padding mask, head dims 64 and 128, a query block only half used; and
    both match the reference."""
    from fp4video.kernels import dispatch
    from fp4video.kernels.operands import TileOperands
    from fp4video.kernels.plan import Plan, plan

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon NVFP4 kernel is built for sm_90")
    for sk, d, masked in ((100, 128, False), (1024, 128, False), (937, 64, False), (1531, 128, True)):
        q, k, v = (rand(2, 3, 333, d, seed=90 + i, device="cuda", dtype=torch.bfloat16) * 2 for i in range(3))  # 333 = 2·128 + 77
        k, v = rand(2, 3, sk, d, seed=93, device="cuda", dtype=torch.bfloat16) * 2, \
            rand(2, 3, sk, d, seed=94, device="cuda", dtype=torch.bfloat16)
        mask = (rand(2, 1, 1, sk, seed=95, device="cuda") > -1.0) if masked else None
        outs = {}
        for kernel, loop in (("triton", "nvfp4"), ("sm90", "nvfp4_sm90")):
            monkeypatch.setenv("FP4VIDEO_NV_KERNEL", kernel)
            assert plan(METHODS[method], q, v, mask).loop == loop, (kernel, method, d)
            torch.full((64 << 20,), float("nan"), device="cuda")  # poison the memory the outputs reuse
            outs[kernel] = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton")
        (a, la), (b, lb) = outs["triton"], outs["sm90"]
        case = (method, sk, d, masked)
        assert torch.isfinite(b).all() and torch.isfinite(lb).all(), case
        assert torch.equal(a, b) and torch.equal(la, lb), case
        r, lr = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference")
        assert cossim(r.float(), b.float()) >= 0.9999 and (lr - lb).abs().max() < 2e-2, case
    monkeypatch.setenv("FP4VIDEO_NV_KERNEL", "sm90")
    qh = torch.zeros(1, 1, 8, 32, device="cuda", dtype=torch.bfloat16)  # head dim 32: not built for it
    with pytest.raises(ValueError, match=r"FP4VIDEO_NV_KERNEL=sm90: .*head dims 64 and 128"):
        plan(METHODS[method], qh)
    with pytest.raises(ValueError, match=r"FP4VIDEO_NV_KERNEL=sm90: .*no launch options"):
        plan(METHODS[method], q, launch_given=True)
    gluon = Plan("nvfp4_sm90", "tiles", arch="sm_90", work_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims 64 and 128"):  # the loop's own check, whatever plan it is given
        dispatch.run_loop(gluon, TileOperands(qh, qh, qh, 8), None, recipe=METHODS[method], scale=1.0,
                          out_dtype=torch.bfloat16, dv=32)
    monkeypatch.delenv("FP4VIDEO_NV_KERNEL")
    assert plan(METHODS[method], q, launch_given=False).loop == "nvfp4_sm90"
    assert plan(METHODS[method], q, launch_given=True).loop == "nvfp4"


def test_gluon_nvfp4_launch_binds_every_argument_by_name():
    """attention_nvfp4_sm90 passes the Triton loop's shared arguments to the Gluon kernel by
    parameter name: every runtime parameter of the Gluon kernel is either one of them or a TMA
    descriptor / padded length it adds (a renamed parameter fails here, not on the GPU)."""
    from fp4video.kernels import loop_nvfp4_sm90
    from fp4video.kernels.loop_nvfp4 import nv_launch_args

    q = torch.zeros(1, 1, 8, 64)
    kv = torch.zeros(1, 1, 128, 64)
    shared = set(nv_launch_args(q, kv, kv, None, sk=100, recipe=METHODS["sage3"], scale=1.0, out_dtype=q.dtype)[2])
    kernel = loop_nvfp4_sm90.KERNEL
    runtime = [n for i, n in enumerate(kernel.arg_names) if i not in kernel.constexprs]
    assert set(runtime) - shared == {"Kd", "Vd", "SK_PAD"}, runtime
