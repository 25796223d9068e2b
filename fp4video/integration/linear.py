"""Low-precision linear layers through torchao: which method each linear layer of a diffusers video
transformer runs (a :class:`LinearPolicy`), installed and uninstalled like the attention policy.

fp4video writes no GEMM here: it picks layers and hands them to torchao's inference workflows.

- ``bf16``: the layer is left as it is (any device).
- ``fp8-rowwise``: ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``: e4m3
  weights with a scale per output channel, activations quantized per token at run time,
  ``torch._scaled_mm``. NVIDIA sm_89+ (Ada, Hopper, Blackwell).
- ``fp8-tensor``: the same with ``PerTensor()`` (one scale per tensor). sm_89+.
- ``mxfp8``: ``MXDynamicActivationMXWeightConfig`` (e4m3 elements, an e8m0 scale per 32 values
  along K). sm_100+ (Blackwell); anywhere emulated.
- ``nvfp4``: ``NVFP4DynamicActivationNVFP4WeightConfig`` (e2m1 elements, an e4m3 scale per 16
  values and a per-tensor scale). sm_100+.

``emulate: true`` runs mxfp8 through torchao's emulated MX GEMM (``KernelPreference.EMULATED``:
the MX quantization, then a bf16 matmul of the dequantized operands): the format's exact numerics
on any device, slower than bf16, for accuracy work. torchao has no emulation of its float8 or
NVFP4 inference workflows, so those are refused off their GPUs, in one line
(:func:`check_linear_support`, the one place that knows what each GPU runs).

Kinds of linear layer (:data:`KINDS`), read from the model's structure the way
:mod:`fp4video.integration.sites` reads attention (no list of model names): the model's *blocks*
are the items of its ``nn.ModuleList`` children that hold attention modules (the same indices as
the attention policy's ``blocks``). Inside a block, a linear layer of an attention module is
``attention`` (self or joint attention: q, k, v, out and joint attention's context projections) or
``cross_attention`` (a module built for another sequence's keys: Wan's ``attn2``, with its
image-context projections); one inside a normalization module (an adaptive norm's shift, scale and
gate: HunyuanVideo's ``norm1.linear``) is ``modulation``; any other is ``ffn`` (the feed-forward
layers, and HunyuanVideo's single blocks' ``proj_mlp`` and the ``proj_out`` its attention and MLP
share). Outside the blocks, a linear layer registered after the last block list is ``head`` (the
output norm's modulation and the output projection); any other is ``embedder`` (time, text and
image embedders, HunyuanVideo's token refiner).

A policy in YAML (under a run config's ``linear:``)::

    method: fp8-rowwise                      # every linear layer no rule takes
    compile: true                            # regional torch.compile of the repeated blocks
    rules:
      - {method: bf16, kinds: [embedder, modulation, head]}   # small layers: nothing to gain
      - {method: bf16, blocks: [0, 39]}
      - {method: bf16, experts: [high_noise], kinds: [cross_attention]}

Rules are tried in order; the first whose conditions all hold picks the method. Denoising steps do
not apply: a layer's weights are quantized once, at install, for every step.

:func:`install_linear` keeps each quantized layer's original weight aside (in host memory by
default, so the GPU holds only the quantized weights) and :func:`uninstall_linear` puts it back bit
for bit. :func:`measure_linear` gives calibration a layer's relative error and, on a GPU, the time
it saves.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import types
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from .callers import caller_stacklevel
from .sites import Site, is_attention
from .policy import non_negative_blocks, not_empty

__all__ = ["METHODS", "KINDS", "BLOCK_KINDS", "OUTSIDE_KINDS", "EXPERTS", "TORCHAO_REQUIREMENT", "LinearRule",
           "LinearPolicy", "LinearSite", "LinearPlan", "LinearInstall", "LinearMeasure", "LinearUnsupported",
           "as_linear_policy", "linear_sites", "block_lists", "plan_linear", "install_linear", "uninstall_linear",
           "installed_linear", "check_linear_support", "unfit_reason", "shape_reason", "measure_linear", "torchao_config",
           "GEMM_REFUSED", "gemm_guarded"]

METHODS = ("bf16", "fp8-rowwise", "fp8-tensor", "mxfp8", "nvfp4")
#: Kinds of linear layer inside the transformer blocks, then outside them (see the module's docstring).
BLOCK_KINDS = ("attention", "cross_attention", "ffn", "modulation")
OUTSIDE_KINDS = ("embedder", "head")
KINDS = BLOCK_KINDS + OUTSIDE_KINDS
#: Wan2.2's two transformers, as the attention policy names them.
EXPERTS = ("high_noise", "low_noise")
#: The torchao releases this module is written against: 0.17 is the first built ABI-stable against
#: torch 2.11; the prototype MX / NVFP4 workflows change between releases, so the next is left out
#: until checked.
TORCHAO_REQUIREMENT = ">=0.17,<0.19"
_TORCHAO_RANGE = ((0, 17), (0, 19))

#: What each method needs of an NVIDIA GPU: (compute capability, the words for messages).
_GPU_NEED = {"fp8-rowwise": ((8, 9), "compute capability 8.9 or newer (Ada, Hopper, Blackwell) for torch._scaled_mm's "
                                     "float8 GEMM"),
             "fp8-tensor": ((8, 9), "compute capability 8.9 or newer (Ada, Hopper, Blackwell) for torch._scaled_mm's "
                                    "float8 GEMM"),
             "mxfp8": ((10, 0), "compute capability 10.0 or newer (Blackwell) for the MX block-scaled GEMM"),
             "nvfp4": ((10, 0), "compute capability 10.0 or newer (Blackwell) for the NVFP4 block-scaled GEMM")}
#: The shapes torchao's workflows take: (multiple of in_features, multiple of out_features).
_SHAPE = {"fp8-rowwise": (16, 16), "fp8-tensor": (16, 16), "mxfp8": (32, 16), "nvfp4": (16, 16)}
#: The methods torchao can run emulated (exact numerics, no low-precision GEMM).
_EMULATED = ("mxfp8",)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _refuse_steps(data):
    """A mapping with ``steps``: refused with the reason (not as an unknown field)."""
    if isinstance(data, dict) and "steps" in data:
        raise ValueError("steps do not apply to linear layers: a layer's weights are quantized once, at install, "
                         "for every denoising step (leave steps out; step rules belong to the attention policy)")
    return data


# --- the policy -------------------------------------------------------------------------------------


class LinearRule(_Strict):
    """One rule: ``method`` for the linear layers that meet every condition given (a condition left
    out holds for every layer)."""

    method: Literal["bf16", "fp8-rowwise", "fp8-tensor", "mxfp8", "nvfp4"]
    blocks: list[StrictInt] | None = Field(None, description="transformer block indices (0-based)")
    kinds: list[Literal["attention", "cross_attention", "ffn", "modulation", "embedder", "head"]] | None = None
    experts: list[Literal["high_noise", "low_noise"]] | None = None

    _no_steps = model_validator(mode="before")(classmethod(lambda cls, data: _refuse_steps(data)))

    _non_negative_blocks = field_validator("blocks")(classmethod(lambda cls, v: non_negative_blocks(v)))
    _not_empty = field_validator("blocks", "kinds", "experts")(classmethod(lambda cls, v, info: not_empty(v, info)))

    @model_validator(mode="after")
    def _kinds_in_blocks(self):
        outside = [k for k in (self.kinds or ()) if k in OUTSIDE_KINDS]
        if self.blocks is not None and self.kinds is not None and len(outside) == len(self.kinds):
            raise ValueError(f"kinds {outside} lie outside the transformer blocks, so with blocks {self.blocks} the "
                             "rule could never match (leave blocks out for them)")
        return self

    def describe(self) -> str:
        """The rule as one YAML-like line, for messages."""
        parts = [f"method: {self.method}"]
        for name in ("blocks", "kinds", "experts"):
            if getattr(self, name) is not None:
                parts.append(f"{name}: {getattr(self, name)}")
        return "{" + ", ".join(parts) + "}"

    def matches(self, *, expert: str | None, block: int, kind: str) -> bool:
        """Whether a layer of ``kind`` in ``block`` (-1: outside the blocks) of ``expert``'s transformer
        (None: no expert) meets the rule's conditions."""
        return ((self.blocks is None or block in self.blocks) and (self.kinds is None or kind in self.kinds)
                and (self.experts is None or expert in self.experts))


