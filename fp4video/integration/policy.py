"""Precision policies: which attention method runs for each call (block, denoising step, attention
kind, Wan2.2 expert), loaded from YAML and validated.

Rules are tried in order; the first whose conditions all match picks the method, otherwise the
policy's default ``method`` applies. Example (MXAttention's Wan2.2 main table)::

    method: mxattn
    rules:
      - {method: fp16, blocks: [0]}          # block 0 in high precision
      - {method: fp16, steps: {last: 2}}     # and the final two denoising steps
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..recipe import METHODS

#: Kinds of attention call (see :mod:`fp4video.integration.routing`): ``self``, ``cross`` (keys from
#: the text or another sequence), ``image`` (Wan I2V's image-context keys), ``joint`` (context tokens
#: among the queries: HunyuanVideo's blocks).
KINDS = ("self", "cross", "image", "joint")
EXPERTS = ("high_noise", "low_noise")


def _check_method(v: str) -> str:
    if v not in METHODS:
        raise ValueError(f"unknown method {v!r}; allowed: {', '.join(METHODS)}")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepRange(_Strict):
    """Denoising steps a rule covers (0-based). Exactly one of the fields."""

    first: int | None = Field(None, ge=0, description="the first N steps")
    last: int | None = Field(None, ge=0, description="the last N steps")
    range: tuple[int, int] | None = Field(None, description="[start, stop) step indices")
    fraction: tuple[float, float] | None = Field(None, description="[lo, hi) as fractions of the schedule")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("first", "last", "range", "fraction") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of first, last, range, fraction (got {given or 'none'})")
        if self.range is not None and not (0 <= self.range[0] <= self.range[1]):
            raise ValueError(f"range must be [start, stop) with 0 <= start <= stop, got {list(self.range)}")
        if self.fraction is not None and not (0.0 <= self.fraction[0] <= self.fraction[1] <= 1.0):
            raise ValueError(f"fraction must be [lo, hi) with 0 <= lo <= hi <= 1, got {list(self.fraction)}")
        return self

    def contains(self, step: int, num_steps: int) -> bool:
        if self.first is not None:
            return step < self.first
        if self.last is not None:
            return step >= num_steps - self.last
        if self.range is not None:
            return self.range[0] <= step < self.range[1]
        lo, hi = self.fraction
        return lo <= step / num_steps < hi


class Rule(_Strict):
    method: str
    blocks: list[int] | None = Field(None, description="transformer block indices (0-based)")
    steps: StepRange | None = None
    kinds: list[Literal["self", "cross", "image", "joint"]] | None = None
    experts: list[Literal["high_noise", "low_noise"]] | None = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        return _check_method(v)

    @field_validator("blocks")
    @classmethod
    def _non_negative_blocks(cls, v):
        if v is not None and any(b < 0 for b in v):
            raise ValueError(f"block indices count from 0 (no negative indices), got {v}")
        return v

    def describe(self) -> str:
        """The rule as one YAML-like line, for messages."""
        parts = [f"method: {self.method}"]
        for name in ("blocks", "kinds", "experts"):
            if getattr(self, name) is not None:
                parts.append(f"{name}: {getattr(self, name)}")
        if self.steps is not None:
            parts.append(f"steps: {self.steps.model_dump(exclude_none=True)}")
        return "{" + ", ".join(parts) + "}"

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


class Policy(_Strict):
    """A precision policy. ``fallback``: what to do when the FP4 path refuses a call (an input it
    does not support): ``"error"`` raises, ``"stock"`` runs diffusers' own attention for that call
    and counts it in the generation summary."""

    method: str = "mxattn"
    rules: list[Rule] = []
    fallback: Literal["error", "stock"] = "error"
    refiner: bool = Field(False, description="quantize the attention outside the transformer blocks too "
                                            "(HunyuanVideo's token refiner); block rules never match it")

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        return _check_method(v)

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
        always a policy written for another schedule), one message each."""
        out = []
        for i, r in enumerate(self.rules):
            if r.steps is None:
                continue
            n = sum(r.steps.contains(s, num_steps) for s in range(num_steps))
            if n in (0, num_steps):
                out.append(f"rules[{i}] {r.describe()} covers {'every one' if n else 'none'} of the "
                           f"{num_steps} denoising steps")
        return out

    def method_for(self, *, block: int, step: int | None, num_steps: int | None, kind: str,
                   expert: str | None) -> str:
        for rule in self.rules:
            if rule.matches(block=block, step=step, num_steps=num_steps, kind=kind, expert=expert):
                return rule.method
        return self.method


def format_validation_error(err, source: str) -> str:
    """pydantic's errors as ``source: field.path: message`` lines, all of them."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in e["loc"]).replace(".[", "[")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown field (allowed: {', '.join(_allowed_fields(err.title, e['loc']))})"
        lines.append(f"{source}: {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


def _allowed_fields(model_name: str, loc) -> list[str]:
    """Field names allowed where an unknown key was found (walks the models along ``loc``)."""
    from . import config as _config  # the run config embeds Policy

    models = {m.__name__: m for m in (Policy, Rule, StepRange, *_config.CONFIG_MODELS)}
    model = models.get(model_name)
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _inner_model(field.annotation) if field else None
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
