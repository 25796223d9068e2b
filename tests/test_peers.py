"""The peers `bench kernel` times beside fp4video (FlashAttention-3, SageAttention2): found when
importable, named with the reason when not, called with the conventions of their APIs; standing in
for SDPA in a whole diffusers forward (`bench pipeline --peers`). CPU stand-ins here; the real ones
run in the GPU benchmark."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fp4video.eval.peers import E4M3_MAX, FA3_MODULES, Peer, find_peers, fp8_per_tensor, sdpa_replaced_by
from fp4video.metrics import cossim

SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.fixture
def nothing_installed(monkeypatch):
    for name in (*FA3_MODULES, "sageattention"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def _fake_fa3(calls):
    def flash_attn_func(q, k, v, q_descale=None, k_descale=None, v_descale=None):
        calls.append({"dtype": q.dtype, "shape": tuple(q.shape), "descale": None if q_descale is None else
                      tuple(q_descale.shape)})
        if q.dtype == torch.float8_e4m3fn:  # (B, S, H, D) with (B, H) descales
            q, k, v = (t.float() * d[:, None, :, None] for t, d in ((q, q_descale), (k, k_descale), (v, v_descale)))
        out = SDPA(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float())
        return out.transpose(1, 2).to(torch.bfloat16), None  # (out, lse) as FlashAttention-3 returns

    return types.SimpleNamespace(flash_attn_func=flash_attn_func)


def test_missing_peers_are_named_with_the_reason(nothing_installed):
    peers = find_peers()
    assert [p.name for p in peers] == ["FlashAttention-3 bf16", "FlashAttention-3 FP8 (cast included)",
                                       "FlashAttention-3 FP8 (kernel only)", "SageAttention2 sageattn (INT8 QK, FP8 PV)"]
    assert all(p.fn is None for p in peers)
    assert [p.whole_call for p in peers] == [True, True, False, True]
    assert all(p.missing.startswith("not installed (import ") for p in peers)
    assert "flash_attn_interface" in peers[0].missing and "fa3_fwd_interface" in peers[0].missing


def test_flash_attention_3_bf16_and_fp8_through_its_api(nothing_installed, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", _fake_fa3(calls))  # the fa3-fwd wheel's name
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    before = [t.clone() for t in (q, k, v)]
    bf16, fp8, fp8_kernel, sage = find_peers()
    want = SDPA(q.float(), k.float(), v.float())
    out = bf16.fn(*bf16.args(q, k, v))
    assert out.shape == q.shape and calls[-1] == {"dtype": torch.bfloat16, "shape": (2, 40, 3, 16), "descale": None}
    assert cossim(out.float(), want) > 0.9999
    out8 = fp8.fn(*fp8.args(q, k, v))
    assert calls[-1] == {"dtype": torch.float8_e4m3fn, "shape": (2, 40, 3, 16), "descale": (2, 3)}
    assert 0.99 < cossim(out8.float(), want) < 0.99999  # quantized, and not silently the bf16 path
    args = fp8_kernel.args(q, k, v)  # the cast done before the timed kernel
    assert torch.equal(fp8_kernel.fn(*args), out8)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before))  # callers' tensors untouched
    assert sage.fn is None
    masked = find_peers(key_mask=True)
    assert all(p.fn is None for p in masked) and masked[0].missing == "takes no key-padding mask"
    assert masked[3].missing.startswith("not installed")  # the first reason stays


def test_sageattention_called_in_head_major_layout(nothing_installed, monkeypatch):
    seen = []

    def sageattn(q, k, v, tensor_layout="HND"):
        seen.append(tensor_layout)
        return SDPA(q, k, v)

    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    sage = find_peers()[3]
    q = torch.randn(1, 2, 8, 16)
    assert torch.equal(sage.fn(*sage.args(q, q, q)), SDPA(q, q, q)) and seen == ["HND"]


def test_fp8_per_tensor_scale_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 16, generator=g) * torch.tensor([1.0, 1e-3, 1e3])[None, :, None, None]
    x[1, 2] = 0  # an all-zero head: scale 1, no NaN
    x8, scale = fp8_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = x8.float() * scale[:, :, None, None]
    assert torch.isfinite(back).all() and torch.equal(back[1, 2], x[1, 2])
    amax = x.abs().amax(dim=(2, 3))
    assert torch.allclose(x8.float().abs().amax(dim=(2, 3))[amax > 0], torch.tensor(E4M3_MAX))
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normal values
    normal = x.abs() > 2 ** -6 * scale[:, :, None, None]
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-12)[normal].all()


def _counting_peer(calls):
    """A stand-in peer: exact attention in fp32 (by the SDPA saved at import), its inputs recorded."""
    def fn(q, k, v):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return SDPA(q.float(), k.float(), v.float()).to(q.dtype)

    return Peer("stand-in", "bf16", fn)


def test_sdpa_replaced_by_a_peer_takes_what_it_can_and_leaves_the_rest():
    calls = []
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    kv = torch.randn(1, 2, 7, 16, generator=g)
    mask = torch.ones(1, 1, 24, 24, dtype=torch.bool)
    mask[..., -3:] = False
    F = torch.nn.functional
    with sdpa_replaced_by(_counting_peer(calls), dtypes=(torch.float32,), devices=("cpu",)) as route:
        assert F.scaled_dot_product_attention is not SDPA
        out = F.scaled_dot_product_attention(q, k, v)
        cross = F.scaled_dot_product_attention(q, kv, kv)  # other key length: the peer's too
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scaled = F.scaled_dot_product_attention(q, k, v, scale=0.5)
        same_scale = F.scaled_dot_product_attention(q, k, v, scale=16 ** -0.5)
        half = F.scaled_dot_product_attention(q.half(), k.half(), v.half())  # not in `dtypes`
        F.scaled_dot_product_attention(q, k, v[..., :8])  # another value head dim
        F.scaled_dot_product_attention(q[0], k[0], v[0])  # 3-d
    assert F.scaled_dot_product_attention is SDPA  # restored
    assert route.routed == 3 and calls == [((1, 2, 24, 16), (1, 2, 24, 16)), ((1, 2, 24, 16), (1, 2, 7, 16)),
                                           ((1, 2, 24, 16), (1, 2, 24, 16))]
    assert dict(route.left) == {"with a mask": 1, "causal": 1, "another scale": 1, "in torch.float16": 1,
                                "other shapes": 2}
    assert route.reasons() == "2 other shapes, 1 with a mask, 1 causal, 1 another scale, 1 in torch.float16"
    assert route.summary() == ("stand-in: 3 of 9 attention calls; the rest on SDPA (2 other shapes, 1 with a mask, "
                               "1 causal, 1 another scale, 1 in torch.float16)")
    for got, want in ((out, SDPA(q, k, v)), (cross, SDPA(q, kv, kv)), (masked, SDPA(q, k, v, attn_mask=mask)),
                      (causal, SDPA(q, k, v, is_causal=True)), (scaled, SDPA(q, k, v, scale=0.5)),
                      (same_scale, SDPA(q, k, v))):
        assert torch.allclose(got, want, atol=1e-6)
    assert half.dtype == torch.float16


def test_sdpa_is_restored_after_an_error_and_unrunnable_peers_are_refused():
    def broken(q, k, v):
        raise RuntimeError("this build cannot run these shapes")

    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="cannot run"):
        with sdpa_replaced_by(Peer("broken", "bf16", broken), dtypes=(torch.float32,), devices=("cpu",)):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.nn.functional.scaled_dot_product_attention is SDPA
    with pytest.raises(ValueError, match="not installed"):
        with sdpa_replaced_by(Peer("absent", "bf16", None, "not installed (import x)")):
            pass
    with pytest.raises(ValueError, match="prepared inputs"):
        with sdpa_replaced_by(Peer("kernel only", "fp8", lambda a: a, prepare=lambda q, k, v: q, whole_call=False)):
            pass
    # on the defaults (bf16 / fp16 on a GPU) a CPU fp32 call stays on SDPA
    with sdpa_replaced_by(Peer("gpu only", "bf16", broken)) as route:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert route.routed == 0 and dict(route.left) == {"in torch.float32": 1}


def test_a_peer_in_place_of_sdpa_inside_a_compiled_block_counts_calls_and_compiles_once():
    """A compiled function calling SDPA runs the peer at every call (not only while dynamo traces
    it) and keeps one graph: the route's counters are not guarded on, call after call."""
    import torch._dynamo
    import torch._dynamo.testing

    calls = []
    counter = torch._dynamo.testing.CompileCounter()

    def block(x, w):
        y = x @ w
        return torch.nn.functional.scaled_dot_product_attention(y, y, y) + 1

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counter)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 2, 12, 8, generator=g), torch.randn(8, 8, generator=g)
    with sdpa_replaced_by(_counting_peer(calls), dtypes=(torch.float32,), devices=("cpu",)) as route:
        outs = [compiled(x, w) for _ in range(4)]
    torch._dynamo.reset()
    assert route.routed == 4 and len(calls) == 4
    assert counter.frame_count <= 2  # the graph before the peer and the one after it, compiled once
    want = SDPA(x @ w, x @ w, x @ w) + 1
    for out in outs:
        assert torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("model", ["wan22", "hunyuan"])