class LinearPolicy(_Strict):
    """Which method each linear layer runs. ``method``: the default for layers no rule takes.
    ``compile``: regional ``torch.compile`` of the transformer blocks (each block's forward; the
    blocks share one compiled graph per block list), so that inductor can fuse the activations'
    quantization with the elementwise work around each GEMM. ``emulate``: mxfp8 through torchao's emulation (exact MX
    numerics on any device, slower than bf16). ``originals``: where the original weights wait for
    :func:`uninstall_linear`: ``cpu`` (host memory: the GPU keeps only the quantized weights; a
    model already on the CPU keeps its own tensors) or ``device`` (next to the quantized weights:
    no memory saved, the fastest uninstall)."""

    method: Literal["bf16", "fp8-rowwise", "fp8-tensor", "mxfp8", "nvfp4"] = "bf16"
    rules: list[LinearRule] = []
    compile: StrictBool = False
    emulate: StrictBool = False
    originals: Literal["cpu", "device"] = "cpu"

    _no_steps = model_validator(mode="before")(classmethod(lambda cls, data: _refuse_steps(data)))

    @model_validator(mode="after")
    def _emulate_applies(self):
        if self.emulate and not any(m in _EMULATED for m in self.methods()):
            raise ValueError(f"emulate: true runs torchao's emulation of {', '.join(_EMULATED)}, which the policy does "
                             f"not name (its methods: {', '.join(self.methods())}); torchao has no emulation of "
                             "fp8-rowwise, fp8-tensor or nvfp4")
        return self

    @model_validator(mode="after")
    def _every_rule_can_match(self):
        """A rule whose every layer earlier rules take first (on any model) is refused. Layers are
        told apart by what the rules name: a block for each set of rules naming it and one no rule
        names, each kind (outside kinds only outside the blocks), each expert and none."""
        named = [set(r.blocks) for r in self.rules if r.blocks is not None]
        alike = {frozenset(i for i, bs in enumerate(named) if b in bs): b for bs in named for b in bs}
        blocks = (*alike.values(), max((b for bs in named for b in bs), default=-1) + 1)
        layers = {(e, b, k) for e in (*EXPERTS, None) for b in blocks for k in BLOCK_KINDS}
        layers |= {(e, -1, k) for e in (*EXPERTS, None) for k in OUTSIDE_KINDS}
        problems = self.unmatchable(layers, "any model")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def methods(self) -> list[str]:
        """The methods the policy names (default first), once each."""
        return list(dict.fromkeys([self.method, *(r.method for r in self.rules)]))

    def method_for(self, *, expert: str | None, block: int, kind: str) -> str:
        """The method of a layer: the first rule that matches, else the default."""
        for rule in self.rules:
            if rule.matches(expert=expert, block=block, kind=kind):
                return rule.method
        return self.method

    def unmatchable(self, layers: set, name: str, *, why_none=None) -> list[str]:
        """One message for each rule that matches no layer of ``layers`` ((expert, block, kind)
        triples of ``name``) or whose every layer earlier rules take; ``why_none(rule)`` says why a
        rule meets no layer (default: a generic phrase)."""
        out, covered = [], []
        for i, r in enumerate(self.rules):
            mine = {t for t in layers if r.matches(expert=t[0], block=t[1], kind=t[2])}
            covered.append(mine)
            why = None
            if not mine:
                why = why_none(r) if why_none else f"no linear layer of {name} meets its conditions together"
            else:
                before = [j for j in range(i) if covered[j] & mine]
                if mine <= set().union(*(covered[j] for j in before)):
                    why = "every layer it would take is taken first by " + ", ".join(
                        f"rules[{j}] {self.rules[j].describe()}" for j in before)
            if why:
                out.append(f"rules[{i}] {r.describe()} can never match: {why}")
        return out


