"""diffusers integration on tiny offline pipelines: stock equality, policy routing from the recorded
calls (steps under CFG, two experts), install/uninstall, policies and configs, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from fp4video.integration import FP4Processor, Policy, install, installed_context, uninstall  # noqa: E402
from fp4video.integration.routing import BACKEND  # noqa: E402
from fp4video.integration.config import ConfigError, load_config  # noqa: E402
from fp4video.integration.tiny import TINY_SIZES, tiny_wan_pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipe():
    return tiny_wan_pipeline(two_experts=True)


def run(pipe, steps=4):
    return pipe(prompt="a cat", negative_prompt="", height=TINY_SIZES["height"], width=TINY_SIZES["width"],
                num_frames=TINY_SIZES["frames"], num_inference_steps=steps, guidance_scale=4.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames[0]


def test_fp16_policy_reproduces_stock_and_uninstall_restores(pipe):
    before = {n: p for n, p in pipe.transformer.attn_processors.items()}
    stock = run(pipe)
    ctx = install(pipe, Policy(method="fp16"))
    routed = pipe.transformer_2.attn_processors
    assert all(getattr(p._attention_backend, "value", None) == BACKEND for p in routed.values())
    assert all(pipe.transformer.attn_processors[n] is p for n, p in before.items())  # the stock processors stay
    fp16 = run(pipe)
    assert abs(fp16 - stock).max() <= 1e-5
    assert len(ctx.calls) == 4 * 2 * 2 * 2  # steps x (cond, uncond) x blocks x (self, cross)
    uninstall(pipe)
    assert all(pipe.transformer.attn_processors[n] is p for n, p in before.items())
    assert all(p._attention_backend is None and "_attention_backend" not in vars(p) for p in before.values())
    assert not any(hasattr(m, "_fp4video_block") for m in pipe.transformer.modules())
    assert abs(run(pipe) - stock).max() == 0


def test_processor_matches_stock_module_by_module():
    """Each attention module's output with FP4Processor('fp16') equals the stock processor's."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    pipe = tiny_wan_pipeline(two_experts=False, seed=3)
    model = pipe.transformer
    attn1, attn2 = model.blocks[0].attn1, model.blocks[0].attn2
    x = torch.randn(1, 300, 128)
    ctx = torch.randn(1, 512, 128)
    cos, sin = torch.randn(1, 300, 1, 64), torch.randn(1, 300, 1, 64)
    for attn, kw in ((attn1, dict(rotary_emb=(cos, sin))), (attn2, dict(encoder_hidden_states=ctx))):
        stock = WanAttnProcessor()(attn, x, **kw)
        ours = FP4Processor(method="fp16")(attn, x, **kw)
        assert (ours - stock).abs().max() <= 1e-5
        quant = FP4Processor(method="mxattn")(attn, x, **kw)
        assert 0 < (quant - stock).abs().max() and torch.nn.functional.cosine_similarity(
            quant.flatten(), stock.flatten(), dim=0) > 0.9  # same computation, FP4-rounded


def test_mxattn_hybrid_policy_routing(pipe):
    policy = load_config(ROOT / "configs" / "wan22_mxattn.yaml").policy
    ctx = install(pipe, policy)
    try:
        run(pipe, steps=6)
    finally:
        uninstall(pipe)
    calls = ctx.calls
    for c in calls:
        assert set(c) >= {"step", "expert", "block", "kind", "method"}
        assert isinstance(c["step"], int) and isinstance(c["block"], int)
        want = "fp16" if c["block"] == 0 or c["step"] >= 4 else "mxattn"
        assert c["method"] == want, c
    per_step = Counter(c["step"] for c in calls)
    assert sorted(per_step) == list(range(6)) and set(per_step.values()) == {8}  # CFG: 2 calls x 4 modules
    experts = {c["step"]: c["expert"] for c in calls}
    assert experts[0] == "high_noise" and experts[5] == "low_noise"
    switch = [s for s in range(5) if experts[s] != experts[s + 1]]
    assert len(switch) == 1  # one boundary: high-noise expert first, then the low-noise one


