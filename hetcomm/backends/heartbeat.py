"""Heartbeats: a dead or hung peer named on every survivor within a second (issue 20, item 3).

Without them a survivor learns of a lost peer only when a transfer to it breaks (a killed
process's sockets close: fast) or when the group timeout expires (a hung peer: minutes). One
:class:`Heartbeat` thread per process watches the default group:

* every ``interval_s`` it writes its beat counter to the store (``hetcomm/hb/<rank>``, through a
  clone of the group's store, so the thread never waits behind the main thread's store calls)
  and reads every peer's (one ``multi_get``);
* a peer on this host is also checked through ``/proc`` (its pid from the placement): gone or a
  zombie = ``exited``, state ``T`` (SIGSTOP, a debugger) = ``stopped``, found within one interval;
* a peer whose beat has not moved for its silence threshold is ``silent`` (hung with its GIL
  held, stopped on another host, a host that vanished, a partition). The threshold adapts to
  what this rank has seen of that peer: ``max(miss_s, GAP_FACTOR x`` the longest of its last
  ``GAP_WINDOW`` gaps between beats``)``, and ``START_MISS_S`` until ``MIN_GAPS`` gaps were seen.
  On a quiet machine that is ``miss_s``; on an overloaded one (load 30 on 2 cores, an emulated
  cluster's shaped store link) healthy peers' beats arrive in bursts, and a fixed 0.6 s took a
  busy rank 0 for a dead one and failed a healthy job;
* the store itself unreachable for ``miss_s``: its host (rank 0, whose process hosts the
  attempt's store) is named.

A loss is recorded once (:attr:`Heartbeat.lost`, with the cause and the seconds since that
peer's last beat) and logged on stderr. Only the causes seen through ``/proc`` are certain
(:data:`DEFINITIVE`: ``exited``, ``stopped``): for those, :meth:`Heartbeat.lost_among` lets the
executor's wait loop (:func:`hetcomm.backends.executor.drive`) turn a routed collective waiting
on that peer into a :class:`~hetcomm.errors.CollectiveError` naming the rank and the collective,
instead of waiting for the group timeout. Silence (``silent``, ``store``) is a judgement: on an
overloaded machine a healthy rank can fall quiet for seconds, so it is named (within a second on
a quiet machine) but never fails a collective by itself (the group timeout and
:mod:`.faults` still do), and a silent peer that beats again is taken off the list. Every survivor watches every peer, so every
survivor names the same rank. Delegated collectives (gloo's all_reduce and friends) block inside
gloo and still end at the group timeout (or at once when the peer's sockets close).

Why by hand: torch's elastic agent checks its *workers* from the agent process (every
``--monitor-interval``, same host only), and torchft's heartbeats go to its lighthouse/manager
process, which this stack does not run; neither tells a worker which peer it is waiting on.

Cost: one small store write and one ``multi_get`` per interval per rank (10/s by default), and
no work on the collectives' path beyond an integer comparison per wait-loop turn.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence

__all__ = ["PeerLoss", "Heartbeat", "active", "lost_definitively", "start", "start_for", "stop", "DEFINITIVE", "DEFAULT_INTERVAL_S", "DEFAULT_MISS_S"]

#: Seconds between beats.
DEFAULT_INTERVAL_S = 0.1
#: The shortest silence after which a peer is declared silent (the threshold adapts upwards to
#: the gaps seen, see the module docstring): with 0.1 s beats, detection in 0.6-0.75 s.
DEFAULT_MISS_S = 0.6
#: A peer not seen yet is not judged before this many seconds (ranks start at different times).
START_GRACE_S = 60.0
#: Silence threshold while fewer than ``MIN_GAPS`` gaps between a peer's beats were seen.
START_MISS_S = 3.0
MIN_GAPS = 8
#: The threshold is at least this many times the longest recent gap between a peer's beats...
GAP_FACTOR = 4.0
#: ... over this many gaps.
GAP_WINDOW = 32
#: Causes certain enough to fail a collective at once (seen through ``/proc`` on this host).
DEFINITIVE = ("exited", "stopped")
#: The value a rank leaves at a clean shutdown.
_BYE = "bye"


@dataclass(frozen=True)
class PeerLoss:
    """A peer this rank declared lost.

    Attributes:
        rank: the peer (default-group rank).
        cause: ``exited`` (process gone), ``stopped`` (SIGSTOP'd), ``silent`` (no beat for
            ``miss_s``) or ``store`` (the store, hosted by that rank, is unreachable).
        silent_s: seconds since that peer's last beat was seen (or since the store last answered).
        detected_at: ``time.time()`` when this rank declared it (for detection-time measurements).
        detail: one line saying what was seen.
    """

    rank: int
    cause: str
    silent_s: float
    detected_at: float
    detail: str


def _proc_state(pid: int) -> Optional[str]:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z``, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split(" ", 1)[0]


class Heartbeat:
    """The watching thread of one process (see the module docstring).

    Args:
        store: the default group's store (cloned here).
        rank / world_size: this process in the default group.
        local_pids: ``{rank: pid}`` of peers on this host (checked through ``/proc``).
        interval_s: seconds between beats.
        miss_s: seconds without a beat before a peer is declared silent.
        store_host: the rank whose process hosts the store (named if the store goes away), or None.
    """

    def __init__(self, store, rank: int, world_size: int, *, local_pids: Optional[Dict[int, int]] = None,
                 interval_s: float = DEFAULT_INTERVAL_S, miss_s: float = DEFAULT_MISS_S,
                 store_host: Optional[int] = 0) -> None:
        if not 0 < interval_s < miss_s:
            raise ValueError(f"heartbeat: need 0 < interval_s ({interval_s}) < miss_s ({miss_s})")
        self.store = store.clone()
        self.rank = rank
        self.world_size = world_size
        self.local_pids = dict(local_pids or {})
        self.interval_s = interval_s
        self.miss_s = miss_s
        self.store_host = store_host
        #: Peers declared lost, by rank (a ``silent`` one that beats again is taken off).
        self.lost: Dict[int, PeerLoss] = {}
        #: Bumped on every new loss: waiters compare it instead of locking.
        self.version = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = 0
        self._thread = threading.Thread(target=self._run, name=f"hetcomm-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and say goodbye: peers then take this rank's silence for a clean exit."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval_s + 1.0)
        try:
            self.store.set(self._key(self.rank), _BYE)
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass

    def lost_among(self, peers: Sequence[int]) -> List[PeerLoss]:
        """The losses among ``peers`` (default-group ranks), in rank order."""
        if not self.lost:
            return []
        with self._lock:
            return [self.lost[p] for p in sorted(set(peers)) if p in self.lost]

    # -- the thread ------------------------------------------------------------------------------
    def _key(self, r: int) -> str:
        return f"hetcomm/hb/{r}"

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(self._key(self.rank), str(self._beat))

    def _declare(self, rank: int, cause: str, silent_s: float, detail: str) -> None:
        with self._lock:
            if rank in self.lost:
                return
            self.lost[rank] = PeerLoss(rank, cause, silent_s, time.time(), detail)
            self.version += 1
        print(f"hetcomm heartbeat: rank {self.rank} lost peer rank {rank}: {detail}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        started = time.monotonic()
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {}
        gaps: Dict[int, Deque[float]] = {r: deque(maxlen=GAP_WINDOW) for r in peers}
        store_ok_at = started
        departed: set = set()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._publish()
                seen = [r for r in peers if r in last_value and r not in departed]
                unseen = [r for r in peers if r not in last_value and self.store.check([self._key(r)])]
                values = self.store.multi_get([self._key(r) for r in seen + unseen]) if seen or unseen else []
                store_ok_at = now
            except Exception as e:  # noqa: BLE001 - any store failure means the same: it is gone
                if now - store_ok_at > self.miss_s and self.store_host is not None and self.store_host != self.rank:
                    self._declare(self.store_host, "store", now - store_ok_at,
                                  f"the store it hosts stopped answering {now - store_ok_at:.2f} s ago ({type(e).__name__})")
                values, seen, unseen = [], [], []
            for r, v in zip(seen + unseen, values):
                if v == _BYE.encode():
                    departed.add(r)
                elif last_value.get(r) != v:
                    if r in last_change:
                        gaps[r].append(now - last_change[r])
                    last_value[r] = v
                    last_change[r] = now
                    if r in self.lost and self.lost[r].cause not in DEFINITIVE:
                        self._revoke(r)
            for r, pid in self.local_pids.items():
                if r in self.lost or r in departed:
                    continue
                state = _proc_state(pid)
                if state is None or state in ("Z", "X"):
                    if self._said_bye(r):  # it shut down cleanly between the read and the look
                        departed.add(r)
                        continue
                    self._declare(r, "exited", now - last_change.get(r, started), f"its process (pid {pid}) exited")
                elif state in ("T", "t"):
                    self._declare(r, "stopped", now - last_change.get(r, started),
                                  f"its process (pid {pid}) is stopped (state {state})")
            for r in peers:
                if r in self.lost or r in departed:
                    continue
                if r in last_change:  # (a stopped peer's store key stays as it was: judged by /proc above)
                    quiet = now - last_change[r]
                    if quiet > self.silence_threshold(gaps[r]) and not self._said_bye(r):
                        self._declare(r, "silent", quiet, f"no heartbeat for {quiet:.2f} s (hung, stopped or unreachable)")
                elif now - started > START_GRACE_S:
                    self._declare(r, "silent", now - started, f"never sent a heartbeat in {now - started:.0f} s")

    def _revoke(self, rank: int) -> None:
        with self._lock:
            loss = self.lost.pop(rank, None)
            self.version += 1
        if loss is not None:
            print(f"hetcomm heartbeat: rank {self.rank}: peer rank {rank} beats again (was {loss.cause})",
                  file=sys.stderr, flush=True)

    def silence_threshold(self, gaps: Sequence[float]) -> float:
        """Seconds without a beat after which a peer with these recent gaps is silent."""
        if len(gaps) < MIN_GAPS:
            return max(self.miss_s, START_MISS_S)
        return max(self.miss_s, GAP_FACTOR * max(gaps))

    def _said_bye(self, r: int) -> bool:
        try:
            return self.store.get(self._key(r)) == _BYE.encode()
        except Exception:  # noqa: BLE001
            return False


_active: Optional[Heartbeat] = None
#: Whether the last stopped heartbeat of the default group had seen a peer exit or stop (what
#: the group's shutdown asks after the heartbeat is gone: :func:`lost_definitively`).
_stopped_with_loss = False


def active() -> Optional[Heartbeat]:
    """The heartbeat of this process's default group, or None."""
    return _active


