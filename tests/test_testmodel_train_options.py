"""The test model's training options for its shapes and the VAE's red: the shape-weighted
flow-matching loss (``--shape-loss-weight``), the shapes' and the VAE's colours' sampling weights
(``--shape-weights``, ``--vae-colour-weights``) and the VAE's first-frame weight. Their defaults
draw and train exactly as training does without them; each option does what it says against an
independent computation; bad values are refused before any work."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from fp4video.testmodel import scenes
from fp4video.testmodel import train as tm
from fp4video.testmodel.model import SMOKE, build_pipeline
from fp4video.testmodel.scenes import COLOURS, SHAPES, render, sample_scenes
from fp4video.testmodel.train import SMOKE_SETTINGS, Settings, flow_loss, latent_cover

ROOT = Path(__file__).resolve().parents[1]

# chi-square critical values at p = 0.001 (3 and 7 degrees of freedom)
CHI2_3, CHI2_7 = 16.27, 24.32


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _counts(names: list[str], universe) -> torch.Tensor:
    return torch.tensor([names.count(k) for k in universe], dtype=torch.float64)


def _same_scenes(a, b) -> bool:
    return a.specs == b.specs and a.params.keys() == b.params.keys() and all(
        torch.equal(a.params[k], b.params[k]) for k in a.params)


def _cover_reference(mask: torch.Tensor, lt: int, lh: int, lw: int) -> torch.Tensor:
    """The shape's coverage of each latent cell, cell by cell: latent frame 0 is frame 0, latent
    frame k the frames 4k - 3 .. 4k (the causal VAE's chunks), each latent pixel an f × f block."""
    b, _, t, h, w = mask.shape
    ft, f = (t - 1) // (lt - 1), h // lh
    out = torch.zeros(b, 1, lt, lh, lw)
    for k in range(lt):
        frames = [0] if k == 0 else list(range(ft * (k - 1) + 1, ft * k + 1))
        for i in range(lh):
            for j in range(lw):
                out[:, 0, k, i, j] = mask[:, 0, frames, i * f:(i + 1) * f, j * f:(j + 1) * f].flatten(1).amax(1)
    return out


# --- sampling weights ------------------------------------------------------------------------------

def test_default_and_equal_weights_draw_todays_uniform_scenes():
    """No weights (and all-equal weights) draw what the uniform draw draws: the specs from the
    seed's generator, one randint per name in order (colour, shape, motion, background, camera)."""
    n, seed = 300, 5
    got = sample_scenes(n, seed=seed, exclude=())
    g = torch.Generator().manual_seed(seed)
    c, s, m, b, cam = (torch.randint(k, (n,), generator=g).tolist() for k in (8, 4, 7, 15, 8))
    colours, backgrounds = list(COLOURS), list(scenes.BACKGROUNDS)
    for i, spec in enumerate(got.specs):
        assert (spec.colour, spec.shape, spec.motion, spec.background) == (
            colours[c[i]], SHAPES[s[i]], scenes.MOTIONS[m[i]], backgrounds[b[i]]), i
        plain = scenes.BACKGROUNDS[spec.background][0] == "plain"
        assert spec.camera == ("still" if cam[i] >= 4 or plain else scenes.CAMERAS[1 + cam[i]]), i
    held = sample_scenes(n, seed=seed)
    assert _same_scenes(held, sample_scenes(n, seed=seed, shape_weights=None, colour_weights=None))
    assert _same_scenes(held, sample_scenes(n, seed=seed, shape_weights={k: 2.5 for k in SHAPES},
                                            colour_weights={"red": 1, "blue": 1.0}))


def test_shape_and_colour_weights_set_the_drawn_frequencies():
    """square=2,triangle=2 draws squares and triangles twice as often as circles and bars (chi-square
    against 1/3, 1/6, 1/3, 1/6 on 4,000 draws); red=2 draws red 2/9 of the time, the other colours
    1/9. The uniform draw fails the weighted expectation (the check can tell them apart)."""
    n = 4000
    weighted = sample_scenes(n, seed=21, shape_weights={"square": 2, "triangle": 2}, colour_weights={"red": 2})
    shape_p = torch.tensor([2, 1, 2, 1], dtype=torch.float64) / 6
    colour_p = torch.tensor([2] + [1] * 7, dtype=torch.float64) / 9
    assert _chi2(_counts([s.shape for s in weighted.specs], SHAPES), shape_p) < CHI2_3
    assert _chi2(_counts([s.colour for s in weighted.specs], COLOURS), colour_p) < CHI2_7
    uniform = sample_scenes(n, seed=21)
    assert _chi2(_counts([s.shape for s in uniform.specs], SHAPES), shape_p) > 10 * CHI2_3
    assert _chi2(_counts([s.shape for s in uniform.specs], SHAPES), torch.full((4,), 0.25, dtype=torch.float64)) < CHI2_3
    # a zero weight never draws that shape; held-out combinations stay out
    only = sample_scenes(500, seed=3, shape_weights={"circle": 0, "bar": 0})
    assert {s.shape for s in only.specs} == {"square", "triangle"}
    assert not {s.combination for s in weighted.specs} & {h.combination for h in scenes.HELD_OUT}
    # the same seed and weights give the same scenes; the renders of the drawn specs are the specs'
    again = sample_scenes(n, seed=21, shape_weights={"square": 2, "triangle": 2}, colour_weights={"red": 2})
    assert _same_scenes(weighted, again)


@pytest.mark.parametrize("kw, match", [
    (dict(shape_weights={"sqaure": 2}), "unknown name 'sqaure'"),
    (dict(shape_weights={"square": -1}), "finite number"),
    (dict(shape_weights={"square": float("inf")}), "finite number"),
    (dict(shape_weights={"square": True}), "finite number"),
    (dict(shape_weights={k: 0 for k in SHAPES}), "every weight is 0"),
    (dict(colour_weights={"crimson": 2}), "unknown name 'crimson'"),
    (dict(colour_weights={"red": float("nan")}), "finite number"),
])
def test_sample_scenes_refuses_bad_weights(kw, match):
    with pytest.raises(ValueError, match=match):
        sample_scenes(4, seed=0, **kw)


# --- the shape-weighted flow loss ------------------------------------------------------------------

def test_latent_cover_is_the_max_over_each_latent_cells_frames_and_pixels():
    """latent_cover of a render's mask is, cell by cell, the max of the coverage over the cell's
    frames (the causal VAE's: frame 0 alone, then groups of 4) and its 8 × 8 pixels; the grid is the
    shipped VAE's (29 frames of 128 × 128 -> 8 × 16 × 16)."""
    sc = sample_scenes(3, seed=2, specs=[
        scenes.SceneSpec(colour="red", shape="square", motion="moves right", background="grey"),
        scenes.SceneSpec(colour="cyan", shape="triangle", motion="spins", background="coins"),
        scenes.SceneSpec(colour="white", shape="bar", motion="grows", background="black")])
    _, mask = render(sc, frames=29, height=128, width=128)
    cover = latent_cover(mask, (3, 16, 8, 16, 16))
    assert cover.shape == (3, 1, 8, 16, 16)
    ref = _cover_reference(mask, 8, 16, 16)
    assert torch.equal(cover, ref)
    assert 0 < (cover > 0).float().mean() < 0.2 and cover.max() == 1
    # the first latent frame is frame 0's alone: a moving square's first cell row differs from a
    # plain max over frames 0..3
    plain = mask[:, :, :4].amax(2).unflatten(-2, (16, 8)).unflatten(-1, (16, 8)).amax((-3, -1))
    assert not torch.equal(cover[:, :, 0], plain)
    # the smoke VAE's latent grid is what latent_cover maps onto
    pipe = build_pipeline(SMOKE, seed=0)
    sc = sample_scenes(2, seed=4)
    video, mask = render(sc, frames=SMOKE.frames, height=SMOKE.height, width=SMOKE.width)
    with torch.no_grad():
        mu = pipe.vae.encode(video).latent_dist.mean
    assert torch.equal(latent_cover(mask, mu.shape), _cover_reference(mask, *mu.shape[-3:]))
    with pytest.raises(ValueError, match="does not map onto a latent grid"):
        latent_cover(mask, (2, 4, 3, 5, 5))


def test_flow_loss_weighs_each_latent_cell_one_plus_w_cover():
    """With weight W the loss's gradient weighs each latent cell's squared error 1 + W·cover
    (relative to an uncovered cell), cover computed cell by cell from the render; the loss is
    the weighted mean (sum of weight × error over sum of weights). W = 0 is the plain mean, bit
    for bit."""
    sc = sample_scenes(2, seed=9, shape_weights={"square": 1, "circle": 0, "triangle": 1, "bar": 0})
    _, mask = render(sc, frames=29, height=128, width=128)
    cover = _cover_reference(mask, 8, 16, 16)
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 4, 8, 16, 16, generator=g)
    pred = (target + torch.randn(target.shape, generator=g)).requires_grad_()
    w = 4.0
    loss = flow_loss(pred, target, latent_cover(mask, pred.shape), w)
    loss.backward()
    # d loss / d pred = 2 (pred - target) · weight / (N · mean weight)
    eff = pred.grad / (2 * (pred.detach() - target))
    eff = eff / eff[(cover == 0).expand_as(eff)].mean()
    expected = (1 + w * cover).expand_as(eff)
    assert torch.allclose(eff, expected, rtol=1e-4, atol=1e-5)
    covered = (cover > 0).expand_as(eff)
    assert covered.any() and (expected[covered] > 1).all()
    weight = (1 + w * cover).expand_as(target)
    err = (pred.detach() - target) ** 2
    assert torch.allclose(loss.detach(), (weight * err).sum() / weight.sum(), rtol=1e-6)
    plain = (pred.detach().float() - target).pow(2).mean()
    assert torch.equal(flow_loss(pred.detach(), target), plain)
    assert torch.equal(flow_loss(pred.detach(), target, latent_cover(mask, pred.shape), 0.0), plain)
    with pytest.raises(ValueError, match="needs the shape's coverage"):
        flow_loss(pred.detach(), target, None, 1.0)


