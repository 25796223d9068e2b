"""The kernels as the ``fp4video::attention`` custom op: opcheck, torch.compile (fullgraph) and CUDA
graphs see one opaque op that returns the kernel's values."""

from __future__ import annotations

import pytest
import torch

from fp4video import METHODS, fp4_attention

pytest.importorskip("triton")
from conftest import rand  # noqa: E402


@pytest.mark.parametrize("method", ["mxattn", "sage3", "fp16"])
def test_custom_op_passes_opcheck(method, device):
    """Schema, fake (meta) implementation and AOT dispatch of ``torch.ops.fp4video.attention``
    agree with the real kernel (torch.library.opcheck runs both and compares)."""
    from fp4video.kernels.dispatch import attention as attention_op

    dev = device
    q = rand(1, 40, 2, 64, seed=40, device=dev).transpose(1, 2)  # a bshd view, as diffusers passes
    k, v = rand(1, 2, 96, 64, seed=41, device=dev), rand(1, 2, 96, 32, seed=42, device=dev)
    alive = rand(1, 96, seed=43, device=dev) > -0.5
    for key_alive in (alive, None):
        torch.library.opcheck(attention_op, (q, k, v, key_alive, METHODS[method].to_spec(), 0.125))


def test_compiled_fullgraph_equals_eager():
    """fp4_attention(backend="triton") inside torch.compile(fullgraph=True): no graph break, and the
    compiled call returns the kernel's values (the fake implementation only describes shapes)."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test compiles with inductor and CUDA graphs")
    q, k, v = (rand(1, 2, 64, 64, seed=s) for s in (44, 45, 46))
    mask = rand(1, 1, 1, 64, seed=47) > -0.5

    def f(q, k, v, mask):
        return fp4_attention(q, k, v, method="mxattn", attn_mask=mask, backend="triton") * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, mask), f(q, k, v, mask))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_and_cuda_graphs_gpu(mode):
    """Inductor, fullgraph, and with mode="reduce-overhead" CUDA graphs: equal to eager."""
    q, k, v = (rand(1, 8, 1000, 128, seed=s, device="cuda", dtype=torch.bfloat16) for s in (48, 49, 50))
    mask = rand(1, 1, 1, 1000, seed=51, device="cuda") > -1.0

    def f(q, k, v, mask):
        return fp4_attention(q, k, v, method="mxattn", attn_mask=mask) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode=mode)
    want = f(q, k, v, mask)
    for _ in range(3):  # CUDA graphs record on a later call and replay after
        got = compiled(q, k, v, mask)
    assert torch.equal(got, want)


def test_a_one_method_diffusers_backend_compiles_fullgraph(monkeypatch):
    """``fp4video_<method>`` through diffusers' dispatcher inside torch.compile(fullgraph=True): the
    one-method backend stays traceable (its kernel is one custom op), while the policy backend of
    ``install`` is opaque by design (its kernel depends on the block, step and call)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU check of the traced path (the GPU suite compiles with inductor)")
    import functools

    import diffusers.models.attention_dispatch as dispatch

    import fp4video.attention as attention_mod
    from fp4video.integration.dispatcher import register_attention_backends

    # the Triton custom op, as a GPU call takes it (TRITON_INTERPRET=1 on the CPU)
    monkeypatch.setattr(attention_mod, "fp4_attention", functools.partial(attention_mod.fp4_attention,
                                                                         backend="triton"))
    register_attention_backends(["mxattn"])
    name = dispatch.AttentionBackendName("fp4video_mxattn")
    q, k, v = (rand(1, 64, 2, 64, seed=s) for s in (52, 53, 54))

    def f(q, k, v):
        return dispatch.dispatch_attention_fn(q, k, v, backend=name) * 2

    want = f(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(q, k, v), want)
