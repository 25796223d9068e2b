"""Review of HunyuanVideo's RoPE at the dispatch and ``bench pipeline --local-heads``: defects found,
each test named after its class.

- ``--local-heads`` sharpness values that are not finite (``inf``), or too large for the float32
  the heads' norm weights are built in (``1e39``), are taken: ``inf`` times a model whose
  self-attention outputs are NaN and prints the table as if it measured something, ``1e39`` ends in
  a multi-line traceback (exit 1) instead of the one-line usage error, exit 2.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fp4video.cli import bench
from fp4video.cli.common import UsageError


def pipeline_args(**kw):
    """``bench pipeline``'s arguments for the tiny Wan transformer (the CPU path)."""
    return argparse.Namespace(**{**dict(model="wan22", layers=None, resolutions=["480p"], methods=["fp16"], configs=[],
                                        reps=1, peers=False, tiny=True, linear=["bf16"], local_heads=[1.0, 3.0]),
                                 **kw})


@pytest.mark.parametrize("sharpest", [math.inf, 1e39], ids=["inf", "1e39"])
def test_local_heads_sharpness_that_is_not_a_finite_float32_is_refused_in_one_line(sharpest):
    """Sharpness is a norm weight (a float32 of the model): a value that is not finite, or not
    representable there, is bad input, refused before any forward with the usage error."""
    with pytest.raises(UsageError, match="--local-heads") as err:
        bench.bench_pipeline(pipeline_args(local_heads=[1.0, sharpest]))
    assert "\n" not in str(err.value)


def test_local_heads_never_builds_a_model_whose_attention_is_nan():
    """Whatever values ``_build`` accepts, the model it times is finite: an accepted ``inf`` gives
    NaN norm weights and a NaN forward (here: ``_build`` must refuse it, or give finite weights)."""
    args = argparse.Namespace(model="wan22", layers=None, tiny=True, local_heads=[1.0, math.inf])
    try:
        model, inputs, _ = bench._build(args, "cpu")
    except UsageError:
        return
    weights = torch.cat([b.attn1.norm_q.weight.detach() for b in model.blocks])
    kw, _ = inputs("480p")
    with torch.no_grad():
        out = model(**kw)[0]
    assert torch.isfinite(weights).all() and torch.isfinite(out).all(), "the timed model's attention is NaN"
