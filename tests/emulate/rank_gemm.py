"""Rank program for the compute-speed test: the same GEMM loop on two nodes, taking turns.

Usage: rank_gemm.py OUT_DIR ORDER ROUNDS ITERS, ORDER a comma list of ranks (``2,3``). Ranks not
in ORDER exit at once. The others take turns (turn files in OUT_DIR): rank ORDER[0] runs ITERS
GEMMs, then ORDER[1], ... for ROUNDS rounds, so no two measured loops compete for a core, and a
neighbour's load that comes and goes on a shared machine falls on every node alike.

numpy, not torch: importing torch costs seconds of CPU, which a rank throttled to a tenth of a
core would pay ten times over. Writes OUT_DIR/rank<N>.json: node, cpu cgroup (from
/proc/self/cgroup), the cores it may run on, and per round the wall and CPU seconds of ITERS 192x192 float64 GEMMs.
"""

import json
import os
import sys
import time

import numpy as np


def _wait_for(path: str, rank: int) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: {path} did not appear in 120 s")
        time.sleep(0.005)


def main() -> int:
    out_dir, order = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    rounds, iters = int(sys.argv[3]), int(sys.argv[4])
    rank = int(os.environ["RANK"])
    with open("/proc/self/cgroup") as f:
        # v1 "N:cpu:/path" (or "cpu,cpuacct"), v2 "0::/path"
        lines = [x.split(":", 2) for x in f.read().splitlines()]
    cgroup = next((x[2] for x in lines if "cpu" in x[1].split(",")), lines[-1][2])
    if rank not in order:
        return 0
    k = order.index(rank)
    rng = np.random.default_rng(rank)
    a, b = rng.standard_normal((192, 192)), rng.standard_normal((192, 192))
    for _ in range(3):
        a @ b
    walls, cpus = [], []
    for r in range(rounds):
        turn = r * len(order) + k
        if turn > 0:
            _wait_for(os.path.join(out_dir, f"turn{turn - 1}"), rank)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            a @ b
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        open(os.path.join(out_dir, f"turn{turn}"), "w").close()
    result = {
        "rank": rank,
        "node": os.environ["HETCOMM_EMULATE_NODE"],
        "cgroup": cgroup,
        "compute": os.environ.get("HETCOMM_EMULATE_COMPUTE"),
        "cores": sorted(os.sched_getaffinity(0)),
        "wall_s": walls,
        "cpu_s": cpus,
    }
    tmp = os.path.join(out_dir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
