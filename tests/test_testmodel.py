"""The project's test model (fp4video.testmodel): its scenes and captions, the motion checker on
true and false clips, the flow-matching convention against diffusers' sampler, packing, and a
smoke training run whose saved pipeline ``WanPipeline.from_pretrained`` loads and generates from
through ``fp4video.install``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4video.testmodel import checker, scenes
from fp4video.testmodel.checker import check_clip, check_rate, colour_mask, describe_shapes
from fp4video.testmodel.model import (FULL, SMOKE, TEST_MODEL_CALL, build_pipeline, build_tokenizer, pack, tokenize,
                                      unpack)
from fp4video.testmodel.scenes import HELD_OUT, SceneSpec, caption, render, sample_scenes

ROOT = Path(__file__).resolve().parents[1]
H = W = 128
T = 29


def _frames(sc, **kw):
    video, mask = render(sc, frames=kw.get("frames", T), height=kw.get("height", H), width=kw.get("width", W))
    return ((video + 1) / 2).permute(0, 2, 3, 4, 1), mask[:, 0]


@pytest.fixture(scope="module")
def truth():
    """28 scenes at the shipped size, every motion with every shape (colours, backgrounds and
    cameras cycling): (scenes, frames (B, T, H, W, 3), coverage)."""
    colours, backgrounds = list(scenes.COLOURS), list(scenes.BACKGROUNDS)
    specs = []
    for i, (motion, shape) in enumerate((m, s) for m in scenes.MOTIONS for s in scenes.SHAPES):
        background = backgrounds[(5 * i) % len(backgrounds)]
        camera = "still" if scenes.BACKGROUNDS[background][0] == "plain" else scenes.CAMERAS[i % len(scenes.CAMERAS)]
        specs.append(SceneSpec(colour=colours[(3 * i) % 8], shape=shape, motion=motion, background=background,
                               camera=camera))
    sc = sample_scenes(len(specs), seed=11, specs=specs)
    frames, mask = _frames(sc)
    return sc, frames, mask


# --- scenes and captions ---------------------------------------------------------------------------

def test_scenes_are_deterministic_from_the_seed():
    a, b, c = sample_scenes(6, seed=3), sample_scenes(6, seed=3), sample_scenes(6, seed=4)
    assert a.specs == b.specs and all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert a.specs != c.specs or not torch.equal(a.params["pos0"], c.params["pos0"])
    va, ma = render(a, frames=5, height=32, width=48)
    vb, mb = render(b, frames=5, height=32, width=48, chunk=4)  # chunking does not change a pixel
    assert torch.equal(va, vb) and torch.equal(ma, mb)
    assert va.shape == (6, 3, 5, 32, 48) and ma.shape == (6, 1, 5, 32, 48)
    assert va.min() >= -1 and va.max() <= 1


def test_captions_name_the_scene_and_the_tokenizer_knows_every_word():
    spec = SceneSpec(colour="red", shape="square", motion="moves left", background="astronaut", camera="pans right")
    assert caption(spec) == "a red square moves left over the astronaut photo as the camera pans right"
    assert caption(SceneSpec(colour="orange", shape="bar", motion="grows", background="striped")) == \
        "an orange bar grows on a striped background"
    sc = sample_scenes(200, seed=0)
    tok = build_tokenizer()
    ids, mask = tokenize(tok, sc.captions(), 32)
    assert int(mask.sum(1).max()) < 32  # no caption is cut
    assert not (ids == tok.unk_token_id).any()
    for s, text in zip(sc.specs, sc.captions()):
        assert f" {s.colour} {s.shape} {s.motion} " in f" {text} "
        assert scenes.BACKGROUNDS[s.background][1] in text
        assert (s.camera == "still") == (" as the camera " not in text)
    with pytest.raises(ValueError, match="black background shows no camera motion"):
        SceneSpec(colour="red", shape="square", motion="grows", background="black", camera="zooms in")


def test_held_out_combinations_are_never_drawn_for_training():
    combos = {s.combination for s in HELD_OUT}
    assert len(combos) == len(HELD_OUT) == 24
    assert {s.colour for s in HELD_OUT} == set(scenes.COLOURS) and {s.shape for s in HELD_OUT} == set(scenes.SHAPES)
    assert {s.motion for s in HELD_OUT} == set(scenes.DIRECTIONS) | {"grows", "shrinks"}
    drawn = sample_scenes(4000, seed=5).specs
    assert not [s for s in drawn if s.combination in combos]
    assert {s.combination for s in drawn} > set()  # (the draw is not empty)
    # and asked for, they are what the evaluation uses
    held = scenes.held_out_scenes(seed=1)
    assert [s.combination for s in held.specs] == [s.combination for s in HELD_OUT]


def test_renders_show_the_named_motion_colour_and_size(truth):
    sc, frames, mask = truth
    for i, s in enumerate(sc.specs):
        cov = mask[i]  # (T, H, W) the shape's coverage
        area = cov.sum((1, 2))
        ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
        cx, cy = (cov * xs).sum((1, 2)) / area, (cov * ys).sum((1, 2)) / area
        # fully covered pixels carry the named colour exactly
        inside = cov[0] >= 1
        assert torch.allclose(frames[i, 0][inside], torch.tensor(scenes.COLOURS[s.colour]), atol=1e-6)
        # the shape lies inside the frame: its area is the shape's area at its size and scale
        size = float(sc.params["size"][i]) * H
        scale0 = float(sc.params["scale0"][i])
        assert float(area[0]) == pytest.approx(scenes.SHAPE_AREA[s.shape] * (size * scale0) ** 2, rel=0.05)
        dx, dy = float(cx[-1] - cx[0]) / W, float(cy[-1] - cy[0]) / H
        if s.motion in scenes.DIRECTIONS:
            along = {"moves left": -dx, "moves right": dx, "moves up": -dy, "moves down": dy}[s.motion]
            assert scenes.DISTANCE_RANGE[0] - 0.01 <= along <= scenes.DISTANCE_RANGE[1] + 0.01, (s, dx, dy)
        else:
            assert math.hypot(dx, dy) < 1e-3
        if s.motion in ("grows", "shrinks"):
            ratio = float(area[-1] / area[0])
            expected = (scenes.SCALE_RANGE[1] / scenes.SCALE_RANGE[0]) ** 2
            assert ratio == pytest.approx(expected if s.motion == "grows" else 1 / expected, rel=0.05)


def test_backgrounds_never_carry_a_shape_colour(truth):
    """The checker relies on it: no background pixel is saturated or bright enough for a colour name."""
    sc, frames, mask = truth
    background = frames[mask == 0]
    top, bottom = background.amax(-1), background.amin(-1)
    assert float(top.max()) <= 0.65 + 1e-5
    sat = (top - bottom) / top.clamp_min(1e-6)
    assert float(sat.max()) <= 0.35 + 1e-5


# --- the motion checker ----------------------------------------------------------------------------

def test_checker_passes_ground_truth_clips(truth):
    sc, frames, _ = truth
    result = check_rate(list(frames), sc.specs)
    failed = [(s.caption, v["reason"]) for s, v in zip(sc.specs, result["verdicts"]) if not v["passed"]]
    assert not failed and result["rate"] == 1.0


def test_checker_passes_blurred_ground_truth_clips(truth):
    """Generated clips are softer than renders: a 5×5 binomial blur keeps every verdict."""
    sc, frames, _ = truth
    k = torch.tensor([1.0, 4, 6, 4, 1])
    k = (k[:, None] * k[None]) / 256
    x = frames.permute(0, 1, 4, 2, 3).reshape(-1, 1, H, W)
    blurred = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (2, 2, 2, 2), mode="replicate"), k[None, None])
    blurred = blurred.reshape(frames.shape[0], T, 3, H, W).permute(0, 1, 3, 4, 2)
    assert check_rate(list(blurred), sc.specs)["rate"] == 1.0


def test_checker_fails_reversed_motion(truth):
    sc, frames, _ = truth
    checked = 0
    for s, f in zip(sc.specs, frames):
        if s.motion == "spins":
            continue  # a spin either way is a spin
        v = check_clip(f.flip(0), s)
        assert v.colour and v.shape and not v.motion, (s.caption, v.as_dict())
        checked += 1
    assert checked == 24


def test_checker_fails_a_static_clip(truth):
    sc, frames, _ = truth
    for s, f in zip(sc.specs, frames):
        if s.motion == "spins" and s.shape == "circle":
            continue  # a circle's spin cannot be seen: only its stillness is checked
        v = check_clip(f[:1].expand_as(f), s)
        assert not v.motion and not v.passed, (s.caption, v.as_dict())


def test_checker_fails_the_wrong_colour_and_shape(truth):
    sc, frames, _ = truth
    colours = list(scenes.COLOURS)
    for s, f in zip(sc.specs, frames):
        other = colours[(colours.index(s.colour) + 3) % len(colours)]
        assert not check_clip(f, s.model_copy(update={"colour": other})).colour, s.caption
        wrong = scenes.SHAPES[(scenes.SHAPES.index(s.shape) + 1) % 4]
        v = check_clip(f, s.model_copy(update={"shape": wrong}))
        assert v.colour and not v.shape, (s.caption, v.as_dict())


def test_check_rate_counts_what_was_drawn_for_each_captioned_shape(truth):
    """``by_shape``: per captioned shape, its clips, its shape check's rate and the shape that won
    each clip's frames. Every shape's own renders, captioned as drawn: all drawn as captioned. The
    same renders captioned as the next shape: each row names the shape that was really drawn. A
    clip without the colour counts as "none"."""
    sc, frames, _ = truth
    names = list(scenes.SHAPES)
    right = check_rate(list(frames), sc.specs)["by_shape"]
    for shape in names:
        n = sum(s.shape == shape for s in sc.specs)
        assert right[shape] == {"clips": n, "shape": 1.0, "drawn": {shape: n}}
    shifted = [s.model_copy(update={"shape": names[(names.index(s.shape) + 1) % 4]}) for s in sc.specs]
    grey = torch.full((T, H, W, 3), 0.4)
    wrong = check_rate([*frames, grey], [*shifted, sc.specs[0]])["by_shape"]
    for shape in names:
        drawn = names[(names.index(shape) - 1) % 4]
        n = sum(s.shape == drawn for s in sc.specs)
        extra = {"none": 1} if shape == sc.specs[0].shape else {}
        assert wrong[shape]["drawn"] == {drawn: n, **extra} and wrong[shape]["shape"] == 0.0
        assert wrong[shape]["clips"] == n + len(extra)
    line = describe_shapes({"by_shape": wrong})
    assert line.startswith(f"{names[0]} 0/") and f"{names[-1]} 0/" in line


def test_checker_fails_noise_and_empty_clips():
    g = torch.Generator().manual_seed(0)
    for spec in HELD_OUT[:8]:
        noise = torch.rand(T, H, W, 3, generator=g)
        assert not check_clip(noise, spec).passed
        grey = torch.full((T, H, W, 3), 0.4)
        v = check_clip(grey, spec)
        assert not (v.colour or v.shape or v.motion) and "region is in 0 of" in v.reason
    uint8 = (torch.rand(T, H, W, 3, generator=g) * 255).to(torch.uint8)
    assert not check_clip(uint8.numpy(), HELD_OUT[0]).passed


def _discs(centres, radius, colour, frames=T):
    """A clip on a plain grey background: discs of ``colour`` (RGB) at ``centres`` (frames, discs, 2)
    in pixels (x, y)."""
    y, x = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    clip = torch.full((frames, H, W, 3), 0.42)
    for t in range(frames):
        for cx, cy in centres[t].tolist():
            clip[t][(x - cx) ** 2 + (y - cy) ** 2 <= radius ** 2] = torch.tensor(colour)
    return clip


def test_checker_several_blobs_of_the_colour_are_not_one_shape():
    """Three magenta discs in a column, moving left together: their pixels taken as one region have
    a bar's moments, but no bar is drawn."""
    spec = SceneSpec(colour="magenta", shape="bar", motion="moves left", background="grey")
    tau = torch.linspace(0, 1, T)[:, None]
    x = 96 - 50 * tau  # moves 39% of the frame to the left
    centres = torch.stack([torch.cat([x, x, x], 1), torch.tensor([[40.0, 64, 88]]).expand(T, 3)], -1)
    clip = _discs(centres, 8, scenes.COLOURS["magenta"])
    v = check_clip(clip, spec)
    assert not v.passed and not v.colour and v.details["largest_share"] < 0.5, v.as_dict()
    one = _discs(centres[:, 1:2], 8, scenes.COLOURS["magenta"])  # one of the discs alone: a circle moving left
    v = check_clip(one, spec.model_copy(update={"shape": "circle"}))
    assert v.passed, v.as_dict()


