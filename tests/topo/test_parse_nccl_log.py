"""NCCL_DEBUG=INFO log parser: observed transports per rank pair, NICs and NCCL facts.

Fixtures are real logs mixed with program output (tests/fixtures); inline logs are synthetic.
"""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import LinkClass
from hetcomm.topo.parse import nccl_log
from hetcomm.topo.parse.nccl_log import classify_transport


def read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def test_h100_two_node_roce_gdr_and_p2p(fixture_path):
    text = read(fixture_path, "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt")
    assert nccl_log.sniff_nccl_log(text)
    topo = nccl_log.parse_nccl_log(text)
    assert sorted(d.name for d in topo.devices) == sorted(f"rank{r}" for r in range(16))
    r8 = topo.device("rank8")
    assert (r8.host, r8.index, r8.pci_bus_id, r8.vendor) == (
        "tpgds-aihub0008",
        0,
        "0000:18:00.0",
        "nvidia",
    )
    assert topo.device("rank0").host is None  # the other node's ranks appear only in channel lines
    intra = topo.link("rank8", "rank9")
    assert (intra.link_class, intra.raw) == (LinkClass.P2P, "P2P/IPC")
    inter = topo.link("rank0", "rank8")
    assert (inter.link_class, inter.raw) == (LinkClass.NET_ROCE_GDR, "NET/IB/0/GDRDMA")
    assert {link.link_class for link in topo.links} == {LinkClass.P2P, LinkClass.NET_ROCE_GDR}
    assert sorted(n.name for n in topo.nics) == [
        "mlx5_0",
        "mlx5_1",
        "mlx5_11",
        "mlx5_2",
        "mlx5_5",
        "mlx5_6",
        "mlx5_7",
        "mlx5_8",
    ]
    assert all(n.link_layer == "Ethernet" and n.port == 1 for n in topo.nics)
    f = topo.facts
    assert f["nccl_env"]["NCCL_IB_GID_INDEX"] == "3"
    assert f["nccl_env"]["NCCL_IB_DISABLE"] == "0"  # "0." in the log: trailing dot removed
    assert f["nccl_env"]["NCCL_NET_GDR_LEVEL"] == "PIX"
    assert f["nccl_env"]["NCCL_IB_HCA"].startswith("mlx5_0,mlx5_1")
    assert f["nccl_network"] == "IB" and f["nccl_gdr"] == [1]
    assert f["nccl_version"] == "2.27.5+cuda12.9"
    assert f["nccl_net_class"] == "NET_ROCE_GDR"
    assert f["nccl_transports"]["P2P/IPC"] == 240
    assert sum(v for k, v in f["nccl_transports"].items() if k.endswith("/GDRDMA")) == 64
    assert f["nccl_nnodes"] == 2 and f["nccl_comms"] == {"0xde4443395863ef4a": 16}


def test_g6e_p2p_level_forces_shm(fixture_path):
    topo = nccl_log.parse_nccl_log(read(fixture_path, "nccl_log_g6e_l40s_shm.txt"))
    assert len(topo.devices) == 4 and len(topo.links) == 4
    assert {(link.link_class, link.raw) for link in topo.links} == {
        (LinkClass.SHM, "SHM/direct/direct")
    }
    assert topo.facts["nccl_env"]["NCCL_P2P_LEVEL"] == "NVL"
    assert topo.facts["nccl_env"]["NCCL_TOPO_FILE"] == ""
    assert topo.facts["nccl_network"] == "Libfabric"
    assert topo.facts["nccl_transports"] == {"SHM/direct/direct": 28}


def test_p4d_socket_classified_from_using_network(fixture_path):
    topo = nccl_log.parse_nccl_log(read(fixture_path, "nccl_log_p4d_ib_disabled_net_socket.txt"))
    f = topo.facts
    assert f["nccl_env"] == {"NCCL_IB_DISABLE": "1"}
    assert f["nccl_network"] == "Socket"
    assert not any(k.startswith("NET/") for k in f["nccl_transports"])  # no `via NET/Socket`
    assert f["nccl_net_class"] == "NET_SOCKET"
    (nic,) = topo.nics
    assert (nic.name, nic.link_layer, nic.host) == ("ens32", "Ethernet", "ip-172-31-3-153")
    assert topo.link("rank0", "rank1").raw == "P2P/CUMEM/read"
    assert topo.device("rank3").pci_bus_id == "0000:20:1d.0"
    assert any("aws-ofi-nccl initialization failed" in w for w in f["nccl_warnings"])


