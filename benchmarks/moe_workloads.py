"""The eight skew workloads W0-W7 (``hetcomm.moe.workloads``) under static placement, EPLB,
speed-blind exact token balancing and hetcomm's per-step time-proportional split (issue 19).

Two parts, side by side in one run:

* **model** (always): per step, per-rank time ``rows_r / speed_r`` with the clusters' speeds
  (``hetcomm.moe.workload_sim``): ``static``, ``EPLB`` (DeepSeek's published algorithm as in
  ``bench_balancer.py``: replicas by largest per-copy load + balanced packing, re-run every
  ``--eplb-every`` steps on the last ``2 x`` that many steps' loads, with as many redundant copies
  as hetcomm's replicas, rows split evenly over copies), ``token-equal`` (MoonEP-style: every rank
  exactly ``total / W`` rows), ``hetcomm`` (speed-proportional placement, the hot experts copied on
  every rank, the per-step split) and the ``oracle`` (LP optimum for hetcomm's copies).
* **emulated** (``--emulated``, as root): the real ``MoELayer`` forward + backward on the 4 ranks
  of ``hetcomm emulate up --compute`` (cpu cgroup quota per rank = its relative speed), for each
  workload: ``static`` (no copies), ``token-equal`` (``token_split`` with equal speeds: rows split
  equally among copies) and ``hetcomm`` (``token_split`` with the measured speed vector). The gate
  is the layer's own, fed inputs whose routing is the workload's (``wg`` = identity on the first
  ``E`` dims, the token's experts set there). Step time = barrier to end of backward, slowest
  rank; per-rank MoE time = each rank's forward expert seconds (the layer's ``expert_s``).

    .venv/bin/python benchmarks/moe_workloads.py                     # model only
    sudo .venv/bin/python benchmarks/moe_workloads.py --emulated     # + the measured runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

WORLD_SIZE = 4
CLUSTERS = {"half": "mixed-mini-halfspeed.yaml", "mixed": "mixed-mini.yaml"}
MEASURED = ("static", "token-equal", "hetcomm")


def cluster_path(name: str) -> str:
    return os.path.join(REPO, "configs", "clusters", CLUSTERS[name]) if name in CLUSTERS else name


def eplb_policy(E: int, W: int, redundant: int, every: int):
    """``f(step, counts) -> rows per rank`` for EPLB (re-planned every ``every`` steps on the last
    ``2 * every`` steps' global loads; static blocks until the first plan)."""
    import bench_balancer as bb

    history: List[List[int]] = []
    state: Dict[str, Any] = {"map": None}

    def f(step: int, counts) -> List[float]:
        total = [sum(c[e] for c in counts) for e in range(E)]
        if step % every == 0 and history:
            window = history[-2 * every:]
            load = [sum(h[e] for h in window) / len(window) for e in range(E)]
            state["map"] = bb.eplb_rebalance(load, E + redundant, W)
        history.append(total)
        rows = [0.0] * W
        m = state["map"]
        for e in range(E):
            rs = m.ranks_of(e) if m is not None else [e * W // E]
            for r in rs:
                rows[r] += total[e] / len(rs)
        return rows

    return f


def freeze_gate_to_routing(layer, num_experts: int, model_dim: int) -> None:
    """Make ``layer``'s gate pick, for an input from :func:`routed_input`, exactly the experts
    that input names: its weight is the identity on the first ``num_experts`` dimensions, frozen."""
    import torch

    with torch.no_grad():
        wg = torch.zeros(num_experts, model_dim)
        wg[:, :num_experts] = torch.eye(num_experts)
        layer.gate.wg.weight.copy_(wg)
    layer.gate.wg.weight.requires_grad_(False)


def routed_input(idx, num_experts: int, model_dim: int, step: int, rank: int):
    """``[T, model_dim]`` float32 tokens that a gate frozen by :func:`freeze_gate_to_routing` routes
    to ``idx`` (``[T, k]`` int64 experts): small noise, the first ``num_experts`` dimensions zero but
    8 at a token's first expert, 7 at its second, and so on."""
    import torch

    g = torch.Generator().manual_seed(step * 131 + rank)
    x = torch.randn(idx.size(0), model_dim, generator=g) * 0.1
    x[:, :num_experts] = 0.0
    for j in range(idx.size(1)):
        x[torch.arange(idx.size(0)), idx[:, j]] = 8.0 - j
    return x


def model_part(args) -> Dict[str, Any]:
    from hetcomm.moe.workload_sim import simulate_workload
    from hetcomm.moe.workloads import WORKLOADS, WorkloadSpec
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.topo.compute import rank_speeds

    spec = WorkloadSpec(args.experts, WORLD_SIZE, args.tokens, 2)
    N = args.replicate_top
    out: Dict[str, Any] = {}
    for name in args.clusters.split(","):
        speeds = [float(s) for s in rank_speeds(load_cluster(cluster_path(name)))]
        out[name] = {"speeds": speeds, "workloads": {}}
        for w in WORKLOADS:
            extra = {"EPLB": eplb_policy(args.experts, WORLD_SIZE, N * (WORLD_SIZE - 1), args.eplb_every)}
            out[name]["workloads"][w] = simulate_workload(
                w, spec, speeds, steps=args.model_steps, seed=args.seed, replicate_top=N, extra_policies=extra
            )
    return out


# -- one rank (inside the emulation) -----------------------------------------------------------


def _rank_main(args) -> int:
    import datetime as dt

    import torch
    import torch.distributed as dist

    from hetcomm.moe import MoELayer
    from hetcomm.moe.placement import place_experts
    from hetcomm.moe.workloads import WORKLOADS, WorkloadSpec, workload_routing
    from hetcomm.topo.cluster import load_cluster
    from hetcomm.topo.compute import rank_speeds

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=dt.timedelta(seconds=args.timeout))
    try:
        E, D, F, T = args.experts, args.model_dim, args.hidden_dim, args.tokens
        spec = WorkloadSpec(E, world, T, 2)
        prior = [float(s) for s in rank_speeds(load_cluster(args.cluster))]

        def make(policy: str) -> MoELayer:
            split = policy != "static"
            placement = place_experts(E, world, rank_weights=prior if policy == "hetcomm" else None)
            layer = MoELayer(
                D, E, k=2, dropless=True, calibrate=False, wire_dtype="fp32", placement=placement, cluster=None,
                replicate=split, token_split=split, replicate_top=args.replicate_top, replicate_every=args.replicate_every,
                replicate_alpha=0.5, speed_every=4 if policy == "hetcomm" else 0,
                expert=lambda d: torch.nn.Sequential(torch.nn.Linear(d, F), torch.nn.GELU(), torch.nn.Linear(F, d)),
            )
            freeze_gate_to_routing(layer, E, D)
            if policy == "token-equal":
                layer.speed.set_prior([1.0] * world)
            return layer

        res: Dict[str, Any] = {}
        for w in WORKLOADS:
            layers = {p: make(p) for p in MEASURED}
            res[w] = {p: {"step_s": [], "expert_s": []} for p in MEASURED}
            for step in range(args.warmup + args.steps):
                idx = workload_routing(w, spec, args.seed, step, rank)
                x = routed_input(idx, E, D, step, rank)
                order = list(MEASURED[step % 3:] + MEASURED[: step % 3])  # rotate who goes first
                for p in order:
                    layer = layers[p]
                    layer.zero_grad(set_to_none=True)
                    xi = x.clone().requires_grad_(True)
                    dist.barrier()
                    t0 = time.perf_counter()
                    layer(xi).square().mean().backward()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    es = torch.zeros(world)
                    es[rank] = layer.step_stats()["expert_s"]
                    dist.all_reduce(es)
                    if step >= args.warmup:
                        res[w][p]["step_s"].append(float(t))
                        res[w][p]["expert_s"].append(es.tolist())
            res[w]["speeds"] = list(layers["hetcomm"].speed.speeds)
        with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        return 0
    finally:
        dist.destroy_process_group()


def summarize_measured(run: Dict[str, Any]) -> Dict[str, Any]:
    from hetcomm.moe.token_split import max_over_mean

    out: Dict[str, Any] = {}
    for w, per in run.items():
        row: Dict[str, Any] = {"speeds": per["speeds"]}
        for p in MEASURED:
            row[p] = {
                "median_step_s": statistics.median(per[p]["step_s"]),
                "median_max_over_mean": statistics.median(max_over_mean(v) for v in per[p]["expert_s"]),
            }
        out[w] = row
    return out


# -- the table ---------------------------------------------------------------------------------


def render(model: Dict[str, Any], measured: Dict[str, Any], args, before, after, elapsed: float) -> str:
    lines = [f"moe_workloads: {args.experts} experts, {WORLD_SIZE} ranks, {args.tokens} tokens/rank, top-2, "
             f"{args.replicate_top} hot experts copied on every rank; {before['date']} UTC, load "
             f"{before['loadavg']} -> {after['loadavg']}, {elapsed:.0f} s", ""]
    for name, cl in model.items():
        lines.append(f"model, {name} (speeds {cl['speeds']}): median max/mean of per-rank time; hetcomm "
                     f"throughput over static / EPLB / token-equal; hetcomm makespan over oracle (median, max)")
        lines.append("| workload | static | EPLB | token-equal | hetcomm | x static | x EPLB | x token-equal | / oracle |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for w, r in cl["workloads"].items():
            p = r["policies"]
            h = p["hetcomm"]["throughput"]
            lines.append(
                f"| {w} | {p['static']['median_max_over_mean']:.3f} | {p['EPLB']['median_max_over_mean']:.3f} | "
                f"{p['token-equal']['median_max_over_mean']:.3f} | {p['hetcomm']['median_max_over_mean']:.3f} | "
                f"{h / p['static']['throughput']:.2f} | {h / p['EPLB']['throughput']:.2f} | "
                f"{h / p['token-equal']['throughput']:.2f} | {r['hetcomm_over_oracle_median']:.4f} / "
                f"{r['hetcomm_over_oracle_max']:.4f} |")
        lines.append("")
    for name, per in measured.items():
        lines.append(f"measured, {name} (emulated --compute): median step ms; median max/mean of per-rank forward "
                     f"expert time; hetcomm's speedup; agreed speeds (rows/s)")
        lines.append("| workload | static ms | token-equal ms | hetcomm ms | max/mean static / token-equal / hetcomm | x static | x token-equal |")
        lines.append("|---|---|---|---|---|---|---|")
        for w, r in per.items():
            s, t, h = (r[p]["median_step_s"] for p in MEASURED)
            mm = " / ".join(f"{r[p]['median_max_over_mean']:.2f}" for p in MEASURED)
            lines.append(f"| {w} | {s * 1e3:.0f} | {t * 1e3:.0f} | {h * 1e3:.0f} | {mm} | {s / h:.2f} | {t / h:.2f} |")
        lines.append(f"speeds measured (last workload): {[round(v) for v in per[list(per)[-1]]['speeds']]}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="half,mixed")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--replicate-top", type=int, default=8)
    ap.add_argument("--replicate-every", type=int, default=4, help="steps between hot-set choices (measured part)")
    ap.add_argument("--model-steps", type=int, default=64)
    ap.add_argument("--eplb-every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulated", action="store_true", help="also measure on the emulated clusters (root)")
    ap.add_argument("--skip-model", action="store_true", help="only the emulated part")
    ap.add_argument("--scale", type=float, default=1e-2, help="emulated link rate factor")
    ap.add_argument("--model-dim", type=int, default=256)
    ap.add_argument("--hidden-dim", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per workload")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        return _rank_main(args)

    from placement_speed import machine_info

    before = machine_info()
    t0 = time.monotonic()
    model = {} if args.skip_model else model_part(args)
    measured: Dict[str, Any] = {}
    if args.emulated:
        from emulated_runs import run_in_emulation

        for name in args.clusters.split(","):
            args.cluster, args.runs = cluster_path(name), 1
            rc, runs = run_in_emulation(
                "moe_workloads", __file__, args,
                ("experts", "tokens", "replicate_top", "replicate_every", "seed", "model_dim", "hidden_dim", "steps", "warmup",
                 "timeout", "cluster"),
                WORLD_SIZE, up_options=("--compute",), up_timeout=180,
            )
            if rc != 0:
                return rc
            measured[name] = summarize_measured(runs[0][0])
    after = machine_info()
    print(render(model, measured, args, before, after, time.monotonic() - t0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": before, "after": after, "args": vars(args), "model": model, "measured": measured}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
