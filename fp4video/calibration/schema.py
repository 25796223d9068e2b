"""``report.json`` as pydantic models: every field of a calibration report with its type and range,
checked once when a report is read back (:func:`load_report`), before anything is chosen from it.

The report is fp4video's own format, so the models are strict (a number is an int or a float,
never a string or a boolean; a whole number is an int) and forbid keys they do not know. Non-finite
numbers are spelled ``"nan"``, ``"inf"``, ``"-inf"`` (standard JSON has none): an error may be NaN
(a candidate whose output was not finite never meets a budget), a measured cost infinite (a
candidate that could not run at a shape); nothing else may. Beyond each field, the report must hold
together: every site's shape among the measured shapes, a cost for every candidate at each of
them, every site's step inside the schedule, no site twice. A problem is a :class:`ReportError`,
one line naming the field by its path (``sites[3].rel_l2.fp8: must be >= 0, got -1``).

A calibration of the linear layers too adds ``linear`` (how they were measured and the policy
chosen) and ``linear_sites`` (per expert, block and kind: each method's error, its time saved and
that time's source, the choice); a report without them (linear layers not calibrated, or written
before they could be) loads as it is.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from ..integration.linear import BLOCK_KINDS as LINEAR_BLOCK_KINDS, KINDS as LINEAR_KINDS, METHODS as LINEAR_METHODS
from ..integration.linear import LinearPolicy
from ..integration.policy import EXPERTS, KINDS
from .plan import Budget, is_exact_target, split_target

__all__ = ["CalibrationReport", "ReportError", "load_report", "validate_report"]


class ReportError(ValueError):
    """A report that cannot be chosen from: one line naming the field and the reason."""


def _spelled(v):
    """``"nan"``, ``"inf"``, ``"-inf"`` as the floats they spell (how report.json writes them)."""
    return float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v


def _num(v: float) -> str:
    return format(v, "g")


def _number(low: float | None = None, *, above: bool = False, high: float | None = None, nan: bool = False,
            inf: bool = False):
    """A float field's check: at least ``low`` (above it with ``above``), at most ``high``; NaN
    allowed with ``nan``, +infinity with ``inf``."""
    def check(v: float) -> float:
        if math.isnan(v):
            if nan:
                return v
            raise ValueError("must be a number, got nan")
        if math.isinf(v) and not (inf and v > 0):
            raise ValueError(f"must be finite, got {_num(v)}")
        if low is not None and (v <= low if above else v < low):
            raise ValueError(f"must be {'>' if above else '>='} {_num(low)}, got {_num(v)}")
        if high is not None and v > high:
            raise ValueError(f"must be <= {_num(high)}, got {_num(v)}")
        return v

    return Annotated[float, BeforeValidator(_spelled), AfterValidator(check)]


def _whole(low: int):
    def check(v: int) -> int:
        if v < low:
            raise ValueError(f"must be >= {low}, got {v}")
        return v

    return Annotated[int, AfterValidator(check)]


#: a site's worst-head relative L2 error: >= 0; NaN or +inf where the candidate's output was not finite
Error = _number(0, nan=True, inf=True)
#: a site's worst-head cosine: -1 to 1 (1e-3 of float rounding allowed over); NaN where not finite
Cosine = _number(-1.001, high=1.001, nan=True)
#: a block-sparse candidate's mean density: the share of tile pairs visited, 0 to 1
Density = _number(0, high=1)
#: a time relative to stock: > 0; +inf where the candidate could not run at that shape
Cost = _number(0, above=True, inf=True)
Seconds = _number(0)
PositiveSeconds = _number(0, above=True)
#: a derived figure (a speed-up, a ratio): >= 0, NaN and +inf kept as computed
Derived = _number(0, nan=True, inf=True)
Correlation = _number(-1.001, high=1.001, nan=True)
Count = _whole(0)
Positive = _whole(1)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)


class Transformer(_Model):
    expert: Literal[EXPERTS] | None
    class_: str = Field(alias="class")
    blocks: Count
    parameters: Count


class ModelSummary(_Model):
    name: str
    transformers: list[Transformer]


class Costs(_Model):
    source: str
    relative_to_stock: dict[str, dict[str, Cost]]


class SingleTarget(_Model):
    predicted_step_speedup_vs_stock: Derived
    calibrated_speedup_vs_it: Derived
    predicted_attention_speedup_vs_stock: Derived | None
    sites_over_budget: Count
    sites_refused_kept_fp16: Count
    worst_rel_l2: Error


class Prediction(_Model):
    attention_share_of_stock_forward: _number(0, high=1, nan=True) | None
    step_speedup_vs_stock: Derived
    attention_speedup_vs_stock: Derived | None
    vs_single_target: dict[str, SingleTarget]
    measured_stock_forward_seconds: Seconds


class SiteName(_Model):
    expert: Literal[EXPERTS] | None
    block: Count
    kind: Literal[KINDS]
    step: Count | None


class HoldoutSummary(_Model):
    prompts: list[str]
    quantized_sites: Count
    sites_over_budget: Count
    over_budget: list[SiteName]
    median_error_ratio_holdout_to_calibration: Derived | None
    max_error_ratio_holdout_to_calibration: Derived | None
    sites_not_seen: Count


class Pair(SiteName):
    attention_rel_l2: Error
    output_rel_l2: Error


class Propagation(_Model):
    target: str | None
    pairs: list[Pair]
    spearman: Correlation | None = None
    median_gain_output_per_attention: Derived | None = None
    gain_spread_max_over_min: Derived | None = None

    @model_validator(mode="after")
    def _target_of_pairs(self):
        if self.pairs and self.target is None:
            raise ValueError("target is null, but pairs were measured on one")
        return self


class CalibrationCost(_Model):
    seconds: Seconds
    peak_bytes: Count
    what: str
    peak_over_start_bytes: Count | None = None
    sites: Positive
    statistics_kept: Count


class ShapeRow(_Model):
    shape: Annotated[list[Positive], Field(min_length=4, max_length=4)]
    masked: bool
    calls: Positive
    stock_seconds: PositiveSeconds


class Measurements(_Model):
    shapes: Annotated[list[ShapeRow], Field(min_length=1)]
    forward_seconds: PositiveSeconds
    forwards: Positive


class Statistics(_Model):
    calls: Positive
    rel_l2: dict[str, Error]
    cosine: dict[str, Cosine]
    refused: dict[str, str]
    density: dict[str, Density | None]
    #: a block-sparse candidate's worst kept mass: the least exact attention mass a query tile's
    #: sampled rows kept in any of the site's calls (its check), 0 to 1
    kept: dict[str, Density] = {}

    @model_validator(mode="after")
    def _paired(self):
        if set(self.rel_l2) != set(self.cosine):
            odd = sorted(set(self.rel_l2) ^ set(self.cosine))
            raise ValueError(f"rel_l2 and cosine name different candidates ({', '.join(odd)} in one only)")
        for name in ("density", "kept"):
            dense = [t for t in getattr(self, name) if split_target(t)[1] is None]
            if dense:
                raise ValueError(f"{name}: {', '.join(dense)} is not a block-sparse candidate")
        return self


class Site(SiteName, Statistics):
    shape: Annotated[list[Positive], Field(min_length=4, max_length=4)]
    chosen: str
    holdout: Statistics | None


#: a time a linear method saves per forward (ms): negative where it costs time
SavedMs = _number()


class LinearLayers(_Model):
    expert: Literal[EXPERTS] | None
    block: _whole(-1)
    kind: Literal[LINEAR_KINDS]


class LinearSummary(_Model):
    methods: Annotated[list[Literal[LINEAR_METHODS]], Field(min_length=1)]
    measured_by: dict[Literal[LINEAR_METHODS], str]
    reference: str
    rows_per_call: Positive
    compile: bool
    time_model: str
    unmeasured: list[LinearLayers]
    policy: LinearPolicy
    chosen: dict[Literal[LINEAR_METHODS], Count]
    saved_ms_per_forward: SavedMs

    @model_validator(mode="after")
    def _methods(self):
        if self.methods[0] != "bf16":
            raise ValueError(f"methods: bf16 (the reference every site can keep) comes first, got {self.methods[0]}")
        missing = sorted(set(self.methods) - set(self.measured_by))
        if missing:
            raise ValueError(f"measured_by: no entry for {missing[0]}")
        return self


class LinearSite(_Model):
    expert: Literal[EXPERTS] | None
    block: Count
    kind: Literal[LINEAR_BLOCK_KINDS]
    layers: Annotated[list[str], Field(min_length=1)]
    calls: Count
    rel_l2: dict[Literal[LINEAR_METHODS], Error]
    worst_layer: dict[Literal[LINEAR_METHODS], str]
    refused: dict[Literal[LINEAR_METHODS], str]
    time_saved_ms: dict[Literal[LINEAR_METHODS], SavedMs | None]
    time_source: dict[Literal[LINEAR_METHODS], Literal["measured", "table", "none"]]
    chosen: Literal[LINEAR_METHODS]

    @model_validator(mode="after")
    def _bf16_is_the_reference(self):
        if self.rel_l2.get("bf16", 0.0) != 0.0:
            raise ValueError(f"rel_l2.bf16: the reference's own error is 0, got {_num(self.rel_l2['bf16'])}")
        if set(self.time_saved_ms) != set(self.time_source):
            odd = sorted(set(self.time_saved_ms) ^ set(self.time_source))
            raise ValueError(f"time_saved_ms and time_source name different methods ({', '.join(odd)} in one only)")
        return self


class Replanned(_Model):
    from_: str = Field(alias="from")
    on: str
    measured_budget: Budget


def _no_holdout(v):
    return None if v == {} else v  # a report without hold-out prompts writes {}


def _candidate_name(v):
    if isinstance(v, str):
        from .candidates import as_target

        as_target(v)
    return v


def _fp16_backend(v):
    if isinstance(v, str) and v != "stock":
        from ..integration.backends import check_backend_name, is_exact

        check_backend_name(v)
        if not is_exact(v):
            raise ValueError(f"{v!r} quantizes: the fp16 tier is stock or an exact backend")
    return v


class CalibrationReport(_Model):
    """A calibration's ``report.json`` (:func:`~fp4video.calibration.report.build_report` writes it)."""

    model: ModelSummary
    prompts: Annotated[list[str], Field(min_length=1)]
    holdout_prompts: list[str]
    budget: Budget
    budget_text: str
    date: str
    device: str
    num_steps: Positive | None
    candidates: Annotated[list[Annotated[str, AfterValidator(_candidate_name)]], Field(min_length=1)]
    unavailable: dict[str, str]
    fp16_backend: Annotated[str, AfterValidator(_fp16_backend)]
    fp16_exact_backend: str | None
    costs: Costs
    chosen: dict[str, Count]
    prediction: Prediction
    holdout: Annotated[HoldoutSummary | None, BeforeValidator(_no_holdout)]
    propagation: Propagation
    calibration: CalibrationCost
    measurements: Measurements
    sites: Annotated[list[Site], Field(min_length=1)]
    replanned: Replanned | None = None
    linear: LinearSummary | None = None
    linear_sites: list[LinearSite] = []

    @model_validator(mode="after")
    def _holds_together(self):
        if "fp16" not in self.candidates:
            raise ValueError("candidates: fp16 (the stock tier every site can fall back to) is missing")
        twice = sorted({c for c in self.candidates if self.candidates.count(c) > 1})
        if twice:
            raise ValueError(f"candidates: {', '.join(twice)} listed twice")
        match = self.budget.match
        if match is not None:
            from .candidates import as_target, check_match

            try:
                as_target(match)
                check_match(self.budget)
            except ValueError as e:
                raise ValueError(f"budget.match: {e}") from None
            if match not in self.candidates and match not in self.unavailable:
                raise ValueError(f"budget.match: {match} is not among the candidates measured")
        shapes = {"x".join(map(str, row.shape)) for row in self.measurements.shapes}
        for t in self.candidates:
            row = self.costs.relative_to_stock.get(t)
            if row is None:
                raise ValueError(f"costs.relative_to_stock: no row for {t} (a candidate)")
            missing = sorted(shapes - set(row))
            if missing:
                raise ValueError(f"costs.relative_to_stock.{t}: no cost at {missing[0]} (a measured shape)")
        seen = {}
        known = set(self.candidates)
        # a re-chosen report keeps the statistics of the candidates it left out (listed as unavailable)
        measured = known | set(self.unavailable)
        for i, s in enumerate(self.sites):
            where = f"sites[{i}]"
            key = (s.expert, s.block, s.kind, s.step)
            if key in seen:
                raise ValueError(f"{where}: the same site as sites[{seen[key]}] (expert {s.expert}, block {s.block}, "
                                 f"kind {s.kind}, step {s.step})")
            seen[key] = i
            shape = "x".join(map(str, s.shape))
            if shape not in shapes:
                raise ValueError(f"{where}.shape: {shape} is not among measurements.shapes "
                                 f"({', '.join(sorted(shapes))})")
            if s.step is not None and self.num_steps is None:
                raise ValueError(f"{where}.step: {s.step}, but num_steps is null (a run without denoising steps)")
            if s.step is None and self.num_steps is not None:  # a policy's step rules could not tell it apart
                raise ValueError(f"{where}.step: null, but num_steps is {self.num_steps} (every site of a run with a "
                                 "schedule has its step)")
            if s.step is not None and s.step >= self.num_steps:
                raise ValueError(f"{where}.step: {s.step} is not below num_steps {self.num_steps} (steps count from 0)")
            for part, stats in (("", s), (".holdout", s.holdout)):
                if stats is None:
                    continue
                for field in ("rel_l2", "refused", "density", "kept"):
                    odd = sorted(set(getattr(stats, field)) - measured)
                    if odd:
                        raise ValueError(f"{where}{part}.{field}.{odd[0]}: neither a candidate nor an unavailable one")
                exact = sorted(t for t in stats.rel_l2 if is_exact_target(t))
                if exact:
                    raise ValueError(f"{where}{part}.rel_l2.{exact[0]}: an exact target has no error to measure")
            if s.chosen not in measured:
                raise ValueError(f"{where}.chosen: {s.chosen!r} is neither a candidate nor an unavailable one")
        self._linear_holds_together()
        return self

    def _linear_holds_together(self):
        if self.linear is None:
            if self.linear_sites:
                raise ValueError("linear_sites: given without the linear section that says how they were measured")
            return
        methods = set(self.linear.methods)
        seen = {}
        for i, s in enumerate(self.linear_sites):
            where = f"linear_sites[{i}]"
            key = (s.expert, s.block, s.kind)
            if key in seen:
                raise ValueError(f"{where}: the same linear site as linear_sites[{seen[key]}] (expert {s.expert}, "
                                 f"block {s.block}, kind {s.kind})")
            seen[key] = i
            for name in ("rel_l2", "worst_layer", "refused", "time_saved_ms"):
                odd = sorted(set(getattr(s, name)) - methods)
                if odd:
                    raise ValueError(f"{where}.{name}.{odd[0]}: not among linear.methods")
            if s.chosen not in methods:
                raise ValueError(f"{where}.chosen: {s.chosen} is not among linear.methods")
            given = self.linear.policy.method_for(expert=s.expert, block=s.block, kind=s.kind)
            if given != s.chosen:
                raise ValueError(f"{where}.chosen: {s.chosen}, but linear.policy gives the site {given}")


