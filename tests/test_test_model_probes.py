"""``scripts/test_model_probes.py`` on a smoke-trained test model: the seen-unseen probe draws the
clips a training run's pool draws and gives equal losses on equal sets; the partial probe's t0 = 0
is the VAE's round trip and its negative captions change the shape word alone; bad arguments are
one line."""

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
from fp4video.testmodel.train import SMOKE_SETTINGS, Settings, clip_frames, config_of, eval_scenes

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory):
    run = tmp_path_factory.mktemp("probe") / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _load("train_test_model").main(["--smoke", "--out", str(run), "--max-vae-steps", "1",
                                               "--eval-clips", "0"]) == 0
    return run


def _quiet_main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = _load("test_model_probes").main(argv)
    return code, out.getvalue()


def test_pool_clips_draw_what_a_training_runs_pool_draws(monkeypatch, tmp_path):
    """The (count, stream seed) of every encode a fresh smoke run's pool makes are the ones
    ``pool_clips`` makes for that seed from 0, and a later ``first`` moves along the same stream."""
    calls = []
    encode = tm._encode_clips

    def spy(pipe, config, s, device, count, seed):
        calls.append((count, seed))
        return encode(pipe, config, s, device, count, seed)

    monkeypatch.setattr(tm, "_encode_clips", spy)
    s = Settings(**{**SMOKE_SETTINGS, "eval_clips": 0, "seed": 3})
    tm.train(s, tmp_path / "run", device="cpu", log=lambda *a, **k: None)
    pool_draws = [c for c in calls if c[1] in {tm._stream(3, "pool", i) for i in range(0, s.pool_size, 1)}]
    assert len(pool_draws) == math.ceil(s.pool_size / s.encode_batch)
    calls.clear()
    pipe = test_model_pipeline(device=torch.device("cpu"), dtype=torch.float32, path=tmp_path / "run")
    config = config_of(pipe, SMOKE)
    lat, ids, masks, cover = tm.pool_clips(pipe, config, 3, 0, s.pool_size, "cpu", encode_batch=s.encode_batch)
    assert calls == pool_draws
    assert len(lat) == len(ids) == len(masks) == len(cover) == s.pool_size and cover.shape[1] == 1
    calls.clear()
    tm.pool_clips(pipe, config, 3, 2 * s.encode_batch, 1, "cpu", encode_batch=s.encode_batch)
    assert calls == [(1, tm._stream(3, "pool", 2 * s.encode_batch))]


def test_seen_unseen_gives_equal_losses_on_equal_sets_and_writes_its_record(smoke_model, tmp_path):
    code, printed = _quiet_main(["seen-unseen", "--model", str(smoke_model), "--smoke", "--clips", "3",
                                 "--u", "0.2", "0.9", "--fresh-offset", "0", "--out", str(tmp_path / "same")])
    assert code == 0 and "u 0.9" in printed
    same = json.loads((tmp_path / "same" / "seen-unseen.json").read_text())["results"]
    for u in ("0.2", "0.9"):
        assert same[u]["pool"] == same[u]["fresh"], "the same clips and noise give the same loss"
        assert math.isfinite(same[u]["pool"]["loss"]) and same[u]["pool"]["loss"] > 0
    code, _ = _quiet_main(["seen-unseen", "--model", str(smoke_model), "--smoke", "--clips", "3", "--u", "0.9",
                           "--out", str(tmp_path / "apart")])
    apart = json.loads((tmp_path / "apart" / "seen-unseen.json").read_text())["results"]["0.9"]
    assert apart["pool"] == same["0.9"]["pool"] and apart["fresh"] != apart["pool"], "other clips, another loss"


def test_partial_from_t0_zero_is_the_vae_round_trip_and_the_negative_changes_the_shape_word(smoke_model):
    probes = _load("test_model_probes")
    pipe = test_model_pipeline(device=torch.device("cpu"), dtype=torch.float32, path=smoke_model)
    config = config_of(pipe, SMOKE)
    scenes = eval_scenes(3, 1234)
    calls = []
    pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    runs = {}
    with torch.no_grad():
        for t0, steps in ((0.0, 4), (1.0, 3), (0.5, 4)):
            calls.clear()
            runs[t0] = probes.denoise_from(pipe, config, scenes, t0, steps=steps, guidance=4.0, seed=0, device="cpu")
            runs[t0, "calls"] = len(calls)
        video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device="cpu")
        trip = clip_frames(pipe.vae.decode(pipe.vae.encode(video).latent_dist.mean).sample)
    torch.testing.assert_close(runs[0.0], trip, rtol=0, atol=1e-5)
    # the transformer runs twice (caption, negative) a step: no step from t0 = 0, all of them from 1,
    # from 0.5 those of the shift-3 grid below it (u = 0.25 of 4 steps: 1)
    assert (runs[0.0, "calls"], runs[1.0, "calls"], runs[0.5, "calls"]) == (0, 2 * 3 * 3, 2 * 3 * 1)
    assert runs[1.0].shape == trip.shape and torch.isfinite(runs[1.0]).all()
    specs = eval_scenes(24, 1234).specs  # every shape
    for shape in ("square", "circle", "triangle", "bar"):
        for spec, neg in zip(specs, probes.negative_captions(specs, shape)):
            want = shape if spec.shape != shape else ("circle" if shape == "square" else "square")
            assert neg == spec.caption.replace(spec.shape, want, 1) and want != spec.shape, (spec.caption, neg)


def test_partial_cli_writes_each_t0_and_bad_arguments_are_one_line(smoke_model, tmp_path):
    code, printed = _quiet_main(["partial", "--model", str(smoke_model), "--smoke", "--clips", "2", "--t0", "0", "0.5",
                                 "--steps", "2", "--negative-shape", "bar", "--out", str(tmp_path / "p")])
    assert code == 0 and printed.count("t0 ") == 2
    record = json.loads((tmp_path / "p" / "partial.json").read_text())
    assert set(record["results"]) == {"0.0", "0.5"} and record["results"]["0.0"]["clips"] == 2
    for argv, message in ((["partial", "--t0", "1.5"], "--t0 1.5: must be in [0, 1]"),
                          (["seen-unseen", "--clips", "0"], "--clips must be at least 1, got 0"),
                          (["partial", "--model", str(tmp_path / "nowhere")], "no such folder")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            _load("test_model_probes").main([*argv, "--out", str(tmp_path / "bad")])
        last = err.getvalue().strip().splitlines()[-1]
        assert last.startswith("test_model_probes.py: error:") and message in last, last
    assert not (tmp_path / "bad").exists()
