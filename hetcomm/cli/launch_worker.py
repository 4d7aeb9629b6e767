"""The entry point of every torchrun worker ``hetcomm launch`` starts.

    python -m hetcomm.cli.launch_worker [hetcomm subcommand and its arguments]

Runs :func:`hetcomm.ops.worker.main` (place the rank in the job's cluster YAML, a fresh store per
attempt, grouped start, then the subcommand in this process, a finished job's exit code recorded
for ``hetcomm launch``) with this CLI's parser: the entry point lives in ``cli`` so that ``ops``
never imports the floor above it.
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the worker for ``argv`` (default ``sys.argv[1:]``); see :func:`hetcomm.ops.worker.main`."""
    from hetcomm.cli.main import EXIT_USAGE, build_parser
    from hetcomm.ops import worker

    return worker.main(argv, build_parser=build_parser, exit_usage=EXIT_USAGE)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
