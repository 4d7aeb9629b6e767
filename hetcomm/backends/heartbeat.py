"""Heartbeats: a dead or hung peer named on every survivor within a second.

Without them a survivor learns of a lost peer only when a transfer to it breaks (a killed
process's sockets close: fast) or when the group timeout expires (a hung peer: minutes). One
:class:`Heartbeat` thread per process watches the default group:

* every ``interval_s`` it writes its beat counter to the store (``hetcomm/hb/<rank>``, through a
  clone of the group's store, so the thread never waits behind the main thread's store calls)
  and reads every peer's (one ``multi_get``);
* a peer on this host is also checked through ``/proc`` (its pid from the placement): gone or a
  zombie = ``exited``, state ``T`` (SIGSTOP, a debugger) = ``stopped``, found within one interval;
* what this rank sees stopped through ``/proc`` it says in its own beat (``"<n> stopped=2,5"``),
  so observers on other hosts, which cannot see that pid, declare the peer ``stopped`` at their
  next read (two intervals) instead of at their silence threshold. Only a beat seen to *move*
  is believed (a reporter that itself went quiet may carry an old verdict), and the field lists
  what ``/proc`` says now, not what was once declared: a late observer (one that starts
  watching after the fact) is never told that a peer that was continued is stopped;
* a peer whose beat has not moved for its silence threshold is ``silent`` (hung with its GIL
  held, stopped on another host, a host that vanished, a partition). The threshold adapts to
  what this rank has seen of that peer: ``max(miss_s, GAP_FACTOR x`` the longest of its last
  ``GAP_WINDOW`` gaps between beats``)``, and ``START_MISS_S`` until ``MIN_GAPS`` gaps were seen.
  On a quiet machine that is ``miss_s``; on an overloaded one (load 30 on 2 cores, an emulated
  cluster's shaped store link) healthy peers' beats arrive in bursts, and a fixed 0.6 s took a
  busy rank 0 for a dead one and failed a healthy job. A late observer counts a peer's silence
  from its own first look (it cannot know when the last beat was written), so a peer that went
  quiet before it started watching is named once the threshold passes from then, and a
  healthy peer, whose beat moves, never is;
* the store itself unreachable for ``miss_s``: its host (rank 0, whose process hosts the
  attempt's store) is named. A store whose host is *stopped* does not fail a call, it never
  answers one (torch's ``TCPStore`` client has no read timeout: ``check``/``get``/``set`` block
  for good, whatever the store's timeout), so a second thread watches the beating thread's store
  call: stuck for two intervals with the store's host on this host, ``/proc`` decides (stopped or
  exited: certain); stuck for the silence threshold, the host is named ``store``.
  :meth:`Heartbeat.store_host_loss` then tells the failure path (:mod:`.faults`) and the goodbye
  to leave the store alone, and a worker of ``hetcomm launch`` (rank 0 hosts the store) that has
  not ended ``give_up_s`` (the group timeout) after such a verdict exits with status 1, naming the
  store's host, so that torchrun restarts the job instead of every survivor hanging in a store
  call (:meth:`Heartbeat._give_up_later`).

A loss is recorded once (:attr:`Heartbeat.lost`, with the cause and the seconds since that
peer's last beat; a ``silent`` one gives way to a certain cause found later) and logged on stderr. Only the causes seen through ``/proc`` (here or by a
reporter) are certain (:data:`DEFINITIVE`: ``exited``, ``stopped``): for those, the listeners
(:func:`add_listener`: the gloo rails, which release a transfer blocked on that peer inside
gloo) are told at once, and :meth:`Heartbeat.lost_among` lets the executor's wait loop
(:func:`hetcomm.backends.executor.drive`) and :func:`hetcomm.backends.faults.wait_watching` turn
a collective waiting on that peer into a :class:`~hetcomm.errors.CollectiveError` naming the
rank and the collective, instead of waiting for the group timeout. :attr:`PeerLoss.verdict` is
the same words on every survivor whoever saw it first (no pid, no times), so every survivor's
error reads the same. Silence (``silent``, ``store``) is a judgement: on an overloaded machine a
healthy rank can fall quiet for seconds, so it is named (within a second on a quiet machine) but
never fails a collective by itself (the group timeout and :mod:`.faults` still do), and a silent
peer that beats again is taken off the list. Every survivor watches every peer, so every
survivor names the same rank.

Why by hand: torch's elastic agent checks its *workers* from the agent process (every
``--monitor-interval``, same host only), and torchft's heartbeats go to its lighthouse/manager
process, which this stack does not run; neither tells a worker which peer it is waiting on.

Cost: one small store write and one ``multi_get`` per interval per rank (10/s by default), and
no work on the collectives' path beyond an integer comparison per wait-loop turn.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
import weakref
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from hetcomm.backends.thread_name import name_native_thread

__all__ = [
    "PeerLoss", "Heartbeat", "active", "add_listener", "remove_listener", "lost_definitively", "start", "start_for",
    "stop", "DEFINITIVE", "DEFAULT_INTERVAL_S", "DEFAULT_MISS_S",
]

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

    @property
    def verdict(self) -> str:
        """The loss in words every survivor writes alike, whoever saw it first and how (no pid,
        no times): what errors say, so that the cross-rank check keeps them identical."""
        if self.cause == "exited":
            return f"rank {self.rank} exited"
        if self.cause == "stopped":
            return f"rank {self.rank} is stopped (SIGSTOP or a debugger: state T)"
        if self.cause == "store":
            return f"rank {self.rank}'s store stopped answering"
        return f"rank {self.rank} fell silent"


def _encode_beat(n: int, stopped: Sequence[int]) -> str:
    """A beat's value: its counter, and the peers this rank sees stopped through ``/proc``."""
    return f"{n} stopped={','.join(map(str, sorted(stopped)))}" if stopped else str(n)


