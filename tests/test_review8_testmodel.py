"""Review of the test model as its users meet it: the motion checker on bad input, loading saved
models (folders, packs, a training run's folder) that are missing parts, damaged or hostile, the
training and quality scripts' options, and ``fp4video generate --model test``'s prompts and lines.
Each test is named after the defect class it guards."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4video.testmodel import HELD_OUT, check_clip, check_rate, parse_caption, render, sample_scenes
from fp4video.testmodel.model import SMOKE, build_pipeline, pack, save_pipeline, unpack

ROOT = Path(__file__).resolve().parents[1]
CANONICAL = "a red circle moves right over the coffee photo"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"review8_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(main, args) -> str:
    """The last stderr line of a script's ``main(args)`` that must stop with exit status 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2, err.getvalue()[-2000:]
    return err.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def truth():
    """A ground-truth render of a held-out caption (T, H, W, 3) in [0, 1], which the checker passes."""
    spec = HELD_OUT[0]
    video, _ = render(sample_scenes(1, seed=0, specs=[spec]), frames=13, height=64, width=64)
    clip = ((video[0].permute(1, 2, 3, 0) + 1) / 2).clamp(0, 1)
    assert check_clip(clip, spec).passed
    return clip, spec


@pytest.fixture(scope="module")
def smoke_folder(tmp_path_factory):
    """An untrained SMOKE pipeline saved as a folder, and its pack."""
    root = tmp_path_factory.mktemp("review8")
    folder = save_pipeline(build_pipeline(SMOKE), root / "pipe")
    pack(folder, root / "pack")
    return folder, root / "pack"


# --- the motion checker on bad input ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_fail_a_clip_and_are_named(truth, bad):
    """One NaN or infinite value in an otherwise right clip: failed, the reason names it (a NaN
    passed unseen, an infinity was an out-of-range error)."""
    clip, spec = truth
    broken = clip.clone()
    broken[3, 10, 10, 1] = bad
    v = check_clip(broken, spec)
    assert not v.passed and not (v.colour or v.shape or v.motion)
    assert "1 NaN or infinite" in v.reason and v.details["non_finite_values"] == 1
    assert check_rate([broken, clip], [spec, spec])["rate"] == 0.5


@pytest.mark.parametrize("shape", [(0, 64, 64, 3), (13, 64, 0, 3), (13, 0, 64, 3)])
def test_an_empty_clip_is_a_one_line_value_error(shape):
    with pytest.raises(ValueError, match=r"^frames: an empty clip \(shape"):
        check_clip(torch.zeros(shape), HELD_OUT[0])


def test_check_rate_refuses_a_single_spec_a_single_clip_and_no_clips(truth):
    """A single SceneSpec was iterated as its five fields ("1 clips but 5 specs"); a single clip as
    its frames; no clips gave a rate of 0 (every clip failed) instead of none."""
    clip, spec = truth
    with pytest.raises(TypeError, match="got a single SceneSpec"):
        check_rate([clip], spec)
    with pytest.raises(TypeError, match="got one clip of shape"):
        check_rate(clip, [spec])
    with pytest.raises(ValueError, match="no clips"):
        check_rate([], [])
    assert check_rate(clip[None], [spec])["rate"] == 1.0  # a batch of one clip


def test_parse_caption_refuses_what_is_not_text():
    """bytes or None were read through str() and called "not a caption"."""
    for text in (CANONICAL.encode(), None, 5):
        with pytest.raises(TypeError, match="parse_caption: text must be a str"):
            parse_caption(text)


# --- loading saved models ------------------------------------------------------------------------

def _pack_copy(pack_dir: Path, dest: Path, edit=None) -> Path:
    shutil.copytree(pack_dir, dest)
    if edit is not None:
        index = json.loads((dest / "model.json").read_text())
        edit(index)
        (dest / "model.json").write_text(json.dumps(index))
    return dest


