"""`fp4video.install` on the video transformers of diffusers, each a tiny random model built from
its config: blocks and kinds found from the model's structure, `fp16` equal to stock bit for bit,
each call routed as the policy says, masks honoured, models that bypass the dispatcher refused, and
diffusers' caches keeping the step and recording what they skipped."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
import diffusers  # noqa: E402

from fp4video.integration import Policy, install, uninstall  # noqa: E402
from fp4video.integration.routing import BACKEND, boolean_mask  # noqa: E402
from fp4video.integration.sites import NotRoutable, attention_sites  # noqa: E402


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _randomized(model):
    """A random model: diffusers zero-initializes some output layers, which would hide attention."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if not p.any():
                p.copy_(_rand(*p.shape, seed=100 + i) * 0.05)
    return model.eval()


#: family -> (tiny transformer, its inputs, the kinds its blocks' calls have, number of blocks)
FAMILIES = {
    "wan-vace": (
        lambda: diffusers.WanVACETransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=48),
        lambda: dict(hidden_states=_rand(1, 16, 2, 8, 8), timestep=torch.tensor([500]),
                     encoder_hidden_states=_rand(1, 12, 32, seed=1), control_hidden_states=_rand(1, 48, 2, 8, 8, seed=2)),
        {"self", "cross"}, 5),  # 3 blocks, then the 2 VACE blocks
    "skyreels-v2": (
        lambda: diffusers.SkyReelsV2Transformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
        lambda: dict(hidden_states=_rand(1, 16, 2, 8, 8), timestep=torch.tensor([500]),
                     encoder_hidden_states=_rand(1, 12, 32, seed=1)),
        {"self", "cross"}, 2),
    "hunyuan-video-1.5": (
        lambda: diffusers.HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(8, 12, 12),
            task_type="t2v"),
        lambda: dict(hidden_states=_rand(1, 9, 2, 8, 8), timestep=torch.tensor([500.0]),
                     encoder_hidden_states=_rand(1, 10, 16, seed=1), encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3]),
                     encoder_hidden_states_2=_rand(1, 6, 8, seed=2), encoder_attention_mask_2=torch.tensor([[1] * 4 + [0] * 2]),
                     image_embeds=torch.zeros(1, 5, 12)),
        {"joint"}, 2),
    "ltx-video": (
        lambda: diffusers.LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64,
            num_layers=2, caption_channels=16),
        lambda: dict(hidden_states=_rand(1, 2 * 8 * 8, 8), encoder_hidden_states=_rand(1, 10, 16, seed=1),
                     timestep=torch.tensor([500]), encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3]),
                     num_frames=2, height=8, width=8),
        {"self", "cross"}, 2),
    "sana-video": (  # linear self-attention (not through the dispatcher) stays; cross-attention is routed
        lambda: diffusers.SanaVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2,
            num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=16,
            sample_size=8),
        lambda: dict(hidden_states=_rand(1, 4, 2, 8, 8), encoder_hidden_states=_rand(1, 10, 16, seed=1),
                     timestep=torch.tensor([500]), encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3])),
        {"cross"}, 2),
    "kandinsky5": (
        lambda: diffusers.Kandinsky5Transformer3DModel(
            in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=32, out_visual_dim=4, model_dim=64, ff_dim=64,
            num_text_blocks=1, num_visual_blocks=2, axes_dims=(8, 12, 12)),
        lambda: dict(hidden_states=_rand(1, 2, 8, 8, 4), encoder_hidden_states=_rand(1, 10, 16, seed=1),
                     timestep=torch.tensor([500.0]), pooled_projections=_rand(1, 8, seed=2),
                     visual_rope_pos=(torch.arange(2), torch.arange(4), torch.arange(4)), text_rope_pos=torch.arange(10)),
        {"self", "cross"}, 3),  # the text block, then the 2 visual blocks
}

# processors that call the dispatcher without naming a backend: routed through the active backend
FAMILIES["cosmos-1.0"] = (
    lambda: diffusers.CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2, text_embed_dim=16,
        adaln_lora_dim=8, max_size=(4, 16, 16), concat_padding_mask=False),
    lambda: dict(hidden_states=_rand(1, 4, 2, 8, 8), timestep=torch.tensor([500.0]),
                 encoder_hidden_states=_rand(1, 10, 16, seed=1)),
    {"self", "cross"}, 2)
