"""Calibrating the transformer's linear layers beside its attention: per *linear site* (expert ×
block × kind of linear layer, :mod:`fp4video.integration.linear`'s kinds inside the blocks) the
relative L2 error of each candidate method's output and the time it saves, and the cheapest method
within the same budget as the attention sites, emitted as a
:class:`~fp4video.integration.linear.LinearPolicy`.

Measured during the calibration's own forwards: a forward hook on every linear layer inside the
transformer blocks takes a sample of its input rows at each call (up to ``rows`` tokens, drawn with
the run's seed), computes the reference, the layer's own product in fp32 (its weights and inputs
upcast, no rounding of the output), and each method's output on the same rows; a site keeps its
worst layer's worst call (``‖y − y_ref‖ / ‖y_ref‖`` over the sampled rows), as the attention sites
keep their worst head's worst call. Only statistics are kept, never a tensor. Layers outside the
blocks (embedders, the head: a token or a few each) are not measured and stay bf16.

How each method is measured (:func:`measuring_forms`): fp8 on a GPU that runs it, by torchao
itself; elsewhere by :func:`fp4video.formats.float8_linear`, the exact numerics of torchao's float8
workflow (per token / per output channel or per tensor scales ``amax / 448``, e4m3, fp32 product;
a per-tensor activation scale from the whole input's amax, not the sample's); mxfp8 by torchao's
own emulation off Blackwell; nvfp4 only on a GPU that runs it.

Time saved (:func:`linear_times`), per layer call, as :mod:`.costs` models attention: ``measured``
on a CUDA device that runs the method (:func:`~fp4video.integration.linear.measure_linear`'s
timing, both forms on an input of the call's shape); elsewhere ``table``: this device's bf16 time
of the call × (1 − the method's time relative to bf16 on an H200, :data:`LINEAR_TABLE`, by the
layer's shape class). A site's saving is the sum over its layers of each layer's mean per call,
the milliseconds one forward saves. A method whose time is unknown at a site, or that saves
nothing, is never chosen there: eager fp8 is slower than bf16 at several shapes.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["LINEAR_TABLE", "LINEAR_TABLE_SOURCE", "REFERENCE", "DEFAULT_ROWS", "LinearSiteStats", "LinearObserver",
           "check_linear_methods", "measuring_forms", "shape_class", "table_ratio", "linear_times", "choose_linear",
           "linear_policy_for", "verify_linear_policy", "torchao_installed"]

#: The reference every linear error is measured against.
REFERENCE = ("the layer's own product: its weights and input rows upcast to fp32, an fp32 matmul and bias "
             "(the bf16 layer without the output's rounding)")

#: Input rows (tokens) sampled per layer call.
DEFAULT_ROWS = 256

#: Milliseconds per call on an H200 at Wan2.2-A14B 720p (75,600 tokens), torch 2.11.0+cu130, torchao
#: 0.18.0 without MSLK: {"eager" or "compile": {shape class: {method: ms}}}, from docs/linear.md's
#: measured table (scripts/profile_linear.py). Compiled, no shape has both a bf16 and an fp8 time
#: there yet, so none has a compiled time: ``--linear-compile`` off a GPU chooses bf16.
LINEAR_TABLE = {
    "eager": {"square": {"bf16": 4.92, "fp8-rowwise": 7.00},      # q/k/v/o 5120 -> 5120
              "expand": {"bf16": 15.05, "fp8-rowwise": 11.79},    # FFN up 5120 -> 13824
              "contract": {"bf16": 14.93, "fp8-rowwise": 19.10}},  # FFN down 13824 -> 5120
    "compile": {},
}
LINEAR_TABLE_SOURCE = ("H200 times per call at Wan2.2 720p (docs/linear.md; torchao 0.18.0 without MSLK), one ratio "
                       "per shape class (in = out, out > in, out < in), applied to this device's bf16 time")


def torchao_installed() -> bool:
    """Whether torchao can be imported (a linear calibration needs it: the policy it writes runs
    through torchao)."""
    return importlib.util.find_spec("torchao") is not None


def shape_class(in_features: int, out_features: int) -> str:
    """``square`` (out = in: the attention projections), ``expand`` (out > in: the FFN's up
    projection) or ``contract`` (out < in: its down projection)."""
    return "square" if out_features == in_features else "expand" if out_features > in_features else "contract"


def table_ratio(method: str, in_features: int, out_features: int, *, compile: bool = False) -> float | None:
    """``method``'s time relative to bf16 for a layer of this shape by :data:`LINEAR_TABLE` (None:
    no time for it)."""
    row = LINEAR_TABLE["compile" if compile else "eager"].get(shape_class(in_features, out_features), {})
    if method == "bf16":
        return 1.0
    if method not in row or "bf16" not in row:
        return None
    return row[method] / row["bf16"]


def measuring_forms(methods, device) -> dict:
    """{method: how it is measured on ``device``}: ``torchao on GPU`` where torchao runs it here,
    ``emulated e4m3 rowwise`` / ``emulated e4m3 tensorwise`` (:func:`fp4video.formats.float8_linear`)
    for fp8 elsewhere, ``torchao's emulated mxfp8`` for mxfp8 off Blackwell. A method nothing here
    can run, even emulated, is a :class:`~fp4video.integration.linear.LinearUnsupported` (one line);
    an unknown one a ValueError."""
    from ..integration.linear import METHODS, LinearUnsupported, check_linear_support

    device = torch.device(device)
    forms = {}
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown linear method {m!r}; allowed: {', '.join(METHODS)}")
        if m == "bf16":
            forms[m] = "the reference (unchanged)"
            continue
        if device.type == "cuda":
            try:
                check_linear_support(m, device)
                forms[m] = "torchao on GPU"
                continue
            except LinearUnsupported as e:
                why = str(e)
        else:
            why = f"linear method {m} needs an NVIDIA GPU; the layers are on {device}"
        if m.startswith("fp8"):
            forms[m] = "emulated e4m3 rowwise" if m == "fp8-rowwise" else "emulated e4m3 tensorwise"
        elif m == "mxfp8":
            check_linear_support(m, device, emulate=True)  # torchao's own emulation (refuses without torchao)
            forms[m] = "torchao's emulated mxfp8"
        else:
            raise LinearUnsupported(f"{why.split('; torchao has no')[0]}, and nothing emulates {m} for measuring")
    return forms


def check_linear_methods(methods, device) -> tuple[list, dict]:
    """(the methods, bf16 first, once each; {method: how it is measured}): torchao installed (else a
    one-line :class:`~fp4video.integration.linear.LinearUnsupported` naming the extra to install),
    every method known and runnable here (:func:`measuring_forms`)."""
    from ..integration.linear import METHODS, TORCHAO_REQUIREMENT, LinearUnsupported

    methods = list(dict.fromkeys(["bf16", *methods]))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown linear method {unknown[0]!r}; allowed: {', '.join(METHODS)}")
    if not torchao_installed():
        raise LinearUnsupported(f"calibrating linear layers needs torchao{TORCHAO_REQUIREMENT} (the policy it writes "
                                "runs through it): pip install 'fp4video[linear]'")
    return methods, measuring_forms(methods, device)


@dataclass
class LinearSiteStats:
    """What calibration keeps of one linear site: its layers (name -> (in, out) features), calls,
    per method the worst relative L2 error over its layers' calls and the layer it came from, the
    methods refused (a layer the method cannot take), and per layer the token counts of its calls."""

    layers: dict = field(default_factory=dict)
    calls: int = 0
    rel_l2: dict = field(default_factory=dict)
    worst_layer: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))  # layer -> {M: calls}
    time_saved_ms: dict = field(default_factory=dict)  # method -> ms per forward (None: unknown)
    time_source: dict = field(default_factory=dict)  # method -> "measured" / "table" / "none"

    def update(self, method: str, rel: float, layer: str) -> None:
        old = self.rel_l2.get(method)
        if old is None or (not math.isnan(old) and not rel <= old):  # a NaN is the worst, and stays
            self.rel_l2[method], self.worst_layer[method] = rel, layer

    def meets(self, method: str, rel_l2: float) -> bool:
        return method == "bf16" or (method not in self.refused and method in self.rel_l2
                                    and self.rel_l2[method] <= rel_l2)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    num = float((y.double() - ref.double()).square().sum())
    den = float(ref.double().square().sum())
    if math.isnan(num):
        return math.nan
    return (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else math.inf)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LinearObserver:
    """Forward hooks on every linear layer inside the transformer blocks of ``target``: at each call
    (while ``active()``), each method's error on a sample of the call's input rows."""

    def __init__(self, target, methods: list, forms: dict, *, rows: int = DEFAULT_ROWS, seed: int = 0,
                 active=lambda: True, excluded=None):
        from ..integration.linear import linear_sites, unfit_reason

        self.methods = [m for m in methods if m != "bf16"]
        self.forms = forms
        self.rows = rows
        self.active = active
        self.excluded = excluded  # called with the seconds spent here (kept out of the forward's time)
        self.generator = torch.Generator().manual_seed(seed)
        self.sites = [s for s in linear_sites(target) if s.block >= 0]
        self.stats: dict = {}
        self.unmeasured = sorted({(s.expert, s.block, s.kind) for s in linear_sites(target) if s.block < 0},
                                 key=str)
        for s in self.sites:
            st = self.stats.setdefault((s.expert, s.block, s.kind), LinearSiteStats())
            st.layers[s.name] = s.shape
            for m in self.methods:
                why = unfit_reason(s.module, m)
                if why is not None:
                    st.refused.setdefault(m, f"{s.name}: {why}")
        self.modules = {s.name: s.module for s in self.sites}
        self.handles = []

    def attach(self) -> None:
        for s in self.sites:
            self.handles.append(s.module.register_forward_hook(self._hook(s)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, site):
        key = (site.expert, site.block, site.kind)

        def hook(module, args, output):
            if not self.active() or not args or not torch.is_tensor(args[0]):
                return None
            x = args[0]
            _sync(x.device)
            t0 = time.perf_counter()
            self._measure(key, site.name, module, x)
            _sync(x.device)
            if self.excluded is not None:
                self.excluded(time.perf_counter() - t0)
            return None

        return hook

    def _measure(self, key, name: str, module: torch.nn.Linear, x: torch.Tensor) -> None:
        from ..formats import float8_linear

        st = self.stats[key]
        st.calls += 1
        x2 = x.detach().reshape(-1, x.shape[-1])
        m_tokens = x2.shape[0]
        st.tokens[name][m_tokens] += 1
        pick = torch.randperm(m_tokens, generator=self.generator)[:self.rows].sort().values.to(x2.device)
        xs = x2.index_select(0, pick)
        w, b = module.weight.detach(), None if module.bias is None else module.bias.detach()
        with torch.no_grad():
            ref = torch.nn.functional.linear(xs.float(), w.float(), None if b is None else b.float())
            for m in self.methods:
                form = self.forms[m]
                if form.startswith("emulated e4m3"):
                    rowwise = m == "fp8-rowwise"
                    y = float8_linear(xs, w, b, rowwise=rowwise, x_amax=None if rowwise else x2.abs().amax())
                else:
                    try:
                        y = self._torchao(module, m, x2, xs, pick, form)
                    except RuntimeError as e:  # a GEMM this torch / torchao pair cannot run: the method is refused
                        y = f"torchao failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                    if isinstance(y, str):
                        st.refused.setdefault(m, f"{name}: {y}")
                        continue
                st.update(m, _rel(y, ref), name)

    @staticmethod
    def _torchao(module, method: str, x2, xs, pick, form: str):
        """The layer quantized by torchao (a bf16 copy), on the sampled rows; a per-tensor method on
        every row (its activation scale is the whole input's), the sample taken from its output."""
        from ..integration.linear import torchao_config, unfit_reason

        # a new layer, not a copy: a copy would carry this observer's hook
        w = module.weight.detach()
        q = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device=w.device,
                            dtype=torch.bfloat16)
        with torch.no_grad():
            q.weight.copy_(w)
            if module.bias is not None:
                q.bias.copy_(module.bias.detach())
        why = unfit_reason(q, method)
        if why is not None:
            return why
        from torchao.quantization import quantize_

        quantize_(q, torchao_config(method, emulate=form.startswith("torchao's emulated")))
        per_tensor = method in ("fp8-tensor", "nvfp4")
        return q(x2.to(torch.bfloat16)).index_select(0, pick) if per_tensor else q(xs.to(torch.bfloat16))