def test_unpack_checks_the_whole_pack_before_writing(smoke_folder, tmp_path):
    """A pack naming a file outside its folder after its sound ones was refused only on reaching
    it: the target already held model_index.json and the files before it (a folder that looks
    like a pipeline). Now nothing is written, inside or out."""
    _, pack_dir = smoke_folder

    def escape(index):
        index["files"]["zzz/../../escaped.json"] = "x"  # sorted last: after model_index.json
    bad = _pack_copy(pack_dir, tmp_path / "bad", escape)
    with pytest.raises(ValueError, match="names a file outside its folder"):
        unpack(bad, tmp_path / "target")
    assert not (tmp_path / "target").exists() and not list(tmp_path.rglob("escaped.json"))
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]  # no temporary folder left beside it


def test_unpack_reads_no_weights_from_outside_the_pack(smoke_folder, tmp_path):
    """A 'weights' entry named after no model ("../x") made unpack copy ../x.safetensors, a file
    beside the pack, into the pipeline."""
    _, pack_dir = smoke_folder
    shutil.copyfile(pack_dir / "vae.safetensors", tmp_path / "x.safetensors")  # outside the pack
    bad = _pack_copy(pack_dir, tmp_path / "bad", lambda i: i["weights"].update({"../x": "x.safetensors"}))
    with pytest.raises(ValueError, match="'weights' must name one"):
        unpack(bad, tmp_path / "target")
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("text", ["{not json", "[]", json.dumps({"format": "fp4video-testmodel-pack"})])
def test_a_damaged_pack_index_is_named_in_one_line(smoke_folder, tmp_path, text):
    """model.json not JSON, not an object, or without its parts: a JSONDecodeError without the
    file's name, an AttributeError, a KeyError."""
    from fp4video.testmodel import test_model_pipeline

    _, pack_dir = smoke_folder
    bad = _pack_copy(pack_dir, tmp_path / "bad")
    (bad / "model.json").write_text(text)
    with pytest.raises(ValueError, match=r"bad/model\.json: ") as e:
        test_model_pipeline(path=bad)
    assert "\n" not in str(e.value)


def test_truncated_weights_are_named_not_a_temporary_folder(smoke_folder, tmp_path):
    """A truncated safetensors file gave diffusers' several-line OSError, naming (for a pack) the
    temporary folder it was unpacked into, gone by the time the user reads it."""
    from fp4video.testmodel import test_model_pipeline

    folder, pack_dir = smoke_folder
    bad_pack = _pack_copy(pack_dir, tmp_path / "bad_pack")
    weights = bad_pack / "transformer.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad_pack))}/transformer\.safetensors: not a readable safetensors file "
                                         r"\(truncated or damaged"):
        test_model_pipeline(path=bad_pack)
    bad_folder = shutil.copytree(folder, tmp_path / "bad_folder")
    weights = bad_folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(weights))}: not a readable safetensors file"):
        test_model_pipeline(path=bad_folder)


@pytest.mark.parametrize("remove, match", [
    ("tokenizer", "tokenizer/tokenizer.json is missing"),  # was: sentencepiece or tiktoken needed
    ("vae/diffusion_pytorch_model.safetensors", "vae/ holds no .safetensors weights"),  # was: no ...bin found
    ("scheduler/scheduler_config.json", "scheduler/scheduler_config.json is missing"),
])
def test_a_folder_missing_a_part_is_named(smoke_folder, tmp_path, remove, match):
    from fp4video.testmodel import test_model_pipeline

    folder, _ = smoke_folder
    bad = shutil.copytree(folder, tmp_path / "bad")
    target = bad / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError, match=match):
        test_model_pipeline(path=bad)


