"""Training the test model within a wall-clock budget: the VAE first (reconstruction and a small
KL), then the transformer and the text encoder jointly with flow matching on the VAE's latents.

Data are drawn on the training device from :mod:`~fp4video.testmodel.scenes`, each batch's scenes
from the run's seed and the batch's index in its stream, so a fresh run of a seed gives the same
data every time; a resumed run's streams start past what the runs in its log drew
(:func:`data_offsets`). The transformer trains on a pool of encoded latents (as many clips as the
pool's share of the budget allows; ``pool_refresh`` fresh clips replace the oldest after every
step), with fresh noise and timesteps every step:

    x_t = (1 - t) x_0 + t ε,   the transformer predicts ε - x_0,

t = shift·u / (1 + (shift - 1)·u) with u uniform (Wan's shifted schedule: the scheduler's
``flow_shift`` unless ``train_shift`` is given), the timestep passed as 1000·t; captions are dropped (the empty caption) with
probability ``caption_dropout`` for classifier-free guidance; the text is padded as the pipeline
pads it (to ``max_sequence_length``, and to 512 tokens every ``long_text_every``-th step, the
pipeline's default, so a call without ``max_sequence_length`` works too).

Everything is written as it goes under the run's folder: the pipeline (a checkpoint every
``checkpoint_seconds``; packed into a few files with ``pack``), ``train_log.json`` (losses,
steps, times, settings, sizes, the evaluation) and ``loss.png``; at the end the held-out captions
are generated and checked (:mod:`~fp4video.testmodel.checker`), and ``samples.png`` shows them.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .checker import check_rate, describe_shapes
from .model import (FINE, FULL, SMOKE, TRAIN_LOG, TestModelConfig, build_pipeline, pack, parameter_counts,
                    read_training_log, save_pipeline, text_embeddings, tokenize)
from .scenes import COLOURS, SHAPES, SceneSpec, held_out_scenes, render, sample_scenes, sampling_probabilities

__all__ = ["Settings", "SMOKE_SETTINGS", "train", "config_of", "fresh_config", "vae_mismatch", "data_offsets",
           "training_log_of", "chain_starts_unlogged", "trained_upright", "overwrite_oldest", "clip_frames",
           "generate", "evaluate", "eval_scenes",
           "EVAL_COMBINATIONS", "call_for", "flow_sample", "latent_cover", "flow_loss", "grow_blocks", "pool_clips"]

_PHASES = {"vae": 1, "stats": 2, "pool": 3, "noise": 4}


class Settings(BaseModel):
    """A training run's settings (the script's options)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    seed: int = 0
    size: Literal["full", "fine"] = Field("full", description="a fresh run's model: FULL (the shipped sizes) or "
                                          "FINE (a 4× VAE and a (1, 2, 2) patch); a resumed run keeps its model's")
    heads: int | None = Field(None, gt=0, description="a fresh run's transformer heads of 64 (None: the size's; "
                              "its feed-forward stays 4× the width)")
    layers: int | None = Field(None, gt=0, description="a fresh run's transformer blocks (None: the size's)")
    grow_layers: int = Field(0, ge=0, description="blocks a resumed run adds to its transformer before it trains "
                             "(grow_blocks: copies whose outputs start at zero, so training starts from the "
                             "resumed model's function)")
    vae_from: str | None = Field(None, description="a saved model whose trained VAE (weights and latent "
                                 "statistics) a fresh run takes instead of a new one")
    minutes: float = Field(8.0, gt=0, description="wall-clock budget of the whole run, from its start")
    vae_minutes: float = Field(2.0, ge=0, description="of which the VAE trains (from the start)")
    vae_decoder_only: bool = Field(False, description="the VAE phase trains the decoder alone: the encoder, and so "
                                   "the latents and their statistics a resumed transformer learned on, stay as they are")
    reserve_seconds: float = Field(60.0, ge=0, description="kept at the end for the evaluation and the last save")
    vae_batch: int = Field(12, gt=0)
    vae_frames: int = Field(29, gt=0, description="frames of the VAE's training clips (4n + 1); the clip's own "
                            "length, since the causal cache drifts on chunks later than training showed")
    vae_lr: float = Field(6e-4, gt=0)
    kl_weight: float = Field(1e-5, ge=0)
    shape_weight: float = Field(4.0, ge=0, description="extra reconstruction weight on the shape's pixels")
    batch: int = Field(128, gt=0)
    train_shift: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      description="the shift of the timesteps the transformer trains on (None: the "
                                      "scheduler's flow_shift, which sampling uses; 1: uniform t, more steps near "
                                      "the clean clip; above 3: more near pure noise)")
    lr: float = Field(4e-4, gt=0)
    warmup_steps: int = Field(200, ge=0)
    pool_size: int = Field(12288, gt=0, description="clips in the latent pool (at most)")
    pool_share: float = Field(0.15, gt=0, le=1, description="of the time left after the VAE, at most, for the pool")
    pool_refresh: int = Field(0, ge=0, description="fresh clips rendered and encoded after every transformer step, "
                              "each over the pool's oldest (0: the pool stays as built)")
    encode_batch: int = Field(64, gt=0)
    stats_clips: int = Field(256, gt=1, description="clips whose latents set latents_mean / latents_std")
    caption_dropout: float = Field(0.1, ge=0, lt=1)
    long_text_every: int = Field(4, ge=0, description="pad the text to 512 tokens every n-th step (0: never)")
    checkpoint_seconds: float = Field(60.0, gt=0)
    log_seconds: float = Field(10.0, ge=0)
    vae_colour_weights: dict[str, float] | None = Field(
        None, description="relative weights of the VAE's clips' colours ({colour: weight}, others 1; None: uniform)")
    vae_first_frame_weight: float = Field(1.0, gt=0, allow_inf_nan=False,
                                          description="the first frame's factor on the VAE's reconstruction weight")
    shape_weights: dict[str, float] | None = Field(
        None, description="relative weights of the shapes of the VAE's clips and the latent pool's "
        "({shape: weight}, others 1; None: uniform)")
    upright: bool = Field(False, description="every clip's shape starts at angle 0 (the VAE's, the statistics', the "
                          "pool's and the evaluation's clips) instead of a random angle no caption names")
    shape_loss_weight: float = Field(0.0, ge=0, allow_inf_nan=False,
                                     description="extra flow-matching weight on the latent cells the shape covers")
    ema_decay: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False,
                             description="the transformer's and text encoder's saved weights are an exponential "
                             "moving average of the trained ones with this decay per step (0: the trained ones)")
    max_vae_steps: int | None = Field(None, ge=0)
    max_steps: int | None = Field(None, ge=0)
    eval_clips: int = Field(24, ge=0, description="held-out captions generated and checked at the end")
    eval_steps: int | None = Field(None, gt=0, description="denoising steps (default TEST_MODEL_CALL's)")
    eval_guidance: float | None = Field(None, ge=0)
    eval_seed: int = 1234
    compile: bool = False
    smoke: bool = False

    @field_validator("shape_weights")
    @classmethod
    def _shape_names(cls, v):
        sampling_probabilities(v, SHAPES, "shape weights")
        return v

    @field_validator("vae_colour_weights")
    @classmethod
    def _colour_names(cls, v):
        sampling_probabilities(v, COLOURS, "colour weights")
        return v

    @model_validator(mode="after")
    def _refresh_fits(self):
        if self.pool_refresh > self.pool_size:
            raise ValueError(f"pool_refresh ({self.pool_refresh}) exceeds pool_size ({self.pool_size}): a step "
                             "cannot replace more clips than the pool holds")
        return self

    @field_validator("vae_frames")
    @classmethod
    def _four_n_plus_one(cls, v: int) -> int:
        if v % 4 != 1:
            raise ValueError(f"must be 4n + 1 (the VAE's causal 4x in time), got {v}")
        return v


