"""``hetcomm doctor FILE...``: the troubleshooting table as rules over a job's record.

Give it what a job left behind — the metrics file of ``hetcomm train --metrics``, NCCL/HCCL logs
and the job's stderr, ``chronyc tracking``/``ntpq -p``/``timedatectl`` output of each node,
``hetcomm audit --json`` — in any order; each file is recognised by its content. Every finding
says what was seen, where (file:line, step, rank, node) and how to fix it (docs/OPERATIONS.md).

Exit codes: 0 no error finding, 1 an error finding (like ``hetcomm audit``), 2 unreadable input.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="diagnose a job from its metrics file, logs and clock reports",
        description="Run the troubleshooting rules (step-time jitter, starved experts, OOM with "
        "prefetch, loss oscillating with migrations, init hangs, clock offsets, NCCL/HCCL "
        "environment) over a job's record.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="metrics .jsonl, NCCL/HCCL/job logs, env dumps, chrony/ntp output, audit JSON")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from hetcomm.ops.doctor import diagnose, load_record, render

    rec = load_record(args.files)
    findings = diagnose(rec)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        print(render(rec, findings))
    return 1 if any(f.severity == "error" for f in findings) else 0
