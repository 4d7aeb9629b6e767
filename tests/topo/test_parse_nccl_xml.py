"""Tests for hetcomm.topo.parse.nccl_xml on the OCI H100 dump and synthetic XMLs."""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import LinkClass
from hetcomm.topo.parse import nccl_xml
from hetcomm.topo.parse.nccl_xml import cpu_mask_to_list, parse_nccl_xml, sniff_nccl_xml

FIXTURE = "nccl_topo_xml_oci_h100_8gpu_cx7.xml"


def _read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def test_oci_h100_devices(fixture_path):
    text = _read(fixture_path, FIXTURE)
    assert sniff_nccl_xml(text)
    topo = parse_nccl_xml(text, "h100.xml")
    gpus = topo.devices
    assert [d.name for d in gpus] == [f"GPU{i}" for i in range(8)]
    assert {(d.model, d.pci_device_id) for d in gpus} == {("H100-SXM5-80GB", "10de:2330")}
    assert gpus[0].pci_bus_id == "0000:0f:00.0" and gpus[7].pci_bus_id == "0000:d8:00.0"
    assert [d.numa for d in gpus] == [0] * 4 + [1] * 4
    # Affinity masks converted to the CPU-list form nvidia-smi prints.
    assert gpus[0].cpu_affinity == "0-55,112-167"
    assert gpus[4].cpu_affinity == "56-111,168-223"
    assert topo.facts["nvlink_active"] == {f"GPU{i}": 18 for i in range(8)}  # 5+5+4+4
    assert topo.facts["nvswitch_count"] == 4


def test_oci_h100_nics(fixture_path):
    topo = parse_nccl_xml(_read(fixture_path, FIXTURE))
    assert len(topo.nics) == 16
    mlx0 = topo.nic("mlx5_0")
    assert (mlx0.rate_gbps, mlx0.link_layer, mlx0.gdr, mlx0.port, mlx0.numa) == (
        180.0,
        "Ethernet",
        True,
        1,
        0,
    )
    assert mlx0.pci_bus_id == "0000:0c:00.0"
    assert topo.nic("mlx5_1").port == 2
    assert topo.nic("mlx5_17").numa == 1


def test_oci_h100_links(fixture_path):
    topo = parse_nccl_xml(_read(fixture_path, FIXTURE))
    assert len(topo.links) == 24 * 23 // 2  # 8 GPUs + 16 ports, each pair once
    for i in range(8):
        for j in range(i + 1, 8):
            link = topo.link(f"GPU{i}", f"GPU{j}")
            assert (link.link_class, link.raw) == (LinkClass.NVLINK, "NV18")
            assert link.gbps == nominal_gbps(LinkClass.NVLINK, "H100", num_nvlinks=18)
    # Each GPU shares one Broadcom PEX switch with one dual-port CX7: a 1:1 PIX rail.
    rails = {"GPU0": "mlx5_0", "GPU1": "mlx5_3", "GPU4": "mlx5_9", "GPU7": "mlx5_16"}
    for gpu in (f"GPU{i}" for i in range(8)):
        pix = [l for l in topo.links_of(gpu) if l.link_class == LinkClass.PCIE_PIX]
        assert len(pix) == 2, gpu  # both ports of its NIC
        if gpu in rails:
            assert rails[gpu] in {pix[0].a, pix[0].b, pix[1].a, pix[1].b}
    assert topo.link("GPU0", "mlx5_3").link_class == LinkClass.PCIE_PHB  # same CPU, other switch
    assert topo.link("GPU0", "mlx5_9").link_class == LinkClass.PCIE_SYS  # other CPU
    assert topo.link("mlx5_0", "mlx5_1").link_class == LinkClass.PCIE_PIX  # two ports of one card
    assert topo.facts["formats"] == ["nccl-xml"]


# synthetic: a 2-socket PCIe box; two GPUs bridged by NVLink (direct, tclass = GPU class) under one
# PLX switch, a third GPU behind a second switch level, and an InfiniBand HCA on the other socket.
SYNTHETIC = """\
<!-- source: synthetic (written for tests) -->
<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:40:00.0" class="0x060400" vendor="0x10b5" device="0x8796">
      <pci busid="0000:41:00.0" class="0x060400" vendor="0x10b5" device="0x8796">
        <pci busid="0000:43:00.0" class="0x030200" vendor="0x10de" device="0x20b1">
          <gpu dev="0" sm="80" rank="0" gdr="1">
            <nvlink target="0000:44:00.0" count="4" tclass="0x030200"/>
          </gpu>
        </pci>
      </pci>
      <pci busid="0000:42:00.0" class="0x060400" vendor="0x10b5" device="0x8796">
        <pci busid="0000:44:00.0" class="0x030200" vendor="0x10de" device="0x20b1">
          <gpu dev="1" sm="80" rank="1" gdr="1">
            <nvlink target="0000:43:00.0" count="4" tclass="0x030200"/>
          </gpu>
        </pci>
        <pci busid="0000:45:00.0" class="0x060400" vendor="0x1000" device="0xc010">
          <pci busid="0000:46:00.0" class="0x030200" vendor="0x10de" device="0x20b1">
            <gpu dev="2" sm="80" rank="2" gdr="1"/>
          </pci>
        </pci>
      </pci>
    </pci>
  </cpu>
  <cpu numaid="1" affinity="ffff0000" arch="x86_64" vendor="AuthenticAMD">
    <pci busid="0000:c1:00.0" class="0x020700" vendor="0x15b3" device="0x101b">
      <nic>
        <net name="mlx5_0" dev="0" speed="200000" port="1" gdr="0"/>
      </nic>
    </pci>
  </cpu>
</system>
"""


