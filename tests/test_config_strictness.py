"""One strictness for YAML, the command line and the Python API: every field of the run config and
the policy takes values of its own type only (an integer field no boolean, float or string of
digits; a number field no boolean, string, nan or inf; a text field no number; a flag no 0 / 1),
and a wrong one is a ConfigError in one line naming the file and the field. Policy matching refuses
a schedule of no steps; pydantic's reasons reach the command line's one-line errors."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from fp4video.cli.common import one_line
from fp4video.integration.linear import LinearPolicy, LinearRule
from fp4video.integration.config import ConfigError, ParallelSettings, RunConfig, load_config
from fp4video.integration.policy import (DynamicSelection, Fallback, Policy, Rule, Sparsity, StaticSelection,
                                         StepRange)

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=20, deadline=None)

#: Each model: where it sits in a run config (the path's field names, as an error names them), how
#: a run config holds a document of it, and valid documents of it (each field in one at least).
PLACES = {
    RunConfig: ("", lambda d: d, [{}]),
    ParallelSettings: ("parallel.", lambda d: {"parallel": d}, [{}]),
    Policy: ("policy.", lambda d: {"policy": d}, [{}, {"backend": "native"}]),
    Rule: ("policy.rules[0].", lambda d: {"policy": {"rules": [d]}}, [{"method": "fp16"}, {"backend": "native"}]),
    StepRange: ("policy.rules[0].steps.", lambda d: {"policy": {"rules": [{"method": "fp16", "steps": d}]}},
                [{"first": 1}, {"last": 1}, {"range": [0, 2]}, {"fraction": [0, 0.5]}]),
    Fallback: ("policy.fallback.", lambda d: {"policy": {"fallback": d}}, [{"method": "fp16"}, {"backend": "native"}]),
    Sparsity: ("policy.sparsity.", lambda d: {"policy": {"sparsity": d}},
               [{"dynamic": {"tau": 0.5}}, {"static": {"window": [1, 1, 1]}}]),
    DynamicSelection: ("policy.sparsity.dynamic.", lambda d: {"policy": {"sparsity": {"dynamic": d}}}, [{"tau": 0.5}]),
    StaticSelection: ("policy.sparsity.static.", lambda d: {"policy": {"sparsity": {"static": d}}},
                      [{"window": [1, 1, 1]}]),
    LinearPolicy: ("linear.", lambda d: {"linear": d}, [{}, {"method": "mxfp8", "rules": [{"method": "bf16"}],
                                                              "compile": True, "emulate": True, "originals": "device"}]),
    LinearRule: ("linear.rules[0].", lambda d: {"linear": {"rules": [d]}},
                 [{"method": "fp8-rowwise", "blocks": [0], "kinds": ["ffn"], "experts": ["low_noise"]}]),
}
FIELDS = [(model, name) for model in PLACES for name in model.model_fields]


def test_every_model_of_a_run_config_is_covered():
    """The models the strictness property walks are every fp4video model a run config holds."""
    found, todo = set(), [RunConfig]
    while todo:
        model = todo.pop()
        found.add(model)
        for f in model.model_fields.values():
            todo += [m for m in _models_in(f.annotation) if m not in found]
    assert found == set(PLACES)


def _models_in(annotation) -> list:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _strip(annotation):
    """(the annotation without Annotated and None, whether None is allowed)."""
    optional = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            optional |= len(args) < len(typing.get_args(annotation))
            if len(args) != 1:
                return typing.Union[tuple(args)], optional
            annotation = args[0]
        else:
            return annotation, optional


BOOLS = st.booleans()
NUMBER_TEXT = st.integers(-10**6, 10**6).map(str) | st.floats(-1e6, 1e6).map(repr)
TEXT = st.text(max_size=8)
INTS = st.integers(-10**6, 10**6)
#: floats, integral ones often (480.0 is not an int either, and a multiple of 16)
FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 64).map(lambda n: 16.0 * n)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
LISTS = st.lists(INTS, max_size=2)
MAPPINGS = st.dictionaries(st.sampled_from(["a", "b"]), INTS, min_size=1, max_size=2)


def wrong_values(annotation) -> st.SearchStrategy:
    """YAML values of every type ``annotation`` does not take."""
    t, optional = _strip(annotation)
    null = st.nothing() if optional else st.none()
    origin = typing.get_origin(t)
    if t is bool:
        return INTS | FLOATS | NON_FINITE | TEXT | LISTS | MAPPINGS | null
    if t is int:
        return BOOLS | NUMBER_TEXT | TEXT | FLOATS | NON_FINITE | LISTS | MAPPINGS | null
    if t is float:
        return BOOLS | NUMBER_TEXT | TEXT | NON_FINITE | LISTS | MAPPINGS | null
    if t is str:
        return BOOLS | INTS | FLOATS | NON_FINITE | LISTS | MAPPINGS | null
    if origin is typing.Literal:
        allowed = set(typing.get_args(t))
        return BOOLS | INTS | FLOATS | NON_FINITE | TEXT.filter(lambda s: s not in allowed) | LISTS | MAPPINGS | null
    scalars = BOOLS | INTS | FLOATS | NON_FINITE | TEXT
    if origin is list:
        (item,) = typing.get_args(t)
        return scalars | MAPPINGS | null | wrong_values(item).map(lambda v: [v])
    if origin is tuple:
        items = typing.get_args(t)
        return scalars | MAPPINGS | null | st.integers(0, len(items) - 1).flatmap(
            lambda i: wrong_values(items[i]).map(lambda v: [*(_valid(a) for a in items[:i]), v,
                                                             *(_valid(a) for a in items[i + 1:])]))
    if isinstance(t, type) and issubclass(t, BaseModel):
        return scalars | LISTS | null
    # the policy's fallback: a name (a Literal) or a mapping (Fallback)
    names = {a for arg in typing.get_args(t) if typing.get_origin(_strip(arg)[0]) is typing.Literal
             for a in typing.get_args(_strip(arg)[0])}
    return BOOLS | INTS | FLOATS | NON_FINITE | TEXT.filter(lambda s: s not in names) | LISTS | null


def _valid(annotation):
    t, _ = _strip(annotation)
    return 0.5 if t is float else 1


def _base(model, name) -> dict:
    """A valid document of ``model`` holding field ``name`` (when a valid one does)."""
    docs = PLACES[model][2]
    return next((d for d in docs if name in d), docs[0])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("configs")


@pytest.mark.parametrize("model, name", FIELDS, ids=[f"{m.__name__}.{n}" for m, n in FIELDS])
def test_values_of_a_wrong_type_are_refused_naming_the_field(folder, model, name):
    """For every field, YAML values of each wrong type: a ConfigError whose one line names the file
    and the field (and the Python API refuses the same mapping)."""
    prefix, place, _ = PLACES[model]
    path = folder / f"{model.__name__}.{name}.yaml"
    base = _base(model, name)
    path.write_text(yaml.safe_dump(place(base)))
    load_config(path)  # the document the wrong values go into is valid

    @FAST
    @given(value=wrong_values(model.model_fields[name].annotation))
    def check(value):
        doc = place({**base, name: value})
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError) as e:
            load_config(path)
        message = str(e.value)
        assert "\n" not in message, message
        assert message.startswith(f"{path}: {prefix}{name}"), message
        assert message[len(f"{path}: {prefix}{name}")] in ":[.", message
        with pytest.raises(ValidationError):
            RunConfig.model_validate(yaml.safe_load(path.read_text()))

    check()


@pytest.mark.parametrize("text, field", [
    ("tau: true", "tau"), ("tau: '0.5'", "tau"), ("steps: '4'", "steps"), ("steps: true", "steps"),
    ("steps: 4.0", "steps"), ("guidance_scale: .inf", "guidance_scale"), ("seed: false", "seed"),
    ("parallel: {ring_degree: '2'}", "parallel.ring_degree"), ("height: 480.0", "height"),
])
def test_yaml_values_are_not_coerced(tmp_path, text, field):
    """The examples of the defect: each once coerced (``tau: true`` read as τ = 1, dense)."""
    if text.startswith("tau"):
        text, field = f"policy: {{sparsity: {{dynamic: {{{text}}}}}}}", f"policy.sparsity.dynamic.{field}"
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}: {field.replace('.', '[.]')}: "):
        load_config(path)


def test_an_int_is_a_number_and_values_of_the_right_type_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("guidance_scale: 5\npolicy: {sparsity: {dynamic: {tau: 1, min_similarity: 0}},"
                    " rules: [{method: fp16, steps: {fraction: [0, 1]}}]}\n")
    cfg = load_config(path)
    assert cfg.guidance_scale == 5.0 and isinstance(cfg.guidance_scale, float)
    assert cfg.policy.sparsity.dynamic.tau == 1.0 and cfg.policy.rules[0].steps.fraction == (0.0, 1.0)


def test_the_fallback_of_a_wrong_type_is_one_error_naming_the_field(tmp_path):
    """The fallback is a name or a mapping: a value of neither kind is one line, not one per form."""
    path = tmp_path / "c.yaml"
    for value, reason in (("5", "error, stock or a mapping"), ("sometimes", "'error' or 'stock'"),
                          ("{method: nope}", "unknown method 'nope'"), ("{methd: fp16}", "allowed: backend, method")):
        path.write_text(f"policy: {{fallback: {value}}}\n")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: policy.fallback"), str(e.value)
        assert reason in str(e.value) and "function-after" not in str(e.value) and "literal[" not in str(e.value)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_a_config_dumps_to_a_mapping_that_loads_back(path, tmp_path):
    """Every shipped config, and one whose policy's default is a backend, through model_dump (what
    the command line's overrides re-validate) and through YAML."""
    cfg = load_config(path)
    assert RunConfig.model_validate(cfg.model_dump()) == cfg
    out = tmp_path / "again.yaml"
    out.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(out) == cfg