def _bf16_ms_here(weight: torch.Tensor, bias, tokens: int, reps: int = 3) -> float:
    """This device's time of one bf16-layer call (the layer's own dtype) on ``tokens`` random rows."""
    from .costs import median_seconds

    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(tokens, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=g)
    with torch.no_grad():
        return 1000 * median_seconds(lambda: torch.nn.functional.linear(x, weight, bias), weight.device, reps)


def linear_times(observer: LinearObserver, *, compile: bool = False) -> None:
    """Fill each site's ``time_saved_ms`` and ``time_source`` per method: ``measured`` where torchao
    runs the method on this CUDA device (each distinct (tokens, in, out) timed once, on random input),
    else ``table`` (this device's bf16 time × (1 − :func:`table_ratio`)); None with source ``none``
    where neither knows (an emulated method the table has no time for, a layer it refuses)."""
    from ..integration.linear import LinearUnsupported, measure_linear

    memo: dict = {}
    bf16_ms: dict = {}  # one bf16 time per shape, shared by every method's table estimate: methods
    # compared on two timings of the same GEMM would be ranked by the timer's noise

    def saved(name: str, tokens: int, method: str):
        module = observer.modules[name]
        k, n = module.in_features, module.out_features
        key = (tokens, k, n, str(module.weight.dtype), method)
        if key in memo:
            return memo[key]
        out = (None, "none")
        if observer.forms[method] == "torchao on GPU":
            g = torch.Generator(device=module.weight.device).manual_seed(0)
            x = torch.randn(tokens, k, device=module.weight.device, generator=g).to(module.weight.dtype)
            try:
                m = measure_linear(module, x, method, compile=compile, reps=10)
                if m.saved_ms is not None:
                    out = (m.saved_ms, "measured")
            except (LinearUnsupported, ValueError, RuntimeError):  # (a GEMM that fails: no time, never chosen)
                pass
        else:
            ratio = table_ratio(method, k, n, compile=compile)
            if ratio is not None:
                shape = (tokens, k, n, str(module.weight.dtype), module.bias is not None, str(module.weight.device))
                if shape not in bf16_ms:
                    bias = None if module.bias is None else module.bias.detach()
                    bf16_ms[shape] = _bf16_ms_here(module.weight.detach(), bias, tokens)
                out = (bf16_ms[shape] * (1 - ratio), "table")
        memo[key] = out
        return out

    for st in observer.stats.values():
        for method in observer.methods:
            total, sources = 0.0, set()
            for name, by_tokens in st.tokens.items():
                calls = sum(by_tokens.values())
                per_layer = 0.0
                for tokens, c in by_tokens.items():
                    ms, source = saved(name, tokens, method)
                    if ms is None:
                        total = None
                        break
                    per_layer += ms * c / calls
                    sources.add(source)
                if total is None:
                    break
                total += per_layer
            if total is None or not st.tokens:
                st.time_saved_ms[method], st.time_source[method] = None, "none"
            else:  # one form per method: every shape of it measured, or every one from the table
                st.time_saved_ms[method], st.time_source[method] = total, next(iter(sources))


