"""Snapshot cost per step on the demo (`hetcomm train` defaults): with and without, side by side.

    python benchmarks/snapshot_cost.py [--steps 60] [--repeats 2]

Alternates `hetcomm train --snapshot-every 0` and `--snapshot-every 1` (4 ranks of mixed-mini,
every step into /dev/shm plus the peer copy), `--repeats` times each, and prints one JSON line:
the median step time of each (rank 0's `step_s` from the metrics, steps after the first 5), their
ratio, and the summary's own "snapshot cost" row (time the step spent in the snapshot hook:
capture, write, the wait for the previous peer transfer), with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hetcomm.ops.metrics import read_metrics  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    med = {0: [], 1: []}
    rows = []
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            for every in (0, 1) if i % 2 == 0 else (1, 0):
                m = os.path.join(d, f"m{every}-{i}.jsonl")
                out = subprocess.run([sys.executable, "-m", "hetcomm.cli.main", "train", "--steps", str(args.steps),
                                      "--snapshot-every", str(every), "--metrics", m], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
                med[every].append(statistics.median(s.step_s for s in read_metrics(m).steps[5:]))
                rows += [line.strip() for line in out.splitlines() if line.startswith("snapshot")]
                loads.append(os.getloadavg()[0])
    off, on = statistics.median(med[0]), statistics.median(med[1])
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "step_s_off": off, "step_s_on": on,
                      "ratio_on_off": on / off, "runs_off": med[0], "runs_on": med[1], "summary_rows": rows,
                      "load": [round(x, 1) for x in loads]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
