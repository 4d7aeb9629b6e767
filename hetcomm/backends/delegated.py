"""Delegated collectives: the ones a hetcomm group runs on its inner gloo group.

all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter(_tensor), gather (also into one
tensor: :meth:`DelegatedCollectives.gather_single`), scatter, reduce, barrier and the coalesced
forms run on ``gloo0`` (:attr:`RailSet.gloo
<hetcomm.backends.railset.RailSet.gloo>`), so their results are gloo's. This module adds what gloo
lacks:

* **a cross-rank check before any byte moves** (:mod:`.checks`, on by default; ``check_splits`` /
  ``HETCOMM_CHECK=0`` turns it off): every rank publishes the collective's kind, its sequence
  number in the group, dtype, element count, reduce op and root — through the shared-memory
  board when the whole group shares memory, else one all_gather on the executor's gloo group —
  and every rank raises the same :class:`~hetcomm.errors.CrossRankMismatch` (a ``ValueError``)
  on a mismatch, where gloo would return garbage, time out, or abort the process. A rank whose
  own arguments are invalid (e.g. an all_gather output list of the wrong length) says so in its
  vector, so the others raise too instead of waiting for it. The check is ordered with the routed
  collectives' checks: a checked collective runs as a job of the group's executor (inline on the
  caller's thread when it blocks and nothing is queued), so ``gloo0`` sees collectives in call
  order on every rank;
* **strided views**: gloo reads and writes a non-contiguous tensor as if it were contiguous
  (``base[2:8:2]`` of 10 elements: it reduced ``base[2:5]``); such tensors are copied into
  contiguous buffers and back, so only the view's elements change;
* **dtypes gloo refuses** ("Invalid scalar type": int16, uint16, uint32, uint64, the float8
  kinds, complex32, ...): data-moving collectives carry their bytes (a ``uint8`` view);
  reductions run in a wider dtype (int16/uint16 -> int32, uint32 -> int64, float8/complex32 ->
  float32/complex64) and cast back, which wraps integers exactly like arithmetic in the narrow
  dtype; uint64 reduces as int64 bit patterns (SUM/PRODUCT/bitwise ops agree modulo 2**64;
  MIN/MAX/AVG are refused with a clear error);
* AVG reductions (gloo has none): run as SUM, then divided;
* errors that name the rank at fault (:mod:`.faults`) instead of gloo's connection text, raised as
  :class:`~hetcomm.errors.CollectiveError` from ``wait()``;
* statistics: every delegated collective counts in ``hetcomm.stats()`` under rail ``gloo``
  (``ops``, ``seconds_busy``, and bytes by the nccl-tests bus-bytes convention: an all_reduce of
  ``S`` bytes on ``n`` ranks moves ``2(n-1)/n * S`` per rank each way, an all_gather of an
  ``S``-byte output ``(n-1)/n * S``, a broadcast ``S``), so the train summary's "sent over" rows
  include the replica reductions.

Point-to-point ``send``/``recv`` are not collectives and are not checked (gloo matches them by
tag). C++ callers of methods the 2.13 trampoline does not forward (functional all_gather /
reduce_scatter) reach ``gloo0`` directly and are not checked either.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from hetcomm.backends import checks
from hetcomm.backends.faults import FaultDiagnosis, release_frames, wait_watching
from hetcomm.backends.rails.gloo import release_gloo
from hetcomm.backends.stats import record as _record
from hetcomm.backends.work import HetcommWork
from hetcomm.errors import CollectiveError

__all__ = ["DelegatedCollectives", "bus_bytes", "GLOO_DTYPES"]

#: dtypes ProcessGroupGloo (torch 2.13) accepts; every other one fails with "Invalid scalar type".
GLOO_DTYPES = frozenset(
    {
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
        torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    }
)
# Reductions in a dtype gloo refuses run in this one and are cast back.
_WIDER = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.float8_e4m3fn: torch.float32,
    torch.float8_e5m2: torch.float32,
    torch.float8_e4m3fnuz: torch.float32,
    torch.float8_e5m2fnuz: torch.float32,
    torch.float8_e8m0fnu: torch.float32,
    torch.complex32: torch.complex64,
}
# Ops whose result on int64 bit patterns equals the uint64 result modulo 2**64.
_MODULAR_OPS = ("SUM", "PRODUCT", "BAND", "BOR", "BXOR")
_OPS = (
    (dist.ReduceOp.SUM, "SUM"), (dist.ReduceOp.AVG, "AVG"), (dist.ReduceOp.PRODUCT, "PRODUCT"),
    (dist.ReduceOp.MIN, "MIN"), (dist.ReduceOp.MAX, "MAX"), (dist.ReduceOp.BAND, "BAND"),
    (dist.ReduceOp.BOR, "BOR"), (dist.ReduceOp.BXOR, "BXOR"), (dist.ReduceOp.PREMUL_SUM, "PREMUL_SUM"),
)


def _op_name(op) -> str:
    for member, name in _OPS:
        if op == member:
            return name
    return "UNUSED"


def _is_async(opts) -> bool:
    """Whether the caller keeps the Work (``async_op=True``, or a C++ caller: unknown)."""
    return True if opts is None else bool(opts.asyncOp)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sparse_nbytes(t: torch.Tensor) -> int:
    """Bytes of a sparse COO tensor's indices and values on this rank."""
    if t.layout != torch.sparse_coo:
        return 0
    return t._indices().numel() * t._indices().element_size() + t._values().numel() * t._values().element_size()


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


