"""``ms-deepseek report RUN_DIR [-o report.html] [--watch S]``: the run's HTML health page
(:mod:`ms_deepseek.report.html`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ms_deepseek.core.errors import UserError
from ms_deepseek.report.html import generate, watch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default=None, help="HTML file to write (default: RUN_DIR/report.html)")
    parser.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="rewrite the page every SECONDS until interrupted (the page reloads itself)",
    )


def run(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        raise UserError(f"--watch: must be a positive number of seconds, got {args.watch}")
    if args.watch:
        out = args.output or str(Path(args.run_dir) / "report.html")
        print(f"writing {out} every {args.watch:g} s (Ctrl-C to stop)", flush=True)
        try:
            return watch(args.run_dir, args.output, args.watch, echo=lambda s: print(s, flush=True))
        except KeyboardInterrupt:
            return 0
    from ms_deepseek.core.safe_io import check_output_file

    check_output_file(args.output or Path(args.run_dir) / "report.html", "report")  # before reading anything
    info = generate(args.run_dir, args.output)
    for problem in info.get("problems", ()):
        print(f"warning: {problem}", file=sys.stderr)
    for alert in info["alerts"]:
        print(alert)
    print(f"wrote {info['output']}: {info['records']} records, {len(info['alerts'])} alert(s)")
    return 0
