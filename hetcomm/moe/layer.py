"""``MoELayer``: a Mixture-of-Experts layer whose expert-parallel traffic goes through hetcomm.

Shapes (DeepEP-style notation, see ``hetcomm.moe.routing``):
    x        ``[..., D]`` input, any float dtype; flattened to ``[T, D]`` inside
    output   same shape and dtype as ``x``
    l_aux    scalar float32 auxiliary (load-balancing) loss, with grad, on ``layer.l_aux``

One forward:
    gate (top-k softmax, calibrated)  ->  route (one stable sort; capacity; replica copies set
    aside)  ->  ``token_dispatch.dispatch`` (counts, metadata, token rows: a token crosses to a
    rank once; async, per chunk, per-pair wire dtype)  ->  local experts on each arrived chunk
    ->  ``token_dispatch.combine`` (weighted sums per token row, back once per rank)

With ``page_budget > 0`` the local experts are paged (:mod:`hetcomm.moe.paging`): once the
dispatch's count exchange tells which local experts receive rows, the pager starts their loads
(overlapping the rows' transfer) and the experts run resident-first, faults as their loads land;
a training step whose experts do not fit the budget streams them in waves (backward pages each
in again). See ``docs/MOE.md``.

With one process (no ``torch.distributed``, or a group of one) it runs locally: same routing,
no collectives. Experts per rank may differ (strong devices hold more, see
``hetcomm.moe.placement``).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import fields, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.backends import tokens as token_dispatch
from hetcomm.errors import ConfigError
from hetcomm.moe.gate_calibration import LoadCalibrator
from hetcomm.moe.routing import ChunkLayout, gather_rows, route_tokens, weighted_combine
from hetcomm.moe.experts import ExpertBank, ExpertSpec, build_expert
from hetcomm.moe.gate import TopKGate
from hetcomm.moe.routing_metrics import MetricsAccumulator, routing_metrics
from hetcomm.moe.overlap import PipelineTimes
from hetcomm.moe.layer_config import MoEConfig
from hetcomm.moe.layer_paging import PagedExperts
from hetcomm.moe.paging import ExpertPager
from hetcomm.moe.placement.assign import ExpertPlacement, check_adopted_map, place_experts
from hetcomm.moe.placement.replicate import HotExpertReplicator
from hetcomm.moe.powersgd import node_ids_of
from hetcomm.moe.speed import SpeedMeter, speed_classes
from hetcomm.moe.step_stats import StepStats
from hetcomm.moe.token_split import TokenSplitter

__all__ = ["MoEConfig", "MoELayer"]


class _EndOfBackward(torch.autograd.Function):
    """Identity that queues ``callback`` to run once the whole backward pass is done."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback) -> torch.Tensor:  # type: ignore[override]
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        torch.autograd.Variable._execution_engine.queue_callback(ctx.callback)
        return grad, None


