"""Real captures from the wild (issue 11 item 5): the classification each must get, and every
finding code firing on at least one real capture. Sources are in each file's first line."""

from __future__ import annotations

import os

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.audit import FINDING_CODES, audit
from hetcomm.topo.cluster import load_cluster
from hetcomm.topo.discover import assemble_cluster, compare_with_cluster
from hetcomm.topo.model import LinkClass, Topology
from hetcomm.topo.parse import parse_file, parse_files
from tests.conftest import FIXTURES

MINI = "configs/clusters/mixed-mini.yaml"


def parsed(*names: str) -> Topology:
    return parse_files([os.path.join(FIXTURES, n) for n in names])


def cls(topo: Topology, a: str, b: str) -> str:
    link = topo.link(a, b)
    assert link is not None, f"no link {a}-{b}"
    return link.link_class.name


def codes(topo: Topology, cluster=None):
    return sorted({f.code for f in audit(topo, cluster)})


def test_sglang_env_report_h800_names_the_model_and_keeps_the_matrix():
    t = parsed("envreport_sglang_h800_nv8_11nic_kvm.txt")
    assert {d.model for d in t.devices} == {"H800"} and len(t.devices) == 8
    assert cls(t, "GPU0", "GPU7") == "NVLINK" and t.link("GPU0", "GPU7").raw == "NV8"
    assert len(t.nics) == 11 and cls(t, "GPU0", "mlx5_1") == "PCIE_PIX" and cls(t, "GPU0", "mlx5_0") == "PCIE_SYS"
    assert codes(t) == []


def test_sglang_env_report_two_a100_sxm4():
    t = parsed("envreport_sglang_a100_sxm4_x2_nv12_5nic.txt")
    assert [d.model for d in t.devices] == ["A100-SXM4-80GB"] * 2
    assert t.link("GPU0", "GPU1").raw == "NV12"
    assert cls(t, "GPU0", "NIC2") == "PCIE_PXB" and cls(t, "GPU0", "NIC3") == "PCIE_SYS"
    assert codes(t) == []


def test_p100_pcie_box_two_switches():
    t = parsed("nvsmi_topo_p100_x8_pix_phb_jenkins.txt")
    assert len(t.devices) == 8 and not t.nics
    assert cls(t, "GPU0", "GPU3") == "PCIE_PIX" and cls(t, "GPU3", "GPU4") == "PCIE_PHB"
    assert codes(t) == []


def test_old_nvidia_smi_names_nics_in_the_header():
    t = parsed("nvsmi_topo_a100_x2_nv12_mlx5_named_columns.txt")
    assert sorted(n.name for n in t.nics) == [f"mlx5_{i}" for i in range(8)]
    assert cls(t, "GPU0", "GPU1") == "NVLINK" and cls(t, "GPU1", "mlx5_7") == "PCIE_PXB"
    assert t.device("GPU0").numa == 1


def test_consumer_rtx5090_pair_has_no_p2p():
    t = parsed("nvsmi_topo_p2p_rtx5090_x2_phb_gns.txt")
    assert cls(t, "GPU0", "GPU1") == "PCIE_PHB"
    assert t.facts["p2p"] == {"GPU0-GPU1": "GNS"}
    assert codes(t) == ["p2p-not-supported"]


def test_h100_four_gpu_nv6_mesh_is_complete():
    t = parsed("nvsmi_topo_h100_x4_nv6_mesh_4numa.txt")
    assert all(cls(t, f"GPU{a}", f"GPU{b}") == "NVLINK" for a in range(4) for b in range(a + 1, 4))
    for d in t.devices:
        d.model = "H100-SXM5-80GB"  # the matrix names no model; 3 peers x NV6 = the H100's 18
    assert "nvlink-degraded" not in codes(t)


def test_v100_with_two_inactive_nvlinks_is_degraded():
    t = parsed("nvsmi_nvlink_status_v100_sxm2_2_inactive.txt")
    findings = [f for f in audit(t) if f.code == "nvlink-degraded"]
    assert [f.subject for f in findings] == ["GPU3"] and "4 active" in findings[0].message


@pytest.mark.parametrize(
    "name, network",
    [("nccl_log_efa_ofi_1.3_hmem_unsupported.txt", "AWS Libfabric"), ("nccl_log_p5en_h200_efa_16nic_libfabric.txt", "Libfabric")],
)
def test_nccl_through_the_aws_ofi_plugin_is_efa(name, network):
    t = parsed(name)
    assert t.facts["nccl_network"] == network and t.facts["nccl_net_class"] == "NET_EFA"


def test_aws_p4d_static_topology_file():
    t = parsed("nccl_topo_xml_aws_p4d_24xl_efa_static.xml")
    assert [d.model for d in t.devices] == ["A100-SXM4-40GB"] * 8
    assert [n.name for n in t.nics] == ["efa0", "efa1", "efa2", "efa3"]
    assert cls(t, "GPU0", "GPU1") == "PCIE_PIX" and cls(t, "GPU0", "efa0") == "PCIE_PIX"
    assert cls(t, "GPU0", "GPU2") == "PCIE_PHB" and cls(t, "GPU0", "GPU4") == "PCIE_SYS"
    # the file describes PCIe only: NVLink is not missing, it is not described
    assert t.facts["pcie_view"] is True and codes(t) == []


