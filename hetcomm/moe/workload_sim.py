"""Per-rank MoE time of the eight workloads under four policies, by the rows/speed model.

Used by ``hetcomm bench moe --workload`` and ``benchmarks/moe_workloads.py`` (which adds EPLB and
the measured run). One step's per-rank time is ``rows_r / speed_r``; the step's MoE time is the
slowest rank's. Policies:

- ``static``: experts in contiguous equal blocks, one copy each.
- ``token-equal`` (speed-blind exact token balancing, MoonEP-style): every rank computes exactly
  ``total / W`` rows each step (MoonEP's per-micro-batch redundant experts make that exact).
- ``hetcomm``: experts in proportion to speed (``place_experts(rank_weights=speeds)``), the
  ``replicate_top`` hottest experts by an EMA of past steps' global counts copied on every rank,
  and each step :func:`hetcomm.moe.token_split.plan_split` with the speeds: what ``MoELayer``
  with ``token_split=True`` does (the hot set is the past's, never the current step's).
- ``oracle``: :func:`hetcomm.moe.workloads.oracle_makespan` for hetcomm's placement and copies:
  the best any split could do this step.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence

from hetcomm.moe.placement import place_experts
from hetcomm.moe.token_split import max_over_mean, plan_split
from hetcomm.moe.workloads import WorkloadSpec, global_counts, oracle_makespan, resolve_workload

__all__ = ["simulate_workload"]


def simulate_workload(
    workload: str,
    spec: WorkloadSpec,
    speeds: Sequence[float],
    *,
    steps: int = 64,
    seed: int = 0,
    replicate_top: Optional[int] = None,
    ema_alpha: float = 0.5,
    extra_policies: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Model ``steps`` steps of ``workload``; returns per policy the median max/mean of per-rank
    time, the summed makespan, and for hetcomm the median ratio to the oracle.

    ``extra_policies``: name -> ``f(step, counts [W][E]) -> per-rank rows [W]`` (e.g. EPLB).
    """
    workload = resolve_workload(workload)
    E, W = spec.num_experts, spec.world_size
    N = replicate_top if replicate_top is not None else max(1, E // 4)
    static_owner = place_experts(E, W).owner
    het_owner = place_experts(E, W, rank_weights=list(speeds)).owner
    ema = [0.0] * E
    res: Dict[str, Dict[str, List[float]]] = {}

    def add(name: str, times: Sequence[float]) -> None:
        d = res.setdefault(name, {"mm": [], "makespan": []})
        d["mm"].append(max_over_mean(times))
        d["makespan"].append(max(times))

    ratio: List[float] = []
    tokens = 0
    for step in range(steps):
        counts = global_counts(workload, spec, seed, step)
        total = [sum(c[e] for c in counts) for e in range(E)]
        tokens += sum(total) // spec.k
        rows = [0.0] * W
        for e in range(E):
            rows[static_owner[e]] += total[e]
        add("static", [rows[r] / speeds[r] for r in range(W)])
        add("token-equal", [sum(total) / W / speeds[r] for r in range(W)])
        hot = sorted(range(E), key=lambda e: (-ema[e], e))[:N] if step else []
        holders = {e: tuple(range(W)) for e in hot}
        plan = plan_split(counts, het_owner, holders, speeds)
        add("hetcomm", plan.predicted)
        opt, _ = oracle_makespan(total, holders, het_owner, speeds)
        add("oracle", [opt] * W)  # makespan only; max/mean of the oracle is not defined per rank
        ratio.append(plan.makespan / opt if opt > 0 else 1.0)
        for name, f in (extra_policies or {}).items():
            r = f(step, counts)
            add(name, [r[i] / speeds[i] for i in range(W)])
        for e in range(E):
            ema[e] = ema_alpha * ema[e] + (1 - ema_alpha) * total[e]
    out: Dict[str, Any] = {"workload": workload, "steps": steps, "tokens": tokens, "policies": {}}
    for name, d in res.items():
        out["policies"][name] = {
            "median_max_over_mean": statistics.median(d["mm"]),
            "makespan_sum": sum(d["makespan"]),
            "throughput": tokens / sum(d["makespan"]) if sum(d["makespan"]) > 0 else float("inf"),
        }
    out["hetcomm_over_oracle_median"] = statistics.median(ratio)
    out["hetcomm_over_oracle_max"] = max(ratio)
    return out
