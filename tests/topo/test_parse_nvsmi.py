"""Tests for hetcomm.topo.parse.nvsmi on real nvidia-smi captures and synthetic variants."""

from __future__ import annotations

import re

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import LinkClass
from hetcomm.topo.parse import nvsmi
from hetcomm.topo.parse.nvsmi import (
    parse_nvsmi,
    parse_nvsmi_nvlink,
    parse_nvsmi_topo,
    parse_nvsmi_topo_mp,
    parse_nvsmi_topo_p2p,
    sniff_nvsmi,
    sniff_nvsmi_nvlink,
    sniff_nvsmi_topo,
    sniff_nvsmi_topo_mp,
    sniff_nvsmi_topo_p2p,
)


def _read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def _gpus(topo):
    return [d for d in topo.devices if d.name.startswith("GPU")]


# -- topo -m on the real fixtures -------------------------------------------------------------------


def test_dgx_a100_mlx5_columns(fixture_path):
    topo = parse_nvsmi_topo(_read(fixture_path, "nvsmi_topo_dgx_a100_mlx5x12.txt"), "dgx.txt")
    assert [d.name for d in _gpus(topo)] == [f"GPU{i}" for i in range(8)]
    assert [n.name for n in topo.nics] == [f"mlx5_{i}" for i in range(12)]
    # 20 matrix columns -> every unordered pair exactly once.
    assert len(topo.links) == 20 * 19 // 2
    assert len({l.key for l in topo.links}) == len(topo.links)
    for i in range(8):
        for j in range(i + 1, 8):
            link = topo.link(f"GPU{i}", f"GPU{j}")
            assert link.link_class == LinkClass.NVLINK and link.raw == "NV12"
            assert link.gbps == nominal_gbps(LinkClass.NVLINK, num_nvlinks=12) == 12 * 25 * 8
    assert topo.link("GPU0", "mlx5_0").link_class == LinkClass.PCIE_PXB
    assert topo.link("mlx5_1", "GPU1").raw == "PXB"
    # mlx5_4/5 hang off no GPU's switch: SYS to every GPU, PIX to each other.
    assert all(topo.link(f"GPU{i}", "mlx5_4").link_class == LinkClass.PCIE_SYS for i in range(8))
    assert topo.link("mlx5_4", "mlx5_5").link_class == LinkClass.PCIE_PIX
    assert [d.numa for d in _gpus(topo)] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert topo.device("GPU0").cpu_affinity == "48-63,176-191"
    assert topo.facts["pcie_view"] is False
    assert topo.facts["formats"] == ["nvsmi-topo"] and topo.facts["sources"] == ["dgx.txt"]