def test_rules_by_kind_and_expert(pipe):
    policy = Policy.model_validate({"method": "fp16", "rules": [
        {"method": "sage3", "kinds": ["cross"], "experts": ["low_noise"]},
        {"method": "mxattn", "steps": {"fraction": [0.0, 0.5]}, "kinds": ["self"]}]})
    ctx = install(pipe, policy)
    try:
        run(pipe, steps=4)
    finally:
        uninstall(pipe)
    for c in ctx.calls:
        if c["kind"] == "cross" and c["expert"] == "low_noise":
            assert c["method"] == "sage3"
        elif c["kind"] == "self" and c["step"] < 2:
            assert c["method"] == "mxattn"
        else:
            assert c["method"] == "fp16"


def test_install_twice_is_refused(pipe):
    install(pipe, "mxattn")
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            install(pipe, "sage3")
    finally:
        uninstall(pipe)


# --- policies and configs ------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.prompts and cfg.policy.method
    assert path.read_text().startswith("#"), "each config starts with a comment saying what it reproduces"
    assert f"fp4video generate --config configs/{path.name}" in path.read_text()


def test_wan_animate_inputs_on_another_family_are_refused(tmp_path):
    """A pose video (or replace mode) in a config of another family would be silently unused."""
    path = tmp_path / "c.yaml"
    path.write_text("family: wan\npose_video: pose.mp4\nanimate_mode: replace\n")
    with pytest.raises(ConfigError, match=r"pose_video, animate_mode: Wan Animate's inputs, but family is 'wan'"):
        load_config(path)
    path.write_text("family: animate\ntask: i2v\n")
    with pytest.raises(ConfigError, match="task: i2v does not apply to family animate"):
        load_config(path)
    path.write_text("family: animate\npose_video: pose.mp4\n")
    assert load_config(path).pose_video == "pose.mp4"


def test_wan22_mxattn_config_is_the_papers_policy():
    p = load_config(ROOT / "configs" / "wan22_mxattn.yaml").policy
    m = lambda block, step: p.method_for(block=block, step=step, num_steps=40, kind="self", expert="high_noise")  # noqa: E731
    assert m(0, 10) == "fp16" and m(5, 38) == "fp16" and m(5, 39) == "fp16" and m(5, 37) == "mxattn"


@pytest.mark.parametrize("text, match", [
    ("policy: {method: mxfp5}", r"bad.yaml: policy.method: .*unknown method 'mxfp5'"),
    ("policy: {method: mxattn, rules: [{method: fp16, blok: [0]}]}", r"policy.rules\[0\].blok: unknown field \(allowed: backend, blocks, experts, kinds, method, sparsity, steps\)"),
    ("policy: {rules: [{method: fp16, steps: {last: 2, first: 1}}]}", r"policy.rules\[0\].steps: .*exactly one of"),
    ("policy: {rules: [{method: fp16, kinds: [audio]}]}", r"policy.rules\[0\].kinds\[0\]: Input should be 'self', 'cross', 'image' or 'joint'"),
    ("heigth: 480", r"bad.yaml: heigth: unknown field \(allowed: .*height"),
    ("steps: zero", r"bad.yaml: steps: Input should be a valid integer"),
    ("- a\n- b", r"expected a mapping"),
    ("model: [unclosed", r"not valid YAML"),
])
def test_bad_yaml_names_file_and_field(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f)


