#!/usr/bin/env python3
"""Per-pixel difference of two frame arrays from scripts/generate_frames.py, in 8-bit steps.

    python scripts/compare_frames.py A.npy B.npy
"""

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    a, b = np.load(args.a), np.load(args.b)
    if a.shape != b.shape:
        raise SystemExit(f"error: shapes differ: {a.shape} vs {b.shape}")
    d = np.abs(np.round(a * 255) - np.round(b * 255))
    print(f"{args.a} vs {args.b}: shape {a.shape}, max |diff| {d.max():.0f}/255, mean {d.mean():.4f}/255")
    return 0


if __name__ == "__main__":
    sys.exit(main())