def test_checker_reads_the_shape_not_a_speck_beside_it(truth):
    """A still 6 × 6 speck of the shape's colour in a corner of every frame (what generated clips
    show beside the shape): the shape and its motion are still read from the shape."""
    sc, frames, mask = truth
    checked = 0
    for s, f, m in zip(sc.specs, frames, mask):
        if m[:, :20, :20].any():
            continue  # the shape itself passes through that corner
        specked = f.clone()
        specked[:, 4:10, 4:10] = torch.tensor(scenes.COLOURS[s.colour])
        v = check_clip(specked, s)
        assert v.passed, (s.caption, v.as_dict())
        checked += 1
    assert checked >= 20


def test_checker_shape_tie_names_no_shape():
    """A clip that is a square for half its frames and a circle for the other half names neither
    shape: the verdict cannot depend on the order the shapes are listed in."""
    specs = [SceneSpec(colour="red", shape=shape, motion="moves right", background="grey")
             for shape in ("square", "circle")]
    square, circle = (_frames(sample_scenes(1, seed=3, specs=[s]), frames=28)[0][0] for s in specs)
    clip = torch.cat([square[:14], circle[14:]])  # one seed, one track: only the shape changes
    for spec in specs:
        v = check_clip(clip, spec)
        assert v.colour and v.motion and not v.shape, (spec.shape, v.as_dict())
        assert v.details["shape_votes"]["square"] == v.details["shape_votes"]["circle"] == 14


