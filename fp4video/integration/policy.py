"""Precision policies: which attention method runs for each call (block, denoising step, attention
kind, Wan2.2 expert), loaded from YAML and validated.

Rules are tried in order; the first whose conditions all match picks the attention, otherwise the
policy's default applies. Example (MXAttention's Wan2.2 main table)::

    method: mxattn
    rules:
      - {method: fp16, blocks: [0]}          # block 0 in high precision
      - {method: fp16, steps: {last: 2}}     # and the final two denoising steps

A rule (and the default) names either one of fp4video's methods (``method:``) or an external
attention backend (``backend:``): any backend of the installed diffusers' dispatcher by its
diffusers name, or a peer diffusers lacks (:mod:`fp4video.integration.backends`)::

    method: mxattn-pv8
    fp16_backend: fastest                    # the fp16 tier on the fastest exact backend installed
    fallback: {backend: native}              # calls a backend cannot take (a mask, an LSE) go here
    rules:
      - {backend: fa3_fp8, kinds: [self]}
      - {method: fp16, steps: {last: 2}}

A method may run block-sparse (:mod:`fp4video.sparse`): ``sparsity`` on a rule, or on the policy
for its default, visits only the key tiles a dynamic or static selection keeps::

    method: mxattn-pv8
    sparsity: {dynamic: {tau: 0.9}}          # every call not matched below: block-sparse
    rules:
      - {method: mxattn-pv8, blocks: [0]}    # block 0 dense
      - {method: fp16, steps: {last: 2}}

Calls are routed by *target*: a method name (``"mxattn"``) or ``"backend:<name>"``; recorded calls
carry the target that actually ran (and a sparse call its selection and density).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import (AllowInfNan, BaseModel, ConfigDict, Discriminator, Field, Strict, StrictBool, StrictInt,
                      StrictStr, Tag, field_validator, model_serializer, model_validator)

from ..recipe import METHODS

#: Kinds of attention call (see :mod:`fp4video.integration.routing`): ``self``, ``cross`` (keys from
#: the text or another sequence), ``image`` (Wan I2V's image-context keys), ``joint`` (context tokens
#: among the queries: HunyuanVideo's blocks).
KINDS = ("self", "cross", "image", "joint")
EXPERTS = ("high_noise", "low_noise")
#: The kinds whose keys come from another sequence than the queries (so Sq and Sk differ): a static
#: window (over the latent grid's tokens) and the dynamic selection's neighbours (a band around each
#: query tile's own tokens) have no meaning there.
CROSS_KINDS = ("cross", "image")

#: A number for a float field, validated as strictly as the integers (:class:`pydantic.StrictInt`):
#: an int or a float, finite; never a boolean (YAML's ``true`` is not 1), a string of digits, nan or
#: ±inf. One strictness for YAML, the command line and Python callers.
Number = Annotated[float, Strict(), AllowInfNan(False)]


#: How a target names an external backend: ``"backend:" + name``.
BACKEND_TARGET = "backend:"


def _check_method(v: str) -> str:
    if v not in METHODS:
        hint = ""
        if isinstance(v, str) and not v.startswith(BACKEND_TARGET):
            try:
                from .backends import backend_names

                if v in backend_names():
                    hint = f" ({v!r} is an external attention backend: name it as `backend: {v}`)"
            except ImportError:
                pass
        raise ValueError(f"unknown method {v!r}; allowed: {', '.join(METHODS)}{hint}")
    return v


def _check_backend(v: str | None) -> str | None:
    if v is None:
        return v
    from .backends import check_backend_name

    if isinstance(v, str) and v in METHODS:
        raise ValueError(f"{v!r} is one of fp4video's methods: name it as `method: {v}`")
    return check_backend_name(v)


def target_of(method: str | None, backend: str | None) -> str:
    """The routing target of a ``method`` / ``backend`` pair (exactly one given)."""
    return method if backend is None else BACKEND_TARGET + backend


def backend_of(target: str) -> str | None:
    """The external backend a target names, None for an fp4video method."""
    return target[len(BACKEND_TARGET):] if target.startswith(BACKEND_TARGET) else None


def check_schedule(step, num_steps) -> None:
    """ValueError unless ``num_steps`` (the denoising steps of the schedule) is None or an int >= 1
    and ``step`` (a step's index) None or an int >= 0: step rules divide by the schedule's length."""
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise ValueError(f"num_steps must be an int >= 1 (the denoising steps of the schedule) or None (no "
                         f"schedule known), got {num_steps!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 (a denoising step's index) or None (no step known), got {step!r}")


def non_negative_blocks(v):
    """A rule's ``blocks``: indices from 0 (a field validator's check, shared by every kind of rule)."""
    if v is not None and any(b < 0 for b in v):
        raise ValueError(f"block indices count from 0 (no negative indices), got {v}")
    return v


def not_empty(v, info):
    """A rule's list condition: None (every one) or not empty (an empty one could never match)."""
    if v is not None and not v:
        raise ValueError(f"{info.field_name}: [] lists none, so the rule could never match (leave "
                         f"{info.field_name} out to match every one)")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepRange(_Strict):
    """Denoising steps a rule covers (0-based). Exactly one of the fields."""

    first: StrictInt | None = Field(None, ge=0, description="the first N steps")
    last: StrictInt | None = Field(None, ge=0, description="the last N steps")
    range: tuple[StrictInt, StrictInt] | None = Field(None, description="[start, stop) step indices")
    fraction: tuple[Number, Number] | None = Field(None, description="[lo, hi) as fractions of the schedule")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("first", "last", "range", "fraction") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of first, last, range, fraction (got {given or 'none'})")
        if self.range is not None and not (0 <= self.range[0] <= self.range[1]):
            raise ValueError(f"range must be [start, stop) with 0 <= start <= stop, got {list(self.range)}")
        if self.fraction is not None and not (0.0 <= self.fraction[0] <= self.fraction[1] <= 1.0):
            raise ValueError(f"fraction must be [lo, hi) with 0 <= lo <= hi <= 1, got {list(self.fraction)}")
        (name, value), = self.model_dump(exclude_none=True).items()
        if value == 0 or (isinstance(value, tuple) and value[0] == value[1]):
            raise ValueError(f"{name}: {list(value) if isinstance(value, tuple) else value} covers no denoising step, "
                             "so the rule could never match")
        return self

    def _interval(self) -> tuple[str, float, float]:
        """(``"index"``, ``"last"`` or ``"fraction"``, lo, hi): the steps as one half-open interval."""
        if self.first is not None:
            return "index", 0, self.first
        if self.range is not None:
            return "index", *self.range
        if self.last is not None:
            return "last", 0, self.last
        return "fraction", *self.fraction

    @property
    def every_step(self) -> bool:
        """Whether the range holds every step of every schedule (``fraction: [0, 1]``)."""
        return self.fraction is not None and self.fraction[0] == 0 and self.fraction[1] == 1

    def covers(self, other: "StepRange") -> bool:
        """Whether this range holds every step ``other`` holds, for every schedule length (False
        where that depends on the length: ``first`` against ``last``, steps against fractions)."""
        (kind, lo, hi), (other_kind, other_lo, other_hi) = self._interval(), other._interval()
        return kind == other_kind and lo <= other_lo and other_hi <= hi

    def contains(self, step: int, num_steps: int) -> bool:
        """Whether step ``step`` of a schedule of ``num_steps`` steps lies in the range (ValueError
        for a ``num_steps`` below 1 or a negative ``step``)."""
        if step is None or num_steps is None:
            raise ValueError(f"StepRange.contains needs a step and the schedule's num_steps, got step {step!r} and "
                             f"num_steps {num_steps!r}")
        check_schedule(step, num_steps)
        if self.first is not None:
            return step < self.first
        if self.last is not None:
            return step >= num_steps - self.last
        if self.range is not None:
            return self.range[0] <= step < self.range[1]
        lo, hi = self.fraction
        return lo <= step / num_steps < hi


