"""The ``nccl`` rail: CUDA tensors between NVIDIA ranks, over torch's ProcessGroupNCCL.

Thin on purpose: one ``ProcessGroupNCCL`` over the group's NVIDIA ranks (in group-rank order),
created on first use (its NCCL communicators are created lazily by NCCL itself), and each step is
one coalesced batch of ``send``/``recv`` (``ncclGroupStart/End`` under the hood), so sends and
receives between the same pair cannot deadlock. Untested on the CPU-only development machine:
its tests carry ``@pytest.mark.gpu``.

Stream contract (:mod:`hetcomm.backends.devices`): steps start on the executor inside the
group's rail-stream scope, so the rail stream (already waiting on the event the call recorded on
the caller's stream) is the current stream here. ProcessGroupNCCL makes its NCCL stream wait on
the current stream at each call, and ``work.wait()`` in :meth:`_CoalescedOp.poll` makes the
current stream wait on the NCCL kernels, so the collective's done event follows them. The poll
itself waits on the host for the kernels to finish (``is_completed`` queries their events): the
executor is host-driven. ProcessGroupNCCL ``record_stream``-s the tensors on its own stream.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import List, Sequence

import torch

from hetcomm.backends.rails.base import Rail, RailOp, Xfer
from hetcomm.backends.stats import record as _record
from hetcomm.errors import CollectiveError

__all__ = ["NcclRail", "nccl_available"]


def nccl_available() -> bool:
    """torch was built with NCCL and a CUDA device is present."""
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_nccl_available()


class _CoalescedOp(RailOp):
    def __init__(self, rail: str, work, peers: List[int], nbytes: int, op: str, rank: int):
        self.rail = rail
        self.work = work
        self.peers = peers
        self.nbytes = nbytes
        self.op = op
        self.rank = rank
        self.progressed = False
        self.t0 = time.perf_counter()

    def poll(self) -> bool:
        if self.work is not None and not self.work.is_completed():
            return False
        try:
            if self.work is not None:
                self.work.wait()
        except Exception as e:
            raise CollectiveError(f"batch to peers {self.peers} failed: {e}", op=self.op, rank=self.rank, peer=self.peers[0] if self.peers else None, rail=self.rail) from e
        _record(self.rail, seconds_busy=time.perf_counter() - self.t0, ops=1)
        return True

    def pending_peers(self) -> List[int]:
        return [] if self.work is None or self.work.is_completed() else list(self.peers)


class NcclRail(Rail):
    """Coalesced p2p over a ProcessGroupNCCL spanning ``members`` (group ranks, sorted)."""

    name = "nccl"

    def __init__(self, store, rank: int, members: Sequence[int], timeout: timedelta):
        self.store = store
        self.rank = rank
        self.members = list(members)
        self.timeout = timeout
        self._pg = None

    def _group(self):
        if self._pg is None:
            from torch.distributed import PrefixStore
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self._pg = ProcessGroupNCCL(
                PrefixStore("hetcomm/nccl/", self.store), self.members.index(self.rank), len(self.members), opts
            )
        return self._pg

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        pg = self._group()
        xs = list(recvs) + list(sends)
        if not xs:
            return _CoalescedOp(self.name, None, [], 0, op, self.rank)
        device = xs[0].tensor.device
        nbytes = 0
        pg._start_coalescing(device)
        for x in recvs:
            pg.recv([x.tensor], self.members.index(x.peer), 0)
            _record(self.name, bytes_received=x.tensor.nbytes, chunks_received=1)
        for x in sends:
            pg.send([x.tensor], self.members.index(x.peer), 0)
            _record(self.name, bytes_sent=x.tensor.nbytes, chunks_sent=1)
        work = pg._end_coalescing(device)
        return _CoalescedOp(self.name, work, sorted({x.peer for x in xs}), nbytes, op, self.rank)

    def close(self) -> None:
        if self._pg is not None:
            try:
                self._pg.shutdown()
            except Exception:
                pass
            self._pg = None
