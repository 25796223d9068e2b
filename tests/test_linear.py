"""Low-precision linear layers through torchao (fp4video.integration.linear): the policy (strict,
first matching rule wins, steps and rules that can never match refused), the kinds of linear layer
read from the structure of diffusers' Wan and HunyuanVideo transformers, install / uninstall
(original weights back bit for bit, a second install refused, a failure half-way undone), the one
place that refuses a method a device cannot run, and torchao's emulated MXFP8 against an
independent MXFP8 reference (fp4video.formats' E4M3 rounding)."""

from __future__ import annotations

import copy
import importlib.util
import re
import types
import warnings

import pytest
import torch
from pydantic import ValidationError

from fp4video.formats import round_e4m3
from fp4video.integration import linear as L
from fp4video.integration.policy import EXPERTS, format_validation_error

pytest.importorskip("diffusers")
from fp4video.integration.tiny import tiny_hunyuan_transformer, tiny_wan_pipeline, tiny_wan_transformer  # noqa: E402



def _torchao_in_range() -> bool:
    """Whether a torchao within fp4video.integration.linear.TORCHAO_REQUIREMENT is installed."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        return version("torchao").split("+")[0] in SpecifierSet(L.TORCHAO_REQUIREMENT)
    except PackageNotFoundError:
        return False


HAS_TORCHAO = _torchao_in_range()
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason=f"torchao{L.TORCHAO_REQUIREMENT} (the linear extra) is "
                                                           "not installed")

# The kinds of every linear layer of the tiny transformers, written out from diffusers' module trees
# (Wan: attn1 self attention, attn2 cross attention, ffn; HunyuanVideo: the dual block's joint
# attention with its context projections, the adaptive norms' modulation, the single block's MLP).
WAN_KINDS = {
    "condition_embedder.time_embedder.linear_1": "embedder", "condition_embedder.time_embedder.linear_2": "embedder",
    "condition_embedder.time_proj": "embedder", "condition_embedder.text_embedder.linear_1": "embedder",
    "condition_embedder.text_embedder.linear_2": "embedder", "proj_out": "head",
    **{f"blocks.{b}.{n}": k for b in (0, 1) for n, k in [
        ("attn1.to_q", "attention"), ("attn1.to_k", "attention"), ("attn1.to_v", "attention"),
        ("attn1.to_out.0", "attention"), ("attn2.to_q", "cross_attention"), ("attn2.to_k", "cross_attention"),
        ("attn2.to_v", "cross_attention"), ("attn2.to_out.0", "cross_attention"), ("ffn.net.0.proj", "ffn"),
        ("ffn.net.2", "ffn")]},
}
HUNYUAN_KINDS = {
    **{f"context_embedder.{n}": "embedder" for n in [
        "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
        "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "proj_in",
        "token_refiner.refiner_blocks.0.attn.to_q", "token_refiner.refiner_blocks.0.attn.to_k",
        "token_refiner.refiner_blocks.0.attn.to_v", "token_refiner.refiner_blocks.0.attn.to_out.0",
        "token_refiner.refiner_blocks.0.ff.net.0.proj", "token_refiner.refiner_blocks.0.ff.net.2",
        "token_refiner.refiner_blocks.0.norm_out.linear"]},
    **{f"time_text_embed.{n}": "embedder" for n in [
        "timestep_embedder.linear_1", "timestep_embedder.linear_2", "text_embedder.linear_1", "text_embedder.linear_2",
        "guidance_embedder.linear_1", "guidance_embedder.linear_2"]},
    **{f"transformer_blocks.0.{n}": k for n, k in [
        ("norm1.linear", "modulation"), ("norm1_context.linear", "modulation"), ("attn.to_q", "attention"),
        ("attn.to_k", "attention"), ("attn.to_v", "attention"), ("attn.add_k_proj", "attention"),
        ("attn.add_v_proj", "attention"), ("attn.add_q_proj", "attention"), ("attn.to_out.0", "attention"),
        ("attn.to_add_out", "attention"), ("ff.net.0.proj", "ffn"), ("ff.net.2", "ffn"),
        ("ff_context.net.0.proj", "ffn"), ("ff_context.net.2", "ffn")]},
    **{f"single_transformer_blocks.0.{n}": k for n, k in [
        ("attn.to_q", "attention"), ("attn.to_k", "attention"), ("attn.to_v", "attention"),
        ("norm.linear", "modulation"), ("proj_mlp", "ffn"), ("proj_out", "ffn")]},
    "norm_out.linear": "head", "proj_out": "head",
}


class _AttentionStandIn(torch.nn.Module):
    """Counts as an attention module for fp4video's block finder (a processor and set_processor)."""
    processor = None

    def set_processor(self, processor):
        self.processor = processor


def one_block_holding(layer: torch.nn.Linear) -> torch.nn.Module:
    """A transformer of one block whose feed-forward is ``layer`` (fp4video finds linear layers
    through a model's blocks)."""
    block = torch.nn.Module()
    block.attn = _AttentionStandIn()
    block.ff = layer
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    return model


def wan_bf16(seed=0):
    return tiny_wan_transformer(seed).to(torch.bfloat16)


def wan_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g).bfloat16(),
                encoder_hidden_states=torch.randn(1, 24, 32, generator=g).bfloat16(),
                timestep=torch.tensor([500.0]), return_dict=False)


def forward(model):
    with torch.no_grad():
        return model(**wan_inputs())[0]