FAMILIES["cosmos-2.5"] = (  # the image context (Cosmos 2.5's img_context): its own dispatch, kind "image"
    lambda: diffusers.CosmosTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2, text_embed_dim=16,
        adaln_lora_dim=8, max_size=(4, 16, 16), concat_padding_mask=False, extra_pos_embed_type=None,
        use_crossattn_projection=True, crossattn_proj_in_channels=24, encoder_hidden_states_channels=16,
        img_context_dim_in=12, img_context_num_tokens=5, img_context_dim_out=64),
    lambda: dict(hidden_states=_rand(1, 4, 2, 8, 8), timestep=torch.tensor([500.0]),
                 encoder_hidden_states=(_rand(1, 10, 24, seed=1), _rand(1, 5, 12, seed=2))),
    {"self", "cross", "image"}, 2)
FAMILIES["ltx-2"] = (  # video and audio streams: self, text cross, audio-to-video and video-to-audio cross
    lambda: diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=16,
        audio_cross_attention_dim=32, num_layers=2, caption_channels=16),
    lambda: dict(hidden_states=_rand(1, 2 * 8 * 8, 8), audio_hidden_states=_rand(1, 6, 8, seed=3),
                 encoder_hidden_states=_rand(1, 10, 16, seed=1), audio_encoder_hidden_states=_rand(1, 10, 16, seed=2),
                 timestep=torch.tensor([500]), encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3]),
                 audio_encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3]), num_frames=2, height=8, width=8,
                 audio_num_frames=6),
    {"self", "cross"}, 2)
FAMILIES["wan-animate"] = (  # the 2 blocks, then the face adapter's 2 attention blocks (its own block list)
    lambda: diffusers.WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=36, latent_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, image_dim=16, added_kv_proj_dim=64,
        rope_max_seq_len=32, motion_encoder_size=64, motion_style_dim=16, motion_dim=8, motion_encoder_dim=16,
        face_encoder_hidden_dim=32, face_encoder_num_heads=2, inject_face_latents_blocks=1),
    lambda: dict(hidden_states=_rand(1, 36, 3, 8, 8), timestep=torch.tensor([500]),
                 encoder_hidden_states=_rand(1, 512, 32, seed=1),  # its processor takes the last 512 as the text
                 encoder_hidden_states_image=_rand(1, 5, 16, seed=2), pose_hidden_states=_rand(1, 16, 2, 8, 8, seed=3),
                 face_pixel_values=_rand(1, 3, 2, 64, 64, seed=4)),
    {"self", "cross", "image"}, 4)

# Wan-architecture derivatives, and Motif Video (HunyuanVideo-style dual / single-stream blocks)
FAMILIES["chronoedit"] = (
    lambda: diffusers.ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
    lambda: dict(hidden_states=_rand(1, 16, 2, 8, 8), timestep=torch.tensor([500]),
                 encoder_hidden_states=_rand(1, 12, 32, seed=1)),
    {"self", "cross"}, 2)
FAMILIES["helios"] = (
    lambda: diffusers.HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, rope_dim=(8, 12, 12)),
    lambda: dict(hidden_states=_rand(1, 16, 2, 8, 8), timestep=torch.tensor([500]),
                 encoder_hidden_states=_rand(1, 12, 32, seed=1)),
    {"self", "cross"}, 2)
FAMILIES["anyflow"] = (  # its latents come (B, T, C, H, W), with a timestep and an r-timestep per frame
    lambda: diffusers.AnyFlowTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
    lambda: dict(hidden_states=_rand(1, 2, 16, 8, 8), timestep=torch.tensor([[500, 500]]),
                 r_timestep=torch.tensor([[250, 250]]), encoder_hidden_states=_rand(1, 12, 32, seed=1)),
    {"self", "cross"}, 2)