def test_a_policy_whose_default_is_a_backend_dumps_to_a_mapping_that_loads_back():
    """The dump of a backend default carried ``method: mxattn`` beside ``backend``, which is refused."""
    cfg = RunConfig(policy=Policy(backend="native", fallback={"method": "fp16"}))
    assert RunConfig.model_validate(cfg.model_dump()) == cfg
    assert "method" not in cfg.policy.model_dump() and Policy.model_validate(cfg.policy.model_dump()) == cfg.policy


# --- a schedule of no steps -----------------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [0, -3, True, 2.0])
def test_a_schedule_of_no_steps_is_refused_naming_num_steps(num_steps):
    """Matching with num_steps 0 divided by it (a fraction rule): now a ValueError naming num_steps."""
    policy = Policy(rules=[{"method": "fp16", "steps": {"fraction": [0.5, 1]}}])
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        policy.route_for(block=0, step=0, num_steps=num_steps, kind="self", expert=None)
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        StepRange(fraction=(0.5, 1)).contains(0, num_steps)
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        policy.step_warnings(num_steps)


def test_matching_follows_the_schedule_where_it_has_steps():
    policy = Policy(rules=[{"method": "fp16", "steps": {"fraction": [0.5, 1]}}])
    route = [policy.method_for(block=0, step=s, num_steps=4, kind="self", expert=None) for s in range(4)]
    assert route == ["mxattn", "mxattn", "fp16", "fp16"]
    assert policy.method_for(block=0, step=None, num_steps=None, kind="self", expert=None) == "mxattn"
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        policy.route_for(block=0, step=-1, num_steps=4, kind="self", expert=None)