def test_all_errors_are_reported_together(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("steps: -1\nfps: 0\npolicy: {method: nope}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).count("bad.yaml:") == 3


# --- the CLI, in a subprocess ---------------------------------------------------------------------------


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fp4video.cli.main", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)


def test_generate_embedded_default(tmp_path):
    """The embedded default: the trained test model under MXAttention's hybrid policy writes a clip
    whose caption's colour, shape and motion the checker finds (the regression test of the shipped
    weights and the default prompt), and the sidecar records every call and the check."""
    from fp4video.integration.config import DEFAULT_CONFIG, TEST_MODEL_SIZES
    from fp4video.testmodel import check_clip, parse_caption

    out = tmp_path / "video.mp4"
    proc = _cli("generate", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import imageio.v3 as iio

    frames = iio.imread(out)
    assert frames.shape == (TEST_MODEL_SIZES["frames"], TEST_MODEL_SIZES["height"], TEST_MODEL_SIZES["width"], 3)
    side = json.loads(out.with_suffix(".json").read_text())
    calls = side["attention_calls"]
    from fp4video.testmodel import WEIGHTS

    blocks = json.loads((WEIGHTS / "transformer" / "config.json").read_text())["num_layers"]
    assert len(calls) == TEST_MODEL_SIZES["steps"] * 2 * blocks * 2  # steps × guidance branches × blocks × kinds
    assert {c["method"] for c in calls} == {"fp16", "mxattn"}
    assert {c["block"] for c in calls if c["method"] == "mxattn"} == set(range(1, blocks))  # block 0 in FP16
    assert side["config"]["policy"]["method"] == "mxattn" and side["generation_seconds"] > 0
    assert side["video_seconds"] == round(side["frames"] / side["fps"], 3)
    check = side["motion_check"]
    assert check["checked"] and check["passed"], check
    # the mp4 itself (8-bit, compressed) passes the checker too, not only the frames the run checked
    assert check_clip(frames / 255.0, parse_caption(DEFAULT_CONFIG.prompts[0])).passed
    assert "motion check of the caption: passed" in proc.stderr and "wrote" in proc.stderr


def test_generate_says_when_a_prompt_is_not_a_test_model_caption(tmp_path):
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--prompt", "a cat walks on the grass", "--steps", "1", "--frames", "5", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is not a caption of the test model's scenes" in proc.stderr
    assert json.loads(out.with_suffix(".json").read_text())["motion_check"]["checked"] is False


def test_generate_a_clip_too_short_to_check_is_written_and_said_unchecked(tmp_path):
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--frames", "1", "--steps", "1", "--output", str(out))
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    check = json.loads(out.with_suffix(".json").read_text())["motion_check"]
    assert check["checked"] is False and "3 frames" in check["reason"], check


def test_the_test_models_sizes_apply_to_it_alone():
    """The default config's model is the test model, at its own sizes; naming another model gives
    that model the run config's own sizes (a real model's), not the test model's."""
    import argparse

    from fp4video.cli.generate import resolve_config
    from fp4video.integration.config import TEST_MODEL_SIZES, RunConfig

    def args(**kw):
        return argparse.Namespace(**{**dict(config=None, model=None, prompt=None, method=None, steps=None, seed=None,
                                            height=None, width=None, frames=None, ring_degree=None,
                                            ulysses_degree=None), **kw})

    default = resolve_config(args())
    assert default.model == "test" and {k: getattr(default, k) for k in TEST_MODEL_SIZES} == TEST_MODEL_SIZES
    real = resolve_config(args(model="/models/Wan2.2-T2V-A14B-Diffusers"))
    assert {k: getattr(real, k) for k in TEST_MODEL_SIZES} == {k: getattr(RunConfig(), k) for k in TEST_MODEL_SIZES}
    tiny = resolve_config(args(model="tiny"))
    assert {k: getattr(tiny, k) for k in ("height", "width", "frames", "steps")} == {
        k: TINY_SIZES[k] for k in ("height", "width", "frames", "steps")}


def test_generate_tiny_model_still_runs_at_its_own_sizes(tmp_path):
    out = tmp_path / "video.mp4"
    proc = _cli("generate", "--model", "tiny", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import imageio.v3 as iio

    assert iio.imread(out).shape == (TINY_SIZES["frames"], TINY_SIZES["height"], TINY_SIZES["width"], 3)
    side = json.loads(out.with_suffix(".json").read_text())
    assert len(side["attention_calls"]) == TINY_SIZES["steps"] * 2 * 2 * 2 and side["motion_check"] is None


def test_generate_frames_script_saves_the_decoded_frames(tmp_path):
    """scripts/generate_frames.py (the CLI, frames saved as .npy: the 2xH200 video comparison in
    BENCHMARKS.md) and scripts/compare_frames.py."""
    import numpy as np

    root = Path(__file__).resolve().parents[1] / "scripts"
    out = tmp_path / "f.mp4"
    proc = subprocess.run([sys.executable, str(root / "generate_frames.py"), "generate", "--model", "tiny", "--steps", "2",
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = np.load(f"{out}.npy")
    assert frames.shape == (TINY_SIZES["frames"], TINY_SIZES["height"], TINY_SIZES["width"], 3)
    assert frames.dtype == np.float32 and 0 <= frames.min() and frames.max() <= 1 and frames.std() > 0
    assert not out.exists() and out.with_suffix(".json").exists()  # no mp4 encoded; the sidecar as usual
    other = frames.copy()
    other[3, 5, 7, 1] = np.clip(other[3, 5, 7, 1] + 9 / 255, 0, 1) if other[3, 5, 7, 1] < 0.5 else other[3, 5, 7, 1] - 9 / 255
    np.save(tmp_path / "other.npy", other)
    cmp = subprocess.run([sys.executable, str(root / "compare_frames.py"), f"{out}.npy", str(tmp_path / "other.npy")],
                         capture_output=True, text=True, timeout=60)
    assert cmp.returncode == 0 and "max |diff| 9/255" in cmp.stdout, cmp.stdout + cmp.stderr


def test_generate_loads_a_saved_pipeline(tmp_path):
    tiny_wan_pipeline(two_experts=True).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "saved.mp4"
    proc = _cli("generate", "--model", str(tmp_path / "tiny"), "--steps", "3", "--height", "96", "--width", "160",
                "--frames", "9", "--method", "sage3", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert {c["method"] for c in side["attention_calls"]} == {"sage3"} and side["frames"] == 9


def _streams(path: Path) -> str:
    """ffmpeg's description of a media file's streams (its stderr when given no output)."""
    import imageio_ffmpeg

    return subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)], capture_output=True,
                          text=True).stderr


def test_generate_ltx2_writes_the_soundtrack_into_the_mp4(tmp_path):
    """LTX-2 returns a waveform beside the frames: it goes into the mp4 as AAC at the vocoder's rate,
    as long as the video, and the sidecar says so."""
    cfg = tmp_path / "ltx2.yaml"
    cfg.write_text("family: ltx2\nfps: 8\npolicy: {method: mxattn, rules: [{method: fp16, blocks: [0]}]}\n")
    out = tmp_path / "ltx2.mp4"
    proc = _cli("generate", "--config", str(cfg), "--steps", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["audio"]["sample_rate"] == 16000 and side["audio"]["channels"] == 2
    assert abs(side["audio"]["seconds"] - side["frames"] / 8) < 0.1  # 9 frames at 8 fps
    streams = _streams(out)
    assert "Video: h264" in streams and "Audio: aac" in streams and "16000 Hz, stereo" in streams, streams
    assert {c["method"] for c in side["attention_calls"]} == {"fp16", "mxattn", "skipped"}


def test_write_video_without_audio_has_no_audio_stream_and_wav_is_exact(tmp_path):
    import wave

    import numpy as np

    from fp4video.integration.media import write_wav, write_video

    frames = np.random.default_rng(0).random((5, 32, 48, 3), dtype=np.float32)
    write_video(frames, tmp_path / "v.mp4", 8)
    assert "Video: h264" in _streams(tmp_path / "v.mp4") and "Audio:" not in _streams(tmp_path / "v.mp4")
    wave_in = torch.tensor([[0.0, 0.5, -0.5, 1.5], [-1.0, 0.25, 2e-5, -3.0]])  # beyond ±1 clipped
    write_wav(wave_in, 16000, tmp_path / "a.wav")
    with wave.open(str(tmp_path / "a.wav")) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, 16000, 4)
        pcm = np.frombuffer(w.readframes(4), "<i2").reshape(4, 2).T
    assert pcm.tolist() == [[0, 16384, -16384, 32767], [-32767, 8192, 1, -32767]]


def test_generate_wan_animate_from_a_saved_pipeline_and_video_files(tmp_path):
    """The real-model path of Wan Animate: the pipeline from a local folder, the character image and
    the pose and face videos read from files named in the config."""
    from diffusers.utils import export_to_video

    from fp4video.integration.tiny import tiny_animate_pipeline, tiny_animate_videos

    tiny_animate_pipeline().save_pretrained(tmp_path / "animate")
    inputs = tiny_animate_videos(96, 160, 9)
    inputs["image"].save(tmp_path / "character.png")
    for name in ("pose_video", "face_video"):
        export_to_video(inputs[name], str(tmp_path / f"{name}.mp4"), fps=8)
    cfg = tmp_path / "animate.yaml"
    cfg.write_text(f"family: animate\nmodel: {tmp_path / 'animate'}\nheight: 96\nwidth: 160\nframes: 9\nsteps: 2\n"
                   f"image: {tmp_path / 'character.png'}\npose_video: {tmp_path / 'pose_video.mp4'}\n"
                   f"face_video: {tmp_path / 'face_video.mp4'}\npolicy: {{method: mxattn, rules: [{{method: fp16, kinds: [image]}}]}}\n")
    out = tmp_path / "animate.mp4"
    proc = _cli("generate", "--config", str(cfg), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["frames"] == 9 and side["audio"] is None
    assert Counter((c["kind"], c["method"]) for c in side["attention_calls"]).keys() == {
        ("self", "mxattn"), ("cross", "mxattn"), ("image", "fp16")}
    # the same config without its face video, and with a face video of another length
    cfg.write_text(cfg.read_text().replace(f"face_video: {tmp_path / 'face_video.mp4'}\n", ""))
    proc = _cli("generate", "--config", str(cfg), "--output", str(out))
    assert proc.returncode == 2 and "family animate (animate mode) needs `face_video:`" in proc.stderr, proc.stderr[-2000:]
    export_to_video(inputs["face_video"][:5], str(tmp_path / "short.mp4"), fps=8)
    cfg.write_text(cfg.read_text() + f"face_video: {tmp_path / 'short.mp4'}\n")
    proc = _cli("generate", "--config", str(cfg), "--output", str(out))
    assert proc.returncode == 2 and "pose_video 9, face_video 5" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args, match", [
    (["--model", "/no/such/folder"], "no such pipeline folder"),
    (["--config", "missing.yaml"], "no such config file"),
    (["--height", "100"], "height: Input should be a multiple of 16"),
    (["--method", "fp5"], "unknown method 'fp5'"),
])
def test_generate_errors_are_clear(tmp_path, args, match):
    proc = _cli("generate", "--output", str(tmp_path / "x.mp4"), *args)
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr[-2000:]


def test_generate_without_weights_offline_says_how_to_get_them(tmp_path):
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--model", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                           "--output", str(tmp_path / "x.mp4")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2
    assert "hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers --local-dir" in proc.stderr and "huggingface-cli" not in proc.stderr


# --- HunyuanVideo and Wan image-to-video ---------------------------------------------------------


def _hunyuan_run(pipe, steps=2):
    from fp4video.integration.tiny import TINY_HUNYUAN_CALL

    return pipe(prompt="a cat", height=TINY_SIZES["height"], width=TINY_SIZES["width"], num_frames=9,
                num_inference_steps=steps, output_type="np", generator=torch.Generator().manual_seed(0),
                **TINY_HUNYUAN_CALL).frames[0]


def test_hunyuan_fp16_equals_stock_and_refiner_is_kept():
    from fp4video.integration.tiny import tiny_hunyuan_pipeline

    pipe = tiny_hunyuan_pipeline()
    refiner = "context_embedder.token_refiner.refiner_blocks.0.attn.processor"
    stock_refiner = pipe.transformer.attn_processors[refiner]
    stock = _hunyuan_run(pipe)
    ctx = install(pipe, "fp16")
    assert pipe.transformer.attn_processors[refiner] is stock_refiner  # full precision, stock processor
    assert abs(_hunyuan_run(pipe) - stock).max() <= 1e-5
    assert sorted({c["block"] for c in ctx.calls}) == [0, 1]  # the dual block, then the single block
    assert sorted({c["step"] for c in ctx.calls}) == [0, 1]  # step tracking works on this pipeline too
    uninstall(pipe)
    install(pipe, "mxattn")
    try:
        out = _hunyuan_run(pipe)
    finally:
        uninstall(pipe)
    assert out.shape == stock.shape and abs(out - stock).max() > 0


def test_hunyuan_text_mask_reaches_the_fp4_path():
    """Padded text tokens are masked: changing them changes no video-token output of the FP4 path."""
    from fp4video.integration.tiny import tiny_hunyuan_transformer

    model = tiny_hunyuan_transformer(seed=5)
    attn = model.transformer_blocks[0].attn
    x, text = torch.randn(1, 64, 128), torch.randn(1, 16, 128)
    mask = torch.ones(1, 1, 1, 80, dtype=torch.bool)
    mask[..., 70:] = False  # the last 10 text tokens are padding
    text2 = text.clone()
    text2[:, 6:] = 100.0
    proc = FP4Processor(method="mxattn")
    with torch.no_grad():
        a, _ = proc(attn, x, text, attention_mask=mask)
        b, _ = proc(attn, x, text2, attention_mask=mask)
    assert torch.equal(a, b)


def test_wan_i2v_image_attention_is_routed():
    from fp4video.integration.tiny import tiny_image, tiny_wan_i2v_pipeline

    pipe = tiny_wan_i2v_pipeline()
    kw = dict(image=tiny_image(96, 160), prompt="a cat", negative_prompt="", height=96, width=160, num_frames=9,
              num_inference_steps=2, output_type="np")
    stock = pipe(generator=torch.Generator().manual_seed(0), **kw).frames[0]
    ctx = install(pipe, Policy.model_validate({"method": "fp16", "rules": [{"method": "mxattn", "kinds": ["image"]}]}))
    try:
        out = pipe(generator=torch.Generator().manual_seed(0), **kw).frames[0]
    finally:
        uninstall(pipe)
    kinds = Counter((c["kind"], c["method"]) for c in ctx.calls)
    assert kinds == {("self", "fp16"): 8, ("cross", "fp16"): 8, ("image", "mxattn"): 8}
    assert sorted({c["step"] for c in ctx.calls}) == [0, 1]
    assert abs(out - stock).max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_generate_every_shipped_config_on_the_tiny_model(tmp_path, config):
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--config", str(ROOT / "configs" / config), "--model", "tiny", "--steps", "2",
                "--frames", "9", "--output", str(out))
    from fp4video.integration.linear import LinearUnsupported, check_linear_support

    def runs_here(method):  # generate's device for the tiny model: the GPU where there is one
        try:
            check_linear_support(method, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        except LinearUnsupported:
            return False
        return True

    linear = load_config(ROOT / "configs" / config).linear
    if not all(runs_here(m) for m in linear.methods() if m != "bf16"):
        # fp8 linear layers are a GPU's: refused in one line before anything loads, no video
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and "needs an NVIDIA GPU" in errors[0], proc.stderr[-3000:]
        assert not out.exists()
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    side = json.loads(out.with_suffix(".json").read_text())
    policy = load_config(ROOT / "configs" / config).policy
    assert side["frames"] == 9 and side["attention_calls"]
    for c in side["attention_calls"]:
        if c["method"] != "skipped":
            assert c["method"] == policy.method_for(block=c["block"], step=c["step"], num_steps=2, kind=c["kind"],
                                                    expert=c["expert"])


def test_vae_tiling_keeps_fp16_equal_to_stock():
    pipe = tiny_wan_pipeline(two_experts=True, seed=11)
    pipe.vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                           tile_sample_stride_height=48, tile_sample_stride_width=48)
    stock = run(pipe, steps=2)
    install(pipe, "fp16")
    try:
        assert abs(run(pipe, steps=2) - stock).max() <= 1e-5
    finally:
        uninstall(pipe)


@pytest.mark.gpu
def test_model_cpu_offload_with_fp4_on_gpu():
    """enable_model_cpu_offload() moves each model to the GPU only while it runs; the FP4 path
    (Triton kernels under backend="auto") works inside it and both experts are routed."""
    pipe = tiny_wan_pipeline(two_experts=True)
    pipe.enable_model_cpu_offload()
    ctx = install(pipe, "mxattn")
    try:
        frames = run(pipe, steps=4)
    finally:
        uninstall(pipe)
    assert frames.shape[0] == TINY_SIZES["frames"]
    assert {c["expert"] for c in ctx.calls} == {"high_noise", "low_noise"}
    assert {c["method"] for c in ctx.calls} == {"mxattn"}


def test_bench_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = _cli("bench", "pipeline")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert _cli("bench", "kernel", "--help").returncode == 0


def test_set_attn_processor_with_one_instance_works_on_both_families():
    """The design card's one-liner: transformer.set_attn_processor(FP4Processor(method="mxattn"))."""
    from fp4video.integration.tiny import tiny_hunyuan_pipeline

    hy = tiny_hunyuan_pipeline()
    stock = _hunyuan_run(hy, steps=1)
    proc = FP4Processor(method="mxattn")
    hy.transformer.set_attn_processor(proc)  # the token refiner too: it stays full precision
    out = _hunyuan_run(hy, steps=1)
    assert out.shape == stock.shape and abs(out - stock).max() > 0
    kinds = Counter((c["kind"], c["method"]) for c in proc.context.calls)
    assert kinds[("refiner", "fp16")] > 0 and kinds[("self", "mxattn")] == 2
    wan = tiny_wan_pipeline(two_experts=False, seed=7)
    wan.transformer.set_attn_processor(FP4Processor(method="mxattn"))
    assert run(wan, steps=1).shape[0] == TINY_SIZES["frames"]


def test_unsupported_input_falls_back_only_when_allowed():
    """A float (additive) mask is refused by the FP4 path: an error by default, a counted stock
    fallback with `fallback: stock`."""
    from fp4video.integration.tiny import tiny_hunyuan_transformer

    attn = tiny_hunyuan_transformer(seed=5).transformer_blocks[0].attn
    x, text = torch.randn(1, 64, 128), torch.randn(1, 16, 128)
    float_mask = torch.zeros(1, 1, 1, 80)
    with torch.no_grad():
        with pytest.raises(TypeError, match="boolean"):
            FP4Processor(method="mxattn")(attn, x, text, attention_mask=float_mask)
        proc = FP4Processor(policy=Policy(method="mxattn", fallback="stock"))
        proc(attn, x, text, attention_mask=float_mask)
    assert sum(proc.context.fallbacks.values()) == 1 and "boolean" in next(iter(proc.context.fallbacks))
    assert proc.context.calls[-1]["method"] == "stock-fallback"


def test_attention_backends_through_diffusers_dispatcher():
    """set_attention_backend("fp4video_mxattn") runs the same FP4 attention as fp4video.install
    (bit for bit on a tiny Wan transformer); reset brings stock attention back; unknown methods
    and the fp16 backend behave."""
    from fp4video.integration import install, uninstall
    from fp4video.integration.dispatcher import register_attention_backends, reset_attention_backend
    from fp4video.integration.tiny import tiny_wan_transformer

    names = register_attention_backends()
    assert "fp4video_mxattn" in names and "fp4video_mxattn_sk" in names
    assert register_attention_backends(["mxattn"]) == ["fp4video_mxattn"]  # idempotent
    with pytest.raises(ValueError, match="unknown method"):
        register_attention_backends(["mxfp8"])
    model = tiny_wan_transformer(0, 32)
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g), timestep=torch.tensor([500.0]),
              encoder_hidden_states=torch.randn(1, 12, 32, generator=g), return_dict=False)
    with torch.no_grad():
        stock = model(**kw)[0]
        install(model, "mxattn")
        installed = model(**kw)[0]
        uninstall(model)
        try:
            model.set_attention_backend("fp4video_mxattn")
            via_backend = model(**kw)[0]
            model.set_attention_backend("fp4video_fp16")
            fp16 = model(**kw)[0]
        finally:
            reset_attention_backend(model)
        again = model(**kw)[0]
    assert torch.equal(via_backend, installed) and not torch.equal(via_backend, stock)
    assert torch.equal(again, stock)
    assert (fp16 - stock).abs().max() < 1e-5