@pytest.mark.parametrize(
    "raw, roce, expected",
    [
        ("P2P/IPC", None, LinkClass.P2P),
        ("P2P/CUMEM/read", None, LinkClass.P2P),
        ("P2P/direct pointer", None, LinkClass.P2P),
        ("SHM/direct/direct", None, LinkClass.SHM),
        ("NET/IB/10/GDRDMA", None, LinkClass.NET_IB_GDR),
        ("NET/IB/1", None, LinkClass.NET_IB),
        ("NET/IB/1", True, LinkClass.NET_ROCE),
        ("NET/IB/0/GDRDMA/Shared", True, LinkClass.NET_ROCE_GDR),
        ("NET/Socket/0", None, LinkClass.NET_SOCKET),
        ("NET/Libfabric/0/GDRDMA", None, LinkClass.NET_EFA),
        ("NET/AWS Libfabric/1", None, LinkClass.NET_EFA),
        ("NET/OFI/0", None, LinkClass.NET_EFA),
        ("NET/IB/3(4)/GDRDMA", True, LinkClass.NET_ROCE_GDR),  # PXN through rank 4's NIC
        ("NET/IBext_v8/0/GDRDMA", False, LinkClass.NET_IB_GDR),  # SHARP plugin
        ("NET/UCX/0", None, None),
        ("CollNet/0", None, None),
    ],
)
def test_classify_transport(raw, roce, expected):
    assert classify_transport(raw, roce) == expected


def _line(host: str, pid: int, dev: int, msg: str) -> str:
    return f"{host}:{pid}:{pid} [{dev}] NCCL INFO {msg}"


def test_synthetic_hca_index_10_is_not_1():
    # Synthetic: 11 HCAs, [1] is InfiniBand and [10] is RoCE; NET/IB/1 must not be read out of
    # NET/IB/10/GDRDMA, and each index must pick its own HCA's link layer.
    hcas = " ".join(f"[{i}]mlx5_{i}:1/{'RoCE' if i == 10 else 'IB'}" for i in range(11))
    text = "\n".join(
        [
            _line("a", 1, 0, f"NET/IB : Using {hcas} [RO]; OOB eth0:10.0.0.1<0>"),
            _line("a", 1, 0, "Channel 00/0 : 0[0] -> 2[0] [send] via NET/IB/10/GDRDMA"),
            _line("a", 1, 0, "Channel 01/0 : 0[0] -> 4[0] [send] via NET/IB/1"),
        ]
    )
    topo = nccl_log.parse_nccl_log(text)
    assert topo.link("rank0", "rank2").link_class == LinkClass.NET_ROCE_GDR
    assert topo.link("rank0", "rank4").link_class == LinkClass.NET_IB
    assert (
        topo.nic("mlx5_10").link_layer == "Ethernet"
        and topo.nic("mlx5_1").link_layer == "InfiniBand"
    )


def test_synthetic_best_evidence_and_interleaved_records():
    text = "\n".join(
        [
            "step 10 loss 2.3",
            _line("n0", 7, 0, "Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct"),
            # two writers glued onto one line: both records are read
            _line("n0", 7, 0, "Channel 01/0 : 0[0] -> 1[1] via P2P/direct pointer")
            + _line("n0", 8, 1, "Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct"),
            _line("n0", 8, 1, "Channel 00/0 : 1[1] -> 2[2] via NET/Socket/0"),
            _line("n0", 8, 1, "Channel 00/0 : 1[1] -> 3[3] via NET/Foo/0"),
        ]
    )
    topo = nccl_log.parse_nccl_log(text, "mix.log")
    best = topo.link("rank0", "rank1")
    assert (best.link_class, best.raw) == (LinkClass.P2P, "P2P/direct pointer")
    assert topo.facts["nccl_transports"]["SHM/direct/direct"] == 2
    assert topo.link("rank1", "rank2").link_class == LinkClass.NET_SOCKET
    assert topo.link("rank1", "rank3").link_class == LinkClass.UNKNOWN
    assert any(
        w.startswith("mix.log:5:") and "NET/Foo/0" in w for w in topo.facts["parse_warnings"]
    )


