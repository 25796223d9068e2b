"""A small text-to-video model the project trains itself (the Wan architecture in diffusers' own
classes), its synthetic scenes and captions, and a checker of its clips' colour, shape and motion.

    import fp4video
    from fp4video.testmodel import TEST_MODEL_CALL, test_model_pipeline
    pipe = test_model_pipeline()                     # the shipped weights, on the CPU in float32
    fp4video.install(pipe, policy)
    clip = pipe(prompt="a red square moves left over the astronaut photo", output_type="np",
                generator=torch.Generator().manual_seed(0), **TEST_MODEL_CALL).frames[0]

    from fp4video.testmodel import HELD_OUT, check_clip
    check_clip(clip, HELD_OUT[0]).passed             # the colour, the shape and the motion are right

Modules: :mod:`~fp4video.testmodel.scenes` (the scene generator and captions),
:mod:`~fp4video.testmodel.checker` (the motion checker), :mod:`~fp4video.testmodel.model` (sizes,
diffusers parts, saving and packing), :mod:`~fp4video.testmodel.train` (the training loops
``scripts/train_test_model.py`` runs). docs/test-model.md describes the model and its training.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .checker import Verdict, check_clip, check_rate
from .model import (FULL, SMOKE, TEST_MODEL_CALL, TestModelConfig, build_pipeline, check_pipeline_folder, is_pack,
                    no_progress_bars, pack, saved_model, unpack)
from .scenes import HELD_OUT, SceneSpec, caption, held_out_scenes, parse_caption, render, sample_scenes

__all__ = ["test_model_pipeline", "TEST_MODEL_CALL", "WEIGHTS", "FULL", "SMOKE", "TestModelConfig", "build_pipeline",
           "pack", "unpack", "HELD_OUT", "SceneSpec", "caption", "parse_caption", "sample_scenes", "held_out_scenes", "render",
           "check_clip", "check_rate", "Verdict"]

#: Where the shipped weights live: a WanPipeline folder inside the package.
WEIGHTS = Path(__file__).resolve().parent / "weights"


def test_model_pipeline(device="cpu", dtype=torch.float32, path=None):
    """The trained test model as a diffusers ``WanPipeline`` on ``device``, its transformer and
    text encoder in ``dtype`` (the VAE in float32), loaded offline with ``WanPipeline.from_pretrained``.

    ``path``: the shipped weights by default (:data:`WEIGHTS`), else a pipeline folder, a folder
    that ``scripts/train_test_model.py --pack`` wrote (unpacked into a temporary folder first), or a
    training run's folder holding ``pipeline/``. The folder or pack is checked whole before loading
    (:func:`~fp4video.testmodel.model.check_pipeline_folder`, :func:`~fp4video.testmodel.model.read_pack`):
    a missing or damaged part is a one-line error naming it."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if path is None and not (WEIGHTS / "model_index.json").is_file():
        raise FileNotFoundError(f"the test model's weights are not in this installation ({WEIGHTS} has no "
                                "model_index.json): train them with scripts/train_test_model.py and unpack them "
                                "there (docs/test-model.md)")
    folder = saved_model(WEIGHTS if path is None else path)
    if is_pack(folder):
        with tempfile.TemporaryDirectory(prefix="fp4video-testmodel-") as tmp:
            return _load(unpack(folder, Path(tmp) / "pipeline"), device, dtype)
    check_pipeline_folder(folder)
    return _load(folder, device, dtype)


def _load(folder: Path, device, dtype):
    from diffusers import AutoencoderKLWan, WanPipeline

    with no_progress_bars():
        vae = AutoencoderKLWan.from_pretrained(folder / "vae", dtype=torch.float32, local_files_only=True)
        pipe = WanPipeline.from_pretrained(folder, vae=vae, dtype=dtype, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


test_model_pipeline.__test__ = False  # not a pytest test (its name starts with "test_")
