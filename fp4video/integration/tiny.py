"""Tiny random-weight pipelines, built offline from configs (no downloads), that still exercise the
FP4 path for real: head dim 64, hundreds of video tokens, 2 blocks, 512 text tokens.

Used by ``fp4video generate --model tiny`` (the embedded default) and the tests. They produce
noise-like videos: the point is the plumbing and the numerics, not the pictures.
"""

from __future__ import annotations

import torch

__all__ = ["TINY_SIZES", "tiny_wan_pipeline", "tiny_tokenizer"]

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


def _tiny_wan_transformer(seed: int, head_dim: int, **extra):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64, **extra,
    ).eval()


def tiny_wan_pipeline(*, two_experts: bool = True, head_dim: int = 64, seed: int = 0):
    """Wan2.2-style T2V pipeline (two experts, boundary 0.875) or Wan2.1-style (one transformer)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(_VOCAB), d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8)).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    transformer = _tiny_wan_transformer(seed + 1, head_dim)
    transformer_2 = _tiny_wan_transformer(seed + 2, head_dim) if two_experts else None
    return WanPipeline(tokenizer=tiny_tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=transformer_2,
                       boundary_ratio=0.875 if two_experts else None)
