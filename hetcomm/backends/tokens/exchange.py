"""Row exchanges of the token engine: one ``all_to_all_single`` of rows over raw bytes, each
peer's segment in that pair's wire dtype, and the process's row counters.

Part of :mod:`hetcomm.backends.tokens` (its docstring has the notation and the layout of one
dispatch). The segments' dtypes and sizes are :mod:`hetcomm.backends.tokens.wire`'s; the cast
into the packed buffer is the copy the exchange pays anyway.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from hetcomm.backends import rowpool
from hetcomm.backends.checks import splits_agreed
from hetcomm.backends.tokens.wire import ALIGN, WireComm, exact_wires, segment_bytes
from hetcomm.errors import CollectiveError, HetcommError

__all__ = [
    "DispatchComm", "RowExchange", "exchange_ints", "count_rows", "count_meta", "count_meta_bytes",
    "count_plan", "counters", "reset_counters",
]


_counters = {"calls": 0, "bytes_sent": 0, "bytes_recv": 0, "meta_bytes_sent": 0}


def counters() -> dict:
    """This process's dispatch/combine counters: row bytes to/from other ranks (wire dtypes
    applied, forward and backward) and metadata bytes (counts, expert slots, weights)."""
    return dict(_counters)


def reset_counters() -> None:
    """Zero :func:`counters`."""
    for key in _counters:
        _counters[key] = 0


class DispatchComm(WireComm, Protocol):
    """What the token engine uses of a communicator (``hetcomm.Communicator`` provides it).

    Attributes:
        group: the torch ProcessGroup (gloo, hetcomm, ...); None with ``world_size == 1``.
        rank: this process's rank in ``group``.
        world_size: ``W``.
        wire_dtype: ``(peer, dtype, policy=None)`` -> the wire rule's answer for that link
            (:func:`hetcomm.backends.tokens.wire.link_wire_dtype`); both ends of a pair must
            get the same answer (the dispatch checks it).
    """

    group: Optional[dist.ProcessGroup]


class RowExchange:
    """One ``all_to_all_single`` of rows with uneven splits, each peer's segment in its wire dtype.

    Everything travels as ``torch.uint8`` so that every rank makes the same call whatever its
    own peers' dtypes are. When every peer of this rank uses the row dtype and a row is a
    multiple of 8 bytes, the rows are gathered straight into the send buffer and received
    straight into the destination: no copy besides the gather.
    """

    def __init__(self, comm: DispatchComm, send_splits, recv_splits, wire, dtype: torch.dtype, width: int, tag: str):
        self.comm, self.tag = comm, tag
        self.send_splits, self.recv_splits = list(send_splits), list(recv_splits)
        self.dtype, self.width = dtype, width
        self.wire = list(wire)
        row = width * dtype.itemsize
        self.direct = row % ALIGN == 0 and all(w == dtype for p, w in enumerate(self.wire) if p != comm.rank)
        self.send_bytes = [segment_bytes(n, width, self.wire[p]) for p, n in enumerate(self.send_splits)]
        self.recv_bytes = [segment_bytes(n, width, self.wire[p]) for p, n in enumerate(self.recv_splits)]
        self.work = None
        self.finish = None
        self.keep = None

    @property
    def bytes_sent(self) -> int:
        return sum(self.send_bytes)

    @property
    def bytes_recv(self) -> int:
        return sum(self.recv_bytes)

    def start(self, src: torch.Tensor, index: Optional[torch.Tensor], out: torch.Tensor) -> None:
        """Send ``src[index]`` (or ``src``), grouped by destination; fill ``out`` on :meth:`wait`.

        Args:
            src: ``[N, width]`` of ``self.dtype``.
            index: ``[S]`` int64 rows of ``src`` to send, destination-major, or None (send
                ``src`` itself, ``S == N``).
            out: ``[sum(recv_splits), width]`` contiguous, ``self.dtype``; valid after wait.
        """
        dev = src.device
        S = sum(self.send_splits)
        if self.direct:
            if index is None:
                send = src.contiguous()
            else:
                send = rowpool.empty((S, self.width), self.dtype, dev)
                torch.index_select(src, 0, index, out=send)
            sbuf = send.view(-1).view(torch.uint8) if send.numel() else torch.empty(0, dtype=torch.uint8, device=dev)
            rbuf = out.view(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8, device=dev)
            self.finish = None
        else:
            sbuf = rowpool.empty((self.bytes_sent,), torch.uint8, dev)
            rbuf = rowpool.empty((self.bytes_recv,), torch.uint8, dev)
            off = row = 0
            for p, n in enumerate(self.send_splits):
                if n:
                    seg = sbuf[off : off + n * self.width * self.wire[p].itemsize].view(self.wire[p]).view(n, self.width)
                    if index is None:
                        seg.copy_(src[row : row + n])
                    elif self.wire[p] == self.dtype:
                        torch.index_select(src, 0, index[row : row + n], out=seg)
                    else:
                        seg.copy_(src.index_select(0, index[row : row + n]))  # the cast is the copy
                off += self.send_bytes[p]
                row += n

            def finish() -> None:
                off = row = 0
                for p, n in enumerate(self.recv_splits):
                    if n:
                        seg = rbuf[off : off + n * self.width * self.wire[p].itemsize].view(self.wire[p])
                        out[row : row + n].copy_(seg.view(n, self.width))
                    off += self.recv_bytes[p]
                    row += n

            self.finish = finish
        self.keep = (sbuf, rbuf)
        with splits_agreed():  # every split here follows from the (checked) count exchange
            self.work = dist.all_to_all_single(
                rbuf, sbuf, self.recv_bytes, self.send_bytes, group=self.comm.group, async_op=True
            )
        _counters["calls"] += 1

    def wait(self) -> None:
        """Block until the rows are in ``out`` (idempotent)."""
        if self.work is None:
            return
        try:
            self.work.wait()
        except HetcommError:
            raise
        except RuntimeError as e:
            raise CollectiveError(
                f"token {self.tag} exchange failed (sending {self.send_splits} rows, expecting "
                f"{self.recv_splits}): {e}; check that every rank runs the same dispatch/combine "
                f"calls in the same order and that no rank died",
                op="all_to_all_single",
                rank=self.comm.rank,
            ) from e
        self.work = None
        if self.finish is not None:
            with torch.no_grad():
                self.finish()
        self.finish = self.keep = None


def _remote_bytes(ex: RowExchange, rank: int) -> Tuple[int, int]:
    return (
        sum(b for p, b in enumerate(ex.send_bytes) if p != rank),
        sum(b for p, b in enumerate(ex.recv_bytes) if p != rank),
    )


def count_rows(ex: Optional[RowExchange], rank: int) -> Tuple[int, int]:
    """Add a row exchange's bytes to and from other ranks to :func:`counters`; returns them."""
    if ex is None:
        return 0, 0
    sent, recv = _remote_bytes(ex, rank)
    _counters["bytes_sent"] += sent
    _counters["bytes_recv"] += recv
    return sent, recv


def count_meta(ex: RowExchange, rank: int) -> None:
    """Add an exchange of exact metadata (weight gradients) to :func:`counters`."""
    _counters["meta_bytes_sent"] += _remote_bytes(ex, rank)[0]


def count_meta_bytes(nbytes: int) -> None:
    """Add bytes of a count exchange sent to other ranks to :func:`counters`."""
    _counters["meta_bytes_sent"] += nbytes


def count_plan(meta_bytes: int) -> None:
    """Add one planned dispatch and its metadata bytes to :func:`counters`."""
    _counters["meta_bytes_sent"] += meta_bytes
    _counters["calls"] += 1


def exchange_ints(comm: DispatchComm, send: torch.Tensor, send_splits, recv_splits, width: int, tag: str) -> torch.Tensor:
    """Synchronous all-to-all of integer rows ``[S, width]`` (metadata); returns ``[sum(recv_splits), width]``."""
    out = torch.empty((sum(recv_splits), width), dtype=send.dtype, device=send.device)
    ex = RowExchange(comm, send_splits, recv_splits, exact_wires(comm, send.dtype), send.dtype, width, tag)
    ex.start(send.reshape(-1, width), None, out)
    ex.wait()
    return out


