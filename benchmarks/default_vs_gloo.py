"""Default hetcomm rails vs plain gloo: ``hetcomm bench alltoall --nprocs 4`` side by side.

Issue 10.5's target: with the default rails (``rails=None``: same-host pairs on the rail the
communicator calibrated, :mod:`hetcomm.backends.calibrate`) the all-to-all is >= 0.95x plain gloo
at 16 MiB and 64 MiB per rank, best of two runs each, in the same run. The runs alternate
(gloo, hetcomm, gloo, hetcomm) so that a change in the machine's load hits both.

    .venv/bin/python benchmarks/default_vs_gloo.py [--iters 10] [--runs 2] [--sizes 16M,64M]

Prints a Markdown table (time per call = the slowest rank's mean, out of place; ratio =
t_gloo / t_hetcomm, > 1 means hetcomm is faster), the calibration cache entry and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _bench(backend: str, sizes: List[str], iters: int, nprocs: int) -> Dict[int, float]:
    """``size -> seconds`` per call (out of place) of one ``hetcomm bench`` run."""
    exe = os.path.join(os.path.dirname(sys.executable), "hetcomm")
    out: Dict[int, float] = {}
    for size in sizes:
        cmd = [exe, "bench", "alltoall", "--nprocs", str(nprocs), "-b", size, "-e", size, "-n", str(iters),
               "-w", "2", "-c", "0", "--backend", backend, "--json"]
        doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
        for row in doc["rows"]:
            out[row["size"]] = row["out_of_place"]["time_us"] / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--nprocs", type=int, default=4)
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    load0 = os.getloadavg()
    best: Dict[str, Dict[int, float]] = {"gloo": {}, "hetcomm": {}}
    for _ in range(args.runs):
        for backend in ("gloo", "hetcomm"):
            for size, t in _bench(backend, sizes, args.iters, args.nprocs).items():
                best[backend][size] = min(best[backend].get(size, float("inf")), t)
    load1 = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load average {load0[0]:.1f} before / {load1[0]:.1f} after; best of {args.runs} runs x {args.iters} iterations")
    print("| bytes per rank | plain gloo (ms) | hetcomm default rails (ms) | ratio gloo/hetcomm |")
    print("|---|---|---|---|")
    for size in sorted(best["gloo"]):
        g, h = best["gloo"][size], best["hetcomm"][size]
        print(f"| {size >> 20} MiB | {g * 1e3:.1f} | {h * 1e3:.1f} | {g / h:.2f}x |")
    from hetcomm.backends.calibrate import cache_path

    try:
        with open(cache_path()) as f:
            print("# calibration cache:", json.dumps(json.load(f), sort_keys=True))
    except OSError:
        print("# no calibration cache")


if __name__ == "__main__":
    main()
