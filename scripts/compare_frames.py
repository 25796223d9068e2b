#!/usr/bin/env python3
"""Per-pixel difference of two videos, in 8-bit steps: frame arrays from scripts/generate_frames.py
(.npy, floats in [0, 1]) or mp4 files (e.g. one `fp4video generate` on one process and one under
torchrun).

    python scripts/compare_frames.py A.npy B.npy
    python scripts/compare_frames.py one_gpu.mp4 two_gpus.mp4
"""

import argparse
import sys

import numpy as np


def _frames(path: str) -> np.ndarray:
    if path.endswith(".mp4"):
        from fp4video.eval.paired import read_video

        return read_video(path).numpy()
    return np.load(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    a, b = (_frames(p) for p in (args.a, args.b))
    if a.shape != b.shape:
        raise SystemExit(f"error: shapes differ: {a.shape} vs {b.shape}")
    d = np.abs(np.round(a * 255) - np.round(b * 255))
    print(f"{args.a} vs {args.b}: shape {a.shape}, max |diff| {d.max():.0f}/255, mean {d.mean():.4f}/255")
    return 0


if __name__ == "__main__":
    sys.exit(main())
