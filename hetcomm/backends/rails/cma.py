"""Single-copy transfers between processes on one host: Linux cross-memory attach.

``process_vm_readv(2)`` copies bytes from another process's address space straight into this
one's: one copy per byte, in the kernel, with the GIL released (ctypes). The ``shm`` rings copy
every byte twice (into the shared segment, out of it) and loopback TCP (gloo) twice as well (into
the socket buffer, out of it). So when a whole group lives on one host (it has the shared-memory
board, :mod:`hetcomm.backends.board`), an all-to-all can be: publish the input's address with the
cross-rank check's vector (:func:`hetcomm.backends.checks.encode_meta`), read every peer's rows
for this rank directly from the peer's input, then tell the peers that their input may be
reused (:func:`finish`: one more board exchange, carrying any failure so that every rank raises).

No library offers this from Python (MPI and UCX use the same call inside their shared-memory
transports; torch has none), hence ctypes. Only same-user processes may read each other
(``PTRACE_MODE_ATTACH_REALCREDS``); containers or Yama policies can forbid it, so a group
:func:`probe` s it once and falls back to the rings where it fails.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import time
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["cma_available", "probe", "read_from", "copy_bytes", "finish", "CmaError"]


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None


def _lib():
    global _readv
    if _readv is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        _readv = fn
    return _readv


def cma_available() -> bool:
    """Whether this platform has ``process_vm_readv`` (Linux with glibc/musl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _lib()
    except (OSError, AttributeError):
        return False
    return True


class CmaError(Exception):
    """A read from a peer failed: ``peer`` and the ``errno``."""

    def __init__(self, peer: int, err: int):
        super().__init__(f"reading rank {peer}'s memory failed: {os.strerror(err)} (errno {err})")
        self.peer = peer
        self.errno = err


def read_from(peer: int, pid: int, dst_addr: int, src_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src_addr`` of process ``pid`` to ``dst_addr`` here.

    Raises:
        CmaError: the kernel refused (``ESRCH``: the process is gone; ``EFAULT``: the range is
            not mapped there; ``EPERM``: not allowed to read that process).
    """
    fn = _lib()
    done = 0
    while done < nbytes:
        local = _IoVec(dst_addr + done, nbytes - done)
        remote = _IoVec(src_addr + done, nbytes - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            raise CmaError(peer, ctypes.get_errno())
        if got == 0:  # nothing readable at that address although no error: treat as a fault
            raise CmaError(peer, errno.EFAULT)
        done += got  # a partial read (a range split across mappings): continue after it


def copy_bytes(dst_addr: int, src_addr: int, nbytes: int) -> None:
    """``memmove`` between two host addresses of this process, on this thread, GIL released.

    Used instead of ``Tensor.copy_`` for the rails' host copies: torch splits a large copy over
    its OpenMP threads, whose spin-waiting after every parallel region took the cores from the
    other ranks on an oversubscribed host (4 ranks on 2 cores: the shm rail's 16 MiB all-to-all
    used 5x the CPU time with ``copy_``, ``benchmarks/README.md``).
    """
    if nbytes > 0:
        ctypes.memmove(dst_addr, src_addr, nbytes)


def probe(store, rank: int, members: Sequence[int], pids: Sequence[int], timeout: timedelta) -> bool:
    """Whether every member can read every other member's memory (collective over ``members``).

    Each member publishes the address of an 8-byte value that only it knows, reads every other
    member's, and publishes whether that worked; the answer is the same on every member. Costs
    one store round (a few milliseconds).
    """
    from hetcomm.backends.agreement import _wait_all

    key = "hetcomm/cma"
    secret = torch.tensor([(os.getpid() << 16) ^ (rank * 7919) ^ 0x5A5A], dtype=torch.int64, device="cpu")  # host: probe value
    ok = cma_available()
    store.set(f"{key}/addr/{rank}", f"{secret.data_ptr()}" if ok else "-")
    _wait_all(store, [f"{key}/addr/{r}" for r in members], rank, timeout, "hetcomm single-copy probe")
    got = torch.zeros(1, dtype=torch.int64, device="cpu")  # host: probe value
    for r in members:
        if r == rank or not ok:
            continue
        addr = store.get(f"{key}/addr/{r}").decode()
        if addr == "-":
            ok = False
            break
        want = (pids[r] << 16) ^ (r * 7919) ^ 0x5A5A
        try:
            read_from(r, pids[r], got.data_ptr(), int(addr), 8)
        except CmaError:
            ok = False
            break
        ok = int(got[0]) == want
    store.set(f"{key}/ok/{rank}", "1" if ok else "0")
    # Every member waits for all answers: the secrets must stay alive until all reads are done.
    _wait_all(store, [f"{key}/ok/{r}" for r in members], rank, timeout, "hetcomm single-copy probe")
    return all(store.get(f"{key}/ok/{r}").decode() == "1" for r in members)


def gather_rows(
    pids: Sequence[int],
    me: int,
    out: torch.Tensor,
    inp: torch.Tensor,
    addrs: Sequence[int],
    recv_bytes: Sequence[int],
    remote_offsets: Sequence[int],
) -> Tuple[Optional[CmaError], float]:
    """This rank's half of a single-copy all-to-all: every peer's bytes for it, read in place.

    Args:
        pids: every rank's process id.
        out: ``[sum(recv_bytes)]`` uint8, contiguous: bytes from rank j land at
            ``sum(recv_bytes[:j])``.
        inp: this rank's input (contiguous; its own bytes for itself are copied locally).
        addrs: every rank's input address (from the exchanged metadata).
        recv_bytes: bytes this rank receives from every rank.
        remote_offsets: where, in rank j's input, rank j's bytes for this rank start.

    Returns:
        ``(error or None, seconds)``; the first failed read stops the reads (the caller reports
        it through :func:`finish`, so that every rank raises).
    """
    t0 = time.perf_counter()
    n = len(pids)
    base = out.data_ptr()
    off = 0
    local = []
    for j in range(n):
        local.append(off)
        off += recv_bytes[j]
    try:
        # Peer order me+1, me+2, ...: the ranks do not all read the same peer at once.
        for k in range(1, n):
            p = (me + k) % n
            if recv_bytes[p]:
                read_from(p, pids[p], base + local[p], addrs[p] + remote_offsets[p], recv_bytes[p])
    except CmaError as e:
        return e, time.perf_counter() - t0
    copy_bytes(base + local[me], inp.data_ptr() + remote_offsets[me], recv_bytes[me])
    return None, time.perf_counter() - t0


def finish(board, me: int, n: int, op: str, seq: int, error: Optional[CmaError], deadline: float) -> List[Tuple[int, int, int]]:
    """The closing board exchange of a single-copy all-to-all: after it, no peer reads this
    rank's input any more, so the collective may complete. Carries each rank's failure.

    Returns:
        ``[(rank, peer it could not read, errno)]`` over every rank that failed (the same list
        on every rank); empty when all reads succeeded.
    """
    from hetcomm.backends import checks

    vec = checks.encode_collective(
        "all_to_all_single", seq, n, dtype=None,
        count=error.errno if error is not None else 0,
        root=error.peer if error is not None else None,
        local_problem=error is not None,
    )
    rows = [t.tolist() for t in board.exchange(vec, deadline, op)]
    return checks.failures(rows)
