"""``fp4video accuracy``: the op-level harness that reproduces both source documents' numbers."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import UsageError, check_output_dir, seed_arg

EXAMPLES = """examples:
  fp4video accuracy                       # tables on the terminal; plots, accuracy.json and
                                          # accuracy.md (the README's tables) in ./accuracy-report
  fp4video accuracy --out report --seed 1
  fp4video accuracy --json > acc.json     # one JSON object on stdout (tables suppressed)
  fp4video accuracy --speed BENCHMARKS.md # also speed_accuracy.png: accuracy against measured speed
"""

N_STEPS = 10  # progress steps reported by harness.report.run_all


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "accuracy",
        help="reproduce the source documents' op-level accuracy tables",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("accuracy-report"), help="folder for PNG plots and accuracy.json")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of every random input, 0 .. 2**64 - 1 (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout instead of tables")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--speed", type=Path, metavar="MARKDOWN",
                   help="also plot accuracy against kernel speed, read from `fp4video bench kernel` tables in this "
                        "file (a run's --out file, or BENCHMARKS.md): speed_accuracy.png")
    p.add_argument("--speed-seq", type=int, metavar="S", help="the sequence length of --speed's rows (default: the longest)")
    return p


def run(args) -> int:
    """Inputs (the output folder, the --speed file) are checked before the minutes of work; the
    JSON and markdown go out whole (atomic rename)."""
    from tqdm import tqdm

    from ..eval.speed import speed_accuracy_plot
    from ..harness import report
    from ..integration.media import write_text_atomic

    check_output_dir(args.out, "--out")
    speed_text = None
    if args.speed:
        try:
            speed_text = args.speed.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
            raise UsageError(f"--speed {args.speed}: cannot be read ({why})") from None
    t0 = time.perf_counter()
    with tqdm(total=N_STEPS, desc="accuracy", unit="step", file=sys.stderr, leave=False) as bar:

        def step(name):
            bar.set_postfix_str(name)
            bar.update(1)

        result = report.run_all(seed=args.seed, progress=step)
    summary = report.summary_json(result)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "accuracy.json", json.dumps(summary, indent=1, default=report.json_default))
    specs = report.tables(result)
    write_text_atomic(args.out / "accuracy.md", report.render_markdown(specs))
    plots = [] if args.no_plots else report.plots(result, args.out)
    if speed_text is not None:
        try:
            plots.append(speed_accuracy_plot(result, speed_text, args.out / "speed_accuracy.png", args.speed_seq))
        except ValueError as e:
            raise UsageError(f"--speed {args.speed}: {e}") from None
    elapsed = time.perf_counter() - t0
    if args.json:
        json.dump(summary, sys.stdout, default=report.json_default)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    for spec in specs:
        console.print(report.render_rich(spec))
    console.print(f"wrote {args.out / 'accuracy.json'}, {args.out / 'accuracy.md'}" + "".join(f", {p}" for p in plots))
    console.print(f"done in {elapsed:.1f} s (seed {args.seed})")
    return 0
