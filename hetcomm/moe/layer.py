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

The layer composes its parts: the group's ranks, speeds and communicator
(:mod:`hetcomm.moe.layer_group`), the local experts (``layer.experts``, an
:class:`~hetcomm.moe.expert_store.ExpertStore`: resident, or paged with ``page_budget > 0``),
the replicator, the speed meter, the load observer (:mod:`hetcomm.moe.load_observer`) and the
step record (:mod:`hetcomm.moe.step_stats`). See ``docs/MOE.md``.

With one process (no ``torch.distributed``, or a group of one) it runs locally: same routing,
no collectives. Experts per rank may differ (strong devices hold more, see
``hetcomm.moe.placement``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.backends import tokens as token_dispatch
from hetcomm.errors import ConfigError, UsageError
from hetcomm.moe.gate_calibration import LoadCalibrator
from hetcomm.moe.routing import ChunkLayout, route_tokens, weighted_combine
from hetcomm.moe.experts import ExpertSpec, build_expert
from hetcomm.moe import paging_rule
from hetcomm.moe.expert_store import ExpertStore, ResidentExperts, join_graph
from hetcomm.moe.paged_experts import PagedExperts
from hetcomm.moe.gate import TopKGate
from hetcomm.moe.routing_metrics import MetricsAccumulator
from hetcomm.moe.load_observer import LoadObserver
from hetcomm.moe.overlap import PipelineTimes
from hetcomm.moe.layer_config import MoEConfig
from hetcomm.moe.layer_group import group_info, group_speeds, layer_communicator, resolve_cluster
from hetcomm.moe.placement import migration
from hetcomm.moe.placement.assign import ExpertPlacement, check_adopted_map, check_placement, place_experts
from hetcomm.moe.placement.replicate import HotExpertReplicator
from hetcomm.moe.speed import SpeedMeter, speed_classes
from hetcomm.moe.step_stats import StepStats, forward_record, replica_saved_bytes
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


class MoELayer(nn.Module):
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

    def __init__(self, model_dim: int, num_experts: int, k: int = 2, capacity_factor: float = 1.25,
                 expert: ExpertSpec = None, group: Optional[dist.ProcessGroup] = None, *, cluster: Any = None,
                 placement: Optional[ExpertPlacement] = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = MoEConfig.for_layer(model_dim, num_experts, k, capacity_factor, kwargs)
        cfg = self.config
        self.group = group
        self.world_size, self.rank, self.global_ranks = group_info(group)
        W = self.world_size
        self.cluster = resolve_cluster(cluster, self.global_ranks)
        # Strong ranks, replica candidates, device TFLOPS, placement weights: layer_group.GroupSpeeds.
        speeds = group_speeds(self.cluster, self.global_ranks, cfg.rank_weights, cfg.strong_expert_weight)
        self.strong_ranks: List[int] = speeds.strong_ranks
        self.replica_candidates: List[int] = speeds.replica_candidates
        self.rank_tflops: List[float] = speeds.rank_tflops
        self.rank_weights: List[float] = speeds.rank_weights
        if placement is None:
            placement = place_experts(num_experts, W, rank_weights=self.rank_weights)
        self.placement = placement = check_placement(placement, num_experts, W)
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
            self.gate = TopKGate(model_dim, num_experts, k, capacity_factor, cfg.dropless, cfg.normalize_topk, calibrator)
        self._expert_spec = expert
        local_ids = placement.experts_of(self.rank)
        modules = [build_expert(expert, model_dim, e, cfg.seed) for e in local_ids]
        # page_budget="auto" (hetcomm.moe.paging_rule): page only when the experts do not fit the
        # device they were built on; decided here, the config then holds the fraction.
        self.page_budget_auto = cfg.page_budget == "auto"
        if self.page_budget_auto:
            self.config = cfg = replace(cfg, page_budget=paging_rule.auto_page_budget_of(modules))
        #: This rank's experts and how they run: resident, or paged with ``page_budget > 0``.
        self.experts: ExpertStore = ResidentExperts(modules, local_ids) if cfg.page_budget <= 0 else PagedExperts(
            modules, local_ids, cfg.page_budget, cfg.paging, rank=self.rank, peak_flops=self.rank_tflops[self.rank] * 1e12)

        self.replicator: Optional[HotExpertReplicator] = None
        if cfg.replicate:
            self.replicator = HotExpertReplicator.for_layer(
                cfg, placement, self.rank, self.replica_candidates, self.make_expert,
                dict(zip(local_ids, self.experts.experts)), group, self.cluster, initial_holders=self.strong_ranks,
                # The agreed speeds, room flags and noise (self.speed is built below; read lazily).
                measured=lambda: (self.speed.speeds, self.speed.room, self.speed.noise) if self.speed.measured else None,
                ready=lambda: self.speed.differ is not None)  # copies after the first verdict: replicate.py
        self.l_aux: torch.Tensor = torch.zeros((), device="cpu")  # replaced by the first forward
        self.last_stats: Optional[StepStats] = None  # set by every forward
        self.metrics = MetricsAccumulator()
        # The one load observer (add_load_observer): each training forward's global
        # statistics, all-reduced once, go to the calibrator, the replicator and its subscribers.
        self._load = LoadObserver()

        self._migrations: Optional[int] = None  # experts landed here by apply_placement, since the last forward
        # Measured speed (hetcomm.moe.speed): the datasheet TFLOPS are the prior.
        # Room for replicas (agreed with the speeds): allowed to hold them, and not paging its own
        # experts (a rank whose experts do not fit its device has no memory for extra copies).
        room = self.rank in self.replica_candidates and not 0 < float(cfg.page_budget) < 1
        classes = speed_classes(self.rank_tflops) if cfg.speed_pool == "device" else None  # one per datasheet speed
        self.speed = SpeedMeter(W, self.rank, self.rank_tflops, group, every=cfg.speed_every, alpha=cfg.speed_alpha,
                                room=room, classes=classes)
        # Built for True and for "auto" with copies to split among; "auto" starts off and follows the
        # policy's lever (use_token_split, which MeasuredLoop calls after each agreement).
        can_split = cfg.token_split is True or (cfg.token_split == "auto" and cfg.replicate)
        self.splitter: Optional[TokenSplitter] = TokenSplitter(W, self.rank, group, num_experts) if can_split and W > 1 else None
        self.token_split_on = cfg.token_split is True

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
            self._comm = layer_communicator(self.group, self.cluster, self.world_size, self.rank)
        return self._comm

    def add_load_observer(self, observer, fast_topk: Optional[int] = None) -> None:
        """Subscribe ``observer(global_picks, global_probs, num_tokens, global_fast)`` to the
        layer's one load observer, called after every training forward with the statistics the
        layer all-reduces anyway (:meth:`LoadObserver.add <hetcomm.moe.load_observer.LoadObserver.add>`
        documents them); the balancer (:mod:`hetcomm.train.balance`) subscribes here."""
        self._load.add(observer, fast_topk)

    def take_migration_requests(self) -> List[int]:
        """Global ids of the experts the pager asked to move since the last call (its L2 level,
        :mod:`hetcomm.moe.degrade`); the balancer reads them. Empty without paging."""
        return self.experts.take_migration_requests()

    def wire_dtype(self, peer: int, dtype: torch.dtype = torch.float32) -> torch.dtype:
        """The dtype ``dtype`` rows of this layer travel in to/from group rank ``peer`` (the
        Communicator's rule under the layer's ``wire_dtype`` option)."""
        return self.comm.wire_dtype(peer, dtype, self.config.wire_dtype) or dtype

    def extra_repr(self) -> str:
        c = self.config
        return (f"model_dim={c.model_dim}, num_experts={c.num_experts}, k={c.k}, capacity_factor="
                f"{c.capacity_factor}, dropless={c.dropless}, world_size={self.world_size}, rank={self.rank}, "
                f"local_experts={list(self.local_expert_ids)}, wire_dtype={c.wire_dtype}, "
                f"num_chunks={c.num_chunks}, replicate={c.replicate}")

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

    def use_token_split(self, on: bool) -> None:
        """Split hot experts' rows among their copies from the next forward on, or stop (local;
        every rank of the group must set the same, as the policy's agreed lever does).

        Raises:
            UsageError: ``on`` with no splitter: ``token_split=False``, no replication, or one rank.
        """
        if on and self.splitter is None:
            raise UsageError(f"MoELayer (rank {self.rank}): no token split to turn on; build the layer with "
                             "token_split=True or 'auto', replicate=True, on more than one rank")
        self.token_split_on = bool(on)

    @property
    def local_expert_ids(self) -> Tuple[int, ...]:
        """Global ids of this rank's experts in local order (``experts.experts[i]`` is expert
        ``local_expert_ids[i]``)."""
        return self.experts.ids

    # -- paging (the store's, :mod:`hetcomm.moe.paged_experts`; no-ops without paging) -------
    @property
    def pager(self):
        """The :class:`~hetcomm.moe.paging.ExpertPager` over this rank's experts (built at the
        first forward), or None without paging."""
        return self.experts.pager

    def page_stats(self) -> Dict[str, float]:
        """This rank's pager counters since the layer was built, plus ``slots`` and ``experts``
        (:meth:`PagedExperts.page_stats <hetcomm.moe.paged_experts.PagedExperts.page_stats>`)."""
        return self.experts.page_stats()

    def attach_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Page ``optimizer``'s per-element state (Adam's moments) with the experts; call it
        before the optimizer's first step (without it the state stays where it was made)."""
        self.experts.attach_optimizer(optimizer)

    def end_page_step(self) -> None:
        """Close the paging step, after ``optimizer.step()`` (the next forward does it when the
        loop did not; with gradient accumulation call it after each optimizer step)."""
        self.experts.end_step()

    def sync_pages(self) -> None:
        """Wait for every page transfer in flight (before reading expert weights outside a
        step: a checkpoint, a replica refresh, a comparison)."""
        self.experts.sync()

    def warm_pages(self, expert_share: torch.Tensor) -> List[int]:
        """Seed the pager from a known routing (``[E]`` share per global expert; ``hetcomm
        launch --warmup-from``): returns the experts paged in, hottest first
        (:meth:`ExpertStore.warm <hetcomm.moe.expert_store.ExpertStore.warm>`)."""
        return self.experts.warm(expert_share, self.config.num_experts)

    def make_expert(self, expert_id: int) -> nn.Module:
        """A fresh module of expert ``expert_id`` as this layer builds it (its initial weights
        depend only on the seed and the id): spare slots for migrations, references."""
        return build_expert(self._expert_spec, self.config.model_dim, expert_id, self.config.seed)

    def apply_placement(self, expert_to_rank: Union[ExpertPlacement, Sequence[int]], modules: Mapping[int, nn.Module],
                        *, migrated: bool = True) -> List[int]:
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
        ref = self.experts.experts[0] if len(self.experts) else self.make_expert(0)
        mine = check_adopted_map(owner, modules, num_experts=E, world_size=W, rank=self.rank, reference=ref)
        before = set(self.local_expert_ids)
        self.placement = placement = ExpertPlacement(tuple(owner), W)
        self._adopt_layout(placement)
        # A paged store drops its pager (its slots index the old experts); the next forward builds one.
        self.experts.adopt([modules[e] for e in placement.experts_of(self.rank)], placement.experts_of(self.rank))
        if self.replicator is not None:
            self.replicator.adopt_placement(placement, dict(zip(self.local_expert_ids, self.experts.experts)))
        arrived = [e for e in mine if e not in before]
        # A restored map is still a placement change (the stat reads 0, not None, from here on).
        self._migrations = (self._migrations or 0) + (len(arrived) if migrated else 0)
        return arrived

    def rebalance(self, expert_load: Optional[Sequence[float]] = None, optimizer=None) -> List[int]:
        """Re-place experts by ``expert_load`` (``[E]``, identical on every rank; default: the
        replication EMA), now (collective), with the one placement policy; parameters, optimizer
        state and gradients move with them (:func:`~hetcomm.moe.placement.migration.rebalance`).
        Returns the global ids of the experts that moved."""
        return migration.rebalance(self, expert_load, optimizer)

    def speed_placement_due(self) -> bool:
        """Whether :meth:`place_by_speed` has what it needs (identical on every rank;
        :func:`~hetcomm.moe.placement.migration.speed_placement_due`)."""
        return migration.speed_placement_due(self)

    def place_by_speed(self, expert_rows: Sequence[float], optimizer=None) -> List[int]:
        """Re-place the experts so the ranks' predicted expert busy time evens out, now
        (collective; between steps; :func:`~hetcomm.moe.placement.migration.place_by_speed`).
        Returns the experts that moved."""
        return migration.place_by_speed(self, expert_rows, optimizer)

    def sync_replicas(self, force: bool = False, carry: Optional[List[torch.Tensor]] = None) -> bool:
        """Refresh replicas from their owners now (collective). Returns True if weights moved.
        ``force`` / ``carry``: ``HotExpertReplicator.sync`` (the training loop passes both)."""
        if self.replicator is None:
            return False
        self.experts.sync()  # the refresh reads owned experts' weights: no write-back half done
        return self.replicator.sync(force, carry)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route ``x`` (``[..., D]`` tokens, any float dtype) to its experts and combine their
        outputs: ``[..., D]``, same dtype. Copies dropped by capacity contribute zeros (the
        block's residual carries those tokens). ``self.l_aux`` holds the auxiliary loss."""
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
        rep = self.replicator
        self.experts.begin_forward(x2.device)  # paged: closes the previous step, builds the pager
        paged = self.experts.pager is not None
        if rep is not None:
            rep.device = x2.device
            self.experts.sync()  # a refresh reads owned experts' weights: no write-back half done
            rep.sync()  # collective when distributed: every rank calls it here

        g = self.gate(x2)
        self.l_aux = g.l_aux
        replica_here = rep.replica_here() if rep is not None and rep.replicas else None
        # Per-step split among copies (hetcomm.moe.token_split): every kept copy travels (a
        # holder's own rows stay local inside the dispatch), none is set aside for a replica.
        splitter = self.splitter if self.token_split_on and rep is not None and rep.hot and not paged else None
        if splitter is not None:
            replica_here = None
        # The only routing step: capacity, then the copies for local replicas set aside; the
        # dispatch plans the exchange of what is left.
        route = route_tokens(g.topk_idx, self._key_of_expert, g.capacity, replica_here)

        # Global statistics for calibration and replication, summed over ranks: one all-reduce
        # (hetcomm.moe.load_observer), launched now and awaited after the experts.
        update = self.training and (self.gate.calibrator is not None or rep is not None or bool(self._load.observers))
        pending = split_table = None
        if update:
            pending, split_table = self._load.launch(  # the speed agreement rides along when due
                g.probs, route.picks, T, self.group, self.distributed, world_size=self.world_size,
                split_row=splitter.table_row(route.send_counts) if splitter is not None else None,
                speed_row=self.speed.agreement_row(g.probs.device))

        weights_flat = g.topk_weights.t().reshape(-1)  # [A], choice-major like assignments
        idx_send = route.send_idx
        owner_map: Sequence[int] = self.placement.owner
        split_mods: List[nn.Module] = []
        if splitter is not None:
            sr = splitter.route(route.send_idx.t().reshape(-1), route.send_counts, cfg.k, owner_map,
                                rep.holders_of_hot(), rep.replicas, self.speed.speeds, table=split_table)
            idx_send, owner_map, split_mods = sr.topk_idx, sr.expert_to_rank, sr.modules

        times = PipelineTimes()
        # This rank's own tokens are sure to reach its experts: a paged store starts their
        # loads before the count exchange tells what the other ranks send.
        self.experts.prefetch_own(route.send_counts)

        # gate -> dispatch -> experts (chunk by chunk, as each arrives) -> combine. The store
        # says whether the rows arrive as one piece per local expert (resident: no [R, D]
        # concatenation of rows or gradients) or as one block (paged).
        mods = self.experts.dispatch_modules(split_mods)
        res = self.comm.dispatch(x2, idx_send, g.topk_weights, expert_to_rank=owner_map, async_op=True,
                                 num_chunks=cfg.num_chunks, split_by_expert=bool(mods), wire_dtype=cfg.wire_dtype)
        local_y = None
        if route.local_assign.numel():  # copies routed to local replicas, hidden behind the dispatch in flight
            te = time.perf_counter()
            mark = self.speed.begin(x2.device)
            local_y = rep.compute_local(x2, route, self.layout.key_of_expert, self.experts)
            self.speed.end(mark, int(route.local_assign.numel()), learn=False)  # busy, not the speed: speed.py
            times.expert_s += time.perf_counter() - te
        y_recv = join_graph(self.experts.compute(res, mods, times, self.speed, x2.device))
        tw = time.perf_counter()
        out = self.comm.combine(y_recv, res.handle)
        times.record_exchange(res, cfg.num_chunks, tw, t_start)
        saved = replica_saved_bytes(g.topk_idx, route, self.placement.owner, rank=self.rank, world_size=self.world_size,
                                    k=cfg.k, num_chunks=cfg.num_chunks, model_dim=D, dtype=x2.dtype,
                                    wire_dtype=self.wire_dtype)

        if local_y is not None:
            w_loc = weights_flat.index_select(0, route.local_assign)
            out = out + weighted_combine(local_y, w_loc, route.local_assign % T, T)

        if rep is not None and rep.hot and out.requires_grad:
            # Every rank's backward must run the replica-gradient all-reduce at the same point:
            # the end of the whole backward pass. The hook sits on the layer's output, which
            # every backward through this layer starts from (the gate may be frozen).
            out = _EndOfBackward.apply(out, rep.grad_reducer())
        after = self.experts.backward_callback()  # a paged wave step's: land the write-backs
        if after is not None and out.requires_grad:
            out = _EndOfBackward.apply(out, after)

        # Statistics, after the experts so that the all-reduce was hidden behind them.
        global_picks = self._load.deliver(pending, self.gate.calibrator, rep, D * x2.element_size()) if update else None
        self.speed.finish_step(pending.speed_table if pending is not None else None,  # the agreement when due
                               forward_s=time.perf_counter() - t_start)
        if self.splitter is not None:
            self.splitter.last_expert_s = self.speed.last_step[1]  # busy seconds: the speed's own clock
        migrations, self._migrations = self._migrations, (0 if self._migrations is not None else None)
        extra = {**self.experts.step_stats(times.rows_per_expert), **self.speed.record(),
                 **(splitter.record() if splitter is not None else {})}
        self.last_stats = forward_record(
            route, times, rank=self.rank, k=cfg.k, local_expert_ids=self.local_expert_ids, metrics=self.metrics,
            replicator=rep, l_aux=self.l_aux, calibrator=self.gate.calibrator, saved_bytes=saved,
            forward_s=lambda: time.perf_counter() - t_start, global_picks=global_picks, migrations=migrations,
            extra=extra)
        return out.to(x.dtype).reshape(shape)

    # -- stats -------------------------------------------------------------------------------
    def step_stats(self) -> StepStats:
        """What the last forward did on this rank: a :class:`~hetcomm.moe.step_stats.StepStats`
        (frozen; its fields are documented there; it also reads like the dict of earlier
        releases). Paging counters (``page_*``) cover this rank's pager since the previous
        forward (a step's end-of-step evictions and prefetches, and a wave step's backward
        reloads, show in the next forward's); ``migrations`` the experts that landed on this
        rank through :meth:`apply_placement` since the previous forward."""
        return self.last_stats if self.last_stats is not None else StepStats.empty(self.rank)

