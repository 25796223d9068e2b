"""What the command line promises when things go wrong: outputs written whole (an interrupted run
leaves the previous video/sidecar pair, never a short video or a mismatched sidecar); Ctrl-C is
one line and exit 130; unusable input is one line ``fp4video <command>: error: ...`` and exit 2,
found before any work (a real model's frame count included); under torchrun rank 0 alone says
these lines; the accuracy harness builds finite inputs for every seed; `eval` reports identical
videos as PSNR inf; optional libraries' import noise stays off the user's terminal.

CLI calls run in this process through ``main(argv)``; one subprocess runs the real `generate`."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4video.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def shown(text: str) -> str:
    """``text`` as a terminal shows it: of each line, what follows its last carriage return (a
    cleared progress bar leaves nothing), blank lines dropped."""
    lines = (line.split("\r")[-1].rstrip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line.strip())


def cli(capsys, *argv) -> tuple[int, str]:
    """(exit status, stderr as a terminal shows it) of ``fp4video ARGV`` run in this process."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    except KeyboardInterrupt:  # (uncaught, it would stop the whole pytest run)
        pytest.fail("KeyboardInterrupt escaped main()")
    return rc, shown(capsys.readouterr().err)


def assert_one_line_error(rc: int, err: str, command: str, *fragments: str):
    """Exit 2, no traceback, and the error as the last (for argparse: after its usage) single line."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    last = lines[-1]
    assert last.startswith(f"fp4video {command}: error: "), err
    if "usage:" not in err:
        assert len(lines) == 1, err
    for f in fragments:
        assert f in last, (f, last)


@pytest.fixture
def no_work(monkeypatch):
    """Every expensive step of generate / eval / accuracy fails the test if it is reached."""

    def forbidden(*_a, **_k):
        raise AssertionError("work started before the input was checked")

    import fp4video.eval
    import fp4video.harness.report
    import fp4video.integration.pipelines as pipelines

    monkeypatch.setattr(pipelines, "load_pipeline", forbidden)
    monkeypatch.setattr(pipelines, "pipeline_kwargs", forbidden)
    monkeypatch.setattr(fp4video.eval, "evaluate_paths", forbidden)
    monkeypatch.setattr(fp4video.harness.report, "run_all", forbidden)


def small_video(path: Path, frames: int = 3, seed: int = 0):
    import imageio.v3 as iio

    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.interpolate(torch.rand(frames, 3, 4, 4, generator=g), size=(32, 48), mode="bilinear")
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, (x.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy(), fps=8, codec="libx264",
                quality=None, pixelformat="yuv444p", ffmpeg_params=["-crf", "0"])
    return path


# --- outputs are written whole; Ctrl-C is one line ---------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial" in p.name)


@pytest.mark.parametrize("previous", [True, False], ids=["over a previous pair", "fresh"])
@pytest.mark.parametrize("stop_at", ["video write", "video rename", "sidecar rename"])
def test_an_interrupted_write_never_leaves_a_short_video_or_a_mismatched_sidecar(tmp_path, monkeypatch, stop_at,
                                                                                  previous):
    """Ctrl-C at each step of writing a video and its sidecar: the folder holds the previous pair
    (or nothing), or the new video without a sidecar, never a partial video under the final name or
    a video beside another run's sidecar; no temporary file remains."""
    from fp4video.integration import media

    out = tmp_path / "v.mp4"
    if previous:
        out.write_bytes(b"OLD VIDEO")
        out.with_suffix(".json").write_text('{"run": "old"}')

    def partial_writer(frames, path, fps, audio=None, sample_rate=None):
        Path(path).write_bytes(b"NEW VI")  # a partial file under the temporary name
        if stop_at == "video write":
            raise KeyboardInterrupt
        Path(path).write_bytes(b"NEW VIDEO")

    real_replace, renames = os.replace, []

    def replace(src, dst):
        renames.append(Path(dst).suffix)
        if (stop_at == "video rename" and len(renames) == 1) or (stop_at == "sidecar rename" and len(renames) == 2):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(media, "write_video", partial_writer)
    monkeypatch.setattr(media.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        media.write_video_and_sidecar(None, out, '{"run": "new"}', fps=8)
    monkeypatch.undo()
    assert _leftovers(tmp_path) == []
    video = out.read_bytes() if out.exists() else None
    sidecar = json.loads(out.with_suffix(".json").read_text())["run"] if out.with_suffix(".json").exists() else None
    assert video in ((b"OLD VIDEO", b"NEW VIDEO") if previous else (None, b"NEW VIDEO"))  # never b"NEW VI"
    if stop_at == "video write":  # nothing renamed yet: exactly what was there before
        assert (video, sidecar) == ((b"OLD VIDEO", "old") if previous else (None, None))
    if sidecar is not None:
        assert (video, sidecar) in ((b"OLD VIDEO", "old"), (b"NEW VIDEO", "new"))


def test_a_completed_write_replaces_both_and_keeps_a_writers_by_products(tmp_path, monkeypatch):
    """The new pair replaces the old; a stand-in writer that saves frames as NAME.npy instead of a
    video (scripts/generate_frames.py) gets NAME.npy under the final name and no stale video."""
    from fp4video.integration import media

    out = tmp_path / "v.mp4"
    out.write_bytes(b"OLD VIDEO")
    out.with_suffix(".json").write_text('{"run": "old"}')
    monkeypatch.setattr(media, "write_video", lambda frames, path, *a, **k: Path(f"{path}.npy").write_bytes(b"F"))
    media.write_video_and_sidecar(None, out, '{"run": "new"}', fps=8)
    assert not out.exists() and Path(f"{out}.npy").read_bytes() == b"F"
    assert json.loads(out.with_suffix(".json").read_text()) == {"run": "new"} and _leftovers(tmp_path) == []
    monkeypatch.setattr(media, "write_video", lambda frames, path, *a, **k: Path(path).write_bytes(b"NEW VIDEO"))
    media.write_video_and_sidecar(None, out, '{"run": "newer"}', fps=8)
    assert out.read_bytes() == b"NEW VIDEO" and json.loads(out.with_suffix(".json").read_text()) == {"run": "newer"}


@pytest.mark.filterwarnings("ignore:fp4video policy")  # one step: the "last 2 steps" rule covers it
def test_ctrl_c_during_generates_video_write_keeps_the_previous_pair_and_exits_130(tmp_path, monkeypatch, capsys):
    """The real tiny `generate`, interrupted while the mp4 is being written (a partial file on
    disk): exit 130 and one line, the previous run's video and sidecar untouched, no temporary
    file; under the final name there is never a short video."""
    from fp4video.integration import media

    out = tmp_path / "v.mp4"
    out.write_bytes(b"previous video")
    out.with_suffix(".json").write_text('{"run": "previous"}')

    def interrupted(frames, path, fps, audio=None, sample_rate=None):
        Path(path).write_bytes(b"\x00\x00\x00\x18ftypisom")  # the first bytes of an mp4
        raise KeyboardInterrupt

    monkeypatch.setattr(media, "write_video", interrupted)
    rc, err = cli(capsys, "generate", "--steps", "1", "--frames", "5", "--output", out)
    assert rc == 130 and err.splitlines()[-1] == "fp4video: interrupted" and "Traceback" not in err, err
    assert out.read_bytes() == b"previous video" and json.loads(out.with_suffix(".json").read_text())["run"] == "previous"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("argv, target", [
    (["generate"], "fp4video.integration.pipelines.load_pipeline"),
    (["eval", "--reference", "a.mp4", "--candidate", "b.mp4"], "fp4video.eval.evaluate_paths"),
    (["accuracy", "--no-plots"], "fp4video.harness.report.run_all"),
])
def test_ctrl_c_anywhere_in_a_command_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys, argv, target):
    """KeyboardInterrupt in the middle of generate / eval / accuracy: "fp4video: interrupted" and
    exit 130 (128 + SIGINT), no traceback."""
    module, name = target.rsplit(".", 1)

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, interrupt)
    monkeypatch.chdir(tmp_path)
    rc, err = cli(capsys, *argv)
    assert rc == 130 and err.strip() == "fp4video: interrupted", err


