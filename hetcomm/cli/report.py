"""``hetcomm report FILE.jsonl [--plot DIR]``: summarise a metrics file, draw its four PNGs.

The file is what ``hetcomm train --metrics FILE.jsonl`` writes (docs/OPERATIONS.md). Exit codes:
0 ok, 2 unreadable or malformed file (the message names file, line and key), or --plot without
matplotlib.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="summarise a metrics file of hetcomm train and plot it",
        description="Print a summary of a per-step metrics file (hetcomm train --metrics) and, with "
        "--plot DIR, draw step_time.png, bytes_by_link_class.png, expert_load.png and loss.png.",
    )
    p.add_argument("metrics", metavar="FILE.jsonl", help="metrics file written by hetcomm train --metrics")
    p.add_argument("--plot", metavar="DIR", default=None, help="write the four PNGs into DIR")
    return p


def run(args: argparse.Namespace) -> int:
    from hetcomm.ops.metrics import read_metrics
    from hetcomm.ops.plots import plot_metrics, summarize

    log = read_metrics(args.metrics)
    print(summarize(log))
    if args.plot:
        for path in plot_metrics(log, args.plot):
            print(f"wrote {path}")
    return 0
