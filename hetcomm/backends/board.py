"""The metadata board: a cross-rank exchange of small int64 vectors through shared memory.

Every collective of a hetcomm group first checks its arguments across ranks (:mod:`hetcomm.backends.checks`).
Over gloo that check is a collective of its own: on 4 ranks sharing 2 cores a gloo all_gather of
100 bytes took 3.8 ms, longer than the 1 MiB all-to-all it protects (1.1 ms). When every rank of
the group runs on this host, the board does the same exchange in tens of microseconds: each rank
writes its vector into its own slot of one shared segment and publishes a sequence number; the
others read it once they see that number.

Layout (one segment per group, :func:`~hetcomm.backends.rails.shm.map_segment`)::

    slot r = [ seq: int64, alone on a 64-byte line | buffer 0: width x int64 | buffer 1: ... ]

Exchange ``s`` writes buffer ``s % 2`` and then stores ``seq = s`` (x86-64 keeps stores in order,
see the shm rail). Two buffers suffice: a rank writes exchange ``s + 2`` only after every rank
published ``s + 1``, and a rank publishes ``s + 1`` only after it finished reading exchange ``s``.

Waiting: a rank that finds everyone published rings the others' doorbells
(:mod:`hetcomm.backends.doorbell`); a rank that does not, sleeps on its own until rung. Waiters
therefore leave the CPU to the late ranks (on 4 ranks sharing 2 cores a spinning waiter slows
the very rank it waits for) and still wake within microseconds.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import List, Sequence

import numpy as np
import torch

from hetcomm.backends.doorbell import Doorbell
from hetcomm.backends.rails.shm import map_segment, pid_alive
from hetcomm.errors import CollectiveError, PeerTimeout

__all__ = ["MetaBoard"]

_LINE_INT64 = 8  # 64 bytes
# With no progress for this long, a waiting rank checks whether the ranks it waits for still exist.
_LIVENESS_AFTER_S = 0.2
# The longest a waiting rank blocks on its doorbell between checks of the deadline and of the
# missing ranks' processes. It never spins: on 4 ranks sharing 2 cores a sched_yield could hand
# the core to another process for a whole time slice (measured: ~1 ms per exchange either way).
_BLOCK_S = 0.05


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class MetaBoard:
    """All-gather of one ``[width]`` int64 vector per rank, for groups that live on one host.

    Args:
        store: the group's store (setup only).
        rank: this rank in the group.
        pids: the process id of every group rank (to tell a dead peer from a slow one).
        width: length of every rank's vector.
        timeout: how long setup may wait for the other ranks to map the segment.
        bell: this rank's doorbell, opened towards every rank of the group.
    """

    def __init__(
        self, store: "torch.distributed.Store", rank: int, pids: Sequence[int], width: int, timeout: timedelta, bell: Doorbell
    ):
        self.rank = rank
        self.pids = list(pids)
        self.width = width
        n = len(self.pids)
        self._buf_len = _round_up(width, _LINE_INT64)
        self._slot_len = _LINE_INT64 + 2 * self._buf_len
        self._mm = map_segment(store, "hetcomm/board", rank, range(n), n * self._slot_len * 8, timeout)
        self._words = np.frombuffer(self._mm, dtype=np.int64)
        self._seq = 0
        self._bell = bell

    def _buffer(self, r: int, seq: int) -> np.ndarray:
        start = r * self._slot_len + _LINE_INT64 + (seq % 2) * self._buf_len
        return self._words[start : start + self.width]

    def exchange(self, vec: torch.Tensor, deadline: float, op: str) -> List[torch.Tensor]:
        """Publish ``vec`` and return every rank's vector, ``[n]`` tensors of ``[width]`` int64.

        Every rank of the group must call it the same number of times.

        Args:
            deadline: ``time.monotonic()`` value after which waiting ranks are given up on.
            op: the collective, for error messages.

        Raises:
            CollectiveError: a rank we wait for has exited (names it).
            PeerTimeout: ranks still missing at ``deadline`` (names them).
        """
        assert vec.dtype == torch.int64 and vec.numel() == self.width, (vec.dtype, vec.shape, self.width)
        self._seq += 1
        seq = self._seq
        words = self._words
        self._buffer(self.rank, seq)[:] = vec.numpy()
        words[self.rank * self._slot_len] = seq  # publish after the vector (x86-64 TSO)
        pending = [r for r in range(len(self.pids)) if r != self.rank]
        waited = False
        last_progress = time.perf_counter()
        from hetcomm.backends import heartbeat

        beat = heartbeat.active()
        losses_seen = 0
        while True:
            self._bell.clear()  # also the fence between our publication and the reads below
            still = [r for r in pending if words[r * self._slot_len] < seq]
            if not still:
                if not waited:
                    self._bell.ring_all()  # we came last (or together with the last): wake the rest
                break
            now = time.perf_counter()
            if len(still) < len(pending):
                last_progress = now
            pending = still
            waited = True
            if beat is not None and beat.version != losses_seen:
                # A peer the heartbeat saw stop (SIGSTOP) or exit never publishes: end the wait
                # now, naming it, instead of at the group timeout (hetcomm.backends.heartbeat).
                losses_seen = beat.version
                err = self._heartbeat_error(beat, pending, op)
                if err is not None:
                    raise err
            if now - last_progress > _LIVENESS_AFTER_S:
                last_progress = now
                for r in pending:
                    if not pid_alive(self.pids[r]):
                        raise CollectiveError(
                            f"rank {r} (pid {self.pids[r]}) exited before the cross-rank check",
                            op=op, rank=self.rank, peer=r, rail="shm",
                        )
            if time.monotonic() > deadline:
                raise PeerTimeout(
                    f"timed out: no cross-rank check metadata from rank(s) {pending} within the group timeout",
                    op=op, rank=self.rank, peer=pending[0], rail="shm",
                )
            self._bell.wait(_BLOCK_S)
        return [torch.from_numpy(self._buffer(r, seq).copy()) for r in range(len(self.pids))]

    def _heartbeat_error(self, beat, pending: Sequence[int], op: str):
        """The error naming the first of ``pending`` the heartbeat saw exit or stop, or None
        (the loss's verdict: the same words on every survivor).

        The heartbeat's ranks are the default group's; the board's peers are matched by pid."""
        from hetcomm.backends.heartbeat import DEFINITIVE

        by_pid = {pid: r for r, pid in beat.local_pids.items()}
        for r in pending:
            g = by_pid.get(self.pids[r])
            loss = beat.lost.get(g) if g is not None else None
            if loss is not None and loss.cause in DEFINITIVE:
                cls = CollectiveError if loss.cause == "exited" else PeerTimeout
                return cls(
                    f"peer lost before the cross-rank check: {loss.verdict} (named by the heartbeat; every survivor "
                    f"names it); restart the job or let `hetcomm launch` do it",
                    op=op, rank=self.rank, peer=r, rail="shm", diagnosed=True,
                )
        return None

    def close(self) -> None:
        """Unmap the segment (idempotent; the doorbell belongs to the process group)."""
        if self._mm is not None:
            self._words = None  # type: ignore[assignment]
            try:
                self._mm.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it later
                pass
            self._mm = None  # type: ignore[assignment]