# --- unusable input: one line, exit 2, before any work -----------------------------------------------


def _bad_generate_inputs(tmp: Path) -> list[tuple[list, tuple[str, ...]]]:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    (tmp / "w.json").mkdir()
    not_utf8 = tmp / "latin1.yaml"
    not_utf8.write_bytes("model: caf\xe9\n".encode("latin-1"))
    deep = tmp / "deep.yaml"
    deep.write_text("a: " + "[" * 1000 + "]" * 1000 + "\n")
    big_seed = tmp / "seed.yaml"
    big_seed.write_text(f"model: tiny\nseed: {2**70}\n")
    empty_model = tmp / "empty-model.yaml"
    empty_model.write_text('model: ""\n')
    return [
        (["--device", "bogus"], ("--device", "bogus")),
        (["--device", "cuda:x"], ("--device",)),
        (["--output", tmp], ("--output", "is a folder")),
        (["--output", tmp / "v.txt"], ("--output", ".mp4")),
        (["--output", tmp / "v.MKV.json"], ("--output", ".mp4")),
        (["--output", a_file / "v.mp4"], ("--output", "is a file, not a folder")),
        (["--output", "/proc/fp4video-none/v.mp4"], ("--output", "cannot write")),
        (["--output", tmp / "w.mp4"], ("w.json", "is a folder")),
        (["--height", "160000"], ("height 160000", "at most 8192")),
        (["--width", "100000", "--height", "16"], ("width 100000", "at most 8192")),
        (["--height", "8192", "--width", "8192", "--frames", "2001"], ("2**33",)),
        (["--frames", "100001"], ("frames 100001", "at most 2049")),
        (["--steps", "1000000"], ("steps 1000000", "at most 10000")),
        (["--seed", str(2**70)], ("--seed", "out of range")),
        (["--seed", "-1"], ("--seed", "out of range")),
        (["--model", ""], ("--model ''", "empty")),
        (["--model", "  "], ("--model", "empty")),
        (["--config", tmp], (str(tmp),)),
        (["--config", not_utf8], ("latin1.yaml", "UTF-8")),
        (["--config", deep], ("deep.yaml",)),
        (["--config", big_seed], ("seed", "out of range")),
        (["--config", empty_model], ("model", "empty")),
    ]


