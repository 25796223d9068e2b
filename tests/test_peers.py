"""The peers `bench kernel` times beside fp4video (FlashAttention-3, SageAttention2): found when
importable, named with the reason when not, called with the conventions of their APIs. CPU stand-ins
here; the real ones run in the GPU benchmark."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fp4video.eval.peers import E4M3_MAX, FA3_MODULES, find_peers, fp8_per_tensor
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