def test_checker_colour_masks_pick_only_their_colour():
    rgb = torch.tensor(list(scenes.COLOURS.values()))  # one pure pixel of each colour, in 5×5 patches
    frames = rgb[:, None, None, :].expand(-1, 5, 5, 3).reshape(1, -1, 5, 3)
    for i, name in enumerate(scenes.COLOURS):
        m = colour_mask(frames, name)[0]  # (40, 5): patch j is rows 5j..5j+4
        patches = m.reshape(len(rgb), 5, 5)
        assert patches[i].all() and not patches[[j for j in range(len(rgb)) if j != i]].any(), name


def test_checker_refuses_bad_input():
    spec = HELD_OUT[0]
    with pytest.raises(ValueError, match=r"frames must be \(frames, height, width, 3\)"):
        check_clip(torch.zeros(4, 8, 8), spec)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        check_clip(torch.full((4, 8, 8, 3), 2.0), spec)
    with pytest.raises(ValueError, match="at least 3 frames"):
        check_clip(torch.zeros(2, 8, 8, 3), spec)
    with pytest.raises(TypeError, match="spec must be a SceneSpec"):
        check_clip(torch.zeros(4, 8, 8, 3), {"colour": "red"})
    with pytest.raises(ValueError, match="2 clips but 1 specs"):
        check_rate([torch.zeros(4, 8, 8, 3)] * 2, [spec])


