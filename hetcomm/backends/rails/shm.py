"""The ``shm`` rail: same-host peers through POSIX shared memory, no sockets on the data path.

Layout: one segment per node of the group (``/dev/shm/hetcomm-<token>``), created by the node's
lowest rank. It holds one single-producer/single-consumer ring per ordered pair of the node's
ranks::

    ring k = [ control: 128 bytes | data: ring_bytes ]
    control: int64 head at byte 0 (bytes written so far, stored only by the writer),
             int64 tail at byte 64 (bytes read so far, stored only by the reader)

A writer copies into ``data[head % cap ...]`` and then stores the new ``head``; a reader copies
out and then stores the new ``tail``. The counters are aligned 8-byte stores on their own cache
lines; on x86-64 (total store order) the data stores are visible before the counter store that
publishes them. Weaker memory models (aarch64) would need fences that Python cannot issue, so
:func:`shm_supported` refuses them and the selector falls back to gloo there.

Each message is a 16-byte header ``(tag, num_bytes)`` followed by the payload, so a reader
detects a peer that posted something else (a collective-order bug) instead of reading garbage.

Cleanup (:func:`map_segment`): the store is used only during setup (segment name, then
"attached" keys). As soon as every rank of the node has mapped the segment, the creator unlinks
its name: from then on the kernel frees the memory when the last process unmaps it, so a crash or
``kill -9`` at any later time leaks nothing. A failure during setup unlinks it too.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import stat
import time
import uuid
from collections import deque
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from hetcomm.backends.liveness import pid_alive
from hetcomm.backends.rails.base import Rail, RailOp, Xfer, as_bytes
from hetcomm.backends.rails.cma import copy_bytes
from hetcomm.backends.stats import record as _record
from hetcomm.errors import CollectiveError

__all__ = [
    "ShmRail",
    "map_segment",
    "shm_supported",
    "pid_alive",
    "open_peer_path",
    "SHM_DIR",
    "SHM_PREFIX",
]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "hetcomm-"
_CTRL_BYTES = 128
_HEAD, _TAIL = 0, 8  # int64 indices into the control block (64 bytes apart)
_HDR_BYTES = 16
# After this long without progress a step checks whether its peers' processes still exist.
_LIVENESS_AFTER_S = 0.2


# What a hetcomm peer creates in SHM_DIR, and nothing else: segments
# ``hetcomm-<pid>-<12 hex>`` (map_segment) and doorbell FIFOs ``hetcomm-bell-<pid>-<12 hex>``.
_PEER_NAMES = {
    "segment": re.compile(re.escape(SHM_PREFIX) + r"[0-9]+-[0-9a-f]{12}"),
    "fifo": re.compile(re.escape(SHM_PREFIX) + r"bell-[0-9]+-[0-9a-f]{12}"),
}


def open_peer_path(path: str, kind: str, flags: int, *, rank: int, peer: int, num_bytes: int = 0) -> int:
    """Open a path a peer published through the store, only if a hetcomm peer could have made it.

    Whoever can write to the store could otherwise point this rank at any file its user may
    write (the rail maps the segment read-write; a doorbell writes a byte). So the path must be
    ``SHM_DIR/<expected name>`` (no other directory, no ``..``), and the object there must not be
    a link (``O_NOFOLLOW``), must be of ``kind`` (``segment``: a regular file of exactly
    ``num_bytes``; ``fifo``: a named pipe), owned by this process's user, with one link and no
    access for group or others (peers create them ``0600`` with ``O_EXCL``/``mkfifo``).

    Args:
        path: as read from the store.
        kind: ``segment`` or ``fifo``.
        flags: ``os.open`` flags (``O_NOFOLLOW``, ``O_CLOEXEC`` and ``O_NOCTTY`` are added).
        rank / peer: for the error.
        num_bytes: the segment's expected size.

    Returns:
        An open file descriptor (the caller closes it).

    Raises:
        CollectiveError: naming the path, what is wrong and the likely cause.
    """

    def refuse(why: str) -> CollectiveError:
        return CollectiveError(
            f"shared-memory setup: refusing {path!r} published by rank {peer} through the store: "
            f"{why}. A hetcomm peer publishes only its own {kind} in {SHM_DIR}; if the ranks are "
            f"yours, something else wrote to the store: protect its port (see SECURITY.md)",
            op="init",
            rank=rank,
            peer=peer,
            rail="shm",
        )

    if os.path.dirname(path) != SHM_DIR or not _PEER_NAMES[kind].fullmatch(os.path.basename(path)):
        raise refuse(f"not a {SHM_DIR}/{_PEER_NAMES[kind].pattern} name")
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise  # callers explain a missing path (separate /dev/shm mounts)
    except OSError as e:
        raise refuse(e.strerror) from None
    if stat.S_ISLNK(before.st_mode):
        raise refuse("it is a symbolic link")
    want_type = stat.S_ISFIFO if kind == "fifo" else stat.S_ISREG
    if not want_type(before.st_mode):
        raise refuse(f"it is not a {'named pipe' if kind == 'fifo' else 'regular file'}")
    if before.st_uid != os.geteuid():
        raise refuse(f"it is owned by uid {before.st_uid}, not by this rank's uid {os.geteuid()}")
    if before.st_mode & 0o077 or before.st_nlink != 1:
        raise refuse(f"mode {stat.S_IMODE(before.st_mode):o} with {before.st_nlink} links, not a private 0600 file")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise refuse(e.strerror) from None
    st = os.fstat(fd)
    # The same object as checked above (not swapped in between), and the right size.
    if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or (
        kind == "segment" and st.st_size != num_bytes
    ):
        os.close(fd)
        why = "it changed while being opened"
        if (st.st_dev, st.st_ino) == (before.st_dev, before.st_ino):
            why = f"it has {st.st_size} bytes, not the {num_bytes} this group's layout needs"
        raise refuse(why)
    return fd


def shm_supported() -> bool:
    """True where the ring protocol is sound: Linux with /dev/shm on x86-64 (see module doc)."""
    return os.path.isdir(SHM_DIR) and platform.machine().lower() in ("x86_64", "amd64")


class _StreamError(Exception):
    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer
        self.message = message


class _Ring:
    """One single-producer/single-consumer byte ring inside the segment."""

    def __init__(self, mm: mmap.mmap, offset: int, capacity: int):
        self.ctrl = np.frombuffer(mm, dtype=np.int64, count=_CTRL_BYTES // 8, offset=offset)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=capacity, offset=offset + _CTRL_BYTES)
        self.base = self.data.data_ptr()
        self.capacity = capacity
        self.head = int(self.ctrl[_HEAD])  # writer's own copy
        self.tail = int(self.ctrl[_TAIL])  # reader's own copy

    def write(self, src: torch.Tensor, offset: int, max_bytes: int) -> int:
        """Copy up to ``max_bytes`` of ``src[offset:]`` in; returns how many fit."""
        free = self.capacity - (self.head - int(self.ctrl[_TAIL]))
        n = min(free, max_bytes)
        if n <= 0:
            return 0
        pos = self.head % self.capacity
        first = min(n, self.capacity - pos)
        # memmove on this thread, not Tensor.copy_ (OpenMP threads; see cma.copy_bytes).
        at = src.data_ptr() + offset
        copy_bytes(self.base + pos, at, first)
        copy_bytes(self.base, at + first, n - first)
        self.head += n
        self.ctrl[_HEAD] = self.head  # publish after the data (x86-64 TSO)
        return n

    def read(self, dst: torch.Tensor, offset: int, max_bytes: int) -> int:
        """Copy up to ``max_bytes`` out into ``dst[offset:]``; returns how many were there."""
        n = min(int(self.ctrl[_HEAD]) - self.tail, max_bytes)
        if n <= 0:
            return 0
        pos = self.tail % self.capacity
        first = min(n, self.capacity - pos)
        at = dst.data_ptr() + offset
        copy_bytes(at, self.base + pos, first)
        copy_bytes(at + first, self.base, n - first)
        self.tail += n
        self.ctrl[_TAIL] = self.tail
        return n


class _Cursor:
    """Progress of one message (header + payload) through one ring."""

    def __init__(self, ring: _Ring, xfer: Xfer, payload: torch.Tensor, sending: bool):
        self.ring = ring
        self.xfer = xfer
        self.peer = xfer.peer
        self.tag = xfer.tag
        self.payload = payload  # flat uint8
        self.sending = sending
        self.header = torch.zeros(2, dtype=torch.int64, device="cpu")  # host: a shared-memory message header
        if sending:
            self.header[0], self.header[1] = self.tag, payload.numel()
        self.header_bytes = self.header.view(torch.uint8)
        self.done_bytes = 0
        self.total = _HDR_BYTES + payload.numel()

    def step(self) -> bool:
        """Move what the ring allows; True if any byte moved."""
        moved = 0
        move = self.ring.write if self.sending else self.ring.read
        if self.done_bytes < _HDR_BYTES:
            n = move(self.header_bytes, self.done_bytes, _HDR_BYTES - self.done_bytes)
            self.done_bytes += n
            moved += n
            if self.done_bytes < _HDR_BYTES:
                return moved > 0
            if not self.sending:
                self._check_header()
        while self.done_bytes < self.total:
            off = self.done_bytes - _HDR_BYTES
            n = move(self.payload, off, self.total - self.done_bytes)
            if n == 0:
                break
            self.done_bytes += n
            moved += n
        return moved > 0

    def _check_header(self) -> None:
        tag, nbytes = int(self.header[0]), int(self.header[1])
        if tag != self.tag or nbytes != self.payload.numel():
            raise _StreamError(
                self.peer,
                f"shared-memory stream out of step: expected message tag {self.tag} of "
                f"{self.payload.numel()} bytes, got tag {tag} of {nbytes} bytes; the ranks issued "
                f"collectives in different orders or with different sizes (turn on check_splits)",
            )

    @property
    def done(self) -> bool:
        return self.done_bytes >= self.total


class _ShmOp(RailOp):
    rail = "shm"
    needs_polling = True

    def __init__(self, owner: "ShmRail", cursors: List[_Cursor], op: str):
        self.owner = owner
        self.op = op
        # One FIFO per (peer, direction): a pair's messages share one ring, so the second message
        # to a peer may only start once the first is completely written (read).
        self.queues: Dict[tuple, deque] = {}
        for c in cursors:
            self.queues.setdefault((c.peer, c.sending), deque()).append(c)
        self.arrived_xfers: List[Xfer] = []
        self.control_only = all(c.xfer.control for c in cursors)
        self.progressed = False
        self.t0 = time.perf_counter()
        self.last_progress = self.t0
        self.last_liveness = self.t0

    def poll(self) -> bool:
        progressed = False
        touched = set()
        try:
            for key in list(self.queues):
                q = self.queues[key]
                while q:
                    c = q[0]
                    if c.step():
                        progressed = True
                        touched.add(c.peer)
                    if not c.done:
                        break
                    q.popleft()
                    n = c.payload.numel()
                    if c.xfer.control:
                        pass
                    elif c.sending:
                        _record("shm", bytes_sent=n, chunks_sent=1)
                    else:
                        _record("shm", bytes_received=n, chunks_received=1)
                        self.arrived_xfers.append(c.xfer)
                if not q:
                    del self.queues[key]
        except _StreamError as e:
            self.owner.broken = e.message
            raise CollectiveError(e.message, op=self.op, rank=self.owner.rank, peer=e.peer, rail="shm") from None
        if touched and self.owner.bell is not None:
            # A peer may sleep until bytes arrive (reader) or ring space frees up (writer).
            for peer in touched:
                self.owner.bell.ring(peer)
        self.progressed = progressed
        now = time.perf_counter()
        if not self.queues:
            if not self.control_only:
                _record("shm", seconds_busy=now - self.t0, ops=1)
            return True
        if progressed:
            self.last_progress = now
        elif now - self.last_progress > _LIVENESS_AFTER_S and now - self.last_liveness > _LIVENESS_AFTER_S:
            self.last_liveness = now
            for peer in self.pending_peers():
                pid = self.owner.peer_pids[peer]
                if not pid_alive(pid):
                    self.owner.broken = f"peer {peer} (pid {pid}) exited"
                    raise CollectiveError(
                        f"peer process (pid {pid}) exited while this rank waited for it",
                        op=self.op,
                        rank=self.owner.rank,
                        peer=peer,
                        rail="shm",
                    )
        return False

    def pending_peers(self) -> List[int]:
        return sorted({peer for peer, _ in self.queues})


def map_segment(
    store: "torch.distributed.Store", key: str, rank: int, members: Sequence[int], num_bytes: int, timeout: timedelta
) -> mmap.mmap:
    """Map one zero-filled shared segment of ``num_bytes`` into every process of ``members``.

    The lowest member creates ``/dev/shm/hetcomm-<pid>-<random>`` and publishes its name under
    ``<key>/name``; the others map it and set ``<key>/attached/<rank>``. Once all have, the
    creator unlinks the name: the kernel frees the memory when the last process unmaps it, so no
    crash after setup can leak it. A failure during setup unlinks too.

    Raises:
        CollectiveError: a member did not attach within ``timeout`` (names the missing ranks).
    """
    leader = min(members)
    if rank == leader:
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.ftruncate(fd, num_bytes)
                mm = mmap.mmap(fd, num_bytes)
            finally:
                os.close(fd)
            store.set(f"{key}/name", path)
            others = [r for r in members if r != leader]
            try:
                store.wait([f"{key}/attached/{r}" for r in others], timeout)
            except Exception as e:
                missing = [r for r in others if not store.check([f"{key}/attached/{r}"])]
                raise CollectiveError(
                    f"shared-memory setup: rank(s) {missing} did not map segment {path} within {timeout}",
                    op="init", rank=rank, peer=missing[0] if missing else None, rail="shm",
                ) from e
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return mm
    store.wait([f"{key}/name"], timeout)
    path = store.get(f"{key}/name").decode(errors="replace")
    try:
        fd = open_peer_path(path, "segment", os.O_RDWR, rank=rank, peer=leader, num_bytes=num_bytes)
    except FileNotFoundError:
        raise CollectiveError(
            f"shared-memory setup: segment {path}, created by rank {leader} on this host, is not "
            f"visible here: the ranks report the same hostname but have different /dev/shm mounts "
            f"(separate containers or mount namespaces?). Share /dev/shm (docker --ipc=host), give "
            f"them distinct hostnames, or set HETCOMM_RAILS=gloo",
            op="init", rank=rank, peer=leader, rail="shm",
        ) from None
    try:
        mm = mmap.mmap(fd, num_bytes)
    finally:
        os.close(fd)
    store.set(f"{key}/attached/{rank}", "1")
    return mm


class ShmRail(Rail):
    """Shared-memory rings between this rank and the other ranks of its node on this host.

    Args:
        store: the group's store (setup only).
        rank: this process's group rank.
        local_ranks: group ranks sharing this rank's node and host (sorted, includes ``rank``).
        peer_pids: pid of every group rank (liveness checks).
        node: node name (keys the segment in the store).
        ring_bytes: capacity of each ring.
        timeout: how long setup may wait for the node's other ranks.
        bell: this rank's :class:`~hetcomm.backends.doorbell.Doorbell` (rings the peers after
            every step that moved bytes, so that they can sleep instead of polling), or None.
    """

    name = "shm"

    def __init__(
        self,
        store: "torch.distributed.Store",
        rank: int,
        local_ranks: Sequence[int],
        peer_pids: Sequence[int],
        node: str,
        ring_bytes: int,
        timeout: timedelta,
        bell=None,
    ):
        self.rank = rank
        self.bell = bell
        self.local_ranks = list(local_ranks)
        self.peer_pids = list(peer_pids)
        self.ring_bytes = (ring_bytes + 63) // 64 * 64
        self.broken: Optional[str] = None
        self.mm: Optional[mmap.mmap] = None
        self._send: Dict[int, _Ring] = {}
        self._recv: Dict[int, _Ring] = {}
        n = len(self.local_ranks)
        ring_span = _CTRL_BYTES + self.ring_bytes
        total = max(1, n * (n - 1)) * ring_span
        self.mm = map_segment(store, f"hetcomm/shm/{node}", rank, self.local_ranks, total, timeout)
        me = self.local_ranks.index(rank)
        for j, peer in enumerate(self.local_ranks):
            if peer == rank:
                continue
            self._send[peer] = _Ring(self.mm, self._ring_index(me, j, n) * ring_span, self.ring_bytes)
            self._recv[peer] = _Ring(self.mm, self._ring_index(j, me, n) * ring_span, self.ring_bytes)

    @staticmethod
    def _ring_index(src: int, dst: int, n: int) -> int:
        return src * (n - 1) + (dst if dst < src else dst - 1)

    @property
    def peers(self) -> List[int]:
        return sorted(self._send)

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        if self.broken:
            raise CollectiveError(
                f"the shm rail is unusable after an earlier failure ({self.broken}); "
                f"destroy the process group and start a new one",
                op=op,
                rank=self.rank,
                rail="shm",
            )
        cursors = []
        for x in recvs:
            cursors.append(_Cursor(self._recv[x.peer], x, as_bytes(x.tensor), sending=False))
        for x in sends:
            cursors.append(_Cursor(self._send[x.peer], x, as_bytes(x.tensor), sending=True))
        return _ShmOp(self, cursors, op)

    def close(self) -> None:
        self._send.clear()
        self._recv.clear()
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                pass
            self.mm = None
