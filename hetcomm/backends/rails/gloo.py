"""The ``gloo`` rail: point-to-point sends and receives over an inner ProcessGroupGloo (TCP).

Universal fallback and the rail for peers on other hosts. Each transfer is one gloo ``send`` or
``recv`` of the tensor's bytes, posted at once (gloo's own threads move them). In torch 2.13 a
gloo p2p Work reports ``is_completed() == False`` until someone calls ``wait()`` on it (and has
no future), so the rail keeps one waiter thread per peer that waits on that peer's Works in
posting order and flags each as done or failed; ``poll`` reads the flags. gloo enforces the
group timeout on each wait itself.

A peer stopped (SIGSTOP, a debugger) keeps its sockets open, so a wait on it inside gloo would
last the whole group timeout, and only another thread can end it: the rail listens to the
heartbeat (:func:`hetcomm.backends.heartbeat.add_listener`), and when a peer with a transfer in
flight is certainly lost it abandons that step (:meth:`_GlooOp.abandon`) and *releases* the
waits: a 1-byte receive from that peer waited on for 1 ms. gloo's TCP transport answers a
receive that times out by failing its whole context (every pair, every pending operation: its
``UnboundBuffer::waitRecv`` signals the exception to the context), so every wait of this gloo
group returns at once with an error, and the step raises the heartbeat's error naming the peer,
the rail and the collective instead. The group is unusable afterwards, which costs nothing: the
process is failing (a lost peer ends the job's attempt) and destroys the group next. torch has
no other way to end a gloo wait from Python (``Work`` has no ``abort``).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch

from hetcomm.backends.rails.base import Rail, RailOp, Xfer, as_bytes
from hetcomm.backends.stats import record as _record
from hetcomm.backends import heartbeat
from hetcomm.errors import CollectiveError, PeerTimeout
from hetcomm.backends.thread_name import name_native_thread

if TYPE_CHECKING:
    from hetcomm.backends.heartbeat import PeerLoss

__all__ = ["GlooRail", "RELEASE_TAG", "release_gloo"]

#: The tag of the 1-byte receive that releases a gloo group's waits (never a transfer's tag:
#: the executor's start at 2**30, users' are below; this one is the top of the positive range).
RELEASE_TAG = (1 << 31) - 1


_claim_lock = threading.Lock()


def release_gloo(gloo: "torch.distributed.ProcessGroup", peer: int) -> None:
    """End every wait of the gloo group ``gloo`` now: a 1-byte receive from ``peer`` waited on
    for 1 ms, whose timeout fails gloo's whole context (module docstring). The group is
    unusable afterwards: only for a peer certainly lost, in a process that is failing."""
    try:
        byte = torch.empty(1, dtype=torch.uint8)  # host: gloo receives into host memory; never read
        gloo.recv([byte], peer, RELEASE_TAG).wait(timedelta(milliseconds=1))
    except Exception:  # noqa: BLE001 - the timeout is the point; a broken pair is as good
        pass


class _Pending:
    """One gloo Work. gloo's p2p completions are counted, so exactly one thread may wait on a
    Work: whoever :meth:`claim` s it first (the executor or the peer's waiter thread)."""

    __slots__ = ("peer", "is_send", "xfer", "work", "done", "error", "claimed", "finished", "posted", "failed_after")

    def __init__(self, peer: int, is_send: bool, xfer: Xfer, work):
        self.peer = peer
        self.is_send = is_send
        self.xfer = xfer
        self.work = work
        self.done = False
        self.error: Optional[BaseException] = None
        self.claimed = False
        self.finished = threading.Event()
        self.posted = time.monotonic()
        self.failed_after = 0.0  # seconds from posting to the failure

    def claim(self) -> bool:
        with _claim_lock:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def wait_claimed(self) -> None:
        """Wait for the Work, which this thread has claimed; record its outcome."""
        try:
            self.work.wait()  # releases the GIL while gloo moves the bytes
        except BaseException as e:  # reported by poll() on the executor thread
            self.error = e
            self.failed_after = time.monotonic() - self.posted
        self.done = True
        self.finished.set()

    def wait_once(self) -> None:
        """Wait for the Work (if claimed here) or for whoever claimed it."""
        if self.claim():
            self.wait_claimed()
        else:
            self.finished.wait()


class _GlooOp(RailOp):
    can_block = True

    def __init__(self, rank: int, items: List[_Pending], op: str, name: str, timeout_s: float,
                 seq: int = 0, release: Optional[Callable[[int], None]] = None):
        self.rank = rank
        self.items = items
        self.op = op
        self.seq = seq
        self.rail = name
        self.timeout_s = timeout_s
        self._release = release
        self.t0 = time.perf_counter()
        self.progressed = False
        self.arrived_xfers: List[Xfer] = []
        self.control_only = all(it.xfer.control for it in items)

    def block(self) -> None:
        """Wait for every transfer in this thread (gloo releases the GIL), in posting order.

        Used by the executor when nothing else needs polling: it saves the hand-off through the
        waiter threads. gloo bounds each wait by the group timeout.
        """
        for it in self.items:
            if self.abandoned is not None:
                return
            if not it.done:
                it.wait_once()

    def abandon(self, error: CollectiveError) -> None:
        """End the step with ``error`` and release the gloo waits (module docstring)."""
        if self.abandoned is not None:
            return
        self.abandoned = error
        if self._release is not None and error.peer is not None:
            self._release(error.peer)

    def waits_on(self, peer: int) -> bool:
        """Whether a transfer with ``peer`` is still in flight (read on the heartbeat's thread)."""
        return any(it.peer == peer and not it.done for it in list(self.items))

    def poll(self) -> bool:
        if self.abandoned is not None:
            raise self.abandoned
        still = []
        for it in self.items:
            if not it.done:
                still.append(it)
                continue
            if it.error is not None:
                # gloo reports a timeout as a plain RuntimeError: tell it from a broken
                # connection by when it failed (gloo fails a wait only at its timeout).
                if it.failed_after >= 0.95 * self.timeout_s:
                    raise PeerTimeout(
                        f"{'send to' if it.is_send else 'receive from'} peer timed out: {it.error}",
                        op=self.op, rank=self.rank, peer=it.peer, rail=self.rail,
                    ) from it.error
                raise CollectiveError(
                    f"{'send to' if it.is_send else 'receive from'} peer failed: {it.error}",
                    op=self.op,
                    rank=self.rank,
                    peer=it.peer,
                    rail=self.rail,
                ) from it.error
            nbytes = it.xfer.tensor.nbytes
            if it.xfer.control:
                pass
            elif it.is_send:
                _record(self.rail, bytes_sent=nbytes, chunks_sent=1)
            else:
                _record(self.rail, bytes_received=nbytes, chunks_received=1)
                self.arrived_xfers.append(it.xfer)
        self.progressed = len(still) < len(self.items)
        self.items = still
        if not still:
            if not self.control_only:
                _record(self.rail, seconds_busy=time.perf_counter() - self.t0, ops=1)
            return True
        return False

    def pending_peers(self) -> List[int]:
        return sorted({it.peer for it in self.items})


class GlooRail(Rail):
    """Sends and receives over ``gloo`` (an inner ``ProcessGroupGloo`` over the whole group).

    Args:
        gloo: the inner group.
        rank: this rank in it.
        wakeup: set when a transfer completes (the executor may sleep on it).
        name: the rail's name in errors and ``hetcomm.stats()`` (``gloo``; ``gloo-nic<k>`` for
            the group bound to port ``k``).
        global_ranks: the default-group rank of each rank of ``gloo`` (the heartbeat's ranks);
            None: the same numbers.
    """

    name = "gloo"

    def __init__(
        self,
        gloo: "torch.distributed.ProcessGroup",
        rank: int,
        wakeup: Optional[threading.Event] = None,
        name: str = "gloo",
        timeout: Optional[timedelta] = None,
        global_ranks: Optional[Sequence[int]] = None,
    ):
        self.gloo = gloo
        self.name = name
        self.rank = rank
        self.wakeup = wakeup if wakeup is not None else threading.Event()
        #: gloo's own timeout of every wait (the group's inner timeout).
        self.timeout_s = (timeout if timeout is not None else gloo.options._timeout).total_seconds()
        self._waiters: Dict[int, "queue.Queue"] = {}
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()
        self._group_rank = {g: r for r, g in enumerate(global_ranks)} if global_ranks is not None else None
        #: Steps in flight (for the heartbeat's listener); an op leaves when it is dropped.
        self._ops: "weakref.WeakSet[_GlooOp]" = weakref.WeakSet()
        self._released = False
        heartbeat.add_listener(self._on_loss)

    def _waiter(self, peer: int) -> "queue.Queue":
        q = self._waiters.get(peer)
        if q is None:
            with self._lock:
                q = self._waiters.get(peer)
                if q is None:
                    q = queue.Queue()
                    t = threading.Thread(target=self._wait_loop, args=(q, self.wakeup), name=f"hetcomm-gloo-wait-{peer}", daemon=True)
                    t.start()
                    self._threads.append(t)
                    self._waiters[peer] = q
        return q

    @staticmethod
    def _wait_loop(q: "queue.Queue", wakeup: threading.Event) -> None:
        name_native_thread()  # /proc shows which thread spends a rank's CPU
        while True:
            it = q.get()
            if it is None:
                return
            if it.claim():
                it.wait_claimed()
                wakeup.set()

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        items = []

        def post(x: Xfer, is_send: bool) -> None:
            try:
                fn = self.gloo.send if is_send else self.gloo.recv
                items.append(_Pending(x.peer, is_send, x, fn([as_bytes(x.tensor)], x.peer, x.tag)))
            except RuntimeError as e:
                # gloo refuses to post at once when the pair's connection is already broken
                # (the peer died during an earlier step): same error as a failed transfer.
                raise CollectiveError(
                    f"{'send to' if is_send else 'receive from'} peer failed: {e}",
                    op=op, rank=self.rank, peer=x.peer, rail=self.name,
                ) from e

        # Receives first: a posted receive lets gloo land the bytes straight in the tensor.
        for x in recvs:
            post(x, False)
        for x in sends:
            post(x, True)
        for it in items:
            self._waiter(it.peer).put(it)
        out = _GlooOp(self.rank, items, op, self.name, self.timeout_s, seq, self._release)
        with self._lock:
            self._ops.add(out)
        return out

    def _on_loss(self, loss: "PeerLoss") -> None:
        """The heartbeat's listener: abandon the steps waiting on a peer certainly lost (exited
        or stopped), with the error every survivor raises for it (:func:`~hetcomm.backends.faults.loss_error`)."""
        from hetcomm.backends.faults import loss_error

        peer = loss.rank if self._group_rank is None else self._group_rank.get(loss.rank)
        if peer is None or peer == self.rank:
            return
        with self._lock:
            ops = [o for o in list(self._ops) if o.abandoned is None and o.waits_on(peer)]
        for o in ops:
            o.abandon(loss_error(loss, peer=peer, seq=o.seq, op=o.op, rank=self.rank, rail=self.name))

    def _release(self, peer: int) -> None:
        """End every wait of this gloo group now (once): a 1-byte receive from ``peer`` waited
        on for 1 ms fails the gloo context (module docstring)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        release_gloo(self.gloo, peer)
        self.wakeup.set()

    def close(self) -> None:
        """Stop the waiter threads and join them (each ends within gloo's timeout: a thread
        still waiting on a Work returns when gloo fails that wait)."""
        heartbeat.remove_listener(self._on_loss)
        with self._lock:
            queues, threads = list(self._waiters.values()), self._threads
            self._waiters, self._threads = {}, []
        for q in queues:
            q.put(None)
        # A peer the heartbeat saw stop or exit may hold a waiter in gloo until gloo's timeout
        # (a wait not released above): a failing process would sit here that long before it
        # exits and torchrun can restart the job. Then the (daemon) threads get a second each.
        lost = heartbeat.lost_definitively()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=1.0 if lost else self.timeout_s + 5.0)
