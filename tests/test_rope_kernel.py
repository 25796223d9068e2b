"""Wan's RoPE as one fused kernel (:mod:`fp4video.kernels.rope`) against the stock processor's eight
torch operations (:func:`fp4video.integration.rope.stock_wan_rope`, a copy of diffusers' own), bit for
bit, and against the rotation itself in fp64 (each pair turned by its token's angle) within one
rounding of the output dtype: 16- and 32-bit inputs, batches, single tokens, strided keys, non-finite
values where the stock puts them; inputs left as they were; operands it does not take refused in one
line and run by the stock operations in the processor. The ``gpu`` twins run the kernel at Wan2.2
720p's shape and a tiny Wan transformer through fp4video's processor with and without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fp4video.integration import rope as route_rope  # noqa: E402
from fp4video.kernels import rope  # noqa: E402

from conftest import HAS_CUDA, rand  # noqa: E402


def tables(seq: int, dim: int, seed: int, device="cpu", dtype=torch.float32):
    """Wan's (1, S, 1, D) cos and sin tables (fp32 as diffusers keeps them; 16-bit after a model's
    ``.to(dtype)``): one angle per pair, repeated for both members."""
    angle = rand(seq, dim // 2, seed=seed, dtype=torch.float64) * 7
    cos = angle.cos().repeat_interleave(2, -1).to(dtype).view(1, seq, 1, dim).to(device)
    sin = angle.sin().repeat_interleave(2, -1).to(dtype).view(1, seq, 1, dim).to(device)
    return cos, sin


def exact(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x[2i], x[2i+1]) as a complex number times e^{iθ}, in fp64."""
    z = torch.view_as_complex(x.double().cpu().unflatten(-1, (-1, 2)).contiguous())
    turn = torch.complex(cos.double().cpu()[..., 0::2], sin.double().cpu()[..., 1::2])
    return torch.view_as_real(z * turn).flatten(-2)


SHAPES = [(1, 37, 3, 16), (2, 5, 2, 8), (2, 1, 4, 16), (1, 130, 5, 128), (3, 19, 1, 64)]


UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("table", DTYPES, ids=lambda t: f"tables-{str(t)[6:]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_stock_bits_and_the_rotation(device, shape, dtype, table):
    b, s, h, d = shape
    q = (rand(*shape, seed=1) * 3).to(device, dtype)
    k = rand(*shape, seed=2).to(device, dtype)
    cos, sin = tables(s, d, seed=3, device=device, dtype=table)
    q0, k0 = q.clone(), k.clone()
    qo, ko = rope.rope_pairs(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0), "the inputs were modified"
    for x, out in ((q, qo), (k, ko)):
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        stock = route_rope.stock_wan_rope(x, cos, sin)
        bad = (out != stock).flatten(0, 2).any(-1).nonzero()
        assert not len(bad), f"rows {bad[:5].tolist()} differ from the stock operations"
        # the rotation by the tables' angles: within the roundings of the operations' dtype (torch's
        # promotion of the two) and one of the output's
        op = UNIT[torch.promote_types(dtype, table)]
        ref = exact(x, cos, sin)
        xd = x.double().cpu().unflatten(-1, (-1, 2))
        radius = xd.norm(dim=-1, keepdim=True).expand_as(xd).flatten(-2)
        assert ((out.double().cpu() - ref).abs() <= 4 * op * radius + UNIT[dtype] * ref.abs()).all()


@pytest.mark.parametrize("table", DTYPES, ids=lambda t: f"tables-{str(t)[6:]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,rows", [((1, 37, 3, 16), 37), ((2, 40, 2, 8), 29), ((3, 19, 1, 64), 1),
                                         ((1, 130, 5, 128), 98)], ids=str)
def test_diffusers_apply_rotary_emb_bits_with_text_tokens_after(device, shape, rows, dtype, table):
    """style="interleaved" against diffusers' own ``apply_rotary_emb`` (HunyuanVideo's call: real
    tables, pairs interleaved, sequence dim 1) on the first ``rows`` tokens, the rest (text) as
    they were: bit for bit."""
    from diffusers.models.embeddings import apply_rotary_emb

    b, s, h, d = shape
    q = (rand(*shape, seed=21) * 3).to(device, dtype)
    k = rand(*shape, seed=22).to(device, dtype)
    angle = rand(rows, d // 2, seed=23, dtype=torch.float64) * 7
    cos = angle.cos().repeat_interleave(2, -1).to(device, table)
    sin = angle.sin().repeat_interleave(2, -1).to(device, table)
    cos[:, 1::2] *= 0.5  # members with their own entries: the style must read each one
    q0, k0 = q.clone(), k.clone()
    qo, ko = rope.rope_pairs(q, k, cos, sin, "interleaved")
    assert torch.equal(q, q0) and torch.equal(k, k0), "the inputs were modified"
    for x, out in ((q, qo), (k, ko)):
        stock = torch.cat([apply_rotary_emb(x[:, :rows], (cos, sin), sequence_dim=1), x[:, rows:]], dim=1)
        assert out.dtype == x.dtype and out.is_contiguous()
        bad = (out != stock).flatten(0, 1).any(-1).any(-1).nonzero()
        assert not len(bad), f"tokens {bad[:5].flatten().tolist()} differ from diffusers' apply_rotary_emb"


def test_strided_keys_and_non_finite_values(device):
    """Keys sliced from a wider projection (token stride larger than H·D) and inf/NaN inputs: the
    stock's result, NaN where it has NaN."""
    b, s, h, d = 2, 23, 3, 32
    wide = rand(b, s, h * d * 2, seed=4).to(device, torch.bfloat16)
    k = wide[..., : h * d].unflatten(2, (h, d))
    q = rand(b, s, h, d, seed=5).to(device, torch.bfloat16)
    q[0, 3, 1, 4] = float("inf")
    q[1, 7, 0, 9] = float("nan")
    q[1, 8, 2, 0] = -float("inf")
    cos, sin = tables(s, d, seed=6, device=device)
    assert rope.rope_pairs_supported(q, k, cos, sin)
    qo, ko = rope.rope_pairs(q, k, cos, sin)
    torch.testing.assert_close(qo, route_rope.stock_wan_rope(q, cos, sin), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ko, route_rope.stock_wan_rope(k, cos, sin), rtol=0, atol=0)
    assert torch.isfinite(qo[0, :3]).all() and torch.isfinite(ko).all()


def test_operands_it_does_not_take_are_refused_and_run_by_the_stock(device, monkeypatch):
    q = rand(1, 8, 2, 16, seed=7).to(device, torch.bfloat16)
    cos, sin = tables(8, 16, seed=8, device=device)
    refused = [
        (q, q[:, :4], cos, sin),                                   # q and k differ in shape
        (q, q, cos.double(), sin.double()),                         # fp64 tables: the stock computes in fp64
        (q, q, cos[:, :4], sin[:, :4]),                             # a table for other tokens
        (q.transpose(2, 3), q.transpose(2, 3), cos, sin),           # heads' dims not packed
        (q[..., :15], q[..., :15], cos[..., :15], sin[..., :15]),   # an odd head dim
    ]
    for args in refused:
        assert not rope.rope_pairs_supported(*args)
        with pytest.raises(ValueError, match=r"rope_pairs\(style='wan'\) takes") as err:
            rope.rope_pairs(*args)
        assert "\n" not in str(err.value)
    # the processor's route hands them to the stock operations, never to the kernel
    monkeypatch.setattr(rope, "rope_pairs", lambda *a: pytest.fail("the kernel was called"))
    qo, ko = route_rope.apply_rope(q, q, cos.double(), sin.double(), "wan")
    assert torch.equal(qo, route_rope.stock_wan_rope(q, cos.double(), sin.double()))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_wan_720p_shape_on_the_gpu():
    """Wan2.2 720p's self-attention operands (75,600 tokens, 40 heads of 128): the stock's bits."""
    b, s, h, d = 1, 75600, 40, 128
    q = (torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16) * 4).unflatten(2, (h, d))
    k = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    cos, sin = tables(s, d, seed=9, device="cuda")
    qo, ko = rope.rope_pairs(q, k, cos, sin)
    for x, out in ((q, qo), (k, ko)):
        stock = route_rope.stock_wan_rope(x, cos, sin)
        assert torch.equal(out, stock), (out != stock).flatten(0, 2).any(-1).nonzero()[:5].tolist()


def tiny_wan(device="cpu"):
    """A tiny Wan transformer, its inputs (a 4 × 8 × 8 latent grid: 64 video tokens a frame) and its
    stock output."""
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=11).to(device)
    g = torch.Generator().manual_seed(12)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, 16, 16, generator=g).to(device),
                  timestep=torch.tensor([500]).to(device),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(device))
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
    return model, inputs, stock


def routed_output(model, inputs, monkeypatch):
    """The model's output under fp4video's fp16 policy, and (style, q shape, k shape, table rows) of
    each RoPE the routing applied at a dispatch."""
    from fp4video.integration import Policy, install, routing, uninstall

    seen = []

    def counted(q, k, cos, sin, style):
        seen.append((style, tuple(q.shape), tuple(k.shape), cos.shape[1] if style == "wan" else cos.shape[0]))
        return route_rope.apply_rope(q, k, cos, sin, style)

    monkeypatch.setattr(routing, "apply_rope", counted)
    install(model, Policy(method="fp16"))
    try:
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
    finally:
        uninstall(model)
    return out, seen


