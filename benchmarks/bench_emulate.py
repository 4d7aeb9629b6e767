"""Simulator vs emulation: ``hetcomm simulate`` predictions against ``hetcomm bench alltoall``
measured on an emulated cluster (namespaces + veths shaped by tc), same cluster, same scale.

For every cluster: one emulation is brought up (``hetcomm emulate up``), then for each repeat
and each plan ``hetcomm emulate run --id ... -- hetcomm bench alltoall --plan P -J FILE`` runs
all sizes in one go; the plans alternate inside each repeat, so the machine's background load
hits them alike. The simulator gets a copy of the cluster YAML whose network rates (NIC ports
and the cross-vendor bridge) are multiplied by the same scale as the emulation's shapers;
intra-node fabrics stay nominal (in the emulation they are real shared memory, far faster than
any shaped link, so they matter only for tiny messages).

Reported per (cluster, plan, size): the predicted time, the median measured time over the
repeats (nccl-tests ``time``: the max over ranks of each rank's mean per iteration), the
error ``(measured - predicted) / predicted``, and the lower bound.

Needs root (the emulation). Usage::

    sudo .venv/bin/python benchmarks/bench_emulate.py --repeats 3 --out /tmp/bench_emulate.json
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
from typing import Any, Dict, List, Optional

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HETCOMM = [sys.executable, "-m", "hetcomm"]
SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _bytes(text: str) -> int:
    text = text.strip().upper()
    if text[-1] in SIZE_SUFFIX:
        return int(float(text[:-1]) * SIZE_SUFFIX[text[-1]])
    return int(text)


def _log(msg: str) -> None:
    print(f"bench_emulate: {msg}", file=sys.stderr, flush=True)


def scaled_cluster(path: str, scale: float, out_dir: str) -> str:
    """A copy of the cluster YAML with NIC and bridge rates multiplied by ``scale``."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    for g in doc["node_groups"]:
        for nic in g.get("nics") or []:
            nic["gbps"] = nic["gbps"] * scale
    cross = (doc.get("interconnect") or {}).get("cross_vendor")
    if cross is not None:
        cross["gbps"] = cross.get("gbps", 100.0) * scale
    doc["name"] = f"{doc['name']}-x{scale:g}"
    doc.pop("emulation", None)
    out = os.path.join(out_dir, os.path.basename(path).replace(".yaml", f"-x{scale:g}.yaml"))
    with open(out, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return out


def simulate(cluster: str, size: int, plan: str) -> Dict[str, Any]:
    """``hetcomm simulate --json`` for one size and plan: predicted and bound seconds."""
    proc = subprocess.run(
        HETCOMM + ["simulate", "--cluster", cluster, "--size", str(size), "--plans", plan, "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    doc = json.loads(proc.stdout)
    p = doc["plans"][0]
    return {"predicted_s": p["time_s"], "bound_s": doc["lower_bound"]["time_s"],
            "bytes_by_class": p.get("bytes_by_class", {}), "busiest": p.get("busiest_resource", {}).get("name")}


def measure(run_id: str, state_dir: str, plan: str, backend: str, sizes: List[int], iters: int,
            timeout_s: float, work: str) -> Dict[int, Optional[float]]:
    """One emulated ``hetcomm bench alltoall`` over all sizes; seconds per size (None = failed)."""
    out = os.path.join(work, f"bench-{run_id}-{plan}-{time.monotonic_ns()}.json")
    factor = 4
    cmd = ["hetcomm", "bench", "alltoall", "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", str(factor),
           "-n", str(iters), "-w", "1", "-c", "1", "--backend", backend, "-J", out, "-T", str(int(timeout_s))]
    if backend == "hetcomm":
        cmd += ["--plan", plan]
    proc = subprocess.run(
        HETCOMM + ["emulate", "run", "--id", run_id, "--state-dir", state_dir, "--timeout", str(timeout_s), "--"] + cmd,
        capture_output=True, text=True, timeout=timeout_s + 60, cwd=REPO,
    )
    if proc.returncode != 0 or not os.path.exists(out):
        tail = [x for x in proc.stderr.splitlines() if "socket.cpp" not in x][-4:]
        _log(f"{plan}: run failed (exit {proc.returncode}): " + " | ".join(tail))
        return {s: None for s in sizes}
    with open(out) as f:
        doc = json.load(f)
    got = {}
    for row in doc["rows"]:
        wrong = row["out_of_place"].get("wrong") or 0
        got[row["size"]] = row["out_of_place"]["time_us"] * 1e-6 if wrong == 0 else None
    return {s: got.get(s) for s in sizes}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default="configs/clusters/mixed-mini.yaml,configs/clusters/emulated-4node.yaml")
    ap.add_argument("--plans", default="flat,hier,multirail")
    ap.add_argument("--sizes", default="1M,4M,16M", help="bytes per rank; must be a x4 geometric series")
    ap.add_argument("--repeats", type=int, default=3, help="bench runs per plan (median reported)")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per size inside one run")
    ap.add_argument("--scale", type=float, default=1e-3)
    ap.add_argument("--backend", default="hetcomm", choices=("hetcomm", "gloo"))
    ap.add_argument("--gloo-baseline", action="store_true", help="also measure plain gloo (plan 'gloo')")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per emulated bench run")
    ap.add_argument("--state-dir", default=None, help="emulation state dir (default: a temp dir)")
    ap.add_argument("--out", default="/tmp/bench_emulate.json")
    args = ap.parse_args(argv)

    sizes = [_bytes(s) for s in args.sizes.split(",")]
    plans = [p for p in args.plans.split(",") if p]
    work = tempfile.mkdtemp(prefix="bench-emulate-")
    state_dir = args.state_dir or os.path.join(work, "state")
    results: List[Dict[str, Any]] = []
    meta = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "scale": args.scale, "repeats": args.repeats, "iters": args.iters, "backend": args.backend,
        "time": "nccl-tests time: max over ranks of each rank's mean per iteration, out-of-place",
    }
    for cluster in args.clusters.split(","):
        cpath = os.path.join(REPO, cluster) if not os.path.isabs(cluster) else cluster
        scaled = scaled_cluster(cpath, args.scale, work)
        up = subprocess.run(HETCOMM + ["emulate", "up", "--cluster", cpath, "--scale", str(args.scale),
                                       "--state-dir", state_dir, "--json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
        if up.returncode != 0:
            _log(f"emulate up failed for {cluster}: {up.stderr.strip()}")
            return 2
        run_id = json.loads(up.stdout)["run_id"]
        _log(f"{cluster}: emulation hc{run_id} up")
        try:
            variants = [(p, args.backend) for p in plans] + ([("gloo", "gloo")] if args.gloo_baseline else [])
            measured: Dict[str, Dict[int, List[float]]] = {v[0]: {s: [] for s in sizes} for v in variants}
            for rep in range(args.repeats):
                for plan, backend in variants:
                    t0 = time.monotonic()
                    got = measure(run_id, state_dir, plan, backend, sizes, args.iters, args.timeout, work)
                    for s, v in got.items():
                        if v is not None:
                            measured[plan][s].append(v)
                    _log(f"{cluster} repeat {rep + 1}/{args.repeats} {plan}: "
                         + ", ".join(f"{s >> 20} MiB {v * 1e3:.0f} ms" if v else f"{s >> 20} MiB failed" for s, v in got.items())
                         + f" ({time.monotonic() - t0:.0f} s)")
        finally:
            subprocess.run(HETCOMM + ["emulate", "down", "--id", run_id, "--state-dir", state_dir],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        for plan, _ in variants:
            for s in sizes:
                sim = simulate(scaled, s, "flat" if plan == "gloo" else plan)
                runs = measured[plan][s]
                med = statistics.median(runs) if runs else None
                pred = sim.get("predicted_s")
                results.append({
                    "cluster": os.path.basename(cpath).replace(".yaml", ""), "plan": plan, "size_bytes": s,
                    "predicted_s": pred, "bound_s": sim.get("bound_s"), "measured_s": med, "runs_s": runs,
                    "error": (med - pred) / pred if (med and pred) else None,
                    "busiest": sim.get("busiest"), "simulate_error": sim.get("error"),
                })
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"Machine: {meta['machine']}; date: {meta['date']}; scale {args.scale:g}; backend {args.backend}; "
          f"median of {args.repeats} runs x {args.iters} iterations\n")
    print("| cluster | plan | size/rank | predicted | measured (median) | error | bound | busiest (simulator) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        pred = f"{r['predicted_s'] * 1e3:.0f} ms" if r["predicted_s"] else (r["simulate_error"] or "-")
        meas = f"{r['measured_s'] * 1e3:.0f} ms" if r["measured_s"] else "failed"
        err = f"{r['error'] * 100:+.0f}%" if r["error"] is not None else "-"
        bound = f"{r['bound_s'] * 1e3:.0f} ms" if r["bound_s"] else "-"
        print(f"| {r['cluster']} | {r['plan']} | {r['size_bytes'] >> 20} MiB | {pred} | {meas} | {err} | {bound} | {r['busiest'] or '-'} |")
    _log(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
