"""The quality budget, the candidates' costs, the choice per site, and the policy that routes it.

Budget unit: the relative L2 error of a site's attention output against the exact (stock)
output, ``‖o_c − o‖ / ‖o‖`` over one head's tokens and channels, taken at the worst head of the
worst call the site made (every prompt, every classifier-free-guidance pass). A candidate meets the
budget at a site when that number is at most ``Budget.rel_l2`` (and, if set, the worst head's
cosine is at least ``Budget.min_cosine``), and it took every call there (no refusal). The FP16
tier and every exact backend that takes the site's calls meet every budget. Per site the cheapest
candidate that meets it is chosen.

Costs are relative times, ``t(candidate) / t(stock attention)`` at the site's shape, from one of:
``"table"`` (:data:`DEFAULT_RELATIVE_COST`, measured on an H200 at Wan2.2 720p), ``"measure"``
(each candidate timed on this device on the sites' own inputs) or a ``fp4video bench kernel``
markdown table (the row nearest the site's sequence length).

Block-sparse candidates (:func:`sparse_target`: ``"mxattn-pv8+dynamic:0.9"``, a method and a
selection) are measured like the others, on each call's own inputs with the selection the installed
policy would compute for that call, and the density of each selection is kept. A block-sparse
loop's time follows the density of its selection (:func:`sparse_time`): its cost at a site is its
method's dense cost × ``sparse_time(mean density of the site's calls)``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from ..integration.policy import Policy, backend_of

__all__ = ["Budget", "SiteKey", "SiteStats", "DEFAULT_RELATIVE_COST", "KERNEL_TABLE_NAMES", "choose", "policy_for",
           "plan_of_policy", "costs_from_table", "SPARSE_FIXED", "sparse_time", "sparse_target", "parse_sparsity",
           "split_target", "site_cost", "is_exact_target"]

#: Time relative to diffusers' stock attention (cuDNN SDPA bf16) on an H200 at Wan2.2 720p
#: (75,600 tokens, 40 heads × 128; BENCHMARKS.md, `bench kernel`): the default cost of each
#: candidate. ``fp16`` is the stock backend itself.
DEFAULT_RELATIVE_COST = {
    "fp16": 1.0,
    "backend:native": 1.0,
    "backend:_native_cudnn": 1.0,
    "backend:_flash_3": 176.99 / 212.05,
    "backend:fa3_fp8": 139.80 / 212.05,
    "backend:sage": 146.98 / 212.05,
    "backend:_sage_qk_int8_pv_fp8_cuda_sm90": 146.98 / 212.05,  # the kernel `sage` picks on sm_90
    "mxattn-pv8": 150.41 / 212.05,
    "fp8": 153.59 / 212.05,
    "mxattn": 162.71 / 212.05,
    "mxfp4-ocp": 164.84 / 212.05,
    "nvfp4": 251.27 / 212.05,
    "sage3": 255.02 / 212.05,
}

#: ``bench kernel`` row names -> targets (the stock row is ``SDPA default dispatch bf16``).
KERNEL_TABLE_NAMES = {
    "SDPA default dispatch bf16": "fp16",
    "cuDNN SDPA bf16": "backend:_native_cudnn",
    "flash SDPA bf16": "backend:_native_flash",
    "FlashAttention-3 bf16": "backend:_flash_3",
    "FlashAttention-3 FP8 (cast included)": "backend:fa3_fp8",
    "SageAttention2 sageattn (INT8 QK, FP8 PV)": "backend:sage",
}


#: The share of a dense call's time a block-sparse call takes whatever its density (the pre-pass over
#: every key, the tile lists, the selection itself): :func:`sparse_time`.
SPARSE_FIXED = 0.04


def sparse_time(density: float) -> float:
    """A block-sparse call's time relative to the dense call of its method at ``density`` (the share
    of tile pairs it visits): ``SPARSE_FIXED + (1 − SPARSE_FIXED) · density``, the line through the
    H200's measurements of ``fp4video bench sparse`` at Wan 720p (density 0.25: 0.28× the dense
    time; 0.5: 0.52×), 1 at density 1. The dynamic selection's pooling reads Q and K once, small
    next to the attention's Sq × Sk work: inside the fixed share."""
    return 1.0 if density >= 1 else SPARSE_FIXED + (1.0 - SPARSE_FIXED) * density


#: Between a method and its selection in a block-sparse candidate's name.
SPARSE_SEPARATOR = "+"


