"""Tiny random-weight pipelines, built offline from configs (no downloads), that still exercise the
FP4 path for real: head dim 64, hundreds of video tokens, 2 blocks, 512 text tokens.

A public API: ``fp4video generate --model tiny``, ``fp4video calibrate
--model tiny``, ``fp4video bench --tiny`` and the tests use it, and so can a user trying fp4video
without weights::

    from fp4video.integration.tiny import TINY_SIZES, tiny_wan_pipeline
    pipe = tiny_wan_pipeline(two_experts=True)          # Wan2.2-style, both experts
    frames = pipe(prompt="a cat", height=TINY_SIZES["height"], width=TINY_SIZES["width"],
                  num_frames=TINY_SIZES["frames"], num_inference_steps=4, output_type="np").frames[0]

One builder per family (``tiny_<family>_pipeline``; :func:`tiny_pipeline` by family name),
transformers alone (:func:`tiny_wan_transformer`, :func:`tiny_hunyuan_transformer`), each family's
sizes (:func:`tiny_sizes`) and call arguments (:data:`TINY_CALLS`), and :func:`add_sensitivity`,
which builds into a transformer the sites a real model needs precision at (a block whose K has
outlier channels with a large mean; denoising steps with sharp attention), to prove calibration.
They produce noise-like videos: the point is the plumbing and the numerics, not the pictures.
"""

from __future__ import annotations

import torch

__all__ = ["TINY_SIZES", "TINY_LTX_SIZES", "TINY_CALLS", "TINY_LTX_CALL", "TINY_HUNYUAN_CALL", "tiny_wan_transformer",
           "tiny_hunyuan_transformer", "add_sensitivity", "tiny_image", "tiny_wan_pipeline", "tiny_wan_i2v_pipeline", "tiny_hunyuan_pipeline", "tiny_ltx_pipeline",
           "tiny_ltx2_pipeline", "tiny_skyreels_pipeline", "tiny_vace_pipeline", "tiny_animate_pipeline", "tiny_sana_pipeline",
           "tiny_hunyuan15_pipeline", "tiny_kandinsky5_pipeline", "tiny_pipeline", "tiny_sizes", "tiny_tokenizer",
           "tiny_animate_videos"]

#: Generation sizes used with the tiny models (the YAML's sizes are for the real model).
#: 96×160, 17 frames -> latent 5 × 12 × 20 -> 300 video tokens after the (1, 2, 2) patch.
TINY_SIZES = {"height": 96, "width": 160, "frames": 17, "steps": 4, "fps": 8}

_VOCAB = ["<pad>", "</s>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def tiny_tokenizer():
    """A word-level tokenizer over single letters (T5-style pad / eos / unk), made in memory."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(_VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_wan_transformer(seed: int = 0, head_dim: int = 64, cls=None, **overrides):
    """A 2-block Wan-architecture transformer with random weights (``cls``: WanTransformer3DModel,
    or a Wan derivative taking the same config: SkyReels-V2, VACE); ``overrides`` change its config
    (e.g. ``num_layers``). 2 heads of ``head_dim``, text dim 32, 16 latent channels."""
    if cls is None:
        from diffusers import WanTransformer3DModel as cls

    torch.manual_seed(seed)
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )
    return cls(**{**config, **overrides}).eval()


def _tiny_wan_parts(seed: int):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(_VOCAB), d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8)).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return dict(tokenizer=tiny_tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler)


def _tiny_clip_vision(with_projection: bool):
    """A tiny CLIP image encoder (hidden size 16, 32 px images) and its PIL image processor."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

    try:  # transformers 5: the PIL backend by name (no torchvision needed)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor

    cls = CLIPVisionModelWithProjection if with_projection else CLIPVisionModel
    encoder = cls(CLIPVisionConfig(hidden_size=16, projection_dim=16, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, intermediate_size=16, patch_size=8)).eval()
    processor = CLIPImageProcessor(crop_size=32, do_center_crop=True, do_normalize=True, do_resize=True,
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711], resample=3, size=32)
    return encoder, processor


def tiny_wan_i2v_pipeline(*, head_dim: int = 64, seed: int = 0):
    """Wan2.1-style image-to-video: a tiny CLIP image encoder and ``added_kv_proj_dim`` set, so the
    cross-attention has the extra image-context attention (the context is [image; 512 text])."""
    from diffusers import WanImageToVideoPipeline

    parts = _tiny_wan_parts(seed)
    image_encoder, processor = _tiny_clip_vision(with_projection=True)
    transformer = tiny_wan_transformer(seed + 1, head_dim, in_channels=36, image_dim=16,
                                        added_kv_proj_dim=2 * head_dim)
    return WanImageToVideoPipeline(**parts, image_encoder=image_encoder, image_processor=processor,
                                   transformer=transformer)