def test_h800_nic_legend_and_rails(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt")
    assert "NVIDIA Topology:" in text  # the sglang prefix line
    topo = parse_nvsmi_topo(text)
    legend = [
        "mlx5_0",
        "mlx5_3",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_7",
        "mlx5_8",
        "mlx5_9",
        "mlx5_bond_0",
    ]
    assert [n.name for n in topo.nics] == legend
    assert topo.nic("NIC0") is None  # legend names replace NICn everywhere
    for i in range(8):
        peers = [l for l in topo.links_of(f"GPU{i}") if l.link_class == LinkClass.NVLINK]
        assert len(peers) == 7 and {l.raw for l in peers} == {"NV8"}
        assert peers[0].gbps == 8 * 25 * 8
        # 1:1 rail: GPUi is PIX to exactly the i-th legend NIC.
        pix = [l for l in topo.links_of(f"GPU{i}") if l.link_class == LinkClass.PCIE_PIX]
        assert len(pix) == 1 and legend[i] in (pix[0].a, pix[0].b)
    assert topo.link("GPU0", "mlx5_bond_0").link_class == LinkClass.PCIE_NODE
    assert topo.link("GPU7", "mlx5_bond_0").link_class == LinkClass.PCIE_SYS
    assert [d.numa for d in _gpus(topo)] == [0] * 4 + [1] * 4
    assert topo.device("GPU5").cpu_affinity == "56-111,168-223"
    assert "gpu_numa_id" not in topo.facts  # every GPU NUMA ID is N/A


def test_h100_nv18_with_ibdev2netdev_and_empty_cells(fixture_path):
    topo = parse_nvsmi_topo(_read(fixture_path, "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt"))
    assert topo.link("GPU0", "GPU5").raw == "NV18"
    assert topo.link("GPU0", "GPU5").gbps == 18 * 25 * 8
    # Rails are not in NIC order here: GPU3 -> NIC5 = mlx5_5, GPU4 -> mlx5_6.
    assert topo.link("GPU3", "mlx5_5").link_class == LinkClass.PCIE_PIX
    assert topo.link("GPU4", "mlx5_6").link_class == LinkClass.PCIE_PIX
    # mlx5_3/4 are PIX to each other and to no GPU.
    assert topo.link("mlx5_3", "mlx5_4").link_class == LinkClass.PCIE_PIX
    assert all(topo.link(f"GPU{i}", "mlx5_3").link_class == LinkClass.PCIE_NODE for i in range(8))
    # GPU rows hold an empty tab cell before "N/A"; NUMA and affinity still land right.
    assert {(d.numa, d.cpu_affinity) for d in _gpus(topo)} == {(0, "0-191")}
    mlx0, mlx10, mlx3 = topo.nic("mlx5_0"), topo.nic("mlx5_10"), topo.nic("mlx5_3")
    assert (mlx0.netdev, mlx0.state, mlx0.port) == ("enp25s0np0", "Active", 1)
    assert (mlx10.netdev, mlx10.state) == ("enp210s0f1np1", "Down")
    assert mlx3.netdev == "bond0"
    assert "ibdev2netdev" in topo.facts["formats"]
    # The `ip -br a` lines create nothing.
    assert topo.nic("enp25s0np0") is None and len(topo.nics) == 12


def test_l40s_numa_mismatch_signature(fixture_path):
    topo = parse_nvsmi_topo(_read(fixture_path, "nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt"))
    assert not [l for l in topo.links if l.link_class == LinkClass.NVLINK]
    for gpu, cls in (
        ("GPU0", LinkClass.PCIE_SYS),
        ("GPU1", LinkClass.PCIE_SYS),
        ("GPU2", LinkClass.PCIE_NODE),
    ):
        assert {topo.link(gpu, n).link_class for n in ("mlx5_0", "mlx5_1")} == {cls}
    assert topo.link("GPU0", "GPU1").link_class == LinkClass.PCIE_NODE
    assert topo.link("GPU1", "GPU2").link_class == LinkClass.PCIE_SYS
    assert topo.link("GPU1", "GPU2").gbps == nominal_gbps(LinkClass.PCIE_SYS)


def test_pcie8_numa_na_and_no_leading_whitespace(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_pcie8_pix_pxb_sys_numa_na.txt")
    assert re.search(r"(?m)^GPU0\s+GPU1", text)  # header without leading whitespace
    topo = parse_nvsmi_topo(text)
    assert topo.nics == []
    assert len(topo.links) == 28
    assert [d.numa for d in _gpus(topo)] == [None] * 8  # "N/A" is unknown, not 0
    assert topo.device("GPU7").cpu_affinity == "0-95"
    assert topo.link("GPU0", "GPU1").link_class == LinkClass.PCIE_PIX
    assert topo.link("GPU0", "GPU2").link_class == LinkClass.PCIE_PXB
    assert topo.link("GPU3", "GPU4").link_class == LinkClass.PCIE_SYS


def test_topo_mp_sets_pcie_view(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_mp_dgx1_v100_pcie_only.txt")
    assert sniff_nvsmi_topo_mp(text) and sniff_nvsmi_topo(text)
    for parse in (parse_nvsmi_topo_mp, parse_nvsmi_topo):  # the command line says -mp either way
        topo = parse(text)
        assert topo.facts["pcie_view"] is True
        assert topo.facts["formats"] == ["nvsmi-topo-mp"]
        assert topo.link("GPU0", "GPU1").link_class == LinkClass.PCIE_PIX
        assert topo.link("GPU0", "mlx5_0").raw == "PIX"
        assert topo.link("GPU0", "GPU4").link_class == LinkClass.PCIE_SYS


def test_topo_mp_without_command_line_when_named(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_mp_dgx1_v100_pcie_only.txt").replace(
        "$ nvidia-smi topo -mp", ""
    )
    assert not sniff_nvsmi_topo_mp(text)
    assert parse_nvsmi_topo(text).facts["pcie_view"] is False
    assert parse_nvsmi_topo_mp(text).facts["pcie_view"] is True


# Synthetic: a -m and a -mp matrix of the same 2-GPU box in one capture.
SYNTHETIC_M_AND_MP = """\
# synthetic: nvidia-smi topo -m then -mp of one 2-GPU NVLink-bridge box
$ nvidia-smi topo -mp
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\t0-15\t0
GPU1\tPIX\t X \t0-15\t0
$ nvidia-smi topo -m
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\t0-15\t0
GPU1\tNV4\t X \t0-15\t0
"""


def test_full_matrix_wins_over_pcie_view():
    topo = parse_nvsmi_topo(SYNTHETIC_M_AND_MP)
    assert topo.link("GPU0", "GPU1").raw == "NV4"
    assert topo.link("GPU0", "GPU1").gbps == 4 * 25 * 8
    assert topo.facts["pcie_view"] is False
    assert topo.facts["formats"] == ["nvsmi-topo", "nvsmi-topo-mp"]


# -- synthetic variants of topo -m ------------------------------------------------------------------


def test_tabs_spaces_and_crlf_give_the_same_topology(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_dgx_a100_mlx5x12.txt")
    # synthetic: the same capture re-printed with runs of spaces, then with CRLF line ends.
    spaced = "\n".join(re.sub(r"\t", "    ", line) for line in text.splitlines())
    crlf = text.replace("\n", "\r\n")
    ref = parse_nvsmi_topo(text)
    for variant in (spaced, crlf):
        topo = parse_nvsmi_topo(variant)
        assert [(l.a, l.b, l.link_class, l.raw) for l in topo.links] == [
            (l.a, l.b, l.link_class, l.raw) for l in ref.links
        ]
        assert [(d.name, d.numa, d.cpu_affinity) for d in topo.devices] == [
            (d.name, d.numa, d.cpu_affinity) for d in ref.devices
        ]


# synthetic: 3 GPUs, a NIC legend naming a Broadcom RoCE device, an extra (unknown) trailing
# column, no GPU NUMA ID, trailing blank lines, and a path token newer than this parser.
SYNTHETIC_3GPU = """\
        GPU0    GPU1    GPU2    NIC0    CPU Affinity    NUMA Affinity   Future Column
GPU0     X      NV2     PHB     PIX     0-31            0               7
GPU1    NV2      X      PHB     PHB     0-31            0               7
GPU2    PHB     PHB      X      C2C     32-63           1               7
NIC0    PIX     PHB     C2C      X

Legend:

  X    = Self

NIC Legend:

  NIC0: bnxt_re0


"""


def test_other_counts_extra_columns_and_unknown_tokens():
    topo = parse_nvsmi_topo(SYNTHETIC_3GPU)
    assert [n.name for n in topo.nics] == ["bnxt_re0"]
    assert topo.link("GPU0", "GPU1").raw == "NV2"
    assert topo.link("GPU0", "bnxt_re0").link_class == LinkClass.PCIE_PIX
    unknown = topo.link("GPU2", "bnxt_re0")
    assert unknown.link_class == LinkClass.UNKNOWN and unknown.raw == "C2C" and unknown.gbps is None
    assert [(d.numa, d.cpu_affinity) for d in _gpus(topo)] == [
        (0, "0-31"),
        (0, "0-31"),
        (1, "32-63"),
    ]


# synthetic, in the shape current drivers print on a terminal: an underlined (ANSI) header, the
# double tab before GPU NUMA ID, and GPUs whose CPU Affinity is empty (outside the cpuset).
SYNTHETIC_ANSI_EMPTY_AFFINITY = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tNV18\t44-51,148-155\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV18\t\t1\t\tN/A\n"
    "GPU2\tNV18\tNV18\t X \t\t1\t\t3\n"
)


def test_ansi_header_and_empty_affinity_cells():
    text = SYNTHETIC_ANSI_EMPTY_AFFINITY
    assert sniff_nvsmi_topo(text)
    topo = parse_nvsmi_topo(text)
    assert [(d.name, d.cpu_affinity, d.numa) for d in topo.devices] == [
        ("GPU0", "44-51,148-155", 0),
        ("GPU1", None, 1),  # the empty cell is kept apart from NUMA 1
        ("GPU2", None, 1),
    ]
    assert topo.facts["gpu_numa_id"] == {"GPU2": 3}
    # The same capture pasted from a web page: ESC bytes lost, "[4m" left behind.
    pasted = text.replace("\x1b", "")
    assert [d.numa for d in parse_nvsmi_topo(pasted).devices] == [0, 1, 1]


def test_space_separated_row_with_empty_affinity():
    # synthetic: a tool re-printed the matrix with spaces, so the empty CPU Affinity vanished.
    text = (
        "        GPU0    GPU1    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
        "GPU0     X      NV4     0-7             0               N/A\n"
        "GPU1    NV4      X                      1               N/A\n"
    )
    topo = parse_nvsmi_topo(text)
    assert [(d.cpu_affinity, d.numa) for d in topo.devices] == [("0-7", 0), (None, 1)]


def test_too_many_trailing_cells_is_rejected():
    text = (
        "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\t0\t9\nGPU1\tNV4\t X \t0-7\n"  # synthetic
    )
    with pytest.raises(TopologyParseError, match="more cells than the header") as err:
        parse_nvsmi_topo(text)
    assert err.value.line == 2


def test_single_gpu_matrix():
    text = (
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-63\t0\t\t1\n"  # synthetic
    )
    assert sniff_nvsmi_topo(text)
    topo = parse_nvsmi_topo(text)
    assert [d.name for d in topo.devices] == ["GPU0"] and topo.links == []
    assert topo.facts["gpu_numa_id"] == {"GPU0": 1}


def test_old_soc_token_is_sys():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSOC\t0-7\nGPU1\tSOC\t X \t8-15\n"  # synthetic, driver <= 375
    assert parse_nvsmi_topo(text).link("GPU0", "GPU1").link_class == LinkClass.PCIE_SYS


# -- topo -p2p ---------------------------------------------------------------------------------------

# synthetic: `nvidia-smi topo -p2p r` of a 4-GPU GeForce box behind a chipset; legend wording from
# topology-notes §1.1. Not a capture from a real machine.
SYNTHETIC_P2P = """\
# synthetic: nvidia-smi topo -p2p r, 4 consumer GPUs (written for tests, not a real capture)
$ nvidia-smi topo -p2p r
 \tGPU0\tGPU1\tGPU2\tGPU3\t
 GPU0\tX\tOK\tGNS\tCNS\t
 GPU1\tOK\tX\tGNS\tCNS\t
 GPU2\tGNS\tGNS\tX\tTNS\t
 GPU3\tCNS\tCNS\tNS\tX\t

Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
  GNS  = GPU not supported
  TNS  = Topology not supported
  NS   = Not supported
  U    = Unknown
"""


def test_p2p_matrix():
    assert sniff_nvsmi_topo_p2p(SYNTHETIC_P2P)
    assert not sniff_nvsmi_topo(SYNTHETIC_P2P)
    topo = parse_nvsmi_topo_p2p(SYNTHETIC_P2P)
    assert topo.facts["p2p"] == {
        "GPU0-GPU1": "OK",
        "GPU0-GPU2": "GNS",
        "GPU0-GPU3": "CNS",
        "GPU1-GPU2": "GNS",
        "GPU1-GPU3": "CNS",
        "GPU2-GPU3": "TNS",  # the non-OK status of either direction (NS the other way) is kept
    }
    assert topo.links == []  # P2P status is not a path
    assert [d.name for d in topo.devices] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert topo.facts["formats"] == ["nvsmi-topo-p2p"]


def test_p2p_and_topo_in_one_capture():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-7\nGPU1\tPHB\t X \t0-7\n\n" + (
        "$ nvidia-smi topo -p2p w\n\tGPU0\tGPU1\nGPU0\tX\tGNS\nGPU1\tGNS\tX\n"
    )  # synthetic: GeForce pair, PHB path and GNS write status
    topo = parse_nvsmi_topo(text)
    assert topo.link("GPU0", "GPU1").raw == "PHB"
    assert topo.facts["p2p"] == {"GPU0-GPU1": "GNS"}
    assert topo.facts["formats"] == ["nvsmi-topo", "nvsmi-topo-p2p"]


# -- nvlink -s and identity --------------------------------------------------------------------------


def test_nvlink_status_a100_sxm4(fixture_path):
    text = _read(fixture_path, "nvsmi_nvlink_status_a100_sxm4_8gpu.txt")
    assert sniff_nvsmi_nvlink(text) and not sniff_nvsmi(text)
    topo = parse_nvsmi_nvlink(text)
    assert len(topo.devices) == 8
    assert {d.model for d in topo.devices} == {"A100-SXM4-80GB"}
    assert topo.facts["nvlink_active"] == {f"GPU{i}": 12 for i in range(8)}
    assert topo.facts["nvlink_gbps_per_link"] == {f"GPU{i}": 25.0 for i in range(8)}


def test_identity_a100_pcie_nvlink_inactive(fixture_path):
    text = _read(fixture_path, "nvsmi_a100_pcie_x2_nvlink_inactive.txt")
    assert sniff_nvsmi(text) and sniff_nvsmi_nvlink(text)
    topo = parse_nvsmi(text)
    assert [(d.name, d.model, d.pci_bus_id) for d in topo.devices] == [
        ("GPU0", "A100-PCIE-40GB", "0000:12:00.0"),
        ("GPU1", "A100-PCIE-40GB", "0000:8a:00.0"),
    ]
    assert topo.facts["persistence_mode"] == {"GPU0": "Off", "GPU1": "Off"}
    assert topo.facts["mig"] == {"GPU0": "Disabled", "GPU1": "Disabled"}
    assert topo.facts["power_limit_w"] == {"GPU0": 250, "GPU1": 250}
    # "all links are inActive" is zero active links, not missing information.
    assert topo.facts["nvlink_active"] == {"GPU0": 0, "GPU1": 0}
    assert "nvlink_gbps_per_link" not in topo.facts
    assert topo.facts["formats"] == ["nvsmi-nvlink", "nvsmi"]


def test_nvlink_inactive_links_and_list_gpus():
    # synthetic: one GPU with 2 of 4 links down, then `nvidia-smi -L` of the same box.
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n"
        "\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n\t Link 2: 26.562 GB/s\n\t Link 3: <inactive>\n"
        "$ nvidia-smi -L\n"
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
    )
    topo = parse_nvsmi_nvlink(text)
    assert topo.facts["nvlink_active"] == {"GPU0": 2}  # GPU1 came from -L: no NVLink information
    assert topo.facts["nvlink_gbps_per_link"] == {"GPU0": 26.562}
    assert topo.device("GPU1").model == "H100 80GB HBM3"
    assert parse_nvsmi(text).facts["formats"] == ["nvsmi-nvlink", "nvsmi"]


def test_query_gpu_csv():
    text = (  # synthetic, in the format of `nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv`
        "index, name, pci.bus_id\n"
        "0, NVIDIA H800, 00000000:18:00.0\n"
        "1, NVIDIA H800, 00000000:2A:00.0\n"
    )
    assert sniff_nvsmi(text)
    topo = parse_nvsmi(text)
    assert [(d.name, d.model, d.pci_bus_id) for d in topo.devices] == [
        ("GPU0", "H800", "0000:18:00.0"),
        ("GPU1", "H800", "0000:2a:00.0"),
    ]


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parse",
    [parse_nvsmi_topo, parse_nvsmi_topo_mp, parse_nvsmi_topo_p2p, parse_nvsmi_nvlink, parse_nvsmi],
)
def test_empty_input(parse):
    with pytest.raises(TopologyParseError, match=r"topo.txt:1: empty input"):
        parse("\n\n", "topo.txt")
    with pytest.raises(TopologyParseError, match="empty input"):
        parse("# source: header only\n", "topo.txt")