def snapshot(model):
    """(every parameter and buffer, cloned with its dtype and device; the module's repr)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, repr(model)


def assert_bit_for_bit(model, snap):
    tensors, text = snap
    now = model.state_dict()
    assert set(now) == set(tensors)
    for k, v in tensors.items():
        assert type(now[k]) in (torch.Tensor, torch.nn.Parameter), (k, type(now[k]))
        assert now[k].dtype == v.dtype and now[k].device == v.device and torch.equal(now[k], v), k
    assert repr(model) == text


def rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


# --- the policy ---------------------------------------------------------------------------------------


def test_policy_fields_are_strict_and_unknown_fields_refused():
    assert L.LinearPolicy().method == "bf16"
    for bad in ({"method": "fp8"}, {"method": "fp8-rowwise", "compile": "yes"}, {"compile": 1},
                {"rules": [{"method": "bf16", "kinds": ["mlp"]}]}, {"rules": [{"method": "bf16", "blocks": ["3"]}]},
                {"rules": [{"method": "bf16", "blocks": [True]}]}, {"rules": [{"method": "bf16", "experts": ["high"]}]},
                {"method": "bf16", "sparsity": {}}, {"rules": [{"kinds": ["ffn"]}]}, {"originals": "disk"}):
        with pytest.raises(ValidationError):
            L.LinearPolicy.model_validate(bad)
    with pytest.raises(ValidationError) as err:
        L.LinearPolicy.model_validate({"rules": [{"method": "bf16", "backend": "flash"}]})
    assert "rules[0].backend: unknown field" in format_validation_error(err.value)
    policy = L.LinearPolicy(method="fp8-rowwise")
    with pytest.raises(ValidationError):
        policy.method = "bf16"  # frozen


def test_steps_are_refused_with_the_reason():
    for bad in ({"rules": [{"method": "bf16", "steps": {"last": 2}}]}, {"method": "fp8-rowwise", "steps": {"first": 1}}):
        with pytest.raises(ValidationError) as err:
            L.LinearPolicy.model_validate(bad)
        text = format_validation_error(err.value)
        assert "steps do not apply to linear layers" in text and "quantized once" in text
        assert len(text.splitlines()) == 1


@pytest.mark.parametrize("rules, expect", [
    ([{"method": "bf16", "kinds": []}], "kinds: [] lists none"),
    ([{"method": "bf16", "blocks": [-1]}], "count from 0"),
    ([{"method": "bf16", "kinds": ["embedder", "head"], "blocks": [0]}], "lie outside the transformer blocks"),
    ([{"method": "bf16", "kinds": ["ffn"]}, {"method": "mxfp8", "kinds": ["ffn"], "blocks": [3]}],
     "rules[1] {method: mxfp8, blocks: [3], kinds: ['ffn']} can never match: every layer it would take is taken "
     "first by rules[0]"),
    ([{"method": "bf16", "experts": ["high_noise", "low_noise"]}, {"method": "mxfp8", "experts": ["low_noise"]}],
     "can never match"),
])
def test_rules_that_could_never_match_are_refused(rules, expect):
    with pytest.raises(ValidationError) as err:
        L.LinearPolicy.model_validate({"method": "fp8-rowwise", "rules": rules})
    assert expect in format_validation_error(err.value)


def test_a_rule_outside_kinds_and_a_later_block_rule_both_stand():
    """Rules on different layers do not shadow each other (no false refusal)."""
    policy = L.LinearPolicy.model_validate({"method": "fp8-rowwise", "rules": [
        {"method": "bf16", "kinds": ["embedder", "head", "modulation"]}, {"method": "bf16", "blocks": [0]},
        {"method": "mxfp8", "kinds": ["ffn"]}, {"method": "fp8-tensor", "experts": ["low_noise"]}]})
    assert len(policy.rules) == 4


def test_the_first_matching_rule_wins():
    policy = L.LinearPolicy.model_validate({"method": "fp8-rowwise", "rules": [
        {"method": "bf16", "blocks": [0]}, {"method": "mxfp8", "kinds": ["ffn"]},
        {"method": "nvfp4", "kinds": ["ffn", "attention"], "experts": ["low_noise"]}]})
    assert policy.method_for(expert=None, block=0, kind="ffn") == "bf16"
    assert policy.method_for(expert="low_noise", block=3, kind="ffn") == "mxfp8"
    assert policy.method_for(expert="low_noise", block=3, kind="attention") == "nvfp4"
    assert policy.method_for(expert="high_noise", block=3, kind="attention") == "fp8-rowwise"
    assert policy.method_for(expert=None, block=-1, kind="embedder") == "fp8-rowwise"


def test_emulate_needs_a_method_torchao_emulates():
    assert L.LinearPolicy(method="mxfp8", emulate=True).emulate
    with pytest.raises(ValidationError, match="torchao's emulation of mxfp8"):
        L.LinearPolicy(method="fp8-rowwise", emulate=True)


def test_experts_are_the_attention_policys():
    assert L.EXPERTS == EXPERTS


def test_as_linear_policy():
    assert L.as_linear_policy(None) == L.LinearPolicy()
    assert L.as_linear_policy("mxfp8").method == "mxfp8"
    with pytest.raises(ValueError, match="unknown method 'fp4'"):
        L.as_linear_policy("fp4")
    with pytest.raises(TypeError, match="model_validate"):
        L.as_linear_policy({"method": "mxfp8"})


# --- the kinds, the plan ----------------------------------------------------------------------------


def test_kinds_of_the_tiny_wan_and_hunyuan_transformers():
    for model, expect, blocks in ((tiny_wan_transformer(), WAN_KINDS, {"blocks.0": 0, "blocks.1": 1}),
                                  (tiny_hunyuan_transformer(), HUNYUAN_KINDS,
                                   {"transformer_blocks.0": 0, "single_transformer_blocks.0": 1})):
        sites = L.linear_sites(model)
        assert {s.name: s.kind for s in sites} == expect
        every = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert {s.name for s in sites} == every  # nothing left out
        for s in sites:
            block = next((i for prefix, i in blocks.items() if s.name.startswith(prefix + ".")), -1)
            assert s.block == block and s.expert is None and s.module is model.get_submodule(s.name)


def test_plan_is_pure_and_names_the_experts_layers():
    pipe = tiny_wan_pipeline(two_experts=True)
    for t in (pipe.transformer, pipe.transformer_2):
        t.to(torch.bfloat16)
    snaps = [snapshot(pipe.transformer), snapshot(pipe.transformer_2)]
    policy = L.LinearPolicy.model_validate({"method": "bf16", "rules": [
        {"method": "mxfp8", "experts": ["low_noise"], "kinds": ["ffn"]}, {"method": "fp8-rowwise", "blocks": [1]}]})
    plan = L.plan_linear(pipe, policy)
    assert plan.quantized() == {
        **{f"transformer_2.blocks.{b}.{n}": "mxfp8" for b in (0, 1) for n in ("ffn.net.0.proj", "ffn.net.2")},
        **{f"{t}.blocks.1.{n}": "fp8-rowwise" for t in ("transformer", "transformer_2") for n in WAN_KINDS_BLOCK1
           if not (t == "transformer_2" and n.startswith("ffn"))}}
    assert len(plan) == 2 * len(WAN_KINDS) and not plan.kept
    assert_bit_for_bit(pipe.transformer, snaps[0])
    assert_bit_for_bit(pipe.transformer_2, snaps[1])


WAN_KINDS_BLOCK1 = [n.removeprefix("blocks.1.") for n in WAN_KINDS if n.startswith("blocks.1.")]


def test_layers_a_method_cannot_take_stay_and_are_listed():
    """An fp32 layer (Wan keeps its time embedder in fp32) and one whose shape the format does not
    take (HunyuanVideo's tiny text embedder: 8 input features) keep their precision, each listed."""
    wan = wan_bf16()
    wan.condition_embedder.time_embedder.float()
    plan = L.plan_linear(wan, "fp8-rowwise")
    assert set(plan.kept) == {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"}
    assert "float32" in plan.kept["condition_embedder.time_embedder.linear_1"]
    assert plan["condition_embedder.time_embedder.linear_1"] == "bf16"
    assert len(plan.quantized()) == len(WAN_KINDS) - 2
    hunyuan = tiny_hunyuan_transformer().to(torch.bfloat16)
    plan = L.plan_linear(hunyuan, "mxfp8")
    assert "context_embedder.time_text_embed.text_embedder.linear_1" in plan.kept
    assert "16 -> 128 features: mxfp8 needs in_features a multiple of 32" in plan.kept[
        "context_embedder.time_text_embed.text_embedder.linear_1"]
    assert "time_text_embed.text_embedder.linear_1" in plan.kept  # 8 input features


@pytest.mark.parametrize("target, rules, expect", [
    ("wan", [{"method": "mxfp8", "blocks": [1, 2]}], "names blocks WanTransformer3DModel does not have (it has 2, 0 to 1)"),
    ("wan", [{"method": "mxfp8", "kinds": ["modulation"]}],
     "kinds ['modulation']: WanTransformer3DModel has no such linear layers (its kinds: attention, cross_attention, "
     "ffn, embedder, head)"),
    ("wan", [{"method": "mxfp8", "experts": ["low_noise"]}], "on a bare WanTransformer3DModel, no layer has an expert"),
    ("hunyuan", [{"method": "mxfp8", "kinds": ["cross_attention"]}], "HunyuanVideoTransformer3DModel has no such"),
    ("wan21", [{"method": "mxfp8", "experts": ["high_noise"]}], "WanPipeline has one transformer, so no layer has an expert"),
])
def test_a_policy_that_does_not_fit_the_model_is_refused(target, rules, expect):
    model = {"wan": tiny_wan_transformer, "hunyuan": tiny_hunyuan_transformer,
             "wan21": lambda: tiny_wan_pipeline(two_experts=False)}[target]()
    with pytest.raises(ValueError) as err:
        L.plan_linear(model, L.LinearPolicy.model_validate({"method": "bf16", "rules": rules}))
    assert expect in str(err.value) and "\n" not in str(err.value)


# --- the device check ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method, expect", [
    ("fp8-rowwise", "linear method fp8-rowwise needs an NVIDIA GPU of compute capability 8.9 or newer"),
    ("fp8-tensor", "torchao has no emulation of it: use bf16 there"),
    ("nvfp4", "compute capability 10.0 or newer (Blackwell)"),
    ("mxfp8", "(emulate: true runs its numerics anywhere, slower than bf16)"),
])
def test_the_cpu_is_refused_in_one_line(method, expect):
    with pytest.raises(L.LinearUnsupported) as err:
        L.check_linear_support(method, "cpu")
    assert expect in str(err.value) and "the layers are on cpu" in str(err.value) and "\n" not in str(err.value)
    model = wan_bf16()
    snap = snapshot(model)
    with pytest.raises(L.LinearUnsupported):
        L.install_linear(model, method)
    assert_bit_for_bit(model, snap)
    assert L.installed_linear(model) is None