def test_a_schedule_shorter_than_its_scheduler_order_leaves_the_step_unknown():
    """A scheduler of order 2 holding one timestep has no whole step (its schedule counts 0): the
    installed policy took num_steps 0 and divided by it at the first call; the step is unknown now,
    so step rules do not apply and the default runs."""
    import torch

    from fp4video import install, uninstall
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer()
    pipe = types.SimpleNamespace(transformer=model, scheduler=types.SimpleNamespace(
        timesteps=torch.tensor([500.0]), order=2))
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 1, 4, 4, generator=g), timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 4, 32, generator=g), return_dict=False)
    ctx = install(pipe, Policy(method="mxattn", rules=[{"method": "fp16", "steps": {"fraction": [0.5, 1]}}]))
    try:
        with torch.no_grad():
            model(**kw)
    finally:
        uninstall(pipe)
    calls = ctx.recorded_calls()
    assert calls and all(c["step"] is None and c["method"] == "mxattn" for c in calls)


# --- pydantic's reasons on the command line -------------------------------------------------------


def _pydantic_text(make) -> str:
    with pytest.raises(ValidationError) as e:
        make()
    return str(e.value)


def test_pydantic_text_in_a_message_keeps_its_reason_on_one_line():
    """A message carrying pydantic's own text (several lines, ending in a link to its documentation)
    is one line keeping each error's location and reason, not the link."""
    text = _pydantic_text(lambda: Sparsity(dynamic={"tau": 2.0}))
    line = one_line(f"sparse candidate 'dynamic:2': {text}")
    assert line == "sparse candidate 'dynamic:2': dynamic.tau: Input should be less than or equal to 1 (got 2.0)"
    text = _pydantic_text(lambda: Policy(method="nope", rules=[{"method": "fp16", "blocks": [-1]}]))
    line = one_line(text)
    assert "unknown method 'nope'" in line and "rules.0.blocks: block indices count from 0" in line
    assert "further information" not in line and "validation error" not in line and "\n" not in line
    assert one_line(_pydantic_text(lambda: Policy(method="fp16", backend="native"))) == \
        "give method or backend as the default, not both"
    assert one_line("first\n  second\nthird") == "first; second; third"
    assert one_line("--from r.json: 1 validation error for Budget") == "--from r.json: 1 validation error for Budget"


def test_the_cli_names_the_file_the_field_and_pydantics_reason(tmp_path, capsys):
    from fp4video.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text("steps: true\npolicy: {sparsity: {dynamic: {tau: .inf}}}\n")
    assert main(["generate", "--config", str(path), "--output", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "further information" not in err
    assert f"{path}: steps: Input should be a valid integer" in err
    assert f"{path}: policy.sparsity.dynamic.tau: Input should be a finite number" in err