def test_row_with_missing_cells_names_line_and_count(fixture_path):
    lines = _read(fixture_path, "nvsmi_topo_h800_nv8_mlx5_bond.txt").splitlines()
    lines[5] = lines[5][:40]  # GPU2 row (file line 6) cut after a few cells
    with pytest.raises(TopologyParseError) as err:
        parse_nvsmi_topo("\n".join(lines), "h800.txt")
    assert err.value.line == 6 and err.value.path == "h800.txt"
    assert "17 columns" in str(err.value) and "GPU2" in str(err.value)


def test_truncated_matrix_missing_rows(fixture_path):
    lines = _read(fixture_path, "nvsmi_topo_l40s_x4_pcie_nic_numa_mismatch.txt").splitlines()
    text = "\n".join(lines[:5])  # header + GPU0..GPU2, then the capture ends
    with pytest.raises(TopologyParseError) as err:
        parse_nvsmi_topo(text, "l40s.txt")
    assert "GPU3, NIC0, NIC1" in str(err.value) and "truncated" in str(err.value)
    assert err.value.line == 6


def test_misaligned_row_is_rejected():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\t X \tNV4\t0-7\n"  # synthetic
    with pytest.raises(TopologyParseError, match="self cell X") as err:
        parse_nvsmi_topo(text)
    assert err.value.line == 3


