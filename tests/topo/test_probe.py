"""Live probes: this machine for real, and prepared sysfs trees read by the same code.

The prepared trees are real directories, files and symlinks in ``tmp_path`` laid out as the
kernel lays out ``/sys``; ``probe_local(sysfs_root=...)`` reads them exactly as it reads ``/``.
NVML and npu-smi cannot run on a machine without NVIDIA/Ascend hardware, so their tests use a
stand-in ``pynvml`` module and a stand-in ``npu-smi`` executable that prints a real captured
output; the ``gpu``-marked test runs the real NVML where a GPU exists.
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import types

import pytest

from hetcomm.topo import probe
from hetcomm.topo.audit import audit
from hetcomm.topo.model import LinkClass
from hetcomm.topo.probe import local_vendors, pcie_path_class, probe_local


# -- a sysfs tree builder ------------------------------------------------------------------


class SysTree:
    """Builds ``sys/`` and ``proc/`` under a root the way Linux lays them out."""

    def __init__(self, root) -> None:
        self.root = root
        self._write("proc/sys/kernel/hostname", "gpu-node-7\n")
        self._write("proc/meminfo", "MemTotal:       2097152 kB\nMemFree:  1 kB\n")
        self._write("proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU 9000\n")
        self._write("sys/devices/system/cpu/online", "0-15\n")
        self._write("sys/devices/system/node/node0/cpulist", "0-7\n")
        self._write("sys/devices/system/node/node1/cpulist", "8-15\n")

    def _write(self, rel: str, text: str) -> str:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def pci(
        self, chain, vendor: str, device: str, pci_class: str, numa: int = -1, cpulist: str = ""
    ) -> str:
        """A PCI function at ``sys/devices/pci0000:xx/<bridges...>/<bdf>`` (last of ``chain``)."""
        rel = os.path.join("sys/devices", *chain)
        for key, value in (
            ("vendor", f"0x{vendor}"),
            ("device", f"0x{device}"),
            ("class", pci_class),
            ("numa_node", str(numa)),
            ("local_cpulist", cpulist),
        ):
            self._write(os.path.join(rel, key), value + "\n")
        bdf = chain[-1]
        link = os.path.join(self.root, "sys/bus/pci/devices", bdf)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.join(self.root, rel), link)
        return os.path.join(self.root, rel)

    def ib(
        self, name: str, pci_dir: str, rate: str, layer: str, state: str, netdev: str = ""
    ) -> None:
        base = os.path.join(self.root, "sys/class/infiniband", name)
        os.makedirs(base, exist_ok=True)
        os.symlink(pci_dir, os.path.join(base, "device"))
        for key, value in (("rate", rate), ("link_layer", layer), ("state", state)):
            self._write(f"sys/class/infiniband/{name}/ports/1/{key}", value + "\n")
        if netdev:
            os.makedirs(os.path.join(pci_dir, "net", netdev), exist_ok=True)

    def peermem(self) -> None:
        self._write("sys/module/nvidia_peermem/version", "1.0\n")


@pytest.fixture
def hgx_tree(tmp_path):
    """Two sockets. Socket 0: one PCIe switch with GPU0, GPU1 and mlx5_0 (a 1:1-ish rail).
    Socket 1: GPU2 on its own root port, mlx5_1 on another root complex of the same NUMA node,
    an NVSwitch, and a GPU whose NUMA node the kernel does not know is not here (see below)."""
    t = SysTree(str(tmp_path))
    sw0 = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]  # root port, switch upstream port
    gpu0 = t.pci(sw0 + ["0000:02:00.0", "0000:03:00.0"], "10de", "20b2", "0x030200", 0, "0-7")
    gpu1 = t.pci(sw0 + ["0000:02:01.0", "0000:04:00.0"], "10de", "20b2", "0x030200", 0, "0-7")
    nic0 = t.pci(sw0 + ["0000:02:02.0", "0000:05:00.0"], "15b3", "1021", "0x020700", 0, "0-7")
    t.pci(["pci0000:80", "0000:80:01.0", "0000:81:00.0"], "10de", "2331", "0x030200", 1, "8-15")
    nic1 = t.pci(
        ["pci0000:a0", "0000:a0:01.0", "0000:a1:00.0"], "15b3", "1021", "0x020000", 1, "8-15"
    )
    t.pci(["pci0000:c0", "0000:c0:00.0"], "10de", "1af1", "0x068000", 1)
    t.pci(["pci0000:c0", "0000:c0:01.0"], "8086", "0001", "0x060400", 1)  # ignored vendor
    t.ib("mlx5_0", nic0, "400 Gb/sec (4X NDR)", "InfiniBand", "4: ACTIVE", netdev="ibp5s0")
    t.ib("mlx5_1", nic1, "200 Gb/sec (4X HDR)", "Ethernet", "1: DOWN")
    t.peermem()
    assert gpu0 and gpu1
    return t


# -- PCIe path classes ---------------------------------------------------------------------


def test_pcie_path_class_follows_nvidia_smi_levels():
    sw = ["0000:00:01.0", "0000:01:00.0"]
    a = ("pci0000:00", sw + ["0000:02:00.0"])
    b = ("pci0000:00", sw + ["0000:02:01.0"])
    assert pcie_path_class(a, b, 0, 0) == LinkClass.PCIE_PIX
    # Same function's sibling (two ports of one NIC): same bridges.
    assert pcie_path_class(a, a, 0, 0) == LinkClass.PCIE_PIX
    # A second switch level below the common bridge: PXB.
    deep = ("pci0000:00", sw + ["0000:02:03.0", "0000:06:00.0", "0000:07:00.0"])
    assert pcie_path_class(a, deep, 0, 0) == LinkClass.PCIE_PXB
    # Same root complex, different root ports: host bridge.
    other_port = ("pci0000:00", ["0000:00:02.0"])
    assert pcie_path_class(a, other_port, 0, 0) == LinkClass.PCIE_PHB
    # Different root complexes: NODE on one NUMA node, SYS across (or when unknown).
    far = ("pci0000:80", ["0000:80:01.0"])
    assert pcie_path_class(a, far, 0, 0) == LinkClass.PCIE_NODE
    assert pcie_path_class(a, far, 0, 1) == LinkClass.PCIE_SYS
    assert pcie_path_class(a, far, None, None) == LinkClass.PCIE_SYS
    assert pcie_path_class(None, far, 1, 1) == LinkClass.PCIE_NODE


# -- prepared trees ------------------------------------------------------------------------


def test_probe_reads_gpus_nics_links_and_gdr_from_sysfs(hgx_tree):
    topo = probe_local(sysfs_root=hgx_tree.root)
    host = topo.facts["host"]
    assert host["hostname"] == "gpu-node-7"
    assert host["cpus"] == 16 and host["numa_nodes"] == 2
    assert host["memory_bytes"] == 2097152 * 1024
    assert host["cpu_model"] == "Test CPU 9000"

    gpus = {d.name: d for d in topo.devices}
    assert sorted(gpus) == ["GPU0", "GPU1", "GPU2"]  # bus order; no cpu0 when GPUs exist
    assert gpus["GPU0"].model == "A100-SXM4-80GB" and gpus["GPU0"].pci_device_id == "10de:20b2"
    assert gpus["GPU2"].model == "H100-PCIE-80GB" and gpus["GPU2"].numa == 1
    assert gpus["GPU0"].cpu_affinity == "0-7" and gpus["GPU0"].host == "gpu-node-7"
    assert topo.facts["nvswitch_count"] == 1

    mlx0, mlx1 = topo.nic("mlx5_0"), topo.nic("mlx5_1")
    assert (mlx0.link_layer, mlx0.rate_gbps, mlx0.state, mlx0.numa) == (
        "InfiniBand",
        400.0,
        "Active",
        0,
    )
    assert mlx0.netdev == "ibp5s0" and mlx0.pci_bus_id == "0000:05:00.0"
    assert (mlx1.link_layer, mlx1.rate_gbps, mlx1.state) == ("Ethernet", 200.0, "Down")
    assert topo.facts["peermem"] is True and mlx0.gdr is True

    assert topo.link("GPU0", "GPU1").link_class == LinkClass.PCIE_PIX
    assert topo.link("GPU0", "mlx5_0").link_class == LinkClass.PCIE_PIX
    assert topo.link("GPU0", "GPU2").link_class == LinkClass.PCIE_SYS
    assert topo.link("GPU2", "mlx5_1").link_class == LinkClass.PCIE_NODE
    assert topo.link("GPU0", "GPU2").raw == "SYS"
    assert topo.facts["formats"] == ["live-probe"]
    # Without NVML the GPU pairs are a PCIe view (NVLink invisible), as with `topo -mp`.
    assert topo.facts["pcie_view"] is True


def test_probe_then_audit_a_gpu_box_without_peermem(hgx_tree):
    os.remove(os.path.join(hgx_tree.root, "sys/module/nvidia_peermem/version"))
    topo = probe_local(sysfs_root=hgx_tree.root)
    assert topo.facts["peermem"] is False and topo.nic("mlx5_0").gdr is False
    found = [(f.code, f.subject) for f in audit(topo)]
    assert ("no-gdr", "mlx5_0, mlx5_1") in found
    assert ("rdma-port-down", "mlx5_1") in found
    # GPU0 (socket 0, NIC mlx5_0 under its switch) is fine; GPU2 (socket 1) has mlx5_1 on NODE.
    assert not [c for c, _ in found if c in ("nic-numa-mismatch", "pcie-not-sxm", "numa-unknown")]


def test_probe_then_audit_rdma_nics_on_a_host_without_gpus(tmp_path):
    t = SysTree(str(tmp_path))
    nic = t.pci(["pci0000:00", "0000:00:01.0", "0000:01:00.0"], "15b3", "1021", "0x020700", 0)
    t.ib("mlx5_0", nic, "200 Gb/sec (4X HDR)", "InfiniBand", "4: ACTIVE")
    topo = probe_local(sysfs_root=str(tmp_path))
    assert [d.name for d in topo.devices] == ["cpu0"] and topo.nic("mlx5_0").gdr is None
    assert audit(topo) == []


def test_probe_of_a_cpu_only_tree_reports_the_host(tmp_path):
    SysTree(str(tmp_path))
    topo = probe_local(sysfs_root=str(tmp_path))
    assert [d.name for d in topo.devices] == ["cpu0"]
    cpu0 = topo.devices[0]
    assert (cpu0.vendor, cpu0.model, cpu0.cpu_affinity) == ("cpu", "Test CPU 9000", "0-15")
    assert "peermem" not in topo.facts  # no NVIDIA GPU: GPUDirect RDMA is not a question
    notes = " | ".join(topo.facts["probe_notes"])
    assert "no sys/class/infiniband" in notes and "CPU-only host" in notes
    assert local_vendors(str(tmp_path)) == set()


def test_probe_survives_missing_and_unreadable_files(tmp_path):
    t = SysTree(str(tmp_path))
    gpu = t.pci(
        ["pci0000:00", "0000:00:01.0", "0000:01:00.0"], "10de", "20b2", "0x030200", -1, "0-15"
    )
    os.remove(os.path.join(gpu, "numa_node"))
    broken = t.pci(["pci0000:00", "0000:00:02.0", "0000:02:00.0"], "10de", "20b2", "0x030200")
    os.remove(os.path.join(broken, "class"))
    os.remove(os.path.join(str(tmp_path), "proc/meminfo"))
    os.makedirs(os.path.join(str(tmp_path), "sys/class/infiniband/mlx5_9"))  # no ports, no device
    topo = probe_local(sysfs_root=str(tmp_path))
    assert [d.name for d in topo.devices] == ["GPU0"]
    assert topo.devices[0].numa is None  # numa_node missing (as if -1): unknown, not 0
    notes = " | ".join(topo.facts["probe_notes"])
    assert "0000:02:00.0: unreadable vendor/device/class" in notes
    assert "MemTotal" in notes and "mlx5_9: no ports" in notes
    assert topo.facts["host"]["memory_bytes"] is None
    assert local_vendors(str(tmp_path)) == {"nvidia"}


def test_probe_of_an_empty_root_does_not_crash(tmp_path):
    topo = probe_local(sysfs_root=str(tmp_path))
    assert [d.vendor for d in topo.devices] == ["cpu"]
    assert any("sys/bus/pci/devices" in n for n in topo.facts["probe_notes"])


# -- this machine --------------------------------------------------------------------------


def test_probe_of_this_machine_never_crashes():
    topo = probe_local()
    host = topo.facts["host"]
    assert host["hostname"] == socket.gethostname()
    assert host["cpus"] and host["cpus"] >= 1
    assert host["memory_bytes"] and host["memory_bytes"] > 0
    if not local_vendors():
        assert [d.name for d in topo.devices] == ["cpu0"]
        assert topo.links == []
    topo.to_dict()  # serialisable


# -- NVML (stand-in module: NVML cannot run without an NVIDIA driver) -------------------------


class _NVMLError(Exception):
    pass


def _fake_pynvml(init_fails: bool = False) -> types.ModuleType:
    """A module with pynvml's names and semantics for 4 GPUs.

    GPU0 and GPU1 are joined by 4 direct NVLinks; GPU2 and GPU3 have no NVLink, a SYS common
    ancestor, and P2P status GNS. nvmlDeviceGetP2PStatus rejects a tuple index the way the ctypes
    call does with nvidia-ml-py 13.615.71's ``NVML_P2P_CAPS_INDEX_READ = (0,)``.
    """
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 18
    m.NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    m.NVML_P2P_CAPS_INDEX_READ = (0,)
    buses = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:9A:00.0", "00000000:AB:00.0"]
    calls = {"shutdown": 0}

    def init():
        if init_fails:
            raise _NVMLError("NVML Shared Library Not Found")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    m.calls = calls
    m.nvmlDeviceGetCount = lambda: 4
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3" if h < 2 else "NVIDIA H100 PCIe"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=buses[h].encode(), pciDeviceId=0x233010DE if h < 2 else 0x233110DE
    )
    m.nvmlDeviceGetNumaNodeId = lambda h: 0 if h < 2 else 1
    m.nvmlDeviceGetCpuAffinity = lambda h, n: [0x00FF] if h < 2 else [0xFF00]

    def nvlink_state(h, link):
        if link >= 4:
            raise _NVMLError("Not Supported")
        return 1 if h < 2 else 0

    m.nvmlDeviceGetNvLinkState = nvlink_state
    m.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: 0
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(busId=buses[1 - h])
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10 if {a, b} == {0, 1} else 50

    def p2p(a, b, index):
        if not isinstance(index, int):
            raise TypeError("an integer is required (got type tuple)")
        return 2 if {a, b} == {2, 3} else 0

    m.nvmlDeviceGetP2PStatus = p2p
    return m


def test_nvml_probe_reads_names_nvlink_levels_and_p2p(monkeypatch):
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    notes: list = []
    topo = probe.Topology()
    assert probe._probe_nvml(topo, "node", 16, notes) is True
    assert fake.calls["shutdown"] == 1
    g0, g2 = topo.device("GPU0"), topo.device("GPU2")
    assert g0.model == "H100 80GB HBM3" and g0.pci_bus_id == "0000:18:00.0"
    assert g0.pci_device_id == "10de:2330" and g0.numa == 0 and g0.cpu_affinity == "0-7"
    assert g2.cpu_affinity == "8-15" and g2.numa == 1
    nv = topo.link("GPU0", "GPU1")
    assert (nv.link_class, nv.raw, nv.source) == (LinkClass.NVLINK, "NV4", "nvml")
    assert topo.link("GPU2", "GPU3").link_class == LinkClass.PCIE_SYS
    assert topo.link("GPU0", "GPU2").raw == "SYS"
    assert topo.facts["nvlink_active"] == {"GPU0": 4, "GPU1": 4, "GPU2": 0, "GPU3": 0}
    assert topo.facts["p2p"]["GPU2-GPU3"] == "GNS" and topo.facts["p2p"]["GPU0-GPU1"] == "OK"


def test_nvml_init_failure_is_a_note_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_fails=True))
    topo = probe_local()
    assert any("nvmlInit failed" in n for n in topo.facts["probe_notes"])


def test_without_nvidia_ml_py_the_probe_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    topo = probe_local()
    assert any("nvidia-ml-py not installed" in n for n in topo.facts["probe_notes"])


@pytest.mark.gpu
def test_real_nvml_names_every_cuda_gpu():
    pynvml = pytest.importorskip("pynvml")
    import torch

    topo = probe_local()
    gpus = [d for d in topo.devices if d.vendor == "nvidia"]
    assert len(gpus) == torch.cuda.device_count()
    assert "probe:nvml" in topo.facts["sources"]
    assert all(d.model for d in gpus)
    del pynvml


# -- npu-smi (stand-in executable printing a real capture) ----------------------------------


def _install_npu_smi(tmp_path, monkeypatch, body: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "npu-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def test_npu_smi_output_is_parsed_into_npus(tmp_path, monkeypatch, fixture_path):
    topo_fixture = fixture_path("npusmi_topo_910b3_x8_hccs.txt")
    info_fixture = fixture_path("npusmi_info_910b3_x8.txt")
    # The captures' first line is a provenance header (and the topo one has a shell prompt);
    # the stand-in prints the tool output only, as the real npu-smi would.
    body = (
        f'if [ "$2" = "-t" ]; then tail -n +3 "{topo_fixture}"; '
        f'else tail -n +3 "{info_fixture}"; fi\n'
    )
    _install_npu_smi(tmp_path, monkeypatch, body)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo = probe_local()
    npus = [d for d in topo.devices if d.vendor == "ascend"]
    assert len(npus) == 8
    assert topo.link("NPU0", "NPU7").link_class == LinkClass.HCCS
    assert "probe:npu-smi" in topo.facts["sources"]
    assert not any(d.name == "cpu0" for d in topo.devices)


@pytest.mark.timeout(30)
def test_npu_smi_that_hangs_times_out_with_a_note(tmp_path, monkeypatch):
    _install_npu_smi(tmp_path, monkeypatch, "exec sleep 30\n")
    monkeypatch.setattr(probe, "_NPU_SMI_TIMEOUT_S", 0.5)
    topo = probe_local(use_nvml=False)
    notes = " | ".join(topo.facts["probe_notes"])
    assert "timed out after" in notes
    assert [d.name for d in topo.devices] == ["cpu0"]


def test_npu_smi_failing_is_a_note(tmp_path, monkeypatch):
    _install_npu_smi(tmp_path, monkeypatch, "echo 'dcmi module initialize failed' >&2; exit 3\n")
    topo = probe_local(use_nvml=False)
    assert any("exited 3" in n and "dcmi" in n for n in topo.facts["probe_notes"])
