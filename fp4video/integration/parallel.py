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
from .diffusers_api import templated_context_parallel_attention


def uses_ring(parallel_config) -> bool:
    """Whether ``parallel_config`` (diffusers' ``ParallelConfig`` or None) splits keys over a ring."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    return cp is not None and cp.ring_degree > 1


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


def _any_rank(flag: bool, parallel_config, device) -> bool:
    """Whether ``flag`` holds on any rank of the context-parallel group (of the whole process group
    where the config has no mesh)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cp_group(parallel_config))
    return bool(t.item())


def _cp_group(parallel_config):
    """The process group of the context-parallel mesh (the whole process group without one)."""
    mesh = getattr(parallel_config, "_flattened_mesh", None)
    return None if mesh is None else mesh.get_group()


def _gather_tokens(x, dim: int, parallel_config):
    """Every rank's shard of ``x`` concatenated along ``dim`` in the mesh's rank order: the order
    in which diffusers' plan split the tokens (equal chunks, rank r the r-th)."""
    import torch
    import torch.distributed as dist

    group = _cp_group(parallel_config)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gathered_attention(q, k, v, attn_mask, method, parallel_config, scale, backend, return_lse):
    """A masked call under context parallelism: diffusers' plan splits a key-padding mask with the
    tokens (LTX-Video's text and its mask), so a rank's share of it describes only its own keys,
    while Ulysses attends to every rank's keys and ring to each shard in turn. Here K, V and the
    mask are gathered from every rank in token order and this rank's queries attend to all keys,
    all heads: the single-process result for these rows under both Ulysses and ring (the keys'
    quantization blocks are the single-process ones). The cost is an all-gather of K and V, as
    diffusers' ring does; the masked calls of the video models are text cross-attention, whose
    keys are a few hundred tokens."""
    if attn_mask.dim() != 4 or attn_mask.shape[2] != 1 or attn_mask.shape[3] != k.shape[1]:
        raise ValueError(
            f"context-parallel attention takes key-padding masks (B, 1 or H, 1, S_local) over this rank's "
            f"{k.shape[1]} keys; got a mask of shape {tuple(attn_mask.shape)}")
    k_all, v_all = _gather_tokens(k, 1, parallel_config), _gather_tokens(v, 1, parallel_config)
    mask_all = _gather_tokens(attn_mask, 3, parallel_config)
    out, lse = fp4_attention(q, k_all, v_all, method=method, layout="bshd", attn_mask=mask_all, scale=scale,
                             return_lse=True, backend=backend)
    return (out, lse) if return_lse else out


def _no_backward(*args, **kwargs):
    raise RuntimeError("fp4video's FP4 attention is inference-only: it has no backward pass")


