"""``fp4video.calibrate(..., linear=...)`` / ``fp4video calibrate --linear``: the linear layers of a
tiny bf16 Wan2.2 pipeline measured in the calibration's own forwards, per linear site (expert,
block, kind); a layer made sensitive on purpose kept bf16 while the others are quantized; the
emitted policy reproduced layer by layer by ``plan_linear``; the report through the strict schema
(and an old report without linear data); the exact emulation of torchao's float8 numerics against
independent computations (and, on a GPU, torchao itself); bad input in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("torchao")

from fp4video.calibration import calibrate, replan  # noqa: E402
from fp4video.calibration import linear as CL  # noqa: E402
from fp4video.calibration.schema import ReportError, validate_report  # noqa: E402
from fp4video.eval.paired import json_ready  # noqa: E402
from fp4video.formats import E4M3_MAX, float8_linear, float8_quantize_dequantize, round_e4m3  # noqa: E402
from fp4video.integration import linear as L  # noqa: E402
from fp4video.integration.tiny import tiny_wan_pipeline  # noqa: E402

WAN_CALL = dict(negative_prompt="", height=48, width=64, num_frames=5, num_inference_steps=2, guidance_scale=4.0,
                max_sequence_length=16)
METHODS = ["fp8-rowwise", "fp8-tensor"]
#: A time table under which both fp8 methods save time at every shape (the H200's eager table has
#: fp8 slower at two of its three shapes): the choice is then the budget's alone.
SAVING_TABLE = {"eager": {c: {"bf16": 10.0, "fp8-rowwise": 7.0, "fp8-tensor": 7.5}
                          for c in ("square", "expand", "contract")}}


def make_sensitive(model: torch.nn.Module, block: int = 1) -> None:
    """Block ``block``'s FFN down layer loses everything to fp8: its input channel 0 is always 0
    (the up projection's row 0 gives GELU(-30) = 0) and its weight column 0 is huge, so every
    weight scale (per output channel or per tensor) is set by a column that meets only zeros, and
    the other weights fall under e4m3's smallest subnormal. The model's output is unchanged."""
    ffn = model.blocks[block].ffn
    up, down = ffn.net[0].proj, ffn.net[2]
    with torch.no_grad():
        up.weight[0] = 0
        up.bias[0] = -30
        down.weight[:, 0] = 1e6


def bf16_pipeline():
    pipe = tiny_wan_pipeline(two_experts=True)
    for t in (pipe.transformer, pipe.transformer_2):
        t.to(torch.bfloat16)
        make_sensitive(t)
    return pipe


@pytest.fixture(scope="module")
def linear_calibration():
    pipe = bf16_pipeline()
    mp = pytest.MonkeyPatch()
    mp.setattr(CL, "LINEAR_TABLE", SAVING_TABLE)
    try:
        result = calibrate(pipe, ["a cat on the grass"], budget=0.2, candidates=["fp16", "fp8"], call=WAN_CALL,
                           propagation=0, progress=False, model_name="tiny Wan2.2 bf16", linear=METHODS, linear_rows=64)
    finally:
        mp.undo()
    return pipe, result


def test_every_block_and_kind_is_a_linear_site_with_its_errors(linear_calibration):
    pipe, result = linear_calibration
    sites = result.report["linear_sites"]
    layers = [s for s in L.linear_sites(pipe) if s.block >= 0]
    assert {(s["expert"], s["block"], s["kind"]) for s in sites} == {(s.expert, s.block, s.kind) for s in layers}
    assert len(sites) == 2 * 2 * 3  # experts × blocks × (attention, cross_attention, ffn)
    assert sorted(n for s in sites for n in s["layers"]) == sorted(s.name for s in layers)
    for s in sites:
        assert s["rel_l2"]["bf16"] == 0.0 and s["calls"] > 0
        assert 0 < s["rel_l2"]["fp8-rowwise"] < math.inf  # positive, finite
        assert s["time_source"] == {m: "table" for m in METHODS}  # off a GPU: the (test's) table
    # ordinary layers: rowwise scales fit each token and channel as well as one scale for all. The tiny
    # model's rows have nearly one scale, so the two errors are equal to e4m3's rounding (which of them
    # is the smaller flips with the random weights): within 5% of each other at every site
    ordinary = [s for s in sites if not (s["block"] == 1 and s["kind"] == "ffn")]
    assert all(s["rel_l2"]["fp8-rowwise"] < 0.06 for s in ordinary)
    assert all(s["rel_l2"]["fp8-rowwise"] <= 1.05 * s["rel_l2"]["fp8-tensor"] for s in ordinary), sites
    # torchao's per-tensor GEMM refuses 128 x 128 weights: the attention projections of the tiny model
    assert all("fp8-tensor" in s["refused"] for s in sites if s["kind"] != "ffn")
    lin = result.report["linear"]
    assert lin["measured_by"] == {"bf16": "the reference (unchanged)", "fp8-rowwise": "emulated e4m3 rowwise",
                                  "fp8-tensor": "emulated e4m3 tensorwise"}
    assert lin["rows_per_call"] == 64 and "fp32" in lin["reference"]


def test_the_sensitive_layer_stays_bf16_and_the_others_are_quantized(linear_calibration):
    _, result = linear_calibration
    plan = result.linear.plan
    sensitive = {(e, 1, "ffn") for e in ("high_noise", "low_noise")}
    for key in sensitive:
        st = result.linear.stats[key]
        assert st.rel_l2["fp8-rowwise"] > 0.5 and st.rel_l2["fp8-tensor"] > 0.5  # over the 0.2 budget
        assert st.worst_layer["fp8-rowwise"].endswith("blocks.1.ffn.net.2")
        assert plan[key] == "bf16"
    # every other site takes the method saving the most (rowwise, 7.0 of 10 in the table)
    assert all(m == "fp8-rowwise" for k, m in plan.items() if k not in sensitive), plan
    assert result.report["linear"]["chosen"] == {"fp8-rowwise": 10, "bf16": 2}


def test_the_policy_is_compact_and_plan_linear_reproduces_it(linear_calibration, tmp_path):
    import yaml

    from fp4video.integration.config import RunConfig

    pipe, result = linear_calibration
    policy = result.linear_policy
    # bf16 for the sensitive FFN and the layers outside the blocks: two rules naming one block
    assert policy.method == "fp8-rowwise" and not policy.compile
    assert [r.model_dump(exclude_none=True) for r in policy.rules] == [
        {"method": "bf16", "blocks": [1], "kinds": ["ffn"]}, {"method": "bf16", "kinds": ["embedder", "head"]}]
    # as run.yaml writes it (the CLI's test below writes one)
    text = yaml.safe_dump({"model": "tiny", "prompts": ["a cat"],
                           "linear": policy.model_dump(mode="json", exclude_defaults=True)})
    spec = yaml.safe_load(text)
    assert "steps" not in json.dumps(spec["linear"])
    cfg = RunConfig.model_validate(spec)
    assert cfg.linear == policy
    layers = L.plan_linear(pipe, cfg.linear)
    assert not layers.kept
    for name, method in layers.items():
        s = layers.sites[name]
        assert method == result.linear.plan.get((s.expert, s.block, s.kind), "bf16"), name


def test_the_report_round_trips_and_an_old_report_loads(linear_calibration, tmp_path):
    _, result = linear_calibration
    paths = result.write(tmp_path)
    data = json.loads(paths["json"].read_text())
    report = validate_report(data)
    assert report.linear.policy == result.linear_policy and len(report.linear_sites) == 12
    assert validate_report(json.loads(json.dumps(report.model_dump(mode="json", by_alias=True)))) == report
    old = {k: v for k, v in data.items() if k not in ("linear", "linear_sites")}
    assert validate_report(old).linear is None and validate_report(old).linear_sites == []
    # holds together: a site's choice is the policy's, no method it did not measure, no site twice
    bad = json.loads(json.dumps(data))
    bad["linear_sites"][0]["chosen"] = "bf16" if bad["linear_sites"][0]["chosen"] != "bf16" else "fp8-rowwise"
    with pytest.raises(ReportError, match=r"linear_sites\[0\]\.chosen: .* but linear.policy gives"):
        validate_report(bad)
    bad = json.loads(json.dumps(data))
    bad["linear_sites"][1]["rel_l2"]["mxfp8"] = 0.1
    with pytest.raises(ReportError, match=r"linear_sites\[1\]\.rel_l2\.mxfp8: not among linear.methods"):
        validate_report(bad)
    bad = json.loads(json.dumps(data))
    bad["linear"]["policy"]["rules"][0]["steps"] = {"first": 2}
    with pytest.raises(ReportError, match="steps do not apply to linear layers"):
        validate_report(bad)
    md = paths["markdown"].read_text()
    assert "## Linear layers" in md and "| high_noise | 1 | ffn | 2 | bf16 |" in md and "emulated e4m3 rowwise" in md
    assert paths["heatmap"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_choosing_again_rechooses_the_linear_sites(linear_calibration, tmp_path):
    _, result = linear_calibration
    result.write(tmp_path)
    tight = replan(tmp_path, budget=1e-3)  # under every fp8 error: bf16 everywhere
    assert set(tight.linear.plan.values()) == {"bf16"} and tight.linear_policy.method == "bf16"
    same = replan(tmp_path)
    assert same.linear.plan == result.linear.plan and same.linear_policy == result.linear_policy
    validate_report(json.loads(json.dumps(json_ready(tight.report))))


def test_a_method_that_costs_time_is_never_chosen():
    """The H200's eager times: fp8 is slower than bf16 for in = out and out < in, faster for
    out > in; a site is quantized only where its layers together save time."""
    assert CL.table_ratio("fp8-rowwise", 5120, 5120) > 1 and CL.table_ratio("fp8-rowwise", 13824, 5120) > 1
    assert CL.table_ratio("fp8-rowwise", 5120, 13824) < 1
    assert CL.table_ratio("fp8-tensor", 5120, 13824) is None  # no H200 time: never chosen from the table
    assert CL.table_ratio("fp8-rowwise", 5120, 5120, compile=True) is None
    st = {("x", 0, "ffn"): CL.LinearSiteStats(rel_l2={"fp8-rowwise": 0.03, "mxfp8": 0.01},
                                              time_saved_ms={"fp8-rowwise": -1.0, "mxfp8": None}),
          ("x", 1, "ffn"): CL.LinearSiteStats(rel_l2={"fp8-rowwise": 0.03, "mxfp8": 0.01},
                                              time_saved_ms={"fp8-rowwise": 2.0, "mxfp8": 3.0}),
          ("x", 2, "ffn"): CL.LinearSiteStats(rel_l2={"fp8-rowwise": 0.03, "mxfp8": 0.5},
                                              time_saved_ms={"fp8-rowwise": 2.0, "mxfp8": 3.0})}
    plan = CL.choose_linear(st, ["bf16", "fp8-rowwise", "mxfp8"], 0.1)
    assert plan == {("x", 0, "ffn"): "bf16", ("x", 1, "ffn"): "mxfp8", ("x", 2, "ffn"): "fp8-rowwise"}


def test_the_h200_table_keeps_the_tiny_model_bf16(monkeypatch):
    """Under the real eager table the tiny model's sites (square attention projections, an FFN
    whose up layer saves less than its down layer costs) gain nothing: bf16 everywhere. The table
    scales this device's bf16 time of each layer; here that time is its multiply-adds' count, since
    a CPU's timing of two equal-sized layers is noise beside the FFN's margin (a loaded CI machine
    timed the up layer slower and flipped it)."""
    from fp4video.integration.tiny import tiny_wan_transformer

    monkeypatch.setattr(CL, "_bf16_ms_here", lambda weight, bias, tokens, reps=3: 1e-6 * tokens * weight.numel())

    model = tiny_wan_transformer(seed=3).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 16, 32, generator=g).bfloat16(), timestep=torch.tensor([500.0]),
                  return_dict=False)
    result = calibrate(model, [inputs], budget=0.2, candidates=["fp16"], propagation=0, progress=False,
                       linear="fp8-rowwise")
    lin = result.linear
    assert set(lin.plan) == {(None, b, k) for b in (0, 1) for k in ("attention", "cross_attention", "ffn")}
    assert all(st.time_source["fp8-rowwise"] == "table" for st in lin.stats.values())
    assert all(lin.stats[k].time_saved_ms["fp8-rowwise"] < 0 for k in lin.plan if k[2] != "ffn")
    assert set(lin.plan.values()) == {"bf16"} and lin.policy == L.LinearPolicy()


def test_linear_policy_for_any_plan_routes_every_site():
    import random

    rng = random.Random(0)
    methods = ["bf16", "fp8-rowwise", "fp8-tensor", "mxfp8"]
    outside = [(e, -1, k) for e in ("high_noise", "low_noise") for k in ("embedder", "head")]
    for _ in range(30):
        plan = {(e, b, k): rng.choice(methods) for e in ("high_noise", "low_noise") for b in range(4)
                for k in ("attention", "cross_attention", "ffn")}
        policy = CL.linear_policy_for(plan, outside)
        assert all(policy.method_for(expert=e, block=b, kind=k) == m for (e, b, k), m in plan.items())
        assert all(policy.method_for(expert=e, block=b, kind=k) == "bf16" for e, b, k in outside)
    uniform = {(None, b, k): "fp8-rowwise" for b in range(40) for k in ("attention", "ffn")}
    uniform[(None, 7, "ffn")] = "bf16"
    policy = CL.linear_policy_for(uniform, [(None, -1, "embedder")])
    assert policy.method == "fp8-rowwise" and len(policy.rules) == 2  # block 7's FFN and the embedder


# --- the float8 emulation ---------------------------------------------------------------------------


def test_float8_emulation_on_hand_built_rows():
    # a row whose amax is 448: the scale is 1 and every value is e4m3's own rounding
    row = torch.tensor([[448.0, 1.0, 1.0625, 1.1875, -3.3, 0.0, 2.0**-9, 2.0**-11]])
    expect = torch.tensor([[448.0, 1.0, 1.0, 1.25, -3.25, 0.0, 2.0**-9, 0.0]])  # ties to even; under 2^-10: 0
    assert torch.equal(float8_quantize_dequantize(row, rowwise=True), expect)
    # scaled rows: amax / 448 per row, the same rounding at that scale; a zero row stays zeros, not NaN
    x = torch.tensor([[896.0, 2.125, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [4.48, 0.01, 0.0103, -4.48]])
    out = float8_quantize_dequantize(x, rowwise=True)
    assert torch.equal(out[0], torch.tensor([896.0, 2.0, -1.0, 0.0]))  # 2.125 / 2 = 1.0625 -> 1.0, times 2
    assert torch.equal(out[1], torch.zeros(4)) and not out.isnan().any()
    s = 4.48 / 448
    assert torch.allclose(out[2], round_e4m3(x[2] / s) * s, rtol=0, atol=0)
    # per tensor: one scale from the largest value (or the amax given for the whole activation)
    t = float8_quantize_dequantize(x, rowwise=False)
    assert torch.equal(t, round_e4m3(x / 2.0) * 2.0)
    assert torch.equal(float8_quantize_dequantize(x, rowwise=False, amax=torch.tensor(1792.0)),
                       round_e4m3(x / 4.0) * 4.0)
    assert torch.equal(float8_quantize_dequantize(torch.zeros(3, 5), rowwise=False), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="per-tensor amax only"):
        float8_quantize_dequantize(x, rowwise=True, amax=torch.tensor(1.0))


def test_float8_linear_is_the_e4m3_product_of_an_independent_computation():
    """bf16 activations with rows 2^-4 .. 2^4 apart and a weight with one large row: per-row
    scales (bf16's amax / 448, as torchao divides in the tensor's dtype), round_e4m3, fp64."""
    torch.manual_seed(0)
    x = (torch.randn(33, 64) * torch.exp2(torch.randint(-4, 5, (33, 1)).float())).bfloat16()
    x[5] = 0
    w = torch.randn(48, 64).bfloat16()
    w[3] *= 1000
    b = torch.randn(48).bfloat16()

    def q(t, dim):
        amax = t.abs().amax(dim=dim, keepdim=True) if dim is not None else t.abs().amax()
        scale = (amax / 448).double()  # bf16 division, then widened
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return round_e4m3(t.double() / scale) * scale

    for rowwise in (True, False):
        dim = -1 if rowwise else None
        expect = q(x, dim) @ q(w, dim).T + b.double()
        got = float8_linear(x, w, b, rowwise=rowwise)
        assert got.dtype == torch.float32 and not got.isnan().any()
        assert torch.allclose(got.double(), expect, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[5], b.float()) if rowwise else True  # a zero row: the bias alone
    # per tensor on a sample of rows: the whole activation's amax, as torchao's scale sees it
    sample = x[10:20]
    assert torch.equal(float8_quantize_dequantize(sample, rowwise=False, amax=x.abs().amax()),
                       float8_quantize_dequantize(x, rowwise=False)[10:20])
    whole = float8_linear(x, w, b, rowwise=False)[10:20]
    assert torch.allclose(float8_linear(sample, w, b, rowwise=False, x_amax=x.abs().amax()), whole, rtol=1e-5,
                          atol=1e-4)
    # the big weight row costs per-tensor scaling far more than per-row
    exact = x.double() @ w.double().T + b.double()
    err = {r: float((float8_linear(x, w, b, rowwise=r).double() - exact).norm() / exact.norm()) for r in (True, False)}
    assert 0 < err[True] < 0.05 and err[False] > err[True]


def test_float8_emulation_is_torchaos_quantization_bit_for_bit():
    """Against torchao's own float8 primitives (its torch path's scale and cast), on the CPU."""
    prim = pytest.importorskip("torchao.quantization.quant_primitives")
    torch.manual_seed(1)
    x = (torch.randn(50, 64) * torch.exp2(torch.randint(-8, 8, (50, 1)).float())).bfloat16()
    for rowwise, block in ((True, [1, 64]), (False, [50, 64])):
        scale = prim._choose_scale_float8(x, block)
        theirs = prim._dequantize_affine_float8(prim._quantize_affine_float8(x, scale), scale)
        assert torch.equal(float8_quantize_dequantize(x, rowwise=rowwise), theirs)


@pytest.mark.gpu
def test_float8_emulation_is_torchaos_float8_workflow_on_the_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torchao's float8 workflow needs an sm_89+ GPU")
    from torchao.quantization import quantize_

    torch.manual_seed(2)
    layer = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    x = (torch.randn(300, 512, device="cuda") * torch.exp2(torch.randint(-4, 5, (300, 1), device="cuda"))).bfloat16()
    for method in ("fp8-rowwise", "fp8-tensor"):
        q = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
        q.load_state_dict(layer.state_dict())
        quantize_(q, L.torchao_config(method))
        with torch.no_grad():
            theirs = q(x).float()
        ours = float8_linear(x, layer.weight.detach(), layer.bias.detach(), rowwise=method == "fp8-rowwise")
        # the same e4m3 operands; torchao's output is rounded to bf16
        assert float((theirs - ours).norm() / ours.norm()) < 4e-3, method


# --- bad input --------------------------------------------------------------------------------------


def test_bad_linear_arguments_are_one_line_errors():
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(seed=3)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8), encoder_hidden_states=torch.randn(1, 16, 32),
                  timestep=torch.tensor([500.0]), return_dict=False)
    with pytest.raises(ValueError, match="unknown linear method 'fp9'"):
        calibrate(model, [inputs], linear=["fp9"], candidates=["fp16"], progress=False)
    with pytest.raises(L.LinearUnsupported, match="nothing emulates nvfp4"):
        calibrate(model, [inputs], linear="nvfp4", candidates=["fp16"], progress=False)
    with pytest.raises(ValueError, match="linear_rows must be a whole number"):
        calibrate(model, [inputs], linear="fp8-rowwise", linear_rows=0, candidates=["fp16"], progress=False)
    assert not any(m._forward_hooks for m in model.modules())  # nothing left hooked


@pytest.mark.parametrize("args, message", [
    (["--linear", "fp9"], "--linear fp9: unknown linear method; allowed: bf16, fp8-rowwise"),
    (["--linear", "nvfp4"], "--linear nvfp4: linear method nvfp4 needs an NVIDIA GPU; the layers are on cpu, and "
                            "nothing emulates nvfp4 for measuring"),
    (["--linear-compile"], "--linear-compile is for --linear"),
    (["--linear", "fp8-rowwise", "--linear-rows", "0"], "--linear-rows 0: at least 1"),
])
def test_cli_bad_linear_input_is_one_line(tmp_path, capsys, args, message):
    from fp4video.cli.main import main

    assert main(["calibrate", "--out", str(tmp_path / "o"), "--model", "tiny", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4video calibrate: error:") and message in err[0], err


def test_cli_without_torchao_says_what_to_install(tmp_path, capsys, monkeypatch):
    from fp4video.cli.main import main

    monkeypatch.setattr(CL, "torchao_installed", lambda: False)
    assert main(["calibrate", "--out", str(tmp_path / "o"), "--model", "tiny", "--linear", "fp8-rowwise"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--linear: calibrating linear layers needs torchao" in err[0] \
        and "pip install 'fp4video[linear]'" in err[0], err
    with pytest.raises(L.LinearUnsupported, match=r"pip install 'fp4video\[linear\]'"):
        CL.check_linear_methods(["fp8-rowwise"], "cpu")


def test_cli_writes_the_linear_section_of_run_yaml(tmp_path, capsys):
    """The tiny pipeline on the CPU is float32: torchao takes bf16 weights, so every method is
    refused (named in the report) and the linear section keeps bf16; the errors are measured."""
    from fp4video.cli.main import main
    from fp4video.integration.config import load_config

    out = tmp_path / "calib"
    rc = main(["calibrate", "--model", "tiny", "--family", "ltx", "--steps", "2", "--height", "32", "--width", "32",
               "--frames", "1", "--candidates", "fp16", "fp8", "--propagation", "0", "--prompt", "a cat", "--quiet",
               "--linear", "fp8-rowwise", "--linear-rows", "32", "--out", str(out)])
    assert rc == 0
    cfg = load_config(out / "run.yaml")
    assert cfg.linear == L.LinearPolicy()
    report = json.loads((out / "report.json").read_text())
    assert report["linear"]["rows_per_call"] == 32
    assert all("float32" in s["refused"]["fp8-rowwise"] and s["rel_l2"]["fp8-rowwise"] > 0 and s["chosen"] == "bf16"
               for s in report["linear_sites"])
    capsys.readouterr()
    # choosing again keeps the linear section, replaced by the new choice
    assert main(["calibrate", "--from", str(out), "--budget", "0.3", "--out", str(tmp_path / "again")]) == 0
    assert load_config(tmp_path / "again" / "run.yaml").linear == L.LinearPolicy()
    assert main(["calibrate", "--from", str(out), "--linear", "fp8-rowwise", "--out", str(tmp_path / "x")]) == 2
    assert "--linear measures; --from only chooses again" in capsys.readouterr().err


def test_choosing_again_keeps_a_users_linear_section_when_linear_layers_were_not_calibrated(tmp_path, capsys):
    """--from over a calibration without --linear: the run's own linear section (written by the user
    into run.yaml) is the run's, kept as it was; only the attention policy is chosen again."""
    import yaml

    from fp4video.cli.main import main
    from fp4video.integration.config import load_config

    out = tmp_path / "calib"
    assert main(["calibrate", "--model", "tiny", "--family", "ltx", "--steps", "2", "--height", "32", "--width", "32",
                 "--frames", "1", "--candidates", "fp16", "fp8", "--propagation", "0", "--prompt", "a cat", "--quiet",
                 "--out", str(out)]) == 0
    run = yaml.safe_load((out / "run.yaml").read_text())
    run["linear"] = {"method": "fp8-rowwise", "rules": [{"method": "bf16", "blocks": [0]}]}
    (out / "run.yaml").write_text(yaml.safe_dump(run))
    capsys.readouterr()
    assert main(["calibrate", "--from", str(out), "--budget", "0.3", "--out", str(tmp_path / "again")]) == 0
    again = load_config(tmp_path / "again" / "run.yaml")
    assert again.linear == L.LinearPolicy.model_validate(run["linear"]) and again.linear.method == "fp8-rowwise"


