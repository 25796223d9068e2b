"""The test model's configuration, its diffusers parts, its text encoding, and its files.

The model is a Wan text-to-video pipeline in diffusers' own classes: ``WanTransformer3DModel``,
``AutoencoderKLWan``, a small ``T5EncoderModel`` with a word-level ``PreTrainedTokenizerFast`` over
the captions' words, and ``UniPCMultistepScheduler`` with Wan's flow settings. :data:`FULL` is the
shipped size (docs/test-model.md says why), :data:`SMOKE` a tiny one for CPU tests.

A saved model is a folder ``WanPipeline.from_pretrained`` loads (model_index.json, transformer/,
vae/, text_encoder/, tokenizer/, scheduler/; safetensors in fp16). :func:`pack` turns it into four
files (one safetensors per model and ``model.json`` holding every other file's text) and
:func:`unpack` turns those back into the folder, byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .scenes import vocabulary

__all__ = ["TestModelConfig", "FULL", "FINE", "SMOKE", "TEST_MODEL_CALL", "SPECIAL_TOKENS", "build_tokenizer",
           "build_pipeline", "text_embeddings", "tokenize", "save_pipeline", "pack", "unpack", "is_pack",
           "PACK_FILE", "PACKED_MODELS", "PIPELINE_FILES", "parameter_counts", "check_pipeline_folder",
           "read_pack", "read_training_log", "TRAIN_LOG", "saved_model", "no_progress_bars", "test_model_folder",
           "recorded_config"]

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]

#: The pack's index file (configs, tokenizer, scheduler and model index as text).
PACK_FILE = "model.json"
#: The models a pack holds one safetensors file each of (``<name>.safetensors``).
PACKED_MODELS = ("transformer", "vae", "text_encoder")
_PACK_FORMAT = "fp4video-testmodel-pack"
#: The text files a saved pipeline needs besides the weights (what ``WanPipeline.from_pretrained``
#: reads): the model index, each model's config, the tokenizer and the scheduler.
PIPELINE_FILES = ("model_index.json", *(f"{m}/config.json" for m in PACKED_MODELS), "tokenizer/tokenizer.json",
                  "scheduler/scheduler_config.json")


class TestModelConfig(BaseModel):
    """Sizes of the test model and of its clips."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    __test__ = False  # not a pytest test class (its name starts with "Test")

    height: int = Field(gt=0, description="a multiple of the VAE's spatial compression")
    width: int = Field(gt=0, description="a multiple of the VAE's spatial compression")
    frames: int = Field(gt=0, description="4n + 1 (the VAE's causal 4× in time)")
    # VAE (AutoencoderKLWan): 2^(levels - 1)× in space (8× with four levels, Wan's; 4× with three),
    # 4× in time (the last two downsamplings halve time as well)
    z_dim: int = Field(gt=0)
    vae_base_dim: int = Field(gt=0)
    vae_dim_mult: tuple[int, int, int, int] | tuple[int, int, int]
    vae_res_blocks: int = Field(gt=0)
    # transformer (WanTransformer3DModel)
    patch_size: tuple[int, int, int]
    heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    layers: int = Field(gt=0)
    ffn_dim: int = Field(gt=0)
    freq_dim: int = Field(gt=0)
    # text encoder (T5EncoderModel)
    text_dim: int = Field(gt=0)
    text_layers: int = Field(gt=0)
    text_heads: int = Field(gt=0)
    text_ff: int = Field(gt=0)
    max_sequence_length: int = Field(gt=0, description="text tokens the pipeline pads to (TEST_MODEL_CALL's)")
    flow_shift: float = Field(gt=0)

    def model_post_init(self, _context) -> None:
        if (self.frames - 1) % 4:
            raise ValueError(f"frames must be 4n + 1 (the Wan VAE's time compression), got {self.frames}")
        f = self.spatial_compression
        if self.height % f or self.width % f:
            raise ValueError(f"height and width must be multiples of the VAE's {f}× spatial compression, "
                             f"got {self.height}×{self.width}")
        lf, lh, lw = self.latent_shape
        pt, ph, pw = self.patch_size
        if lf % pt or lh % ph or lw % pw:
            raise ValueError(f"the latent grid {lf}×{lh}×{lw} does not divide into patches {self.patch_size}")

    @property
    def spatial_compression(self) -> int:
        """The VAE's spatial factor: each level after the first halves height and width."""
        return 2 ** (len(self.vae_dim_mult) - 1)

    @property
    def temporal_downsample(self) -> list[bool]:
        """``AutoencoderKLWan``'s ``temperal_downsample``: the last two downsamplings halve time
        (4× in time at any depth; Wan's ``[False, True, True]`` at four levels)."""
        return [False] * (len(self.vae_dim_mult) - 3) + [True, True]

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(latent frames, latent height, latent width)."""
        f = self.spatial_compression
        return ((self.frames - 1) // 4 + 1, self.height // f, self.width // f)

    @property
    def video_tokens(self) -> int:
        """Tokens of one clip in the transformer's self-attention (after patching)."""
        lf, lh, lw = self.latent_shape
        pt, ph, pw = self.patch_size
        return (lf // pt) * (lh // ph) * (lw // pw)


#: A fresh run's model at the shipped sizes: 128×128 px, 29 frames -> latent 8 × 16 × 16 -> 2,048
#: video tokens with the (1, 1, 1) patch; 4 blocks of 4 heads × 64 (width 256). The shipped weights
#: were trained at this size and grown to 6 blocks (``--grow-layers 2``).
FULL = TestModelConfig(
    height=128, width=128, frames=29, z_dim=16, vae_base_dim=32, vae_dim_mult=(1, 2, 2, 2), vae_res_blocks=1,
    patch_size=(1, 1, 1), heads=4, head_dim=64, layers=4, ffn_dim=1024, freq_dim=256,
    text_dim=128, text_layers=2, text_heads=4, text_ff=256, max_sequence_length=32, flow_shift=3.0)

#: The shipped clips and transformer over a latent twice as fine: a VAE of three levels (4× in
#: space, latent 8 × 32 × 32, z 8) and Wan's (1, 2, 2) patch, so the transformer sees the same
#: 2,048 tokens while a shape of 22-29 px spans 6-7 latent cells (3-4 at 8×), where a square's
#: corners and a circle's edge are apart.
FINE = TestModelConfig(
    height=128, width=128, frames=29, z_dim=8, vae_base_dim=32, vae_dim_mult=(1, 2, 2), vae_res_blocks=1,
    patch_size=(1, 2, 2), heads=4, head_dim=64, layers=4, ffn_dim=1024, freq_dim=256,
    text_dim=128, text_layers=2, text_heads=4, text_ff=256, max_sequence_length=32, flow_shift=3.0)

#: A tiny model for CPU tests: 32×32 px, 5 frames -> 2 × 4 × 4 = 32 tokens; 2 blocks.
SMOKE = TestModelConfig(
    height=32, width=32, frames=5, z_dim=4, vae_base_dim=8, vae_dim_mult=(1, 1, 1, 1), vae_res_blocks=1,
    patch_size=(1, 1, 1), heads=2, head_dim=64, layers=2, ffn_dim=128, freq_dim=64,
    text_dim=32, text_layers=1, text_heads=2, text_ff=64, max_sequence_length=32, flow_shift=3.0)

#: Call arguments for generating with the shipped model (besides the prompt and the generator).
TEST_MODEL_CALL = {"height": FULL.height, "width": FULL.width, "num_frames": FULL.frames, "num_inference_steps": 16,
                   "guidance_scale": 4.0, "max_sequence_length": FULL.max_sequence_length}


def build_tokenizer():
    """A word-level tokenizer over the captions' words (lower-cased, split on whitespace; ``</s>``
    appended, as T5's tokenizer does), made in memory."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + vocabulary()
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=512)


def build_pipeline(config: TestModelConfig = FULL, seed: int = 0):
    """A ``WanPipeline`` of ``config``'s sizes with fresh (random) weights from ``seed``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=config.vae_base_dim, z_dim=config.z_dim, dim_mult=list(config.vae_dim_mult),
                           num_res_blocks=config.vae_res_blocks, temperal_downsample=config.temporal_downsample,
                           scale_factor_spatial=config.spatial_compression,
                           latents_mean=[0.0] * config.z_dim, latents_std=[1.0] * config.z_dim)
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=config.text_dim, d_kv=config.text_dim // config.text_heads,
        d_ff=config.text_ff, num_layers=config.text_layers, num_heads=config.text_heads,
        relative_attention_num_buckets=16, relative_attention_max_distance=32, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    torch.manual_seed(seed + 2)
    transformer = WanTransformer3DModel(
        patch_size=config.patch_size, num_attention_heads=config.heads, attention_head_dim=config.head_dim,
        in_channels=config.z_dim, out_channels=config.z_dim, text_dim=config.text_dim, freq_dim=config.freq_dim,
        ffn_dim=config.ffn_dim, num_layers=config.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=config.flow_shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)


