"""Whole MoE step time: the all-to-alls of a routing *and* each rank's expert compute.

The plan simulator (:mod:`hetcomm.sched.simulate`) judges plans by the bytes they move; an MoE
step also computes. On a mixed cluster a rank's expert FFN time depends on how many token copies
its experts receive and on its device (an H800 computes ~3x an A100 or a 910B,
:mod:`hetcomm.topo.compute`), so a placement that evens out bytes can still leave every rank
waiting for the slowest one. This module puts the two together.

Notation:
    W ranks, E experts, ``owner[e]`` the rank holding expert ``e``; ``p[e]`` the share of token
    copies routed to ``e`` (sums to 1); each rank routes ``T`` tokens, ``k`` copies each, of
    width ``D`` at ``b`` bytes per element; an expert is ``Linear(D, F) -> act -> Linear(F, D)``.

Model (one training step of one MoE layer):

* traffic: rank ``i`` sends ``T k p(j) D b`` bytes to rank ``j``, ``p(j) = sum of p[e] over
  experts on j`` — the dispatch; the combine sends the same matrix transposed; backward repeats
  both. Each all-to-all is planned and simulated on the cluster (``plan``);
* compute: rank ``r`` runs ``W T k p(r)`` token copies through its experts; forward is
  ``4 D F`` FLOPs per copy (two GEMMs), backward twice that; at ``tflops[r] * efficiency``;
* the step: the ranks meet at every all-to-all, so
  ``step = dispatch + max_r fwd_r + combine + combine_bwd + max_r bwd_r + dispatch_bwd``,
  plus ``overhead_s``, a per-step constant for what neither term explains (gating, row
  sorting, the framework), calibrated from one measured step when one is available.

Dense (attention) compute is the same on every rank of a data-parallel group and is left out:
this is the part placement can change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hetcomm.errors import UsageError
from hetcomm.sched.cost import CostParams
from hetcomm.topo.cluster import Cluster

__all__ = ["MoEWorkload", "StepResult", "routing_traffic", "expert_flops", "simulate_moe_step", "zipf_load"]


@dataclass(frozen=True)
class MoEWorkload:
    """One MoE layer's work per step.

    Attributes:
        tokens_per_rank: ``T``, tokens each rank routes per step.
        k: copies per token.
        model_dim / hidden_dim: ``D`` / ``F`` of every expert.
        wire_bytes: bytes per activation element on the wire (2 for FP16/BF16).
        backward: include the backward pass (2x forward FLOPs, the all-to-alls again).
        efficiency: fraction of the device's peak TFLOPS an expert GEMM reaches (0.5 is typical
            for the small per-expert batches of MoE; measured with ``hetcomm bench compute``).
        overhead_s: per-step time neither the links nor the expert GEMMs explain (gating,
            sorting rows, kernel launches, the framework), the same for every placement; 0 by
            default, calibrated from one measured step where one exists.
    """

    tokens_per_rank: int
    k: int = 2
    model_dim: int = 4096
    hidden_dim: int = 14336
    wire_bytes: int = 2
    backward: bool = True
    efficiency: float = 0.5
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "k", "model_dim", "hidden_dim", "wire_bytes"):
            if getattr(self, name) < 1:
                raise UsageError(f"MoE workload: {name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.efficiency <= 1:
            raise UsageError(f"MoE workload: efficiency must be in (0, 1], got {self.efficiency}")
        if not self.overhead_s >= 0:
            raise UsageError(f"MoE workload: overhead_s must be >= 0, got {self.overhead_s}")


@dataclass(frozen=True)
class StepResult:
    """What :func:`simulate_moe_step` predicts.

    Attributes:
        time_s: the whole step (all-to-alls + the slowest rank's compute per phase).
        alltoall_s: the four all-to-alls together.
        compute_s: ``[W]`` each rank's expert compute (forward + backward) in seconds.
        copies: ``[W]`` token copies each rank computes per step.
        slowest_rank: the rank whose compute bounds the step.
        plan: the strategy the all-to-alls used.
    """

    time_s: float
    alltoall_s: float
    compute_s: np.ndarray
    copies: np.ndarray
    slowest_rank: int
    plan: str
    notes: Tuple[str, ...] = field(default=())

    @property
    def compute_max_s(self) -> float:
        return float(self.compute_s.max()) if len(self.compute_s) else 0.0


def zipf_load(num_experts: int, s: float, *, seed: int = 0) -> np.ndarray:
    """Expert popularity ``p[e] ~ 1/(rank_e + 1)**s`` over a seeded permutation; sums to 1."""
    if num_experts < 1:
        raise UsageError(f"need at least one expert, got {num_experts}")
    w = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s
    perm = np.random.default_rng(seed).permutation(num_experts)
    p = np.empty(num_experts)
    p[perm] = w
    return p / p.sum()


def _rank_share(owner: Sequence[int], load: np.ndarray, num_ranks: int) -> np.ndarray:
    owner_arr = np.asarray(owner, dtype=np.int64)
    if len(owner_arr) != len(load):
        raise UsageError(f"{len(owner_arr)} expert owners for {len(load)} expert loads")
    if len(owner_arr) and (owner_arr.min() < 0 or owner_arr.max() >= num_ranks):
        raise UsageError(f"expert owners must be ranks 0..{num_ranks - 1}")
    return np.bincount(owner_arr, weights=load, minlength=num_ranks)


def routing_traffic(owner: Sequence[int], load: Sequence[float], workload: MoEWorkload, num_ranks: int) -> np.ndarray:
    """``[W, W]`` int64 dispatch bytes: row ``i`` = what rank ``i`` sends to each expert's owner."""
    load = np.asarray(load, dtype=np.float64)
    load = load / load.sum()
    share = _rank_share(owner, load, num_ranks)
    per_copy = workload.model_dim * workload.wire_bytes
    row = np.rint(workload.tokens_per_rank * workload.k * share * per_copy).astype(np.int64)
    return np.tile(row, (num_ranks, 1))


def expert_flops(workload: MoEWorkload) -> float:
    """FLOPs of one token copy through one expert, forward (+ backward when asked)."""
    fwd = 4.0 * workload.model_dim * workload.hidden_dim
    return fwd * (3.0 if workload.backward else 1.0)


def simulate_moe_step(
    cluster: Cluster,
    owner: Sequence[int],
    load: Sequence[float],
    workload: MoEWorkload,
    *,
    tflops: Optional[Sequence[float]] = None,
    plan: str = "auto",
    params: Optional[CostParams] = None,
) -> StepResult:
    """Predict one MoE step for a placement (``owner``) under a routing (``load``).

    Args:
        cluster: the cluster (its ranks are the placement's ranks).
        owner: rank of each expert (``ExpertPlacement.owner``).
        load: each expert's share of token copies (any non-negative weights; normalised).
        workload: sizes and efficiency.
        tflops: each rank's dense TFLOPS (default: :func:`hetcomm.topo.compute.rank_speeds`).
        plan: all-to-all strategy for the planner (``flat``, ``hier``, ``multirail``, ``auto``).
        params: cost parameters of the links.
    """
    from hetcomm.sched.planner import plan_all_to_all
    from hetcomm.sched.simulate import simulate
    from hetcomm.topo.compute import rank_speeds

    W = cluster.num_ranks
    speeds = np.asarray(list(tflops) if tflops is not None else rank_speeds(cluster), dtype=np.float64)
    if len(speeds) != W or not (speeds > 0).all():
        raise UsageError(f"need {W} positive per-rank TFLOPS figures, got {list(speeds)}")
    load_arr = np.asarray(load, dtype=np.float64)
    if (load_arr < 0).any() or not load_arr.sum() > 0:
        raise UsageError("expert load must be non-negative with a positive sum")
    load_arr = load_arr / load_arr.sum()
    share = _rank_share(owner, load_arr, W)
    copies = W * workload.tokens_per_rank * workload.k * share
    compute = copies * expert_flops(workload) / (speeds * 1e12 * workload.efficiency)
    traffic = routing_traffic(owner, load_arr, workload, W)
    notes: List[str] = []
    a2a = 0.0
    for matrix in (traffic, traffic.T.copy()):  # dispatch, combine
        if matrix.sum() - np.trace(matrix) <= 0:
            continue
        p = plan_all_to_all(cluster, matrix, plan, params=params)
        a2a += simulate(p, cluster, params).time_s
    if workload.backward:
        a2a *= 2.0
        fwd = compute / 3.0
        step = a2a + float(fwd.max()) + float((compute - fwd).max())
    else:
        step = a2a + float(compute.max())
    step += workload.overhead_s
    return StepResult(
        time_s=step,
        alltoall_s=a2a,
        compute_s=compute,
        copies=copies,
        slowest_rank=int(np.argmax(compute)),
        plan=plan,
        notes=tuple(notes),
    )
