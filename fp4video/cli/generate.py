"""``fp4video generate``: a video through the FP4 attention path, with a JSON sidecar that records
every attention call (step, expert, block, kind, method)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

EXAMPLES = """examples:
  fp4video generate                                   # embedded default: tiny random Wan2.2, mxattn policy
  fp4video generate --config configs/wan22_mxattn.yaml --model /models/Wan2.2-T2V-A14B-Diffusers \\
      --output wan.mp4 --device cuda
  fp4video generate --config configs/wan22_sage3.yaml --model tiny --steps 6 --seed 3
  torchrun --nproc-per-node 2 -m fp4video.cli.main generate --config configs/wan22_mxattn.yaml \\
      --model /models/Wan2.2-T2V-A14B-Diffusers --ulysses-degree 2     # one video on 2 GPUs
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate a video with FP4 attention", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="run config YAML (default: the embedded tiny Wan2.2 + mxattn config)")
    p.add_argument("--model", help='"tiny", a local pipeline folder or a hub id (overrides the config)')
    p.add_argument("--prompt", action="append", help="prompt (repeat for several; overrides the config)")
    p.add_argument("--output", type=Path, default=Path("fp4video.mp4"),
                   help="output mp4 (several prompts: NAME_0.mp4, NAME_1.mp4, ...); a .json sidecar goes beside it")
    p.add_argument("--steps", type=int, help="denoising steps (overrides the config)")
    p.add_argument("--seed", type=int, help="random seed (overrides the config)")
    p.add_argument("--height", type=int, help="video height (overrides the config)")
    p.add_argument("--width", type=int, help="video width (overrides the config)")
    p.add_argument("--frames", type=int, help="number of frames (overrides the config)")
    p.add_argument("--method", help="replace the policy by one method everywhere (e.g. fp16, mxattn)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"],
                   help="FP4 attention backend (default auto: Triton kernels on CUDA, else the reference)")
    p.add_argument("--ring-degree", type=int, help="under torchrun: ring attention degree (overrides the config)")
    p.add_argument("--ulysses-degree", type=int, help="under torchrun: Ulysses degree (overrides the config)")
    return p


def resolve_config(args):
    from ..integration.config import DEFAULT_CONFIG, RunConfig, load_config
    from ..integration.policy import Policy
    from ..integration.tiny import tiny_sizes

    cfg = load_config(args.config) if args.config else DEFAULT_CONFIG
    changes = {}
    if args.model:
        changes["model"] = args.model
    if args.prompt:
        changes["prompts"] = args.prompt
    if args.method:
        changes["policy"] = Policy(method=args.method)
    if (args.model or cfg.model) == "tiny":  # the YAML's sizes are for the real model
        changes.update(tiny_sizes(cfg.family))
    for name in ("steps", "seed", "height", "width", "frames"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.ring_degree is not None or args.ulysses_degree is not None:
        base = cfg.parallel.model_dump() if cfg.parallel else {}
        changes["parallel"] = {**base, **{k: v for k, v in (("ring_degree", args.ring_degree),
                                                              ("ulysses_degree", args.ulysses_degree)) if v is not None}}
    # re-validate: overrides get the same checks as the YAML
    return RunConfig.model_validate({**cfg.model_dump(), **changes}) if changes else cfg


def run(args) -> int:
    import torch

    from ..integration import install
    from ..integration.config import ConfigError
    from pydantic import ValidationError

    from ..integration.pipelines import load_pipeline, pipeline_kwargs
    from ..integration.policy import format_validation_error
    from ..integration.runner import generate_video

    try:
        cfg = resolve_config(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"error: {format_validation_error(e, 'command line')}", file=sys.stderr)
        return 2
    from ..integration import distributed

    rank, size = distributed.world()
    if size > 1 and (cfg.parallel is None or cfg.parallel.ring_degree * cfg.parallel.ulysses_degree != size):
        got = "none" if cfg.parallel is None else f"ring {cfg.parallel.ring_degree} × ulysses {cfg.parallel.ulysses_degree}"
        print(f"error: launched on {size} processes, so ring_degree × ulysses_degree must be {size} (config "
              f"`parallel:` or --ring-degree/--ulysses-degree); got {got}", file=sys.stderr)
        return 2
    if size == 1 and cfg.parallel is not None and cfg.parallel.ring_degree * cfg.parallel.ulysses_degree > 1:
        print("error: context parallelism needs several processes: launch with "
              "`torchrun --nproc-per-node N -m fp4video.cli.main generate ...`", file=sys.stderr)
        return 2
    problem = device_problem(args.device, args.backend)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    device = distributed.setup_process_group(args.device) if size > 1 else \
        torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    try:
        calls = [pipeline_kwargs(cfg, prompt, device) for prompt in cfg.prompts]  # inputs checked before loading
        pipe = load_pipeline(cfg, device)
        if size > 1:
            distributed.enable_context_parallel(pipe, ring_degree=cfg.parallel.ring_degree,
                                                ulysses_degree=cfg.parallel.ulysses_degree, device=device)
    except (FileNotFoundError, OSError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t0
    if rank != 0:
        pipe.set_progress_bar_config(disable=True)
    ctx = install(pipe, cfg.policy, backend=args.backend)

    for i, (prompt, call) in enumerate(zip(cfg.prompts, calls)):
        out = args.output if len(cfg.prompts) == 1 else args.output.with_name(f"{args.output.stem}_{i}{args.output.suffix}")
        sidecar = generate_video(pipe, ctx, cfg, prompt, call, out, device=device, backend=args.backend,
                                 load_seconds=t_load, write=rank == 0, world_size=size)
        if rank == 0:
            _summary(out, sidecar)
    if size > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank done with its collectives before the group goes
        dist.destroy_process_group()
    return 0


def device_problem(device: str | None, backend: str) -> str | None:
    """What stops ``--device`` / ``--backend`` from working on this machine, in one line (or None)."""
    import torch

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


def _summary(out, sidecar):
    from rich.console import Console
    from rich.table import Table

    calls = sidecar["attention_calls"]
    t = Table(title=f"{out}  ({sidecar['frames']} frames, {sidecar['timings_s']['generate']:.1f} s)",
              title_justify="left", min_width=72)
    for col in ("method", "kind", "calls"):
        t.add_column(col, justify="left" if col != "calls" else "right")
    for (method, kind), n in sorted(Counter((c["method"], c["kind"]) for c in calls).items()):
        t.add_row(method, kind, str(n))
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    console.print(t)
    if sidecar["fallbacks"]:
        console.print(f"[yellow]stock fallbacks: {sidecar['fallbacks']}[/yellow]")
    console.print(f"wrote {out} and {out.with_suffix('.json')}")