# --- the model -------------------------------------------------------------------------------------

def test_shipped_size_meets_the_requirements():
    assert FULL.video_tokens >= 2000 and FULL.layers >= 4 and FULL.head_dim in (64, 128)
    assert FULL.patch_size in ((1, 1, 1), (1, 2, 2))
    assert TEST_MODEL_CALL["num_frames"] == FULL.frames and TEST_MODEL_CALL["height"] == FULL.height
    pipe = build_pipeline(FULL)
    params = sum(p.numel() for name in ("transformer", "vae", "text_encoder")
                 for p in getattr(pipe, name).parameters())
    assert params * 2 <= 25e6  # fp16 storage
    assert pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim == 256


def test_training_text_matches_the_pipelines_encoding():
    """What the transformer trains on is what WanPipeline gives it: the caption's tokens, zero
    beyond them, zero-padded to max_sequence_length."""
    from fp4video.testmodel.model import text_embeddings

    pipe = build_pipeline(SMOKE)
    captions = sample_scenes(3, seed=2).captions()
    with torch.no_grad():
        ids, mask = tokenize(pipe.tokenizer, captions, 32)
        ours = text_embeddings(pipe.text_encoder, ids, mask)
        ours_long = text_embeddings(pipe.text_encoder, ids, mask, pad_to=512)
        theirs, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=32,
                                       device="cpu")
        theirs_long, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=512,
                                            device="cpu")  # WanPipeline.__call__'s default length
    assert torch.equal(ours, theirs)
    # the pipeline's default length: the encoder runs on 512 tokens there (the padding masked), so
    # only the summation order differs
    assert ours_long.shape == theirs_long.shape == (3, 512, SMOKE.text_dim)
    assert torch.allclose(ours_long, theirs_long, atol=1e-5, rtol=1e-5)
    assert int((ours.abs().sum(-1) > 0).sum(1).max()) == int(mask.sum(1).max())


