"""Multi-rail striping: the transfers of each pair spread over several rails (one per NIC).

A node with several NIC ports reaches another node over each of them. One gloo group per port
(each bound to that port's interface, so that every rank of the group advertises an address on
that rail and every connection of the group runs over it) gives one rail per port; this rail
deals a pair's transfers out to them in turn.

Both ends must agree which transfer goes where without talking: each end counts the transfers of
every ordered pair (sender, receiver), and the ``k``-th one goes over rail
``(k + sender + receiver) % R`` on both ends. The offset ``sender + receiver`` starts different
pairs on different rails, so even single-chunk exchanges use every port.

Why not one gloo group with rail-matched interfaces (``GLOO_SOCKET_IFNAME=nic<local rank>``)? gloo
binds only its listening socket: a rank on rail 1 dials a rail-0 peer from its rail-0 address, so
that pair's bytes all ride rail 0. Under the emulation of ``emulated-4node`` three quarters of a
flat all-to-all's bytes left through nic0 (``benchmarks/README.md``, emulate section).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence

from hetcomm.backends.rails.base import CompositeOp, Rail, RailOp, Xfer

__all__ = ["StripedRail"]


class StripedRail(Rail):
    """Deals each pair's transfers round-robin over ``rails`` (e.g. one gloo group per NIC).

    Args:
        rails: the rails, in port order; every rank passes the same number.
        rank: this rank in the group.
    """

    name = "gloo"

    def __init__(self, rails: Sequence[Rail], rank: int):
        assert len(rails) >= 1
        self.rails = list(rails)
        self.rank = rank
        self._sent: Dict[int, int] = defaultdict(int)
        self._received: Dict[int, int] = defaultdict(int)

    def _deal(self, xfers: Sequence[Xfer], counts: Dict[int, int]) -> List[List[Xfer]]:
        out: List[List[Xfer]] = [[] for _ in self.rails]
        for x in xfers:
            k = counts[x.peer]
            counts[x.peer] = k + 1
            out[(k + self.rank + x.peer) % len(self.rails)].append(x)
        return out

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        s_by = self._deal(sends, self._sent)
        r_by = self._deal(recvs, self._received)
        ops = [rail.start(s, r, op, seq) for rail, s, r in zip(self.rails, s_by, r_by) if s or r]
        return CompositeOp(ops, rail="gloo")

    def close(self) -> None:
        for rail in self.rails:
            rail.close()