class DynamicSelection(_Strict):
    """:class:`fp4video.sparse.DynamicSparsity`'s rule: the share ``tau`` of each query tile's
    estimated mass; in joint attention the context (text) tokens are global. ``neighbours``: the key
    tiles either side of a query tile's own tokens it always keeps (0: its own; null: none), in calls
    with as many queries as keys (self and joint attention); cross attention has no tokens of the
    query tile's own among its keys, so a rule naming cross kinds (``cross``, ``image``) cannot give
    it a band (neighbours >= 1 is refused there)."""

    tau: Annotated[Number, Field(gt=0, le=1)] | None = None
    neighbours: Annotated[StrictInt, Field(ge=0)] | None = 0
    sink_tiles: Annotated[StrictInt, Field(ge=0)] = 0
    min_similarity: Annotated[Number, Field(ge=-1, le=1)] = 0.1
    topk: Annotated[Number, Field(ge=0, le=1)] = 0.0
    estimate: Literal["pooled", "sampled", "covering"] = "pooled"
    estimate_rows: Annotated[StrictInt, Field(ge=1)] = 4

    @model_validator(mode="after")
    def _tau_or_topk(self):
        if self.tau is None and not self.topk:
            raise ValueError("dynamic gives tau (a cumulative share of estimated mass), topk (a share of key tiles) "
                             "or both")
        return self

    def describe(self) -> str:
        parts = ([f"τ={self.tau:g}"] if self.tau is not None else []) + (
            [f"top-k {self.topk:g}"] if self.topk else []) + ([self.estimate] if self.estimate != "pooled" else [])
        return "dynamic " + " ".join(parts)