FAMILIES["kandinsky6"] = (  # video and audio: the text blocks of each, then visual blocks with audio-video cross-attention
    lambda: diffusers.Kandinsky6Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=32, model_dim=64, ff_dim=64,
        num_text_blocks=1, num_visual_blocks=2, axes_dims=(8, 12, 12), visual_cond=False),
    lambda: dict(hidden_states=_rand(1, 2, 8, 8, 4), encoder_hidden_states=_rand(1, 10, 16, seed=1),
                 pooled_projections=_rand(1, 8, seed=2), timestep=torch.tensor([500.0]),
                 visual_rope_pos=(torch.arange(2), torch.arange(4), torch.arange(4)),
                 audio_hidden_states=_rand(1, 6, 20, seed=3)),
    {"self", "cross"}, 4)
FAMILIES["hunyuan-framepack"] = (  # HunyuanVideo's blocks over [history (clean, 2x, 4x); new latents]
    lambda: diffusers.HunyuanVideoFramepackTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(8, 12, 12),
        image_condition_type=None, has_image_proj=True, image_proj_dim=12, has_clean_x_embedder=True),
    lambda: dict(hidden_states=_rand(1, 4, 2, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=_rand(1, 10, 16, seed=1),
                 encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3]), pooled_projections=_rand(1, 8, seed=2),
                 image_embeds=_rand(1, 5, 12, seed=3), indices_latents=torch.arange(2), guidance=torch.tensor([3500.0]),
                 latents_clean=_rand(1, 4, 1, 8, 8, seed=4), indices_latents_clean=torch.tensor([2]),
                 latents_history_2x=_rand(1, 4, 2, 8, 8, seed=5), indices_latents_history_2x=torch.tensor([3, 4]),
                 latents_history_4x=_rand(1, 4, 4, 8, 8, seed=6), indices_latents_history_4x=torch.tensor([5, 6, 7, 8])),
    {"joint"}, 2)
FAMILIES["motif-video"] = (  # the text padding mask in its joint attention
    lambda: diffusers.MotifVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=32, num_layers=1,
        num_single_layers=1, text_embed_dim=16, rope_axes_dim=(8, 12, 12)),
    lambda: dict(hidden_states=_rand(1, 16, 2, 8, 8), timestep=torch.tensor([500]),
                 encoder_hidden_states=_rand(1, 10, 16, seed=1), encoder_attention_mask=torch.tensor([[1] * 7 + [0] * 3])),
    {"joint"}, 2)

#: name -> (tiny transformer, what the refusal names: the processor and why it cannot be routed)
REFUSED = {
    "cogvideox": (lambda: diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8, sample_frames=5, max_text_seq_length=10),
        r"CogVideoXAttnProcessor2_0 calls PyTorch's scaled_dot_product_attention itself"),
    "easyanimate": (lambda: diffusers.EasyAnimateTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2, sample_width=8,
        sample_height=8, num_layers=1, mmdit_layers=1, time_embed_dim=8, text_embed_dim=16),
        r"EasyAnimateAttnProcessor2_0 calls PyTorch's scaled_dot_product_attention itself"),
    # block-sparse flex attention, whatever backend the model is set to
    "kandinsky6-sr": (lambda: diffusers.Kandinsky6SRTransformer3DModel(
        in_visual_dim=4, out_visual_dim=4, time_dim=32, model_dim=64, ff_dim=64, num_visual_blocks=2,
        axes_dims=(8, 12, 12)),
        r"Kandinsky6SRAttnProcessor hands diffusers' dispatcher a fixed backend \(FLEX\)"),
}


def _forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    build, inputs, kinds, n_blocks = FAMILIES[request.param]
    torch.manual_seed(0)
    return request.param, _randomized(build()), inputs(), kinds, n_blocks