def as_linear_policy(policy, what: str = "linear policy") -> LinearPolicy:
    """``policy`` as a :class:`LinearPolicy`: a LinearPolicy, a method name (that method for every
    linear layer) or None (bf16: nothing changes); anything else is a TypeError."""
    if policy is None:
        return LinearPolicy()
    if isinstance(policy, LinearPolicy):
        return policy
    if isinstance(policy, str):
        if policy not in METHODS:
            raise ValueError(f"{what}: unknown method {policy!r}; allowed: {', '.join(METHODS)}")
        return LinearPolicy(method=policy)
    raise TypeError(f"{what} must be a LinearPolicy, a method name ({', '.join(METHODS)}) or None, got "
                    f"{type(policy).__name__} {policy!r:.60}" + (" (LinearPolicy.model_validate(mapping) reads a "
                                                                 "mapping)" if isinstance(policy, dict) else ""))


# --- the model's linear layers ----------------------------------------------------------------------


@dataclass(frozen=True)
class LinearSite:
    """A linear layer: ``name`` (its module path; a pipeline's are prefixed with the transformer's
    attribute, ``transformer.`` / ``transformer_2.``), its ``kind``, its ``block`` (-1 outside the
    blocks) and the ``expert`` whose transformer holds it (None: no expert)."""

    name: str
    module: torch.nn.Linear
    kind: str
    block: int
    expert: str | None
    model: torch.nn.Module

    @property
    def shape(self) -> tuple[int, int]:
        """(in_features, out_features)."""
        return self.module.in_features, self.module.out_features