def _decode_beat(value: bytes) -> Tuple[bytes, List[int]]:
    """``(counter, stopped ranks)`` of a beat's value (a malformed field reads as none)."""
    counter, _, rest = value.partition(b" ")
    stopped: List[int] = []
    if rest.startswith(b"stopped="):
        try:
            stopped = [int(x) for x in rest[len(b"stopped="):].split(b",") if x]
        except ValueError:
            stopped = []
    return counter, stopped


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
        give_up_s: with ``store_host``, seconds this process may live on after the store's host
            was found lost (stopped, exited, or not answering) before it exits with status 1
            (:meth:`_give_up_later`); None: never (the process's owner decides).
        describe_peer: ``rank -> "rank 0 (pid 12, host a)"`` for the give-up line (default: the rank).
    """

    def __init__(self, store, rank: int, world_size: int, *, local_pids: Optional[Dict[int, int]] = None,
                 interval_s: float = DEFAULT_INTERVAL_S, miss_s: float = DEFAULT_MISS_S,
                 store_host: Optional[int] = 0, give_up_s: Optional[float] = None,
                 describe_peer: Optional[Callable[[int], str]] = None) -> None:
        if not 0 < interval_s < miss_s:
            raise ValueError(f"heartbeat: need 0 < interval_s ({interval_s}) < miss_s ({miss_s})")
        self.store = store.clone()
        self.rank = rank
        self.world_size = world_size
        self.local_pids = dict(local_pids or {})
        self.interval_s = interval_s
        self.miss_s = miss_s
        self.store_host = store_host
        self.give_up_s = give_up_s
        self._describe_peer = describe_peer or (lambda r: f"rank {r}")
        #: ``time.monotonic()`` when the beating thread's store call in flight began (None: none).
        #: Read by the store watch: a call to a stopped store never returns.
        self._store_call_at: Optional[float] = None
        self._giving_up = False
        #: Peers that said goodbye (a clean exit): a store host that left is not lost.
        self._departed: Set[int] = set()
        #: Peers declared lost, by rank (a ``silent`` one that beats again is taken off).
        self.lost: Dict[int, PeerLoss] = {}
        #: Bumped on every new loss: waiters compare it instead of locking.
        self.version = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = 0
        #: Same-host peers ``/proc`` shows stopped at the last look (said in this rank's beat).
        self._stopped_here: Set[int] = set()
        self._thread = threading.Thread(target=self._run, name=f"hetcomm-heartbeat-{rank}", daemon=True)
        self._store_watch = threading.Thread(target=self._watch_store, name=f"hetcomm-heartbeat-store-{rank}",
                                             daemon=True)

    def start(self) -> "Heartbeat":
        self._publish()
        self._thread.start()
        if self.store_host is not None and self.store_host != self.rank:
            self._store_watch.start()
        return self

    def stop(self) -> None:
        """Stop beating and say goodbye: peers then take this rank's silence for a clean exit."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval_s + 1.0)
        # No goodbye when the beating thread is still inside a store call (the store is not
        # answering: this call would queue behind it on the same client, for good) or the store's
        # host is known lost (a stopped host never answers; peers learn of this exit from /proc
        # or their own failure anyway).
        if self._thread.is_alive() or self.store_host_loss() is not None:
            return
        try:
            self.store.set(self._key(self.rank), _BYE)
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass

    def store_host_loss(self) -> Optional["PeerLoss"]:
        """The loss of the rank hosting the store when it was declared stopped, exited or not
        answering (``store``), else None: then no store call can be trusted to return."""
        if self.store_host is None:
            return None
        loss = self.lost.get(self.store_host)
        if loss is not None and (loss.cause in DEFINITIVE or loss.cause == "store"):
            return loss
        return None

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
        self.store.set(self._key(self.rank), _encode_beat(self._beat, sorted(self._stopped_here)))

    def _watch_store(self) -> None:
        """The store watch (its own thread: the beating thread is the one a dead store blocks).

        A store call of the beating thread in flight for two intervals: with the store's host on
        this host, ``/proc`` says whether it is stopped or gone (certain, as for any peer); a call
        in flight for the silence threshold names the host ``store`` (a judgement). Either verdict
        arms the give-up (:meth:`_give_up_later`) through :meth:`_declare`."""
        name_native_thread()
        host = self.store_host
        assert host is not None
        pid = self.local_pids.get(host)
        while not self._stop.wait(self.interval_s):
            at = self._store_call_at
            if at is None or (host in self.lost and self.lost[host].cause in DEFINITIVE):
                continue
            stuck = time.monotonic() - at
            if stuck < 2 * self.interval_s:
                continue
            if pid is not None:
                state = _proc_state(pid)
                if state is None or state in ("Z", "X"):
                    self._declare(host, "exited", stuck, f"its process (pid {pid}) exited; it hosted the store, "
                                  f"whose call has waited {stuck:.2f} s")
                    continue
                if state in ("T", "t"):
                    self._declare(host, "stopped", stuck, f"its process (pid {pid}) is stopped (state {state}); it "
                                  f"hosts the store, whose call has waited {stuck:.2f} s")
                    continue
            if stuck > max(self.miss_s, START_MISS_S) and host not in self.lost:
                self._declare(host, "store", stuck, f"the store it hosts has not answered a call for {stuck:.2f} s")

    def _give_up_later(self, loss: "PeerLoss") -> None:
        """Exit this process with status 1 if it still runs ``give_up_s`` after the store's host
        was lost.

        Why: every survivor's failure path ends in store calls (failure marks, the group's
        shutdown, torch's own), and a call to a stopped host never returns; a survivor that does
        not exit leaves torchrun nothing to restart and the job hangs for good. The timer is a
        backstop: the failure path skips the store once the loss is known (:mod:`.faults`,
        :meth:`stop`), so a survivor normally exits well before it. Armed only for a worker
        whose rank hosts the store (``store_host``) and with ``give_up_s``: torchrun's agent then
        stops the rest of the attempt (SIGKILL ends a stopped process too) and restarts it."""
        if self.give_up_s is None or self._giving_up or loss.rank in self._departed:
            return
        self._giving_up = True
        who = self._describe_peer(loss.rank)
        give_up_s = self.give_up_s

        how = {"exited": "exited", "stopped": "is stopped (SIGSTOP or a debugger: state T)"}.get(
            loss.cause, "does not answer store calls")

        def give_up() -> None:  # pragma: no cover - ends the process
            time.sleep(give_up_s)
            if self.lost.get(loss.rank) is None or loss.rank in self._departed:  # answered again, or left cleanly
                self._giving_up = False
                return
            print(f"hetcomm heartbeat: rank {self.rank} gives up: {who}, which hosts the group's store, "
                  f"{how} ({loss.detail}); this process has not ended {give_up_s:.0f} s "
                  f"(the group timeout) later, its store calls cannot return: exiting with status 1 so that "
                  f"the job can restart", file=sys.stderr, flush=True)
            os._exit(1)

        threading.Thread(target=give_up, name=f"hetcomm-give-up-{self.rank}", daemon=True).start()

    def _declare(self, rank: int, cause: str, silent_s: float, detail: str) -> None:
        with self._lock:
            # Once only; but a judgement (silent) gives way to a certainty found later (a
            # reporter's beat saying "stopped"), which alone fails the collectives waiting on it.
            if rank in self.lost and (self.lost[rank].cause in DEFINITIVE or cause not in DEFINITIVE):
                return
            loss = PeerLoss(rank, cause, silent_s, time.time(), detail)
            self.lost[rank] = loss
            self.version += 1
        print(f"hetcomm heartbeat: rank {self.rank} lost peer rank {rank}: {detail}", file=sys.stderr, flush=True)
        if rank == self.store_host and rank != self.rank and (cause in DEFINITIVE or cause == "store"):
            self._give_up_later(loss)
        if cause in DEFINITIVE:
            _tell_listeners(loss)

    def _run(self) -> None:
        name_native_thread()  # /proc shows which thread spends a rank's CPU
        peers = [r for r in range(self.world_size) if r != self.rank]
        started = time.monotonic()
        last_value: Dict[int, bytes] = {}
        last_change: Dict[int, float] = {}
        gaps: Dict[int, Deque[float]] = {r: deque(maxlen=GAP_WINDOW) for r in peers}
        store_ok_at = started
        departed: set = self._departed
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            # /proc first, so that this beat already says what this rank sees stopped.
            self._look_at_local_peers(now, started, last_change, departed)
            try:
                self._store_call_at = time.monotonic()
                self._publish()
                seen = [r for r in peers if r in last_value and r not in departed]
                unseen = [r for r in peers if r not in last_value and self.store.check([self._key(r)])]
                values = self.store.multi_get([self._key(r) for r in seen + unseen]) if seen or unseen else []
                store_ok_at = now
                self._store_call_at = None
            except Exception as e:  # noqa: BLE001 - any store failure means the same: it is gone
                self._store_call_at = None
                if now - store_ok_at > self.miss_s and self.store_host is not None and self.store_host != self.rank:
                    self._declare(self.store_host, "store", now - store_ok_at,
                                  f"the store it hosts stopped answering {now - store_ok_at:.2f} s ago ({type(e).__name__})")
                values, seen, unseen = [], [], []
            reported: Dict[int, int] = {}  # stopped peer -> the reporter whose moving beat says so
            for r, v in zip(seen + unseen, values):
                if v == _BYE.encode():
                    departed.add(r)
                    continue
                counter, stopped = _decode_beat(v)
                if last_value.get(r) != counter:
                    moved = r in last_value  # a first sight is no proof that the beat is alive
                    if r in last_change:
                        gaps[r].append(now - last_change[r])
                    last_value[r] = counter
                    last_change[r] = now
                    if r in self.lost and self.lost[r].cause not in DEFINITIVE:
                        self._revoke(r)
                    if moved:
                        for x in stopped:
                            reported.setdefault(x, r)
            for x, by in sorted(reported.items()):
                if x != self.rank and x in gaps and not self._certain(x) and x not in departed:
                    self._declare(x, "stopped", now - last_change.get(x, started),
                                  f"rank {by} sees its process stopped (state T) through /proc")
            for r in peers:
                if r in self.lost or r in departed:
                    continue
                if r in last_change:  # (a stopped peer's store key stays as it was: judged by /proc above)
                    quiet = now - last_change[r]
                    if quiet > self.silence_threshold(gaps[r]) and not self._said_bye(r):
                        self._declare(r, "silent", quiet, f"no heartbeat for {quiet:.2f} s (hung, stopped or unreachable)")
                elif now - started > START_GRACE_S:
                    self._declare(r, "silent", now - started, f"never sent a heartbeat in {now - started:.0f} s")

    def _look_at_local_peers(self, now: float, started: float, last_change: Dict[int, float], departed: set) -> None:
        """Same-host peers through ``/proc``: declare the exited and the stopped ones, and keep
        :attr:`_stopped_here` (what this rank's beat says) to the state seen now."""
        stopped_now: Set[int] = set()
        for r, pid in self.local_pids.items():
            if r in departed:
                continue
            state = _proc_state(pid)
            if state in ("T", "t"):
                stopped_now.add(r)
            if self._certain(r):
                continue
            if state is None or state in ("Z", "X"):
                if self._said_bye(r):  # it shut down cleanly between the read and the look
                    departed.add(r)
                    continue
                self._declare(r, "exited", now - last_change.get(r, started), f"its process (pid {pid}) exited")
            elif state in ("T", "t"):
                self._declare(r, "stopped", now - last_change.get(r, started),
                              f"its process (pid {pid}) is stopped (state {state})")
        self._stopped_here = stopped_now

    def _certain(self, rank: int) -> bool:
        loss = self.lost.get(rank)
        return loss is not None and loss.cause in DEFINITIVE

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
        # check() first: get() of a key never set (a peer that died before its first beat)
        # would block this thread for the store's whole timeout.
        try:
            return self.store.check([self._key(r)]) and self.store.get(self._key(r)) == _BYE.encode()
        except Exception:  # noqa: BLE001
            return False


_active: Optional[Heartbeat] = None
#: Called with every certain loss (:data:`DEFINITIVE`) on the heartbeat's thread; held weakly.
_listeners: List["weakref.ReferenceType"] = []
_listeners_lock = threading.Lock()


def _ref(fn: Callable[[PeerLoss], None]) -> "weakref.ReferenceType":
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)


