"""Ascend parsers: npu-smi topo/info/board, lspci Huawei lines, and hccn_tool (hccn.py).

Fixtures are real captures (tests/fixtures, headers kept); inline texts are synthetic variants
written for this file and say so.
"""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import LinkClass
from hetcomm.topo.parse import hccn, npusmi


def read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


# -- npu-smi info -t topo ------------------------------------------------------------------------


def test_topo_910b3_full_hccs_mesh(fixture_path):
    text = read(fixture_path, "npusmi_topo_910b3_x8_hccs.txt")
    assert npusmi.sniff_npusmi_topo(text)
    topo = npusmi.parse_npusmi_topo(text, "topo.txt")
    assert [d.name for d in topo.devices] == [f"NPU{i}" for i in range(8)]
    assert all(d.vendor == "ascend" for d in topo.devices)
    assert topo.device("NPU0").cpu_affinity == "144-167"
    assert topo.device("NPU2").cpu_affinity == "96-119"
    assert topo.device("NPU7").cpu_affinity == "48-71"
    assert len(topo.links) == 28  # 8 choose 2, each pair once
    assert {link.link_class for link in topo.links} == {LinkClass.HCCS}
    assert {link.raw for link in topo.links} == {"HCCS"}
    assert {link.gbps for link in topo.links} == {448.0}  # 56 GB/s per pair (910B)
    assert topo.facts["formats"] == ["npu-smi-topo"] and topo.facts["sources"] == ["topo.txt"]
    assert "parse_warnings" not in topo.facts


# Synthetic: first-generation 910 layout (two 4-NPU HCCS rings joined by PCIe, topology-notes
# §2.3), CRLF line ends, tab separators, an NA cell and an extra NUMA column.
SYNTH_910A_RINGS = "\r\n".join(
    [
        "\tNPU0\tNPU1\tNPU2\tNPU3\tNPU4\tNPU5\tNPU6\tNPU7\tCPU Affinity\tNUMA Affinity",
        "NPU0\tX\tHCCS\tHCCS\tHCCS\tPIX\tSYS\tSYS\tSYS\t0-23\t0",
        "NPU1\tHCCS\tX\tHCCS\tHCCS\tSYS\tSYS\tSYS\tSYS\t0-23\t0",
        "NPU2\tHCCS\tHCCS\tX\tHCCS\tSYS\tSYS\tSYS\tSYS\t24-47\t1",
        "NPU3\tHCCS\tHCCS\tHCCS\tX\tSYS\tSYS\tSYS\tNA\t24-47\t1",
        "NPU4\tPIX\tSYS\tSYS\tSYS\tX\tHCCS\tHCCS\tHCCS\t48-71\t2",
        "NPU5\tSYS\tSYS\tSYS\tSYS\tHCCS\tX\tHCCS\tHCCS\t48-71\t2",
        "NPU6\tSYS\tSYS\tSYS\tSYS\tHCCS\tHCCS\tX\tHCCS\t72-95\t3",
        "NPU7\tSYS\tSYS\tSYS\tNA\tHCCS\tHCCS\tHCCS\tX\t72-95\t3",
        "",
        "Legend:",
        "  X    = Self",
        "",
    ]
)


def test_topo_synthetic_910a_rings_crlf_tabs_na():
    topo = npusmi.parse_npusmi_topo(SYNTH_910A_RINGS)
    assert topo.link("NPU0", "NPU3").link_class == LinkClass.HCCS
    assert topo.link("NPU0", "NPU4").link_class == LinkClass.PCIE_PIX
    assert topo.link("NPU1", "NPU6").link_class == LinkClass.PCIE_SYS
    na = topo.link("NPU3", "NPU7")
    assert na.link_class == LinkClass.UNKNOWN and na.raw == "NA" and na.gbps is None
    assert topo.device("NPU4").cpu_affinity == "48-71"  # CPU Affinity, not NUMA Affinity
    hccs = [link for link in topo.links if link.link_class == LinkClass.HCCS]
    assert len(hccs) == 12  # two rings of 4: 6 pairs each


def test_topo_synthetic_spaces_no_affinity_two_npus():
    # Synthetic: runs of spaces, no CPU Affinity column, 2 NPUs.
    text = "        NPU0    NPU1\nNPU0     X      PHB\nNPU1    PHB      X\n"
    topo = npusmi.parse_npusmi_topo(text)
    assert topo.link("NPU0", "NPU1").link_class == LinkClass.PCIE_PHB
    assert topo.device("NPU0").cpu_affinity is None


def test_topo_truncated_row_names_line_and_count():
    lines = SYNTH_910A_RINGS.split("\r\n")
    lines[3] = "NPU2\tHCCS\tHCCS\tX"  # line 4 cut short
    with pytest.raises(TopologyParseError) as e:
        npusmi.parse_npusmi_topo("\n".join(lines), "cut.txt")
    assert e.value.line == 4 and e.value.path == "cut.txt"
    assert "3 cells, expected 8" in str(e.value)