def test_bad_generate_input_is_one_line_before_any_work(tmp_path, no_work, capsys, monkeypatch):
    """Each kind of unusable `generate` input (device names, output paths that cannot take the mp4
    or its sidecar, sizes past the bounds, seeds torch cannot take, an empty model, configs that
    are folders / not UTF-8 / nested 1000 deep) ends in one line and exit 2 before the pipeline
    or its inputs are touched."""
    monkeypatch.chdir(tmp_path)  # the default --output goes here
    for argv, fragments in _bad_generate_inputs(tmp_path):
        rc, err = cli(capsys, "generate", *argv)
        assert_one_line_error(rc, err, "generate", *fragments)


@pytest.fixture(scope="module")
def saved_pipelines(tmp_path_factory) -> Path:
    """Tiny Wan and LTX-Video pipelines saved as a real model's folder is (model_index.json naming
    the pipeline class, each part in its folder): ``wan/`` and ``ltx/``."""
    from fp4video.integration.tiny import tiny_ltx_pipeline, tiny_wan_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    tiny_wan_pipeline(two_experts=False).save_pretrained(root / "wan")
    tiny_ltx_pipeline().save_pretrained(root / "ltx")
    return root


def test_a_real_models_frame_count_is_refused_before_it_loads(tmp_path, saved_pipelines, no_work, capsys, monkeypatch):
    """A frame count a real model's family cannot take (Wan: 4n + 1, LTX-Video: 8n + 1) was found
    only once the weights had loaded. It is refused in one line before any loading wherever the family
    is known: from a pipeline folder's model_index.json (which wins over the config's family: the
    embedded default says wan) or, for a hub id, from the config's family. A count the family takes
    goes on to the loader."""
    monkeypatch.chdir(tmp_path)
    ltx_config = ROOT / "configs" / "ltx_mxattn.yaml"
    for argv, fragment in [
        (["--model", saved_pipelines / "wan", "--frames", "30"],
         "frames 30: Wan (WanPipeline) takes 4n + 1 frames (its VAE's 4× in time), e.g. 29 or 33"),
        (["--model", saved_pipelines / "ltx", "--frames", "21"],
         "frames 21: LTX-Video (LTXPipeline) takes 8n + 1 frames (its VAE's 8× in time), e.g. 17 or 25"),
        (["--config", ltx_config, "--model", "someone/LTX-Video-copy", "--frames", "21"],
         "frames 21: LTX-Video (family ltx) takes 8n + 1 frames"),
    ]:
        rc, err = cli(capsys, "generate", *argv)
        assert_one_line_error(rc, err, "generate", fragment)
    for argv in (["--model", saved_pipelines / "wan", "--frames", "29"],
                 ["--model", saved_pipelines / "ltx", "--frames", "25"]):
        with pytest.raises(AssertionError, match="work started"):
            main(["generate", *map(str, argv)])


