"""``hetcomm launch --health-only --probe-compute`` on a CPU machine whose device kinds are labels
(the demo's A100/H800/910B as four CPU processes): every rank's GEMM runs on the same CPU, so
judging it by the datasheet ratios called the H800, the fastest label, slow and exited 1. The
compute check judges against the measured CPU there: a healthy job passes (exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_probe_compute_on_cpu_labels_calls_no_healthy_rank_slow(tmp_path):
    work = tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HETCOMM_EMULATE_COMPUTE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "hetcomm.cli.main", "launch", "--health-only", "--probe-compute", "1",
         "--probe-size", "64K", "--probe-iters", "3", "--work-dir", str(work),
         # the network verdict is not under test: on a loaded machine a node's probes can take 3x
         # the median, and --health-only would exit 1 for that
         "--threshold", "1e6"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert "slow in its class" not in out, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert "compute not judged: the device kinds are labels" in out, out[-4000:]
    verdict = json.loads((work / "verdict.json").read_text())
    assert verdict["slow_in_class"] == [], verdict
    report = json.loads((work / "health-local.json").read_text())
    assert all(r["label_only"] for r in report["ranks"]) and all(r["gemm_s"] > 0 for r in report["ranks"])
