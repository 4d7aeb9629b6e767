"""`hetcomm emulate` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

from hetcomm.errors import UsageError


def add_parser(subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("emulate", help="(not implemented yet)")


def run(args: argparse.Namespace) -> int:
    raise UsageError("'hetcomm emulate' is not implemented yet")
