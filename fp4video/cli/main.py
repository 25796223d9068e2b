"""The ``fp4video`` command line: one module per subcommand."""

from __future__ import annotations

import argparse
import sys

from . import accuracy, bench, check, generate, vbench_weights
from . import eval as eval_

SUBCOMMANDS = {"generate": generate, "eval": eval_, "accuracy": accuracy, "bench": bench, "check": check,
               "vbench-weights": vbench_weights}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4video",
        description="4-bit microscaling (MXFP4 / NVFP4) attention for video diffusion transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