#: A run on the CPU in seconds: the smoke model, a few steps of each phase, two clips checked.
SMOKE_SETTINGS = dict(minutes=2.0, vae_minutes=1.0, reserve_seconds=0.0, vae_batch=2, vae_frames=5, batch=2,
                      warmup_steps=1, pool_size=4, encode_batch=2, stats_clips=4, checkpoint_seconds=1e9, log_seconds=0.0,
                      max_vae_steps=2, max_steps=3, eval_clips=2, eval_steps=2, smoke=True)


def call_for(config: TestModelConfig, steps: int | None = None, guidance: float | None = None) -> dict:
    """Generation arguments of a model of ``config``'s sizes (TEST_MODEL_CALL's for the shipped one)."""
    from .model import TEST_MODEL_CALL

    return {"height": config.height, "width": config.width, "num_frames": config.frames,
            "num_inference_steps": steps or TEST_MODEL_CALL["num_inference_steps"],
            "guidance_scale": TEST_MODEL_CALL["guidance_scale"] if guidance is None else guidance,
            "max_sequence_length": config.max_sequence_length}


def flow_sample(x0: torch.Tensor, noise: torch.Tensor, u: torch.Tensor, shift: float):
    """Wan's flow-matching training pair: ``(x_t, timestep, target)`` for clean latents ``x0``,
    noise, and uniform ``u`` (one per clip): t = shift·u / (1 + (shift - 1)·u), x_t = (1 - t) x0 +
    t·noise, the timestep 1000·t, the target noise - x0 (what UniPC's ``flow_prediction`` takes)."""
    t = shift * u / (1 + (shift - 1) * u)
    tt = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise, t * 1000, noise - x0


def latent_cover(mask: torch.Tensor, latent_shape) -> torch.Tensor:
    """The shape's coverage of each latent cell: ``mask`` (B, 1, T, H, W), the pixels' coverage in
    [0, 1] (:func:`~fp4video.testmodel.scenes.render`'s), max-pooled onto the latent grid of
    ``latent_shape`` (B, C, T', H', W'), the causal VAE's: latent frame 0 holds frame 0 alone,
    latent frame k the frames 4k - 3 .. 4k (the factor (T - 1) / (T' - 1)), and each latent pixel
    an f × f block of pixels (f = H / H'). Returns (B, 1, T', H', W')."""
    b, _, t, h, w = mask.shape
    lt, lh, lw = latent_shape[-3:]
    ft = (t - 1) // (lt - 1) if lt > 1 else 1
    if (lt - 1) * ft + 1 != t or h % lh or w % lw or h // lh != w // lw:
        raise ValueError(f"latent_cover: a mask of {t}×{h}×{w} does not map onto a latent grid of {lt}×{lh}×{lw}")
    f = h // lh
    # frame 0 repeated to a whole first group: the first latent frame's group is frame 0 alone
    padded = torch.cat([mask[:, :, :1].expand(b, 1, ft - 1, h, w), mask], 2) if ft > 1 else mask
    return torch.nn.functional.max_pool3d(padded.float(), kernel_size=(ft, f, f), stride=(ft, f, f))


def flow_loss(pred: torch.Tensor, target: torch.Tensor, cover: torch.Tensor | None = None,
              weight: float = 0.0) -> torch.Tensor:
    """The transformer's flow-matching loss: the mean squared error of ``pred`` against ``target``,
    weighted as the VAE's reconstruction is where ``weight`` > 0: each latent cell's error times
    1 + weight·cover (``cover`` (B, 1, T', H', W') from :func:`latent_cover`, the same for every
    channel), divided by the weights' mean (so the loss keeps its scale). ``weight`` 0 is the
    plain mean, computed as it is without coverage."""
    err = (pred.float() - target).pow(2)
    if not weight:
        return err.mean()
    if cover is None:
        raise ValueError("flow_loss: a shape weight needs the shape's coverage (cover)")
    w = 1 + weight * cover.float()
    return (w * err).mean() / w.mean()


def _stream(seed: int, phase: str, index: int) -> int:
    """The seed of batch ``index`` of a phase's data."""
    return ((seed * 7919 + _PHASES[phase]) * 1_000_003 + index) % (2 ** 62)


