"""``edgeps report FILE``: the table of a job's report, and its plot, again."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeps.cli.common import Subparsers


def cmd_report(args: argparse.Namespace) -> int:
    from edgeps.report import format_report, plot_curves, read_report

    report = read_report(args.file)
    format_report(report, max_rows=args.rows).print()
    plot = Path(args.plot) if args.plot else Path(args.file).with_suffix(".png")
    plot_curves(report, plot, title=f"edgeps: {Path(args.file).name}")
    print(f"\nplot: {plot}")
    return 0


def add(sub: Subparsers) -> None:
    """The role's subcommand, its options and its function."""
    report = sub.add_parser("report", help="print a job's report (edgeps ps --report, the demo's) and plot it")
    report.add_argument("file", help="the report's JSON file")
    report.add_argument("--plot", help="where to draw the metric and loss curves (default: FILE with .png)")
    report.add_argument("--rows", type=int, default=25, help="versions in the table at most (default: %(default)s)")
    report.set_defaults(func=cmd_report)
