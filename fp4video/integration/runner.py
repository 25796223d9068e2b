"""One video through an installed pipeline, written as mp4 + JSON sidecar: the single code path
behind ``fp4video generate`` and the evaluation sweeps."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from .config import RunConfig, is_test_model
from .processor import AttentionContext, sparse_summary

__all__ = ["generate_video"]


def motion_check(cfg: RunConfig, prompt: str, frames) -> dict | None:
    """The test model's clip (shipped or saved: :func:`~fp4video.integration.config.is_test_model`)
    checked against its caption (:func:`fp4video.testmodel.check_clip`: the named colour's region,
    its shape and its motion, from the frames alone); None for other models. A prompt that is not a
    caption of the test model's scenes is said so, unchecked."""
    if not is_test_model(cfg.model):
        return None
    from ..testmodel import check_clip, parse_caption

    spec = parse_caption(prompt)
    if spec is None:
        return {"checked": False, "reason": "not a caption of the test model's scenes (docs/test-model.md)"}
    try:
        v = check_clip(frames, spec)
    except ValueError as e:  # a clip the checker cannot read (fewer than 3 frames): said, never fatal
        return {"checked": False, "reason": str(e)}
    return {"checked": True, "passed": v.passed, "colour": v.colour, "shape": v.shape, "motion": v.motion,
            "reason": v.reason, "details": v.details}


def generate_video(pipe, ctx: AttentionContext, cfg: RunConfig, prompt: str, call: dict, out: Path, *,
                   device, backend: str, load_seconds: float = 0.0, write: bool = True, world_size: int = 1,
                   linear=None, typed_prompt: str | None = None) -> dict:
    """Run the pipeline once with ``call`` (from :func:`pipelines.pipeline_kwargs`), write ``out``
    (mp4) and ``out.json`` (the sidecar, also returned; ``linear``: the linear-layer installation's
    :class:`~fp4video.integration.linear.LinearInstall`, or None; ``typed_prompt``: the words the
    user gave, recorded beside ``prompt`` when the run changed them). Under torchrun every rank runs the
    pipeline and only the one with ``write`` writes. The pair is written through temporary names
    and renamed into place (:func:`media.write_video_and_sidecar`): an interrupted run leaves the
    previous pair, or a video without a sidecar, never a short video or a mismatched sidecar."""
    from .media import audio_sample_rate, write_video_and_sidecar

    if write:
        out.parent.mkdir(parents=True, exist_ok=True)
    ctx.calls.clear()
    ctx.fallbacks.clear()
    t0 = time.perf_counter()
    result = pipe(**call)
    seconds = time.perf_counter() - t0
    frames = result.frames[0]
    audio = getattr(result, "audio", None)  # LTX-2's soundtrack: (batch, channels, samples)
    sound = None
    if audio is not None:
        audio, rate = audio[0], audio_sample_rate(pipe)
        sound = {"sample_rate": rate, "channels": int(audio.shape[0]), "seconds": round(audio.shape[-1] / rate, 3)}
    calls = ctx.recorded_calls()
    sidecar = {
        "output": str(out),
        "prompt": prompt,
        **({"typed_prompt": typed_prompt} if typed_prompt is not None and typed_prompt != prompt else {}),
        "config": cfg.model_dump(mode="json"),
        "device": str(device),
        "processes": world_size,
        "backend": backend,
        "load_seconds": round(load_seconds, 3),
        "generation_seconds": round(seconds, 3),
        "frames": int(len(frames)),
        "fps": cfg.fps,
        "video_seconds": round(len(frames) / cfg.fps, 3),
        "audio": sound,
        "methods_used": dict(Counter(c["method"] for c in calls)),
        "fallbacks": dict(ctx.fallbacks),
        "block_sparse": sparse_summary(calls),
        "linear_layers": None if linear is None else {
            "summary": linear.summary(), "runs": linear.runs,
            # {layer: {token count: calls}} run weight-only where cuBLASLt refused the GEMM, since install
            "refused_since_install": {n: {str(m): c for m, c in r.items()} for n, r in linear.refused().items()}},
        "motion_check": motion_check(cfg, prompt, frames),
        "attention_calls": calls,
    }
    if write:
        write_video_and_sidecar(frames, out, json.dumps(sidecar, indent=1), cfg.fps, audio,
                                sound and sound["sample_rate"])
    return sidecar
