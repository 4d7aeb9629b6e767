"""What one :func:`hetcomm.launcher.launch` is asked to do, as one frozen record.

``launch(target, world_size, **kw)`` took 17 arguments; the 15 that say *how* to run the ranks are
the fields here, so a caller can build them once, check them before anything starts, and pass
them around (``launch(fn, 4, opts)``; ``launch(fn, 4, opts, timeout_s=60)`` changes one). The
keyword form is unchanged: every keyword of ``launch`` is a field of :class:`LaunchOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from hetcomm.errors import UsageError

__all__ = ["LaunchOptions", "LogTarget"]

#: Where a rank's stdout and stderr go: a path or an open file descriptor.
LogTarget = Union[str, int]


@dataclass(frozen=True)
class LaunchOptions:
    """How :func:`hetcomm.launcher.launch` runs its ranks.

    Attributes:
        args: arguments of a callable target (pickled; the same for every rank).
        start: ``"exec"`` (a fresh interpreter per rank, like torchrun) or ``"forkserver"``
            (callables only: a child of a server that imported torch and hetcomm once).
        env: variables for every rank (None unsets one); ``rank_env(rank)``: per rank, applied last.
        rank_env: see ``env``.
        prefix: ``prefix(rank)`` is put in front of the rank's command line (exec only).
        logs: per rank, a path or fd that receives its stdout and stderr; others inherit ours.
        store: host a ``TCPStore`` for the ranks (``MASTER_ADDR``/``MASTER_PORT``).
        store_timeout_s: that store's timeout.
        timeout_s: wall-clock limit of the whole run (None: none).
        grace_s: after the first failure, seconds the others may run on before they are stopped
            (None: they are never stopped early).
        kill_grace_s: seconds between SIGTERM and SIGKILL when stopping a rank.
        clean_shm: remove ``/dev/shm`` segments and doorbells that ranks left behind.
        die_with_launcher: exec'd ranks get ``PR_SET_PDEATHSIG`` (False: they outlive a killed
            launcher; emulate keeps them for ``hetcomm emulate down``, which reads their pids).
        name: names the scratch directory (``hetcomm-<name>-*`` under ``$TMPDIR``).
        on_start: called as ``on_start(rank, pid)`` after each rank started (emulate records
            the pids in its state file).
        rejoin: variables added to the environment of a process started once more in the slot
            of a rank killed by a signal (once per rank; None: nobody is started again). The
            rank's outcome is then the replacement's, and names the process it replaced
            (``hetcomm train --grow-back``: the replacement joins the survivors in place).

    Raises:
        UsageError: ``start`` is neither ``exec`` nor ``forkserver``, or a time is negative.
    """

    args: Sequence[Any] = ()
    # exec by default: each rank imports torch itself and owns its threads, as under torchrun.
    start: str = "exec"
    env: Optional[Mapping[str, Optional[str]]] = None
    rank_env: Optional[Callable[[int], Mapping[str, Optional[str]]]] = None
    prefix: Optional[Callable[[int], Sequence[str]]] = None
    logs: Optional[Mapping[int, LogTarget]] = None
    store: bool = False
    # 300 s: torch's own rendezvous default is 30 min; a test or a demo should fail sooner.
    store_timeout_s: float = 300.0
    timeout_s: Optional[float] = None
    # 0: one failed rank usually means the others wait for it until their own timeout.
    grace_s: Optional[float] = 0.0
    kill_grace_s: float = 3.0
    clean_shm: bool = False
    die_with_launcher: bool = True
    name: str = "ranks"
    on_start: Optional[Callable[[int, int], None]] = None
    rejoin: Optional[Mapping[str, str]] = None

    def __post_init__(self) -> None:
        if self.start not in ("exec", "forkserver"):
            raise UsageError(f"launch: start must be 'exec' or 'forkserver', not {self.start!r}")
        for key in ("store_timeout_s", "timeout_s", "grace_s", "kill_grace_s"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise UsageError(f"launch: {key} must be >= 0 seconds, not {value!r}")
