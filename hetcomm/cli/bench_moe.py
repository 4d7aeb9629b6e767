"""``hetcomm bench moe --workload NAME``: the eight skew workloads under the per-rank time model.

For each workload (``hetcomm.moe.workloads``: W0-W7 after Megatron-LM's runtime-imbalance
benchmark, deterministic from ``(workload, seed, step)``) and the cluster's rank speeds (the
datasheet, ``hetcomm.topo.compute``, or ``--speeds``), models ``--moe-steps`` steps of per-rank
MoE time ``rows_r / speed_r`` (``hetcomm.moe.workload_sim``) under ``static`` placement,
``token-equal`` (MoonEP-style: every rank the same rows), ``hetcomm`` (speed-proportional
placement + the per-step time-proportional split, ``hetcomm.moe.token_split``) and the exact
``oracle`` (LP optimum for hetcomm's copies). Prints median max/mean of per-rank time, throughput
relative to static, and hetcomm's makespan over the oracle. ``benchmarks/moe_workloads.py`` adds
EPLB and the measured run on the emulated cluster.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List

__all__ = ["add_moe_args", "run_moe"]


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``hetcomm bench moe`` (the collective flags do not apply to it)."""
    g = p.add_argument_group("moe workloads (hetcomm bench moe)")
    g.add_argument("--workload", default="all", help="W0..W7 (or a name: balanced, hot_set, ...), or all (default)")
    g.add_argument("--moe-experts", type=int, default=32, help="experts (default %(default)s)")
    g.add_argument("--moe-tokens", type=int, default=1024, help="tokens per rank per step (default %(default)s)")
    g.add_argument("--moe-steps", type=int, default=32, help="modelled steps (default %(default)s)")
    g.add_argument("--moe-seed", type=int, default=0)
    g.add_argument("--replicate-top", type=int, default=8, help="hot experts copied on every rank (default %(default)s)")
    g.add_argument("--speeds", default=None, help="comma-separated rank speeds (default: the cluster's datasheet TFLOPS)")


def _speeds(args: argparse.Namespace) -> List[float]:
    from hetcomm.errors import ConfigError

    if args.speeds:
        try:
            speeds = [float(s) for s in args.speeds.split(",")]
        except ValueError:
            raise ConfigError(f"--speeds takes comma-separated numbers, got {args.speeds!r}", key="bench.speeds") from None
        if not speeds or min(speeds) <= 0:
            raise ConfigError(f"--speeds must be positive numbers, got {args.speeds!r}", key="bench.speeds")
        return speeds
    from hetcomm.cli.train import repo_path
    from hetcomm.topo.cluster import cluster_from_env, load_cluster
    from hetcomm.topo.compute import rank_speeds

    cluster = load_cluster(repo_path(args.cluster)) if getattr(args, "cluster", None) else cluster_from_env()
    if cluster is None:
        cluster = load_cluster(repo_path("configs/clusters/mixed-mini.yaml"))
    return [float(s) for s in rank_speeds(cluster)]


def run_moe(args: argparse.Namespace) -> int:
    from hetcomm.moe.workload_sim import simulate_workload
    from hetcomm.moe.workloads import WORKLOADS, WorkloadSpec, resolve_workload

    speeds = _speeds(args)
    names = list(WORKLOADS) if args.workload == "all" else [resolve_workload(args.workload)]
    spec = WorkloadSpec(args.moe_experts, len(speeds), args.moe_tokens, 2)
    rows: List[Dict[str, Any]] = []
    for w in names:
        r = simulate_workload(w, spec, speeds, steps=args.moe_steps, seed=args.moe_seed, replicate_top=args.replicate_top)
        p = r["policies"]
        rows.append({
            "workload": w,
            **{f"{k}_max_over_mean": p[k]["median_max_over_mean"] for k in ("static", "token-equal", "hetcomm")},
            "hetcomm_x_static": p["hetcomm"]["throughput"] / p["static"]["throughput"],
            "hetcomm_x_token_equal": p["hetcomm"]["throughput"] / p["token-equal"]["throughput"],
            "hetcomm_over_oracle": r["hetcomm_over_oracle_median"],
        })
    if getattr(args, "json", False):
        print(json.dumps({"speeds": speeds, "experts": args.moe_experts, "tokens": args.moe_tokens, "rows": rows}, indent=2))
        return 0
    print(f"# hetcomm bench moe: {args.moe_experts} experts, {len(speeds)} ranks (speeds {speeds}), "
          f"{args.moe_tokens} tokens/rank, top-2, {args.moe_steps} steps, per-rank time = rows / speed")
    print(f"# {'workload':<20} {'static':>7} {'tok-eq':>7} {'hetcomm':>7}   {'x static':>8} {'x tok-eq':>8}  {'/oracle':>7}")
    for r in rows:
        print(f"  {r['workload']:<20} {r['static_max_over_mean']:7.3f} {r['token-equal_max_over_mean']:7.3f} "
              f"{r['hetcomm_max_over_mean']:7.3f}   {r['hetcomm_x_static']:8.2f} {r['hetcomm_x_token_equal']:8.2f}  "
              f"{r['hetcomm_over_oracle']:7.4f}")
    print("# columns 2-4: median max/mean of per-rank MoE time; x: hetcomm's throughput over that policy")
    return 0
