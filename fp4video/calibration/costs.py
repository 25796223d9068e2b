"""The candidates' costs, times relative to stock attention at a site's shape: stock attention
timed on one sample of each shape the run made (always: the prediction needs it), each candidate
timed too with ``costs="measure"``, and the cost function from those timings, the H200 table or a
``fp4video bench kernel`` file."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from .plan import DEFAULT_RELATIVE_COST, costs_from_table, nearest, split_target

__all__ = ["median_seconds", "stock_and_candidate_times", "cost_function"]


def median_seconds(fn, device, reps: int = 3) -> float:
    """The median time of ``fn()`` over ``reps`` runs after one warm-up (CUDA events on a GPU)."""
    fn()  # warm-up (and compilation)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def stock_and_candidate_times(samples, targets, ctx, fp16_exact, *, measure: bool, progress: bool) -> dict:
    """{shape: {"stock": s, target: s, ...}}: diffusers' active (stock) attention timed on each
    sample; with ``measure`` each candidate too (fp16 on its exact backend where one is set)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from tqdm import tqdm

    from .measure import run_target

    out = {}
    with torch.no_grad():
        for shape, a in tqdm(samples.items(), desc="timing", unit="shape", disable=not progress, leave=False):
            device = a.query.device
            row = {"stock": median_seconds(lambda: dispatch_attention_fn(a.query, a.key, a.value,
                                                                         attn_mask=a.attn_mask, scale=a.scale), device)}
            if measure:
                for t in targets:
                    if t == "fp16":
                        if fp16_exact is not None and fp16_exact.why_not(a) is None:
                            row[t] = median_seconds(lambda: fp16_exact.run(a), device)
                        else:
                            row[t] = row["stock"]
                        continue
                    if split_target(t)[1] is not None:
                        continue  # block-sparse: its method's time × its density's share (cost_function)
                    if isinstance(run_target(t, a, ctx), str):
                        continue  # it cannot take these calls: never chosen for them
                    row[t] = median_seconds(lambda t=t: run_target(t, a, ctx), device)
            out[shape] = row
    return out


def cost_function(costs, times, fp16_exact):
    """cost(target, site shape) -> time relative to stock attention (None: unknown); a block-sparse
    candidate's is its method's dense one (:func:`~fp4video.calibration.plan.site_cost` scales it
    by the density measured at each site)."""
    by_shape = {shape[:4]: row for shape, row in times.items()}
    if costs == "measure":
        def cost(target, shape):
            target = split_target(target)[0]
            row = by_shape.get(shape)
            if row is None or target not in row:
                return math.inf if row is not None else None
            return row[target] / row["stock"]
        return cost
    if costs == "table":
        table = dict(DEFAULT_RELATIVE_COST)
    else:
        points = costs_from_table(Path(costs).read_text())
        table = None

    def cost(target, shape):
        target = split_target(target)[0]
        t = f"backend:{fp16_exact.name}" if target == "fp16" and fp16_exact is not None else target
        if table is not None:
            return table.get(t, 1.0 if t == "fp16" else None)
        seq = math.isqrt(shape[0] * shape[1])
        if t not in points:
            return 1.0 if t == "fp16" else None
        return nearest(points[t], seq)

    return cost
