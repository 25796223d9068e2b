"""Policies that carry block sparsity: a rule (or the default) names a method plus a dynamic or
static selection; the calls it matches run on that selection (the static window on the latent grid
of the transformer's input), record the selection and its density, and equal the dense policy when
the selection keeps every tile; what cannot take a selection is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fp4video import Policy, install, uninstall

pytest.importorskip("diffusers")
from fp4video.integration.tiny import TINY_SIZES, tiny_wan_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def pipe():
    return tiny_wan_pipeline(two_experts=False, seed=5)


def run(pipe, steps=2):
    return pipe(prompt="a cat", negative_prompt="", height=TINY_SIZES["height"], width=TINY_SIZES["width"],
                num_frames=TINY_SIZES["frames"], num_inference_steps=steps, guidance_scale=4.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames[0]


def generate(pipe, policy, steps=2):
    ctx = install(pipe, Policy.model_validate(policy))
    try:
        return run(pipe, steps), ctx.recorded_calls()
    finally:
        uninstall(pipe)


def test_a_selection_keeping_every_tile_is_the_dense_policy_and_calls_record_it(pipe):
    dense, _ = generate(pipe, {"method": "mxattn"})
    sparse, calls = generate(pipe, {"method": "mxattn", "sparsity": {"dynamic": {"tau": 1.0}}})
    assert (sparse == dense).all()
    assert calls and all(c["sparsity"] == "dynamic τ=1" and c["density"] == 1.0 for c in calls)


def test_a_static_window_runs_on_the_latent_grid_outside_the_dense_rules(pipe):
    """Self attention block-sparse on a one-frame window (the grid is the transformer input's),
    block 0 and cross attention dense; the recorded densities are the window's."""
    policy = {"method": "fp16", "rules": [
        {"method": "mxattn", "blocks": [0]},
        {"method": "mxattn", "kinds": ["self"], "sparsity": {"static": {"window": [0, 1, 1]}}}]}
    _, calls = generate(pipe, policy)
    sparse = [c for c in calls if "density" in c]
    assert sparse and all(c["block"] != 0 and c["kind"] == "self" and c["method"] == "mxattn" for c in sparse)
    assert all(c["sparsity"] == "static window [0, 1, 1]" and 0 < c["density"] < 1 for c in sparse)
    assert all("density" not in c for c in calls if c["block"] == 0 or c["kind"] == "cross")


def test_what_cannot_take_a_selection_follows_the_fallback_or_raises(pipe, monkeypatch):
    """A call whose latent grid the transformer's input does not give (here: read as unknown) cannot
    take a static window: under fallback error it raises naming the grid, under stock it runs stock."""
    from fp4video.integration import routing

    monkeypatch.setattr(routing, "latent_grid", lambda model, hidden_states: None)
    policy = {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self"],
                                             "sparsity": {"static": {"window": [0, 1, 1]}}}]}
    with pytest.raises(ValueError, match="a static window needs the latent grid"):
        generate(pipe, policy)
    _, calls = generate(pipe, {**policy, "fallback": "stock"})
    assert {c["method"] for c in calls if c["kind"] == "self"} == {"stock-fallback"}
    assert {c["method"] for c in calls if c["kind"] == "cross"} == {"mxattn"}


STATIC = {"static": {"window": [0, 1, 1]}}


@pytest.mark.parametrize("policy, message", [
    ({"method": "mxattn", "sparsity": STATIC},
     r"the policy's default \{method: mxattn, sparsity: static window \[0, 1, 1\]\}: its static window applies to "
     r"self and joint attention .* takes WanTransformer3DModel's cross attention \(keys from another sequence\) in "
     r"blocks 0-1, where it could never apply"),
    ({"method": "mxattn", "sparsity": STATIC, "fallback": "stock"}, r"the policy's default .* cross attention"),
    ({"method": "mxattn", "rules": [{"method": "fp16", "blocks": [0]}, {"method": "mxattn", "sparsity": STATIC}]},
     r"rules\[1\] \{method: mxattn, sparsity: static window \[0, 1, 1\]\}: .*cross attention .* in block 1,"),
    ({"method": "mxattn", "rules": [{"method": "fp16", "kinds": ["cross"], "steps": {"last": 1}}], "sparsity": STATIC},
     r"the policy's default .* cross attention .* in blocks 0-1"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 0.9, "neighbours": 1}}},
     r"the policy's default .*: its dynamic selection's neighbours 1 .* need as many queries as keys, but it takes "
     r"WanTransformer3DModel's cross attention"),
])
def test_sparsity_that_can_never_apply_to_calls_it_takes_is_refused_at_install(pipe, policy, message):
    """A static window (or the dynamic selection's band of neighbours) on calls that can never take
    it was accepted and failed at the first such call without naming the rule: refused at install,
    naming the rule or the default and the calls, with the pipeline left as it was."""
    try:
        with pytest.raises(ValueError, match=message):
            install(pipe, Policy.model_validate(policy))
        install(pipe, "mxattn")  # nothing was installed
    finally:
        uninstall(pipe)


