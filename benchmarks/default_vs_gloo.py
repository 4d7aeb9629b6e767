"""Default hetcomm rails vs plain gloo: ``hetcomm bench alltoall --nprocs 4`` side by side.

Issue 10.5's target: with the default rails (``rails=None``: same-host pairs on the rail the
communicator calibrated, :mod:`hetcomm.backends.calibrate`) the all-to-all is >= 0.95x plain gloo
at 16 MiB and 64 MiB per rank, best of two runs each, in the same run. The runs alternate
(gloo, hetcomm, gloo, hetcomm) so that a change in the machine's load hits both.

    .venv/bin/python benchmarks/default_vs_gloo.py [--iters 20] [--runs 2] [--sizes 16M,64M] [--recalibrate]

Prints a Markdown table (time per call = the slowest rank's mean, out of place; ratio =
t_gloo / t_hetcomm, > 1 means hetcomm is faster; the way the calibration chose for that size
class: ``cma`` single-copy reads, ``shm`` rings or ``gloo``), the target met or missed, the
calibration's measured times per size class and the load. ``--recalibrate`` makes the first
hetcomm run measure again (``HETCOMM_RECALIBRATE=1``) instead of reading the host's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _bench(backend: str, sizes: List[str], iters: int, nprocs: int, env: Optional[Dict[str, str]] = None) -> Dict[int, float]:
    """``size -> seconds`` per call (out of place) of one ``hetcomm bench`` run."""
    exe = os.path.join(os.path.dirname(sys.executable), "hetcomm")
    out: Dict[int, float] = {}
    for size in sizes:
        cmd = [exe, "bench", "alltoall", "--nprocs", str(nprocs), "-b", size, "-e", size, "-n", str(iters),
               "-w", "2", "-c", "0", "--backend", backend, "--json"]
        doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                                        env=dict(os.environ, **(env or {}))).stdout)
        env = None  # --recalibrate: the first run only
        for row in doc["rows"]:
            out[row["size"]] = row["out_of_place"]["time_us"] / 1e6
    return out


def _calibration(nprocs: int) -> Optional[dict]:
    """This host's cache entry for a group of ``nprocs`` local ranks (None: none yet)."""
    from hetcomm.backends.calibrate import CACHE_VERSION, cache_path

    try:
        with open(cache_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    want = f"unit={nprocs}|group={nprocs}|"
    hits = [v for k, v in data.items() if k.startswith(f"v={CACHE_VERSION}|") and want in k]
    return hits[0] if hits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--recalibrate", action="store_true", help="the first hetcomm run measures the rails again")
    args = ap.parse_args()
    from hetcomm.backends.calibrate import SameHostRails

    sizes = args.sizes.split(",")
    load0 = os.getloadavg()
    best: Dict[str, Dict[int, float]] = {"gloo": {}, "hetcomm": {}}
    recal = {"HETCOMM_RECALIBRATE": "1"} if args.recalibrate else None
    # The calibration is what the default rails run on: never the test suite's pin.
    unpinned = {"HETCOMM_SAME_HOST_RAIL": ""}
    for _ in range(args.runs):
        for backend in ("gloo", "hetcomm"):
            env = dict(unpinned, **(recal or {})) if backend == "hetcomm" else unpinned
            for size, t in _bench(backend, sizes, args.iters, args.nprocs, env).items():
                best[backend][size] = min(best[backend].get(size, float("inf")), t)
            if backend == "hetcomm":
                recal = None
    load1 = os.getloadavg()
    entry = _calibration(args.nprocs)
    classes = None
    if entry is not None:
        classes = SameHostRails(tuple((int(b), str(w)) for b, w in entry["classes"]))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load average {load0[0]:.1f} before / {load1[0]:.1f} after; best of {args.runs} runs x {args.iters} iterations")
    print("| bytes per rank | plain gloo (ms) | hetcomm default rails (ms) | ratio gloo/hetcomm | way chosen by calibration | target >= 0.95x |")
    print("|---|---|---|---|---|---|")
    for size in sorted(best["gloo"]):
        g, h = best["gloo"][size], best["hetcomm"][size]
        way = classes.rail_for(size) if classes is not None else "?"
        print(f"| {size >> 20} MiB | {g * 1e3:.1f} | {h * 1e3:.1f} | {g / h:.2f}x | {way} | {'met' if g / h >= 0.95 else 'MISSED'} |")
    if entry is None:
        print("# no calibration cache entry for this group shape (HETCOMM_SAME_HOST_RAIL pinned?)")
        return
    print(f"# calibration ({entry.get('when')}, load {entry.get('load', 0):.1f}, single-copy possible: "
          f"{entry.get('cma_possible')}): slowest rank's best wall time / CPU time of all ranks (median), per way; "
          f"decided by wall time on a quiet host, by CPU time on a busy one")
    print("| calibrated size per rank | shm rings (ms) | gloo (ms) | cma single-copy (ms) | decided by | chosen |")
    print("|---|---|---|---|---|---|")
    for row in entry.get("measured", []):
        cell = lambda k: f"{row[k + '_s'] * 1e3:.1f} / {row[k + '_cpu_s'] * 1e3:.1f}" if k + "_s" in row else "-"
        print(f"| {row['bytes_per_rank'] >> 20} MiB | {cell('shm')} | {cell('gloo')} | {cell('cma')} | "
              f"{row.get('by', 'wall')} | {row['rail']} |")


if __name__ == "__main__":
    main()