def test_topo_missing_rows_is_an_error():
    lines = SYNTH_910A_RINGS.split("\r\n")[:6]  # NPU5..NPU7 rows lost
    with pytest.raises(TopologyParseError, match="no row for NPU5, NPU6, NPU7"):
        npusmi.parse_npusmi_topo("\n".join(lines))


def test_topo_x_off_diagonal_is_an_error():
    text = "\tNPU0\tNPU1\nNPU0\tHCCS\tX\nNPU1\tHCCS\tX\n"
    with pytest.raises(TopologyParseError, match="diagonal") as e:
        npusmi.parse_npusmi_topo(text)
    assert e.value.line == 2


def test_topo_asymmetric_cells_warn_and_keep_first():
    text = "\tNPU0\tNPU1\nNPU0\tX\tHCCS\nNPU1\tSYS\tX\n"
    topo = npusmi.parse_npusmi_topo(text, "asym.txt")
    assert topo.link("NPU0", "NPU1").link_class == LinkClass.HCCS
    assert any("asym.txt:3" in w for w in topo.facts["parse_warnings"])


def test_topo_not_a_matrix_raises():
    with pytest.raises(TopologyParseError, match="NPU0 NPU1"):
        npusmi.parse_npusmi_topo("hello\nworld\n")


def test_topo_sniffer_ignores_gpu_matrices(fixture_path):
    assert not npusmi.sniff_npusmi_topo(read(fixture_path, "nvsmi_topo_dgx_a100_mlx5x12.txt"))
    assert not npusmi.sniff_npusmi_topo(read(fixture_path, "npusmi_info_910b3_x8.txt"))


# -- npu-smi info --------------------------------------------------------------------------------


def test_info_910b3_devices_health_hbm(fixture_path):
    text = read(fixture_path, "npusmi_info_910b3_x8.txt")
    assert npusmi.sniff_npusmi_info(text)
    topo = npusmi.parse_npusmi_info(text)
    assert [d.name for d in topo.devices] == [f"NPU{i}" for i in range(8)]
    npu0 = topo.device("NPU0")
    assert npu0.model == "910B3" and npu0.vendor == "ascend" and npu0.index == 0
    assert npu0.pci_bus_id == "0000:c1:00.0"
    assert topo.device("NPU7").pci_bus_id == "0000:42:00.0"
    assert topo.facts["npu_health"] == {f"NPU{i}": "OK" for i in range(8)}
    assert topo.facts["npu_hbm_mb"]["NPU3"] == 65536
    assert topo.facts["npu_smi_version"] == "24.1.rc1.b030"


# Synthetic: a 310P-style card with two chips per NPU, a Warning health, no HBM column and the
# process table after the device table.
SYNTH_INFO_MULTICHIP = """\
+------------------------------------------------------------------------------------+
| npu-smi 23.0.0                          Version: 23.0.0                            |
+-----------------------+-----------------+------------------------------------------+
| NPU   Name            | Health          | Power(W)   Temp(C)   Hugepages-Usage(page)|
| Chip  Device          | Bus-Id          | AICore(%)  Memory-Usage(MB)              |
+=======================+=================+==========================================+
| 8     310P3           | Warning         | NA         45        0    / 0            |
| 0     0               | 0000:01:00.0    | 0          1782 / 21527                  |
| 1     1               | 0000:01:00.1    | 0          1711 / 21527                  |
+=======================+=================+==========================================+
+-----------------------+-----------------+------------------------------------------+
| NPU   Chip            | Process id      | Process name     | Process memory(MB)    |
+=======================+=================+==========================================+
| 8     0               | 4242            | python           | 100                   |
+=======================+=================+==========================================+
"""


def test_info_synthetic_multichip_warning_no_hbm():
    topo = npusmi.parse_npusmi_info(SYNTH_INFO_MULTICHIP)
    assert [d.name for d in topo.devices] == ["NPU8-0", "NPU8-1"]
    assert topo.device("NPU8-1").pci_bus_id == "0000:01:00.1"
    assert topo.device("NPU8-0").model == "310P3"
    assert topo.facts["npu_health"] == {"NPU8-0": "Warning", "NPU8-1": "Warning"}
    assert "npu_hbm_mb" not in topo.facts  # Memory-Usage is DDR, not HBM


def test_info_without_rows_raises():
    head = "\n".join(SYNTH_INFO_MULTICHIP.splitlines()[:6])
    with pytest.raises(TopologyParseError, match="no NPU rows"):
        npusmi.parse_npusmi_info(head)


# -- npu-smi info -t board / -m / health, lspci --------------------------------------------------


def test_board_910a_fixture(fixture_path):
    text = read(fixture_path, "npusmi_board_lspci_hccn_910a_x8.txt")
    assert npusmi.sniff_npusmi_board(text)
    topo = npusmi.parse_npusmi_board(text)
    assert [d.name for d in topo.devices] == [f"NPU{i}" for i in range(8)]  # from `-m`
    npu0 = topo.device("NPU0")
    assert npu0.model == "910A" and npu0.pci_device_id == "19e5:d801"
    assert npu0.pci_bus_id == "0000:61:00.0"
    assert all(d.model == "910A" for d in topo.devices)
    assert topo.facts["npu_health"] == {"NPU0": "OK"}  # `-t health` attributed via `-i 0`
    assert topo.facts["npu_hbm_mb"] == {"NPU0": 31129}


