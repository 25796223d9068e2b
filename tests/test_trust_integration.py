"""What `fp4video.install` promises about its own state and about the policies it takes, on the tiny
offline models: one installation per transformer whatever the handle (pipelines sharing a
transformer, bare transformers), uninstall in any order back to the stock model bit for bit;
policy rules that can never match refused (by the policy alone, or on the model installed);
config YAML read strictly (a key given twice at any depth, deep nesting, directories, non-UTF-8);
the policy, backend and block indices checked when given, not at the first attention call."""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings

import pytest
import torch

pytest.importorskip("diffusers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp4video.integration import FP4Processor, Policy, install, uninstall  # noqa: E402
from fp4video.integration import routing  # noqa: E402
from fp4video.integration.config import ConfigError, load_config, read_yaml_mapping  # noqa: E402
from fp4video.integration.policy import EXPERTS, KINDS  # noqa: E402
from fp4video.integration.tiny import (tiny_wan_transformer, tiny_hunyuan_transformer, tiny_wan_i2v_pipeline,  # noqa: E402
                                       tiny_wan_pipeline)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _wan_inputs(in_channels=16, text=4, image=None):
    """A tiny Wan transformer's inputs: 4 video tokens (one latent frame of 4 x 4, patches of 2 x 2)."""
    kw = dict(hidden_states=_rand(1, in_channels, 1, 4, 4), timestep=torch.tensor([500.0]),
              encoder_hidden_states=_rand(1, text, 32, seed=1), return_dict=False)
    if image:
        kw["encoder_hidden_states_image"] = _rand(1, image, 16, seed=2)
    return kw


def _hunyuan_inputs():
    return dict(hidden_states=_rand(1, 4, 1, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=_rand(1, 6, 16, seed=1),
                encoder_attention_mask=torch.ones(1, 6), pooled_projections=_rand(1, 8, seed=2),
                guidance=torch.tensor([3500.0]), return_dict=False)


def _forward(model, kw):
    with torch.no_grad():
        return model(**kw)[0]


def _stock_state(model):
    """Each attention processor's backend attribute (and whether it is on the instance), and the
    number of forward hooks of each module: what install changes and uninstall must restore."""
    procs = {n: (getattr(p, "_attention_backend", None), "_attention_backend" in vars(p))
             for n, p in model.attn_processors.items()}
    hooks = {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}
    return procs, hooks


def _stack_is_empty():
    return not routing.call_stack()


def _assert_backend_refuses_outside_install():
    """The fp4video_policy backend called with no routed module running raises (no stale entry)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="outside an attention module"):
        dispatch_attention_fn(q, q, q, backend=routing.register_routing_backend())


# --- one installation per transformer, whatever the handle -------------------------------------------


@pytest.fixture(scope="module")
def shared():
    """A two-expert Wan2.2 pipeline A and a one-transformer pipeline B sharing A's first transformer."""
    from diffusers import WanPipeline

    a = tiny_wan_pipeline(two_experts=True, head_dim=32)
    b = WanPipeline(tokenizer=a.tokenizer, text_encoder=a.text_encoder, vae=a.vae, scheduler=a.scheduler,
                    transformer=a.transformer)
    kw = _wan_inputs()
    stock = {id(m): _forward(m, kw) for m in (a.transformer, a.transformer_2)}
    state = {id(m): _stock_state(m) for m in (a.transformer, a.transformer_2)}
    return a, b, kw, stock, state


def _models_of(handle, a):
    if isinstance(handle, torch.nn.Module):
        return [handle]
    return [m for m in (handle.transformer, getattr(handle, "transformer_2", None)) if m is not None]


def test_installing_a_transformer_twice_through_any_handle_then_uninstalling_all_restores_stock(shared):
    """One transformer installed through two handles (the pipeline, then the bare transformer; or a
    second pipeline sharing it): after uninstalling every handle the output is the stock output bit
    for bit, every processor has its stock backend, no fp4video hook is left, the first context
    records no more calls and no stale routing entry lets the policy backend run outside a module."""
    a, b, kw, stock, state = shared
    t1 = a.transformer
    ctx = install(a, "mxattn")
    for other in (t1, b):
        with contextlib.suppress(RuntimeError):  # refused now; before, it routed t1 a second time
            install(other, "sage3")
        _forward(t1, kw)  # with t1 installed twice this left an entry on the routing stack
        _forward(a.transformer_2, kw)
        uninstall(other)
    uninstall(a)
    n_calls = len(ctx.calls)
    for model in (t1, a.transformer_2):
        assert torch.equal(_forward(model, kw), stock[id(model)])
        assert _stock_state(model) == state[id(model)]
        assert all(getattr(getattr(p, "_attention_backend", None), "value", None) != routing.BACKEND
                   for p in model.attn_processors.values())
    assert len(ctx.calls) == n_calls  # the uninstalled context records nothing more
    assert _stack_is_empty()
    _assert_backend_refuses_outside_install()


def test_second_install_on_an_installed_transformer_is_refused_and_changes_nothing(shared):
    """A transformer takes one installation: a second one through any handle (the same pipeline,
    the bare transformer, another pipeline sharing it) is refused with a message naming the handle
    that installed it, and the installed routing stays as it was."""
    a, b, kw, stock, state = shared
    ctx = install(a, "fp16")
    try:
        before = {id(m): _stock_state(m) for m in (a.transformer, a.transformer_2)}
        for handle in (a, a.transformer, a.transformer_2, b):
            with pytest.raises(RuntimeError, match=r"already installed on WanTransformer3DModel \(through WanPipeline\)"):
                install(handle, "mxattn")
            assert {id(m): _stock_state(m) for m in (a.transformer, a.transformer_2)} == before
        assert torch.equal(_forward(a.transformer, kw), stock[id(a.transformer)])  # still fp16 = stock
        assert {c["method"] for c in ctx.calls} == {"fp16"}
    finally:
        uninstall(a)
    # uninstall through another handle restores the transformer it shares
    install(b, "mxattn")
    uninstall(a.transformer)
    assert _stock_state(a.transformer) == state[id(a.transformer)]
    install(a.transformer, "mxattn")
    uninstall(b)
    assert _stock_state(a.transformer) == state[id(a.transformer)]


def test_a_processor_shared_by_two_transformers_gets_its_stock_backend_back():
    """Two transformers (the experts) sharing one processor instance: fp16 through it reaches the
    stock backend (not the policy backend again), and uninstall gives it its stock backend."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    pipe = tiny_wan_pipeline(two_experts=True, head_dim=32)
    proc = WanAttnProcessor()
    for model in (pipe.transformer, pipe.transformer_2):
        model.set_attn_processor(proc)
    kw = _wan_inputs()
    stock = [_forward(m, kw) for m in (pipe.transformer, pipe.transformer_2)]
    install(pipe, "fp16")
    try:
        assert all(torch.equal(_forward(m, kw), s) for m, s in zip((pipe.transformer, pipe.transformer_2), stock))
    finally:
        uninstall(pipe)
    assert "_attention_backend" not in vars(proc) and proc._attention_backend is None
    assert all(torch.equal(_forward(m, kw), s) for m, s in zip((pipe.transformer, pipe.transformer_2), stock))


_OPS = st.lists(st.tuples(st.sampled_from(["install", "uninstall"]), st.integers(0, 3),
                          st.sampled_from(["fp16", "fp16", "fp16", "mxattn"])), min_size=1, max_size=6)


@settings(max_examples=12, **SETTINGS)
@given(ops=_OPS)
def test_random_install_uninstall_sequences_keep_the_routing_consistent(shared, ops):
    """Random install / uninstall sequences over two pipelines sharing a transformer and the bare
    transformers: after each step each transformer has exactly the installation the sequence gives
    it (or none), its processors and hooks are stock where it has none, its forward records only in
    its own installation's context (fp16: the stock output bit for bit) and the routing stack is
    empty; after uninstalling everything the output is the stock output bit for bit."""
    from fp4video.integration.install import installed_context

    a, b, kw, stock, state = shared
    handles = [a, b, a.transformer, a.transformer_2]
    models = [a.transformer, a.transformer_2]
    expected: dict[int, tuple] = {}  # id(model) -> (context, method)
    contexts = []
    try:
        for op, h, method in ops:
            handle = handles[h]
            mine = _models_of(handle, a)
            if op == "install":
                if any(id(m) in expected for m in mine):
                    with pytest.raises(RuntimeError, match="already installed"):
                        install(handle, method)
                else:
                    ctx = install(handle, method)
                    contexts.append(ctx)
                    expected.update({id(m): (ctx, method) for m in mine})
            else:
                uninstall(handle)
                for m in mine:
                    expected.pop(id(m), None)
            for model in models:
                want = expected.get(id(model))
                assert installed_context(model) is (want[0] if want else None)
                counts = [len(c.calls) for c in contexts]
                out = _forward(model, kw)
                grown = [i for i, c in enumerate(contexts) if len(c.calls) != counts[i]]
                assert _stack_is_empty()
                if want is None:
                    assert _stock_state(model) == state[id(model)] and grown == []
                    assert torch.equal(out, stock[id(model)])
                else:
                    assert [contexts[i] for i in grown] == [want[0]]
                    assert all(getattr(p._attention_backend, "value", None) == routing.BACKEND
                               for p in model.attn_processors.values())
                    assert torch.equal(out, stock[id(model)]) == (want[1] == "fp16")
    finally:
        for handle in handles:
            uninstall(handle)
    for model in models:
        assert _stock_state(model) == state[id(model)]
        assert torch.equal(_forward(model, kw), stock[id(model)])
    # (other tests' installations may stay routed: only these models' processors are checked)
    assert not any(routing.is_routed(p) for m in models for p in m.attn_processors.values())
    assert _stack_is_empty()
    _assert_backend_refuses_outside_install()


# --- rules that can never match -------------------------------------------------------------------


@pytest.mark.parametrize("rules, match", [
    ([{"method": "fp16", "blocks": []}], r"blocks: \[\] lists none, so the rule could never match"),
    ([{"method": "fp16", "kinds": []}], r"kinds: \[\] lists none"),
    ([{"method": "fp16", "experts": []}], r"experts: \[\] lists none"),
    ([{"method": "fp16", "steps": {"first": 0}}], r"first: 0 covers no denoising step"),
    ([{"method": "fp16", "steps": {"last": 0}}], r"last: 0 covers no denoising step"),
    ([{"method": "fp16", "steps": {"range": [3, 3]}}], r"range: \[3, 3\] covers no denoising step"),
    ([{"method": "fp16", "steps": {"fraction": [0.5, 0.5]}}], r"fraction: \[0.5, 0.5\] covers no denoising step"),
    ([{"method": "fp16"}, {"method": "sage3", "blocks": [0]}],
     r"rules\[1\] \{method: sage3, blocks: \[0\]\} can never match: every call it would take is taken first by "
     r"rules\[0\] \{method: fp16\}"),
    ([{"method": "fp16", "kinds": ["self"]}, {"method": "sage3", "kinds": ["cross", "image", "joint"]},
      {"method": "mxattn", "blocks": [3]}], r"rules\[2\] .* taken first by rules\[0\] .*, rules\[1\]"),
    ([{"method": "fp16", "steps": {"first": 5}}, {"method": "sage3", "steps": {"range": [1, 4]}}],
     r"rules\[1\] .* taken first by rules\[0\] \{method: fp16, steps: \{'first': 5\}\}"),
])
def test_rules_that_can_never_match_on_any_model_are_refused_by_the_policy(rules, match):
    """Empty lists, step ranges holding no step and rules whose every call an earlier rule takes can
    never match on any model: the policy refuses them, naming the rule and why."""
    with pytest.raises(ValueError, match=match):
        Policy.model_validate({"method": "mxattn", "rules": rules})


_STEP_OPTIONS = [None, {"first": 2}, {"first": 4}, {"last": 1}, {"last": 3}, {"range": [1, 3]}, {"range": [0, 2]},
                 {"fraction": [0.0, 0.5]}, {"fraction": [0.25, 0.5]}]


def _subset(items, none_weight=1):
    """None (the condition left out: every value) or a non-empty list of ``items``."""
    return st.one_of(*[st.none()] * none_weight,
                     st.lists(st.sampled_from(items), min_size=1, max_size=len(items), unique=True))


# conditions left out more often than not, so that earlier rules often take every call of later ones
_RULE = st.fixed_dictionaries({"method": st.sampled_from(["fp16", "sage3"]), "blocks": _subset([0, 1, 2], 2),
                               "kinds": _subset(list(KINDS), 2), "experts": _subset(list(EXPERTS), 2),
                               "steps": st.sampled_from([None] * len(_STEP_OPTIONS) + _STEP_OPTIONS)})


def _first_matches(rules) -> set:
    """Brute force: the indices of the rules that are the first to match some call, over blocks 0-3,
    every kind, each expert and none, schedules of 1 to 12 steps and an unknown step."""
    policy = Policy.model_construct(rules=rules)  # no validation: the reference reads the rules as given
    live = set()
    for n in range(1, 13):
        for block, kind, expert, step in itertools.product(range(4), KINDS, (*EXPERTS, None), (*range(n), None)):
            for i, r in enumerate(policy.rules):
                if r.matches(block=block, step=step, num_steps=n if step is not None else None, kind=kind, expert=expert):
                    live.add(i)
                    break
    return live


@settings(max_examples=30, **SETTINGS)
@given(raw=st.lists(_RULE, min_size=1, max_size=4))
def test_policies_refuse_exactly_the_rules_no_call_reaches(raw):
    """Generated rule lists: a rule the policy refuses is the first match of no call (brute force
    over blocks, kinds, experts and schedules); without step rules, every rule that is the first
    match of no call is refused."""
    from fp4video.integration.policy import Rule

    raw = [{k: v for k, v in r.items() if v is not None} for r in raw]
    rules = [Rule.model_validate(r) for r in raw]
    live = _first_matches(rules)
    try:
        Policy.model_validate({"rules": raw})
        refused = set()
    except ValueError as e:
        refused = {int(i) for i in re.findall(r"rules\[(\d+)\] \{[^}]*(?:\{[^}]*\}[^}]*)?\} can never match", str(e))}
        assert refused, str(e)
    assert not refused & live, (raw, refused, live)
    if not any("steps" in r for r in raw):
        assert refused == set(range(len(raw))) - live, (raw, refused, live)


@pytest.fixture(scope="module")
def families():
    """name -> (install handle, [(model, its inputs)], whether the step is known, the recorded
    (expert, block, kind) of every attention call of an fp16 forward of each model)."""
    wan22 = tiny_wan_pipeline(two_experts=True, head_dim=32)
    wan21 = tiny_wan_pipeline(two_experts=False, head_dim=32, seed=1)
    i2v = tiny_wan_i2v_pipeline(head_dim=32)
    hy = tiny_hunyuan_transformer(head_dim=32)
    out = {}
    for name, handle, models in (
            ("wan2.2 pipeline", wan22, [(wan22.transformer, _wan_inputs()), (wan22.transformer_2, _wan_inputs())]),
            ("wan2.1 pipeline", wan21, [(wan21.transformer, _wan_inputs())]),
            ("bare wan transformer", wan22.transformer, [(wan22.transformer, _wan_inputs())]),
            ("wan i2v pipeline", i2v, [(i2v.transformer, _wan_inputs(36, 512, image=5))]),
            ("bare hunyuanvideo transformer", hy, [(hy, _hunyuan_inputs())])):
        ctx = install(handle, "fp16")
        try:
            for model, kw in models:
                _forward(model, kw)
        finally:
            uninstall(handle)
        calls = {(c["expert"], c["block"], c["kind"]) for c in ctx.calls}
        out[name] = (handle, models, not isinstance(handle, torch.nn.Module), calls)
    return out


@pytest.mark.parametrize("name, rule, match", [
    ("wan2.1 pipeline", {"method": "fp16", "experts": ["low_noise"]},
     r"experts: WanPipeline has one transformer, so no call has an expert"),
    ("bare wan transformer", {"method": "fp16", "experts": ["high_noise"]},
     r"experts: installed on a bare WanTransformer3DModel, no call has an expert"),
    ("bare wan transformer", {"method": "fp16", "steps": {"last": 2}},
     r"steps: installed on a bare WanTransformer3DModel, no denoising step is known"),
    ("wan2.2 pipeline", {"method": "fp16", "kinds": ["image"]},
     r"kinds \['image'\]: WanTransformer3DModel makes no image attention calls \(its calls: cross, self\)"),
    ("wan2.1 pipeline", {"method": "fp16", "kinds": ["joint"]}, r"makes no joint attention calls"),
    ("bare hunyuanvideo transformer", {"method": "fp16", "kinds": ["image"]},
     r"HunyuanVideoTransformer3DModel makes no image attention calls"),
    ("wan i2v pipeline", {"method": "fp16", "kinds": ["joint"], "blocks": [1]}, r"makes no joint attention calls"),
])
def test_rules_that_cannot_match_on_the_model_are_refused_at_install(families, name, rule, match):
    """Expert rules without two experts, kinds the model's calls never have, step rules on a bare
    transformer: install refuses the policy naming the rule and why, and changes nothing."""
    from fp4video.integration.install import installed_context

    handle, models, _, _ = families[name]
    before = [_stock_state(m) for m, _ in models]
    with pytest.raises(ValueError, match=r"rules\[0\] .* can never match: .*" + match):
        install(handle, Policy.model_validate({"method": "mxattn", "rules": [rule]}))
    assert [_stock_state(m) for m, _ in models] == before
    assert all(installed_context(m) is None for m, _ in models)


def test_refiner_on_a_model_without_attention_outside_its_blocks_is_refused(families):
    """`refiner: true` quantizes the attention outside the blocks (HunyuanVideo's token refiner); on a
    model with none there it could never apply: refused, the model left as it was."""
    handle, models, _, _ = families["wan2.2 pipeline"]
    before = [_stock_state(m) for m, _ in models]
    with pytest.raises(ValueError, match=r"refiner: true .* WanTransformer3DModel's transformer blocks .* has none"):
        install(handle, Policy(refiner=True))
    assert [_stock_state(m) for m, _ in models] == before


@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_install_refuses_a_rule_exactly_when_no_call_of_the_model_can_match_it(families, data):
    """Generated rules over the tiny families (Wan2.2's two experts, one-transformer Wan, a bare
    transformer, Wan I2V's image calls, HunyuanVideo's joint calls): install refuses a rule only if
    no recorded attention call meets it (or it needs a step and none is known), and refuses every
    such rule whose kinds, experts or steps are what no call has (on HunyuanVideo, self and cross
    rules aside: its single-stream blocks cannot be told from their structure)."""
    name = data.draw(st.sampled_from(sorted(families)))
    handle, models, steps_known, calls = families[name]
    n_blocks = max(b for _, b, _ in calls) + 1
    rule = {k: v for k, v in data.draw(st.fixed_dictionaries({
        "method": st.just("sage3"), "blocks": _subset(list(range(n_blocks))), "kinds": _subset(list(KINDS)),
        "experts": _subset(list(EXPERTS)), "steps": st.sampled_from([None, {"last": 1}])})).items() if v is not None}
    policy = Policy.model_validate({"method": "fp16", "rules": [rule]})
    r = policy.rules[0]
    reachable = {c for c in calls if r.matches_call(*c)} and (steps_known or r.steps is None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            install(handle, policy)
            refused = False
        except ValueError as e:
            assert "rules[0]" in str(e) and "can never match" in str(e) and "\n" not in str(e)
            refused = True
    uninstall(handle)
    if refused:
        assert not reachable, (name, rule)
    loose = "hunyuan" in name and r.kinds is not None and set(r.kinds) & {"self", "cross"}
    if not reachable and not loose:
        assert refused, (name, rule)


# --- the config YAML ------------------------------------------------------------------------------


def test_a_key_given_twice_in_a_config_is_refused_not_overridden(tmp_path):
    """`rules:` twice (the last one `[]`) would run the default method everywhere without a word:
    a key given twice in one mapping, at any depth, is refused naming the key and both lines."""
    f = tmp_path / "twice.yaml"
    f.write_text("policy:\n  method: mxattn\n  rules:\n    - {method: fp16, blocks: [0]}\n  rules: []\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: not valid YAML: key 'rules' given twice in one mapping "
                                          r"\(first on line 3\).*\(line 5, column 3\)"):
        load_config(f)
    f.write_text("steps: 4\npolicy: {rules: [{method: fp16, steps: {last: 2, last: 3}}]}\n")
    with pytest.raises(ConfigError, match="key 'last' given twice"):
        load_config(f)


def _yaml_block(obj, indent=0) -> str:
    pad = " " * indent
    if isinstance(obj, list):  # pairs: a mapping written with its keys in order (duplicates kept)
        out = ""
        for k, v in obj:
            if isinstance(v, list):
                out += f"{pad}{k}:\n" + _yaml_block(v, indent + 2)
            else:
                out += f"{pad}{k}: {v}\n"
        return out
    return f"{pad}{obj}\n"


def _yaml_flow(obj) -> str:
    if isinstance(obj, list):
        return "{" + ", ".join(f"{k}: {_yaml_flow(v)}" for k, v in obj) + "}"
    return str(obj)


def _as_dict(obj):
    return {k: _as_dict(v) for k, v in obj} if isinstance(obj, list) else obj


def _nested(depth, dup_at, draw):
    """A mapping `depth` levels deep (as key-value pairs), a key repeated at level `dup_at` (None: no
    repeat), other keys distinct within each mapping."""
    keys = draw(st.lists(st.sampled_from("abcdefgh"), min_size=2, max_size=4, unique=True))
    inner = _nested(depth - 1, None if dup_at is None else dup_at - 1, draw) if depth > 1 else draw(st.integers(0, 9))
    pairs = [(keys[0], inner)] + [(k, draw(st.integers(0, 9))) for k in keys[1:]]
    if dup_at == 0:
        pairs.insert(draw(st.integers(1, len(pairs))), (draw(st.sampled_from(keys)), draw(st.integers(0, 9))))
    return pairs


@settings(max_examples=30, **SETTINGS)
@given(data=st.data(), depth=st.integers(1, 8), flow=st.booleans())
def test_duplicate_keys_are_refused_at_any_depth(tmp_path_factory, data, depth, flow):
    """Generated nested mappings (block or flow style): with a key repeated at a generated depth the
    loader refuses the file in one line naming the key; without one it reads the mapping as written."""
    dup_at = data.draw(st.one_of(st.none(), st.integers(0, depth - 1)))
    doc = _nested(depth, dup_at, data.draw)
    text = "top: " + _yaml_flow(doc) + "\n" if flow else "top:\n" + _yaml_block(doc, 2)
    f = tmp_path_factory.mktemp("dup") / "c.yaml"
    f.write_text(text)
    if dup_at is None:
        assert read_yaml_mapping(f) == {"top": _as_dict(doc)}
    else:
        with pytest.raises(ConfigError, match=r"key '[a-h]' given twice in one mapping") as e:
            read_yaml_mapping(f)
        assert "\n" not in str(e.value)


def test_merge_keys_still_override(tmp_path):
    """`<<: *base` then a key of base: YAML's override, not a key given twice."""
    f = tmp_path / "merge.yaml"
    f.write_text("base: &b {x: 1, y: 2}\nother: {<<: *b, x: 3}\n")
    assert read_yaml_mapping(f) == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}


@pytest.mark.parametrize("make, match", [
    (lambda p: p.mkdir(), r"is a directory, not a config file"),
    (lambda p: p.write_bytes(b"model: tiny\nprompts: ['caf\xe9']\n"), r"not UTF-8 text \(byte 0xe9 at offset 26\)"),
    (lambda p: p.write_text("a: " + "[" * 1000 + "]" * 1000 + "\n"), r"not valid YAML: nested deeper than 32 levels"),
    (lambda p: p.write_text("".join(f"{' ' * (2 * i)}k{i}:\n" for i in range(1000)) + " " * 2000 + "v\n"),
     r"not valid YAML: nested deeper than 32 levels"),
    (lambda p: p.write_text("- a\n- b\n"), r"expected a mapping of settings at the top level, got list"),
    (lambda p: p.write_text("just text\n"), r"expected a mapping of settings at the top level, got str"),
    (lambda p: p.write_text("# nothing\n"), r"the file is empty"),
    (lambda p: p.write_text("a: 1\n---\nb: 2\n"), r"not valid YAML: expected a single document"),
])
def test_unreadable_config_files_are_one_line_errors(tmp_path, make, match):
    """A directory, a non-UTF-8 file, 1,000-deep YAML (flow or block), a document that is not a
    mapping: each a ConfigError (a ValueError) in one line naming the file, not a traceback from
    inside the reader."""
    path = tmp_path / "c.yaml"
    make(path)
    with pytest.raises(ValueError, match=r"c\.yaml: " + match) as e:
        load_config(path)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)


def test_policy_module_does_not_import_the_run_config():
    """policy.py and config.py import in one direction only (config embeds the policy)."""
    import ast
    from pathlib import Path

    import fp4video.integration.policy as policy

    tree = ast.parse(Path(policy.__file__).read_text())
    imported = {f"{n.module or ''}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {f"{n.module}." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if "config" in m.split(".")}, imported


# --- arguments checked when given ---------------------------------------------------------------------


def test_install_checks_its_arguments_before_the_first_call():
    """A backend that does not exist (with `fallback: stock` too, which would only count it), a
    policy that is neither a Policy nor a method name, an unknown method name, a record flag that
    is not a bool: refused by install with one line, the model left as it was."""
    model = tiny_wan_transformer(0, 32)
    state = _stock_state(model)
    for policy in (Policy(method="mxattn"), Policy(method="mxattn", fallback="stock")):
        with pytest.raises(ValueError, match=r"backend must be one of auto, reference, triton, got 'bogus'"):
            install(model, policy, backend="bogus")
    with pytest.raises(TypeError, match=r"policy must be a fp4video Policy, a method name .* got int 3"):
        install(model, 3)
    with pytest.raises(TypeError, match=r"got dict .*Policy.model_validate\(mapping\)"):
        install(model, {"method": "fp16"})
    with pytest.raises(ValueError, match=r"unknown method 'mxfp5'"):
        install(model, "mxfp5")
    with pytest.raises(TypeError, match="record must be True or False"):
        install(model, "fp16", record="no")
    assert _stock_state(model) == state


def test_fp4processor_takes_a_method_name_as_its_policy():
    """FP4Processor(policy="mxattn") is FP4Processor(method="mxattn") (it used to fail at the first
    call); a policy of another type, a method and a context together are refused at construction."""
    from fp4video.integration import AttentionContext

    attn = tiny_wan_transformer(0, 32).blocks[0].attn1
    x = _rand(1, 32, 64)
    with torch.no_grad():
        by_policy = FP4Processor(policy="mxattn")(attn, x)
        by_method = FP4Processor(method="mxattn")(attn, x)
        stock = FP4Processor(policy="fp16")(attn, x)
    assert torch.equal(by_policy, by_method) and not torch.equal(by_policy, stock)
    with pytest.raises(TypeError, match="policy must be a fp4video Policy"):
        FP4Processor(policy=3)
    with pytest.raises(TypeError, match="method must be a method name"):
        FP4Processor(method=3)
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        FP4Processor(policy="nope")
    ctx = AttentionContext(policy=Policy())
    with pytest.raises(ValueError, match="give context, or method / policy, not both"):
        FP4Processor(method="sage3", context=ctx)
    with pytest.raises(ValueError, match="backend must be one of"):
        AttentionContext(policy=Policy(), backend="cuda")


@settings(max_examples=20, **SETTINGS)
@given(where=st.sampled_from(["blocks", "first", "last", "range", "fraction"]), value=st.booleans())
def test_booleans_are_not_block_indices_or_steps(where, value):
    """YAML's true / false where a rule takes numbers (block indices, step counts, ranges,
    fractions) are refused, not read as 1 / 0."""
    rule = {"method": "fp16"}
    if where == "blocks":
        rule["blocks"] = [value]
    elif where in ("first", "last"):
        rule["steps"] = {where: value}
    else:
        rule["steps"] = {where: [value, 1]}
    with pytest.raises(ValueError, match=r"valid (integer|number)"):
        Policy.model_validate({"rules": [rule]})
    with pytest.raises(ValueError, match="valid boolean"):
        Policy.model_validate({"refiner": "yes"})
