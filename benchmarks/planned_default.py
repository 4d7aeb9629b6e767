"""The default all-to-all path (``plan="adaptive"``) against the pinned direct path, on the emulated
mixed clusters, next to what the cost model predicted for the same call.

For each cluster one emulation is brought up (``hetcomm emulate up``); each repeat runs
``hetcomm bench alltoall --plan P`` once per variant (``adaptive`` = the default, ``direct``,
``hier``), all sizes in one go, variants alternating inside a repeat so that the shared machine's
load hits them alike (``bench_emulate.measure``: nccl-tests ``time``, the max over ranks of each
rank's mean per iteration, out of place). Per size: the median over repeats of each variant, the
measured ratio default/direct and hier/direct (median of the per-repeat ratios), and the ratio the
model predicted: the ranks' own decision (``hetcomm.backends.planpick.PlanChooser`` on the same
cluster, rates x the emulation scale, as the ranks see it) for the bench's uniform matrix, its
predicted time over the direct (``flat``) prediction. error = measured ratio / predicted - 1.

Needs root (the emulation). Usage::

    sudo .venv/bin/python benchmarks/planned_default.py --repeats 3 --out /tmp/planned_default.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_emulate as be  # noqa: E402  (sibling script: measure(), emulation up/down)

REPO = be.REPO
VARIANTS = ("adaptive", "direct", "hier")


def predicted(cluster_path: str, scale: float, size: int) -> Dict[str, Any]:
    """What the ranks' planner decides for the bench's uniform ``size``-byte-per-rank matrix, and
    the predicted seconds of direct (flat), hier and the choice."""
    import numpy as np

    from hetcomm.backends.planpick import PlanChooser, scaled_cluster
    from hetcomm.backends.rank_placement import Placement, RankPlace
    from hetcomm.sched.planner import plan_all_to_all
    from hetcomm.sched.simulate import simulate
    from hetcomm.topo.cluster import load_cluster

    c = load_cluster(cluster_path)
    n = c.num_ranks
    pl = Placement(tuple(RankPlace(i, i, "n", "h", 0, "cpu", "cpu", True) for i in range(n)), c)
    ch = PlanChooser(pl, "adaptive")
    ch.cluster = scaled_cluster(c, scale)  # as HETCOMM_EMULATE_SCALE makes the ranks see it
    ch._eligible = None
    T = np.full((n, n), size // n, np.int64)
    choice = ch.choose(T) if ch.eligible else None
    t_direct = simulate(plan_all_to_all(ch.cluster, T, strategy="flat"), ch.cluster).time_s
    t_hier = simulate(plan_all_to_all(ch.cluster, T, strategy="hier"), ch.cluster).time_s
    t_choice = t_direct if choice is None else simulate(plan_all_to_all(ch.cluster, T, strategy=choice), ch.cluster).time_s
    return {"choice": choice or "direct", "eligible": ch.eligible, "pred_direct_s": t_direct, "pred_hier_s": t_hier,
            "pred_choice_s": t_choice}


def _emulation_up(cpath: str, scale: float, state_dir: str) -> str:
    up = subprocess.run(
        be.HETCOMM + ["emulate", "up", "--cluster", cpath, "--scale", str(scale), "--state-dir", state_dir, "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )
    if up.returncode != 0:
        raise SystemExit(f"emulate up failed for {cpath}: {up.stderr.strip()}")
    return json.loads(up.stdout)["run_id"]


def _emulation_down(run_id: str, state_dir: str) -> None:
    subprocess.run(be.HETCOMM + ["emulate", "down", "--id", run_id, "--state-dir", state_dir],
                   capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default="configs/clusters/emulated-4node.yaml,configs/clusters/mixed-mini.yaml")
    ap.add_argument("--sizes", default="2K,32K,512K,8M", help="bytes per rank; a x16 geometric series")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of adaptive,direct,hier (direct is required)")
    ap.add_argument("--out", default="/tmp/planned_default.json")
    args = ap.parse_args(argv)

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    sizes = [be._bytes(s) for s in args.sizes.split(",")]
    variants = tuple(v for v in args.variants.split(",") if v)
    work = tempfile.mkdtemp(prefix="planned-default-")
    state_dir = os.path.join(work, "state")
    meta = {"machine": f"{platform.node()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "scale": args.scale, "repeats": args.repeats, "iters": args.iters, "load_before": _load()}
    results: List[Dict[str, Any]] = []
    for cluster in args.clusters.split(","):
        cpath = os.path.join(REPO, cluster)
        name = os.path.basename(cpath).replace(".yaml", "")
        run_id = _emulation_up(cpath, args.scale, state_dir)
        be._log(f"{name}: emulation hc{run_id} up")
        runs: Dict[str, List[Dict[int, Any]]] = {v: [] for v in VARIANTS}
        try:
            for rep in range(args.repeats):
                k = rep % len(variants)
                order = variants[k:] + variants[:k]
                for v in order:
                    # bench's sizes: min..max by x4 (-f 4); the x16 series is a subset
                    got = be.measure(run_id, state_dir, v, "hetcomm", sizes, args.iters, args.timeout, work)
                    runs[v].append(got)
                    be._log(f"{name} repeat {rep} {v}: " + ", ".join(f"{s >> 10}K {t * 1e3:.1f} ms" if t else f"{s >> 10}K -" for s, t in got.items()) + f" (load {_load()})")
        finally:
            _emulation_down(run_id, state_dir)
        for s in sizes:
            pred = predicted(cpath, args.scale, s)
            row: Dict[str, Any] = {"cluster": name, "size_bytes": s, **pred}
            for v in VARIANTS:
                vals = [r[s] for r in runs[v] if r.get(s)]
                row[f"{v}_runs_s"] = vals
                row[f"{v}_s"] = statistics.median(vals) if vals else None
            for v in ("adaptive", "hier"):
                ratios = [a[s] / d[s] for a, d in zip(runs[v], runs["direct"]) if a.get(s) and d.get(s)]
                row[f"{v}_ratio"] = statistics.median(ratios) if ratios else None
            row["predicted_ratio"] = pred["pred_choice_s"] / pred["pred_direct_s"]
            row["predicted_hier_ratio"] = pred["pred_hier_s"] / pred["pred_direct_s"]
            row["error"] = row["adaptive_ratio"] / row["predicted_ratio"] - 1 if row["adaptive_ratio"] else None
            row["hier_error"] = row["hier_ratio"] / row["predicted_hier_ratio"] - 1 if row["hier_ratio"] else None
            results.append(row)
    meta["load_after"] = _load()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"scale {args.scale}, {args.repeats} repeats x {args.iters} iterations, load {meta['load_before']} -> {meta['load_after']}")
    print("| cluster | size/rank | default chose | default (ms) | direct (ms) | measured default/direct | predicted | error | hier (ms) | measured hier/direct | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        def ms(x):
            return f"{x * 1e3:.1f}" if x else "-"

        def rt(x):
            return f"{x:.2f}" if x else "-"

        def er(x):
            return f"{x * 100:+.0f}%" if x is not None else "-"

        print(f"| {r['cluster']} | {r['size_bytes'] >> 10} KiB | {r['choice']} | {ms(r['adaptive_s'])} | {ms(r['direct_s'])} | "
              f"{rt(r['adaptive_ratio'])} | {rt(r['predicted_ratio'])} | {er(r['error'])} | {ms(r['hier_s'])} | "
              f"{rt(r['hier_ratio'])} | {rt(r['predicted_hier_ratio'])} | {er(r['hier_error'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
