"""The ``hetcomm`` command: ``hetcomm topo | audit | bench | simulate | train | emulate | discover | report | doctor | launch | settings``.

Each subcommand lives in its own module ``hetcomm.cli.<name>`` exposing::

    def add_parser(subparsers) -> argparse.ArgumentParser   # registers its flags
    def run(args: argparse.Namespace) -> int                 # returns the exit code

Exit codes (documented in README): 0 ok, 1 check failed (error findings, wrong results),
2 bad usage or unreadable input, 3 a peer timed out.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from hetcomm.errors import ConfigError, HetcommError, TopologyParseError, UsageError

__all__ = ["main", "SUBCOMMANDS", "EXIT_OK", "EXIT_FINDINGS", "EXIT_USAGE", "EXIT_TIMEOUT"]

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3

SUBCOMMANDS = ("topo", "audit", "bench", "simulate", "train", "emulate", "discover", "report", "doctor", "launch", "settings")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="hetcomm",
        description="Communication middleware for MoE training on mixed NVIDIA/Ascend clusters.",
    )
    from hetcomm._version import __version__

    parser.add_argument("--version", action="version", version=f"hetcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"hetcomm.cli.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except (UsageError, ConfigError, TopologyParseError) as e:
        print(f"hetcomm {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except HetcommError as e:
        print(f"hetcomm {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FINDINGS
    except KeyboardInterrupt:
        print(f"hetcomm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
