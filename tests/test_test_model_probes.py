"""``scripts/test_model_probes.py`` on a smoke-trained test model: ``pool_clips`` gives the clips a
run's pool holds; the seen-unseen probe reads the run's pool from its log and gives equal losses on
equal sets; the partial probe from t0 = 1 is the pipeline's own generation and from t0 = 0 the VAE's
round trip, its negative captions change the shape word alone; bad arguments are one line."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch

from fp4video.testmodel import test_model_pipeline
from fp4video.testmodel import train as tm
from fp4video.testmodel.model import SMOKE
from fp4video.testmodel.scenes import render
from fp4video.testmodel.train import SMOKE_SETTINGS, Settings, call_for, clip_frames, config_of, eval_scenes, generate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _load(name):
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A smoke run of seed 3 (pool of 4 clips in encode batches of 3: one whole batch, one of 1),
    with the pool it built."""
    run = tmp_path_factory.mktemp("probe") / "run"
    built = []
    build = tm._build_pool

    def keep(*a, **k):
        built.append(build(*a, **k))
        return built[-1]

    tm._build_pool = keep
    try:
        s = Settings(**{**SMOKE_SETTINGS, "eval_clips": 0, "seed": 3, "encode_batch": 3})
        tm.train(s, run, device="cpu", log=lambda *a, **k: None)
    finally:
        tm._build_pool = build
    return run, s, built[0]


def _quiet_main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = _load("test_model_probes").main(argv)
    return code, out.getvalue()


def test_pool_clips_are_the_clips_of_the_runs_pool(smoke_run):
    """Every prefix of the pool (within a batch, across the batches, the whole pool) equals the pool
    the run built; a count beyond the pool is refused."""
    run, s, (latents, ids, masks, _) = smoke_run
    pipe = test_model_pipeline(device=torch.device("cpu"), dtype=torch.float32, path=run / "pipeline")
    config = config_of(pipe, SMOKE)
    # the saved weights are half precision: the reloaded VAE encodes within a few thousandths of the
    # run's own; another clip is a different latent altogether
    for count in (1, 2, 3, 4):
        lat, i, m, cover = tm.pool_clips(pipe, config, s, 0, count, "cpu")
        torch.testing.assert_close(lat, latents[:count], rtol=0, atol=0.02)
        assert torch.equal(i, ids[:count]) and torch.equal(m, masks[:count]) and cover.shape[:2] == (count, 1)
    later = tm.pool_clips(pipe, config, s, 3, 1, "cpu")[0]
    assert (later[0] - latents[0]).abs().max() > 0.2 and (later[0] - latents[3]).abs().max() > 0.2
    with pytest.raises(ValueError, match=r"count must be in 1\.\.4"):
        tm.pool_clips(pipe, config, s, 0, 5, "cpu")


def test_seen_unseen_reads_the_pool_from_the_log_and_equal_sets_give_equal_losses(smoke_run, tmp_path):
    run, s, _ = smoke_run
    code, printed = _quiet_main(["seen-unseen", "--model", str(run), "--smoke", "--clips", "3", "--u", "0.2", "0.9",
                                 "--fresh-offset", "0", "--out", str(tmp_path / "same")])
    assert code == 0 and "u 0.9" in printed
    record = json.loads((tmp_path / "same" / "seen-unseen.json").read_text())
    assert record["pool"] == {"seed": 3, "first": 0, "encode_batch": 3, "pool_size": 4, "shape_weights": None,
                              "upright": False, "from_training_log": True}
    same = record["results"]
    for u in ("0.2", "0.9"):
        assert same[u]["pool"] == same[u]["fresh"], "the same clips and noise give the same loss"
        assert same[u]["paired_difference"] == {"mean": 0.0, "se": 0.0}
        assert math.isfinite(same[u]["pool"]["loss"]) and same[u]["pool"]["loss"] > 0
    assert same["0.9"]["t"] == pytest.approx(3 * 0.9 / (1 + 2 * 0.9), rel=1e-6)  # the shift-3 t of u
    code, _ = _quiet_main(["seen-unseen", "--model", str(run), "--smoke", "--clips", "3", "--u", "0.9",
                           "--out", str(tmp_path / "apart")])
    apart = json.loads((tmp_path / "apart" / "seen-unseen.json").read_text())["results"]["0.9"]
    assert apart["pool"] == same["0.9"]["pool"] and apart["fresh"] != apart["pool"], "other clips, another loss"
    assert apart["paired_difference"]["mean"] == pytest.approx(apart["pool"]["loss"] - apart["fresh"]["loss"])