def parse_sparsity(spec: str):
    """A :class:`~fp4video.integration.policy.Sparsity` from ``dynamic:TAU`` (a share of the
    estimated attention mass, greater than 0 and at most 1) or ``static:F,Y,X`` (the window's radii
    in frames, rows, columns: whole numbers from 0) with ``,radial`` optional, each followed by
    options: ``,sampled`` (the dynamic estimate from sampled rows), ``,topk=S``, ``,sinks``,
    ``,floor=F``; a one-line ValueError naming the spec and the reason otherwise."""
    from pydantic import ValidationError

    from ..integration.policy import Sparsity, format_validation_error

    kind, _, args = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind not in ("dynamic", "static"):
        raise ValueError(f"sparse candidate {spec!r}: give dynamic:TAU[,sampled|,covering][,topk=S] (e.g. dynamic:0.9) or "
                         "static:F,Y,X[,radial] (e.g. static:4,45,80,radial), then [,sinks][,floor=F]")
    try:
        parts = args.split(",")
        check, rest = {}, []
        for part in parts:
            if part == "sinks":
                check["sinks"] = True
            elif part.startswith("floor="):
                check["floor"] = _share(part[6:], "floor")
            else:
                rest.append(part)
        if kind == "dynamic":
            dynamic = {}
            for part in rest[1:]:
                if part in ("sampled", "covering"):
                    if "estimate" in dynamic:
                        raise ValueError(f"one estimate, got {dynamic['estimate']} and {part}")
                    dynamic["estimate"] = part
                elif part.startswith("topk="):
                    dynamic["topk"] = _share(part[5:], "topk")
                else:
                    raise ValueError(f"unknown option {part!r} (sampled, covering, topk=S, sinks, floor=F)")
            tau = _share(rest[0] if rest else "", "τ")
            return Sparsity(dynamic={"tau": tau, **dynamic}, **check)
        radial = bool(rest) and rest[-1] == "radial"
        radii = rest[:-1] if radial else rest
        if len(radii) != 3:
            raise ValueError(f"the window takes 3 radii (frames, rows, columns), got {len(radii)}")
        window = []
        for r in radii:
            if not r.strip().isdecimal():
                raise ValueError(f"a window radius is a whole number from 0, got {r!r}")
            window.append(int(r))
        return Sparsity(static={"window": window, "radial": radial}, **check)
    except ValidationError as e:
        raise ValueError(f"sparse candidate {spec!r}: {'; '.join(format_validation_error(e).splitlines())}") from None
    except ValueError as e:
        raise ValueError(f"sparse candidate {spec!r}: {e}") from None


