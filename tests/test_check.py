"""`fp4video check`, the self-check users run on their GPU: under Triton's interpreter on the CPU
here (small shapes, no timing); on the H200 in full."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_check_command_end_to_end_on_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "check", "--device", "cpu", "--small",
                           "--methods", "mxattn", "sage3-pv8", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and [m["method"] for m in report["methods"]] == ["mxattn", "sage3-pv8"]
    # which loop ran, as the dispatch chose it (the interpreter: the e4m3 loop, the NVFP4 one)
    assert [m["loop"] for m in report["methods"]] == ["loop_e4m3", "loop_nvfp4"]
    for m in report["methods"]:
        assert set(m["accuracy"]) == {"gaussian", "sharp (t=4)", "outlier channels", "attention sinks",
                                      "V outlier tokens"}
    assert "| mxattn | loop_e4m3 |" in proc.stdout and "all methods pass" in proc.stdout
    # block-sparse: the e4m3 loop takes a selection and matches the reference on it; the NVFP4 loop
    # takes none and the report says why
    mx, nv = report["methods"]
    assert mx["sparse"]["ok"] and 0.2 <= mx["sparse"]["density"] <= 0.4 and mx["sparse_reason"] is None
    assert nv["sparse"] is None and "loop_nvfp4 loop takes no key-tile selection" in nv["sparse_reason"]
    assert (f"| {mx['sparse']['rows_off']:.1%} / {mx['sparse']['worst_row']:.3f} at 0.29, kept ≥ "
            f"{mx['sparse']['kept']['kept_min']:.2f} |") in proc.stdout
    # the check's row-mass kernel against the reference, and what the check measured of the selection
    assert mx["sparse"]["row_mass_kernel_max_abs_diff"] < 1e-4
    assert 0 <= mx["sparse"]["kept"]["kept_min"] <= mx["sparse"]["kept"]["kept_mean"] <= 1
    assert "| no selection |" in proc.stdout and "block-sparse: the loop_nvfp4 loop takes no" in proc.stdout
    # the RoPE kernel the routing runs, against the stock operations
    assert report["rope"]["wan"]["ok"] and report["rope"]["interleaved"]["ok"]
    assert report["rope"]["wan"]["values"] > 0 and report["rope"]["wan"]["differing"] == 0
    assert "RoPE kernel (HunyuanVideo's) against the stock operations: bit for bit on" in proc.stdout


def test_a_rope_kernel_one_value_off_fails_the_check(monkeypatch):
    from fp4video.eval import check
    from fp4video.kernels import rope

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = rope.rope_pairs

    def one_off(q, k, cos, sin, style="wan", **kw):
        qo, ko = real(q, k, cos, sin, style, **kw)
        ko[0, 1, 0, 2] = ko[0, 1, 0, 2] * 2 + 1
        return qo, ko

    monkeypatch.setattr(rope, "rope_pairs", one_off)
    out = check._rope_check(torch.device("cpu"), 2, 40, 16)
    assert not out["wan"]["ok"] and out["wan"]["differing"] == 1 and not out["interleaved"]["ok"]
    report = {"device": {"name": "cpu", "torch": "-", "triton": "-", "fp4video": "-"}, "date": "-",
              "accuracy_shape": "-", "methods": [], "rope": out, "timing": {}, "ok": False}
    text = check.format_check(report)
    assert "RoPE kernel (Wan's) against the stock operations: 1 of 5,120 values differ ✗" in text


def test_check_without_interpreter_on_cpu_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "check", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr and "Traceback" not in proc.stderr


def test_a_wrong_kernel_row_fails_the_check(monkeypatch):
    """The check must catch a kernel that is off in a single row (the tensor's cosine would not)."""
    import fp4video.attention as attention
    from fp4video.eval.check import format_check, run_check

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = attention.fp4_attention

    def one_row_off(q, k, v, **kw):
        out = real(q, k, v, **kw)
        if kw.get("backend") == "triton":
            out, lse = out
            out = out.clone()
            out[0, 0, 3] *= 1.5  # one of 128 rows 50% off
            return out, lse
        return out

    monkeypatch.setattr(attention, "fp4_attention", one_row_off)
    report = run_check(["mxattn"], device="cpu", heads=2, sq=64, sk=130, head_dim=64, timing_seq=None)
    assert not report["ok"]
    acc = report["methods"][0]["accuracy"]["gaussian"]
    assert acc["worst_row"] == pytest.approx(0.5, abs=0.02) and not acc["ok"]
    assert "SOME CHECKS FAILED" in format_check(report)
    assert torch.isfinite(torch.tensor(acc["lse_worst"]))


def test_random_selection_visits_about_the_density_and_a_live_key_per_row():
    from fp4video.eval.check import random_selection

    alive = torch.arange(1000) < 700  # the last tiles hold no live key
    sel = random_selection(2, 3, 300, 1000, density=0.3, key_alive=alive, seed=1)
    assert tuple(sel.tiles.shape) == (2, 3, 3, 8) and (sel.tiles.sum(-1) == 2).all()
    live = torch.tensor([True] * 6 + [False] * 2)
    assert (sel.tiles & live).any(-1).all()
    assert not torch.equal(sel.tiles[0, 0], sel.tiles[1, 2])  # drawn per batch entry and head


def test_a_sparse_kernel_that_ignores_its_selection_fails_the_check(monkeypatch):
    """A kernel that visits every key tile of a block-sparse call (the dense result) is off by far
    more than the bounds against the reference on the selection."""
    import fp4video.attention as attention
    from fp4video.eval.check import format_check, run_check

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = attention.fp4_attention

    def dense_kernel(q, k, v, **kw):
        if kw.get("backend") == "triton":
            kw.pop("sparsity", None)
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention, "fp4_attention", dense_kernel)
    report = run_check(["mxattn"], device="cpu", heads=2, sq=64, sk=130, head_dim=64, timing_seq=None)
    m = report["methods"][0]
    assert all(a["ok"] for a in m["accuracy"].values()) and not m["sparse"]["ok"] and not report["ok"]
    assert m["sparse"]["worst_row"] > 0.2
    assert " ✗ |" in format_check(report) and "SOME CHECKS FAILED" in format_check(report)