def test_fp16_is_stock_and_the_policy_routes_each_call(family):
    from fp4video.integration.dispatcher import active_backend

    name, model, kw, kinds, n_blocks = family
    active = active_backend()
    stock = _forward(model, kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sana-video's linear attention: its own test below
        ctx = install(model, "fp16")
    try:
        assert torch.equal(_forward(model, kw), stock)  # the model's own processors, stock backend
    finally:
        uninstall(model)
    assert {c["kind"] for c in ctx.calls} == kinds
    assert sorted({c["block"] for c in ctx.calls}) == list(range(n_blocks))
    policy = Policy.model_validate({"method": "fp16", "rules": [
        {"method": "mxattn", "blocks": [n_blocks - 1]}, {"method": "sage3", "kinds": ["cross", "joint"]}]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = install(model, policy)
    try:
        out = _forward(model, kw)
    finally:
        uninstall(model)
    assert torch.isfinite(out).all() and not torch.equal(out, stock)
    for c in ctx.calls:
        assert c["method"] == policy.method_for(block=c["block"], step=None, num_steps=None, kind=c["kind"], expert=None)
    assert {c["method"] for c in ctx.calls} >= {"sage3", "mxattn"} - ({"mxattn"} if kinds <= {"cross", "joint"} else set())
    assert torch.equal(_forward(model, kw), stock)  # uninstall restored the model
    assert active_backend() is active  # the process-wide backend put back after each routed module
    assert not any(getattr(getattr(m, "processor", None), "_attention_backend", None) is not None
                   for m in model.modules())


def test_the_kinds_read_from_the_structure_cover_every_call_and_name_image_and_joint_exactly(family):
    """What install checks kind rules against (the kinds each site's calls can have, read from the
    model's structure) holds every kind a forward records at that site, and names ``image`` and
    ``joint`` for a model exactly when its calls have them: a kind rule is refused only where no call
    can match it, and an image or joint rule on a model without such calls is refused."""
    from fp4video.integration.routing import possible_kinds

    name, model, kw, kinds, _ = family
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = install(model, "fp16")
    try:
        _forward(model, kw)
    finally:
        uninstall(model)
    recorded: dict = {}
    for c in ctx.calls:
        recorded.setdefault(c["site"], set()).add(c["kind"])
    predicted = {s.name: possible_kinds(s) for s in attention_sites(model) if s.name in recorded}
    assert set(predicted) == set(recorded)
    for site, got in recorded.items():
        assert got <= predicted[site], (name, site, got, predicted[site])
    every = set().union(*predicted.values())
    assert every & {"image", "joint"} == kinds & {"image", "joint"}, (name, every)


def test_sites_are_read_from_the_structure():
    """Block indices count the model's block lists in registration order (Kandinsky 5: the text
    block first); attention outside the lists (HunyuanVideo-1.5's token refiner) is block -1."""
    k5 = FAMILIES["kandinsky5"][0]()
    blocks = {s.name.split(".")[0]: s.block for s in attention_sites(k5) if s.block >= 0}
    assert blocks == {"text_transformer_blocks": 0, "visual_transformer_blocks": 2}  # last site of each list
    hy = FAMILIES["hunyuan-video-1.5"][0]()
    outside = [s for s in attention_sites(hy) if s.block < 0]
    assert outside and all("refiner" in s.name for s in outside)


def test_linear_attention_is_named_not_dropped():
    build, inputs, *_ = FAMILIES["sana-video"]
    model = _randomized(build())
    with pytest.warns(UserWarning, match=r"2 attention modules of SanaVideoTransformer3DModel's blocks keep their own "
                                         r"attention \(SanaLinearAttnProcessor3_0"):
        ctx = install(model, "mxattn")
    uninstall(model)
    assert sorted(ctx.unrouted) == ["SanaVideoTransformer3DModel.transformer_blocks.0.attn1",
                                    "SanaVideoTransformer3DModel.transformer_blocks.1.attn1"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_models_whose_processors_bypass_the_dispatcher_are_refused(name):
    build, why = REFUSED[name]
    model = build()
    before = {s.name: s.processor for s in attention_sites(model)}
    with pytest.raises(NotRoutable, match=why):
        install(model, "mxattn")
    assert {s.name: s.processor for s in attention_sites(model)} == before
    assert not any(hasattr(m, "_fp4video_block") or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("name", ["ltx-video", "hunyuan-video-1.5", "motif-video", "hunyuan-framepack"])
def test_text_mask_is_honoured_on_the_fp4_path(name):
    """LTX-Video passes its text padding as an additive mask to the cross-attention,
    HunyuanVideo-1.5, Motif Video and FramePack as a boolean mask over [video; text] to their joint attention: padded text tokens
    must not change the output under an FP4 method (they would, were the mask dropped)."""
    build, inputs, *_ = FAMILIES[name]
    model = _randomized(build())
    kw = inputs()
    other = dict(kw, encoder_hidden_states=kw["encoder_hidden_states"].clone())
    other["encoder_hidden_states"][:, 7:] = 50.0  # only the masked (padding) tokens differ
    assert not torch.equal(_forward(model, dict(kw, encoder_hidden_states=kw["encoder_hidden_states"] * 2)),
                           _forward(model, kw))  # the text does matter
    assert not torch.equal(_forward(model, kw)[..., :1], torch.zeros(1))
    install(model, "mxattn")
    try:
        a, b = _forward(model, kw), _forward(model, other)
    finally:
        uninstall(model)
    assert torch.equal(a, b)


def test_boolean_mask():
    assert boolean_mask(None) is None
    m = torch.tensor([[True, False]])
    assert boolean_mask(m) is m
    additive = torch.tensor([[0.0, -10000.0, float("-inf"), 0.0]])
    assert torch.equal(boolean_mask(additive), torch.tensor([[True, False, False, True]]))
    with pytest.raises(ValueError, match=r"bias values \(e.g. -0.5\).*needs method fp16"):
        boolean_mask(torch.tensor([[0.0, -0.5]]))
    with pytest.raises(ValueError, match="dtype torch.int64"):
        boolean_mask(torch.tensor([[1, 0]]))


def test_the_backend_outside_an_install_says_what_to_do():
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from fp4video.integration.routing import register_routing_backend

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=rf"{BACKEND} attention backend outside an attention module"):
        dispatch_attention_fn(q, q, q, backend=register_routing_backend())


# --- diffusers' caches -----------------------------------------------------------------------------


def _cache_configs(pipe):
    """Each cache set to skip on the tiny Wan model: diffusers' defaults skip nothing in 4 steps or,
    for Wan, cannot run (FasterCache's defaults expect CFG batched into one call, which Wan's
    pipeline does not do; TaylorSeer's default patterns fully match no module named ``attn1``)."""
    return {
        "FirstBlockCache": diffusers.FirstBlockCacheConfig(threshold=1e9),  # skip every block it may
        "PyramidAttentionBroadcast": diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep),
        # the first step must compute (the approximation needs two cached outputs)
        "FasterCache": diffusers.FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 900),
            current_timestep_callback=lambda: pipe.current_timestep, attention_weight_callback=lambda _: 0.3,
            is_guidance_distilled=True, tensor_format="BFCHW"),
        "TaylorSeerCache": diffusers.TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, cache_identifiers=[r"blocks\.\d+\.attn\d"],
            taylor_factors_dtype=torch.float32),
        # ratios of 1 (residuals that do not change) let it skip as long as max_skip_steps allows
        "MagCache": diffusers.MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4, threshold=0.5,
                                             max_skip_steps=2, retention_ratio=0.0),
    }