def _got(value) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


#: pydantic's error types -> what the field must be
_MUST_BE = {
    "dict_type": "an object ({...})", "model_type": "an object ({...})", "model_attributes_type": "an object ({...})",
    "list_type": "a list ([...])", "tuple_type": "a list ([...])", "int_type": "a whole number",
    "float_type": "a number", "string_type": "a string", "bool_type": "true or false",
    "literal_error": None, "too_short": None, "too_long": None,
}


def _path(loc) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + str(part)
    return text


def _describe(e: dict) -> str:
    kind, value = e["type"], e.get("input")
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "not a field of a calibration report"
    if kind == "value_error":
        return e["msg"].removeprefix("Value error, ")
    if kind in ("too_short", "too_long"):
        n = (e.get("ctx") or {}).get("min_length" if kind == "too_short" else "max_length")
        return (f"must hold {'at least' if kind == 'too_short' else 'at most'} {n} {'entry' if n == 1 else 'entries'}, "
                f"got {_got(value)}")
    bound = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bound:
        limit = next(iter((e.get("ctx") or {}).values()), "")
        return f"must be {bound[kind]} {limit}, got {_got(value)}"
    if kind == "finite_number":
        return f"must be finite, got {_got(value)}"
    if kind == "literal_error":
        return f"must be one of {(e.get('ctx') or {}).get('expected', '')}, got {_got(value)}"
    must = _MUST_BE.get(kind)
    if must is not None:
        return f"must be {must}, got {_got(value)}"
    return f"{e['msg']}, got {_got(value)}"


