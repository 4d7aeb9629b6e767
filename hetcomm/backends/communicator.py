"""``hetcomm.Communicator``: one object per expert-parallel process group.

A communicator knows who is where (the :class:`~hetcomm.backends.rank_placement.Placement`), the
effective :class:`~hetcomm.backends.options.HetcommOptions`, the wire-dtype policy and the
statistics, and offers DeepEP-shaped :meth:`Communicator.dispatch` / :meth:`Communicator.combine`
(a face of the token engine, :mod:`hetcomm.backends.tokens`).

Two kinds of group:

* a ``hetcomm`` group (``backend="hetcomm"``): the group builds its communicator when c10d
  creates it, and ``Communicator(group)`` / :func:`communicator` return that one object (it owns
  the rails and the executor; the group is its c10d face);
* any other group (``gloo``, ``nccl``): the communicator places the ranks through the group's
  store and moves data with that group's own collectives.

Data flow (README): topology -> cluster -> placement/plan -> **communicator** -> rails -> layer.
"""

from __future__ import annotations

import os
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.agreement import agree, settings_of
from hetcomm.backends.options import HetcommOptions, options_from_env
from hetcomm.backends.rank_placement import Placement, build_placement
from hetcomm.backends.tokens.wire import link_wire_dtype
from hetcomm.errors import UsageError

if TYPE_CHECKING:
    from hetcomm.backends.routed import RoutedCollectives

__all__ = ["Communicator", "communicator", "LateGroupRef"]

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo groups

#: The communicator each hetcomm group built for itself (:meth:`Communicator._for_backend`),
#: keyed weakly by the group. ``Communicator(group)`` looks a group up here instead of importing
#: its c10d face (``hetcomm.backends.process_group`` imports this module, not the other way).
_GROUP_OWNED: "weakref.WeakKeyDictionary[Any, Communicator]" = weakref.WeakKeyDictionary()


class LateGroupRef:
    """The group of a communicator built before c10d made its ProcessGroup (``dist.shrink_group``:
    the backend's ``shrink`` returns first, then c10d wraps it in a new group). Called like a
    weak reference; it finds the group at the first call after c10d registered it (``serves``
    recognises it) and then registers the communicator as that group's (``Communicator(group)``)."""

    def __init__(self, serves: Callable[[Any], bool]) -> None:
        self._serves = serves
        self._ref: Optional[Callable[[], Any]] = None
        self.comm: Optional["Communicator"] = None
        _LATE.add(self)

    def __call__(self):
        if self._ref is not None:
            return self._ref()
        import torch.distributed as dist

        for pg in list(dist.distributed_c10d._world.pg_map):
            if self._serves(pg):
                self._ref = weakref.ref(pg)
                if self.comm is not None:
                    _GROUP_OWNED[pg] = self.comm
                _LATE.discard(self)
                return pg
        return None


#: Late references not bound yet (weakly: one whose communicator died leaves by itself).
_LATE: "weakref.WeakSet[LateGroupRef]" = weakref.WeakSet()


def _bind_late(pg) -> Optional["Communicator"]:
    """The communicator of ``pg`` when a :class:`LateGroupRef` serves it (binding it), else None."""
    for late in list(_LATE):
        if late() is pg:
            return late.comm
    return None


def _resolve_group(group):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError(
            "hetcomm.Communicator needs an initialised process group; call "
            "torch.distributed.init_process_group(...) first"
        )
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _group_store(group) -> "torch.distributed.Store":
    """The store c10d made for ``group`` (already prefixed per group)."""
    import torch.distributed as dist

    return dist.distributed_c10d._world.pg_map[group][1]


