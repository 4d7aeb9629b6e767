"""The ``bridge`` rail: NVIDIA <-> Ascend pairs, through host memory, in pipelined chunks.

NCCL and HCCL cannot talk to each other, so a cross-vendor transfer is staged: the sender copies
device memory into pinned host memory, casting to the *wire dtype* when the link's policy says
so (fp16 across vendors by default, see ``Cluster.wire_dtype_for``), the host bytes move over a
host transport (``shm`` when both ranks share a host and node, else ``gloo``), and the receiver
copies them into its device tensor, casting back.

Host-staged bridges elsewhere copy the whole tensor down, send it, and copy it up, one after the
other. Here every transfer is cut into pieces of at most ``chunk_bytes`` (default 8 MiB, the
group's agreed ``HetcommOptions.chunk_bytes``: both ends must cut alike) and the step runs as
*rounds*: round ``r`` moves piece ``r`` of every transfer. All device->host copies are queued at
once on a copy stream, each followed by an event; round ``r`` starts as soon as its pieces'
events have fired, so the device->host copy of piece ``r + 1`` runs while piece ``r`` is on the
wire; on the receiving side the host->device copy of piece ``r`` is queued as soon as round
``r`` has arrived, while round ``r + 1`` travels. At most :data:`MAX_ROUNDS_IN_FLIGHT` rounds are
posted at a time (pinned memory is the budget). Both ends post the rounds in the same order,
so each ordered pair stays a FIFO stream for the host transport.

Stream contract (device tensors; see docs/BACKEND.md and :mod:`hetcomm.backends.devices`):
the step is ordered after the work queued so far on the current stream of the thread that
starts it (an event recorded there, the copy stream waits on it). Inside a collective that
thread is the executor's, and its current stream is the group's rail stream, which already
waited on the event the call recorded on the *caller's* stream: so the device->host copies read
what the caller's kernels wrote, on whatever stream the caller made current. When the step
finishes, the finishing thread's current stream (the rail stream again) waits on the copy
stream, so the host->device copies are before the collective's done event, and the host never
waits for them. Device tensors are ``record_stream``-ed on the copy stream (the caller may free
them while copies are queued); the pinned staging buffers are protected by the host caching
allocator, which records an event for each non-blocking copy from or to pinned memory.

With CPU tensors (this repository's test machine) the same path runs: the pieces, rounds and
casts are real, the copies are plain host copies done in line. ``chunk_bytes`` small forces
many rounds (the tests do). Counters under ``bridge`` count the staged bytes once.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.devices import device_module
from hetcomm.backends.rails.base import CompositeOp, Rail, RailOp, Xfer
from hetcomm.backends.stats import record as _record
from hetcomm.errors import CollectiveError

__all__ = ["BridgeRail", "DEFAULT_CHUNK_BYTES", "MAX_ROUNDS_IN_FLIGHT", "pieces"]

#: Staging piece size when the group does not say (the options' default chunk_bytes).
DEFAULT_CHUNK_BYTES = 8 << 20
#: Rounds posted to the host transport at once: one on the wire, one staged behind it.
MAX_ROUNDS_IN_FLIGHT = 2


def pieces(numel: int, itemsize: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """``(start, count)`` element ranges of at most ``chunk_bytes`` (at least one element each;
    one empty piece for an empty tensor, so that both ends still post one transfer)."""
    per = max(1, chunk_bytes // max(1, itemsize))
    if numel == 0:
        return [(0, 0)]
    return [(s, min(per, numel - s)) for s in range(0, numel, per)]


class _Staged:
    """One transfer of the step, staged through a host buffer in pieces."""

    def __init__(self, x: Xfer, wire: torch.dtype, chunk_bytes: int):
        self.x = x
        self.flat = x.tensor.reshape(-1)
        pin = x.tensor.device.type != "cpu"
        # host: the staging buffer is host memory by definition (pinned for device tensors).
        self.host = torch.empty(self.flat.numel(), dtype=wire, device="cpu", pin_memory=pin)
        self.pieces = pieces(self.flat.numel(), wire.itemsize, chunk_bytes)
        self.events: List[Optional[object]] = [None] * len(self.pieces)

    def view(self, r: int) -> torch.Tensor:
        s, n = self.pieces[r]
        return self.host[s : s + n]

    def dev(self, r: int) -> torch.Tensor:
        s, n = self.pieces[r]
        return self.flat[s : s + n]


class _BridgeOp(RailOp):
    """The rounds of one bridge step (see the module docstring), driven by :meth:`poll`."""

    rail = "bridge"

    def __init__(self, bridge: "BridgeRail", sends: List[_Staged], recvs: List[_Staged], op: str, seq: int, copy_stream, dev_mod):
        self.bridge, self.sends, self.recvs = bridge, sends, recvs
        self.op, self.seq, self.rank = op, seq, bridge.rank
        self.copy_stream, self.dev_mod = copy_stream, dev_mod
        self.num_rounds = max([len(s.pieces) for s in sends + recvs] or [0])
        self.next_round = 0
        self.in_flight: List[Tuple[int, CompositeOp]] = []
        self.needs_polling = True
        self.can_block = False  # the unstaging copies run on the executor
        self.progressed = False
        self.arrived_xfers = []
        self.t0 = time.perf_counter()

    def _staged(self, r: int) -> bool:
        """Have the device->host copies of round ``r`` completed?"""
        for s in self.sends:
            if r < len(s.pieces) and s.events[r] is not None and not s.events[r].query():
                return False
        return True

    def _start_round(self, r: int) -> None:
        groups: Dict[int, Tuple[Rail, List[Xfer], List[Xfer]]] = {}

        def slot(peer: int):
            rail = self.bridge.transport_for(peer)
            return groups.setdefault(id(rail), (rail, [], []))

        for s in self.recvs:
            if r < len(s.pieces):
                # control=True: the host rail carries the staged bytes but must not count them;
                # they are the bridge's bytes, counted once, under "bridge".
                slot(s.x.peer)[2].append(Xfer(s.x.peer, s.view(r), s.x.tag, control=True))
        for s in self.sends:
            if r < len(s.pieces):
                slot(s.x.peer)[1].append(Xfer(s.x.peer, s.view(r), s.x.tag, control=True))
        inner = []
        for rail, snd, rcv in groups.values():
            try:
                inner.append(rail.start(snd, rcv, self.op, self.seq))
            except CollectiveError as e:
                raise _as_bridge_error(rail.name, e, self.op, self.rank) from e
        comp = CompositeOp(inner, rail="bridge", on_error=lambda o, e: _as_bridge_error(o.rail, e, self.op, self.rank))
        self.in_flight.append((r, comp))

    def _unstage(self, r: int) -> None:
        """Queue (device) or do (CPU) the host->device copies of round ``r``'s arrivals."""
        for s in self.recvs:
            if r >= len(s.pieces) or s.pieces[r][1] == 0:
                continue
            try:
                if self.copy_stream is not None:
                    with self.dev_mod.stream(self.copy_stream):
                        s.dev(r).copy_(s.view(r), non_blocking=True)  # wire dtype -> tensor dtype
                else:
                    s.dev(r).copy_(s.view(r))
            except RuntimeError as e:
                raise CollectiveError(
                    f"copy from the host staging buffer failed: {e}", op=self.op, rank=self.rank, peer=s.x.peer, rail="bridge"
                ) from e

    def poll(self) -> bool:
        progressed = False
        # Finish rounds in order (the host transport delivers each pair in order anyway).
        while self.in_flight:
            r, comp = self.in_flight[0]
            if not comp.poll():
                progressed = progressed or comp.progressed
                break
            self.in_flight.pop(0)
            self._unstage(r)
            progressed = True
        while (
            self.next_round < self.num_rounds
            and len(self.in_flight) < MAX_ROUNDS_IN_FLIGHT
            and self._staged(self.next_round)
        ):
            self._start_round(self.next_round)
            self.next_round += 1
            progressed = True
        self.progressed = progressed
        return self.next_round >= self.num_rounds and not self.in_flight

    def finish(self) -> None:
        if self.copy_stream is not None:
            # The host->device copies are ordered before later work on this thread's current
            # stream (the rail stream: the collective's done event follows); no host wait.
            self.dev_mod.current_stream(self.copy_stream.device).wait_stream(self.copy_stream)
        for s in self.recvs:
            if not s.x.control:
                _record("bridge", bytes_received=s.host.nbytes, chunks_received=len(s.pieces))
        _record("bridge", seconds_busy=time.perf_counter() - self.t0, ops=1)

    def pending_peers(self) -> List[int]:
        peers = {p for _, comp in self.in_flight for p in comp.pending_peers()}
        if self.next_round < self.num_rounds:
            peers |= {s.x.peer for s in self.sends + self.recvs if self.next_round < len(s.pieces)}
        return sorted(peers)


