"""The c10d faces of a :class:`~hetcomm.backends.communicator.Communicator`.

torch.distributed builds one face per group created with backend ``"hetcomm"``
(:mod:`.registry`'s creator picks which):

* torch >= 2.14: :class:`HetcommBackend`, a Python subclass of torch's c10d ``Backend``
  (``torch._C._distributed_c10d.Backend``, ``dist.BackendBase`` on torch main). c10d wraps it in
  a plain ``ProcessGroup`` like a C++ backend (registered for ``cpu``, and ``cuda`` where
  present, as ``BackendType.CUSTOM``), so DeviceMesh, DTensor, FSDP2 and torch's membership
  changes (``shrink_group``, ``_reconfigure``: they act on ``pg._get_backend(device)``) see an
  ordinary backend;
* torch 2.13, whose ``Backend`` has no Python constructor: :class:`HetcommProcessGroup`, a
  Python ``dist.ProcessGroup`` that c10d uses as the group itself.

Both are thin: the shared :class:`_HetcommFace` owns nothing but the group's communicator
(``face.communicator``), which owns the placement, the agreed options, the rails
(:mod:`.railset`), the executor (:mod:`.executor`), fault diagnosis (:mod:`.faults`) and the
wire-dtype policy. Every c10d method forwards:

* routed collectives (``all_to_all_single``, ``all_to_all``, plans) to
  :class:`~hetcomm.backends.routed.RoutedCollectives`: every peer over its own rail;
* delegated collectives (all_reduce, broadcast, all_gather, reduce_scatter, gather, gather into
  one tensor, scatter, reduce, barrier) to :class:`~hetcomm.backends.delegated.DelegatedCollectives` on the inner gloo
  group, so their results are exactly gloo's; send/recv to :class:`~hetcomm.backends.p2p.PointToPoint`
  over it. The functional all_gather/reduce_scatter (C++ callers) reach the same path through
  the trampoline's ``*_single_coalesced`` methods, never gloo with the GIL held. On 2.13 the
  inner gloo group is also registered as the group's C++ fallback backend, for C++ callers of
  methods that trampoline does not forward; a 2.14 ``Backend`` has no fallback, and the methods
  its trampoline does not forward raise torch's "does not support" error (docs/BACKEND.md):
  ``gather_single`` is one, so ``hetcomm.backends.gather_into_tensor`` calls it directly.

Device tensors follow torch's stream contract (ordered after the caller's current stream,
results ready on the waiting thread's stream; :mod:`hetcomm.backends.devices`): the routed
collectives record the caller's event on this (the caller's) thread before the hand-off to the
executor, after the contiguous copies they make, which is why it happens there and not here.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend

from hetcomm import settings
from hetcomm.backends.communicator import Communicator, LateGroupRef
from hetcomm.backends.delegated import DelegatedCollectives
from hetcomm.backends.options import HetcommOptions
from hetcomm.backends.p2p import HEADER_TAG_BASE, PointToPoint
from hetcomm.backends.rank_placement import Placement
from hetcomm.backends.reconfigure import Members, NotConfigured, reconfigure_group, shrink_backend
from hetcomm.backends.reconfigure import supported as reconfigure_supported
from hetcomm.backends.work import FutureWork, HetcommWork
from hetcomm.errors import UsageError

__all__ = ["HetcommBackend", "HetcommProcessGroup", "backend_subclassable", "face_of"]

log = logging.getLogger("hetcomm.backends")


def _configure_logging() -> None:
    level = (settings.LOG.get() or "").upper()
    if level and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.getLevelName(level) if isinstance(logging.getLevelName(level), int) else logging.INFO)


#: Groups not shut down yet (weakly: a destroyed group leaves by itself).
_LIVE: "weakref.WeakSet[_HetcommFace]" = weakref.WeakSet()

#: Each :class:`HetcommBackend`, kept alive by the ``ProcessGroup`` it serves (weak key, strong
#: value: the backend holds the group weakly, so no cycle). Without it, under
#: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the Python object died as soon as the creator returned:
#: c10d registers the ``_ProcessGroupWrapper`` around it, which holds only the C++ trampoline,
#: and every later call failed with "getBackendName is not implemented" (torch keeps a Python
#: backend alive only when it registers that object itself).
_KEEP_ALIVE: "weakref.WeakKeyDictionary[Any, HetcommBackend]" = weakref.WeakKeyDictionary()


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


@functools.lru_cache(maxsize=None)
def backend_subclassable() -> bool:
    """Whether this torch lets Python subclass its c10d ``Backend`` (torch >= 2.14).

    Asked of torch itself, not its version string: 2.13's binding has no constructor
    ("No constructor defined!"), so a subclass cannot be built there.
    """

    class _Probe(_C10dBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return False
    return True


def face_of(group: Any) -> Optional["_HetcommFace"]:
    """The hetcomm face behind ``group``, or None if it does not use backend ``hetcomm``.

    ``group`` is a face itself (2.13: the group *is* its :class:`HetcommProcessGroup`), or a
    ``ProcessGroup`` whose CPU backend is a :class:`HetcommBackend`, possibly inside the
    ``_ProcessGroupWrapper`` that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts around every backend.
    """
    if isinstance(group, _HetcommFace):
        return group
    get = getattr(group, "_get_backend", None)
    if get is None:
        return None
    try:
        backend = get(torch.device("cpu"))
    except RuntimeError:  # no CPU backend (an nccl-only group)
        return None
    for _ in range(4):  # wrappers do not nest deeper than this in torch
        if isinstance(backend, _HetcommFace):
            return backend
        backend = getattr(backend, "wrapped_pg", None)
        if backend is None:
            return None
    return None


class _HetcommFace:
    """What both faces are: a communicator's c10d methods (one implementation for both).

    A mixin, first in each face's bases, so that its methods override the torch base's and the
    pybind11 trampoline finds them by name. The torch base is constructed by the face itself.

    Attributes:
        communicator: the group's :class:`~hetcomm.backends.communicator.Communicator`
            (``hetcomm.communicator(group)`` returns it).
    """

    def _init_face(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: Optional[HetcommOptions],
        global_ranks: Sequence[int],
        group_id: str,
        group: Any,
        enable_reconfigure: bool = False,
    ) -> None:
        """Build the communicator; ``group`` is the torch ProcessGroup it serves (held weakly).
        With ``enable_reconfigure`` there is none until the first :meth:`reconfigure` (torch's contract)."""
        _configure_logging()
        if options is not None and not isinstance(options, HetcommOptions):
            raise UsageError(
                f"pg_options for backend 'hetcomm' must be hetcomm.backends.HetcommOptions, "
                f"got {type(options).__name__}"
            )
        self._group_id = group_id
        self._timeout = timeout
        self._closed = False
        #: Who is in the group and what a membership change rebuilds from (.reconfigure).
        self._members = Members(store, rank, size, options, list(global_ranks), group_id)
        # The communicator holds the group weakly and the face holds it: no reference cycle, so
        # the face (and its inner gloo groups) die by reference counting on the thread that
        # destroys them, never on a gloo callback thread (whose ProcessGroupGloo destructor
        # would join itself).
        self._pg_ref = weakref.ref(group)
        _LIVE.add(self)
        if enable_reconfigure:  # a joining process's group of one publishes nothing until then
            self._install(None)
            return
        self._install(Communicator._for_backend(store, rank, size, timeout, options, global_ranks, group_id, self._pg_ref))

    def _install(self, comm: Optional[Communicator], why: str = "") -> None:
        """Serve every c10d method from ``comm`` (None: every call raises, saying ``why``)."""
        self.communicator = comm  # type: ignore[assignment]
        if comm is None:
            self._routed = self._delegated = self._p2p = NotConfigured(self._members.rank, why)  # type: ignore[assignment]
            return
        routed = comm.routed
        assert routed is not None
        self._routed = routed
        self._delegated = DelegatedCollectives(routed.rails.gloo, comm.rank, comm.world_size, routed.faults, routed)
        self._p2p = PointToPoint(routed.rails.gloo, comm.rank, comm.world_size, comm.timeout, self._delegated.in_flight)
        self._log_routes()

    def _release(self) -> Optional[Communicator]:
        """Stop serving from the current communicator (finished work first) and hand it back."""
        comm = self.communicator
        if comm is not None:
            # Completions still running on gloo's threads finish first (delegated._InFlight):
            # their callbacks must not hold the last reference to what is being closed.
            self._delegated.in_flight.wait_idle(comm.timeout.total_seconds())
            # p2p lanes still waiting in gloo end now, not while the interpreter finalises (p2p.py)
            self._p2p.close()
        return comm

    # -- what the communicator knows -----------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self.communicator.placement

    def rail_names(self, device_type: str = "cpu") -> List[str]:
        """The rail name for every group rank (``"self"`` for this rank) for ``device_type`` tensors."""
        return self._routed.rails.rail_names(device_type)

    def getBackendName(self) -> str:
        """c10d's name of the backend (``Backend.name()``, error messages, flight recorder)."""
        return "hetcomm"

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def _get_sequence_number_for_group(self) -> int:
        """c10d's per-group collective count: ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s wrapper asks
        it before every collective and compares it across ranks (torch's default raises "does
        not yet support sequence numbers"). Every rank counts the same collectives."""
        return self._routed.last_seq

    def _log_routes(self) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        me = self.communicator.rank
        placement = self.placement
        names = self.rail_names("cpu")
        lines = [
            f"hetcomm group {self._group_id or '0'} rank {me}: {placement.describe(me)}"
            + (f"; cluster '{placement.cluster.name}'" if placement.cluster else "; no cluster YAML")
        ]
        if self.communicator.same_host_rail:
            lines.append(f"  same-host rail by host: {self.communicator.same_host_rail}")
        for p in range(self.communicator.world_size):
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

    def gather_single(self, output, input, opts=None):
        """Gather into one tensor: the method ``dist.gather_into_tensor`` / ``dist.gather_single``
        dispatch to, which torch 2.14.1's trampoline does not forward (and 2.13 has neither), so
        :func:`hetcomm.backends.gather_into_tensor` calls it directly, on both versions."""
        return self._delegated.gather_single(output, input, opts)

    def gather_into_tensor(self, output, input, opts=None):
        """Deprecated torch 2.14 name of :meth:`gather_single`."""
        return self.gather_single(output, input, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        return self._delegated.scatter(output_tensors, input_tensors, opts)

    def barrier(self, opts=None):
        return self._delegated.barrier(opts)

    # p2p: a size header first, checked by the receiver (gloo aborts the process on a size
    # mismatch; hetcomm/backends/p2p.py)
    def send(self, tensors, dstRank, tag=0):
        _check_user_tag(tag, self.communicator.rank)
        return self._p2p.send(tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag=0):
        _check_user_tag(tag, self.communicator.rank)
        return self._p2p.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        _check_user_tag(tag, self.communicator.rank)
        return self._p2p.recv(tensors, None, tag)

    # -- membership (torch >= 2.14: dist.shrink_group, dist._reconfigure; .reconfigure) -------
    @property
    def supports_reconfigure(self) -> bool:
        """True where torch has the reconfigure API (>= 2.14; the 2.13 face never gets the call)."""
        return isinstance(self, _C10dBackend) and reconfigure_supported()

    def get_reconfigure_handle(self) -> str:
        """This process's handle for the next :meth:`reconfigure` (the same until then)."""
        return self._members.handle(self.communicator).encode()

    def reconfigure(self, opts) -> dist.Work:
        """Move the group to the membership ``opts.handles`` names (``dist._reconfigure``):
        :func:`hetcomm.backends.reconfigure.reconfigure_group`. Blocking: the Work returned is
        complete; on an error the group keeps its membership."""
        return reconfigure_group(self, opts)

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the executor and release the rails (shm segments, waiter threads)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        comm = self._release()
        if comm is not None:
            comm.close()
        # The inner gloo is not shut down explicitly: ProcessGroupGloo.shutdown() racing with
        # the completion callbacks of its last Works aborted processes ("Resource deadlock
        # avoided") in DDP tests. It is released with this object, which holds no reference
        # cycles, so that happens on the thread that destroys the group.

    def abort(self) -> None:
        self.shutdown()


class HetcommBackend(_HetcommFace, _C10dBackend):
    """The hetcomm group as torch's c10d ``Backend`` (torch >= 2.14): c10d's ``ProcessGroup``
    dispatches to it through the pybind11 trampoline, which forwards every method of
    :class:`_HetcommFace` above (``docs/BACKEND.md``, "The c10d Backend").

    Args:
        store: the group's store (already prefixed by c10d).
        rank: this process's rank in the group.
        size: number of ranks in the group.
        timeout: the group timeout; every wait of every collective is bounded by it.
        options: :class:`HetcommOptions` (``pg_options``); ``HETCOMM_*`` variables fill the
            fields not passed explicitly. (``backend.options`` stays torch's
            ``Backend.Options``, which ``shrink``/``split`` read; the agreed HetcommOptions are
            ``backend.communicator.options``.)
        global_ranks: global rank of each group rank (empty for the default group).
        group_id: c10d's name of the group (for logs).
        process_group: the ``ProcessGroup`` c10d made for this backend (the creator's
            ``opts.process_group``): the group the communicator serves.

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
        process_group: Optional[dist.ProcessGroup] = None,
        enable_reconfigure: bool = False,
    ):
        _C10dBackend.__init__(self, rank, size)
        if process_group is None:
            raise UsageError(
                f"HetcommBackend (rank {rank}): process_group is required (c10d passes it to the "
                f"creator as opts.process_group); create groups with backend='hetcomm'"
            )
        self._init_face(store, rank, size, timeout, options, global_ranks, group_id, process_group, enable_reconfigure)
        self._c10d_options = _c10d_options(timeout, global_ranks)
        _KEEP_ALIVE[process_group] = self

    @classmethod
    def _adopt(cls, comm: Communicator, members: Members, timeout: timedelta, group_id: str, group_ref) -> "HetcommBackend":
        """A backend serving ``comm``, built by a membership change (no second communicator);
        ``group_ref()`` is the ProcessGroup it serves (a :class:`LateGroupRef` for a shrink)."""
        self = cls.__new__(cls)
        _C10dBackend.__init__(self, comm.rank, comm.world_size)
        _configure_logging()
        self._group_id, self._timeout, self._closed, self._members = group_id, timeout, False, members
        self._pg_ref = group_ref
        self._c10d_options = _c10d_options(timeout, ())
        _LIVE.add(self)
        self._install(comm)
        group = group_ref() if not isinstance(group_ref, LateGroupRef) else None
        if group is not None:
            _KEEP_ALIVE[group] = self
        return self

    # -- what c10d asks of a backend ---------------------------------------------------------
    # torch 2.14.1's trampoline answers each of these C++ questions by looking the Python
    # attribute up and calling it; without an override here that attribute is torch's own
    # property, which asks the trampoline again: RecursionError (batch_isend_irecv reads
    # supports_coalescing, shrink_group supports_shrinking, new_group's split path
    # supports_splitting). Subclasses that add a capability override the one property.
    # supports_reconfigure is the face's (True on torch >= 2.14).
    @property
    def options(self) -> "_C10dBackend.Options":
        """torch's ``Backend.Options`` (backend ``"hetcomm"``, the group timeout, the group's
        global ranks); the agreed :class:`HetcommOptions` are ``communicator.options``."""
        return self._c10d_options

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_time_estimate(self) -> bool:
        return False

    @property
    def supports_shrinking(self) -> bool:
        """``dist.shrink_group`` works on hetcomm groups (:meth:`shrink`)."""
        return True

    @property
    def supports_window(self) -> bool:
        return False

    def shrink(self, ranks_to_exclude: List[int], shrink_flags: int = 0, opts_override=None) -> "HetcommBackend":
        """``dist.shrink_group``'s backend step: a new backend over the survivors
        (:func:`hetcomm.backends.reconfigure.shrink_backend`; ``shrink_flags`` and
        ``opts_override`` are accepted and unused: nothing runs to abort, the options stay)."""
        return shrink_backend(self, ranks_to_exclude)

    def __repr__(self) -> str:
        return f"HetcommBackend(rank={self.rank()}, size={self.size()}, rails={self.rail_names('cpu')})"


class HetcommProcessGroup(_HetcommFace, dist.ProcessGroup):
    """The hetcomm group as a Python ``dist.ProcessGroup`` (torch 2.13, whose ``Backend`` cannot
    be subclassed from Python): c10d uses this object as the group itself.

    Args: as :class:`HetcommBackend`, without ``process_group`` (the group is this object).

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
    ):
        dist.ProcessGroup.__init__(self, rank, size)  # the 3-arg (store, rank, size) ctor fails in 2.13
        self._group_name = ""
        self._group_desc = ""
        self._init_face(store, rank, size, timeout, options, global_ranks, group_id, self)
        # C++ callers of methods the 2.13 trampoline does not forward land on this backend.
        gloo = self._routed.rails.gloo
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, gloo)
        if torch.cuda.device_count() > 0:  # NVML first: no CUDA initialisation (registry.py)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM, gloo)

    @property
    def options(self) -> HetcommOptions:
        """The agreed options (explicit ``pg_options`` fields, then ``HETCOMM_*``, then defaults)."""
        return self.communicator.options

    # -- identity (c10d needs these on a Python group) ---------------------------------------
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"HetcommProcessGroup(rank={self.rank()}, size={self.size()}, rails={self.rail_names('cpu')})"


def _c10d_options(timeout: timedelta, global_ranks: Sequence[int]) -> "_C10dBackend.Options":
    """torch's ``Backend.Options`` of a hetcomm backend (what c10d's shrink and split read)."""
    opts = _C10dBackend.Options("hetcomm", timeout)
    opts.global_ranks_in_group = list(global_ranks)
    return opts


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