@pytest.mark.parametrize("cache", ["FirstBlockCache", "PyramidAttentionBroadcast", "FasterCache", "TaylorSeerCache",
                                   "MagCache"])
def test_caches_keep_the_step_and_record_what_they_skip(cache):
    from fp4video.integration.tiny import TINY_SIZES, tiny_wan_pipeline

    pipe = tiny_wan_pipeline(two_experts=False, seed=3)
    config = _cache_configs(pipe)[cache]
    pipe.transformer.enable_cache(config)
    policy = Policy.model_validate({"method": "mxattn", "rules": [{"method": "fp16", "blocks": [0]},
                                                                 {"method": "fp16", "steps": {"last": 1}}]})
    ctx = install(pipe, policy)
    try:
        out = pipe(prompt="a cat", negative_prompt="", height=TINY_SIZES["height"], width=TINY_SIZES["width"],
                   num_frames=TINY_SIZES["frames"], num_inference_steps=4, guidance_scale=1.0, output_type="np",
                   generator=torch.Generator().manual_seed(0)).frames[0]
    finally:
        uninstall(pipe)
        pipe.transformer.disable_cache()
    assert torch.isfinite(torch.as_tensor(out)).all()
    attended = [c for c in ctx.calls if c["method"] != "skipped"]
    skipped = [c for c in ctx.calls if c["method"] == "skipped"]
    assert skipped, f"{cache} skipped nothing: the test would not show anything"
    assert sorted({c["step"] for c in ctx.calls}) == [0, 1, 2, 3]  # denoising steps, not transformer calls
    for c in attended:
        assert c["method"] == policy.method_for(block=c["block"], step=c["step"], num_steps=4, kind=c["kind"],
                                                expert=None)
    # per step, every site of every block either attended or was recorded as skipped
    sites = {s.name for s in attention_sites(pipe.transformer) if s.block >= 0}
    per_step = Counter((c["step"], c["site"]) for c in ctx.calls)
    for step in range(4):
        assert {site for (s, site) in per_step if s == step} == sites


