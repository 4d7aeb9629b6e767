"""The launch health check judges each pair against its *declared* link class: a 910B node that
the cluster YAML reaches only over a slower cross-vendor bridge is not slow for being behind it
(compared class-blind with the median, ``--eject`` left that healthy node out of the job).

Real probes over the emulated links (``hetcomm emulate run``: every link shaped to its declared
rate, the bridge 10x slower than the RoCE ports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hetcomm.ops.health import judge

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")

pytestmark = [pytest.mark.emulate]


@pytest.mark.timeout(300)
def test_a_910b_behind_a_declared_slow_bridge_is_not_slow(tmp_path):
    with open(MINI) as f:
        text = f.read()
    assert "cross_vendor: {class: HOST_BRIDGE, gbps: 100," in text
    cluster = tmp_path / "slow-bridge.yaml"
    # The bridge declared at 20 Gb/s beside 200 Gb/s RoCE: the 910B's pairs take ~10x longer by design.
    bridge = "cross_vendor: {class: HOST_BRIDGE, gbps: "
    cluster.write_text(text.replace("name: mixed-mini\n", "name: slow-bridge\n")
                       .replace(bridge + "100,", bridge + "20,"))
    out = tmp_path / "health.json"
    cmd = [sys.executable, "-m", "hetcomm.cli.main", "emulate", "run", "--cluster", str(cluster),
           "--state-dir", str(tmp_path / "sd"), "--timeout", "240", "--",
           sys.executable, "-m", "hetcomm.ops.health", "--out", str(out), "--size", "262144", "--iters", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert [r["node"] for r in report["ranks"]] == ["a100-0", "a100-0", "h800-0", "ascend-0"]
    verdict = judge(report)
    assert verdict.slow_nodes == [] and verdict.slow_ranks == [], verdict
    assert verdict.by_class, verdict  # judged against each pair's declared link class
    # The probes did see the bridge as slow in seconds (the premise): the 910B's best pair is
    # several times the others', which a class-blind verdict took for a slow node.
    nodes = [r["node"] for r in report["ranks"]]
    m = report["pair_p50"]
    raw_best = [min(v for p, v in enumerate(row) if v is not None and nodes[p] != nodes[r]) for r, row in enumerate(m)]
    assert raw_best[3] > 3 * sorted(raw_best)[1], raw_best