def tokenize(tokenizer, captions: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each (len(captions), max_sequence_length), as WanPipeline tokenizes prompts."""
    out = tokenizer(list(captions), padding="max_length", max_length=max_sequence_length, truncation=True,
                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


def text_embeddings(text_encoder, ids: torch.Tensor, mask: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """The text encoder's output as WanPipeline passes it to the transformer: zero past each
    caption's tokens, and zero-padded to ``pad_to`` tokens (the pipeline's max_sequence_length)."""
    hidden = text_encoder(ids, attention_mask=mask).last_hidden_state
    hidden = hidden * mask[..., None].to(hidden.dtype)
    if pad_to is not None and pad_to > hidden.shape[1]:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad_to - hidden.shape[1]))
    return hidden


def parameter_counts(pipe) -> dict:
    """{model: parameters} of the pipeline's transformer, VAE and text encoder."""
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in PACKED_MODELS}


@contextlib.contextmanager
def no_progress_bars():
    """diffusers' and transformers' progress bars off within the block (loading and saving the test
    model take well under a second: their "Loading ..." / "Writing model shards" bars are noise),
    each put back as it was."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    was = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in was:
        m.disable_progress_bar()
    try:
        yield
    finally:
        for m, enabled in was:
            if enabled:
                m.enable_progress_bar()


def save_pipeline(pipe, folder, dtype=torch.float16) -> Path:
    """Save ``pipe`` as a WanPipeline folder with its floating-point weights stored in ``dtype``
    (the pipeline itself is not changed). Written next to ``folder`` and moved into place, so an
    interrupted save never leaves a half-written folder."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        with no_progress_bars():
            pipe.save_pretrained(tmp, safe_serialization=True)
        for path in tmp.rglob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata()
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
            save_file(tensors, str(path), metadata=metadata)
        for path in tmp.rglob("*.json"):  # where the pipeline was loaded from (a temporary folder): not its own
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.pop("_name_or_path", None) is not None:
                path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        old = folder.with_name(folder.name + ".old")
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
        tmp.chmod(0o755)  # (mkdtemp makes it private)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _check_weights(path: Path, what: str) -> None:
    """``path`` is a whole safetensors file (its header read and its data's length checked)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types for a damaged or truncated file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}: not a readable safetensors file (truncated or damaged: {first})") from None


def check_pipeline_folder(folder) -> None:
    """Raise a one-line ``FileNotFoundError`` / ``ValueError`` naming the first part a test-model
    pipeline folder lacks or holds damaged: :data:`PIPELINE_FILES`, and one whole safetensors file
    for each of :data:`PACKED_MODELS` (diffusers' own errors name other files or temporary folders)."""
    folder = Path(folder)
    for rel in PIPELINE_FILES:
        if not (folder / rel).is_file():
            raise FileNotFoundError(f"{folder}: {rel} is missing (not a whole test-model pipeline folder)")
    for rel in (r for r in PIPELINE_FILES if r.endswith(".json")):
        try:
            data = json.loads((folder / rel).read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder / rel}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{folder / rel}: a JSON object expected, got a {type(data).__name__}")
    for model in PACKED_MODELS:
        weights = sorted((folder / model).glob("*.safetensors"))
        if not weights:
            raise FileNotFoundError(f"{folder}: {model}/ holds no .safetensors weights")
        for path in weights:
            _check_weights(path, str(path))


def read_pack(pack_dir) -> dict:
    """The index (:data:`PACK_FILE`) of the pack ``pack_dir``, checked before anything is written
    from it: the format, every stored file's name relative and inside the folder, the files a
    pipeline needs (:data:`PIPELINE_FILES`), and one whole ``<model>.safetensors`` beside it for each
    of :data:`PACKED_MODELS`. A one-line ``FileNotFoundError`` / ``ValueError`` names the problem."""
    pack_dir = Path(pack_dir)
    index_path = pack_dir / PACK_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"{pack_dir}: not a packed test model (no {PACK_FILE})")
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{index_path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != _PACK_FORMAT:
        got = repr(index.get("format")) if isinstance(index, dict) else f"none: a JSON {type(index).__name__}"
        raise ValueError(f"{index_path}: not a test-model pack (format {got})")
    weights, files = index.get("weights"), index.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"{index_path}: 'files' must map file names to their text")
    if not isinstance(weights, dict) or sorted(weights) != sorted(PACKED_MODELS) or \
            not all(isinstance(v, str) and v.startswith(f"{k}/") and v.endswith(".safetensors")
                    for k, v in weights.items()):
        raise ValueError(f"{index_path}: 'weights' must name one <model>/....safetensors file for each of "
                         f"{', '.join(PACKED_MODELS)}, got {weights!r}")
    for rel in (*files, *weights.values()):
        if not _relative_inside(rel):
            raise ValueError(f"{index_path}: names a file outside its folder: {rel!r}")
    missing = [rel for rel in PIPELINE_FILES if rel not in files]
    if missing:
        raise ValueError(f"{index_path}: holds no {missing[0]} (not a whole pipeline)")
    for model in PACKED_MODELS:
        src = pack_dir / f"{model}.safetensors"
        if not src.is_file():
            raise FileNotFoundError(f"{pack_dir}: {src.name} is missing")
        _check_weights(src, str(src))
    return index


