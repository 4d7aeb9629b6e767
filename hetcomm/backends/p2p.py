"""Point-to-point ``send``/``recv`` with a size check.

gloo matches a send and a receive by peer and tag only, and when their sizes differ the
receiving process dies with SIGABRT inside gloo (an enforce on the message length). Here every
``send`` is preceded by a 4-word header on a tag of its own — ``[dtype code, elements, bytes,
sending rank]`` — and the receiver posts its data receive only once that header has arrived and
matches its buffer; on a mismatch it drains the message into a scratch buffer (so the pair stays
in step and the sender completes) and raises :class:`~hetcomm.errors.CrossRankMismatch` naming
both sides. The sender is not told (its bytes did leave); the receiver's error says what each
side passed.

The header of user tag ``t`` travels on tag ``t + 2**29`` (:data:`HEADER_TAG_BASE`): user tags
are ``< 2**29`` (checked), hetcomm's internal tags are ``[2**30, 2**31)`` and gloo refuses
negative ones.

**Receives are matched per lane.** gloo cannot withdraw a posted receive, so a receive whose
``wait(timeout)`` expired used to stay posted and steal the next message from that peer with
that tag (or a later receive got the message meant for the cancelled one). Here the receives
from one source (or from any source) with one tag form a *lane*: one helper thread per busy
lane receives the headers in order and hands each message to the oldest receive still waiting,
which then posts its data receive. A receive that times out before its header arrived is
*cancelled*: it leaves the lane, its buffer is never written, and the next message goes to the
next receive -- MPI's ``MPI_Cancel`` semantics (gloo itself has no cancel: its timed-out
receive keeps its place). A header that arrives when no receive waits is kept for the next one
(the sender's data send completes once that receive is posted). A receive whose header had
already arrived when its wait timed out is no longer cancellable: its data is on the wire, and
the wait completes it instead of raising. A ``wait()`` without a timeout is bounded by the
group timeout and names the silent peer and the tag; the lane's own gloo receive has no timeout
of its own, since an expired gloo receive would not be withdrawn either.

The lane thread keeps the receive asynchronous (``irecv``, ``batch_isend_irecv``): posting the
data receive late would be fine for gloo, but the sender's data send completes only once it is
posted, so a caller waiting on its own send before its receive (a ring) must not depend on this
rank calling ``wait()``.

Every send/recv Work has a future (gloo's have none: "Work::getFuture not implemented"); its
callbacks run on the p2p thread that completed it, inside the group's in-flight count, so a
callback may destroy the group (shutdown waits for the other threads' completions, not its own).
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hetcomm.backends import checks
from hetcomm.backends.faults import release_frames
from hetcomm.backends.rails.gloo import release_gloo
from hetcomm.backends.work import HetcommWork
from hetcomm.errors import CrossRankMismatch, PeerTimeout, UsageError

__all__ = ["PointToPoint", "checked_send", "check_peer", "header_tag", "HEADER_TAG_BASE"]

#: Size headers of user tag ``t`` travel on ``HEADER_TAG_BASE + t``; user tags stay below it.
HEADER_TAG_BASE = 1 << 29

_WORDS = 4


def header_tag(tag: int) -> int:
    """The tag of user tag ``tag``'s size header (see the module docstring)."""
    return HEADER_TAG_BASE + tag


def _header(t: torch.Tensor, rank: int) -> torch.Tensor:
    words = [checks.dtype_code(t.dtype), t.numel(), t.numel() * t.element_size(), rank]
    return torch.tensor(words, dtype=torch.int64, device="cpu")  # host: gloo sends the header


def check_peer(op: str, peer: int, rank: int, size: int, tag: int) -> None:
    """Refuse a peer that is not another rank of the group, before any byte moves.

    gloo indexes its pairs by the peer without a bounds check: ``send`` to rank 7 of a group of
    2 (or to -1) read past its pair table and killed the process with SIGSEGV/SIGABRT. A send
    to this rank itself has no pair either (torch refuses it in ``dist.send`` already; C++
    callers and ``batch_isend_irecv`` reach here directly).

    Raises:
        UsageError: naming the rank, the peer, the tag and the group size.
    """
    role = "destination" if op == "send" else "source"
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        raise UsageError(
            f"hetcomm {op} (rank {rank}, tag {tag}): {role} rank {peer!r} is not a rank of this group of {size}: "
            f"pass a group rank 0 <= {role} < {size} (dist.get_global_rank / get_group_rank convert global ranks); "
            f"nothing was sent or received"
        )
    if peer == rank:
        raise UsageError(
            f"hetcomm {op} (rank {rank}, tag {tag}): the {role} rank is this rank itself (group of {size}): "
            f"p2p needs another rank; copy the tensor locally instead"
        )