def _group_timeout(group) -> timedelta:
    """The group's timeout (gloo keeps it in its options; other backends: torch's default)."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # a group without a CPU backend (nccl only)
        return _DEFAULT_TIMEOUT
    if isinstance(backend, ProcessGroupGloo):
        return backend.options._timeout
    return _DEFAULT_TIMEOUT


def _global_ranks(group) -> List[int]:
    """Global rank of each group rank; empty for the default group (build_placement's convention)."""
    import torch.distributed as dist

    if group is dist.distributed_c10d._get_default_group():
        return []
    return list(dist.get_process_group_ranks(group))


class Communicator:
    """The communicator of one process group.

    Args:
        group: a ``torch.distributed`` process group (default: the default group). A ``hetcomm``
            group already has its communicator: that object is returned.
        cluster: path of a cluster YAML or a :class:`~hetcomm.topo.cluster.Cluster`; default
            ``options.cluster`` / ``$HETCOMM_CLUSTER``, else placement by hostname.
        options: :class:`HetcommOptions`; fields set explicitly win over ``HETCOMM_*``
            environment variables, which fill the rest.

    Attributes:
        group: the torch ProcessGroup.
        rank / world_size: this process in the group.
        options: the effective options (explicit fields, then environment, then defaults).
        cluster: the :class:`~hetcomm.topo.cluster.Cluster`, or None (hostname placement).
        placement: who is where (:class:`Placement`).
        timeout: the group timeout; every wait of the communicator is bounded by it.

    Raises:
        ConfigError: a setting that must agree differs between ranks (every rank raises,
            naming the ranks and each differing field), or a bad option / cluster file.
        UsageError: no process group is initialised, or options given for a hetcomm group that
            already has different ones.
    """

    _group_ref: Callable[[], Any]
    _initialized: bool = False
    #: The default group's heartbeat (hetcomm.backends.heartbeat), started with its rails.
    _heartbeat: Any = None

    def __new__(cls, group=None, *, cluster=None, options: Optional[HetcommOptions] = None):
        pg = _resolve_group(group)
        comm = _GROUP_OWNED.get(pg)
        if comm is None:
            comm = _bind_late(pg)
        if comm is not None:  # a hetcomm group: it built its communicator when c10d created it
            if options is not None and options_from_env(options) != comm.options:
                raise UsageError(
                    f"hetcomm.Communicator (rank {comm.rank}): this hetcomm group was created with "
                    f"options {comm.options}; pass pg_options= to new_group() instead of options="
                )
            if cluster is not None and not _same_cluster(cluster, comm.cluster):
                raise UsageError(
                    f"hetcomm.Communicator (rank {comm.rank}): this hetcomm group uses cluster "
                    f"{comm.cluster.name if comm.cluster else None!r}; set HetcommOptions.cluster at "
                    f"new_group(pg_options=...) instead of cluster="
                )
            return comm
        return super().__new__(cls)

    def __init__(self, group=None, *, cluster=None, options: Optional[HetcommOptions] = None):
        if self._initialized:  # a hetcomm group's own communicator, returned by __new__
            return
        import torch.distributed as dist

        pg = _resolve_group(group)
        if options is not None and not isinstance(options, HetcommOptions):
            raise UsageError(f"options must be hetcomm.backends.HetcommOptions, got {type(options).__name__}")
        cluster_obj = None
        if isinstance(cluster, (str, os.PathLike)):
            options = (options or HetcommOptions()).with_changes(cluster=os.fspath(cluster))
        elif cluster is not None:
            cluster_obj = cluster  # a loaded or detected Cluster
        opts = options_from_env(options)
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        store = _CommStore.prefixed(_group_store(pg), pg)
        timeout = _group_timeout(pg)
        placement = build_placement(
            store, rank, size, _global_ranks(pg), cluster_obj if cluster_obj is not None else opts.cluster, timeout
        )
        # Weakly: a communicator (cached by communicator(), kept by a layer) must not keep its
        # group alive past destroy_process_group(), or the group's gloo threads die inside the
        # interpreter's finalisation ("terminate called without an active exception").
        self._setup(weakref.ref(pg), rank, size, opts, placement, timeout)
        agree(store, rank, size, settings_of(opts, placement), timeout, what=f"hetcomm.Communicator over {dist.get_backend(pg)} group")

    def _setup(self, group_ref: Callable[[], Any], rank: int, size: int, options: HetcommOptions, placement: Placement, timeout: timedelta) -> None:
        self._group_ref = group_ref
        self.rank = rank
        self.world_size = size
        self.options = options
        self.placement = placement
        self.timeout = timeout
        #: The routed collectives (rails, executor); None over a non-hetcomm group.
        self.routed: Optional["RoutedCollectives"] = None
        #: The way CPU tensors travel between same-host peers, per host and size class, as
        #: calibrated (or as configured): ``host|node -> SameHostRails`` (``str()`` reads e.g.
        #: ``gloo at 1 MiB, cma at 4 MiB, cma at 16 MiB``; see :mod:`hetcomm.backends.calibrate`);
        #: empty over a non-hetcomm group.
        self.same_host_rail: Dict[str, Any] = {}
        self._initialized = True

    @classmethod
    def _for_backend(
        cls,
        store,
        rank: int,
        size: int,
        timeout: timedelta,
        options: Optional[HetcommOptions],
        global_ranks: Sequence[int],
        group_id: str,
        group_ref: Callable[[], Any],
        watch_peers: Optional[bool] = None,
    ) -> "Communicator":
        """The communicator of a hetcomm group face (:mod:`hetcomm.backends.process_group`)
        under construction: places the ranks, agrees on the settings, builds the rails and the
        executor. ``group_ref()`` returns the group (held weakly: the group holds this object).
        ``watch_peers``: run the heartbeat, watching every peer (:mod:`hetcomm.backends.heartbeat`); None: for the
        default group (no ``global_ranks``) only. A membership change of the default group
        names its slots as ``global_ranks`` and asks for it (:mod:`hetcomm.backends.reconfigure`).

        Raises:
            ConfigError: settings differ between ranks (before any rail is built).
        """
        from hetcomm.backends.calibrate import same_host_rails
        from hetcomm.backends.executor import Executor
        from hetcomm.backends.faults import FaultDiagnosis
        from hetcomm.backends.planpick import plan_model
        from hetcomm.backends.railset import RailSet
        from hetcomm.backends.routed import RoutedCollectives

        from hetcomm.backends.claim import claim_rank

        # Before anything is published: a process that joined another job's store says so now.
        claim_rank(store, rank, size)
        opts = options_from_env(options)
        placement = build_placement(store, rank, size, global_ranks, opts.cluster, timeout)
        comm = super().__new__(cls)
        comm._setup(group_ref, rank, size, opts, placement, timeout)
        if isinstance(group_ref, LateGroupRef):
            group_ref.comm = comm  # registered in _GROUP_OWNED once c10d has made the group
        else:
            _GROUP_OWNED[group_ref()] = comm  # the group dies with its construction if that fails below
        # Before any rail: two ring layouts of one shared segment would corrupt each other.
        # plan_model: the cost model's rate scale, an input of every adaptive plan decision.
        agree(store, rank, size, settings_of(opts, placement, {"plan_model": plan_model()}), timeout)
        # Inner waits get 75 % of the group timeout, so that naming the peer at fault (up to
        # 10 % more, see faults.py) still ends within the timeout the user gave.
        inner = timedelta(seconds=timeout.total_seconds() * 0.75)
        me = weakref.proxy(comm)  # no cycle: the rails must die by reference counting
        rails = RailSet(store, rank, size, timeout, inner, opts, placement, lambda peer, dt: me.wire_dtype(peer, dt))
        try:
            comm.same_host_rail = same_host_rails(store, rails, opts, placement, rank, size, timeout)
            rails.set_same_host_rails(comm.same_host_rail)
            faults = FaultDiagnosis(store, placement, rank, size, timeout, lambda: rails.rail_names("cpu"))
            executor = Executor(group_id, rank, faults.blame)
        except BaseException:
            rails.close()
            raise
        comm.routed = RoutedCollectives(rails, executor, faults, opts, placement, rank, size, inner.total_seconds())
        if watch_peers if watch_peers is not None else not global_ranks:  # the default group: watch every peer
            from hetcomm.backends import heartbeat

            # give_up_s: a survivor whose store host stopped exits within the group timeout.
            comm._heartbeat = heartbeat.start_for(store, rank, size, placement, give_up_s=timeout.total_seconds())
        return comm

    # -- identity ---------------------------------------------------------------------------
    @property
    def group(self):
        """The torch ProcessGroup this communicator serves."""
        return self._group_ref()

    @property
    def cluster(self):
        """The :class:`~hetcomm.topo.cluster.Cluster` the placement came from, or None."""
        return self.placement.cluster

    # -- wire dtypes --------------------------------------------------------------------------
    def wire_dtype(self, peer: int, dtype: torch.dtype, policy: Optional[str] = None) -> Optional[torch.dtype]:
        """The dtype a ``dtype`` tensor travels in between this rank and ``peer``; None = as is.

        One vocabulary for the backend and the MoE layer (:mod:`hetcomm.wire_dtypes`):
        ``exact`` keeps every dtype; ``cluster`` (alias ``auto``) follows the cluster YAML's
        ``wire_dtype`` per link class (FP16 across vendors, FP32 elsewhere, by default);
        ``fp32``/``fp16``/``bf16`` force one. Only floating-point tensors are cast, and only to a
        narrower dtype (an FP32 wire for FP16 tensors keeps FP16, an FP16 wire for BF16 tensors
        keeps BF16), so the answer is None whenever the tensor already is at most as wide as the
        wire. The rule itself is :func:`hetcomm.backends.tokens.wire.link_wire_dtype`, the one
        every rail and both token faces follow.

        Args:
            peer: group rank of the other end (this rank: always None).
            dtype: the tensor's dtype.
            policy: override of ``options.wire_dtype`` (e.g. the MoE layer's ``wire_dtype``).
        """
        own = peer == self.rank  # one's own rows never travel; the policy is checked all the same
        wire = link_wire_dtype(
            dtype, policy if policy is not None else self.options.wire_dtype,
            lambda: None if own else self.placement.wire_dtype(self.rank, peer),
        )
        return None if own else wire

    # -- statistics ---------------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per-rail counters of this process (``hetcomm.stats()``; see :mod:`hetcomm.backends.stats`)."""
        from hetcomm.backends.stats import stats

        return stats()

    @property
    def plan_paths(self) -> Dict[str, Any]:
        """How this rank's ``all_to_all_single`` calls went (``hetcomm.backends.planpick``):
        ``taken`` (calls per path: ``direct``, ``hier``, ...), ``eligible`` (whether ``adaptive``
        may plan on this group at all), ``decisions`` (per shape class cached so far: the path
        and the predicted seconds of the direct path and of the choice), ``cluster`` (the
        cluster the planner sees, None = direct only). Empty over a non-hetcomm group."""
        if self.routed is None:
            return {}
        ch = self.routed.chooser
        return {
            "strategy": ch.strategy,
            "taken": dict(ch.taken),
            "eligible": ch.needs_traffic,
            "decisions": [(d[0] or "direct", d[1], d[2]) for d in ch.decisions.values()],
            "cluster": None if ch.cluster is None else ch.cluster.name,
        }

    # -- data movement ---------------------------------------------------------------------
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ):
        """``dist.all_to_all_single`` on this communicator's group.

        Args:
            output: ``[sum(output_split_sizes), *S]``, any dtype, same device as ``input``.
            input: ``[sum(input_split_sizes), *S]``.
            output_split_sizes / input_split_sizes: rows per rank (None = equal split).
            async_op: return the Work instead of waiting.

        Returns:
            The Work when ``async_op``, else None. On a hetcomm group every peer goes over its
            rail; on any other group it is that group's own all-to-all.
        """
        if self.routed is not None:
            work = self.routed.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)
            if async_op:
                return work
            work.wait()
            return None
        import torch.distributed as dist

        return dist.all_to_all_single(
            output, input, list(output_split_sizes) if output_split_sizes is not None else None,
            list(input_split_sizes) if input_split_sizes is not None else None, group=self.group, async_op=async_op,
        )

    def close(self) -> None:
        """Stop the executor and release the rails (a hetcomm group calls it at shutdown)."""
        if self.routed is not None:
            if self._heartbeat is not None:
                from hetcomm.backends import heartbeat

                heartbeat.stop(self._heartbeat)
                self._heartbeat = None
            self.routed.executor.close(self.timeout.total_seconds())
            self.routed.rails.close()

    # -- token dispatch (DeepEP-shaped; a face of the token engine, backends/tokens) -----------
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        expert_to_rank,
        capacity: Optional[int] = None,
        async_op: bool = False,
        num_chunks: int = 1,
        split_by_expert: bool = False,
        wire_dtype: Optional[str] = None,
    ):
        """Send each token's row to the ranks of its top-k experts (once per destination rank).

        Args:
            x: ``[T, D]`` token rows (any float dtype, any device).
            topk_idx: ``[T, k]`` int64 expert ids (``-1`` = no expert).
            topk_weights: ``[T, k]`` float gate weights.
            expert_to_rank: group rank of every expert (``[E]``).
            capacity: copies per expert kept at most, an integer >= 0 (None = dropless).
            async_op: return before the rows arrive (``result.work``).
            num_chunks: chunks of the pipelined exchange.
            split_by_expert: ``recv_x`` as one piece per local expert.
            wire_dtype: wire-dtype policy of these rows (None: ``options.wire_dtype``), see
                :meth:`wire_dtype`.

        Returns:
            A :class:`~hetcomm.backends.tokens.DispatchResult` (``recv_x [R, D]``,
            ``recv_counts`` per local expert, ``handle``, ``work``) — see
            :func:`hetcomm.backends.tokens.dispatch`.
        """
        from hetcomm.backends.tokens import deepep

        return deepep.dispatch(
            self, x, topk_idx, topk_weights, expert_to_rank=expert_to_rank, capacity=capacity, async_op=async_op,
            num_chunks=num_chunks, split_by_expert=split_by_expert, wire_dtype=wire_dtype,
        )

    def combine(self, y: torch.Tensor, handle, *, async_op: bool = False):
        """Return expert outputs to their tokens: ``y [R, D]`` -> ``[T, D]`` weighted sums.

        See :func:`hetcomm.backends.tokens.combine`.
        """
        from hetcomm.backends.tokens import deepep

        return deepep.combine(self, y, handle, async_op=async_op)

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"cluster={self.cluster.name if self.cluster else None!r}, options={self.options})"
        )