def test_synthetic_direct_nvlink_and_pcie_classes():
    topo = parse_nccl_xml(SYNTHETIC)
    assert topo.devices[0].model == "A100-PCIE-40GB"
    assert topo.devices[0].cpu_affinity == "0-15" and topo.devices[0].numa == 0
    nv = topo.link("GPU0", "GPU1")
    assert (nv.link_class, nv.raw, nv.gbps) == (LinkClass.NVLINK, "NV4", 4 * 25 * 8)
    assert topo.facts["nvswitch_count"] == 0
    assert topo.facts["nvlink_active"] == {"GPU0": 4, "GPU1": 4, "GPU2": 0}
    # GPU0 and GPU2 share the PLX switch, but GPU2 also sits behind a Broadcom switch: 2 switches.
    assert topo.link("GPU0", "GPU2").link_class == LinkClass.PCIE_PXB
    assert topo.link("GPU1", "GPU2").link_class == LinkClass.PCIE_PXB
    assert topo.link("GPU0", "mlx5_0").link_class == LinkClass.PCIE_SYS
    mlx = topo.nic("mlx5_0")
    assert (mlx.link_layer, mlx.rate_gbps, mlx.gdr, mlx.numa) == ("InfiniBand", 200.0, False, 1)


def test_cpu_mask_to_list():
    assert cpu_mask_to_list("000000ff,ffffffff") == "0-39"
    assert cpu_mask_to_list("00000005") == "0,2"
    assert cpu_mask_to_list("80000000,00000000") == "63"
    assert cpu_mask_to_list("00000000") is None
    assert cpu_mask_to_list("zz") is None


def test_truncated_xml_names_the_line(fixture_path):
    lines = _read(fixture_path, FIXTURE).splitlines()
    with pytest.raises(TopologyParseError, match="not well-formed XML") as err:
        parse_nccl_xml("\n".join(lines[:40]), "cut.xml")
    assert err.value.path == "cut.xml" and err.value.line is not None and err.value.line >= 40


def test_errors():
    with pytest.raises(TopologyParseError, match=r"x.xml:1: empty input"):
        parse_nccl_xml("<!-- source: only a header -->\n", "x.xml")
    with pytest.raises(TopologyParseError, match="root element is <graphs>"):
        parse_nccl_xml('<graphs version="1"><graph id="0"/></graphs>')
    with pytest.raises(TopologyParseError, match="no <gpu> and no <net>"):
        parse_nccl_xml('<system version="1"><cpu numaid="0"/></system>')
    with pytest.raises(TopologyParseError, match="dev='x'"):
        parse_nccl_xml(
            '<system><cpu numaid="0"><pci busid="0000:01:00.0" class="0x030200">'
            '<gpu dev="x"/></pci></cpu></system>'
        )
    with pytest.raises(TopologyParseError, match="count='many'"):
        parse_nccl_xml(
            '<system><cpu numaid="0"><pci busid="0000:01:00.0" class="0x030200">'
            '<gpu dev="0"><nvlink target="0000:02:00.0" count="many" tclass="0x068000"/>'
            "</gpu></pci></cpu></system>"
        )
    two_gpu0 = (
        '<system><cpu numaid="0"><pci busid="0000:01:00.0" class="0x030200"><gpu dev="0"/></pci>'
        '<pci busid="0000:02:00.0" class="0x030200"><gpu dev="0"/></pci></cpu></system>'
    )
    with pytest.raises(TopologyParseError, match="GPU0 appear"):
        parse_nccl_xml(two_gpu0)
    assert not sniff_nccl_xml("<html><body>system</body></html>")


def test_formats_contract():
    assert [name for name, _, _ in nccl_xml.FORMATS] == ["nccl-xml"]


def test_every_truncation_fails_cleanly(fixture_path):
    text = _read(fixture_path, FIXTURE)
    for cut in range(0, len(text) - 20, 211):  # any cut before </system> is malformed XML
        with pytest.raises(TopologyParseError) as err:
            parse_nccl_xml(text[:cut], "cut.xml")
        assert err.value.path == "cut.xml"