def block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The model's block lists, in registration order: its ``nn.ModuleList`` children whose items
    hold attention modules (:func:`fp4video.integration.sites.attention_sites` counts the same)."""
    return [(name, child) for name, child in model.named_children()
            if isinstance(child, torch.nn.ModuleList) and any(is_attention(m) for b in child for m in b.modules())]


def _is_norm(module: torch.nn.Module) -> bool:
    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ())
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


def _kind_in_block(path: list[torch.nn.Module]) -> str:
    """The kind of a linear layer inside a block; ``path``: the modules from the block's child down
    to the layer's parent (empty: the layer is the block's own child)."""
    for m in path:
        if is_attention(m):
            return "cross_attention" if Site("", 0, None, m).role == "cross" else "attention"
    for m in path:
        if "Norm" in type(m).__name__ or any(_is_norm(c) for c in m.children()):
            return "modulation"
    return "ffn"


def _block_linears(module: torch.nn.Module, name: str, path: list) -> list[tuple[str, torch.nn.Linear, str]]:
    """[(name, layer, kind)] of the linear layers under ``module`` (a block, or a module inside one)."""
    out = []
    for child_name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            out.append((f"{name}.{child_name}", child, _kind_in_block(path)))
        else:
            out += _block_linears(child, f"{name}.{child_name}", path + [child])
    return out


def _model_sites(model: torch.nn.Module, prefix: str, expert: str | None) -> list[LinearSite]:
    lists = block_lists(model)
    if not lists:
        raise ValueError(f"{type(model).__name__} has no transformer blocks (no nn.ModuleList of blocks holding "
                         "attention modules): fp4video finds the blocks and the kinds of linear layer through them")
    list_names = [n for n, _ in lists]
    children = [n for n, _ in model.named_children()]
    last_list = max(children.index(n) for n in list_names)
    sites, index = [], 0
    for position, (top_name, top) in enumerate(model.named_children()):
        if top_name in list_names:
            for i, block in enumerate(top):
                sites += [LinearSite(prefix + name, m, kind, index, expert, model)
                          for name, m, kind in _block_linears(block, f"{top_name}.{i}", [])]
                index += 1
            continue
        kind = "head" if position > last_list else "embedder"
        sites += [LinearSite(prefix + name, m, kind, -1, expert, model)
                  for name, m in top.named_modules(prefix=top_name) if isinstance(m, torch.nn.Linear)]
    return sites


def _transformers(target) -> list[tuple[str | None, str, torch.nn.Module]]:
    """[(expert or None, name prefix, transformer)] of a pipeline or a bare transformer."""
    if isinstance(target, torch.nn.Module):
        return [(None, "", target)]
    t1, t2 = getattr(target, "transformer", None), getattr(target, "transformer_2", None)
    if not isinstance(t1, torch.nn.Module):
        raise TypeError(f"{type(target).__name__} has no `transformer` module: pass a diffusers video pipeline or a "
                        "transformer")
    if t2 is None:
        return [(None, "transformer.", t1)]
    if not isinstance(t2, torch.nn.Module):
        raise TypeError(f"{type(target).__name__}.transformer_2 is a {type(t2).__name__}, not a transformer")
    if t2 is t1:
        raise ValueError(f"{type(target).__name__}.transformer and .transformer_2 are the same model: its high- and "
                         "low-noise layers cannot be told apart")
    return [("high_noise", "transformer.", t1), ("low_noise", "transformer_2.", t2)]


def linear_sites(target) -> list[LinearSite]:
    """Every linear layer of ``target`` (a pipeline, both Wan2.2 experts included, or a bare
    transformer), in module order, with its kind, block and expert."""
    return [s for expert, prefix, model in _transformers(target) for s in _model_sites(model, prefix, expert)]


# --- the plan ---------------------------------------------------------------------------------------


class LinearPlan(dict):
    """{layer name: the method it runs} for every linear layer; ``kept``: {layer name: why} for the
    layers a rule or the default gives a low-precision method they cannot take (they stay as they
    are, and the plan says ``bf16`` for them); ``sites``: {layer name: :class:`LinearSite`}."""

    def __init__(self, methods: dict, kept: dict, sites: dict):
        super().__init__(methods)
        self.kept = kept
        self.sites = sites

    def quantized(self) -> dict[str, str]:
        """{layer name: method} of the layers that change."""
        return {n: m for n, m in self.items() if m != "bf16"}


def unfit_reason(module: torch.nn.Linear, method: str) -> str | None:
    """Why torchao's ``method`` cannot take ``module`` (None: it can): a weight that is not a plain
    bf16 tensor (already quantized, on the meta device, another dtype) or a shape its kernels do not
    take."""
    if method == "bf16":
        return None
    w = module.weight
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        return f"its weight is already a {type(w).__name__} (fp4video quantizes bf16 weights)"
    if w.device.type == "meta":
        return "its weight is on the meta device (not loaded)"
    if w.dtype != torch.bfloat16:
        return f"its weight is {str(w.dtype).removeprefix('torch.')} (torchao's {method} takes bfloat16 weights)"
    if method == "fp8-tensor" and tuple(w.shape) == (128, 128):
        return ("a 128 x 128 weight: torchao takes its per-tensor scale for 128 x 128 block scaling, and its GEMM "
                "refuses the layer")
    return shape_reason(module.in_features, module.out_features, method)


def shape_reason(in_features: int, out_features: int, method: str) -> str | None:
    """Why torchao's ``method`` (not bf16) cannot take a layer of this shape (None: it can): its
    kernels take K and N in multiples of 16 (32 along K for mxfp8)."""
    k_mult, n_mult = _SHAPE[method]
    if in_features % k_mult or out_features % n_mult:
        return (f"{in_features} -> {out_features} features: {method} needs in_features a multiple of "
                f"{k_mult} and out_features a multiple of {n_mult}")
    return None


def plan_linear(target, policy) -> LinearPlan:
    """The method each linear layer of ``target`` (a pipeline or a transformer) runs under ``policy``
    (a :class:`LinearPolicy` or a method name), from its structure alone: nothing is changed or
    imported. A policy that does not fit the model (a block it does not have, a rule that can match
    none of its layers) is a ValueError naming every such rule."""
    policy = as_linear_policy(policy)
    models = _transformers(target)
    sites = linear_sites(target)
    names = " and ".join(sorted({type(m).__name__ for _, _, m in models}))
    n_blocks = {type(m).__name__: sum(len(b) for _, b in block_lists(m)) for _, _, m in models}
    fewest = min(n_blocks.values())
    bad = [f"rules[{i}] {r.describe()}: block(s) {[b for b in r.blocks if b >= fewest]}"
           for i, r in enumerate(policy.rules) if r.blocks is not None and any(b >= fewest for b in r.blocks)]
    if bad:
        raise ValueError(f"the linear policy names blocks {names} does not have (it has {fewest}, 0 to {fewest - 1}): "
                         + "; ".join(bad))
    layers = {(s.expert, s.block, s.kind) for s in sites}
    bare = isinstance(target, torch.nn.Module)

    def why_none(rule: LinearRule) -> str:
        have_kinds = sorted({k for _, _, k in layers}, key=KINDS.index)
        if rule.experts is not None and not any(e is not None for e, _, _ in layers):
            return (f"experts {rule.experts}: " + (f"on a bare {names}, no layer has an expert (experts tell "
                                                   "Wan2.2's two transformers apart: pass the pipeline)" if bare else
                                                   f"{type(target).__name__} has one transformer, so no layer has an "
                                                   "expert"))
        if rule.kinds is not None and not set(rule.kinds) & set(have_kinds):
            return f"kinds {rule.kinds}: {names} has no such linear layers (its kinds: {', '.join(have_kinds)})"
        given = ", ".join(f"{n} {getattr(rule, n)}" for n in ("blocks", "kinds", "experts")
                          if getattr(rule, n) is not None)
        return f"no linear layer of {names} has {given} together"

    problems = policy.unmatchable(layers, names, why_none=why_none)
    if problems:
        raise ValueError(f"the linear policy does not fit {names}: " + "; ".join(problems))
    methods, kept = {}, {}
    for s in sites:
        method = policy.method_for(expert=s.expert, block=s.block, kind=s.kind)
        why = unfit_reason(s.module, method)
        if why is not None:
            kept[s.name] = f"{method}: {why}"
            method = "bf16"
        methods[s.name] = method
    return LinearPlan(methods, kept, {s.name: s for s in sites})


# --- torchao ------------------------------------------------------------------------------------


class LinearUnsupported(ValueError):
    """A method this device, this torch or the installed torchao cannot run (one line: why)."""


def _torchao(method: str):
    """torchao, checked against :data:`TORCHAO_REQUIREMENT` (imported only for a non-bf16 method)."""
    if importlib.util.find_spec("torchao") is None:
        raise LinearUnsupported(f"linear method {method} runs through torchao{TORCHAO_REQUIREMENT}, which is not "
                                "installed (pip install 'fp4video[linear]')")
    import torchao

    version = getattr(torchao, "__version__", "unknown")
    try:
        found = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        found = None
    lo, hi = _TORCHAO_RANGE
    if found is None or not lo <= found < hi:
        raise LinearUnsupported(f"linear method {method} needs torchao{TORCHAO_REQUIREMENT}, found torchao {version} "
                                "(pip install 'fp4video[linear]')")
    return torchao


def check_linear_support(method: str, device, *, emulate: bool = False) -> str:
    """What runs ``method`` on ``device`` (a short phrase), or :class:`LinearUnsupported` in one
    line: the one place that knows which GPU runs which method. fp8: NVIDIA compute capability 8.9+;
    mxfp8 and nvfp4: 10.0+ (Blackwell); ``emulate`` runs mxfp8 anywhere through torchao's emulation."""
    if method not in METHODS:
        raise ValueError(f"unknown linear method {method!r}; allowed: {', '.join(METHODS)}")
    if method == "bf16":
        return "unchanged (bf16)"
    device = torch.device(device)
    if emulate and method in _EMULATED:
        _torchao(method)
        return f"torchao's emulated {method} GEMM (exact {method} numerics, dequantized operands in a bf16 matmul)"
    capability, need = _GPU_NEED[method]
    hint = (" (emulate: true runs its numerics anywhere, slower than bf16)" if method in _EMULATED else
            "; torchao has no emulation of it: use bf16 there")
    if device.type != "cuda":
        raise LinearUnsupported(f"linear method {method} needs an NVIDIA GPU of {need}; the layers are on {device}{hint}")
    found = torch.cuda.get_device_capability(device)
    if found < capability:
        name = torch.cuda.get_device_name(device)
        raise LinearUnsupported(f"linear method {method} needs an NVIDIA GPU of {need}; {name} is sm_{found[0]}{found[1]}"
                                f"{hint}")
    _torchao(method)
    if method.startswith("fp8"):
        if importlib.util.find_spec("mslk") is not None and found >= (9, 0) and method == "fp8-rowwise":
            return "torchao float8 rowwise: MSLK's fused row quantization and rowwise GEMM"
        return (f"torchao float8 {'rowwise' if method == 'fp8-rowwise' else 'tensorwise'}: activations quantized by torch ops (amax, divide, "
                "clamp, cast; fused only under compile), torch._scaled_mm")
    return f"torchao {method}: torch._scaled_mm with block scales"


