"""Fault diagnosis: which rank is at fault when a collective of a hetcomm group fails.

A failed transfer only says which *connection* broke; the peer at its other end may be a victim
too (a survivor that failed first and exited closes its sockets as well). Before an error reaches
the caller, :class:`FaultDiagnosis` looks for the rank really at fault: same-host peers whose
process is gone, minus those that left a failure mark in the store; otherwise the ranks that did
not report the failure within a short wait. The result is a :class:`~hetcomm.errors.CollectiveError`
(or :class:`~hetcomm.errors.PeerTimeout`) whose ``peer`` names that rank and whose ``diagnosed``
field is set, so nothing diagnoses it twice.

A peer the heartbeat found certainly lost (:mod:`hetcomm.backends.heartbeat`: exited, stopped)
ends a wait at once, with :func:`loss_error`: the same words on every survivor (the loss's
:attr:`~hetcomm.backends.heartbeat.PeerLoss.verdict`, the collective and its number; no pid, no
times), so the cross-rank check keeps every rank's error identical. :func:`wait_watching` is
that rule for a gloo Work waited on in this thread (the delegated collectives, the all-gloo
split check and the gloo all-to-all).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

from hetcomm.backends import checks
from hetcomm.backends.rank_placement import Placement
from hetcomm.errors import CollectiveError, GroupStoppedWaiting, HetcommError, PeerTimeout

if TYPE_CHECKING:
    import torch.distributed

    from hetcomm.backends.heartbeat import PeerLoss

__all__ = ["FaultDiagnosis", "SeqDiagnosis", "release_frames", "loss_error", "wait_watching"]

#: How long :meth:`FaultDiagnosis.blame` looks for a certain loss in the heartbeat before it
#: diagnoses a broken wait by itself (a few beats: the loss another survivor acted on).
CERTAIN_WAIT_S = 1.0
#: Slices of a watched gloo wait (:func:`wait_watching`): the heartbeat is looked at between them.
WATCH_S = 0.25


def loss_error(loss: "PeerLoss", *, peer: int, seq: int, op: str, rank: int, rail: Optional[str]) -> CollectiveError:
    """The error of a collective (``op``, number ``seq`` in its group) waiting on ``peer`` (its
    group rank) when the heartbeat found that peer certainly lost: :class:`PeerTimeout` for a
    stopped peer (it still holds its sockets), :class:`CollectiveError` for one that exited.
    Every survivor builds the same message, whoever saw the loss and however it learnt of it."""
    cls = PeerTimeout if loss.cause == "stopped" else CollectiveError
    return cls(
        f"peer lost during collective #{seq}: {loss.verdict} (named by the heartbeat; every survivor names it); "
        f"restart the job or let `hetcomm launch` do it",
        op=op, rank=rank, peer=peer, rail=rail, diagnosed=True,
    )


def wait_watching(work: "torch.distributed.Work", faults: "FaultDiagnosis", seq: int, op: str,
                  release: Optional[Callable[[int], None]] = None) -> Optional[CollectiveError]:
    """``work.wait()`` for a gloo Work, ending early with :func:`loss_error` as soon as the
    heartbeat names a peer of the group certainly lost.

    gloo waits for a stopped (SIGSTOP) peer until the group timeout; a killed one closes its
    sockets and ends the wait at once. With a heartbeat running the wait is cut into
    :data:`WATCH_S` slices (``Work.wait(timeout)`` leaves a gloo collective pending when it times
    out) and the heartbeat is looked at between them. ``release(peer)``, when given, then ends
    the gloo op itself (:func:`hetcomm.backends.rails.gloo.release_gloo`), so that no gloo
    thread stays behind in it until the group timeout.

    Returns:
        None when gloo completed (its own errors are raised), else the error to raise instead.
    """
    from hetcomm.backends import heartbeat

    beat = heartbeat.active()
    if beat is None or faults.size < 2:
        work.wait()
        return None
    seen = 0  # a loss declared before the call counts too
    diagnosis = SeqDiagnosis(faults, seq)
    peers = [p for p in range(faults.size) if p != faults.rank]
    while True:
        if beat.version != seen:
            seen = beat.version
            err = diagnosis.lost_error(peers, op)
            if err is not None:
                if release is not None:
                    release(err.peer)
                return err
        try:
            work.wait(timedelta(seconds=WATCH_S))
            return None
        except RuntimeError as e:  # c10d's words for a wait(timeout) that ran out (gloo's own differ)
            if "Operation timed out" not in str(e):
                raise


def release_frames(exc: BaseException) -> BaseException:
    """Let ``exc`` be kept in a Work without keeping the collective's frames; returns ``exc``.

    An exception stored in a Work references its traceback, whose frames reference their locals
    and, through ``f_back``, every caller up to the c10d call: the Work, the job, the group's rails
    and gloo groups, the process group itself. That is a reference cycle (work -> error -> frames
    -> work), so after a failure or a cross-rank mismatch the whole group outlived
    ``destroy_process_group`` until the cyclic GC ran: at interpreter exit, or on any thread, e.g.
    a gloo thread whose group destructor then joins itself.

    hetcomm's own errors (:class:`~hetcomm.errors.HetcommError`) say what, where and how to fix in
    their message and fields, so their tracebacks (and their causes', e.g. gloo's text) are
    dropped. Any other exception is an internal bug: its traceback is kept for the report.
    """
    if not isinstance(exc, HetcommError):
        return exc
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return exc


class StoreHostLost(HetcommError):
    """A store call refused because the heartbeat found the store's host lost."""


