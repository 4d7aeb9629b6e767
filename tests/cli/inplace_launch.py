"""``hetcomm launch`` with one rank set to SIGKILL itself after step ``KILL_AFTER``: the launcher
process of ``tests/cli/test_launch_inplace.py``.

    python -m tests.cli.inplace_launch LAUNCH ARGS...   (env INPLACE_TEST_VICTIM, INPLACE_TEST_OUT)

As this module's ``__main__`` it is ``hetcomm launch`` itself. hetcomm's launcher starts each
rank as multiprocessing's spawn does (:func:`hetcomm.launcher.launch`, ``start="exec"``): the rank
re-imports the launcher's main module, this one, as ``__mp_main__`` before it unpickles its
target, so in the job's ranks (and only there: torchrun's health-check workers import nothing of
it) the module installs the kill hook of ``tests/train/test_inplace_shrink.py``
(:func:`install_kill_hook`): rank ``INPLACE_TEST_VICTIM`` dies after step ``KILL_AFTER``, and
every rank that finishes writes what it ended as to ``INPLACE_TEST_OUT/rank<R>.json``. With
``INPLACE_TEST_GROW`` set (``--grow-back``) the victim's replacement is not killed and the
survivors wait for it (:func:`tests.train.test_inplace_growback.install_wait_hook`).
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

    _VICTIM = int(os.environ["INPLACE_TEST_VICTIM"])
    # --grow-back: the victim's replacement (HETCOMM_JOIN) is not killed again, and the survivors
    # wait for its handle at step WAIT_AT (tests/train/test_inplace_growback.py)
    install_kill_hook(-1 if os.environ.get("HETCOMM_JOIN") else _VICTIM, _record)
    if os.environ.get("INPLACE_TEST_GROW"):
        from tests.train.test_inplace_growback import install_wait_hook

        install_wait_hook(_VICTIM)

if __name__ == "__main__":
    from hetcomm.cli.main import main

    sys.exit(main(["launch", *sys.argv[1:]]))