def test_affinity_in_a_cell_is_rejected():
    # synthetic: GPU1 lost its NV4 cell, so the CPU list slides into the matrix.
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV4\tSYS\t0-7\t0\n"
        "GPU1\tNV4\t X \t0-7\t0\nGPU2\tSYS\tSYS\t X \t8-15\t1\n"
    )
    with pytest.raises(TopologyParseError, match="'0-7' is not a topology token") as err:
        parse_nvsmi_topo(text)
    assert err.value.line == 3


def test_wrong_section_and_random_text():
    with pytest.raises(TopologyParseError, match="no `nvidia-smi topo -m` output found"):
        parse_nvsmi_topo("GPU 0: NVIDIA A100 (UUID: GPU-1)\n")
    with pytest.raises(TopologyParseError, match="no `nvidia-smi nvlink -s` output"):
        parse_nvsmi_nvlink(SYNTHETIC_3GPU)
    random_text = "lorem ipsum\nGPU0 is fast\n1 2 3\n"
    assert not any(sniff(random_text) for _, sniff, _ in nvsmi.FORMATS)
    with pytest.raises(TopologyParseError):
        parse_nvsmi(random_text)


def test_sniffers_ignore_other_tools(fixture_path):
    for name in (
        "npusmi_topo_910b3_x8_hccs.txt",
        "ibstat_cx7_roce200_cx6dx_down_truncated.txt",
        "nccl_log_h100_2node_roce_gdrdma_p2pipc.txt",
        "nccltests_alltoall_perf_b300_1node_2node.txt",
        "lspci_nn_a100_nvswitch_vm.txt",
    ):
        text = _read(fixture_path, name)
        assert not any(sniff(text) for _, sniff, _ in nvsmi.FORMATS), name