# --- the latent pool -------------------------------------------------------------------------------

def _pool(settings: Settings, tmp_path):
    pipe = build_pipeline(SMOKE, seed=0)
    run = tm._Run(tmp_path, lambda *a: None, {}, None)
    return pipe, tm._build_pool(run, pipe, SMOKE, settings, torch.device("cpu"), deadline=1e9)


def _pool_reference(pipe, settings: Settings, shape_weights=None):
    """The pool as training builds it without the options: each encode batch's scenes from the
    pool's stream, rendered, encoded (posterior mean) and normalized; coverage max-pooled cell by cell."""
    from fp4video.testmodel.model import tokenize

    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents, ids, covers = [], [], []
    for n in range(0, settings.pool_size, settings.encode_batch):
        b = min(settings.encode_batch, settings.pool_size - n)
        sc = sample_scenes(b, seed=tm._stream(settings.seed, "pool", n), shape_weights=shape_weights)
        video, mask = render(sc, frames=SMOKE.frames, height=SMOKE.height, width=SMOKE.width)
        with torch.no_grad():
            mu = pipe.vae.encode(video).latent_dist.mean.float()
        latents.append((mu - mean) / std)
        ids.append(tokenize(pipe.tokenizer, sc.captions(), SMOKE.max_sequence_length)[0])
        covers.append(_cover_reference(mask, *mu.shape[-3:]))
    return torch.cat(latents), torch.cat(ids), torch.cat(covers)


def test_default_pool_is_the_pool_without_the_options(tmp_path):
    """The default settings build the pool training built before the options (same latents and
    token ids, bit for bit) and keep no coverage."""
    s = Settings(**SMOKE_SETTINGS)
    pipe, (latents, ids, _, covers) = _pool(s, tmp_path)
    ref_latents, ref_ids, _ = _pool_reference(pipe, s)
    assert covers is None
    assert torch.equal(latents, ref_latents) and torch.equal(ids, ref_ids)


def test_shape_weighted_pool_keeps_each_clips_coverage(tmp_path):
    """With --shape-loss-weight and --shape-weights the pool holds the weighted draw's clips and
    each clip's coverage of its latent grid, row for row with its latents."""
    weights = {"square": 3.0, "circle": 0.0}
    s = Settings(**{**SMOKE_SETTINGS, "pool_size": 6, "shape_loss_weight": 4.0, "shape_weights": weights})
    pipe, (latents, ids, _, covers) = _pool(s, tmp_path)
    ref_latents, ref_ids, ref_covers = _pool_reference(pipe, s, weights)
    assert torch.equal(latents, ref_latents) and torch.equal(ids, ref_ids)
    assert covers.shape == (6, 1, *latents.shape[-3:]) and torch.equal(covers, ref_covers)
    assert (covers.flatten(1).amax(1) > 0).all()  # every clip's shape covers some cell


# --- the script ------------------------------------------------------------------------------------

