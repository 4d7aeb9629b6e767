"""`hetcomm train` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse

from hetcomm.errors import UsageError


def add_parser(subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("train", help="(not implemented yet)")


def run(args: argparse.Namespace) -> int:
    raise UsageError("'hetcomm train' is not implemented yet")
