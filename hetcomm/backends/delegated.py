"""Delegated collectives: the ones a hetcomm group runs on its inner gloo group unchanged.

all_reduce, broadcast, all_gather, reduce_scatter, gather, scatter, reduce and barrier run on
``gloo0`` (:attr:`RailSet.gloo <hetcomm.backends.railset.RailSet.gloo>`), so their results are
exactly gloo's. This module adds what gloo lacks:

* AVG reductions (gloo has none): run as SUM, then divided;
* errors that name the rank at fault (:mod:`.faults`) instead of gloo's connection text, raised as
  :class:`~hetcomm.errors.CollectiveError` from ``wait()``;
* statistics: every delegated collective counts in ``hetcomm.stats()`` under rail ``gloo``
  (``ops``, ``seconds_busy``, and bytes by the nccl-tests bus-bytes convention: an all_reduce of
  ``S`` bytes on ``n`` ranks moves ``2(n-1)/n * S`` per rank each way, an all_gather of an
  ``S``-byte output ``(n-1)/n * S``, a broadcast ``S``), so the train summary's "sent over" rows
  include the replica reductions.
"""

from __future__ import annotations

import time
import weakref
from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from hetcomm.backends.faults import FaultDiagnosis
from hetcomm.backends.stats import record as _record
from hetcomm.backends.work import FutureWork
from hetcomm.errors import CollectiveError

__all__ = ["DelegatedCollectives", "bus_bytes"]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bus_bytes(op: str, payload: int, n: int) -> int:
    """Bytes one rank moves each way for collective ``op`` on ``payload`` bytes (nccl-tests'
    bus-bytes convention; ``payload`` = the tensor of an all_reduce/broadcast/reduce, the output
    of an all_gather/gather, the input of a reduce_scatter/scatter)."""
    if n <= 1:
        return 0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) * payload // n
    if op in ("broadcast", "reduce"):
        return payload
    return (n - 1) * payload // n