def choose_linear(stats: dict, methods: list, rel_l2: float) -> dict:
    """{site: method}: per linear site the method within the budget (``rel_l2``, the same bound as
    the attention sites') that saves the most time, bf16 where none saves any (a method whose time is
    unknown, or that costs time, is never chosen); ties go to the smaller error, then the earlier
    method."""
    plan = {}
    for key, st in stats.items():
        best, best_key = "bf16", (0.0, 0.0, 0)
        for i, m in enumerate(methods):
            if m == "bf16" or not st.meets(m, rel_l2):
                continue
            saved = st.time_saved_ms.get(m)
            if saved is None or not saved > 0:
                continue
            k = (saved, -st.rel_l2[m], -i)
            if k > best_key:
                best, best_key = m, k
        plan[key] = best
    return plan


def _rules_for(desired: dict, default: str, experts: set) -> list:
    """Rules giving every (expert, block, kind) of ``desired`` its method where it differs from
    ``default``: one rule per (method, set of blocks, set of experts) with the kinds that share them;
    blocks left out for kinds outside the blocks, experts left out where every expert shares it."""
    groups = defaultdict(set)  # (method, kind, blocks) -> experts
    by_kind = defaultdict(lambda: defaultdict(set))  # (method, expert, kind) -> blocks
    for (expert, block, kind), method in desired.items():
        if method != default:
            by_kind[(method, expert, kind)]["blocks"].add(block)
    for (method, expert, kind), d in by_kind.items():
        groups[(method, kind, frozenset(d["blocks"]))].add(expert)
    merged = defaultdict(list)  # (method, blocks, experts) -> kinds
    for (method, kind, blocks), ex in groups.items():
        every = ex == experts
        merged[(method, blocks, None if every else frozenset(ex))].append(kind)
    rules = []
    for (method, blocks, ex), kinds in sorted(merged.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]),
                                                                              sorted(map(str, kv[0][2] or ())))):
        rule = {"method": method}
        if blocks != frozenset({-1}):
            rule["blocks"] = sorted(blocks)
        rule["kinds"] = sorted(kinds)
        if ex is not None:
            rule["experts"] = sorted(ex)
        rules.append(rule)
    return rules


