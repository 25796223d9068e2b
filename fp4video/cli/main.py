"""The ``fp4video`` command line: one module per subcommand.

Every subcommand ends the same way on bad input: one line ``fp4video <command>: error: ...`` on
stderr and exit status 2 (argparse's own errors look the same); Ctrl-C prints ``fp4video:
interrupted`` and exits 130 (128 + SIGINT, as shells report it). ``FP4VIDEO_TRACEBACK=1`` shows the
full traceback of an error instead."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from . import accuracy, bench, calibrate, check, generate, vbench_weights
from . import eval as eval_
from .common import one_line, quiet_optional_imports
from .help_text import plain_help

SUBCOMMANDS = {"generate": generate, "eval": eval_, "accuracy": accuracy, "bench": bench, "calibrate": calibrate,
               "check": check, "vbench-weights": vbench_weights}

#: Exit status of a run stopped by Ctrl-C
EXIT_INTERRUPTED = 130
#: Exit status of unusable input (argparse's too)
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4video",
        description="4-bit microscaling (MXFP4 / NVFP4) attention for video diffusion transformers.",
    )
    parser.add_argument("--version", action="version", version=f"fp4video {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return plain_help(parser)  # docstrings serve as descriptions: --help prints them as plain text


def command_name(args) -> str:
    """``generate``, ``bench kernel``, ...: the words the user typed to pick the subcommand."""
    return " ".join(w for w in (args.command, getattr(args, "what", None)) if w)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with quiet_optional_imports():
            try:
                return SUBCOMMANDS[args.command].run(args) or 0
            except (ValueError, TypeError, OSError) as e:  # input the command cannot use
                if os.environ.get("FP4VIDEO_TRACEBACK") == "1":
                    raise
                return report_error(command_name(args), e)
    except KeyboardInterrupt:
        print("fp4video: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def report_error(command: str, err: BaseException) -> int:
    """``fp4video <command>: error: <what>`` on one line; the exit status of unusable input."""
    from pydantic import ValidationError

    if isinstance(err, ValidationError):
        from ..integration.policy import format_validation_error

        text = format_validation_error(err, "command line")
    elif isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.filename}: {err.strerror}"
    else:
        text = str(err) or type(err).__name__
    print(f"fp4video {command}: error: {one_line(text)}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
