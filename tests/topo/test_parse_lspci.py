"""Tests for hetcomm.topo.parse.lspci: ``lspci -nn`` and the nv-fabricmanager log."""

from __future__ import annotations

import pytest

from hetcomm.errors import TopologyParseError
from hetcomm.topo.bandwidth import is_sxm_model
from hetcomm.topo.parse import lspci
from hetcomm.topo.parse.lspci import (
    normalize_bus_id,
    parse_fabricmanager_log,
    parse_lspci,
    sniff_fabricmanager_log,
    sniff_lspci,
)


def _read(fixture_path, name: str) -> str:
    with open(fixture_path(name), encoding="utf-8") as f:
        return f.read()


def test_a100_nvswitch_vm(fixture_path):
    text = _read(fixture_path, "lspci_nn_a100_nvswitch_vm.txt")
    assert sniff_lspci(text)
    topo = parse_lspci(text, "lspci.txt")
    gpus = topo.devices
    assert [d.name for d in gpus] == [f"GPU{i}" for i in range(8)]
    assert {(d.model, d.pci_device_id, d.vendor) for d in gpus} == {
        ("A100-SXM4-80GB", "10de:20b2", "nvidia")
    }
    assert [d.pci_bus_id for d in gpus][:5] == [
        "0001:00:00.0",
        "0002:00:00.0",
        "0003:00:00.0",
        "0004:00:00.0",
        "000b:00:00.0",
    ]
    assert all(is_sxm_model(d.model) for d in gpus)
    assert topo.facts["form_factor"] == {f"GPU{i}": "SXM" for i in range(8)}
    assert topo.facts["nvswitch_count"] == 6
    # 8 ConnectX-6 VFs (Infiniband controller) + 1 ConnectX-4 Lx VF (Ethernet); no NVMe.
    assert len(topo.nics) == 9
    assert sum(n.link_layer == "InfiniBand" for n in topo.nics) == 8
    assert topo.nic("c941:00:02.0").link_layer == "Ethernet"
    assert topo.facts["nic_models"]["0101:00:00.0"] == "ConnectX-6 VF (15b3:101c)"
    assert topo.links == []
    assert topo.facts["formats"] == ["lspci"] and topo.facts["sources"] == ["lspci.txt"]


# synthetic: a bare-metal PCIe A100 box (no domain printed), a GeForce card with its audio
# function, an H100 HGX part with an NVSwitch, an Ascend 910B, an EFA and `-v` detail lines.
SYNTHETIC = """\
17:00.0 3D controller [0302]: NVIDIA Corporation GA100 [A100 PCIe 40GB] [10de:20b1] (rev a1)
\tSubsystem: NVIDIA Corporation Device [10de:145f]
\tKernel driver in use: nvidia
65:00.0 VGA compatible controller [0300]: NVIDIA Corporation AD102 [GeForce RTX 4090] [10de:2684] (rev a1)
65:00.1 Audio device [0403]: NVIDIA Corporation AD102 High Definition Audio Controller [10de:22ba] (rev a1)
18:00.0 3D controller [0302]: NVIDIA Corporation GH100 [H100 SXM5 80GB] [10de:2330] (rev a1)
07:00.0 Bridge [0680]: NVIDIA Corporation GH100 [H100 NVSwitch] [10de:22a3] (rev a1)
c1:00.0 Processing accelerators [1200]: Huawei Technologies Co., Ltd. Device [19e5:d802] (rev 20)
3b:00.0 RAID bus controller [0104]: Huawei Technologies Co., Ltd. Device [19e5:3758] (rev 01)
10:1c.0 Ethernet controller [0200]: Amazon.com, Inc. Elastic Fabric Adapter (EFA) [1d0f:efa1]
29:00.0 Infiniband controller [0207]: Mellanox Technologies MT2910 Family [ConnectX-7] [15b3:1021]
2a:00.0 3D controller [0302]: NVIDIA Corporation Device [10de:29ff] (rev a1)
"""


def test_synthetic_mix_of_parts():
    assert sniff_lspci(SYNTHETIC)
    topo = parse_lspci(SYNTHETIC)
    gpus = [d for d in topo.devices if d.vendor == "nvidia"]
    assert [(d.name, d.model, d.pci_bus_id) for d in gpus] == [
        ("GPU0", "A100-PCIE-40GB", "0000:17:00.0"),
        ("GPU1", "GeForce RTX 4090", "0000:65:00.0"),  # its audio function is not a GPU
        ("GPU2", "H100-SXM5-80GB", "0000:18:00.0"),
        ("GPU3", None, "0000:2a:00.0"),  # an id this table does not know: no model invented
    ]
    assert topo.facts["form_factor"] == {"GPU0": "PCIe", "GPU1": "PCIe", "GPU2": "SXM"}
    assert not is_sxm_model(gpus[0].model)
    assert topo.facts["nvswitch_count"] == 1
    npus = [d for d in topo.devices if d.vendor == "ascend"]
    assert [(d.name, d.model, d.pci_device_id) for d in npus] == [("NPU0", "910B", "19e5:d802")]
    assert topo.nic("0000:10:1c.0").link_layer is None
    assert topo.facts["nic_models"]["0000:10:1c.0"].startswith("EFA")
    assert topo.nic("0000:29:00.0").link_layer == "InfiniBand"


