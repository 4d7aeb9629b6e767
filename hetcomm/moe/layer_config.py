"""``MoEConfig``: the options of one :class:`hetcomm.moe.MoELayer`, validated on construction
(a bad value raises ``ConfigError`` naming the ``moe.<key>``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from hetcomm.errors import ConfigError
from hetcomm.moe.paging import PagingConfig
from hetcomm.wire_dtypes import LAYER_SPELLINGS, parse_wire_dtype

__all__ = ["MoEConfig"]


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
        wire_dtype: the policy of the Communicator's one wire rule for the layer's rows
            (:meth:`hetcomm.Communicator.wire_dtype`, :mod:`hetcomm.wire_dtypes`): ``auto``
            (the cluster's per-link policy; FP32 without a cluster, FP16 between vendors) or
            ``fp32``/``fp16``/``bf16`` for every pair.
        num_chunks: chunks of the pipelined dispatch/combine (1 = no pipelining).
        replicate: hot-expert replication on strong ranks, from the first speed verdict on, on
            the fastest of them with room (:func:`~hetcomm.moe.placement.replicate.choose_holders`).
        replicate_top: ``N`` hot experts replicated.
        replicate_every: ``M`` steps between hot-set refreshes (1: every step; a new hot set
            costs no extra transfer, the after-step refresh brings its weights).
        replicate_alpha: EMA decay of per-expert token counts (below 0.5, a hot set that moved
            is followed after one step: with ``replicate_every=1``, a moving hotspot; docs/MOE.md).
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
        page_budget: expert paging (:mod:`hetcomm.moe.paging`): the fraction of this rank's
            local experts whose weights (and optimizer state) stay on the device; the rest wait
            in a host pool and are paged in when the gate routes tokens to them. 0 (default):
            off, every expert stays where the module put it.
        paging: the pager's other knobs (:class:`~hetcomm.moe.paging.PagingConfig`; its
            ``budget_fraction`` is replaced by ``page_budget``), or None for the defaults.
            ``page_budget="auto"``: page only when the experts do not fit the device they are
            built on (:mod:`hetcomm.moe.paging_rule`; never on CPU ranks).
        token_split: per-step, time-proportional split of a replicated expert's rows among its
            copies (:mod:`hetcomm.moe.token_split`; off with paging). True: always (needs
            ``replicate``); ``"auto"`` (default): the policy's ``token_split`` lever turns it on
            and off (:class:`~hetcomm.moe.MeasuredLoop` applies it after each agreement: on once
            the agreed speeds differ); off without replication or a :class:`MeasuredLoop`; False: never.
        speed_every: steps between agreements of the measured per-rank speed vector
            (:mod:`hetcomm.moe.speed`; 0 = keep the datasheet prior).
        speed_alpha: EMA decay of the measured rows and seconds.
        speed_pool: ``"device"`` (default): ranks at one datasheet speed (the prior:
            ``device.tflops`` or the model's) pool their measurements when these agree within
            their noise (a straggler inside a class keeps its own speed); ``"rank"``: each
            rank's speed is its own measurement (:mod:`hetcomm.moe.speed`).
        replicate_powersgd: PowerSGD rank of the replicas' gradient sums on cross-node pairs
            (:mod:`hetcomm.moe.placement.replicate`, torch's error feedback and warm start;
            exact inside a node). 0 (default): every sum exact. Needs ``replicate``, a cluster
            (its nodes) and the layer's group to be the whole job.
        replicate_powersgd_start: exact sums for the first this many replica-gradient
            reductions (backward passes with a hot set; PowerSGD's ``start_powerSGD_iter``; >= 2).
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
    replicate_every: int = 1
    replicate_alpha: float = 0.25
    replicate_policy: str = "always"
    strong_expert_weight: float = 2.0
    rank_weights: str = "strong"
    seed: int = 0
    page_budget: float = 0.0
    paging: Optional[PagingConfig] = None
    token_split: Union[bool, str] = "auto"
    speed_every: int = 5
    speed_alpha: float = 0.8
    speed_pool: str = "device"
    replicate_powersgd: int = 0
    replicate_powersgd_start: int = 10

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
        parse_wire_dtype(self.wire_dtype, allowed=LAYER_SPELLINGS, key="moe.wire_dtype")
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise bad("num_chunks", f"must be a positive integer, got {self.num_chunks!r}")
        if self.rank_weights not in ("strong", "throughput"):
            raise bad("rank_weights", f"expected 'strong' or 'throughput', got {self.rank_weights!r}")
        if self.speed_pool not in ("rank", "device"):
            raise bad("speed_pool", f"expected 'rank' or 'device', got {self.speed_pool!r}")
        if self.token_split not in (True, False, "auto"):
            raise bad("token_split", f"must be True, False or 'auto', got {self.token_split!r}")
        if self.token_split is True and not self.replicate:
            raise bad("token_split", "splits a replicated expert's rows among its copies: set replicate=True too")
        if not self.strong_expert_weight > 0:
            raise bad("strong_expert_weight", f"must be > 0, got {self.strong_expert_weight!r}")
        if self.calibration_strength < 0:
            raise bad("calibration_strength", f"must be >= 0, got {self.calibration_strength!r}")
        pb = self.page_budget
        if pb != "auto" and (isinstance(pb, bool) or not isinstance(pb, (int, float)) or not 0.0 <= pb <= 1.0):
            raise bad("page_budget", f"must be a fraction within [0, 1] (0 = paging off) or 'auto', got {pb!r}")
        if self.paging is not None and not isinstance(self.paging, PagingConfig):
            raise bad("paging", f"must be a hetcomm.moe.paging.PagingConfig or None, got {type(self.paging).__name__}")
        rp = self.replicate_powersgd
        if isinstance(rp, bool) or not isinstance(rp, int) or rp < 0:
            raise bad("replicate_powersgd", f"must be a whole number >= 0 (0 = exact sums), got {rp!r}")
        if rp and not self.replicate:
            raise bad("replicate_powersgd", "compresses the replicas' gradient sums: set replicate=True too")
        rs = self.replicate_powersgd_start
        if isinstance(rs, bool) or not isinstance(rs, int) or rs < 2:
            raise bad("replicate_powersgd_start", f"must be a whole number >= 2 (torch's error feedback needs it), got {rs!r}")

    @classmethod
    def for_layer(cls, model_dim: int, num_experts: int, k: int, capacity_factor: float,
                  options: Mapping[str, Any]) -> "MoEConfig":
        """The config of ``MoELayer(model_dim, num_experts, k, capacity_factor, **options)``.

        Raises:
            ConfigError: an option that is no field of this class (``key='moe'``, listing the
                valid ones), or a bad value (``key='moe.<field>'``).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(
                f"unknown MoELayer option(s) {unknown}; valid options: {sorted(names - {'model_dim', 'num_experts', 'k', 'capacity_factor'})}",
                key="moe",
            )
        return cls(model_dim=model_dim, num_experts=num_experts, k=k, capacity_factor=capacity_factor, **options)