def torchao_config(method: str, *, emulate: bool = False):
    """The torchao workflow config of ``method`` (a non-bf16 method). Inductor's global settings are
    left alone (``set_inductor_config=False``): a config never changes process-wide state."""
    _torchao(method)
    if method in ("fp8-rowwise", "fp8-tensor"):
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

        granularity = PerRow() if method == "fp8-rowwise" else PerTensor()
        return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False)
    if method == "mxfp8":
        from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig
        from torchao.quantization.quantize_.common import KernelPreference

        preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
        return MXDynamicActivationMXWeightConfig(activation_dtype=torch.float8_e4m3fn, weight_dtype=torch.float8_e4m3fn,
                                                 kernel_preference=preference)
    if method == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        # the fused activation quantization is MSLK's (torchao asserts it is installed when asked for)
        return NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=importlib.util.find_spec("mslk") is not None)
    raise ValueError(f"linear method {method!r} has no torchao config")


def _quantize(module: torch.nn.Linear, config) -> None:
    from torchao.quantization import quantize_

    quantize_(module, config)
    if type(module.weight) in (torch.Tensor, torch.nn.Parameter):  # torchao skips a layer it cannot take, silently
        raise RuntimeError(f"torchao left {module} unquantized under {type(config).__name__}")


#: What cuBLASLt answers when it has no low-precision GEMM for a problem. The eager 40-block Wan
#: forward on the H200 (torch 2.11+cu130, torchao 0.18) stopped on it while Wan's 720p layer shapes
#: ran alone; pytorch/ao#4582 reports row-wise fp8 refused for large K with at most 256 rows on the
#: H100. Which problems it refuses is cuBLASLt's heuristic's choice, not a rule fp4video can check
#: at install.
GEMM_REFUSED = "CUBLAS_STATUS_NOT_SUPPORTED"