def test_check_report_shows_the_clock_each_timing_ran_at():
    """With NVML the check's table gives each method's SM clock and power-cap share beside its
    time, the timing list each baseline's; without it the report says why instead of leaving the
    reader to guess."""
    from fp4video.eval.check import format_check

    method = {"method": "mxattn-pv8", "loop": "loop_e4m3", "accuracy": {}, "ms": 5.12, "x_best_bf16": 1.31,
              "sm_mhz": 1728.4, "power_capped": 1.0, "error": None, "ok": True}
    report = {"device": {"name": "GPU X", "capability": "9.0", "torch": "t", "triton": "tr", "fp4video": "f"},
              "date": "2026-12-03", "accuracy_shape": "s", "methods": [method], "ok": True,
              "timing": {"shape": "B=1 H=24 S=16384 D=128, bf16", "ms": {"cuDNN SDPA bf16": 6.70, "flash SDPA bf16": None},
                         "peers_missing": {}, "clock": {"cuDNN SDPA bf16": {"mhz": 1629.0, "watts": 691.0, "capped": 0.95},
                                                        "mxattn-pv8": {"mhz": 1728.4, "watts": 692.0, "capped": 1.0}},
                         "clock_missing": None}}
    text = format_check(report)
    assert "| SM MHz (power-capped) |" in text and "| 5.12 | 1.31 | 1728 (100%) | yes |" in text
    assert "- cuDNN SDPA bf16: 6.70 ms at 1629 MHz, 95% of it power-capped" in text
    assert "- flash SDPA bf16: failed" in text
    method.update(sm_mhz=None, power_capped=None)
    report["timing"].update(clock={}, clock_missing="NVML is not installed (pip install nvidia-ml-py, or fp4video[bench])")
    text = format_check(report)
    assert "| 5.12 | 1.31 |  | yes |" in text
    assert "- SM clock and power cap not sampled: NVML is not installed" in text

