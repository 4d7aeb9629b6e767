"""Doorbells: wake a same-host peer that sleeps until there is something for it to do.

The shm rail and the metadata board move bytes through shared memory, which tells nobody that
something changed. Polling does not work on an oversubscribed machine (4 ranks on 2 cores):
``sched_yield`` can hand the core to another process for a whole time slice, and sleeping adds
its own delay. Instead each rank owns a doorbell, a named pipe that its same-host peers open for
writing. A peer that made progress the owner may be waiting for (published bytes, freed ring
space, its own arrival at the board) writes one byte to it; the owner sleeps in ``select`` on its
end and drains it when it wakes.

A pipe is level-triggered, so no ring is lost between the owner's last look at shared memory and
its ``select``; and the ``read`` that drains it takes a kernel lock, which orders the owner's own
stores before the loads that follow (x86-64 may otherwise let a later load pass an earlier store).
Every pipe is unlinked as soon as all peers opened it: nothing is left in ``/dev/shm`` after
setup, whatever happens to the processes later.

A doorbell also serves as the executor's wake-up event (``set``/``wait``/``clear``, like
``threading.Event``): the gloo rail's waiter threads ring it when a transfer completes.
"""

from __future__ import annotations

import os
import select
import threading
import uuid
from datetime import timedelta
from typing import Dict, Sequence

import torch.distributed as dist

from hetcomm.backends.rails.shm import SHM_DIR, SHM_PREFIX, open_peer_path
from hetcomm.errors import CollectiveError

__all__ = ["Doorbell"]


class Doorbell:
    """This rank's doorbell, and write ends of its peers' doorbells.

    Attributes:
        rung_by_peers: always True: a waiter may sleep on it for shared-memory progress.

    Args:
        store: the group's store (setup only).
        key: store prefix shared by the members.
        rank: this rank.
        peers: ranks on this host that will ring this rank or be rung by it (may be empty).
        timeout: how long setup may wait for the peers.
    """

    rung_by_peers = True

    def __init__(self, store: dist.Store, key: str, rank: int, peers: Sequence[int], timeout: timedelta):
        self.rank = rank
        self._fd = -1
        self._peer_fds: Dict[int, int] = {}
        # Held around every write/read and by close(): a rail thread that rings after close must
        # not write into whatever file reused the descriptor number.
        self._fd_lock = threading.Lock()
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}bell-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.mkfifo(path, 0o600)
        try:
            # O_RDWR: opening never blocks, and the pipe never reports end-of-file.
            self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            others = [p for p in peers if p != rank]
            if others:
                store.set(f"{key}/path/{rank}", path)
                store.wait([f"{key}/path/{p}" for p in others], timeout)
                for p in others:
                    peer_path = store.get(f"{key}/path/{p}").decode(errors="replace")
                    try:
                        # Only a private FIFO of this user in SHM_DIR: the path comes from the store.
                        self._peer_fds[p] = open_peer_path(
                            peer_path, "fifo", os.O_WRONLY | os.O_NONBLOCK, rank=rank, peer=p
                        )
                    except FileNotFoundError:
                        raise CollectiveError(
                            f"doorbell setup: {peer_path} of rank {p} is not visible here although "
                            f"both ranks report this host (separate /dev/shm mounts?); set HETCOMM_RAILS=gloo",
                            op="init", rank=rank, peer=p, rail="shm",
                        ) from None
                store.set(f"{key}/opened/{rank}", "1")
                store.wait([f"{key}/opened/{p}" for p in others], timeout)
        except BaseException:
            self.close()
            raise
        finally:
            os.unlink(path)

    def fileno(self) -> int:
        return self._fd

    def ring(self, peer: int) -> None:
        """Wake ``peer`` (a no-op if its doorbell already rings or it is gone)."""
        with self._fd_lock:
            fd = self._peer_fds.get(peer)
            if fd is not None:
                try:
                    os.write(fd, b"\0")
                except (BlockingIOError, BrokenPipeError):
                    pass

    def ring_all(self) -> None:
        for peer in list(self._peer_fds):
            self.ring(peer)

    # -- threading.Event interface, for the executor's wake-ups -------------------------------
    def set(self) -> None:
        """Ring this rank's own doorbell (from any thread; a no-op once closed)."""
        with self._fd_lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, b"\0")
            except BlockingIOError:  # already ringing (pipe full)
                pass

    def wait(self, timeout: float) -> bool:
        """Sleep until the doorbell rings or ``timeout`` seconds pass; True if it rang."""
        fd = self._fd
        if fd < 0:
            return False
        return bool(select.select([fd], [], [], max(0.0, timeout))[0])

    def clear(self) -> None:
        """Swallow every ring so far (also orders this rank's stores before its next loads)."""
        with self._fd_lock:
            if self._fd < 0:
                return
            try:
                while os.read(self._fd, 4096):
                    pass
            except BlockingIOError:  # empty
                pass

    def close(self) -> None:
        """Close every end (idempotent); later rings and waits do nothing."""
        with self._fd_lock:
            fds = [self._fd, *self._peer_fds.values()]
            self._fd, self._peer_fds = -1, {}
            for fd in fds:
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
