"""Where a trained test model loses what its caption says: two probes of a saved model.

    python scripts/test_model_probes.py seen-unseen --out probes                  # the shipped weights, 128 clips a set
    python scripts/test_model_probes.py partial --out probes --t0 0 0.6 0.8 0.9 1
    python scripts/test_model_probes.py partial --out probes --t0 1 --negative-shape circle

``seen-unseen``: the transformer's flow-matching loss at fixed noise levels (``--u``, the training's
uniform draw before the shift), the same noise for every clip, on clips its training pool held (the
first ``--clips`` of the pool stream of ``--pool-seed``, in the pool's encode batches: what a fresh
run of that seed drew; every run of the shipped chain used seed 0) and on as many clips from the same
stream far past them (``--fresh-offset``), on all latent cells and on the cells the shape covers.
A lower loss on the pool's clips says the transformer memorised them; equal losses, within the
standard errors printed, say it fits seen and unseen clips alike.

``partial``: the held-out captions' true clips, encoded, noised to ``t0`` (the sampler's t) and
denoised from there with Euler steps on the flow-shift grid (``t0`` = 1 takes the ``--steps`` of a
full run, less from lower ``t0``) under classifier-free guidance, then decoded and checked. ``t0`` = 0
is the VAE's round trip; the highest ``t0`` at which the captioned shape still comes out is where the
model decides it. ``--negative-shape NAME`` guides away from the caption with that shape word (a
caption of that shape gets "square", or "circle" for squares) instead of the empty caption: if the
shape still does not come out, the model's prediction does not tell the shapes apart.

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


def seen_unseen(pipe, config, *, clips: int, pool_seed: int, fresh_offset: int, us, device, batch: int = 8,
                log=print) -> dict:
    """The flow-matching loss on the pool's first ``clips`` clips of ``pool_seed`` and on ``clips``
    from ``fresh_offset`` on, per ``u``: mean, standard error over the clips, and the mean over the
    shape's latent cells."""
    from fp4video.testmodel.model import text_embeddings
    from fp4video.testmodel.train import flow_sample, pool_clips

    sets = {}
    for name, first in (("pool", 0), ("fresh", fresh_offset)):
        sets[name] = pool_clips(pipe, config, pool_seed, first, clips, device)
        log(f"{name}: {clips} clips encoded (pool stream of seed {pool_seed} from {first})")
    noise = torch.randn(sets["pool"][0].shape, generator=torch.Generator().manual_seed(7)).to(device)
    out = {}
    for u in us:
        row = {}
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
            per_clip = torch.cat(per_clip)
            row[name] = {"loss": float(per_clip.mean()), "se": float(per_clip.std() / len(per_clip) ** 0.5),
                         "shape_cells": shape_err / max(shape_w, 1e-12)}
        out[str(u)] = row
        p, f = row["pool"], row["fresh"]
        log(f"u {u}: pool {p['loss']:.4f} ± {p['se']:.4f} (shape cells {p['shape_cells']:.4f}), "
            f"fresh {f['loss']:.4f} ± {f['se']:.4f} (shape cells {f['shape_cells']:.4f})")
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
                 negative: list[str] | None = None) -> torch.Tensor:
    """The ``scenes``' clips (B, T, H, W, 3) in [0, 1]: their latents (the VAE's mean) noised to ``t0``
    with clip i's noise from generator seed ``seed + i``, then Euler steps on the shifted grid from
    ``t0`` to 0 under guidance (against the empty caption, or ``negative``'s captions), decoded."""
    from fp4video.testmodel.model import text_embeddings, tokenize
    from fp4video.testmodel.scenes import render
    from fp4video.testmodel.train import clip_frames

    shift = config.flow_shift
    tshift = lambda u: shift * u / (1 + (shift - 1) * u)  # noqa: E731
    u0 = t0 / (shift - (shift - 1) * t0)  # the unshifted u of t0
    n = max(1, round(steps * u0)) if t0 > 0 else 0
    grid = [tshift(u) for u in torch.linspace(u0, 0, n + 1).tolist()] if n else []
    mean = torch.tensor(pipe.vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    video, _ = render(scenes, frames=config.frames, height=config.height, width=config.width, device=device)
    ids, mask = tokenize(pipe.tokenizer, scenes.captions(), config.max_sequence_length)
    cond = text_embeddings(pipe.text_encoder, ids.to(device), mask.to(device))
    if negative is None:
        e_ids, e_mask = tokenize(pipe.tokenizer, [""] * len(scenes.specs), config.max_sequence_length)
    else:
        e_ids, e_mask = tokenize(pipe.tokenizer, negative, config.max_sequence_length)
    uncond = text_embeddings(pipe.text_encoder, e_ids.to(device), e_mask.to(device))
    clips = []
    for i in range(len(scenes.specs)):
        x0 = (pipe.vae.encode(video[i:i + 1]).latent_dist.mean - mean) / std
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed + i)).to(device)
        x = (1 - t0) * x0 + t0 * eps
        for a, b in zip(grid[:-1], grid[1:]):
            t = torch.tensor([1000.0 * a], device=device)
            vc = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=cond[i:i + 1], return_dict=False)[0]
            vu = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=uncond[i:i + 1],
                                  return_dict=False)[0]
            x = x + (b - a) * (vu + guidance * (vc - vu))
        clips.append(clip_frames(pipe.vae.decode(x * std + mean).sample)[0])
    return torch.stack(clips)


