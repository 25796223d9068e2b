"""Driving VBench (Subject Consistency, Imaging Quality, Aesthetic Quality) from its own virtual
environment.

VBench 0.1.5 pins ``transformers==4.33.2``, ``numpy<2``, ``timm<=1.0.12`` and needs
``setuptools<70``: it cannot share an environment with current diffusers, so
``scripts/setup_vbench_env.sh`` builds one, and :func:`run_vbench` calls its Python on
``_vbench_runner.py`` (which imports only vbench) as a subprocess, then normalizes the results.

VBench downloads its weights only when they are missing; offline they must be in place first:
:func:`weight_status` says, for each file, whether it is present and the exact path expected, and
:func:`place_weights` copies them from a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DIMENSIONS", "VBENCH_PINS", "Weight", "weight_status", "place_weights", "MissingWeights",
           "run_vbench", "normalize_results", "default_dirs"]

DIMENSIONS = ("subject_consistency", "imaging_quality", "aesthetic_quality")
VBENCH_PINS = ("vbench==0.1.5", "transformers==4.33.2", "numpy<2", "timm<=1.0.12", "setuptools<70")


@dataclass(frozen=True)
class Weight:
    dimension: str
    filename: str
    path: Path  # where VBench (or the library under it) reads it


def default_dirs() -> tuple[Path, Path]:
    """(VBENCH_CACHE_DIR, TORCH_HOME), from the environment or VBench's / torch's defaults."""
    cache = Path(os.environ.get("VBENCH_CACHE_DIR", Path.home() / ".cache" / "vbench"))
    torch_home = Path(os.environ.get("TORCH_HOME", Path.home() / ".cache" / "torch"))
    return cache, torch_home


def required_weights(cache_dir: Path, torch_home: Path) -> list[Weight]:
    dino = "dino_vitbase16_pretrain.pth"
    return [
        # DINO's hub code ignores VBench's path and reads torch's hub cache: the file goes in both
        Weight("subject_consistency", dino, torch_home / "hub" / "checkpoints" / dino),
        Weight("subject_consistency", dino, cache_dir / "dino_model" / dino),
        Weight("subject_consistency", "facebookresearch_dino_main/hubconf.py",
               cache_dir / "dino_model" / "facebookresearch_dino_main" / "hubconf.py"),
        Weight("imaging_quality", "musiq_spaq_ckpt-358bb6af.pth", cache_dir / "pyiqa_model" / "musiq_spaq_ckpt-358bb6af.pth"),
        Weight("aesthetic_quality", "ViT-L-14.pt", cache_dir / "clip_model" / "ViT-L-14.pt"),
        # about 4 KB; VBench 0.1.5's own download of it is broken
        Weight("aesthetic_quality", "sa_0_4_vit_l_14_linear.pth",
               cache_dir / "aesthetic_model" / "emb_reader" / "sa_0_4_vit_l_14_linear.pth"),
    ]


def weight_status(cache_dir: Path | None = None, torch_home: Path | None = None) -> list[dict]:
    d_cache, d_torch = default_dirs()
    return [{"dimension": w.dimension, "file": w.filename, "path": str(w.path), "present": w.path.is_file()}
            for w in required_weights(cache_dir or d_cache, torch_home or d_torch)]


def place_weights(source: Path, cache_dir: Path | None = None, torch_home: Path | None = None) -> list[str]:
    """Copy every required file found under ``source`` (by file name; the DINO repo by its folder)
    to where VBench expects it. Returns the paths written."""
    d_cache, d_torch = default_dirs()
    written = []
    for w in required_weights(cache_dir or d_cache, torch_home or d_torch):
        if w.path.is_file():
            continue
        if "/" in w.filename:  # the DINO hub repository: copy its whole folder
            folder = w.filename.split("/")[0]
            found = next((p for p in source.rglob(folder) if p.is_dir()), None)
            if found:
                shutil.copytree(found, w.path.parent, dirs_exist_ok=True)
                written.append(str(w.path.parent))
            continue
        found = next((p for p in source.rglob(w.filename) if p.is_file()), None)
        if found:
            w.path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(found, w.path)
            written.append(str(w.path))
    return written


class MissingWeights(FileNotFoundError):
    def __init__(self, missing: list[dict]):
        lines = "\n".join(f"  {m['dimension']}: {m['file']} -> expected at {m['path']}" for m in missing)
        super().__init__("VBench weights are missing (no network to download them):\n" + lines +
                         "\nPlace them with `fp4video vbench-weights --from DIR` (DIR holding the files).")
        self.missing = missing


def run_vbench(videos_dir: Path, *, python: str, out_dir: Path, name: str = "fp4video",
               cache_dir: Path | None = None, torch_home: Path | None = None, timeout: float = 3600) -> dict:
    """Run VBench's three dimensions on every mp4 in ``videos_dir`` with the VBench environment's
    ``python``; return :func:`normalize_results` of its output."""
    d_cache, d_torch = default_dirs()
    cache_dir, torch_home = cache_dir or d_cache, torch_home or d_torch
    missing = [w for w in weight_status(cache_dir, torch_home) if not w["present"]]
    if missing:
        raise MissingWeights(missing)
    if not Path(python).exists() and shutil.which(python) is None:
        raise FileNotFoundError(f"{python}: no such Python; build VBench's environment with scripts/setup_vbench_env.sh")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VBENCH_CACHE_DIR": str(cache_dir), "TORCH_HOME": str(torch_home),
           "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # pyiqa 0.1.10 loads MUSIQ without weights_only
    runner = Path(__file__).with_name("_vbench_runner.py")
    proc = subprocess.run([python, str(runner), "--videos", str(videos_dir), "--out", str(out_dir), "--name", name,
                           "--dimensions", *DIMENSIONS], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"VBench failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result_file = out_dir / f"{name}_eval_results.json"
    if not result_file.exists():
        raise RuntimeError(f"VBench finished but wrote no {result_file}")
    return normalize_results(json.loads(result_file.read_text()))


def normalize_results(raw: dict) -> dict:
    """VBench's ``{dimension: [overall, [{video_path, video_results}, ...]]}`` on one 0–1 scale:
    imaging quality's per-video values come on 0–100 (only its overall value is divided by 100)."""
    per_video: dict[str, dict] = {}
    overall = {}
    for dim in DIMENSIONS:
        if dim not in raw:
            raise ValueError(f"VBench results have no {dim!r} (got {sorted(raw)})")
        total, videos = raw[dim]
        overall[dim] = float(total)
        for v in videos:
            value = float(v["video_results"])
            if dim == "imaging_quality":
                value /= 100.0
            per_video.setdefault(Path(v["video_path"]).name, {})[dim] = value
    for dim in DIMENSIONS:
        if not 0.0 <= overall[dim] <= 1.0:
            raise ValueError(f"VBench {dim} overall {overall[dim]} is outside [0, 1]: unexpected result scale")
    return {"overall": overall, "videos": per_video}
