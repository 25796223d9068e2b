"""fp4video eval: paired metrics against independent definitions (scikit-image SSIM, PSNR from its
formula), errors, the VBench driver with stand-ins, the Table 2 / Table 3 sweep on the tiny model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4video.eval import evaluate_paths, paired_metrics, read_video
from fp4video.eval import vbench_driver as vb


def write_video(path: Path, frames: torch.Tensor, fps: int = 8):
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, (frames.clamp(0, 1) * 255).round().to(torch.uint8).numpy(), fps=fps, codec="libx264",
                quality=None, pixelformat="yuv444p", ffmpeg_params=["-crf", "0"])


def smooth_video(t=5, h=48, w=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.interpolate(torch.rand(t, 3, 6, 8, generator=g), size=(h, w), mode="bilinear")
    return base.permute(0, 2, 3, 1).contiguous()


def test_identical_videos_score_perfectly(tmp_path):
    v = smooth_video()
    write_video(tmp_path / "a.mp4", v)
    r = evaluate_paths(tmp_path / "a.mp4", tmp_path / "a.mp4")
    assert r["cosine"] == pytest.approx(1.0, abs=1e-12) and r["ssim"] == pytest.approx(1.0, abs=1e-12)
    assert r["psnr"] == math.inf and r["identical_frames"] == r["frames"] == 5  # identical: PSNR is infinite
    assert r["videos"]["a.mp4"]["per_frame"]["psnr"] == [math.inf] * 5
    from fp4video.eval import json_ready

    text = json.dumps(json_ready(r), allow_nan=False)  # standard JSON: infinities as the string "inf"
    back = json.loads(text)
    assert back["psnr"] == "inf" and float(back["psnr"]) == math.inf
    from fp4video.cli.eval import summary_line

    assert "psnr inf (every frame identical)" in summary_line(r) and "psnr inf" in summary_line(back)


def test_psnr_mean_leaves_identical_frames_out_and_counts_them():
    ref = smooth_video(seed=7)
    cand = ref.clone()
    cand[2:] = (cand[2:] + 0.02).clamp(0, 1)  # frames 0 and 1 stay identical
    m = paired_metrics(ref, cand)
    differing = m["per_frame"]["psnr"][2:]
    assert m["per_frame"]["psnr"][:2] == [math.inf, math.inf] and all(math.isfinite(x) for x in differing)
    assert m["identical_frames"] == 2 and m["psnr"] == pytest.approx(sum(differing) / 3)
    from fp4video.cli.eval import summary_line

    line = summary_line({**m, "videos": {"v": m}, "cosine_range": "x"})
    assert "over the 3 differing frames (2 identical)" in line
    assert f"cosine {m['cosine']:.6f}" in line  # six digits: methods differ in the fourth


def test_metrics_match_per_frame_definitions():
    """SSIM as torchmetrics defines it, frame by frame (each frame scored on its own, then averaged);
    PSNR and cosine from their formulas; scikit-image's SSIM as a loose cross-check (its Gaussian
    filtering differs: up to 0.033 apart on these 48x64 frames, 0.005 on 160x256, measured)."""
    from skimage.metrics import structural_similarity
    from torchmetrics.functional.image import structural_similarity_index_measure as tm_ssim

    ref = smooth_video(seed=1)
    cand = (ref + 0.03 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    m = paired_metrics(ref, cand)
    r, c = ref.double().numpy(), cand.double().numpy()
    frame = lambda x: torch.from_numpy(x).permute(2, 0, 1)[None]  # noqa: E731
    ssim_tm = [float(tm_ssim(frame(c[i]), frame(r[i]), gaussian_kernel=True, sigma=1.5, kernel_size=11, data_range=1.0))
               for i in range(len(r))]
    ssim_sk = [structural_similarity(r[i], c[i], gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
                                     data_range=1.0, channel_axis=-1) for i in range(len(r))]
    psnr = [10 * math.log10(1.0 / np.mean((r[i] - c[i]) ** 2)) for i in range(len(r))]
    cos = [float(np.dot(r[i].ravel(), c[i].ravel()) / np.linalg.norm(r[i]) / np.linalg.norm(c[i])) for i in range(len(r))]
    assert np.allclose(m["per_frame"]["ssim"], ssim_tm, atol=1e-10)
    assert np.allclose(m["per_frame"]["ssim"], ssim_sk, atol=0.05)
    assert np.allclose(m["per_frame"]["psnr"], psnr, atol=1e-9)
    assert np.allclose(m["per_frame"]["cosine"], cos, atol=1e-12)
    assert m["psnr"] == pytest.approx(np.mean(psnr)) and m["ssim"] == pytest.approx(np.mean(ssim_tm)) and m["ssim"] < 0.99


def test_read_video_roundtrip_is_lossless_enough(tmp_path):
    v = smooth_video(seed=3)
    write_video(tmp_path / "v.mp4", v)
    back = read_video(tmp_path / "v.mp4")
    assert back.shape == v.shape and (back - v).abs().max() < 3 / 255


def test_shape_mismatch_and_pairing_errors(tmp_path):
    write_video(tmp_path / "r" / "x.mp4", smooth_video(t=5))
    write_video(tmp_path / "c" / "x.mp4", smooth_video(t=4))
    with pytest.raises(ValueError, match=r"x.mp4: reference and candidate differ in shape .*\(5, 48, 64, 3\) vs \(4, 48, 64, 3\)"):
        evaluate_paths(tmp_path / "r", tmp_path / "c")
    write_video(tmp_path / "c2" / "y.mp4", smooth_video(t=5))
    with pytest.raises(ValueError, match="unmatched: x.mp4, y.mp4"):
        evaluate_paths(tmp_path / "r", tmp_path / "c2")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        evaluate_paths(tmp_path / "r", tmp_path / "nope")
    with pytest.raises(ValueError, match="two mp4 files or two folders"):
        evaluate_paths(tmp_path / "r", tmp_path / "r" / "x.mp4")


def test_folders_are_paired_by_name(tmp_path):
    for name, seed in (("a.mp4", 4), ("b.mp4", 5)):
        v = smooth_video(seed=seed)
        write_video(tmp_path / "ref" / name, v)
        write_video(tmp_path / "cand" / name, v if name == "a.mp4" else (v * 0.9))
    r = evaluate_paths(tmp_path / "ref", tmp_path / "cand")
    assert set(r["videos"]) == {"a.mp4", "b.mp4"}
    assert r["videos"]["a.mp4"]["psnr"] == math.inf and r["videos"]["b.mp4"]["psnr"] < 40
    assert r["psnr"] == r["videos"]["b.mp4"]["psnr"]  # the mean over videos with a finite PSNR
    assert r["identical_frames"] == r["videos"]["a.mp4"]["frames"]


def test_eval_cli(tmp_path):
    write_video(tmp_path / "a.mp4", smooth_video(seed=6))
    write_video(tmp_path / "b.mp4", smooth_video(seed=6) * 0.95)
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "eval", "--reference", str(tmp_path / "a.mp4"),
                           "--candidate", str(tmp_path / "b.mp4"), "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert set(r) >= {"cosine", "ssim", "psnr", "videos"} and 0 < r["ssim"] < 1
    bad = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "eval", "--reference", str(tmp_path / "a.mp4"),
                          "--candidate", str(tmp_path / "zz.mp4")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "zz.mp4: no such" in bad.stderr


# --- VBench driver ---------------------------------------------------------------------------------

RAW = {  # VBench 0.1.5's output format: [overall, [{video_path, video_results}]]
    "subject_consistency": [0.95, [{"video_path": "/x/a.mp4", "video_results": 0.96}, {"video_path": "/x/b.mp4", "video_results": 0.94}]],
    "imaging_quality": [0.65, [{"video_path": "/x/a.mp4", "video_results": 66.0}, {"video_path": "/x/b.mp4", "video_results": 64.0}]],
    "aesthetic_quality": [0.61, [{"video_path": "/x/a.mp4", "video_results": 0.62}, {"video_path": "/x/b.mp4", "video_results": 0.60}]],
}


def test_normalize_vbench_results():
    n = vb.normalize_results(RAW)
    assert n["overall"] == {"subject_consistency": 0.95, "imaging_quality": 0.65, "aesthetic_quality": 0.61}
    assert n["videos"]["a.mp4"]["imaging_quality"] == pytest.approx(0.66)
    with pytest.raises(ValueError, match="no 'aesthetic_quality'"):
        vb.normalize_results({k: v for k, v in RAW.items() if k != "aesthetic_quality"})


def test_missing_weights_error_names_every_file(tmp_path):
    with pytest.raises(vb.MissingWeights) as e:
        vb.run_vbench(tmp_path, python=sys.executable, out_dir=tmp_path / "o", cache_dir=tmp_path / "cache",
                      torch_home=tmp_path / "th")
    msg = str(e.value)
    for f in ("dino_vitbase16_pretrain.pth", "musiq_spaq_ckpt-358bb6af.pth", "ViT-L-14.pt", "sa_0_4_vit_l_14_linear.pth"):
        assert f in msg
    assert str(tmp_path / "th" / "hub" / "checkpoints" / "dino_vitbase16_pretrain.pth") in msg


def _standin_weights(folder: Path):
    for name in ("dino_vitbase16_pretrain.pth", "musiq_spaq_ckpt-358bb6af.pth", "ViT-L-14.pt", "sa_0_4_vit_l_14_linear.pth"):
        (folder / "sub").mkdir(parents=True, exist_ok=True)
        (folder / "sub" / name).write_bytes(b"stand-in")
    (folder / "facebookresearch_dino_main").mkdir()
    (folder / "facebookresearch_dino_main" / "hubconf.py").write_text("# stand-in\n")


def test_vbench_weights_cli_places_and_checks(tmp_path):
    _standin_weights(tmp_path / "src")
    args = ["--cache-dir", str(tmp_path / "cache"), "--torch-home", str(tmp_path / "th")]
    cmd = [sys.executable, "-m", "fp4video.cli.main", "vbench-weights", *args]
    before = subprocess.run(cmd, capture_output=True, text=True)
    assert before.returncode == 1 and "0 of 6 present" in before.stdout and "MISSING" in before.stdout
    placed = subprocess.run(cmd + ["--from", str(tmp_path / "src")], capture_output=True, text=True)
    assert placed.returncode == 0 and "6 of 6 present" in placed.stdout, placed.stdout


def test_vbench_driver_end_to_end_with_a_standin_vbench(tmp_path):
    """The real driver (weights check, subprocess, environment, result file, normalization) around a
    stand-in `vbench` package that writes results in VBench 0.1.5's format. The real VBench was not
    run: its weights cannot be downloaded here."""
    _standin_weights(tmp_path / "src")
    vb.place_weights(tmp_path / "src", tmp_path / "cache", tmp_path / "th")
    fake = tmp_path / "fake_site" / "vbench"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent('''
        import json, os
        class VBench:
            def __init__(self, device, info, out):
                self.out = out
                assert os.environ["VBENCH_CACHE_DIR"] and os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
            def evaluate(self, videos_path, name, dimension_list, local, mode):
                vids = sorted(f for f in os.listdir(videos_path) if f.endswith(".mp4"))
                res = {d: [0.5, [{"video_path": os.path.join(videos_path, v),
                                  "video_results": 50.0 if d == "imaging_quality" else 0.5} for v in vids]]
                       for d in dimension_list}
                json.dump(res, open(os.path.join(self.out, name + "_eval_results.json"), "w"))
    '''))
    videos = tmp_path / "videos"
    write_video(videos / "a.mp4", smooth_video(t=2))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake_site'} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    r = vb.run_vbench(videos, python=str(wrapper), out_dir=tmp_path / "out", cache_dir=tmp_path / "cache",
                      torch_home=tmp_path / "th")
    assert r["overall"]["imaging_quality"] == 0.5 and r["videos"]["a.mp4"]["imaging_quality"] == 0.5


# --- the sweep ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sweep_produces_both_tables_and_resumes(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red panda\na boat\n")
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "sweep_tables.py"),
           "--out", str(tmp_path / "s"), "--prompts-file", str(prompts), "--steps", "2", "--frames", "5"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    res = json.loads((tmp_path / "s" / "tables.json").read_text())
    assert [r["method"] for r in res["table2"]] == ["FP16", "MXFP4 (OCP)", "NVFP4", "NVFP4 + SageAttention", "MXAttention"]
    assert [r["configuration"] for r in res["table3"]] == ["Full", "w/o UOS", "w/o PNQ and UOS", "OCP MXFP4"]
    for r in res["table2"][1:] + res["table3"]:
        assert 0 < r["ssim"] <= 1 and r["cosine"] > 0.5
    md = (tmp_path / "s" / "tables.md").read_text()
    assert "Table 3" in md and "policy rules: block 0 in fp16" in md
    assert all(r["cosine_se"] is not None for r in res["table2"][1:])  # two prompts: a spread
    for png in ("methods.png", "similarity_over_frames.png"):
        assert (tmp_path / "s" / png).stat().st_size > 1000
    # Table 3's rows are fully 4-bit, Table 2's keep block 0 in FP16: the sidecars say so
    side2 = json.loads((tmp_path / "s" / "videos" / "table2-mxattn" / "000.json").read_text())
    side3 = json.loads((tmp_path / "s" / "videos" / "table3-mxattn" / "000.json").read_text())
    assert "fp16" in side2["methods_used"] and set(side3["methods_used"]) == {"mxattn"}
    mtime = (tmp_path / "s" / "videos" / "fp16" / "000.mp4").stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "sweep:" not in again.stderr  # nothing left to generate
    assert (tmp_path / "s" / "videos" / "fp16" / "000.mp4").stat().st_mtime_ns == mtime


def test_sweep_tables_refuses_frames_the_vae_cannot_take(tmp_path):
    """--frames 8 on the test model (a Wan pipeline) would be rounded to 9 by the pipeline with a
    log line, the tables naming a run that did not happen: refused in one line before any video."""
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "sweep_tables.py"),
           "--out", str(tmp_path / "s"), "--steps", "1", "--frames", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("sweep_tables.py: error: frames 8: this WanPipeline takes "
                                                    "4n + 1 frames (its VAE's 4× in time), e.g. 5 or 9")
    assert not (tmp_path / "s" / "videos").exists()


def test_sweep_tables_bold_only_differences_beyond_the_spread_and_say_the_policy():
    from fp4video.eval.sweep import bold_best, describe_rules

    rows = [{"method": "FP16", "cosine": None},
            {"method": "A", "cosine": 0.990, "cosine_se": 0.001}, {"method": "B", "cosine": 0.980, "cosine_se": 0.001},
            {"method": "C", "cosine": 0.970, "cosine_se": None}]
    assert [c["cosine"] for c in bold_best(rows, ["cosine"])] == ["–", "**0.990000**", "0.980000", "0.970000"]
    close = [dict(r) for r in rows]
    close[1]["cosine"] = 0.9815  # 0.0015 ahead, within 2 × 0.001
    assert "**" not in "".join(c["cosine"] for c in bold_best(close, ["cosine"]))
    one_prompt = [dict(r, cosine_se=None) for r in rows]
    assert "**" not in "".join(c["cosine"] for c in bold_best(one_prompt, ["cosine"]))
    assert describe_rules([{"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 2}}]) == \
        "block 0 in fp16; the last 2 steps in fp16"
    assert describe_rules([]) == "none (every call in the method)"


# --- the clock and the power cap under a timing (fp4video.eval.power) -----------------------------


class _FakeNVML:
    """What :mod:`fp4video.eval.power` calls of pynvml: a GPU whose clock and power follow a
    script, the power-cap bit set in every other sample."""

    NVML_CLOCK_SM = 1

    def __init__(self, clocks, watts):
        self.clocks, self.watts, self.calls = clocks, watts, 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        assert handle == "gpu0"
        return 0x4 if self.calls % 2 else 0x1  # SW power cap / GPU idle

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert which == self.NVML_CLOCK_SM
        self.calls += 1
        return self.clocks[min(self.calls - 1, len(self.clocks) - 1)]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.watts * 1000  # mW


def test_clock_sampler_means_the_settled_window_and_counts_the_power_cap():
    """The sampler averages the clock and power over the window's last three quarters (the first
    quarter, where the clock is still falling, left out), and the share of samples with the power
    cap's bit (0x4) set; a window too short for 8 samples gives no mean and says so."""
    import time

    from fp4video.eval.power import ClockSampler, summarize

    nvml = _FakeNVML([1980] * 4 + [1700] * 400, 690)
    sampler = ClockSampler(nvml, "gpu0", interval=0.002)
    with sampler:
        time.sleep(0.2)
    w = sampler
    assert w.result is not None and w.why is None
    assert abs(w.result.watts - 690) < 1e-9
    assert 1700 <= w.result.mhz < 1700 + 280 * 4 / 60  # the first quarter (with the 1980s) dropped
    assert 0.4 < w.result.capped < 0.6
    assert summarize([(1980.0, 400.0, False)] * 7) is None
    short = ClockSampler(nvml, "gpu0", interval=10.0)
    with short:
        pass
    assert short.result is None and "too few" in short.why
    short.interval = 0.002  # the same sampler again: each block starts afresh
    with short:
        time.sleep(0.1)
    assert short.result is not None and short.why is None
    # by hand: the quarter rule and the shares
    s = summarize([(2000.0, 100.0, False)] * 2 + [(1600.0, 700.0, True)] * 3 + [(1800.0, 500.0, False)] * 3)
    assert (s.mhz, s.watts, s.capped) == (1700.0, 600.0, 0.5)


