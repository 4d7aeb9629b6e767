"""The ``bridge`` rail: NVIDIA <-> Ascend pairs, through host memory.

NCCL and HCCL cannot talk to each other, so a cross-vendor transfer is staged: the sender copies
device memory into a (pinned) host buffer, casting to the *wire dtype* when the link's policy
says so (fp16 across vendors by default, see ``Cluster.wire_dtype_for``), the host bytes move
over a host transport (``shm`` when both ranks share a host and node, else ``gloo``), and the
receiver copies them into its device tensor, casting back.

With CPU tensors (this repository's test machine) the same path runs: the staging copies and the
cast are real, only the device<->host copies degenerate to host copies. Counters under
``bridge`` count the staged bytes; the transport that carried them counts them too.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.rails.base import Rail, RailOp, Xfer
from hetcomm.backends.stats import record as _record
from hetcomm.errors import CollectiveError

__all__ = ["BridgeRail"]


def _staging(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty host buffer shaped like ``like``; pinned when ``like`` lives on a device."""
    pin = like.device.type != "cpu"
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)


class _BridgeOp(RailOp):
    rail = "bridge"

    def __init__(self, inner: List[RailOp], unstage: List[Tuple[int, torch.Tensor, torch.Tensor, bool]], op: str, rank: int):
        self.inner = inner
        self.needs_polling = any(o.needs_polling for o in inner)
        self.unstage = unstage  # (peer, host buffer, destination, is control message)
        self.op = op
        self.rank = rank
        self.progressed = False
        self.t0 = time.perf_counter()

    def poll(self) -> bool:
        still = []
        progressed = False
        for o in self.inner:
            try:
                done = o.poll()
            except CollectiveError as e:
                raise CollectiveError(
                    f"(host transport {o.rail}) {str(e).split(': ', 1)[-1]}", op=self.op, rank=self.rank, peer=e.peer, rail="bridge"
                ) from e
            if done:
                o.finish()
                progressed = True
            else:
                progressed = progressed or getattr(o, "progressed", False)
                still.append(o)
        self.inner = still
        self.progressed = progressed
        return not still

    def finish(self) -> None:
        for peer, host, dst, control in self.unstage:
            try:
                dst.copy_(host, non_blocking=False)  # host -> device, wire dtype -> tensor dtype
            except RuntimeError as e:
                raise CollectiveError(f"copy from the host staging buffer failed: {e}", op=self.op, rank=self.rank, peer=peer, rail="bridge") from e
            if not control:
                _record("bridge", bytes_received=host.nbytes, chunks_received=1)
        _record("bridge", seconds_busy=time.perf_counter() - self.t0, ops=1)

    def pending_peers(self) -> List[int]:
        return sorted({p for o in self.inner for p in o.pending_peers()})


class BridgeRail(Rail):
    """Host-staged transfers between vendors.

    Args:
        rank: this process's group rank.
        transport_for: the host rail (``shm`` or ``gloo``) that carries the staged bytes to a peer.
        wire_dtype_for: the dtype a floating-point tensor of dtype ``d`` travels in to ``peer``
            (``None`` = unchanged); both ends of a pair must get the same answer.
    """

    name = "bridge"

    def __init__(
        self,
        rank: int,
        transport_for: Callable[[int], Rail],
        wire_dtype_for: Callable[[int, torch.dtype], Optional[torch.dtype]],
    ):
        self.rank = rank
        self.transport_for = transport_for
        self.wire_dtype_for = wire_dtype_for

    def _wire(self, peer: int, dtype: torch.dtype) -> torch.dtype:
        if not dtype.is_floating_point:
            return dtype
        return self.wire_dtype_for(peer, dtype) or dtype

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        groups: Dict[int, Tuple[Rail, List[Xfer], List[Xfer]]] = {}

        def slot(peer: int):
            rail = self.transport_for(peer)
            return groups.setdefault(id(rail), (rail, [], []))

        unstage = []
        for x in recvs:
            host = _staging(x.tensor, self._wire(x.peer, x.tensor.dtype))
            # control=True: the host rail carries the staged bytes but must not count them;
            # they are the bridge's bytes, counted once, under "bridge".
            slot(x.peer)[2].append(Xfer(x.peer, host, x.tag, control=True))
            unstage.append((x.peer, host, x.tensor, x.control))
        for x in sends:
            host = _staging(x.tensor, self._wire(x.peer, x.tensor.dtype))
            host.copy_(x.tensor)  # device -> pinned host, tensor dtype -> wire dtype
            slot(x.peer)[1].append(Xfer(x.peer, host, x.tag, control=True))
            if not x.control:
                _record("bridge", bytes_sent=host.nbytes, chunks_sent=1)
        inner = []
        for rail, s, r in groups.values():
            try:
                inner.append(rail.start(s, r, op, seq))
            except CollectiveError as e:
                raise CollectiveError(
                    f"(host transport {rail.name}) {str(e).split(': ', 1)[-1]}", op=op, rank=self.rank, peer=e.peer, rail="bridge"
                ) from e
        return _BridgeOp(inner, unstage, op, self.rank)