def test_the_routing_applies_wans_rope_at_the_dispatch_with_the_stock_output(monkeypatch):
    """Installed on a Wan transformer, the self-attention modules' RoPE is taken off their calls and
    applied at their dispatch: once per block, the queries' and keys' shapes, the stock output bit for
    bit; cross-attention keeps its call as it was."""
    model, inputs, stock = tiny_wan(device="cuda" if HAS_CUDA else "cpu")
    out, seen = routed_output(model, inputs, monkeypatch)
    assert len(seen) == len(model.blocks)  # self-attention only, once a block
    assert all(style == "wan" and q == k and q[1] == rows == 4 * 8 * 8 for style, q, k, rows in seen)
    assert torch.equal(out, stock)
    with torch.no_grad():  # uninstalled: the processors rotate again
        assert torch.equal(model(**inputs, return_dict=False)[0], stock)


def test_rope_is_left_to_processors_that_are_not_wans_own(monkeypatch):
    """A subclass of Wan's processor (which may use the tables otherwise) and a processor under
    context parallelism keep their RoPE: nothing taken off their calls, the stock output."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Mine(WanAttnProcessor):
        pass

    model, inputs, stock = tiny_wan()
    model.set_attn_processor(Mine())
    out, seen = routed_output(model, inputs, monkeypatch)
    assert not seen and torch.equal(out, stock)

    attn = model.blocks[0].attn1
    assert route_rope.defers(WanAttnProcessor(), attn) == ("wan", "rotary_emb")
    assert route_rope.defers(Mine(), attn) is None
    proc = WanAttnProcessor()
    hidden = torch.zeros(1, 5, 8)
    cos = sin = torch.zeros(1, 5, 1, 4)
    assert route_rope.deferrable("wan", proc, hidden, None, (cos, sin))
    proc._parallel_config = object()
    assert not route_rope.deferrable("wan", proc, hidden, None, (cos, sin))
    assert not route_rope.deferrable("wan", WanAttnProcessor(), hidden, torch.zeros(1, 3, 8), (cos, sin))
    assert not route_rope.deferrable("wan", WanAttnProcessor(), hidden, None, (cos[:, :4], sin[:, :4]))
    rows5, rows4 = (torch.zeros(5, 4),) * 2, (torch.zeros(4, 4),) * 2  # HunyuanVideo's (S, D) tables
    assert route_rope.deferrable("interleaved", WanAttnProcessor(), hidden, torch.zeros(1, 3, 8), rows5)
    assert not route_rope.deferrable("interleaved", WanAttnProcessor(), hidden, torch.zeros(1, 3, 8), rows4)
    assert not route_rope.deferrable("interleaved", WanAttnProcessor(), hidden, None, (cos, sin))


def test_the_routing_applies_hunyuanvideos_rope_at_the_dispatch_with_the_stock_output(monkeypatch):
    """HunyuanVideo (a dual- and a single-stream block, a token refiner, a text padding mask): the
    tables taken off both blocks' calls and applied at their joint dispatch to the 128 video tokens that
    come first, the 24 text tokens after them left as they are; the stock output bit for bit."""
    from fp4video.integration.tiny import tiny_hunyuan_transformer

    model = tiny_hunyuan_transformer(seed=31, head_dim=32)
    g = torch.Generator().manual_seed(32)
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[:, :17] = True
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16, generator=g),  # 2 · 8 · 8 = 128 video tokens
                  encoder_hidden_states=torch.randn(1, 24, 16, generator=g), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([500.0]),
                  guidance=torch.tensor([6000.0]))
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
    out, seen = routed_output(model, inputs, monkeypatch)
    assert [(style, q[1], rows) for style, q, k, rows in seen] == [("interleaved", 128 + 24, 128)] * 2
    assert torch.equal(out, stock)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_fused_kernel_runs_in_a_routed_wan_on_the_gpu(monkeypatch):
    """On the GPU the routed dispatch's RoPE is the fused kernel, with the stock output."""
    model, inputs, stock = tiny_wan(device="cuda")
    model.to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
    calls = []
    fused = rope.rope_pairs
    monkeypatch.setattr(rope, "rope_pairs", lambda *a: calls.append(1) or fused(*a))
    out, seen = routed_output(model, inputs, monkeypatch)
    assert len(calls) == len(model.blocks) and torch.equal(out, stock)


def test_skyreels_v2_takes_the_same_path_with_the_stock_output(monkeypatch):
    """SkyReels-V2's processor is Wan's code under another name: its RoPE too is applied at the
    dispatch, once per block, with the stock output bit for bit."""
    from diffusers import SkyReelsV2Transformer3DModel

    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=41, cls=SkyReelsV2Transformer3DModel)
    g = torch.Generator().manual_seed(42)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, 16, 16, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
    out, seen = routed_output(model, inputs, monkeypatch)
    assert [(style, rows) for style, q, k, rows in seen] == [("wan", 4 * 8 * 8)] * len(model.blocks)
    assert torch.equal(out, stock)
