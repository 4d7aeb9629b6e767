"""``hetcomm simulate --placement equal,strong,throughput``: placements judged on whole-step time.

Each placement spreads the experts over the cluster's ranks (``hetcomm.moe.placement``):

* ``equal``: the same number of experts on every rank;
* ``strong``: strong ranks (cluster ``strong: true``) hold twice the experts of weak ones;
* ``throughput``: experts in proportion to each rank's dense TFLOPS (``hetcomm.topo.compute``).

and :func:`hetcomm.sched.step.simulate_moe_step` predicts its step: the four all-to-alls of the
routing plus the slowest rank's expert compute in each phase.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from hetcomm.errors import UsageError

__all__ = ["PLACEMENTS", "placement_owner", "placement_report", "placement_text"]

PLACEMENTS = ("equal", "strong", "throughput")


def placement_owner(cluster, name: str, num_experts: int, strong_weight: float = 2.0) -> List[int]:
    """Owner rank of each expert under placement ``name`` (see the module docstring)."""
    from hetcomm.moe.placement import place_experts
    from hetcomm.topo.compute import rank_speeds

    W = cluster.num_ranks
    if name == "equal":
        weights: Optional[Sequence[float]] = None
    elif name == "strong":
        strong = set(cluster.strong_ranks)
        weights = [strong_weight if r in strong else 1.0 for r in range(W)]
    elif name == "throughput":
        weights = rank_speeds(cluster)
    else:
        raise UsageError(f"unknown placement {name!r}; choose from {', '.join(PLACEMENTS)}")
    return list(place_experts(num_experts, W, rank_weights=weights).owner)


def placement_report(
    cluster_path: str,
    placements: Sequence[str],
    *,
    num_experts: int,
    workload: Any,
    skew: str = "uniform",
    plan: str = "auto",
    seed: int = 0,
    params: Any = None,
) -> Dict[str, Any]:
    """The JSON document of ``hetcomm simulate --placement ... --json``."""
    import numpy as np

    from hetcomm.sched.step import simulate_moe_step, zipf_load
    from hetcomm.sched.traffic import parse_skew
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.topo.compute import rank_speeds

    cluster = load_cluster(cluster_path)
    kind, s = parse_skew(skew)
    load = np.full(num_experts, 1.0 / num_experts) if kind == "uniform" else zipf_load(num_experts, s, seed=seed)
    speeds = rank_speeds(cluster)
    rows = []
    for name in placements:
        owner = placement_owner(cluster, name, num_experts)
        res = simulate_moe_step(cluster, owner, load, workload, tflops=speeds, plan=plan, params=params)
        per_model: Dict[str, List[int]] = {}
        for r in range(cluster.num_ranks):
            per_model.setdefault(cluster.rank(r).model, []).append(owner.count(r))
        rows.append(
            {
                "placement": name,
                "step_s": res.time_s,
                "alltoall_s": res.alltoall_s,
                "compute_max_s": res.compute_max_s,
                "slowest_rank": res.slowest_rank,
                "slowest_model": cluster.rank(res.slowest_rank).model,
                "experts_per_rank": {m: sorted(set(v)) for m, v in per_model.items()},
            }
        )
    base = rows[0]["step_s"] if rows else 0.0
    for row in rows:
        row["speedup_vs_first"] = base / row["step_s"] if row["step_s"] > 0 else None
    return {
        "schema": "hetcomm.simulate.placement/1",
        "cluster": {"name": cluster.name, "path": cluster_path, "num_ranks": cluster.num_ranks},
        "workload": {
            "experts": num_experts,
            "tokens_per_rank": workload.tokens_per_rank,
            "k": workload.k,
            "model_dim": workload.model_dim,
            "hidden_dim": workload.hidden_dim,
            "wire_bytes": workload.wire_bytes,
            "efficiency": workload.efficiency,
            "skew": skew,
            "plan": plan,
        },
        "tflops_by_model": {cluster.rank(r).model: speeds[r] for r in range(cluster.num_ranks)},
        "placements": rows,
    }


def placement_text(doc: Dict[str, Any]) -> str:
    """The table ``hetcomm simulate --placement`` prints."""
    w = doc["workload"]
    lines = [
        f"MoE step on {doc['cluster']['name']} ({doc['cluster']['num_ranks']} ranks): {w['experts']} experts, "
        f"{w['tokens_per_rank']} tokens/rank, k={w['k']}, D={w['model_dim']}, F={w['hidden_dim']}, "
        f"{w['wire_bytes']} B/elem, skew {w['skew']}, plan {w['plan']}, GEMM efficiency {w['efficiency']:.0%}",
        "TFLOPS: " + ", ".join(f"{m} {t:g}" for m, t in doc["tflops_by_model"].items()),
        "",
        f"{'placement':<11} {'step':>10} {'all-to-all':>11} {'max compute':>12} {'slowest':>16}  {'vs first':>8}  experts/rank",
    ]
    for row in doc["placements"]:
        experts = ", ".join(f"{m} {'/'.join(map(str, v))}" for m, v in row["experts_per_rank"].items())
        lines.append(
            f"{row['placement']:<11} {row['step_s'] * 1e3:>8.2f}ms {row['alltoall_s'] * 1e3:>9.2f}ms "
            f"{row['compute_max_s'] * 1e3:>10.2f}ms {('rank ' + str(row['slowest_rank']) + ' ' + row['slowest_model'])[:16]:>16}  "
            f"{row['speedup_vs_first']:>7.2f}x  {experts}"
        )
    return "\n".join(lines)
