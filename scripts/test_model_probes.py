"""Where a trained test model loses what its caption says: two probes of a saved model.

    python scripts/test_model_probes.py seen-unseen --out probes                  # the shipped weights, 128 clips a set
    python scripts/test_model_probes.py partial --out probes --t0 0 0.6 0.8 0.9 1
    python scripts/test_model_probes.py partial --out probes --t0 1 --negative-shape circle

``seen-unseen``: the transformer's flow-matching loss at fixed noise levels (``--u``, the training's
uniform draw before the shift; the shifted t is recorded beside it) on the first ``--clips`` clips of
the latent pool the model's last training run built (its seed, encode batch, pool size, shape
weights and the pool stream's start, read from its training log; for a model without a log, a
fresh run's of ``--pool-seed``, 0 by default) and on as many clips from the same stream far past them (``--fresh-offset``). Clip i of
both sets gets the same noise, so the per-clip difference is paired. A lower loss on the pool's
clips says the transformer memorised them; a paired difference within its standard error says it
fits seen and unseen clips alike. On all latent cells and on the cells the shape covers.

``partial``: the held-out captions' true clips, encoded, noised to the first sigma of the sampler's
grid at or below ``t0`` and denoised from there by a copy of the pipeline's own scheduler (UniPC,
``--steps`` from pure noise, classifier-free guidance as WanPipeline applies it), then decoded and
checked. ``t0`` = 1 starts from pure noise with the pipeline's noise and is the pipeline's own
generation; ``t0`` = 0 is the VAE's round trip; the highest ``t0`` from which the captioned shape
still comes out is where the model decides it (the per-clip verdicts are kept).
``--negative-shape NAME`` guides away from the caption with that shape word (a caption of that
shape gets "square", or "circle" for squares) instead of the empty caption: if the shape still does
not come out, the model's prediction does not tell the shapes apart.

CPU or GPU (``--device``); float32. Writes ``<probe>.json`` into ``--out`` and prints a line per result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import fp4video  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))


def seen_unseen(pipe, config, settings, first: int, *, clips: int, fresh_offset: int, us, seed: int, device,
                batch: int = 8, log=print) -> dict:
    """The flow-matching loss on the first ``clips`` clips of the pool a run of ``settings`` builds
    from pool-stream index ``first`` and on ``clips`` from ``fresh_offset`` on, per ``u``: each
    set's mean and standard error over its clips, the mean over the shape's latent cells, and the
    paired per-clip difference (pool - fresh) with its standard error. Clip i of both sets gets
    the noise of generator ``seed`` (one draw)."""
    from fp4video.testmodel.model import text_embeddings
    from fp4video.testmodel.train import flow_sample, pool_clips

    sets = {}
    for name, start in (("pool", first), ("fresh", fresh_offset)):
        sets[name] = pool_clips(pipe, config, settings, start, clips, device)
        log(f"{name}: {clips} clips encoded (pool stream of seed {settings.seed} from {start})")
    noise = torch.randn(sets["pool"][0].shape, generator=torch.Generator().manual_seed(seed)).to(device)
    out = {}
    for u in us:
        row, per = {}, {}
        for name, (lat, ids, masks, cover) in sets.items():
            lat = lat.float()
            xt, timestep, target = flow_sample(lat, noise, torch.full((len(lat),), float(u), device=device),
                                               config.flow_shift)
            per_clip, shape_err, shape_w = [], 0.0, 0.0
            for i in range(0, len(lat), batch):
                text = text_embeddings(pipe.text_encoder, ids[i:i + batch], masks[i:i + batch])
                pred = pipe.transformer(hidden_states=xt[i:i + batch], timestep=timestep[i:i + batch],
                                        encoder_hidden_states=text, return_dict=False)[0]
                err = (pred.float() - target[i:i + batch]).pow(2)
                w = cover[i:i + batch].float().expand_as(err)
                per_clip.append(err.flatten(1).mean(1))
                shape_err, shape_w = shape_err + float((w * err).sum()), shape_w + float(w.sum())
            per[name] = torch.cat(per_clip).double()
            row[name] = {"loss": float(per[name].mean()), "se": float(per[name].std() / len(per[name]) ** 0.5),
                         "shape_cells": shape_err / max(shape_w, 1e-12)}
        diff = per["pool"] - per["fresh"]
        row["t"] = float(timestep[0]) / 1000
        row["paired_difference"] = {"mean": float(diff.mean()), "se": float(diff.std() / len(diff) ** 0.5)}
        out[str(u)] = row
        p, f, d = row["pool"], row["fresh"], row["paired_difference"]
        log(f"u {u} (t {row['t']:.3f}): pool {p['loss']:.4f} ± {p['se']:.4f} (shape cells {p['shape_cells']:.4f}), "
            f"fresh {f['loss']:.4f} ± {f['se']:.4f} (shape cells {f['shape_cells']:.4f}); pool - fresh "
            f"{d['mean']:+.4f} ± {d['se']:.4f}")
    return out


def negative_captions(specs, shape: str) -> list[str]:
    """Each caption with its shape word replaced by ``shape`` (by "square" where it is ``shape``,
    by "circle" where both are "square")."""
    from fp4video.testmodel.scenes import SceneSpec

    def other(spec):
        if spec.shape != shape:
            return shape
        return "circle" if shape == "square" else "square"

    return [SceneSpec(**{**spec.model_dump(), "shape": other(spec)}).caption for spec in specs]


def denoise_from(pipe, config, scenes, t0: float, *, steps: int, guidance: float, seed: int, device,
                 negative: list[str] | None = None) -> tuple[torch.Tensor, float]:
    """The ``scenes``' clips (B, T, H, W, 3) in [0, 1] and the sigma they started from: their latents
    (the VAE's mean, normalized as the pool's) noised to the first sigma of a ``steps``-step grid of
    the pipeline's scheduler at or below ``t0``, with clip i's noise from generator ``seed + i`` (the
    pipeline's draw), then the scheduler's remaining steps under guidance against the empty caption
    (or ``negative``'s captions), as WanPipeline computes them; decoded."""
    import copy

    from fp4video.testmodel.model import text_embeddings, tokenize
    from fp4video.testmodel.scenes import render
    from fp4video.testmodel.train import clip_frames

    scheduler = copy.deepcopy(pipe.scheduler)  # the pipeline's own stays as it is
    scheduler.set_timesteps(steps, device=device)
    sigmas = scheduler.sigmas.tolist()
    begin = next((i for i in range(len(scheduler.timesteps)) if sigmas[i] <= t0 + 1e-9), len(scheduler.timesteps))
    sigma = sigmas[begin] if begin < len(scheduler.timesteps) else 0.0
    mean = torch.tensor(pipe.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device=device)
    ids, mask = tokenize(pipe.tokenizer, scenes.captions(), config.max_sequence_length)
    cond = text_embeddings(pipe.text_encoder, ids.to(device), mask.to(device))
    negative = [""] * len(scenes.specs) if negative is None else negative
    n_ids, n_mask = tokenize(pipe.tokenizer, negative, config.max_sequence_length)
    uncond = text_embeddings(pipe.text_encoder, n_ids.to(device), n_mask.to(device))
    clips = []
    for i in range(len(scenes.specs)):
        x0 = (pipe.vae.encode(video[i:i + 1]).latent_dist.mean - mean) / std
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed + i)).to(device)
        x = x0 if sigma == 0 else (1 - sigma) * x0 + sigma * eps
        scheduler.set_timesteps(steps, device=device)  # a fresh multistep history per clip
        scheduler.set_begin_index(begin)
        for t in scheduler.timesteps[begin:]:
            tt = t.expand(1)
            vc = pipe.transformer(hidden_states=x, timestep=tt, encoder_hidden_states=cond[i:i + 1],
                                  return_dict=False)[0]
            if guidance > 1:  # WanPipeline guides only above 1; at or below it takes the caption's prediction
                vu = pipe.transformer(hidden_states=x, timestep=tt, encoder_hidden_states=uncond[i:i + 1],
                                      return_dict=False)[0]
                vc = vu + guidance * (vc - vu)
            x = scheduler.step(vc, t, x, return_dict=False)[0]
        clips.append(clip_frames(pipe.vae.decode(x * std + mean).sample)[0])
    return torch.stack(clips), sigma


