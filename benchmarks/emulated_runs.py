"""Run a benchmark's worker on every rank of an emulated cluster, several times, and collect each
rank's JSON result: the driver that ``moe_emulated.py`` and ``placement_speed.py`` share.

``hetcomm emulate up`` once, ``hetcomm emulate run`` per run (the worker is this benchmark's own
script with ``--worker-out DIR``, writing ``DIR/rank<r>.json``), ``hetcomm emulate down`` and the
temporary directory removed whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emulate(*argv: str, timeout: float, capture: bool = False) -> subprocess.CompletedProcess:
    """``python -m hetcomm emulate ARGV`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "hetcomm", "emulate", *argv],
        cwd=REPO, timeout=timeout, check=False, stdout=subprocess.PIPE if capture else None, text=True,
    )


def run_in_emulation(
    name: str,
    script: str,
    args: Any,
    worker_options: Sequence[str],
    world_size: int,
    up_options: Sequence[str] = (),
    up_timeout: float = 120,
) -> Tuple[int, List[Dict[int, Any]]]:
    """``(exit code, runs)``: ``args.runs`` runs of ``script --worker-out DIR`` on the cluster
    ``args.cluster`` at ``args.scale``, each run ``{rank: that rank's JSON}``.

    ``worker_options`` are attribute names of ``args`` passed on as ``--name-with-dashes VALUE``
    (``args.timeout`` bounds each run); ``up_options`` go to ``emulate up`` (e.g. ``--compute``).
    A non-zero exit code is that of the step that failed, already reported on stderr.
    """
    up = emulate("up", "--cluster", args.cluster, "--scale", f"{args.scale:g}", *up_options, "--json",
                 timeout=up_timeout, capture=True)
    if up.returncode != 0:
        print(f"{name}: 'hetcomm emulate up' failed (exit {up.returncode})", file=sys.stderr)
        return up.returncode, []
    run_id = "hc" + json.loads(up.stdout)["run_id"]
    runs: List[Dict[int, Any]] = []
    tmp = tempfile.mkdtemp(prefix=f"{name}.")
    try:
        for i in range(args.runs):
            out = os.path.join(tmp, f"run{i}")
            os.makedirs(out)
            print(f"{name}: run {i + 1}/{args.runs} in {run_id}", file=sys.stderr, flush=True)
            worker = [sys.executable, os.path.abspath(script), "--worker-out", out]
            for opt in worker_options:
                worker += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
            rc = emulate("run", "--id", run_id, "--timeout", str(args.timeout), "--", *worker,
                         timeout=args.timeout + 60).returncode
            if rc != 0:
                print(f"{name}: run {i + 1} failed (exit {rc}); see the rank log above", file=sys.stderr)
                return rc, runs
            run = {}
            for r in range(world_size):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    run[r] = json.load(f)
            runs.append(run)
    finally:
        emulate("down", "--id", run_id, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0, runs
