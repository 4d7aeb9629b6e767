"""RDMA parsers: ibstat, ibv_devinfo, show_gids, /sys/class/infiniband dumps, ibdev2netdev.

Fixtures are real captures (tests/fixtures, headers kept); inline texts are synthetic.
"""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.parse import rdma


def read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


# -- ibstat --------------------------------------------------------------------------------------


def test_ibstat_truncated_keeps_complete_cas_and_warns(fixture_path):
    text = read(fixture_path, "ibstat_cx7_roce200_cx6dx_down_truncated.txt")
    assert rdma.sniff_ibstat(text)
    topo = rdma.parse_ibstat(text, "ibstat.txt")
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_10"]
    cx7 = topo.nic("mlx5_0")
    assert (cx7.link_layer, cx7.rate_gbps, cx7.state, cx7.port) == ("Ethernet", 200.0, "Active", 1)
    down = topo.nic("mlx5_10")
    assert down.state == "Down" and down.rate_gbps is None and down.link_layer is None
    assert topo.facts["ib_phys_state"]["mlx5_10"] == "Disabled"
    assert topo.facts["hca_type"] == {"mlx5_0": "MT4129", "mlx5_1": "MT4129", "mlx5_10": "MT4125"}
    (warning,) = topo.facts["parse_warnings"]
    assert warning.startswith("ibstat.txt:46:") and "mlx5_10" in warning and "Rate" in warning


def test_ibstat_ibpanic_keeps_parsed_ca(fixture_path):
    topo = rdma.parse_ibstat(read(fixture_path, "ibstat_ib_hdr200_partial_ibpanic.txt"), "p.txt")
    (nic,) = topo.nics
    assert (nic.name, nic.link_layer, nic.rate_gbps, nic.state) == (
        "mlx5_7",
        "InfiniBand",
        200.0,
        "Active",
    )
    assert "hca_type" not in topo.facts  # "CA type: ..." was elided in the capture
    assert any(w.startswith("p.txt:21:") and "ibpanic" in w for w in topo.facts["parse_warnings"])


# Synthetic: a dual-port HCA, CRLF line ends, spaces instead of tabs, port 2 down.
SYNTH_DUAL_PORT = "\r\n".join(
    [
        "CA 'mlx5_2'",
        "    CA type: MT4123",
        "    Number of ports: 2",
        "    Port 1:",
        "        State: Active",
        "        Physical state: LinkUp",
        "        Rate: 100",
        "        Link layer: InfiniBand",
        "    Port 2:",
        "        State: Down",
        "        Physical state: Polling",
        "        Rate: 10",
        "        Link layer: InfiniBand",
        "",
    ]
)


def test_ibstat_synthetic_dual_port_crlf():
    topo = rdma.parse_ibstat(SYNTH_DUAL_PORT)
    assert [n.name for n in topo.nics] == ["mlx5_2", "mlx5_2:2"]
    assert topo.nic("mlx5_2:2").state == "Down" and topo.nic("mlx5_2:2").port == 2
    assert topo.facts["ib_phys_state"]["mlx5_2:2"] == "Polling"
    assert "parse_warnings" not in topo.facts


def test_ibstat_missing_second_port_warns():
    text = "\n".join(SYNTH_DUAL_PORT.split("\r\n")[:8])
    topo = rdma.parse_ibstat(text, "one.txt")
    assert [n.name for n in topo.nics] == ["mlx5_2"]
    assert any("says 2 ports but only 1" in w for w in topo.facts["parse_warnings"])


def test_ibstat_without_ports_raises():
    with pytest.raises(TopologyParseError, match="no ibstat data") as e:
        rdma.parse_ibstat("CA 'mlx5_0'\n\tCA type: MT4129\n", "x.txt")
    assert e.value.path == "x.txt"


# -- ibv_devinfo / show_gids ---------------------------------------------------------------------


def test_ibv_devinfo_roce_port(fixture_path):
    text = read(fixture_path, "ibv_devinfo_show_gids_cx7_roce.txt")
    assert rdma.sniff_ibv_devinfo(text) and rdma.sniff_show_gids(text)
    topo = rdma.parse_ibv_devinfo(text)
    (nic,) = topo.nics
    # transport is "InfiniBand (0)" but the link layer is Ethernet: RoCE.
    assert (nic.name, nic.link_layer, nic.state, nic.port) == ("mlx5_0", "Ethernet", "Active", 1)
    assert nic.rate_gbps is None  # plain ibv_devinfo prints no speed/width
    assert topo.facts["hca_type"] == {"mlx5_0": "MT4129"}


def test_ibv_devinfo_verbose_rate_synthetic():
    # Synthetic `ibv_devinfo -v` excerpt of an HDR InfiniBand port.
    text = (
        "hca_id:\tmlx5_3\n\ttransport:\t\t\tInfiniBand (0)\n\tvendor_part_id:\t\t\t4123\n"
        "\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tactive_width:\t\t4X (2)\n"
        "\t\t\tactive_speed:\t\t50.0 Gbps (64)\n\t\t\tlink_layer:\t\tInfiniBand\n"
        "\t\tport:\t2\n\t\t\tstate:\t\t\tPORT_DOWN (1)\n\t\t\tlink_layer:\t\tInfiniBand\n"
    )
    topo = rdma.parse_ibv_devinfo(text)
    assert topo.nic("mlx5_3").rate_gbps == 200.0
    assert topo.nic("mlx5_3:2").state == "Down"


