"""The rail interface: post a step of sends and receives to some peers, then poll it to the end.

A *step* is what one collective asks of one rail: a list of contiguous tensors to send, each to
one peer, and a list of contiguous tensors to fill, each from one peer. Both ends of a pair post
the matching transfers in the same order (the executor guarantees it), so a rail can treat each
ordered pair as a FIFO stream and needs no matching by tag beyond what its transport wants.

Rails are driven by one thread per process group (the executor's): :meth:`RailOp.poll` makes
whatever progress is possible without blocking and says whether the step is done; it raises
:class:`~hetcomm.errors.CollectiveError` naming the peer and the rail when a transfer failed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from hetcomm.errors import CollectiveError

__all__ = ["Xfer", "Rail", "RailOp", "CompositeOp", "as_bytes"]


@dataclass
class Xfer:
    """One transfer of a step.

    Attributes:
        peer: the other end (rank in the group).
        tensor: contiguous tensor to send from, or to receive into; any shape and dtype.
        tag: a number both ends compute the same way (the gloo rail uses it as the message tag).
        control: a control message (the split check), left out of ``hetcomm.stats()``.
        where: for a receive, ``(peer, row_start, num_rows)`` of the output it fills (reported
            to ``Work.arrivals()`` once it landed); None when nobody asks.
    """

    peer: int
    tensor: torch.Tensor
    tag: int = 0
    control: bool = False
    where: Optional[Tuple[int, int, int]] = None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``torch.uint8`` view of contiguous ``t`` (shares storage; ``[t.nbytes]``)."""
    assert t.is_contiguous(), "rails move contiguous tensors only"
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class RailOp(abc.ABC):
    """A step in flight on one rail.

    Every hook between the executor and a rail is declared here, with its default; the executor
    never probes an op for optional attributes.

    Attributes:
        rail: the rail's name.
        needs_polling: True when only :meth:`poll` makes progress (shm); False when other
            threads move the bytes and set the rail's wake-up event (gloo, nccl), so an idle
            executor may sleep on that event instead of polling.
        can_block: True when :meth:`block` may be called: every transfer is moved by another
            thread and waiting for it in the caller's thread is allowed (gloo).
        progressed: set by :meth:`poll`: whether the last call moved anything.
        arrived_xfers: receives that landed during the last polls and were not yet taken by
            :meth:`take_arrivals` (ops that cannot report single chunks leave it empty).
        abandoned: the error the step was abandoned with (:meth:`abandon`), else None.
    """

    rail: str = "?"
    needs_polling: bool = False
    can_block: bool = False
    progressed: bool = False
    arrived_xfers: Sequence[Xfer] = ()
    abandoned: Optional[CollectiveError] = None

    @abc.abstractmethod
    def poll(self) -> bool:
        """Make progress without blocking; True once every transfer of the step is done.

        Raises:
            CollectiveError: a transfer failed (the error names peer and rail).
        """

    @abc.abstractmethod
    def pending_peers(self) -> List[int]:
        """Peers with a transfer still in flight (for timeout messages)."""

    def finish(self) -> None:
        """Called once after :meth:`poll` returned True (e.g. unstage received bytes)."""

    def block(self) -> None:
        """Wait in the calling thread until every transfer is done (only when ``can_block``)."""
        raise NotImplementedError(f"rail {self.rail} cannot block")

    def take_arrivals(self) -> List[Xfer]:
        """The receives that landed since the last call (each reported once)."""
        got = list(self.arrived_xfers)
        if got:
            self.arrived_xfers = []
        return got

    def abandon(self, error: CollectiveError) -> None:
        """End the step with ``error`` (a peer it waits for is certainly lost: the heartbeat saw
        it exit or stop). May be called from another thread while one waits in :meth:`block`:
        a rail whose waits only another thread can end (gloo) releases them here; afterwards
        :meth:`poll` raises ``error``. The default records it (polled rails never block)."""
        if self.abandoned is None:
            self.abandoned = error


class CompositeOp(RailOp):
    """Several steps polled as one: the one loop behind the executor's wait, the striped rail
    (one sub-step per port) and the bridge (one sub-step per host transport).

    Args:
        ops: the sub-steps.
        rail: the name the composite reports (``"gloo"`` for stripes, ``"bridge"``).
        on_error: maps a sub-step's :class:`CollectiveError` to the one to raise (default:
            raised as is); the bridge names itself as the rail.
    """

    def __init__(
        self,
        ops: Sequence[RailOp],
        rail: str = "?",
        on_error: Optional[Callable[[RailOp, CollectiveError], CollectiveError]] = None,
    ):
        self.ops: List[RailOp] = list(ops)
        self.rail = rail
        self.on_error = on_error
        self.needs_polling = any(o.needs_polling for o in self.ops)
        self.can_block = all(o.can_block for o in self.ops)
        self.progressed = False
        self.arrived_xfers: List[Xfer] = []

    def poll(self) -> bool:
        if self.abandoned is not None:
            raise self.abandoned
        still: List[RailOp] = []
        progressed = False
        for o in self.ops:
            try:
                if o.abandoned is not None:
                    raise o.abandoned
                done = o.poll()
            except CollectiveError as e:
                if self.on_error is None:
                    raise
                raise self.on_error(o, e) from e
            self.arrived_xfers.extend(o.take_arrivals())
            if done:
                o.finish()
                progressed = True
            else:
                progressed = progressed or o.progressed
                still.append(o)
        self.ops = still
        self.progressed = progressed
        # The remaining ops may all be thread-driven now (an shm sub-step finished).
        self.needs_polling = any(o.needs_polling for o in still)
        self.can_block = all(o.can_block for o in still)
        return not still

    def block(self) -> None:
        """Wait in this thread for every sub-step (all thread-driven)."""
        for o in self.ops:
            if self.abandoned is not None or o.abandoned is not None:
                return
            o.block()

    def abandon(self, error: CollectiveError) -> None:
        """Abandon every sub-step (see :meth:`RailOp.abandon`)."""
        if self.abandoned is None:
            self.abandoned = error
        for o in list(self.ops):
            o.abandon(error)

    def pending_peers(self) -> List[int]:
        return sorted({p for o in self.ops for p in o.pending_peers()})

    def pending_rails(self) -> List[str]:
        """Rails with a sub-step still in flight (for timeout messages)."""
        return sorted({o.rail for o in self.ops})


class Rail(abc.ABC):
    """A transport between this rank and some peers."""

    name: str = "?"

    @abc.abstractmethod
    def start(self, sends: Sequence[Xfer], recvs: Sequence[Xfer], op: str, seq: int) -> RailOp:
        """Post one step.

        Args:
            sends: tensors to send (contiguous; read until the step is done).
            recvs: tensors to fill (contiguous; valid once the step is done).
            op: the collective, for error messages (``all_to_all_single``).
            seq: the collective's sequence number in the group (same on every rank).
        """

    def close(self) -> None:
        """Release the rail's resources (idempotent)."""