def test_board_synthetic_910b_device_id():
    # Synthetic: `npu-smi info -t board -i 3` of a 910B part whose Chip Name is not printed.
    text = "\tNPU ID : 3\n\tPCI Vendor ID : 0x19E5\n\tPCI Device ID : 0xD802\n"
    topo = npusmi.parse_npusmi_board(text)
    assert topo.device("NPU3").pci_device_id == "19e5:d802"
    assert topo.device("NPU3").model == "910B"


def test_board_without_npu_raises():
    with pytest.raises(TopologyParseError, match="NPU ID"):
        npusmi.parse_npusmi_board("Chip Name : 910A\n")


def test_lspci_ascend_lines(fixture_path):
    text = read(fixture_path, "npusmi_board_lspci_hccn_910a_x8.txt")
    topo = npusmi.parse_lspci_ascend(text)
    pci = topo.facts["ascend_pci"]
    assert len(pci) == 8 and topo.devices == []
    assert pci[0] == {"pci_bus_id": "0000:3d:00.0", "pci_device_id": "19e5:d801", "model": "910A"}
    # lspci -nn spelling (synthetic)
    nn = (
        "c1:00.0 Processing accelerators [1200]: Huawei Technologies Co., Ltd. "
        "Device [19e5:d802] (rev 20)"
    )
    assert npusmi.parse_lspci_ascend(nn).facts["ascend_pci"][0]["model"] == "910B"
    assert not npusmi.sniff_lspci_ascend(read(fixture_path, "lspci_nn_a100_nvswitch_vm.txt"))


# -- hccn_tool -----------------------------------------------------------------------------------


def test_hccn_910a_net_health_and_optical(fixture_path):
    text = read(fixture_path, "npusmi_board_lspci_hccn_910a_x8.txt")
    assert hccn.sniff_hccn(text)
    topo = hccn.parse_hccn(text)
    assert topo.facts["hccn_health"] == {"npu0-roce": "Socket failed"}
    npu0 = topo.facts["hccn"]["npu0-roce"]
    assert npu0["rx_los_flag"] == "0xff" and npu0["optical_present"] == "not present"
    assert npu0["ip"] == "192.161.200.10" and npu0["link_up_count"] == 2
    assert npu0["link_changes"] == 3
    # npu-smi's key/value lines after the hccn_tool views are not taken for NIC data
    assert "Chip Name" not in str(topo.facts["hccn"])


def test_hccn_910b_speed_and_conf(fixture_path):
    topo = hccn.parse_hccn(read(fixture_path, "hccn_tool_910b_status_lldp_ip_route_ping.txt"))
    nic = topo.nic("npu3-roce")
    assert nic.rate_gbps == 200.0 and nic.link_layer == "Ethernet"
    assert topo.facts["hccn"]["npu3-roce"]["ip"] == "29.1.112.213"
    assert topo.facts["hccn"]["npu7-roce"]["conf_address"] == "29.1.170.143"


def test_hccn_env_check_eight_npus(fixture_path):
    topo = hccn.parse_hccn(read(fixture_path, "hccn_tool_ascend_8npu_env_check.txt"))
    assert sorted(n.name for n in topo.nics) == sorted(f"npu{i}-roce" for i in range(8))
    assert topo.facts["hccn"]["npu5-roce"]["ip"] == "10.10.0.15"
    assert topo.facts["hccn"]["npu5-roce"]["roce_rx_err_pkt_num"] == 0


def test_hccn_link_status_synthetic():
    text = "hccn_tool -i 2 -link -g\nlink status: DOWN\n"
    topo = hccn.parse_hccn(text)
    assert topo.nic("npu2-roce").state == "Down"


def test_hccn_nothing_raises():
    with pytest.raises(TopologyParseError, match="hccn_tool"):
        hccn.parse_hccn("nothing here\n")


def test_topo_synthetic_16_npus_sio_hccs_sw():
    # Synthetic A3-style matrix: 16 NPUs, die pairs joined by SIO, the rest through an HCCS
    # switch; single-space separated header.
    names = [f"NPU{i}" for i in range(16)]
    rows = [" ".join(names) + " CPU Affinity"]
    for i in range(16):
        cells = ["X" if i == j else ("SIO" if i // 2 == j // 2 else "HCCS_SW") for j in range(16)]
        rows.append(f"NPU{i} " + " ".join(cells) + f" {i * 10}-{i * 10 + 9}")
    topo = npusmi.parse_npusmi_topo("\n".join(rows))
    assert len(topo.devices) == 16 and len(topo.links) == 120
    assert topo.link("NPU10", "NPU11").raw == "SIO"
    assert topo.link("NPU1", "NPU15").raw == "HCCS_SW"
    assert topo.link("NPU1", "NPU15").link_class == LinkClass.HCCS
    assert topo.device("NPU15").cpu_affinity == "150-159"