#: A window's radius in latent frames, rows or columns.
_Radius = Annotated[StrictInt, Field(ge=0)]


class StaticSelection(_Strict):
    """:class:`fp4video.sparse.StaticSparsity`'s rule on the call's latent grid (known from the
    transformer's input): ``window`` radii (frames, rows, columns), ``radial`` narrowing with frame
    distance; in joint attention the context (text) tokens are global."""

    window: tuple[_Radius, _Radius, _Radius]
    radial: StrictBool = False


#: Why a static window cannot apply to a call of each cross kind (for messages).
_NO_WINDOW = {"cross": "cross attention (keys from another sequence)",
              "image": "image attention (keys from the image context)"}


class Sparsity(_Strict):
    """Block-sparse attention for a method's calls: ``dynamic``, ``static`` or both (a hybrid: each
    query tile visits what either keeps), and the check every call runs
    (:func:`fp4video.sparse.check_selection`): ``check_rows`` rows per query tile (null: 10 with a
    floor, 2 without: :func:`fp4video.sparse.check_rows_for`), spread over its queries, measure the
    exact mass kept and bound the tile's mean over all its rows (fewer rows:
    a cheaper check, a wider bound, more tiles added by a floor); ``sinks`` makes key tiles heavy
    for most query tiles global; ``floor`` repairs a query tile until that bound reaches it (null:
    measured, not repaired)."""

    dynamic: DynamicSelection | None = None
    static: StaticSelection | None = None
    floor: Annotated[Number, Field(ge=0, le=1)] | None = None
    sinks: StrictBool = False
    check_rows: Annotated[StrictInt, Field(ge=1, le=128)] | None = None

    @model_validator(mode="after")
    def _one(self):
        if self.dynamic is None and self.static is None:
            raise ValueError("sparsity gives dynamic: {tau: ...}, static: {window: [f, y, x]} or both")
        return self

    def describe(self) -> str:
        parts = []
        if self.static is not None:
            parts.append(f"static window {list(self.static.window)}{', radial' if self.static.radial else ''}")
        if self.dynamic is not None:
            parts.append(self.dynamic.describe())
        text = " ∪ ".join(parts)
        if self.sinks:
            text += ", sinks"
        if self.floor is not None:
            text += f", floor {self.floor:g}"
        return text


def _sparse_method(sparsity, method, where: str):
    if sparsity is not None and method is None:
        raise ValueError(f"{where}: sparsity applies to an fp4video method (method: ...), not to an external backend")
    if sparsity is not None and method == "fp16":
        raise ValueError(f"{where}: sparsity applies to fp4video's quantized methods, not to fp16 (the stock attention "
                         "or an exact backend, which takes no selection): it could never apply")


