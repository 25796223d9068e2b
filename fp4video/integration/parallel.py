"""FP4 attention inside diffusers' context parallelism (Ulysses all-to-all, ring with LSE merging).

diffusers runs a context-parallel attention as ``_templated_context_parallel_attention(q, k, v,
..., forward_op=..., _parallel_config=...)``: Ulysses exchanges heads for tokens (all-to-all) and
calls ``forward_op`` once on the full sequence for H / N heads; ring gathers the K/V shards and
calls ``forward_op`` once per shard, merging the partial outputs with their log-sum-exp in fp32.
fp4video plugs :func:`fp4video.fp4_attention` in as that ``forward_op``; this module is the only
place that touches that private diffusers function, and it fails with a clear message if it moves.

Quantization blocks and shards: Q and K are quantized along the head dim, which no shard splits.
V's blocks (32 tokens) and P's blocks (32 keys) are formed inside each ``forward_op`` call, from
the first key of the K/V it was given: under Ulysses that is the whole sequence (the blocks are
the single-GPU blocks, so the result equals the single-GPU one); under ring it is one shard, so a
block never straddles two shards (a shard whose length is not a multiple of 32 ends in a partial
block, padded as the single-GPU tail is). Ring attention therefore equals the LSE-merge of FP4
attention over the shards, which differs from single-GPU FP4 attention by the rounding of the
blocks at shard boundaries and by each shard's own running maximum (P̃ = exp(s − m) is quantized
relative to the maximum seen so far).
"""

from __future__ import annotations

from ..attention import fp4_attention
from ..recipe import AttentionRecipe, get_recipe


def _templated_attention():
    try:
        from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    except ImportError as e:  # pragma: no cover - depends on the installed diffusers
        import diffusers

        raise RuntimeError(
            "fp4video's context-parallel attention uses diffusers' _templated_context_parallel_attention "
            f"(present in diffusers 0.42.1); diffusers {diffusers.__version__} does not have it. Pin "
            "diffusers to a version with it, or run without context parallelism."
        ) from e
    return _templated_context_parallel_attention


def make_forward_op(method: str | AttentionRecipe, backend: str = "auto"):
    """A diffusers ``forward_op`` running fp4video's FP4 attention on (B, S, H, D) tensors."""
    recipe = get_recipe(method)

    def forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   _save_ctx=True, _parallel_config=None):
        if dropout_p or is_causal or enable_gqa:
            raise ValueError("fp4video's FP4 attention has no dropout, causal mask or GQA "
                             f"(got dropout_p={dropout_p}, is_causal={is_causal}, enable_gqa={enable_gqa})")
        out, lse = fp4_attention(query, key, value, method=recipe, layout="bshd", attn_mask=attn_mask, scale=scale,
                                 return_lse=True, backend=backend)
        return (out, lse) if return_lse else out

    return forward_op


def _no_backward(*args, **kwargs):
    raise RuntimeError("fp4video's FP4 attention is inference-only: it has no backward pass")


def context_parallel_attention(q, k, v, *, method: str | AttentionRecipe, parallel_config, attn_mask=None,
                               scale: float | None = None, backend: str = "auto"):
    """FP4 attention of this rank's (B, S_local, H, D) shards under ``parallel_config`` (diffusers'
    ``ParallelConfig`` with a context-parallel part, set up on every rank). Returns this rank's
    output shard (B, S_local, H, D)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        raise ValueError("parallel_config has no context_parallel_config")
    if cp.ulysses_degree > 1 and q.shape[2] % cp.ulysses_degree:
        raise ValueError(f"Ulysses needs the head count ({q.shape[2]}) divisible by ulysses_degree ({cp.ulysses_degree})")
    return _templated_attention()(
        q, k, v, attn_mask, 0.0, False, scale, False, False,
        forward_op=make_forward_op(method, backend), backward_op=_no_backward, _parallel_config=parallel_config,
    )