def _relative_inside(rel: str) -> bool:
    """Whether ``rel`` is a relative path that stays inside the folder it is joined to."""
    from pathlib import PurePosixPath, PureWindowsPath

    parts = PurePosixPath(rel).parts
    return bool(parts) and not PurePosixPath(rel).is_absolute() and not PureWindowsPath(rel).drive \
        and ".." not in parts and "\\" not in rel


def saved_model(path) -> Path:
    """The saved test model at ``path``: ``path`` itself where it is a pack or a pipeline folder,
    else the ``pipeline/`` folder of a training run's output (``scripts/train_test_model.py`` without
    ``--pack``); ``FileNotFoundError`` (one line) where it is none of those."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder (a test-model pipeline folder, pack or training run)")
    if is_pack(path) or (path / "model_index.json").is_file():
        return path
    if (path / "pipeline" / "model_index.json").is_file():
        return path / "pipeline"
    raise FileNotFoundError(f"{path}: neither a pipeline folder (model_index.json), a test-model pack (model.json) "
                            "nor a training run's folder (pipeline/)")


def is_pack(path) -> bool:
    """Whether ``path`` is a folder :func:`pack` wrote."""
    return (Path(path) / PACK_FILE).is_file()


#: The training log ``scripts/train_test_model.py`` writes beside its ``pipeline/`` (or its pack).
TRAIN_LOG = "train_log.json"


def read_training_log(path) -> dict:
    """The training log at ``path`` (:data:`TRAIN_LOG`) as a dict; a one-line ``ValueError`` naming
    the file where it is not a file holding a JSON object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a training log (a JSON object expected)")
    return data