def partial(pipe, config, scenes, t0s, *, steps: int, guidance: float, seed: int, device,
            negative_shape: str | None = None, log=print) -> dict:
    """The checker's result of :func:`denoise_from` at each ``t0``, with each clip's verdict."""
    from fp4video.testmodel.checker import check_rate, describe_shapes

    negative = negative_captions(scenes.specs, negative_shape) if negative_shape else None
    out = {}
    for t0 in t0s:
        t = time.perf_counter()
        clips, sigma = denoise_from(pipe, config, scenes, t0, steps=steps, guidance=guidance, seed=seed,
                                    device=device, negative=negative)
        r = check_rate(list(clips), scenes.specs)
        out[str(t0)] = {"sigma": sigma, **{k: r[k] for k in ("rate", "colour", "shape", "motion", "clips", "by_shape")},
                        "verdicts": [{"caption": c, **{k: v.get(k) for k in ("passed", "colour", "shape", "motion",
                                                                             "shape_drawn", "reason")}}
                                     for c, v in zip(scenes.captions(), r["verdicts"])]}
        log(f"t0 {t0} (sigma {sigma:.3f}): pass {r['rate']:.0%} (colour {r['colour']:.0%}, shape {r['shape']:.0%}, "
            f"motion {r['motion']:.0%}); {describe_shapes(r)} [{time.perf_counter() - t:.0f} s]")
    return out