def test_flow_targets_follow_the_schedulers_convention():
    """Training's (x_t, timestep, target) are the shipped sampler's: its sigmas are the training
    shift of evenly spaced values, the timesteps it passes the transformer are 1000·σ, and an oracle
    returning the training target takes it from noise along training's x_t to x0."""
    from fp4video.testmodel.train import flow_sample

    sched = build_pipeline(SMOKE).scheduler
    sched.set_timesteps(16)
    sigma = sched.sigmas[:-1].double()
    shift = FULL.flow_shift
    u = sigma / (shift - (shift - 1) * sigma)  # what training's shift maps onto each sigma
    steps = torch.diff(u)
    assert torch.allclose(steps, steps.mean().expand_as(steps), atol=1e-5)  # evenly spaced: the same shift
    x0 = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = flow_sample(x0, noise, u[:1], shift)[0]  # (σ0 is just below 1: the sampler's first state)
    for i, t in enumerate(sched.timesteps):
        xt, timestep, target = flow_sample(x0, noise, u[i:i + 1], shift)
        assert abs(float(timestep) - float(t)) <= 1.0
        assert torch.allclose(x, xt, atol=1e-6), i  # the sampler walks training's path
        x = sched.step(target, t, x).prev_sample  # the oracle answers training's target
    assert torch.allclose(x, x0, atol=1e-6)


def test_pack_and_unpack_give_the_folder_back(tmp_path):
    from fp4video.testmodel.model import save_pipeline

    folder = save_pipeline(build_pipeline(SMOKE), tmp_path / "pipe")
    files = pack(folder, tmp_path / "pack")
    assert sorted(p.name for p in files) == ["model.json", "text_encoder.safetensors", "transformer.safetensors",
                                             "vae.safetensors"]
    unpack(tmp_path / "pack", tmp_path / "back")
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    after = {p.relative_to(tmp_path / "back"): p.read_bytes() for p in (tmp_path / "back").rglob("*") if p.is_file()}
    assert before == after
    with pytest.raises(FileNotFoundError, match="not a packed test model"):
        unpack(tmp_path / "pipe", tmp_path / "x")


