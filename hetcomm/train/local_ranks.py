"""How one machine's training ranks run on hetcomm's own launcher, and what their run exits with.

Two callers start a training job's ranks with :func:`hetcomm.launcher.launch` and must do it
the same way: ``hetcomm train`` (its ranks run :func:`hetcomm.train.loop.train_worker`) and
``hetcomm launch --shrink-in-place`` (its ranks run ``hetcomm.cli.launch_worker``'s entry, which
places the rank, waits its start wave and runs the ``train`` job). :func:`launch_options` is the
one policy (the launcher hosts the store; with an in-place shrink a dead rank stops nobody), and
:func:`exit_code` the one verdict (a timeout, ranks that died while the others finished in place,
bad input a rank found, a failure, or the lowest rank's own code).
"""

from __future__ import annotations

import sys
from typing import Set

__all__ = ["launch_options", "exit_code", "usage_error_names"]

#: Seconds allowed per step on top of the job's own timeout before the launcher stops the run.
STEP_ALLOWANCE_S = 10.0


def launch_options(cfg, in_place: bool):
    """The :class:`~hetcomm.launch_options.LaunchOptions` of ``cfg``'s ranks (args: ``(cfg,)``;
    a caller whose target takes other arguments replaces them).

    The launcher hosts the ``TCPStore`` (it must outlive any rank: an in-place shrink goes on
    over it), the run is stopped after ``timeout_s + 10 s per step``, and the ranks' leftover
    shared memory is removed. ``grace_s``: one failed rank usually means the others wait for it
    until their timeout, so they are stopped at once; with an in-place shrink they drop it and
    go on (a survivor that cannot fails by itself), so nobody is stopped early. With
    ``--grow-back`` a rank killed by a signal is started once more in its slot, as a joiner
    (``HETCOMM_JOIN=1``: :mod:`hetcomm.train.growback`).
    """
    from hetcomm import settings
    from hetcomm.launch_options import LaunchOptions

    return LaunchOptions(
        args=(cfg,),
        store=True,
        store_timeout_s=cfg.timeout_s,
        timeout_s=cfg.timeout_s + cfg.steps * STEP_ALLOWANCE_S,
        grace_s=None if in_place else 0.0,
        clean_shm=True,
        name="train",
        rejoin={settings.JOIN.name: "1"} if in_place and cfg.grow_back else None,
    )


def usage_error_names() -> Set[str]:
    """Class names of the errors that mean bad input (CLI exit 2), as a rank reports them."""
    from hetcomm.errors import ConfigError, UsageError

    names, todo = set(), [ConfigError, UsageError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def exit_code(outcome, in_place: bool, who: str = "hetcomm train") -> int:
    """The run's exit code, with its lines on stderr (prefixed ``who``).

    * first, one line per process started in a killed rank's slot (``--grow-back``), naming both
      pids and how the new one ended;
    * ranks still running at the time limit: 1, naming them;
    * with ``in_place``, ranks killed by a signal while every other rank finished: the lowest
      survivor's verdict, naming who died and who finished in place
      (:func:`hetcomm.train.inplace.outcome_code`);
    * bad input a rank found (a damaged checkpoint, nothing to train): 2, one line;
    * another failure: 1, the first failing rank's traceback and one line naming it;
    * all ranks finished: the lowest rank's result (0, 1 or 2; anything else is 1).
    """
    from hetcomm.train import inplace

    for r in outcome.ranks:  # --grow-back: the processes started in a killed rank's slot
        if r.replaced is not None:
            print(f"{who}: rank {r.rank} (pid {r.replaced[0]}) was killed by signal {-r.replaced[1]}; pid {r.pid} "
                  f"was started in its slot (--grow-back) and {'finished' if r.ok else r.how_it_ended()}",
                  file=sys.stderr, flush=True)
    if outcome.timed_out:
        print(f"{who}: the run exceeded its time limit ({outcome.timeout_s:g} s); ranks {list(outcome.timed_out)} "
              "had not finished; stopped all ranks", file=sys.stderr)
        return 1
    code = inplace.outcome_code(outcome, who) if in_place and not outcome.ok else None
    if code is not None:
        return code
    if not outcome.ok:
        first = outcome.ranks[outcome.first_failure if outcome.first_failure is not None else outcome.failures[0].rank]
        usage = [r for r in outcome.ranks if r.error_type in usage_error_names()]
        if usage:
            # It is the cause even when a peer's report of the raising rank's exit came first.
            print(f"{who}: error: {usage[0].error}", file=sys.stderr)
            return 2
        if first.traceback:
            print(first.traceback, file=sys.stderr, end="")
        print(f"{who}: {first.describe()}; stopped the other ranks", file=sys.stderr)
        return 1
    result = outcome.results[0]
    return result if type(result) is int and result in (0, 1, 2) else 1
