"""The ``hccl`` rail: NPU tensors between Ascend ranks, over torch_npu's ProcessGroupHCCL.

The Ascend twin of :mod:`hetcomm.backends.rails.nccl`: one ``ProcessGroupHCCL`` over the group's
Ascend ranks, created on first use, each step one coalesced batch of ``send``/``recv``.
``torch_npu`` is imported only here and only when an NPU tensor is routed. Untested on the
CPU-only development machine (marker ``npu``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

from hetcomm.backends.rails.base import RailOp, Xfer
from hetcomm.backends.rails.nccl import NcclRail, _CoalescedOp

__all__ = ["HcclRail", "hccl_available"]


def hccl_available() -> bool:
    """torch_npu is installed and an NPU is present."""
    try:
        import torch
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:
        return False


class HcclRail(NcclRail):
    """Coalesced p2p over a ProcessGroupHCCL spanning ``members`` (group ranks, sorted)."""

    name = "hccl"

    def __init__(self, store, rank: int, members: Sequence[int], timeout: timedelta):
        super().__init__(store, rank, members, timeout)

    def _group(self):
        if self._pg is None:
            from torch.distributed import PrefixStore
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL

            opts = ProcessGroupHCCL.Options()
            opts._timeout = self.timeout
            self._pg = ProcessGroupHCCL(
                PrefixStore("hetcomm/hccl/", self.store), self.members.index(self.rank), len(self.members), opts
            )
        return self._pg

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        pg = self._group()
        if not hasattr(pg, "_start_coalescing"):
            # Older torch_npu: plain p2p, receives posted first; HCCL queues them on per-pair streams.
            works = [pg.recv([x.tensor], self.members.index(x.peer), 0) for x in recvs]
            works += [pg.send([x.tensor], self.members.index(x.peer), 0) for x in sends]
            return _MultiOp(self.name, works, sorted({x.peer for x in list(sends) + list(recvs)}), op, self.rank)
        return super().start(sends, recvs, op, seq)


class _MultiOp(_CoalescedOp):
    def __init__(self, rail, works, peers, op, rank):
        super().__init__(rail, None, peers, 0, op, rank)
        self.works = works

    def poll(self) -> bool:
        if not all(w.is_completed() for w in self.works):
            return False
        for w in self.works:
            w.wait()
        return True