def _script():
    spec = importlib.util.spec_from_file_location("train_test_model_script", ROOT / "scripts" / "train_test_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, match", [
    (["--shape-loss-weight", "-1"], "--shape-loss-weight: Input should be greater than or equal to 0"),
    (["--shape-loss-weight", "inf"], "--shape-loss-weight: Input should be a finite number"),
    (["--shape-weights", "sqare=2"], "--shape-weights: shape weights: unknown name 'sqare'"),
    (["--shape-weights", "square"], "argument --shape-weights: expected name=weight"),
    (["--shape-weights", "square=two"], "argument --shape-weights: the weight of square is not a number"),
    (["--shape-weights", "square=1,square=2"], "square given twice"),
    (["--shape-weights", "square=0,circle=0,triangle=0,bar=0"], "every weight is 0"),
    (["--vae-colour-weights", "red=-2"], "--vae-colour-weights: colour weights: the weight of red must be"),
    (["--vae-colour-weights", "scarlet=2"], "unknown name 'scarlet'"),
    (["--vae-first-frame-weight", "0"], "--vae-first-frame-weight: Input should be greater than 0"),
    (["--pool-refresh", "-1"], "--pool-refresh must be at least 0, got -1"),
    (["--train-shift", "0"], "--train-shift: Input should be greater than 0"),
    (["--train-shift", "nan"], "--train-shift: Input should be a finite number"),
])
def test_script_refuses_bad_option_values_before_any_work(args, match, tmp_path):
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        _script().main(["--smoke", "--out", str(out), *args])
    assert exit_.value.code == 2
    last = err.getvalue().strip().splitlines()[-1]
    assert last.startswith("train_test_model.py: error: ") and match in last, last
    assert not out.exists()


@pytest.mark.slow
def test_smoke_run_with_the_options_trains_and_logs_them(tmp_path):
    """A smoke run with every option trains both phases and logs the options and the pool's coverage."""
    out = tmp_path / "run"
    args = ["--smoke", "--out", str(out), "--max-vae-steps", "1", "--eval-clips", "0",
            "--shape-loss-weight", "4", "--shape-weights", "square=2,triangle=2",
            "--vae-colour-weights", "red=2", "--vae-first-frame-weight", "2"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(args) == 0
    log = json.loads((out / "train_log.json").read_text())
    st = log["settings"]
    assert st["shape_loss_weight"] == 4.0 and st["shape_weights"] == {"square": 2.0, "triangle": 2.0}
    assert st["vae_colour_weights"] == {"red": 2.0} and st["vae_first_frame_weight"] == 2.0
    assert log["phases"]["vae"]["steps"] == 1 and log["phases"]["transformer"]["steps"] == 3
    assert 0 < log["phases"]["pool"]["shape_cover"] < 1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log["curves"]["vae"] + log["curves"]["transformer"])


# --- the weights' moving average -------------------------------------------------------------------

def _saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for part in ("transformer", "text_encoder"):
        for f in sorted((folder / "pipeline" / part).glob("*.safetensors")):
            out.update({f"{part}.{k}": v.float() for k, v in load_file(f).items()})
    return out


@pytest.mark.slow
def test_ema_saves_the_moving_average_of_the_trained_weights(tmp_path):
    """With ``ema_decay`` d, one step saves d·w0 + (1 - d)·w1 for every transformer and text-encoder
    weight, where w0 is what training starts from and w1 what one step trains (both saved by runs
    without the average: the average changes nothing of the training itself); the evaluation checks
    the trained weights beside the average."""
    d = 0.5
    quiet = dict(log=lambda *a, **k: None)
    runs = {}
    for name, steps, decay, clips in (("w0", 0, 0.0, 0), ("w1", 1, 0.0, 0), ("ema", 1, d, 1)):
        # a large first step (no warm-up), so that the step moves most weights well past fp16's resolution
        # budgets far past what the step counts need: a busy CPU must not cut a phase short
        settings = Settings(**{**SMOKE_SETTINGS, "max_steps": steps, "eval_clips": clips, "ema_decay": decay,
                               "warmup_steps": 0, "lr": 0.05, "minutes": 60.0, "vae_minutes": 30.0})
        runs[name] = tm.train(settings, tmp_path / name, device="cpu", **quiet)
    w0, w1, ema = (_saved_weights(tmp_path / n) for n in ("w0", "w1", "ema"))
    assert w0.keys() == w1.keys() == ema.keys() and any(k.startswith("text_encoder.") for k in ema)
    moved = 0
    for k in ema:
        expected = d * w0[k] + (1 - d) * w1[k]
        scale = max(float(w0[k].abs().max()), float(w1[k].abs().max()), 1e-6)
        torch.testing.assert_close(ema[k], expected, rtol=0, atol=2e-3 * scale, msg=k)
        gap = float((w1[k] - w0[k]).abs().max())
        if gap > 1e-2 * scale:  # a weight the step moved: the average sits halfway, not at w1
            moved += 1
            assert float((ema[k] - w1[k]).abs().max()) > 0.25 * gap, k
    assert moved >= len(ema) // 2
    ev = runs["ema"]["evaluation"]
    assert ev["generated"]["clips"] == ev["generated_without_ema"]["clips"] == 1
    assert runs["ema"]["phases"]["transformer"]["ema_decay"] == d
    assert "generated_without_ema" not in (runs["w1"].get("evaluation") or {})