def test_aws_g5_static_file_has_nothing_to_model_and_says_so():
    with pytest.raises(TopologyParseError) as err:
        parse_file(os.path.join(FIXTURES, "nccl_topo_xml_aws_g5_48xl_cpu_roots_only.xml"))
    assert "no <gpu> and no <net>" in str(err.value) and "g5_48xl" in str(err.value)


def test_azure_nd_static_topology_files():
    v4 = parsed("nccl_topo_xml_azure_ndv4_a100_ib_4numa.xml")
    assert len(v4.devices) == 8 and {n.link_layer for n in v4.nics} == {"InfiniBand"} and len(v4.nics) == 8
    assert {d.numa for d in v4.devices} == {0, 1, 2, 3}
    assert cls(v4, "GPU0", "GPU1") == "PCIE_PIX" and cls(v4, "GPU0", "GPU2") == "PCIE_SYS"
    assert codes(v4) == []
    v5 = parsed("nccl_topo_xml_azure_ndv5_h100_ib_2numa.xml")
    assert len(v5.nics) == 8 and {d.numa for d in v5.devices} == {0, 1}
    v2 = parsed("nccl_topo_xml_azure_ndv2_v100_ib.xml")
    assert len(v2.nics) == 1 and v2.nics[0].numa == 0
    # GPUs 4-7 reach the only HCA across the socket link
    mismatch = sorted(f.subject for f in audit(v2) if f.code == "nic-numa-mismatch")
    assert mismatch == ["GPU4", "GPU5", "GPU6", "GPU7"]


#: code -> (captures of one host, cluster file or None): a real capture on which the code fires.
COVERAGE = {
    "known-bad-version": (["nvsmi_470.82.01_tesla_m60_azure_nv12s_v3_srun_pyxis.txt"], None),
    "bandwidth-shortfall": (["nccltests_alltoall_rtx2080ti_x2_pix_p2p_ns.txt"], None),
    "pcie-not-sxm": (["nvsmi_a100_pcie_x2_nvlink_inactive.txt"], MINI),
    "nvlink-degraded": (["nvsmi_nvlink_status_v100_sxm2_2_inactive.txt"], None),
    "nic-numa-mismatch": (["nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"], None),
    "numa-unknown": (["nvsmi_topo_pcie8_pix_pxb_sys_numa_na.txt"], None),
    "no-gdr": (["lsmod_nvidia_peermem_bound_vs_unbound.txt", "ibstat_cx7_roce200_cx6dx_down_truncated.txt"], None),
    "nccl-ib-disabled": (["nccl_log_p4d_ib_disabled_net_socket.txt"], None),
    "nccl-p2p-shm-fallback": (["nccl_log_g6e_l40s_shm.txt"], None),
    "p2p-not-supported": (["nvsmi_topo_p2p_rtx5090_x2_phb_gns.txt"], None),
    "rdma-port-down": (["ibstat_cx7_roce200_cx6dx_down_truncated.txt"], None),
    "fabric-manager-missing": (["lspci_nn_a100_nvswitch_vm.txt"], None),
}
#: Codes no public capture shows yet (only synthetic tests in test_audit.py exercise them).
NOT_YET_SEEN = {"hccs-missing"}


@pytest.mark.parametrize("code", sorted(COVERAGE))
def test_finding_code_fires_on_a_real_capture(code):
    names, cluster = COVERAGE[code]
    assert code in codes(parsed(*names), load_cluster(cluster) if cluster else None)


def test_cluster_mismatch_fires_on_real_captures():
    hosts = {
        "a100-box": parsed("nvsmi_a100_pcie_x2_nvlink_inactive.txt"),
        "h800-box": parsed("envreport_sglang_h800_nv8_11nic_kvm.txt"),
        "ascend-box": parsed("npusmi_info_910b3_x8.txt", "npusmi_topo_910b3_x8_hccs.txt"),
    }
    found = assemble_cluster([{"host": h} for h in ("a100-box", "a100-box", "h800-box", "ascend-box")], hosts)
    assert "cluster-mismatch" in {f.code for f in compare_with_cluster(found, load_cluster(MINI))}


def test_every_code_is_covered_or_declared_missing():
    assert set(COVERAGE) | {"cluster-mismatch"} | NOT_YET_SEEN == set(FINDING_CODES)


def test_no_claimed_capture_crashes_or_comes_back_empty():
    for name in sorted(os.listdir(FIXTURES)):
        try:
            t = parse_file(os.path.join(FIXTURES, name))
        except TopologyParseError:
            continue  # refused with a message naming the file: allowed
        assert t.devices or t.nics or t.links or t.measurements or len(t.facts) > 2, name