def clip_frames(video: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) in [-1, 1] -> (B, T, H, W, 3) float in [0, 1] (what the checker takes)."""
    return ((video.float() + 1) / 2).clamp(0, 1).permute(0, 2, 3, 4, 1).cpu()


class _Run:
    """The run's log, written as it goes (JSON and the loss plot)."""

    def __init__(self, out: Path, log, info: dict, started: float | None):
        self.out, self.print = out, log
        self.t0 = time.perf_counter() if started is None else started
        self.data = {**info, "curves": {"vae": [], "transformer": []}, "phases": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def offsets(self) -> dict[str, int]:
        """Where this run's data streams start (:func:`data_offsets` of the runs it resumes)."""
        return data_offsets(self.data.get("previous_log"))

    def say(self, text: str) -> None:
        self.print(text)
        sys.stdout.flush()

    def write(self) -> None:
        path = self.out / "train_log.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(path)
        try:
            _plot_losses(self.data, self.out / "loss.png")
        except Exception as e:  # a plot failure never stops training
            self.data["plot_error"] = f"{type(e).__name__}: {e}"


def _chain(log: dict) -> list[dict]:
    """The runs that trained a model, first to last: ``log`` and the logs of the runs it resumed."""
    runs = [log]
    while isinstance(runs[-1].get("previous_log"), dict):
        runs.append(runs[-1]["previous_log"])
    return runs[::-1]


def chain_starts_unlogged(log: dict | None) -> bool:
    """Whether a run of the chain ``log`` records resumed a model without a log
    (``resumed_without_log``): what the runs before it drew is unknown, so :func:`data_offsets`
    counts only the logged runs, and a resumed run needs a seed of its own to draw new clips."""
    return isinstance(log, dict) and any(run.get("resumed_without_log") for run in _chain(log))


def training_log_of(model: Path) -> Path | None:
    """The training log of a saved model: ``train_log.json`` in a pack, a run's folder or a pipeline
    folder ``--unpack`` wrote (the shipped weights' included), or beside a run's ``pipeline/``
    folder; None where there is none."""
    model = Path(model)
    for folder in (model, model.parent) if model.name == "pipeline" else (model,):
        if (folder / TRAIN_LOG).is_file():
            return folder / TRAIN_LOG
    return None


def data_offsets(previous_log: dict | None) -> dict[str, int]:
    """Where a run's data streams start: past every batch the runs it resumes drew (their VAE steps,
    pool clips and refreshed clips, two noise streams per run), so a resumed run trains on clips and
    noise its predecessors never saw, whatever its seed (the logged ones: where the chain starts from
    a model without a log, :func:`chain_starts_unlogged`, the runs before it are not counted). A fresh
    run starts every stream at 0."""
    offsets = {"vae": 0, "pool": 0, "noise": 0}
    for log in _chain(previous_log) if isinstance(previous_log, dict) else []:
        phases = log.get("phases") or {}
        offsets["vae"] += int((phases.get("vae") or {}).get("steps", 0))
        offsets["pool"] += int((phases.get("pool") or {}).get("clips", 0))
        offsets["pool"] += int((phases.get("transformer") or {}).get("refreshed_clips", 0))
        offsets["noise"] += 2
    return offsets


def _plot_losses(log: dict, path: Path) -> None:
    """Each phase's loss against its steps over the whole chain of resumed runs (a run per colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    runs = _chain(log)
    for ax, name in zip(axes, ("vae", "transformer")):
        offset = 0
        for i, run in enumerate(runs):
            rows = run.get("curves", {}).get(name) or []
            if not rows:
                continue
            rate = (run.get("evaluation") or {}).get("generated", {}).get("rate")
            label = f"run {i + 1}" + (f" (held-out {rate:.0%})" if rate is not None and name == "transformer" else "")
            ax.plot([offset + r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2, label=label)
            offset += rows[-1]["step"]
        ax.set_title(f"{name} loss")
        ax.set_xlabel("steps (resumed runs continue the count)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)


def _load(resume: Path, device):
    """A pipeline to continue training (a pipeline folder or a pack), in float32 on ``device``."""
    from . import test_model_pipeline

    return test_model_pipeline(device=device, dtype=torch.float32, path=resume)


def fresh_config(s: Settings) -> TestModelConfig:
    """The sizes a fresh run builds: FULL or FINE, or the SMOKE model (of FINE's VAE depth and patch
    where ``size`` is "fine"); ``heads`` and ``layers``, where given, replace the transformer's (its
    feed-forward 4× the width, as in every size)."""
    if not s.smoke:
        config = FINE if s.size == "fine" else FULL
    elif s.size == "full":
        config = SMOKE
    else:
        config = TestModelConfig(**{**SMOKE.model_dump(), "vae_dim_mult": SMOKE.vae_dim_mult[:3],
                                    "patch_size": FINE.patch_size})
    update = {}
    if s.heads is not None:
        update.update(heads=s.heads, ffn_dim=4 * s.heads * config.head_dim)
    if s.layers is not None:
        update.update(layers=s.layers)
    return TestModelConfig(**{**config.model_dump(), **update}) if update else config


def vae_mismatch(config: TestModelConfig, vae) -> str | None:
    """How ``vae`` (an ``AutoencoderKLWan``) differs from the VAE ``config`` builds ("z_dim 16, this
    run's 8; ..."), or None where it is of those sizes (it can be taken into that model)."""
    want = {"base_dim": config.vae_base_dim, "z_dim": config.z_dim, "dim_mult": list(config.vae_dim_mult),
            "num_res_blocks": config.vae_res_blocks, "temperal_downsample": config.temporal_downsample,
            "scale_factor_spatial": config.spatial_compression}
    have = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in vae.config.items() if k in want}
    diff = [f"{k} {have.get(k)}, this run's {v}" for k, v in want.items() if have.get(k) != v]
    return "; ".join(diff) or None


def trained_upright(log: dict | None) -> bool:
    """Whether the run of this training log drew its shapes upright (:attr:`Settings.upright`; False
    for no log and for logs from before the option)."""
    return bool((log or {}).get("settings", {}).get("upright", False))


def _say_angle_change(run: _Run, source: str, before: bool, now: bool) -> None:
    """One line where a run draws its shapes otherwise than the model it starts from was trained on:
    a choice, not an error (runs do not inherit ``upright``), so it is said, not refused."""
    if before != now:
        turned = {True: "upright", False: "randomly turned"}
        run.say(f"{source} trained on {turned[before]} shapes; this run draws {turned[now]} ones")


def _take_vae(run: _Run, pipe, config: TestModelConfig, source: Path, device) -> None:
    """Load ``source``'s trained VAE (weights, latent statistics) into the fresh ``pipe``; a VAE of
    other sizes is refused in one line."""
    src = _load(source, device).vae
    diff = vae_mismatch(config, src)
    if diff:
        raise ValueError(f"vae_from {source}: its VAE is not of this run's size ({diff})")
    pipe.vae.load_state_dict(src.state_dict())
    pipe.vae.register_to_config(latents_mean=list(src.config.latents_mean), latents_std=list(src.config.latents_std))
    log_path = training_log_of(source)
    run.data["vae_from"] = {"model": str(source), "log": str(log_path or "")}
    run.say(f"VAE taken from {source}")
    _say_angle_change(run, f"{source}'s VAE", trained_upright(read_training_log(log_path) if log_path else None),
                      run.data["settings"]["upright"])