def test_every_shipped_config_takes_its_familys_frame_count():
    """The shipped configs' frame counts pass the rule their family is checked against before loading."""
    from fp4video.integration.config import FAMILIES, load_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        step = FAMILIES[cfg.family].frame_step
        assert step is None or (cfg.frames - 1) % step == 0, (path.name, cfg.frames, step)


@FAST
@given(height=st.integers(1, 700).map(lambda n: 16 * n), width=st.integers(1, 700).map(lambda n: 16 * n),
       frames=st.integers(1, 3000), steps=st.integers(1, 20_000),
       seed=st.one_of(st.integers(max_value=-1), st.integers(0, 2**64 - 1), st.integers(min_value=2**64)))
def test_run_config_bounds_refuse_exactly_the_absurd_sizes_and_seeds(height, width, frames, steps, seed):
    """A config is refused exactly when a side passes 8192, frames pass 2049, height × width × frames
    passes 2**33, steps pass 10000, or the seed falls outside 0 .. 2**64 - 1; the message names the
    value and its bound."""
    from fp4video.cli.common import UsageError
    from fp4video.cli.generate import check_run_config
    from fp4video.integration.config import RunConfig

    cfg = RunConfig(height=height, width=width, frames=frames, steps=steps, seed=seed)
    expected = []
    if height > 8192:
        expected.append(f"height {height}: at most 8192")
    if width > 8192:
        expected.append(f"width {width}: at most 8192")
    if frames > 2049:
        expected.append(f"frames {frames}: at most 2049")
    if steps > 10_000:
        expected.append(f"steps {steps}: at most 10000")
    if height * width * frames > 2**33:
        expected.append("at most 2**33")
    if not 0 <= seed < 2**64:
        expected.append(f"seed {seed}: out of range")
    if not expected:
        check_run_config(cfg)
        return
    with pytest.raises(UsageError) as e:
        check_run_config(cfg)
    assert any(x in str(e.value) for x in expected), (str(e.value), expected)