def tiny_wan_pipeline(*, two_experts: bool = True, head_dim: int = 64, seed: int = 0):
    """Wan2.2-style T2V pipeline (two experts, boundary 0.875) or Wan2.1-style (one transformer)."""
    from diffusers import WanPipeline

    parts = _tiny_wan_parts(seed)
    transformer = tiny_wan_transformer(seed + 1, head_dim)
    transformer_2 = tiny_wan_transformer(seed + 2, head_dim) if two_experts else None
    return WanPipeline(**parts, transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=0.875 if two_experts else None)


def tiny_skyreels_pipeline(*, head_dim: int = 64, seed: int = 0):
    """SkyReels-V2 text-to-video (a Wan derivative: UMT5-style text encoder, the Wan VAE)."""
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    return SkyReelsV2Pipeline(**_tiny_wan_parts(seed),
                              transformer=tiny_wan_transformer(seed + 1, head_dim, SkyReelsV2Transformer3DModel))


def tiny_vace_pipeline(*, head_dim: int = 64, seed: int = 0):
    """Wan VACE (its control branch: 2 VACE blocks beside the 2 main ones). Without a control video
    the pipeline conditions on an empty one, as for text-to-video."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline, WanVACETransformer3DModel

    parts = dict(_tiny_wan_parts(seed), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    transformer = tiny_wan_transformer(seed + 1, head_dim, WanVACETransformer3DModel, vace_layers=[0, 1],
                                        vace_in_channels=96)
    return WanVACEPipeline(**parts, transformer=transformer)


#: Face frames of the tiny Wan Animate model (its motion encoder's input size; the real model's is 512).
TINY_ANIMATE_FACE_SIZE = 64


def tiny_animate_pipeline(*, head_dim: int = 64, seed: int = 0):
    """Wan Animate (character animation from a reference image, a pose video and a face video): the
    2 Wan blocks with the image context, the face adapter (2 attention blocks of its own) fed by a
    tiny motion encoder, the tiny CLIP image encoder."""
    from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel

    image_encoder, processor = _tiny_clip_vision(with_projection=False)
    transformer = tiny_wan_transformer(
        seed + 1, head_dim, WanAnimateTransformer3DModel, in_channels=36, latent_channels=16, image_dim=16,
        added_kv_proj_dim=2 * head_dim, motion_encoder_size=TINY_ANIMATE_FACE_SIZE, motion_style_dim=16, motion_dim=8,
        motion_encoder_dim=16, face_encoder_hidden_dim=32, face_encoder_num_heads=2, inject_face_latents_blocks=1)
    return WanAnimatePipeline(**_tiny_wan_parts(seed), image_processor=processor, image_encoder=image_encoder,
                              transformer=transformer)


def tiny_animate_videos(height: int, width: int, frames: int) -> dict:
    """Deterministic conditioning for the tiny Wan Animate model: the reference image, a pose video
    (the test pattern turning) and a face video at the motion encoder's size (turning the other way)."""
    face = TINY_ANIMATE_FACE_SIZE
    return {"image": tiny_image(height, width),
            "pose_video": [tiny_image(height, width).rotate(4 * i) for i in range(frames)],
            "face_video": [tiny_image(face, face).rotate(-4 * i) for i in range(frames)]}


