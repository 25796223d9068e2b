"""Frame-level similarity of a candidate video to its FP16 reference, as the MXAttention paper's
Cosine / SSIM / PSNR columns: per frame, then averaged.

- SSIM: 11×11 Gaussian window, σ = 1.5, data range 1 (torchmetrics' definition, per frame).
- PSNR: per frame with data range 1, then the mean over the frames that differ (not one global
  PSNR); an identical frame's PSNR is infinite, so identical frames are counted
  (``identical_frames``) and left out of the mean, which is ``inf`` only when every frame is
  identical. In Python the values are floats (``math.inf``); :func:`json_ready` turns every
  infinity into the string ``"inf"`` for JSON, which has no infinity (``float("inf")`` reads it
  back, as it reads any number).
- Cosine: per frame on the flattened RGB pixels in [0, 1], then the mean. Pixel values are all
  non-negative, so any two frames score well above 0; read it comparatively.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

__all__ = ["read_video", "paired_metrics", "evaluate_paths", "json_ready", "COSINE_RANGE"]

COSINE_RANGE = "RGB pixels in [0, 1]"


def read_video(path: str | Path) -> torch.Tensor:
    """(T, H, W, 3) float32 in [0, 1]; a ValueError naming the file when ffmpeg cannot read it."""
    import imageio.v3 as iio

    from ..integration.media import unreadable_reason

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such video")
    if not path.is_file():
        raise ValueError(f"{path}: a folder, not a video file")
    try:
        frames = iio.imread(path)
    except (OSError, RuntimeError, ValueError, IndexError, StopIteration) as e:
        raise ValueError(f"{path}: not a video ffmpeg can read ({unreadable_reason(e)})") from None
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"{path}: expected RGB video frames (T, H, W, 3), got shape {tuple(frames.shape)}")
    return torch.from_numpy(frames).float() / 255.0


def paired_metrics(ref: torch.Tensor, cand: torch.Tensor, *, name: str = "video") -> dict:
    """Per-frame and mean cosine / SSIM / PSNR of ``cand`` against ``ref``, both (T, H, W, 3) in [0, 1]."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    if ref.shape != cand.shape:
        raise ValueError(f"{name}: reference and candidate differ in shape (frames, height, width, channels): "
                         f"{tuple(ref.shape)} vs {tuple(cand.shape)}")
    r = ref.permute(0, 3, 1, 2).double()
    c = cand.permute(0, 3, 1, 2).double()
    cos = torch.nn.functional.cosine_similarity(r.flatten(1), c.flatten(1), dim=1).clamp(-1.0, 1.0)
    ssim = structural_similarity_index_measure(c, r, gaussian_kernel=True, sigma=1.5, kernel_size=11,
                                               data_range=1.0, reduction="none")
    mse = (r - c).pow(2).flatten(1).mean(1)
    differ = mse > 0
    psnr = peak_signal_noise_ratio(c, r, data_range=1.0, dim=(1, 2, 3), reduction="none")
    return {
        "frames": int(ref.shape[0]),
        "cosine": float(cos.mean()),
        "ssim": float(ssim.mean()),
        "psnr": float(psnr[differ].mean()) if bool(differ.any()) else math.inf,
        "identical_frames": int((~differ).sum()),
        "per_frame": {"cosine": cos.tolist(), "ssim": ssim.tolist(),
                      "psnr": [float(x) if d else math.inf for x, d in zip(psnr.tolist(), differ.tolist())]},
    }


def _pairs(reference: Path, candidate: Path) -> list[tuple[str, Path, Path]]:
    if reference.is_file() and candidate.is_file():
        return [(candidate.name, reference, candidate)]
    if reference.is_dir() and candidate.is_dir():
        refs = {p.name: p for p in reference.glob("*.mp4") if p.is_file()}
        cands = {p.name: p for p in candidate.glob("*.mp4") if p.is_file()}
        if not refs:
            raise ValueError(f"{reference}: no .mp4 files")
        missing = sorted(set(refs) ^ set(cands))
        if missing:
            raise ValueError(f"videos are paired by file name; unmatched: {', '.join(missing)}")
        return [(n, refs[n], cands[n]) for n in sorted(refs)]
    for p in (reference, candidate):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or folder")
    raise ValueError(f"give two mp4 files or two folders, got {reference} and {candidate}")


def evaluate_paths(reference: str | Path, candidate: str | Path, progress: bool = False) -> dict:
    """Two mp4 files, or two folders of mp4s paired by file name. Means over frames, then videos
    (PSNR: over the videos with a finite one; ``inf`` when every video is identical)."""
    pairs = _pairs(Path(reference), Path(candidate))
    from tqdm import tqdm

    videos = {}
    # leave=False: the bar goes when done or on an error, so an error message starts its own line
    with tqdm(pairs, desc="eval", unit="video", disable=not progress, leave=False) as bar:
        for name, r, c in bar:
            videos[name] = paired_metrics(read_video(r), read_video(c), name=name)
    mean = lambda key: sum(v[key] for v in videos.values()) / len(videos)  # noqa: E731
    psnrs = [v["psnr"] for v in videos.values() if math.isfinite(v["psnr"])]  # identical videos: inf, left out
    return {"cosine": mean("cosine"), "ssim": mean("ssim"), "psnr": sum(psnrs) / len(psnrs) if psnrs else math.inf,
            "identical_frames": sum(v["identical_frames"] for v in videos.values()),
            "frames": sum(v["frames"] for v in videos.values()), "cosine_range": COSINE_RANGE, "videos": videos}


def json_ready(obj):
    """``obj`` with every non-finite float spelled as a string (``"inf"``, ``"-inf"``, ``"nan"``):
    standard JSON has no infinity, and ``float()`` reads the strings back."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj
