"""Planner benchmarks: simulated all-to-all times against the bound, and planning cost vs scale.

Run from the repository root::

    .venv/bin/python benchmarks/bench_sched.py            # everything, markdown on stdout
    .venv/bin/python benchmarks/bench_sched.py --quick    # smaller scale sweep, fewer repeats

Three tables:

1. *Targets*: ``configs/clusters/mixed-a100-h800-910b.yaml`` (80 ranks), 1 / 64 / 256 MiB per
   rank, uniform and Zipf(1.2): predicted time of every strategy, the lower bound, ratios, and
   ``auto``'s speed-up over ``flat``. Simulated numbers are deterministic (same inputs, same
   output), so they are quoted once; the device kinds are labels in a cluster file.
2. *Sensitivity*: the same for 1 and 64 MiB uniform with the per-message occupancy set to zero
   (a pure alpha-beta model), to show how much of ``flat``'s loss that assumption carries.
3. *Scale*: wall time of planning and of simulating, per strategy, for clusters scaled from the
   80-rank file (same 4:4:2 mix of A100 / H800 / 910B nodes, 8 devices and 8 ports each) up to
   1,024 ranks on 128 nodes. Medians of several runs on this machine, with its load average.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hetcomm.sched import CostParams, lower_bound, plan_all_to_all, simulate  # noqa: E402
from hetcomm.sched.traffic import make_traffic  # noqa: E402
from hetcomm.topo.cluster import Cluster, load_cluster, load_cluster_text  # noqa: E402

BIG = os.path.join(REPO, "configs", "clusters", "mixed-a100-h800-910b.yaml")
STRATEGIES = ("flat", "hier", "multirail", "auto")


def scaled_cluster_text(num_nodes: int) -> str:
    """The 80-rank cluster file with its node counts scaled to ``num_nodes`` (same mix)."""
    with open(BIG) as f:
        doc = yaml.safe_load(f)
    groups = doc["node_groups"]
    total = sum(g["count"] for g in groups)
    counts = [max(1, round(g["count"] * num_nodes / total)) for g in groups]
    counts[0] += num_nodes - sum(counts)
    for g, c in zip(groups, counts):
        g["count"] = c
    doc["name"] = f"mixed-scaled-{num_nodes}"
    doc["description"] = f"{BIG} scaled to {num_nodes} nodes"
    return yaml.safe_dump(doc, sort_keys=False)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {load[0]:.1f} (shared machine: wall times are noisy)"
    )


def ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def targets(cluster: Cluster, params: CostParams = None) -> List[str]:
    rows = [
        "| size/rank | traffic | bound (ms) | flat | hier | multirail | auto (picks) | auto / bound | flat / auto |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sizes = [1 << 20, 64 << 20, 256 << 20] if params is None else [1 << 20, 64 << 20]
    skews = ["uniform", "zipf:1.2"]
    for size in sizes:
        for skew in skews:
            T = make_traffic(cluster.num_ranks, size, skew, seed=0)
            bound = lower_bound(cluster, T, params).time_s
            got: Dict[str, float] = {}
            pick = ""
            for s in STRATEGIES:
                plan = plan_all_to_all(cluster, T, s, params=params)
                got[s] = simulate(plan, cluster, params).time_s
                if s == "auto":
                    pick = plan.strategy
            rows.append(
                f"| {size >> 20} MiB | {skew} | {ms(bound)} | "
                + " | ".join(f"{ms(got[s])} ({got[s] / bound:.2f}x)" for s in ("flat", "hier", "multirail"))
                + f" | {ms(got['auto'])} ({pick}) | {got['auto'] / bound:.2f} | {got['flat'] / got['auto']:.2f} |"
            )
            print(".", end="", file=sys.stderr, flush=True)
    return rows


def scale(node_counts: List[int], repeats: int) -> List[str]:
    rows = [
        "| ranks | nodes | strategy | chunks | messages | plan (ms, median) | simulate (ms, median) | plan+simulate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for nodes in node_counts:
        cluster = load_cluster_text(scaled_cluster_text(nodes), f"<scaled {nodes}>")
        T = make_traffic(cluster.num_ranks, 64 << 20, "uniform")
        plan_all_to_all(cluster, T, "hier")  # warm the per-cluster resource model
        reps = repeats if cluster.num_ranks <= 320 else max(3, repeats // 2)
        for s in STRATEGIES:
            tp, ts = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                plan = plan_all_to_all(cluster, T, s)
                t1 = time.perf_counter()
                sim = simulate(plan, cluster)
                t2 = time.perf_counter()
                tp.append(t1 - t0)
                ts.append(t2 - t1)
            p, q = statistics.median(tp), statistics.median(ts)
            rows.append(
                f"| {cluster.num_ranks} | {nodes} | {s}{' -> ' + plan.strategy if s == 'auto' else ''} | "
                f"{plan.num_transfers} | {sim.num_messages} | {p * 1e3:.1f} | {q * 1e3:.1f} | {(p + q) * 1e3:.1f} |"
            )
            print(".", end="", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="scale sweep to 320 ranks, 3 repeats")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    cluster = load_cluster(BIG)
    out = [
        f"Machine: {machine()}. Date: {datetime.date.today().isoformat()}.",
        "",
        "**Targets** (simulated, `mixed-a100-h800-910b.yaml`, 80 ranks; device kinds are labels; "
        "time in ms and ratio to the lower bound):",
        "",
    ]
    out += targets(cluster)
    out += [
        "",
        "**Sensitivity**: 1 and 64 MiB with the per-message occupancy (`overhead_us`) set to 0 for every "
        "class (pure alpha-beta):",
        "",
    ]
    zero = CostParams.make(overhead_us={c: 0.0 for c in (
        "NVLINK", "HCCS", "PCIE_PIX", "PCIE_PXB", "PCIE_PHB", "PCIE_NODE", "PCIE_SYS", "P2P", "SHM",
        "NET_IB_GDR", "NET_IB", "NET_ROCE_GDR", "NET_ROCE", "NET_EFA", "NET_SOCKET", "HOST_BRIDGE", "UNKNOWN")})
    out += targets(cluster, zero)
    nodes = [10, 20, 40] if args.quick else [10, 20, 40, 80, 128]
    repeats = 3 if args.quick else args.repeats
    out += [
        "",
        f"**Scale** (64 MiB per rank, uniform; wall time per call, median of {repeats} runs, 3 above 320 ranks):",
        "",
    ]
    out += scale(nodes, repeats)
    print(file=sys.stderr)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
