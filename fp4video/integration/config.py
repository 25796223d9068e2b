"""Run configs for ``fp4video generate``: model, sizes, sampling, prompts and the precision policy,
from YAML, validated (every error names the file, the field and what is allowed)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .policy import Policy, format_validation_error

__all__ = ["RunConfig", "ParallelSettings", "load_config", "ConfigError", "DEFAULT_CONFIG"]


class ConfigError(ValueError):
    """A config file that does not validate; the message lists every problem."""


class ParallelSettings(BaseModel):
    """Context parallelism over the processes of a ``torchrun`` launch (ring × ulysses = processes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ring_degree: int = Field(1, ge=1, description="ring attention over K/V shards, merged with the LSE")
    ulysses_degree: int = Field(1, ge=1, description="all-to-all over heads (heads must divide)")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field("tiny", description='"tiny" (embedded random model), a local folder or a hub id')
    family: Literal["wan", "hunyuan", "hunyuan15", "ltx", "ltx2", "skyreels", "vace", "animate", "sana", "kandinsky5"] = Field(
        "wan", description="the pipeline's family: the tiny model `--model tiny` embeds, and the call's arguments")
    task: Literal["t2v", "i2v"] = "t2v"
    height: int = Field(480, gt=0, multiple_of=16)
    width: int = Field(832, gt=0, multiple_of=16)
    frames: int = Field(81, gt=0)
    steps: int = Field(40, gt=0)
    guidance_scale: float = Field(4.0, ge=0)
    seed: int = 0
    fps: int = Field(16, gt=0)
    prompts: list[str] = Field(default_factory=lambda: ["A cat walks on the grass, realistic style."], min_length=1)
    negative_prompt: str = ""
    image: str | None = Field(None, description="conditioning image for i2v, the character image of Wan Animate (a file path)")
    pose_video: str | None = Field(None, description="Wan Animate: the pose video to follow (a file path)")
    face_video: str | None = Field(None, description="Wan Animate: the face video, cropped to the face (a file path)")
    animate_mode: Literal["animate", "replace"] = Field(
        "animate", description="Wan Animate: animate the character image, or replace the person in background_video")
    background_video: str | None = Field(None, description="Wan Animate, replace mode: the video whose person is replaced")
    mask_video: str | None = Field(None, description="Wan Animate, replace mode: the mask of that person (a file path)")
    policy: Policy = Policy()
    parallel: ParallelSettings | None = Field(None, description="context parallelism under torchrun")

    @model_validator(mode="after")
    def _animate_fields_need_animate(self):
        """Wan Animate's inputs on another family would be silently unused: refused."""
        set_ = [n for n in ("pose_video", "face_video", "background_video", "mask_video") if getattr(self, n) is not None]
        if self.animate_mode != "animate":
            set_.append("animate_mode")
        if set_ and self.family != "animate":
            raise ValueError(f"{', '.join(set_)}: Wan Animate's inputs, but family is {self.family!r} (family: animate)")
        if self.family == "animate" and self.task == "i2v":
            raise ValueError("task: i2v does not apply to family animate (its character image is `image:`; leave task "
                             "out)")
        return self


CONFIG_MODELS = (RunConfig, ParallelSettings)

#: The embedded default: MXAttention's Wan2.2 main-table policy on the tiny two-expert model.
DEFAULT_CONFIG = RunConfig(
    model="tiny",
    family="wan",
    prompts=["A red panda climbs a snowy tree, cinematic."],
    policy=Policy(method="mxattn", rules=[{"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 2}}]),
)


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