def test_clock_sampler_without_nvml_says_what_to_install(monkeypatch):
    """Without nvidia-ml-py the sampler is unavailable, measures nothing, and names the package."""
    import sys

    from fp4video.eval.power import ClockSampler

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    sampler = ClockSampler.for_device(0)
    assert not sampler.available and "nvidia-ml-py" in sampler.why
    with sampler:
        pass
    assert sampler.result is None and "nvidia-ml-py" in sampler.why


# --- speed tables as plots (fp4video.eval.speed) -------------------------------------------------


def test_bench_kernel_tables_parse_back_and_plot(tmp_path):
    """What `bench kernel` writes (its own formatter) is read back row for row — sequence length,
    kernel, milliseconds, ratio — across several tables with other markdown between them, and drawn
    as a PNG with one bar per fp4video row; a header without rows is an error, not a silent skip."""
    from PIL import Image

    from fp4video.cli.bench import RATIO_PEERS, KernelTiming, format_kernel_table
    from fp4video.eval.speed import KernelTable, parse_kernel_tables, plot_kernel_tables

    sage, fa3 = 40.0, 41.0  # peers' ms
    row = lambda s, k, t, pre=None, loop=None, peers=True, cos=0.9, mhz=None, capped=None: KernelTiming(  # noqa: E731
        s, k, t, pre, loop, 38.48 / t, dict(zip(RATIO_PEERS, (sage / t, fa3 / t) if peers else (None, None))),
        cos, cos - 0.1, None if "best" in k else 0.99, mhz, capped)
    rows_a = [row(32760, "cuDNN SDPA bf16 (best bf16)", 38.48, mhz=1629.4, capped=1.0),
              row(32760, "FlashAttention-3 FP8 (cast included)", fa3, mhz=1725.0, capped=0.985),
              row(32760, "fp4video mxattn", 36.91, 0.98, 35.97, cos=0.97045, mhz=1853.2, capped=0.0),
              row(32760, "fp4video sage3", 53.77, 1.85, 51.94, cos=0.98184)]
    rows_b = [row(119056, "SDPA default dispatch bf16 (best bf16)", 438.76, peers=False),
              row(119056, "fp4video nvfp4", 485.90, 2.29, 484.04, peers=False, cos=0.98181)]
    text = "\n".join([
        "# notes", format_kernel_table("### bench kernel, B=1 H=40 D=128, bf16: GPU X, 2026-11-30", rows_a, 40, 128),
        "some prose | with a pipe", "### bench pipeline, other: GPU X",
        format_kernel_table("### bench kernel, B=1 H=24 D=128, bf16, last 56 keys masked (key padding): GPU X, d",
                            rows_b, 24, 128, notes=["SageAttention2: takes no key-padding mask"]),
        # the format before the clock was sampled (peers timed) reads back too
        "### bench kernel, B=1 H=40 D=128, bf16: GPU Z, 2026-12-01", "",
        "| S | kernel | ms (total) | TFLOP/s | pre-pass ms | loop ms | × best bf16 | × SageAttention2 | "
        "× FA3 FP8 (cast incl.) | cosine to fp32 | worst-row cosine to fp32 | cosine to best bf16 |",
        "|" + " --- |" * 12,
        "| 75600 | fp4video mxattn-pv8 | 150.41 | 778 | 1.61 | 146.15 | 1.18 | 0.98 | 0.93 | 0.98627 | 0.9533 | 0.98632 |",
        # and the format before peers were timed
        "### bench kernel, B=1 H=40 D=128, bf16: GPU Y, 2026-11-30", "",
        "| S | kernel | ms (total) | TFLOP/s | pre-pass ms | loop ms | × best baseline | cosine to best baseline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 8192 | cuDNN SDPA bf16 (best baseline) | 2.50 | 440 |  |  | 1.00 | (reference) |",
        "| 8192 | fp4video mxattn | 2.30 | 478 | 0.10 | 2.10 | 1.09 | 0.96900 |"])
    assert "Not timed: SageAttention2: takes no key-padding mask." in text
    tables = parse_kernel_tables(text)
    assert [t.title for t in tables] == ["B=1 H=40 D=128, bf16", "B=1 H=24 D=128, bf16, last 56 keys masked (key padding)",
                                         "B=1 H=40 D=128, bf16", "B=1 H=40 D=128, bf16"]
    # the clock columns: as written (MHz to the unit, the power-cap share in whole percent), empty where not sampled
    assert [(r.mhz, r.capped) for r in tables[0].rows] == [(1629.0, 1.0), (1725.0, 0.98), (1853.0, 0.0), (None, None)]
    assert all((r.mhz, r.capped) == (None, None) for t in tables[1:] for r in t.rows)
    assert [(r.kernel, r.ms, r.ratio, r.x_peers, r.cos_fp32) for r in tables[2].rows] == [
        ("fp4video mxattn-pv8", 150.41, 1.18, (0.98, 0.93), 0.98627)]
    for table, rows in zip(tables, (rows_a, rows_b)):
        assert [(r.seq, r.kernel, r.ms) for r in table.rows] == [(x.seq, x.kernel, round(x.ms, 2)) for x in rows]
        assert [r.ratio for r in table.rows] == [round(x.x_best_bf16, 2) for x in rows]
        assert [r.cos_fp32 for r in table.rows] == [round(x.cos_fp32, 5) for x in rows]
    assert tables[0].rows[2].x_peers == (round(sage / 36.91, 2), round(fa3 / 36.91, 2))
    assert tables[1].rows[1].x_peers == (None, None)
    assert [(r.kernel, r.ratio, r.x_peers, r.cos_fp32) for r in tables[3].rows] == [
        ("cuDNN SDPA bf16 (best baseline)", 1.0, (), None), ("fp4video mxattn", 1.09, (), None)]
    png = plot_kernel_tables(tables, tmp_path / "speed.png", bar=0.8)
    with Image.open(png) as im:
        assert im.size[0] > 600 and im.size[1] > 300
    with pytest.raises(ValueError, match="has no rows"):
        parse_kernel_tables("### bench kernel, B=1 H=40 D=128, bf16: GPU X\n\n| S | kernel |\n")
    only_baseline = KernelTable("t", "w", tables[0].rows[:1])
    with pytest.raises(ValueError, match="no fp4video rows"):
        plot_kernel_tables([only_baseline], tmp_path / "x.png")
