"""Health judged per device class on the compute-heterogeneous emulation (issue 20, item 4).

mixed-mini-halfspeed declares the 910B at half the others' TFLOPS; its cgroup quota is half of
theirs, so it computes at half speed and is healthy. Here the H800 gets the same half quota while
it declares full speed: a throttled H800. The launch health check's compute probe runs on real
ranks in their cgroups; :func:`hetcomm.ops.health_class.judge_by_class` must call the H800 slow
(naming its measurement and its class baseline) and never the 910B. Marked ``emulate`` (root,
iproute2, a cgroup cpu controller); the ratios hold on a loaded machine for the reasons given in
tests/emulate/test_compute.py (small quotas, high cgroup weights, many CFS periods per probe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetcomm.emulate.cgroup import find_cpu_hierarchy
from hetcomm.ops.health_class import judge_by_class
from hetcomm.topo.cluster import load_cluster
from hetcomm.topo.compute import rank_speeds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HALF = os.path.join(REPO, "configs", "clusters", "mixed-mini-halfspeed.yaml")

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.skipif(find_cpu_hierarchy() is None, reason="no cgroup cpu controller"),
]


@pytest.mark.timeout(300)
def test_a_healthy_910b_is_never_slow_and_a_throttled_h800_is(tmp_path):
    with open(HALF) as f:
        text = f.read()
    throttled = tmp_path / "throttled-h800.yaml"
    # The 910B's half quota matches its declared half speed; the H800's does not (a throttle).
    throttled.write_text(text.replace("name: mixed-mini-halfspeed", "name: throttled-h800")
                         + "  compute_scale: {h800: 0.5, ascend: 0.5}\n")
    out = tmp_path / "health.json"
    cmd = [sys.executable, "-m", "hetcomm.cli.main", "emulate", "run", "--compute", "--cpu-per-rank", "0.2",
           "--cluster", str(throttled), "--state-dir", str(tmp_path / "sd"), "--timeout", "240", "--",
           sys.executable, "-m", "hetcomm.ops.health", "--out", str(out), "--size", "4096", "--iters", "2",
           "--compute-s", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["ranks"]] == ["A100-SXM4-80GB", "A100-SXM4-80GB", "H800", "910B"]
    cluster = load_cluster(str(throttled))
    verdict = judge_by_class(report, rank_speeds(cluster))
    compute = [s for s in verdict.slow if s.probe == "compute"]
    assert [s.rank for s in compute] == [2], (verdict, report["ranks"])
    h800 = compute[0]
    assert h800.model == "H800" and h800.measured_s == report["ranks"][2]["gemm_s"] and h800.baseline_s > 0
    assert h800.measured_s > 1.4 * h800.baseline_s
    assert verdict.compute_factor[3] < 1.4  # the 910B: as fast as a 910B should be
    # Judged against the A100s' raw times, as a class-blind straggler test would, the 910B is out too.
    a100 = max(report["ranks"][0]["gemm_s"], report["ranks"][1]["gemm_s"])
    assert report["ranks"][3]["gemm_s"] > 1.4 * a100