def _same_cluster(given, have) -> bool:
    if have is None:
        return False
    if isinstance(given, (str, os.PathLike)):
        return have.path is not None and os.path.realpath(str(given)) == os.path.realpath(have.path)
    return given == have


class _CommStore:
    """Store keys of the communicators built over non-hetcomm groups.

    Every rank builds a group's communicators in the same order, so a per-group counter gives
    every construction its own key prefix (a second ``Communicator(g)`` does not read the
    first one's entries)."""

    _lock = threading.Lock()
    _count: Dict[int, int] = {}

    @classmethod
    def prefixed(cls, store, group) -> "torch.distributed.Store":
        from torch.distributed import PrefixStore

        with cls._lock:
            n = cls._count.get(id(group), 0)
            cls._count[id(group)] = n + 1
        return PrefixStore(f"hetcomm/comm{n}/", store)


_cache_lock = threading.Lock()
# (id, name) of the group -> (weak reference to the group, its communicator). Weak: the cache must
# not keep a destroyed group alive until the interpreter's finalisation.
_cache: Dict[Tuple[int, str], Tuple[Any, "Communicator"]] = {}


def communicator(group=None) -> Communicator:
    """The communicator of ``group`` (default: the default group), built on first use.

    Collective on first call per group: every rank of the group must make it. Later calls
    return the same object. A hetcomm group's communicator is the group's own.
    """
    import torch.distributed as dist

    pg = _resolve_group(group)
    live = dist.distributed_c10d._world.pg_map
    key = (id(pg), str(pg.group_name))
    with _cache_lock:
        for k in [k for k, (g, _) in _cache.items() if g() is None or g() not in live]:
            del _cache[k]  # destroyed groups
        hit = _cache.get(key)
    if hit is not None and hit[0]() is pg:
        return hit[1]
    comm = Communicator(pg)
    with _cache_lock:
        _cache[key] = (weakref.ref(pg), comm)
    return comm
