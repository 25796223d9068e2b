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
