"""`bench pipeline --local-heads`: a Wan transformer whose self-attention heads attend by position, a
stand-in for trained attention's locality (random weights attend nearly uniformly, so a dynamic sparse
rule keeps almost every tile on them). Checked from the module's own projections and diffusers' RoPE
tables: every token's query and key are the same vector, so the logits depend only on the offset
between query and key, peak at offset 0 and fall with distance; a sharper head keeps more of its mass
near the query; values and the rest of the model are untouched; bad uses refused in one line."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from fp4video.cli import bench
from fp4video.cli.common import UsageError
from fp4video.integration.rope import stock_wan_rope
from fp4video.integration.tiny import tiny_wan_transformer


def attention_of_centre(model, frames=4, height=12, width=12):
    """(probabilities of the centre token's query over every key, per head; each key's Chebyshev
    distance on the latent grid) of block 0's self-attention, from its projections and RoPE tables."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    attn = model.blocks[0].attn1
    tokens = frames * height * width
    x = torch.randn(1, tokens, attn.to_q.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(x)).unflatten(2, (attn.heads, -1))
    rope = WanRotaryPosEmbed(q.shape[-1], (1, 2, 2), 64)
    cos, sin = rope(torch.zeros(1, 16, frames, 2 * height, 2 * width))
    q, k = stock_wan_rope(q, cos, sin), stock_wan_rope(k, cos, sin)
    grid = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width),
                                      indexing="ij"), -1).reshape(-1, 3)
    centre = (frames // 2) * height * width + (height // 2) * width + width // 2
    logits = torch.einsum("shd,hd->hs", k[0].double(), q[0, centre].double()) / math.sqrt(q.shape[-1])
    return logits.softmax(-1), (grid - grid[centre]).abs().max(-1).values, x, q, k


def test_queries_and_keys_lose_the_tokens_and_attention_falls_with_distance():
    model = tiny_wan_transformer(0, 128, num_attention_heads=2)
    values_before = model.blocks[0].attn1.to_v.weight.clone()
    cross_before = model.blocks[0].attn2.to_q.weight.clone()
    bench.make_heads_local(model, 1.0, 3.0)
    probs, dist, x, _, _ = attention_of_centre(model)
    attn = model.blocks[0].attn1
    with torch.no_grad():
        q = attn.norm_q(attn.to_q(x))
    assert torch.equal(q, q[:, :1].expand_as(q)), "a query still depends on its token"
    assert torch.equal(attn.to_v.weight, values_before) and torch.equal(model.blocks[0].attn2.to_q.weight, cross_before)
    near = [float(p[dist <= 2].sum()) for p in probs]
    share = float((dist <= 2).double().mean())  # what a uniform head would keep there
    assert near[1] > near[0] > share, (near, share)  # both local; the sharper head more so
    assert near[1] > 0.5
    for p in probs:  # a key's weight falls with its distance over the first rings; the far ones 10× below
        rings = [float(p[dist == r].mean()) for r in range(int(dist.max()) + 1)]
        assert all(a > b for a, b in zip(rings[:4], rings[1:4])) and rings[0] > 10 * max(rings[4:]), rings


def test_random_weights_attend_nearly_uniformly_beside_it():
    """Without it the same heads are not local: what the option is for."""
    probs, dist, *_ = attention_of_centre(tiny_wan_transformer(0, 128, num_attention_heads=2))
    share = float((dist <= 2).double().mean())
    assert all(float(p[dist <= 2].sum()) < 3 * share for p in probs)


def pipeline_args(**kw):
    return argparse.Namespace(**{**dict(model="wan22", layers=None, resolutions=["480p"], methods=["fp16"], configs=[],
                                        reps=1, peers=False, tiny=True, linear=["bf16"], local_heads=[1.0, 3.0]),
                                 **kw})


def test_bench_pipeline_says_so_under_the_table():
    table = bench.bench_pipeline(pipeline_args())
    assert "self-attention heads made local (--local-heads)" in table
    assert "- --local-heads 1 3: every self-attention head attends by position" in table
    assert "| 480p |" in table


@pytest.mark.parametrize("kw,message", [
    (dict(model="hunyuan"), "--local-heads is for --model wan22"),
    (dict(local_heads=[2.0, 1.0]), "--local-heads takes 0 < FLATTEST <= SHARPEST <= 100, got 2 1"),
    (dict(local_heads=[0.0, 1.0]), "--local-heads takes 0 < FLATTEST <= SHARPEST <= 100, got 0 1"),
    (dict(local_heads=[1.0, 101.0]), "--local-heads takes 0 < FLATTEST <= SHARPEST <= 100, got 1 101"),
    (dict(linear=["bf16", "fp8-rowwise"]), "--local-heads zeroes the self-attention's q/k projection weights"),
])
def test_bad_uses_are_refused_in_one_line(kw, message):
    with pytest.raises(UsageError, match=message) as err:
        bench.bench_pipeline(pipeline_args(**kw))
    assert "\n" not in str(err.value)