def _one_line(err: ValidationError) -> str:
    errors = err.errors()
    first = errors[0]
    path = _path(first["loc"])
    text = f"{path}: {_describe(first)}" if path else _describe(first)
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def validate_report(data) -> CalibrationReport:
    """``data`` (report.json's content) as a :class:`CalibrationReport`, or a :class:`ReportError`
    naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise ReportError(f"not a calibration report (a JSON {type(data).__name__}, not an object)")
    missing = [name for name, f in CalibrationReport.model_fields.items() if f.is_required() and name not in data]
    if missing == ["measurements"]:
        raise ReportError("this report has no measurements section (written by an older fp4video): calibrate again")
    if len(missing) > len(CalibrationReport.model_fields) // 2:
        raise ReportError(f"not a calibration report (no {', '.join(repr(m) for m in missing[:3])}, ... in it)")
    try:
        return CalibrationReport.model_validate(data)
    except ValidationError as e:
        raise ReportError(_one_line(e)) from None
    except RecursionError:
        raise ReportError("nested too deeply") from None


def load_report(path) -> CalibrationReport:
    """The report in the file ``path``, validated; a :class:`ReportError` naming the file's problem."""
    from pathlib import Path

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ReportError(f"cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ReportError(f"not a calibration report (not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start})") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"not a calibration report (not JSON: {e.msg} at line {e.lineno} column {e.colno})") \
            from None
    except RecursionError:
        raise ReportError("not a calibration report (nested too deeply)") from None
    return validate_report(data)
