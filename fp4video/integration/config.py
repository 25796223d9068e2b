"""Run configs for ``fp4video generate``: model, sizes, sampling, prompts and the precision policy,
from YAML, validated (every error names the file, the field and what is allowed).

Values are taken as they are typed, as the Python API takes them: an integer field takes an int
(not ``true``, ``4.0`` or ``'4'``), a number field an int or a finite float (not ``.inf``, ``.nan``,
``true`` or ``'0.5'``), a text field a string, a flag ``true`` or ``false``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from .linear import LinearPolicy
from .policy import Number, Policy, format_validation_error
from ..testmodel import WEIGHTS
from ..testmodel.model import TEST_MODEL_CALL, recorded_config, test_model_folder

__all__ = ["RunConfig", "ParallelSettings", "load_config", "read_yaml_mapping", "ConfigError", "DEFAULT_CONFIG",
           "TEST_MODEL_SIZES", "test_model_path", "is_test_model", "test_model_call", "Family", "FAMILIES",
           "family_of_pipeline"]


class ConfigError(ValueError):
    """A config file that does not validate; the message lists every problem."""


class Family(NamedTuple):
    """A pipeline family a run config names (``family:``)."""

    #: Its name in messages
    title: str
    #: The frame counts its VAE takes: ``frame_step``·n + 1 (the VAE's time compression); None where
    #: the family's VAEs differ in it, so that only the loaded pipeline says
    frame_step: int | None
    #: Its diffusers pipeline classes, as a folder's model_index.json names them (``_class_name``)
    pipelines: tuple[str, ...]


#: Every family ``RunConfig.family`` takes. The frame steps are those of diffusers' pipelines
#: (``vae_scale_factor_temporal`` / ``vae_temporal_compression_ratio``, read from the VAE's config):
#: the Wan VAE's ``scale_factor_temporal`` 4 (Wan, SkyReels-V2, VACE, Animate), HunyuanVideo's and
#: HunyuanVideo-1.5's ``temporal_compression_ratio`` 4 (Kandinsky 5 uses HunyuanVideo's VAE),
#: LTX-Video's and LTX-2's 8. Sana-Video runs with Wan's VAE (4×) or LTX-2's (8×): known only
#: once loaded. A count off the rule is rounded by the pipeline with only a log line, or cut.
FAMILIES: dict[str, Family] = {
    "wan": Family("Wan", 4, ("WanPipeline", "WanImageToVideoPipeline")),
    "hunyuan": Family("HunyuanVideo", 4, ("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline",
                                          "HunyuanSkyreelsImageToVideoPipeline")),
    "hunyuan15": Family("HunyuanVideo-1.5", 4, ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")),
    "ltx": Family("LTX-Video", 8, ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline")),
    "ltx2": Family("LTX-2", 8, ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")),
    "skyreels": Family("SkyReels-V2", 4, ("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline",
                                          "SkyReelsV2DiffusionForcingPipeline",
                                          "SkyReelsV2DiffusionForcingImageToVideoPipeline")),
    "vace": Family("Wan VACE", 4, ("WanVACEPipeline",)),
    "animate": Family("Wan Animate", 4, ("WanAnimatePipeline",)),
    "sana": Family("Sana-Video", None, ("SanaVideoPipeline", "SanaImageToVideoPipeline")),
    "kandinsky5": Family("Kandinsky 5", 4, ("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline")),
}


def family_of_pipeline(class_name: str) -> str | None:
    """The family whose pipelines include ``class_name`` (a diffusers pipeline class), or None."""
    return next((name for name, fam in FAMILIES.items() if class_name in fam.pipelines), None)


class ParallelSettings(BaseModel):
    """Context parallelism over the processes of a ``torchrun`` launch (ring × ulysses = processes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ring_degree: StrictInt = Field(1, ge=1, description="ring attention over K/V shards, merged with the LSE")
    ulysses_degree: StrictInt = Field(1, ge=1, description="all-to-all over heads (heads must divide)")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: StrictStr = Field("tiny", description='"test" (the project\'s trained test model), "tiny" (an embedded '
                             'random model), a local folder (a saved test model runs as "test" does) or a hub id')
    family: Literal[tuple(FAMILIES)] = Field(
        "wan", description="the pipeline's family: the tiny model `--model tiny` embeds, and the call's arguments")
    task: Literal["t2v", "i2v"] = "t2v"
    height: StrictInt = Field(480, gt=0, multiple_of=16)
    width: StrictInt = Field(832, gt=0, multiple_of=16)
    frames: StrictInt = Field(81, gt=0)
    steps: StrictInt = Field(40, gt=0)
    guidance_scale: Number = Field(4.0, ge=0)
    seed: StrictInt = 0
    fps: StrictInt = Field(16, gt=0)
    prompts: list[StrictStr] = Field(default_factory=lambda: ["A cat walks on the grass, realistic style."],
                                     min_length=1)
    negative_prompt: StrictStr = ""
    image: StrictStr | None = Field(
        None, description="conditioning image for i2v, the character image of Wan Animate (a file path)")
    pose_video: StrictStr | None = Field(None, description="Wan Animate: the pose video to follow (a file path)")
    face_video: StrictStr | None = Field(
        None, description="Wan Animate: the face video, cropped to the face (a file path)")
    animate_mode: Literal["animate", "replace"] = Field(
        "animate", description="Wan Animate: animate the character image, or replace the person in background_video")
    background_video: StrictStr | None = Field(
        None, description="Wan Animate, replace mode: the video whose person is replaced")
    mask_video: StrictStr | None = Field(
        None, description="Wan Animate, replace mode: the mask of that person (a file path)")
    policy: Policy = Policy()
    linear: LinearPolicy = Field(default_factory=LinearPolicy,
                                 description="low-precision linear layers through torchao (default bf16: unchanged)")
    parallel: ParallelSettings | None = Field(None, description="context parallelism under torchrun")

    @model_validator(mode="after")
    def _test_model_is_wan_t2v(self):
        if (self.family != "wan" or self.task != "t2v") and is_test_model(self.model):
            what = "the project's trained" if self.model == "test" else "a saved test model, the project's"
            raise ValueError(f"model: {self.model} is {what} Wan text-to-video model: it needs family wan and "
                             f"task t2v, got family {self.family!r}, task {self.task!r}")
        return self

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


#: The shipped test model's own sizes (its TEST_MODEL_CALL's). Like the tiny models', a test model's
#: sizes replace a config's where the model is a test model (``pipelines.embedded_sizes``), not in the
#: config itself: a config's sizes are for the real model it may also run.
TEST_MODEL_SIZES = {"height": TEST_MODEL_CALL["height"], "width": TEST_MODEL_CALL["width"],
                    "frames": TEST_MODEL_CALL["num_frames"], "steps": TEST_MODEL_CALL["num_inference_steps"]}


def test_model_path(model: str) -> Path | None:
    """Where the test model that ``model`` names is saved, or None where ``model`` names another
    model: the one place that says whether a run is the test model's. ``"test"``: the shipped
    weights (:data:`fp4video.testmodel.WEIGHTS`); a local folder holding a saved test model (a
    pipeline folder, a pack, a training run's folder; :func:`fp4video.testmodel.model.test_model_folder`
    knows it by its files, reading no weights): that model; ``"tiny"``, a real pipeline's folder, a
    hub id: None."""
    if model == "test":
        return WEIGHTS
    if model == "tiny" or not model.strip():
        return None
    return test_model_folder(Path(model).expanduser())


def is_test_model(model: str) -> bool:
    """Whether ``model`` names the test model, shipped or saved (:func:`test_model_path`)."""
    return test_model_path(model) is not None


def test_model_call(model: str) -> dict | None:
    """The generation arguments of the test model ``model`` names (:data:`TEST_MODEL_CALL`), a
    saved model's own sizes and text length in them where its training recorded them
    (:func:`fp4video.testmodel.model.recorded_config`: a pack's, a training run's, the log an unpacked
    folder keeps); None where
    ``model`` is another model. A record that cannot be read is a one-line ``ValueError``."""
    path = test_model_path(model)
    if path is None:
        return None
    own = recorded_config(path)
    if own is None:
        return dict(TEST_MODEL_CALL)
    return {**TEST_MODEL_CALL, "height": own.height, "width": own.width, "num_frames": own.frames,
            "max_sequence_length": own.max_sequence_length}


test_model_path.__test__ = test_model_call.__test__ = False  # not pytest tests (their names start with "test_")

#: The embedded default: MXAttention's Wan2.2 main-table policy (block 0 and the last two steps in
#: FP16) on the project's trained test model (at its own sizes, applied where the config is
#: resolved), with a caption of the kind it was trained on.
DEFAULT_CONFIG = RunConfig(
    model="test",
    family="wan",
    guidance_scale=TEST_MODEL_CALL["guidance_scale"],
    prompts=["a red circle moves right over the coffee photo"],
    policy=Policy(method="mxattn", rules=[{"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 2}}]),
)


#: How deep a config's YAML may nest (a run config nests 4 levels; the limit keeps a pathological
#: file from reaching Python's recursion limit inside the YAML or pydantic code)
MAX_YAML_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (at any depth: PyYAML keeps
    the last silently) and nesting deeper than :data:`MAX_YAML_DEPTH`."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.MarkedYAMLError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: its keys are meant to be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the constructor below says so
                if first is not key_node:
                    raise yaml.MarkedYAMLError(
                        problem=f"key {key!r} given twice in one mapping (first on line {first.start_mark.line + 1}); "
                                "YAML would keep only the last", problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what, and where (line, column)."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        what = "; ".join(str(p) for p in (e.context, e.problem) if p)
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what
    return " ".join(str(e).split())


def read_yaml_mapping(path: str | Path) -> dict:
    """The mapping at the top of a YAML file, or a :class:`ConfigError` in one line naming the file
    and the problem: no such file, a directory, unreadable, not UTF-8, not valid YAML (a key given
    twice in one mapping included), nested too deep, empty, or not a mapping."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; expected a mapping of settings")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    return data


def load_config(path: str | Path) -> RunConfig:
    """A run config from a YAML file; every problem a :class:`ConfigError` naming the file."""
    data = read_yaml_mapping(path)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None
