"""``StepStats``: what one forward of :class:`hetcomm.moe.MoELayer` did on this rank, as a typed record.

The metrics collector (:mod:`hetcomm.ops.metrics`), the training loop's progress line and
summary, and through the metrics records ``hetcomm report`` and ``hetcomm doctor`` read it.
Fields that only exist in some runs (training-only global shares, paging, migrations) are None
when absent.

It also reads like the dict of earlier releases (``st["dropped"]``, ``"page_hits" in st``,
``st.get(...)``, ``dict(st)``): a key is present when its field is not None. New code reads the
attributes. :func:`forward_record` makes one from a forward's routing and timings (the layer's
own parts: :func:`replica_saved_bytes`; the expert store's, the speed meter's and the split's
fields come as ``extra``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from hetcomm.backends import tokens as token_dispatch
from hetcomm.moe.overlap import PipelineTimes
from hetcomm.moe.routing import Routing
from hetcomm.moe.routing_metrics import MetricsAccumulator, routing_metrics

__all__ = ["StepStats", "forward_record", "replica_saved_bytes"]


@dataclass(frozen=True, eq=True)
class StepStats(Mapping):
    """One forward of one MoE layer on this rank.

    Attributes:
        rank: this rank in the layer's group.
        tokens: tokens routed (``T``).
        copies: token copies routed (``T * k``).
        dropped: copies dropped by the capacity limit.
        overflow_rate: ``dropped / copies``.
        top5_share: share of this rank's picks taken by its 5 most-picked experts.
        min_expert_rate: share of picks of the least-picked expert (0.0 = an idle expert).
        local_fraction: kept copies computed on this rank (own experts, local replicas) / kept.
        a2a_bytes_sent: forward activation bytes to other ranks (dispatch + combine, wire
            dtypes applied).
        a2a_bytes_recv: forward activation bytes from other ranks.
        a2a_bytes_sent_without_replication: ``a2a_bytes_sent`` plus what local replicas saved.
        comm_exposed_s: seconds blocked waiting for dispatch/combine exchanges.
        expert_s: seconds in the expert modules.
        forward_s: seconds of the whole forward.
        num_chunks: ``C`` of the pipelined dispatch.
        rows_per_expert: rows each local expert computed (``[L]``).
        replicas: experts replicated on this rank.
        hot_experts: the replicator's hot set.
        replica_extra_bytes: bytes of replica refreshes and gradient sums.
        l_aux: the auxiliary loss of this forward.
        global_top5_share: top-5 share over every rank (training steps only, else None).
        global_min_expert_rate: least-picked expert's share over every rank (training only).
        calibration_lag: the gate calibrator's lag factor (None without calibration).
        migrations: experts that landed on this rank through ``apply_placement`` since the
            previous forward (None until a placement has been applied).
        page_hits: paging (None when off): expert computations that started without waiting.
        page_faults: computations that waited for their load, or took the L1/L3 answer.
        page_stall_s: seconds computations waited for loads (backward reloads included).
        page_loads / page_evictions / page_prefetches / page_reacquires: the pager's transfers
            since the previous forward (``reacquires``: backward reloads of a wave step).
        page_resident / page_slots: experts on the device now / room for them.
        page_waves: this step's experts did not fit and streamed through the slots.
        page_experts_used: local experts this step routed to.
        page_l1_waits / page_l1_stale / page_l2_pins / page_l2_migration_requests /
            page_l3_substitutions: the degradation levels (:mod:`hetcomm.moe.degrade`).
        speed_rows_per_s: the group's agreed per-rank expert speed (:mod:`hetcomm.moe.speed`),
            rows/s once measured (``speed_measured``), the datasheet prior before;
            ``speed_agreements``, ``speed_local_rows_per_s`` (this rank's EMA),
            ``speed_max_over_min``, ``speed_noise`` (each rank's relative noise, None where
            unknown) and ``speed_differ`` (the agreed verdict of the one rule; None before it).
        split_experts / moe_rows / moe_time_predicted / moe_time_measured_s: the per-step split
            (:mod:`hetcomm.moe.token_split`): experts split among copies, rows per rank, predicted
            expert time per rank (rows / speed) and each rank's measured forward expert seconds
            of the previous step, with their ``*_max_over_mean``. None when no split ran.
    """

    rank: int
    tokens: int
    copies: int
    dropped: int
    overflow_rate: float
    top5_share: float
    min_expert_rate: float
    local_fraction: float
    a2a_bytes_sent: int
    a2a_bytes_recv: int
    a2a_bytes_sent_without_replication: int
    comm_exposed_s: float
    expert_s: float
    forward_s: float
    num_chunks: int
    rows_per_expert: Tuple[int, ...]
    replicas: Tuple[int, ...]
    hot_experts: Tuple[int, ...]
    replica_extra_bytes: int
    l_aux: float
    global_top5_share: Optional[float] = None
    global_min_expert_rate: Optional[float] = None
    calibration_lag: Optional[float] = None
    migrations: Optional[int] = None
    page_hits: Optional[int] = None
    page_faults: Optional[int] = None
    page_stall_s: Optional[float] = None
    page_loads: Optional[int] = None
    page_evictions: Optional[int] = None
    page_prefetches: Optional[int] = None
    page_reacquires: Optional[int] = None
    page_resident: Optional[int] = None
    page_slots: Optional[int] = None
    page_waves: Optional[bool] = None
    page_experts_used: Optional[int] = None
    page_l1_waits: Optional[int] = None
    page_l1_stale: Optional[int] = None
    page_l2_pins: Optional[int] = None
    page_l2_migration_requests: Optional[int] = None
    page_l3_substitutions: Optional[int] = None
    # Paging rule (hetcomm.moe.paging_rule): do the copies hide? None on CPU ranks.
    page_can_hide: Optional[bool] = None
    page_hide_threshold_tokens: Optional[float] = None
    # Measured speed (hetcomm.moe.speed): the agreed per-rank vector, rows/s (prior units before
    # the first agreement).
    speed_rows_per_s: Optional[Tuple[float, ...]] = None
    speed_measured: Optional[bool] = None
    speed_agreements: Optional[int] = None
    speed_local_rows_per_s: Optional[float] = None
    speed_max_over_min: Optional[float] = None
    speed_noise: Optional[Tuple[Optional[float], ...]] = None
    speed_differ: Optional[bool] = None
    # Per-step split (hetcomm.moe.token_split; None when no split ran this forward).
    split_experts: Optional[Tuple[int, ...]] = None
    moe_rows: Optional[Tuple[int, ...]] = None
    moe_time_predicted: Optional[Tuple[float, ...]] = None
    moe_time_predicted_max_over_mean: Optional[float] = None
    moe_time_measured_s: Optional[Tuple[float, ...]] = None
    moe_time_measured_max_over_mean: Optional[float] = None

    @staticmethod
    def empty(rank: int = 0) -> "StepStats":
        """The record of a layer that has not run a forward yet (every count 0)."""
        return StepStats(rank, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0.0, 0.0, 0.0, 1, (), (), (), 0, 0.0)

    # -- the dict view of earlier releases ---------------------------------------------------
    def as_dict(self) -> Dict[str, Any]:
        """The fields that are set, as a plain dict (``rows_per_expert`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        out["rows_per_expert"] = list(self.rows_per_expert)
        return out

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key, None) if key in _NAMES else None
        if value is None:
            raise KeyError(key)
        return list(value) if key == "rows_per_expert" else value

    def __iter__(self) -> Iterator[str]:
        return (n for n in _ORDER if getattr(self, n) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_ORDER = tuple(f.name for f in fields(StepStats))
_NAMES = frozenset(_ORDER)


def forward_record(route: Routing, times: PipelineTimes, *, rank: int, k: int, local_expert_ids: Sequence[int],
                   metrics: MetricsAccumulator, replicator: Any, l_aux: torch.Tensor, calibrator: Any,
                   forward_s: Callable[[], float], saved_bytes: int, global_picks: Optional[torch.Tensor],
                   migrations: Optional[int], extra: Dict[str, Any]) -> StepStats:
    """The :class:`StepStats` of one forward of :class:`hetcomm.moe.MoELayer` on this rank; adds
    its picks, drops and local copies to ``metrics`` too.

    Args:
        route: the forward's :class:`~hetcomm.moe.routing.Routing`.
        times: its :class:`~hetcomm.moe.overlap.PipelineTimes`.
        rank: this rank in the layer's group; ``k``: experts per token.
        local_expert_ids: global ids of this rank's experts.
        metrics: the layer's windowed accumulator.
        replicator: the layer's :class:`~hetcomm.moe.placement.replicate.HotExpertReplicator`
            or None; ``calibrator``: the gate's, or None.
        l_aux: the auxiliary loss (scalar).
        forward_s: seconds since the forward began (called last).
        saved_bytes: forward bytes local replicas saved (:func:`replica_saved_bytes`).
        global_picks: ``[E]`` picks summed over the group (training forwards), or None.
        migrations: experts that landed since the previous forward, or None.
        extra: the other fields (the expert store's ``page_*``, the speed meter's, the split's).
    """
    kept = route.num_assign - route.num_dropped
    own = [e for e in local_expert_ids]
    num_self = int(route.send_counts[list(own)].sum()) if own else 0
    num_local = num_self + int(route.local_assign.numel())
    metrics.add(route.picks, route.num_dropped, num_local, kept)
    m = routing_metrics(route.picks, route.num_dropped, num_local, kept)
    gm = routing_metrics(global_picks, 0, 0) if global_picks is not None else None
    rep = replicator
    return StepStats(
        rank=rank,
        tokens=route.num_assign // max(1, k),
        copies=route.num_assign,
        dropped=route.num_dropped,
        overflow_rate=m.overflow_rate,
        top5_share=m.top5_share,
        min_expert_rate=m.min_expert_rate,
        local_fraction=m.local_fraction,
        a2a_bytes_sent=times.bytes_sent,
        a2a_bytes_recv=times.bytes_recv,
        a2a_bytes_sent_without_replication=times.bytes_sent + saved_bytes,
        comm_exposed_s=times.comm_exposed_s,
        expert_s=times.expert_s,
        forward_s=forward_s(),
        num_chunks=times.num_chunks,
        rows_per_expert=tuple(times.rows_per_expert),
        replicas=tuple(rep.replicas) if rep else (),
        hot_experts=tuple(rep.hot) if rep else (),
        replica_extra_bytes=rep.extra_bytes if rep else 0,
        l_aux=float(l_aux.detach()),
        global_top5_share=gm.top5_share if gm is not None else None,
        global_min_expert_rate=gm.min_expert_rate if gm is not None else None,
        calibration_lag=calibrator.lag_factor() if calibrator is not None else None,
        migrations=migrations,
        **extra,
    )


def replica_saved_bytes(topk_idx: torch.Tensor, route: Routing, owner: Sequence[int], *, rank: int, world_size: int,
                        k: int, num_chunks: int, model_dim: int, dtype: torch.dtype,
                        wire_dtype: Callable[[int, torch.dtype], torch.dtype]) -> int:
    """Forward bytes (dispatch + combine) the copies computed on local replicas would have
    cost: the token rows with them minus the token rows without them, per destination.

    Args:
        topk_idx: ``[T, k]`` int64 the gate's picks.
        route: the forward's routing (``send_idx`` without the replica copies).
        owner: ``[E]`` owner rank of each expert; ``rank``: this one of ``world_size``.
        k: experts per token; ``num_chunks``: the dispatch's chunks.
        model_dim: ``D``; ``dtype``: the rows' dtype.
        wire_dtype: ``f(peer, dtype)``, the dtype rows travel in to/from ``peer``.
    """
    if route.local_assign.numel() == 0:
        return 0
    T = topk_idx.size(0)
    idx_cm = route.send_idx.t().reshape(-1)
    with_rep = idx_cm.clone()
    with_rep[route.local_assign] = topk_idx.t().reshape(-1)[route.local_assign]
    rows = [
        token_dispatch.count_token_rows(i.view(k, T).t(), owner, world_size, num_chunks)
        for i in (with_rep, idx_cm)
    ]
    extra = (rows[0] - rows[1]).tolist()
    saved = 0
    for d, n in enumerate(extra):
        if d != rank and n:
            wd = wire_dtype(d, dtype)
            # Sent once by dispatch, once more by combine (summed over ranks, what comes back
            # to one rank is what another sends).
            saved += 2 * n * model_dim * wd.itemsize
    return saved
