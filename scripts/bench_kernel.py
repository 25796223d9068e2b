#!/usr/bin/env python3
"""Kernel benchmark on a GPU: the same as `fp4video bench kernel` (see `--help`).

    python scripts/bench_kernel.py --seqs 8192 32760 75600 --out run.md
"""

import sys

from fp4video.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernel", *sys.argv[1:]]))