def linear_policy_for(plan: dict, unmeasured=(), *, compile: bool = False):
    """A :class:`~fp4video.integration.linear.LinearPolicy` giving every linear site of ``plan``
    its method and the ``unmeasured`` (expert, block, kind) triples bf16, in as few rules as the
    default allows: the default is the method that leaves the fewest rules, then the fewest blocks
    named in them (bf16 on a tie), rules on blocks, kinds and experts, never steps. Raises
    RuntimeError if it does not give a site its planned method (a self-check)."""
    from ..integration.linear import BLOCK_KINDS, OUTSIDE_KINDS, LinearPolicy

    desired = {**{tuple(t): "bf16" for t in unmeasured}, **plan}
    experts = {e for e, _, _ in desired}
    # rules grouping inside and outside kinds never share blocks: outside ones have block -1 alone
    inside = {k: v for k, v in desired.items() if k[2] in BLOCK_KINDS}
    outside = {k: v for k, v in desired.items() if k[2] in OUTSIDE_KINDS}
    best = None
    for default in dict.fromkeys(["bf16", *desired.values()]):
        rules = _rules_for(inside, default, experts) + _rules_for(outside, default, experts)
        size = (len(rules), sum(len(r.get("blocks", ())) for r in rules))  # fewest rules, then fewest blocks named
        if best is None or size < best[0]:
            best = (size, default, rules)
    _, default, rules = best
    policy = LinearPolicy.model_validate({"method": default, "rules": rules, "compile": compile})
    wrong = {k: (m, policy.method_for(expert=k[0], block=k[1], kind=k[2])) for k, m in desired.items()
             if policy.method_for(expert=k[0], block=k[1], kind=k[2]) != m}
    if wrong:
        raise RuntimeError(f"the calibrated linear policy gives {len(wrong)} sites another method than planned, e.g. "
                           f"{next(iter(wrong.items()))}")
    return policy


def verify_linear_policy(target, policy, plan: dict) -> None:
    """``plan_linear`` of ``policy`` on ``target`` gives every layer its site's planned method
    (layers of no site: bf16), none kept: else a RuntimeError naming the first layer that differs."""
    from ..integration.linear import plan_linear

    layers = plan_linear(target, policy)
    for name, method in layers.items():
        s = layers.sites[name]
        want = plan.get((s.expert, s.block, s.kind), "bf16")
        if method != want or name in layers.kept:
            raise RuntimeError(f"the calibrated linear policy gives {name} {method}"
                               + (f" ({layers.kept[name]})" if name in layers.kept else "") + f", planned {want}")