def tiny_sana_pipeline(*, head_dim: int = 64, seed: int = 0):
    """Sana-Video text-to-video: 2 blocks (linear self-attention, which fp4video leaves as it is, and
    cross-attention to the text), a tiny Gemma2 text encoder, the tiny Wan VAE (one of the VAEs the
    pipeline takes)."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel
    from transformers import Gemma2Config, Gemma2Model

    vae = _tiny_wan_parts(seed)["vae"]
    torch.manual_seed(seed + 1)
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(_VOCAB), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512)).eval()
    transformer = SanaVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=head_dim, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=head_dim, cross_attention_dim=2 * head_dim,
        caption_channels=32, sample_size=16, patch_size=(1, 2, 2)).eval()
    scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return SanaVideoPipeline(tokenizer=tiny_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
                             scheduler=scheduler)


def tiny_hunyuan15_pipeline(*, head_dim: int = 64, seed: int = 0):
    """HunyuanVideo-1.5 text-to-video: 2 joint blocks and a token refiner, a tiny Qwen2.5-VL text
    model (its chat template reduced to the messages' text) and a tiny ByT5 encoder, the tiny
    HunyuanVideo-1.5 VAE (16× in space, 4× in time). The text lengths and the template's crop are
    the tiny model's (the real ones are 1,000 + 108 and 256 tokens)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(_VOCAB), hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=1, eos_token_id=1,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})).eval()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=384, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
                                             relative_attention_num_buckets=8)).eval()
    vae = AutoencoderKLHunyuanVideo15(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,) * 5,
                                      layers_per_block=1, spatial_compression_ratio=16,
                                      temporal_compression_ratio=4).eval()
    torch.manual_seed(seed + 1)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=head_dim, num_layers=2,
        num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
        rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8), task_type="t2v").eval()
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2, tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=3.0))
    pipe.tokenizer_max_length, pipe.prompt_template_encode_start_idx, pipe.tokenizer_2_max_length = 32, 0, 16
    return pipe


def tiny_hunyuan_transformer(seed: int = 0, head_dim: int = 64):
    """A HunyuanVideo transformer with random weights: 1 dual- and 1 single-stream block, a token
    refiner, 2 heads of ``head_dim``, 4 latent channels, text dim 16."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=head_dim, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    ).eval()


def tiny_hunyuan_pipeline(*, head_dim: int = 64, seed: int = 0):
    """HunyuanVideo T2V: 1 dual- and 1 single-stream block, a token refiner, a text padding mask."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    vae = _tiny_hunyuan_vae()
    llama = LlamaModel(LlamaConfig(vocab_size=len(_VOCAB), hidden_size=16, intermediate_size=37, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)).eval()
    return HunyuanVideoPipeline(text_encoder=llama, tokenizer=tiny_tokenizer(), transformer=tiny_hunyuan_transformer(seed + 1, head_dim),
                                vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=_tiny_clip_text(),
                                tokenizer_2=tiny_tokenizer())


def _fill_zero_parameters(model, seed: int) -> None:
    """Small random values in the parameters a model initializes to zero (output projections, gate
    modulations): at zero the attention would not reach the output, and a random tiny model could not
    show what a method changes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _tiny_hunyuan_vae():
    """HunyuanVideo's causal video VAE, 8× in space and 4× in time, 4 latent channels."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
        scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=True,
    ).eval()


def _tiny_clip_text():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(vocab_size=len(_VOCAB), hidden_size=8, intermediate_size=37, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1)).eval()


def tiny_kandinsky5_pipeline(*, seed: int = 0):
    """Kandinsky 5 text-to-video: 1 text and 2 visual blocks, a tiny Qwen2.5-VL (its prompt template
    the tiny model's: a short prefix, nothing cropped), a tiny CLIP text encoder, the tiny
    HunyuanVideo VAE (the VAE its pipeline takes)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    vae = _tiny_hunyuan_vae()
    text = dict(vocab_size=len(_VOCAB), hidden_size=16, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=1, eos_token_id=1,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vocab_size=len(_VOCAB), image_token_id=2, video_token_id=2,
        vision_start_token_id=2)).eval()
    torch.manual_seed(seed + 1)
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=32, out_visual_dim=4, model_dim=64, ff_dim=64,
        num_text_blocks=1, num_visual_blocks=2, axes_dims=(8, 12, 12)).eval()
    _fill_zero_parameters(transformer, seed + 2)  # its output and modulation layers start at zero
    pipe = Kandinsky5T2VPipeline(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tiny_tokenizer(),
                                 text_encoder_2=_tiny_clip_text(), tokenizer_2=tiny_tokenizer(),
                                 scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    pipe.prompt_template, pipe.prompt_template_encode_start_idx = "video: {}", 0
    return pipe


def tiny_ltx_pipeline(*, head_dim: int = 64, seed: int = 0):
    """LTX-Video T2V: 2 blocks (self-attention with RoPE, cross-attention with the text padding mask
    as an additive mask), a tiny causal video VAE (4× in space and time) and T5 text encoder."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    blocks = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                  spatio_temporal_scaling=(True, True, False, False))
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, **blocks,
        decoder_block_out_channels=blocks["block_out_channels"], decoder_layers_per_block=blocks["layers_per_block"],
        decoder_spatio_temporal_scaling=blocks["spatio_temporal_scaling"],
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(_VOCAB), d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8)).eval()
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                             num_attention_heads=2, attention_head_dim=head_dim, cross_attention_dim=128,
                                             num_layers=2, caption_channels=32).eval()
    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                       tokenizer=tiny_tokenizer(), transformer=transformer)


