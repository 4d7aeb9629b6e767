"""``MoELayer``: a Mixture-of-Experts layer whose expert-parallel traffic goes through hetcomm.

Shapes (DeepEP-style notation, see ``hetcomm.moe.dispatch``):
    x        ``[..., D]`` input, any float dtype; flattened to ``[T, D]`` inside
    output   same shape and dtype as ``x``
    l_aux    scalar float32 auxiliary (load-balancing) loss, with grad, on ``layer.l_aux``

One forward:
    gate (top-k softmax, calibrated)  ->  route (one stable sort; capacity; replica copies set
    aside)  ->  ``token_dispatch.dispatch`` (counts, metadata, token rows: a token crosses to a
    rank once; async, per chunk, per-pair wire dtype)  ->  local experts on each arrived chunk
    ->  ``token_dispatch.combine`` (weighted sums per token row, back once per rank)

With one process (no ``torch.distributed``, or a group of one) it runs locally: same routing,
no collectives. Experts per rank may differ (strong devices hold more, see
``hetcomm.moe.placement``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.backends import token_dispatch
from hetcomm.errors import ConfigError
from hetcomm.moe.calibrate import LoadCalibrator
from hetcomm.moe.dispatch import ChunkLayout, gather_rows, plan_route, weighted_combine
from hetcomm.moe.experts import ExpertBank, ExpertSpec, build_expert, cat_rows
from hetcomm.moe.gate import TopKGate
from hetcomm.moe.metrics import MetricsAccumulator, routing_metrics
from hetcomm.moe.overlap import PipelineTimes
from hetcomm.moe.placement import ExpertPlacement, place_experts
from hetcomm.moe.replicate import HotExpertReplicator
from hetcomm.moe.wire import WIRE_DTYPES, WirePolicy, wire_policy

__all__ = ["MoEConfig", "MoELayer"]


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of one :class:`MoELayer` (validated on construction).

    Attributes:
        model_dim: ``D``.
        num_experts: ``E`` global experts.
        k: experts per token.
        capacity_factor: capacity slack over an even split (ignored when ``dropless``).
        dropless: never drop a token copy.
        normalize_topk: rescale a token's ``k`` weights to sum to 1.
        calibrate: load-aware gate calibration on (switchable at run time through
            ``layer.gate.calibrator.enabled``).
        calibration_strength: initial per-expert calibration weight. 1.5: on a gate whose top-5
            experts take 91% of picks it settles at ~58% top-5 share (1.0 gives ~67%).
        wire_dtype: ``auto`` (the cluster's per-link policy; FP32 without a cluster) or
            ``fp32``/``fp16``/``bf16`` for every pair.
        num_chunks: chunks of the pipelined dispatch/combine (1 = no pipelining).
        replicate: hot-expert replication on strong ranks.
        replicate_top: ``N`` hot experts replicated.
        replicate_every: ``M`` steps between hot-set refreshes.
        replicate_alpha: EMA decay of per-expert token counts.
        replicate_policy: ``always`` replicates the top ``N``; ``profitable`` only those whose
            saved all-to-all bytes exceed their weight and gradient sync bytes
            (:mod:`hetcomm.moe.replicate`).
        strong_expert_weight: a strong rank holds this many times the experts of a weak one
            (``rank_weights="strong"``).
        rank_weights: how experts are spread over ranks: ``strong`` (strong ranks hold
            ``strong_expert_weight`` x the experts of weak ones) or ``throughput`` (experts in
            proportion to each rank's device TFLOPS from ``hetcomm.topo.compute``, replicas only
            on the fastest strong ranks) — speed-aware placement for compute-heterogeneous clusters.
        seed: initial weights depend only on this and the expert id (never on the placement).
    """

    model_dim: int
    num_experts: int
    k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    normalize_topk: bool = True
    calibrate: bool = True
    calibration_strength: float = 1.5
    wire_dtype: str = "auto"
    num_chunks: int = 1
    replicate: bool = False
    replicate_top: int = 3
    replicate_every: int = 10
    replicate_alpha: float = 0.99
    replicate_policy: str = "always"
    strong_expert_weight: float = 2.0
    rank_weights: str = "strong"
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(msg, key=f"moe.{key}")

        if not isinstance(self.model_dim, int) or self.model_dim < 1:
            raise bad("model_dim", f"must be a positive integer, got {self.model_dim!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise bad("num_experts", f"must be a positive integer, got {self.num_experts!r}")
        if not isinstance(self.k, int) or not 1 <= self.k <= self.num_experts:
            raise bad("k", f"must be in 1..num_experts={self.num_experts}, got {self.k!r}")
        if not self.capacity_factor > 0:
            raise bad("capacity_factor", f"must be > 0, got {self.capacity_factor!r} (use dropless=True for no limit)")
        if self.wire_dtype != "auto" and self.wire_dtype not in WIRE_DTYPES:
            raise bad("wire_dtype", f"unknown wire dtype {self.wire_dtype!r}; expected auto, fp32, fp16 or bf16")
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise bad("num_chunks", f"must be a positive integer, got {self.num_chunks!r}")
        if self.rank_weights not in ("strong", "throughput"):
            raise bad("rank_weights", f"expected 'strong' or 'throughput', got {self.rank_weights!r}")
        if not self.strong_expert_weight > 0:
            raise bad("strong_expert_weight", f"must be > 0, got {self.strong_expert_weight!r}")
        if self.calibration_strength < 0:
            raise bad("calibration_strength", f"must be >= 0, got {self.calibration_strength!r}")


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


class _WireComm:
    """The layer's face for :mod:`hetcomm.backends.token_dispatch` (a ``DispatchComm``): its
    group, and the wire dtype of each pair from the layer's own :class:`WirePolicy` (the
    ``wire_dtype`` option can differ from the backend's options, so it is not the
    Communicator's policy)."""

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, world_size: int, policy: WirePolicy):
        self.group, self.rank, self.world_size, self.policy = group, rank, world_size, policy

    def wire_dtype(self, peer: int, dtype: torch.dtype) -> Optional[torch.dtype]:
        if peer == self.rank:
            return None
        return WIRE_DTYPES[self.policy.names[self.rank][peer]]


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
            self.rank_tflops = rank_speeds(cluster, self.global_ranks)
            if cfg.rank_weights == "throughput":
                # Replica holders are the fastest ranks: the strong ones within STRONG_FRACTION of
                # the fastest device (a replica on a slow rank adds work where time is short).
                fast = set(strong_by_throughput(self.rank_tflops))
                self.strong_ranks = [r for r in self.strong_ranks if r in fast] or sorted(fast)
        else:
            self.strong_ranks = list(range(W))

        if placement is None:
            if cfg.rank_weights == "throughput":
                weights = list(self.rank_tflops)  # experts in proportion to compute speed
            else:
                weights = [cfg.strong_expert_weight if r in self.strong_ranks else 1.0 for r in range(W)]
            placement = place_experts(num_experts, W, rank_weights=weights)
        elif placement.world_size != W or placement.num_experts != num_experts:
            raise ConfigError(
                f"placement is for {placement.num_experts} experts on {placement.world_size} ranks "
                f"but the layer has {num_experts} experts on a group of {W}",
                key="moe.placement",
            )
        self.placement = placement
        self.wire: WirePolicy = wire_policy(W, cfg.wire_dtype, cluster, self.global_ranks)
        self._comm = _WireComm(group if W > 1 else None, self.rank, W, self.wire)
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
                self.strong_ranks,
                lambda e: build_expert(self._expert_spec, model_dim, e, cfg.seed),
                owned,
                group,
                num_hot=cfg.replicate_top,
                every=cfg.replicate_every,
                alpha=cfg.replicate_alpha,
                policy=cfg.replicate_policy,
            )
        self.l_aux: torch.Tensor = torch.zeros((), device="cpu")  # replaced by the first forward
        self.last_stats: Dict[str, Any] = {}
        self.metrics = MetricsAccumulator()

    # -- helpers -----------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"model_dim={c.model_dim}, num_experts={c.num_experts}, k={c.k}, capacity_factor="
            f"{c.capacity_factor}, dropless={c.dropless}, world_size={self.world_size}, rank={self.rank}, "
            f"local_experts={list(self.local_expert_ids)}, wire={self.wire.uniform or 'mixed'}, "
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

    def _modules_by_id(self) -> List[nn.Module]:
        """This rank's experts in ascending global id (the dispatch's local-expert order)."""
        ids = self.placement.experts_of(self.rank)
        return [self.experts.experts[i] for i in sorted(range(len(ids)), key=lambda i: ids[i])]

    def _make_expert(self, expert_id: int) -> nn.Module:
        return build_expert(self._expert_spec, self.config.model_dim, expert_id, self.config.seed)

    def _set_placement(self, placement: ExpertPlacement, modules: Sequence[nn.Module]) -> None:
        """Adopt ``placement`` with ``modules`` as this rank's experts, in local order."""
        self.placement = placement
        self._adopt_layout(placement)
        self.local_expert_ids = tuple(placement.experts_of(self.rank))
        self.experts.experts = nn.ModuleList(modules)
        if self.replicator is not None:
            self.replicator.adopt_placement(
                placement, {e: self.experts.experts[i] for i, e in enumerate(self.local_expert_ids)}
            )

    def rebalance(self, expert_load: Optional[Sequence[float]] = None, optimizer=None) -> List[int]:
        """Re-place experts by load: hottest spread over strong ranks, coldest on weak ranks.

        Collective. Every rank keeps its number of experts; moved experts carry their optimizer
        state along (see :mod:`hetcomm.moe.migrate`), so training continues unchanged.

        Args:
            expert_load: ``[E]`` load per expert, identical on every rank (default: the
                replication EMA of global token counts, which is).
            optimizer: the optimizer holding this layer's parameters, or None.
        Returns:
            Global ids of the experts that moved.

        Raises:
            ConfigError: no load given and replication off.
        """
        from hetcomm.moe.migrate import migrate_experts

        if expert_load is None:
            if self.replicator is None:
                raise ConfigError(
                    "rebalance() needs expert_load=[E loads] when replication is off (the "
                    "replication EMA is the default load)",
                    key="moe.rebalance",
                )
            expert_load = self.replicator.ema.tolist()
        new = place_experts(
            self.config.num_experts,
            self.world_size,
            strong_ranks=self.strong_ranks,
            expert_load=list(expert_load),
            num_local_experts=self.placement.num_local_experts_per_rank,
        )
        return migrate_experts(self, new, optimizer)

    def sync_replicas(self, force: bool = False) -> bool:
        """Refresh replicas from their owners now (collective). Returns True if weights moved."""
        if self.replicator is None:
            return False
        return self.replicator.sync(force)

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
        if rep is not None:
            rep.device = x2.device
            rep.sync()  # collective when distributed: every rank calls it here

        g = self.gate(x2)
        self.l_aux = g.l_aux
        replica_here = rep.replica_here() if rep is not None and rep.replicas else None
        route = plan_route(g.topk_idx, self._key_of_expert, g.capacity, replica_here)

        # Global statistics for calibration and replication, summed over ranks: one all-reduce
        # of [probs (E), picks (E), tokens (1)], launched now and awaited after the experts.
        update = self.training and (self.gate.calibrator is not None or rep is not None)
        stat_vec = stat_work = None
        if update:
            stat_vec = torch.cat(
                [g.probs.detach().sum(0).double(), route.picks.double(), torch.tensor([float(T)], dtype=torch.float64, device=x2.device)]
            )
            if self.distributed:
                stat_work = dist.all_reduce(stat_vec, group=self.group, async_op=True)

        weights_flat = g.topk_weights.t().reshape(-1)  # [A], choice-major like assignments
        # The copies that travel (kept, not computed on a local replica), as the dispatch's
        # topk_idx: -1 in every other slot.
        A = route.num_assign
        idx_cm = torch.full((A,), -1, dtype=torch.int64, device=x2.device)
        idx_cm[route.send_assign] = g.topk_idx.t().reshape(-1)[route.send_assign]
        idx_send = idx_cm.view(cfg.k, T).t()

        times = PipelineTimes()
        local_out: List = []

        def compute_local() -> None:
            # Copies routed to local replicas: computed here, hidden behind the dispatch in flight.
            if route.local_assign.numel() == 0:
                return
            te = time.perf_counter()
            xs = gather_rows(x2, route.local_assign % T)
            counts = torch.bincount(route.local_expert, minlength=E)
            order = sorted(set(route.local_expert.tolist()), key=lambda e: int(self.layout.key_of_expert[e]))
            mods = rep.local_modules(order)
            y = self.experts.forward_sorted(xs, [int(counts[e]) for e in order], modules=mods)
            local_out.append(y)
            times.expert_s += time.perf_counter() - te

        # gate -> dispatch -> experts (chunk by chunk, as each arrives) -> combine.
        recv_x, counts, handle, work = token_dispatch.dispatch(
            self._comm,
            x2,
            idx_send,
            g.topk_weights,
            expert_to_rank=self.placement.owner,
            async_op=True,
            num_chunks=cfg.num_chunks,
        )
        compute_local()
        mods = self._modules_by_id()
        ys, off = [], 0
        for c, n in enumerate(handle.chunk_rows):
            work.wait_chunk(c)
            lo, hi = handle.chunk_experts[c]
            te = time.perf_counter()
            ys.append(self.experts.forward_sorted(recv_x[off : off + n], counts[lo:hi], modules=mods[lo:hi]))
            times.expert_s += time.perf_counter() - te
            off += n
        y_recv = ys[0] if len(ys) == 1 or not sum(handle.chunk_rows) else cat_rows(ys)
        tw = time.perf_counter()
        out = token_dispatch.combine(self._comm, y_recv, handle)
        times.comm_exposed_s = work.exposed_s + time.perf_counter() - tw
        times.num_chunks = cfg.num_chunks
        times.rows_per_expert = list(counts)
        # Combine sends back exactly what dispatch received, in the same wire dtypes.
        times.bytes_sent = times.bytes_recv = handle.bytes_sent + handle.bytes_recv
        times.total_s = time.perf_counter() - t_start
        saved = self._replica_saved_bytes(g.topk_idx, route, idx_cm, D, x2.element_size())

        if local_out:
            w_loc = weights_flat.index_select(0, route.local_assign)
            out = out + weighted_combine(local_out[0], w_loc, route.local_assign % T, T)

        if rep is not None and rep.hot and out.requires_grad:
            # Every rank's backward must run the replica-gradient all-reduce at the same point:
            # the end of the whole backward pass. The hook sits on the layer's output, which
            # every backward through this layer starts from (the gate may be frozen).
            out = _EndOfBackward.apply(out, rep.grad_reducer())

        # Statistics, after the experts so that the all-reduce was hidden behind them.
        if update:
            if stat_work is not None:
                stat_work.wait()
            gp, gpicks, gT = stat_vec[:E], stat_vec[E : 2 * E], float(stat_vec[2 * E])
            if self.gate.calibrator is not None:
                self.gate.calibrator.update(gp, gT)
            if rep is not None:
                rep.observe(gpicks, row_bytes=D * x2.element_size())
        self._record(route, times, t_start, saved, global_picks=stat_vec[E : 2 * E] if update else None)
        return out.to(x.dtype).reshape(shape)

    def _replica_saved_bytes(self, topk_idx, route, idx_cm, D: int, elem: int) -> int:
        """Forward bytes (dispatch + combine) the copies computed on local replicas would have
        cost: the token rows with them minus the token rows without them, per destination."""
        if route.local_assign.numel() == 0:
            return 0
        cfg = self.config
        T = topk_idx.size(0)
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
                wd = WIRE_DTYPES[self.wire.names[self.rank][d]]
                # Sent once by dispatch, once more by combine (summed over ranks, what comes back
                # to one rank is what another sends).
                saved += 2 * n * D * min(wd.itemsize, elem)
        return saved

    # -- stats -------------------------------------------------------------------------------
    def _record(self, route, times: PipelineTimes, t_start: float, saved: int, global_picks=None) -> None:
        kept = route.num_assign - route.num_dropped
        own = [e for e in self.local_expert_ids]
        num_self = int(route.send_counts[list(own)].sum()) if own else 0
        num_local = num_self + int(route.local_assign.numel())
        self.metrics.add(route.picks, route.num_dropped, num_local, kept)
        m = routing_metrics(route.picks, route.num_dropped, num_local, kept)
        D = self.config.model_dim
        stats: Dict[str, Any] = {
            "rank": self.rank,
            "tokens": route.num_assign // max(1, self.config.k),
            "copies": route.num_assign,
            "dropped": route.num_dropped,
            "overflow_rate": m.overflow_rate,
            "top5_share": m.top5_share,
            "min_expert_rate": m.min_expert_rate,
            "local_fraction": m.local_fraction,
            "a2a_bytes_sent": times.bytes_sent,
            "a2a_bytes_recv": times.bytes_recv,
            "a2a_bytes_sent_without_replication": times.bytes_sent + saved,
            "comm_exposed_s": times.comm_exposed_s,
            "expert_s": times.expert_s,
            "forward_s": time.perf_counter() - t_start,
            "num_chunks": times.num_chunks,
            "rows_per_expert": list(times.rows_per_expert),
            "replicas": tuple(self.replicator.replicas) if self.replicator else (),
            "hot_experts": self.replicator.hot if self.replicator else (),
            "replica_extra_bytes": self.replicator.extra_bytes if self.replicator else 0,
            "l_aux": float(self.l_aux.detach()),
        }
        if global_picks is not None:
            gm = routing_metrics(global_picks, 0, 0)
            stats["global_top5_share"] = gm.top5_share
            stats["global_min_expert_rate"] = gm.min_expert_rate
        if self.gate.calibrator is not None:
            stats["calibration_lag"] = self.gate.calibrator.lag_factor()
        self.last_stats = stats

    def step_stats(self) -> Dict[str, Any]:
        """The per-step stats dict of the last forward (a copy). Keys:

        ``tokens``, ``copies``, ``dropped``, ``overflow_rate``, ``top5_share``,
        ``min_expert_rate``, ``local_fraction`` (this rank's routing); ``global_top5_share`` and
        ``global_min_expert_rate`` (all ranks, training steps only); ``a2a_bytes_sent`` /
        ``a2a_bytes_recv`` (forward activation bytes to/from other ranks, wire dtypes applied);
        ``a2a_bytes_sent_without_replication`` (what replication saved, added back);
        ``comm_exposed_s``, ``expert_s``, ``forward_s``, ``num_chunks``, ``rows_per_expert`` (rows
        each local expert computed); ``hot_experts``,
        ``replicas`` (held here), ``replica_extra_bytes``; ``l_aux``; ``calibration_lag``.
        """
        return dict(self.last_stats)
