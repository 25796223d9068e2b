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


def test_what_cannot_take_a_selection_follows_the_fallback_or_raises(pipe):
    static = {"static": {"window": [0, 1, 1]}}
    with pytest.raises(ValueError, match="static window applies to self and joint attention, not to cross"):
        generate(pipe, {"method": "mxattn", "sparsity": static})
    _, calls = generate(pipe, {"method": "mxattn", "sparsity": static, "fallback": "stock"})
    assert {c["method"] for c in calls if c["kind"] == "cross"} == {"stock-fallback"}
    assert all("density" in c for c in calls if c["kind"] == "self")


@pytest.mark.parametrize("policy, message", [
    ({"method": "mxattn", "rules": [{"backend": "native", "sparsity": {"dynamic": {"tau": 0.9}}}]},
     "sparsity applies to an fp4video method"),
    ({"backend": "native", "sparsity": {"dynamic": {"tau": 0.9}}}, "sparsity applies to an fp4video method"),
    ({"method": "mxattn", "sparsity": {}}, "exactly one of dynamic"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 0.9}, "static": {"window": [1, 2, 2]}}},
     "exactly one of dynamic"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 1.5}}}, "less than or equal to 1"),
    ({"method": "mxattn", "sparsity": {"static": {"window": [1, -2, 2]}}}, "greater than or equal to 0"),
    ({"method": "mxattn", "sparsity": {"dynamic": {"tau": 0.9, "windw": 1}}}, "windw"),
])
def test_bad_sparsity_is_refused_when_the_policy_is_read(policy, message):
    with pytest.raises(ValidationError, match=message):
        Policy.model_validate(policy)
