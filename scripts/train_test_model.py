#!/usr/bin/env python3
"""Train the project's test text-to-video model (fp4video.testmodel) within a wall-clock budget.

    # the H200 run: 8 minutes in all (2 for the VAE), the pipeline packed into a few files
    python3 scripts/train_test_model.py --minutes 8 --vae-minutes 2 --pack --out $OUT/testmodel
    # here, on the CPU: the tiny smoke model, a few steps of each phase (well under a minute)
    python scripts/train_test_model.py --smoke --out /tmp/smoke
    # continue training a saved model (a pipeline folder or a pack); its VAE is kept
    python3 scripts/train_test_model.py --resume $OUT/testmodel --minutes 8 --pack --out $OUT/testmodel2
    # the same with 2 more transformer blocks (copies whose outputs start at zero)
    python3 scripts/train_test_model.py --resume $OUT/testmodel --grow-layers 2 --minutes 8 --pack --out $OUT/deeper
    # first 1.5 minutes on the VAE's decoder alone (the encoder and so the transformer's latents kept)
    python3 scripts/train_test_model.py --resume $OUT/testmodel --vae-minutes 1.5 --vae-decoder-only --minutes 8 \
        --pack --out $OUT/sharper
    # shapes drawn upright (angle 0) instead of at a random angle no caption names
    python3 scripts/train_test_model.py --resume $OUT/testmodel --upright --minutes 8 --pack --out $OUT/upright
    # a pack -> the pipeline folder WanPipeline.from_pretrained loads (the shipped weights' place)
    python scripts/train_test_model.py --unpack run/ --out fp4video/testmodel/weights

The budget counts from the script's start; the VAE trains for ``--vae-minutes`` (reconstruction +
a small KL), then the transformer and the text encoder with flow matching until
``--reserve-seconds`` before the end, which the last save and the held-out evaluation use. Data
are drawn on the device from ``--seed``. Progress lines (step, loss, elapsed) are flushed as they
come; ``--out`` gets the pipeline (a checkpoint every ``--checkpoint-seconds`` and at the end: a
``pipeline/`` folder, or with ``--pack`` ``transformer/vae/text_encoder.safetensors`` and
``model.json``), ``train_log.json``, ``loss.png`` and ``samples.png`` (held-out captions: ground
truth left, generated right). The last line gives the motion checker's rate on the held-out
captions. docs/test-model.md describes the model.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
try:
    import fp4video  # noqa: F401
except ImportError:  # a checkout without an install: the package beside this script
    sys.path.insert(0, str(ROOT))


def _git() -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": bool(dirty)} if commit else {}


def _weights(text: str) -> dict:
    """``name=weight,name=weight`` -> {name: weight} (the names and values are checked by Settings)."""
    out = {}
    for item in text.split(","):
        name, eq, value = (x.strip() for x in item.partition("="))
        if not name or not eq:
            raise argparse.ArgumentTypeError(f"expected name=weight[,name=weight...], got {text!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"{name} given twice in {text!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"the weight of {name} is not a number: {value!r}") from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_test_model.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder the run writes (or --unpack's pipeline folder)")
    p.add_argument("--minutes", type=float, help="wall-clock budget of the whole run (default 8; smoke 2)")
    p.add_argument("--vae-minutes", type=float,
                   help="of which the VAE trains (default 2 for a fresh run, 0 with --resume or --vae-from)")
    p.add_argument("--reserve-seconds", type=float, help="kept for the last save and the evaluation (default 60)")
    p.add_argument("--seed", type=int, help="the data's and a fresh model's seed (default 0; a run resuming a model "
                   "without its training log must name one)")
    p.add_argument("--heads", type=int, help="a fresh run's transformer heads of 64 (default: the size's, 4; the "
                   "feed-forward stays 4x the width)")
    p.add_argument("--layers", type=int, help="a fresh run's transformer blocks (default: the size's, 4)")
    p.add_argument("--grow-layers", type=int, help="blocks a resumed run adds to its transformer: copies of its "
                   "blocks, spread over the depth, whose outputs start at zero (the grown model starts as the "
                   "resumed one)")
    p.add_argument("--vae-decoder-only", action="store_true", default=None,
                   help="with --resume and --vae-minutes: train the VAE's decoder alone, keeping the encoder and "
                   "so the latents the transformer learned on (e.g. to sharpen what it draws)")
    p.add_argument("--upright", action=argparse.BooleanOptionalAction, default=None,
                   help="every clip's shape starts at angle 0 instead of a random angle no caption names (the "
                   "VAE's, the pool's and the evaluation's clips; a resumed run does not inherit it). With "
                   "--evaluate: check upright (or, --no-upright, turned) ground truths (default: as the model's "
                   "training log says, turned without a log)")
    p.add_argument("--vae-from", type=Path, metavar="MODEL",
                   help="a fresh run takes this saved model's trained VAE (pipeline folder, pack or run) and "
                        "trains a new transformer on it; the VAE must be of the run's --size")
    p.add_argument("--size", choices=["full", "fine"],
                   help="a fresh run's model: full (the shipped sizes, the default) or fine (a VAE of 4x spatial "
                   "compression and a (1, 2, 2) patch: the same 2,048 tokens over a latent twice as fine)")
    p.add_argument("--batch", type=int, help="transformer batch (default 128)")
    p.add_argument("--vae-batch", type=int, help="VAE batch (default 12)")
    p.add_argument("--vae-frames", type=int, help="frames of the VAE's training clips, 4n + 1 (default 29, the clip's)")
    p.add_argument("--lr", type=float, help="transformer and text encoder learning rate (default 4e-4)")
    p.add_argument("--train-shift", type=float, metavar="S",
                   help="shift of the timesteps the transformer trains on, t = S·u / (1 + (S - 1)·u) for uniform u "
                        "(default: the scheduler's flow_shift, 3, which sampling keeps; 1: uniform t)")
    p.add_argument("--vae-lr", type=float, help="VAE learning rate (default 6e-4)")
    p.add_argument("--vae-colour-weights", type=_weights, metavar="COLOUR=W,...",
                   help="draw the VAE's clips' colours with these relative weights, e.g. red=2 (others 1; "
                   "default uniform)")
    p.add_argument("--vae-first-frame-weight", type=float, metavar="F",
                   help="multiply the VAE's reconstruction weight of each clip's first frame by F (default 1)")
    p.add_argument("--shape-weights", type=_weights, metavar="SHAPE=W,...",
                   help="draw the VAE's and the latent pool's shapes with these relative weights, e.g. "
                   "square=2,triangle=2 (others 1; default uniform)")
    p.add_argument("--shape-loss-weight", type=float, metavar="W",
                   help="weight the transformer's loss by 1 + W x the shape's coverage of each latent cell "
                   "(default 0: unweighted)")
    p.add_argument("--ema-decay", type=float, metavar="D",
                   help="save an exponential moving average of the transformer's and text encoder's weights, "
                        "decay D per step (e.g. 0.999; default 0: the trained weights); the evaluation "
                        "checks both")
    p.add_argument("--pool-size", type=int, help="clips in the transformer's latent pool, at most (default 12288)")
    p.add_argument("--pool-refresh", type=int, metavar="N",
                   help="after every transformer step, N fresh clips replace the pool's oldest (default 0: the "
                        "pool stays as built; each costs a render and a VAE encode)")
    p.add_argument("--max-steps", type=int, help="stop the transformer after this many steps")
    p.add_argument("--max-vae-steps", type=int, help="stop the VAE after this many steps")
    p.add_argument("--eval-clips", type=int, help="held-out captions checked at the end (default 24; 0: none)")
    p.add_argument("--checkpoint-seconds", type=float, help="seconds between checkpoints (default 60)")
    p.add_argument("--resume", type=Path, help="continue training this model (a pipeline folder or a pack)")
    p.add_argument("--pack", action="store_true",
                   help="write the pipeline as one safetensors per model and model.json (few, small files)")
    p.add_argument("--unpack", type=Path, metavar="PACK",
                   help="only write the pipeline folder of the pack PACK to --out (no training)")
    p.add_argument("--evaluate", metavar="MODEL",
                   help="only check MODEL (a pipeline folder or pack, or 'shipped') on --eval-clips held-out "
                        "captions (default 24), as a run's evaluation does; writes evaluation.json to --out")
    p.add_argument("--eval-combinations", choices=["held-out", "training"], default="held-out",
                   help="with --evaluate: check the held-out combinations of colour, shape, motion and "
                        "background (default), or as many combinations training draws, camera still")
    p.add_argument("--smoke", action="store_true", help="the tiny model and a few steps (a CPU check)")
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    return p


def _evaluate_only(parser, args) -> int:
    """``--evaluate``: the held-out check of a saved model, without training."""
    clips = 24 if args.eval_clips is None else args.eval_clips
    if clips < 1:
        parser.error(f"--eval-clips must be at least 1 with --evaluate, got {clips}")
    path = None if args.evaluate == "shipped" else Path(args.evaluate)
    if path is not None and not path.is_dir():
        parser.error(f"--evaluate {args.evaluate}: no such folder (a pipeline folder or pack, or 'shipped')")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: a file, not a folder")
    import json

    import torch

    from fp4video.testmodel import test_model_pipeline
    from fp4video.testmodel.model import FULL, SMOKE
    from fp4video.testmodel.checker import describe_shapes
    from fp4video.testmodel.train import SMOKE_SETTINGS, Settings, call_for, config_of, evaluate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    try:
        pipe = test_model_pipeline(device=device, dtype=torch.float32, path=path)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"--evaluate {args.evaluate}: {str(e).splitlines()[0]}")
    pipe.set_progress_bar_config(disable=True)
    config = config_of(pipe, SMOKE if args.smoke else FULL)
    call = call_for(config, SMOKE_SETTINGS["eval_steps"] if args.smoke else None)  # as a run evaluates
    t = time.perf_counter()
    upright, upright_from = args.upright, {True: "--upright", False: "--no-upright", None: ""}[args.upright]
    if upright is None:  # as the model was trained, where its log says
        from fp4video.testmodel import WEIGHTS
        from fp4video.testmodel.model import read_training_log
        from fp4video.testmodel.train import trained_upright, training_log_of

        log_path = training_log_of(WEIGHTS if path is None else path)
        try:
            upright = trained_upright(read_training_log(log_path) if log_path else None)
        except ValueError as e:
            parser.error(f"--evaluate {args.evaluate}: {e}")
        upright_from = "training log" if log_path else "default (no training log)"
    result = evaluate(pipe, config, clips=clips, call=call, seed=Settings().eval_seed, device=device,
                      combinations=args.eval_combinations, upright=upright)
    result.pop("_frames")
    result.pop("_specs")
    result.update(model=args.evaluate, device=str(device), seconds=round(time.perf_counter() - t, 1), git=_git(),
                  upright_from=upright_from)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "evaluation.json").write_text(json.dumps(result, indent=1, default=str))
    g, gt, rc = result["generated"], result["ground_truth"], result["vae_reconstruction"]
    print(f"{args.eval_combinations}{' upright' if upright else ''} motion check: generated {g['rate']:.0%} of {g['clips']} (colour {g['colour']:.0%}, "
          f"shape {g['shape']:.0%}, motion {g['motion']:.0%}); ground truth {gt['rate']:.0%}, VAE "
          f"reconstructions {rc['rate']:.0%}")
    print(f"shapes drawn, per captioned shape: {describe_shapes(g)}")
    return 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from fp4video.testmodel.model import is_pack, saved_model, unpack

    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: a file, not a folder")
    if args.eval_combinations != "held-out" and args.evaluate is None:
        parser.error(f"--eval-combinations {args.eval_combinations}: only with --evaluate (a run checks the held-out "
                     "combinations)")
    if args.unpack is not None:
        if not is_pack(args.unpack):
            parser.error(f"--unpack {args.unpack}: not a packed test model (no model.json)")
        if args.out.exists() and any(args.out.iterdir()) and not (args.out / "model_index.json").is_file():
            parser.error(f"--out {args.out}: a folder with other files in it (give an empty or a pipeline folder)")
        try:  # the pack is checked whole before anything is written (a refused pack leaves --out as it was)
            unpack(args.unpack, args.out)
        except (OSError, ValueError) as e:
            parser.error(f"--unpack {args.unpack}: {str(e).splitlines()[0]}")
        print(f"unpacked {args.unpack} -> {args.out}")
        return 0
    if args.evaluate is not None:
        return _evaluate_only(parser, args)
    for name in ("minutes", "vae_minutes", "reserve_seconds", "lr", "vae_lr", "checkpoint_seconds"):
        v = getattr(args, name)
        zero = name in ("vae_minutes", "reserve_seconds")  # may be 0
        if v is not None and (not math.isfinite(v) or v < 0 or (v == 0 and not zero)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number {'≥ 0' if zero else '> 0'}, got {v}")
    for name in ("batch", "vae_batch", "vae_frames", "pool_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    for name in ("max_steps", "max_vae_steps", "eval_clips", "pool_refresh"):
        v = getattr(args, name)
        if v is not None and v < 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0, got {v}")
    if args.resume is not None:
        try:  # a pipeline folder, a pack, or a run's folder (its pipeline/)
            resumed = saved_model(args.resume)
        except FileNotFoundError as e:
            parser.error(f"--resume {e}")
        if args.out.resolve() in (args.resume.resolve(), resumed.resolve()):
            parser.error("--resume and --out are the same folder: write the continued run elsewhere")
        from fp4video.testmodel.model import read_training_log
        from fp4video.testmodel.train import chain_starts_unlogged, training_log_of

        log_path = training_log_of(args.resume)
        if args.seed is None and log_path is None:
            parser.error(f"--resume {args.resume}: no training log says which clips it was trained on; give --seed "
                         "(a fresh run draws seed 0's, so another seed draws new clips)")
        try:
            resumed_log = read_training_log(log_path) if log_path is not None else None
        except ValueError as e:
            parser.error(f"--resume {args.resume}: {e}")
        if args.seed is None and chain_starts_unlogged(resumed_log):
            parser.error(f"--resume {args.resume}: its training log starts from a model without a log, so not every "
                         "clip it was trained on is known; give --seed (a fresh run draws seed 0's, so another seed "
                         "draws new clips)")
    previous = [n for n in ("train_log.json", "model.json", "pipeline") if (args.out / n).exists()]
    if previous:  # a run writes a folder of its own: another run's files beside it would be read as its
        parser.error(f"--out {args.out}: holds a previous run ({', '.join(previous)}); give a new folder (or "
                     "delete that one)")
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            parser.error(f"--device {args.device}: {e}")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device here")

    from pydantic import ValidationError

    from fp4video.testmodel.train import SMOKE_SETTINGS, Settings, train

    options = ("seed", "size", "heads", "layers", "grow_layers", "minutes", "vae_minutes", "reserve_seconds", "batch",
               "vae_batch", "vae_frames", "lr", "vae_lr", "train_shift", "pool_size", "pool_refresh", "max_steps",
               "max_vae_steps", "eval_clips", "checkpoint_seconds", "compile", "shape_weights", "vae_colour_weights",
               "vae_first_frame_weight", "shape_loss_weight", "ema_decay", "vae_decoder_only", "upright")
    given = {name: getattr(args, name) for name in options if getattr(args, name) is not None}
    if args.resume is not None and args.size is not None:
        parser.error("--size chooses a fresh run's model: a resumed run keeps its model's sizes")
    for name in ("heads", "layers", "vae_from"):
        if args.resume is not None and getattr(args, name) is not None:
            parser.error(f"--{name.replace('_', '-')} builds a fresh run's model: a resumed run keeps its model"
                         + (" (--grow-layers deepens it)" if name == "layers" else ""))
    if args.vae_decoder_only and (args.resume is None or not args.vae_minutes):
        parser.error("--vae-decoder-only trains a resumed model's VAE decoder: give --resume and --vae-minutes > 0")
    if args.grow_layers is not None and args.resume is None:
        parser.error("--grow-layers adds blocks to a resumed model: a fresh run's depth is --layers")
    if args.vae_from is not None:
        try:
            given["vae_from"] = str(saved_model(args.vae_from))
        except FileNotFoundError as e:
            parser.error(f"--vae-from {e}")
    if (args.resume is not None or args.vae_from is not None) and args.vae_minutes is None:
        given["vae_minutes"] = 0.0
    base = dict(SMOKE_SETTINGS) if args.smoke else {}
    try:
        settings = Settings(**{**base, **given})
    except ValidationError as e:
        first = e.errors()[0]
        msg = first["msg"].removeprefix("Value error, ")
        parser.error(f"--{'-'.join(map(str, first['loc'][:1])).replace('_', '-')}: {msg}")
    if settings.vae_minutes * 60 >= settings.minutes * 60 - settings.reserve_seconds:
        parser.error(f"--vae-minutes {settings.vae_minutes:g} leaves the transformer no time within --minutes "
                     f"{settings.minutes:g} less {settings.reserve_seconds:g} reserved seconds")
    if args.resume is None and args.vae_from is None and settings.vae_minutes == 0:
        parser.error("a fresh run trains its VAE first: give --vae-minutes > 0 (or --resume a trained model, or "
                     "--vae-from one)")
    if args.vae_from is not None:  # before any work: the VAE must fit the run's sizes
        from fp4video.testmodel import test_model_pipeline
        from fp4video.testmodel.train import fresh_config, vae_mismatch

        try:
            source = test_model_pipeline(path=settings.vae_from)
        except (FileNotFoundError, ValueError) as e:
            parser.error(f"--vae-from {args.vae_from}: {str(e).splitlines()[0]}")
        diff = vae_mismatch(fresh_config(settings), source.vae)
        if diff:
            parser.error(f"--vae-from {args.vae_from}: its VAE is not of this run's --size ({diff})")
    try:
        train(settings, args.out, resume=args.resume, packed=args.pack, device=args.device, git=_git(),
              started=STARTED)
    except FloatingPointError as e:  # a diverged run: said in one line, its last finite checkpoint kept
        print(f"train_test_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from fp4video.cli.common import quiet_optional_imports

    with quiet_optional_imports():  # torchao's import-time log lines, as the CLI drops them
        code = main()
    sys.exit(code)