def _as_bridge_error(transport: str, e: CollectiveError, op: str, rank: int) -> CollectiveError:
    """A host transport's error, re-aimed at the bridge rail (same type, same peer)."""
    return type(e)(f"(host transport {transport}) {e.detail}", op=op, rank=rank, peer=e.peer, rail="bridge")


class BridgeRail(Rail):
    """Host-staged transfers between vendors, pipelined in pieces.

    Args:
        rank: this process's group rank.
        transport_for: the host rail (``shm`` or ``gloo``) that carries the staged bytes to a peer.
        wire_dtype_for: the dtype a floating-point tensor of dtype ``d`` travels in to ``peer``
            (``None`` = unchanged); both ends of a pair must get the same answer.
        chunk_bytes: staging piece size in wire bytes; must agree on both ends of every pair
            (the group's agreed ``HetcommOptions.chunk_bytes``).
    """

    name = "bridge"

    def __init__(
        self,
        rank: int,
        transport_for: Callable[[int], Rail],
        wire_dtype_for: Callable[[int, torch.dtype], Optional[torch.dtype]],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        self.rank = rank
        self.transport_for = transport_for
        self.wire_dtype_for = wire_dtype_for
        self.chunk_bytes = int(chunk_bytes)
        self._copy_streams: Dict[torch.device, object] = {}

    def _wire(self, peer: int, dtype: torch.dtype) -> torch.dtype:
        if not dtype.is_floating_point:
            return dtype
        return self.wire_dtype_for(peer, dtype) or dtype

    def _copy_stream(self, device: torch.device, dev_mod):
        if device not in self._copy_streams:
            self._copy_streams[device] = dev_mod.Stream(device=device)
        return self._copy_streams[device]

    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        staged_s = [_Staged(x, self._wire(x.peer, x.tensor.dtype), self.chunk_bytes) for x in sends]
        staged_r = [_Staged(x, self._wire(x.peer, x.tensor.dtype), self.chunk_bytes) for x in recvs]
        device = next((x.tensor.device for x in list(sends) + list(recvs) if x.tensor.device.type != "cpu"), None)
        dev_mod = device_module(device) if device is not None else None
        copy_stream = None
        if dev_mod is not None:
            copy_stream = self._copy_stream(device, dev_mod)
            # Ordered after what the starting thread queued so far on its current stream (in a
            # collective: the rail stream, itself after the caller's stream; module docstring).
            ready = dev_mod.Event()
            ready.record(dev_mod.current_stream(device))
            copy_stream.wait_event(ready)
            for x in list(sends) + list(recvs):
                if x.tensor.device == device:
                    # The copy stream reads (sends) or writes (receives) this memory later; the
                    # caching allocator must not hand it out again before those copies ran.
                    x.tensor.record_stream(copy_stream)
        for s in staged_s:
            for r in range(len(s.pieces)):
                if copy_stream is not None and s.x.tensor.device.type != "cpu":
                    with dev_mod.stream(copy_stream):
                        s.view(r).copy_(s.dev(r), non_blocking=True)  # device -> pinned host, cast
                        ev = dev_mod.Event()
                        ev.record(copy_stream)
                    s.events[r] = ev
                elif r == 0:
                    s.host.copy_(s.flat)  # a host tensor: one plain copy (and cast)
            if not s.x.control:
                _record("bridge", bytes_sent=s.host.nbytes, chunks_sent=len(s.pieces))
        return _BridgeOp(self, staged_s, staged_r, op, seq, copy_stream, dev_mod)
