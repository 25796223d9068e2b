"""``fp4video calibrate``: measure where a model needs precision and write the cheapest policy that
keeps every attention site within a quality budget, with its report.

The pipeline runs on the prompts with stock attention; at every site (expert × block × kind ×
denoising step) each candidate — fp4video's methods and every external backend installed — runs
on the very inputs of the stock call and is compared with its output. The budget is the largest
relative L2 error of a site's attention output (worst head, worst call). Writes ``policy.yaml``
(loadable by ``Policy``), ``run.yaml`` (a run config with that policy: ``fp4video generate
--config``, ``fp4video bench pipeline --configs``), ``report.json``, ``report.md`` and
``heatmap.png`` in ``--out``.

``--transformer`` calibrates a full-size transformer with random weights instead (speed and
error statistics at the real shapes, no weights needed): each forward takes random latents at a
different timestep; no denoising step is known, so the policy is per block and kind.

``--from`` chooses again from an earlier calibration's report at another budget or among fewer
candidates, in a moment: nothing is measured again.

``--linear METHOD ...`` calibrates the transformer's linear layers too, in the same forwards: per
linear site (expert, block, kind of linear layer) each method's relative L2 error and the time it
saves, and within the same budget the method that saves the most (bf16 where none does), written as
``run.yaml``'s ``linear:`` section.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import UsageError, check_output_dir, seed_arg

EXAMPLES = """examples:
  fp4video calibrate --model tiny --out calib-tiny                      # tiny random Wan2.2, 2 prompts
  fp4video calibrate --model tiny --family hunyuan --sensitive --out calib-hy   # with sites built to need precision
  fp4video calibrate --config configs/wan22_mxattn.yaml --model /models/Wan2.2-T2V-A14B-Diffusers \\
      --prompt "a cat on the grass" --prompt "a city street at night" --holdout "a dog running" \\
      --steps 40 --budget 0.1 --costs measure --fp16-backend fastest --out calib-wan22
  fp4video calibrate --transformer wan22 --resolution 720p --budget 0.1 --costs measure --out calib-wan22-720p
  fp4video calibrate --transformer wan22 --resolution 720p --sparse --out calib-wan22-sparse   # block-sparse too
  fp4video calibrate --from calib-wan22 --budget 0.2 --out calib-wan22-0.2    # choose again, no measuring
  fp4video calibrate --transformer wan22 --resolution 720p --linear fp8-rowwise --out calib-wan22-linear