#: Each probe's own options (given to the other probe, they are refused).
_OWN = {"seen-unseen": ("pool_seed", "pool_first", "fresh_offset", "u"),
        "partial": ("t0", "steps", "guidance", "negative_shape", "upright")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("probe", choices=list(_OWN))
    p.add_argument("--out", type=Path, required=True, help="folder for <probe>.json")
    p.add_argument("--model", default="shipped", help="a test-model pipeline folder or pack, or 'shipped'")
    p.add_argument("--smoke", action="store_true", help="the model is a --smoke run's (its clip sizes)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--clips", type=int, help="seen-unseen: clips a set (default 128, at least 2); partial: held-out "
                   "captions (default 24)")
    p.add_argument("--seed", type=int, default=1234, help="the noise's generator seed, and the held-out scenes' "
                   "parameters (default: the training evaluation's)")
    p.add_argument("--pool-seed", type=int, help="seen-unseen: the seed of the run whose pool is probed (default: its "
                   "training log's, else 0)")
    p.add_argument("--pool-first", type=int, help="seen-unseen: the pool stream's start (default: its training "
                   "log's, else 0)")
    p.add_argument("--fresh-offset", type=int, help="seen-unseen: the stream index the unseen clips start at "
                   "(default 5,000,000, past any run's pool)")
    p.add_argument("--u", type=float, nargs="+", help="seen-unseen: noise levels, as the training's uniform draw "
                   "before the shift (default 0.1 0.5 0.9)")
    p.add_argument("--t0", type=float, nargs="+", help="partial: start times (default 0 0.6 0.8 0.9 1)")
    p.add_argument("--steps", type=int, help="partial: the scheduler's steps from pure noise (default "
                   "TEST_MODEL_CALL's)")
    p.add_argument("--guidance", type=float, help="partial: default TEST_MODEL_CALL's")
    p.add_argument("--upright", action=argparse.BooleanOptionalAction, default=None,
                   help="partial: the true clips' shapes at angle 0 (or, --no-upright, turned; default: as the "
                   "model's training log says, turned without a log)")
    p.add_argument("--negative-shape", choices=["square", "circle", "triangle", "bar"],
                   help="partial: guide away from the caption with this shape word")
    args = p.parse_args(argv)
    other = next(probe for probe in _OWN if probe != args.probe)
    for name in _OWN[other]:
        if getattr(args, name) is not None:
            p.error(f"--{name.replace('_', '-')} is the {other} probe's option, not {args.probe}'s")
    minimum = 2 if args.probe == "seen-unseen" else 1
    if args.clips is not None and args.clips < minimum:
        p.error(f"--clips must be at least {minimum}, got {args.clips}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    for name in ("t0", "u"):
        bad = [v for v in getattr(args, name) or [] if not 0 <= v <= 1]
        if bad:
            p.error(f"--{name} {bad[0]:g}: must be in [0, 1]")
    for name in ("pool_seed", "pool_first", "fresh_offset", "seed"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.guidance is not None and not args.guidance >= 0:
        p.error(f"--guidance must be >= 0, got {args.guidance}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: a file, not a folder")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        p.error(f"--device {args.device}: {str(e).splitlines()[0]}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")

    from fp4video.testmodel import TEST_MODEL_CALL, WEIGHTS, test_model_pipeline
    from fp4video.testmodel.model import FULL, SMOKE, read_training_log
    from fp4video.testmodel.train import (Settings, config_of, data_offsets, eval_scenes, trained_upright,
                                          training_log_of)

    path = None if args.model == "shipped" else Path(args.model)
    if path is not None and not path.is_dir():
        p.error(f"--model {args.model}: no such folder (a pipeline folder or pack, or 'shipped')")
    try:
        pipe = test_model_pipeline(device=device, dtype=torch.float32, path=path)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"--model {args.model}: {str(e).splitlines()[0]}")
    config = config_of(pipe, SMOKE if args.smoke else FULL)
    record = {"probe": args.probe, "model": args.model, "device": str(device),
              "argv": sys.argv[1:] if argv is None else list(argv)}
    log_path = training_log_of(WEIGHTS if path is None else path)
    try:
        trained = read_training_log(log_path) if log_path is not None else {}
    except ValueError as e:
        p.error(f"--model {args.model}: {e}")
    upright = trained_upright(trained) if args.upright is None else args.upright
    if args.probe == "seen-unseen":
        known = {k: v for k, v in trained.get("settings", {}).items() if k in Settings.model_fields}
        settings = Settings.model_validate({**known, **({"seed": args.pool_seed} if args.pool_seed is not None else {})})
        first = data_offsets(trained.get("previous_log"))["pool"] if args.pool_first is None else args.pool_first
        clips = args.clips or 128
        if clips > settings.pool_size:
            p.error(f"--clips {clips}: the run's pool held {settings.pool_size}")
        record["pool"] = {"seed": settings.seed, "first": first, "encode_batch": settings.encode_batch,
                          "pool_size": settings.pool_size, "shape_weights": settings.shape_weights,
                          "upright": settings.upright,
                          "from_training_log": log_path is not None}
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch.no_grad():
        if args.probe == "seen-unseen":
            result = seen_unseen(pipe, config, settings, first, clips=clips, seed=args.seed,
                                 fresh_offset=5_000_000 if args.fresh_offset is None else args.fresh_offset,
                                 us=args.u or [0.1, 0.5, 0.9], device=device)
        else:
            scenes = eval_scenes(args.clips or 24, args.seed, upright=upright)
            record["upright"] = upright
            result = partial(pipe, config, scenes, args.t0 or [0.0, 0.6, 0.8, 0.9, 1.0],
                             steps=args.steps or TEST_MODEL_CALL["num_inference_steps"],
                             guidance=TEST_MODEL_CALL["guidance_scale"] if args.guidance is None else args.guidance,
                             seed=args.seed, device=device, negative_shape=args.negative_shape)
    record.update(seconds=round(time.perf_counter() - started, 1), results=result)
    (args.out / f"{args.probe}.json").write_text(json.dumps(record, indent=1, allow_nan=False))
    print(f"written: {args.out / (args.probe + '.json')}")
    return 0


if __name__ == "__main__":
    from fp4video.cli.common import quiet_optional_imports

    with quiet_optional_imports():  # torchao's import-time log lines, as the CLI drops them
        code = main()
    sys.exit(code)