class DelegatedCollectives:
    """The delegated collectives of one group on this rank.

    Args:
        gloo: the inner ``ProcessGroupGloo`` (``gloo0``).
        rank / size: this process in the group.
        faults: names the rank at fault when a collective fails.
    """

    def __init__(self, gloo, rank: int, size: int, faults: FaultDiagnosis):
        self.gloo = gloo
        self.rank = rank
        self.size = size
        self.faults = faults
        self._dseq = 0

    def _next_diag_seq(self) -> int:
        self._dseq += 1
        return -self._dseq  # delegated collectives count down, routed ones up: separate diag keys

    # -- Work wrappers ----------------------------------------------------------------------------
    def _guard(
        self, op: str, fut: "torch.futures.Future", errors: List[BaseException], nbytes: int
    ) -> "torch.futures.Future":
        """Chain ``fut`` so that a failure becomes a CollectiveError naming the peer at fault
        (also appended to ``errors``, so that :class:`FutureWork` can re-raise it as such) and a
        success is counted in the statistics."""
        seq = self._next_diag_seq()
        # The callback runs on a gloo thread and may outlive the group: hold the diagnosis
        # weakly, or the last reference could drop there and join gloo's threads from one of them.
        faults_ref = weakref.ref(self.faults)
        rank = self.rank
        t0 = time.perf_counter()

        def check(f: "torch.futures.Future"):
            try:
                value = f.value()
            except Exception as e:
                faults = faults_ref()
                ranks, text = faults.culprits(seq) if faults is not None else ([], "")
                err = CollectiveError(
                    f"failed{text}: {e}", op=op, rank=rank, peer=ranks[0] if ranks else None, rail="gloo", diagnosed=True
                )
                errors.append(err)
                raise err from e
            _record("gloo", bytes_sent=nbytes, bytes_received=nbytes, seconds_busy=time.perf_counter() - t0, ops=1)
            return value

        return fut.then(check)

    def wrap(self, op: str, work: "dist.Work", payload: int) -> "dist.Work":
        """A gloo Work as a Work whose failure names the peer at fault and that counts in stats."""
        nbytes = bus_bytes(op, payload, self.size)
        errors: List[BaseException] = []
        try:
            fut = work.get_future()
        except RuntimeError:  # gloo reduce_scatter/gather/scatter/p2p Works have no future
            return _GuardedWork(work, op, self, nbytes)
        return FutureWork(self._guard(op, fut, errors, nbytes), errors)

    def avg_as_sum(self, name: str, opts, launch: Callable, finish: Callable[[int], list], payload: int):
        """gloo has no AVG: run the reduction with SUM (``launch(sum_opts)`` returns the gloo Work),
        then ``finish(group_size)`` divides the results (see :func:`_divide`) and returns the
        future's value."""
        o = type(opts)()
        o.timeout = opts.timeout
        if isinstance(opts, (dist.ReduceOptions,)):
            o.rootRank = opts.rootRank
            o.rootTensor = opts.rootTensor
        o.reduceOp = dist.ReduceOp.SUM
        errors: List[BaseException] = []
        fut = self._guard(name, launch(o).get_future(), errors, bus_bytes(name, payload, self.size))
        return FutureWork(fut.then(lambda f, n=self.size: finish(n)), errors)

    # -- the collectives ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        payload = _nbytes(tensors)
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self.avg_as_sum("all_reduce", opts, lambda o: self.gloo.allreduce(tensors, o), lambda n: _divide(tensors, n), payload)
        return self.wrap("all_reduce", self.gloo.allreduce(tensors, opts), payload)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self.wrap("all_reduce_coalesced", self.gloo.allreduce_coalesced(tensors, opts), _nbytes(tensors))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self.wrap("broadcast", self.gloo.broadcast(tensors, opts), _nbytes(tensors))

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        payload = sum(_nbytes(ts) for ts in output_tensors)
        return self.wrap("all_gather", self.gloo.allgather(output_tensors, input_tensors, opts), payload)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        payload = sum(_nbytes(ts) for ts in output_lists)
        return self.wrap("all_gather_coalesced", self.gloo.allgather_coalesced(output_lists, input_list, opts), payload)

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self.wrap("all_gather_into_tensor", self.gloo._allgather_base(output, input, opts), _nbytes([output]))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        payload = sum(_nbytes(ts) for ts in input_lists)
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self.avg_as_sum(
                "reduce_scatter", opts, lambda o: self.gloo.reduce_scatter(output_tensors, input_lists, o),
                lambda n: _divide(list(output_tensors), n), payload,
            )
        return self.wrap("reduce_scatter", self.gloo.reduce_scatter(output_tensors, input_lists, opts), payload)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        payload = _nbytes([input])
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self.avg_as_sum(
                "reduce_scatter_tensor", opts, lambda o: self.gloo._reduce_scatter_base(output, input, o),
                lambda n: _divide([output], n), payload,
            )
        return self.wrap("reduce_scatter_tensor", self.gloo._reduce_scatter_base(output, input, opts), payload)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        payload = _nbytes(tensors)
        if opts.reduceOp == dist.ReduceOp.AVG:
            # Only the root holds the sum; the other ranks' tensors are left as gloo leaves them.
            on_root = self.rank == opts.rootRank
            return self.avg_as_sum(
                "reduce", opts, lambda o: self.gloo.reduce(tensors, o),
                lambda n: _divide(tensors, n) if on_root else tensors, payload,
            )
        return self.wrap("reduce", self.gloo.reduce(tensors, opts), payload)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        payload = _nbytes(input_tensors) * self.size
        return self.wrap("gather", self.gloo.gather(output_tensors, input_tensors, opts), payload)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        payload = _nbytes(output_tensors) * self.size
        return self.wrap("scatter", self.gloo.scatter(output_tensors, input_tensors, opts), payload)

    def barrier(self, opts=None):
        o = dist.BarrierOptions()
        if opts is not None:
            o.timeout = opts.timeout
        return self.wrap("barrier", self.gloo.barrier(o), 0)


class _GuardedWork(dist.Work):
    """An inner Work without a future: ``wait()`` names the peer at fault when it fails and
    counts the collective in the statistics when it succeeds."""

    def __init__(self, inner: "dist.Work", op: str, owner: DelegatedCollectives, nbytes: int):
        super().__init__()
        self._inner = inner
        self._op = op
        self._faults = weakref.ref(owner.faults)
        self._rank = owner.rank
        self._seq = owner._next_diag_seq()
        self._nbytes = nbytes
        self._t0 = time.perf_counter()
        self._counted = False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            out = self._inner.wait()
        except Exception as e:
            faults = self._faults()
            ranks, text = faults.culprits(self._seq) if faults is not None else ([], "")
            raise CollectiveError(
                f"failed{text}: {e}", op=self._op, rank=self._rank, peer=ranks[0] if ranks else None, rail="gloo", diagnosed=True
            ) from e
        if not self._counted:
            self._counted = True
            _record("gloo", bytes_sent=self._nbytes, bytes_received=self._nbytes, seconds_busy=time.perf_counter() - self._t0, ops=1)
        return out

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> "torch.futures.Future":
        return self._inner.get_future()


def _divide(tensors: List[torch.Tensor], n: int) -> List[torch.Tensor]:
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")
    return tensors