def config_of(pipe, base: TestModelConfig) -> TestModelConfig:
    """The sizes of a loaded test-model pipeline (to continue training it): its models' from their
    configs, the clips' from ``base``."""
    t, v, te = pipe.transformer.config, pipe.vae.config, pipe.text_encoder.config
    return TestModelConfig(**{**base.model_dump(), "z_dim": v.z_dim, "vae_base_dim": v.base_dim,
                              "vae_dim_mult": tuple(v.dim_mult), "vae_res_blocks": v.num_res_blocks,
                              "patch_size": tuple(t.patch_size), "heads": t.num_attention_heads,
                              "head_dim": t.attention_head_dim, "layers": t.num_layers, "ffn_dim": t.ffn_dim,
                              "freq_dim": t.freq_dim, "text_dim": te.d_model, "text_layers": te.num_layers,
                              "text_heads": te.num_heads, "text_ff": te.d_ff,
                              "flow_shift": float(pipe.scheduler.config.flow_shift)})


def _autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _lr_factor(step: int, warmup: int, frac: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 to 0.1 over the phase's budget."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))


def _set_lr(opt, base_lr: float, step: int, warmup: int, frac: float, max_steps: int | None) -> None:
    """The phase's learning rate at ``step`` (:func:`_lr_factor`); ``frac``, the share of the phase's
    time spent, is raised to the share of ``max_steps`` done where a step count bounds the phase."""
    if max_steps:
        frac = max(frac, step / max_steps)
    for group in opt.param_groups:
        group["lr"] = base_lr * _lr_factor(step, warmup, frac)


def _non_finite(pipe) -> list[str]:
    """The pipeline's models holding a NaN or infinite parameter or buffer."""
    bad = []
    for name in ("transformer", "text_encoder", "vae"):
        model = getattr(pipe, name, None)
        tensors = [] if model is None else [*model.parameters(), *model.buffers()]
        if any(not bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()):
            bad.append(name)
    return bad


def _save(run: _Run, pipe, packed: bool, final: bool = False) -> None:
    """Writes the pipeline (or its pack) over the run's last checkpoint; weights gone non-finite
    (a diverged run) are refused, so the last finite checkpoint stays on disk."""
    bad = _non_finite(pipe)
    if bad:
        run.data["diverged"] = {"elapsed": round(run.elapsed(), 1), "models": bad}
        run.write()
        # the VAE trains at --vae-lr, the transformer and the text encoder at --lr
        rates = [flag for flag, models in (("--lr", {"transformer", "text_encoder"}), ("--vae-lr", {"vae"}))
                 if models & set(bad)]
        raise FloatingPointError(f"training diverged: non-finite weights in the {' and '.join(bad)} at "
                                 f"{run.elapsed():.0f} s; not saved (the run's last checkpoint, if any, is kept; "
                                 f"try a lower {' or '.join(rates)})")
    t = time.perf_counter()
    if packed:
        with tempfile.TemporaryDirectory(prefix="fp4video-testmodel-") as tmp:
            folder = save_pipeline(pipe, Path(tmp) / "pipeline")
            files = pack(folder, run.out, extra={"config": run.data.get("config")})
    else:
        folder = save_pipeline(pipe, run.out / "pipeline")
        files = sorted(p for p in folder.rglob("*.safetensors"))
    run.data["weights_bytes"] = {p.parent.name if not packed else p.stem: p.stat().st_size
                                 for p in files if p.suffix == ".safetensors"}
    run.data["checkpoints"] = run.data.get("checkpoints", 0) + 1
    run.data["last_checkpoint"] = {"elapsed": round(run.elapsed(), 1), "final": final,
                                   "seconds": round(time.perf_counter() - t, 2)}
    run.write()


def _vae_phase(run: _Run, pipe, config: TestModelConfig, s: Settings, device, deadline: float, packed: bool) -> None:
    vae = pipe.vae
    vae.train()
    frozen = [vae.encoder, vae.quant_conv] if s.vae_decoder_only else []
    for module in frozen:
        module.eval().requires_grad_(False)
    trained = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=s.vae_lr, betas=(0.9, 0.99), weight_decay=0.0,
                            **({"fused": True} if device.type == "cuda" else {}))
    offsets = run.offsets()
    gen = torch.Generator(device).manual_seed(_stream(s.seed, "noise", offsets["noise"]))
    start, step, acc, last_log, last_ckpt = run.elapsed(), 0, [], run.elapsed(), run.elapsed()
    budget = max(deadline - start, 1e-9)
    while run.elapsed() < deadline and (s.max_vae_steps is None or step < s.max_vae_steps):
        scenes = sample_scenes(s.vae_batch, seed=_stream(s.seed, "vae", offsets["vae"] + step),
                               shape_weights=s.shape_weights,
                               colour_weights=s.vae_colour_weights, upright=s.upright)
        video, mask = render(scenes, frames=s.vae_frames, height=config.height, width=config.width, device=device)
        _set_lr(opt, s.vae_lr, step, s.warmup_steps, (run.elapsed() - start) / budget, s.max_vae_steps)
        with _autocast(device):
            with torch.set_grad_enabled(not s.vae_decoder_only):
                posterior = vae.encode(video).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen, device=device,
                                                             dtype=posterior.mean.dtype)
            recon = vae.decode(z).sample
        weight = 1 + s.shape_weight * mask
        if s.vae_first_frame_weight != 1:
            weight[:, :, 0] *= s.vae_first_frame_weight
        rec_loss = (weight * (recon.float() - video).abs()).mean() / weight.mean()
        mean, logvar = posterior.mean.float(), posterior.logvar.float()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        loss = rec_loss + s.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        step += 1
        acc.append(torch.stack([loss.detach(), rec_loss.detach(), kl.detach()]))
        now = run.elapsed()
        if now - last_log >= s.log_seconds or run.elapsed() >= deadline:
            l, r, k = torch.stack(acc).mean(0).tolist()
            run.data["curves"]["vae"].append({"step": step, "elapsed": round(now, 2), "loss": l, "recon": r, "kl": k})
            run.say(f"vae step {step} loss {l:.4f} recon {r:.4f} kl {k:.2f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"elapsed {now:.0f}s ({step / max(now - start, 1e-9):.2f} steps/s)")
            acc, last_log = [], now
        if now - last_ckpt >= s.checkpoint_seconds:
            run.data["phases"]["vae"] = {"steps": step, "seconds": round(now - start, 1), "done": False}
            _save(run, pipe, packed)
            last_ckpt = run.elapsed()
    vae.eval()
    for module in frozen:
        module.requires_grad_(True)
    seconds = run.elapsed() - start
    run.data["phases"]["vae"] = {"steps": step, "seconds": round(seconds, 1), "clips": step * s.vae_batch,
                                 "steps_per_second": round(step / max(seconds, 1e-9), 3), "done": True,
                                 "decoder_only": s.vae_decoder_only}
    if not s.vae_decoder_only:  # the encoder changed: so did the latents' statistics
        _latent_statistics(run, pipe, config, s, device)


@torch.no_grad()
def _latent_statistics(run: _Run, pipe, config: TestModelConfig, s: Settings, device) -> None:
    """Set the VAE's latents_mean / latents_std (the pipeline's normalisation) from its latents of
    fresh clips."""
    n = s.stats_clips
    means = []
    for i in range(0, n, s.encode_batch):
        scenes = sample_scenes(min(s.encode_batch, n - i), seed=_stream(s.seed, "stats", i), upright=s.upright)
        video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device=device)
        with _autocast(device):
            means.append(pipe.vae.encode(video).latent_dist.mean.float())
    mu = torch.cat(means).transpose(0, 1).flatten(1)  # (z, everything else)
    mean, std = mu.mean(1), mu.std(1).clamp_min(1e-4)
    pipe.vae.register_to_config(latents_mean=[round(float(x), 5) for x in mean],
                                latents_std=[round(float(x), 5) for x in std])
    run.data["latent_statistics"] = {"clips": n, "mean": pipe.vae.config.latents_mean,
                                     "std": pipe.vae.config.latents_std}


