"""``HetcommProcessGroup``: the c10d face of a :class:`~hetcomm.backends.communicator.Communicator`.

torch.distributed builds one per group created with backend ``"hetcomm"``. It owns nothing but
its communicator (``group.communicator``), which owns the placement, the agreed options, the
rails (:mod:`.railset`), the executor (:mod:`.executor`), fault diagnosis (:mod:`.faults`) and
the wire-dtype policy. Every c10d method forwards:

* routed collectives (``all_to_all_single``, ``all_to_all``, plans) to
  :class:`~hetcomm.backends.routed.RoutedCollectives`: every peer over its own rail;
* delegated collectives (all_reduce, broadcast, all_gather, reduce_scatter, gather, scatter,
  reduce, barrier) to :class:`~hetcomm.backends.delegated.DelegatedCollectives` on the inner gloo
  group, so their results are exactly gloo's; send/recv straight to it. The functional
  all_gather/reduce_scatter (C++ callers) reach the same path through the trampoline's
  ``*_single_coalesced`` methods, never gloo with the GIL held. The inner gloo group is also
  registered as the group's C++ fallback backend, for C++ callers of methods the 2.13 trampoline
  does not forward.

Device tensors follow torch's stream contract (ordered after the caller's current stream,
results ready on the waiting thread's stream; :mod:`hetcomm.backends.devices`): the routed
collectives record the caller's event on this (the caller's) thread before the hand-off to the
executor, after the contiguous copies they make, which is why it happens there and not here.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from hetcomm import settings
from hetcomm.backends.communicator import Communicator
from hetcomm.backends.delegated import DelegatedCollectives
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.p2p import HEADER_TAG_BASE, PointToPoint
from hetcomm.backends.rank_placement import Placement
from hetcomm.backends.reconfigure import Members, NotConfigured as _NotConfigured, done_work as _done
from hetcomm.backends.reconfigure import supported as reconfigure_supported
from hetcomm.backends.work import FutureWork, HetcommWork
from hetcomm.errors import UsageError

__all__ = ["HetcommProcessGroup"]

log = logging.getLogger("hetcomm.backends")


def _configure_logging() -> None:
    level = (settings.LOG.get() or "").upper()
    if level and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.getLevelName(level) if isinstance(logging.getLevelName(level), int) else logging.INFO)


#: Groups not shut down yet (weakly: a destroyed group leaves by itself).
_LIVE: "weakref.WeakSet[HetcommProcessGroup]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_groups() -> None:
    """Shut down the groups a program left alive (no ``destroy_process_group()`` before exit).

    Their executor and heartbeat threads (and p2p lanes) were still running when the interpreter
    finalised: a thread inside a store or gloo call (C++, GIL released) that returns then is
    ended by CPython through pybind11's ``noexcept`` GIL guard, and ``std::terminate`` aborts the
    process ("terminate called without an active exception", exit -6; 3 of 30 rank exits of
    ``tests.backends.exit_driver dispatch --no-destroy``). atexit handlers run before that, while
    threads still run normally; each shutdown is bounded by its group timeout.
    """
    for group in list(_LIVE):
        try:
            group.shutdown()
        except Exception:  # exiting anyway: a failed shutdown must not hide the real exit status
            pass


class HetcommProcessGroup(dist.ProcessGroup):
    """A process group whose all-to-alls route every peer over its own rail.

    Args:
        store: the group's store (already prefixed by c10d).
        rank: this process's rank in the group.
        size: number of ranks in the group.
        timeout: the group timeout; every wait of every collective is bounded by it.
        options: :class:`HetcommOptions` (``pg_options``); ``HETCOMM_*`` variables fill the
            fields not passed explicitly.
        global_ranks: global rank of each group rank (empty for the default group).
        group_id: c10d's id of the group (for logs).

    Raises:
        ConfigError: a setting that must agree differs between ranks (on every rank).
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
        enable_reconfigure: bool = False,
    ):
        super().__init__(rank, size)  # the 3-arg (store, rank, size) ctor fails in 2.13
        _configure_logging()
        if options is not None and not isinstance(options, HetcommOptions):
            raise UsageError(
                f"pg_options for backend 'hetcomm' must be hetcomm.backends.HetcommOptions, "
                f"got {type(options).__name__}"
            )
        self._group_name = ""
        self._group_desc = ""
        self._group_id = group_id
        self._timeout = timeout
        self._closed = False
        #: What a membership change rebuilds from (:mod:`hetcomm.backends.reconfigure`).
        self._members = Members(store, rank, size, options, list(global_ranks), group_id)
        self._registered = False
        if enable_reconfigure:
            # torch's contract: no communicator until the first reconfigure() (a joining process
            # creates its group of one this way and publishes nothing under the others' keys).
            self._install(None)
        else:
            #: The group's communicator (``hetcomm.communicator(group)`` returns it). It holds the
            #: group weakly and the group holds it: no reference cycle, so the group (and its
            #: inner gloo groups) die by reference counting on the thread that destroys them,
            #: never on a gloo callback thread (whose ProcessGroupGloo destructor would join itself).
            self._install(Communicator._for_backend(store, rank, size, timeout, options, global_ranks, group_id,
                                                    weakref.ref(self)))
        _LIVE.add(self)

    def _install(self, comm: Optional[Communicator]) -> None:
        """Serve the c10d methods from ``comm`` (None: not configured yet, every call raises)."""
        if comm is None:
            self.communicator = None  # type: ignore[assignment]
            self._routed = self._delegated = self._p2p = _NotConfigured(self._members.rank)  # type: ignore[assignment]
            return
        routed = comm.routed
        assert routed is not None
        rank, size = comm.rank, comm.world_size
        self.communicator = comm
        self._routed = routed
        self._delegated = DelegatedCollectives(routed.rails.gloo, rank, size, routed.faults, routed)
        self._p2p = PointToPoint(routed.rails.gloo, rank, size, comm.timeout, self._delegated.in_flight)
        if not self._registered:
            # C++ callers of methods the 2.13 trampoline does not forward land on this backend.
            # 2.14's trampoline also forwards all_gather_single, reduce_scatter_single, reduce,
            # alltoall, gather and scatter to the methods below; the rest still land here. c10d
            # keeps the first backend registered for a device: after a membership change the
            # methods it does not forward still reach the first membership's gloo (BACKEND.md).
            self._registered = True
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, routed.rails.gloo)
            if torch.cuda.device_count() > 0:  # NVML first: no CUDA initialisation (registry.py)
                self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, routed.rails.gloo)
        self._log_routes()

    # -- membership (torch >= 2.14: dist._reconfigure; hetcomm.backends.reconfigure) -----------
    def rank(self) -> int:
        """This process's rank in the group's current membership."""
        return self._members.rank

    def size(self) -> int:
        """The size of the group's current membership."""
        return self._members.size

    @property
    def supports_reconfigure(self) -> bool:
        """True where torch has the reconfigure API (>= 2.14)."""
        return reconfigure_supported()

    def get_reconfigure_handle(self) -> str:
        """This process's handle for the next :meth:`reconfigure` (the same until then)."""
        return self._members.handle(self.communicator).encode()

    def reconfigure(self, opts) -> dist.Work:
        """Move this group to the membership ``opts.handles`` names (``dist._reconfigure``).

        Blocking: the returned Work is complete. On an error the group keeps its membership.

        Raises:
            UsageError: bad handles (damaged, repeated, this process's missing).
            PeerTimeout: a member did not answer within ``opts.timeout`` (default: the group's).
            ConfigError: the members passed different handles.
        """
        old = self.communicator
        new = self._members.reconfigure(opts, old, self._timeout, weakref.ref(self), self._is_default())
        self._swap(old, new)
        return _done()

    def _is_default(self) -> bool:
        return dist.is_initialized() and dist.distributed_c10d._world.default_pg is self

    def _swap(self, old: Optional[Communicator], new: Communicator) -> None:
        """Serve from ``new`` and close ``old`` (its dead peers' waits end at once: nothing runs)."""
        if old is not None:
            self._delegated.in_flight.wait_idle(old.timeout.total_seconds())
            self._p2p.close()
        self._install(new)
        if old is not None:
            old.close()
        if self._is_default():  # c10d's rank map of the default group follows the new numbering
            dist.distributed_c10d._world.pg_group_ranks[self] = {r: r for r in range(new.world_size)}

    # -- what the communicator knows -----------------------------------------------------------
    @property
    def options(self) -> HetcommOptions:
        """The agreed options (explicit ``pg_options`` fields, then ``HETCOMM_*``, then defaults)."""
        return self.communicator.options

    @property
    def placement(self) -> Placement:
        return self.communicator.placement

    def rail_names(self, device_type: str = "cpu") -> List[str]:
        """The rail name for every group rank (``"self"`` for this rank) for ``device_type`` tensors."""
        return self._routed.rails.rail_names(device_type)

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

    def _log_routes(self) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        me = self.rank()
        placement = self.placement
        names = self.rail_names("cpu")
        lines = [
            f"hetcomm group {self._group_id or '0'} rank {me}: {placement.describe(me)}"
            + (f"; cluster '{placement.cluster.name}'" if placement.cluster else "; no cluster YAML")
        ]
        if self.communicator.same_host_rail:
            lines.append(f"  same-host rail by host: {self.communicator.same_host_rail}")
        for p in range(self.size()):
            if p != me:
                lines.append(
                    f"  peer {p} [{placement.describe(p)}] link {placement.link_class(me, p).name}"
                    f" -> rail {names[p]} (CPU tensors)"
                )
        labels = sorted({r.model for r in placement.ranks if r.label_only})
        if labels:
            lines.append(f"  device kinds that are labels only (CPU processes): {', '.join(labels)}")
        log.info("\n".join(lines))

    # -- routed collectives -------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: see :meth:`RoutedCollectives.all_to_all_single
        <hetcomm.backends.routed.RoutedCollectives.all_to_all_single>`."""
        return self._routed.all_to_all_single(output, input, output_split_sizes, input_split_sizes, _is_async(opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Pre-2.13 name of :meth:`all_to_all_single` (the trampoline tries both)."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all`` (list form): see :meth:`RoutedCollectives.all_to_all
        <hetcomm.backends.routed.RoutedCollectives.all_to_all>`."""
        return self._routed.all_to_all(output_tensors, input_tensors, _is_async(opts))

    def run_plan(self, plan, output: torch.Tensor, input: torch.Tensor) -> HetcommWork:
        """Execute a :class:`~hetcomm.sched.plan.Plan` (async); see :meth:`RoutedCollectives.run_plan
        <hetcomm.backends.routed.RoutedCollectives.run_plan>`."""
        return self._routed.run_plan(plan, output, input)

    # -- delegated collectives (results identical to gloo) ------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._delegated.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._delegated.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, opts=None):
        return self._delegated.broadcast(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._delegated.allgather(output_tensors, input_tensors, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self._delegated.allgather_coalesced(output_lists, input_list, opts)

    def all_gather_single(self, output, input, opts=None):
        return self._delegated.all_gather_single(output, input, opts)

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(self, output_tensors, input_tensors, opts=None):
        """The functional all_gather (``funcol.all_gather_tensor`` and other C++ callers): one
        :meth:`all_gather_single` per pair. Served here, not by the C++ fallback backend: the 2.13
        trampoline calls its fallback with the GIL held, and a gloo worker that frees a finished
        Work under its queue lock needs the GIL to drop the tensors' Python objects, so the two
        waited for each other for good (a rank stuck in ``ProcessGroupGloo::enqueue``, 3 of 12
        runs of 20 functional collectives under load). Here gloo is entered through its Python
        binding, which releases the GIL."""
        return _all_of([self.all_gather_single(o, i, opts) for o, i in zip(output_tensors, input_tensors)])

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        return self._delegated.reduce_scatter(output_tensors, input_lists, opts)

    def reduce_scatter_single_coalesced(self, output_tensors, input_tensors, opts=None):
        """The functional reduce_scatter (``funcol.reduce_scatter_tensor``): one
        :meth:`reduce_scatter_single` per pair, for the reason given in
        :meth:`all_gather_single_coalesced`."""
        return _all_of([self.reduce_scatter_single(o, i, opts) for o, i in zip(output_tensors, input_tensors)])

    def reduce_scatter_single(self, output, input, opts=None):
        return self._delegated.reduce_scatter_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def reduce(self, tensors, opts=None):
        return self._delegated.reduce(tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        return self._delegated.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._delegated.scatter(output_tensors, input_tensors, opts)

    def barrier(self, opts=None):
        return self._delegated.barrier(opts)

    # p2p: a size header first, checked by the receiver (gloo aborts the process on a size
    # mismatch; hetcomm/backends/p2p.py)
    def send(self, tensors, dstRank, tag=0):
        _check_user_tag(tag, self.rank())
        return self._p2p.send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        _check_user_tag(tag, self.rank())
        return self._p2p.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        _check_user_tag(tag, self.rank())
        return self._p2p.recv(tensors, None, tag)

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the executor and release the rails (shm segments, waiter threads)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self.communicator is None:  # never configured (enable_reconfigure=True)
            return
        # Completions still running on gloo's threads finish first (delegated._InFlight): their
        # callbacks must not be left holding the last reference to a group being destroyed.
        self._delegated.in_flight.wait_idle(self.communicator.timeout.total_seconds())
        # p2p lanes still waiting in gloo end now, not while the interpreter finalises (p2p.py)
        self._p2p.close()
        self.communicator.close()
        # The inner gloo is not shut down explicitly: ProcessGroupGloo.shutdown() racing with
        # the completion callbacks of its last Works aborted processes ("Resource deadlock
        # avoided") in DDP tests. It is released with this object, which holds no reference
        # cycles, so that happens on the thread that destroys the group.

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"HetcommProcessGroup(rank={self.rank()}, size={self.size()}, rails={self.rail_names('cpu')})"


def _all_of(works: List[dist.Work]) -> dist.Work:
    """One Work for ``works`` (the Work itself when there is one)."""
    if len(works) == 1:
        return works[0]
    return FutureWork(torch.futures.collect_all([w.get_future() for w in works]))


def _is_async(opts) -> bool:
    """Whether the caller keeps the Work (``async_op=True``, or a C++ caller: unknown)."""
    return True if opts is None else bool(opts.asyncOp)


def _check_user_tag(tag: int, rank: int) -> None:
    if tag < 0 or tag >= HEADER_TAG_BASE:
        raise UsageError(
            f"hetcomm send/recv (rank {rank}): tag {tag} is out of range: user tags are 0 <= tag < "
            f"{HEADER_TAG_BASE} (larger ones carry hetcomm's size headers and internal transfers)"
        )