def _sparse_kinds(sparsity: "Sparsity | None", kinds) -> None:
    """A rule's sparsity that cannot apply to kinds it names (every model): refused."""
    cross = [k for k in (kinds or ()) if k in CROSS_KINDS]
    if sparsity is None or not cross:
        return
    if sparsity.static is not None:
        raise ValueError(f"kinds {cross}: a static window applies to self and joint attention over the latent grid, "
                         f"not to {' or '.join(_NO_WINDOW[k] for k in cross)}: it could never apply to those calls "
                         "(name only self or joint kinds, or give them a rule of their own)")
    n = sparsity.dynamic.neighbours
    if n is not None and n > 0:
        raise ValueError(f"sparsity.dynamic.neighbours {n} with kinds {cross}: the band of key tiles around a query "
                         "tile's own tokens needs as many queries as keys (self or joint attention), which "
                         f"{' and '.join(cross)} attention never has (leave neighbours out for those kinds)")


def _neighbours(sparsity: "Sparsity | None") -> int:
    """The band the dynamic selection of ``sparsity`` keeps beside each query tile's own key tiles (0: none)."""
    return (sparsity.dynamic.neighbours or 0) if sparsity is not None and sparsity.dynamic is not None else 0


class Rule(_Strict):
    """One rule: ``method`` (an fp4video method) or ``backend`` (an external backend) for the calls
    that match every condition given (a condition left out matches every call)."""

    method: StrictStr | None = None
    backend: StrictStr | None = Field(None, description="an external attention backend (diffusers' name, or a peer)")
    blocks: list[StrictInt] | None = Field(None, description="transformer block indices (0-based)")
    steps: StepRange | None = None
    kinds: list[Literal["self", "cross", "image", "joint"]] | None = None
    experts: list[Literal["high_noise", "low_noise"]] | None = None
    sparsity: Sparsity | None = Field(None, description="block-sparse attention for the rule's calls")

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        return None if v is None else _check_method(v)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v):
        return _check_backend(v)

    @model_validator(mode="after")
    def _method_or_backend(self):
        if (self.method is None) == (self.backend is None):
            raise ValueError("give exactly one of method (an fp4video method) and backend (an external attention "
                             f"backend), got {'both' if self.method else 'neither'}")
        _sparse_method(self.sparsity, self.method, "a rule")
        _sparse_kinds(self.sparsity, self.kinds)
        return self

    @property
    def target(self) -> str:
        """What the rule routes its calls to: the method name, or ``"backend:<name>"``."""
        return target_of(self.method, self.backend)

    _non_negative_blocks = field_validator("blocks")(classmethod(lambda cls, v: non_negative_blocks(v)))
    _not_empty = field_validator("blocks", "kinds", "experts")(classmethod(lambda cls, v, info: not_empty(v, info)))

    def describe(self) -> str:
        """The rule as one YAML-like line, for messages."""
        parts = [f"method: {self.method}" if self.backend is None else f"backend: {self.backend}"]
        for name in ("blocks", "kinds", "experts"):
            if getattr(self, name) is not None:
                parts.append(f"{name}: {getattr(self, name)}")
        if self.steps is not None:
            parts.append(f"steps: {self.steps.model_dump(exclude_none=True)}")
        if self.sparsity is not None:
            parts.append(f"sparsity: {self.sparsity.describe()}")
        return "{" + ", ".join(parts) + "}"

    def matches_call(self, expert: str | None, block: int, kind: str) -> bool:
        """Whether the block, kind and expert conditions hold for a call (its step aside)."""
        return ((self.blocks is None or block in self.blocks) and (self.kinds is None or kind in self.kinds)
                and (self.experts is None or expert in self.experts))

    def matches(self, *, block: int, step: int | None, num_steps: int | None, kind: str, expert: str | None) -> bool:
        if self.blocks is not None and block not in self.blocks:
            return False
        if self.kinds is not None and kind not in self.kinds:
            return False
        if self.experts is not None and expert not in self.experts:
            return False
        if self.steps is not None:
            if step is None or num_steps is None:
                return False  # outside a pipeline call no step is known: step rules do not apply
            return self.steps.contains(step, num_steps)
        return True