def partial(pipe, config, scenes, t0s, *, steps: int, guidance: float, seed: int, device,
            negative_shape: str | None = None, log=print) -> dict:
    """The checker's result of :func:`denoise_from` at each ``t0``."""
    from fp4video.testmodel.checker import check_rate, describe_shapes

    negative = negative_captions(scenes.specs, negative_shape) if negative_shape else None
    out = {}
    for t0 in t0s:
        t = time.perf_counter()
        clips = denoise_from(pipe, config, scenes, t0, steps=steps, guidance=guidance, seed=seed, device=device,
                             negative=negative)
        r = check_rate(list(clips), scenes.specs)
        out[str(t0)] = {k: r[k] for k in ("rate", "colour", "shape", "motion", "clips", "by_shape")}
        log(f"t0 {t0}: pass {r['rate']:.0%} (colour {r['colour']:.0%}, shape {r['shape']:.0%}, motion "
            f"{r['motion']:.0%}); {describe_shapes(r)} [{time.perf_counter() - t:.0f} s]")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("probe", choices=["seen-unseen", "partial"])
    p.add_argument("--out", type=Path, required=True, help="folder for <probe>.json")
    p.add_argument("--model", default="shipped", help="a test-model pipeline folder or pack, or 'shipped'")
    p.add_argument("--smoke", action="store_true", help="the model is a --smoke run's (its clip sizes)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--clips", type=int, help="seen-unseen: clips a set (default 128); partial: held-out captions "
                   "(default 24)")
    p.add_argument("--pool-seed", type=int, default=0, help="seen-unseen: the training run's seed (default 0)")
    p.add_argument("--fresh-offset", type=int, default=5_000_000,
                   help="seen-unseen: the stream index the unseen clips start at (past any run's pool)")
    p.add_argument("--u", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="seen-unseen: noise levels, as the training's uniform draw before the shift")
    p.add_argument("--t0", type=float, nargs="+", default=[0.0, 0.6, 0.8, 0.9, 1.0], help="partial: start times")
    p.add_argument("--steps", type=int, default=None, help="partial: steps from t0 = 1 (default TEST_MODEL_CALL's)")
    p.add_argument("--guidance", type=float, default=None, help="partial: default TEST_MODEL_CALL's")
    p.add_argument("--negative-shape", choices=["square", "circle", "triangle", "bar"],
                   help="partial: guide away from the caption with this shape word")
    p.add_argument("--seed", type=int, default=1234, help="held-out scenes' parameters and the noise (default: "
                   "the training evaluation's)")
    args = p.parse_args(argv)
    if args.clips is not None and args.clips < 1:
        p.error(f"--clips must be at least 1, got {args.clips}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    bad = [v for v in args.t0 if not 0 <= v <= 1]
    if bad:
        p.error(f"--t0 {bad[0]:g}: must be in [0, 1]")
    bad = [v for v in args.u if not 0 <= v <= 1]
    if bad:
        p.error(f"--u {bad[0]:g}: must be in [0, 1]")
    if args.fresh_offset < 0 or args.pool_seed < 0:
        p.error("--fresh-offset and --pool-seed must be >= 0")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: a file, not a folder")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")

    from fp4video.testmodel import TEST_MODEL_CALL, test_model_pipeline
    from fp4video.testmodel.model import FULL, SMOKE
    from fp4video.testmodel.train import config_of, eval_scenes

    path = None if args.model == "shipped" else Path(args.model)
    if path is not None and not path.is_dir():
        p.error(f"--model {args.model}: no such folder (a pipeline folder or pack, or 'shipped')")
    try:
        pipe = test_model_pipeline(device=device, dtype=torch.float32, path=path)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"--model {args.model}: {str(e).splitlines()[0]}")
    config = config_of(pipe, SMOKE if args.smoke else FULL)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with torch.no_grad():
        if args.probe == "seen-unseen":
            result = seen_unseen(pipe, config, clips=args.clips or 128, pool_seed=args.pool_seed,
                                 fresh_offset=args.fresh_offset, us=args.u, device=device)
        else:
            scenes = eval_scenes(args.clips or 24, args.seed)
            result = partial(pipe, config, scenes, args.t0, steps=args.steps or TEST_MODEL_CALL["num_inference_steps"],
                             guidance=TEST_MODEL_CALL["guidance_scale"] if args.guidance is None else args.guidance,
                             seed=args.seed, device=device, negative_shape=args.negative_shape)
    record = {"probe": args.probe, "model": args.model, "device": str(device), "argv": sys.argv[1:] if argv is None
              else list(argv), "seconds": round(time.perf_counter() - started, 1), "results": result}
    (args.out / f"{args.probe}.json").write_text(json.dumps(record, indent=1))
    print(f"written: {args.out / (args.probe + '.json')}")
    return 0


if __name__ == "__main__":
    from fp4video.cli.common import quiet_optional_imports

    with quiet_optional_imports():  # torchao's import-time log lines, as the CLI drops them
        code = main()
    sys.exit(code)