def test_ibv_devinfo_without_port_raises():
    with pytest.raises(TopologyParseError, match="ibv_devinfo"):
        rdma.parse_ibv_devinfo("hca_id:\tmlx5_0\n\ttransport:\t\tInfiniBand (0)\n")


def test_show_gids_table(fixture_path):
    topo = rdma.parse_show_gids(read(fixture_path, "ibv_devinfo_show_gids_cx7_roce.txt"))
    gids = topo.facts["roce_gids"]["mlx5_0"]
    assert [g["index"] for g in gids] == [0, 1, 2, 3]
    v2_ipv4 = [g for g in gids if g["ver"] == "v2" and g["ipv4"]]
    assert v2_ipv4 == [
        {
            "index": 3,
            "ver": "v2",
            "ipv4": "10.99.91.39",
            "gid": "0000:0000:0000:0000:0000:ffff:0a63:5b27",
            "port": 1,
            "netdev": "ens108np0",
        }
    ]
    assert gids[0]["ipv4"] is None
    assert topo.nic("mlx5_0").netdev == "ens108np0"


def test_show_gids_bad_row_names_line():
    text = (
        "DEV\tPORT\tINDEX\tGID\t\tIPv4\t\tVER\tDEV\n---\t----\n mlx5_0\t1\t0\tnot-a-gid\tv1\teth0\n"
    )
    with pytest.raises(TopologyParseError, match="not a GID") as e:
        rdma.parse_show_gids(text, "g.txt")
    assert e.value.line == 3


# -- /sys/class/infiniband -----------------------------------------------------------------------


def test_sysfs_fixture_ndr_ib_and_roce_bond(fixture_path):
    text = read(fixture_path, "sys_class_infiniband_h100_ndr_ib_plus_roce_bond.txt")
    assert rdma.sniff_ib_sysfs(text)
    topo = rdma.parse_ib_sysfs(text)
    assert len(topo.nics) == 9
    ib = topo.nic("mlx5_0")
    assert (ib.link_layer, ib.rate_gbps, ib.state) == ("InfiniBand", 400.0, "Active")
    bond = topo.nic("mlx5_bond_0")
    assert (bond.link_layer, bond.rate_gbps) == ("Ethernet", 200.0)
    assert topo.facts["hca_type"]["mlx5_bond_0"] == "MT41692"
    assert topo.facts["ib_phys_state"]["mlx5_9"] == "LinkUp"


def test_sysfs_head_layout_and_grep_layout_synthetic():
    # Synthetic: `head /sys/class/infiniband/*/ports/*/*` blocks, then `grep .` lines (no space).
    text = (
        "==> /sys/class/infiniband/mlx5_1/ports/1/rate <==\n200 Gb/sec (4X HDR)\n\n"
        "==> /sys/class/infiniband/mlx5_1/ports/1/state <==\n1: DOWN\n\n"
        "/sys/class/infiniband/mlx5_1/ports/1/link_layer:InfiniBand\n"
        "/sys/class/infiniband/mlx5_1/device/numa_node:1\n"
        "/sys/class/infiniband/mlx5_1/ports/2/state:4: ACTIVE\n"
    )
    topo = rdma.parse_ib_sysfs(text)
    nic = topo.nic("mlx5_1")
    assert (nic.rate_gbps, nic.state, nic.link_layer, nic.numa) == (200.0, "Down", "InfiniBand", 1)
    assert topo.nic("mlx5_1:2").state == "Active"


def test_sysfs_without_ports_raises():
    with pytest.raises(TopologyParseError, match="infiniband"):
        rdma.parse_ib_sysfs("/sys/class/infiniband/mlx5_0/hca_type: MT4129\n")


# -- ibdev2netdev --------------------------------------------------------------------------------


def test_ibdev2netdev_in_h100_capture(fixture_path):
    text = read(fixture_path, "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt")
    assert rdma.sniff_ibdev2netdev(text)
    topo = rdma.parse_ibdev2netdev(text)
    assert len(topo.nics) == 12
    assert topo.nic("mlx5_10").netdev == "enp210s0f1np1"
    assert topo.nic("mlx5_0").state is None  # netdev state is not the IB port state
    assert topo.facts["netdev_state"]["enp210s0f1np1"] == "Down"
    assert topo.facts["netdev_state"]["enp25s0np0"] == "Up"


def test_sniffers_reject_other_tools(fixture_path):
    other = read(fixture_path, "nvsmi_topo_dgx_a100_mlx5x12.txt")
    for _, sniff, _ in rdma.FORMATS:
        assert not sniff(other)
    log = read(fixture_path, "nccl_log_g6e_l40s_shm.txt")  # mentions /sys/devices paths
    assert not rdma.sniff_ib_sysfs(log)