def _default_statistics(pipe) -> bool:
    """Whether the VAE's latents_mean / latents_std are still the fresh model's zeros and ones."""
    cfg = pipe.vae.config
    return all(m == 0 for m in cfg.latents_mean) and all(s == 1 for s in cfg.latents_std)


def _normalizer(pipe, device):
    mean = torch.tensor(pipe.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    return mean, std


def grow_blocks(transformer, extra: int) -> list[int]:
    """Add ``extra`` blocks to a ``WanTransformer3DModel``, each a copy of one of its blocks placed
    right after it (the blocks copied spread evenly over the depth; more copies than blocks copy each
    several times), with the three output projections that write into the residual stream (self-
    attention's, cross-attention's, the feed-forward's second linear) set to zero: every new block
    adds exactly zero, so the grown model computes what the given one computes, and training starts
    from its function with more depth. The config's ``num_layers`` follows (the model saves and loads
    at its new depth). Returns the indices, in the given model, of the blocks copied."""
    import copy

    blocks = transformer.blocks
    n = len(blocks)
    if extra < 0:
        raise ValueError(f"grow_blocks: extra must be >= 0, got {extra}")
    copied = [min(n - 1, (2 * j + 1) * n // (2 * extra)) for j in range(extra)]
    grown = []
    for i, block in enumerate(blocks):
        grown.append(block)
        for _ in range(copied.count(i)):
            new = copy.deepcopy(block)
            with torch.no_grad():  # diffusers' FeedForward: net = [projection and GELU, dropout, output linear]
                for layer in (new.attn1.to_out[0], new.attn2.to_out[0], new.ffn.net[2]):
                    layer.weight.zero_()
                    if layer.bias is not None:
                        layer.bias.zero_()
            grown.append(new)
    transformer.blocks = torch.nn.ModuleList(grown)
    transformer.register_to_config(num_layers=len(grown))
    return copied


@torch.no_grad()
def overwrite_oldest(pool: tuple, fresh: tuple, oldest: int) -> int:
    """Write the rows of each ``fresh`` tensor over the rows of its ``pool`` tensor from row
    ``oldest`` on, wrapping around (a ring: the pool's oldest clips go first); None entries are
    skipped. Returns the row that is now the oldest."""
    rows = len(pool[0])
    k = len(fresh[0])
    if not 0 < k <= rows:
        raise ValueError(f"{k} fresh clips for a pool of {rows}")
    slots = (oldest + torch.arange(k, device=pool[0].device)) % rows
    for old, new in zip(pool, fresh):
        if old is not None:
            old[slots] = new.to(old.device, old.dtype)
    return (oldest + k) % rows


@torch.no_grad()
def _encode_clips(pipe, config: TestModelConfig, s: Settings, device, count: int, seed: int,
                  keep: int | None = None):
    """(latents normalized, token ids, text masks, the shape's latent coverage or None) of ``count``
    fresh clips drawn from ``seed`` (the first ``keep`` of them where given: a draw's clips depend on
    its count); latents and coverage in bfloat16 on CUDA."""
    mean, std = _normalizer(pipe, device)
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    scenes = sample_scenes(count, seed=seed, shape_weights=s.shape_weights, upright=s.upright)
    if keep is not None and keep < count:
        scenes = scenes.subset(torch.arange(keep))
    video, cover = render(scenes, frames=config.frames, height=config.height, width=config.width, device=device)
    with _autocast(device):
        mu = pipe.vae.encode(video).latent_dist.mean.float()
    cover = latent_cover(cover, mu.shape).to(store) if s.shape_loss_weight else None
    ids, masks = tokenize(pipe.tokenizer, scenes.captions(), config.max_sequence_length)
    return ((mu - mean) / std).to(store), ids.to(device), masks.to(device), cover


@torch.no_grad()
def pool_clips(pipe, config: TestModelConfig, settings: Settings, first: int, count: int, device):
    """Clips 0 to ``count`` - 1 of the latent pool a run of ``settings`` (its seed, encode batch,
    pool size and shape weights) builds from pool-stream index ``first`` (the run's
    ``data_offsets(...)["pool"]``, 0 for a fresh run), drawn in the pool's own batches: the same
    clips. Returns (latents normalized, token ids, text masks, the shape's latent coverage), the
    latents and coverage in bfloat16 on CUDA."""
    if not 0 < count <= settings.pool_size:
        raise ValueError(f"pool_clips: count must be in 1..{settings.pool_size} (the pool's size), got {count}")
    device = torch.device(device)
    s = settings.model_copy(update={"shape_loss_weight": 1.0})  # coverage wanted; the draws do not depend on it
    parts = []
    for n in range(0, count, s.encode_batch):
        b = min(s.encode_batch, s.pool_size - n)  # the batch _build_pool draws here
        parts.append(_encode_clips(pipe, config, s, device, b, _stream(s.seed, "pool", first + n), keep=count - n))
    return tuple(torch.cat(p) for p in zip(*parts))


@torch.no_grad()
def _build_pool(run: _Run, pipe, config: TestModelConfig, s: Settings, device, deadline: float):
    """Latents (normalized, bfloat16 on CUDA), token ids, text masks and, where the transformer's
    loss weighs the shape (``shape_loss_weight`` > 0), the shape's coverage of the latent grid
    (:func:`latent_cover`; else None) of as many fresh clips as fit before ``deadline`` (at least
    one encode batch, at most ``pool_size``). Every run builds its pool afresh, a resumed one from
    clips its predecessors never drew (:func:`data_offsets`)."""
    latents, ids, masks, covers = [], [], [], []
    start, n, first = run.elapsed(), 0, run.offsets()["pool"]
    while n < s.pool_size and (n == 0 or run.elapsed() < deadline):
        b = min(s.encode_batch, s.pool_size - n)
        lat, i, m, cover = _encode_clips(pipe, config, s, device, b, _stream(s.seed, "pool", first + n))
        latents.append(lat)
        ids.append(i)
        masks.append(m)
        if cover is not None:
            covers.append(cover)
        n += b
    seconds = run.elapsed() - start
    run.data["phases"]["pool"] = {"clips": n, "seconds": round(seconds, 1),
                                  "clips_per_second": round(n / max(seconds, 1e-9), 1)}
    covers = torch.cat(covers) if covers else None
    if covers is not None:
        run.data["phases"]["pool"]["shape_cover"] = round(float((covers > 0).float().mean()), 4)
    run.say(f"latent pool: {n} clips in {seconds:.0f}s")
    return torch.cat(latents), torch.cat(ids), torch.cat(masks), covers


class _Ema:
    """An exponential moving average of the transformer's and text encoder's parameters and
    buffers (torch's ``AveragedModel``), started from the weights training starts from: after n
    steps it is Σ d^(n-i) (1 - d) w_i + d^n w_0. ``swap`` exchanges the averaged and the trained
    values in place (the pipeline's modules stay the same objects)."""

    def __init__(self, transformer, text_encoder, decay: float):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.live = torch.nn.ModuleList([transformer, text_encoder])
        self.avg = AveragedModel(self.live, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.avg.update_parameters(self.live)  # the first call copies: the average starts at w_0

    def update(self) -> None:
        self.avg.update_parameters(self.live)

    @torch.no_grad()
    def swap(self) -> None:
        live = list(self.live.parameters()) + list(self.live.buffers())
        avg = list(self.avg.module.parameters()) + list(self.avg.module.buffers())
        for a, b in zip(live, avg):
            tmp = a.detach().clone()
            a.copy_(b)
            b.copy_(tmp)

    @contextlib.contextmanager
    def swapped(self):
        self.swap()
        try:
            yield
        finally:
            self.swap()


def _transformer_phase(run: _Run, pipe, config: TestModelConfig, s: Settings, device, deadline: float,
                       packed: bool) -> _Ema | None:
    pool_deadline = run.elapsed() + s.pool_share * max(deadline - run.elapsed(), 0.0)
    latents, ids, masks, covers = _build_pool(run, pipe, config, s, device, pool_deadline)
    if s.shape_loss_weight and covers is None:
        raise ValueError("shape_loss_weight > 0 needs a latent pool built with the shape's coverage")
    empty_ids, empty_mask = (t.to(device) for t in tokenize(pipe.tokenizer, [""], config.max_sequence_length))
    transformer, text_encoder = pipe.transformer, pipe.text_encoder
    transformer.train()
    text_encoder.train()
    model = torch.compile(transformer) if s.compile else transformer
    params = [p for m in (transformer, text_encoder) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.99), weight_decay=0.0,
                            **({"fused": True} if device.type == "cuda" else {}))
    offsets = run.offsets()
    gen = torch.Generator(device).manual_seed(_stream(s.seed, "noise", offsets["noise"] + 1))
    next_clip, oldest, refreshed = offsets["pool"] + len(latents), 0, 0  # refreshed clips continue the pool's stream
    ema = _Ema(transformer, text_encoder, s.ema_decay) if s.ema_decay > 0 else None
    shift = config.flow_shift if s.train_shift is None else s.train_shift
    start, step, acc, last_log, last_ckpt = run.elapsed(), 0, [], run.elapsed(), run.elapsed()
    budget = max(deadline - start, 1e-9)
    while run.elapsed() < deadline and (s.max_steps is None or step < s.max_steps):
        b = s.batch
        idx = torch.randint(len(latents), (b,), generator=gen, device=device)
        x0 = latents[idx].float()
        ids_b, mask_b = ids[idx], masks[idx]
        drop = torch.rand(b, generator=gen, device=device) < s.caption_dropout
        ids_b = torch.where(drop[:, None], empty_ids, ids_b)
        mask_b = torch.where(drop[:, None], empty_mask, mask_b)
        u = torch.rand(b, generator=gen, device=device)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        xt, timestep, target = flow_sample(x0, noise, u, shift)
        pad_to = 512 if s.long_text_every and step % s.long_text_every == s.long_text_every - 1 else None
        _set_lr(opt, s.lr, step, s.warmup_steps, (run.elapsed() - start) / budget, s.max_steps)
        with _autocast(device):
            text = text_embeddings(text_encoder, ids_b, mask_b, pad_to)
            pred = model(hidden_states=xt, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        loss = flow_loss(pred, target, covers[idx] if covers is not None else None, s.shape_loss_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if ema is not None:
            ema.update()
        step += 1
        acc.append(loss.detach())
        if s.pool_refresh and run.elapsed() < deadline and (s.max_steps is None or step < s.max_steps):
            k = min(s.pool_refresh, len(latents))  # a pool cut short by its time share holds fewer
            fresh = [_encode_clips(pipe, config, s, device, min(s.encode_batch, k - i),
                                   _stream(s.seed, "pool", next_clip + i)) for i in range(0, k, s.encode_batch)]
            fresh = tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*fresh))
            oldest = overwrite_oldest((latents, ids, masks, covers), fresh, oldest)
            next_clip, refreshed = next_clip + k, refreshed + k
        now = run.elapsed()
        if now - last_log >= s.log_seconds or now >= deadline:
            l = float(torch.stack(acc).mean())
            run.data["curves"]["transformer"].append({"step": step, "elapsed": round(now, 2), "loss": l})
            run.say(f"transformer step {step} loss {l:.4f} lr {opt.param_groups[0]['lr']:.2e} elapsed {now:.0f}s "
                    f"({step / max(now - start, 1e-9):.2f} steps/s, batch {b})")
            acc, last_log = [], now
        if now - last_ckpt >= s.checkpoint_seconds:
            run.data["phases"]["transformer"] = {"steps": step, "seconds": round(now - start, 1),
                                                 "refreshed_clips": refreshed, "done": False}
            transformer.eval()
            text_encoder.eval()
            with ema.swapped() if ema is not None else contextlib.nullcontext():
                _save(run, pipe, packed)
            transformer.train()
            text_encoder.train()
            last_ckpt = run.elapsed()
    transformer.eval()
    text_encoder.eval()
    seconds = run.elapsed() - start
    run.data["phases"]["transformer"] = {
        "steps": step, "seconds": round(seconds, 1), "batch": s.batch, "samples": step * s.batch,
        "steps_per_second": round(step / max(seconds, 1e-9), 3),
        "pool_epochs": round(step * s.batch / max(len(latents), 1), 2), "refreshed_clips": refreshed,
        "distinct_clips": len(latents) + refreshed, "done": True}
    if ema is None:
        return None
    ema.swap()  # from here on the pipeline holds the averaged weights (saved, evaluated)
    run.data["phases"]["transformer"]["ema_decay"] = s.ema_decay
    return ema


@torch.no_grad()
def generate(pipe, captions: list[str], call: dict, seed: int, device, batch: int = 8) -> torch.Tensor:
    """Clips of ``captions`` (B, T, H, W, 3) in [0, 1], clip i from generator seed ``seed + i``."""
    out = []
    for start in range(0, len(captions), batch):
        part = captions[start:start + batch]
        gens = [torch.Generator(device).manual_seed(seed + start + i) for i in range(len(part))]
        frames = pipe(prompt=part, generator=gens, output_type="pt", **call).frames  # (B, T, 3, H, W) in [0, 1]
        out.append(frames.float().permute(0, 1, 3, 4, 2).cpu())
    return torch.cat(out)


#: What :func:`evaluate` checks: the held-out combinations, or combinations training draws.
EVAL_COMBINATIONS = ("held-out", "training")


def eval_scenes(clips: int, seed: int, combinations: str = "held-out", upright: bool = False):
    """The scenes :func:`evaluate` checks: ``clips`` of the :data:`~.scenes.HELD_OUT` combinations
    (each in turn, parameters from ``seed``), or ``clips`` combinations training draws (from ``seed``)
    with the camera still, as the held-out ones have it. A rate on the second set beside the first
    tells a model that has not learned a word from one that has not generalised it. ``upright``:
    the shapes start at angle 0, as a model trained with :attr:`Settings.upright` saw them (the
    captions, and so the generated clips, are the same either way)."""
    if combinations == "held-out":
        return held_out_scenes(seed=seed, repeats=max(1, math.ceil(clips / 24)),
                               upright=upright).subset(torch.arange(clips))
    if combinations != "training":
        raise ValueError(f"combinations: {combinations!r}, not one of {', '.join(EVAL_COMBINATIONS)}")
    specs = [SceneSpec(**{**spec.model_dump(), "camera": "still"}) for spec in sample_scenes(clips, seed=seed).specs]
    return sample_scenes(clips, seed=seed, specs=specs, upright=upright)


@torch.no_grad()
def evaluate(pipe, config: TestModelConfig, *, clips: int, call: dict, seed: int, device,
             combinations: str = "held-out", upright: bool = False) -> dict:
    """The motion checker's rate on ``clips`` captions of :func:`eval_scenes` (held-out ones unless
    ``combinations`` is ``"training"``): ground-truth renders, their VAE reconstructions and the
    model's generations. Returns the rates, the clips (``_frames``) and the scenes' specs (``_specs``)."""
    scenes = eval_scenes(clips, seed, combinations, upright)
    video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device=device)
    truth = clip_frames(video)
    with _autocast(device):
        recon = torch.cat([pipe.vae.decode(pipe.vae.encode(v[None].to(pipe.vae.dtype)).latent_dist.mean).sample.float()
                           for v in video])
    recon = clip_frames(recon)
    generated = generate(pipe, scenes.captions(), call, seed, device)
    result = {"captions": scenes.captions(), "call": call, "seed": seed, "combinations": combinations,
              "upright": upright}
    for name, frames in (("ground_truth", truth), ("vae_reconstruction", recon), ("generated", generated)):
        result[name] = check_rate(list(frames), scenes.specs)
    result["_frames"] = {"ground_truth": truth, "generated": generated}
    result["_specs"] = scenes.specs
    return result


def _samples_png(frames: dict, path: Path, rows: int = 8) -> None:
    """Rows of clips: ground truth then generated, first, middle and last frames."""
    from PIL import Image

    truth, gen = frames["ground_truth"][:rows], frames["generated"][:rows]
    if not len(truth):
        return
    t = truth.shape[1]
    pick = [0, t // 2, t - 1]
    tiles = []
    for a, b in zip(truth, gen):
        tiles.append(torch.cat([a[i] for i in pick] + [torch.ones_like(a[0][:, :4])] + [b[i] for i in pick], 1))
    grid = (torch.cat(tiles, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    Image.fromarray(grid).save(path)


def _environment(device) -> dict:
    import diffusers
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _precision_switches() -> list[tuple[object, str]]:
    """The process-wide switches of TF32 and cuDNN's autotuning, as (object, attribute): torch's
    ``fp32_precision`` settings where it has them (reading the legacy ``allow_tf32`` flags after
    those were set is an error there), else the legacy flags."""
    cudnn = torch.backends.cudnn
    if hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None),
                                                                          "fp32_precision"):
        return [(torch.backends.cuda.matmul, "fp32_precision"), (cudnn.conv, "fp32_precision"), (cudnn, "benchmark")]
    return [(torch.backends.cuda.matmul, "allow_tf32"), (cudnn, "allow_tf32"), (cudnn, "benchmark")]


@contextlib.contextmanager
def _fast_cuda_kernels(device):
    """TF32 matmuls and convolutions and cuDNN's autotuning while a run trains on a GPU; the
    process's settings are put back when it ends (a caller's later work keeps its own precision)."""
    if device.type != "cuda":
        yield
        return
    switches = _precision_switches()
    saved = [getattr(obj, name) for obj, name in switches]
    for obj, name in switches:
        setattr(obj, name, True if name != "fp32_precision" else "tf32")
    try:
        yield
    finally:
        for (obj, name), value in zip(switches, saved):
            setattr(obj, name, value)


def train(settings: Settings, out, *, resume=None, packed: bool = False, device=None, git: dict | None = None,
          log=print, started: float | None = None) -> dict:
    """Run the training ``settings`` describe, writing under ``out`` as it goes; returns the log.
    ``started``: the ``time.perf_counter()`` the budget counts from (default: now)."""
    if settings.grow_layers and resume is None:
        raise ValueError("grow_layers adds blocks to a resumed model: a fresh run's depth is layers")
    if settings.vae_decoder_only and (resume is None or settings.vae_minutes == 0):
        raise ValueError("vae_decoder_only trains a resumed model's VAE decoder: give resume and vae_minutes > 0")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with _fast_cuda_kernels(device):
        return _train(settings, out, resume=resume, packed=packed, device=device, git=git, log=log, started=started)


def _train(settings: Settings, out, *, resume, packed: bool, device: torch.device, git: dict | None, log,
           started: float | None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    s = settings
    run = _Run(out, log, {"settings": s.model_dump(), "environment": _environment(device), "git": git or {},
                          "resumed_from": str(resume) if resume else None}, started)
    deadline = s.minutes * 60 - s.reserve_seconds
    if resume is not None:
        resume = Path(resume)
        log_path = training_log_of(resume)
        if log_path is not None:
            run.data["previous_log"] = read_training_log(log_path)
            _say_angle_change(run, str(resume), trained_upright(run.data["previous_log"]), s.upright)
        else:  # what its training drew is unknown: the streams start at 0 (the script asks for a seed)
            run.data["resumed_without_log"] = True
            run.say(f"{resume} holds no training log: this run draws seed {s.seed}'s streams from their start")
        pipe = _load(resume, device)
        if s.grow_layers:
            before = pipe.transformer.config.num_layers
            copied = grow_blocks(pipe.transformer, s.grow_layers)
            run.data["grown"] = {"layers_before": before, "layers_after": pipe.transformer.config.num_layers,
                                 "blocks_copied": copied}
            total = sum(parameter_counts(pipe).values())
            run.say(f"transformer grown from {before} to {pipe.transformer.config.num_layers} blocks (copies of "
                    f"blocks {copied}, their outputs zero): {total / 1e6:.2f} M parameters in all, "
                    f"{2 * total / 1e6:.1f} MB in fp16")
        config = config_of(pipe, SMOKE if s.smoke else FULL)
    else:
        config = fresh_config(s)
        pipe = build_pipeline(config, seed=s.seed).to(device)
        if s.vae_from is not None:
            _take_vae(run, pipe, config, Path(s.vae_from), device)
    run.data["data_offsets"] = run.offsets()
    pipe.set_progress_bar_config(disable=True)
    counts = parameter_counts(pipe)
    run.data.update(config=config.model_dump(), video_tokens=config.video_tokens, parameters=counts)
    run.say(f"test model: {config.video_tokens} video tokens per clip ({config.height}×{config.width}, "
            f"{config.frames} frames), parameters " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in counts.items())
            + f"; device {device}; budget {s.minutes:g} min")
    run.write()
    if s.vae_minutes > 0 and (s.max_vae_steps is None or s.max_vae_steps > 0):
        _vae_phase(run, pipe, config, s, device, min(s.vae_minutes * 60, deadline), packed)
        _save(run, pipe, packed)
    elif resume is None and s.vae_from is None:
        raise ValueError("a fresh run trains its VAE first: give --vae-minutes > 0 (or --resume a trained model, "
                         "or --vae-from one)")
    elif _default_statistics(pipe):  # a checkpoint from within the VAE's training: its statistics not yet set
        _latent_statistics(run, pipe, config, s, device)
    ema = _transformer_phase(run, pipe, config, s, device, deadline, packed)
    _save(run, pipe, packed, final=True)
    if s.eval_clips:
        call = call_for(config, s.eval_steps, s.eval_guidance)
        t = time.perf_counter()
        result = evaluate(pipe, config, clips=s.eval_clips, call=call, seed=s.eval_seed, device=device,
                          upright=s.upright)
        frames, specs = result.pop("_frames"), result.pop("_specs")
        result["seconds"] = round(time.perf_counter() - t, 1)
        run.data["evaluation"] = result
        _samples_png(frames, out / "samples.png")
        if ema is not None:  # the trained weights beside their average, on the same captions and seeds
            with ema.swapped():
                frames_raw = generate(pipe, result["captions"], call, s.eval_seed, device)
            result["generated_without_ema"] = check_rate(list(frames_raw), specs)
            w = result["generated_without_ema"]
            run.say(f"held-out motion check without the average: generated {w['rate']:.0%} of {w['clips']} "
                    f"(colour {w['colour']:.0%}, shape {w['shape']:.0%}, motion {w['motion']:.0%})")
        g, gt, rc = result["generated"], result["ground_truth"], result["vae_reconstruction"]
        run.say(f"held-out motion check: generated {g['rate']:.0%} of {g['clips']} (colour {g['colour']:.0%}, "
                f"shape {g['shape']:.0%}, motion {g['motion']:.0%}); ground truth {gt['rate']:.0%}, VAE "
                f"reconstructions {rc['rate']:.0%}")
        run.say(f"shapes drawn, per captioned shape: {describe_shapes(g)}")
    run.data["elapsed"] = round(run.elapsed(), 1)
    run.write()
    run.say(f"done in {run.elapsed():.0f}s: {out}")
    return run.data
