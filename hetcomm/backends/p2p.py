"""Point-to-point ``send``/``recv`` with a size check (issue 21.21).

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
negative ones. A
receive waits for its header on a short-lived thread so that the returned Work is asynchronous
(``irecv``, ``batch_isend_irecv``): posting the data receive late would be fine for gloo, but
the sender's data send completes only once it is posted, so a caller waiting on its own send
before its receive (a ring) must not depend on this rank calling ``wait()``.

Every send/recv Work has a future (gloo's have none: "Work::getFuture not implemented"); its
callbacks run on the p2p thread that completed it, inside the group's in-flight count, so a
callback may destroy the group (shutdown waits for the other threads' completions, not its own).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from hetcomm.backends import checks
from hetcomm.backends.faults import release_frames
from hetcomm.backends.work import HetcommWork
from hetcomm.errors import CrossRankMismatch, PeerTimeout, UsageError

__all__ = ["checked_send", "checked_recv", "check_peer", "header_tag", "HEADER_TAG_BASE"]

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
    f: dist.destroy_process_group())``), and ``HetcommProcessGroup.shutdown`` then waits for the
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


class _RecvWork(_P2PWork):
    """A receive whose data part is posted once the header matched (on a helper thread)."""

    def __init__(self, gloo, tensor: torch.Tensor, src: Optional[int], tag: int, rank: int, in_flight):
        super().__init__([tensor], in_flight)
        self._source = src if src is not None else -1
        self._thread = threading.Thread(
            target=self._run, args=(gloo, tensor, src, tag, rank), name="hetcomm-recv", daemon=True
        )
        self._thread.start()

    def _run(self, gloo, tensor: torch.Tensor, src: Optional[int], tag: int, rank: int) -> None:
        exc: Optional[BaseException] = None
        try:
            header = torch.zeros(_WORDS, dtype=torch.int64, device="cpu")  # host: gloo header
            if src is None:
                hw = gloo.recv_anysource([header], header_tag(tag))
                hw.wait()
                src = int(header[3])
                self._source = src
            else:
                gloo.recv([header], src, header_tag(tag)).wait()
            code, numel, nbytes, _ = (int(x) for x in header)
            mine = (checks.dtype_code(tensor.dtype), tensor.numel(), tensor.numel() * tensor.element_size())
            if (code, numel, nbytes) == mine:
                # gloo refuses a strided destination; receive into a contiguous buffer and copy
                # into the view, so only the view's elements change
                buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
                gloo.recv([buf], src, tag).wait()
                if buf is not tensor:
                    tensor.copy_(buf)
            else:
                scratch = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device)
                gloo.recv([scratch], src, tag).wait()  # drain: the pair stays in step
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
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            raise PeerTimeout(f"recv timed out after {seconds:.1f} s", op="recv")
        return super().wait()

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


def checked_recv(gloo, tensors: List[torch.Tensor], src: Optional[int], tag: int, rank: int, size: int, in_flight) -> dist.Work:
    """Receive into ``tensors`` (one tensor) from ``src`` (None: any source) after a size check.

    Raises:
        UsageError: ``src`` is not another rank of the group of ``size`` (before any byte moves).
    """
    if src is not None:
        check_peer("recv", src, rank, size, tag)
    return _RecvWork(gloo, _one(tensors, "recv", rank), src, tag, rank, in_flight)