class _Staging:
    """Contiguous, gloo-accepted stand-ins for the caller's tensors, and the copies back.

    ``reduce``: the stand-in has a dtype gloo can reduce (see the module docstring); ``move``:
    the stand-in carries the same bytes (a ``uint8`` view when gloo refuses the dtype). A
    contiguous tensor of a gloo dtype is used as it is (no copy).
    """

    def __init__(self, mode: str, reduce_op: str = "SUM"):
        self.mode = mode
        self.reduce_op = reduce_op
        self.back: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (caller's tensor, stand-in)
        self.error: Optional[str] = None

    def wire_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """The dtype a reduction of ``dtype`` runs in, or None (then :attr:`error` says why)."""
        if dtype in GLOO_DTYPES:
            return dtype
        if dtype in _WIDER:
            return _WIDER[dtype]
        if dtype == torch.uint64:
            if self.reduce_op in _MODULAR_OPS:
                return torch.int64
            self.error = (
                f"{self.reduce_op} of torch.uint64 tensors is not supported (gloo has no unsigned 64-bit "
                f"reduction; SUM, PRODUCT and bitwise ops are): cast to torch.int64 or a float dtype first"
            )
            return None
        self.error = f"gloo cannot reduce {dtype}: cast to a float or int dtype first"
        return None

    def stage(self, t: torch.Tensor, is_output: bool) -> torch.Tensor:
        """The tensor to hand to gloo in place of ``t``."""
        if t.layout != torch.strided:
            # Refused through the cross-rank check (every rank raises): raising here, before
            # the check, left the ranks that passed dense tensors waiting for this one.
            self.error = (
                f"a {t.layout} tensor is not supported here (gloo moves dense tensors only and sums sparse "
                f"COO tensors in all_reduce only): call .to_dense() first"
            )
            return t
        if self.mode == "reduce":
            wire = self.wire_dtype(t.dtype)
            if wire is None:
                return t
            if wire == t.dtype and t.is_contiguous():
                return t
            if t.dtype == torch.uint64:  # bit patterns, not values
                s = t.contiguous().view(torch.int64)
                if is_output and s.data_ptr() != t.data_ptr():
                    self.back.append((t, s))
                return s
            s = t.to(dtype=wire, memory_format=torch.contiguous_format, copy=True)
        else:
            if t.dtype in GLOO_DTYPES:
                if t.is_contiguous():
                    return t
                s = t.contiguous()
            else:
                flat = t.contiguous().reshape(-1)
                try:
                    s = flat.view(torch.uint8)
                except RuntimeError as e:
                    self.error = f"cannot send tensors of {t.dtype} as bytes ({e}); cast them first"
                    return t
                if t.is_contiguous():
                    return s  # a view of t's own memory: nothing to copy back
        if is_output:
            self.back.append((t, s))
        return s

    def finish(self) -> None:
        """Copy the stand-ins of outputs back into the caller's tensors (casting back)."""
        for t, s in self.back:
            if s.dtype == torch.uint8 and t.dtype != torch.uint8:
                t.copy_(s.view(t.dtype).view(t.shape))
            elif t.dtype == torch.uint64:
                t.copy_(s.view(torch.uint64).view(t.shape))
            else:
                t.copy_(s.view(t.shape))


class _InFlight:
    """The completions running on gloo's threads now, so that a group's shutdown can wait for them.

    The callbacks a completion runs (the Work's future's: PowerSGD's hook chains three
    collectives there) may hold the caller's process groups. Had the caller destroyed them
    meanwhile, the callback thread would drop the last reference and ``~ProcessGroupGloo`` would
    join its own thread: ``std::system_error: Resource deadlock avoided``, the process aborted
    (seen once in ~1,500 tests: a gloo thread inside :meth:`_Completion.finish` while the main
    thread was in ``destroy_process_group``). The group face's :meth:`shutdown
    <hetcomm.backends.process_group._HetcommFace.shutdown>` waits until none runs.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._threads: Counter = Counter()  # thread ident -> completions it is inside

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._threads[me] += 1
        try:
            yield
        finally:
            with self._cond:
                self._threads[me] -= 1
                if not self._threads[me]:
                    del self._threads[me]
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no other thread is inside a completion (this one may be: a callback that
        destroys the group must not wait for itself); False after ``timeout_s``."""
        me = threading.get_ident()
        with self._cond:
            return self._cond.wait_for(lambda: not (set(self._threads) - {me}), timeout_s)


class _Completion:
    """Completes a delegated collective's Work once gloo's op has finished.

    Holds the group's fault diagnosis weakly: the callback runs on a gloo thread and may outlive
    the group, and the last reference dropping there would join gloo's threads from one of them.
    """

    def __init__(self, work: HetcommWork, op: str, rank: int, seq: int, faults_ref, staging, after, nbytes: int, complete,
                 in_flight: _InFlight):
        self.in_flight = in_flight
        self.work = work
        #: ``Executor.complete``: at once on a gloo thread, deferred until the job released the
        #: executor when called inside one (its callbacks may start and wait for collectives).
        self._complete_ref = weakref.WeakMethod(complete)
        self.op = op
        self.rank = rank
        self.seq = seq
        self.faults_ref = faults_ref
        self.staging = staging
        self.after = after
        self.nbytes = nbytes
        self.t0 = time.perf_counter()

    def complete(self, work: HetcommWork, exc: Optional[BaseException]) -> None:
        executor_complete = self._complete_ref()
        if executor_complete is not None:
            executor_complete(work, exc)
        else:  # the group is gone: nothing is queued any more
            work._complete(exc)

    def callback(self, fut: "torch.futures.Future") -> None:
        with self.in_flight.running():
            try:
                fut.value()
            except Exception as e:
                self.finish(e)
            else:
                self.finish(None)

    def finish(self, error: Optional[BaseException]) -> None:
        if error is not None:
            faults = self.faults_ref()
            if faults is not None:
                late = faults.late_error(CollectiveError(f"failed: {error}", op=self.op, rank=self.rank, rail="gloo"), self.seq)
                if late is not None:
                    self.complete(self.work, release_frames(late))
                    return
            ranks, text = faults.culprits(self.seq) if faults is not None else ([], "")
            err = CollectiveError(
                f"failed{text}: {error}", op=self.op, rank=self.rank, peer=ranks[0] if ranks else None, rail="gloo",
                diagnosed=True,
            )
            err.__cause__ = error
            self.complete(self.work, release_frames(err))
            return
        try:
            if self.after is not None:
                self.after()
            if self.staging is not None:
                self.staging.finish()
        except BaseException as e:  # e.g. a copy back that fails: the caller must hear of it
            self.complete(self.work, release_frames(e))
            return
        _record("gloo", bytes_sent=self.nbytes, bytes_received=self.nbytes, seconds_busy=time.perf_counter() - self.t0, ops=1)
        self.complete(self.work, None)


@dataclass
class _Call:
    """One delegated collective, described for the check and the job."""

    kind: str
    dtype: Optional[torch.dtype] = None
    count: int = 0
    shape: Tuple[int, ...] = ()
    reduce_op: Optional[str] = None
    root: Optional[int] = None
    local_error: Optional[str] = None
    payload: int = 0
    #: The kind the cross-rank check compares when it differs from ``kind`` (the op name in
    #: errors): a sparse all_reduce is another collective on the wire than a dense one.
    check_kind: Optional[str] = None


class DelegatedCollectives:
    """The delegated collectives of one group on this rank.

    Args:
        gloo: the inner ``ProcessGroupGloo`` (``gloo0``).
        rank / size: this process in the group.
        faults: names the rank at fault when a collective fails.
        routed: the group's routed collectives: their sequence counter, executor and metadata
            exchange order the checks of both kinds (:class:`~hetcomm.backends.routed.RoutedCollectives`).
    """

    def __init__(self, gloo, rank: int, size: int, faults: FaultDiagnosis, routed):
        self.gloo = gloo
        self.rank = rank
        self.size = size
        self.faults = faults
        self.routed = routed
        #: Completions running on gloo's threads (:class:`_InFlight`); shutdown waits for them.
        self.in_flight = _InFlight()

    # -- the common path ----------------------------------------------------------------------
    def _run(
        self,
        call: _Call,
        launch: Callable[[], "dist.Work"],
        result: List[torch.Tensor],
        staging: Optional[_Staging],
        async_op: bool,
        after: Optional[Callable[[], None]] = None,
        bus_op: Optional[str] = None,
    ) -> HetcommWork:
        """Check ``call`` across ranks (when the check is on), then ``launch()`` the gloo op; when
        it completes, run ``after`` (AVG's division), copy staged outputs back, count it and
        complete the returned Work.

        The check and the launch run in the executor's order (so ``gloo0`` sees collectives in
        call order on every rank). A blocking call then waits for gloo right there; an async one
        completes from gloo's future, on a gloo thread, as before the check existed. Completions
        made inside the job (a blocking call, a refusal, a gloo op that finished before its
        callback was attached) go through ``Executor.complete``, which defers them until the job
        released the executor and hands the queue to a new thread before running callbacks on
        the executor's own thread: a callback that starts and waits for another collective
        (PowerSGD's hook does) never waits for itself.

        Raises (from the Work): CrossRankMismatch on every rank when the ranks' calls do not fit;
        CollectiveError naming the rank at fault when gloo fails.
        """
        routed = self.routed
        seq = routed.next_seq()
        local_error = call.local_error
        if local_error is None and staging is not None and staging.error is not None:
            local_error = staging.error
        checked = routed.options.check_splits
        if local_error is not None and not checked:
            raise checks.refusal(call.kind, self.rank, local_error)
        meta = None
        if checked:
            meta = checks.encode_collective(
                call.check_kind or call.kind, seq, self.size, call.dtype, call.count, call.shape, call.reduce_op, call.root,
                local_problem=local_error is not None,
            )
        user = HetcommWork(result, seq)
        executor = routed.executor
        done = _Completion(
            user, call.kind, self.rank, seq, weakref.ref(self.faults), staging, after,
            bus_bytes(bus_op or call.kind, call.payload, self.size), executor.complete, self.in_flight,
        )
        faults = self.faults
        kind = call.kind
        inner = self.gloo

        def job(w: HetcommWork) -> None:
            try:
                if meta is not None:
                    routed.exchange_meta(kind, seq, meta, "elements", local_error=local_error)
                gwork = launch()
            except CollectiveError as e:
                executor.complete(user, release_frames(faults.blame(e, seq)))
                return
            except BaseException as e:  # CrossRankMismatch, or gloo refusing at once
                executor.complete(user, release_frames(e))
                return
            fut = None
            if async_op:
                try:
                    fut = gwork.get_future()
                except RuntimeError:  # gloo reduce_scatter/gather/scatter Works have no future
                    fut = None
            if fut is None:  # a blocking call waits here: no hand-off through a gloo callback thread
                try:
                    lost = wait_watching(gwork, faults, seq, kind, release=lambda p: release_gloo(inner, p))
                except Exception as e:
                    done.finish(e)
                else:
                    if lost is not None:  # a peer stopped or exited while gloo waits for it
                        done.complete(done.work, release_frames(lost))
                    else:
                        done.finish(None)
            else:
                fut.then(done.callback)

        routed.executor.submit(job, HetcommWork([], seq), async_op)
        return user

    def _reduce_opts(self, opts, cls):
        """``(gloo options, op name)``: AVG becomes SUM (gloo has no AVG; divided afterwards)."""
        name = _op_name(opts.reduceOp)
        o = cls()
        o.timeout = opts.timeout
        if isinstance(opts, dist.ReduceOptions):
            o.rootRank = opts.rootRank
            o.rootTensor = opts.rootTensor
        o.reduceOp = dist.ReduceOp.SUM if name == "AVG" else opts.reduceOp
        return o, name

    # -- the collectives ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        o, name = self._reduce_opts(opts, dist.AllreduceOptions)
        t = tensors[0]
        if t.layout != torch.strided:
            return self._sparse_allreduce(tensors, o, name, opts)
        call = _Call("all_reduce", t.dtype, t.numel(), tuple(t.shape), name, payload=_nbytes(tensors))
        if len(tensors) != 1:
            call.local_error = f"all_reduce takes one tensor per process, got {len(tensors)}"
        st = _Staging("reduce", name)
        staged = [st.stage(x, True) for x in tensors]
        n = self.size
        after = (lambda: _divide(staged, n)) if name == "AVG" else None
        return self._run(call, lambda: self.gloo.allreduce(staged, o), list(tensors), st, _is_async(opts), after)

    def _sparse_allreduce(self, tensors, o, name: str, opts):
        """``all_reduce`` of a sparse COO tensor: gloo's own sparse all-reduce (it
        gathers every rank's indices and values and sums them; the result, coalesced, replaces
        the caller's tensor), after the same cross-rank check on the dense shape. No staging: a
        sparse tensor has no strided layout to copy into. SUM, and AVG as SUM then divide; gloo
        refuses other ops and other sparse layouts, which are refused here on every rank."""
        t = tensors[0]
        call = _Call("all_reduce", t.dtype, t.numel(), tuple(t.shape), name, payload=_sparse_nbytes(t) * self.size,
                     check_kind="all_reduce_sparse")
        if len(tensors) != 1:
            call.local_error = f"all_reduce takes one tensor per process, got {len(tensors)}"
        elif t.layout != torch.sparse_coo:
            call.local_error = f"all_reduce of a {t.layout} tensor is not supported (gloo reduces sparse COO only): call .to_sparse_coo() first"
        elif name not in ("SUM", "AVG"):
            call.local_error = f"{name} of sparse tensors is not supported (gloo sums sparse tensors only): use SUM or AVG, or .to_dense() first"
        elif t.dtype not in GLOO_DTYPES:
            call.local_error = f"gloo cannot reduce sparse {t.dtype} tensors: cast the values to a float or int dtype first"
        n = self.size
        after = (lambda: _divide(list(tensors), n)) if name == "AVG" else None
        # bus bytes as an all_gather of every rank's indices and values (what gloo moves)
        return self._run(call, lambda: self.gloo.allreduce(list(tensors), o), list(tensors), None, _is_async(opts), after, bus_op="all_gather")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        name = _op_name(opts.reduceOp)
        call = _Call(
            "all_reduce_coalesced", tensors[0].dtype if tensors else None, sum(t.numel() for t in tensors),
            (len(tensors),), name, payload=_nbytes(tensors),
        )
        if len({t.dtype for t in tensors}) > 1:
            call.local_error = "all_reduce_coalesced needs tensors of one dtype"
        if name == "AVG":
            call.local_error = "all_reduce_coalesced has no AVG on gloo; use SUM and divide, or all_reduce"
        st = _Staging("reduce", name)
        staged = [st.stage(x, True) for x in tensors]
        return self._run(call, lambda: self.gloo.allreduce_coalesced(staged, opts), list(tensors), st, _is_async(opts))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = tensors[0]
        call = _Call("broadcast", t.dtype, t.numel(), tuple(t.shape), root=opts.rootRank, payload=_nbytes(tensors))
        call.local_error = self._root_error(opts.rootRank)
        st = _Staging("move")
        staged = [st.stage(x, True) for x in tensors]
        return self._run(call, lambda: self.gloo.broadcast(staged, opts), list(tensors), st, _is_async(opts))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        o, name = self._reduce_opts(opts, dist.ReduceOptions)
        t = tensors[0]
        call = _Call("reduce", t.dtype, t.numel(), tuple(t.shape), name, opts.rootRank, payload=_nbytes(tensors))
        call.local_error = self._root_error(opts.rootRank)
        st = _Staging("reduce", name)
        staged = [st.stage(x, True) for x in tensors]
        # Only the root holds the sum; the other ranks' tensors are left as gloo leaves them.
        n = self.size
        after = (lambda: _divide(staged, n)) if name == "AVG" and self.rank == opts.rootRank else None
        return self._run(call, lambda: self.gloo.reduce(staged, o), list(tensors), st, _is_async(opts), after)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        t = input_tensors[0]
        outs = output_tensors[0] if output_tensors else []
        call = _Call("all_gather", t.dtype, t.numel(), tuple(t.shape), payload=sum(_nbytes(ts) for ts in output_tensors))
        call.local_error = self._list_error("output_tensors", outs, t, self.size)
        st = _Staging("move")
        s_in = [st.stage(t, False)]
        s_out = [[st.stage(x, True) for x in outs]]
        return self._run(call, lambda: self.gloo.allgather(s_out, s_in, opts), list(outs), st, _is_async(opts))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        call = _Call(
            "all_gather_coalesced", input_list[0].dtype if input_list else None, sum(t.numel() for t in input_list),
            (len(input_list),), payload=sum(_nbytes(ts) for ts in output_lists),
        )
        st = _Staging("move")
        s_in = [st.stage(t, False) for t in input_list]
        s_out = [[st.stage(x, True) for x in ts] for ts in output_lists]
        result = [x for ts in output_lists for x in ts]
        return self._run(call, lambda: self.gloo.allgather_coalesced(s_out, s_in, opts), result, st, _is_async(opts))

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        call = _Call("all_gather_into_tensor", input.dtype, input.numel(), tuple(input.shape), payload=_nbytes([output]))
        if output.numel() != self.size * input.numel() or output.dtype != input.dtype:
            call.local_error = (
                f"the output has {output.numel()} elements of {output.dtype}; all_gather_into_tensor needs "
                f"group size x input = {self.size} x {input.numel()} elements of {input.dtype}"
            )
        st = _Staging("move")
        s_in, s_out = st.stage(input, False), st.stage(output, True)
        return self._run(call, lambda: self.gloo._allgather_base(s_out, s_in, opts), [output], st, _is_async(opts))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        o, name = self._reduce_opts(opts, dist.ReduceScatterOptions)
        out = output_tensors[0]
        ins = input_lists[0] if input_lists else []
        call = _Call("reduce_scatter", out.dtype, out.numel(), tuple(out.shape), name, payload=sum(_nbytes(ts) for ts in input_lists))
        call.local_error = self._list_error("input_list", ins, out, self.size)
        st = _Staging("reduce", name)
        s_out = [st.stage(out, True)]
        s_in = [[st.stage(x, False) for x in ins]]
        n = self.size
        after = (lambda: _divide(s_out, n)) if name == "AVG" else None
        return self._run(call, lambda: self.gloo.reduce_scatter(s_out, s_in, o), [out], st, _is_async(opts), after)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        o, name = self._reduce_opts(opts, dist.ReduceScatterOptions)
        call = _Call("reduce_scatter_tensor", output.dtype, output.numel(), tuple(output.shape), name, payload=_nbytes([input]))
        if input.numel() != self.size * output.numel() or output.dtype != input.dtype:
            call.local_error = (
                f"the input has {input.numel()} elements of {input.dtype}; reduce_scatter_tensor needs "
                f"group size x output = {self.size} x {output.numel()} elements of {output.dtype}"
            )
        st = _Staging("reduce", name)
        s_out, s_in = st.stage(output, True), st.stage(input, False)
        n = self.size
        after = (lambda: _divide([s_out], n)) if name == "AVG" else None
        return self._run(call, lambda: self.gloo._reduce_scatter_base(s_out, s_in, o), [output], st, _is_async(opts), after)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        t = input_tensors[0]
        outs = output_tensors[0] if output_tensors else []
        call = _Call("gather", t.dtype, t.numel(), tuple(t.shape), root=opts.rootRank, payload=_nbytes(input_tensors) * self.size)
        call.local_error = self._root_error(opts.rootRank)
        if call.local_error is None and self.rank == opts.rootRank:
            call.local_error = self._list_error("gather_list", outs, t, self.size)
        st = _Staging("move")
        s_in = [st.stage(t, False)]
        s_out = [[st.stage(x, True) for x in outs]] if output_tensors else []
        return self._run(call, lambda: self.gloo.gather(s_out, s_in, opts), list(outs), st, _is_async(opts))

    def gather_single(self, output, input, opts=None):
        """Gather into one tensor (``dist.gather_into_tensor``'s semantics): every rank's
        ``input`` (any shape, ``numel`` elements, one dtype on every rank) lands in rank order in
        the root's ``output`` (``size * numel`` elements: flat or ``[size, *input.shape]``).
        Off the root ``output`` is unused (an empty tensor)."""
        opts = opts if opts is not None else dist.GatherOptions()
        root = opts.rootRank
        call = _Call("gather_into_tensor", input.dtype, input.numel(), tuple(input.shape), root=root,
                     payload=_nbytes([input]) * self.size)
        call.local_error = self._root_error(root)
        if call.local_error is None and self.rank == root and (
            output.numel() != self.size * input.numel() or output.dtype != input.dtype
        ):
            call.local_error = (
                f"the output on dst (group rank {root}) has {output.numel()} elements of {output.dtype}; "
                f"gather_into_tensor needs group size x input = {self.size} x {input.numel()} elements of "
                f"{input.dtype}: pass a tensor of shape ({self.size} * tensor.numel(),) or "
                f"({self.size}, *tensor.shape)"
            )
        st = _Staging("move")
        s_in = [st.stage(input, False)]
        s_out = []
        if self.rank == root and call.local_error is None:
            # gloo's list gather into the rows of the root's (staged, contiguous) output: the
            # same bytes as torch 2.14's gloo gather_single, and the one path on 2.13 too, whose
            # gloo has no gather_single
            whole = st.stage(output, True)
            s_out = [list(whole.view(self.size, *s_in[0].shape).unbind(0))] if st.error is None else []
        return self._run(call, lambda: self.gloo.gather(s_out, s_in, opts), [output], st, _is_async(opts))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        out = output_tensors[0]
        ins = input_tensors[0] if input_tensors else []
        call = _Call("scatter", out.dtype, out.numel(), tuple(out.shape), root=opts.rootRank, payload=_nbytes(output_tensors) * self.size)
        call.local_error = self._root_error(opts.rootRank)
        if call.local_error is None and self.rank == opts.rootRank:
            call.local_error = self._list_error("scatter_list", ins, out, self.size)
        st = _Staging("move")
        s_out = [st.stage(out, True)]
        s_in = [[st.stage(x, False) for x in ins]] if input_tensors else []
        return self._run(call, lambda: self.gloo.scatter(s_out, s_in, opts), [out], st, _is_async(opts))

    def barrier(self, opts=None):
        o = dist.BarrierOptions()
        if opts is not None:
            o.timeout = opts.timeout
        return self._run(_Call("barrier"), lambda: self.gloo.barrier(o), [], None, _is_async(opts))

    # -- local validation (reported through the check, so every rank raises) --------------------
    def _root_error(self, root: int) -> Optional[str]:
        if not 0 <= root < self.size:
            return f"root {root} is not a rank of this group of {self.size}"
        return None

    @staticmethod
    def _list_error(name: str, tensors: Sequence[torch.Tensor], like: torch.Tensor, n: int) -> Optional[str]:
        if len(tensors) != n:
            return f"{name} has {len(tensors)} tensors for a group of {n}"
        for i, x in enumerate(tensors):
            if x.numel() != like.numel() or x.dtype != like.dtype:
                return (
                    f"{name}[{i}] has {x.numel()} elements of {x.dtype} but the other side has "
                    f"{like.numel()} of {like.dtype}"
                )
        return None


def _divide(tensors: List[torch.Tensor], n: int) -> List[torch.Tensor]:
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")
    return tensors
