"""The entry point of every torchrun worker ``hetcomm launch`` starts.

    python -m hetcomm.cli.worker [hetcomm subcommand and its arguments]

Places the rank and staggers the start (:mod:`hetcomm.ops.worker`: the job's cluster YAML in
torchrun's node order, a fresh store per attempt, grouped start), then runs the subcommand in this
process and records a finished job's exit code where ``hetcomm launch`` reads it.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from hetcomm import settings
from hetcomm.ops.worker import fresh_store, place, stagger

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run the job; a *finished* job's exit code is recorded, not returned.

    torchrun restarts the workers when one exits non-zero, which is right for a crash (a dead
    peer, a collective error: they propagate from here with their traceback) but wrong for a
    job that ran to its end and whose check failed (``hetcomm train``'s loss verdict, exit 1) or
    whose input is bad (exit 2): a restart would only repeat it. Those codes are written to
    ``$HETCOMM_LAUNCH_DIR/job-exit`` by rank 0, the worker exits 0, and ``hetcomm launch``
    returns the recorded code.
    """
    from hetcomm.cli.main import EXIT_USAGE, build_parser
    from hetcomm.errors import ConfigError, TopologyParseError, UsageError

    args = place(list(sys.argv[1:] if argv is None else argv))
    fresh_store()
    stagger()
    ns = build_parser().parse_args(args)
    try:
        code = int(ns._run(ns) or 0)
    except (UsageError, ConfigError, TopologyParseError) as e:
        print(f"hetcomm {ns.command}: error: {e}", file=sys.stderr)
        code = EXIT_USAGE
    out = settings.LAUNCH_DIR.get()
    if out and os.environ.get("RANK", "0") == "0":
        with open(os.path.join(out, "job-exit"), "w", encoding="utf-8") as f:
            f.write(f"{code}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