class Fallback(_Strict):
    """Where a call goes that its target cannot take: an fp4video method or an external backend."""

    method: StrictStr | None = None
    backend: StrictStr | None = None

    _known_method = field_validator("method")(classmethod(lambda cls, v: None if v is None else _check_method(v)))
    _known_backend = field_validator("backend")(classmethod(lambda cls, v: _check_backend(v)))

    @model_validator(mode="after")
    def _one(self):
        if (self.method is None) == (self.backend is None):
            raise ValueError("a fallback gives exactly one of method and backend")
        return self

    @property
    def target(self) -> str:
        return target_of(self.method, self.backend)


def _fallback_form(v) -> str | None:
    """Which form of ``fallback`` a value is (a name or a target), None for neither: one error each."""
    if isinstance(v, str):
        return "name"
    return "target" if isinstance(v, (dict, Fallback)) else None


class Policy(_Strict):
    """A precision policy. ``method`` (or ``backend``): the default for calls no rule matches.
    ``fallback``: what to do when a call's target refuses it (an input the FP4 path or an external
    backend does not take): ``"error"`` raises, ``"stock"`` runs diffusers' own attention for that
    call, ``{method: ...}`` / ``{backend: ...}`` runs that target; each fallback is counted and
    recorded. ``fp16_backend``: what method ``fp16`` runs on: ``"stock"`` (the processor's own
    backend, the stock output), ``"fastest"`` (the fastest exact backend installed, chosen at
    install: :data:`fp4video.integration.backends.EXACT_PREFERENCE`) or an exact backend's name."""

    method: StrictStr = "mxattn"
    backend: StrictStr | None = Field(None, description="the default as an external backend (instead of method)")
    rules: list[Rule] = []
    fallback: Annotated[
        Annotated[Literal["error", "stock"], Tag("name")] | Annotated[Fallback, Tag("target")],
        Discriminator(_fallback_form, custom_error_type="fallback_type",
                      custom_error_message="Input should be error, stock or a mapping {method: ...} / {backend: ...}"),
    ] = "error"
    fp16_backend: StrictStr = "stock"
    refiner: StrictBool = Field(False, description="quantize the attention outside the transformer blocks too "
                                                  "(HunyuanVideo's token refiner); block rules never match it")
    sparsity: Sparsity | None = Field(None, description="block-sparse attention for the default method's calls")

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        return _check_method(v)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v):
        return _check_backend(v)

    @field_validator("fp16_backend")
    @classmethod
    def _exact_backend(cls, v):
        if v in ("stock", "fastest"):
            return v
        from .backends import is_exact

        try:
            _check_backend(v)
        except ValueError as e:
            raise ValueError(f"fp16_backend is stock, fastest or an exact backend's name: {e}") from None
        if not is_exact(v):
            raise ValueError(f"fp16_backend {v!r} quantizes: the fp16 tier needs an exact backend (stock, fastest, "
                             "native, _native_cudnn, flash, _flash_3, ...)")
        return v

    @model_validator(mode="after")
    def _default_is_method_or_backend(self):
        if self.backend is not None and "method" in self.model_fields_set:
            raise ValueError("give method or backend as the default, not both")
        _sparse_method(self.sparsity, None if self.backend is not None else self.method, "the policy's default")
        return self

    @model_serializer(mode="wrap")
    def _without_unused_method(self, handler):
        """A backend default's dump leaves ``method`` out (it is not the default then), so that the
        dump validates again: a mapping naming both is refused."""
        out = handler(self)
        if self.backend is not None and isinstance(out, dict):
            out.pop("method", None)
        return out

    @property
    def target(self) -> str:
        """The default target: ``backend:<name>`` when ``backend`` is given, else ``method``."""
        return target_of(self.method if self.backend is None else None, self.backend)

    def targets(self) -> list[str]:
        """Every target the policy can route a call to (default, rules, fallback), in order, once each."""
        out = [self.target, *(r.target for r in self.rules)]
        if isinstance(self.fallback, Fallback):
            out.append(self.fallback.target)
        return list(dict.fromkeys(out))

    def external_backends(self) -> list[str]:
        """The external backends the policy names (its fp16 tier's too, when named)."""
        names = [backend_of(t) for t in self.targets() if backend_of(t) is not None]
        if self.fp16_backend not in ("stock", "fastest"):
            names.append(self.fp16_backend)
        return list(dict.fromkeys(names))

    @model_validator(mode="after")
    def _every_rule_can_match(self):
        """A rule whose every call earlier rules take first can never match, on any model: refused.
        The calls are told apart by what rules name (the blocks, one for each set of rules naming
        it, and one no rule names; each kind; each expert and none), so this is exact for them;
        steps count as taken only where an earlier rule's steps hold the rule's for every schedule
        length."""
        # one block for each set of rules naming it (blocks named by the same rules are alike to
        # every rule), and one no rule names
        named = [set(r.blocks) for r in self.rules if r.blocks is not None]
        alike = {frozenset(i for i, bs in enumerate(named) if b in bs): b for bs in named for b in bs}
        blocks = (*alike.values(), -1)
        space = CallSpace(calls={(e, b, k) for e in (*EXPERTS, None) for b in blocks for k in KINDS},
                          steps_known=True, name="any model")
        problems = self.unmatchable(space)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def needs_install(self) -> bool:
        """Whether a rule names blocks, steps or experts: facts about a call that only
        :func:`fp4video.install` provides (it annotates block indices, follows the pipeline's
        denoising step and tells the Wan2.2 experts apart)."""
        return any(r.blocks is not None or r.steps is not None or r.experts is not None for r in self.rules)

    def check_blocks(self, n_blocks: int, model: str = "the model") -> None:
        """Raise ``ValueError`` naming every rule whose block indices ``model`` does not have."""
        bad = [f"rules[{i}] {r.describe()}: block(s) {[b for b in r.blocks if b >= n_blocks]}"
               for i, r in enumerate(self.rules) if r.blocks is not None and any(b >= n_blocks for b in r.blocks)]
        if bad:
            raise ValueError(f"the policy names blocks {model} does not have (it has {n_blocks}, 0 to "
                             f"{n_blocks - 1}): " + "; ".join(bad))

    def step_warnings(self, num_steps: int) -> list[str]:
        """Step rules that cover every one or none of ``num_steps`` denoising steps (almost
        always a policy written for another schedule), one message each; ValueError for a
        ``num_steps`` below 1."""
        if num_steps is None:
            raise ValueError("num_steps must be an int >= 1 (the denoising steps of the schedule), got None")
        check_schedule(None, num_steps)
        out = []
        for i, r in enumerate(self.rules):
            if r.steps is None:
                continue
            n = sum(r.steps.contains(s, num_steps) for s in range(num_steps))
            if n in (0, num_steps):
                out.append(f"rules[{i}] {r.describe()} covers {'every one' if n else 'none'} of the "
                           f"{num_steps} denoising steps")
        return out

    def unmatchable(self, space: "CallSpace") -> list[str]:
        """One message for each rule that can match no call of ``space`` (a model's calls, or every
        call a rule can tell apart): it names the rule and why (a condition no call meets, or earlier
        rules that take every call it would)."""
        out, covered = [], []  # covered[i]: the calls of space rule i matches
        for i, r in enumerate(self.rules):
            calls = {c for c in space.calls if r.matches_call(*c)}
            if r.steps is not None and not space.steps_known:
                calls = set()
            covered.append(calls)
            why = None
            if r.experts is not None and not any(e is not None for e, _, _ in space.calls):
                why = f"experts: {space.no_experts}"
            elif r.steps is not None and not space.steps_known:
                why = f"steps: {space.no_steps}"
            elif not calls:
                why = _unmet(r, space)
            else:
                before = [j for j in range(i) if covered[j] & calls and _steps_cover(self.rules[j], r)]
                taken = set().union(*(covered[j] for j in before))
                if calls <= taken:
                    why = "every call it would take is taken first by " + ", ".join(
                        f"rules[{j}] {self.rules[j].describe()}" for j in before)
            if why:
                out.append(f"rules[{i}] {r.describe()} can never match: {why}")
        return out

    def unfit_sparsity(self, space: "CallSpace") -> list[str]:
        """One message for each rule (and the default) whose sparsity cannot apply to calls of
        ``space`` it takes: a static window to calls of ``space.cross`` or ``space.no_window``, the
        dynamic selection's neighbours (>= 1) to calls of ``space.cross``. A rule takes the calls it
        matches that no earlier rule takes at every step; the default takes those no rule does."""
        out, left = [], set(space.calls)
        for i, r in enumerate(self.rules):
            if r.steps is not None and not space.steps_known:
                continue  # it takes no call (:meth:`unmatchable` says so)
            calls = {c for c in left if r.matches_call(*c)}
            why = _unfit(r.sparsity, calls, space)
            if why:
                out.append(f"rules[{i}] {r.describe()}: {why} (give those calls a rule of their own before it, or "
                           "name the kinds it takes)")
            if r.steps is None or r.steps.every_step:
                left -= calls
        why = _unfit(self.sparsity, left, space)
        if why:
            out.append(f"the policy's default {{method: {self.method}, sparsity: {self.sparsity.describe()}}}: {why} "
                       "(give those calls a rule of their own, or put the sparsity on a rule naming the kinds it "
                       "takes)")
        return out

    def method_for(self, *, block: int, step: int | None, num_steps: int | None, kind: str,
                   expert: str | None) -> str:
        """The target of a call: an fp4video method name, or ``"backend:<name>"``."""
        return self.route_for(block=block, step=step, num_steps=num_steps, kind=kind, expert=expert)[0]

    def route_for(self, *, block: int, step: int | None, num_steps: int | None, kind: str,
                  expert: str | None) -> tuple[str, Sparsity | None]:
        """(the target of a call, its :class:`Sparsity` or None: dense), from the first rule that
        matches, else the default. ``step`` and ``num_steps``: the call's denoising step and the
        schedule's length (None: not known; a ``num_steps`` below 1 is a ValueError)."""
        check_schedule(step, num_steps)
        for rule in self.rules:
            if rule.matches(block=block, step=step, num_steps=num_steps, kind=kind, expert=expert):
                return rule.target, rule.sparsity
        return self.target, self.sparsity


