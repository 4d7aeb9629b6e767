"""The ``gloo`` rail: point-to-point sends and receives over an inner ProcessGroupGloo (TCP).

Universal fallback and the rail for peers on other hosts. Each transfer is one gloo ``send`` or
``recv`` of the tensor's bytes, posted at once (gloo's own threads move them); ``poll`` checks
the Works. gloo enforces the group timeout on each Work itself.
"""

from __future__ import annotations

import time
from typing import List, Sequence, Tuple

import torch

from hetcomm.backends.stats import record as _record
from hetcomm.backends.rails.base import Rail, RailOp, Xfer, as_bytes
from hetcomm.errors import CollectiveError

__all__ = ["GlooRail"]


class _GlooOp(RailOp):
    rail = "gloo"

    def __init__(self, rank: int, works: List[Tuple[int, bool, Xfer, "torch.distributed.Work"]], op: str, name: str):
        self.rank = rank
        self.works = works  # (peer, is_send, nbytes, work)
        self.op = op
        self.rail = name
        self.t0 = time.perf_counter()
        self.progressed = False
        self.arrived_xfers: List[Xfer] = []

    def poll(self) -> bool:
        still = []
        for item in self.works:
            peer, is_send, x, w = item
            nbytes = x.tensor.nbytes
            if not w.is_completed():
                still.append(item)
                continue
            try:
                w.wait()
                if is_send:
                    _record(self.rail, bytes_sent=nbytes, chunks_sent=1)
                else:
                    _record(self.rail, bytes_received=nbytes, chunks_received=1)
                    self.arrived_xfers.append(x)
            except Exception as e:  # gloo raises RuntimeError naming only a socket address
                raise CollectiveError(
                    f"{'send to' if is_send else 'receive from'} peer failed: {e}",
                    op=self.op,
                    rank=self.rank,
                    peer=peer,
                    rail=self.rail,
                ) from e
        self.progressed = len(still) < len(self.works)
        self.works = still
        if not still:
            _record(self.rail, seconds_busy=time.perf_counter() - self.t0, ops=1)
            return True
        return False

    def pending_peers(self) -> List[int]:
        return sorted({p for p, _, _, _ in self.works})


class GlooRail(Rail):
    """Sends and receives over ``gloo`` (an inner ``ProcessGroupGloo`` over the whole group)."""

    name = "gloo"

    def __init__(self, gloo: "torch.distributed.ProcessGroup", rank: int):
        self.gloo = gloo
        self.rank = rank

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        works = []
        # Receives first: a posted receive lets gloo land the bytes straight in the tensor.
        for x in recvs:
            b = as_bytes(x.tensor)
            works.append((x.peer, False, x, self.gloo.recv([b], x.peer, x.tag)))
        for x in sends:
            b = as_bytes(x.tensor)
            works.append((x.peer, True, x, self.gloo.send([b], x.peer, x.tag)))
        return _GlooOp(self.rank, works, op, self.name)