@pytest.mark.parametrize("family", ["ltx", "ltx2", "skyreels", "vace", "animate", "sana", "hunyuan15", "kandinsky5"])
def test_tiny_pipelines_fp16_is_stock_and_steps_are_tracked(family):
    """The embedded tiny pipelines beyond Wan and HunyuanVideo (`generate --model tiny` with
    `family: ltx | ltx2 | skyreels | vace | animate | sana | hunyuan15 | kandinsky5`), called as `generate`
    calls them: fp16 through fp4video is the stock video (and LTX-2's soundtrack) bit for bit, the
    policy sees each denoising step, and the FP4 step changes the video."""
    from fp4video.integration.config import RunConfig
    from fp4video.integration.pipelines import configure_pipeline, pipeline_kwargs
    from fp4video.integration.tiny import tiny_pipeline, tiny_sizes

    cfg = RunConfig(model="tiny", family=family, **{**tiny_sizes(family), "steps": 2}, guidance_scale=3.0)
    pipe = configure_pipeline(tiny_pipeline(family), cfg)

    def run():
        out = pipe(**pipeline_kwargs(cfg, "a cat", torch.device("cpu")))
        if family == "ltx2":  # the video and its soundtrack, side by side
            return np.concatenate([out.frames[0].ravel(), out.audio[0].float().numpy().ravel()])
        return out.frames[0]

    stock = run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sana-video's linear self-attention stays (test_linear_attention_...)
        ctx = install(pipe, Policy.model_validate({"method": "fp16", "rules": [{"method": "mxattn", "steps": {"last": 1}}]}))
    try:
        out = run()
    finally:
        uninstall(pipe)
    assert sorted({c["step"] for c in ctx.calls}) == [0, 1]
    attended = [c for c in ctx.calls if c["method"] != "skipped"]
    assert {(c["step"], c["method"]) for c in attended} == {(0, "fp16"), (1, "mxattn")}
    skipped = {c["site"].split(".")[-1] for c in ctx.calls if c["method"] == "skipped"}
    if family == "ltx2":  # its modality-guidance pass runs each stream without the other: recorded
        assert skipped == {"audio_to_video_attn", "video_to_audio_attn"}
        assert {c["site"].split(".")[-1] for c in attended} == {"attn1", "attn2", "audio_attn1", "audio_attn2",
                                                                 "audio_to_video_attn", "video_to_audio_attn"}
    else:
        assert not skipped
    if family == "vace":  # the control branch's blocks are routed too
        assert {c["site"].split(".")[0] for c in ctx.calls} == {"blocks", "vace_blocks"}
    if family == "animate":  # the face adapter's blocks too, and the reference image's context
        assert {c["site"].split(".")[0] for c in ctx.calls} == {"blocks", "face_adapter"}
        assert {c["kind"] for c in ctx.calls} == {"self", "cross", "image"}
    assert out.shape == stock.shape and abs(out - stock).max() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        install(pipe, "fp16")
    try:
        assert abs(run() - stock).max() == 0
    finally:
        uninstall(pipe)


def test_tiny_pipeline_names_the_families_it_has():
    from fp4video.integration.tiny import tiny_pipeline

    with pytest.raises(ValueError, match="no tiny model for family 'mochi'; tiny models: wan, hunyuan, ltx"):
        tiny_pipeline("mochi")
    with pytest.raises(ValueError, match="the tiny ltx model is text-to-video"):
        tiny_pipeline("ltx", "i2v")
