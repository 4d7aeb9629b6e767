"""``hetcomm settings``: every ``HETCOMM_*`` variable, its value here, and typos.

Reads the registry (:mod:`hetcomm.settings`): one line per declared variable with its type, its
value in this environment (parsed, so a bad value fails here with the variable, the value and
what is allowed, exit 2) and its default; then any ``HETCOMM_*`` variable that nothing declares,
with the closest declared name (exit 1: a typo such as ``HETCOMM_CLUSTERS`` is silently
ignored by everything else). ``--markdown`` prints the table of ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "settings",
        help="list the HETCOMM_* environment variables, their values here, and typos",
        description="List every declared HETCOMM_* variable with its value in this environment; "
        "flag undeclared HETCOMM_* names (exit 1) and bad values (exit 2).",
    )
    p.add_argument("--markdown", action="store_true", help="print the docs table (docs/ARCHITECTURE.md) instead")
    return p


def run(args: argparse.Namespace) -> int:
    from hetcomm import settings

    if args.markdown:
        sys.stdout.write(settings.markdown_table())
        return 0
    for s in settings.REGISTRY.values():
        shown = f"{s.get()!r}" if s.is_set() else "unset"  # get(): a bad value raises SettingError (exit 2)
        print(f"{s.name:26} {s.kind:6} {shown:24} default {s.default!r}")
    unknown = settings.unknown_names()
    for name, close in unknown:
        hint = f"; did you mean {close}?" if close else ""
        print(f"hetcomm settings: {name} is set but not a hetcomm setting (nothing reads it){hint}", file=sys.stderr)
    return 1 if unknown else 0
