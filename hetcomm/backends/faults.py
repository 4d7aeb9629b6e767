"""Fault diagnosis: which rank is at fault when a collective of a hetcomm group fails.

A failed transfer only says which *connection* broke; the peer at its other end may be a victim
too (a survivor that failed first and exited closes its sockets as well). Before an error reaches
the caller, :class:`FaultDiagnosis` looks for the rank really at fault: same-host peers whose
process is gone, minus those that left a failure mark in the store; otherwise the ranks that did
not report the failure within a short wait. The result is a :class:`~hetcomm.errors.CollectiveError`
(or :class:`~hetcomm.errors.PeerTimeout`) whose ``peer`` names that rank and whose ``diagnosed``
field is set, so nothing diagnoses it twice.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable, List, Optional, Tuple

from hetcomm.backends import checks
from hetcomm.backends.placement import Placement
from hetcomm.errors import CollectiveError

__all__ = ["FaultDiagnosis"]


class FaultDiagnosis:
    """Names the rank at fault for a failed collective of one group.

    Args:
        store: the group's store (failure marks live under ``hetcomm/diag/failed/<rank>``).
        placement: who is where (pids of same-host peers).
        rank / size: this process in the group.
        timeout: the group timeout; diagnosis takes at most ~10 % of it (<= 3 s).
        rail_names: the CPU rail of every peer (to name the culprit's rail).
    """

    def __init__(
        self,
        store,
        placement: Placement,
        rank: int,
        size: int,
        timeout: timedelta,
        rail_names: Callable[[], List[str]],
    ):
        self.store = store
        self.placement = placement
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.rail_names = rail_names

    def culprits(self, seq: int) -> Tuple[List[int], str]:
        """``(ranks, text)``: who is most likely at fault for the failure of collective ``seq``.

        Peers on this host whose process is gone come first, minus those that left a failure
        mark in the store (they failed like us, maybe one collective earlier or later, and then
        exited); otherwise the ranks that left no mark within a short wait (dead, hung, or never
        called the collective). A group is unusable after a failure, so one mark per rank is
        enough.
        """
        key = lambda r: f"hetcomm/diag/failed/{r}"
        try:
            self.store.set(key(self.rank), "1")
        except Exception:  # the store may be gone with rank 0: diagnosis continues without it
            pass
        # A killed peer's sockets close before /proc shows it dead, and survivors mark the store
        # at slightly different times: look a few times, for at most ~10 % of the timeout.
        deadline = time.monotonic() + min(3.0, max(0.5, 0.1 * self.timeout.total_seconds()))
        missing: Optional[List[int]] = None
        while True:
            dead = checks.dead_peers(self.placement, self.rank, None)
            if dead:
                try:
                    failed_too = {r for r, _ in dead if self.store.check([key(r)])}
                except Exception:
                    failed_too = set()
                culprits = [(r, pid) for r, pid in dead if r not in failed_too]
                if culprits:
                    return [r for r, _ in culprits], "; exited: " + ", ".join(f"rank {r} (pid {pid})" for r, pid in culprits)
            missing = checks.missing_peers(self.store, self.rank, self.size, 0.0)
            if missing is None or not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if missing is None:
            return [], "; the store is unreachable too (did rank 0 or the launcher die?)"
        if missing:
            who = ", ".join(f"rank {r}" for r in missing)
            return missing, f"; {who} did not report this failure: dead, hung, or never called collective #{seq}"
        return [], ""

    def blame(self, e: CollectiveError, seq: int) -> CollectiveError:
        """Re-aim a rail error at the rank really at fault (same type; ``diagnosed`` set)."""
        if e.diagnosed:
            return e
        ranks, text = self.culprits(seq)
        if not ranks or e.peer in ranks:
            out = type(e)(f"{e.detail}{text}", op=e.op, rank=e.rank, peer=e.peer, rail=e.rail, diagnosed=True)
        else:
            culprit = ranks[0]
            names = self.rail_names()
            rail = names[culprit] if culprit < len(names) else e.rail
            out = type(e)(
                f"peer failed{text} (first symptom: {e.detail})", op=e.op, rank=e.rank, peer=culprit, rail=rail, diagnosed=True
            )
        out.__cause__ = e.__cause__ if e.__cause__ is not None else e
        return out

    def for_seq(self, seq: int) -> Callable[[List[int]], str]:
        """The ``diagnose`` callback of :func:`hetcomm.backends.executor.drive` for collective ``seq``."""
        return lambda peers: self.culprits(seq)[1]