@pytest.mark.parametrize("value", ["1", "-0.1", "nan"])
def test_script_refuses_an_ema_decay_outside_zero_to_one(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--smoke", "--out", str(tmp_path / "run"), "--ema-decay", value])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("train_test_model.py: error: --ema-decay: "), last
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_evaluate_only_checks_a_saved_model_as_its_runs_evaluation_did(tmp_path):
    """``--evaluate MODEL`` checks a saved model on the held-out captions a run's own evaluation
    uses (same captions, scenes and seeds: the same ground-truth verdicts), without training; bad
    values are refused in one line before any work."""
    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--out", str(run), "--max-vae-steps", "1", "--eval-clips", "2"]) == 0
        assert _script().main(["--smoke", "--evaluate", str(run / "pipeline"), "--eval-clips", "2",
                               "--out", str(tmp_path / "ev")]) == 0
    trained = json.loads((run / "train_log.json").read_text())["evaluation"]
    ev = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert ev["captions"] == trained["captions"] and ev["seed"] == trained["seed"] and ev["call"] == trained["call"]
    assert ev["ground_truth"] == trained["ground_truth"] and ev["generated"]["clips"] == 2
    assert not (tmp_path / "ev" / "pipeline").exists()  # nothing trained or saved


@pytest.mark.parametrize("args, match", [
    (["--evaluate", "{tmp}/missing"], "--evaluate"),
    (["--evaluate", "shipped", "--eval-clips", "0"], "--eval-clips must be at least 1"),
])
def test_evaluate_only_refuses_bad_values_before_any_work(args, match, tmp_path, capsys):
    out = tmp_path / "ev"
    with pytest.raises(SystemExit) as e:
        _script().main([a.replace("{tmp}", str(tmp_path)) for a in args] + ["--out", str(out)])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("train_test_model.py: error: ") and match in last, last
    assert not out.exists()


# --- a diverged run -----------------------------------------------------------------------------------

def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_last_one_kept(tmp_path):
    """A save after the weights went NaN (a diverged run) raises, names the model, records it in the
    log and leaves the previous checkpoint's files byte for byte; a finite pipeline saves."""
    pipe = build_pipeline(SMOKE)
    run = tm._Run(tmp_path, lambda *a, **k: None, {}, None)
    tm._save(run, pipe, packed=False)
    files = {p: p.read_bytes() for p in sorted((tmp_path / "pipeline").rglob("*.safetensors"))}
    assert files
    with torch.no_grad():
        next(pipe.text_encoder.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"^training diverged: non-finite weights in the text_encoder at"):
        tm._save(run, pipe, packed=False)
    assert {p: p.read_bytes() for p in sorted((tmp_path / "pipeline").rglob("*.safetensors"))} == files
    assert json.loads((tmp_path / "train_log.json").read_text())["diverged"]["models"] == ["text_encoder"]


@pytest.mark.slow
def test_script_says_a_diverged_run_in_one_line(tmp_path, capsys):
    """An absurd learning rate sends the weights to NaN: the script ends with status 1 and one line,
    not a traceback or a NaN checkpoint."""
    out = tmp_path / "run"
    code = _script().main(["--smoke", "--out", str(out), "--max-vae-steps", "1", "--eval-clips", "0",
                           "--lr", "1e30"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("train_test_model: training diverged: non-finite weights in the "), err[-3:]
    assert json.loads((out / "train_log.json").read_text())["diverged"]["models"]


@pytest.mark.slow
def test_script_prints_no_optional_import_noise(tmp_path):
    """Run as users run it, the script prints its result and none of torchao's import-time lines
    (compiled extensions it cannot load, deprecated pytree registrations), as the CLI does not."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_test_model.py"
    proc = subprocess.run([sys.executable, str(script), "--evaluate", "shipped", "--eval-clips", "1",
                           "--out", str(tmp_path / "eval")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "motion check: generated" in proc.stdout
    from fp4video.cli.common import OPTIONAL_IMPORT_NOISE

    for _, needles in OPTIONAL_IMPORT_NOISE:
        for needle in needles:
            assert needle not in proc.stderr + proc.stdout, needle


def test_a_diverged_vae_names_the_vaes_learning_rate(tmp_path):
    """The VAE trains at --vae-lr, the transformer and the text encoder at --lr: the line of a
    diverged run names the rate of the model that went non-finite."""
    pipe = build_pipeline(SMOKE)
    run = tm._Run(tmp_path, lambda *a, **k: None, {}, None)
    with torch.no_grad():
        next(pipe.vae.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite weights in the vae at .*try a lower --vae-lr\)$"):
        tm._save(run, pipe, packed=False)
    with torch.no_grad():
        next(pipe.transformer.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"in the transformer and vae at .*try a lower --lr or --vae-lr\)$"):
        tm._save(run, pipe, packed=False)


# --- which combinations an evaluation checks ---------------------------------------------------------

def test_eval_scenes_training_combinations_are_drawn_as_training_draws_them_with_the_camera_still():
    """``eval_scenes(..., "training")``: combinations outside HELD_OUT, camera still, the same for a
    seed; ``"held-out"``: the held-out scenes a run's evaluation checks; anything else refused."""
    held = {s.combination for s in scenes.HELD_OUT}
    train = tm.eval_scenes(40, 1234, "training")
    assert len(train) == 40 and all(s.camera == "still" for s in train.specs)
    assert not {s.combination for s in train.specs} & held
    assert len({s.combination for s in train.specs}) > 30  # drawn, not one combination repeated
    assert train.captions() == tm.eval_scenes(40, 1234, "training").captions()
    assert tm.eval_scenes(40, 1234, "training").params["colour"].equal(train.params["colour"])
    ref = scenes.held_out_scenes(seed=1234, repeats=2).subset(torch.arange(30))
    assert tm.eval_scenes(30, 1234).captions() == ref.captions()
    with pytest.raises(ValueError, match="combinations: 'train', not one of held-out, training"):
        tm.eval_scenes(2, 0, "train")


def test_eval_combinations_without_evaluate_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    for extra in ([], ["--unpack", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            _script().main(["--smoke", "--eval-combinations", "training", "--out", str(out)] + extra)
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == ("train_test_model.py: error: --eval-combinations training: only with --evaluate "
                        "(a run checks the held-out combinations)"), last
    assert not out.exists()


@pytest.mark.slow
def test_evaluate_on_training_combinations_checks_those_and_says_so(tmp_path):
    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--out", str(run), "--max-vae-steps", "1", "--eval-clips", "2"]) == 0
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--evaluate", str(run / "pipeline"), "--eval-clips", "3",
                               "--eval-combinations", "training", "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert ev["combinations"] == "training" and ev["generated"]["clips"] == 3
    assert ev["captions"] == tm.eval_scenes(3, Settings().eval_seed, "training").captions()
    held = {s.caption for s in scenes.HELD_OUT}
    assert not set(ev["captions"]) & held
    assert said.getvalue().startswith("training motion check: generated")


# --- the fine size: a VAE of 4× spatial compression and a (1, 2, 2) patch --------------------------

def test_fine_size_keeps_the_tokens_over_a_latent_twice_as_fine():
    """FINE is FULL's clips and transformer over a 4× VAE: latent 8 × 32 × 32, the same 2,048 tokens
    after the (1, 2, 2) patch; the VAE built from it encodes a clip to that grid and says its factor
    to the pipeline (``scale_factor_spatial``)."""
    from fp4video.testmodel.model import FINE, FULL

    assert FINE.latent_shape == (8, 32, 32) and FULL.latent_shape == (8, 16, 16)
    assert FINE.video_tokens == FULL.video_tokens == 2048
    assert (FINE.spatial_compression, FULL.spatial_compression) == (4, 8)
    assert FINE.temporal_downsample == [True, True] and FULL.temporal_downsample == [False, True, True]
    pipe = build_pipeline(FINE)
    assert pipe.vae_scale_factor_spatial == 4 and pipe.vae.config.scale_factor_spatial == 4
    with torch.no_grad():
        z = pipe.vae.encode(torch.rand(1, 3, FINE.frames, FINE.height, FINE.width)).latent_dist.mean
    assert tuple(z.shape) == (1, FINE.z_dim, *FINE.latent_shape)
    assert tm.config_of(pipe, FULL) == FINE  # what a resumed run reads back


@pytest.mark.parametrize("update, match", [
    ({"vae_dim_mult": (1, 2)}, "vae_dim_mult"),
    ({"height": 36}, "multiples of the VAE's 8× spatial compression"),
    ({"vae_dim_mult": (1, 2, 2), "width": 130}, "multiples of the VAE's 4× spatial compression"),
    ({"vae_dim_mult": (1, 2, 2), "patch_size": (1, 3, 3)}, "does not divide into patches"),
])
def test_model_sizes_refuse_a_vae_or_patch_that_does_not_fit(update, match):
    from pydantic import ValidationError

    from fp4video.testmodel.model import FULL, TestModelConfig

    with pytest.raises((ValueError, ValidationError), match=match):
        TestModelConfig(**{**FULL.model_dump(), **update})


@pytest.mark.slow
def test_a_fine_smoke_run_trains_saves_and_resumes_at_its_sizes(tmp_path):
    """``--size fine`` on the smoke model trains a 3-level VAE and a (1, 2, 2) patch; the saved
    pipeline loads with its 4× factor, and a resumed run keeps those sizes (``--size`` with
    ``--resume`` is refused in one line)."""
    from diffusers import WanPipeline

    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--size", "fine", "--out", str(run), "--max-vae-steps", "1",
                               "--eval-clips", "1"]) == 0
    log = json.loads((run / "train_log.json").read_text())
    assert log["settings"]["size"] == "fine"
    assert log["config"]["vae_dim_mult"] == [1, 1, 1] and log["config"]["patch_size"] == [1, 2, 2]
    assert log["video_tokens"] == 2 * 4 * 4
    pipe = WanPipeline.from_pretrained(run / "pipeline")
    assert pipe.vae_scale_factor_spatial == 4 and tuple(pipe.transformer.config.patch_size) == (1, 2, 2)
    with torch.no_grad():
        frames = pipe("a red square moves left on a black background", height=SMOKE.height, width=SMOKE.width,
                      num_frames=SMOKE.frames, num_inference_steps=2, output_type="pt",
                      generator=torch.Generator().manual_seed(0)).frames
    assert tuple(frames.shape) == (1, SMOKE.frames, 3, SMOKE.height, SMOKE.width) and torch.isfinite(frames).all()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _script().main(["--smoke", "--size", "fine", "--resume", str(run), "--out", str(tmp_path / "again")])
    assert err.getvalue().strip().splitlines()[-1] == ("train_test_model.py: error: --size chooses a fresh run's "
                                                       "model: a resumed run keeps its model's sizes")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--resume", str(run), "--out", str(tmp_path / "again"),
                               "--eval-clips", "0"]) == 0
    again = json.loads((tmp_path / "again" / "train_log.json").read_text())
    assert again["config"] == log["config"]


# --- the data a resumed run draws, and the refreshed pool ------------------------------------------

def test_data_offsets_start_past_every_batch_the_resumed_runs_drew():
    """A fresh run's streams start at 0; a resumed one's past the VAE steps, pool clips (built and
    refreshed) and two noise streams of every run in its chain, a checkpoint's partial phases too."""
    assert tm.data_offsets(None) == {"vae": 0, "pool": 0, "noise": 0}
    first = {"phases": {"vae": {"steps": 470}, "pool": {"clips": 384}, "transformer": {"steps": 27}}}
    second = {"previous_log": first, "phases": {"pool": {"clips": 12288},
                                                "transformer": {"steps": 9, "refreshed_clips": 144}}}
    third = {"previous_log": second, "phases": {"vae": {"steps": 5, "done": False}}}
    assert tm.data_offsets(first) == {"vae": 470, "pool": 384, "noise": 2}
    assert tm.data_offsets(second) == {"vae": 470, "pool": 384 + 12288 + 144, "noise": 4}
    assert tm.data_offsets(third) == {"vae": 475, "pool": 384 + 12288 + 144, "noise": 6}


def test_overwrite_oldest_replaces_the_pools_rows_as_a_ring():
    pool = (torch.arange(5.0).view(5, 1).repeat(1, 3), torch.arange(5).view(5, 1), None)
    oldest = 0
    for wave in range(3):  # 2 fresh rows a wave: rows 0-1, 2-3, then 4 and 0
        fresh = (torch.full((2, 3), 10.0 + wave), torch.full((2, 1), 10 + wave), torch.zeros(2))
        oldest = tm.overwrite_oldest(pool, fresh, oldest)
    assert oldest == 1
    assert pool[0][:, 0].tolist() == [12.0, 10.0, 11.0, 11.0, 12.0]
    assert pool[1][:, 0].tolist() == [12, 10, 11, 11, 12] and pool[1].dtype == torch.int64
    with pytest.raises(ValueError, match="6 fresh clips for a pool of 5"):
        tm.overwrite_oldest(pool, (torch.zeros(6, 3),), 0)


@pytest.mark.slow
def test_a_resumed_run_draws_clips_and_noise_its_predecessors_never_did(tmp_path, monkeypatch):
    """Every stream index a run draws (VAE batches, pool clips, refreshed clips, noise) is recorded:
    a fresh rerun draws the same ones (reproducible from the seed), a resumed run with the same seed
    draws none of its predecessor's, and the pool refresh draws fresh clips after every step, its
    clips continuing the pool's stream."""
    drawn: dict[str, list] = {}
    stream = tm._stream

    def spy(seed, phase, index):
        drawn.setdefault(phase, []).append(index)
        return stream(seed, phase, index)

    monkeypatch.setattr(tm, "_stream", spy)
    overwrite, writes = tm.overwrite_oldest, []

    def spy_overwrite(pool, fresh, oldest):
        before = pool[0].clone()
        after = overwrite(pool, fresh, oldest)
        writes.append((len(pool[0]), int((pool[0] != before).flatten(1).any(1).sum()), after))
        return after

    monkeypatch.setattr(tm, "overwrite_oldest", spy_overwrite)
    quiet = dict(log=lambda *a, **k: None, device="cpu")
    s = Settings(**{**SMOKE_SETTINGS, "eval_clips": 0, "pool_refresh": 2})  # pool 4 (2 batches), 3 steps
    runs = {}
    for name, resume in (("first", None), ("again", None), ("resumed", "first")):
        drawn = {}
        log = tm.train(s, tmp_path / name, resume=tmp_path / resume if resume else None, **quiet)
        runs[name] = ({k: sorted(v) for k, v in drawn.items() if k != "stats"}, log)
    (first, log), (again, _), (resumed, rlog) = runs["first"], runs["again"], runs["resumed"]
    assert first == again
    assert writes[:2] == [(4, 2, 2), (4, 2, 0)]  # the first run's pool of 4: 2 rows changed a step, none after the last
    assert first["vae"] == [0, 1] and first["noise"] == [0, 1]
    assert first["pool"] == [0, 2, 4, 6]  # two encode batches, then 2 fresh clips after each step but the last
    assert log["phases"]["transformer"]["refreshed_clips"] == 4 and log["phases"]["transformer"]["distinct_clips"] == 8
    for phase in ("vae", "pool", "noise"):
        assert not set(resumed[phase]) & set(first[phase]), phase
    assert min(resumed["pool"]) == 8 and resumed["noise"] == [2, 3] and resumed["vae"] == [2, 3]
    assert rlog["data_offsets"] == {"vae": 2, "pool": 8, "noise": 2}


@pytest.mark.slow
def test_train_shift_sets_the_transformers_timesteps_and_not_the_samplers(tmp_path, monkeypatch):
    """``train_shift`` S draws the transformer's training timesteps as S·u / (1 + (S - 1)·u); the
    default draws them with the scheduler's flow_shift; the saved scheduler (what sampling uses)
    keeps its flow_shift either way."""
    seen = []
    sample = tm.flow_sample

    def spy(x0, noise, u, shift):
        xt, timestep, target = sample(x0, noise, u, shift)
        seen.append((shift, u.clone(), timestep.clone()))
        return xt, timestep, target

    monkeypatch.setattr(tm, "flow_sample", spy)
    quiet = dict(log=lambda *a, **k: None, device="cpu")
    for name, shift in (("default", None), ("uniform", 1.0)):
        seen.clear()
        tm.train(Settings(**{**SMOKE_SETTINGS, "eval_clips": 0, "train_shift": shift}), tmp_path / name, **quiet)
        expected = SMOKE.flow_shift if shift is None else shift
        assert len(seen) == SMOKE_SETTINGS["max_steps"] and all(s == expected for s, _, _ in seen)
        for _, u, timestep in seen:
            t = expected * u / (1 + (expected - 1) * u)
            torch.testing.assert_close(timestep.float(), 1000 * t, rtol=0, atol=1e-3)
        scheduler = json.loads((tmp_path / name / "pipeline" / "scheduler" / "scheduler_config.json").read_text())
        assert scheduler["flow_shift"] == SMOKE.flow_shift


def test_training_log_of_finds_a_runs_log_beside_its_pipeline_and_none_for_a_bare_folder(tmp_path):
    run = tmp_path / "run"
    (run / "pipeline").mkdir(parents=True)
    (run / "train_log.json").write_text("{}")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model_index.json").write_text("{}")
    assert tm.training_log_of(run) == run / "train_log.json"
    assert tm.training_log_of(run / "pipeline") == run / "train_log.json"
    assert tm.training_log_of(bare) is None


def test_a_refresh_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match=r"pool_refresh \(5\) exceeds pool_size \(4\)"):
        Settings(**{**SMOKE_SETTINGS, "pool_refresh": 5})


