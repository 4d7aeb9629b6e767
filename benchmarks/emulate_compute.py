"""Emulated compute speed: the same GEMM on every emulated node, with and without ``--compute``.

One emulation of the cluster is brought up with ``--compute`` (a cpu cgroup per rank, quota =
the node's relative speed x cpu_per_rank) and one without; each repeat runs the GEMM worker in
both (alternating, so the machine's background load hits them alike). Inside a run the measured
ranks take turns (rank files in a scratch directory), ``--rounds`` rounds of ``--iters`` GEMMs
each, so no two measured loops compete for a core.

Reported per node: the configured relative speed (device table / ``device.tflops`` /
``emulation.compute_scale``), GEMMs per second with and without compute emulation (median over
repeats of the total over rounds), and the time ratio to the fastest measured node, which should
equal the inverse of the configured speed ratio.

Needs root. Usage::

    sudo .venv/bin/python benchmarks/emulate_compute.py --repeats 3
    sudo .venv/bin/python benchmarks/emulate_compute.py --lib numpy \
        --cluster configs/clusters/mixed-mini.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HETCOMM = [sys.executable, "-m", "hetcomm"]


def _log(msg: str) -> None:
    print(f"emulate_compute: {msg}", file=sys.stderr, flush=True)


def worker(out_dir: str, order: List[int], rounds: int, iters: int, size: int, lib: str) -> int:
    """One rank: ``rounds`` turns of ``iters`` size x size GEMMs, in turn with ``order``."""
    rank = int(os.environ["RANK"])
    if rank not in order:
        return 0
    if lib == "torch":
        import torch

        torch.set_num_threads(1)
        a, b = torch.randn(size, size), torch.randn(size, size)

        def gemm():
            torch.mm(a, b)
    else:
        import numpy as np

        rng = np.random.default_rng(rank)
        a, b = (
            rng.standard_normal((size, size), dtype=np.float32),
            rng.standard_normal((size, size), dtype=np.float32),
        )

        def gemm():
            a @ b

    for _ in range(3):
        gemm()
    k = order.index(rank)
    walls, cpus = [], []
    for r in range(rounds):
        turn = r * len(order) + k
        if turn > 0:
            prev = os.path.join(out_dir, f"turn{turn - 1}")
            deadline = time.monotonic() + 300
            while not os.path.exists(prev):
                if time.monotonic() > deadline:
                    raise SystemExit(f"rank {rank}: {prev} did not appear in 300 s")
                time.sleep(0.005)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            gemm()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        open(os.path.join(out_dir, f"turn{turn}"), "w").close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "node": os.environ["HETCOMM_EMULATE_NODE"],
                "wall_s": walls,
                "cpu_s": cpus,
            },
            f,
        )
    return 0


def _up(cluster: str, state_dir: str, compute: bool, cpu_per_rank: float) -> Dict:
    argv = HETCOMM + ["emulate", "up", "--cluster", cluster, "--state-dir", state_dir, "--json"]
    argv += ["--compute", "--cpu-per-rank", str(cpu_per_rank)] if compute else ["--no-compute"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"emulate up failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _run(rid: str, state_dir: str, args, order: List[int]) -> Dict[int, Dict]:
    with tempfile.TemporaryDirectory(prefix="hetcomm-emucompute-") as out:
        argv = HETCOMM + [
            "emulate", "run", "--id", rid, "--state-dir", state_dir, "--timeout", "900", "--",
            sys.executable, os.path.abspath(__file__), "--worker", out, ",".join(map(str, order)),
            str(args.rounds), str(args.iters), str(args.size), args.lib,
        ]  # fmt: skip
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"emulate run failed: {proc.stderr[-3000:]}")
        return {r: json.load(open(os.path.join(out, f"rank{r}.json"))) for r in order}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        out, order, rounds, iters, size, lib = sys.argv[2:8]
        return worker(
            out, [int(x) for x in order.split(",")], int(rounds), int(iters), int(size), lib
        )
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cluster", default=os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml")
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--iters",
        type=int,
        default=800,
        help="GEMMs per round (a round should span >= 25 CFS periods of 20 ms)",
    )
    p.add_argument("--size", type=int, default=256, help="square GEMM dimension (float32)")
    p.add_argument("--lib", choices=("torch", "numpy"), default="torch")
    p.add_argument(
        "--cpu-per-rank", type=float, default=0.5, help="CPUs of a speed-1 rank (default 0.5)"
    )
    args = p.parse_args()
    from hetcomm.emulate.spec import node_compute_scale, settings_from_cluster
    from hetcomm.topo.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    settings = settings_from_cluster(cluster, compute=True, cpu_per_rank=args.cpu_per_rank)
    speed = {n.name: node_compute_scale(cluster, settings, n) for n in cluster.nodes}
    # One measured rank per node: its first.
    order = [n.first_rank for n in cluster.nodes]
    node_of = {n.first_rank: n.name for n in cluster.nodes}
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="hetcomm-emucompute-st-") as sd:
        states = {}
        try:
            for variant, compute in (("on", True), ("off", False)):
                states[variant] = _up(args.cluster, sd, compute, args.cpu_per_rank)
            results: Dict[str, List[Dict[int, Dict]]] = {"on": [], "off": []}
            for rep in range(args.repeats):
                for variant in ("on", "off"):
                    results[variant].append(_run(states[variant]["run_id"], sd, args, order))
                    _log(f"repeat {rep + 1}/{args.repeats} compute {variant} done")
        finally:
            subprocess.run(HETCOMM + ["emulate", "down", "--state-dir", sd], cwd=REPO, check=False)
    load1 = os.getloadavg()
    gemm_s = {
        v: {
            r: statistics.median(
                args.rounds * args.iters / sum(res[r]["wall_s"]) for res in results[v]
            )
            for r in order
        }
        for v in results
    }
    ratios = {
        r: statistics.median(
            sum(res[r]["wall_s"]) / min(sum(res[q]["wall_s"]) for q in order)
            for res in results["on"]
        )
        for r in order
    }
    top = max(speed.values())
    print(
        f"\n{os.path.basename(args.cluster)}, {args.lib} {args.size}x{args.size} float32 GEMM, "
        f"{args.rounds} rounds x {args.iters} per node in turns, "
        f"cpu_per_rank {args.cpu_per_rank:g}, "
        f"{args.repeats} repeats; {platform.node()}, {os.cpu_count()} CPUs, {started}; "
        f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end\n"
    )
    print(
        "| node (rank) | configured speed | GEMM/s, --no-compute | GEMM/s, --compute "
        "| time / fastest, measured | expected |"
    )
    print("|---|---|---|---|---|---|")
    for r in order:
        n = node_of[r]
        print(
            f"| {n} ({r}) | {speed[n]:.3g} | {gemm_s['off'][r]:.1f} | {gemm_s['on'][r]:.1f} | "
            f"{ratios[r]:.2f} | {top / speed[n]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
