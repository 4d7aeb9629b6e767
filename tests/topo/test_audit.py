"""The audit rules, on real captured outputs (tests/fixtures) and on hand-built topologies
for the signatures no public capture shows; and the three buyer answers."""

from __future__ import annotations

import os

import pytest

from hetcomm.errors import UsageError
from hetcomm.topo.audit import (
    ALPHA_US,
    FINDING_CODES,
    audit,
    cross_vendor_path,
    estimate_alltoall,
    measurement_rows,
    parse_size,
    run_audit,
)
from hetcomm.topo.cluster import load_cluster, load_cluster_text
from hetcomm.topo.model import Device, Link, LinkClass, Measurement, Nic, Topology
from hetcomm.topo.parse import parse_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(REPO, "configs", "clusters", "mixed-mini.yaml")


def parsed(fixture_path, *names) -> Topology:
    topo = Topology()
    for name in names:
        topo.merge(parse_file(fixture_path(name)))
    return topo


def codes(findings, code=None):
    found = [(f.code, f.severity, f.subject) for f in findings]
    return [x for x in found if code is None or x[0] == code]


def gpus(n, model=None, **kw):
    return [Device(f"GPU{i}", "nvidia", model, index=i, **kw) for i in range(n)]


def mesh(topo, names, cls, raw, gbps=None):
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            topo.add_link(Link(a, b, cls, raw=raw, gbps=gbps, source="test"))


def test_every_finding_has_a_meaning_fix_and_valid_severity(fixture_path):
    topo = parsed(
        fixture_path,
        "lsmod_nvidia_peermem_bound_vs_unbound.txt",
        "ibstat_cx7_roce200_cx6dx_down_truncated.txt",
    )
    for f in audit(topo):
        assert f.code in FINDING_CODES and f.fix and f.message
        assert f.severity in ("error", "warning", "info")
    assert set(FINDING_CODES) == {
        "pcie-not-sxm",
        "nvlink-degraded",
        "nic-numa-mismatch",
        "numa-unknown",
        "no-gdr",
        "nccl-ib-disabled",
        "nccl-p2p-shm-fallback",
        "p2p-not-supported",
        "rdma-port-down",
        "fabric-manager-missing",
        "hccs-missing",
        "cluster-mismatch",  # raised by hetcomm.topo.discover.compare_with_cluster
        "bandwidth-shortfall",  # issue #22 (hetcomm.topo.rules_measured)
        "known-bad-version",
    }


# -- fixtures: the Done-when signatures --------------------------------------------------------