@pytest.mark.slow
def test_resuming_a_model_without_its_log_needs_a_seed(tmp_path):
    """A pipeline folder without its training log (a run's pipeline/ copied away from it) cannot say
    which clips trained it: resuming it without --seed is refused in one line before any work; with
    one, the run says and logs that its streams start at 0. A run's pipeline/ folder finds its log."""
    import shutil

    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--out", str(run), "--max-vae-steps", "1", "--eval-clips", "0"]) == 0
    bare = tmp_path / "bare"
    shutil.copytree(run / "pipeline", bare)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _script().main(["--smoke", "--resume", str(bare), "--out", str(tmp_path / "a")])
    assert err.getvalue().strip().splitlines()[-1] == (
        f"train_test_model.py: error: --resume {bare}: no training log says which clips it was trained on; give "
        "--seed (a fresh run draws seed 0's, so another seed draws new clips)")
    assert not (tmp_path / "a").exists()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--resume", str(bare), "--seed", "5", "--out", str(tmp_path / "b"),
                               "--eval-clips", "0"]) == 0
    assert f"{bare} holds no training log: this run draws seed 5's streams from their start" in out.getvalue()
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert log["resumed_without_log"] is True and log["data_offsets"] == {"vae": 0, "pool": 0, "noise": 0}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--resume", str(run / "pipeline"), "--out", str(tmp_path / "c"),
                               "--eval-clips", "0"]) == 0
    log = json.loads((tmp_path / "c" / "train_log.json").read_text())
    assert "resumed_without_log" not in log and log["data_offsets"]["vae"] == 1