def lost_definitively() -> bool:
    """Whether this process's default-group heartbeat (running, or the one its shutdown just
    stopped) saw a peer exit or stop: waits on that peer are not worth sitting out."""
    hb = _active
    if hb is not None:
        return any(x.cause in DEFINITIVE for x in list(hb.lost.values()))
    return _stopped_with_loss


def start(store, rank: int, world_size: int, **kwargs) -> Heartbeat:
    """Start the heartbeat of the default group (replacing a previous group's)."""
    global _active, _stopped_with_loss
    stop()
    _stopped_with_loss = False
    _active = Heartbeat(store, rank, world_size, **kwargs).start()
    return _active


def start_for(store, rank: int, world_size: int, placement) -> Heartbeat:
    """:func:`start` for a default group with this :class:`~hetcomm.backends.rank_placement.Placement`:
    same-host peers are watched through ``/proc`` too; the store's host is named if it goes away
    when rank 0 hosts it (``hetcomm launch``'s workers: one store per attempt in rank 0)."""
    import os

    local = {r: placement.ranks[r].pid for r in range(world_size) if r != rank and placement.same_host(rank, r)}
    # TORCHELASTIC_USE_AGENT_STORE=False is how hetcomm.ops.worker hands the store to rank 0.
    host = 0 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else None
    return start(store, rank, world_size, local_pids=local, store_host=host)


def stop(which: Optional[Heartbeat] = None) -> None:
    """Stop the default group's heartbeat (at group shutdown); with ``which``, only if it is that one."""
    global _active, _stopped_with_loss
    if which is not None and which is not _active:
        which.stop()
        return
    hb, _active = _active, None
    if hb is not None:
        _stopped_with_loss = any(x.cause in DEFINITIVE for x in list(hb.lost.values()))
        hb.stop()