def test_partial_from_one_is_the_pipelines_generation_and_from_zero_the_vae_round_trip(smoke_run):
    run, _, _ = smoke_run
    probes = _load("test_model_probes")
    pipe = test_model_pipeline(device=torch.device("cpu"), dtype=torch.float32, path=run / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    config = config_of(pipe, SMOKE)
    scenes = eval_scenes(2, 1234)
    timesteps = []
    pipe.transformer.register_forward_pre_hook(lambda mod, args, kw: timesteps.append(kw["timestep"].clone()),
                                               with_kwargs=True)
    with torch.no_grad():
        from_noise, sigma1 = probes.denoise_from(pipe, config, scenes, 1.0, steps=3, guidance=4.0, seed=50,
                                                 device="cpu")
        probe_steps = list(timesteps)
        timesteps.clear()
        stock = generate(pipe, scenes.captions(), call_for(config, 3, 4.0), 50, torch.device("cpu"))
        stock_steps = list(timesteps)
        timesteps.clear()
        unguided, _ = probes.denoise_from(pipe, config, scenes, 1.0, steps=2, guidance=1.0, seed=50, device="cpu")
        unguided_calls = len(timesteps)
        stock_unguided = generate(pipe, scenes.captions(), call_for(config, 2, 1.0), 50, torch.device("cpu"))
        timesteps.clear()
        trip_probe, sigma0 = probes.denoise_from(pipe, config, scenes, 0.0, steps=3, guidance=4.0, seed=0,
                                                 device="cpu")
        video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device="cpu")
        trip = clip_frames(pipe.vae.decode(pipe.vae.encode(video).latent_dist.mean).sample)
    torch.testing.assert_close(from_noise, stock, rtol=0, atol=2e-6)
    assert sigma1 == pytest.approx(float(pipe.scheduler.sigmas[0])) and sigma0 == 0.0
    # the pipeline runs the batch of 2 at once, the probe clip by clip: the same timesteps, in order
    assert [float(t[0]) for t in stock_steps] == [float(t[0]) for t in probe_steps[:len(stock_steps)]]
    assert len(probe_steps) == 2 * 2 * 3 and timesteps == []  # (caption, negative) × 3 steps × 2 clips; none from 0
    torch.testing.assert_close(trip_probe, trip, rtol=0, atol=1e-5)
    # guidance 1: no guidance, as the pipeline has it (the caption's prediction alone, one call a step)
    torch.testing.assert_close(unguided, stock_unguided, rtol=0, atol=2e-6)
    assert unguided_calls == 2 * 2
    specs = eval_scenes(24, 1234).specs  # every shape
    for shape in ("square", "circle", "triangle", "bar"):
        for spec, neg in zip(specs, probes.negative_captions(specs, shape)):
            want = shape if spec.shape != shape else ("circle" if shape == "square" else "square")
            assert neg == spec.caption.replace(spec.shape, want, 1) and want != spec.shape, (spec.caption, neg)


def test_partial_cli_writes_each_t0_with_its_verdicts_and_bad_arguments_are_one_line(smoke_run, tmp_path):
    run, _, _ = smoke_run
    code, printed = _quiet_main(["partial", "--model", str(run), "--smoke", "--clips", "2", "--t0", "0", "0.6",
                                 "--steps", "4", "--negative-shape", "bar", "--out", str(tmp_path / "p")])
    assert code == 0 and printed.count("t0 ") == 2
    results = json.loads((tmp_path / "p" / "partial.json").read_text())["results"]
    assert set(results) == {"0.0", "0.6"} and results["0.0"]["clips"] == 2 and len(results["0.6"]["verdicts"]) == 2
    assert results["0.0"]["sigma"] == 0.0 and results["0.6"]["sigma"] == pytest.approx(0.5, abs=0.002)  # shift 3, 4 steps
    for argv, message in ((["partial", "--t0", "1.5"], "--t0 1.5: must be in [0, 1]"),
                          (["seen-unseen", "--clips", "1"], "--clips must be at least 2, got 1"),
                          (["seen-unseen", "--t0", "0.3"], "--t0 is the partial probe's option, not seen-unseen's"),
                          (["partial", "--u", "0.3"], "--u is the seen-unseen probe's option, not partial's"),
                          (["partial", "--device", "nowhere"], "--device nowhere:"),
                          (["seen-unseen", "--model", str(run), "--smoke", "--clips", "5"],
                           "--clips 5: the run's pool held 4"),
                          (["partial", "--model", str(tmp_path / "nowhere")], "no such folder")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            _load("test_model_probes").main([*argv, "--out", str(tmp_path / "bad")])
        last = err.getvalue().strip().splitlines()[-1]
        assert last.startswith("test_model_probes.py: error:") and message in last, last
    assert not (tmp_path / "bad").exists()


def test_partial_denoises_upright_clips_for_a_model_trained_on_them(smoke_run, tmp_path, monkeypatch):
    """The partial probe's true clips are drawn as the probed model's training log says: upright for
    a model trained ``upright``, turned for the others; the record says which."""
    import shutil

    run, _, _ = smoke_run
    upright_run = tmp_path / "upright"
    shutil.copytree(run, upright_run)
    log = json.loads((upright_run / "train_log.json").read_text())
    log["settings"]["upright"] = True
    (upright_run / "train_log.json").write_text(json.dumps(log))
    asked = []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("upright", False))
        return eval_scenes(*args, **kwargs)

    monkeypatch.setattr(tm, "eval_scenes", spy)
    for model, expected in ((upright_run, True), (run, False)):
        out = tmp_path / f"p-{expected}"
        code, _ = _quiet_main(["partial", "--model", str(model), "--smoke", "--clips", "1", "--t0", "0",
                               "--steps", "2", "--out", str(out)])
        assert code == 0 and asked[-1] is expected
        assert json.loads((out / "partial.json").read_text())["upright"] is expected
    code, _ = _quiet_main(["partial", "--model", str(upright_run), "--smoke", "--clips", "1", "--t0", "0",
                           "--steps", "2", "--no-upright", "--out", str(tmp_path / "forced")])
    assert code == 0 and asked[-1] is False
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _load("test_model_probes").main(["seen-unseen", "--upright", "--out", str(tmp_path / "bad")])
    assert "--upright is the partial probe's option, not seen-unseen's" in err.getvalue()