"""

#: Timesteps of the random-weight transformer's forwards (spread over the schedule), then hold-out.
FORWARD_TIMESTEPS = (999.0, 750.0, 500.0, 250.0, 100.0)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("calibrate", help="find the cheapest attention per site within a quality budget",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True,
                   help="folder for policy.yaml, run.yaml, report.json, report.md, heatmap.png (written as one set)")
    src = p.add_argument_group("what to calibrate (a pipeline, --transformer, or --from)")
    src.add_argument("--from", dest="source", type=Path, metavar="DIR",
                     help="choose again from this earlier calibration's report (its --out folder or report.json): "
                          "takes --budget, --min-cosine, --min-kept, --match, --candidates")
    src.add_argument("--config", type=Path, help="run config YAML: model, family, sizes, steps, prompts")
    src.add_argument("--model", help='"test" (the trained test model), "tiny" (random weights), a local pipeline '
                     'folder (a saved test model\'s folder, pack or training run runs as "test" does) or a hub id '
                     '(overrides the config)')
    src.add_argument("--family", help="the pipeline's family (wan, hunyuan, ltx, ...; overrides the config)")
    src.add_argument("--prompt", action="append", help="a calibration prompt (repeat; default: the config's)")
    src.add_argument("--holdout", action="append", default=[], help="a hold-out prompt the plan is checked on (repeat)")
    src.add_argument("--steps", type=int, help="denoising steps (the policy's steps are fractions of them)")
    src.add_argument("--height", type=int)
    src.add_argument("--width", type=int)
    src.add_argument("--frames", type=int)
    src.add_argument("--sensitive", action="store_true",
                     help="tiny model only: build in a block with K outlier channels and sharp late steps")
    src.add_argument("--transformer", choices=["wan22", "hunyuan"],
                     help="a full-size Wan2.2-A14B- or HunyuanVideo-shaped transformer with random bf16 weights")
    src.add_argument("--layers", type=int, help="--transformer: blocks (default: the real model's)")
    src.add_argument("--resolution", choices=["480p", "720p"], default=None,
                     help="--transformer: video size (default 720p)")
    src.add_argument("--forwards", type=int, default=None,
                     help="--transformer: calibration forwards, 1 to 4 (default 2; +1 hold-out)")
    how = p.add_argument_group("how")
    how.add_argument("--budget", type=float, default=None,
                     help="largest relative L2 error of a site's attention output (worst head, worst call; "
                          "default 0.1, or with --from the report's)")
    how.add_argument("--min-cosine", type=float, default=None, help="also: smallest cosine of a site's output")
    how.add_argument("--min-kept", type=float, default=None,
                     help="a block-sparse candidate is admitted at a site only where every query tile of every call "
                          "kept at least this share of its sampled rows' exact attention mass (default 0.9, or with "
                          "--from the report's)")
    how.add_argument("--match", default=None, metavar="TARGET",
                     help="per site, no worse than this candidate's own error there (e.g. backend:fa3_fp8); "
                          "--budget bounds the sites it cannot take")
    how.add_argument("--candidates", nargs="+", default=None, metavar="TARGET",
                     help="fp4video methods and backend:<name> (default: fp8 mxattn-pv8 mxattn and every quantized "
                          "external backend that runs here)")
    how.add_argument("--sparse", nargs="*", default=None, metavar="SELECTION",
                     help="block-sparse candidates too: dynamic:TAU and static:F,Y,X[,radial] selections for the "
                          "fastest method candidate, or METHOD+SELECTION (alone: dynamic:0.9 dynamic:0.95 "
                          "static:4,45,80,radial); each costs its method's time × its measured density's share")
    how.add_argument("--linear", nargs="+", default=None, metavar="METHOD",
                     help="calibrate the linear layers too: fp8-rowwise, fp8-tensor, mxfp8, nvfp4 (measured by torchao "
                          "where this GPU runs them, else fp8 by an exact e4m3 emulation, mxfp8 by torchao's); per "
                          "linear site the method within --budget that saves the most time (run.yaml's linear:)")
    how.add_argument("--linear-compile", action="store_true",
                     help="with --linear: time the methods under torch.compile (the policy's compile: true)")
    how.add_argument("--linear-rows", type=int, default=None, metavar="N",
                     help="with --linear: input rows (tokens) sampled per linear call (default 256)")
    how.add_argument("--costs", default="table",
                     help="table (H200 relative times), measure (timed here at the sites' shapes) or a "
                          "`bench kernel --out` markdown file")
    how.add_argument("--fp16-backend", default="stock",
                     help="the FP16 tier: stock, an exact backend's name, or fastest (per site, stock or the "
                          "cheapest exact backend installed there, named by the policy's rules)")
    how.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"], help="fp4video's kernels")
    how.add_argument("--propagation", type=int, default=8,
                     help="(site, step) pairs replayed to measure the transformer output's error (0: none)")
    how.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    how.add_argument("--seed", type=seed_arg, default=0)
    how.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


#: The pipeline's flags, with the run config's field each sets.
PIPELINE_FLAGS = {"config": None, "model": "model", "family": "family", "prompt": "prompts", "holdout": None,
                  "steps": "steps", "height": "height", "width": "width", "frames": "frames", "sensitive": None}
#: --transformer's own flags (refused without it), and the defaults of two of them.
TRANSFORMER_FLAGS = ("layers", "resolution", "forwards")
DEFAULT_RESOLUTION, DEFAULT_FORWARDS = "720p", 2


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_flags(args) -> None:
    """Every flag's value, checked before anything loads or runs: a :class:`UsageError` naming the
    flag and the reason, on one line."""
    import math

    from ..calibration.candidates import DEFAULT_CANDIDATES, as_target, check_match, sparse_targets
    from ..calibration.plan import Budget

    check_output_dir(args.out, "--out")  # written after minutes of measuring: checked first
    for name in ("policy.yaml", "report.json", "report.md", "heatmap.png", "run.yaml"):
        if (args.out / name).is_dir():
            raise UsageError(f"--out {args.out}: {args.out / name} is a folder, where the calibration's {name} goes")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise UsageError(f"--budget {args.budget}: a relative L2 error, greater than 0 and finite")
    if args.min_cosine is not None and not -1 < args.min_cosine <= 1:  # (nan fails too)
        raise UsageError(f"--min-cosine {args.min_cosine}: a cosine, greater than -1 and at most 1")
    if args.min_kept is not None and not 0 <= args.min_kept <= 1:  # (nan fails too)
        raise UsageError(f"--min-kept {args.min_kept}: a share of the attention mass, from 0 to 1")
    for flag, values in (("--match", [args.match] if args.match is not None else []),
                         ("--candidates", args.candidates or [])):
        for v in values:
            try:
                as_target(v)
            except (ValueError, TypeError) as e:
                raise UsageError(f"{flag} {v}: {e}") from None
    if args.match is not None:
        try:
            check_match(Budget(match=args.match))
        except ValueError as e:
            raise UsageError(f"--match {args.match}: {e}") from None
    if args.sparse:
        try:
            sparse_targets(args.sparse, ["fp16", *(args.candidates or DEFAULT_CANDIDATES)])
        except (ValueError, TypeError) as e:
            raise UsageError(f"--sparse: {e}") from None
    _check_costs(args.costs)
    _check_linear(args)
    if args.fp16_backend not in ("stock", "fastest"):
        from ..integration.backends import check_backend_name, is_exact

        try:
            check_backend_name(args.fp16_backend)
        except ValueError as e:
            raise UsageError(f"--fp16-backend {args.fp16_backend}: {e}; or stock, fastest") from None
        if not is_exact(args.fp16_backend):
            raise UsageError(f"--fp16-backend {args.fp16_backend}: quantizes; the FP16 tier is stock, fastest or an "
                             "exact backend (native, _native_cudnn, flash, _flash_3, ...)")
    if args.propagation < 0:
        raise UsageError(f"--propagation {args.propagation}: a number of (site, step) pairs, 0 or more")
    for name in ("steps", "height", "width", "frames", "layers", "forwards"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"{_flag(name)} {v}: at least 1")
    if args.forwards is not None and args.forwards >= len(FORWARD_TIMESTEPS):
        raise UsageError(f"--forwards {args.forwards}: 1 to {len(FORWARD_TIMESTEPS) - 1}")
    for flag, values in (("--prompt", args.prompt or []), ("--holdout", args.holdout)):
        for v in values:
            if not v.strip():
                raise UsageError(f"{flag} {v!r}: an empty prompt")
    if args.model is not None and not args.model.strip():
        raise UsageError(f"--model {args.model!r}: empty; give \"test\", \"tiny\", a local pipeline folder or a hub id")
    _check_device(args.device, args.backend)


def _check_linear(args) -> None:
    """--linear's methods known, torchao installed, each runnable on the device (at least emulated);
    --linear-compile and --linear-rows only with it."""
    if args.linear is None:
        for flag in ("linear_compile", "linear_rows"):
            if getattr(args, flag) not in (None, False):
                raise UsageError(f"{_flag(flag)} is for --linear (the linear layers' calibration)")
        return
    if args.linear_rows is not None and args.linear_rows < 1:
        raise UsageError(f"--linear-rows {args.linear_rows}: at least 1")
    import torch

    from ..calibration.linear import measuring_forms, torchao_installed
    from ..integration.linear import METHODS, TORCHAO_REQUIREMENT

    for m in args.linear:
        if m not in METHODS:
            raise UsageError(f"--linear {m}: unknown linear method; allowed: {', '.join(METHODS)}")
    if not torchao_installed():
        raise UsageError(f"--linear: calibrating linear layers needs torchao{TORCHAO_REQUIREMENT} (the policy it "
                         "writes runs through it): pip install 'fp4video[linear]'")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for m in args.linear:
        try:
            measuring_forms([m], device)
        except ValueError as e:
            raise UsageError(f"--linear {m}: {str(e).splitlines()[0]}") from None


def _check_costs(costs: str) -> None:
    if costs in ("table", "measure"):
        return
    from ..calibration.plan import costs_from_table

    path = Path(costs)
    if not path.is_file():
        raise UsageError(f"--costs {costs}: no such file; give table, measure or a `fp4video bench kernel --out` "
                         "markdown file")
    try:
        costs_from_table(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"--costs {costs}: {getattr(e, 'strerror', None) or e}") from None


def _check_device(device: str | None, backend: str) -> None:
    import torch

    if device is not None:
        try:
            kind = torch.device(device).type
        except (RuntimeError, ValueError, TypeError):
            raise UsageError(f"--device {device!r}: not a device name (cpu, cuda, cuda:N)") from None
        if kind not in ("cpu", "cuda"):
            raise UsageError(f"--device {device}: calibration runs on cpu or cuda[:N]")
        if kind == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is visible here (leave --device out: the CPU)")
        index = torch.device(device).index
        if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if backend == "triton" and (not torch.cuda.is_available() or (device or "cuda").startswith("cpu")):
        raise UsageError("--backend triton runs fp4video's kernels on a CUDA GPU; on the CPU use --backend reference "
                         "(or auto)")


def run(args) -> int:
    import torch

    from ..calibration import Budget, calibrate

    check_flags(args)
    if args.source is not None:
        return _replan(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = Budget(rel_l2=0.1 if args.budget is None else args.budget, min_cosine=args.min_cosine, match=args.match,
                    **({} if args.min_kept is None else {"min_kept": args.min_kept}))
    if args.transformer:
        for flag in PIPELINE_FLAGS:
            if getattr(args, flag) not in (None, [], False):
                raise UsageError(f"--{flag} is for a pipeline; --transformer takes --layers, --resolution, --forwards")
        target, prompts, holdout, name = _random_transformer(args, device)
        call, run = None, {"family": "wan" if args.transformer == "wan22" else "hunyuan"}
    else:
        for flag in TRANSFORMER_FLAGS:
            if getattr(args, flag) is not None:
                raise UsageError(f"{_flag(flag)} is for --transformer")
        target, prompts, holdout, call, name, run = _pipeline(args, device)
    result = calibrate(target, prompts, holdout=holdout, budget=budget, candidates=args.candidates, costs=args.costs,
                       call=call, fp16_backend=args.fp16_backend, backend=args.backend, propagation=args.propagation,
                       seed=args.seed, progress=not args.quiet, model_name=name,
                       sparse=None if args.sparse is None else (args.sparse or True), linear=args.linear,
                       linear_compile=args.linear_compile,
                       **({} if args.linear_rows is None else {"linear_rows": args.linear_rows}))
    r = result.report
    return _write(result, args.out, run, f"calibrated {name} on {r['device']}",
                  f"calibration {r['calibration']['seconds']:.1f} s, {r['calibration']['peak_bytes'] / 2**30:.2f} GiB")


def _write(result, out: Path, run: dict, what: str, tail: str = "", run_source: str | None = None) -> int:
    """Write the calibration's files and ``run.yaml`` in ``out`` as one set; say what was chosen
    and where it went. ``run_source`` names where ``run`` came from (for its errors)."""
    paths = result.write(out, extra={"run.yaml": _run_config_text(run, result, run_source)})
    r = result.report
    print(f"{what}: {', '.join(f'{t} {n}' for t, n in r['chosen'].items())} sites; "
          f"predicted step {r['prediction']['step_speedup_vs_stock']:.3f}× stock" + (f"; {tail}" if tail else ""))
    for kind, path in {**paths, "run config": out / "run.yaml"}.items():
        print(f"wrote {path} ({kind})", file=sys.stderr)
    return 0


#: Options that measure (refused with --from, which measures nothing), with their defaults.
MEASURING = {"config": None, "model": None, "family": None, "prompt": None, "holdout": [], "steps": None,
             "height": None, "width": None, "frames": None, "sensitive": False, "transformer": None, "layers": None,
             "resolution": None, "forwards": None, "sparse": None, "costs": "table", "fp16_backend": "stock",
             "backend": "auto", "propagation": 8, "device": None, "seed": 0, "linear": None,
             "linear_compile": False, "linear_rows": None}


def _replan(args) -> int:
    from ..calibration import Budget, replan
    from ..calibration.candidates import as_target
    from ..calibration.replan import read_report
    from ..integration.config import ConfigError, read_yaml_mapping

    given = [k for k, default in MEASURING.items() if getattr(args, k) != default]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} measures; --from only chooses again (it takes --budget, "
                         "--min-cosine, --min-kept, --match, --candidates)")
    source = args.source / "report.json" if args.source.is_dir() else args.source
    if not source.is_file():
        raise UsageError(f"--from {args.source}: no report.json there (a `fp4video calibrate --out` folder)")
    try:
        report, _ = read_report(source)
    except ValueError as e:  # the report's file, field and reason
        raise UsageError(f"--from {e}") from None
    measured = report.budget.model_dump()  # the report's budget, with the flags given in its place
    given = {k: v for k, v in (("rel_l2", args.budget), ("min_cosine", args.min_cosine), ("match", args.match),
                               ("min_kept", args.min_kept)) if v is not None}
    for flag, names in (("--candidates", args.candidates or []), ("--match", [args.match] if args.match else [])):
        unknown = [c for c in names if as_target(c) not in report.candidates]
        if unknown:
            raise UsageError(f"{flag}: {unknown[0]} not measured in this calibration (its candidates: "
                             f"{', '.join(report.candidates)})")
    try:
        result = replan(report, budget=Budget(**{**measured, **given}), candidates=args.candidates)
    except ValueError as e:
        raise UsageError(f"--from {source}: {str(e).splitlines()[0]}") from None
    result.report["replanned"]["from"] = str(source)
    run_yaml = source.parent / "run.yaml"  # the measured run's config, its policy replaced
    run = {}
    if run_yaml.exists():
        try:
            # the policy is chosen again; the linear section too where the report measured linear layers,
            # else the run's own section stays as it was
            replaced = ("policy", "linear") if result.linear_policy is not None else ("policy",)
            run = {k: v for k, v in read_yaml_mapping(run_yaml).items() if k not in replaced}
        except ConfigError as e:
            raise UsageError(f"--from {args.source}: {e}") from None
    r = result.report
    return _write(result, args.out, run, f"chose again for {r['model']['name']} ({r['budget_text']})",
                  run_source=str(run_yaml))


def _pipeline(args, device):
    import torch

    from ..integration.config import DEFAULT_CONFIG, ConfigError, load_config
    from ..integration.pipelines import embedded_sizes, load_pipeline, pipeline_kwargs
    from ..integration.tiny import add_sensitivity

    try:
        cfg = load_config(args.config) if args.config else DEFAULT_CONFIG
    except ConfigError as e:
        raise UsageError(f"--config {e}") from None
    changes = {k: v for k, v in (("model", args.model), ("family", args.family)) if v is not None}
    model = changes.get("model", cfg.model)
    family = changes.get("family", cfg.family)
    changes.update(embedded_sizes(model, family))  # an embedded model's own sizes (a YAML's are the real model's)
    for name in ("steps", "height", "width", "frames"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.prompt:
        changes["prompts"] = args.prompt
    elif model == "tiny" and not args.config:
        changes["prompts"] = ["a cat walks on the grass", "a city street at night"]
    cfg = _run_config({**cfg.model_dump(), **changes}, args)
    if args.sensitive and cfg.model != "tiny":
        raise UsageError("--sensitive builds sensitivity into the tiny model's random weights: it needs --model tiny")
    pipe = load_pipeline(cfg, device)
    from ..integration.pipelines import check_pipeline_frames

    # a count the VAE cannot take is rounded or cut by the pipeline, and the report would name the wrong one
    check_pipeline_frames(pipe, cfg.frames)
    if args.sensitive:
        steps = cfg.steps
        pipe.scheduler.set_timesteps(steps, device=device)
        late = float(pipe.scheduler.timesteps[steps // 2])  # the second half of the steps: sharp
        for name in ("transformer", "transformer_2"):
            model_ = getattr(pipe, name, None)
            if isinstance(model_, torch.nn.Module):
                add_sensitivity(model_, outlier_blocks=(1,), sharp_timesteps=(0.0, late + 1e-3))

    def call(prompt):
        kw = pipeline_kwargs(cfg, prompt, device)
        del kw["prompt"]
        kw.pop("output_type", None)
        return kw

    name = f"{cfg.model} {cfg.family} ({cfg.height}×{cfg.width}, {cfg.frames} frames, {cfg.steps} steps)"
    run = cfg.model_dump(mode="json", exclude={"policy", "parallel"}, exclude_defaults=True)
    return pipe, list(cfg.prompts), list(args.holdout), call, name, run


def _run_config(spec: dict, args):
    """The run config of ``spec`` (the config file's, the flags' changes applied), checked as
    ``fp4video generate`` checks its own; a problem names the flag that set the field, else the
    config file."""
    from pydantic import ValidationError

    from ..integration.config import RunConfig
    from ..integration.policy import format_validation_error
    from .generate import check_run_config

    def problem(field: str, line: str) -> UsageError:
        """``line`` (``field ...: reason``) blamed on the flag that set ``field``, else the config."""
        flag = next((f for f, name in PIPELINE_FLAGS.items() if name == field and getattr(args, f)), None)
        if flag is None:
            return UsageError(f"--config {args.config}: {line}" if args.config else f"the default run config: {line}")
        value = getattr(args, flag)
        line = line.removeprefix("(top level): ")
        reason = line.split(": ", 1)[1] if line.startswith(field) and ": " in line else line
        return UsageError(f"--{flag} {' '.join(value) if isinstance(value, list) else value}: {reason}")

    try:
        cfg = RunConfig.model_validate(spec)
    except ValidationError as e:
        first = e.errors()[0]
        # a check of the whole config (model: test needs family wan) is the model's or the family's flag
        field = str(first["loc"][0]) if first["loc"] else next(
            (name for flag, name in PIPELINE_FLAGS.items() if name in ("model", "family") and getattr(args, flag)), "")
        raise problem(field, format_validation_error(e).splitlines()[0]) from None
    try:
        check_run_config(cfg)
    except UsageError as e:
        raise problem(str(e).split(" ", 1)[0].rstrip(":"), str(e)) from None
    return cfg


def _run_config_text(run: dict, result, source: str | None = None) -> str:
    """``run.yaml``: a run config with the calibrated policy (``fp4video generate --config``,
    ``bench pipeline --configs``), headed like the policy; checked to load back. ``source`` names
    the file ``run`` was read from (a problem there is its own, one line)."""
    import yaml
    from pydantic import ValidationError

    from ..integration.config import RunConfig
    from ..integration.policy import format_validation_error

    spec = {**run, "policy": result.policy.model_dump(mode="json", exclude_none=True)}
    if result.linear_policy is not None:  # the calibrated linear layers (a LinearPolicy: never steps)
        spec["linear"] = result.linear_policy.model_dump(mode="json", exclude_defaults=True)
    try:
        RunConfig.model_validate(spec)  # what is written loads back
    except ValidationError as e:
        where = source or "the run config"
        raise UsageError(f"{where}: {'; '.join(format_validation_error(e).splitlines())}") from None
    header = "".join(line + "\n" for line in result.policy_yaml().splitlines() if line.startswith("#"))
    return header + yaml.safe_dump(spec, sort_keys=False, width=120, default_flow_style=None)


def _random_transformer(args, device):
    """A full-size transformer with random bf16 weights and its forwards' inputs (random latents
    at timesteps spread over the schedule; the last one is the hold-out)."""
    import torch

    from .bench import HUNYUAN, HUNYUAN_LATENTS, LATENTS, WAN22_A14B

    resolution = args.resolution or DEFAULT_RESOLUTION
    forwards = args.forwards or DEFAULT_FORWARDS
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if args.transformer == "wan22":
                from diffusers import WanTransformer3DModel

                layers = args.layers or WAN22_A14B["num_layers"]
                model = WanTransformer3DModel(**{**WAN22_A14B, "num_layers": layers}).eval()
                name = f"Wan2.2-A14B-shaped transformer, random weights, {layers} blocks, {resolution}"
            else:
                from diffusers import HunyuanVideoTransformer3DModel

                dual = args.layers or HUNYUAN["num_layers"]
                model = HunyuanVideoTransformer3DModel(**{**HUNYUAN, "num_layers": dual,
                                                          "num_single_layers": 2 * dual}).eval()
                name = f"HunyuanVideo-shaped transformer, random weights, {dual}+{2 * dual} blocks, {resolution}"
    finally:
        torch.set_default_dtype(default)

    def inputs(i, t):
        g = torch.Generator(device=device).manual_seed(args.seed + 1 + i)
        rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
        kw = {"timestep": torch.tensor([t], device=device), "return_dict": False}
        if args.transformer == "wan22":
            f, h, w = LATENTS[resolution]
            kw.update(hidden_states=rand(1, 16, f, h, w), encoder_hidden_states=rand(1, 512, 4096))
        else:
            f, h, w = HUNYUAN_LATENTS[resolution]
            mask = torch.zeros(1, 256, device=device, dtype=torch.bool)
            mask[:, :200] = True
            kw.update(hidden_states=rand(1, 16, f, h, w), encoder_hidden_states=rand(1, 256, 4096),
                      encoder_attention_mask=mask, pooled_projections=rand(1, 768),
                      guidance=torch.tensor([6000.0], device=device))
        return kw

    times = FORWARD_TIMESTEPS[:forwards]
    return model, [inputs(i, t) for i, t in enumerate(times)], [inputs(99, FORWARD_TIMESTEPS[-1])], name