@pytest.mark.slow
def test_vae_from_trains_a_new_transformer_on_a_saved_models_vae(tmp_path):
    """``--vae-from`` takes a saved model's trained VAE (weights and latent statistics, bit for bit)
    into a fresh model, whose transformer ``--heads`` / ``--layers`` size, and trains no VAE; a VAE
    of other sizes, and the options with ``--resume``, are refused in one line before any work."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--size", "fine", "--out", str(src), "--max-vae-steps", "1",
                               "--eval-clips", "0"]) == 0
    out = tmp_path / "wide"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--size", "fine", "--vae-from", str(src), "--heads", "3", "--layers", "3",
                               "--seed", "7", "--out", str(out), "--eval-clips", "0"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert "vae" not in log["phases"] and log["phases"]["transformer"]["steps"] == SMOKE_SETTINGS["max_steps"]
    assert log["vae_from"]["model"] == str(src / "pipeline")
    t = json.loads((out / "pipeline" / "transformer" / "config.json").read_text())
    assert (t["num_attention_heads"], t["num_layers"], t["ffn_dim"]) == (3, 3, 4 * 3 * t["attention_head_dim"])
    a, b = (json.loads((f / "pipeline" / "vae" / "config.json").read_text()) for f in (src, out))
    assert a["latents_mean"] == b["latents_mean"] and a["latents_std"] == b["latents_std"]
    wa, wb = (load_file(next((f / "pipeline" / "vae").glob("*.safetensors"))) for f in (src, out))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    broken = tmp_path / "broken"  # a pipeline folder's index alone
    broken.mkdir()
    (broken / "model_index.json").write_text("{}")
    for args, match in (
            (["--vae-from", str(src)], "--vae-from " + str(src) + ": its VAE is not of this run's --size (dim_mult "),
            (["--resume", str(out), "--heads", "2"], "--heads builds a fresh run's model: a resumed run keeps its model"),
            (["--vae-from", str(tmp_path / "nowhere")], "--vae-from " + str(tmp_path / "nowhere") + ": no such folder"),
            (["--vae-from", str(broken)], f"--vae-from {broken}: {broken}: transformer/config.json is missing")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            _script().main(["--smoke", "--out", str(tmp_path / "refused"), *args])
        last = err.getvalue().strip().splitlines()[-1]
        assert last.startswith("train_test_model.py: error: " + match), last
        assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match="vae_decoder_only trains a resumed model's VAE decoder"):
        tm.train(Settings(**{**SMOKE_SETTINGS, "vae_decoder_only": True}), tmp_path / "fresh", device="cpu",
                 log=lambda *a, **k: None)
    assert not (tmp_path / "fresh").exists()


def test_a_gpu_run_puts_the_process_matmul_settings_back(monkeypatch):
    """``train`` on a GPU runs its work with TF32 and cuDNN's autotuning on and puts the process's
    settings back when it ends, also when it fails; a CPU run changes none (the switches are
    process-wide; setting them needs no GPU)."""
    switches = tm._precision_switches()
    state = lambda: [getattr(obj, name) for obj, name in switches]  # noqa: E731
    fast = [True if name != "fp32_precision" else "tf32" for _, name in switches]
    before = state()
    seen = []

    def fake_train(settings, out, *, device, **kwargs):
        seen.append((device.type, state()))
        if settings.seed == 13:
            raise RuntimeError("diverged")
        return {}

    monkeypatch.setattr(tm, "_train", fake_train)
    slow = [False if name != "fp32_precision" else "ieee" for _, name in switches]
    try:
        for (obj, name), value in zip(switches, slow):
            setattr(obj, name, value)
        tm.train(Settings(**SMOKE_SETTINGS), "unused", device="cuda")
        assert seen[-1] == ("cuda", fast) and state() == slow
        with pytest.raises(RuntimeError, match="diverged"):
            tm.train(Settings(**{**SMOKE_SETTINGS, "seed": 13}), "unused", device="cuda")
        assert seen[-1] == ("cuda", fast) and state() == slow
        tm.train(Settings(**SMOKE_SETTINGS), "unused", device="cpu")
        assert seen[-1] == ("cpu", slow) and state() == slow
    finally:
        for (obj, name), value in zip(switches, before):
            setattr(obj, name, value)
    assert state() == before


# --- growing a resumed transformer -----------------------------------------------------------------

def _wan_call(transformer, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    x = torch.randn(2, cfg.in_channels, 2, 4, 4, generator=g)
    text = torch.randn(2, 5, cfg.text_dim, generator=g)
    t = torch.tensor([870.0, 130.0])
    return dict(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)


def test_grown_blocks_keep_the_function_copy_their_source_and_learn(tmp_path):
    """grow_blocks: the grown transformer's outputs equal the given one's bit for bit on random inputs
    (every new block adds zero); each new block sits right after the block it copies, equal to it but
    for the three output projections, which are zero; the new depth saves and loads; and a training
    step's gradient reaches the zeroed projections (the new blocks learn)."""
    from diffusers import WanTransformer3DModel

    transformer = build_pipeline(SMOKE, seed=0).transformer.float()
    with torch.no_grad():  # trained-looking weights: no parameter left at a constant initial value
        for p in transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    source = [b for b in transformer.blocks]
    calls = [_wan_call(transformer, seed) for seed in (1, 2)]
    with torch.no_grad():
        before = [transformer(**c)[0] for c in calls]
    n = len(source)
    copied = tm.grow_blocks(transformer, 3)
    assert copied == [0, 1, 1] and len(transformer.blocks) == n + 3 and transformer.config.num_layers == n + 3
    order = [0, "0", 1, "1", "1"]  # the given blocks as they were (same objects), copies after their source
    for block, where in zip(transformer.blocks, order):
        if isinstance(where, int):
            assert block is source[where]
            continue
        src = dict(source[int(where)].named_parameters())
        zeroed = {"attn1.to_out.0.weight", "attn1.to_out.0.bias", "attn2.to_out.0.weight", "attn2.to_out.0.bias",
                  "ffn.net.2.weight", "ffn.net.2.bias"}
        for name, p in block.named_parameters():
            assert p.data_ptr() != src[name].data_ptr(), f"{name} shares storage with its source"
            if name in zeroed:
                assert not p.any(), name
            else:
                assert torch.equal(p, src[name]), name
        assert zeroed <= set(src), "the zeroed names are the block's output projections"
    with torch.no_grad():
        after = [transformer(**c)[0] for c in calls]
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    transformer.save_pretrained(tmp_path / "grown")
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "grown")
    assert loaded.config.num_layers == n + 3 and len(loaded.blocks) == n + 3
    with torch.no_grad():
        assert torch.equal(loaded(**calls[0])[0], before[0])
    out = transformer(**calls[0])[0]
    out.pow(2).mean().backward()
    for i in (1, 3, 4):
        for layer in (transformer.blocks[i].attn1.to_out[0], transformer.blocks[i].attn2.to_out[0],
                      transformer.blocks[i].ffn.net[2]):
            assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0, i
    assert tm.grow_blocks(transformer, 0) == [] and len(transformer.blocks) == n + 3
    with pytest.raises(ValueError, match="extra must be >= 0"):
        tm.grow_blocks(transformer, -1)