def test_a_packs_training_log_travels_through_unpack_and_pack(tmp_path):
    from fp4video.testmodel.model import save_pipeline
    from fp4video.testmodel.train import trained_upright, training_log_of

    folder = save_pipeline(build_pipeline(SMOKE), tmp_path / "pipe")
    pack(folder, tmp_path / "pack")
    log = {"settings": {"upright": True, "seed": 3}, "phases": {"vae": {"steps": 7}}}
    (tmp_path / "pack" / "train_log.json").write_text(json.dumps(log))
    back = unpack(tmp_path / "pack", tmp_path / "back")
    assert training_log_of(back) == back / "train_log.json"  # the unpacked weights keep their record
    assert json.loads((back / "train_log.json").read_text()) == log and trained_upright(log)
    files = pack(back, tmp_path / "again")  # the log goes beside the pack, not into its pipeline files
    assert tmp_path / "again" / "train_log.json" in files
    assert json.loads((tmp_path / "again" / "train_log.json").read_text()) == log
    assert "train_log.json" not in json.loads((tmp_path / "again" / "model.json").read_text())["files"]
    (tmp_path / "pack" / "train_log.json").write_text('{"settings": {"seed": 9}}')  # other weights' log
    pack(back, tmp_path / "pack")  # over a pack of other weights: their log is replaced by this one's
    assert json.loads((tmp_path / "pack" / "train_log.json").read_text()) == log
    (tmp_path / "own").mkdir()  # a folder without a log (a run's fresh pipeline) leaves the run's own log
    (tmp_path / "own" / "train_log.json").write_text("{}")
    pack(folder, tmp_path / "own")
    assert (tmp_path / "own" / "train_log.json").read_text() == "{}"
    unpack(tmp_path / "own", back)  # and a pipeline written over the folder takes that pack's log
    assert (back / "train_log.json").read_text() == "{}"
    (tmp_path / "pack" / "train_log.json").write_text("[1, 2")  # a damaged log: refused before writing
    with pytest.raises(ValueError, match="train_log.json: not a training log"):
        unpack(tmp_path / "pack", tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists()
    (back / "train_log.json").write_text("[]")  # pack checks it too, before writing anything
    with pytest.raises(ValueError, match="train_log.json: not a training log"):
        pack(back, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    (back / "train_log.json").unlink()
    (back / "train_log.json").mkdir()  # a folder of that name is not a log either
    with pytest.raises(ValueError, match="train_log.json: not a training log"):
        pack(back, tmp_path / "refused")


def test_the_shipped_weights_carry_the_training_log_they_were_trained_under():
    from fp4video.testmodel import WEIGHTS
    from fp4video.testmodel.model import recorded_config
    from fp4video.testmodel.train import trained_upright, training_log_of

    path = training_log_of(WEIGHTS)
    assert path == WEIGHTS / "train_log.json", "the shipped weights carry no training log"
    log = json.loads(path.read_text())
    assert trained_upright(log)  # the evaluation and the probes check upright ground truths by default
    transformer = json.loads((WEIGHTS / "transformer" / "config.json").read_text())
    assert log["config"]["layers"] == recorded_config(WEIGHTS).layers == transformer["num_layers"]


def test_missing_weights_are_named(monkeypatch, tmp_path):
    import fp4video.testmodel as tm

    monkeypatch.setattr(tm, "WEIGHTS", tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match="weights are not in this installation"):
        tm.test_model_pipeline()
    with pytest.raises(FileNotFoundError, match="no such folder"):
        tm.test_model_pipeline(path=tmp_path / "nowhere")


# --- a smoke training run --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "run"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_test_model.py"), "--smoke", "--pack",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


@pytest.mark.slow
def test_smoke_run_writes_its_log_and_pack(smoke_run):
    out, stdout = smoke_run
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "model.json", "samples.png", "text_encoder.safetensors",
                                                     "train_log.json", "transformer.safetensors", "vae.safetensors"]
    log = json.loads((out / "train_log.json").read_text())
    assert log["phases"]["vae"]["steps"] == 2 and log["phases"]["transformer"]["steps"] == 3
    assert [r["step"] for r in log["curves"]["transformer"]] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in log["curves"]["vae"] + log["curves"]["transformer"])
    assert log["evaluation"]["generated"]["clips"] == 2 and "rate" in log["evaluation"]["ground_truth"]
    assert len(log["latent_statistics"]["std"]) == SMOKE.z_dim
    assert "vae step 2 loss" in stdout and "transformer step 3 loss" in stdout and "held-out motion check" in stdout