@pytest.mark.parametrize("policy", [
    {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self"], "sparsity": STATIC}]},
    {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["cross"]}], "sparsity": STATIC},
    {"method": "mxattn", "rules": [{"method": "fp16", "kinds": ["cross"], "steps": {"fraction": [0, 1]}}],
     "sparsity": STATIC},
    {"method": "mxattn", "sparsity": {"dynamic": {"tau": 0.9}}},  # neighbours 0: a call's own tiles, where it has them
    {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["cross"], "sparsity": {"dynamic": {"tau": 0.9,
                                                                                            "neighbours": 0}}}]},
])
def test_sparsity_every_call_of_which_can_take_it_is_installed(pipe, policy):
    install(pipe, Policy.model_validate(policy))
    uninstall(pipe)


def test_what_a_call_space_shows_decides_which_sparse_rules_can_apply():
    """Policy.unfit_sparsity on calls of known shape: a static window refused on cross calls, on the
    attention outside the blocks and on a model whose latent grid is unknown; a rule taking only
    calls it can apply to, or calls earlier rules take at every step, passes."""
    from fp4video.integration.policy import CallSpace

    calls = {(None, b, k) for b in (-1, 0, 1) for k in ("self", "cross")}
    outside = "attention outside the blocks"
    space = CallSpace(calls=calls, steps_known=True, name="M",
                      cross=frozenset({(None, 0, "cross"), (None, 1, "cross")}),
                      no_window={(None, -1, "self"): outside, (None, -1, "cross"): outside})
    static = Policy(method="mxattn", sparsity=STATIC)
    (message,) = static.unfit_sparsity(space)
    assert message.startswith("the policy's default {method: mxattn, sparsity: static window [0, 1, 1]}: ")
    assert "M's attention outside the blocks and cross attention (keys from another sequence) in blocks 0-1," in message
    ruled = Policy(method="mxattn", rules=[
        {"method": "mxattn", "blocks": [0, 1], "kinds": ["self"], "sparsity": STATIC},
        {"method": "mxattn", "blocks": [1], "sparsity": STATIC}])
    (message,) = ruled.unfit_sparsity(space)
    assert message.startswith("rules[1] {method: mxattn, blocks: [1], sparsity: static window [0, 1, 1]}: ")
    assert "M's cross attention (keys from another sequence) in block 1," in message
    gridless = CallSpace(calls=calls, steps_known=True, name="M", no_window={c: "attention, whose latent grid is "
                                                                                "unknown" for c in calls})
    assert "M's attention, whose latent grid is unknown in blocks 0-1" in ruled.unfit_sparsity(gridless)[0]
    assert Policy(method="mxattn", rules=[{"method": "fp16", "blocks": [0, 1], "kinds": ["cross"]},
                                          {"method": "fp16", "kinds": ["cross", "self"], "blocks": [0, 1],
                                           "steps": {"last": 1}}],
                  sparsity={"dynamic": {"tau": 0.9, "neighbours": 3}}).unfit_sparsity(space) == []
    assert Policy(method="mxattn", sparsity={"dynamic": {"tau": 0.9, "neighbours": 3}}).unfit_sparsity(space)


def test_a_static_default_on_joint_attention_only_is_installed():
    """HunyuanVideo's blocks attend jointly over the latent grid and the text: a static default fits."""
    from fp4video.integration.tiny import tiny_hunyuan_pipeline

    hunyuan = tiny_hunyuan_pipeline()
    install(hunyuan, Policy(method="mxattn", sparsity=STATIC))
    uninstall(hunyuan)


