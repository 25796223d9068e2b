"""Video files in and out: frames read from a video, frames written as mp4, with the soundtrack
muxed in for pipelines that make sound (LTX-2). imageio's ffmpeg reads and writes them.

Every file written here goes to a temporary name in its own folder first and is renamed into place
(:func:`os.replace`, atomic on one file system): an interrupted or failed write leaves the previous
file, or none, under the final name, never a truncated one."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

__all__ = ["read_video_frames", "write_video", "audio_sample_rate", "temporary_sibling", "write_text_atomic",
           "write_video_and_sidecar"]


@contextlib.contextmanager
def temporary_sibling(path: Path):
    """A fresh temporary name in ``path``'s folder (hidden, unique to this process), ending in
    ``path``'s suffix (writers pick the format from it). On the way out, whatever is still under
    it, or under its name plus a tail (a writer's by-products), is removed: only what was renamed
    into place meanwhile survives."""
    path = Path(path)
    # not created here (mkstemp's files are private, 0600): the writer creates it under the umask
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.partial{path.suffix}")
    try:
        yield tmp
    finally:
        for leftover in [tmp, *_by_products(tmp)]:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def _by_products(tmp: Path) -> list[Path]:
    """Files a writer made beside ``tmp`` under its name plus a tail (``NAME.npy``, ``NAME.log``)."""
    try:
        return [p for p in tmp.parent.iterdir() if p.name.startswith(tmp.name) and p.name != tmp.name]
    except OSError:
        return []


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` (UTF-8) under ``path``: the whole new file or the old one, never a part."""
    path = Path(path)
    with temporary_sibling(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def write_video_and_sidecar(frames, out: Path, sidecar_text: str, fps: int, audio=None,
                            sample_rate: int | None = None) -> Path:
    """The video as ``out`` and its JSON sidecar as ``out.with_suffix('.json')``, as a pair: both
    are written to temporary names first; then the old sidecar goes, the video is renamed into
    place and the sidecar last. An interruption at any point leaves the previous pair, or a video
    without a sidecar, never a short video or a video beside a sidecar of another run (a video
    without its sidecar counts as not made: the sweeps remake it). A writer's by-products named
    after the temporary name (``NAME.npy``) move to the final name with the video; a writer that
    made no video file (a stand-in that saves frames only) leaves no video, not the previous
    run's. Returns the sidecar's path."""
    out = Path(out)
    sidecar = out.with_suffix(".json")
    with temporary_sibling(out) as tmp_video, temporary_sibling(sidecar) as tmp_sidecar:
        write_video(frames, tmp_video, fps, audio, sample_rate)
        tmp_sidecar.write_text(sidecar_text, encoding="utf-8")
        with contextlib.suppress(FileNotFoundError):
            sidecar.unlink()
        if tmp_video.exists():
            os.replace(tmp_video, out)
        else:
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
        for extra in _by_products(tmp_video):
            os.replace(extra, out.with_name(out.name + extra.name[len(tmp_video.name):]))
        os.replace(tmp_sidecar, sidecar)
    return sidecar


def read_video_frames(path: Path) -> list:
    """Every frame of a video file as an RGB PIL image (ValueError naming the file when it is not a
    video ffmpeg can read)."""
    import imageio.v3 as iio
    from PIL import Image

    try:
        frames = [Image.fromarray(f).convert("RGB") for f in iio.imiter(path, plugin="FFMPEG")]
    except (OSError, RuntimeError, ValueError) as e:
        if isinstance(e, FileNotFoundError) or not Path(path).exists():
            raise FileNotFoundError(f"{path}: no such video") from None
        raise ValueError(f"{path}: not a video ffmpeg can read ({unreadable_reason(e)})") from None
    if not frames:
        raise ValueError(f"{path}: no frames could be read")
    return frames


def unreadable_reason(err: BaseException) -> str:
    """The last line of an imageio/ffmpeg error (ffmpeg's verdict), without its banner."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("===")]
    return lines[-1] if lines else type(err).__name__


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
        write_wav(audio, sample_rate, sound)
        proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-i", str(video), "-i",
                               str(sound), "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac", str(out)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"ffmpeg could not mux the soundtrack into {out}: {proc.stderr.strip()[-500:]}")


def write_wav(audio, sample_rate: int, path: Path) -> None:
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