@needs_torchao
@pytest.mark.parametrize("gpu, capability", [("NVIDIA L40S", (8, 9)), ("NVIDIA H200", (9, 0)),
                                             ("NVIDIA B200", (10, 0)), ("NVIDIA RTX A6000", (8, 6))])
@pytest.mark.parametrize("mslk", [False, True])
def test_what_each_gpu_kind_runs(monkeypatch, gpu, capability, mslk):
    """The GPU-kind check on the CPU (the device's name and compute capability stand in): fp8 from
    sm_89, mxfp8 and nvfp4 from sm_100, each refusal naming the GPU; fp8-rowwise on sm_90+ says
    MSLK's kernels run it where MSLK is installed, torch ops elsewhere."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real("torch") if mslk else None) if name == "mslk" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    for method, need in (("fp8-rowwise", (8, 9)), ("fp8-tensor", (8, 9)), ("mxfp8", (10, 0)), ("nvfp4", (10, 0))):
        if capability < need:
            with pytest.raises(L.LinearUnsupported) as err:
                L.check_linear_support(method, "cuda")
            assert f"{gpu} is sm_{capability[0]}{capability[1]}" in str(err.value), str(err.value)
            continue
        runs = L.check_linear_support(method, "cuda")
        if method == "fp8-rowwise":
            assert ("MSLK" in runs) == (mslk and capability >= (9, 0)), runs
            assert ("torch ops" in runs) == (not (mslk and capability >= (9, 0))), runs
        if method.startswith("fp8"):  # the scales' granularity, named once
            assert runs.startswith(f"torchao float8 {'rowwise' if method == 'fp8-rowwise' else 'tensorwise'}:"), runs
        assert L.check_linear_support(method, "cuda", emulate=True).startswith(
            "torchao's emulated" if method == "mxfp8" else "torchao")


def test_bf16_needs_no_torchao_and_a_missing_torchao_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert L.check_linear_support("bf16", "cpu") == "unchanged (bf16)"
    model = wan_bf16()
    report = L.install_linear(model, L.LinearPolicy(method="bf16"))
    assert not report.plan.quantized()
    L.uninstall_linear(model)
    with pytest.raises(L.LinearUnsupported, match=r"torchao>=0.17,<0.19, which is not installed \(pip install "
                                                  r"'fp4video\[linear\]'\)"):
        L.check_linear_support("mxfp8", "cpu", emulate=True)


# --- install / uninstall -----------------------------------------------------------------------------


@needs_torchao
@pytest.mark.parametrize("originals", ["cpu", "device"])
def test_install_quantizes_and_uninstall_restores_bit_for_bit(originals):
    model = wan_bf16()
    stock, snap = forward(model), snapshot(model)
    params = {n: p for n, p in model.named_parameters()}
    report = L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True, originals=originals,
                                                    rules=[L.LinearRule(method="bf16", kinds=["embedder", "head"])]))
    assert report.plan.quantized() == {n: "mxfp8" for n, k in WAN_KINDS.items() if k not in ("embedder", "head")}
    assert L.installed_linear(model) is report
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    assert isinstance(model.blocks[0].ffn.net[2].weight, MXTensor)
    assert type(model.proj_out.weight) is torch.nn.Parameter  # a bf16 rule's layer is untouched
    quantized = forward(model)
    assert 1e-3 < rel(quantized, stock) < 0.1  # it runs the format, and the output is still the model's
    L.uninstall_linear(model)
    assert_bit_for_bit(model, snap)
    assert all(p is params[n] for n, p in model.named_parameters())  # a CPU model gets its own tensors back
    assert torch.equal(forward(model), stock)
    assert L.installed_linear(model) is None
    L.uninstall_linear(model)  # nothing installed: nothing to do


@needs_torchao
def test_a_second_install_is_refused_and_changes_nothing():
    model = wan_bf16()
    L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    first = forward(model)
    with pytest.raises(RuntimeError, match="already installed on WanTransformer3DModel .through the bare "
                                           "WanTransformer3DModel.: call .*uninstall_linear"):
        L.install_linear(model, L.LinearPolicy(method="bf16"))
    assert torch.equal(forward(model), first)
    L.uninstall_linear(model)


@needs_torchao
def test_a_pipeline_install_covers_both_experts_and_any_handle_uninstalls():
    pipe = tiny_wan_pipeline(two_experts=True)
    models = (pipe.transformer, pipe.transformer_2)
    for t in models:
        t.to(torch.bfloat16)
    snaps = [snapshot(t) for t in models]
    report = L.install_linear(pipe, L.LinearPolicy(method="bf16", emulate=True, rules=[
        L.LinearRule(method="mxfp8", experts=["low_noise"], kinds=["attention"])]))
    assert set(report.plan.quantized()) == {f"transformer_2.blocks.{b}.attn1.{n}" for b in (0, 1)
                                            for n in ("to_q", "to_k", "to_v", "to_out.0")}
    with pytest.raises(RuntimeError, match="through WanPipeline"):
        L.install_linear(pipe.transformer_2, "bf16")
    assert_bit_for_bit(pipe.transformer, snaps[0])  # the high-noise expert: no rule quantizes it
    L.uninstall_linear(pipe.transformer_2)
    assert_bit_for_bit(pipe.transformer_2, snaps[1])
    assert L.installed_linear(pipe.transformer) is report  # still installed there, through the pipeline
    L.uninstall_linear(pipe)
    assert L.installed_linear(pipe.transformer) is None


@needs_torchao
def test_a_failure_half_way_leaves_the_model_as_it_was(monkeypatch):
    import torchao.quantization

    model = wan_bf16()
    snap = snapshot(model)
    real, calls = torchao.quantization.quantize_, []

    def failing(module, config, *a, **k):
        calls.append(module)
        if len(calls) == 5:
            raise RuntimeError("a torchao failure")
        return real(module, config, *a, **k)

    monkeypatch.setattr(torchao.quantization, "quantize_", failing)
    with pytest.raises(RuntimeError, match="a torchao failure"):
        L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    assert len(calls) == 5
    assert_bit_for_bit(model, snap)
    assert L.installed_linear(model) is None


@needs_torchao
def test_refusals_before_anything_changes():
    model = wan_bf16()
    model.blocks[1].ffn.net[2].weight = model.blocks[0].ffn.net[2].weight  # tied
    snap = snapshot(model)
    with pytest.raises(ValueError, match="blocks.1.ffn.net.2 and blocks.0.ffn.net.2 share one weight tensor"):
        L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    assert_bit_for_bit(model, snap)
    fp32 = tiny_wan_transformer()
    with pytest.raises(ValueError, match="would quantize none of the layers it names .26, e.g. "
                                         "condition_embedder.time_embedder.linear_1: mxfp8: its weight is float32"):
        L.install_linear(fp32, L.LinearPolicy(method="mxfp8", emulate=True))
    assert L.installed_linear(fp32) is None


@needs_torchao
def test_kept_layers_are_warned_once():
    model = wan_bf16()
    model.condition_embedder.time_embedder.float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    ours = [str(w.message) for w in caught if "fp4video linear" in str(w.message)]
    assert ours == ["fp4video linear: 2 linear layers keep their precision (condition_embedder.time_embedder.linear_1: "
                    "mxfp8: its weight is float32 (torchao's mxfp8 takes bfloat16 weights), ...): see the report's "
                    "plan.kept"]
    assert len(report.plan.kept) == 2
    L.uninstall_linear(model)


@needs_torchao
def test_regional_compile_wraps_each_block_and_uninstall_unwraps():
    """compile: true compiles each block's forward (here with torch.compile's eager backend: the
    tracing, not inductor's code generation); the output is the eager quantized model's, and
    uninstall leaves the class's forward."""
    model = wan_bf16()
    stock, snap = forward(model), snapshot(model)
    L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    eager = forward(model)
    L.uninstall_linear(model)
    report = L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True, compile=True),
                              compile_backend="eager")
    assert report.compiled == 2 and all("forward" in b.__dict__ for b in model.blocks)
    assert torch.equal(forward(model), eager)
    L.uninstall_linear(model)
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()  # a backend that counts the graphs it is given and runs them
    L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True, compile=True), compile_backend=counter)
    forward(model)
    forward(model)
    assert counter.frame_count == 1  # one graph for both blocks and both forwards, no graph break
    L.uninstall_linear(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert_bit_for_bit(model, snap)
    assert torch.equal(forward(model), stock)


@pytest.mark.parametrize("sparse", [False, True])
def test_compiled_blocks_with_fp4video_attention_compile_once_for_any_block_count(sparse):
    """Regional compile with fp4video attention installed: the attention call is opaque to dynamo
    (a graph break), so the blocks' graphs do not depend on the block index, the step or the call's
    routing: the same graph count for 2 and 5 blocks, no recompile past the first forward, and the
    output is the eager one's. (Before, each block recompiled the routing and the kernels' Python,
    past dynamo's recompile limit: 35 graphs for 5 blocks.)"""
    from torch._dynamo.testing import CompileCounter

    import fp4video
    from fp4video.integration import Policy

    policy = Policy.model_validate({"method": "mxattn", **({"sparsity": {"dynamic": {"tau": 0.9}}} if sparse else {})})
    graphs = []
    for layers in (2, 5):
        torch._dynamo.reset()
        model = tiny_wan_transformer(0, 32, num_layers=layers)
        fp4video.install(model, policy)
        want = forward_fp32(model)
        counter = CompileCounter()
        L.install_linear(model, L.LinearPolicy(compile=True), compile_backend=counter)
        got = forward_fp32(model)
        first = counter.frame_count
        forward_fp32(model)
        assert counter.frame_count == first  # the second forward reuses every graph
        graphs.append(first)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        L.uninstall_linear(model)
        fp4video.uninstall(model)
    assert graphs[0] == graphs[1] <= 8, graphs


def forward_fp32(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return model(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g), timestep=torch.tensor([500.0]),
                     encoder_hidden_states=torch.randn(1, 24, 32, generator=g), return_dict=False)[0]


# --- torchao's emulated MXFP8 against an independent reference, and the layer measure --------------


def mxfp8_reference(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3 elements, one power-of-two scale per 32 values along the last dim, the scale
    2^ceil(log2(amax / 448)): cuBLAS's / torchao's RCEIL rule), dequantized, in fp64."""
    blocks = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))), torch.ones_like(amax))
    return (round_e4m3(blocks / scale) * scale).reshape(x.shape)


@needs_torchao
def test_emulated_mxfp8_layer_is_the_mxfp8_product():
    """Weights and activations both in MXFP8 (not weight-only: that misses the reference by the
    activations' rounding), product to within bf16 output rounding."""
    torch.manual_seed(3)
    layer = torch.nn.Linear(256, 96, dtype=torch.bfloat16)
    x = (torch.randn(40, 256) * torch.exp2(torch.randint(-4, 5, (40, 1)).float())).bfloat16()
    x_before, w_before = x.clone(), layer.weight.detach().clone()
    expect = mxfp8_reference(x) @ mxfp8_reference(layer.weight.detach()).T + layer.bias.double()
    weight_only = x.double() @ mxfp8_reference(layer.weight.detach()).T + layer.bias.double()
    m = L.measure_linear(layer, [x[:25], x[25:]], "mxfp8", emulate=True)
    assert torch.equal(x, x_before) and torch.equal(layer.weight, w_before)  # the caller's tensors
    assert type(layer.weight) is torch.nn.Parameter
    q = torch.nn.Linear(256, 96, dtype=torch.bfloat16)
    q.load_state_dict(layer.state_dict())
    from torchao.quantization import quantize_

    quantize_(q, L.torchao_config("mxfp8", emulate=True))
    with torch.no_grad():
        out = q(x)
    assert rel(out, expect) < 4e-3 < rel(weight_only, expect) / 2
    with torch.no_grad():
        stock = layer(x)
    assert m.rel_l2 == pytest.approx(rel(out, stock), rel=1e-6)
    assert m.bf16_ms is None and m.method_ms is None and m.saved_ms is None  # not timed off a GPU
    assert 5e-3 < m.rel_l2 < 0.1


def test_measure_refuses_what_install_refuses():
    layer = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    with pytest.raises(L.LinearUnsupported, match="needs an NVIDIA GPU"):
        L.measure_linear(layer, torch.randn(4, 64).bfloat16(), "fp8-rowwise")
    with pytest.raises(ValueError, match=r"inputs must be tensors \(\.\.\., 64\)"):
        L.measure_linear(layer, torch.randn(4, 32).bfloat16(), "bf16")
    assert L.measure_linear(layer, torch.randn(4, 64).bfloat16(), "bf16").rel_l2 == 0.0


# --- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_torchao
def test_fp8_rowwise_on_the_gpu_is_the_rowwise_e4m3_product():
    """Scales amax / 448 per row of the activations and per output channel of the weight, divided
    in the layer's dtype (torchao divides the bf16 amax in bf16: the scale carries bf16's rounding),
    E4M3 elements, saturating: with fp32 accumulation the GEMM is that product to bf16 rounding;
    fp4video's config keeps torchao's default, Hopper's fast accumulation (a narrower running sum),
    whose extra error stays within the same bound here. The layer's measure times both forms."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import quantize_

    torch.manual_seed(4)
    # Wan's q/k/v/o shape at 1,024 tokens (cuBLASLt refuses some smaller problems: see gemm_guarded)
    layer = torch.nn.Linear(5120, 5120, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 5120, device="cuda").bfloat16()

    def rowwise(t):
        t = t.cpu()
        s = (t.abs().amax(-1, keepdim=True) / 448.0).double()  # in bf16, as torchao
        return round_e4m3(t.double() / s).double() * s

    expect = rowwise(x) @ rowwise(layer.weight.detach()).T + layer.bias.double().cpu()
    m = L.measure_linear(layer, x, "fp8-rowwise", reps=5)
    config = L.torchao_config("fp8-rowwise")
    assert config.mm_config.use_fast_accum  # the documented default
    outs = {}
    for fast in (True, False):
        q = torch.nn.Linear(5120, 5120, device="cuda", dtype=torch.bfloat16)
        q.load_state_dict(layer.state_dict())
        quantize_(q, config if fast else type(config)(granularity=config.granularity, set_inductor_config=False,
                                                      mm_config=Float8MMConfig(use_fast_accum=False)))
        with torch.no_grad():
            outs[fast] = q(x).cpu()
    print(f"relative error to the e4m3 product: fp32 accumulation {rel(outs[False], expect):.2e}, "
          f"fast accumulation {rel(outs[True], expect):.2e}")
    assert rel(outs[False], expect) < 4e-3
    assert rel(outs[True], expect) < 4e-3
    assert m.bf16_ms > 0 and m.method_ms > 0 and m.saved_ms == m.bf16_ms - m.method_ms


@pytest.mark.gpu
@needs_torchao
def test_install_on_the_gpu_keeps_originals_on_the_host_and_restores_them():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    model = wan_bf16().cuda()
    snap = snapshot(model)
    L.install_linear(model, L.LinearPolicy(method="fp8-rowwise"))
    L.uninstall_linear(model)
    assert_bit_for_bit(model, snap)


def test_unfit_shapes_and_weights_are_named():
    bf16 = lambda k, n: torch.nn.Linear(k, n, dtype=torch.bfloat16)  # noqa: E731
    assert L.unfit_reason(bf16(128, 128), "bf16") is None
    assert L.unfit_reason(bf16(256, 128), "fp8-tensor") is None
    assert "torchao takes its per-tensor scale for 128 x 128 block scaling" in L.unfit_reason(bf16(128, 128), "fp8-tensor")
    assert L.unfit_reason(bf16(128, 128), "fp8-rowwise") is None
    assert "multiple of 16" in L.unfit_reason(bf16(24, 128), "fp8-rowwise")
    assert "multiple of 32" in L.unfit_reason(bf16(48, 128), "mxfp8")
    assert "float32" in L.unfit_reason(torch.nn.Linear(64, 64), "nvfp4")
    assert "meta device" in L.unfit_reason(torch.nn.Linear(64, 64, device="meta", dtype=torch.bfloat16), "nvfp4")


@pytest.mark.slow
@needs_torchao
def test_the_profile_script_runs_its_code_paths_on_the_cpu(tmp_path):
    """scripts/profile_linear.py --smoke: the tiny model, mxfp8 emulated, every stage run and recorded
    as it goes, the table written (its GPU numbers come from the H200)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "profile_linear.py"), "--out", str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    configs = {r.get("config") for r in rows if r.get("part") == "forward" and "s" in r}
    assert configs == {"bf16 eager", "mxfp8 eager", "mxfp8 regional compile", "bf16 regional compile"}
    assert len([r for r in rows if r.get("part") == "shapes"]) == 3
    compare = next(r for r in rows if r.get("config") == "compare")
    assert compare["quant_op_calls_added"] > 0  # the quantized forward's own ops, found by the profile
    assert "| mxfp8 regional compile |" in (tmp_path / "table.md").read_text()


def test_a_run_config_names_the_linear_layers_method_and_generate_honours_it(tmp_path):
    """``linear:`` in a run config: a method this machine cannot run is one line before anything
    loads; a policy that fits none of the model's layers (fp32 weights for torchao's mxfp8) is one
    line naming a layer and why, and no video is written."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    bad = tmp_path / "fp8.yaml"
    bad.write_text("model: tiny\nlinear: {method: fp8-rowwise}\n")
    run = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--config", str(bad), "--output",
                          str(tmp_path / "a.mp4"), "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "linear: linear method fp8-rowwise needs an NVIDIA GPU" in run.stderr
    assert not (tmp_path / "a.mp4").exists()
    fp32 = tmp_path / "mx.yaml"  # the tiny model is fp32 on the CPU: torchao's mxfp8 takes bf16 weights only
    fp32.write_text("model: tiny\nprompts: ['a cat']\nlinear: {method: mxfp8, emulate: true}\n")
    run = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--config", str(fp32), "--output",
                          str(tmp_path / "b.mp4"), "--device", "cpu", "--steps", "2"], capture_output=True, text=True,
                         timeout=900)
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert run.returncode == 2 and len(errors) == 1 and "would quantize none of the layers" in errors[0], run.stderr
    assert "its weight is float32" in errors[0] and not (tmp_path / "b.mp4").exists()


# --- a GEMM cuBLASLt refuses runs weight-only, counted ----------------------------------------------


@needs_torchao
def test_a_refused_gemm_runs_weight_only_and_is_counted_per_layer_and_row_count():
    """cuBLASLt refuses some quantized GEMMs by shape (CUBLAS_STATUS_NOT_SUPPORTED): such a call runs
    with the layer's quantized weight dequantized, the layer and row count are counted in the
    report, one warning names the layer; calls of other row counts still take the quantized GEMM,
    other errors propagate; the report holds counts, not the layers. (The refusal is a stand-in:
    cuBLASLt is a GPU's.)"""
    model = wan_bf16()
    report = L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    name = "blocks.1.ffn.net.0.proj"
    layer = model.get_submodule(name)
    calls = []

    def picky(x, *a, **kw):  # as cuBLASLt: no GEMM for one row
        calls.append(x.numel() // x.shape[-1])
        if calls[-1] == 1:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul(...)")
        return torch.nn.Linear.forward(layer, x, *a, **kw)

    layer._fp4video_guard["own"] = picky
    x1, x4 = (torch.randn(1, n, layer.in_features).bfloat16() for n in (1, 4))
    with pytest.warns(UserWarning, match=rf"cuBLASLt has no GEMM for {re.escape(name)} \(MXTensor .*\) at 1 rows"):
        y1 = layer(x1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y1b, y4 = layer(x1), layer(x4)
    w = layer.weight.dequantize(torch.bfloat16)
    assert torch.equal(y1, torch.nn.functional.linear(x1, w, layer.bias)) and torch.equal(y1b, y1)
    assert torch.equal(y4, torch.nn.Linear.forward(layer, x4))  # another row count: the quantized GEMM
    assert calls == [1, 4]  # the refused row count is not tried again
    assert report.refused() == {name: {1: 2}}

    def broken(x, *a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    layer._fp4video_guard["own"] = broken
    with pytest.raises(RuntimeError, match="illegal memory access"):
        layer(x4)
    L.uninstall_linear(model)
    assert "forward" not in layer.__dict__ and "_fp4video_guard" not in layer.__dict__
    assert report.refused() == {name: {1: 2}}  # the counts outlive the install, the layers are not held
    assert not any(isinstance(v, torch.nn.Module) for v in vars(report).values())


@needs_torchao
def test_the_guard_keeps_a_layers_own_forward_and_a_deep_copy_guards_itself():
    """A layer's own instance forward (e.g. an offload hook's) runs under the guard and is back after
    uninstall; a deep copy of an installed model runs its own layers, not the original's."""
    model = wan_bf16()
    layer = model.get_submodule("blocks.1.ffn.net.2")
    seen = []

    def hook(self, x, *a, **kw):  # bound to the layer, as accelerate's hooks are
        seen.append(x.shape)
        return torch.nn.Linear.forward(self, x, *a, **kw)

    hooked = layer.forward = types.MethodType(hook, layer)
    L.install_linear(model, L.LinearPolicy(method="mxfp8", emulate=True))
    forward(model)
    assert seen  # the own forward ran under the guard
    twin = copy.deepcopy(model)
    before = forward(twin)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.add_(1.0)
    assert torch.equal(forward(twin), before)  # the copy's layers are its own
    L.uninstall_linear(model)
    assert layer.__dict__["forward"] is hooked


def test_quantized_layers_are_wrapped_at_install_and_unwrapped_at_uninstall(monkeypatch):
    """The install wraps each quantized layer's forward (an instance attribute) in the refusal
    guard and uninstall removes it; bf16 layers are not wrapped. (torchao's float8 runs on a GPU
    only: its quantization is stubbed here, the wrapping is what is checked.)"""
    model = wan_bf16()
    stock = forward(model)
    monkeypatch.setattr(L, "check_linear_support", lambda method, device, emulate=False: "stub")
    monkeypatch.setattr(L, "torchao_config", lambda method, emulate=False: None)
    monkeypatch.setattr(L, "_torchao", lambda method: None)
    monkeypatch.setattr(L, "_quantize", lambda module, config: None)
    L.install_linear(model, L.LinearPolicy(method="fp8-rowwise",
                                           rules=[L.LinearRule(method="bf16", kinds=["embedder", "head"])]))
    wrapped = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__}
    assert wrapped == {n for n, k in WAN_KINDS.items() if k not in ("embedder", "head")}
    torch.testing.assert_close(forward(model), stock, rtol=0, atol=0)  # stubs: the layers' own values
    L.uninstall_linear(model)
    assert not [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]


@pytest.mark.gpu
@needs_torchao
@pytest.mark.parametrize("rows", [1, 300, 32760])
def test_fp8_rowwise_layers_take_any_token_count_on_the_gpu(rows):
    """An installed fp8 layer answers every token count (one time embedding, 300 rows, Wan 480p's
    32,760 tokens), through the quantized GEMM or, where cuBLASLt refuses the shape, weight-only
    (counted in the report, printed here)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89+")
    torch.manual_seed(5)
    layer = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 512, device="cuda").bfloat16()
    ref = layer(x).float()
    holder = one_block_holding(layer)
    report = L.install_linear(holder, L.LinearPolicy(method="fp8-rowwise"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = holder.blocks[0].ff(x).float()
    print(f"{rows} rows: refused {report.refused()}")
    assert torch.isfinite(out).all() and rel(out, ref) < 0.08, report.refused()
    L.uninstall_linear(holder)
    wan = one_block_holding(torch.nn.Linear(5120, 5120, device="cuda", dtype=torch.bfloat16))
    report = L.install_linear(wan, L.LinearPolicy(method="fp8-rowwise"))
    with torch.no_grad():
        wan.blocks[0].ff(torch.randn(1024, 5120, device="cuda").bfloat16())
    assert report.refused() == {}  # Wan's 5120 -> 5120 at 1,024 rows takes the fp8 GEMM itself
    L.uninstall_linear(wan)


def test_bench_pipelinelinear_variants_parse_and_refuse_in_one_line():
    """`bench pipeline --linear` takes METHOD, METHOD+compile and torchao:METHOD(+compile); anything
    else is refused by argparse naming the entry and the forms."""
    import argparse

    from fp4video.cli.bench import LinearVariant, linear_variant

    assert linear_variant("fp8-rowwise") == LinearVariant("fp8-rowwise")
    assert linear_variant("fp8-rowwise+compile") == LinearVariant("fp8-rowwise", compile=True)
    assert linear_variant("torchao:fp8-tensor+compile") == LinearVariant("fp8-tensor", compile=True, own=True)
    assert linear_variant("bf16+compile").label() == "bf16, blocks compiled"
    for bad in ("fp9", "torchao:bf16", "fp8-rowwise+compiled", "+compile"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"{bad!r} is not a linear variant")):
            linear_variant(bad)


def test_bench_pipeline_times_every_attention_row_under_everylinear_variant(monkeypatch):
    """The stock bf16 step comes first even when not named (every ratio needs it); each variant is
    installed once, its rows timed, then uninstalled; a variant that fails is named under the table
    and the others still run."""
    import argparse

    import fp4video.cli.bench as bench
    import fp4video.integration.linear as lin

    installed = []
    real_install = lin.install_linear

    def install_linear(model, policy=None, **kw):
        installed.append(policy.method)
        if policy.method == "fp8-rowwise":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (stand-in)")
        return real_install(model, policy, **kw)

    monkeypatch.setattr(lin, "install_linear", install_linear)
    monkeypatch.setattr(lin, "check_linear_support", lambda method, device, **kw: "stand-in")
    args = argparse.Namespace(model="wan22", layers=None, resolutions=["480p"], methods=["fp16"], configs=[], reps=1,
                              peers=False, tiny=True, linear=["fp8-rowwise", "mxfp8"])
    real_config = lin.torchao_config  # mxfp8 through torchao's exact emulation: it runs on the CPU
    real_build = bench._build_tiny

    def build_bf16(args, device):  # torchao's mxfp8 takes bf16 weights
        model, inputs, desc = real_build(args, device)

        def inputs_bf16(res):
            kw, tokens = inputs(res)
            return {k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v
                    for k, v in kw.items()}, tokens

        return model.bfloat16(), inputs_bf16, desc

    monkeypatch.setattr(bench, "_build_tiny", build_bf16)
    monkeypatch.setattr(lin, "torchao_config", lambda method, emulate=False: real_config(method, emulate=True))
    table = bench.bench_pipeline(args)
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| 480p")]
    assert [(r[2], r[3]) for r in rows] == [("stock diffusers attention (SDPA)", "bf16"), ("fp4video fp16", "bf16"),
                                            ("stock diffusers attention (SDPA)", "mxfp8"), ("fp4video fp16", "mxfp8")]
    assert installed == ["fp8-rowwise", "mxfp8"]
    assert "- linear fp8-rowwise: failed (RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED (stand-in))" in table
    assert rows[0][6] == rows[1][6] == "1.00"  # a bf16 row against itself
    assert float(rows[3][6]) > 0  # an mxfp8 row against the same attention's bf16 row (seconds too short to compare)


def test_guarded_layers_join_a_compiled_blocks_graph():
    """Inside a compiled block, a guarded layer's forward is the layer's own (a refusal propagates
    there): dynamo traces through it without a graph break, one graph for both blocks and both
    forwards, and the output is the eager guarded model's."""
    from torch._dynamo.testing import CompileCounter

    model = wan_bf16()
    want = forward(model)
    for site in L.linear_sites(model):
        if site.block is not None:
            L.gemm_guarded(site.module, site.name, {})
    assert torch.equal(forward(model), want)  # eager: the guard calls the layer's own forward
    torch._dynamo.reset()
    counter = CompileCounter()
    L.install_linear(model, L.LinearPolicy(method="bf16", compile=True), compile_backend=counter)
    got = forward(model)
    forward(model)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    L.uninstall_linear(model)


def test_a_deep_copy_of_a_compiled_installation_runs_its_own_weights():
    """compile: true binds the compiled forward to each block: a deep copy of the model runs the
    copy's blocks (a compiled bound method in the copy called the original's blocks)."""
    import copy

    model = wan_bf16()
    L.install_linear(model, L.LinearPolicy(compile=True), compile_backend="eager")
    want = forward(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    torch.testing.assert_close(forward(twin), want, rtol=0, atol=0)
    assert not torch.equal(forward(model), want)
    L.uninstall_linear(twin)
    assert all("forward" not in b.__dict__ for b in twin.blocks)
    torch.testing.assert_close(forward(twin), want, rtol=0, atol=0)


def test_a_refused_gemm_warns_at_the_line_that_called_the_model():
    """cuBLASLt's refusal of a quantized layer's GEMM is met inside the model's call: its warning
    names the line that called the model (this file), not torch's module.py that calls the layer."""
    from pathlib import Path

    class Dequantizable(torch.Tensor):  # a quantized weight's dequantize(dtype), as torchao's have
        def dequantize(self, dtype=None):
            return self.as_subclass(torch.Tensor).to(dtype)

    class Refusing(torch.nn.Linear):
        def forward(self, x):
            raise RuntimeError(f"{L.GEMM_REFUSED} (stand-in)")

    layer = Refusing(8, 8)
    weight = layer.weight.detach()
    del layer.weight
    layer.weight = weight.as_subclass(Dequantizable)
    model = torch.nn.Sequential(torch.nn.Identity(), layer)
    refused = {}
    L.gemm_guarded(layer, "1", refused)
    with pytest.warns(UserWarning, match="cuBLASLt has no GEMM for 1") as caught:
        out = model(torch.randn(2, 8))
    assert refused == {2: 1} and out.shape == (2, 8)
    assert {Path(w.filename).name for w in caught if "cuBLASLt" in str(w.message)} == {Path(__file__).name}