@dataclass(frozen=True)
class CallSpace:
    """The attention calls a policy can see: (expert, block, kind) triples, whether the denoising
    step is known, and phrases for messages (``name``: what the calls are of; ``no_experts`` and
    ``no_steps``: why no call has an expert, a step). What the model's structure shows of calls
    that occur (for :meth:`Policy.unfit_sparsity`; empty: nothing known): ``cross``, calls whose
    keys come from another sequence (a cross-attention module's); ``no_window``, {call: why} for
    other calls no static window can apply to (attention outside the blocks, a model whose latent
    grid cannot be read)."""

    calls: set
    steps_known: bool
    name: str
    no_experts: str = "no call has an expert"
    no_steps: str = "no call has a denoising step"
    cross: frozenset = frozenset()
    no_window: dict = field(default_factory=dict)


def _unfit(sparsity: Sparsity | None, calls: set, space: CallSpace) -> str | None:
    """Why ``sparsity`` cannot apply to some of ``calls`` (None: it can, as far as ``space`` shows)."""
    if sparsity is None:
        return None
    if sparsity.static is not None:
        bad = {c: space.no_window[c] for c in calls if c in space.no_window}
        bad.update({c: _NO_WINDOW[c[2]] for c in calls & space.cross})
        what = "its static window applies to self and joint attention over the latent grid, but it takes"
    elif _neighbours(sparsity) > 0:
        bad = {c: _NO_WINDOW[c[2]] for c in calls & space.cross}
        what = (f"its dynamic selection's neighbours {_neighbours(sparsity)} (a band around each query tile's own "
                "tokens) need as many queries as keys, but it takes")
    else:
        return None
    if not bad:
        return None
    blocks: dict = {}
    for (_, block, _), why in bad.items():
        blocks.setdefault(why, set()).add(block)
    parts = [why + (f" in {_block_list(bs)}" if any(b >= 0 for b in bs) else "") for why, bs in sorted(blocks.items())]
    return f"{what} {space.name}'s {' and '.join(parts)}, where it could never apply"