def gemm_guarded(module: torch.nn.Linear, name: str, refused: dict) -> None:
    """Guard ``module`` (a quantized linear layer, called ``name``) against cuBLASLt's refusals: its
    forward becomes :func:`_guarded_forward` (bound to the module, so a deep copy guards itself): a
    call whose GEMM raises :data:`GEMM_REFUSED` runs again as ``x @ W'ᵀ + b`` with ``W'`` the
    layer's quantized weight dequantized (weight-only quantization, the activations in their own
    dtype), and later calls with the same token count go there directly. ``refused`` ({token count:
    calls}) counts them; the first refusal of each layer warns, naming it. Other errors propagate.
    Eager calls only: inside a compiled block the GEMM runs in the compiled graph, where a refusal
    propagates."""
    module._fp4video_guard = {"name": name, "own": module.__dict__.get("forward"), "counted": set(),
                              "refused": refused}
    module.forward = types.MethodType(_guarded_forward, module)


def _own_forward(self, guard, x, args, kwargs):
    """The layer's forward as it was before :func:`gemm_guarded`: its own instance forward, else its class's."""
    own = guard["own"]
    return own(x, *args, **kwargs) if own is not None else type(self).forward(self, x, *args, **kwargs)


def _guarded_forward(self, x, *args, **kwargs):
    guard = self._fp4video_guard
    if torch.compiler.is_compiling():  # the GEMM joins the compiled block's graph (a refusal propagates)
        return _own_forward(self, guard, x, args, kwargs)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if m not in guard["counted"]:
        try:
            return _own_forward(self, guard, x, args, kwargs)
        except RuntimeError as e:
            if GEMM_REFUSED not in str(e):
                raise
            if not guard["refused"]:
                warnings.warn(f"fp4video linear: cuBLASLt has no GEMM for {guard['name']} "
                              f"({type(self.weight).__name__} {tuple(self.weight.shape)}) at {m} rows "
                              f"({GEMM_REFUSED}); the layer runs such calls with its quantized weight dequantized "
                              "(weight-only), counted in the install report's refused()",
                              stacklevel=caller_stacklevel())  # the user's line, not torch's module.py
            guard["counted"].add(m)
    guard["refused"][m] = guard["refused"].get(m, 0) + 1
    w = self.weight.dequantize(x.dtype)
    return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


# --- install / uninstall ----------------------------------------------------------------------------


@dataclass
class _Original:
    """A quantized layer's original weight (the Parameter itself, or a host copy of its values)."""

    module: torch.nn.Linear
    weight: torch.Tensor
    copied: bool  # a host copy: restored as a new Parameter on the quantized weight's device
    requires_grad: bool
    extra_repr: object  # the layer's own instance ``extra_repr`` before torchao set one (None: none)
    own_forward: object = None  # the layer's own instance ``forward`` before install (None: none)


@dataclass
class _Installed:
    """What :func:`install_linear` changed on one transformer (its ``_fp4video_linear``)."""

    originals: list
    forwards: list  # [(block, its own instance ``forward`` before compile, or None)]
    through: str
    report: "LinearInstall"


@dataclass
class LinearInstall:
    """What :func:`install_linear` did: ``plan`` (every layer's method; ``plan.kept`` the layers that
    could not take theirs), ``runs`` ({method: what runs it on this device}), ``compiled`` (the
    blocks compiled), ``notes`` (one line each, also warned)."""

    plan: LinearPlan
    runs: dict = field(default_factory=dict)
    compiled: int = 0
    notes: list = field(default_factory=list)
    refused_calls: dict = field(default_factory=dict, repr=False)  # {layer: {token count: calls}}

    def refused(self) -> dict:
        """{layer name: {token count: calls}}: the calls whose GEMM cuBLASLt refused, run with the
        layer's quantized weight dequantized (:func:`gemm_guarded`); empty when none was."""
        return {n: dict(c) for n, c in self.refused_calls.items() if c}

    def summary(self) -> str:
        counts: dict = {}
        for m in self.plan.values():
            counts[m] = counts.get(m, 0) + 1
        text = ", ".join(f"{n} {m}" for m, n in counts.items()) + " linear layers"
        if self.compiled:
            text += f"; {self.compiled} blocks compiled"
        return text


