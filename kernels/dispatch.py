"""One attention call on the GPU: the plan (:func:`.plan.plan`), the input checks, the pre-pass, the
loop, the LSE shift and the NaN policy, in that order, inside the ``fp4video::attention`` custom op.

The op lives inside ``torch.compile``d models and CUDA graphs: opaque to the compiler (no graph
break), its fake implementation only describes the outputs. Its body is the whole call, so a call
reaches its loop in three frames: ``fp4_attention`` → :func:`attention` → ``attention_<loop>``.
:func:`prepare` and :func:`run_loop` run the two halves apart (benchmarks time them separately).
"""

from __future__ import annotations

import functools
import importlib

import torch

from fp4video.recipe import AttentionRecipe
from fp4video.reference import (input_ranges, plan_ranges, poison_heads, range_summary, rescale_inputs,
                                rescale_output)

from .checks import k_smoothing_mean, nonfinite_heads, smoothing_lse_shift
from .loop_e4m3 import E4M3_V_SPAN_LIMIT, FAST_LOGIT_BOUND
from .operands import FP8Operands, KeyTileLists, PackedOperands, TileOperands, WorkOperands
from .plan import Plan, plan as plan_call
from .prepass import prepass, prepass_fp8, prepass_packed, prepass_tiles

__all__ = ["attention", "prepare", "prepare_checked", "run_loop", "loop_function", "key_padding", "LOOP_FUNCTIONS"]

#: each plan's loop: (module, launch function); every one takes (operands, key_alive, plan, *,
#: recipe, scale, out_dtype, dv, exact, block_m, num_warps, num_stages)
LOOP_FUNCTIONS = {
    "e4m3": ("loop_e4m3", "attention_e4m3"),
    "scaled": ("loop_scaled", "attention_packed"),
    "nvfp4": ("loop_nvfp4", "attention_nvfp4"),
    "nvfp4_sm90": ("loop_nvfp4_sm90", "attention_nvfp4_sm90"),  # imported only where chosen: it needs Gluon
    "bf16": ("loop_bf16", "attention_bf16"),
}


@functools.cache
def loop_function(loop: str):
    """The launch function of a plan's loop (:data:`LOOP_FUNCTIONS`)."""
    module, name = LOOP_FUNCTIONS[loop]
    return getattr(importlib.import_module(f".{module}", __package__), name)


@functools.lru_cache(maxsize=64)
def _recipe(spec: str) -> AttentionRecipe:
    """The op's recipe, parsed once per spec (:meth:`AttentionRecipe.to_spec`)."""
    return AttentionRecipe.from_spec(spec)


def key_padding(mask, b: int, sk: int):
    """A key-padding mask (B|1, 1, 1, Sk|1) as the kernels' ``key_alive`` (B, Sk), or None: a mask
    broadcast over batches or keys is expanded, so every key it covers counts (in K's smoothing mean
    too: :func:`.checks.k_smoothing_mean`)."""
    return None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]


def prepare(q, k, v, recipe: AttentionRecipe, key_alive, plan: Plan | None = None, mean=None):
    """The pre-pass of ``plan`` (default: :func:`.plan.plan` for these inputs): its operands
    (:mod:`.operands`). ``mean``: K's smoothing mean (:func:`.checks.k_smoothing_mean`) when the
    caller has it. No input checks (:func:`attention` runs them)."""
    plan = plan_call(recipe, q, v) if plan is None else plan
    if not plan.runnable:
        raise NotImplementedError(plan.reason)
    if plan.operands == "fp8":
        return prepass_fp8(q, k, v, recipe, key_alive, k_tile_order=plan.key_order == "tile", mean=mean)
    if plan.operands == "packed":
        return prepass_packed(q, k, v, recipe, key_alive, mean, quad_order=plan.key_order == "quad")
    if plan.operands == "tiles":
        return prepass_tiles(q, k, v, recipe, key_alive, plan.work_dtype, mean)
    if plan.operands == "work":
        return prepass(q, k, v, recipe, key_alive, plan.work_dtype, mean)
    if plan.work_dtype is not None:  # "inputs" in the interpreter: fp32 copies (exact)
        return WorkOperands(*(t.to(plan.work_dtype) for t in (q, k, v)))
    return WorkOperands(q, k, v)  # the inputs as they are: no copy, any strides


def run_loop(plan: Plan, operands, key_alive, *, recipe: AttentionRecipe, scale: float, out_dtype, dv: int,
             exact: bool = True, block_m: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None, visit: KeyTileLists | None = None):
    """The attention loop alone, on :func:`prepare`'s operands for ``plan``; ``dv``: the value head
    dim. Launch values override the loop's own; ``exact``: the exponents' exact form (False only
    where every logit lies within :data:`.loop_e4m3.FAST_LOGIT_BOUND` nats, which lets the e4m3
    loop run its fast form; the other loops have one exact form); ``visit``: a block-sparse call's key
    tiles (:meth:`.operands.KeyTileLists.from_bitmap`; the loops of :data:`.plan.SPARSE_LOOPS` take them)."""
    if visit is not None and (why := plan.sparse_reason):
        raise NotImplementedError(why)
    expected = {"fp8": FP8Operands, "packed": PackedOperands, "tiles": TileOperands}.get(plan.operands, WorkOperands)
    if not isinstance(operands, expected):
        raise TypeError(f"the {plan.module} plan takes {expected.__name__}, got {type(operands).__name__}")
    return loop_function(plan.loop)(operands, key_alive, plan, recipe=recipe, scale=scale, out_dtype=out_dtype, dv=dv,
                                    exact=exact, block_m=block_m, num_warps=num_warps, num_stages=num_stages,
                                    **({"visit": visit} if visit is not None else {}))