@FAST
@given(seed=st.integers(-(2**80), 2**80))
def test_seeds_are_accepted_exactly_where_torchs_generator_takes_them_without_aliasing(seed):
    """The CLI's seed range is 0 .. 2**64 - 1: every seed it accepts, torch.Generator takes and keeps
    as given (negative seeds, which torch wraps onto 2**64 + seed, are refused)."""
    import argparse

    from fp4video.cli.common import seed_arg

    try:
        value = seed_arg(str(seed))
    except argparse.ArgumentTypeError:
        assert not 0 <= seed < 2**64
        return
    assert value == seed and torch.Generator().manual_seed(value).initial_seed() == seed


def test_bad_eval_input_is_one_line(tmp_path, capsys, monkeypatch):
    """`eval` of a corrupt or empty mp4 names the file in one line; an --out that cannot be written
    (an existing folder, a folder under a file, an unwritable place) is refused before any video is read."""
    good = small_video(tmp_path / "good.mp4")
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"not a video" * 50)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    for bad in (corrupt, empty):
        rc, err = cli(capsys, "eval", "--reference", good, "--candidate", bad)
        assert_one_line_error(rc, err, "eval", bad.name, "not a video")
    (tmp_path / "file").write_text("x")
    import fp4video.eval

    monkeypatch.setattr(fp4video.eval, "evaluate_paths", lambda *a, **k: pytest.fail("read before --out was checked"))
    for out, fragment in ((tmp_path, "is a folder"), (tmp_path / "file" / "r.json", "is a file, not a folder"),
                          ("/proc/fp4video-none/r.json", "cannot write")):
        rc, err = cli(capsys, "eval", "--reference", good, "--candidate", good, "--out", out)
        assert_one_line_error(rc, err, "eval", "--out", fragment)