@pytest.mark.slow
def test_a_resumed_run_grows_its_transformer_and_a_fresh_one_refuses_to(tmp_path):
    """``--grow-layers`` on a resumed smoke run: the log records the growth, the saved pipeline has
    the new depth and loads; a fresh run with it is refused in one line, before any work (the
    script's and ``train``'s own check)."""
    from diffusers import WanPipeline

    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--out", str(run), "--max-vae-steps", "1", "--eval-clips", "0"]) == 0
        assert _script().main(["--smoke", "--resume", str(run), "--grow-layers", "2", "--out", str(tmp_path / "grown"),
                               "--eval-clips", "1"]) == 0
    log = json.loads((run / "train_log.json").read_text())
    grown = json.loads((tmp_path / "grown" / "train_log.json").read_text())
    n = log["config"]["layers"]
    assert grown["grown"] == {"layers_before": n, "layers_after": n + 2, "blocks_copied": [0, 1]}
    assert grown["config"]["layers"] == n + 2
    assert grown["parameters"]["transformer"] > log["parameters"]["transformer"]
    pipe = WanPipeline.from_pretrained(tmp_path / "grown" / "pipeline")
    assert pipe.transformer.config.num_layers == n + 2 and len(pipe.transformer.blocks) == n + 2
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _script().main(["--smoke", "--grow-layers", "1", "--out", str(tmp_path / "fresh")])
    assert err.getvalue().strip().splitlines()[-1] == ("train_test_model.py: error: --grow-layers adds blocks to a "
                                                       "resumed model: a fresh run's depth is --layers")
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(ValueError, match="grow_layers adds blocks to a resumed model"):
        tm.train(Settings(**{**SMOKE_SETTINGS, "grow_layers": 1}), tmp_path / "fresh2", device="cpu",
                 log=lambda *a, **k: None)
    assert not (tmp_path / "fresh2").exists()


