"""Review of Wan's fused RoPE and its routing: defects found, each test named after its class.

- a routed Wan self-attention whose processor is pointed at another backend after install
  (``set_attention_backend``) loses its RoPE: the hook takes the tables off the call, and the
  dispatch that would apply them is no longer fp4video's;
- the deferral is decided per site at install, so a routed processor of another class moved onto a
  deferred site after install gets its tables taken away;
- the kernel's outputs carry no autograd, though ``rope_pairs_supported`` takes operands that need it
  (``apply_rope`` runs it on CUDA under grad: the projections of q and k get no gradient);
- bf16 subnormal operands: the kernel's result under Triton's CPU interpreter is not the stock's
  (its bf16 <-> fp32 conversions mishandle subnormals; bit-exact conversions via the bits fix it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from fp4video.integration import Policy, install, routing, uninstall  # noqa: E402
from fp4video.integration import rope as route_rope  # noqa: E402
from fp4video.kernels import rope  # noqa: E402

from conftest import rand  # noqa: E402


def tiny_wan():
    """A tiny Wan transformer, its inputs and its stock output (CPU)."""
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=11)
    g = torch.Generator().manual_seed(12)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g))
    with torch.no_grad():
        stock = model(**inputs, return_dict=False)[0]
    return model, inputs, stock


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_set_attention_backend_after_install_keeps_wans_rope():
    """Pointing the routed processors at another backend after install bypasses fp4video's dispatch,
    so whatever the output, the processors' RoPE must still be applied: the stock output."""
    model, inputs, stock = tiny_wan()
    install(model, Policy(method="fp16"))
    try:
        assert torch.equal(forward(model, inputs), stock)
        model.set_attention_backend("native")
        out = forward(model, inputs)
    finally:
        uninstall(model)
    assert torch.equal(out, stock), f"RoPE dropped: max |diff| {(out - stock).abs().max().item():.3g}"


def test_a_processor_moved_onto_a_deferred_site_after_install_keeps_its_rope(monkeypatch):
    """A routed subclass of Wan's processor that uses the tables otherwise (here: the inverse
    rotation), moved after install onto a site that held Wan's own processor at install, gets its
    tables: the output equals the same install without any deferral."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class Inverse(WanAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            if rotary_emb is not None:
                rotary_emb = (rotary_emb[0], -rotary_emb[1])
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    def swapped_output(defer: bool):
        model, inputs, _ = tiny_wan()
        inverse = Inverse()
        model.blocks[0].attn1.set_processor(inverse)
        if not defer:
            monkeypatch.setattr(routing, "defers", lambda processor, module: False)
        install(model, Policy(method="fp16"))
        try:
            model.blocks[1].attn1.processor = inverse  # routed (block 0's), moved onto a deferred site
            return forward(model, inputs)
        finally:
            uninstall(model)
            monkeypatch.undo()

    deferred, undeferred = swapped_output(True), swapped_output(False)
    assert torch.equal(deferred, undeferred), f"max |diff| {(deferred - undeferred).abs().max().item():.3g}"


def test_the_kernel_keeps_autograd_or_refuses_operands_that_need_it():
    """Operands that need a gradient: either refused (the stock operations keep the graph) or
    rotated with the graph kept; never an output cut off from q, k (silently zero gradients for the
    q/k projections under the fp16 policy on a GPU)."""
    q = rand(1, 6, 2, 8, seed=1).requires_grad_()
    k = rand(1, 6, 2, 8, seed=2).requires_grad_()
    angle = rand(6, 4, seed=3, dtype=torch.float64)
    cos = angle.cos().repeat_interleave(2, -1).float().view(1, 6, 1, 8)
    sin = angle.sin().repeat_interleave(2, -1).float().view(1, 6, 1, 8)
    if rope.rope_pairs_supported(q, k, cos, sin):
        qo, ko = rope.rope_pairs(q, k, cos, sin)
        assert qo.requires_grad and ko.requires_grad, "the kernel's outputs are cut off from q and k's graph"


def test_bf16_subnormal_operands_keep_the_stock_bits():
    """bf16 queries and keys at and below bf16's smallest normal (products in fp32's subnormal range,
    inputs and results bf16 subnormals): the stock's bits, as the module's docstring claims."""
    b, s, h, d = 1, 4, 2, 8
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the compiled kernel on a GPU, the interpreter here
    tiny = torch.finfo(torch.bfloat16).tiny
    q = (rand(b, s, h, d, seed=4) * tiny).to(dev, torch.bfloat16)
    k = (rand(b, s, h, d, seed=5) * tiny * 0.01).to(dev, torch.bfloat16)
    angle = rand(s, d // 2, seed=6, dtype=torch.float64) * 7
    cos = angle.cos().repeat_interleave(2, -1).float().view(1, s, 1, d).to(dev)
    sin = angle.sin().repeat_interleave(2, -1).float().view(1, s, 1, d).to(dev)
    qo, ko = rope.rope_pairs(q, k, cos, sin)
    for x, out in ((q, qo), (k, ko)):
        stock = route_rope.stock_wan_rope(x, cos, sin)
        assert torch.equal(out.view(torch.int16), stock.view(torch.int16)), \
            f"{int((out.view(torch.int16) != stock.view(torch.int16)).sum())} of {out.numel()} values differ"
