"""Evaluation: paired similarity to the FP16 video (cosine / SSIM / PSNR) and the VBench driver."""

from .paired import evaluate_paths, json_ready, paired_metrics, read_video

__all__ = ["paired_metrics", "evaluate_paths", "read_video", "json_ready"]