def test_a_training_runs_folder_loads_as_its_pipeline(smoke_folder, tmp_path, capfd):
    """What ``train_test_model.py --out RUN`` (no --pack) writes, RUN/pipeline/, loads from RUN,
    as a pack run's folder does; and loading prints no progress bars (diffusers' and transformers'
    "Loading ..." bars for a model that loads in well under a second), leaving them as they were."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from fp4video.testmodel import test_model_pipeline

    folder, _ = smoke_folder
    run = tmp_path / "run"
    shutil.copytree(folder, run / "pipeline")
    (run / "train_log.json").write_text("{}")
    capfd.readouterr()
    pipe = test_model_pipeline(path=run)
    assert pipe.transformer.config.num_layers == SMOKE.layers
    err = capfd.readouterr().err
    assert "Loading" not in err and "%|" not in err, err
    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()


def test_saving_prints_no_progress_bars(tmp_path, capfd):
    """Every checkpoint of a training run printed transformers' "Writing model shards" bar."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    pipe = build_pipeline(SMOKE)
    capfd.readouterr()
    save_pipeline(pipe, tmp_path / "pipe")
    err = capfd.readouterr().err
    assert "Writing" not in err and "%|" not in err, err
    assert (tmp_path / "pipe" / "model_index.json").is_file()
    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()


# --- scripts/train_test_model.py -----------------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    (["--minutes", "inf"], "--minutes must be a finite number > 0, got inf"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),  # trained to NaN weights and saved them
    (["--vae-lr", "nan"], "--vae-lr must be a finite number > 0"),
    (["--checkpoint-seconds", "inf"], "--checkpoint-seconds must be a finite number > 0"),
    (["--reserve-seconds", "-5"], "--reserve-seconds must be a finite number ≥ 0, got -5.0"),
])
def test_train_script_refuses_non_finite_values_before_any_work(args, match, tmp_path):
    out = tmp_path / "run"
    last = _refused(_script("train_test_model").main, ["--smoke", "--out", str(out), *args])
    assert last.startswith("train_test_model.py: error: ") and match in last, last
    assert not out.exists()


@pytest.mark.parametrize("previous", ["model.json", "pipeline", "train_log.json"])
def test_train_script_refuses_an_out_holding_a_previous_run(previous, tmp_path):
    """A folder run into a pack run's --out left the old pack beside the new pipeline/; loading or
    resuming that folder took the stale pack."""
    out = tmp_path / "run"
    out.mkdir()
    (out / previous).mkdir() if previous == "pipeline" else (out / previous).write_text("{}")
    last = _refused(_script("train_test_model").main, ["--smoke", "--out", str(out)])
    assert f"--out {out}: holds a previous run ({previous})" in last, last
    assert sorted(p.name for p in out.iterdir()) == [previous]


def test_unpack_to_a_file_is_a_one_line_error(smoke_folder, tmp_path):
    """--unpack PACK --out FILE ended in a NotADirectoryError traceback."""
    _, pack_dir = smoke_folder
    target = tmp_path / "file.txt"
    target.write_text("mine")
    last = _refused(_script("train_test_model").main, ["--unpack", str(pack_dir), "--out", str(target)])
    assert last == f"train_test_model.py: error: --out {target}: a file, not a folder"
    assert target.read_text() == "mine"