def _group_info(group: Optional[dist.ProcessGroup]):
    """(world_size, rank, global ranks) of ``group``; (1, 0, [0]) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, [0]
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if group is None:
        ranks = list(range(W))
    else:
        ranks = [dist.get_global_rank(group, r) for r in range(W)]
    return W, rank, ranks


def _layer_communicator(group, cluster, world_size: int, rank: int) -> token_dispatch.DispatchComm:
    """The communicator a layer's tokens travel through: the group's :class:`Communicator`
    (a ``hetcomm`` group's own), one over ``cluster`` when the layer names another cluster
    than the group's (a gloo group), or a local one when the group has one rank.

    Raises:
        ConfigError: the layer names another cluster than its ``hetcomm`` group uses (one
            wire rule per group: give the backend the same file).
    """
    if world_size == 1:
        return token_dispatch.GroupComm(None, 0, 1)
    from hetcomm.backends.communicator import Communicator, communicator

    comm = communicator(group)
    if cluster is None or _same_cluster(cluster, comm.cluster):
        return comm
    if comm.routed is not None:
        raise ConfigError(
            f"MoELayer (rank {rank}) was given cluster '{cluster.name}' but its hetcomm group uses "
            f"{comm.cluster.name if comm.cluster is not None else 'none'!r}; pass the same cluster to "
            f"the backend (HetcommOptions.cluster / pg_options, or HETCOMM_CLUSTER) or drop cluster=",
            key="moe.cluster",
            path=cluster.path,
        )
    key = (id(comm.group), cluster.path or cluster.name)
    hit = _CLUSTER_COMMS.get(key)
    if hit is None or hit[0]() is not comm.group:
        hit = _CLUSTER_COMMS[key] = (weakref.ref(comm.group), Communicator(comm.group, cluster=cluster))
    return hit[1]


#: Communicators over non-hetcomm groups for layers that name their own cluster, by (group,
#: file); the group held weakly (a destroyed group must not live on until the interpreter exits).
_CLUSTER_COMMS: Dict[Any, Any] = {}


def _same_cluster(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    import os

    if a.path and b.path:
        return os.path.realpath(a.path) == os.path.realpath(b.path)
    return a == b


class MoELayer(PagedExperts, nn.Module):
    """Mixture-of-Experts layer (Tutel/DeepSpeed shape) over any process group.

    Args:
        model_dim: ``D``.
        num_experts: ``E`` global experts.
        k: experts per token.
        capacity_factor: capacity slack (see :mod:`hetcomm.moe.gate`).
        expert: an ``nn.Module`` (deep-copied and re-initialised per expert), a factory
            ``f(model_dim) -> nn.Module``, or None for ``Linear(D, 4D) + GELU + Linear(4D, D)``.
        group: expert-parallel process group (None: the default group; no ``torch.distributed``
            or a group of one: everything runs locally).
        cluster: a :class:`hetcomm.topo.cluster.Cluster` or a path to its YAML (None:
            ``$HETCOMM_CLUSTER`` if set). Decides strong ranks and wire dtypes; without one, all
            ranks are equal and strong and every wire is FP32 (unless ``wire_dtype`` says).
        placement: explicit :class:`ExpertPlacement` (default: by rank strength from the cluster).
        **kwargs: any other :class:`MoEConfig` field (``dropless``, ``wire_dtype``,
            ``num_chunks``, ``replicate``, ...).

    Attributes:
        l_aux: auxiliary loss of the last forward (scalar float32 with grad).
        last_stats: per-step stats dict of the last forward (see :meth:`step_stats`).
        metrics: a :class:`MetricsAccumulator` over forwards (reset it per window).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 2,
        capacity_factor: float = 1.25,
        expert: ExpertSpec = None,
        group: Optional[dist.ProcessGroup] = None,
        *,
        cluster: Any = None,
        placement: Optional[ExpertPlacement] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        names = {f.name for f in fields(MoEConfig)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"unknown MoELayer option(s) {unknown}; valid options: {sorted(names - {'model_dim', 'num_experts', 'k', 'capacity_factor'})}",
                key="moe",
            )
        self.config = MoEConfig(model_dim=model_dim, num_experts=num_experts, k=k, capacity_factor=capacity_factor, **kwargs)
        cfg = self.config
        self.group = group
        self.world_size, self.rank, self.global_ranks = _group_info(group)
        W = self.world_size

        if isinstance(cluster, str):
            from hetcomm.topo.cluster import load_cluster

            cluster = load_cluster(cluster)
        elif cluster is None:
            from hetcomm.topo.cluster import cluster_from_env

            cluster = cluster_from_env() if W > 1 else None
        self.cluster = cluster
        if cluster is not None and max(self.global_ranks) >= cluster.num_ranks:
            raise ConfigError(
                f"global rank {max(self.global_ranks)} is in the MoE group but cluster "
                f"'{cluster.name}' has only {cluster.num_ranks} ranks; launch {cluster.num_ranks} "
                f"ranks or pass the matching cluster file",
                path=cluster.path,
            )
        # Dense FP16 TFLOPS of each group rank's device (hetcomm.topo.compute; YAML device.tflops
        # overrides), equal without a cluster.
        self.rank_tflops: List[float] = [1.0] * W
        if cluster is not None:
            from hetcomm.topo.compute import rank_speeds, strong_by_throughput

            strong_global = set(cluster.strong_ranks)
            self.strong_ranks = [r for r in range(W) if self.global_ranks[r] in strong_global]
            #: Ranks allowed to hold replicas (the YAML's strong flag); which of them do is
            #: re-chosen by measured speed (:func:`~hetcomm.moe.placement.replicate.choose_holders`).
            self.replica_candidates: List[int] = list(self.strong_ranks)
            self.rank_tflops = rank_speeds(cluster, self.global_ranks)
            if cfg.rank_weights == "throughput":
                # Replica holders are the fastest ranks: the strong ones within STRONG_FRACTION of
                # the fastest device (a replica on a slow rank adds work where time is short).
                fast = set(strong_by_throughput(self.rank_tflops))
                self.strong_ranks = [r for r in self.strong_ranks if r in fast] or sorted(fast)
        else:
            self.strong_ranks = list(range(W))
            self.replica_candidates = list(range(W))

        if cfg.rank_weights == "throughput":
            weights = list(self.rank_tflops)  # experts in proportion to compute speed
        else:
            weights = [cfg.strong_expert_weight if r in self.strong_ranks else 1.0 for r in range(W)]
        #: ``[W]`` relative speed of each rank: the initial assignment's weights and the
        #: placement policy's speeds (:meth:`rebalance`).
        self.rank_weights: List[float] = weights
        if placement is None:
            placement = place_experts(num_experts, W, rank_weights=weights)
        elif placement.world_size != W or placement.num_experts != num_experts:
            raise ConfigError(
                f"placement is for {placement.num_experts} experts on {placement.world_size} ranks "
                f"but the layer has {num_experts} experts on a group of {W}",
                key="moe.placement",
            )
        self.placement = placement
        # The group's Communicator, resolved at the first forward (a collective over a group
        # that has none yet; construction of the layer stays local).
        self._comm: Optional[token_dispatch.DispatchComm] = None
        # Registered (not persistent: derived from the placement) so that layer.to(device)
        # moves it with the parameters.
        self.register_buffer("_key_of_expert", torch.zeros(num_experts, dtype=torch.int64, device="cpu"), persistent=False)
        self._adopt_layout(placement)

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            calibrator = LoadCalibrator(num_experts, strength=cfg.calibration_strength, enabled=cfg.calibrate)
            self.gate = TopKGate(
                model_dim, num_experts, k, capacity_factor, cfg.dropless, cfg.normalize_topk, calibrator
            )
        self._expert_spec = expert
        local_ids = placement.experts_of(self.rank)
        self.local_expert_ids = tuple(local_ids)
        self.experts = ExpertBank([build_expert(expert, model_dim, e, cfg.seed) for e in local_ids])
        for p in self.experts.parameters():
            # Like DeepSpeed's ``allreduce = False``: data-parallel gradient averaging must skip
            # these (each rank holds different experts); see :meth:`expert_parameters`.
            p.hetcomm_expert = True

        self.replicator: Optional[HotExpertReplicator] = None
        if cfg.replicate:
            owned = {e: self.experts.experts[i] for i, e in enumerate(local_ids)}
            self.replicator = HotExpertReplicator(
                placement,
                self.rank,
                # Copies on strong ranks only, with or without the per-step split: their
                # weight and gradient reductions then run over the candidates' group and never
                # cross a weak rank's (often cross-vendor) link; the split balances among them.
                # Which strong ranks hold them follows the measured speed once agreed.
                self.replica_candidates,
                lambda e: build_expert(self._expert_spec, model_dim, e, cfg.seed),
                owned,
                group,
                num_hot=cfg.replicate_top,
                every=cfg.replicate_every,
                alpha=cfg.replicate_alpha,
                policy=cfg.replicate_policy,
                powersgd_rank=cfg.replicate_powersgd,
                powersgd_start=cfg.replicate_powersgd_start,
                node_ids=node_ids_of(cluster, cluster.num_ranks) if cluster is not None and cfg.replicate_powersgd else None,
                initial_holders=self.strong_ranks,  # the datasheet's choice: the prior
                # The agreed speeds, room flags and noise (self.speed is built below; read lazily).
                measured=lambda: (self.speed.speeds, self.speed.room, self.speed.noise) if self.speed.measured else None,
            )
        self.l_aux: torch.Tensor = torch.zeros((), device="cpu")  # replaced by the first forward
        self.last_stats: Optional[StepStats] = None  # set by every forward
        self.metrics = MetricsAccumulator()
        # The one load observer's subscribers (add_load_observer): each training forward's
        # global statistics, all-reduced once, go to the calibrator, the replicator and these.
        self._load_observers: List[Any] = []
        self._fast_topk: Optional[int] = None

        # Expert paging (config.page_budget > 0): the pager is built at the first forward, on
        # the input's device, over this rank's experts in dispatch order (ascending id).
        self.pager: Optional[ExpertPager] = None
        self._page_optimizer: Optional[torch.optim.Optimizer] = None
        self._page_open = False            # a step began and end_page_step has not closed it
        self._page_mark: Dict[str, float] = {}
        self._page_retired: Dict[str, float] = {}  # counters of pagers replaced by a placement change
        self._page_last: Dict[str, Any] = {}
        self._migrations: Optional[int] = None  # experts landed here by apply_placement, since the last forward
        # page_budget="auto" (hetcomm.moe.paging_rule): page only when the experts do not fit the
        # device they were built on; decided here, the config then holds the fraction.
        self.page_budget_auto = cfg.page_budget == "auto"
        if self.page_budget_auto:
            from hetcomm.moe import paging_rule

            dev = next(self.experts.parameters()).device if len(self.experts) else torch.device("cpu")
            nbytes = sum(p.numel() * p.element_size() for p in self.experts.parameters())
            budget = paging_rule.auto_page_budget(nbytes, len(self.experts), paging_rule.free_device_bytes(dev))
            self.config = cfg = replace(cfg, page_budget=budget)
        self._h2d_bytes_per_s: Optional[float] = None  # measured when a pager is built on a device
        self._check_page_budget()
        # Measured speed (hetcomm.moe.speed): the datasheet TFLOPS are the prior.
        # Room for replicas (agreed with the speeds): allowed to hold them, and not paging its own
        # experts (a rank whose experts do not fit its device has no memory for extra copies).
        room = self.rank in self.replica_candidates and not 0 < float(cfg.page_budget) < 1
        classes = speed_classes(self.rank_tflops) if cfg.speed_pool == "device" else None  # one per datasheet speed
        self.speed = SpeedMeter(W, self.rank, self.rank_tflops, group, every=cfg.speed_every, alpha=cfg.speed_alpha,
                                room=room, classes=classes)
        self.splitter: Optional[TokenSplitter] = (
            TokenSplitter(W, self.rank, group, num_experts) if cfg.token_split and W > 1 else None
        )

    # -- helpers -----------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def comm(self) -> token_dispatch.DispatchComm:
        """The :class:`hetcomm.Communicator` of the layer's group (its ``dispatch``/``combine``
        move the tokens, its ``wire_dtype`` decides each pair's wire dtype), built on first use
        (collective when the group has none yet); a local one with a group of one."""
        if self._comm is None:
            self._comm = _layer_communicator(self.group, self.cluster, self.world_size, self.rank)
        return self._comm

    def add_load_observer(self, observer, fast_topk: Optional[int] = None) -> None:
        """Subscribe ``observer(global_picks, global_probs, num_tokens, global_fast)`` to the
        layer's one load observer: called after every training forward with the statistics the
        layer all-reduces anyway, in the same all-reduce (``global_picks`` ``[E]`` float64 picks
        per expert summed over the group, dropped ones included; ``global_probs`` ``[E]``
        float64 summed router probabilities; ``num_tokens`` the group's tokens;
        ``global_fast`` ``[E]`` float64 the summed ``fast_signal`` of the router's log
        probabilities over their top ``fast_topk``, or None when no observer asked for it).
        The calibrator and the replicator read the same numbers; the balancer
        (:mod:`hetcomm.train.balance`) subscribes here."""
        if fast_topk is not None:
            if self._fast_topk and self._fast_topk != fast_topk:
                raise ConfigError(
                    f"the layer's load observer already computes the fast signal over the top {self._fast_topk}; "
                    f"got another observer asking for {fast_topk}",
                    key="moe.load_observer",
                )
            self._fast_topk = int(fast_topk)
        self._load_observers.append(observer)

    def take_migration_requests(self) -> List[int]:
        """Global ids of the experts the pager asked to move since the last call (its L2 level:
        an expert that keeps faulting when pinning it would exceed the pin budget,
        :mod:`hetcomm.moe.degrade`); the balancer reads them. Empty without paging."""
        if self.pager is None or not self.pager.migration_requests:
            return []
        ids = self._sorted_local_ids()
        out = [ids[l] for l in self.pager.migration_requests]
        self.pager.migration_requests.clear()
        return out

    def wire_dtype(self, peer: int, dtype: torch.dtype = torch.float32) -> torch.dtype:
        """The dtype ``dtype`` rows of this layer travel in to/from group rank ``peer`` (the
        Communicator's rule under the layer's ``wire_dtype`` option)."""
        return self.comm.wire_dtype(peer, dtype, self.config.wire_dtype) or dtype

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"model_dim={c.model_dim}, num_experts={c.num_experts}, k={c.k}, capacity_factor="
            f"{c.capacity_factor}, dropless={c.dropless}, world_size={self.world_size}, rank={self.rank}, "
            f"local_experts={list(self.local_expert_ids)}, wire_dtype={c.wire_dtype}, "
            f"num_chunks={c.num_chunks}, replicate={c.replicate}"
        )

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of the experts this rank owns (rank-local: never average them across the
        expert-parallel group; each carries ``p.hetcomm_expert = True``)."""
        return self.experts.parameters()

    def shared_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters every rank holds a copy of (the gate; the frozen calibration weight
        included): average their gradients over data-parallel ranks like any dense layer's."""
        return self.gate.parameters()

    def _adopt_layout(self, placement: ExpertPlacement) -> None:
        self.layout = ChunkLayout.build(placement, self.config.num_chunks)
        with torch.no_grad():
            self._key_of_expert.copy_(self.layout.key_of_expert)

    def set_num_chunks(self, num_chunks: int) -> None:
        """Pipeline the dispatch in ``num_chunks`` chunks from the next forward on (local; every
        rank of the group must set the same number, as for ``MoEConfig.num_chunks``)."""
        self.config = replace(self.config, num_chunks=num_chunks)  # validated by MoEConfig
        self._adopt_layout(self.placement)

    def _sorted_local_ids(self) -> List[int]:
        """This rank's experts' global ids in ascending order (the dispatch's local order)."""
        return sorted(self.local_expert_ids)

    def _modules_by_id(self) -> List[nn.Module]:
        """This rank's experts in ascending global id (the dispatch's local-expert order)."""
        ids = self.placement.experts_of(self.rank)
        return [self.experts.experts[i] for i in sorted(range(len(ids)), key=lambda i: ids[i])]

    def make_expert(self, expert_id: int) -> nn.Module:
        """A fresh module of expert ``expert_id`` as this layer builds it (its initial weights
        depend only on the seed and the id): spare slots for migrations, references."""
        return build_expert(self._expert_spec, self.config.model_dim, expert_id, self.config.seed)

    _make_expert = make_expert

    def _set_placement(self, placement: ExpertPlacement, modules: Sequence[nn.Module]) -> None:
        """Adopt ``placement`` with ``modules`` as this rank's experts, in local order."""
        self._drop_pager()  # its slots index the old local experts; the next forward builds one
        self.placement = placement
        self._adopt_layout(placement)
        self.local_expert_ids = tuple(placement.experts_of(self.rank))
        self.experts.experts = nn.ModuleList(modules)
        if self.replicator is not None:
            self.replicator.adopt_placement(
                placement, {e: self.experts.experts[i] for i, e in enumerate(self.local_expert_ids)}
            )

    def apply_placement(
        self,
        expert_to_rank: Union[ExpertPlacement, Sequence[int]],
        modules: Mapping[int, nn.Module],
        *,
        migrated: bool = True,
    ) -> List[int]:
        """Adopt a new expert -> rank map whose parameters have already moved (a balancer's
        migration, :mod:`hetcomm.train.balance`). Local, not collective: every rank of the group
        calls it with the same map, each with its own modules.

        Args:
            expert_to_rank: ``[E]`` owner rank of each global expert (or an
                :class:`ExpertPlacement`), identical on every rank.
            modules: global expert id -> module, for exactly the experts this rank owns under
                the new map, each with the same parameter shapes as this layer's experts.
            migrated: count the arrivals in the ``migrations`` step stat; False when the map is
                a checkpoint's placement being restored (nothing moved between ranks).
        Returns:
            Global ids of the experts that arrived on this rank.

        Raises:
            ConfigError: (``key='moe.placement'``) a map of the wrong length or with an owner
                outside the group, a module missing or extra for an expert, or one whose
                parameters do not match — naming the expert; nothing changes then.
        """
        E, W = self.config.num_experts, self.world_size
        owner = list(expert_to_rank.owner) if isinstance(expert_to_rank, ExpertPlacement) else [int(r) for r in expert_to_rank]
        ref = self.experts.experts[0] if len(self.experts) else self._make_expert(0)
        mine = check_adopted_map(owner, modules, num_experts=E, world_size=W, rank=self.rank, reference=ref)
        before = set(self.local_expert_ids)
        placement = ExpertPlacement(tuple(owner), W)
        self._set_placement(placement, [modules[e] for e in placement.experts_of(self.rank)])
        arrived = [e for e in mine if e not in before]
        # A restored map is still a placement change (the stat reads 0, not None, from here on).
        self._migrations = (self._migrations or 0) + (len(arrived) if migrated else 0)
        return arrived

    def rebalance(self, expert_load: Optional[Sequence[float]] = None, optimizer=None) -> List[int]:
        """Re-place experts by load, now (collective), with the one placement policy.

        The map comes from :class:`~hetcomm.moe.placement.balancer.ExpertBalancer` (the policy
        of ``hetcomm train --balance``: capacity-aware packing by rank speed, refined, moves
        only where they shorten the slowest rank's step), fed this one load; every rank keeps
        its number of experts; the moves are carried out by
        :func:`~hetcomm.moe.placement.migration.migrate_now` (parameters, optimizer state and
        gradients travel with each expert), so training continues unchanged.

        Args:
            expert_load: ``[E]`` load per expert, identical on every rank (default: the
                replication EMA of global token counts, which is).
            optimizer: the optimizer holding this layer's parameters, or None.
        Returns:
            Global ids of the experts that moved.

        Raises:
            ConfigError: no load given and replication off.
        """
        from hetcomm.moe.placement.balancer import BalancerConfig, ExpertBalancer, ExpertMap
        from hetcomm.moe.placement.migration import migrate_now

        if expert_load is None:
            if self.replicator is None:
                raise ConfigError(
                    "rebalance() needs expert_load=[E loads] when replication is off (the "
                    "replication EMA is the default load)",
                    key="moe.rebalance",
                )
            expert_load = self.replicator.ema.tolist()
        E, W = self.config.num_experts, self.world_size
        balancer = ExpertBalancer(
            E,
            self.speed.speeds if self.speed.measured else self.rank_weights,  # measured once agreed
            BalancerConfig(window=1, every=1, cooldown=1),
            slots=list(self.placement.num_local_experts_per_rank),
            initial=ExpertMap.from_lists([[r] for r in self.placement.owner], W),
        )
        balancer.observe(torch.tensor([float(v) for v in expert_load], dtype=torch.float64))  # host: planning state
        plan = balancer.propose()
        if not plan.adopted:
            return []
        return migrate_now(self, plan.new_map.owner(), optimizer)

    def cold_placement_due(self) -> bool:
        """Whether :meth:`place_cold_on_slow` has what it needs (identical on every rank;
        :func:`~hetcomm.moe.placement.migration.cold_placement_due`)."""
        from hetcomm.moe.placement.migration import cold_placement_due

        return cold_placement_due(self)

    def place_cold_on_slow(self, optimizer=None) -> List[int]:
        """Move the coldest experts by global load onto the measured-slow ranks, now (collective;
        between steps; :func:`~hetcomm.moe.placement.migration.place_cold_on_slow`). Returns the
        experts that moved."""
        from hetcomm.moe.placement.migration import place_cold_on_slow

        return place_cold_on_slow(self, optimizer)

    def sync_replicas(self, force: bool = False, carry: Optional[List[torch.Tensor]] = None) -> bool:
        """Refresh replicas from their owners now (collective). Returns True if weights moved.
        ``force`` / ``carry``: ``HotExpertReplicator.sync`` (the training loop passes both)."""
        if self.replicator is None:
            return False
        self.sync_pages()  # the refresh reads owned experts' weights: no write-back half done
        return self.replicator.sync(force, carry)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route ``x`` to its experts and combine their outputs.

        Args:
            x: ``[..., D]`` tokens, any float dtype.
        Returns:
            ``[..., D]``, same dtype. Copies dropped by capacity contribute zeros (the block's
            residual carries those tokens). ``self.l_aux`` holds the auxiliary loss.
        """
        cfg = self.config
        D = cfg.model_dim
        if x.size(-1) != D:
            raise ConfigError(
                f"MoELayer input has last dimension {x.size(-1)} but model_dim is {D} (input shape "
                f"{tuple(x.shape)}, rank {self.rank}); reshape the input to [..., {D}]",
                key="moe.model_dim",
            )
        t_start = time.perf_counter()
        shape = x.shape
        x2 = x.reshape(-1, D)
        T = x2.size(0)
        E = cfg.num_experts
        rep = self.replicator
        pager = None
        if cfg.page_budget > 0:
            self.end_page_step()  # the previous step's, when the loop did not close it
            pager = self._ensure_pager(x2.device)
        if rep is not None:
            rep.device = x2.device
            if pager is not None:
                pager.sync()  # a refresh reads owned experts' weights: no write-back half done
            rep.sync()  # collective when distributed: every rank calls it here

        g = self.gate(x2)
        self.l_aux = g.l_aux
        replica_here = rep.replica_here() if rep is not None and rep.replicas else None
        # Per-step split among copies (hetcomm.moe.token_split): every kept copy travels (a
        # holder's own rows stay local inside the dispatch), none is set aside for a replica.
        splitter = self.splitter if self.splitter is not None and rep is not None and rep.hot and pager is None else None
        if splitter is not None:
            replica_here = None
        # The only routing step: capacity, then the copies for local replicas set aside; the
        # dispatch plans the exchange of what is left.
        route = route_tokens(g.topk_idx, self._key_of_expert, g.capacity, replica_here)

        # Global statistics for calibration and replication, summed over ranks: one all-reduce
        # of [probs (E), picks (E), tokens (1)], launched now and awaited after the experts.
        update = self.training and (self.gate.calibrator is not None or rep is not None or bool(self._load_observers))
        stat_vec = stat_work = split_table = None
        if update:
            parts = [g.probs.detach().sum(0).double(), route.picks.double(), torch.tensor([float(T)], dtype=torch.float64, device=x2.device)]
            if self._fast_topk:  # the balancer's fast timescale (add_load_observer(fast_topk=...))
                from hetcomm.moe.placement.balancer import fast_signal

                parts.append(fast_signal(torch.log(g.probs.detach().clamp_min(1e-30)), self._fast_topk).to(torch.float64))
            n_stat = sum(int(p.numel()) for p in parts)
            if splitter is not None:  # the split's [W, E + 1] count table rides in the same all-reduce
                parts.append(splitter.table_row(route.send_counts).reshape(-1))
            stat_vec = torch.cat(parts)
            if self.distributed:
                # Blocking when the split needs its table before the dispatch (one small collective
                # instead of two: a checked hetcomm all-reduce costs ~3x gloo's at this size).
                stat_work = dist.all_reduce(stat_vec, group=self.group, async_op=splitter is None)
            if splitter is not None:
                split_table = stat_vec[n_stat:].view(self.world_size, E + 1).tolist()
                stat_vec = stat_vec[:n_stat]

        weights_flat = g.topk_weights.t().reshape(-1)  # [A], choice-major like assignments
        idx_send = route.send_idx
        owner_map: Sequence[int] = self.placement.owner
        split_mods: List[nn.Module] = []
        if splitter is not None:
            sr = splitter.route(route.send_idx.t().reshape(-1), route.send_counts, cfg.k, owner_map,
                                rep.holders_of_hot(), rep.replicas, self.speed.speeds, table=split_table)
            idx_send, owner_map, split_mods = sr.topk_idx, sr.expert_to_rank, sr.modules

        times = PipelineTimes()
        local_out: List = []

        def compute_local() -> None:
            # Copies routed to local replicas: computed here, hidden behind the dispatch in flight.
            if route.local_assign.numel() == 0:
                return
            te = time.perf_counter()
            mark = self.speed.begin(x2.device)
            xs = gather_rows(x2, route.local_assign % T)
            counts = torch.bincount(route.local_expert, minlength=E)
            order = sorted(set(route.local_expert.tolist()), key=lambda e: int(self.layout.key_of_expert[e]))
            mods = rep.local_modules(order)
            y = self.experts.forward_sorted(xs, [int(counts[e]) for e in order], modules=mods)
            local_out.append(y)
            self.speed.end(mark, xs.size(0))
            times.expert_s += time.perf_counter() - te

        if pager is not None:
            # This rank's own tokens are sure to reach its experts: page those in before the
            # count exchange tells what the other ranks send.
            # Only into free slots: an eviction here could push out an expert the other ranks
            # route to, which the counts would have said a moment later.
            free = pager.free_slots()
            own = route.send_counts[list(self._sorted_local_ids())].tolist()
            for l, n in enumerate(own):
                if not free:
                    break
                if n and pager.slot_of[l] is None and pager.prefetch(l):
                    free -= 1

        # gate -> dispatch -> experts (chunk by chunk, as each arrives) -> combine.
        # Unpaged, the rows arrive as one piece per local expert and the outputs go to the
        # combine as they come: no [R, D] concatenation of rows or gradients. A rank without
        # experts takes the whole (empty) block, which keeps x in its backward's graph.
        mods = self._modules_by_id() + split_mods if pager is None else []
        res = self.comm.dispatch(
            x2,
            idx_send,
            g.topk_weights,
            expert_to_rank=owner_map,
            async_op=True,
            num_chunks=cfg.num_chunks,
            split_by_expert=bool(mods),
            wire_dtype=cfg.wire_dtype,
        )
        recv_x, counts, handle, work = res.recv_x, res.recv_counts, res.handle, res.work
        compute_local()
        if pager is not None:
            y_recv = self._paged_experts(recv_x, counts, handle, work, times)
        elif mods:
            y_recv = []
            for c, (lo, hi) in enumerate(handle.chunk_experts):
                work.wait_chunk(c)
                te = time.perf_counter()
                mark = self.speed.begin(x2.device)
                y_recv += self.experts.forward_pieces(recv_x[lo:hi], modules=mods[lo:hi])
                self.speed.end(mark, sum(counts[lo:hi]))
                times.expert_s += time.perf_counter() - te
        else:
            work.wait()
            y_recv = recv_x * 0
        tw = time.perf_counter()
        out = self.comm.combine(y_recv, handle)
        times.comm_exposed_s = work.exposed_s + time.perf_counter() - tw
        times.num_chunks = cfg.num_chunks
        times.rows_per_expert = list(counts)
        # Combine sends back exactly what dispatch received, in the same wire dtypes.
        times.bytes_sent = times.bytes_recv = handle.bytes_sent + handle.bytes_recv
        times.total_s = time.perf_counter() - t_start
        saved = self._replica_saved_bytes(g.topk_idx, route, x2.dtype)

        if local_out:
            w_loc = weights_flat.index_select(0, route.local_assign)
            out = out + weighted_combine(local_out[0], w_loc, route.local_assign % T, T)

        if rep is not None and rep.hot and out.requires_grad:
            # Every rank's backward must run the replica-gradient all-reduce at the same point:
            # the end of the whole backward pass. The hook sits on the layer's output, which
            # every backward through this layer starts from (the gate may be frozen).
            out = _EndOfBackward.apply(out, rep.grad_reducer())
        if pager is not None and self._page_last.get("page_waves") and out.requires_grad:
            # Backward of a wave step evicts experts with write-backs in flight, whose host
            # copies the optimizer step then updates: land them first.
            out = _EndOfBackward.apply(out, pager.sync)

        # Statistics, after the experts so that the all-reduce was hidden behind them.
        if update:
            if stat_work is not None:
                stat_work.wait()
            gp, gpicks, gT = stat_vec[:E], stat_vec[E : 2 * E], float(stat_vec[2 * E])
            if self.gate.calibrator is not None:
                self.gate.calibrator.update(gp, gT)
            if rep is not None:
                rep.observe(gpicks, row_bytes=D * x2.element_size())
            gfast = stat_vec[2 * E + 1 :] if self._fast_topk else None
            for observer in self._load_observers:
                observer(gpicks, gp, gT, gfast)
        self.speed.finish_step()  # collective every speed_every forwards (the agreement)
        if self.splitter is not None:
            self.splitter.last_expert_s = self.speed.last_step[1]  # busy seconds: the speed's own clock
        self._record(route, times, t_start, saved, global_picks=stat_vec[E : 2 * E] if update else None,
                     splitter=splitter)
        return out.to(x.dtype).reshape(shape)

    def _replica_saved_bytes(self, topk_idx, route, dtype: torch.dtype) -> int:
        """Forward bytes (dispatch + combine) the copies computed on local replicas would have
        cost: the token rows with them minus the token rows without them, per destination."""
        if route.local_assign.numel() == 0:
            return 0
        cfg = self.config
        T = topk_idx.size(0)
        idx_cm = route.send_idx.t().reshape(-1)
        with_rep = idx_cm.clone()
        with_rep[route.local_assign] = topk_idx.t().reshape(-1)[route.local_assign]
        rows = [
            token_dispatch.count_token_rows(i.view(cfg.k, T).t(), self.placement.owner, self.world_size, cfg.num_chunks)
            for i in (with_rep, idx_cm)
        ]
        extra = (rows[0] - rows[1]).tolist()
        saved = 0
        for d, n in enumerate(extra):
            if d != self.rank and n:
                wd = self.comm.wire_dtype(d, dtype, cfg.wire_dtype) or dtype
                # Sent once by dispatch, once more by combine (summed over ranks, what comes back
                # to one rank is what another sends).
                saved += 2 * n * cfg.model_dim * wd.itemsize
        return saved

    # -- stats -------------------------------------------------------------------------------
    def _record(self, route, times: PipelineTimes, t_start: float, saved: int, global_picks=None, splitter=None) -> None:
        kept = route.num_assign - route.num_dropped
        own = [e for e in self.local_expert_ids]
        num_self = int(route.send_counts[list(own)].sum()) if own else 0
        num_local = num_self + int(route.local_assign.numel())
        self.metrics.add(route.picks, route.num_dropped, num_local, kept)
        m = routing_metrics(route.picks, route.num_dropped, num_local, kept)
        gm = routing_metrics(global_picks, 0, 0) if global_picks is not None else None
        rep = self.replicator
        migrations, self._migrations = self._migrations, (0 if self._migrations is not None else None)
        self.last_stats = StepStats(
            rank=self.rank,
            tokens=route.num_assign // max(1, self.config.k),
            copies=route.num_assign,
            dropped=route.num_dropped,
            overflow_rate=m.overflow_rate,
            top5_share=m.top5_share,
            min_expert_rate=m.min_expert_rate,
            local_fraction=m.local_fraction,
            a2a_bytes_sent=times.bytes_sent,
            a2a_bytes_recv=times.bytes_recv,
            a2a_bytes_sent_without_replication=times.bytes_sent + saved,
            comm_exposed_s=times.comm_exposed_s,
            expert_s=times.expert_s,
            forward_s=time.perf_counter() - t_start,
            num_chunks=times.num_chunks,
            rows_per_expert=tuple(times.rows_per_expert),
            replicas=tuple(rep.replicas) if rep else (),
            hot_experts=tuple(rep.hot) if rep else (),
            replica_extra_bytes=rep.extra_bytes if rep else 0,
            l_aux=float(self.l_aux.detach()),
            global_top5_share=gm.top5_share if gm is not None else None,
            global_min_expert_rate=gm.min_expert_rate if gm is not None else None,
            calibration_lag=self.gate.calibrator.lag_factor() if self.gate.calibrator is not None else None,
            migrations=migrations,
            **self._page_step_stats(),
            **self._page_hide_stats(times.rows_per_expert),
            **self.speed.record(),
            **(splitter.record() if splitter is not None else {}),
        )

    def step_stats(self) -> StepStats:
        """What the last forward did on this rank: a :class:`~hetcomm.moe.step_stats.StepStats`
        (frozen; its fields are documented there). It also reads like the dict of earlier
        releases (``st["dropped"]``, ``"page_hits" in st``, ``dict(st)``).

        Paging counters (``page_*``) cover this rank's pager since the previous forward, so a
        step's end-of-step evictions and prefetches, and a wave step's backward reloads, show in
        the next forward's stats; ``migrations`` counts the experts that landed on this rank
        through :meth:`apply_placement` since the previous forward.
        """
        return self.last_stats if self.last_stats is not None else StepStats.empty(self.rank)

