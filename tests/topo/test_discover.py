"""Cluster assembly from per-host probes (pure functions; the 4-rank run is in tests/cli)."""

from __future__ import annotations

import os
import shutil
from datetime import timedelta

import pytest
import torch.distributed as dist

from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster, load_cluster_text
from hetcomm.topo.discover import (
    assemble_cluster,
    compare_with_cluster,
    discover_cluster,
    host_record,
    probe_host,
    topology_from_record,
)
from hetcomm.topo.model import LinkClass
from hetcomm.topo.parse import parse_files

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")

#: Three captured hosts: a PCIe A100 box (2 GPUs, NVLink inactive), an H800 SXM box (NV8, 11
#: mlx5 ports), a 910B3 box (HCCS mesh, hccn_tool NIC).
HOSTS = {
    "a100-pcie-box": ["nvsmi_a100_pcie_x2_nvlink_inactive.txt"],
    "h800-box": ["envreport_sglang_h800_nv8_11nic_kvm.txt"],
    "ascend-box": ["npusmi_info_910b3_x8.txt", "npusmi_topo_910b3_x8_hccs.txt", "hccn_tool_910b_status_lldp_ip_route_ping.txt"],
}
#: mixed-mini's rank layout: 2 A100 ranks on one node, then H800, then 910B.
LAYOUT = ["a100-pcie-box", "a100-pcie-box", "h800-box", "ascend-box"]


def make_probe_dirs(root) -> str:
    """One directory of real captures per host, plus ``rank<r>`` links; returns the template."""
    for host, files in HOSTS.items():
        d = os.path.join(root, "hosts", host)
        os.makedirs(d)
        for f in files:
            shutil.copy(os.path.join(FIXTURES, f), d)
        with open(os.path.join(d, "hostname"), "w") as fh:
            fh.write(host + "\n")
    for r, host in enumerate(LAYOUT):
        os.symlink(os.path.join(root, "hosts", host), os.path.join(root, f"rank{r}"))
    return os.path.join(str(root), "rank{rank}")


@pytest.fixture(scope="module")
def hosts():
    return {h: parse_files([os.path.join(FIXTURES, f) for f in files]) for h, files in HOSTS.items()}


def test_three_captured_hosts_assemble(hosts):
    found = assemble_cluster([{"host": h} for h in LAYOUT], hosts)
    c = found.cluster
    assert [n.name for n in c.nodes] == ["a100-pcie-box-0", "h800-box-0", "ascend-box-0"]
    assert [c.rank(r).model for r in range(4)] == ["A100-PCIE-40GB", "A100-PCIE-40GB", "H800", "910B3"]
    assert found.rank_devices == ("GPU0", "GPU1", "GPU0", "NPU0")
    # inside a node from the probe; between nodes from the NICs; across vendors the bridge
    assert found.pair_class(0, 1) == LinkClass.PCIE_SYS  # no NVLink, no matrix: the worse PCIe
    # between nodes: the H800's RoCE ports (the A100 box's captures list no port; Cluster
    # meets a one-sided NIC set at that side's class)
    assert found.pair_class(0, 2) == LinkClass.NET_ROCE
    assert found.pair_class(2, 3) == LinkClass.HOST_BRIDGE
    assert c.nodes[1].group.fabric == LinkClass.NVLINK
    assert c.nodes[2].group.fabric == LinkClass.HCCS
    # rails per node: 11 mlx5 ports (layer unknown -> RoCE, said in a note); 910B NPU RoCE ports
    h800_nics = c.nodes[1].group.nics
    assert sum(s.count for s in h800_nics) == 11 and {s.link_class for s in h800_nics} == {LinkClass.NET_ROCE}
    assert any("link layer unknown" in n for n in found.notes)
    assert {s.gbps for s in c.nodes[2].group.nics} == {200.0}
    # strength from throughput: only the H800 (989 TFLOPS) beats half the fastest
    assert c.strong_ranks == [2]
    # the written YAML loads back to the same classes
    again = load_cluster_text(found.to_yaml())
    assert [again.link_class(a, b) for a, b in ((0, 1), (0, 2), (2, 3))] == [
        LinkClass.PCIE_SYS, LinkClass.NET_ROCE, LinkClass.HOST_BRIDGE
    ]


def test_yaml_saying_nvlink_where_probe_sees_pcie_is_a_finding(hosts):
    found = assemble_cluster([{"host": h} for h in LAYOUT], hosts)
    findings = compare_with_cluster(found, load_cluster("configs/clusters/mixed-mini.yaml"))
    pair = [f for f in findings if "rank0-rank1" in f.subject]
    assert len(pair) == 1 and pair[0].code == "cluster-mismatch" and pair[0].severity == "error"
    text = pair[0].message
    assert "a100-0" in pair[0].subject and "NVLINK" in text and "PCIE_SYS" in text and "a100-pcie-box" in text
    # SXM declared, PCIe seen: the model finding names both
    assert any("A100-SXM4-80GB" in f.message and "A100-PCIE-40GB" in f.message for f in findings)
    # the observed cluster itself contradicts nothing
    clean = assemble_cluster([{"host": h} for h in LAYOUT], hosts)
    assert compare_with_cluster(clean, load_cluster_text(clean.to_yaml())) == []


def test_ranks_of_one_host_must_be_contiguous(hosts):
    with pytest.raises(ConfigError) as err:
        assemble_cluster([{"host": "a100-pcie-box"}, {"host": "h800-box"}, {"host": "a100-pcie-box"}], hosts)
    assert "ranks 0 and 2" in str(err.value)


def test_record_round_trip_keeps_links_and_nics(hosts):
    topo = hosts["h800-box"]
    back = topology_from_record(host_record(topo, "h800-box"))
    assert back.link("GPU0", "GPU7").link_class == LinkClass.NVLINK
    assert len(back.nics) == len(topo.nics) and back.device("GPU3").model == "H800"


def test_exchange_through_a_store_probes_each_host_once(tmp_path):
    """Four 'ranks' in one process over one in-memory store: two of them share a host."""
    template = make_probe_dirs(tmp_path)
    store = dist.HashStore()
    results = []
    # Ranks publish before they wait, so run each rank's exchange on its own thread.
    import threading

    def rank_fn(r):
        results.append((r, discover_cluster(store, r, 4, timedelta(seconds=30), probe_dir=template)))

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4
    yamls = {d.to_yaml() for _, d in results}
    assert len(yamls) == 1  # every rank assembled the same cluster
    assert results[0][1].probes == {"a100-pcie-box": 1, "h800-box": 1, "ascend-box": 1}


def test_this_machine_is_a_cpu_node():
    topo = probe_host(None)
    found = assemble_cluster([{"host": "here"}, {"host": "here"}], {"here": topo})
    assert found.cluster.nodes[0].group.fabric == LinkClass.SHM
    assert found.cluster.rank(1).vendor == "cpu"


def test_bad_probe_dir_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        probe_host(str(tmp_path / "missing"))
    assert "HETCOMM_PROBE_DIR" in str(err.value)
