"""Runs inside VBench's own environment (imports nothing from fp4video): evaluates a folder of
mp4s on the given dimensions and writes VBench's ``{name}_eval_results.json`` into --out.
(No module beside this file may be named ``vbench``: the script's folder is first on sys.path.)"""

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--videos", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="fp4video")
    ap.add_argument("--dimensions", nargs="+", required=True)
    args = ap.parse_args()
    import torch
    from vbench import VBench  # VBENCH_CACHE_DIR is read at import

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = os.path.join(args.out, "vbench_full_info_unused.json")
    with open(info, "w") as f:
        json.dump([], f)
    VBench(device, info, args.out).evaluate(videos_path=args.videos, name=args.name,
                                            dimension_list=args.dimensions, local=True, mode="custom_input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
