"""Simulator vs emulation: ``hetcomm simulate`` predictions against ``hetcomm bench alltoall``
measured on an emulated cluster (namespaces + veths shaped by tc), same cluster, same scale.

For every cluster: one emulation is brought up (``hetcomm emulate up``), then for each repeat
and each plan ``hetcomm emulate run --id ... -- hetcomm bench alltoall --plan P -J FILE`` runs
all sizes in one go; the plans alternate inside each repeat, so the machine's background load
hits them alike. The simulator gets a copy of the cluster YAML whose network rates (NIC ports
and the cross-vendor bridge) are multiplied by the same scale as the emulation's shapers;
intra-node fabrics stay nominal (in the emulation they are real shared memory, far faster than
any shaped link, so they matter only for tiny messages).

``--calibrate`` also measures each network link class of the cluster alone: a 2-node, 2-rank
sub-cluster per class (same vendor -> the NIC class, NVIDIA + Ascend -> ``HOST_BRIDGE``), run
in the emulation with ``hetcomm bench alltoall``, whose nccl-tests table is handed to
``hetcomm simulate --calibrate CLASS=FILE`` (alpha + bytes/rate fitted per class). The table
then shows the calibrated prediction next to the nominal one.

Reported per (cluster, plan, size): the predicted time, the median measured time over the
repeats (nccl-tests ``time``: the max over ranks of each rank's mean per iteration), the
error ``(measured - predicted) / predicted``, and the lower bound.

Needs root (the emulation). Usage::

    sudo .venv/bin/python benchmarks/bench_emulate.py --repeats 3 --calibrate --out /tmp/be.json
    sudo .venv/bin/python benchmarks/bench_emulate.py --from /tmp/be.json --calibrate   # re-predict
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

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


def _tail(stderr: str, n: int = 4) -> str:
    return " | ".join([x for x in stderr.splitlines() if "socket.cpp" not in x][-n:])


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


def simulate(cluster: str, size: int, plan: str, calibrations: List[str]) -> Dict[str, Any]:
    """``hetcomm simulate --json`` for one size and plan: predicted and bound seconds."""
    cmd = ["simulate", "--cluster", cluster, "--size", str(size), "--plans", plan, "--json"]
    for c in calibrations:
        cmd += ["--calibrate", c]
    proc = subprocess.run(
        HETCOMM + cmd, capture_output=True, text=True, timeout=300, cwd=REPO, check=False
    )
    if proc.returncode != 0:
        return {"error": _tail(proc.stderr, 1) or f"exit {proc.returncode}"}
    doc = json.loads(proc.stdout)
    p = doc["plans"][0]
    return {
        "predicted_s": p["time_s"],
        "bound_s": doc["lower_bound"]["time_s"],
        "bytes_by_class": p.get("bytes_by_class", {}),
        "busiest": p.get("busiest_resource", {}).get("name"),
    }


def _bench_cmd(sizes: List[int], iters: int, backend: str, timeout_s: float) -> List[str]:
    return [
        "hetcomm", "bench", "alltoall",
        "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", "4",
        "-n", str(iters), "-w", "1", "-c", "1",
        "--backend", backend, "-T", str(int(timeout_s)),
    ]  # fmt: skip


def measure(
    run_id: str,
    state_dir: str,
    plan: str,
    backend: str,
    sizes: List[int],
    iters: int,
    timeout_s: float,
    work: str,
) -> Dict[int, Optional[float]]:
    """One emulated ``hetcomm bench alltoall`` over all sizes; seconds per size (None = failed)."""
    out = os.path.join(work, f"bench-{run_id}-{plan}-{time.monotonic_ns()}.json")
    cmd = _bench_cmd(sizes, iters, backend, timeout_s) + ["-J", out]
    if backend == "hetcomm":
        cmd += ["--plan", plan]
    proc = subprocess.run(
        HETCOMM
        + ["emulate", "run", "--id", run_id, "--state-dir", state_dir]
        + ["--timeout", str(timeout_s), "--"]
        + cmd,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        cwd=REPO,
        check=False,
    )
    if not os.path.exists(out):
        _log(f"{plan}: run failed (exit {proc.returncode}), no results: {_tail(proc.stderr)}")
        return {s: None for s in sizes}
    if proc.returncode != 0:
        # Rank 0 wrote every row (checked, #wrong included) before some rank failed on its way
        # out; the timings stand, the failure is reported.
        _log(f"{plan}: results written, but the run ended with exit {proc.returncode}: "
             f"{_tail(proc.stderr)}")  # fmt: skip
    with open(out) as f:
        doc = json.load(f)
    got = {}
    for row in doc["rows"]:
        wrong = row["out_of_place"].get("wrong") or 0
        got[row["size"]] = row["out_of_place"]["time_us"] * 1e-6 if wrong == 0 else None
    return {s: got.get(s) for s in sizes}


def _pair_clusters(path: str) -> List[Tuple[str, Dict[str, Any]]]:
    """2-node, 1-rank-per-node sub-clusters of ``path``, one per network link class it has:
    two NVIDIA nodes (the NIC class) and an NVIDIA + an Ascend node (the host bridge)."""
    from hetcomm.topo.cluster import load_cluster_text

    with open(path) as f:
        doc = yaml.safe_load(f)
    groups = doc["node_groups"]
    vendor = {}
    for g in groups:
        text = yaml.safe_dump({"name": "probe", "node_groups": [dict(g, count=1)]})
        vendor[g["name"]] = load_cluster_text(text).groups[0].vendor
    nvidia = [g for g in groups if vendor[g["name"]] == "nvidia"]
    ascend = [g for g in groups if vendor[g["name"]] == "ascend"]
    pairs = []
    if len(nvidia) >= 2 or (nvidia and nvidia[0].get("count", 1) >= 2):
        a = nvidia[0]
        b = nvidia[1] if len(nvidia) >= 2 else nvidia[0]
        pairs.append(("same-vendor", [a, b]))
    if nvidia and ascend:
        pairs.append(("cross-vendor", [nvidia[0], ascend[0]]))
    out = []
    for label, (ga, gb) in pairs:
        sub = {k: v for k, v in doc.items() if k != "node_groups"}
        sub["name"] = f"{doc['name']}-{label}"
        one = [dict(ga, count=1), dict(gb, count=1, name=gb["name"] + ("2" if ga is gb else ""))]
        for g in one:
            g["device"] = dict(g["device"], count=1)
        sub["node_groups"] = one
        out.append((label, sub))
    return out


def calibrate(
    path: str, scale: float, sizes: List[int], iters: int, timeout_s: float, work: str,
    state_dir: str,
) -> List[str]:  # fmt: skip
    """Measure each network link class of ``path`` alone in the emulation; return
    ``CLASS=FILE`` arguments for ``hetcomm simulate --calibrate``."""
    from hetcomm.topo.cluster import load_cluster

    args = []
    for label, sub in _pair_clusters(path):
        sub_path = os.path.join(work, f"{sub['name']}.yaml")
        with open(sub_path, "w") as f:
            yaml.safe_dump(sub, f, sort_keys=False)
        cls = load_cluster(sub_path).link_class(0, 1).name
        table = os.path.join(work, f"calibrate-{sub['name']}.txt")
        with open(table, "w") as out:
            proc = subprocess.run(
                HETCOMM
                + ["emulate", "run", "--cluster", sub_path, "--scale", str(scale)]
                + ["--state-dir", state_dir, "--timeout", str(timeout_s), "--"]
                + _bench_cmd(sizes, iters, "hetcomm", timeout_s),
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout_s + 60,
                cwd=REPO,
                check=False,
            )
        rows = [x for x in open(table).read().splitlines() if x.strip() and x.strip()[0].isdigit()]
        if len(rows) < 2:
            _log(f"calibration {label} ({cls}) failed (exit {proc.returncode}): "
                 f"{_tail(proc.stderr)}")  # fmt: skip
            continue
        if proc.returncode != 0:
            _log(f"calibration {label}: table complete, run ended with exit {proc.returncode}")
        points = "; ".join(f"{int(r.split()[0]) >> 20} MiB {float(r.split()[5]) / 1e3:.0f} ms"
                           for r in rows)  # fmt: skip
        _log(f"calibration {label}: {cls} from {len(rows)} sizes: {points}")
        args.append(f"{cls}={table}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--clusters",
        default="configs/clusters/mixed-mini.yaml,configs/clusters/emulated-4node.yaml",
    )
    ap.add_argument("--plans", default="flat,hier,multirail")
    ap.add_argument("--sizes", default="1M,4M,16M", help="bytes per rank; a x4 geometric series")
    ap.add_argument("--repeats", type=int, default=3, help="bench runs per plan (median reported)")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per size inside one run")
    ap.add_argument("--scale", type=float, default=1e-3)
    ap.add_argument("--backend", default="hetcomm", choices=("hetcomm", "gloo"))
    ap.add_argument("--gloo-baseline", action="store_true", help="also measure plain gloo")
    ap.add_argument("--calibrate", action="store_true", help="also predict with per-class "
                    "parameters measured on 2-node sub-clusters (see module doc)")  # fmt: skip
    ap.add_argument("--from", dest="from_json", help="reuse the measurements of an earlier --out")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per emulated bench run")
    ap.add_argument("--state-dir", default=None, help="emulation state dir (default: a temp dir)")
    ap.add_argument("--out", default="/tmp/bench_emulate.json")
    args = ap.parse_args(argv)

    def _stop(signum, frame):  # SIGTERM tears the emulation down like Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    sizes = [_bytes(s) for s in args.sizes.split(",")]
    plans = [p for p in args.plans.split(",") if p]
    work = tempfile.mkdtemp(prefix="bench-emulate-")
    state_dir = args.state_dir or os.path.join(work, "state")
    previous: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    meta: Dict[str, Any] = {
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "scale": args.scale,
        "repeats": args.repeats,
        "iters": args.iters,
        "backend": args.backend,
        "time": "nccl-tests time: max over ranks of each rank's mean per iteration, out-of-place",
    }
    if args.from_json:
        with open(args.from_json) as f:
            old = json.load(f)
        meta = dict(old["meta"], recomputed=meta["date"])
        for r in old["results"]:
            previous[(r["cluster"], r["plan"], r["size_bytes"])] = r
    results: List[Dict[str, Any]] = []
    for cluster in args.clusters.split(","):
        cpath = os.path.join(REPO, cluster) if not os.path.isabs(cluster) else cluster
        name = os.path.basename(cpath).replace(".yaml", "")
        scaled = scaled_cluster(cpath, args.scale, work)
        variants = [(p, args.backend) for p in plans]
        variants += [("gloo", "gloo")] if args.gloo_baseline else []
        if args.from_json:
            variants = [(p, b) for p, b in variants if (name, p, sizes[0]) in previous]
            measured = {
                p: {s: previous[(name, p, s)]["runs_s"] for s in sizes} for p, _ in variants
            }
        else:
            measured = _measure_cluster(cpath, args, variants, sizes, state_dir, work)
        calibrations: List[str] = []
        if args.calibrate:
            calibrations = calibrate(cpath, args.scale, sizes, args.iters, args.timeout, work,
                                     state_dir)  # fmt: skip
            meta.setdefault("calibrations", {})[name] = [c.split("=")[0] for c in calibrations]
        for plan, _ in variants:
            for s in sizes:
                sim = simulate(scaled, s, "flat" if plan == "gloo" else plan, [])
                cal = simulate(scaled, s, "flat" if plan == "gloo" else plan, calibrations) \
                    if calibrations else {}  # fmt: skip
                runs = measured[plan][s]
                med = statistics.median(runs) if runs else None
                pred, pred_cal = sim.get("predicted_s"), cal.get("predicted_s")
                results.append({
                    "cluster": name, "plan": plan, "size_bytes": s,
                    "predicted_s": pred, "predicted_calibrated_s": pred_cal,
                    "bound_s": sim.get("bound_s"), "measured_s": med, "runs_s": runs,
                    "error": (med - pred) / pred if (med and pred) else None,
                    "error_calibrated": (med - pred_cal) / pred_cal if (med and pred_cal) else None,
                    "busiest": sim.get("busiest"), "simulate_error": sim.get("error"),
                })  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    _print_table(meta, results, args)
    _log(f"results in {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _measure_cluster(cpath, args, variants, sizes, state_dir, work) -> Dict[str, Dict[int, list]]:
    up = subprocess.run(
        HETCOMM + ["emulate", "up", "--cluster", cpath, "--scale", str(args.scale)]
        + ["--state-dir", state_dir, "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    if up.returncode != 0:
        raise SystemExit(f"emulate up failed for {cpath}: {up.stderr.strip()}")
    run_id = json.loads(up.stdout)["run_id"]
    _log(f"{cpath}: emulation hc{run_id} up")
    measured: Dict[str, Dict[int, list]] = {v[0]: {s: [] for s in sizes} for v in variants}
    try:
        for rep in range(args.repeats):
            for plan, backend in variants:
                t0 = time.monotonic()
                got = measure(run_id, state_dir, plan, backend, sizes, args.iters, args.timeout,
                              work)  # fmt: skip
                for s, v in got.items():
                    if v is not None:
                        measured[plan][s].append(v)
                done = ", ".join(
                    f"{s >> 20} MiB {v * 1e3:.0f} ms" if v else f"{s >> 20} MiB failed"
                    for s, v in got.items()
                )
                _log(f"{os.path.basename(cpath)} repeat {rep + 1}/{args.repeats} {plan}: {done} "
                     f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    finally:
        subprocess.run(
            HETCOMM + ["emulate", "down", "--id", run_id, "--state-dir", state_dir],
            capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        )  # fmt: skip
    return measured


def _print_table(meta: Dict[str, Any], results: List[Dict[str, Any]], args) -> None:
    def ms(x: Optional[float]) -> str:
        return f"{x * 1e3:.0f} ms" if x else "-"

    def pct(x: Optional[float]) -> str:
        return f"{x * 100:+.0f}%" if x is not None else "-"

    print(f"Machine: {meta['machine']}; date: {meta['date']}; scale {meta['scale']:g}; "
          f"backend {meta['backend']}; median of {meta['repeats']} runs x {meta['iters']} "
          f"iterations\n")  # fmt: skip
    cal = any(r.get("predicted_calibrated_s") for r in results)
    head = "| cluster | plan | size/rank | measured (median) | predicted | error |"
    head += " predicted (calibrated) | error |" if cal else ""
    head += " bound | busiest (simulator) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        line = (f"| {r['cluster']} | {r['plan']} | {r['size_bytes'] >> 20} MiB | "
                f"{ms(r['measured_s']) if r['measured_s'] else 'failed'} | "
                f"{ms(r['predicted_s']) if r['predicted_s'] else r['simulate_error']} | "
                f"{pct(r['error'])} |")  # fmt: skip
        if cal:
            line += f" {ms(r.get('predicted_calibrated_s'))} | {pct(r.get('error_calibrated'))} |"
        line += f" {ms(r['bound_s'])} | {r['busiest'] or '-'} |"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