def _share(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not a number") from None
    if not 0 < value <= 1:  # (nan fails too)
        raise ValueError(f"{name} is a share, greater than 0 and at most 1, got {text}")
    return value


def _spec(sparsity) -> str:
    if sparsity.dynamic is not None:
        d = sparsity.dynamic
        text = f"dynamic:{d.tau:g}" + (f",{d.estimate}" if d.estimate != "pooled" else "") + (
            f",topk={d.topk:g}" if d.topk else "")
    else:
        st = sparsity.static
        text = "static:" + ",".join(map(str, st.window)) + (",radial" if st.radial else "")
    return text + (",sinks" if sparsity.sinks else "") + ("" if sparsity.floor is None else f",floor={sparsity.floor:g}")


def sparse_target(method: str, sparsity) -> str:
    """The candidate name of ``method`` run block-sparse with ``sparsity`` (a
    :class:`~fp4video.integration.policy.Sparsity` or its spec string): ``"mxattn-pv8+dynamic:0.9"``."""
    if isinstance(sparsity, str):
        sparsity = parse_sparsity(sparsity)
    return f"{method}{SPARSE_SEPARATOR}{_spec(sparsity)}"


def split_target(target: str):
    """(the method or backend target, its :class:`~fp4video.integration.policy.Sparsity` or None)."""
    if backend_of(target) is None and SPARSE_SEPARATOR in target:
        method, _, spec = target.partition(SPARSE_SEPARATOR)
        return method, parse_sparsity(spec)
    return target, None


def is_exact_target(target: str) -> bool:
    """Whether ``target`` computes attention unquantized: ``fp16`` (stock) or an exact external
    backend (FlashAttention, cuDNN, ...). Exact targets meet every budget."""
    from ..integration.backends import is_exact

    name = backend_of(target)
    return target == "fp16" or (name is not None and is_exact(name))


def site_cost(cost, target: str, stats: SiteStats) -> float | None:
    """``target``'s cost at a site: ``cost(target, shape)``; a block-sparse candidate's is its
    method's × :func:`sparse_time` of its mean density over the site's calls."""
    base, sparsity = split_target(target)
    c = cost(base, stats.shape)
    if sparsity is None or c is None:
        return c
    density = stats.mean_density(target)
    return math.inf if density is None else c * sparse_time(density)


class Budget(BaseModel):
    """The quality a site must keep: its worst head's relative L2 error (and optionally cosine)."""

    # strict: a number is an int or a float (never a string or a boolean), finite
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    rel_l2: float = Field(0.1, gt=0, allow_inf_nan=False,
                          description="largest relative L2 error of a site's attention output, worst head")
    min_cosine: float | None = Field(None, gt=-1, le=1, allow_inf_nan=False,
                                     description="smallest cosine of a site's output, worst head")
    match: str | None = Field(None, description="a candidate whose own error at each site is the bound there (e.g. "
                                                 "backend:fa3_fp8: no site worse than FlashAttention-3 FP8 would be); "
                                                 "rel_l2 bounds the sites it cannot take")
    min_kept: float = Field(0.9, ge=0, le=1, allow_inf_nan=False,
                            description="a block-sparse candidate is admitted at a site only where every query tile "
                                        "of every call kept at least this share of its sampled rows' exact "
                                        "attention mass")

    def met(self, rel_l2: float, cosine: float) -> bool:
        return rel_l2 <= self.rel_l2 and (self.min_cosine is None or cosine >= self.min_cosine)

    def describe(self) -> str:
        if self.match is not None:
            s = (f"relative L2 ≤ {self.match}'s own at each site (worst head, worst call; ≤ {self.rel_l2:g} where it "
                 "cannot run)")
        else:
            s = f"relative L2 ≤ {self.rel_l2:g} per site (worst head, worst call)"
        return s + (f", cosine ≥ {self.min_cosine:g}" if self.min_cosine is not None else "") + (
            f"; block-sparse: exact mass kept ≥ {self.min_kept:g} per query tile")


#: (expert or None, block, kind, step or None)
SiteKey = tuple


@dataclass
class SiteStats:
    """What calibration keeps of one site: statistics only, never a tensor."""

    calls: int = 0
    shape: tuple = ()  # (queries, keys, heads, head dim) of its calls
    rel_l2: dict = field(default_factory=dict)  # target -> worst head's relative L2, worst call
    cosine: dict = field(default_factory=dict)  # target -> worst head's cosine, worst call
    refused: dict = field(default_factory=dict)  # target -> why it could not take a call
    density: dict = field(default_factory=dict)  # block-sparse target -> [sum of its calls' densities, calls]
    kept: dict = field(default_factory=dict)  # block-sparse target -> least kept mass of a query tile, any call

    def add_kept(self, target: str, kept: float) -> None:
        """A call's worst query tile's kept mass (NaN: not finite, kept as NaN: never admitted)."""
        old = self.kept.get(target)
        self.kept[target] = kept if old is None or not kept >= old else old

    def add_density(self, target: str, density: float) -> None:
        total = self.density.setdefault(target, [0.0, 0])
        total[0] += density
        total[1] += 1

    def mean_density(self, target: str) -> float | None:
        """A block-sparse target's mean density over the site's calls (None: not measured)."""
        total = self.density.get(target)
        return None if not total or not total[1] else total[0] / total[1]

    def update(self, target: str, rel_l2: float, cosine: float) -> None:
        # NaN compares false: kept as NaN (a candidate whose output is not finite never meets a budget)
        old = self.rel_l2.get(target)
        self.rel_l2[target] = rel_l2 if old is None or not rel_l2 <= old else old
        old = self.cosine.get(target)
        self.cosine[target] = cosine if old is None or not cosine >= old else old

    def meets(self, target: str, budget: Budget) -> bool:
        if target in self.refused:
            return False
        if is_exact_target(target):
            return True
        if target not in self.rel_l2:
            return False
        if split_target(target)[1] is not None and not self.kept.get(target, math.nan) >= budget.min_kept:
            return False  # a selection whose check found a query tile under the floor (or none measured)
        ref = budget.match
        if ref is not None and ref not in self.refused and ref in self.rel_l2:
            return self.rel_l2[target] <= self.rel_l2[ref] and (
                budget.min_cosine is None or self.cosine[target] >= budget.min_cosine)
        return budget.met(self.rel_l2[target], self.cosine[target])


#: The share of stock's time an exact backend must save at a site to replace stock there (equal
#: kernels time a little apart; a rule for noise is not worth writing).
EXACT_MARGIN = 0.02


def choose(stats: dict, candidates: list[str], cost, budget: Budget) -> dict:
    """{site: target}: per site the cheapest candidate meeting ``budget`` (``cost(target, shape)``, a
    block-sparse one's by :func:`site_cost`; an exact backend's with :data:`EXACT_MARGIN` added; ties
    go to a dense candidate (a selection that visits every tile saves nothing), then to the smaller
    error, then to the earlier candidate)."""
    def key_of(t, s):
        c = site_cost(cost, t, s)
        if t != "fp16" and is_exact_target(t):
            c += EXACT_MARGIN
        return (c, split_target(t)[1] is not None, s.rel_l2.get(t, 0.0), candidates.index(t))

    plan = {}
    for key, s in stats.items():
        ok = [t for t in candidates if s.meets(t, budget)]
        plan[key] = min(ok, key=lambda t, s=s: key_of(t, s))
    return plan


def _target_fields(target: str) -> dict:
    name = backend_of(target)
    if name is not None:
        return {"backend": name}
    method, sparsity = split_target(target)
    if sparsity is None:
        return {"method": method}
    return {"method": method, "sparsity": sparsity.model_dump(exclude_defaults=True)}


def _route_target(route) -> str:
    """The candidate name of a :meth:`Policy.route_for` result."""
    target, sparsity = route
    return target if sparsity is None else sparse_target(target, sparsity)


def policy_for(plan: dict, *, num_steps: int | None, fp16_backend: str = "stock", fallback="error") -> Policy:
    """A :class:`Policy` routing every site of ``plan`` to its target: the default is ``fp16``, so
    calls the calibration never saw (another kind, a block a cache skipped) keep full precision,
    and every other target is named by rules (one per expert, kind, target and run of consecutive
    steps with the same blocks; steps as fractions of the schedule, so the policy scales to other
    step counts). Raises RuntimeError if the policy does not route a site as planned (a self-check)."""
    default = "fp16"
    groups = defaultdict(lambda: defaultdict(set))  # (target, expert, kind) -> step -> blocks
    for (expert, block, kind, step), target in plan.items():
        if target != default:
            groups[(target, expert, kind)][step].add(block)
    rules = []
    for (target, expert, kind), by_step in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2])):
        steps = sorted(by_step, key=lambda s: -1 if s is None else s)
        runs = []  # [first step, last step, blocks]
        for s in steps:
            if runs and s is not None and runs[-1][1] is not None and runs[-1][1] == s - 1 and runs[-1][2] == by_step[s]:
                runs[-1][1] = s
            else:
                runs.append([s, s, by_step[s]])
        for first, last, blocks in runs:
            rule = {**_target_fields(target), "blocks": sorted(blocks), "kinds": [kind]}
            if expert is not None:
                rule["experts"] = [expert]
            if first is not None and not (first == 0 and last + 1 == num_steps):
                rule["steps"] = {"fraction": [first / num_steps, (last + 1) / num_steps]}
            rules.append(rule)
    spec = {**_target_fields(default), "rules": rules, "fp16_backend": fp16_backend,
            "fallback": fallback}
    policy = Policy.model_validate(spec)
    wrong = {k: (t, got) for k, t in plan.items()
             if (got := _route_target(policy.route_for(block=k[1], step=k[3], num_steps=num_steps, kind=k[2],
                                                       expert=k[0]))) != t}
    if wrong:
        raise RuntimeError(f"the calibrated policy routes {len(wrong)} sites otherwise than planned, e.g. "
                           f"{next(iter(wrong.items()))}")
    return policy