def _one(tensors: List[torch.Tensor], op: str, rank: int) -> torch.Tensor:
    if len(tensors) != 1:
        raise UsageError(f"hetcomm {op} (rank {rank}): takes one tensor, got {len(tensors)}")
    return tensors[0]


class _P2PWork(HetcommWork):
    """A send or receive; its future runs its callbacks on the p2p thread that completed it.

    The completion runs inside the group's :class:`~hetcomm.backends.delegated._InFlight`, as the
    delegated collectives' do: a callback may destroy the group (``work.get_future().then(lambda
    f: dist.destroy_process_group())``), and the group face's ``shutdown`` then waits for the
    completions running on other threads but not for this one.
    """

    def __init__(self, result: List[torch.Tensor], in_flight):
        super().__init__(result)
        self._in_flight = in_flight

    def _finish(self, exc: Optional[BaseException]) -> None:
        with self._in_flight.running():
            self._complete(release_frames(exc) if exc is not None else None)


class _SendWork(_P2PWork):
    """The header send and the data send of one ``send``; holds the contiguous copy of a
    strided tensor until gloo is done with it.

    gloo's send Works complete only inside their own ``wait()``, so someone must wait: the
    caller's ``wait()``, or, once a future was asked for, a helper thread (one per send whose
    future is used; its callbacks run there).
    """

    def __init__(self, works: List["dist.Work"], data: torch.Tensor, tensor: torch.Tensor, in_flight):
        super().__init__([tensor], in_flight)
        self._works = works
        self._data = data
        self._drive_lock = threading.Lock()  # one thread waits on gloo's Works (two would each wait for a completion)

    def _drive(self) -> None:
        with self._drive_lock:
            if self._done.is_set():
                return
            exc: Optional[BaseException] = None
            try:
                for w in self._works:
                    w.wait()
            except BaseException as e:
                exc = e
            self._works = []
            self._finish(exc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._drive()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        return self._done.is_set() or all(w.is_completed() for w in self._works)

    def get_future(self) -> "torch.futures.Future":
        fut = super().get_future()
        if not self._done.is_set():
            threading.Thread(target=self._drive, name="hetcomm-send", daemon=True).start()
        return fut


def checked_send(gloo, tensors: List[torch.Tensor], dst: int, tag: int, rank: int, size: int, in_flight) -> dist.Work:
    """``gloo.send`` of ``tensors`` (one tensor) to ``dst``, after its size header.

    Raises:
        UsageError: ``dst`` is not another rank of the group of ``size`` (before any byte moves).
    """
    check_peer("send", dst, rank, size, tag)
    t = _one(tensors, "send", rank)
    # gloo refuses a strided view ("input tensor has to be contiguous") -- after the header had
    # gone, which left the receiver waiting for data that never came. Send a contiguous copy
    # (the view's elements in order, as gloo's collectives see them after staging).
    data = t if t.is_contiguous() else t.contiguous()
    header = _header(data, rank)
    h = gloo.send([header], dst, header_tag(tag))
    d = gloo.send([data], dst, tag)
    return _SendWork([h, d], data, t, in_flight)


#: How long a lane's gloo receive may wait: for ever, in practice. The caller's wait enforces the
#: group timeout and cancels; a gloo receive that expired would stay posted all the same.
_LANE_WAIT = timedelta(days=365)


class _RecvWork(_P2PWork):
    """One receive into ``tensor`` (any shape, dtype and layout of strides): queued on its lane,
    completed by the lane's thread once a header reached it (:class:`_Lane`)."""

    def __init__(self, tensor: torch.Tensor, src: Optional[int], tag: int, rank: int, size: int,
                 group_timeout: timedelta, in_flight):
        super().__init__([tensor], in_flight)
        self._tensor = tensor
        self._src = src
        self._source = src if src is not None else -1
        self._tag = tag
        self._rank = rank
        self._size = size
        self._group_timeout = group_timeout
        self._lane: Optional["_Lane"] = None

    def _deliver(self, gloo, header: torch.Tensor) -> None:
        """Receive the message whose ``header`` ([dtype code, elements, bytes, sender], int64)
        reached this receive: into the tensor when it fits, else drained (the pair stays in
        step) and raised. Runs on the lane's thread; never raises."""
        exc: Optional[BaseException] = None
        tensor, tag, rank = self._tensor, self._tag, self._rank
        try:
            code, numel, nbytes, src = (int(x) for x in header)
            self._source = src
            mine = (checks.dtype_code(tensor.dtype), tensor.numel(), tensor.numel() * tensor.element_size())
            if (code, numel, nbytes) == mine:
                # gloo refuses a strided destination; receive into a contiguous buffer and copy
                # into the view, so only the view's elements change
                buf = tensor
                if not tensor.is_contiguous():
                    buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                gloo.recv([buf], src, tag).wait(self._group_timeout)  # sent right after its header
                if buf is not tensor:
                    tensor.copy_(buf)
            else:
                scratch = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
                gloo.recv([scratch], src, tag).wait(self._group_timeout)  # drain: the pair stays in step
                theirs = checks.dtype_from_code(code)
                field = "count" if nbytes != mine[2] else "dtype"
                raise CrossRankMismatch(
                    f"hetcomm recv (rank {rank}): rank {src} sent {numel} elements of {theirs} ({nbytes} bytes) "
                    f"with tag {tag}, but this rank's buffer holds {tensor.numel()} elements of {tensor.dtype} "
                    f"({mine[2]} bytes); pass a receive buffer of the sender's size and dtype (the message was "
                    f"discarded; the group stays usable)",
                    op="recv", rank=rank, ranks=[src], field=field,
                )
        except BaseException as e:
            exc = e
        self._finish(exc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for the message (``timeout``, else the group timeout); on expiry cancel this
        receive and raise :class:`~hetcomm.errors.PeerTimeout` naming the peer and the tag --
        unless its message had started to arrive, which is then waited for."""
        seconds = timeout.total_seconds() if timeout else 0.0
        limit = seconds if seconds > 0 else self._group_timeout.total_seconds()
        if not self._done.wait(limit):
            lane = self._lane
            if lane is not None and lane.cancel(self):
                peer = f"rank {self._src}" if self._src is not None else "any rank"
                raise PeerTimeout(
                    f"no message from {peer} with tag {self._tag} within {limit:.1f} s "
                    f"({'the wait timeout' if seconds > 0 else 'the group timeout'}; group of {self._size}). "
                    f"This receive is cancelled: its buffer is not written, and the next message from {peer} "
                    f"with tag {self._tag} goes to the next receive. Check that {peer} sends with this tag",
                    op="recv", rank=self._rank, peer=self._src,
                )
            # Matched before the deadline: the data follows its header at once (bounded by the
            # lane's data receive, which has the group timeout).
            self._done.wait()
        return super().wait()

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _Lane:
    """The receives from one source (``None``: any source) with one user tag, in post order.

    One thread per busy lane receives the headers in order and hands each to the oldest receive
    still queued (see the module docstring); it ends when the queue is empty.
    """

    def __init__(self, gloo, src: Optional[int], tag: int):
        self._gloo = gloo
        self._src = src
        self._tag = tag
        self._cond = threading.Condition()
        self._queue: Deque[_RecvWork] = deque()
        #: A header that arrived when every receive of the lane had been cancelled ([4] int64):
        #: its message belongs to the next receive posted.
        self._stash: Optional[torch.Tensor] = None
        self._running = False
        self._thread: Optional[threading.Thread] = None
        self._in_header = False  # inside the gloo header receive (the one wait with no end)
        #: Set by :meth:`PointToPoint.close`: the group is going away; the error queued receives get.
        self._closed: Optional[str] = None

    def post(self, work: _RecvWork) -> None:
        with self._cond:
            work._lane = self
            self._queue.append(work)
            if self._closed is not None:
                raise UsageError(self._closed)
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._loop, name="hetcomm-recv", daemon=True)
                self._thread.start()

    def cancel(self, work: _RecvWork) -> bool:
        """Take ``work`` off the lane; False when its header has already reached it."""
        with self._cond:
            try:
                self._queue.remove(work)
            except ValueError:
                return False
            return True

    def _recv_header(self) -> torch.Tensor:
        header = torch.zeros(_WORDS, dtype=torch.int64, device="cpu")  # host: gloo header
        if self._src is None:
            self._gloo.recv_anysource([header], header_tag(self._tag)).wait(_LANE_WAIT)
        else:
            self._gloo.recv([header], self._src, header_tag(self._tag)).wait(_LANE_WAIT)
        return header

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._running = False
                    return
                header, self._stash = self._stash, None
                self._in_header = header is None
            if header is None:
                try:
                    header = self._recv_header()
                except BaseException as e:  # the peer closed the connection, gloo failed, the group closed
                    if self._closed is not None:
                        e = UsageError(self._closed)
                    with self._cond:
                        self._in_header = False
                        failed = list(self._queue)
                        self._queue.clear()
                        self._running = False
                    for w in failed:
                        w._finish(e)
                    return
            with self._cond:
                self._in_header = False
                if not self._queue:  # every receive waiting here was cancelled meanwhile
                    self._stash = header
                    self._running = False
                    return
                work = self._queue.popleft()  # from here on it cannot be cancelled
            work._deliver(self._gloo, header)

    def blocked(self) -> bool:
        """Whether the lane's thread waits in its gloo header receive (a thread delivering a
        message, e.g. running a callback that destroys the group, does not)."""
        with self._cond:
            return self._in_header

    def join(self, timeout_s: float) -> bool:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            return not thread.is_alive()
        return True


class PointToPoint:
    """The send/recv of one group on this rank, over its inner gloo group.

    Args:
        gloo: the inner ``ProcessGroupGloo``.
        rank / size: this process in the group.
        timeout: the group timeout (a receive's ``wait()`` without a timeout is bounded by it).
        in_flight: the group's completions in flight (``delegated._InFlight``).
    """

    def __init__(self, gloo, rank: int, size: int, timeout: timedelta, in_flight):
        self._gloo = gloo
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._in_flight = in_flight
        self._lock = threading.Lock()
        self._lanes: Dict[Tuple[Optional[int], int], _Lane] = {}

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> dist.Work:
        """Send ``tensors`` (one tensor, any dtype gloo moves, any strides) to ``dst``."""
        return checked_send(self._gloo, tensors, dst, tag, self._rank, self._size, self._in_flight)

    def recv(self, tensors: List[torch.Tensor], src: Optional[int], tag: int) -> dist.Work:
        """Receive into ``tensors`` (one tensor) from ``src`` (None: any source) after a size check.

        Raises:
            UsageError: ``src`` is not another rank of the group (before any byte moves).
        """
        if src is not None:
            check_peer("recv", src, self._rank, self._size, tag)
        tensor = _one(tensors, "recv", self._rank)
        work = _RecvWork(tensor, src, tag, self._rank, self._size, self._timeout, self._in_flight)
        with self._lock:
            lane = self._lanes.get((src, tag))
            if lane is None:
                lane = self._lanes[(src, tag)] = _Lane(self._gloo, src, tag)
        lane.post(work)
        return work

    def close(self) -> None:
        """End the lanes' threads before the group goes away (the group face's ``shutdown``).

        A lane still waiting for a header (a receive never matched, or cancelled and never
        followed by a message) would otherwise block in gloo until the process exits, and a gloo
        wait that returns while the interpreter finalises aborts the process (``std::terminate``,
        exit -6: ``tests/backends/exit_driver.py``). Failing the inner gloo context ends that
        wait; the group is being destroyed, so nothing uses gloo afterwards. Receives still
        queued fail with a :class:`~hetcomm.errors.UsageError` saying the group was destroyed.
        """
        with self._lock:
            lanes = list(self._lanes.values())
        message = (
            f"hetcomm recv (rank {self._rank}, group of {self._size}): the group was destroyed while this "
            f"receive waited; destroy the group only after its receives completed"
        )
        for lane in lanes:
            with lane._cond:
                lane._closed = message
        waiting = [lane for lane in lanes if lane.blocked()]
        if not waiting:
            return
        release_gloo(self._gloo, next(p for p in range(self._size) if p != self._rank))
        for lane in waiting:
            lane.join(self._timeout.total_seconds())
