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
from typing import List, Sequence

import torch

__all__ = ["Xfer", "Rail", "RailOp", "as_bytes"]


@dataclass
class Xfer:
    """One transfer of a step.

    Attributes:
        peer: the other end (rank in the group).
        tensor: contiguous tensor to send from, or to receive into; any shape and dtype.
        tag: a number both ends compute the same way (the gloo rail uses it as the message tag).
        control: a control message (the split check), left out of ``hetcomm.stats()``.
    """

    peer: int
    tensor: torch.Tensor
    tag: int = 0
    control: bool = False


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``torch.uint8`` view of contiguous ``t`` (shares storage; ``[t.nbytes]``)."""
    assert t.is_contiguous(), "rails move contiguous tensors only"
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class RailOp(abc.ABC):
    """A step in flight on one rail.

    Attributes:
        rail: the rail's name.
        needs_polling: True when only :meth:`poll` makes progress (shm); False when other
            threads move the bytes and set the rail's wake-up event (gloo, nccl), so an idle
            executor may sleep on that event instead of polling.
        progressed: set by :meth:`poll`: whether the last call moved anything.
    """

    rail: str = "?"
    needs_polling: bool = False
    progressed: bool = False

    @abc.abstractmethod
    def poll(self) -> bool:
        """Make progress without blocking; True once every transfer of the step is done.

        Raises:
            CollectiveError: a transfer failed (the message names peer and rail).
        """

    @abc.abstractmethod
    def pending_peers(self) -> List[int]:
        """Peers with a transfer still in flight (for timeout messages)."""

    def finish(self) -> None:
        """Called once after :meth:`poll` returned True (e.g. unstage received bytes)."""


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
