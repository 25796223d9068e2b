"""``fp4video generate``: a video through the FP4 attention path, with a JSON sidecar that records
every attention call (step, expert, block, kind, method)."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

from .common import UsageError, check_output_file, check_seed, one_line, seed_arg

EXAMPLES = """examples:
  fp4video generate                                   # embedded default: the trained test model, mxattn hybrid
  fp4video generate --config configs/wan22_mxattn.yaml --model /models/Wan2.2-T2V-A14B-Diffusers \\
      --output wan.mp4 --device cuda
  fp4video generate --config configs/wan22_sage3.yaml --model tiny --steps 6 --seed 3
  torchrun --nproc-per-node 2 -m fp4video.cli.main generate --config configs/wan22_mxattn.yaml \\
      --model /models/Wan2.2-T2V-A14B-Diffusers --ulysses-degree 2     # one video on 2 GPUs
"""


#: Bounds on the video a run may ask for, checked before anything loads: sizes past them are typos
#: (the latent and the attention over it would not fit any machine), refused in one line rather
#: than found out by an allocation failure minutes later. Sides up to 8K, up to 2049 frames, and
#: at most 2**33 pixels over the whole video (e.g. 4K UHD for 1035 frames): Wan2.2's VAE (8×8
#: spatial, 4× temporal) and 2×2 patches make that 2.1 million tokens, whose attention matrix
#: holds 4.6e12 entries per head.
MAX_SIDE = 8192
MAX_FRAMES = 2049
MAX_VIDEO_PIXELS = 2**33
#: More denoising steps than any sampler uses (real models: 4 to 100)
MAX_STEPS = 10_000


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate a video with FP4 attention", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="run config YAML (default: the trained test model under MXAttention's hybrid policy)")
    p.add_argument("--model", help='"test" (the trained test model), "tiny" (random weights), a local pipeline folder '
                                   '(a saved test model\'s folder, pack or training run runs as "test" does) or a hub '
                                   'id (overrides the config)')
    p.add_argument("--prompt", action="append", help="prompt (repeat for several; overrides the config)")
    p.add_argument("--output", type=Path, default=Path("fp4video.mp4"),
                   help="output mp4, a .json sidecar beside it; a config or --prompt list with several prompts "
                        "writes one video each, NAME_0.mp4, NAME_1.mp4, ... (said before the run starts)")
    p.add_argument("--steps", type=int, help="denoising steps (overrides the config)")
    p.add_argument("--seed", type=seed_arg, help="random seed, 0 .. 2**64 - 1 (overrides the config)")
    p.add_argument("--height", type=int, help=f"video height, at most {MAX_SIDE} (overrides the config)")
    p.add_argument("--width", type=int, help=f"video width, at most {MAX_SIDE} (overrides the config)")
    p.add_argument("--frames", type=int, help=f"number of frames, at most {MAX_FRAMES} (overrides the config)")
    p.add_argument("--method", help="replace the policy by one method everywhere (e.g. fp16, mxattn)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"],
                   help="FP4 attention backend (default auto: Triton kernels on CUDA, else the reference)")
    p.add_argument("--ring-degree", type=int, help="under torchrun: ring attention degree (overrides the config)")
    p.add_argument("--ulysses-degree", type=int, help="under torchrun: Ulysses degree (overrides the config)")
    return p


def resolve_config(args, notes: list[str] | None = None):
    """The run config: ``--config`` (or the embedded default) with the command line's overrides,
    validated again. ``notes`` collects one line for each silent change worth saying (the tiny
    model replacing a config's sizes)."""
    from ..integration.config import DEFAULT_CONFIG, RunConfig, load_config
    from ..integration.pipelines import embedded_sizes
    from ..integration.policy import Policy

    if args.model is not None and not args.model.strip():
        raise UsageError(f"--model {args.model!r}: empty; give \"test\", \"tiny\", a local pipeline folder or a hub id")
    try:
        cfg = load_config(args.config) if args.config else DEFAULT_CONFIG
    except RecursionError:  # a pathological nesting that reached Python's limit in a parser
        raise UsageError(f"--config {args.config}: nested too deeply") from None
    changes = {}
    if args.model is not None:
        changes["model"] = args.model
    if args.prompt:
        changes["prompts"] = args.prompt
    if args.method is not None:
        changes["policy"] = Policy(method=args.method)
    model = args.model if args.model is not None else cfg.model
    own = embedded_sizes(model, cfg.family)  # an embedded model's sizes: the YAML's are for the real model
    if own:
        changes.update(own)
        replaced = {k: (getattr(cfg, k), v) for k, v in own.items()
                    if getattr(cfg, k) != v and getattr(args, k, None) is None}
        if args.config and replaced and notes is not None:
            notes.append(_embedded_note(args.config, model, replaced))
    for name in ("steps", "seed", "height", "width", "frames"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.ring_degree is not None or args.ulysses_degree is not None:
        base = cfg.parallel.model_dump() if cfg.parallel else {}
        changes["parallel"] = {**base, **{k: v for k, v in (("ring_degree", args.ring_degree),
                                                              ("ulysses_degree", args.ulysses_degree)) if v is not None}}
    # re-validate: overrides get the same checks as the YAML
    cfg = RunConfig.model_validate({**cfg.model_dump(), **changes}) if changes else cfg
    check_run_config(cfg)
    return cfg


def _embedded_note(config, model: str, replaced: dict) -> str:
    def sizes(i):
        v = {k: p[i] for k, p in replaced.items()}
        parts = []
        if "height" in v or "width" in v:
            parts.append(f"{v.get('height', '·')}×{v.get('width', '·')} (h×w)")
        parts += [f"{v[k]} {k}" for k in ("frames", "steps", "fps") if k in v]
        return ", ".join(parts)

    options = [f"--{k}" for k in ("height", "width", "frames", "steps") if k in replaced]
    which = "the tiny model" if model == "tiny" else "the test model"
    return (f"note: {which} runs at its own sizes, {sizes(1)}, instead of {config}'s {sizes(0)} "
            "(those are for the real model" + (f"; {'/'.join(options)} choose others)" if options else ")"))


def check_run_config(cfg) -> None:
    """What the config's own validation leaves open and no run can use, in one line (a
    :class:`UsageError`): an empty model, a seed outside torch's range, sizes past the bounds, a
    frame count the model's VAE cannot take where that is known before loading."""
    if not cfg.model.strip():
        raise UsageError("model: empty; give \"test\", \"tiny\", a local pipeline folder or a hub id")
    check_seed(cfg.seed, "seed")
    for name, bound in (("height", MAX_SIDE), ("width", MAX_SIDE), ("frames", MAX_FRAMES), ("steps", MAX_STEPS)):
        if getattr(cfg, name) > bound:
            raise UsageError(f"{name} {getattr(cfg, name)}: at most {bound}")
    from ..integration.pipelines import FrameCountError, check_family_frames, check_frames, is_test_model

    try:  # known before loading: the test model's VAE, else a real model's family
        if is_test_model(cfg.model):
            check_frames(cfg.frames, 4, "the test model")
        else:
            check_family_frames(cfg.model, cfg.family, cfg.frames)
    except FrameCountError as e:
        raise UsageError(str(e)) from None
    pixels = cfg.height * cfg.width * cfg.frames
    if pixels > MAX_VIDEO_PIXELS:
        raise UsageError(f"height × width × frames = {cfg.height} × {cfg.width} × {cfg.frames} = {pixels:.3g} "
                         f"pixels: at most 2**33 = {MAX_VIDEO_PIXELS:.3g} (e.g. 3840 × 2160 × 1035)")


def output_names(output: Path, prompts: int) -> list[Path]:
    """The mp4 of each prompt: ``output`` itself for one prompt, ``NAME_0.mp4, NAME_1.mp4 ...`` for several."""
    if prompts == 1:
        return [output]
    return [output.with_name(f"{output.stem}_{i}{output.suffix}") for i in range(prompts)]


def several_outputs(outputs: list[Path]) -> str:
    """What a run of several prompts writes, said before it starts (``--output`` names one file)."""
    return (f"{len(outputs)} prompts, so one video each: {', '.join(str(o) for o in outputs)} "
            "(--prompt \"...\" runs one prompt into --output itself)")


def video_title(out, frames: int, fps: int, generation_seconds: float) -> str:
    """The summary's title: the video's own length (frames at fps) apart from the time it took."""
    return (f"{out}: {frames} frames at {fps} fps ({frames / fps:.2f} s of video), "
            f"generated in {generation_seconds:.1f} s")


def run(args) -> int:
    """Every input is checked before anything loads (config, sizes, seed, outputs, device); a
    problem is a :class:`UsageError` (one line, exit 2, from ``main``)."""
    with own_warnings_in_one_line():
        return _run(args)


#: fp4video's own warnings: ``fp4video: ...``, ``fp4video policy: ...``, ``fp4video linear: ...``
_OWN_WARNING = re.compile(r"fp4video(?: ([\w-]+))?: ")


@contextlib.contextmanager
def own_warnings_in_one_line():
    """Within the block, fp4video's own warnings (a policy's step rule, a linear layer's refused GEMM,
    ...) print as ``fp4video generate: warning: ...`` on one line: raised within the run, no line of
    the user's called the pipeline, so Python's form would name runpy or the console script. Other
    warnings print as Python prints them; recorded warnings stay as they are."""
    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        m = _OWN_WARNING.match(str(message))
        if m is None:
            return original(message, category, filename, lineno, line)
        what = f"{m.group(1)}: " if m.group(1) else ""
        return f"fp4video generate: warning: {what}{one_line(str(message)[m.end():])}\n"

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = original


def _run(args) -> int:
    import torch

    from ..integration import install
    from ..integration.pipelines import check_pipeline_frames, is_test_model, load_pipeline, pipeline_kwargs
    from ..integration.runner import generate_video

    notes: list[str] = []
    cfg = resolve_config(args, notes)
    typed = list(cfg.prompts)
    test_model = is_test_model(cfg.model)  # "test", or a folder holding a saved test model
    if test_model:
        cfg = test_model_prompts(cfg, notes)
    # the test model's default policy (FP16 for the last two steps) covers every step of a short run
    # (--steps 2): said once here, in place of a warning from within the run that points into torch
    step_notes = cfg.policy.step_warnings(cfg.steps) if test_model else []
    notes += [f"note: the policy's {m}" for m in step_notes]
    for note in notes:
        print(f"fp4video generate: {note}", file=sys.stderr)
    outputs = [check_output_file(out, "--output", (".mp4",), companions=(".json",))
               for out in output_names(args.output, len(cfg.prompts))]
    from ..integration import distributed

    rank, size = distributed.world()
    if size > 1 and (cfg.parallel is None or cfg.parallel.ring_degree * cfg.parallel.ulysses_degree != size):
        got = "none" if cfg.parallel is None else f"ring {cfg.parallel.ring_degree} × ulysses {cfg.parallel.ulysses_degree}"
        raise UsageError(f"launched on {size} processes, so ring_degree × ulysses_degree must be {size} (config "
                         f"`parallel:` or --ring-degree/--ulysses-degree); got {got}")
    if size == 1 and cfg.parallel is not None and cfg.parallel.ring_degree * cfg.parallel.ulysses_degree > 1:
        raise UsageError("context parallelism needs several processes: launch with "
                         "`torchrun --nproc-per-node N -m fp4video.cli.main generate ...`")
    problem = device_problem(args.device, args.backend)
    if problem:
        raise UsageError(problem)
    device = distributed.setup_process_group(args.device) if size > 1 else \
        torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from ..integration.linear import LinearUnsupported, check_linear_support

    for method in cfg.linear.methods():  # before anything loads: the linear layers' methods run here
        try:
            check_linear_support(method, device, emulate=cfg.linear.emulate)
        except LinearUnsupported as e:
            raise UsageError(f"linear: {e}") from None
    t0 = time.perf_counter()
    calls = [pipeline_kwargs(cfg, prompt, device) for prompt in cfg.prompts]  # inputs checked before loading
    try:
        pipe = load_pipeline(cfg, device)
    except NotImplementedError as e:
        raise UsageError(str(e)) from None
    check_pipeline_frames(pipe, cfg.frames)
    if size > 1:
        distributed.enable_context_parallel(pipe, ring_degree=cfg.parallel.ring_degree,
                                            ulysses_degree=cfg.parallel.ulysses_degree, device=device)
    t_load = time.perf_counter() - t0
    if rank != 0:
        pipe.set_progress_bar_config(disable=True)
    ctx = install(pipe, cfg.policy, backend=args.backend)
    linear = None
    if cfg.linear.methods() != ["bf16"] or cfg.linear.compile:
        from ..integration.linear import install_linear

        linear = install_linear(pipe, cfg.linear)
        print(f"fp4video generate: linear layers: {linear.summary()}", file=sys.stderr)
    if rank == 0 and len(outputs) > 1:
        print(f"fp4video generate: {several_outputs(outputs)}", file=sys.stderr)

    for prompt, typed_prompt, call, out in zip(cfg.prompts, typed, calls, outputs):
        with warnings.catch_warnings():
            for m in step_notes:  # (said above)
                warnings.filterwarnings("ignore", message=re.escape(f"fp4video policy: {m}"))
            sidecar = generate_video(pipe, ctx, cfg, prompt, call, out, device=device, backend=args.backend,
                                     load_seconds=t_load, write=rank == 0, world_size=size,
                                     linear=linear, typed_prompt=typed_prompt)
        if rank == 0:
            _summary(out, sidecar, cfg.fps)
    if rank == 0 and len(outputs) > 1:
        print(f"fp4video generate: wrote {len(outputs)} videos, one per prompt: "
              f"{', '.join(str(o) for o in outputs)} (each with its .json)", file=sys.stderr)
    if size > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank done with its collectives before the group goes
        dist.destroy_process_group()
    return 0


def test_model_prompts(cfg, notes: list[str]):
    """The run config with each prompt that is one of the test model's captions in the caption's own
    words (:func:`fp4video.testmodel.parse_caption` reads case, spacing and a final full stop aside,
    but the model's word-level tokenizer reads a full stop as an unknown word: the clip checked must
    be the caption's); ``notes`` gets a line for each prompt changed and each one left unchecked."""
    from ..integration.config import DEFAULT_CONFIG
    from ..testmodel import parse_caption

    prompts = []
    for prompt in cfg.prompts:
        spec = parse_caption(prompt)
        if spec is None:
            notes.append(f"note: {prompt!r} is not a caption of the test model's scenes (such as "
                         f"\"{DEFAULT_CONFIG.prompts[0]}\"; docs/test-model.md): its clip is generated, not checked")
        elif spec.caption != prompt:
            notes.append(f"note: {prompt!r} runs as the test model's caption {spec.caption!r} (its own words: lower "
                         "case, single spaces, no full stop), which its clip is checked against")
        prompts.append(prompt if spec is None else spec.caption)
    return cfg if prompts == list(cfg.prompts) else cfg.model_copy(update={"prompts": prompts})


def device_problem(device: str | None, backend: str) -> str | None:
    """What stops ``--device`` / ``--backend`` from working on this machine, in one line (or None)."""
    import torch

    if device is not None:
        try:
            kind = torch.device(device).type
        except (RuntimeError, ValueError, TypeError):
            return f"--device {device!r}: not a device name (cpu, cuda, cuda:N)"
        if kind not in ("cpu", "cuda"):
            backend_module = getattr(torch, kind, None)
            available = getattr(backend_module, "is_available", None)
            if kind == "meta" or available is None or not available():
                return f"--device {device}: fp4video generate runs on cpu or cuda[:N]; {kind} is not available here"
    wants_cuda = (device or "").startswith("cuda")
    if wants_cuda and not torch.cuda.is_available():
        build = "a CPU-only build of PyTorch" if torch.version.cuda is None else f"PyTorch {torch.__version__}, but no GPU is visible"
        return (f"--device {device}: this machine has {build}; install a CUDA build of torch on a GPU machine, "
                "or leave --device out (CPU)")
    if wants_cuda:
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "--backend triton: Triton is not installed (pip install 'fp4video[triton]'), or use --backend auto"
        if not torch.cuda.is_available() or (device or "cuda").startswith("cpu"):
            return ("--backend triton runs fp4video's kernels on a CUDA GPU; on the CPU use --backend reference "
                    "(or auto)")
    return None


def _summary(out, sidecar, fps: int):
    from rich.console import Console
    from rich.table import Table

    calls = sidecar["attention_calls"]
    t = Table(title=video_title(out, sidecar["frames"], fps, sidecar["generation_seconds"]),
              title_justify="left", min_width=72)
    for col in ("method", "kind", "calls"):
        t.add_column(col, justify="left" if col != "calls" else "right")
    for (method, kind), n in sorted(Counter((c["method"], c["kind"]) for c in calls).items()):
        t.add_row(method, kind, str(n))
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    console.print(t)
    if sidecar["fallbacks"]:
        console.print(f"[yellow]stock fallbacks: {sidecar['fallbacks']}[/yellow]")
    check = sidecar.get("motion_check")
    if check and check["checked"]:
        marks = ", ".join(f"{k} {'right' if check[k] else 'wrong'}" for k in ("colour", "shape", "motion"))
        console.print(f"motion check of the caption: {'passed' if check['passed'] else 'failed'} ({marks})"
                      + (f": {check['reason']}" if check["reason"] else ""))
    elif check:
        console.print(f"motion check: not checked ({check['reason']})")
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