def test_set_attn_processor_with_block_or_step_rules_refuses_instead_of_ignoring_them():
    """The design card's one-liner with a policy that needs install(): an error that says what to
    call, at the first attention call, instead of the default method everywhere."""
    pipe = tiny_wan_pipeline(two_experts=False, seed=5)
    for rule in ({"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 1}},
                 {"method": "fp16", "experts": ["low_noise"]}):
        pipe.transformer.set_attn_processor(FP4Processor(policy=Policy(method="mxattn", rules=[rule])))
        with pytest.raises(RuntimeError, match=r"fp4video\.install\(pipe, policy\)"):
            run(pipe, steps=1)
    # kind rules need nothing install() provides: they route from the module itself
    pipe.transformer.set_attn_processor(FP4Processor(policy=Policy(
        method="mxattn", rules=[{"method": "sage3", "kinds": ["cross"]}])))
    run(pipe, steps=1)
    proc = pipe.transformer.blocks[0].attn1.processor
    assert {(c["kind"], c["method"]) for c in proc.context.calls} == {("self", "mxattn"), ("cross", "sage3")}


def test_policy_that_does_not_fit_the_model_is_refused_or_warned(pipe):
    with pytest.raises(ValueError, match="negative"):
        Policy.model_validate({"method": "mxattn", "rules": [{"method": "fp16", "blocks": [-1]}]})
    n_blocks = len(pipe.transformer.blocks)
    bad = Policy.model_validate({"method": "mxattn", "rules": [{"method": "fp16", "blocks": [0, n_blocks]}]})
    with pytest.raises(ValueError, match=rf"rules\[0\].*block\(s\) \[{n_blocks}\]"):
        install(pipe, bad)
    for model in (pipe.transformer, pipe.transformer_2):  # both experts left as they were
        assert not any(hasattr(m, "_fp4video_block") for m in model.modules())
        assert not any(isinstance(p, FP4Processor) for p in model.attn_processors.values())
        assert not any(getattr(p, "_attention_backend", None) is not None for p in model.attn_processors.values())
    assert all(installed_context(m) is None for m in (pipe.transformer, pipe.transformer_2))
    every = Policy.model_validate({"method": "mxattn", "rules": [{"method": "fp16", "steps": {"last": 50}}]})
    install(pipe, every)
    try:
        with pytest.warns(UserWarning, match=r"rules\[0\].*covers every one of the 2 denoising steps") as caught:
            run(pipe, steps=2)
        # the warning names the user's line (run() here), not torch's module.py that calls the hook
        assert {Path(w.filename).name for w in caught if "denoising steps" in str(w.message)} == {Path(__file__).name}
    finally:
        uninstall(pipe)
    assert Policy.model_validate({"rules": [{"method": "fp16", "steps": {"range": [50, 60]}}]}).step_warnings(40) \
        == ["rules[0] {method: fp16, steps: {'range': (50, 60)}} covers none of the 40 denoising steps"]


def test_device_and_backend_problems_are_one_line_errors():
    """`--device cuda` on a CPU-only torch and `--backend triton` without a GPU (or without Triton)
    end with one line saying what to do, not a traceback."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU machine's messages")
    proc = _cli("generate", "--device", "cuda")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "--device cuda: this machine has" in proc.stderr
    proc = _cli("generate", "--backend", "triton")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--backend reference" in proc.stderr
    from fp4video.cli.generate import device_problem

    assert device_problem(None, "auto") is None and device_problem("cpu", "reference") is None


def test_generate_help_keeps_the_torchrun_example_on_two_lines():
    out = _cli("generate", "--help").stdout
    line = next(x for x in out.splitlines() if x.lstrip().startswith("torchrun"))
    assert line.rstrip().endswith("\\")


def test_generate_refuses_frames_the_pipelines_vae_cannot_take(tmp_path):
    """Wan's pipeline rounds --frames 8 to 9 with only a log line (and HunyuanVideo's, LTX's cut the
    clip short silently): the frame count is checked against the loaded pipeline's VAE time
    compression and refused in one line; a count it takes runs."""
    from fp4video.integration.pipelines import FrameCountError, check_frames, frame_step

    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--model", "tiny", "--frames", "8", "--steps", "1", "--output", str(out))
    assert proc.returncode == 2 and not out.exists() and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("fp4video generate: error: frames 8: this WanPipeline takes "
                                                    "4n + 1 frames (its VAE's 4× in time), e.g. 5 or 9")
    for step, ok, bad in ((4, (1, 5, 81), (2, 8, 80)), (8, (1, 9, 121), (5, 120))):
        for f in ok:
            check_frames(f, step, "it")
        for f in bad:
            with pytest.raises(FrameCountError, match=rf"frames {f}: it takes {step}n \+ 1 frames"):
                check_frames(f, step, "it")
    check_frames(8, None, "a pipeline that keeps no compression")  # nothing to check against
    assert frame_step(type("P", (), {"vae_temporal_compression_ratio": 8})()) == 8
    assert frame_step(object()) is None


def test_generate_says_a_policy_warning_from_within_the_run_in_one_line(tmp_path):
    """A step rule that covers every step of a tiny model's run (hybrid policy, --steps 2) warns from
    within the run; under the CLI no line of the user's called the pipeline, so it is said as the
    CLI's own line rather than pointing at runpy or the console script."""
    out = tmp_path / "v.mp4"
    proc = _cli("generate", "--model", "tiny", "--steps", "2", "--output", str(out))
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    assert "fp4video generate: warning: policy: rules[1] {method: fp16, steps: {'last': 2}} covers every one " \
           "of the 2 denoising steps" in proc.stderr, proc.stderr[-3000:]
    assert "UserWarning" not in proc.stderr and "runpy" not in proc.stderr