def tiny_ltx2_pipeline(*, head_dim: int = 64, seed: int = 0):
    """LTX-2 text-to-video with sound: the 2-block audio-video transformer (video and audio
    self-attention, text cross-attention of each stream, audio-to-video and video-to-audio
    cross-attention), a tiny Gemma 3 text encoder and its text connectors, the tiny LTX-2 video
    VAE (4× in space and time), the audio VAE (8 mel bins) and a vocoder writing 16 kHz stereo."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=len(_VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=256, sliding_window=64)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=2, boi_token_index=2,
        eoi_token_index=2)).eval()
    connectors = LTX2TextConnectors(  # the text encoder's 3 hidden states (embeddings + 2 layers) stacked
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32).eval()
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False,) * 3,
        downsample_type=("spatiotemporal",) * 2, upsample_residual=(False,) * 2, upsample_factor=(1,) * 2,
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False).eval()
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, in_channels=2,
                                       resolution=32, latent_channels=2, mel_bins=8, sample_rate=16000,
                                       mel_hop_length=160).eval()
    # 160 waveform samples per mel frame (the hop): 16 kHz out
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
                          upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          output_sampling_rate=16000).eval()
    torch.manual_seed(seed + 1)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=head_dim,
        cross_attention_dim=2 * head_dim, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=32, audio_cross_attention_dim=64, num_layers=2, caption_channels=16).eval()
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tiny_tokenizer(), connectors=connectors,
                        transformer=transformer, vocoder=vocoder)


#: Generation sizes of the tiny LTX-Video model: 64×96, 9 frames -> latent 3 × 16 × 24 = 1,152 tokens.
TINY_LTX_SIZES = {"height": 64, "width": 96, "frames": 9, "steps": 4, "fps": 8}


def tiny_pipeline(family: str, task: str = "t2v"):
    """The embedded tiny pipeline of a family (``RunConfig.family``) and task."""
    if task == "i2v":
        if family != "wan":
            raise ValueError(f"the tiny {family} model is text-to-video (task: t2v); the tiny i2v model is Wan's")
        return tiny_wan_i2v_pipeline()
    builders = {"wan": lambda: tiny_wan_pipeline(two_experts=True), "hunyuan": tiny_hunyuan_pipeline,
                "ltx": tiny_ltx_pipeline, "ltx2": tiny_ltx2_pipeline, "skyreels": tiny_skyreels_pipeline,
                "vace": tiny_vace_pipeline, "animate": tiny_animate_pipeline,
                "sana": tiny_sana_pipeline, "hunyuan15": tiny_hunyuan15_pipeline, "kandinsky5": tiny_kandinsky5_pipeline}
    if family not in builders:
        raise ValueError(f"no tiny model for family {family!r}; tiny models: {', '.join(builders)}")
    return builders[family]()


def tiny_sizes(family: str) -> dict:
    """Height, width, frames, steps and fps of a family's tiny model (a YAML's are the real model's)."""
    return dict(TINY_LTX_SIZES if family in ("ltx", "ltx2") else TINY_SIZES)


#: The tiny LTX-Video model's text length (its tokenizer spells prompts letter by letter).
TINY_LTX_CALL = {"max_sequence_length": 32}

#: HunyuanVideo's default prompt template assumes its Llama tokenizer; the tiny model uses none.
TINY_HUNYUAN_CALL = {"prompt_template": {"template": "{}", "crop_start": 0}, "max_sequence_length": 48}

#: Call arguments of each family's tiny model beyond a run config's: short texts (letter by
#: letter); Sana-Video without its Gemma instruction prefix (the real one's chat-style prefix
#: assumes its tokenizer) and without resolution binning (its bins are the real model's sizes).
TINY_CALLS = {
    "ltx": TINY_LTX_CALL,
    "hunyuan": TINY_HUNYUAN_CALL,
    "sana": {"max_sequence_length": 32, "complex_human_instruction": None, "use_resolution_binning": False},
    "kandinsky5": {"max_sequence_length": 32},
    # spatio-temporal guidance off: the real models name the block it perturbs (the default, 28)
    "ltx2": {"max_sequence_length": 32, "stg_scale": 0.0, "audio_stg_scale": 0.0, "spatio_temporal_guidance_blocks": None},
}


