"""``hetcomm discover`` under torchrun: 4 real ranks, each given a captured host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from hetcomm.topo.cluster import load_cluster
from hetcomm.topo.model import LinkClass
from tests.topo.test_discover import make_probe_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_discover_on_four_ranks_with_three_captured_hosts(tmp_path):
    template = make_probe_dirs(tmp_path)
    out = tmp_path / "observed.yaml"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, HETCOMM_PROBE_DIR=template, OMP_NUM_THREADS="1")
    env.pop("HETCOMM_CLUSTER", None)
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         "-m", "hetcomm.cli.main", "discover", "--json", "--out", str(out),
         "--cluster", os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")],
        capture_output=True, text=True, env=env, timeout=240, cwd=str(tmp_path),
    )
    # mixed-mini says NVLink between the two A100 ranks: an error finding, so exit 1 (rank 0)
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert doc["probes"] == {"a100-pcie-box": 1, "h800-box": 1, "ascend-box": 1}  # one probe per host
    assert [r["model"] for r in doc["ranks"]] == ["A100-PCIE-40GB", "A100-PCIE-40GB", "H800", "910B3"]
    assert [r["host"] for r in doc["ranks"]] == ["a100-pcie-box", "a100-pcie-box", "h800-box", "ascend-box"]
    assert doc["pair_classes"]["0-1"] == "PCIE_SYS"
    assert doc["pair_classes"]["2-3"] == doc["pair_classes"]["0-3"] == "HOST_BRIDGE"
    mismatch = [f for f in doc["findings"] if f["code"] == "cluster-mismatch" and "rank0-rank1" in f["subject"]]
    assert len(mismatch) == 1
    assert "node a100-0" in mismatch[0]["subject"]
    assert "NVLINK" in mismatch[0]["message"] and "PCIE_SYS" in mismatch[0]["message"]
    # the written file is a cluster YAML hetcomm loads
    written = load_cluster(str(out))
    assert written.num_ranks == 4 and written.nodes[1].group.fabric == LinkClass.NVLINK
    assert written.nodes[2].group.fabric == LinkClass.HCCS