def test_formats_contract():
    assert [name for name, _, _ in nvsmi.FORMATS] == [
        "nvsmi-topo-p2p",
        "nvsmi-topo-mp",
        "nvsmi-topo",
        "nvsmi-nvlink",
        "nvsmi",
    ]


@pytest.mark.parametrize(
    "name",
    [
        "nvsmi_topo_dgx_a100_mlx5x12.txt",
        "nvsmi_topo_h800_nv8_mlx5_bond.txt",
        "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt",
        "nvsmi_topo_mp_dgx1_v100_pcie_only.txt",
        "nvsmi_nvlink_status_a100_sxm4_8gpu.txt",
        "nvsmi_a100_pcie_x2_nvlink_inactive.txt",
    ],
)
def test_crlf_captures_sniff_and_parse_alike(fixture_path, name):
    text = _read(fixture_path, name)
    crlf = text.replace("\n", "\r\n")  # synthetic: the same capture saved on Windows
    assert [n for n, sniff, _ in nvsmi.FORMATS if sniff(crlf)] == [
        n for n, sniff, _ in nvsmi.FORMATS if sniff(text)
    ]
    for _fmt, sniff, parse in nvsmi.FORMATS:
        if sniff(text):
            assert parse(crlf).to_dict() == parse(text).to_dict()