class _StoreUnlessHostLost:
    """The group's store, refusing every call (:class:`StoreHostLost`, at once) once this
    process's heartbeat found the rank hosting it stopped, exited or not answering.

    Why: torch's ``TCPStore`` client has no read timeout, so a call to a *stopped* host (SIGSTOP,
    a frozen node) never returns, whatever the store's timeout; diagnosis would hang every
    survivor in its first failure mark instead of raising. The callers already treat a failing
    store as "unreachable" and name the culprit without it."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            from hetcomm.backends import heartbeat

            hb = heartbeat.active()
            loss = hb.store_host_loss() if hb is not None else None
            if loss is not None:
                raise StoreHostLost(f"store call {name} not made: {loss.verdict}, and it hosts the store")
            return attr(*args, **kwargs)

        return call


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
        self.store = _StoreUnlessHostLost(store)
        self.placement = placement
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.rail_names = rail_names

    def culprits(self, seq: int, waited_for: Optional[Sequence[int]] = None) -> Tuple[List[int], str]:
        """``(ranks, text)``: the ranks provably at fault for the failure of collective ``seq``.

        Only two kinds of rank are named:

        * **dead**: a peer on this host whose process is gone and that left no failure mark in
          the store. Survivors mark the store before anything else, so one that failed like this
          rank and then exited is not blamed. When the store is unreachable (it lived in a rank
          or launcher that exited), marks cannot be read: then only peers already gone at the
          first look count, restricted to ``waited_for`` when known, and the text says so;
        * **silent**: a rank that has not marked the failure within the diagnosis window and,
          when ``waited_for`` is given (the peers this rank still waited for at its deadline),
          is one of those. A late survivor whose own timeout fires a little later marks within
          the window and drops out; a peer this rank never waited for is not named.

        Args:
            seq: the collective's sequence number in the group.
            waited_for: the peers still pending when the wait ended, if the rail knows them.
        """
        key = lambda r: f"hetcomm/diag/failed/{r}"
        try:
            self.store.set(key(self.rank), "1")
            store_ok = True
        except Exception:  # the store may be gone with rank 0: diagnosis continues without it
            store_ok = False
        candidates = None if waited_for is None else {int(r) for r in waited_for if r != self.rank}
        first_dead = {r for r, _ in checks.dead_peers(self.placement, self.rank, None)}
        # A killed peer's sockets close before /proc shows it dead, and survivors mark the store
        # at slightly different times: look a few times, for at most ~10 % of the timeout.
        deadline = time.monotonic() + min(3.0, max(0.5, 0.1 * self.timeout.total_seconds()))
        silent: Optional[List[int]] = None
        while True:
            dead = checks.dead_peers(self.placement, self.rank, None)
            if dead:
                marked = set()
                if store_ok:
                    try:
                        marked = {r for r, _ in dead if self.store.check([key(r)])}
                    except Exception:
                        store_ok = False
                if store_ok:
                    culprits = [(r, pid) for r, pid in dead if r not in marked]
                    note = ""
                else:
                    culprits = [(r, pid) for r, pid in dead if r in first_dead and (candidates is None or r in candidates)]
                    note = " (the store is unreachable, so a rank that failed like this one and exited first cannot be ruled out)"
                if culprits:
                    return [r for r, _ in culprits], "; exited: " + ", ".join(f"rank {r} (pid {pid})" for r, pid in culprits) + note
            missing = checks.missing_peers(self.store, self.rank, self.size, 0.0) if store_ok else None
            if missing is None:
                break
            silent = [r for r in missing if candidates is None or r in candidates]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if missing is None:
            return [], "; the store is unreachable too (did rank 0 or the launcher die?)"
        if silent:
            if store_ok:
                # Say whom this rank stopped waiting for: a late rank that arrives after this one
                # left is told so (stopped_waiting_for_me), not "connection closed by peer".
                try:
                    self.store.set(f"hetcomm/diag/gave-up/{self.rank}", f"{seq}:" + ",".join(map(str, silent)))
                except Exception:
                    pass
            who = ", ".join(f"rank {r}" for r in silent)
            return silent, f"; {who} did not report this failure: dead, hung, or never called collective #{seq}"
        return [], ""

    def stopped_waiting_for_me(self, seq: int) -> Optional[Tuple[int, int]]:
        """``(rank, its collective)`` of a peer that timed out waiting for *this* rank and left,
        or None. Read from the peers' ``hetcomm/diag/gave-up/<rank>`` marks
        (``"<seq>:<ranks it stopped waiting for>"``), left by :meth:`culprits`."""
        for r in range(self.size):
            if r == self.rank:
                continue
            key = f"hetcomm/diag/gave-up/{r}"
            try:
                if not self.store.check([key]):
                    continue
                their_seq, _, ranks = self.store.get(key).decode().partition(":")
            except Exception:  # no store: nothing to tell
                return None
            if str(self.rank) in ranks.split(",") and int(their_seq) <= seq:
                return r, int(their_seq)
        return None

    def late_error(self, e: CollectiveError, seq: int) -> Optional[GroupStoppedWaiting]:
        """The error for this rank when a peer stopped waiting for it (see
        :meth:`stopped_waiting_for_me`), else None."""
        gave_up = self.stopped_waiting_for_me(seq)
        if gave_up is None:
            return None
        peer, their_seq = gave_up
        out = GroupStoppedWaiting(
            f"the group stopped waiting for this rank: rank {peer} timed out in collective #{their_seq} "
            f"waiting for rank {self.rank} (this rank reached it more than the group timeout of "
            f"{self.timeout.total_seconds():.0f} s late) and left; make every rank reach each collective "
            f"within the group timeout, or raise init_process_group(timeout=...)",
            op=e.op, rank=e.rank, peer=peer, rail=e.rail, diagnosed=True,
        )
        out.__cause__ = e  # what this rank saw (a closed connection, a peer that exited)
        return out

    def blame(self, e: CollectiveError, seq: int) -> CollectiveError:
        """Re-aim a rail error at the rank really at fault (same type; ``diagnosed`` set).

        A peer the heartbeat found certainly lost comes first: a survivor that raised and exited
        breaks its peers' connections too, and without this rule a survivor whose wait broke on
        that one would name it instead of the rank everyone else names."""
        if e.diagnosed:
            return e
        certain = self.await_certain_loss([p for p in range(self.size) if p != self.rank], CERTAIN_WAIT_S)
        if certain is not None:
            peer, loss = certain
            names = self.rail_names()
            out = loss_error(loss, peer=peer, seq=seq, op=e.op or "?", rank=self.rank,
                             rail=names[peer] if peer < len(names) else e.rail)
            out.__cause__ = e
            return out
        late = self.late_error(e, seq)
        if late is not None:
            return late
        # A timeout says whom this rank waited for; a broken connection may be a survivor's exit.
        ranks, text = self.culprits(seq, [e.peer] if isinstance(e, PeerTimeout) and e.peer is not None else None)
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

    def for_seq(self, seq: int) -> "SeqDiagnosis":
        """The ``diagnose`` callback of :func:`hetcomm.backends.executor.drive` for collective ``seq``."""
        return SeqDiagnosis(self, seq)

    def certain_loss(self, peers: Sequence[int]) -> Optional[Tuple[int, "PeerLoss"]]:
        """``(group rank, loss)`` of the root cause among the ``peers`` the heartbeat found exited
        or stopped, or None: a stopped peer before an exited one (a frozen process failed on its
        own, an exited one may be a survivor that raised because of it and left), then the
        earliest declared."""
        from hetcomm.backends.heartbeat import DEFINITIVE

        found = [(p, loss) for p, loss in self.lost(peers) if loss.cause in DEFINITIVE]
        return min(found, key=lambda x: (x[1].cause != "stopped", x[1].detected_at, x[0])) if found else None

    def await_certain_loss(self, peers: Sequence[int], wait_s: float) -> Optional[Tuple[int, "PeerLoss"]]:
        """:meth:`certain_loss`, looking again for up to ``wait_s`` while a heartbeat runs: a
        broken wait is often the echo of a loss another survivor has just acted on (it released
        its gloo group, or raised and exited), which this rank's heartbeat reads a beat later.

        An exited peer is looked past for two more beats: the survivor that raised and left may
        have seen a stopped peer this rank's heartbeat has not read yet."""
        from hetcomm.backends import heartbeat

        deadline = time.monotonic() + wait_s
        while True:
            found = self.certain_loss(peers)
            hb = heartbeat.active()
            if hb is None or time.monotonic() > deadline or (found is not None and found[1].cause == "stopped"):
                return found
            if found is not None:
                deadline = min(deadline, time.monotonic() + 2 * hb.interval_s)
            time.sleep(0.02)

    def lost(self, peers: Sequence[int]) -> List[Tuple[int, "PeerLoss"]]:
        """``(group rank, loss)`` of the ``peers`` the default group's heartbeat declared lost
        (:mod:`hetcomm.backends.heartbeat`; its ranks are global, the placement maps them)."""
        from hetcomm.backends import heartbeat

        hb = heartbeat.active()
        if hb is None or not hb.lost:
            return []
        by_global = {self.placement.ranks[p].global_rank: p for p in peers}
        return [(by_global[loss.rank], loss) for loss in hb.lost_among(list(by_global))]


class SeqDiagnosis:
    """Diagnosis of one collective (``seq``) for :func:`hetcomm.backends.executor.drive`:
    called with the pending peers at a timeout; :meth:`lost` says which of them the heartbeat
    has already declared lost, so the wait can end at once."""

    def __init__(self, faults: FaultDiagnosis, seq: int) -> None:
        self.faults = faults
        self.seq = seq

    def __call__(self, peers: List[int]) -> Tuple[List[int], str]:
        return self.faults.culprits(self.seq, peers)

    def lost_error(self, peers: List[int], op: str) -> Optional[CollectiveError]:
        """The error naming the first peer among ``peers`` the heartbeat saw exit or stop (None
        if none): :func:`loss_error`, the same on every survivor."""
        certain = self.faults.certain_loss(peers)
        if certain is None:
            return None  # silence alone never fails a collective (see hetcomm.backends.heartbeat)
        peer, loss = certain
        names = self.faults.rail_names()
        rail = names[peer] if peer < len(names) else None
        return loss_error(loss, peer=peer, seq=self.seq, op=op, rank=self.faults.rank, rail=rail)