def installed_linear(model: torch.nn.Module) -> LinearInstall | None:
    """The report of the linear installation on ``model`` (a transformer), or None."""
    saved = getattr(model, "_fp4video_linear", None)
    return saved.report if saved is not None else None


def install_linear(target, policy=None, *, compile_backend="inductor") -> LinearInstall:
    """Quantize the linear layers of ``target`` (a pipeline, both Wan2.2 experts included, or a bare
    transformer) as ``policy`` says (a :class:`LinearPolicy` or a method name), through torchao;
    with ``policy.compile``, compile each transformer block (``compile_backend``: torch.compile's
    backend, a name or a callable). Each original weight is kept (``policy.originals``) for :func:`uninstall_linear`.

    Refused, with nothing changed: a transformer that has a linear installation (uninstall it
    first), a policy that does not fit the model (:func:`plan_linear`), a method the layers' device
    cannot run (:func:`check_linear_support`), torchao missing or outside
    :data:`TORCHAO_REQUIREMENT`, a weight shared by several layers. Layers a method cannot take
    (:func:`unfit_reason`) stay as they are, listed in the report's ``plan.kept`` and warned once."""
    policy = as_linear_policy(policy)
    models = _transformers(target)
    for _, _, model in models:
        saved = getattr(model, "_fp4video_linear", None)
        if saved is not None:
            raise RuntimeError(f"fp4video linear layers are already installed on {type(model).__name__} (through "
                               f"{saved.through}): call fp4video.integration.linear.uninstall_linear on it first")
    plan = plan_linear(target, policy)
    todo = plan.quantized()
    if plan.kept and not todo:
        first, why = next(iter(plan.kept.items()))
        raise ValueError(f"the linear policy would quantize none of the layers it names ({len(plan.kept)}, e.g. {first}: "
                         f"{why})")
    report = LinearInstall(plan)
    for name, method in todo.items():
        device = plan.sites[name].module.weight.device
        key = (method, str(device))
        if key not in report.runs:
            report.runs[key] = check_linear_support(method, device, emulate=policy.emulate)
    report.runs = {f"{m} on {d}": what for (m, d), what in report.runs.items()}
    seen: dict = {}
    for name in todo:
        w = plan.sites[name].module.weight
        if id(w) in seen:
            raise ValueError(f"{name} and {seen[id(w)]} share one weight tensor: quantizing it for each layer would "
                             "untie them (give both layers bf16, or untie the weights first)")
        seen[id(w)] = name
    configs = {m: torchao_config(m, emulate=policy.emulate) for m in set(todo.values())}
    through = type(target).__name__ if not isinstance(target, torch.nn.Module) else f"the bare {type(target).__name__}"
    done: list = []
    by_model: dict = {id(m): [] for _, _, m in models}
    try:
        for name, method in todo.items():
            site = plan.sites[name]
            done.append(_keep(site.module, policy.originals))
            by_model[id(site.model)].append(done[-1])
            _quantize(site.module, configs[method])
            gemm_guarded(site.module, name, report.refused_calls.setdefault(name, {}))
    except BaseException:
        _restore(done)
        raise
    for _, _, model in models:
        forwards = _compile_blocks(model, compile_backend) if policy.compile else []
        report.compiled += len(forwards)
        model._fp4video_linear = _Installed(by_model[id(model)], forwards, through, report)
    if plan.kept:
        first = next(iter(plan.kept.items()))
        report.notes.append(f"{len(plan.kept)} linear layers keep their precision ({first[0]}: {first[1]}"
                            + (", ..." if len(plan.kept) > 1 else "") + "): see the report's plan.kept")
    if any(m.startswith("fp8") for m in todo.values()) and not policy.compile and \
            importlib.util.find_spec("mslk") is None:
        report.notes.append("fp8 without compile and without MSLK quantizes each layer's activations with separate "
                            "torch ops (abs, amax, divide, clamp, cast, with float32 temporaries) before its GEMM; "
                            "compile: true fuses them (docs/linear.md)")
    for note in report.notes:
        warnings.warn(f"fp4video linear: {note}", stacklevel=2)
    return report


def _keep(module: torch.nn.Linear, where: str) -> _Original:
    w = module.weight
    own_repr = module.__dict__.get("extra_repr")
    if where == "cpu" and w.device.type != "cpu":
        return _Original(module, w.detach().to("cpu", copy=True), True, w.requires_grad, own_repr,
                         module.__dict__.get("forward"))
    return _Original(module, w, False, w.requires_grad, own_repr, module.__dict__.get("forward"))


