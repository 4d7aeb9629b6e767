"""``StepStats``: what one forward of :class:`hetcomm.moe.MoELayer` did on this rank, as a typed record.

The metrics collector (:mod:`hetcomm.ops.metrics`), the training loop's progress line and
summary, and through the metrics records ``hetcomm report`` and ``hetcomm doctor`` read it.
Fields that only exist in some runs (training-only global shares, paging, migrations) are None
when absent.

It also reads like the dict of earlier releases (``st["dropped"]``, ``"page_hits" in st``,
``st.get(...)``, ``dict(st)``): a key is present when its field is not None. New code reads the
attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ["StepStats"]


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
