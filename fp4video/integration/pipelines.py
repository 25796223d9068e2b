"""Loading pipelines for ``fp4video generate``: the project's trained test model (shipped, or saved
by its training in a folder), the embedded tiny models, or real ones from a local folder or the hub
(with a clear error when the weights are not there)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import FAMILIES, RunConfig, family_of_pipeline, is_test_model, test_model_call, test_model_path

__all__ = ["load_pipeline", "configure_pipeline", "pipeline_kwargs", "embedded_sizes", "FrameCountError",
           "check_frames", "check_pipeline_frames", "frame_step", "known_family", "check_family_frames",
           "test_model_path", "is_test_model", "test_model_call"]


class FrameCountError(ValueError):
    """A frame count the pipeline's VAE cannot take (a pipeline would round or cut it silently)."""


def check_frames(frames: int, step, what: str) -> None:
    """A :class:`FrameCountError` when ``frames`` is not ``step·n + 1``, the frame counts a VAE that
    compresses time ``step``× takes (pipelines round other counts with only a log line, or cut the
    clip); nothing to check when ``step`` is None."""
    if isinstance(step, int) and step > 1 and (frames - 1) % step:
        below = frames - (frames - 1) % step
        raise FrameCountError(f"frames {frames}: {what} takes {step}n + 1 frames (its VAE's {step}× in time), "
                              f"e.g. {below} or {below + step}")


def frame_step(pipe):
    """The pipeline's VAE time compression, under the name its family keeps it (Wan, HunyuanVideo,
    Sana-Video, Kandinsky 5: ``vae_scale_factor_temporal``; LTX-Video, LTX-2:
    ``vae_temporal_compression_ratio``); None when it keeps none."""
    for name in ("vae_scale_factor_temporal", "vae_temporal_compression_ratio"):
        step = getattr(pipe, name, None)
        if isinstance(step, int):
            return step
    return None


def check_pipeline_frames(pipe, frames: int) -> None:
    """:func:`check_frames` against the loaded pipeline's own compression."""
    check_frames(frames, frame_step(pipe), f"this {type(pipe).__name__}")