def context_parallel_attention(q, k, v, *, method: str | AttentionRecipe, parallel_config, attn_mask=None,
                               scale: float | None = None, backend: str = "auto", return_lse: bool = False):
    """FP4 attention of this rank's (B, S_local, H, D) shards under ``parallel_config`` (diffusers'
    ``ParallelConfig`` with a context-parallel part, set up on every rank). Returns this rank's
    output shard (B, S_local, H, D) (and its LSE (B, S_local, H) with ``return_lse``)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        raise ValueError("parallel_config has no context_parallel_config")
    if cp.ulysses_degree > 1 and q.shape[2] % cp.ulysses_degree:
        raise ValueError(f"Ulysses needs the head count ({q.shape[2]}) divisible by ulysses_degree ({cp.ulysses_degree})")
    if attn_mask is not None:
        if _any_rank(not bool(attn_mask.all()), parallel_config, q.device):  # every rank decides alike (or one would wait forever)
            return _gathered_attention(q, k, v, attn_mask, method, parallel_config, scale, backend, return_lse)
        attn_mask = None  # every key kept: the mask changes nothing
    return templated_context_parallel_attention()(
        q, k, v, attn_mask, 0.0, False, scale, False, return_lse,
        forward_op=make_forward_op(method, backend), backward_op=_no_backward, _parallel_config=parallel_config,
    )


def joint_context_parallel_attention(q, k, v, *, n_replicated: int, method: str | AttentionRecipe, parallel_config,
                                     attn_mask=None, scale: float | None = None, backend: str = "auto"):
    """Joint attention whose last ``n_replicated`` tokens (HunyuanVideo's text) are the same on every
    rank while the others (video) are this rank's shard; ``attn_mask`` may mask only those
    replicated tokens (the text padding).

    Ulysses: the video tokens go from sequence shards to head shards (all-to-all), the text
    tokens' own heads are appended, and one FP4 attention runs over [video; text] — the single-GPU
    key order, hence the single-GPU quantization blocks and result. Ring: the video keys go
    through the ring (no mask: all valid), the text keys through a local FP4 attention with
    their mask, and the two partial results are merged with their LSE in fp32, as the ring merges
    its shards. Every query sees every key once either way.
    """
    import torch

    s_local = k.shape[1] - n_replicated
    if s_local <= 0 or n_replicated <= 0:
        raise ValueError(f"expected video tokens followed by {n_replicated} replicated tokens, got {k.shape[1]} keys")
    text_mask = None if attn_mask is None else attn_mask[..., s_local:]
    if attn_mask is not None and not bool(attn_mask[..., :s_local].all()):
        raise ValueError("joint context parallelism expects a mask over the replicated (text) tokens only")
    cp_config = parallel_config.context_parallel_config
    if cp_config.ring_degree == 1:
        return _joint_ulysses(q, k, v, s_local, text_mask, method, cp_config, scale, backend)
    cp = templated_context_parallel_attention()(
        q, k[:, :s_local], v[:, :s_local], None, 0.0, False, scale, False, True,
        forward_op=make_forward_op(method, backend), backward_op=_no_backward, _parallel_config=parallel_config,
    )
    out_v, lse_v = cp[0], cp[1]
    out_t, lse_t = fp4_attention(q, k[:, s_local:], v[:, s_local:], method=method, layout="bshd", attn_mask=text_mask,
                                 scale=scale, return_lse=True, backend=backend)
    lse_v, lse_t = lse_v.float(), lse_t.float()
    lse = torch.logaddexp(lse_v, lse_t)
    w_v = torch.exp(lse_v - lse).nan_to_num(0.0)[..., None]  # rows that see no key at all stay zero
    w_t = torch.exp(lse_t - lse).nan_to_num(0.0)[..., None]
    return (w_v * out_v.float() + w_t * out_t.float()).to(q.dtype)


def _joint_ulysses(q, k, v, s_local, text_mask, method, cp_config, scale, backend):
    """Ulysses for joint attention: video tokens all-to-all'ed from sequence shards to head shards,
    the replicated text tokens' own heads appended, one FP4 attention over [video; text] — the
    single-GPU key order, so the single-GPU quantization blocks — then back; the text outputs
    of the rank's heads are all-gathered."""
    import torch
    import torch.distributed as dist

    group = cp_config._ulysses_mesh.get_group()
    n = cp_config.ulysses_degree
    rank = dist.get_rank(group)
    b, _, h, d = q.shape
    if h % n:
        raise ValueError(f"Ulysses needs the head count ({h}) divisible by ulysses_degree ({n})")
    hl = h // n

    def to_heads(x):  # (B, s_local, H, D) -> (B, n·s_local, H/n, D), global token order
        x = x.reshape(b, s_local, n, hl, x.shape[-1]).permute(2, 1, 0, 3, 4).contiguous()
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=group)
        return y.flatten(0, 1).permute(1, 0, 2, 3)

    def own_heads(x):
        return x[:, :, rank * hl:(rank + 1) * hl]

    qf, kf, vf = (torch.cat([to_heads(x[:, :s_local]), own_heads(x[:, s_local:])], dim=1) for x in (q, k, v))
    mask = None
    if text_mask is not None:
        video = torch.ones(*text_mask.shape[:-1], n * s_local, dtype=torch.bool, device=text_mask.device)
        mask = torch.cat([video, text_mask], dim=-1)
    out = fp4_attention(qf, kf, vf, method=method, layout="bshd", attn_mask=mask, scale=scale, backend=backend)
    video, text = out[:, :n * s_local], out[:, n * s_local:]
    # back: (B, n·s_local, H/n, Dv) -> this rank's tokens, all heads
    video = video.reshape(b, n, s_local, hl, -1).permute(1, 2, 0, 3, 4).contiguous()
    back = torch.empty_like(video)
    dist.all_to_all_single(back, video, group=group)
    video = back.permute(2, 1, 0, 3, 4).reshape(b, s_local, h, -1)
    parts = [torch.empty_like(text) for _ in range(n)]
    dist.all_gather(parts, text.contiguous(), group=group)
    return torch.cat([video, torch.cat(parts, dim=2)], dim=1)