def test_a_torchao_gemm_that_fails_refuses_the_method_at_that_site_and_the_calibration_goes_on(monkeypatch):
    """A torchao GEMM raising inside the calibration's forward (as cuBLASLt's
    CUBLAS_STATUS_NOT_SUPPORTED did for eager float8 on an H200) refuses that method at the site,
    naming the error, and the calibration finishes; the method is never chosen there."""
    pipe = bf16_pipeline()

    def broken(*_a, **_k):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic\nmore")

    monkeypatch.setattr(CL.LinearObserver, "_torchao", staticmethod(broken))
    monkeypatch.setattr(CL, "LINEAR_TABLE", SAVING_TABLE)
    result = calibrate(pipe, ["a cat"], budget=0.2, candidates=["fp16", "fp8"], call=WAN_CALL, propagation=0,
                       progress=False, linear=["mxfp8"], linear_rows=16)
    sites = result.report["linear_sites"]
    assert sites and all("CUBLAS_STATUS_NOT_SUPPORTED" in s["refused"]["mxfp8"] and s["chosen"] == "bf16" for s in sites)


def test_methods_estimated_from_the_table_share_one_bf16_time_per_shape(monkeypatch):
    """The table's estimate of a method's saving is this device's bf16 time × (1 − its ratio). Each
    method took its own timing of the same bf16 GEMM, so on a busy CPU a slower second timing made
    the method the table ranks lower (tensorwise, 7.5 of 10) look the larger saving. A timer that
    answers slower on each call must leave the choice to the table: rowwise at every quantized site."""
    calls = []

    def slower_each_call(weight, bias, tokens, reps=3):
        calls.append((tuple(weight.shape), tokens))
        return float(len(calls))

    monkeypatch.setattr(CL, "LINEAR_TABLE", SAVING_TABLE)
    monkeypatch.setattr(CL, "_bf16_ms_here", slower_each_call)
    result = calibrate(bf16_pipeline(), ["a cat on the grass"], budget=0.2, candidates=["fp16", "fp8"], call=WAN_CALL,
                       propagation=0, progress=False, model_name="tiny Wan2.2 bf16", linear=METHODS, linear_rows=64)
    assert len(calls) == len(set(calls))  # one timing per shape
    sensitive = {(e, 1, "ffn") for e in ("high_noise", "low_noise")}
    assert {k: m for k, m in result.linear.plan.items() if k not in sensitive} == \
        {k: "fp8-rowwise" for k in result.linear.plan if k not in sensitive}