def test_h800_box_is_clean(fixture_path):
    topo = parsed(fixture_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt")
    assert audit(topo) == []


def test_l40s_reports_nic_numa_mismatch_for_the_socket_without_nics(fixture_path):
    findings = audit(parsed(fixture_path, "nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"))
    assert codes(findings, "nic-numa-mismatch") == [
        ("nic-numa-mismatch", "warning", "GPU0"),
        ("nic-numa-mismatch", "warning", "GPU1"),
    ]
    assert "mlx5_0" in findings[0].message and "SYS" in findings[0].message


def test_socket_nccl_log_reports_ib_disabled(fixture_path):
    findings = audit(parsed(fixture_path, "nccl_log_p4d_ib_disabled_net_socket.txt"))
    (f,) = [f for f in findings if f.code == "nccl-ib-disabled"]
    assert f.severity == "error"
    assert "NCCL_IB_DISABLE" in f.message and "Socket" in f.message


def test_gdr_rdma_log_is_clean(fixture_path):
    assert audit(parsed(fixture_path, "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt")) == []


def test_shm_log_reports_p2p_fallback_with_the_env_override(fixture_path):
    findings = audit(parsed(fixture_path, "nccl_log_g6e_l40s_shm.txt"))
    (f,) = [f for f in findings if f.code == "nccl-p2p-shm-fallback"]
    assert f.severity == "warning" and "NCCL_P2P_LEVEL=NVL" in f.message


def test_unbound_peermem_with_rdma_nics_is_no_gdr(fixture_path):
    findings = audit(
        parsed(
            fixture_path,
            "lsmod_nvidia_peermem_bound_vs_unbound.txt",
            "ibstat_cx7_roce200_cx6dx_down_truncated.txt",
        )
    )
    assert ("no-gdr", "error", "mlx5_0, mlx5_1, mlx5_10") in codes(findings)
    assert ("rdma-port-down", "warning", "mlx5_10") in codes(findings)


def test_bound_peermem_alone_is_not_no_gdr(fixture_path, tmp_path):
    # The first listing of the capture is the bound case: cut it out into its own file.
    lines = open(fixture_path("lsmod_nvidia_peermem_bound_vs_unbound.txt")).read().splitlines()
    bound = tmp_path / "lsmod_bound.txt"
    bound.write_text("\n".join(ln.strip() for ln in lines[3:6]) + "\n")
    topo = Topology().merge(parse_file(str(bound)))
    assert topo.facts["peermem"] is True
    topo.merge(parse_file(fixture_path("ibstat_cx7_roce200_cx6dx_down_truncated.txt")))
    assert codes(audit(topo), "no-gdr") == []


def test_lsmod_alone_without_rdma_nics_is_not_no_gdr(fixture_path):
    assert (
        codes(audit(parsed(fixture_path, "lsmod_nvidia_peermem_bound_vs_unbound.txt")), "no-gdr")
        == []
    )


def test_pcie_a100_against_an_sxm_cluster_label_is_pcie_not_sxm(fixture_path):
    topo = parsed(fixture_path, "nvsmi_a100_pcie_x2_nvlink_inactive.txt")
    assert audit(topo) == []  # an honest PCIe card is not a finding
    topo = parsed(fixture_path, "nvsmi_a100_pcie_x2_nvlink_inactive.txt")
    findings = audit(topo, load_cluster(MINI))
    assert codes(findings, "pcie-not-sxm") == [
        ("pcie-not-sxm", "error", "GPU0"),
        ("pcie-not-sxm", "error", "GPU1"),
    ]
    assert "A100-PCIE-40GB" in findings[0].message and "mixed-mini.yaml" in findings[0].message


@pytest.mark.parametrize("order", [0, 1])
def test_sxm_pci_id_with_inactive_nvlink_is_pcie_not_sxm(fixture_path, order):
    # Two captures combined: lspci says SXM4 ids (10de:20b2), nvidia-smi says PCIe names and no
    # active NVLink. Whichever comes first, the conflict is found.
    names = ["lspci_nn_a100_nvswitch_vm.txt", "nvsmi_a100_pcie_x2_nvlink_inactive.txt"]
    if order:
        names.reverse()
    findings = audit(parsed(fixture_path, *names))
    assert [s for _, _, s in codes(findings, "pcie-not-sxm")] == ["GPU0", "GPU1"]


def test_sxm_model_with_pcie_only_matrix_is_pcie_not_sxm_but_not_in_topo_mp_view():
    topo = Topology(devices=gpus(4, "A100-SXM4-80GB"))
    mesh(topo, [d.name for d in topo.devices], LinkClass.PCIE_PIX, "PIX")
    findings = audit(topo)
    assert codes(findings) == [("pcie-not-sxm", "error", f"GPU{i}") for i in range(4)]
    assert "3 GPU peer link(s) are PCIe (PIX)" in findings[0].message
    mp = Topology(devices=gpus(4, "A100-SXM4-80GB"), facts={"pcie_view": True})
    mesh(mp, [d.name for d in mp.devices], LinkClass.PCIE_PIX, "PIX")
    assert audit(mp) == []


def test_dgx1_topo_mp_capture_is_not_pcie_not_sxm(fixture_path):
    # `topo -mp` hides NVLink: its PIX/PHB/SYS between SXM GPUs are not evidence. The DGX-1's
    # V100 has no entry in the NVLink table, so label the GPUs with an SXM model that has one.
    topo = parsed(fixture_path, "nvsmi_topo_mp_dgx1_v100_pcie_only.txt")
    assert topo.facts.get("pcie_view") is True
    for d in topo.devices:
        if d.vendor == "nvidia":
            d.model = "A100-SXM4-40GB"
    assert codes(audit(topo), "pcie-not-sxm") == []
    topo.facts["pcie_view"] = False  # the same matrix from `topo -m` would be a finding
    assert len(codes(audit(topo), "pcie-not-sxm")) == 8


def test_label_only_devices_are_never_audited_as_hardware():
    topo = load_cluster(MINI).to_topology(label_only=True)
    assert audit(topo, load_cluster(MINI)) == []


# -- nvlink-degraded -----------------------------------------------------------------------------


def test_nvlink_degraded_from_matrix_and_from_nvlink_status():
    topo = Topology(devices=gpus(8, "H800"))
    names = [d.name for d in topo.devices]
    mesh(topo, names, LinkClass.NVLINK, "NV8")
    for peer in names[1:]:
        topo.link("GPU0", peer).raw = "NV6"
    topo.facts["nvlink_active"] = {"GPU3": 7}
    found = codes(audit(topo), "nvlink-degraded")
    assert [s for _, _, s in found] == ["GPU0", "GPU3"]
    assert "the matrix shows 6 link(s) (NV6)" in topo.findings[0].message
    assert "nvidia-smi nvlink shows 7 active link(s)" in topo.findings[1].message


def test_direct_nvlink_mesh_adds_links_over_peers():
    # 4-GPU HGX A100 board: 12 links split 4+4+4 over three peers; that is complete, not degraded.
    topo = Topology(devices=gpus(4, "A100-SXM4-40GB"))
    mesh(topo, [d.name for d in topo.devices], LinkClass.NVLINK, "NV4")
    assert audit(topo) == []
    topo.link("GPU0", "GPU1").raw = "NV3"
    assert [s for _, _, s in codes(audit(topo), "nvlink-degraded")] == ["GPU0", "GPU1"]


def test_full_nvlink_fixtures_are_not_degraded(fixture_path):
    assert audit(parsed(fixture_path, "nvsmi_nvlink_status_a100_sxm4_8gpu.txt")) == []
    topo = parsed(fixture_path, "nvsmi_topo_dgx_a100_mlx5x12.txt")
    for d in topo.devices:
        d.model = "A100-SXM4-80GB"
    assert codes(audit(topo), "nvlink-degraded") == []


# -- numa, p2p, ports, fabric, hccs -------------------------------------------------------------


def test_numa_na_and_flattened_numa(fixture_path):
    na = audit(parsed(fixture_path, "nvsmi_topo_pcie8_pix_pxb_sys_numa_na.txt"))
    assert [c for c, _, _ in codes(na)] == ["numa-unknown"]
    assert "N/A" in na[0].message
    flat = audit(parsed(fixture_path, "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt"))
    (f,) = [f for f in flat if f.code == "numa-unknown"]
    assert "NUMA 0" in f.message and "0-191" in f.message
    assert codes(audit(parsed(fixture_path, "npusmi_topo_910b3_x8_hccs.txt"))) == []


def test_p2p_matrix_statuses():
    topo = Topology(devices=gpus(4, "GeForce RTX 5090"))
    topo.facts["p2p"] = {"GPU0-GPU1": "OK", "GPU0-GPU2": "GNS", "GPU1-GPU2": "GNS"}
    (f,) = audit(topo)
    assert (f.code, f.severity) == ("p2p-not-supported", "info")
    dc = Topology(devices=gpus(2, "A100-PCIE-40GB"), facts={"p2p": {"GPU0-GPU1": "CNS"}})
    (f,) = audit(dc)
    assert (f.code, f.severity, f.subject) == ("p2p-not-supported", "warning", "GPU0-GPU1")
    assert "chipset" in f.message


def test_fabric_manager(fixture_path):
    (f,) = audit(parsed(fixture_path, "lspci_nn_a100_nvswitch_vm.txt"))
    assert (f.code, f.severity) == ("fabric-manager-missing", "info")
    assert (
        audit(
            parsed(
                fixture_path,
                "lspci_nn_a100_nvswitch_vm.txt",
                "fabricmanager_log_nvls_multicast.txt",
            )
        )
        == []
    )
    down = parsed(fixture_path, "lspci_nn_a100_nvswitch_vm.txt")
    down.facts["fabric_manager"] = "not-running"
    (f,) = audit(down)
    assert (f.code, f.severity) == ("fabric-manager-missing", "error")


def test_hccs_missing_on_910b_but_not_on_910a_rings(fixture_path):
    assert (
        audit(parsed(fixture_path, "npusmi_topo_910b3_x8_hccs.txt", "npusmi_info_910b3_x8.txt"))
        == []
    )
    npus = [Device(f"NPU{i}", "ascend", "910B3", index=i) for i in range(4)]
    topo = Topology(devices=npus)
    mesh(topo, [d.name for d in npus], LinkClass.HCCS, "HCCS")
    topo.add_link(Link("NPU0", "NPU3", LinkClass.PCIE_PIX, raw="PIX"), replace=True)
    (f,) = audit(topo)
    assert (f.code, f.severity, f.subject) == ("hccs-missing", "error", "NPU0-NPU3 (PIX)")
    ring = Topology(devices=[Device(f"NPU{i}", "ascend", "910A", index=i) for i in range(4)])
    mesh(ring, [f"NPU{i}" for i in range(4)], LinkClass.PCIE_PIX, "PIX")
    assert audit(ring) == []


def test_socket_transport_with_rdma_nics_and_libfabric_case():
    topo = Topology(devices=gpus(2), nics=[Nic("mlx5_0", "InfiniBand", 200.0, "Active")])
    topo.facts["nccl_network"] = "Socket"
    (f,) = [f for f in audit(topo) if f.code == "nccl-ib-disabled"]
    assert f.severity == "error" and "mlx5_0" in f.message
    efa = Topology(facts={"nccl_env": {"NCCL_IB_DISABLE": "1"}, "nccl_network": "Libfabric"})
    (f,) = audit(efa)
    assert (f.code, f.severity) == ("nccl-ib-disabled", "info")


def test_nccl_net_ib_without_gdrdma_is_no_gdr_but_ascend_only_is_exempt():
    topo = Topology(devices=[Device("rank0", "nvidia"), Device("rank8", "nvidia")])
    topo.add_link(Link("rank0", "rank8", LinkClass.NET_IB, raw="NET/IB/0", source="log"))
    (f,) = audit(topo)
    assert f.code == "no-gdr" and "NET/IB/0" in f.message
    ascend = Topology(
        devices=[Device("NPU0", "ascend", "910B")],
        nics=[Nic("hns_0", "Ethernet", 200.0, "Active", port=1)],
        facts={"peermem": False},
    )
    assert audit(ascend) == []


def test_audit_is_idempotent_and_sorted(fixture_path):
    topo = parsed(
        fixture_path,
        "lsmod_nvidia_peermem_bound_vs_unbound.txt",
        "ibstat_cx7_roce200_cx6dx_down_truncated.txt",
    )
    first = audit(topo)
    assert audit(topo) == first and len(topo.findings) == len(first)
    assert [f.severity for f in first] == sorted(
        (f.severity for f in first), key=["error", "warning", "info"].index
    )


# -- (a) all-to-all estimate --------------------------------------------------------------------


def test_alltoall_estimate_formula_on_a_hand_built_topology():
    # 4 ranks: 0-1 NVLink 2400 Gb/s, 2-3 NVLink, every other pair RoCE 200 Gb/s.
    topo = Topology(devices=gpus(4, "A100-SXM4-80GB"))
    for a, b in [("GPU0", "GPU1"), ("GPU2", "GPU3")]:
        topo.add_link(Link(a, b, LinkClass.NVLINK, "NV12", 2400.0))
    for a, b in [("GPU0", "GPU2"), ("GPU0", "GPU3"), ("GPU1", "GPU2"), ("GPU1", "GPU3")]:
        topo.add_link(Link(a, b, LinkClass.NET_ROCE_GDR, "NET/IB/0/GDRDMA", 200.0))
    size = 64 << 20
    est = estimate_alltoall(topo, size)
    rows = {r.link_class: r for r in est.rows}
    chunk = size / 4
    nv = rows[LinkClass.NVLINK]
    assert (nv.num_pairs, nv.num_peers, nv.bytes_per_rank) == (2, 1, chunk)
    assert nv.time_us == pytest.approx(ALPHA_US[LinkClass.NVLINK] + chunk * 8 / 2400e9 * 1e6)
    roce = rows[LinkClass.NET_ROCE_GDR]
    assert (roce.num_pairs, roce.num_peers) == (4, 2)
    assert roce.time_us == pytest.approx(
        ALPHA_US[LinkClass.NET_ROCE_GDR] + 2 * chunk * 8 / 200e9 * 1e6
    )
    assert est.bottleneck == LinkClass.NET_ROCE_GDR and est.time_us == roce.time_us
    assert est.serial_time_us == pytest.approx(nv.time_us + roce.time_us)
    assert est.algbw_gbs == pytest.approx(size / (est.time_us * 1e-6) / 1e9)
    assert est.busbw_gbs == pytest.approx(est.algbw_gbs * 3 / 4)


def test_alltoall_estimate_on_the_mini_cluster_is_bounded_by_the_bridge():
    cluster = load_cluster(MINI)
    topo = cluster.to_topology(label_only=True)
    est = estimate_alltoall(topo, 16 << 20, cluster=cluster)
    assert est.num_ranks == 4 and est.bottleneck == LinkClass.HOST_BRIDGE
    bridge = [r for r in est.rows if r.link_class == LinkClass.HOST_BRIDGE][0]
    # rank3 (the 910B) reaches its 3 peers over the bridge at 100 Gb/s, alpha 30 us.
    assert bridge.num_peers == 3
    assert bridge.time_us == pytest.approx(30 + 3 * (4 << 20) * 8 / 100e9 * 1e6)
    assert any("labels" in n for n in est.notes)
    # The a100 node's one bridge and one NIC are shared by its two ranks.
    assert (
        "HOST_BRIDGE on 'a100' nodes: 100 Gb/s per node shared by 2 ranks = 50 Gb/s per rank"
        in est.notes
    )
    # rank0 (1 RoCE peer at its 100 Gb/s share) and rank2 (2 peers at 200) take the same time.
    roce = [r for r in est.rows if r.link_class == LinkClass.NET_ROCE_GDR][0]
    assert roce.time_us == pytest.approx(ALPHA_US[LinkClass.NET_ROCE_GDR] + (4 << 20) * 8 / 100e9 * 1e6)
    assert (
        "NET_ROCE_GDR on 'a100' nodes: 200 Gb/s per node shared by 2 ranks = 100 Gb/s per rank"
        in est.notes
    )


MEDIUM = """
name: medium
node_groups:
  - name: a100
    count: 2
    device: {model: A100-SXM4-80GB, count: 4}
    nics: [{class: NET_IB_GDR, gbps: 200, count: 4}]
  - name: ascend
    count: 1
    device: {model: 910B, count: 4}
    nics: [{class: NET_ROCE, gbps: 200, count: 4}]
interconnect:
  cross_vendor: {class: HOST_BRIDGE, gbps: 100, latency_us: 30}
"""


def test_alltoall_estimate_counts_every_pair_of_a_multi_node_cluster():
    cluster = load_cluster_text(MEDIUM)
    topo = cluster.to_topology()
    est = estimate_alltoall(topo, 64 << 20, cluster=cluster)
    assert est.num_ranks == 12
    assert sum(r.num_pairs for r in est.rows) == 12 * 11 // 2
    peers = {r.link_class: r.num_peers for r in est.rows}
    assert peers == {
        LinkClass.NVLINK: 3,
        LinkClass.HCCS: 3,
        LinkClass.NET_IB_GDR: 4,
        LinkClass.HOST_BRIDGE: 8,
    }
    small = estimate_alltoall(topo, 1 << 20, cluster=cluster)
    assert (
        small.time_us < est.time_us and small.bottleneck == est.bottleneck == LinkClass.HOST_BRIDGE
    )


def test_alltoall_estimate_edge_cases():
    single = estimate_alltoall(Topology(devices=[Device("cpu0", "cpu")]), 1024)
    assert single.rows == () and single.time_us is None and "local copy" in single.notes[0]
    unknown = Topology(devices=gpus(2))
    unknown.add_link(Link("GPU0", "GPU1", LinkClass.UNKNOWN, "NA", None))
    est = estimate_alltoall(unknown, 1024)
    assert est.time_us is None and est.rows[0].time_us is None
    with pytest.raises(UsageError):
        estimate_alltoall(unknown, 0)


@pytest.mark.parametrize(
    "text,value",
    [("64M", 64 << 20), ("1G", 1 << 30), ("4096", 4096), ("8 KiB", 8192), ("1.5K", 1536)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1M", "0", "12Q"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError, match="size"):
        parse_size(text)


# -- (b) cross-vendor, (c) measurements --------------------------------------------------------


def test_cross_vendor_answers(fixture_path):
    cluster = load_cluster(MINI)
    ans = cross_vendor_path(cluster.to_topology())
    assert (ans.verdict, ans.num_pairs, ans.declared) == ("host-staged", 3, True)
    assert "host memory" in ans.message
    none = cross_vendor_path(parsed(fixture_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt"))
    assert none.verdict == "none" and none.message == "No cross-vendor pair in this topology."
    both = Topology(devices=[Device("GPU0", "nvidia"), Device("NPU0", "ascend")])
    assert cross_vendor_path(both).verdict == "unknown"
    both.add_link(Link("GPU0", "NPU0", LinkClass.NET_ROCE_GDR, "x", 200.0, source="observed"))
    assert cross_vendor_path(both).verdict == "gdr"


def test_measurement_rows_and_full_report():
    topo = Topology(
        measurements=[
            Measurement("alltoall", 1 << 20, 50.0, 20.97, 18.35, num_ranks=8, source="b"),
            Measurement("alltoall", 1024, 20.0, 0.05, 0.04, num_ranks=8, source="b"),
            Measurement("allreduce", 1024, 20.0, 0.05, 0.09, num_ranks=8, source="b"),
        ]
    )
    rows = measurement_rows(topo, "alltoall")
    assert [r["size_bytes"] for r in rows] == [1024, 1 << 20]
    report = run_audit(topo, size_bytes=1 << 20)
    assert len(report.measurements) == 3 and report.num_errors == 0
    answers = report.answers_dict()
    assert set(answers) == {"alltoall_estimate", "cross_vendor", "measurements"}
