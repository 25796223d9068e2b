"""`fp4video accuracy`: run once as a subprocess (as a user would) and check it against the source
documents' published numbers; plus exact checks of the UOS derivation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from fp4video.harness import sageattention3, mxattention


@pytest.fixture(scope="module")
def accuracy(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc")
    proc = subprocess.run(
        [sys.executable, "-m", "fp4video.cli.main", "accuracy", "--json", "--out", str(out), "--seed", "0"],
        capture_output=True, text=True, timeout=900,  # ~20 s alone; generous for a loaded 2-core machine
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), out


def test_json_contract(accuracy):
    r, _ = accuracy
    assert r["e4m3"]["distinct_nonneg"] == 127 and r["e4m3"]["in_p_range"] == 35
    assert r["uos"]["qmax_star"] == 7.25
    assert r["uos"]["ocp_overflow_probability"] == pytest.approx(math.log2(8 / 7))
    assert set(r["methods"]) >= {"fp16", "mxfp4-ocp", "nvfp4", "sage3", "mxattn"}
    for m, v in r["methods"].items():
        assert set(v) >= {"cossim", "rel_l1", "rmse"}, m
    assert r["methods"]["fp16"]["cossim"] > 0.999999
    assert len(r["entropy_sweep"]) == 4
    for e in r["entropy_sweep"]:
        assert set(e) >= {"norm_entropy", "two_level", "direct"}


def test_sageattention3_cells_within_1_5_points(accuracy):
    r, _ = accuracy
    s0, pub = r["sageattention3"], sageattention3.PUBLISHED
    cells = [
        (s0["formats"]["nvfp4"], pub["nvfp4"]),
        (s0["formats"]["mxfp4"], pub["mxfp4"]),
        (s0["p_scale"]["direct"], pub["nvfp4_direct"]),
        (s0["smooth_k"]["off"], pub["smooth_k_off"]),
        (s0["int8_qk_fp16_pv"], pub["int8_qk_fp16_pv"]),
        (s0["split"]["1"]["cos"], pub["qk_only"][1]["cos"]),
        (s0["split"]["16"]["cos"], pub["qk_only"][16]["cos"]),
        (s0["split"]["1"]["pv_only_cos"], pub["pv_only"]),
        (s0["split"]["16"]["pv_only_cos"], pub["pv_only"]),
    ]
    for e, (ent, two, direct) in zip(s0["entropy_sweep"], pub["entropy_sweep"]):
        assert e["norm_entropy"] == pytest.approx(ent, abs=1e-3)
        cells += [(100 * e["two_level"], two), (100 * e["direct"], direct)]
    for ours, published in cells:
        assert abs(ours - published) <= 1.5, (ours, published)


def test_sageattention3_orderings(accuracy):
    s0 = accuracy[0]["sageattention3"]
    assert s0["formats"]["nvfp4"] > s0["formats"]["mxfp4"] > s0["smooth_k"]["off"] - 2 > s0["p_scale"]["direct"]
    sweep = s0["entropy_sweep"]
    assert all(a["two_level"] > b["two_level"] for a, b in zip(sweep, sweep[1:]))  # sharper -> worse
    assert sweep[0]["two_level"] - sweep[0]["direct"] > 0.2  # two-level matters only when diffuse
    assert all(abs(e["two_level"] - e["direct"]) < 0.01 for e in sweep[1:])
    assert s0["distinct_p"]["direct"] < 20 < 1000 < s0["distinct_p"]["two_level"]
    assert s0["smooth_k"]["s_rel_l1_smooth"] < s0["smooth_k"]["s_rel_l1_no_smooth"] / 2


def test_mxattention_results(accuracy):
    s1 = accuracy[0]["mxattention"]
    assert all(q == 7.25 for q in s1["uos"]["objective_minimizers"].values())
    assert s1["mse_sweep"]["gaussian"]["pooled_optimum"] in (7.2, 7.25)
    assert abs(s1["ocp_overflow"]["log_uniform_maxima"] - math.log2(8 / 7)) < 0.01
    for rule in ("ocp", "uos"):
        assert s1["pnq"][rule]["mean_row_sum"] < 0.99 and s1["pnq"][rule]["share_under"] > 0.9
        assert s1["pnq"][rule]["pnq_max_abs_dev"] < 1e-12
    ab = s1["ablation"]["methods"]
    # the sequential ablation's order on outlier-channel inputs: each removal costs accuracy
    assert ab["mxattn"]["rel_l1"] < ab["mxattn-no-uos"]["rel_l1"] < ab["mxattn-no-pnq-uos"]["rel_l1"]


def test_our_combinations_beat_their_parents(accuracy):
    c = accuracy[0]["combinations"]
    for data in c:
        assert c[data]["mxattn-sk"]["rel_l1"] <= c[data]["mxattn"]["rel_l1"] * 1.01, data
    assert c["SageAttention3 t=1"]["mxattn-sk"]["cossim"] > c["SageAttention3 t=1"]["mxattn"]["cossim"] + 0.03
    assert c["outlier channels"]["sage3-hpnq"]["rel_l1"] < 0.7 * c["outlier channels"]["sage3"]["rel_l1"]


def test_plots_and_json_written(accuracy):
    _, out = accuracy
    for name in ("entropy_sweep.png", "row_sum_histogram.png", "uos_objective.png", "uos_mse_sweep.png",
                 "methods.png", "accuracy.json", "accuracy.md"):
        p = out / name
        assert p.exists() and p.stat().st_size > 1000, name
        if name == "accuracy.md":
            assert "**MXAttention — Universal Optimal Scaling**" in p.read_text()
        if name.endswith(".png"):
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_deterministic_for_a_seed(accuracy):
    again = sageattention3.run(seed=0)
    assert again["formats"] == accuracy[0]["sageattention3"]["formats"]


# --- the UOS derivation, exactly --------------------------------------------------------------------


def test_delta_root_is_exactly_29_over_4():
    assert mxattention.delta(Fraction(29, 4)) == 0
    assert mxattention.delta(Fraction(29, 4) - Fraction(1, 1000)) < 0 < mxattention.delta(Fraction(29, 4) + Fraction(1, 1000))
    assert mxattention.qmax_from_delta() == Fraction(29, 4)


@pytest.mark.parametrize("q", [Fraction(21, 2), Fraction(11), Fraction(12), Fraction(20)])
def test_delta_matches_paper_table6_above_10(q):
    assert mxattention.delta(q) == (48 * q * q - 864 * q + 3983) / 8


def test_integrated_error_vectorized_matches_exact():
    xs = [Fraction(i, 7) for i in range(1, 80)]
    got = mxattention.integrated_error_t(torch.tensor([float(x) for x in xs], dtype=torch.float64))
    want = torch.tensor([float(mxattention.integrated_error(x)) for x in xs], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_integrated_error_against_numeric_integral():
    from fp4video.formats import round_e2m1

    t = (torch.arange(2_000_000, dtype=torch.float64) + 0.5) * (9.0 / 2_000_000)
    numeric = float(((t - round_e2m1(t)) ** 2).sum() * (9.0 / 2_000_000))
    assert abs(numeric - float(mxattention.integrated_error(Fraction(9)))) < 1e-6


def test_cli_help_lists_accuracy():
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "accuracy" in proc.stdout