def add_listener(fn: Callable[[PeerLoss], None]) -> None:
    """Call ``fn(loss)`` on the heartbeat's thread for every peer found certainly lost (exited
    or stopped), the moment it is: for waits another thread is blocked in (a gloo transfer),
    which only the heartbeat can end. ``fn`` is held weakly (a bound method lives as long as its
    object) and must not block. Losses already declared are told at once."""
    with _listeners_lock:
        _listeners.append(_ref(fn))
    hb = _active
    if hb is not None:
        for loss in [x for x in list(hb.lost.values()) if x.cause in DEFINITIVE]:
            fn(loss)


def remove_listener(fn: Callable[[PeerLoss], None]) -> None:
    """Stop telling ``fn`` (idempotent)."""
    with _listeners_lock:
        _listeners[:] = [r for r in _listeners if r() is not None and r() != fn]


def _tell_listeners(loss: PeerLoss) -> None:
    with _listeners_lock:
        fns = [r() for r in _listeners]
        _listeners[:] = [r for r, f in zip(list(_listeners), fns) if f is not None]
    for fn in fns:
        if fn is None:
            continue
        try:
            fn(loss)
        except Exception as e:  # noqa: BLE001 - a listener's bug must not stop the heartbeat
            print(f"hetcomm heartbeat: a loss listener failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
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


def start_for(store, rank: int, world_size: int, placement, give_up_s: Optional[float] = None) -> Heartbeat:
    """:func:`start` for a default group with this :class:`~hetcomm.backends.rank_placement.Placement`:
    same-host peers are watched through ``/proc`` too; the store's host is named if it goes away
    when rank 0 hosts it (``hetcomm launch``'s workers: one store per attempt in rank 0), and then
    this process exits ``give_up_s`` (the group timeout) later if it has not ended by itself."""
    local = {r: placement.ranks[r].pid for r in range(world_size) if r != rank and placement.same_host(rank, r)}
    # TORCHELASTIC_USE_AGENT_STORE=False is how hetcomm.ops.worker hands the store to rank 0.
    host = 0 if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else None

    def describe(r: int) -> str:
        p = placement.ranks[r]
        return f"rank {r} (pid {p.pid}, host {p.host})"

    return start(store, rank, world_size, local_pids=local, store_host=host, give_up_s=give_up_s,
                 describe_peer=describe)


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