def prepare_checked(q, k, v, recipe: AttentionRecipe, key_alive, plan: Plan, mean, bad, ranges):
    """(the plan that runs, its operands, whether any head is ``bad``, the values of ``ranges``).

    Every decision here reads the GPU's answer back in **one** transfer: whether V fits the e4m3
    loop's window (else the plan's fallback runs: the exact bf16 loop), whether heads hold a
    NaN/Inf (``bad``: (B, H) bool, or None: unknown, taken as True), and the input ranges the
    finite-output guarantee checks (``ranges``: :func:`fp4video.reference.range_summary`, a 1-D
    device tensor, or None; read back as floats). While a CUDA graph is captured nothing can be
    read back: the window check is skipped, heads are always poisoned, and the ranges are neither
    checked nor rescaled (inputs beyond them may give NaN/Inf there)."""
    operands = prepare(q, k, v, recipe, key_alive, plan, mean)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    wanted = [bad.any()] if bad is not None else []
    span = getattr(operands, "v_span", None)
    if span is not None:  # heads with a NaN/Inf become NaN anyway: their V does not count
        wanted.append((span if bad is None else span.masked_fill(bad[..., None], 0)).max())
    if capturing or not (wanted or ranges is not None):
        return plan, operands, True, None
    parts = [torch.stack([f.to(torch.float64) for f in wanted])] if wanted else []
    if ranges is not None:
        parts.append(ranges.to(torch.float64).flatten())
    values = torch.cat(parts).tolist()
    has_bad = bool(values[0]) if bad is not None else True
    got_ranges = values[len(wanted):] if ranges is not None else None
    if span is not None and values[len(wanted) - 1] > E4M3_V_SPAN_LIMIT:
        plan = plan.fallback
        operands = prepare(q, k, v, recipe, key_alive, plan, mean)
    return plan, operands, has_bad, got_ranges


@torch.library.custom_op("fp4video::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_alive: torch.Tensor | None, recipe: str,
              scale: float, key_tiles: torch.Tensor | None = None,
              query_tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) views in (any strides); (out (B, H, Sq, Dv) in q's dtype, lse (B, H, Sq) fp32) out.

    ``key_alive``: (B, Sk) bool or None (:func:`key_padding`); ``recipe``: :meth:`AttentionRecipe.to_spec`.
    ``key_tiles``: a block-sparse call's selection bitmap (B|1, H|1, ceil(Sq / query_tile), ceil(Sk /
    128)) bool (:class:`fp4video.sparse.BlockSelection`), or None (dense); the LSE is then that of
    the visited keys.

    The finite-output guarantee (:data:`fp4video.reference.LOGIT_BOUND`): the inputs' ranges are
    read back with the NaN/Inf check, in the one transfer of :func:`prepare_checked`; a call beyond
    the logit bound raises, and one whose Q, K or V need an exact power-of-two rescaling
    (:func:`fp4video.reference.plan_ranges`: magnitudes near fp32's limit, rare) runs the pre-pass
    again on the rescaled inputs (a second transfer, on that path only)."""
    recipe = _recipe(recipe)
    plan = plan_call(recipe, q, v)
    if not plan.runnable:
        raise NotImplementedError(plan.reason)
    visit = None
    if key_tiles is not None:
        if why := plan.sparse_reason:
            raise NotImplementedError(why)
        b, h, sq, _ = q.shape
        visit = KeyTileLists.from_bitmap(key_tiles, query_tile, b, h, sq, k.shape[-2])
    bad = nonfinite_heads(q, k, v, key_alive)  # the NaN/Inf policy: those heads' outputs become NaN
    # nothing is read back while a CUDA graph is captured: the ranges are not even computed there
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    ranges = None if capturing else input_ranges(q, k, v, None if key_alive is None else key_alive[:, None, :], bad)
    mean = k_smoothing_mean(k, key_alive) if recipe.smooth_k else None
    summary = None if ranges is None else range_summary(ranges, scale, q.shape[-1])
    run, operands, has_bad, summary = prepare_checked(q, k, v, recipe, key_alive, plan, mean, bad, summary)
    v_factor = None
    if summary is not None and (rescale := plan_ranges(summary, scale, q.dtype)).needed:
        q, k, v, scale, v_factor = rescale_inputs(q, k, v, ranges, rescale, scale)
        mean = k_smoothing_mean(k, key_alive) if recipe.smooth_k else None
        run, operands, has_bad, _ = prepare_checked(q, k, v, recipe, key_alive, plan, mean, bad, None)
    # the e4m3 loop's fast exponents where the logits are known to be bounded (always while a CUDA
    # graph is captured, when nothing is read back)
    exact = summary is not None and not summary[3] <= FAST_LOGIT_BOUND
    out, lse = loop_function(run.loop)(operands, key_alive, run, recipe=recipe, scale=scale, out_dtype=q.dtype,
                                       dv=v.shape[-1], exact=exact, **({"visit": visit} if visit else {}))
    out = rescale_output(out, v_factor)
    if mean is not None:  # the loops' LSE is of the smoothed logits: back to the unsmoothed ones
        lse = lse + smoothing_lse_shift(q, mean, scale)
    if has_bad:  # a pass over the output only where some head holds a NaN/Inf
        poison_heads(out, lse, bad)
    return out, lse


@attention.register_fake
def _(q, k, v, key_alive, recipe, scale, key_tiles=None, query_tile=128):
    b, h, sq, _ = q.shape
    return q.new_empty(b, h, sq, v.shape[-1]), q.new_empty(b, h, sq, dtype=torch.float32)