def test_synthetic_gdr_disabled_for_hca_gives_no_gdr_class():
    text = "\n".join(
        [
            _line("h", 1, 0, "NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.1.0.1<0>"),
            _line("h", 1, 0, "NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0' (no module)"),
            _line("h", 1, 0, "Using network IB"),
            _line("h", 1, 0, "NCCL_NET_GDR_LEVEL set by environment to LOC."),
        ]
    )
    topo = nccl_log.parse_nccl_log(text)
    assert topo.facts["nccl_gdr_hca"] == {"mlx5_0": "Disabled"}
    assert topo.nic("mlx5_0").gdr is False
    assert topo.facts["nccl_net_class"] == "NET_IB"
    assert topo.facts["nccl_env"]["NCCL_NET_GDR_LEVEL"] == "LOC"


INIT = "ncclCommInitRank comm 0x{comm} rank {rank} nranks 2 cudaDev 0 busId 18000 commId 0x9"


def test_synthetic_two_hosts_keep_two_nics():
    text = "\n".join(
        [
            _line("nodeA", 1, 0, "NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.0.0.1<0>"),
            _line("nodeB", 2, 0, "NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.0.0.2<0>"),
            _line(
                "nodeA",
                1,
                0,
                INIT.format(comm=1, rank=0),
            ),
            _line(
                "nodeB",
                2,
                0,
                INIT.format(comm=2, rank=1),
            ),
            _line("nodeA", 1, 0, "Channel 00/0 : 1[0] -> 0[0] [receive] via NET/IB/0"),
        ]
    )
    topo = nccl_log.parse_nccl_log(text)
    assert sorted(n.name for n in topo.nics) == ["mlx5_0@nodeA", "mlx5_0@nodeB"]
    assert topo.device("rank1").host == "nodeB"
    assert topo.link("rank0", "rank1").link_class == LinkClass.NET_IB


def test_not_an_nccl_log_raises():
    assert not nccl_log.sniff_nccl_log("loss 2.3\nNCCL version 2.18.1\n")
    with pytest.raises(TopologyParseError, match="NCCL_DEBUG=INFO") as e:
        nccl_log.parse_nccl_log("loss 2.3\n", "train.log")
    assert e.value.path == "train.log"


def test_synthetic_newer_nccl_spellings():
    # Synthetic, NCCL >= 2.19 style: GDR mechanism in parentheses, PXN device "0(1)", IBext.
    text = "\n".join(
        [
            _line("h", 1, 0, "NET/IBext_v8 : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB x"),
            _line("h", 1, 0, "NET/IB : GPU Direct RDMA (DMABUF) enabled for HCA 0 'mlx5_0'"),
            _line("h", 1, 0, "Channel 02/0 : 0[0] -> 9[1] [send] via NET/IBext_v8/1(1)/GDRDMA"),
            _line("h", 1, 0, "Using network IBext_v8"),
        ]
    )
    topo = nccl_log.parse_nccl_log(text)
    assert topo.facts["nccl_gdr_hca"] == {"mlx5_0": "Enabled"}
    assert topo.nic("mlx5_0").gdr is True
    assert topo.link("rank0", "rank9").link_class == LinkClass.NET_ROCE_GDR
    assert topo.facts["nccl_net_class"] == "NET_ROCE_GDR"


def test_synthetic_older_nccl_init_line():
    # Synthetic, NCCL 2.10 style: no function name, no nvmlDev/commId.
    text = _line("old", 5, 3, "comm 0x55d0 rank 3 nranks 4 cudaDev 3 busId 3b000 - Init COMPLETE")
    topo = nccl_log.parse_nccl_log(text)
    dev = topo.device("rank3")
    assert (dev.index, dev.pci_bus_id, dev.host) == (3, "0000:3b:00.0", "old")


def test_synthetic_renumbering_communicators_warn():
    # Synthetic: two 2-rank communicators whose rank 0 is a different GPU; channel lines cannot
    # say which communicator they belong to, so the parser must say so.
    init = "ncclCommInitRank comm 0x{c} rank 0 nranks 2 cudaDev {d} busId {b} commId 0x{c}"
    text = "\n".join(
        [
            _line("n", 1, 0, init.format(c="a", d=0, b="18000")),
            _line("n", 2, 1, init.format(c="b", d=1, b="2a000")),
        ]
    )
    topo = nccl_log.parse_nccl_log(text, "two.log")
    assert topo.device("rank0").index == 0  # the first communicator's numbering is kept
    (warning,) = topo.facts["parse_warnings"]
    assert warning.startswith("two.log:2:") and "0xb" in warning and "0xa" in warning
    assert topo.facts["nccl_comms"] == {"0xa": 2, "0xb": 2}
