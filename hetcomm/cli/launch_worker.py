"""The entry point of every torchrun worker ``hetcomm launch`` starts.

    python -m hetcomm.cli.launch_worker [hetcomm subcommand and its arguments]

Runs :func:`hetcomm.ops.worker.main` (place the rank in the job's cluster YAML, a fresh store per
attempt, grouped start, then the subcommand in this process, a finished job's exit code recorded
for ``hetcomm launch``) with this CLI's parser: the entry point lives in ``cli`` so that ``ops``
never imports the floor above it. :func:`in_place_rank` is the same worker as the target of
hetcomm's own launcher (``hetcomm launch --shrink-in-place``), which collects its return value.
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main", "in_place_rank"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the worker for ``argv`` (default ``sys.argv[1:]``); see :func:`hetcomm.ops.worker.main`."""
    from hetcomm.cli.main import EXIT_USAGE, build_parser
    from hetcomm.ops import worker

    return worker.main(argv, build_parser=build_parser, exit_usage=EXIT_USAGE)


def in_place_rank(argv: List[str]) -> int:
    """One rank of ``hetcomm launch --shrink-in-place`` (a :func:`hetcomm.launcher.launch` target):
    the torchrun worker's steps, the job's exit code returned (the launcher restarts nobody, and
    after an in-place shrink that lost rank 0 no process is ``RANK=0`` to record it)."""
    from hetcomm.cli.main import EXIT_USAGE, build_parser
    from hetcomm.ops import worker

    return worker.main(argv, build_parser=build_parser, exit_usage=EXIT_USAGE, record_exit=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