def test_bad_accuracy_input_is_one_line_before_any_work(tmp_path, no_work, capsys, monkeypatch):
    """`accuracy`: an --out under a file, a missing --speed file and a seed past 64 bits are refused
    before the minutes of work."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    rc, err = cli(capsys, "accuracy", "--out", tmp_path / "file" / "report")
    assert_one_line_error(rc, err, "accuracy", "--out", "is a file")
    rc, err = cli(capsys, "accuracy", "--out", tmp_path / "r", "--speed", tmp_path / "missing.md")
    assert_one_line_error(rc, err, "accuracy", "--speed", "missing.md")
    rc, err = cli(capsys, "accuracy", "--seed", str(2**70))
    assert_one_line_error(rc, err, "accuracy", "--seed", "out of range")


# --- under torchrun, errors are said once ----------------------------------------------------------


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--frames", "many"], "fp4video generate: error: argument --frames: invalid int value: 'many'"),
    (["generate", "--model", "tiny"], "fp4video generate: error: launched on 2 processes, so ring_degree × "
                                      "ulysses_degree must be 2"),
    (["generate", "--model", "tiny", "--output", "v.txt"], "fp4video generate: error: --output v.txt: "),
    (["bench", "pipeline", "--tiny", "--model", "hunyuan", "--configs", str(ROOT / "configs" / "wan22_mxattn_pv8.yaml")],
     "fp4video bench pipeline: error: " + str(ROOT / "configs" / "wan22_mxattn_pv8.yaml")
     + " is a wan config; this bench runs --model hunyuan"),
])
def test_under_torchrun_an_error_is_said_by_rank_0_alone(tmp_path, no_work, capsys, monkeypatch, argv, fragment):
    """`torchrun --nproc-per-node 2 ... generate` with unusable input printed the usage error or the
    one-line error once per process. Rank 0 says it; every other rank exits with the same status
    and says nothing; a plain run (no RANK) says it as before."""
    monkeypatch.chdir(tmp_path)
    import fp4video.cli.bench as bench

    def built(*a, **k):
        raise AssertionError("bench built its model before refusing its input")

    monkeypatch.setattr(bench, "_build", built)
    said = {}
    plain = "launched on" not in fragment  # (a plain run of a tiny model goes on to work)
    for rank in ("0", "1", None) if plain else ("0", "1"):
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", rank and "2")):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        said[rank] = cli(capsys, *argv)
    assert said["0"][0] == said["1"][0] == 2, said
    assert said["1"][1] == "", said["1"]
    assert fragment in said["0"][1], said["0"]
    if plain:
        assert said[None] == said["0"]


def test_under_torchrun_ctrl_c_is_said_by_rank_0_alone(capsys, monkeypatch):
    """Ctrl-C reaches every process of a torchrun launch: rank 0 says "fp4video: interrupted", the
    others exit 130 in silence."""
    import fp4video.cli.generate as generate

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupt)
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        said[rank] = cli(capsys, "generate")
    assert said == {"0": (130, "fp4video: interrupted"), "1": (130, "")}, said


# --- the tiny model's sizes are said; --model '' is an error ----------------------------------------


def test_tiny_model_replacing_a_configs_sizes_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """`--model tiny` with a real model's config runs the tiny sizes: one line says which sizes
    replace which (only those not given on the command line); nothing for the embedded default."""
    import fp4video.integration.pipelines as pipelines

    def stop(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipelines, "pipeline_kwargs", stop)
    cfg = ROOT / "configs" / "wan22_mxattn.yaml"
    rc, err = cli(capsys, "generate", "--config", cfg, "--model", "tiny", "--output", tmp_path / "v.mp4")
    notes = [x for x in err.splitlines() if "note:" in x]
    assert rc == 130 and len(notes) == 1, err
    assert "96×160" in notes[0] and "720×1280" in notes[0] and "81 frames" in notes[0] and "40 steps" in notes[0]
    rc, err = cli(capsys, "generate", "--output", tmp_path / "v.mp4")
    assert rc == 130 and "note:" not in err, err
    rc, err = cli(capsys, "generate", "--config", cfg, "--model", "tiny", "--height", "96", "--width", "160",
                  "--frames", "17", "--steps", "4", "--output", tmp_path / "v.mp4")
    notes = [x for x in err.splitlines() if "note:" in x]  # only the frame rate, which has no option, is left
    assert rc == 130 and len(notes) == 1 and "8 fps" in notes[0] and "frames" not in notes[0], err


# --- the accuracy harness's inputs are finite for every seed ----------------------------------------


def test_accuracy_seed_1_mse_sweep_inputs_are_finite():
    """`fp4video accuracy --seed 1` (its --help example): the MSE sweep (8 Gaussian tensors, then
    Laplace ones, from one generator) drew a uniform 0 for its third Laplace tensor, whose inverse
    CDF is log(0) = -inf; seeds 18, 25 and 50 hit the same within 8 tensors."""
    from fp4video.harness import mxattention

    for seed, laplace_index in ((1, 2), (18, 1)):
        g = torch.Generator().manual_seed(seed)
        for _ in range(8):
            mxattention.random_operand("gaussian", g)
        for i in range(laplace_index + 1):
            x = mxattention.random_operand("laplace", g)
            assert torch.isfinite(x).all(), (seed, i)


def test_heavy_tailed_sweep_inputs_survive_the_extreme_draws(monkeypatch):
    """The edge values the generators can return (a uniform 0 or 1 - 2^-24; three normals all 0) give
    finite Laplace and Student-t values, with the Laplace tail bounded by 24 ln 2."""
    from fp4video.harness import mxattention

    real_rand, real_randn = torch.rand, torch.randn

    def rand(shape, generator=None, **kw):
        u = real_rand(shape, generator=generator, **kw)
        u.view(-1)[:3] = torch.tensor([0.0, 1 - 2**-24, 0.5])
        return u

    def randn(shape, generator=None, **kw):
        z = real_randn(shape, generator=generator, **kw)
        if len(shape) == 3:  # the chi-square's three normals
            z[:, 0, 0] = 0.0
        return z

    monkeypatch.setattr(torch, "rand", rand)
    monkeypatch.setattr(torch, "randn", randn)
    g = torch.Generator().manual_seed(0)
    lap = mxattention.random_operand("laplace", g, shape=(4, 64))
    t3 = mxattention.random_operand("student-t3", g, shape=(4, 64))
    assert torch.isfinite(lap).all() and lap.abs().max() <= 24 * math.log(2) + 1e-4
    assert torch.isfinite(t3).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**64 - 1))
def test_sweep_inputs_are_finite_for_any_seed(seed):
    """Every distribution of the MSE sweep gives a finite tensor for any seed torch takes (small
    tensors: the extreme draws themselves are forced in the test above)."""
    from fp4video.harness import mxattention

    g = torch.Generator().manual_seed(seed)
    for dist in mxattention.SWEEP_DISTRIBUTIONS:
        assert torch.isfinite(mxattention.random_operand(dist, g, shape=(64, 256))).all(), dist


# --- eval: identical videos are PSNR inf --------------------------------------------------------------


def test_eval_of_identical_videos_prints_and_stores_psnr_inf(tmp_path, capsys):
    """Identical videos: the summary says "psnr inf", the JSON holds the string "inf" (standard JSON
    has no infinity; float() reads it back) for the mean, the video and every frame."""
    v = small_video(tmp_path / "a.mp4")
    rc, err = cli(capsys, "eval", "--reference", v, "--candidate", v, "--out", tmp_path / "r.json")
    assert rc == 0 and "psnr inf" in err, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["psnr"] == "inf" and float(r["psnr"]) == math.inf
    assert r["videos"]["a.mp4"]["per_frame"]["psnr"] == ["inf"] * 3
    rc = main(["eval", "--reference", str(v), "--candidate", str(v)])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out)["psnr"] == "inf"


@FAST
@given(st.recursive(st.floats(allow_nan=True, allow_infinity=True) | st.integers() | st.text(max_size=3),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                    max_leaves=12))
def test_json_ready_spells_every_non_finite_float_and_keeps_the_rest(obj):
    """Strict JSON for any nesting; finite values unchanged; float() of a spelled value restores it."""
    from fp4video.eval import json_ready

    back = json.loads(json.dumps(json_ready(obj), allow_nan=False))

    def same(a, b):
        if isinstance(a, float) and not math.isfinite(a):
            return isinstance(b, str) and (math.isnan(float(b)) if math.isnan(a) else float(b) == a)
        if isinstance(a, dict):
            return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    assert same(obj, back)


# --- optional libraries' import noise -------------------------------------------------------------


def test_quieting_drops_only_the_named_import_noise(caplog):
    """The filters drop the listed torchao / pytree / diffusers import lines and nothing else, and
    are gone after the command."""
    from fp4video.cli.common import quiet_optional_imports

    with caplog.at_level(logging.WARNING):
        with quiet_optional_imports():
            logging.getLogger("torchao").warning("Failed to load /x/_C.so: Could not load this library")
            logging.getLogger("torchao").warning("a torchao warning of another kind")
            logging.getLogger("torch.utils._pytree").warning(
                "%s is an Enum subclass and is now natively supported by torch.compile", "<enum X>")
        logging.getLogger("torchao").warning("Failed to load after the command")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["a torchao warning of another kind", "Failed to load after the command"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchao") is None,
                    reason="torchao (a test extra) is not installed: there is no import noise to keep out")
def test_generate_stderr_has_no_optional_library_import_noise(tmp_path):
    """With the test extras installed (torchao), `fp4video generate` (a subprocess, as a user runs
    it) writes no torchao load failures or pytree deprecation lines, and the mp4 and sidecar appear
    with no temporary file beside them."""
    out = tmp_path / "v.mp4"
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--steps", "1", "--frames", "5",
                           "--output", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in ("Failed to load", "torchao", "_pytree", "register_constant", "Enum subclass"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert out.stat().st_size > 100 and json.loads(out.with_suffix(".json").read_text())["frames"] == 5
    assert _leftovers(tmp_path) == []