#: The test model's ``tokenizer.json`` holds its 52 words in about 3 KB; one larger than this is
#: another model's (a real Wan's UMT5 tokenizer is 16 MB), told apart without reading it.
_TOKENIZER_MAX_BYTES = 1 << 16


def _caption_tokenizer(folder: Path) -> bool:
    """Whether the pipeline folder's ``tokenizer/tokenizer.json`` is the test model's: word-level
    over exactly the captions' words (:func:`build_tokenizer`'s vocabulary, ids included)."""
    path = folder / "tokenizer" / "tokenizer.json"
    try:
        if path.stat().st_size > _TOKENIZER_MAX_BYTES:
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and model.get("type") == "WordLevel" and \
        model.get("vocab") == {w: i for i, w in enumerate(SPECIAL_TOKENS + vocabulary())}


def test_model_folder(path) -> Path | None:
    """The saved test model at ``path`` (what :func:`saved_model` loads) where ``path`` holds one,
    else None; no weights are read and nothing is raised. A test model is known by its files:

    - a pack (:data:`PACK_FILE`): the format is the test model's own;
    - a training run's folder (:data:`TRAIN_LOG` beside ``pipeline/``): its ``pipeline/``;
    - a pipeline folder whose tokenizer is the test model's, word-level over exactly the captions'
      words (a real Wan pipeline has UMT5's tokenizer; the tiny random models' spell letters).

    A pack or a run's folder is the test model even where a part is damaged or missing: loading it
    names the part in one line. A pipeline folder without its tokenizer is not known as one."""
    path = Path(path)
    if not path.is_dir():
        return None
    if is_pack(path):
        return path
    if (path / TRAIN_LOG).is_file() and (path / "pipeline").is_dir():
        return path / "pipeline"
    return path if _caption_tokenizer(path) else None


test_model_folder.__test__ = False  # not a pytest test (its name starts with "test_")