@pytest.mark.parametrize("policy, message", [
    ({"method": "mxattn", "rules": [{"backend": "native", "sparsity": {"dynamic": {"tau": 0.9}}}]},
     "sparsity applies to an fp4video method"),
    ({"backend": "native", "sparsity": {"dynamic": {"tau": 0.9}}}, "sparsity applies to an fp4video method"),
    ({"method": "mxattn", "sparsity": {}}, "dynamic: {tau: ...}, static: {window: \\[f, y, x\\]} or both"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 1.5}}}, "less than or equal to 1"),
    ({"method": "mxattn", "sparsity": {"static": {"window": [1, -2, 2]}}}, "greater than or equal to 0"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 0.9, "windw": 1}}}, "windw"),
    ({"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["cross"], "sparsity": STATIC}]},
     r"rules.0\n.*kinds \['cross'\]: a static window applies to self and joint attention over the latent grid, not to "
     "cross attention"),
    ({"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self", "image"], "sparsity": STATIC}]},
     r"kinds \['image'\]: a static window .* not to image attention"),
    ({"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["cross"],
                                     "sparsity": {"dynamic": {"tau": 0.9, "neighbours": 2}}}]},
     r"sparsity.dynamic.neighbours 2 with kinds \['cross'\]: the band of key tiles .* needs as many queries as keys"),
    ({"method": "mxattn", "rules": [{"method": "fp16", "sparsity": STATIC}]},
     "sparsity applies to fp4video's quantized methods, not to fp16"),
    ({"method": "fp16", "sparsity": {"dynamic": {"tau": 0.9}}}, "the policy's default: sparsity applies to fp4video's "
     "quantized methods, not to fp16"),
])
def test_bad_sparsity_is_refused_when_the_policy_is_read(policy, message):
    with pytest.raises(ValidationError, match=message):
        Policy.model_validate(policy)


def test_sparse_calls_record_what_their_check_measured(pipe):
    """Every sparse call carries its check: kept mass (min, 1% quantile, mean), before repair, the
    repaired share and the rule's own density; a floor of 1 repairs every query tile to dense mass."""
    _, calls = generate(pipe, {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self"], "sparsity": {
        "static": {"window": [0, 1, 1]}, "sinks": True, "floor": 0.999}}]})
    sparse = [c for c in calls if "sparsity" in c]
    assert sparse and all(c["kind"] == "self" for c in sparse)
    for c in sparse:
        assert set(c) >= {"kept_min", "kept_q01", "kept_mean", "kept_min_before", "repaired", "density_before"}
        assert c["kept_min"] >= 0.998 and c["kept_min"] <= c["kept_q01"] <= c["kept_mean"] <= 1.0
        assert c["density"] >= c["density_before"]
        assert c["sparsity"] == "static window [0, 1, 1], sinks, floor 0.999"


def test_a_hybrid_of_a_window_and_a_dynamic_rule_installs_and_runs(pipe):
    _, calls = generate(pipe, {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self"], "sparsity": {
        "static": {"window": [0, 1, 1]}, "dynamic": {"topk": 0.2, "estimate": "sampled"}}}]})
    sparse = [c for c in calls if "sparsity" in c]
    assert sparse and all(c["sparsity"] == "static window [0, 1, 1] ∪ dynamic top-k 0.2 sampled" for c in sparse)


def test_a_dynamic_rule_with_the_covering_estimate_installs_and_runs(pipe):
    _, calls = generate(pipe, {"method": "mxattn", "rules": [{"method": "mxattn", "kinds": ["self"], "sparsity": {
        "dynamic": {"tau": 0.9, "estimate": "covering", "estimate_rows": 3}, "sinks": True}}]})
    sparse = [c for c in calls if "sparsity" in c]
    assert sparse and all(c["sparsity"] == "dynamic τ=0.9 covering, sinks" for c in sparse)
    assert all(0 < c["density"] <= 1 and 0 <= c["kept_min"] <= 1 for c in sparse)


@pytest.mark.parametrize("bad, field", [({"dynamic": {}}, "tau"), ({"dynamic": {"tau": 0.9}, "floor": 1.5}, "floor"),
                                        ({"dynamic": {"tau": 0.9}, "sinks": 1}, "sinks"),
                                        ({"dynamic": {"tau": 0.9, "estimate": "exact"}}, "estimate"),
                                        ({"dynamic": {"tau": 0.9}, "check_rows": 0}, "check_rows"), ({}, "or both")])
def test_bad_checks_and_estimates_are_refused_when_read(bad, field):
    with pytest.raises(ValidationError, match=field):
        Policy.model_validate({"method": "mxattn", "sparsity": bad})
