"""Several processes (``torchrun --nproc-per-node N fp4video generate ...``): one video spread over
N devices with diffusers' context parallelism (Ulysses and/or ring), FP4 attention inside it.

Every rank loads the pipeline and runs the same denoising loop with the same seed; the
transformers' context-parallel plan splits the video tokens across ranks and gathers the output,
so only rank 0 writes the video. On GPUs this is diffusers' own ``enable_parallelism``; without
an accelerator (CPU, gloo: how the tests run it) the same configuration is applied by hand, since
``enable_parallelism`` in diffusers 0.42 requires an accelerator.
"""

from __future__ import annotations

import os

import torch

__all__ = ["world", "setup_process_group", "enable_context_parallel"]


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) for a plain run."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_process_group(device_arg: str | None) -> torch.device:
    """Initialise torch.distributed for this rank (nccl on CUDA, gloo on CPU); returns its device."""
    import torch.distributed as dist

    rank, size = world()
    local = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = (device_arg or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if use_cuda:
        if torch.cuda.device_count() <= local:
            raise RuntimeError(f"rank {rank} wants cuda:{local} but this host has {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=size)
    return device


def hunyuan_video_plan() -> dict:
    """fp4video's context-parallel plan for ``HunyuanVideoTransformer3DModel`` (diffusers has none).

    The video tokens are split after the patch embedding, with their RoPE tables; the text tokens
    (after the token refiner, 256 of them) stay whole on every rank, and the joint attention
    treats them as replicated keys (:func:`fp4video.integration.parallel.joint_context_parallel_attention`):
    the text mask then never has to be split or exchanged. The model's own mask construction
    sees the local video length, so the mask it builds is the local joint mask. The output
    projection gathers the video tokens back.
    """
    from .diffusers_api import context_parallel_input, context_parallel_output

    split_rows = context_parallel_input(split_dim=0, expected_dims=2, split_output=True)
    return {
        "rope": {0: split_rows, 1: split_rows},
        "x_embedder": {0: context_parallel_input(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": context_parallel_output(gather_dim=1, expected_dims=3),
    }


def _require_fp4_processors(model, args):
    """Under fp4video's HunyuanVideo plan the text tokens are replicated on every rank; diffusers'
    stock joint attention would count them once per rank. Refuse to run without fp4video's routing
    (installed by :func:`fp4video.install`) or its processors."""
    from .processor import FP4Processor

    if getattr(model, "_fp4video_saved", None) is not None:
        return
    stock = [name for name, proc in model.attn_processors.items()
             if "token_refiner" not in name and not isinstance(proc, FP4Processor)]
    if stock:
        raise RuntimeError(
            f"{type(model).__name__} runs context parallelism with fp4video's plan, which needs fp4video on its "
            f"joint attention ({len(stock)} modules have stock processors, e.g. {stock[0]}): call "
            "fp4video.install(pipe, policy) (method 'fp16' keeps full precision)")


def context_parallel_plan(model) -> dict:
    """The model's own ``_cp_plan`` (Wan), fp4video's for HunyuanVideo, else a clear error."""
    if getattr(model, "_cp_plan", None) is not None:
        return model._cp_plan
    if type(model).__name__ == "HunyuanVideoTransformer3DModel":
        return hunyuan_video_plan()
    raise NotImplementedError(f"{type(model).__name__} has no context-parallel plan; fp4video has plans for Wan "
                              "(diffusers' own) and HunyuanVideo transformers")


def cpu_parallel_config(*, ring_degree: int, ulysses_degree: int):
    """diffusers' ``ParallelConfig`` for a CPU (gloo) process group, set up on this rank — what
    ``enable_parallelism`` builds on GPUs (it requires an accelerator in diffusers 0.42)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ring_degree, ulysses_degree), mesh_dim_names=("ring", "ulysses"))
    parallel = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring_degree,
                                                                           ulysses_degree=ulysses_degree))
    parallel.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    return parallel


def enable_context_parallel(pipe, *, ring_degree: int, ulysses_degree: int, device: torch.device) -> None:
    """Split every transformer of ``pipe`` (a pipeline, both Wan2.2 experts, or a bare transformer)
    over the process group (call before ``fp4video.install`` or after it: the model's processors,
    which fp4video's routing keeps, pick the configuration up either way)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    size = dist.get_world_size()
    if ring_degree * ulysses_degree != size:
        raise ValueError(f"ring_degree × ulysses_degree = {ring_degree} × {ulysses_degree} must equal the number "
                         f"of processes ({size})")
    parallel = cpu_parallel_config(ring_degree=ring_degree, ulysses_degree=ulysses_degree) if device.type == "cpu" \
        else None
    from .install import transformers_of

    for _, model in transformers_of(pipe):
        plan = context_parallel_plan(model)
        heads = model.config.num_attention_heads
        if heads % ulysses_degree:
            raise ValueError(f"Ulysses splits heads: {heads} heads are not divisible by ulysses_degree={ulysses_degree}")
        if getattr(model, "_cp_plan", None) is None:  # fp4video's plan: only its processors handle it
            model.register_forward_pre_hook(_require_fp4_processors)
        if parallel is None:
            model.enable_parallelism(config=ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree),
                                     cp_plan=plan)
            continue
        # CPU (gloo): what enable_parallelism does, without its accelerator requirement
        from diffusers.hooks.context_parallel import apply_context_parallel

        model._parallel_config = parallel
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = parallel
        apply_context_parallel(model, parallel.context_parallel_config, plan)