def test_bench_pipeline_runs_a_peer_in_place_of_sdpa(model, monkeypatch, nothing_installed):
    """`bench pipeline --tiny --peers` on the CPU: a stand-in peer takes the tiny Wan transformer's
    attention calls; HunyuanVideo's all carry a mask, so it gets no row, only a note saying so; the
    missing peers are named under the table."""
    import argparse

    import fp4video.eval.peers as peers_mod
    from fp4video.cli.bench import bench_pipeline

    calls = []
    real = peers_mod.find_peers
    monkeypatch.setattr(peers_mod, "find_peers", lambda **kw: [_counting_peer(calls), *real(**kw)])
    args = argparse.Namespace(model=model, layers=None, resolutions=["480p"], methods=[], configs=[], reps=1,
                              peers=True, tiny=True)
    table = bench_pipeline(args)
    assert "| stock diffusers attention (SDPA) |" in table
    assert "FlashAttention-3 bf16: not timed, not installed" in table
    assert "SageAttention2 sageattn (INT8 QK, FP8 PV): not timed, not installed" in table
    assert "kernel only" not in table  # a kernel-only timing is not a forward's attention
    note = next(line for line in table.splitlines() if line.startswith("- 480p stand-in:"))
    if model == "hunyuan":  # every call of its joint attention carries the text padding mask
        assert not calls and "| stand-in in place of SDPA |" not in table
        assert note.startswith("- 480p stand-in: not timed, it can take none of the forward's attention calls (")
        assert note.endswith(" with a mask) per forward")
    else:
        assert calls and "| stand-in in place of SDPA |" in table
        assert note == "- 480p stand-in: 4 of 4 attention calls per forward"