def test_old_driver_table_and_windows_driver_model():
    # synthetic, in the r450 layout (name truncated with "...") and a Windows (WDDM) row.
    text = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 450.80.02    Driver Version: 450.80.02    CUDA Version: 11.0     |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|                               |                      |               MIG M. |
|===============================+======================+======================|
|   0  A100-SXM4-40GB      On   | 00000000:07:00.0 Off |                    0 |
| N/A   32C    P0    56W / 400W |      4MiB / 40537MiB |      0%      Default |
|                               |                      |              Enabled |
+-------------------------------+----------------------+----------------------+
|   1  Tesla V100-SXM2...  On   | 00000000:0F:00.0 Off |                    0 |
| N/A   32C    P0    41W / 300W |      0MiB / 16160MiB |      0%      Default |
|                               |                      |                  N/A |
+-------------------------------+----------------------+----------------------+
|   2  NVIDIA GeForce RTX 3090 WDDM  | 00000000:65:00.0  On |              N/A |
"""
    topo = parse_nvsmi(text)
    assert [(d.name, d.model, d.pci_bus_id) for d in topo.devices] == [
        ("GPU0", "A100-SXM4-40GB", "0000:07:00.0"),
        ("GPU1", "Tesla V100-SXM2", "0000:0f:00.0"),
        ("GPU2", "GeForce RTX 3090", "0000:65:00.0"),
    ]
    assert topo.facts["persistence_mode"] == {"GPU0": "On", "GPU1": "On"}
    assert topo.facts["mig"] == {"GPU0": "Enabled", "GPU1": "N/A"}
    assert topo.facts["power_limit_w"] == {"GPU0": 400, "GPU1": 300}


def test_driver_not_loaded_gets_its_own_message():
    text = (  # nvidia-smi's own message on a host without a loaded driver
        "$ nvidia-smi\n"
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
        "that the latest NVIDIA driver is installed and running.\n"
    )
    assert sniff_nvsmi(text)
    with pytest.raises(TopologyParseError, match="could not reach the driver") as err:
        parse_nvsmi(text, "smi.txt")
    assert err.value.line == 2


def test_damaged_nic_legend(fixture_path):
    text = _read(fixture_path, "nvsmi_topo_h100_nv18_12nic_ibdev2netdev.txt")
    damaged = text.replace("  NIC10: mlx5_10", "  NIC10: mlx5_1")  # a legend line cut short
    line = damaged.splitlines().index("  NIC10: mlx5_1") + 1
    with pytest.raises(TopologyParseError, match="names both NIC1 and NIC10 'mlx5_1'") as err:
        parse_nvsmi_topo(damaged, "h100.txt")
    assert err.value.line == line


def test_repeated_header_column():
    text = "\tGPU0\tGPU0\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU0\tNV4\t X \t0-7\n"  # synthetic, damaged
    with pytest.raises(TopologyParseError, match="names GPU0 more than once") as err:
        parse_nvsmi_topo(text)
    assert err.value.line == 1


@pytest.mark.parametrize(
    "name, parse",
    [
        ("nvsmi_topo_h800_nv8_mlx5_bond.txt", parse_nvsmi_topo),
        ("nvsmi_a100_pcie_x2_nvlink_inactive.txt", parse_nvsmi),
    ],
)
def test_every_truncation_parses_or_fails_cleanly(fixture_path, name, parse):
    """A capture cut at any line, or mid-line, gives a Topology or a TopologyParseError."""
    text = _read(fixture_path, name)
    cuts = [i for i, c in enumerate(text) if c == "\n"] + list(range(0, len(text), 211))
    for cut in cuts:
        try:
            parse(text[:cut], "cut.txt")
        except TopologyParseError as err:
            assert err.path == "cut.txt"


def test_query_gpu_csv_any_field_order():
    text = (  # synthetic: `--query-gpu=pci.bus_id,name,memory.total --format=csv`
        "pci.bus_id, name, memory.total [MiB]\n00000000:18:00.0, NVIDIA A800-SXM4-80GB, 81920 MiB\n"
    )
    assert sniff_nvsmi(text)
    assert [(d.model, d.pci_bus_id) for d in parse_nvsmi(text).devices] == [
        ("A800-SXM4-80GB", "0000:18:00.0")
    ]
    assert not sniff_nvsmi("a, b, c\n1, 2, 3\n")
    assert not sniff_nvsmi("name, value\nfoo, 1\n")


def test_models_in_the_same_capture_refine_link_bandwidth():
    # synthetic: `nvidia-smi -L` of a Blackwell box, then its topo -m. NV18 on B200 is NVLink5
    # (50 GB/s per link), which the matrix alone cannot tell from Hopper's 25 GB/s.
    text = (
        "GPU 0: NVIDIA B200 (UUID: GPU-0000)\nGPU 1: NVIDIA B200 (UUID: GPU-0001)\n"
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV18\t0-55\t0\nGPU1\tNV18\t X \t0-55\t0\n"
    )
    topo = parse_nvsmi_topo(text)
    assert topo.device("GPU0").model == "B200"
    assert topo.link("GPU0", "GPU1").gbps == nominal_gbps(LinkClass.NVLINK, "B200", num_nvlinks=18)
    assert topo.link("GPU0", "GPU1").gbps == 18 * 50 * 8
    bare = parse_nvsmi_topo(text.split("\n", 2)[2])  # the matrix alone
    assert bare.link("GPU0", "GPU1").gbps == 18 * 25 * 8


def test_p2p_read_and_write_matrices_space_separated():
    # synthetic, in the space-aligned layout some drivers and tools print: read is OK everywhere,
    # write is refused across the two switches; the pair is usable only if both are OK.
    text = """\
$ nvidia-smi topo -p2p r
P2P Connectivity Matrix
        GPU0  GPU1  GPU2
GPU0      X    OK    OK
GPU1     OK     X    OK
GPU2     OK    OK     X

$ nvidia-smi topo -p2p w
        GPU0    GPU1    GPU2
 GPU0   X       OK      CNS
 GPU1   OK      X       CNS
 GPU2   CNS     CNS     X

Legend:

  X    = Self
  OK   = Status Ok
  CNS  = Chipset not supported
"""
    assert sniff_nvsmi_topo_p2p(text) and not sniff_nvsmi_topo(text)
    topo = parse_nvsmi_topo_p2p(text)
    assert topo.facts["p2p"] == {"GPU0-GPU1": "OK", "GPU0-GPU2": "CNS", "GPU1-GPU2": "CNS"}