@pytest.mark.slow
def test_smoke_checkpoint_loads_and_generates_through_fp4video(smoke_run, tmp_path):
    from diffusers import WanPipeline

    import fp4video
    from fp4video.integration import Policy
    from fp4video.testmodel import test_model_pipeline
    from fp4video.testmodel.train import call_for

    out, _ = smoke_run
    folder = unpack(out, tmp_path / "pipeline")
    assert WanPipeline.from_pretrained(folder).transformer.config.num_layers == SMOKE.layers  # a real checkpoint
    pipe = test_model_pipeline(path=out)  # the pack, unpacked for loading
    log = json.loads((out / "train_log.json").read_text())
    assert pipe.vae.config.latents_std == log["latent_statistics"]["std"]
    policy = Policy(method="mxattn", rules=[{"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 1}}])
    ctx = fp4video.install(pipe, policy)
    call = call_for(SMOKE, steps=3, guidance=2.0)
    frames = pipe(prompt=HELD_OUT[0].caption, generator=torch.Generator().manual_seed(0), output_type="np",
                  **call).frames[0]
    assert frames.shape == (SMOKE.frames, SMOKE.height, SMOKE.width, 3)
    calls = ctx.recorded_calls()
    methods = {(c["step"], c["block"], c["method"]) for c in calls}
    assert (0, 1, "mxattn") in methods and (0, 0, "fp16") in methods and (2, 1, "fp16") in methods
    assert not {m for s, b, m in methods if s == 2} - {"fp16"}
    fp4video.uninstall(pipe)


def test_parse_caption_is_the_inverse_of_caption_and_refuses_other_text():
    from fp4video.testmodel import HELD_OUT, parse_caption, sample_scenes

    for captioned in [*HELD_OUT, *[parse_caption(c) for c in sample_scenes(64, seed=5).captions()]]:
        assert captioned is not None and parse_caption(captioned.caption) == captioned
    assert parse_caption("  A Red Square moves left over the astronaut photo. ") == HELD_OUT[0].__class__(
        colour="red", shape="square", motion="moves left", background="astronaut")
    for text in ("a red panda climbs a tree", "a red square moves left", "a purple square moves left over the grass",
                 "a red square moves sideways over the grass", "a red square moves left over the grass as the camera flies",
                 "a red square grows on a black background as the camera pans left", ""):
        assert parse_caption(text) is None, text


@pytest.mark.slow
def test_calibration_finds_where_the_learned_model_needs_precision():
    """On the shipped test model, with no sensitivity built in: calibration between FP16 and mxattn
    against a 0.15 budget keeps exactly the sites whose measured MXFP4 error is over the budget in
    FP16; the learned structure puts them all in cross attention (sharp rows over a 32-token text),
    and none in self-attention, which stays cheap."""
    from fp4video.calibration import calibrate
    from fp4video.testmodel import TEST_MODEL_CALL, test_model_pipeline

    pipe = test_model_pipeline()
    call = {**TEST_MODEL_CALL, "num_inference_steps": 2}
    result = calibrate(pipe, ["a red circle moves right over the coffee photo"], budget=0.15,
                       candidates=["fp16", "mxattn"], call=call, propagation=0, progress=False)
    plan, stats = result.plan, result.stats
    assert len(plan) == pipe.transformer.config.num_layers * 2 * 2  # blocks × kinds × steps
    error = {k: stats[k].rel_l2["mxattn"] for k in plan}
    over = {k for k in plan if error[k] > 0.15}
    assert all(plan[k] == "fp16" for k in over) and all(plan[k] == "mxattn" for k in plan if k not in over), plan
    cross = {k for k in plan if k[2] == "cross"}
    assert over == cross, error
    # not an accident of the budget: every cross site's error is well over every self site's
    assert min(error[k] for k in cross) > 1.5 * max(error[k] for k in plan if k not in cross), error


def test_the_shipped_weights_name_no_build_folder():
    """Configs saved from a pipeline loaded out of a temporary folder do not record that folder."""
    from fp4video.testmodel import WEIGHTS

    for path in WEIGHTS.rglob("*.json"):
        data = json.loads(path.read_text())
        assert not (isinstance(data, dict) and "_name_or_path" in data), path


def test_quality_scripts_emulated_fp8_linear_layers_are_the_plans_and_come_back():
    """scripts/test_model_quality.py's FP8 linear rows: the layers of blocks 1 onwards (block 0, the
    embedders and the head kept, as bench pipeline's) run the exact float8 emulation, whatever the
    weights' dtype; undo restores every forward."""
    import importlib.util

    from fp4video.formats import float8_linear
    from fp4video.integration.tiny import tiny_wan_transformer

    script = Path(__file__).resolve().parents[1] / "scripts" / "test_model_quality.py"
    spec = importlib.util.spec_from_file_location("tmq", script)
    tmq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tmq)
    model = tiny_wan_transformer(0)
    layers = dict(model.named_modules())
    undo = tmq.emulated_linear(model, "fp8-rowwise")
    swapped = {n for n, m in layers.items() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__}
    assert swapped and all(n.startswith("blocks.") and not n.startswith("blocks.0.") for n in swapped)
    assert {n for n, m in layers.items() if isinstance(m, torch.nn.Linear) and n.startswith("blocks.")
            and not n.startswith("blocks.0.") and m.in_features % 16 == 0 and m.out_features % 16 == 0} == swapped
    name = sorted(swapped)[0]
    m = layers[name]
    x = torch.randn(3, m.in_features)
    torch.testing.assert_close(m(x), float8_linear(x, m.weight, m.bias, rowwise=True), rtol=0, atol=0)
    undo()
    assert not [n for n, m in layers.items() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]
    with pytest.raises(ValueError, match="fp8-rowwise or fp8-tensor"):
        tmq.emulated_linear(model, "nvfp4")


@pytest.mark.slow
def test_quality_script_reports_each_sparse_policys_kept_mass(tmp_path):
    """scripts/test_model_quality.py records, per block-sparse policy, the exact attention mass its
    calls' query tiles kept (their checks' sampled rows) beside the density, and the repaired dynamic
    row keeps every checked query tile at or above its floor."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "test_model_quality.py"
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--captions", "1", "--steps", "4",
                        "--frames", "5", "--only", "τ=0.9 + sinks, floor"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["policies"]
    (name, row), = rows.items()
    sparse = row["sparse"]
    assert "floor 0.9" in name and 0 < sparse["density"] <= 1 and sparse["calls"] > 0
    assert 0.9 <= sparse["kept_min"] <= sparse["kept_mean"] <= 1
    table = (out / "results.md").read_text()
    assert "kept mass min / mean" in table and f"{sparse['kept_min']:.3f} / {sparse['kept_mean']:.3f}" in table