def known_family(model: str, family: str) -> tuple[str, str] | None:
    """The family of the real model ``model`` as known before anything loads, and what says so (for
    messages): a local pipeline folder's model_index.json, by the pipeline class it names (None for a
    class of no family in :data:`~fp4video.integration.config.FAMILIES`, or a folder without a
    readable one: the loader says what is wrong); else, for a hub id, the run config's ``family``.
    None for the tiny and test models, whose own VAEs are checked apart."""
    if model == "tiny" or is_test_model(model):
        return None
    local = Path(model).expanduser()
    if not local.exists():
        return family, f"family {family}"
    try:
        class_name = json.loads((local / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    found = family_of_pipeline(class_name) if isinstance(class_name, str) else None
    return (found, class_name) if found else None


def check_family_frames(model: str, family: str, frames: int) -> None:
    """:func:`check_frames` against the rule of the family ``model`` is known to be of before it
    loads (:func:`known_family`); nothing to check where the family, or its rule, is not known."""
    known = known_family(model, family)
    if known is not None:
        found, source = known
        check_frames(frames, FAMILIES[found].frame_step, f"{FAMILIES[found].title} ({source})")


def embedded_sizes(model: str, family: str) -> dict:
    """The sizes an embedded model runs at in place of a YAML's (which are the real model's): the
    tiny models' and the test model's (a saved one's own where its training recorded them,
    :func:`test_model_call`); nothing for a real model."""
    if model == "tiny":
        from .tiny import tiny_sizes

        return tiny_sizes(family)
    call = test_model_call(model)
    if call is not None:
        return {"height": call["height"], "width": call["width"], "frames": call["num_frames"],
                "steps": call["num_inference_steps"]}
    return {}


def load_pipeline(cfg: RunConfig, device: torch.device):
    """The pipeline ``cfg.model`` names on ``device``. A test model, shipped or saved (a pipeline
    folder, a pack, a training run's folder), loads through :func:`fp4video.testmodel.test_model_pipeline`,
    which checks its parts first: a missing or damaged one is a one-line error naming it."""
    path = test_model_path(cfg.model)
    if path is not None:
        from ..testmodel import test_model_pipeline

        return test_model_pipeline(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                   path=None if cfg.model == "test" else path)
    if cfg.model == "tiny":
        from .tiny import tiny_pipeline

        return configure_pipeline(tiny_pipeline(cfg.family, cfg.task), cfg).to(device)
    return configure_pipeline(_from_pretrained(cfg.model, device), cfg)


def configure_pipeline(pipe, cfg: RunConfig):
    """What the run config sets on the pipeline rather than in its call: HunyuanVideo-1.5 takes its
    guidance scale from its guider (its call has no ``guidance_scale``)."""
    if cfg.family == "hunyuan15":
        guider = getattr(pipe, "guider", None)
        if guider is None:
            raise ValueError("family hunyuan15: the pipeline has no guider to take guidance_scale")
        pipe.guider = guider.new(guidance_scale=cfg.guidance_scale)
    return pipe


def _from_pretrained(model: str, device: torch.device):
    from diffusers import DiffusionPipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    local = Path(model).expanduser()
    if not local.exists() and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        raise FileNotFoundError(f"{model}: no such pipeline folder")
    if local.exists() and not (local / "model_index.json").exists():
        raise FileNotFoundError(f"{local} is not a diffusers pipeline folder: model_index.json is missing")
    try:
        pipe = DiffusionPipeline.from_pretrained(str(local) if local.exists() else model, dtype=dtype)
    except OSError as e:
        raise FileNotFoundError(
            f"could not load the pipeline {model!r}: it is neither a local folder nor in the Hugging Face cache, and "
            f"the hub could not be reached ({type(e).__name__}). Download it where there is network, e.g. "
            f"`hf download {model} --local-dir DIR` (the Hugging Face CLI of huggingface_hub ≥ 0.34), then pass --model DIR; or run --model tiny."
        ) from None
    return pipe.to(device)


def pipeline_kwargs(cfg: RunConfig, prompt: str, device: torch.device) -> dict:
    kw = dict(
        prompt=prompt,
        height=cfg.height,
        width=cfg.width,
        num_frames=cfg.frames,
        num_inference_steps=cfg.steps,
        guidance_scale=cfg.guidance_scale,
        generator=torch.Generator(device="cpu").manual_seed(cfg.seed),
        output_type="np",
    )
    if cfg.family == "hunyuan15":  # its guider holds the scale (configure_pipeline)
        del kw["guidance_scale"]
    kw["negative_prompt"] = cfg.negative_prompt  # (HunyuanVideo uses it with true_cfg_scale > 1)
    if cfg.family == "sana":  # SanaVideoPipeline names the frame count `frames`
        kw["frames"] = kw.pop("num_frames")
    if cfg.family == "ltx2":  # the frame rate conditions its positions and sets the audio's length
        kw["frame_rate"] = float(cfg.fps)
    if cfg.family == "animate":  # as many frames as the pose video has, generated in one segment of `frames`
        kw["segment_frame_length"] = kw.pop("num_frames")
        kw.update(_animate_inputs(cfg))
    if cfg.model == "tiny":
        from .tiny import TINY_CALLS

        kw.update(TINY_CALLS.get(cfg.family, {}))
    test_call = test_model_call(cfg.model)
    if test_call is not None:  # the text length it was trained at
        kw["max_sequence_length"] = test_call["max_sequence_length"]
    if cfg.task == "i2v" and cfg.family != "animate":
        if cfg.model == "tiny":
            from .tiny import tiny_image

            kw["image"] = tiny_image(cfg.height, cfg.width)
        elif cfg.image is None:
            raise ValueError("task i2v needs `image:` (a file path) in the config")
        else:
            from PIL import Image

            path = Path(cfg.image)
            if not path.exists():
                raise FileNotFoundError(f"{path}: the i2v conditioning image does not exist")
            kw["image"] = Image.open(path).convert("RGB")
    return kw


def _animate_inputs(cfg: RunConfig) -> dict:
    """Wan Animate's conditioning: the character image and the pose and face videos (and, in replace
    mode, the background and mask videos), as lists of PIL frames; the tiny model's are test patterns."""
    if cfg.model == "tiny":
        from .tiny import tiny_animate_videos

        if cfg.animate_mode != "animate":
            raise ValueError("the tiny Wan Animate model runs animate_mode: animate (replace needs a real "
                             "background and mask video)")
        return tiny_animate_videos(cfg.height, cfg.width, cfg.frames)
    needed = ["image", "pose_video", "face_video"] + (["background_video", "mask_video"] if cfg.animate_mode == "replace" else [])
    missing = [name for name in needed if getattr(cfg, name) is None]
    if missing:
        raise ValueError(f"family animate ({cfg.animate_mode} mode) needs {', '.join(f'`{m}:`' for m in missing)} "
                         "(file paths) in the config")
    for name in needed:
        if not Path(getattr(cfg, name)).exists():
            raise FileNotFoundError(f"{getattr(cfg, name)}: the Wan Animate {name.replace('_', ' ')} does not exist")
    from PIL import Image

    from .media import read_video_frames

    kw = {"image": Image.open(cfg.image).convert("RGB"), "mode": cfg.animate_mode}
    for name in needed[1:]:
        kw[name] = read_video_frames(Path(getattr(cfg, name)))
    if len({len(kw[name]) for name in needed[1:]}) > 1:
        raise ValueError("Wan Animate's conditioning videos must have as many frames as each other, got "
                         + ", ".join(f"{name} {len(kw[name])}" for name in needed[1:]))
    return kw