def _block_list(blocks) -> str:
    """``block 3``, ``blocks 0-39``, ``blocks 0, 2-5`` (the transformer blocks among ``blocks``)."""
    inside = sorted(b for b in blocks if b >= 0)
    runs: list = []
    for b in inside:
        if runs and runs[-1][1] == b - 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return f"block{'s' if len(inside) > 1 else ''} " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _steps_cover(earlier: Rule, rule: Rule) -> bool:
    """Whether ``earlier``'s steps hold every step of ``rule``'s, for every schedule length."""
    return earlier.steps is None or (rule.steps is not None and earlier.steps.covers(rule.steps))


def _unmet(rule: Rule, space: CallSpace) -> str:
    """Why no call of ``space`` meets ``rule``'s block, kind and expert conditions together."""
    given = {n: getattr(rule, n) for n in ("blocks", "kinds", "experts") if getattr(rule, n) is not None}
    have = {"blocks": {b for _, b, _ in space.calls}, "kinds": {k for _, _, k in space.calls},
            "experts": {e for e, _, _ in space.calls if e is not None}}
    for name, listed in given.items():
        if not set(listed) & have[name]:
            its = ", ".join(str(v) for v in sorted(have[name])) or "none"
            what = {"blocks": f"no attention of {space.name} in those blocks goes through fp4video (its routed "
                              f"blocks: {its})",
                    "kinds": f"{space.name} makes no {' or '.join(listed)} attention calls (its calls: {its})",
                    "experts": f"no call of {space.name} has those experts (its experts: {its})"}[name]
            return f"{name} {listed}: {what}"
    return f"no attention call of {space.name} has {' and '.join(f'{n} {v}' for n, v in given.items())} together"


