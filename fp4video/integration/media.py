"""Video files in and out: frames read from a video, frames written as mp4, with the soundtrack
muxed in for pipelines that make sound (LTX-2). imageio's ffmpeg reads and writes them."""

from __future__ import annotations

import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

__all__ = ["read_video_frames", "write_video", "audio_sample_rate"]


def read_video_frames(path: Path) -> list:
    """Every frame of a video file as an RGB PIL image."""
    import imageio.v3 as iio
    from PIL import Image

    frames = [Image.fromarray(f).convert("RGB") for f in iio.imiter(path, plugin="FFMPEG")]
    if not frames:
        raise ValueError(f"{path}: no frames could be read")
    return frames


def audio_sample_rate(pipe) -> int:
    """The sample rate of the waveform a sound-making pipeline returns: its vocoder's output rate."""
    rate = getattr(getattr(getattr(pipe, "vocoder", None), "config", None), "output_sampling_rate", None)
    if rate is None:
        raise ValueError(f"{type(pipe).__name__} returned audio, but it has no vocoder whose config names the "
                         "output sampling rate")
    return int(rate)


def write_video(frames, out: Path, fps: int, audio=None, sample_rate: int | None = None) -> None:
    """``frames`` (as diffusers returns them) as an mp4; with ``audio`` (channels × samples, values
    in [-1, 1]) the soundtrack goes in as AAC."""
    from diffusers.utils import export_to_video

    if audio is None:
        export_to_video(frames, str(out), fps=fps)
        return
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory() as tmp:
        video, sound = Path(tmp) / "video.mp4", Path(tmp) / "audio.wav"
        export_to_video(frames, str(video), fps=fps)
        _write_wav(audio, sample_rate, sound)
        proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-i", str(video), "-i",
                               str(sound), "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac", str(out)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"ffmpeg could not mux the soundtrack into {out}: {proc.stderr.strip()[-500:]}")


def _write_wav(audio, sample_rate: int, path: Path) -> None:
    """A channels × samples waveform as 16-bit PCM WAV (clipped to [-1, 1])."""
    a = np.asarray(audio.detach().float().cpu() if hasattr(audio, "detach") else audio, dtype=np.float32)
    if a.ndim == 1:
        a = a[None]
    pcm = (np.clip(a, -1.0, 1.0) * 32767).round().astype("<i2").T  # samples × channels, interleaved
    with wave.open(str(path), "wb") as w:
        w.setnchannels(a.shape[0])
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