def test_plain_lspci_without_ids_is_read_when_asked():
    text = "3d:00.0 Processing accelerators: Huawei Technologies Co., Ltd. Device d801 (rev 20)\n"  # synthetic
    assert not sniff_lspci(text)  # no [vendor:device] ids: left to the Ascend parser's sniffer
    topo = parse_lspci(text)
    assert [(d.name, d.model, d.pci_device_id) for d in topo.devices] == [
        ("NPU0", "910A", "19e5:d801")
    ]


def test_no_gpu_no_switch_means_zero_switches_only_when_nvidia_seen():
    topo = parse_lspci(
        "17:00.0 3D controller [0302]: NVIDIA Corporation Device [10de:20b5]\n"
    )  # synthetic
    assert topo.facts["nvswitch_count"] == 0
    assert topo.devices[0].model == "A100-PCIE-80GB"
    topo = parse_lspci(
        "29:00.0 Ethernet controller [0200]: Mellanox Technologies Device [15b3:101d]\n"
    )
    assert "nvswitch_count" not in topo.facts


def test_errors():
    with pytest.raises(TopologyParseError, match=r"pci.txt:1: empty input"):
        parse_lspci("", "pci.txt")
    with pytest.raises(TopologyParseError, match="no lspci line of an NVIDIA") as err:
        parse_lspci(
            "# source: x\n00:1f.2 SATA controller [0106]: Intel Corporation Device [8086:a102]\n",
            "pci.txt",
        )
    assert err.value.line == 2
    assert not sniff_lspci("00:1f.2 SATA controller [0106]: Intel Corporation Device [8086:a102]\n")


@pytest.mark.parametrize(
    "raw, want",
    [
        ("00000000:8A:00.0", "0000:8a:00.0"),
        ("17:00.0", "0000:17:00.0"),
        ("0000:0f:00.0", "0000:0f:00.0"),
        ("0101:00:00.0", "0101:00:00.0"),
    ],
)
def test_normalize_bus_id(raw, want):
    assert normalize_bus_id(raw) == want


# -- fabric manager log ------------------------------------------------------------------------------


def test_fabricmanager_log_fixture(fixture_path):
    text = _read(fixture_path, "fabricmanager_log_nvls_multicast.txt")
    assert sniff_fabricmanager_log(text) and not sniff_lspci(text)
    topo = parse_fabricmanager_log(text, "fm.log")
    assert topo.facts["fabric_manager"] == "running"  # it served multicast team requests
    assert topo.facts["fabric_manager_errors"] == [
        (
            "fm.log:101: detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus id "
            "00000000:86:00.0 physical id 3 port 61"
        )
    ]
    assert topo.facts["formats"] == ["fabricmanager-log"]


def test_fabricmanager_stopped():
    text = (  # synthetic lifecycle: started, then exited
        "[Mar 01 2025 10:00:00] [INFO] [tid 100] Successfully configured all the available GPUs and "
        "NVSwitches to route NVLink traffic.\n"
        "[Mar 01 2025 11:00:00] [ERROR] [tid 100] Fabric Manager is exiting due to a fatal error\n"
    )
    topo = parse_fabricmanager_log(text)
    assert topo.facts["fabric_manager"] == "not-running"
    assert len(topo.facts["fabric_manager_errors"]) == 1
    started_only = text.splitlines()[0]
    assert parse_fabricmanager_log(started_only).facts["fabric_manager"] == "running"


def test_fabricmanager_errors():
    with pytest.raises(TopologyParseError, match="no fabric-manager log line"):
        parse_fabricmanager_log("hello\n", "fm.log")
    assert not sniff_fabricmanager_log("[INFO] something about NVSwitch\n")


def test_formats_contract():
    assert [name for name, _, _ in lspci.FORMATS] == ["lspci", "fabricmanager-log"]


def test_every_truncation_parses_or_fails_cleanly(fixture_path):
    for name, parse in (
        ("lspci_nn_a100_nvswitch_vm.txt", parse_lspci),
        ("fabricmanager_log_nvls_multicast.txt", parse_fabricmanager_log),
    ):
        text = _read(fixture_path, name)
        for cut in range(0, len(text), 53):
            try:
                parse(text[:cut], "cut.txt")
            except TopologyParseError as err:
                assert err.path == "cut.txt"