class _Clock:
    """The timestep of the transformer's current forward (set by a forward pre-hook)."""

    def __init__(self):
        self.timestep = None

    def hook(self, module, args, kwargs):
        t = kwargs.get("timestep")
        self.timestep = float(torch.as_tensor(t).flatten()[0]) if t is not None else None


class _Sensitive(torch.nn.Module):
    """A Q or K norm with sensitivity built in: ``offset`` added to the channels ``channels`` of
    every head (a K channel mean: exact attention is unchanged, as softmax ignores a per-row
    shift, but the large channels set the quantization scales), and the output multiplied by
    ``sharp`` while the timestep lies in ``window`` (sharper attention on those steps)."""

    def __init__(self, inner, head_dim: int, clock: _Clock, *, offset: float = 0.0, channels=(), sharp: float = 1.0,
                 window=None):
        super().__init__()
        self.inner = inner if inner is not None else torch.nn.Identity()
        self.head_dim, self.clock, self.offset, self.channels = head_dim, clock, offset, tuple(channels)
        self.sharp, self.window = sharp, window

    def forward(self, x):
        y = self.inner(x)
        if self.offset:
            pick = torch.zeros(y.shape[-1], dtype=y.dtype, device=y.device)
            idx = torch.arange(y.shape[-1], device=y.device) % self.head_dim
            for c in self.channels:
                pick = torch.where(idx == c, torch.full_like(pick, self.offset), pick)
            y = y + pick
        t = self.clock.timestep
        if self.sharp != 1.0 and t is not None and self.window[0] <= t < self.window[1]:
            y = y * self.sharp
        return y


def add_sensitivity(transformer, *, outlier_blocks=(), k_offset: float = 24.0, outlier_channels=(3, 17, 40),
                    sharp_timesteps=None, sharp_factor: float = 6.0, sharp_blocks=None) -> dict:
    """Build into ``transformer`` (random tiny weights) the sites where a real video model needs
    precision, so that a calibration can be checked against known answers:

    - ``outlier_blocks``: in these blocks' self / joint attention, K gets outlier channels with a
      large mean (``k_offset`` on ``outlier_channels`` of every head): the exact output is
      unchanged, FP4 K without smoothing loses its precision;
    - ``sharp_timesteps=(lo, hi)``: while the transformer's timestep lies in [lo, hi), Q in the
      self / joint attention of ``sharp_blocks`` (default every block) is scaled by
      ``sharp_factor``: sharper attention on those denoising steps.

    Changes the transformer in place (its norms are wrapped); returns what it built."""
    from .sites import attention_sites

    clock = _Clock()
    transformer.register_forward_pre_hook(clock.hook, with_kwargs=True)
    touched = []
    for site in attention_sites(transformer):
        # cross-attention: its role, or the name diffusers' blocks give it (LTX-Video's carries no role)
        if site.block < 0 or site.role == "cross" or site.name.rsplit(".", 1)[-1] == "attn2":
            continue
        m = site.module
        head_dim = m.to_q.out_features // m.heads
        if site.block in outlier_blocks:
            m.norm_k = _Sensitive(m.norm_k, head_dim, clock, offset=k_offset, channels=outlier_channels)
            touched.append((site.name, "K outlier channels"))
        if sharp_timesteps is not None and (sharp_blocks is None or site.block in sharp_blocks):
            m.norm_q = _Sensitive(m.norm_q, head_dim, clock, sharp=sharp_factor, window=tuple(sharp_timesteps))
            touched.append((site.name, "sharp on timesteps " + "-".join(map(str, sharp_timesteps))))
    if not touched:
        raise ValueError("add_sensitivity changed nothing: give outlier_blocks or sharp_timesteps that the model has")
    return {"outlier_blocks": list(outlier_blocks), "sharp_timesteps": sharp_timesteps, "sites": touched}


def tiny_image(height: int, width: int):
    """A deterministic RGB test pattern (PIL) to condition the tiny image-to-video model."""
    from PIL import Image

    y = torch.linspace(0, 1, height)[:, None].expand(height, width)
    x = torch.linspace(0, 1, width)[None, :].expand(height, width)
    rgb = torch.stack([x, y, (x + y) / 2], -1).mul(255).to(torch.uint8).numpy()
    return Image.fromarray(rgb)
