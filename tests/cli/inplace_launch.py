"""``hetcomm launch`` with one rank set to SIGKILL itself after step ``KILL_AFTER``: the launcher
process of ``tests/cli/test_launch_inplace.py``.

    python -m tests.cli.inplace_launch LAUNCH ARGS...   (env INPLACE_TEST_VICTIM, INPLACE_TEST_OUT)

As this module's ``__main__`` it is ``hetcomm launch`` itself. hetcomm's launcher starts each
rank as multiprocessing's spawn does (:func:`hetcomm.launcher.launch`, ``start="exec"``): the rank
re-imports the launcher's main module, this one, as ``__mp_main__`` before it unpickles its
target, so in the job's ranks (and only there: torchrun's health-check workers import nothing of
it) the module installs the kill hook of ``tests/train/test_inplace_shrink.py``
(:func:`install_kill_hook`): rank ``INPLACE_TEST_VICTIM`` dies after step ``KILL_AFTER``, and
every rank that finishes writes what it ended as to ``INPLACE_TEST_OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__mp_main__" and "RANK" in os.environ and "INPLACE_TEST_VICTIM" in os.environ:
    from tests.train.test_inplace_shrink import install_kill_hook

    _RANK = int(os.environ["RANK"])

    def _record(seen: dict) -> None:
        seen = dict(seen, started_as=_RANK)
        with open(os.path.join(os.environ["INPLACE_TEST_OUT"], f"rank{_RANK}.json"), "w", encoding="utf-8") as f:
            json.dump(seen, f)

    install_kill_hook(int(os.environ["INPLACE_TEST_VICTIM"]), _record)

if __name__ == "__main__":
    from hetcomm.cli.main import main

    sys.exit(main(["launch", *sys.argv[1:]]))