def recorded_config(path) -> TestModelConfig | None:
    """The :class:`TestModelConfig` the training of the saved test model at ``path`` recorded: a
    pack's (``extra.config`` of :data:`PACK_FILE`) or a training run's (``config`` of
    :data:`TRAIN_LOG`, ``path`` being the run's folder, its ``pipeline/``, or a pipeline folder
    ``--unpack`` wrote from a pack with a log); None where none is recorded (a pipeline folder
    without a log). A record that is not valid JSON
    or not a TestModelConfig is a one-line ``ValueError`` naming its file."""
    path = Path(path)
    if is_pack(path):
        source, keys = path / PACK_FILE, ("extra", "config")
    elif (path / TRAIN_LOG).is_file():
        source, keys = path / TRAIN_LOG, ("config",)
    elif path.name == "pipeline" and (path.parent / TRAIN_LOG).is_file():
        source, keys = path.parent / TRAIN_LOG, ("config",)
    else:
        return None
    try:
        data = json.loads(source.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    if data is None:
        return None
    try:
        return TestModelConfig.model_validate_json(json.dumps(data))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([*keys, *map(str, first["loc"])])
        raise ValueError(f"{source}: {where}: {first['msg']} (not a test model's sizes)") from None


def pack(folder, out_dir, extra: dict | None = None) -> list[Path]:
    """Pack the pipeline folder ``folder`` into ``out_dir``: ``<model>.safetensors`` for each of
    :data:`PACKED_MODELS` and :data:`PACK_FILE` (every other file's text, and ``extra``). Each file
    is written beside its target and renamed into place. A training log in ``folder`` (:data:`TRAIN_LOG`,
    as :func:`unpack` keeps it) is the model's record, not a pipeline file: it goes beside the pack
    as :data:`TRAIN_LOG` (checked first), over a log ``out_dir`` held; a folder without one leaves
    ``out_dir``'s log as it is (a training run's own, written beside the pack of its fresh
    pipeline folder). Returns the files."""
    folder, out_dir = Path(folder), Path(out_dir)
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{folder}: not a pipeline folder (no model_index.json)")
    log = folder / TRAIN_LOG if (folder / TRAIN_LOG).exists() else None
    if log is not None:
        read_training_log(log)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts, weights = {}, {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == TRAIN_LOG:  # (checked above: the model's record, written beside the pack below)
            continue
        if path.suffix == ".safetensors":
            model = rel.split("/")[0]
            if model not in PACKED_MODELS or model in weights:
                raise ValueError(f"{folder}: unexpected weights file {rel} (a pack holds one safetensors file for "
                                 f"each of {', '.join(PACKED_MODELS)})")
            weights[model] = rel
        else:
            texts[rel] = path.read_text()
    missing = [m for m in PACKED_MODELS if m not in weights]
    if missing:
        raise ValueError(f"{folder}: no weights for {', '.join(missing)}")
    written = []
    for model, rel in weights.items():
        target = out_dir / f"{model}.safetensors"
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(folder / rel, tmp)
        tmp.replace(target)
        written.append(target)
    index = {"format": _PACK_FORMAT, "version": 1, "weights": weights, "files": texts, "extra": extra or {}}
    target = out_dir / PACK_FILE
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(target)
    written.append(target)
    if log is not None:
        target = out_dir / TRAIN_LOG
        tmp = target.with_name(target.name + ".tmp")
        shutil.copyfile(log, tmp)
        tmp.replace(target)
        written.append(target)
    return written


def unpack(pack_dir, folder) -> Path:
    """Write the pipeline folder a :func:`pack` holds (``pack_dir``) to ``folder`` (absent, empty, or
    a pipeline folder, which it replaces). The pack's training log (:data:`TRAIN_LOG`), where it has
    one, goes into ``folder`` with it: the record of how the weights were trained (which shapes'
    angles, which data streams) stays with them. The pack is checked whole first (:func:`read_pack`)
    and the folder written beside ``folder`` and moved into place, so a refused or interrupted
    unpack leaves ``folder`` as it was."""
    pack_dir, folder = Path(pack_dir), Path(folder)
    index = read_pack(pack_dir)
    log = pack_dir / TRAIN_LOG if (pack_dir / TRAIN_LOG).exists() else None
    if log is not None:
        read_training_log(log)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder}: a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "model_index.json").is_file():
        raise FileExistsError(f"{folder}: a folder with other files in it (give an empty or a pipeline folder)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for rel, text in index["files"].items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        for model, rel in index["weights"].items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pack_dir / f"{model}.safetensors", tmp / rel)
        if log is not None:
            shutil.copyfile(log, tmp / TRAIN_LOG)
        tmp.chmod(0o755)  # (mkdtemp makes it private)
        old = None
        if folder.exists():  # moved aside under a fresh name (never one of the user's), removed once replaced
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            old.rmdir()
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
