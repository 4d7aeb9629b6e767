"""Routed collectives of a hetcomm group: every peer's bytes over that peer's rail.

``all_to_all_single``, ``all_to_all`` (list form) and plans run here, on the group's
:class:`~hetcomm.backends.executor.Executor`, after a cross-rank check of split sizes, dtype and
row shape (:mod:`.checks`; through the shared-memory board, one gloo all_gather, or a round of
tiny messages over the rails). Their Work raises the collective's error from ``wait()`` and from
its future. The c10d face (:mod:`.process_group`) and the communicator call these.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from hetcomm.backends import checks, devices
from hetcomm.backends.executor import Executor, chunk_rows, direct_all_to_all, drive, execute_plan, meta_tag, start_step, tag_for
from hetcomm.backends.delegated import GLOO_DTYPES
from hetcomm.backends.faults import FaultDiagnosis, wait_watching
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.planpick import PlanChooser
from hetcomm.backends.rank_placement import Placement
from hetcomm.backends.railset import RailSet
from hetcomm.backends.rails import cma
from hetcomm.backends.rails.gloo import release_gloo
from hetcomm.backends.rails.base import Xfer
from hetcomm.backends.stats import record as _record
from hetcomm.backends.work import HetcommWork
from hetcomm.errors import CollectiveError, UsageError

__all__ = ["RoutedCollectives"]


class RoutedCollectives:
    """The routed collectives of one group on this rank.

    Args:
        rails: the group's rails.
        executor: the group's executor thread.
        faults: fault diagnosis (timeout messages name the rank at fault).
        options: the agreed options.
        placement: who is where.
        rank / size: this process in the group.
        inner_timeout: every wait of one collective ends within it.
    """

    def __init__(
        self,
        rails: RailSet,
        executor: Executor,
        faults: FaultDiagnosis,
        options: HetcommOptions,
        placement: Placement,
        rank: int,
        size: int,
        inner_timeout_s: float,
    ):
        self.rails = rails
        self.executor = executor
        self.faults = faults
        self.options = options
        self.placement = placement
        self.rank = rank
        self.size = size
        self.inner_timeout_s = inner_timeout_s
        self._seq = 0
        #: the group's plan decisions (hetcomm.backends.planpick)
        self.chooser = PlanChooser(placement, options.plan)

    def _deadline(self) -> float:
        return time.monotonic() + self.inner_timeout_s

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @property
    def last_seq(self) -> int:
        """Sequence number of the group's latest collective (routed or delegated; 0 before any)."""
        return self._seq

    # -- split check ------------------------------------------------------------------------
    def exchange_meta(self, op: str, seq: int, meta: torch.Tensor, unit: str, local_error: Optional[str] = None) -> checks.Meta:
        """Share this rank's metadata vector with every peer, get theirs, and check the whole
        matrix (:func:`checks.check_meta`; ``local_error``: this rank's complaint about its own
        arguments, flagged in ``meta``). Every collective of a group takes the same path, so a
        rank in one collective and its peers in another meet, and the check names both.

        Through the shared-memory board when the whole group shares memory (tens of
        microseconds); one gloo all_gather when every pair is on gloo; otherwise one parallel
        round of tiny messages over the pairs' rails (each a FIFO, so the metadata always
        arrives ahead of the data it describes).
        """
        n, me = self.size, self.rank
        if self.rails.board is not None:
            return checks.check_meta(op, me, self.rails.board.exchange(meta, self._deadline(), op), unit, local_error)
        if self.rails.every_pair_on_gloo():
            # All peers over TCP anyway: gloo's all_gather is one hand-off instead of 2(n-1) waits.
            # Watching the heartbeat: a peer stopped (SIGSTOP) would hold gloo's wait to the timeout.
            out = [torch.empty_like(meta) for _ in range(n)]
            try:
                lost = self._wait_gloo_x(self.rails.gloo_x.allgather([out], [meta]), seq, f"{op} (split check)")
            except Exception as e:
                raise CollectiveError(f"the split-size exchange failed: {e}", op=op, rank=me, rail="gloo") from e
            if lost is not None:
                raise lost
            return checks.check_meta(op, me, out, unit, local_error)
        bufs = [meta if r == me else torch.empty_like(meta) for r in range(n)]
        tag = meta_tag(seq)
        sends = [Xfer(p, meta, tag, control=True) for p in range(n) if p != me]
        recvs = [Xfer(p, bufs[p], tag, control=True) for p in range(n) if p != me]
        ops = start_step(sends, recvs, self.rails.rail_of("cpu"), op, seq)
        drive(ops, self._deadline(), f"{op} (split check)", me, self.faults.for_seq(seq), wakeup=self.rails.wakeup)
        return checks.check_meta(op, me, bufs, unit, local_error)

    # -- all_to_all_single ----------------------------------------------------------------------
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]],
        input_split_sizes: Optional[Sequence[int]],
        async_op: bool = True,
    ) -> HetcommWork:
        """Rows of ``input`` to every rank, each peer over its rail.

        Args:
            output: ``[sum(output_split_sizes), *S]``; rows from rank j at offset
                ``sum(output_split_sizes[:j])``.
            input: ``[sum(input_split_sizes), *S]``, same dtype and device.
            output_split_sizes / input_split_sizes: rows per rank; empty/None = equal split.
            async_op: the caller keeps the Work (else a call with nothing queued runs inline).

        Returns:
            A :class:`HetcommWork`; ``wait()`` raises ``ValueError`` on a cross-rank mismatch and
            ``CollectiveError``/``PeerTimeout`` naming peer and rail on a failure.
        """
        op = "all_to_all_single"
        n, me = self.size, self.rank
        try:
            in_splits = _splits(input_split_sizes, input, n, "input_split_sizes", "input", me)
            out_splits = _splits(output_split_sizes, output, n, "output_split_sizes", "output", me)
            if input.dtype != output.dtype:
                raise UsageError(f"hetcomm {op} (rank {me}): input dtype {input.dtype} != output dtype {output.dtype}")
            if input.device != output.device:
                raise UsageError(f"hetcomm {op} (rank {me}): input on {input.device} but output on {output.device}")
            if tuple(input.shape[1:]) != tuple(output.shape[1:]):
                raise UsageError(
                    f"hetcomm {op} (rank {me}): input rows have shape {tuple(input.shape[1:])} but output rows "
                    f"{tuple(output.shape[1:])}; both must be [rows, *S] with the same S"
                )
        except UsageError as e:
            if not self.options.check_splits or checks.splits_are_agreed():
                raise
            return self._refuse(op, str(e), input.dtype, async_op)
        seq = self.next_seq()
        row_shape = tuple(input.shape[1:])
        row_bytes = input.element_size() * _prod(row_shape)
        planned = self._may_plan(input)
        pinned = planned and self.options.plan != "adaptive"
        # The whole group on one host, with a way that depends on the call (calibrate.py): the
        # board exchange always runs (it carries the split matrix that decides the size class,
        # and the input addresses of the single-copy path), and the check on it comes for free.
        sized = self.rails.size_routes if input.device.type == "cpu" and not pinned and self.rails.striped is None else None
        need_meta = (self.options.check_splits and not checks.splits_are_agreed()) or planned or sized is not None
        src = input if input.is_contiguous() else input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        if input.dtype not in GLOO_DTYPES:
            # gloo refuses it ("Invalid scalar type") and torch cannot even copy the sub-byte
            # kinds: the rows travel as their bytes (the check above still names the real dtype).
            src, dst_bytes = _row_bytes(src), _row_bytes(dst)
        else:
            dst_bytes = dst
        addr = src.data_ptr() if sized is not None and "cma" in sized.ways else 0
        meta = checks.encode_meta(op, seq, input.dtype, row_bytes, row_shape, in_splits, out_splits, addr) if need_meta else None
        # Device tensors: ordered after the caller's current stream as of now, that is after
        # the contiguous copies above too (hetcomm.backends.devices).
        work = HetcommWork([output], seq, order=devices.capture((input, output, src, dst), seq))
        rail_of = self.rails.rail_of(input.device.type)

        def job(w: HetcommWork) -> None:
            deadline = self._deadline()
            if need_meta:
                m = self.exchange_meta(op, seq, meta, "rows")
            strategy = None
            if planned:
                # From the exchanged matrix: the same n vectors on every rank, so every rank
                # takes the same path (planpick.py).
                traffic = [[x * row_bytes for x in m.sends(r)] for r in range(n)]
                strategy = self.chooser.choose(traffic)
            self.chooser.note(strategy or "direct")
            way = None
            if sized is not None and strategy is None:
                way = sized.rail_for(sum(sum(m.sends(r)) for r in range(n)) * row_bytes // n)
            if strategy is not None:
                self._run_plan(self.chooser.plan(strategy, traffic), dst_bytes, src, op, seq, deadline)
            elif way == "cma":
                self._cma_all_to_all(dst_bytes, src, m, row_bytes, op, seq, deadline)
            elif way == "gloo" or (
                way is None and input.device.type == "cpu" and self.rails.every_pair_on_gloo() and self.rails.striped is None
            ):
                self._gloo_all_to_all(dst_bytes, src, out_splits, in_splits, row_bytes, op, seq)
            else:
                direct_all_to_all(
                    dst_bytes, src, out_splits, in_splits, me, rail_of, self.options.chunk_bytes, op, seq,
                    deadline, self.faults.for_seq(seq), wakeup=self.rails.wakeup,
                )
            if dst is not output:
                output.copy_(dst)

        return self.executor.submit(job, work, async_op)

    def _refuse(self, op: str, error: str, dtype: torch.dtype, async_op: bool) -> HetcommWork:
        """This rank's arguments are invalid: take part in the cross-rank check with the refusal
        flagged, so that every rank raises (instead of its peers waiting for it until the timeout,
        and its sequence number falling one behind theirs)."""
        seq = self.next_seq()
        meta = checks.encode_collective(op, seq, self.size, dtype, local_problem=True)

        def job(w: HetcommWork) -> None:
            self.exchange_meta(op, seq, meta, "rows", local_error=error)

        return self.executor.submit(job, HetcommWork([], seq), async_op)

    def _cma_all_to_all(self, dst, src, m: checks.Meta, row_bytes: int, op: str, seq: int, deadline: float) -> None:
        """The whole group on one host: read every peer's rows for this rank straight from the
        peer's input (one copy per byte, :mod:`.rails.cma`), then a closing board exchange, after
        which no peer reads this rank's input any more; a failed read raises on every rank.

        Args:
            dst / src: contiguous output and input (rows of ``row_bytes``).
            m: the exchanged (and checked) metadata, with every rank's input address.
        """
        n, me = self.size, self.rank
        pids = [p.pid for p in self.placement.ranks]
        recv_bytes = [c * row_bytes for c in m.recvs(me)]
        # Where rank j's rows for this rank start in rank j's input.
        offsets = [sum(m.sends(j)[:me]) * row_bytes for j in range(n)]
        error, seconds = cma.gather_rows(pids, me, dst, src, [m.addr(j) for j in range(n)], recv_bytes, offsets)
        failed = cma.finish(self.rails.board, me, n, op, seq, error, deadline)
        if failed:
            r, peer, code = failed[0]
            raise CollectiveError(
                f"single-copy all-to-all: rank {r} could not read rank {peer}'s input ({os.strerror(code)}, "
                f"errno {code}); the group is still usable, or set HETCOMM_SAME_HOST_RAIL=shm to use the rings",
                op=op, rank=me, peer=peer, rail="shm",
            )
        sent = [c * row_bytes for c in m.sends(me)]
        _record(
            "shm",
            bytes_sent=sum(b for j, b in enumerate(sent) if j != me),
            bytes_received=sum(b for j, b in enumerate(recv_bytes) if j != me),
            chunks_sent=sum(1 for j, b in enumerate(sent) if j != me and b),
            chunks_received=sum(1 for j, b in enumerate(recv_bytes) if j != me and b),
            seconds_busy=seconds,
            ops=1,
        )

    def _wait_gloo_x(self, work: "dist.Work", seq: int, op: str) -> Optional[CollectiveError]:
        """Wait for a gloo op of the executor's gloo group watching the heartbeat
        (:func:`~hetcomm.backends.faults.wait_watching`; the group is released on a loss)."""
        gloo_x = self.rails.gloo_x
        return wait_watching(work, self.faults, seq, op, release=lambda p: release_gloo(gloo_x, p))

    def _gloo_all_to_all(self, dst, src, out_splits, in_splits, row_bytes: int, op: str, seq: int) -> None:
        """Every pair is on the gloo rail: one gloo all-to-all carries the whole step (gloo's own
        pairwise exchange, no per-chunk Python work), waited on watching the heartbeat. Splits
        were checked already."""
        t0 = time.perf_counter()
        # Equal splits take gloo's alltoall, which beat its alltoallv by 20-50 % at 1 MiB here.
        even = len(set(in_splits)) == 1 and len(set(out_splits)) == 1
        try:
            lost = self._wait_gloo_x(self.rails.gloo_x.alltoall_base(
                dst, src, [] if even else list(out_splits), [] if even else list(in_splits), dist.AllToAllOptions()
            ), seq, op)
        except Exception as e:
            raise CollectiveError(f"gloo all-to-all failed: {e}", op=op, rank=self.rank, rail="gloo") from e
        if lost is not None:
            raise lost
        me = self.rank
        _record(
            "gloo",
            bytes_sent=sum(c for j, c in enumerate(in_splits) if j != me) * row_bytes,
            bytes_received=sum(c for j, c in enumerate(out_splits) if j != me) * row_bytes,
            chunks_sent=sum(1 for j, c in enumerate(in_splits) if j != me and c),
            chunks_received=sum(1 for j, c in enumerate(out_splits) if j != me and c),
            seconds_busy=time.perf_counter() - t0,
            ops=1,
        )

    # -- all_to_all (list form) -----------------------------------------------------------------
    def all_to_all(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], async_op: bool = True) -> HetcommWork:
        """``dist.all_to_all`` (list form): tensors of any, uneven sizes; each peer over its rail.

        Args:
            output_tensors: ``n`` tensors; ``output_tensors[j]`` receives rank j's
                ``input_tensors[me]`` (same number of bytes and dtype).
            input_tensors: ``n`` tensors of one dtype.
        """
        op = "all_to_all"
        n, me = self.size, self.rank
        if len(input_tensors) != n or len(output_tensors) != n:
            raise UsageError(
                f"hetcomm {op} (rank {me}): got {len(input_tensors)} input and {len(output_tensors)} "
                f"output tensors for a group of {n}; pass one per rank"
            )
        dtypes = {t.dtype for t in list(input_tensors) + list(output_tensors)}
        if len(dtypes) != 1:
            raise UsageError(f"hetcomm {op} (rank {me}): all tensors must share one dtype, got {sorted(map(str, dtypes))}")
        dtype = input_tensors[0].dtype
        esize = input_tensors[0].element_size()
        seq = self.next_seq()
        ins = [t.contiguous().reshape(-1) for t in input_tensors]
        outs = [t.reshape(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=dtype, device=t.device) for t in output_tensors]
        meta = None
        if self.options.check_splits:
            meta = checks.encode_meta(op, seq, dtype, esize, (), [t.numel() for t in ins], [t.numel() for t in outs])
        order = devices.capture(list(input_tensors) + list(output_tensors) + ins + outs, seq)
        work = HetcommWork(list(output_tensors), seq, order=order)
        rail_of = self.rails.rail_of(input_tensors[0].device.type)

        def job(w: HetcommWork) -> None:
            deadline = self._deadline()
            if meta is not None:
                self.exchange_meta(op, seq, meta, "elements")
            sends, recvs = [], []
            for k in range(1, n):
                dst, src = (me + k) % n, (me - k) % n
                for i, (s, c) in enumerate(chunk_rows(ins[dst].numel(), esize, self.options.chunk_bytes)):
                    sends.append(Xfer(dst, ins[dst][s : s + c], tag_for(seq, i)))
                for i, (s, c) in enumerate(chunk_rows(outs[src].numel(), esize, self.options.chunk_bytes)):
                    recvs.append(Xfer(src, outs[src][s : s + c], tag_for(seq, i)))
            ops = start_step(sends, recvs, rail_of, op, seq)
            if ins[me].numel() != outs[me].numel():
                raise UsageError(
                    f"hetcomm {op} (rank {me}): input_tensors[{me}] has {ins[me].numel()} elements but "
                    f"output_tensors[{me}] has {outs[me].numel()}"
                )
            outs[me].copy_(ins[me])
            drive(ops, deadline, op, me, self.faults.for_seq(seq), wakeup=self.rails.wakeup)
            for t, o in zip(output_tensors, outs):
                if not t.is_contiguous():
                    t.copy_(o.view(t.shape))

        return self.executor.submit(job, work, async_op)

    # -- plans --------------------------------------------------------------------------------
    def _may_plan(self, input: torch.Tensor) -> bool:
        """Whether this call may run a plan (then it exchanges the split matrix): a pinned
        strategy on a group with a planner, or ``adaptive`` on an eligible group
        (:class:`~hetcomm.backends.planpick.PlanChooser`). ``adaptive`` leaves calls whose
        floating-point rows the group's ``wire_dtype`` may cast to the direct route (plans move
        exact bytes). Every input is agreed across ranks (options, placement, dtype)."""
        if self.options.plan == "adaptive" and self.options.wire_dtype != "exact" and input.dtype.is_floating_point:
            return False
        return self.chooser.needs_traffic

    def _run_plan(self, plan, output: torch.Tensor, input: torch.Tensor, op: str, seq: int, deadline: float) -> None:
        device_type = input.device.type
        execute_plan(
            plan, output, input, self.rank, lambda peer, hint: self.rails.plan_rail_for(peer, hint, device_type),
            op=op, seq=seq, deadline=deadline, diagnose=self.faults.for_seq(seq), wakeup=self.rails.wakeup,
        )

    def run_plan(self, plan, output: torch.Tensor, input: torch.Tensor) -> HetcommWork:
        """Execute a hand-made or planner-made :class:`~hetcomm.sched.plan.Plan` (async).

        Args:
            plan: ``plan.traffic[i][j]`` bytes from rank i to rank j.
            output / input: contiguous tensors (host or device, one device) laid out as in
                ``all_to_all_single``, in bytes (see :func:`hetcomm.backends.executor.execute_plan`).
        """
        seq = self.next_seq()

        def job(w: HetcommWork) -> None:
            self._run_plan(plan, output, input, f"plan '{plan.strategy}'", seq, self._deadline())

        return self.executor.submit(job, HetcommWork([output], seq, order=devices.capture((input, output), seq)))


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[rows, *S]`` tensor as ``[rows, bytes per row]`` uint8 (same memory)."""
    rows = t.shape[0] if t.dim() > 0 else 1
    return t.view(rows, _prod(t.shape[1:])).view(torch.uint8)


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _splits(sizes: Optional[Sequence[int]], t: torch.Tensor, n: int, name: str, tname: str, rank: int) -> List[int]:
    """Validate split sizes locally (before any exchange); empty = equal split."""
    rows = t.size(0) if t.dim() > 0 else 1
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise UsageError(
                f"hetcomm all_to_all_single (rank {rank}): {tname}.size(0)={rows} is not divisible by the "
                f"group size {n}; pass {name} explicitly"
            )
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise UsageError(f"hetcomm all_to_all_single (rank {rank}): {name} has {len(sizes)} entries for a group of {n}")
    if any(s < 0 for s in sizes):
        raise UsageError(f"hetcomm all_to_all_single (rank {rank}): {name}={sizes} has a negative entry")
    if sum(sizes) != rows:
        raise UsageError(f"hetcomm all_to_all_single (rank {rank}): sum({name})={sum(sizes)} != {tname}.size(0)={rows}")
    return sizes