def plan_of_policy(policy: Policy, keys, num_steps: int | None) -> dict:
    """{site: target} that ``policy`` gives the sites ``keys`` (a block-sparse one by :func:`sparse_target`)."""
    return {k: _route_target(policy.route_for(block=k[1], step=k[3], num_steps=num_steps, kind=k[2], expert=k[0]))
            for k in keys}


def costs_from_table(text: str) -> dict:
    """{target: [(sequence length, time relative to stock)]} from ``fp4video bench kernel`` markdown."""
    from ..eval.speed import parse_kernel_tables

    out = defaultdict(list)
    for table in parse_kernel_tables(text):
        by_seq = defaultdict(dict)
        for row in table.rows:
            name = row.kernel.replace(" (best bf16)", "").strip()
            target = name.removeprefix("fp4video ") if name.startswith("fp4video ") else KERNEL_TABLE_NAMES.get(name)
            if target is not None and not (name.startswith("fp4video ") and target == "fp16"):
                by_seq[row.seq][target] = row.ms
        for seq, times in by_seq.items():
            stock = times.get("fp16")
            if stock is None:
                continue
            for target, ms in times.items():
                if not (math.isfinite(ms) and ms > 0):  # a time is positive: a cost is never 0, negative or nan
                    name = next(k for k, v in KERNEL_TABLE_NAMES.items() if v == target) if target == "fp16" else target
                    raise ValueError(f"the cost table's row {name!r} at S={seq}: its time must be a number > 0 ms, "
                                     f"got {ms:g}")
                out[target].append((seq, ms / stock))
    if not out:
        raise ValueError("the cost table has no `bench kernel` rows with a 'SDPA default dispatch bf16' baseline")
    return dict(out)


def nearest(points: list, seq: int) -> float:
    """The value at the sequence length nearest ``seq`` (on a log scale)."""
    return min(points, key=lambda p: abs(math.log(p[0]) - math.log(max(seq, 1))))[1]
