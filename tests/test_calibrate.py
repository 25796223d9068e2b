"""``fp4video.calibrate`` on tiny pipelines with sensitivity built in on purpose (a block whose K
has outlier channels with a large mean; denoising steps with sharp attention): it finds those
sites and keeps them in higher precision, the installed policy routes exactly as planned, and the
videos beat a site-blind policy of equal predicted cost; the measurements against independent
recomputations; the written outputs; the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

pytest.importorskip("diffusers")

from fp4video.calibration import Budget, Calibration, calibrate  # noqa: E402
from fp4video.calibration.measure import head_errors  # noqa: E402
from fp4video.calibration.plan import DEFAULT_RELATIVE_COST, SiteStats, choose, policy_for  # noqa: E402
from fp4video.calibration.report import spearman  # noqa: E402
from fp4video.eval.paired import paired_metrics  # noqa: E402
from fp4video.integration import Policy, install, uninstall  # noqa: E402
from fp4video.integration.tiny import (TINY_HUNYUAN_CALL, TINY_LTX_CALL, add_sensitivity, tiny_hunyuan_pipeline,  # noqa: E402
                                       tiny_ltx_pipeline, tiny_wan_pipeline)

CANDIDATES = ["fp16", "fp8", "mxattn-pv8", "mxattn"]
#: cheapest first by the default cost table: the tier a site without sensitivity takes
CHEAP, PRECISE = "mxattn-pv8", {"fp8", "fp16"}

WAN_CALL = dict(negative_prompt="", height=48, width=64, num_frames=5, num_inference_steps=4, guidance_scale=4.0,
                max_sequence_length=16)
# (a non-empty negative prompt: the tiny tokenizer adds no end token, so "" would leave the text
# mask with no key, where diffusers' additive mask averages every key and fp4video returns zeros)
HUNYUAN_CALL = dict(TINY_HUNYUAN_CALL, height=32, width=32, num_frames=5, num_inference_steps=3, max_sequence_length=16)
LTX_CALL = dict(TINY_LTX_CALL, negative_prompt="a blur", height=32, width=32, num_frames=1, num_inference_steps=3,
                max_sequence_length=16)


def frames(pipe, call, seed=0):
    out = pipe(prompt="a red fox", **call, output_type="np", generator=torch.Generator().manual_seed(seed)).frames[0]
    return torch.from_numpy(out).float()


def run_with(pipe, call, policy):
    ctx = install(pipe, policy)
    try:
        return frames(pipe, call), ctx.calls
    finally:
        uninstall(pipe)


def predicted_attention(result: Calibration, plan: dict) -> float:
    """Σ calls × relative cost (the table's): the attention time a plan is predicted to take."""
    return sum(result.stats[k].calls * DEFAULT_RELATIVE_COST[t] for k, t in plan.items())


def site_blind(plan: dict, n_blocks: int, n_steps: int) -> dict:
    """The plan with its sites moved: each block takes the next block's target, each step the
    mirrored step's (step s that of step n - 1 - s, with that step's expert). Every site keeps its
    shape and call count, so the predicted cost is the same: a policy as cheap that does not know
    where the model needs precision."""
    expert_of = {k[3]: k[0] for k in plan}
    return {(e, b, k, s): plan[(expert_of[n_steps - 1 - s], (b + 1) % n_blocks, k, n_steps - 1 - s)]
            for (e, b, k, s) in plan}


@pytest.fixture(scope="module")
def wan():
    pipe = tiny_wan_pipeline(two_experts=True)
    for model in (pipe.transformer, pipe.transformer_2):
        # block 1: K outlier channels; timesteps below 800 (steps 2 and 3 of 4): sharp attention
        add_sensitivity(model, outlier_blocks=(1,), sharp_timesteps=(0, 800))
    result = calibrate(pipe, ["a cat on the grass"], holdout=["a dog at night"], budget=0.2, candidates=CANDIDATES,
                       call=WAN_CALL, propagation=6, progress=False, model_name="tiny Wan2.2")
    return pipe, result


def test_calibration_finds_the_sensitive_sites_and_keeps_them_precise(wan):
    _, result = wan
    plan = result.plan
    assert {k[0] for k in plan} == {"high_noise", "low_noise"} and {k[3] for k in plan} == {0, 1, 2, 3}
    sensitive = {k for k in plan if k[2] == "self" and (k[1] == 1 or k[3] in (2, 3))}
    assert sensitive and all(plan[k] in PRECISE for k in sensitive), {k: plan[k] for k in sensitive}
    assert all(plan[k] == CHEAP for k in plan if k not in sensitive), {k: plan[k] for k in plan if k not in sensitive}
    # the choice is the budget's: the cheap tier measured over it at every sensitive site, within it elsewhere
    assert all(result.stats[k].rel_l2[CHEAP] > 0.2 for k in sensitive)
    assert all(result.stats[k].rel_l2[CHEAP] <= 0.2 for k in plan if k not in sensitive)


def test_installed_policy_routes_exactly_as_planned(wan):
    pipe, result = wan
    _, calls = run_with(pipe, WAN_CALL, result.policy)
    assert len(calls) == 4 * 2 * 2 * 2  # steps × CFG × blocks × kinds
    routed = {(c["expert"], c["block"], c["kind"], c["step"]): c["method"] for c in calls}
    assert routed == result.plan
    # and the YAML it writes loads back to the same policy
    text = result.policy_yaml()
    assert text.startswith("# Calibrated by fp4video calibrate")
    assert Policy.model_validate(yaml.safe_load(text)) == result.policy


def test_calibrated_video_beats_a_site_blind_policy_of_equal_cost(wan):
    pipe, result = wan
    blind = site_blind(result.plan, 2, 4)
    assert blind != result.plan
    assert math.isclose(predicted_attention(result, blind), predicted_attention(result, result.plan), rel_tol=1e-12)
    uniform = {k: CHEAP for k in result.plan}  # and a uniform policy, cheaper
    reference = frames(pipe, WAN_CALL)
    ours = paired_metrics(reference, run_with(pipe, WAN_CALL, result.policy)[0])
    theirs = paired_metrics(reference, run_with(pipe, WAN_CALL, policy_for(blind, num_steps=4))[0])
    cheap = paired_metrics(reference, run_with(pipe, WAN_CALL, policy_for(uniform, num_steps=4))[0])
    assert ours["psnr"] > theirs["psnr"] and ours["ssim"] >= theirs["ssim"], (ours["psnr"], theirs["psnr"])
    assert ours["psnr"] > cheap["psnr"]


def test_report_holdout_propagation_and_files(wan, tmp_path):
    _, result = wan
    r = result.report
    assert r["holdout"]["quantized_sites"] == len(result.plan) and r["holdout"]["sites_over_budget"] >= 0
    assert set(result.holdout_stats) == set(result.plan)  # the same sites, measured on the other prompt
    pairs = r["propagation"]["pairs"]
    assert len(pairs) == 6 and all(p["output_rel_l2"] > 0 for p in pairs)
    assert r["propagation"]["spearman"] == spearman([p["attention_rel_l2"] for p in pairs],
                                                     [p["output_rel_l2"] for p in pairs])
    pred = r["prediction"]
    # predicted speed-ups: stock is 1; the calibrated plan is slower than the cheap tier everywhere,
    # faster than fp16 everywhere
    assert pred["vs_single_target"]["fp16"]["predicted_step_speedup_vs_stock"] == pytest.approx(1.0)
    assert pred["vs_single_target"][CHEAP]["calibrated_speedup_vs_it"] < 1 < pred["step_speedup_vs_stock"]
    assert pred["vs_single_target"][CHEAP]["sites_over_budget"] == sum(
        1 for k in result.plan if result.stats[k].rel_l2[CHEAP] > 0.2)
    assert r["calibration"]["seconds"] > 0 and r["calibration"]["peak_bytes"] > 0
    paths = result.write(tmp_path)
    assert json.loads(paths["json"].read_text())["chosen"] == r["chosen"]
    assert paths["heatmap"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "Hold-out prompts" in md and "Spearman" in md and "step speed-up vs stock (predicted)" in md


@pytest.mark.parametrize("family", ["hunyuan", "ltx"])
def test_other_families_find_their_outlier_block(family):
    pipe = tiny_hunyuan_pipeline() if family == "hunyuan" else tiny_ltx_pipeline()
    call = HUNYUAN_CALL if family == "hunyuan" else LTX_CALL
    add_sensitivity(pipe.transformer, outlier_blocks=(1,))
    result = calibrate(pipe, ["a cat"], budget=0.2, candidates=CANDIDATES[:3], call=call, propagation=0, progress=False)
    plan = result.plan
    kinds = {k[2] for k in plan}
    assert kinds == ({"joint"} if family == "hunyuan" else {"self", "cross"})
    outlier = {k for k in plan if k[1] == 1 and k[2] != "cross"}
    assert outlier and all(plan[k] in PRECISE for k in outlier)
    assert all(plan[k] == CHEAP for k in plan if k not in outlier), plan
    _, calls = run_with(pipe, call, result.policy)
    assert {(c["expert"], c["block"], c["kind"], c["step"]): c["method"] for c in calls if c["block"] >= 0} == plan
    reference = frames(pipe, call)
    ours = paired_metrics(reference, run_with(pipe, call, result.policy)[0])
    theirs = paired_metrics(reference, run_with(pipe, call, policy_for(site_blind(plan, 2, 3), num_steps=3))[0])
    assert ours["psnr"] > theirs["psnr"]


# --- the pieces, against independent recomputations ------------------------------------------------

def test_head_errors_are_the_worst_heads():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(2, 50, 11, 16, generator=g)  # 11 heads: two chunks of HEAD_CHUNK
    out = exact.clone()
    out[1, :, 9] *= 1.25  # one head off by 25 %: relative L2 0.25, cosine 1
    out[0, :, 2] = -out[0, :, 2]  # one head negated: relative L2 2, cosine -1
    rel, cos = head_errors(out, exact)
    assert rel == pytest.approx(2.0) and cos == pytest.approx(-1.0)
    out[0, :, 2] = exact[0, :, 2]
    assert head_errors(out, exact) == pytest.approx((0.25, 1.0))
    nan = out.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert math.isnan(head_errors(nan, exact)[0])


def test_choice_is_the_cheapest_within_budget_and_nan_never_meets_it():
    s = SiteStats(calls=1, shape=(4, 4, 1, 8))
    s.update("mxattn-pv8", 0.3, 0.95)
    s.update("mxattn-pv8", 0.1, 0.99)  # the worst call is kept
    s.update("fp8", 0.05, 0.999)
    s.update("mxattn", float("nan"), float("nan"))
    cost = lambda t, shape: DEFAULT_RELATIVE_COST[t]  # noqa: E731
    stats = {(None, 0, "self", None): s}
    assert s.rel_l2["mxattn-pv8"] == 0.3
    assert choose(stats, CANDIDATES, cost, Budget(rel_l2=0.35)) == {(None, 0, "self", None): "mxattn-pv8"}
    assert choose(stats, CANDIDATES, cost, Budget(rel_l2=0.2)) == {(None, 0, "self", None): "fp8"}
    assert choose(stats, CANDIDATES, cost, Budget(rel_l2=0.01)) == {(None, 0, "self", None): "fp16"}
    assert choose(stats, CANDIDATES, cost, Budget(rel_l2=0.35, min_cosine=0.99)) == {(None, 0, "self", None): "fp8"}
    s.refused["fp8"] = "takes no attention mask"
    assert choose(stats, CANDIDATES, cost, Budget(rel_l2=0.2)) == {(None, 0, "self", None): "fp16"}


def test_policy_for_routes_every_site_of_a_plan():
    """Random plans over experts, blocks, kinds and 7 steps become policies that route each site
    as planned (checked against Policy.method_for site by site)."""
    import random

    rng = random.Random(0)
    targets = ["fp16", "fp8", "mxattn-pv8", "backend:native"]
    for _ in range(20):
        plan = {(e, b, k, s): rng.choice(targets) for e in ("high_noise", "low_noise") for b in range(5)
                for k in ("self", "cross") for s in range(7)}
        policy = policy_for(plan, num_steps=7)
        assert all(policy.method_for(block=b, step=s, num_steps=7, kind=k, expert=e) == t
                   for (e, b, k, s), t in plan.items())


def test_bad_arguments_are_one_line_errors(wan):
    pipe, _ = wan
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate(pipe, [], call=WAN_CALL)
    with pytest.raises(ValueError, match="unknown candidate 'mxatn'"):
        calibrate(pipe, ["a"], candidates=["mxatn"], call=WAN_CALL)
    with pytest.raises(TypeError, match="budget must be a number"):
        calibrate(pipe, ["a"], budget="0.1", call=WAN_CALL)
    with pytest.raises(FileNotFoundError, match="no such cost table"):
        calibrate(pipe, ["a"], costs="missing.md", call=WAN_CALL)
    assert not hasattr(pipe.transformer, "_fp4video_saved")  # nothing left installed


# --- the command line ---------------------------------------------------------------------------------

def test_cli_writes_a_policy_that_loads_and_says_what_it_found(tmp_path, capsys):
    from fp4video.cli.main import main

    out = tmp_path / "calib"
    rc = main(["calibrate", "--model", "tiny", "--family", "ltx", "--sensitive", "--steps", "2", "--height", "32",
               "--width", "32", "--frames", "1", "--candidates", "fp16", "fp8", "mxattn-pv8", "--propagation", "2",
               "--budget", "0.2", "--prompt", "a cat", "--holdout", "a bird", "--quiet", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "calibrated tiny ltx" in printed and "× stock" in printed
    policy = Policy.model_validate(yaml.safe_load((out / "policy.yaml").read_text()))
    report = json.loads((out / "report.json").read_text())
    assert report["holdout_prompts"] == ["a bird"] and report["num_steps"] == 2
    from fp4video.integration.config import load_config

    assert load_config(out / "run.yaml").policy == policy and load_config(out / "run.yaml").family == "ltx"
    # --sensitive: block 1's self-attention (K outlier channels) never takes the cheap tier
    assert all(s["chosen"] in PRECISE for s in report["sites"] if s["block"] == 1 and s["kind"] == "self")
    assert all(policy.method_for(block=s["block"], step=s["step"], num_steps=2, kind=s["kind"], expert=s["expert"])
               == s["chosen"] for s in report["sites"])


@pytest.mark.parametrize("args, message", [
    (["--transformer", "wan22", "--model", "tiny"], "--model is for a pipeline"),
    (["--budget", "0"], "--budget 0.0: a relative L2 error"),
    (["--model", "tiny", "--candidates", "backend:nope"], "unknown backend 'nope'"),
    (["--model", "tiny", "--sparse", "window:3"], "sparse candidate 'window:3': give dynamic:TAU"),
    # the pipeline would round 8 to 9 and the report and run.yaml would say 8
    (["--model", "tiny", "--frames", "8"], "frames 8: this WanPipeline takes 4n + 1 frames (its VAE's 4× in time)"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, message):
    from fp4video.cli.main import main

    assert main(["calibrate", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4video calibrate: error:") and message in err[0], err


def test_a_bare_transformer_calibrates_per_block_and_kind():
    """No pipeline, so no denoising step: one forward per input dict, a policy without step rules
    that the installed transformer follows call by call."""
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=5)
    add_sensitivity(model, outlier_blocks=(0,))
    g = torch.Generator().manual_seed(0)

    def inputs(t):
        return dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g),
                    encoder_hidden_states=torch.randn(1, 16, 32, generator=g), timestep=torch.tensor([t]),
                    return_dict=False)

    result = calibrate(model, [inputs(900.0), inputs(300.0)], holdout=[inputs(600.0)], budget=0.2,
                       candidates=CANDIDATES[:3], propagation=2, progress=False)
    assert set(result.plan) == {(None, b, k, None) for b in (0, 1) for k in ("self", "cross")}
    assert result.plan[(None, 0, "self", None)] in PRECISE and result.plan[(None, 1, "self", None)] == CHEAP
    assert all(r.steps is None for r in result.policy.rules)
    assert len(result.report["propagation"]["pairs"]) == 2 and result.num_steps is None
    ctx = install(model, result.policy)
    try:
        with torch.no_grad():
            model(**inputs(500.0))
    finally:
        uninstall(model)
    assert {(c["expert"], c["block"], c["kind"], c["step"]): c["method"] for c in ctx.calls} == result.plan


def test_matching_a_peer_is_never_slower_nor_worse_than_it_everywhere(wan):
    """--match: each site's bound is that candidate's own error there, so the chosen plan is no
    worse than the candidate at any site and, since the candidate always qualifies, predicted no
    slower than it everywhere (the H200 target: no worse than FlashAttention-3 FP8, at least as fast)."""
    _, result = wan
    budget = Budget(rel_l2=0.2, match="fp8")
    plan = choose(result.stats, CANDIDATES, lambda t, shape: DEFAULT_RELATIVE_COST[t], budget)
    assert all(t == "fp16" or result.stats[k].rel_l2[t] <= result.stats[k].rel_l2["fp8"] for k, t in plan.items())
    assert all(DEFAULT_RELATIVE_COST[t] <= DEFAULT_RELATIVE_COST["fp8"] for t in plan.values())
    assert predicted_attention(result, plan) <= predicted_attention(result, {k: "fp8" for k in plan})
    # on these inputs nothing cheaper matches fp8 anywhere: the plan is fp8 itself
    assert set(plan.values()) == {"fp8"}


# --- block-sparse candidates ------------------------------------------------------------------------

class _Constant(torch.nn.Module):
    """Q or K of every token the same vector (RoPE then makes the logits a function of the tokens'
    offset, largest at 0: attention to the token itself and its neighbours), or zero (uniform
    attention: every key weighs alike, so every key tile is needed)."""

    def __init__(self, vector):
        super().__init__()
        self.register_buffer("vector", vector)

    def forward(self, x):
        return self.vector.to(x.dtype).expand(x.shape)


SPARSE = ["dynamic:0.9", "static:0,2,2", "static:1,4,4"]


@pytest.fixture(scope="module")
def sparse_calibration():
    """A bare tiny Wan transformer over a 4 × 16 × 16 latent grid (1024 tokens: 8 key tiles) whose
    block 0 self-attention is uniform (it needs every key) and block 1's local (Q = K = one vector
    before RoPE: each token attends most to itself and its neighbours)."""
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=3)
    inner = 2 * 64
    model.blocks[0].attn1.norm_q = _Constant(torch.zeros(inner))
    c = torch.randn(inner, generator=torch.Generator().manual_seed(1))
    c = c / c.square().mean().sqrt()
    model.blocks[1].attn1.norm_q = _Constant(c)
    model.blocks[1].attn1.norm_k = _Constant(c)
    g = torch.Generator().manual_seed(0)

    def inputs(t):
        return dict(hidden_states=torch.randn(1, 16, 4, 32, 32, generator=g),
                    encoder_hidden_states=torch.randn(1, 16, 32, generator=g), timestep=torch.tensor([t]),
                    return_dict=False)

    result = calibrate(model, [inputs(900.0)], budget=Budget(rel_l2=0.1, min_kept=0.5), candidates=["fp16", "mxattn-pv8"],
                       sparse=SPARSE, propagation=0, progress=False)
    return model, inputs, result


def test_sparse_candidates_are_measured_and_chosen_only_within_the_budget(sparse_calibration):
    """Within the error budget and the kept-mass floor (``Budget.min_kept``) only."""
    from fp4video.calibration.plan import site_cost, sparse_time, split_target

    _, _, result = sparse_calibration
    dynamic, static, wider = "mxattn-pv8+dynamic:0.9", "mxattn-pv8+static:0,2,2", "mxattn-pv8+static:1,4,4"
    assert result.candidates == ["fp16", "mxattn-pv8", dynamic, static, wider]
    cost = lambda t, shape: DEFAULT_RELATIVE_COST[t]  # noqa: E731
    for key, s in result.stats.items():
        if key[2] == "self":  # both measured at every self-attention site, with their density
            assert {dynamic, static} <= set(s.rel_l2) and 0 < s.mean_density(static) < 1
            assert s.mean_density(dynamic) is not None
        else:  # a static window on the latent grid does not apply to cross attention
            assert static in s.refused and "static window applies to self and joint" in s.refused[static]
        chosen = result.plan[key]
        if split_target(chosen)[1] is not None:  # sparse only within the budget and cheaper than dense
            assert s.rel_l2[chosen] <= 0.1
            assert site_cost(cost, chosen, s) == pytest.approx(
                DEFAULT_RELATIVE_COST["mxattn-pv8"] * sparse_time(s.mean_density(chosen)))
            assert site_cost(cost, chosen, s) < DEFAULT_RELATIVE_COST["mxattn-pv8"]
        cheaper = [t for t in result.candidates if t != "fp16" and t not in s.refused
                   and site_cost(cost, t, s) < site_cost(cost, chosen, s)]
        # each cheaper candidate is over the error budget, or its check kept under min_kept somewhere
        assert all(s.rel_l2[t] > 0.1 or not s.kept.get(t, math.nan) >= 0.5 for t in cheaper), (key, chosen, cheaper)
        for t in s.kept:  # every measured selection reports its worst query tile's kept mass
            assert split_target(t)[1] is not None and 0 <= s.kept[t] <= 1
        if split_target(chosen)[1] is not None:
            assert s.kept[chosen] >= 0.5
    local, uniform = result.stats[(None, 1, "self", None)], result.stats[(None, 0, "self", None)]
    # the local site takes a sparse candidate; the narrowest window, cheaper, loses too much there
    assert split_target(result.plan[(None, 1, "self", None)])[1] is not None
    assert local.rel_l2[result.plan[(None, 1, "self", None)]] <= 0.1 < local.rel_l2[static]
    # the site built to need every key is not made sparse: the windows lose too much, and the
    # dynamic selection keeps every tile (no cheaper than dense)
    assert split_target(result.plan[(None, 0, "self", None)])[1] is None
    assert min(uniform.rel_l2[static], uniform.rel_l2[wider]) > 0.1 and uniform.mean_density(dynamic) == 1.0
    report = result.report
    site = next(x for x in report["sites"] if x["block"] == 1 and x["kind"] == "self")
    assert site["density"][wider] == pytest.approx(local.mean_density(wider))


def test_installed_sparse_policy_routes_and_selects_as_measured(sparse_calibration):
    from fp4video.calibration.plan import split_target

    model, inputs, result = sparse_calibration
    text = result.policy_yaml()
    assert "sparsity:" in text and Policy.model_validate(yaml.safe_load(text)) == result.policy
    ctx = install(model, result.policy)
    try:
        with torch.no_grad():
            model(**inputs(900.0))
    finally:
        uninstall(model)
    calls = ctx.recorded_calls()
    got = {(c["expert"], c["block"], c["kind"], c["step"]): (c["method"], c.get("sparsity")) for c in calls}
    want = {}
    for key, target in result.plan.items():
        method, sparsity = split_target(target)
        want[key] = (method, None if sparsity is None else sparsity.describe())
    assert got == want
    # the same selections as measured: each sparse call's density is the site's measured one
    for c in calls:
        if c.get("sparsity"):
            key = (c["expert"], c["block"], c["kind"], c["step"])
            assert c["density"] == pytest.approx(result.stats[key].mean_density(result.plan[key]), abs=1e-4)


def test_sparse_candidate_names_parse_and_bad_ones_are_one_line_errors():
    from fp4video.calibration import sparse_targets
    from fp4video.calibration.plan import parse_sparsity, sparse_target, sparse_time

    assert sparse_target("mxattn", "static:1,4,4,radial") == "mxattn+static:1,4,4,radial"
    assert parse_sparsity("dynamic:0.95").dynamic.tau == 0.95
    assert sparse_time(0.25) == pytest.approx(0.28) and sparse_time(0.5) == pytest.approx(0.52)
    assert sparse_time(1.0) == 1.0
    assert sparse_targets(True, ["fp16", "fp8", "mxattn-pv8", "mxattn"]) == [
        "mxattn-pv8+dynamic:0.9", "mxattn-pv8+dynamic:0.95", "mxattn-pv8+dynamic:0.9,sampled,sinks,floor=0.9",
        "mxattn-pv8+static:4,45,80,radial", "mxattn-pv8+static:4,45,80,radial,sinks"]
    # options round-trip: the estimate, top-k, sinks and the floor
    for spec in ("dynamic:0.8,sampled,topk=0.1,sinks,floor=0.95", "static:1,2,3,radial,sinks,floor=0.9",
                 "static:1,2,3,floor=0.5", "dynamic:0.9,covering,sinks"):
        assert sparse_target("mxattn", spec) == "mxattn+" + spec
    sp = parse_sparsity("dynamic:0.8,sampled,topk=0.1,sinks,floor=0.95")
    assert (sp.dynamic.estimate, sp.dynamic.topk, sp.sinks, sp.floor) == ("sampled", 0.1, True, 0.95)
    assert parse_sparsity("dynamic:0.9,covering").dynamic.estimate == "covering"
    for bad in ("dynamic:0.9,floor=2", "dynamic:0.9,exact", "static:1,2,3,floor=x", "dynamic:0.9,topk=0",
                "dynamic:0.9,sampled,covering"):
        with pytest.raises(ValueError, match=r"sparse candidate .*: ") as e:
            parse_sparsity(bad)
        assert "\n" not in str(e.value) and "further information" not in str(e.value)
    assert sparse_targets(["mxattn+dynamic:0.5"], ["fp16"]) == ["mxattn+dynamic:0.5"]
    for bad, message in (("dynamic:2", "sparse candidate 'dynamic:2'"), ("window:3", "give dynamic:TAU"),
                         ("static:1,2", "sparse candidate 'static:1,2'")):
        with pytest.raises(ValueError, match=message):
            sparse_targets([bad], ["fp16", "mxattn-pv8"])
    with pytest.raises(ValueError, match="not one of fp4video's quantized methods"):
        sparse_targets(["fp16+dynamic:0.9"], ["fp16"])


# --- exact backends as the FP16 tier, the measured forward, choosing again -------------------------

def test_exact_backends_meet_every_budget_where_they_take_the_calls():
    """An exact backend is the FP16 tier: it meets any budget, so per site the cheaper of stock
    and it is chosen, unless it refused a call there."""
    cost = {"fp16": 1.0, "backend:_native_cudnn": 0.7, "fp8": 0.8}
    stats = {}
    for block in (0, 1):
        s = SiteStats(calls=1, shape=(4, 4, 1, 8))
        s.update("fp8", 0.5, 0.9)  # over any budget below
        stats[(None, block, "self", None)] = s
    stats[(None, 1, "self", None)].refused["backend:_native_cudnn"] = "takes no mask of this shape"
    plan = choose(stats, ["fp16", "fp8", "backend:_native_cudnn"], lambda t, shape: cost[t], Budget(rel_l2=1e-6))
    assert plan == {(None, 0, "self", None): "backend:_native_cudnn", (None, 1, "self", None): "fp16"}
    policy = policy_for(plan, num_steps=None)
    assert policy.route_for(block=0, step=None, num_steps=None, kind="self", expert=None)[0] == "backend:_native_cudnn"


def test_the_observer_records_what_an_exact_backend_refuses_without_running_it():
    from types import SimpleNamespace

    from fp4video.calibration.measure import Measurer
    from fp4video.integration.dispatcher import AttentionCall

    ran = []

    class Exact:
        def why_not(self, call):
            return "takes no attention mask" if call.attn_mask is not None else None

        def run(self, call):
            ran.append(call)

    ctx = SimpleNamespace(external={"_native_cudnn": Exact()}, expert=None, step=None, num_steps=None, backend="reference")
    m = Measurer(ctx, ["fp16", "backend:_native_cudnn"], propagation=0, propagation_target=None, seed=0)
    q = torch.randn(1, 8, 2, 16)
    for block, mask in ((0, None), (1, torch.ones(1, 8, dtype=torch.bool))):
        m(site=SimpleNamespace(block=block), kind="self", call=AttentionCall(q, q, q, mask), out=q, ran="fp16")
    assert not ran
    assert m.stats[(None, 0, "self", None)].refused == {}
    assert m.stats[(None, 1, "self", None)].refused == {"backend:_native_cudnn": "takes no attention mask"}


def test_a_measured_forward_includes_its_attention(wan):
    """The forward's time excludes the observer's but keeps its own attention calls: the stock
    attention time of the calls is at most the forwards' time."""
    _, result = wan
    m = result.report["measurements"]
    attention = sum(row["calls"] * row["stock_seconds"] for row in m["shapes"])
    assert m["forwards"] == 4 * 2 and 0 < attention <= m["forward_seconds"]  # 4 steps × 2 guidance passes
    assert 0 < result.report["prediction"]["attention_share_of_stock_forward"] < 1


def test_the_observer_lets_the_forwards_queued_work_finish_before_its_clock(monkeypatch):
    """On a GPU the stock forward's kernels are still queued when the observer starts: it syncs
    before reading its clock, or their time is counted as its own and subtracted from the forward."""
    from types import SimpleNamespace

    from fp4video.calibration import measure
    from fp4video.integration.dispatcher import AttentionCall

    events = []
    monkeypatch.setattr(measure, "_sync", lambda device: events.append("sync"))
    real = measure.time.perf_counter
    monkeypatch.setattr(measure.time, "perf_counter", lambda: events.append("clock") or real())
    ctx = SimpleNamespace(external={}, expert=None, step=None, num_steps=None, backend="reference")
    m = measure.Measurer(ctx, ["fp16", "fp8"], propagation=0, propagation_target=None, seed=0)
    q = torch.randn(1, 8, 2, 16)
    m(site=SimpleNamespace(block=0), kind="self", call=AttentionCall(q, q, q), out=q, ran="fp16")
    assert events[:2] == ["sync", "clock"] and events[-2:] == ["sync", "clock"]


def test_calibrated_policies_fall_back_to_stock_and_exact_matches_are_refused(wan):
    pipe, result = wan
    assert result.policy.fallback == "stock"
    with pytest.raises(ValueError, match="matches backend:_native_cudnn, an exact backend: it has no error"):
        calibrate(pipe, ["a"], budget=Budget(match="backend:_native_cudnn"), call=WAN_CALL, progress=False)
    with pytest.raises(ValueError, match="fp16_backend"):
        calibrate(pipe, ["a"], fp16_backend="sage", call=WAN_CALL, progress=False)
    assert not hasattr(pipe.transformer, "_fp4video_saved")


def test_fastest_fp16_tier_tries_every_exact_backend_and_writes_stock():
    """fp16_backend="fastest": each exact backend installed is a candidate (on this CPU none runs:
    each is reported with why), and the policy's own tier is stock."""
    from fp4video.integration.backends import EXACT_PREFERENCE
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=5)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 16, 32, generator=g), timestep=torch.tensor([500.0]),
                  return_dict=False)
    result = calibrate(model, [inputs], holdout=[inputs], budget=0.2, candidates=["fp8"], fp16_backend="fastest",
                       propagation=0, progress=False)
    tried = {f"backend:{b}" for b in EXACT_PREFERENCE if b != "native"}
    assert tried <= set(result.candidates) | set(result.report["unavailable"])
    if not torch.cuda.is_available():
        assert tried <= set(result.report["unavailable"])
    assert result.policy.fp16_backend == "stock" and result.report["fp16_backend"] == "stock"
    assert result.report["prompts"] == ["(inputs 1)"] and result.report["holdout_prompts"] == ["(hold-out inputs 1)"]


def test_sites_are_reported_in_block_order():
    from fp4video.calibration.report import site_order

    keys = [(None, 10, "self", None), (None, 2, "self", None), ("low", 1, "cross", 3), ("low", 1, "cross", None)]
    assert sorted(keys, key=site_order) == [keys[1], keys[0], keys[3], keys[2]]


def _leaves(tree, path="") -> dict:
    """{path: leaf} of a JSON-ready tree (numbers compared with approx, the rest exactly)."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{path}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{path}/{i}").items()}
    return {path: tree}


def test_choosing_again_from_the_report_needs_no_measuring(wan, tmp_path):
    from fp4video.calibration import replan

    _, result = wan
    result.write(tmp_path / "c")
    same = replan(tmp_path / "c")
    assert same.plan == result.plan and same.policy == result.policy
    for key in ("prediction", "holdout", "chosen", "sites"):  # equal up to the order sums are taken in
        a, b = _leaves(same.report[key]), _leaves(result.report[key])
        assert a.keys() == b.keys(), key
        for path in a:
            numbers = isinstance(b[path], float) and not isinstance(b[path], bool)
            assert a[path] == (pytest.approx(b[path], rel=1e-12, nan_ok=True) if numbers else b[path]), path
    for budget in (0.05, 0.5):
        again = replan(tmp_path / "c" / "report.json", budget=budget)
        assert again.plan == choose(result.stats, CANDIDATES, lambda t, shape: DEFAULT_RELATIVE_COST[t],
                                    Budget(rel_l2=budget))
        assert all(t == "fp16" or result.stats[k].rel_l2[t] <= budget for k, t in again.plan.items())
        assert again.report["replanned"]["measured_budget"]["rel_l2"] == 0.2
    loose, tight = replan(tmp_path / "c", budget=0.5), replan(tmp_path / "c", budget=0.05)
    assert loose.report["prediction"]["step_speedup_vs_stock"] >= tight.report["prediction"]["step_speedup_vs_stock"]
    only = replan(tmp_path / "c", candidates=["fp8"])
    assert set(only.plan.values()) <= {"fp16", "fp8"} and "mxattn-pv8" in only.report["unavailable"]
    # bounded by a measured candidate's error without using it
    bounded = replan(tmp_path / "c", budget=Budget(match="mxattn"), candidates=["fp8"])
    assert all(t == "fp16" or result.stats[k].rel_l2[t] <= result.stats[k].rel_l2["mxattn"]
               for k, t in bounded.plan.items())
    again = replan(bounded.report, budget=0.5)  # chained: the measured budget stays the first one's
    assert again.report["replanned"]["measured_budget"]["rel_l2"] == 0.2
    with pytest.raises(ValueError, match="sage3 not measured"):
        replan(tmp_path / "c", candidates=["sage3"])
    with pytest.raises(ValueError, match="matches sage3, whose error this calibration never measured"):
        replan(tmp_path / "c", budget=Budget(match="sage3"))
    with pytest.raises(ValueError, match="an exact backend"):
        replan(tmp_path / "c", budget=Budget(match="backend:_native_cudnn"))
    old = json.loads((tmp_path / "c" / "report.json").read_text())
    del old["measurements"]
    with pytest.raises(ValueError, match="no measurements section"):
        replan(old)


def test_cli_chooses_again_from_an_earlier_calibration(wan, tmp_path, capsys):
    from fp4video.cli.main import main
    from fp4video.integration.config import load_config

    _, result = wan
    result.write(tmp_path / "c")
    assert main(["calibrate", "--from", str(tmp_path / "c"), "--budget", "0.5", "--out", str(tmp_path / "d")]) == 0
    assert "chose again for tiny Wan2.2" in capsys.readouterr().out
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["budget"]["rel_l2"] == 0.5 and report["replanned"]["from"].endswith("report.json")
    assert load_config(tmp_path / "d" / "run.yaml").policy == Policy.model_validate(
        yaml.safe_load((tmp_path / "d" / "policy.yaml").read_text()))
    # a flag given replaces that part of the report's budget only
    assert main(["calibrate", "--from", str(tmp_path / "c"), "--min-cosine", "0.5", "--out", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / "report.json").read_text())["budget"] == {
        "rel_l2": 0.2, "min_cosine": 0.5, "match": None, "min_kept": 0.9}
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    for args, message in ((["--costs", "measure"], "--costs measures; --from only chooses again"),
                          (["--model", "tiny"], "--model measures"),
                          (["--candidates", "sage3"], "sage3 not measured"),
                          (["--from", str(tmp_path / "bad.json")], "not a calibration report (no 'model', 'prompts'")):
        assert main(["calibrate", "--from", str(tmp_path / "c"), "--out", str(tmp_path / "e"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main(["calibrate", "--from", str(tmp_path / "nothing"), "--out", str(tmp_path / "e")]) == 2
    assert "no report.json there" in capsys.readouterr().err


def test_choosing_again_keeps_block_sparse_candidates_and_their_densities(sparse_calibration, tmp_path):
    from fp4video.calibration import replan
    from fp4video.calibration.plan import split_target

    _, _, result = sparse_calibration
    result.write(tmp_path / "s")
    same = replan(tmp_path / "s")
    assert same.plan == result.plan and same.policy == result.policy
    for key, s in result.stats.items():
        for t in s.density:
            assert same.stats[key].mean_density(t) == pytest.approx(s.mean_density(t))
    # a sparse candidate without its dense method: costed from its own row (the method's dense cost)
    wider = "mxattn-pv8+static:1,4,4"
    alone = replan(tmp_path / "s", candidates=[wider], budget=Budget(rel_l2=10.0, min_kept=0.0))
    assert {t for t in alone.plan.values() if split_target(t)[1] is not None} == {wider}


def test_a_selection_under_the_kept_mass_floor_is_never_admitted(sparse_calibration):
    """Choosing again with a floor of kept mass above what a selection's checks measured refuses it at
    every site, whatever its error: no sparse site is kept."""
    from fp4video.calibration.plan import split_target
    from fp4video.calibration import replan

    _, _, result = sparse_calibration
    worst = min(v for s in result.stats.values() for v in s.kept.values())
    strict = replan(result.report, budget=Budget(rel_l2=1e9, min_kept=1.0))
    loose = replan(result.report, budget=Budget(rel_l2=1e9, min_kept=0.0))
    assert worst < 1.0
    assert not any(split_target(t)[1] is not None for t in strict.plan.values())
    assert any(split_target(t)[1] is not None for t in loose.plan.values())
