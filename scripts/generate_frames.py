#!/usr/bin/env python3
"""`fp4video` with the decoded frames saved as ``OUTPUT.npy`` (float32, frames × H × W × 3 in
[0, 1]) instead of encoded as mp4: for machines without ffmpeg (the H200 image has none), and
for comparisons that should not include the codec's own rounding.

    torchrun --nproc-per-node 2 scripts/generate_frames.py generate --ulysses-degree 2 --output two.mp4
    python scripts/generate_frames.py generate --output one.mp4        # -> two.mp4.npy, one.mp4.npy
    python scripts/compare_frames.py two.mp4.npy one.mp4.npy

Everything else (sidecar JSON, progress, torchrun handling) is the CLI's.
"""

import sys

import numpy as np


def _save_frames(frames, output_video_path=None, fps=None, **_):
    np.save(f"{output_video_path}.npy", np.asarray(frames, dtype=np.float32))
    return output_video_path


def main() -> int:
    import diffusers.utils

    diffusers.utils.export_to_video = _save_frames  # the runner imports it at call time
    from fp4video.cli.main import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
