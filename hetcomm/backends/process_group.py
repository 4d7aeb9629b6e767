"""``HetcommProcessGroup``: the Python ``dist.ProcessGroup`` behind backend ``"hetcomm"``.

One object per group. It owns:

* an inner ``ProcessGroupGloo`` over the whole group (``gloo0``): the delegated collectives
  (all_reduce, broadcast, all_gather, reduce_scatter, gather, scatter, reduce, barrier,
  send/recv) run on it unchanged, so their results are exactly gloo's; it is also registered as
  the group's C++ fallback backend, so C++ callers of methods the 2.13 trampoline does not
  forward (functional all_gather/reduce_scatter) reach it;
* the rails (``shm`` rings for same-node peers, the ``gloo`` rail, ``bridge``, and ``nccl`` /
  ``hccl`` created on first use) and the choice of rail per peer (:mod:`.select`);
* one executor thread that runs the routed collectives (``all_to_all_single``, ``all_to_all``,
  plans) one after another, in call order, so every pair's transfers stay in step (a blocking
  call with nothing queued runs inline on the caller's thread instead);
* a second inner gloo group (``gloo1``) for the collectives the executor issues itself (split
  checks and whole-step all-to-alls when every pair is on gloo): gloo matches collectives by
  issue order, and only the executor's order is the same on every rank for those.

Routed collectives first check split sizes across ranks (:mod:`.checks`), then move data; their
Work raises the collective's error from ``wait()`` and from its future.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed import PrefixStore

from hetcomm.backends import checks
from hetcomm.backends.board import MetaBoard
from hetcomm.backends.doorbell import Doorbell
from hetcomm.backends.executor import (
    TAG_BASE,
    chunk_rows,
    direct_all_to_all,
    drive,
    execute_plan,
    meta_tag,
    start_step,
    tag_for,
)
from hetcomm.backends.options import HetcommOptions, options_from_env
from hetcomm.backends.placement import Placement, build_placement
from hetcomm.backends.rails.base import Rail, Xfer
from hetcomm.backends.rails.bridge import BridgeRail
from hetcomm.backends.rails.gloo import GlooRail
from hetcomm.backends.rails.shm import ShmRail, shm_supported
from hetcomm.backends.rails.striped import StripedRail
from hetcomm.backends.select import choose_rail, shm_possible
from hetcomm.backends.stats import record as _record
from hetcomm.backends.work import ChunkArrival, FutureWork, HetcommWork
from hetcomm.errors import CollectiveError, UsageError

__all__ = ["HetcommProcessGroup"]

log = logging.getLogger("hetcomm.backends")


def _configure_logging() -> None:
    level = os.environ.get("HETCOMM_LOG", "").strip().upper()
    if level and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(getattr(logging, level, logging.INFO))


def _device_type(t: torch.Tensor) -> str:
    return t.device.type


class HetcommProcessGroup(dist.ProcessGroup):
    """A process group whose all-to-alls route every peer over its own rail.

    Args:
        store: the group's store (already prefixed by c10d).
        rank: this process's rank in the group.
        size: number of ranks in the group.
        timeout: the group timeout; every wait of every collective is bounded by it.
        options: :class:`HetcommOptions` (``pg_options``); ``HETCOMM_*`` variables fill the
            fields left at their defaults.
        global_ranks: global rank of each group rank (empty for the default group).
        group_id: c10d's id of the group (for logs).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: Optional[HetcommOptions] = None,
        global_ranks: Sequence[int] = (),
        group_id: str = "",
    ):
        super().__init__(rank, size)  # the 3-arg (store, rank, size) ctor fails in 2.13
        _configure_logging()
        if options is not None and not isinstance(options, HetcommOptions):
            raise UsageError(
                f"pg_options for backend 'hetcomm' must be hetcomm.backends.HetcommOptions, "
                f"got {type(options).__name__}"
            )
        self.options = options_from_env(options)
        self._group_name = ""
        self._group_desc = ""
        self._group_id = group_id
        self._store = store
        self._timeout = timeout
        self._closed = False
        self._seq = 0
        self._dseq = 0
        # Inner waits get 75 % of the group timeout, so that naming the peer at fault (up to
        # 10 % more, see _culprits) still ends within the timeout the user gave.
        self._inner_timeout = timedelta(seconds=timeout.total_seconds() * 0.75)
        self._gloo = ProcessGroupGloo(PrefixStore("hetcomm/gloo0/", store), rank, size, self._inner_timeout)
        # A second gloo group for the collectives the executor thread issues (split checks and
        # whole-step all-to-alls): gloo matches collectives by issue order, and the executor
        # runs jobs in call order on every rank, while gloo0 takes the caller's collectives.
        self._gloo_x = ProcessGroupGloo(PrefixStore("hetcomm/gloo1/", store), rank, size, self._inner_timeout)
        # C++ callers of methods the 2.13 trampoline does not forward land on this backend.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)
        if torch.cuda.is_available():
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)
        self.placement: Placement = build_placement(
            store, rank, size, global_ranks, self.options.cluster, timeout
        )
        from hetcomm.backends.communicator import Communicator

        #: The group's communicator (``hetcomm.communicator(group)`` returns it); it holds the
        #: group weakly, the group holds it.
        self.communicator: Communicator = Communicator._for_hetcomm_group(
            weakref.ref(self), rank, size, self.options, self.placement, timeout
        )
        allowed = self.options.rails
        local = [r for r in range(size) if shm_possible(self.placement, rank, r)] if shm_supported() else [rank]
        # Wakes the executor: rung by same-node peers after shared-memory progress and by rail
        # threads when a transfer completes (doorbell.py); a plain Event where there is no /dev/shm.
        self._wakeup = Doorbell(store, "hetcomm/bell", rank, local, timeout) if shm_supported() else threading.Event()
        self._shm: Optional[ShmRail] = None
        if (allowed is None or "shm" in allowed) and len(local) >= 2:
            self._shm = ShmRail(
                store, rank, local, [p.pid for p in self.placement.ranks],
                self.placement.ranks[rank].node, self.options.ring_bytes, timeout, bell=self._wakeup,
            )
        # Split checks through shared memory when the whole group shares memory: one YAML node on
        # one host (board.py). Not across emulated nodes: those have separate /dev/shm mounts.
        self._board: Optional[MetaBoard] = None
        if size >= 2 and len(local) == size:
            self._board = MetaBoard(
                store, rank, [p.pid for p in self.placement.ranks], checks.meta_width(size), timeout, self._wakeup
            )
        self._gloo_rail = GlooRail(self._gloo, rank, self._wakeup)
        self._striped: Optional[StripedRail] = self._make_nic_rails(store, rank, size)
        # No reference cycles through self: the group must be freed by reference counting on the
        # thread that destroys it. Freed by the cyclic GC it could die on a gloo callback thread,
        # whose ProcessGroupGloo destructor would then join itself (std::terminate, EDEADLK).
        me = weakref.proxy(self)
        self._bridge = BridgeRail(rank, lambda peer: me._bridge_transport(peer), lambda peer, dt: me._wire_dtype(peer, dt))
        self._device_rails: Dict[str, Rail] = {}
        self._routes: Dict[str, List[str]] = {}
        self._uniform_gloo: Optional[bool] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._exec_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._run_jobs, name=f"hetcomm-exec-{group_id}", daemon=True)
        self._thread.start()
        self._log_routes()

    def _make_nic_rails(self, store: dist.Store, rank: int, size: int) -> Optional[StripedRail]:
        """One gloo group per NIC port, when the cluster YAML gives every node of the group
        ``R >= 2`` ports and this rank knows its interfaces (``HetcommOptions.nic_ifnames``)."""
        ifnames = self.options.nic_ifnames
        cluster = self.placement.cluster
        if not ifnames or cluster is None or size < 2:
            return None
        num_ports = min(cluster.node_of(p.global_rank).num_nics for p in self.placement.ranks)
        if num_ports < 2:
            return None
        if len(ifnames) < num_ports:
            raise UsageError(
                f"hetcomm (rank {rank}): the cluster YAML gives every node {num_ports} NIC ports but "
                f"HETCOMM_IFNAMES lists {len(ifnames)} ({','.join(ifnames)}); list one interface per port"
            )
        rails = []
        for k in range(num_ports):
            opts = ProcessGroupGloo._Options()
            opts._devices = [ProcessGroupGloo.create_device(interface=ifnames[k])]
            opts._timeout = self._inner_timeout
            pg = ProcessGroupGloo(PrefixStore(f"hetcomm/nic{k}/", store), rank, size, opts)
            rails.append(GlooRail(pg, rank, self._wakeup, name=f"gloo-nic{k}"))
        return StripedRail(rails, rank)

    # -- identity (c10d needs these on a Python group) ---------------------------------------
    def getBackendName(self) -> str:
        return "hetcomm"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    # -- rails ---------------------------------------------------------------------------
    def rail_names(self, device_type: str = "cpu") -> List[str]:
        """The rail name for every group rank (``"self"`` for this rank) for ``device_type`` tensors."""
        if device_type not in self._routes:
            from hetcomm.backends.rails.hccl import hccl_available
            from hetcomm.backends.rails.nccl import nccl_available

            me = self.rank()
            shm_peers = set(self._shm.peers) if self._shm else set()
            nccl_ok = device_type == "cuda" and nccl_available()
            hccl_ok = device_type == "npu" and hccl_available()
            names = []
            for p in range(self.size()):
                if p == me:
                    names.append("self")
                    continue
                names.append(
                    choose_rail(
                        self.placement, me, p, device_type, self.options.rails,
                        shm_ok=p in shm_peers, nccl_ok=nccl_ok, hccl_ok=hccl_ok,
                    )
                )
            self._routes[device_type] = names
        return self._routes[device_type]

    def _rail(self, name: str) -> Rail:
        if name == "shm":
            assert self._shm is not None
            return self._shm
        if name == "gloo":
            return self._striped if self._striped is not None else self._gloo_rail
        if name == "bridge":
            return self._bridge
        if name not in self._device_rails:
            me = self.rank()
            vendor = "nvidia" if name == "nccl" else "ascend"
            members = [r.group_rank for r in self.placement.ranks if r.vendor == vendor and not r.label_only]
            if name == "nccl":
                from hetcomm.backends.rails.nccl import NcclRail

                self._device_rails[name] = NcclRail(self._store, me, members, self._timeout)
            else:
                from hetcomm.backends.rails.hccl import HcclRail

                self._device_rails[name] = HcclRail(self._store, me, members, self._timeout)
        return self._device_rails[name]

    def _rail_of(self, device_type: str) -> Callable[[int], Rail]:
        names = self.rail_names(device_type)
        return lambda peer: self._rail(names[peer])

    def _bridge_transport(self, peer: int) -> Rail:
        if self._shm is not None and peer in self._shm.peers:
            return self._shm
        return self._rail("gloo")

    def _wire_dtype(self, peer: int, dtype: torch.dtype) -> Optional[torch.dtype]:
        return self.communicator.wire_dtype(peer, dtype)

    def _log_routes(self) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        me = self.rank()
        names = self.rail_names("cpu")
        lines = [
            f"hetcomm group {self._group_id or '0'} rank {me}: {self.placement.describe(me)}"
            + (f"; cluster '{self.placement.cluster.name}'" if self.placement.cluster else "; no cluster YAML")
        ]
        for p in range(self.size()):
            if p != me:
                lines.append(
                    f"  peer {p} [{self.placement.describe(p)}] link {self.placement.link_class(me, p).name}"
                    f" -> rail {names[p]} (CPU tensors)"
                )
        labels = sorted({r.model for r in self.placement.ranks if r.label_only})
        if labels:
            lines.append(f"  device kinds that are labels only (CPU processes): {', '.join(labels)}")
        log.info("\n".join(lines))

    # -- executor thread --------------------------------------------------------------------
    def _execute(self, fn: Callable[[HetcommWork], None], work: HetcommWork) -> None:
        with self._exec_lock:
            try:
                # Data movement is never part of an autograd graph (grad mode is per thread, and
                # the caller's no_grad of e.g. an autograd.Function forward does not reach here).
                with torch.no_grad():
                    fn(work)
            except CollectiveError as e:
                work._complete(self._blame(e, getattr(work, "_seq", 0)))
            except BaseException as e:  # delivered to the caller through the Work
                work._complete(e)
            else:
                work._complete(None)
            finally:
                with self._pending_lock:
                    self._pending -= 1

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._execute(*job)

    def _submit(self, fn: Callable[[HetcommWork], None], work: HetcommWork, async_op: bool = True) -> HetcommWork:
        """Run ``fn`` after every earlier routed collective: inline for a blocking call when
        nothing is queued (saves two thread hand-offs), else on the executor thread."""
        if self._closed:
            raise CollectiveError("the process group was destroyed", rank=self.rank())
        with self._pending_lock:
            inline = not async_op and self._pending == 0
            self._pending += 1
        if inline:
            self._execute(fn, work)
        else:
            self._jobs.put((fn, work))
        return work

    def _deadline(self) -> float:
        return time.monotonic() + self._inner_timeout.total_seconds()

    def _culprits(self, seq: int) -> tuple:
        """``(ranks, text)``: who is most likely at fault for the failure of collective ``seq``.

        Peers on this host whose process is gone come first, minus those that left a failure
        mark in the store (they failed like us, maybe one collective earlier or later, and then
        exited); otherwise the ranks that left no mark within a short wait (dead, hung, or never
        called the collective). A group is unusable after a failure, so one mark per rank is
        enough.
        """
        key = lambda r: f"hetcomm/diag/failed/{r}"
        try:
            self._store.set(key(self.rank()), "1")
        except Exception:
            pass
        # A killed peer's sockets close before /proc shows it dead, and survivors mark the store
        # at slightly different times: look a few times, for at most ~10 % of the timeout.
        deadline = time.monotonic() + min(3.0, max(0.5, 0.1 * self._timeout.total_seconds()))
        missing: Optional[List[int]] = None
        while True:
            dead = checks.dead_peers(self.placement, self.rank(), None)
            if dead:
                try:
                    failed_too = {r for r, _ in dead if self._store.check([key(r)])}
                except Exception:
                    failed_too = set()
                culprits = [(r, pid) for r, pid in dead if r not in failed_too]
                if culprits:
                    return [r for r, _ in culprits], "; exited: " + ", ".join(f"rank {r} (pid {pid})" for r, pid in culprits)
            missing = checks.missing_peers(self._store, self.rank(), self.size(), 0.0)
            if missing is None or not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if missing is None:
            return [], "; the store is unreachable too (did rank 0 or the launcher die?)"
        if missing:
            who = ", ".join(f"rank {r}" for r in missing)
            return missing, f"; {who} did not report this failure: dead, hung, or never called collective #{seq}"
        return [], ""

    def _blame(self, e: CollectiveError, seq: int) -> CollectiveError:
        """Re-aim a rail error at the rank really at fault: a survivor that failed and exited
        first closes its sockets too, and must not be blamed for the crash of another rank."""
        if getattr(e, "diagnosed", False):
            return e
        ranks, text = self._culprits(seq)
        if not ranks or e.peer in ranks:
            out = type(e)(f"{str(e).split(': ', 1)[-1]}{text}", op=e.op, rank=e.rank, peer=e.peer, rail=e.rail)
        else:
            culprit = ranks[0]
            names = self.rail_names("cpu")
            rail = names[culprit] if culprit < len(names) else e.rail
            out = type(e)(
                f"peer failed{text} (first symptom: {str(e).split(': ', 1)[-1]})", op=e.op, rank=e.rank, peer=culprit, rail=rail
            )
        out.diagnosed = True
        return out

    def _diagnose_for(self, seq: int) -> Callable[[List[int]], str]:
        return lambda peers: self._culprits(seq)[1]

    def _exchange_meta(self, op: str, seq: int, meta: torch.Tensor, unit: str) -> checks.Meta:
        """Share this rank's metadata vector with every peer, get theirs, and check the whole
        matrix (:func:`checks.check_meta`).

        Through the shared-memory board when the whole group shares memory (tens of
        microseconds); one gloo all_gather when every pair is on gloo; otherwise one parallel
        round of tiny messages over the pairs' rails (each a FIFO, so the metadata always
        arrives ahead of the data it describes).
        """
        n, me = self.size(), self.rank()
        if self._board is not None:
            return checks.check_meta(op, me, self._board.exchange(meta, self._deadline(), op), unit)
        if self._every_pair_on_gloo():
            # All peers over TCP anyway: gloo's all_gather is one hand-off instead of 2(n-1) waits.
            out = [torch.empty_like(meta) for _ in range(n)]
            try:
                self._gloo_x.allgather([out], [meta]).wait()
            except Exception as e:
                raise CollectiveError(f"the split-size exchange failed: {e}", op=op, rank=me, rail="gloo") from e
            return checks.check_meta(op, me, out, unit)
        bufs = [meta if r == me else torch.empty_like(meta) for r in range(n)]
        tag = meta_tag(seq)
        sends = [Xfer(p, meta, tag, control=True) for p in range(n) if p != me]
        recvs = [Xfer(p, bufs[p], tag, control=True) for p in range(n) if p != me]
        ops = start_step(sends, recvs, self._rail_of("cpu"), op, seq)
        drive(ops, self._deadline(), f"{op} (split check)", me, self._diagnose_for(seq), wakeup=self._wakeup)
        return checks.check_meta(op, me, bufs, unit)

    # -- routed collectives -------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: rows of ``input`` to every rank, each peer over its rail.

        Args:
            output: ``[sum(output_split_sizes), *S]``; rows from rank j at offset
                ``sum(output_split_sizes[:j])``.
            input: ``[sum(input_split_sizes), *S]``, same dtype and device.
            output_split_sizes / input_split_sizes: rows per rank; empty = equal split.

        Returns:
            A :class:`HetcommWork`; ``wait()`` raises ``ValueError`` on a cross-rank mismatch and
            ``CollectiveError``/``PeerTimeout`` naming peer and rail on a failure.
        """
        op = "all_to_all_single"
        n, me = self.size(), self.rank()
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
        self._seq += 1
        seq = self._seq
        row_shape = tuple(input.shape[1:])
        row_bytes = input.element_size() * _prod(row_shape)
        use_plan = self._plan_strategy(input)
        need_meta = (self.options.check_splits and not checks.splits_are_agreed()) or use_plan is not None
        meta = checks.encode_meta(op, seq, input.dtype, row_bytes, row_shape, in_splits, out_splits) if need_meta else None
        src = input if input.is_contiguous() else input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        work = HetcommWork([output])
        work._seq = seq
        rail_of = self._rail_of(_device_type(input))

        def job(w: HetcommWork) -> None:
            deadline = self._deadline()
            if need_meta:
                m = self._exchange_meta(op, seq, meta, "rows")
            if use_plan is not None:
                traffic = [[x * row_bytes for x in m.sends(r)] for r in range(n)]
                plan = self._make_plan(use_plan, traffic)
                self._run_plan(plan, dst, src, op, seq, deadline)
                for j in range(n):
                    w._arrived(ChunkArrival(j, sum(out_splits[:j]), out_splits[j]))
            elif input.device.type == "cpu" and self._every_pair_on_gloo() and self._striped is None:
                self._gloo_all_to_all(dst, src, out_splits, in_splits, row_bytes, op, seq)
                for j in range(n):
                    w._arrived(ChunkArrival(j, sum(out_splits[:j]), out_splits[j]))
            else:
                direct_all_to_all(
                    dst, src, out_splits, in_splits, me, rail_of, self.options.chunk_bytes, op, seq,
                    deadline, self._diagnose_for(seq), wakeup=self._wakeup,
                    on_chunk=(lambda p, s, c: w._arrived(ChunkArrival(p, s, c))) if dst is output else None,
                )
            if dst is not output:
                output.copy_(dst)
                for j in range(n):
                    w._arrived(ChunkArrival(j, sum(out_splits[:j]), out_splits[j]))

        return self._submit(job, work, _is_async(opts))

    def _every_pair_on_gloo(self) -> bool:
        """True when every pair of the group (not just this rank's) uses the gloo rail for CPU
        tensors; every rank computes the same answer from the same placement and options."""
        if self._uniform_gloo is None:
            from hetcomm.backends.select import choose_rail

            n = self.size()
            shm = shm_supported() and (self.options.rails is None or "shm" in self.options.rails)
            self._uniform_gloo = all(
                choose_rail(self.placement, a, b, "cpu", self.options.rails, shm_ok=shm) == "gloo"
                for a in range(n) for b in range(n) if a != b
            )
        return self._uniform_gloo

    def _gloo_all_to_all(self, dst, src, out_splits, in_splits, row_bytes: int, op: str, seq: int) -> None:
        """Every pair is on the gloo rail: one gloo all-to-all carries the whole step (gloo's own
        pairwise exchange, no per-chunk Python work). Splits were checked already."""
        t0 = time.perf_counter()
        # Equal splits take gloo's alltoall, which beat its alltoallv by 20-50 % at 1 MiB here.
        even = len(set(in_splits)) == 1 and len(set(out_splits)) == 1
        try:
            self._gloo_x.alltoall_base(
                dst, src, [] if even else list(out_splits), [] if even else list(in_splits), dist.AllToAllOptions()
            ).wait()
        except Exception as e:
            raise CollectiveError(f"gloo all-to-all failed: {e}", op=op, rank=self.rank(), rail="gloo") from e
        me = self.rank()
        _record(
            "gloo",
            bytes_sent=sum(c for j, c in enumerate(in_splits) if j != me) * row_bytes,
            bytes_received=sum(c for j, c in enumerate(out_splits) if j != me) * row_bytes,
            chunks_sent=sum(1 for j, c in enumerate(in_splits) if j != me and c),
            chunks_received=sum(1 for j, c in enumerate(out_splits) if j != me and c),
            seconds_busy=time.perf_counter() - t0,
            ops=1,
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Pre-2.13 name of :meth:`all_to_all_single` (the trampoline tries both)."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all`` (list form): tensors of any, uneven sizes; each peer over its rail.

        Args:
            output_tensors: ``n`` tensors; ``output_tensors[j]`` receives rank j's
                ``input_tensors[me]`` (same number of bytes and dtype).
            input_tensors: ``n`` tensors of one dtype.
        """
        op = "all_to_all"
        n, me = self.size(), self.rank()
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
        self._seq += 1
        seq = self._seq
        ins = [t.contiguous().reshape(-1) for t in input_tensors]
        outs = [t.reshape(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=dtype, device=t.device) for t in output_tensors]
        meta = None
        if self.options.check_splits:
            meta = checks.encode_meta(op, seq, dtype, esize, (), [t.numel() for t in ins], [t.numel() for t in outs])
        work = HetcommWork(list(output_tensors))
        work._seq = seq
        rail_of = self._rail_of(_device_type(input_tensors[0]))

        def job(w: HetcommWork) -> None:
            deadline = self._deadline()
            if meta is not None:
                self._exchange_meta(op, seq, meta, "elements")
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
            drive(ops, deadline, op, me, self._diagnose_for(seq), wakeup=self._wakeup)
            for t, o in zip(output_tensors, outs):
                if not t.is_contiguous():
                    t.copy_(o.view(t.shape))

        return self._submit(job, work, _is_async(opts))

    # -- plans --------------------------------------------------------------------------------
    def _plan_strategy(self, input: torch.Tensor) -> Optional[str]:
        strategy = self.options.plan
        if strategy == "direct" or input.device.type != "cpu":
            return None
        cluster = self.placement.cluster
        if cluster is None or cluster.num_ranks != self.size():
            return None  # plans are over the whole cluster; subgroups use the direct route
        return strategy

    def _make_plan(self, strategy: str, traffic: List[List[int]]):
        try:
            from hetcomm.sched.planner import plan_all_to_all
        except ImportError as e:
            raise UsageError(
                f"hetcomm: plan '{strategy}' asked for (HETCOMM_PLAN / HetcommOptions.plan) but "
                f"hetcomm.sched.planner is not available ({e}); use plan='direct'"
            ) from e
        return plan_all_to_all(self.placement.cluster, traffic, strategy=strategy)

    def _plan_rail_for(self, peer: int, hint: Optional[str]) -> Rail:
        names = self.rail_names("cpu")
        if hint in ("shm", "gloo") and (hint != "shm" or (self._shm is not None and peer in self._shm.peers)):
            if self.options.rails is None or hint in self.options.rails:
                return self._rail(hint)
        name = names[peer]
        if hint and hint.startswith("nic") and hint[3:].isdigit() and self._striped is not None and name == "gloo":
            return self._striped.rails[int(hint[3:]) % len(self._striped.rails)]  # the port the plan chose
        return self._rail("gloo" if name in ("nccl", "hccl") else name)

    def _run_plan(self, plan, output: torch.Tensor, input: torch.Tensor, op: str, seq: int, deadline: float) -> None:
        execute_plan(
            plan, output, input, self.rank(), self._plan_rail_for, op=op, seq=seq, deadline=deadline,
            diagnose=self._diagnose_for(seq), wakeup=self._wakeup,
        )

    def run_plan(self, plan, output: torch.Tensor, input: torch.Tensor) -> HetcommWork:
        """Execute a hand-made or planner-made :class:`~hetcomm.sched.plan.Plan` (async).

        Args:
            plan: ``plan.traffic[i][j]`` bytes from rank i to rank j.
            output / input: contiguous CPU tensors laid out as in ``all_to_all_single``, in
                bytes (see :func:`hetcomm.backends.executor.execute_plan`).
        """
        self._seq += 1
        seq = self._seq

        def job(w: HetcommWork) -> None:
            self._run_plan(plan, output, input, f"plan '{plan.strategy}'", seq, self._deadline())

        work = HetcommWork([output])
        work._seq = seq
        return self._submit(job, work)

    # -- delegated collectives (results identical to gloo) ------------------------------------
    def _guard(self, op: str, fut: "torch.futures.Future", errors: Optional[List[BaseException]] = None) -> "torch.futures.Future":
        """Chain ``fut`` so that a failure becomes a CollectiveError naming the peer at fault
        (also appended to ``errors``, so that :class:`FutureWork` can re-raise it as such)."""
        self._dseq += 1
        seq = -self._dseq  # delegated collectives count down, routed ones up: separate diag keys
        # The callback runs on a gloo thread and may outlive the group: hold it weakly, or the
        # last reference could drop there and join gloo's threads from one of them.
        pg_ref = weakref.ref(self)
        rank = self.rank()

        def check(f: "torch.futures.Future"):
            try:
                return f.value()
            except Exception as e:
                pg = pg_ref()
                ranks, text = pg._culprits(seq) if pg is not None else ([], "")
                err = CollectiveError(f"failed{text}: {e}", op=op, rank=rank, peer=ranks[0] if ranks else None, rail="gloo")
                if errors is not None:
                    errors.append(err)
                raise err from e

        return fut.then(check)

    def _wrap(self, op: str, work: "dist.Work") -> "dist.Work":
        errors: List[BaseException] = []
        try:
            fut = work.get_future()
        except RuntimeError:  # gloo reduce_scatter/gather/scatter/p2p Works have no future
            return _GuardedWork(work, op, self)
        return FutureWork(self._guard(op, fut, errors), errors)

    def _avg_as_sum(self, name: str, opts, launch: Callable, finish: Callable[[int], list]):
        """gloo has no AVG: run the reduction with SUM (``launch(sum_opts)`` returns the gloo Work),
        then ``finish(group_size)`` divides the results (see :func:`_divide`) and returns the
        future's value."""
        o = type(opts)()
        for field in ("timeout", "rootRank", "rootTensor"):
            if hasattr(opts, field):
                setattr(o, field, getattr(opts, field))
        o.reduceOp = dist.ReduceOp.SUM
        errors: List[BaseException] = []
        fut = self._guard(name, launch(o).get_future(), errors)
        return FutureWork(fut.then(lambda f, n=self.size(): finish(n)), errors)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self._avg_as_sum("all_reduce", opts, lambda o: self._gloo.allreduce(tensors, o), lambda n: _divide(tensors, n))
        return self._wrap("all_reduce", self._gloo.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._wrap("all_reduce_coalesced", self._gloo.allreduce_coalesced(tensors, opts if opts is not None else dist.AllreduceCoalescedOptions()))

    def broadcast(self, tensors, opts=None):
        return self._wrap("broadcast", self._gloo.broadcast(tensors, opts if opts is not None else dist.BroadcastOptions()))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._wrap("all_gather", self._gloo.allgather(output_tensors, input_tensors, opts if opts is not None else dist.AllgatherOptions()))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._gloo.allgather_coalesced(output_lists, input_list, opts if opts is not None else dist.AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._wrap("all_gather_into_tensor", self._gloo._allgather_base(output, input, opts if opts is not None else dist.AllgatherOptions()))

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self._avg_as_sum(
                "reduce_scatter",
                opts,
                lambda o: self._gloo.reduce_scatter(output_tensors, input_lists, o),
                lambda n: _divide(list(output_tensors), n),
            )
        return self._wrap("reduce_scatter", self._gloo.reduce_scatter(output_tensors, input_lists, opts))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if opts.reduceOp == dist.ReduceOp.AVG:
            return self._avg_as_sum(
                "reduce_scatter_tensor", opts, lambda o: self._gloo._reduce_scatter_base(output, input, o), lambda n: _divide([output], n)
            )
        return self._wrap("reduce_scatter_tensor", self._gloo._reduce_scatter_base(output, input, opts))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        if opts.reduceOp == dist.ReduceOp.AVG:
            # Only the root holds the sum; the other ranks' tensors are left as gloo leaves them.
            on_root = self.rank() == opts.rootRank
            return self._avg_as_sum(
                "reduce", opts, lambda o: self._gloo.reduce(tensors, o), lambda n: _divide(tensors, n) if on_root else tensors
            )
        return self._wrap("reduce", self._gloo.reduce(tensors, opts))

    def gather(self, output_tensors, input_tensors, opts=None):
        return self._wrap("gather", self._gloo.gather(output_tensors, input_tensors, opts if opts is not None else dist.GatherOptions()))

    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._wrap("scatter", self._gloo.scatter(output_tensors, input_tensors, opts if opts is not None else dist.ScatterOptions()))

    def barrier(self, opts=None):
        o = dist.BarrierOptions()
        if opts is not None:
            o.timeout = opts.timeout
        return self._wrap("barrier", self._gloo.barrier(o))

    def send(self, tensors, dstRank, tag=0):
        _check_user_tag(tag, self.rank())
        return self._gloo.send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        _check_user_tag(tag, self.rank())
        return self._gloo.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        _check_user_tag(tag, self.rank())
        return self._gloo.recv_anysource(tensors, tag)

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the executor and release the rails (shm segments, waiter threads)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=self._timeout.total_seconds())
        for rail in [self._shm, self._board, self._gloo_rail, self._striped, *self._device_rails.values()]:
            if rail is not None:
                rail.close()
        if isinstance(self._wakeup, Doorbell):
            self._wakeup.close()
        # The inner gloo is not shut down explicitly: ProcessGroupGloo.shutdown() racing with
        # the completion callbacks of its last Works aborted processes ("Resource deadlock
        # avoided") in DDP tests. It is released with this object, which holds no reference
        # cycles, so that happens on the thread that destroys the group.

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"HetcommProcessGroup(rank={self.rank()}, size={self.size()}, rails={self.rail_names('cpu')})"


class _GuardedWork(dist.Work):
    """An inner Work without a future: ``wait()`` names the peer at fault when it fails."""

    def __init__(self, inner: "dist.Work", op: str, pg: "HetcommProcessGroup"):
        super().__init__()
        self._inner = inner
        self._op = op
        self._pg = weakref.ref(pg)
        pg._dseq += 1
        self._seq = -pg._dseq

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            return self._inner.wait()
        except Exception as e:
            pg = self._pg()
            ranks, text = pg._culprits(self._seq) if pg is not None else ([], "")
            raise CollectiveError(
                f"failed{text}: {e}", op=self._op, rank=pg.rank() if pg else None,
                peer=ranks[0] if ranks else None, rail="gloo",
            ) from e

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> "torch.futures.Future":
        return self._inner.get_future()


def _is_async(opts) -> bool:
    """Whether the caller keeps the Work (``async_op=True``, or a C++ caller: unknown)."""
    return True if opts is None else bool(getattr(opts, "asyncOp", True))


def _divide(tensors: List[torch.Tensor], n: int) -> List[torch.Tensor]:
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")
    return tensors


def _check_user_tag(tag: int, rank: int) -> None:
    if tag >= TAG_BASE:
        raise UsageError(f"hetcomm send/recv (rank {rank}): tag {tag} is reserved (tags >= {TAG_BASE} are hetcomm's)")


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _splits(sizes: Sequence[int], t: torch.Tensor, n: int, name: str, tname: str, rank: int) -> List[int]:
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