@pytest.mark.slow
def test_vae_decoder_only_trains_the_decoder_and_keeps_the_latents(tmp_path):
    """``--vae-decoder-only`` on a resumed run trains the VAE's decoder and nothing of its encoder:
    the encoder's weights and the latent statistics are saved bit for bit as resumed (the latents a
    resumed transformer learned on), the decoder's change; without ``--resume`` or ``--vae-minutes``
    it is refused in one line before any work."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--out", str(run), "--max-vae-steps", "1", "--eval-clips", "0"]) == 0
        assert _script().main(["--smoke", "--resume", str(run), "--vae-minutes", "0.5", "--vae-decoder-only",
                               "--out", str(tmp_path / "dec"), "--eval-clips", "0"]) == 0
    log = json.loads((tmp_path / "dec" / "train_log.json").read_text())
    assert log["phases"]["vae"]["decoder_only"] is True and log["phases"]["vae"]["steps"] == SMOKE_SETTINGS["max_vae_steps"]
    a, b = (json.loads((f / "pipeline" / "vae" / "config.json").read_text()) for f in (run, tmp_path / "dec"))
    assert a["latents_mean"] == b["latents_mean"] and a["latents_std"] == b["latents_std"]
    wa, wb = (load_file(next((f / "pipeline" / "vae").glob("*.safetensors"))) for f in (run, tmp_path / "dec"))
    assert wa.keys() == wb.keys()
    kept = [k for k in wa if k.startswith(("encoder.", "quant_conv."))]
    trained = [k for k in wa if k.startswith(("decoder.", "post_quant_conv."))]
    assert kept and trained and len(kept) + len(trained) == len(wa)
    assert all(torch.equal(wa[k], wb[k]) for k in kept)
    assert sum(not torch.equal(wa[k], wb[k]) for k in trained) > len(trained) // 2
    for args in (["--vae-minutes", "0.5"], ["--resume", str(run)]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            _script().main(["--smoke", "--vae-decoder-only", *args, "--out", str(tmp_path / "refused")])
        assert err.getvalue().strip().splitlines()[-1] == (
            "train_test_model.py: error: --vae-decoder-only trains a resumed model's VAE decoder: give --resume "
            "and --vae-minutes > 0")
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match="vae_decoder_only trains a resumed model's VAE decoder"):
        tm.train(Settings(**{**SMOKE_SETTINGS, "vae_decoder_only": True}), tmp_path / "fresh", device="cpu",
                 log=lambda *a, **k: None)
    assert not (tmp_path / "fresh").exists()


# --- upright shapes --------------------------------------------------------------------------------

def test_upright_scenes_start_at_angle_zero_and_keep_every_other_draw():
    """``upright``: every angle0 is 0, and every other parameter (spins included) is the draw the
    same seed gives without it; the held-out scenes alike; a non-bool is refused."""
    turned, upright = sample_scenes(96, seed=3), sample_scenes(96, seed=3, upright=True)
    assert turned.specs == upright.specs and (turned.params["angle0"] != 0).all()
    assert torch.equal(upright.params["angle0"], torch.zeros(96, dtype=upright.params["angle0"].dtype))
    assert all(torch.equal(turned.params[k], upright.params[k]) for k in turned.params if k != "angle0")
    assert (upright.params["spin"] != 0).any()  # spinning clips still turn, from 0
    held = scenes.held_out_scenes(seed=5, repeats=2, upright=True)
    assert held.captions() == scenes.held_out_scenes(seed=5, repeats=2).captions()
    assert (held.params["angle0"] == 0).all()
    assert (tm.eval_scenes(30, 1234, upright=True).params["angle0"] == 0).all()
    assert (tm.eval_scenes(30, 1234, "training", upright=True).params["angle0"] == 0).all()
    with pytest.raises(TypeError, match="upright must be True or False"):
        sample_scenes(2, seed=0, upright=1)


def test_an_upright_square_fills_its_axis_aligned_bounding_box():
    """Rendered, an upright still square covers its bounding box (sides along the frame's axes); the
    same square at its drawn angle covers a clearly smaller part of its box."""
    spec = scenes.SceneSpec(colour="red", shape="square", motion="moves left", background="black")
    for seed in range(40):  # a drawn angle far from a multiple of 90 degrees
        angle = float(sample_scenes(1, seed=seed, specs=[spec]).params["angle0"][0]) % (torch.pi / 2)
        if 0.5 < angle < 1.07:
            break
    fills = {}
    for upright in (False, True):
        sc = sample_scenes(1, seed=seed, specs=[spec], upright=upright)
        _, mask = render(sc, frames=1, height=128, width=128)
        m = mask[0, 0, 0] > 0.5
        rows, cols = m.any(1).nonzero().flatten(), m.any(0).nonzero().flatten()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        fills[upright] = float(m.sum() / box)
    assert fills[True] > 0.95 and fills[False] < 0.8, fills


@pytest.mark.slow
def test_upright_reaches_every_clip_a_run_draws_and_a_resumed_run_says_when_it_changes(tmp_path, monkeypatch):
    """``--upright`` reaches the VAE's, the statistics', the pool's and the evaluation's scenes (every
    draw of the run), is logged, and ``--evaluate`` of the model checks upright ground truths as its
    log says; a run resuming it without ``--upright`` says so in a line and draws turned shapes."""
    calls = []
    original = scenes.sample_scenes

    def spy(*args, **kwargs):
        calls.append(kwargs.get("upright", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(scenes, "sample_scenes", spy)
    monkeypatch.setattr(tm, "sample_scenes", spy)
    run = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--upright", "--out", str(run), "--max-vae-steps", "1",
                               "--eval-clips", "2"]) == 0
    log = json.loads((run / "train_log.json").read_text())
    assert log["settings"]["upright"] is True and log["evaluation"]["upright"] is True
    assert len(calls) >= 4 and all(calls)  # VAE batch, statistics, pool batches, evaluation
    calls.clear()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--evaluate", str(run), "--eval-clips", "2",
                               "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert calls == [True] and ev["upright"] is True and ev["upright_from"] == "training log"
    calls.clear()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--evaluate", str(run), "--eval-clips", "2", "--no-upright",
                               "--out", str(tmp_path / "ev-turned")]) == 0
    ev = json.loads((tmp_path / "ev-turned" / "evaluation.json").read_text())
    assert calls == [False] and ev["upright"] is False and ev["upright_from"] == "--no-upright"
    calls.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--resume", str(run), "--out", str(tmp_path / "again"),
                               "--max-steps", "1", "--eval-clips", "0"]) == 0
    assert "trained on upright shapes; this run draws randomly turned ones" in out.getvalue()
    assert calls and not any(calls)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert _script().main(["--smoke", "--vae-from", str(run), "--out", str(tmp_path / "new"),
                               "--max-steps", "1", "--eval-clips", "0"]) == 0
    assert "VAE trained on upright shapes; this run draws randomly turned ones" in out.getvalue()


def test_resuming_a_chain_that_starts_without_a_log_needs_a_seed(tmp_path):
    """A log whose chain resumed a model without a log (the shipped weights' first upright run
    resumed run 4's) does not know every clip its model saw: resuming it without --seed is refused
    in one line before any work. The shipped weights are such a model."""
    import shutil

    from fp4video.testmodel import WEIGHTS

    first = {"settings": {"seed": 6}, "resumed_without_log": True, "phases": {"vae": {"steps": 3}}}
    assert tm.chain_starts_unlogged({"settings": {}, "previous_log": first})
    assert not tm.chain_starts_unlogged({"settings": {}, "previous_log": {"settings": {}}})
    assert not tm.chain_starts_unlogged(None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _script().main(["--resume", str(WEIGHTS), "--out", str(tmp_path / "a")])
    assert err.getvalue().strip().splitlines()[-1] == (
        f"train_test_model.py: error: --resume {WEIGHTS}: its training log starts from a model without a log, so "
        "not every clip it was trained on is known; give --seed (a fresh run draws seed 0's, so another seed draws "
        "new clips)")
    assert not (tmp_path / "a").exists()
    bad = tmp_path / "bad"
    shutil.copytree(WEIGHTS, bad)
    (bad / "train_log.json").write_text("not json")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        _script().main(["--resume", str(bad), "--out", str(tmp_path / "b")])
    assert err.getvalue().strip().splitlines()[-1] == (
        f"train_test_model.py: error: --resume {bad}: {bad / 'train_log.json'}: not a training log (a JSON object "
        "expected)")