def _restore(originals: list) -> None:
    for o in reversed(originals):
        if o.copied:
            device = o.module.weight.device
            o.module.weight = torch.nn.Parameter(o.weight.to(device), requires_grad=o.requires_grad)
        elif o.weight.device != o.module.weight.device:  # the model moved since: the original follows it
            o.module.weight = torch.nn.Parameter(o.weight.to(o.module.weight.device), requires_grad=o.requires_grad)
        else:
            o.module.weight = o.weight
        o.module.__dict__.pop("_fp4video_guard", None)
        if o.own_forward is None:  # :func:`gemm_guarded`'s forward gives way to the class's
            o.module.__dict__.pop("forward", None)
        else:
            o.module.forward = o.own_forward
        if o.extra_repr is None:
            o.module.__dict__.pop("extra_repr", None)
        else:
            o.module.extra_repr = o.extra_repr


def _compile_blocks(model: torch.nn.Module, backend: str) -> list:
    """Compile each block's forward in place (an instance attribute over the class's forward: the
    module's hooks stay outside the compiled region, and removing the attribute undoes it). The
    compiled function is bound to the block as a method, so a deep copy of the model rebinds it to
    the copy's block (a compiled bound method would keep calling the original's); one compiled
    function per block class serves all its blocks."""
    forwards, compiled = [], {}
    for _, blocks in block_lists(model):
        for block in blocks:
            own = block.__dict__.get("forward")
            forwards.append((block, own))
            if own is None or (isinstance(own, types.MethodType) and own.__self__ is block):
                fn = type(block).forward if own is None else own.__func__
                if fn not in compiled:
                    compiled[fn] = torch.compile(fn, backend=backend)
                block.forward = types.MethodType(compiled[fn], block)
            else:  # an instance forward that is not the block's method: compiled as it is
                block.forward = torch.compile(own, backend=backend)
    return forwards


def uninstall_linear(target) -> None:
    """Restore every transformer of ``target`` that has a linear installation: the original weights
    (bit for bit), the blocks' forwards. Transformers without one are left as they are."""
    for _, _, model in _transformers(target):
        saved = getattr(model, "_fp4video_linear", None)
        if saved is None:
            continue
        _restore(saved.originals)
        for block, own in reversed(saved.forwards):
            if own is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = own
        del model._fp4video_linear


# --- per-layer error and time, for calibration ---------------------------------------------------


@dataclass(frozen=True)
class LinearMeasure:
    """One layer under one method: ``rel_l2`` = ||y_method - y_bf16|| / ||y_bf16|| over the sample
    inputs; on a GPU the median milliseconds of one call with the first input in bf16 and in the
    method (None off a GPU, or with an emulated method: its time says nothing of the format's)."""

    method: str
    rel_l2: float
    bf16_ms: float | None = None
    method_ms: float | None = None
    runs: str = ""

    @property
    def saved_ms(self) -> float | None:
        """Milliseconds the method saves per call (negative: it costs), None where not timed."""
        return None if self.bf16_ms is None or self.method_ms is None else self.bf16_ms - self.method_ms


def measure_linear(module: torch.nn.Linear, inputs, method: str, *, emulate: bool = False, compile: bool = False,
                   reps: int = 20) -> LinearMeasure:
    """``module`` (a bf16 ``nn.Linear``, left unchanged) quantized with ``method`` on a copy:
    its output's relative L2 error against the layer's own bf16 output over ``inputs`` (a tensor
    ``(..., in_features)`` or a list of them), and on a CUDA device the time of one call with
    ``inputs[0]`` in each form (median of ``reps``, after warm-up; ``compile``: both forms under
    torch.compile, as :class:`LinearPolicy`'s ``compile`` runs them). Refusals as
    :func:`install_linear`'s (:func:`check_linear_support`, :func:`unfit_reason`)."""
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"measure_linear takes an nn.Linear, got {type(module).__name__}")
    xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if not xs or any(not isinstance(x, torch.Tensor) or x.shape[-1] != module.in_features for x in xs):
        raise ValueError(f"inputs must be tensors (..., {module.in_features}) for a layer of {module.in_features} "
                         "input features")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    device = module.weight.device
    runs = check_linear_support(method, device, emulate=emulate)
    why = unfit_reason(module, method)
    if why is not None:
        raise ValueError(f"{method} cannot take this layer: {why}")
    quantized = copy.deepcopy(module)
    if method != "bf16":
        _quantize(quantized, torchao_config(method, emulate=emulate))
    num = den = 0.0
    with torch.no_grad():
        for x in xs:
            ref = module(x).double()
            out = quantized(x).double()
            num += float((out - ref).square().sum())
            den += float(ref.square().sum())
    rel = (num ** 0.5) / (den ** 0.5) if den > 0 else (0.0 if num == 0 else float("inf"))
    if device.type != "cuda" or (emulate and method in _EMULATED):
        return LinearMeasure(method, rel, runs=runs)
    base, fast = (torch.compile(module), torch.compile(quantized)) if compile else (module, quantized)
    return LinearMeasure(method, rel, _median_ms(base, xs[0], reps), _median_ms(fast, xs[0], reps), runs)


def _median_ms(fn, x: torch.Tensor, reps: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
