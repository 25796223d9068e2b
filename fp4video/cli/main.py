"""The ``fp4video`` command line: one module per subcommand.

Every subcommand ends the same way on bad input: one line ``fp4video <command>: error: ...`` on
stderr and exit status 2 (argparse's own errors look the same); Ctrl-C prints ``fp4video:
interrupted`` and exits 130 (128 + SIGINT, as shells report it). Under ``torchrun`` these lines come
from rank 0 alone, the other ranks exiting with the same status in silence. ``FP4VIDEO_TRACEBACK=1``
shows the full traceback of an error instead."""

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


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (usage, then ``PROG: error: ...``, exit 2) are said through
    :func:`say_error`; the subcommands' parsers are of its class too (argparse makes them so)."""

    def error(self, message):
        say_error(f"{self.format_usage()}{self.prog}: error: {message}")
        self.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
        say_error("fp4video: interrupted")
        return EXIT_INTERRUPTED


def say_error(text: str) -> None:
    """``text`` on stderr: where every error of the command line is said. Under ``torchrun`` every
    rank meets the same input and would say the same line, so rank 0 says it and the other ranks
    say nothing (they exit with the same status)."""
    from ..integration.distributed import world

    rank, size = world()
    if size == 1 or rank == 0:
        print(text, file=sys.stderr)


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
    say_error(f"fp4video {command}: error: {one_line(text)}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