def test_unpack_of_a_refused_pack_leaves_out_as_it_was(smoke_folder, tmp_path):
    _, pack_dir = smoke_folder
    bad = _pack_copy(pack_dir, tmp_path / "bad", lambda i: i["files"].update({"/etc/x.json": "x"}))
    last = _refused(_script("train_test_model").main, ["--unpack", str(bad), "--out", str(tmp_path / "out")])
    assert "names a file outside its folder: '/etc/x.json'" in last, last
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_takes_a_training_runs_folder_and_continues_its_log(smoke_folder, tmp_path):
    """--resume RUN, RUN a folder run's output (RUN/pipeline/, RUN/train_log.json), was refused as
    neither a pipeline folder nor a pack; and a resumed folder run's log was not chained."""
    folder, _ = smoke_folder
    run = tmp_path / "run"
    shutil.copytree(folder, run / "pipeline")
    (run / "train_log.json").write_text(json.dumps({"settings": {"seed": 7}, "curves": {"vae": [], "transformer": []}}))
    out = tmp_path / "continued"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script("train_test_model").main(["--smoke", "--resume", str(run), "--out", str(out),
                                                 "--max-steps", "1", "--eval-clips", "0"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["previous_log"]["settings"] == {"seed": 7} and log["phases"]["transformer"]["steps"] == 1
    assert (out / "pipeline" / "model_index.json").is_file()


# --- scripts/test_model_quality.py ---------------------------------------------------------------

def _quality_args(pack_dir, out, *extra):
    return ["--quick", "--model", str(pack_dir), "--height", "32", "--width", "32", "--frames", "5", "--steps", "2",
            "--captions", "1", "--out", str(out), *extra]


def test_quality_only_matching_nothing_is_an_error_before_any_work(smoke_folder, tmp_path):
    """--only a name no policy has ran the FP16 reference and wrote an empty table; an empty name
    matched every policy."""
    _, pack_dir = smoke_folder
    main = _script("test_model_quality").main
    last = _refused(main, _quality_args(pack_dir, tmp_path / "q", "--only", "nosuch"))
    assert "--only nosuch: matches no policy of --quick (names: mxattn hybrid;" in last, last
    last = _refused(main, _quality_args(pack_dir, tmp_path / "q", "--only", " "))
    assert "--only: an empty name matches every policy" in last, last
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("option, value, match", [
    ("--frames", "8", "--frames 8: must be 4n + 1 (the VAE's 4× in time), e.g. 5 or 9"),  # was rounded to 9
    ("--height", "40", "--height 40: must be a multiple of 16"),  # was a traceback after loading
])
def test_quality_refuses_sizes_the_pipeline_cannot_take(smoke_folder, tmp_path, option, value, match):
    _, pack_dir = smoke_folder
    args = _quality_args(pack_dir, tmp_path / "q")
    args[args.index(option) + 1] = value
    last = _refused(_script("test_model_quality").main, args)
    assert match in last, last
    assert not (tmp_path / "q").exists()


@pytest.mark.slow
def test_quality_continues_after_a_policy_as_exact_as_fp16(smoke_folder, tmp_path):
    """A policy whose clips equal the FP16 ones has an infinite PSNR, stored as "inf" in
    results.json; the documented rerun (to continue) read it back as a string and crashed."""
    _, pack_dir = smoke_folder
    main = _script("test_model_quality").main
    out = tmp_path / "q"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(_quality_args(pack_dir, out, "--only", "mxattn hybrid")) == 0  # 2 steps: all FP16
        assert json.loads((out / "results.json").read_text())["policies"]["mxattn hybrid"]["psnr"] == "inf"
        assert main(_quality_args(pack_dir, out, "--only", "mxattn hybrid", "sage3 hybrid")) == 0
    results = json.loads((out / "results.json").read_text())["policies"]
    assert set(results) == {"mxattn hybrid", "sage3 hybrid"} and results["mxattn hybrid"]["psnr"] == "inf"
    assert "| mxattn hybrid | method hybrid | inf |" in (out / "results.md").read_text()


# --- fp4video generate --model test --------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fp4video.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_generate_runs_a_caption_in_its_own_words_and_says_so(tmp_path):
    """A caption with capitals, a double space and a full stop was checked as the caption, but the
    model was given the text as typed: its word-level tokenizer reads the full stop as an unknown
    word, so the clip checked was not the caption's. It now runs as the caption, said in a note.
    With 2 steps the hybrid policy's last-two-steps rule covers every step: said once as a note,
    not as a UserWarning pointing into torch's module.py."""
    out = tmp_path / "v.mp4"
    typed = "A Red  Circle moves right over the coffee photo."
    proc = _cli("generate", "--model", "test", "--prompt", typed, "--steps", "2", "--frames", "5",
                "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["prompt"] == CANONICAL and side["motion_check"]["checked"]
    assert side["typed_prompt"] == typed  # the user's own words stay on record beside the caption run
    assert f"note: {typed!r} runs as the test model's caption {CANONICAL!r}" in proc.stderr
    assert "note: the policy's rules[1] {method: fp16, steps: {'last': 2}} covers every one of the 2 " \
           "denoising steps" in proc.stderr
    assert "UserWarning" not in proc.stderr and "Loading" not in proc.stderr, proc.stderr


def test_generate_refuses_test_model_frames_its_vae_cannot_take(tmp_path):
    """--frames 8 was rounded to 9 by the pipeline, said only in a diffusers log line."""
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--model", "test", "--frames", "8", "--output", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "fp4video generate: error: frames 8: the test model takes 4n + 1 frames (its VAE's 4× in time), e.g. 5 or 9"]


def test_generate_says_an_unchecked_clip_in_its_summary(tmp_path):
    """A clip too short to check was said unchecked in the sidecar alone: the summary was silent."""
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--model", "test", "--frames", "1", "--steps", "1", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "motion check: not checked (a clip needs at least 3 frames to show motion, got 1)" in proc.stderr


# --- a saved test model given as --model DIR -------------------------------------------------------

#: The sizes a SMOKE run's training records (a pack's model.json, a run's train_log.json); the run's
#: text length is set apart from the shipped one's so that reading it shows.
RUN_TEXT_LENGTH = 24


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A SMOKE test model saved in each form ``scripts/train_test_model.py`` writes: a pipeline folder
    (no sizes recorded), a pack and a training run's folder (sizes recorded as training records them),
    and a tiny *real* Wan pipeline saved by ``save_pretrained``."""
    from fp4video.integration.tiny import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("saved")
    folder = save_pipeline(build_pipeline(SMOKE), root / "pipe")
    pack(folder, root / "pack", extra={"config": SMOKE.model_dump()})
    shutil.copytree(folder, root / "run" / "pipeline")
    (root / "run" / "train_log.json").write_text(json.dumps(
        {"config": {**SMOKE.model_dump(), "max_sequence_length": RUN_TEXT_LENGTH}}))
    tiny_wan_pipeline(two_experts=False).save_pretrained(root / "real")
    return {"folder": folder, "pack": root / "pack", "run": root / "run", "real": root / "real"}


def test_test_model_path_names_saved_test_models_and_nothing_else(saved, tmp_path):
    """"test" is the shipped weights; a pipeline folder, a pack and a training run's folder holding a
    test model are that model; a real Wan pipeline folder (whose tokenizer is word-level too), the
    tiny model, a hub id and a missing folder are not."""
    from fp4video.integration.pipelines import is_test_model, test_model_path
    from fp4video.testmodel import WEIGHTS

    assert test_model_path("test") == WEIGHTS
    assert test_model_path(str(saved["folder"])) == saved["folder"]
    assert test_model_path(str(saved["pack"])) == saved["pack"]
    assert test_model_path(str(saved["run"])) == saved["run"] / "pipeline"
    assert test_model_path(str(saved["run"] / "pipeline")) == saved["run"] / "pipeline"
    for other in (str(saved["real"]), "tiny", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", str(tmp_path / "none"),
                  str(tmp_path)):
        assert test_model_path(other) is None and not is_test_model(other), other
    assert is_test_model("test") and is_test_model(str(saved["pack"]))


def test_a_saved_test_model_runs_at_the_sizes_its_training_recorded(saved):
    """A pack and a run's folder record their model's sizes and text length: the run takes those; a
    pipeline folder records none and runs at the shipped model's; a real model keeps the config's."""
    from fp4video.integration.config import TEST_MODEL_SIZES, RunConfig
    from fp4video.integration.pipelines import embedded_sizes, pipeline_kwargs
    from fp4video.testmodel import TEST_MODEL_CALL

    own = {"height": SMOKE.height, "width": SMOKE.width, "frames": SMOKE.frames,
           "steps": TEST_MODEL_CALL["num_inference_steps"]}
    for model in (saved["pack"], saved["run"], saved["run"] / "pipeline"):
        assert embedded_sizes(str(model), "wan") == own, model
    assert embedded_sizes(str(saved["folder"]), "wan") == TEST_MODEL_SIZES
    assert embedded_sizes(str(saved["real"]), "wan") == {}

    def text_length(model):
        cfg = RunConfig(model=str(model), **{k: v for k, v in own.items()})
        return pipeline_kwargs(cfg, CANONICAL, torch.device("cpu")).get("max_sequence_length")

    assert text_length(saved["pack"]) == SMOKE.max_sequence_length
    assert text_length(saved["run"]) == RUN_TEXT_LENGTH
    assert text_length(saved["folder"]) == TEST_MODEL_CALL["max_sequence_length"]
    assert text_length(saved["real"]) is None


def test_a_saved_test_model_is_wan_text_to_video(saved):
    from pydantic import ValidationError

    from fp4video.integration.config import RunConfig

    with pytest.raises(ValidationError, match="needs family wan and task t2v"):
        RunConfig(model=str(saved["pack"]), family="hunyuan")
    RunConfig(model=str(saved["real"]), family="hunyuan")  # a real folder: its family is the config's to say


def test_generate_runs_a_saved_test_model_folder_as_the_test_model(saved, tmp_path):
    """``--model DIR`` of a saved test model took the path of a generic real model: the typed
    caption reached the model as typed, the sidecar had no motion check, the short run's policy
    note came as a warning. Now it is the test model, recorded as the path the user gave."""
    out = tmp_path / "v.mp4"
    typed = "A Red  Circle moves right over the coffee photo."
    proc = _cli("generate", "--model", str(saved["folder"]), "--prompt", typed, "--steps", "2",
                "--height", "32", "--width", "32", "--frames", "5", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["prompt"] == CANONICAL and side["typed_prompt"] == typed
    assert side["motion_check"]["checked"] and "passed" in side["motion_check"]
    assert side["config"]["model"] == str(saved["folder"])
    assert f"note: {typed!r} runs as the test model's caption {CANONICAL!r}" in proc.stderr
    assert "covers every one of the 2 denoising steps" in proc.stderr and "UserWarning" not in proc.stderr


@pytest.mark.parametrize("form", ["pack", "run"])
def test_generate_runs_a_pack_or_a_run_at_its_own_sizes(saved, tmp_path, form):
    """A pack was not loadable at all, a training run's folder neither; both now run as the test
    model at the sizes their training recorded, under the default policy, checked."""
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--model", str(saved[form]), "--prompt", CANONICAL, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    cfg = side["config"]
    assert cfg["model"] == str(saved[form])
    assert (cfg["height"], cfg["width"], cfg["frames"]) == (SMOKE.height, SMOKE.width, SMOKE.frames)
    assert side["frames"] == SMOKE.frames and side["motion_check"]["checked"]
    assert len(side["attention_calls"]) == cfg["steps"] * 2 * SMOKE.layers * 2  # steps × branches × blocks × kinds


def test_a_real_wan_folder_is_not_taken_for_the_test_model(saved, tmp_path):
    """A real Wan pipeline folder (its tokenizer word-level as the test model's, over other words)
    keeps the path of a real model: the prompt as typed, no motion check, the config's sizes."""
    out = tmp_path / "v.mp4"
    typed = "A Red circle moves right over the coffee photo."
    proc = _cli("generate", "--model", str(saved["real"]), "--prompt", typed, "--steps", "2", "--height", "32",
                "--width", "48", "--frames", "5", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["prompt"] == typed and "typed_prompt" not in side and side["motion_check"] is None
    assert "caption" not in proc.stderr


def _damaged(saved, tmp_path, damage):
    if damage == "pack without its VAE":
        dest = shutil.copytree(saved["pack"], tmp_path / "pack")
        (dest / "vae.safetensors").unlink()
        return dest, "vae.safetensors is missing"
    dest = shutil.copytree(saved["folder"], tmp_path / "pipe")
    if damage == "folder without the VAE's config":
        (dest / "vae" / "config.json").unlink()
        return dest, "vae/config.json is missing"
    weights = next((dest / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    return dest, "not a readable safetensors file"


@pytest.mark.parametrize("damage", ["pack without its VAE", "folder without the VAE's config",
                                    "folder with truncated weights"])
def test_a_damaged_saved_test_model_is_one_line(saved, tmp_path, damage):
    """A folder that is a test model but damaged: check_pipeline_folder's (or the pack's) own line,
    as the CLI's usual error with its usual exit status, not diffusers' traceback."""
    model, reason = _damaged(saved, tmp_path, damage)
    proc = _cli("generate", "--model", str(model), "--output", str(tmp_path / "v.mp4"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("fp4video generate: error: ") and reason in lines[0], lines