def as_policy(policy, what: str = "policy") -> "Policy":
    """``policy`` as a :class:`Policy`: a Policy, a method name (that method everywhere), a
    ``"backend:<name>"`` (that external backend everywhere) or None (``"mxattn"``); anything else is
    a ``TypeError``, an unknown name a ``ValueError``."""
    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        if policy.startswith(BACKEND_TARGET):
            return Policy(backend=backend_of(policy))
        return Policy(method=_check_method(policy))
    raise TypeError(f"{what} must be a fp4video Policy, a method name ({', '.join(METHODS)}) or None, got "
                    f"{type(policy).__name__} {policy!r:.60}" + (" (Policy.model_validate(mapping) reads a mapping)"
                                                                 if isinstance(policy, dict) else ""))


def format_validation_error(err, source: str | None = None) -> str:
    """pydantic's errors as ``source: field.path: reason`` lines (without ``source`` where None), all
    of them: the path names fields and list indices only (a union member's or validator's tag is
    left out), the reason is pydantic's message without its ``Value error, `` prefix."""
    lines = []
    for e in err.errors():
        loc = field_path(err.title, e["loc"], unknown_field=e["type"] == "extra_forbidden")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(_allowed_fields(err.title, e['loc']))})"
        line = f"{loc or '(top level)'}: {msg}"
        line = line if source is None else f"{source}: {line}"
        if line not in lines:  # several members of a union can fail alike
            lines.append(line)
    return "\n".join(lines)


def field_path(model_name: str, loc, unknown_field: bool = False) -> str:
    """``policy.rules[0].steps`` for a pydantic error location under the fp4video model
    ``model_name``: field names and list indices, the tags pydantic puts between them (a union
    member's, a validator's) left out; with ``unknown_field`` the last part is a key the model does
    not have, kept."""
    model = _fp4video_models().get(model_name)
    parts = []
    for i, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif model is None or part in model.model_fields:
            parts.append(str(part))
            model = _inner_model(model.model_fields[part].annotation) if model is not None else None
        elif unknown_field and i == len(loc) - 1:
            parts.append(str(part))
    return ".".join(parts).replace(".[", "[")


def _fp4video_models() -> dict:
    """{class name: class} of fp4video's pydantic models (the policy's and every model embedding
    it, e.g. the run config), found by walking BaseModel's subclasses: nothing here imports them."""
    found, todo = {}, [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("fp4video."):
                found.setdefault(sub.__name__, sub)
    return found


def _allowed_fields(model_name: str, loc) -> list[str]:
    """Field names allowed where an unknown key was found (walks the models along ``loc``)."""
    model = _fp4video_models().get(model_name)
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is not None:  # else a union member's or validator's tag: the same model
            model = _inner_model(field.annotation)
    return sorted(model.model_fields) if model else []


def _inner_model(annotation):
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found:
            return found
    return None
