"""External attention backends in policies: diffusers' backends and the peers it lacks named by
rules, refused at install with the reason when they cannot run, calls they cannot take following
the policy's fallback or raising, every call recorded with what ran; the fp16 tier on the fastest
exact backend; diffusers' backend signature adapted in one place."""

from __future__ import annotations

import ast
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from fp4video.integration import Policy, install, uninstall  # noqa: E402
from fp4video.integration.backends import PEERS, BackendUnavailable, backend_names, resolve  # noqa: E402
from fp4video.integration.tiny import TINY_LTX_CALL, tiny_ltx_pipeline, tiny_wan_pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_wan(pipe, steps=2):
    return pipe(prompt="a cat", negative_prompt="", height=48, width=64, num_frames=5, num_inference_steps=steps,
                max_sequence_length=16, guidance_scale=4.0, output_type="np", generator=torch.Generator().manual_seed(0)).frames[0]


def run_ltx(pipe, steps=2):
    return pipe(prompt="a cat", height=32, width=32, num_frames=9, num_inference_steps=steps, output_type="np",
                generator=torch.Generator().manual_seed(0), **TINY_LTX_CALL).frames[0]


@pytest.fixture(scope="module")
def wan():
    return tiny_wan_pipeline(two_experts=True)


def test_rules_name_diffusers_backends_and_calls_record_what_ran(wan):
    stock = run_wan(wan)
    policy = Policy.model_validate({"method": "fp16", "rules": [{"backend": "_native_math", "kinds": ["self"]}]})
    ctx = install(wan, policy)
    try:
        out = run_wan(wan)
    finally:
        uninstall(wan)
    ran = Counter((c["kind"], c["method"]) for c in ctx.calls)
    assert ran == {("self", "backend:_native_math"): 2 * 2 * 2, ("cross", "fp16"): 2 * 2 * 2}  # steps × CFG × blocks
    assert abs(out - stock).max() <= 1e-5  # PyTorch's math SDPA is exact attention too


def test_names_cannot_be_confused():
    with pytest.raises(ValueError, match="external attention backend: name it as `backend: sage`"):
        Policy.model_validate({"rules": [{"method": "sage"}]})
    with pytest.raises(ValueError, match="one of fp4video's methods: name it as `method: mxattn`"):
        Policy.model_validate({"rules": [{"backend": "mxattn"}]})
    with pytest.raises(ValueError, match="fp4video's own method 'mxattn'"):
        Policy.model_validate({"rules": [{"backend": "fp4video_mxattn"}]})
    with pytest.raises(ValueError, match="exactly one of method"):
        Policy.model_validate({"rules": [{"method": "fp16", "backend": "native"}]})
    with pytest.raises(ValueError, match="quantizes"):
        Policy.model_validate({"fp16_backend": "sage"})
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = backend_names()
    assert {m.value for m in AttentionBackendName if not m.value.startswith("fp4video_")} <= set(names)
    assert set(PEERS) <= set(names) and not set(PEERS) & {m.value for m in AttentionBackendName}


@pytest.mark.parametrize("name, why", [
    ("flash", "not installed"),
    ("sage", "not installed"),
    ("fa3_fp8", r"not installed: import flash_attn_interface: No module"),
    ("sage3_blackwell", r"not installed \(No module named 'sageattn3'|not installed"),
    ("flashinfer_nvfp4_sm120", "not installed"),
    ("_native_cudnn", "takes bf16 or float16|bfloat16 or float16"),  # the tiny model runs in float32
])
def test_a_backend_that_cannot_run_is_refused_at_install_with_the_reason(wan, name, why):
    policy = Policy.model_validate({"method": "fp16", "rules": [{"backend": name, "blocks": [0]}]})
    with pytest.raises(BackendUnavailable, match=why):
        install(wan, policy)
    assert not hasattr(wan.transformer, "_fp4video_saved") and not hasattr(wan.transformer_2, "_fp4video_saved")


def test_a_peer_is_imported_only_when_installed_and_refused_off_its_gpu(monkeypatch):
    calls = []
    fake = types.ModuleType("flash_attn_interface")
    fake.flash_attn_func = lambda *a, **k: calls.append(1)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake)
    with pytest.raises(BackendUnavailable, match="runs on CUDA GPUs only"):
        resolve("fa3_fp8", device="cpu", dtype=torch.bfloat16)
    assert not calls  # refused before any call


def test_a_backend_that_runs_but_is_not_attention_is_refused():
    from fp4video.integration.dispatcher import register_backend

    def not_attention(query, key, value, scale=None):
        return torch.zeros_like(query)

    register_backend("test_zeros", not_attention)
    with pytest.raises(BackendUnavailable, match="not attention's"):
        resolve("test_zeros", device="cpu", dtype=torch.float32)


def test_a_call_asking_for_the_lse_is_refused_where_the_backend_returns_none():
    """Ring attention asks every backend for the log-sum-exp; a backend whose signature has no
    return_lse says so; diffusers' native backend takes the argument and refuses it inside with a
    ValueError, which the routing treats as a refusal (the policy's fallback, or the error)."""
    from fp4video.integration.dispatcher import AttentionCall

    _register_maskless()
    q = torch.randn(1, 8, 2, 16)
    assert resolve("test_maskless", device="cpu", dtype=torch.float32).why_not(
        AttentionCall(q, q, q, return_lse=True)) == "returns no LSE (ring attention needs it)"
    native = resolve("native", device="cpu", dtype=torch.float32)
    call = AttentionCall(q, q, q, return_lse=True)
    assert native.why_not(call) is None
    with pytest.raises(ValueError, match="return_lse"):
        native.run(call)


def _register_maskless():
    """A diffusers backend whose signature has no mask: exact attention of unmasked calls."""
    from fp4video.integration.dispatcher import register_backend

    def maskless(query, key, value, scale=None):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)

    register_backend("test_maskless", maskless)


def test_calls_a_backend_cannot_take_follow_the_fallback_or_raise():
    """LTX-Video's cross-attention carries the text padding mask; its self-attention none."""
    _register_maskless()
    pipe = tiny_ltx_pipeline()
    stock = run_ltx(pipe)
    strict = Policy.model_validate({"method": "fp16", "rules": [{"backend": "test_maskless"}]})
    install(pipe, strict)
    try:
        with pytest.raises(ValueError, match=r"attn2 \(cross attention\): backend:test_maskless takes no attention mask"):
            run_ltx(pipe)
    finally:
        uninstall(pipe)
    policy = strict.model_copy(update={"fallback": Policy.model_validate(
        {"fallback": {"backend": "_native_math"}}).fallback})
    ctx = install(pipe, policy)
    try:
        out = run_ltx(pipe)
    finally:
        uninstall(pipe)
    by_kind = {(c["kind"], c["method"], c.get("planned")) for c in ctx.calls}
    assert by_kind == {("self", "backend:test_maskless", None),
                       ("cross", "backend:_native_math", "backend:test_maskless")}
    assert sum(ctx.fallbacks.values()) == sum(c["kind"] == "cross" for c in ctx.calls) > 0
    assert abs(out - stock).max() <= 1e-5

    # a backend that takes the mask argument and refuses it inside (as flash-attn 3 does): fallback stock
    from fp4video.integration.dispatcher import register_backend

    def raises_on_mask(query, key, value, attn_mask=None, scale=None):
        if attn_mask is not None:
            raise ValueError("`attn_mask` is not supported")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)

    register_backend("test_raises_on_mask", raises_on_mask)
    ctx = install(pipe, Policy.model_validate({"method": "fp16", "fallback": "stock",
                                               "rules": [{"backend": "test_raises_on_mask"}]}))
    try:
        out = run_ltx(pipe)
    finally:
        uninstall(pipe)
    assert {(c["kind"], c["method"], c.get("planned")) for c in ctx.calls} == {
        ("self", "backend:test_raises_on_mask", None), ("cross", "stock-fallback", "backend:test_raises_on_mask")}
    assert any("`attn_mask` is not supported" in why for why in ctx.fallbacks)
    assert abs(out - stock).max() <= 1e-5


def test_fp16_tier_on_the_fastest_exact_backend(wan):
    stock = run_wan(wan)
    ctx = install(wan, Policy(method="fp16", fp16_backend="fastest"))
    try:
        out = run_wan(wan)
    finally:
        uninstall(wan)
    # on a CPU float32 model every faster exact backend is refused (CUDA, bf16): native remains
    assert {(c["method"], c["exact_backend"]) for c in ctx.calls} == {("fp16", "native")}
    assert abs(out - stock).max() <= 1e-5


def test_the_backend_signature_is_adapted_in_one_place():
    """Only dispatcher.py defines a function with diffusers' backend signature (``attn_mask`` ...
    ``_parallel_config``; the context-parallel ``forward_op`` is another interface: ``_save_ctx``)."""
    defining = []
    for path in sorted((ROOT / "fp4video" / "integration").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Lambda)):
                names = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if {"attn_mask", "_parallel_config"} <= names and "_save_ctx" not in names:
                    defining.append(f"{path.name}:{getattr(node, 'name', 'lambda')}")
    assert defining == ["dispatcher.py:backend"]



def test_backends_are_probed_in_the_dtype_of_most_of_the_weights(tmp_path):
    """diffusers keeps a few small modules of a bf16 model in float32 (Wan's scale_shift_table comes
    first): the backends are probed, and calibration runs, in bf16, the attention's dtype."""
    from fp4video.integration.dispatcher import register_backend
    from fp4video.integration.install import model_place
    from fp4video.integration.tiny import tiny_wan_transformer

    tiny_wan_transformer(0).save_pretrained(tmp_path)
    model = type(tiny_wan_transformer(0)).from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32  # what the first parameter says
    assert model_place(model) == (torch.device("cpu"), torch.bfloat16)
    seen = []

    def sdpa_recording(query, key, value, scale=None):
        seen.append(query.dtype)
        return torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scale=scale).transpose(1, 2)

    register_backend("test_dtype_probe", sdpa_recording)
    install(model, Policy.model_validate({"method": "fp16", "rules": [{"backend": "test_dtype_probe"}]}))
    uninstall(model)
    assert seen and set(seen) == {torch.bfloat16}
