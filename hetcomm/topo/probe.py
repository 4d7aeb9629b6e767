"""Live probes: the topology of the machine this process runs on.

:func:`probe_local` reads what the machine itself exposes, cheapest and most reliable first:

1. the host (``/proc``, ``/sys/devices/system``): hostname, online CPUs, NUMA nodes, memory;
2. PCI sysfs (``/sys/bus/pci/devices``): NVIDIA GPUs (vendor ``10de``, class ``0x03xx``),
   NVSwitch bridges (``10de`` class ``0x0680``), Ascend NPUs (``19e5``), their NUMA nodes and the
   PCIe path class between every pair, computed from the bridge chain the way NCCL and
   ``nvidia-smi topo -m`` do (topology-notes §7);
3. RDMA sysfs (``/sys/class/infiniband/*/ports/*``): link layer, rate, state, NUMA;
4. GPUDirect RDMA: the three peer-memory paths NCCL itself checks (``net_ib/gdr.cc``);
5. NVML through ``nvidia-ml-py`` when it imports and ``nvmlInit`` works: names, PCI ids, NUMA,
   CPU affinity, common-ancestor levels, NVLink state and remote type, P2P status;
6. ``npu-smi`` when it is on ``PATH`` (``npu-smi info`` and ``npu-smi info -t topo``), fed to
   the parsers of ``hetcomm.topo.parse``.

Every step catches its own expected failures (a missing file, no permission, a tool that times
out, a library that is not there) and records a note in ``facts["probe_notes"]``; a machine
with none of these (a CPU-only host) yields one ``cpu0`` device and the host facts.

The file-system root is a parameter (``sysfs_root``), so that the same code can read a tree built
in a temporary directory: tests do that instead of replacing functions.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
from typing import Dict, List, Optional, Sequence, Set, Tuple

from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import Device, Link, LinkClass, Nic, Topology
from hetcomm.topo.pci_ids import (
    ASCEND_IDS,
    NVIDIA_GPU_IDS,
    PCI_VENDOR_HUAWEI,
    PCI_VENDOR_NVIDIA,
)

__all__ = [
    "probe_local",
    "local_vendors",
    "pcie_path_class",
    "PEERMEM_PATHS",
]

PCI_VENDOR_MELLANOX = "15b3"

# The paths NCCL's gdr.cc accepts as "GPUDirect RDMA possible" (topology-notes §3.2).
PEERMEM_PATHS = (
    "sys/module/nvidia_peermem/version",
    "sys/kernel/mm/memory_peers/nv_mem/version",
    "sys/kernel/mm/memory_peers/nv_mem_nc/version",
)
# NVML topology levels -> classes (pynvml NVML_TOPOLOGY_*; topology-notes §1.2). INTERNAL (0) is
# two GPUs on one board, which nvidia-smi prints as PIX.
_NVML_LEVELS = {
    0: LinkClass.PCIE_PIX,
    10: LinkClass.PCIE_PIX,
    20: LinkClass.PCIE_PXB,
    30: LinkClass.PCIE_PHB,
    40: LinkClass.PCIE_NODE,
    50: LinkClass.PCIE_SYS,
}
_CLASS_TOKEN = {
    LinkClass.PCIE_PIX: "PIX",
    LinkClass.PCIE_PXB: "PXB",
    LinkClass.PCIE_PHB: "PHB",
    LinkClass.PCIE_NODE: "NODE",
    LinkClass.PCIE_SYS: "SYS",
}
# nvmlGpuP2PStatus_t -> the tokens `nvidia-smi topo -p2p` prints (topology-notes §1.1, §7).
_P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DR", 5: "NS", 6: "U"}
# /sys/class/infiniband/*/ports/*/state is "<n>: <NAME>"; report it as ibstat does.
_IB_STATES = {
    "DOWN": "Down",
    "INIT": "Initializing",
    "ARMED": "Armed",
    "ACTIVE": "Active",
    "ACTIVE_DEFER": "Active",
}
_NPU_SMI_TIMEOUT_S = 10.0
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


# -- small readers --------------------------------------------------------------------------


def _join(root: str, rel: str) -> str:
    return os.path.join(root, rel.lstrip("/"))


def _read(path: str) -> Optional[str]:
    """The stripped contents of ``path``, or None when it cannot be read (missing, no access)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _parse_cpulist(text: Optional[str]) -> Optional[List[int]]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; None for empty or malformed text."""
    if not text:
        return None
    cpus: List[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = part.split("-", 1)
                cpus.extend(range(int(lo), int(hi) + 1))
            else:
                cpus.append(int(part))
    except ValueError:
        return None
    return cpus


def _format_cpulist(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (the kernel's own list format)."""
    out, cpus = [], sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def _numa(value: Optional[int]) -> Optional[int]:
    """sysfs ``numa_node`` is -1 when the kernel does not know it."""
    return value if value is not None and value >= 0 else None


def _norm_bdf(bus_id: str) -> str:
    """NVML's ``00000000:18:00.0`` and sysfs's ``0000:18:00.0`` -> ``0000:18:00.0``."""
    bus_id = bus_id.strip().lower()
    domain, rest = bus_id.split(":", 1) if bus_id.count(":") == 2 else ("0000", bus_id)
    return f"{int(domain, 16):04x}:{rest}"


# -- PCIe path classes ----------------------------------------------------------------------


def _pci_chain(root: str, bdf: str) -> Optional[Tuple[str, List[str]]]:
    """``(root complex, [bridge BDFs from the root port down])`` of a PCI device, or None.

    ``/sys/bus/pci/devices/<bdf>`` is a link into ``/sys/devices/pci<dom>:<bus>/<port>/.../<bdf>``;
    the path components are the bridges the device hangs below.
    """
    link = _join(root, f"sys/bus/pci/devices/{bdf}")
    try:
        real = os.path.realpath(link)
    except OSError:
        return None
    parts = real.split(os.sep)
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            chain = [p for p in parts[i + 1 :] if _BDF.match(p)]
            if not chain or chain[-1] != bdf:
                return None
            return part, chain[:-1]
    return None


def pcie_path_class(
    chain_a: Optional[Tuple[str, List[str]]],
    chain_b: Optional[Tuple[str, List[str]]],
    numa_a: Optional[int],
    numa_b: Optional[int],
) -> LinkClass:
    """The PCIe class between two devices from their bridge chains (see :func:`_pci_chain`).

    The rule nvidia-smi and NCCL use: a common bridge with at most one switch level below it on
    each side is ``PIX``; a common bridge deeper in a switch tree is ``PXB``; the same root
    complex without a common bridge is ``PHB``; different root complexes are ``NODE`` on one NUMA
    node and ``SYS`` otherwise (also when NUMA is unknown: assume the worse).

    Args:
        chain_a, chain_b: ``(root complex, bridges)`` of each device, or None when unknown.
        numa_a, numa_b: NUMA nodes, or None.
    """
    if chain_a is None or chain_b is None:
        if numa_a is not None and numa_a == numa_b:
            return LinkClass.PCIE_NODE
        return LinkClass.PCIE_SYS
    (rc_a, br_a), (rc_b, br_b) = chain_a, chain_b
    if rc_a != rc_b:
        return (
            LinkClass.PCIE_NODE if numa_a is not None and numa_a == numa_b else LinkClass.PCIE_SYS
        )
    common = 0
    while common < min(len(br_a), len(br_b)) and br_a[common] == br_b[common]:
        common += 1
    if common == 0:
        return LinkClass.PCIE_PHB
    # Below the common bridge, a switch adds an upstream and a downstream port: more than one
    # bridge left on either side means a second switch level.
    if len(br_a) - common <= 1 and len(br_b) - common <= 1:
        return LinkClass.PCIE_PIX
    return LinkClass.PCIE_PXB


# -- probe steps ----------------------------------------------------------------------------


def _probe_host(root: str, notes: List[str]) -> Dict[str, object]:
    """Hostname, online CPUs, NUMA nodes (with their CPU lists), memory and CPU model."""
    host: Dict[str, object] = {}
    hostname = _read(_join(root, "proc/sys/kernel/hostname"))
    if hostname is None and os.path.realpath(root) == "/":
        hostname = socket.gethostname()
    host["hostname"] = hostname
    cpus = _parse_cpulist(_read(_join(root, "sys/devices/system/cpu/online")))
    if cpus is None and os.path.realpath(root) == "/":
        count = os.cpu_count()
        cpus = list(range(count)) if count else None
    if cpus is None:
        notes.append("host: cannot read sys/devices/system/cpu/online; CPU count unknown")
    host["cpus"] = len(cpus) if cpus else None
    host["cpulist"] = _format_cpulist(cpus) if cpus else None
    node_dir = _join(root, "sys/devices/system/node")
    nodes = [n for n in _listdir(node_dir) if re.fullmatch(r"node\d+", n)]
    if nodes:
        host["numa_nodes"] = len(nodes)
        host["numa_cpulists"] = {
            int(n[4:]): _read(os.path.join(node_dir, n, "cpulist")) or "" for n in nodes
        }
    else:
        # Kernels built without NUMA have no node directory: that is one node, not an error.
        host["numa_nodes"] = 1 if os.path.isdir(_join(root, "sys/devices/system")) else None
        notes.append("host: no NUMA node directories (kernel without NUMA, or a container)")
    meminfo = _read(_join(root, "proc/meminfo"))
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo or "", re.MULTILINE)
    host["memory_bytes"] = int(match.group(1)) * 1024 if match else None
    if not match:
        notes.append("host: cannot read MemTotal from proc/meminfo")
    cpuinfo = _read(_join(root, "proc/cpuinfo")) or ""
    match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    host["cpu_model"] = match.group(1).strip() if match else None
    return host


class _PciDevice:
    """One PCI function of interest, as sysfs describes it."""

    def __init__(
        self,
        bdf: str,
        vendor: str,
        device: str,
        pci_class: int,
        numa: Optional[int],
        cpulist: Optional[str],
        chain,
    ) -> None:
        self.bdf = bdf
        self.vendor = vendor
        self.device = device
        self.pci_class = pci_class
        self.numa = numa
        self.cpulist = cpulist
        self.chain = chain


def _scan_pci(root: str, notes: List[str]) -> List[_PciDevice]:
    base = _join(root, "sys/bus/pci/devices")
    if not os.path.isdir(base):
        notes.append("pci: no sys/bus/pci/devices (not Linux, or sysfs not mounted)")
        return []
    found = []
    for bdf in _listdir(base):
        d = os.path.join(base, bdf)
        vendor = _read(os.path.join(d, "vendor"))
        device = _read(os.path.join(d, "device"))
        pci_class = _read_int(os.path.join(d, "class"))
        if vendor is None or device is None or pci_class is None:
            notes.append(f"pci: {bdf}: unreadable vendor/device/class, skipped")
            continue
        vendor, device = vendor.lower().replace("0x", ""), device.lower().replace("0x", "")
        if vendor not in (PCI_VENDOR_NVIDIA, PCI_VENDOR_HUAWEI, PCI_VENDOR_MELLANOX):
            continue
        found.append(
            _PciDevice(
                bdf=bdf,
                vendor=vendor,
                device=device,
                pci_class=pci_class,
                numa=_numa(_read_int(os.path.join(d, "numa_node"))),
                cpulist=_read(os.path.join(d, "local_cpulist")),
                chain=_pci_chain(root, bdf),
            )
        )
    return found


def _is_nvidia_gpu(p: _PciDevice) -> bool:
    return p.vendor == PCI_VENDOR_NVIDIA and (p.pci_class >> 16) == 0x03


def _is_nvswitch(p: _PciDevice) -> bool:
    return p.vendor == PCI_VENDOR_NVIDIA and (p.pci_class >> 8) == 0x0680


def _is_ascend_npu(p: _PciDevice) -> bool:
    # Ascend parts are class 0x1200 (processing accelerator); the id table is the safer key.
    return p.vendor == PCI_VENDOR_HUAWEI and p.device in ASCEND_IDS


def _add_pci_devices(
    topo: Topology, pci: List[_PciDevice], host: Optional[str]
) -> Dict[str, object]:
    """Add GPUs and NPUs found in sysfs, named in PCI bus order (nvidia-smi's own order)."""
    chains: Dict[str, object] = {}
    gpus = [p for p in pci if _is_nvidia_gpu(p)]
    npus = [p for p in pci if _is_ascend_npu(p)]
    for prefix, vendor, devs in (("GPU", "nvidia", gpus), ("NPU", "ascend", npus)):
        for i, p in enumerate(devs):
            if vendor == "nvidia":
                model = NVIDIA_GPU_IDS.get(p.device, (None, None))[0]
            else:
                model = ASCEND_IDS.get(p.device)
            name = f"{prefix}{i}"
            topo.add_device(
                Device(
                    name=name,
                    vendor=vendor,
                    model=model,
                    index=i,
                    pci_bus_id=p.bdf,
                    pci_device_id=f"{p.vendor}:{p.device}",
                    numa=p.numa,
                    cpu_affinity=p.cpulist,
                    host=host,
                )
            )
            chains[name] = (p.chain, p.numa)
    switches = [p for p in pci if _is_nvswitch(p)]
    if switches:
        topo.facts["nvswitch_count"] = len(switches)
    return chains


def _probe_infiniband(
    root: str, topo: Topology, host: Optional[str], notes: List[str]
) -> Dict[str, object]:
    """Every RDMA port under ``/sys/class/infiniband``; returns NIC name -> (chain, numa)."""
    base = _join(root, "sys/class/infiniband")
    chains: Dict[str, object] = {}
    if not os.path.isdir(base):
        notes.append("rdma: no sys/class/infiniband (no RDMA devices or drivers)")
        return chains
    for dev in _listdir(base):
        dev_dir = os.path.join(base, dev)
        numa = _numa(_read_int(os.path.join(dev_dir, "device", "numa_node")))
        bdf = None
        try:
            bdf = os.path.basename(os.path.realpath(os.path.join(dev_dir, "device")))
            if not _BDF.match(bdf):
                bdf = None
        except OSError:
            pass
        netdevs = _listdir(os.path.join(dev_dir, "device", "net"))
        ports = [p for p in _listdir(os.path.join(dev_dir, "ports")) if p.isdigit()]
        if not ports:
            notes.append(f"rdma: {dev}: no ports directory")
        for port in ports:
            pdir = os.path.join(dev_dir, "ports", port)
            rate_text = _read(os.path.join(pdir, "rate"))
            match = re.match(r"\s*([\d.]+)\s*Gb/sec", rate_text or "")
            state_text = _read(os.path.join(pdir, "state"))
            state = None
            if state_text:
                token = state_text.split(":", 1)[-1].strip().upper()
                state = _IB_STATES.get(token, token.title())
            name = dev if len(ports) == 1 else f"{dev}:{port}"
            topo.add_nic(
                Nic(
                    name=name,
                    link_layer=_read(os.path.join(pdir, "link_layer")),
                    rate_gbps=float(match.group(1)) if match else None,
                    state=state,
                    numa=numa,
                    port=int(port),
                    pci_bus_id=bdf,
                    netdev=netdevs[0] if netdevs else None,
                    host=host,
                )
            )
            chains[name] = (_pci_chain(root, bdf) if bdf else None, numa)
    return chains


def _probe_peermem(root: str, topo: Topology, notes: List[str]) -> None:
    """``facts["peermem"]``: one of NCCL's GPUDirect RDMA paths exists.

    Set only where an NVIDIA GPU is present (here or seen by NVML later): on a host without
    one, GPUDirect RDMA is not a question, and a storage node's RDMA NICs are not a finding.
    """
    present = [p for p in PEERMEM_PATHS if os.path.exists(_join(root, p))]
    if any(d.vendor == "nvidia" for d in topo.devices):
        topo.facts["peermem"] = bool(present)
    if present:
        notes.append(f"gdr: peer memory module found ({present[0]})")
    else:
        notes.append("gdr: no nvidia_peermem / nv_peer_mem module loaded")


def _add_pcie_links(topo: Topology, chains: Dict[str, object], source: str) -> None:
    """A PCIe-class link between every pair of PCI endpoints (devices and NICs)."""
    names = list(chains)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (chain_a, numa_a), (chain_b, numa_b) = chains[a], chains[b]
            cls = pcie_path_class(chain_a, chain_b, numa_a, numa_b)
            dev = topo.device(a) or topo.device(b)
            topo.add_link(
                Link(
                    a,
                    b,
                    cls,
                    raw=_CLASS_TOKEN[cls],
                    gbps=nominal_gbps(cls, dev.model if dev else None),
                    source=source,
                )
            )


def _cpu_affinity_from_masks(masks: Sequence[int]) -> str:
    """NVML's list of 64-bit CPU masks -> a CPU list (``"0-55,112-167"``)."""
    cpus = [
        word * 64 + bit for word, mask in enumerate(masks) for bit in range(64) if mask >> bit & 1
    ]
    return _format_cpulist(cpus)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe_nvml(
    topo: Topology, host: Optional[str], num_cpus: Optional[int], notes: List[str]
) -> bool:
    """Fill GPUs from NVML; True when NVML answered. Replaces sysfs PCIe links with NVML's."""
    try:
        import pynvml  # nvidia-ml-py; imports without a driver, nvmlInit then fails
    except ImportError:
        notes.append("nvml: nvidia-ml-py not installed (pip install 'hetcomm[nvidia]')")
        return False
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        notes.append(f"nvml: nvmlInit failed ({type(e).__name__}: {e}); no NVIDIA driver")
        return False
    try:
        return _read_nvml(pynvml, topo, host, num_cpus, notes)
    except pynvml.NVMLError as e:
        notes.append(f"nvml: query failed ({type(e).__name__}: {e}); NVML data incomplete")
        return False
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _read_nvml(pynvml, topo: Topology, host, num_cpus, notes: List[str]) -> bool:
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    infos = [pynvml.nvmlDeviceGetPciInfo(h) for h in handles]
    bdfs = [_norm_bdf(_text(pci.busId)) for pci in infos]
    sysfs_gpus = {d.name: d.pci_bus_id for d in topo.devices if d.vendor == "nvidia"}
    if any(sysfs_gpus.get(f"GPU{i}") not in (None, bdf) for i, bdf in enumerate(bdfs)):
        # sysfs named GPUs in bus order; NVML's index order differs (CUDA_VISIBLE_DEVICES or
        # the driver's ordering). NVML's names are the ones nvidia-smi prints: drop the guesses.
        notes.append("nvml: GPU order differs from PCI bus order; using NVML's indices")
        topo.devices = [d for d in topo.devices if d.vendor != "nvidia"]
        topo.links = [ln for ln in topo.links if ln.a not in sysfs_gpus and ln.b not in sysfs_gpus]
    by_bus: Dict[str, str] = {}
    for i, (h, pci, bdf) in enumerate(zip(handles, infos, bdfs)):
        name = f"GPU{i}"
        dev_id = int(pci.pciDeviceId)  # 0xDDDDVVVV: device id high, vendor low
        pci_device_id = f"{dev_id & 0xFFFF:04x}:{dev_id >> 16:04x}"
        numa = None
        try:
            numa = _numa(int(pynvml.nvmlDeviceGetNumaNodeId(h)))
        except (pynvml.NVMLError, AttributeError):
            pass
        affinity = None
        if num_cpus:
            try:
                masks = pynvml.nvmlDeviceGetCpuAffinity(h, math.ceil(num_cpus / 64))
                affinity = _cpu_affinity_from_masks(list(masks))
            except pynvml.NVMLError:
                pass
        model = _text(pynvml.nvmlDeviceGetName(h)).replace("NVIDIA ", "").strip()
        dev = topo.add_device(Device(name=name, vendor="nvidia", index=i, host=host))
        dev.model = model  # NVML's name beats the PCI-id table (which lacks new parts)
        dev.pci_bus_id = bdf
        dev.pci_device_id = pci_device_id
        dev.numa = numa if numa is not None else dev.numa
        dev.cpu_affinity = affinity or dev.cpu_affinity
        by_bus[bdf] = name

    # NVLink: count active links per GPU, and per GPU peer (direct) or to a switch.
    max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
    active: Dict[str, int] = {}
    peer_links: Dict[Tuple[str, str], int] = {}
    switched: Set[str] = set()
    for i, h in enumerate(handles):
        name = f"GPU{i}"
        n_active = 0
        for link in range(max_links):
            try:
                state = pynvml.nvmlDeviceGetNvLinkState(h, link)
            except pynvml.NVMLError:
                break  # NotSupported / InvalidArgument past the last link
            if state != getattr(pynvml, "NVML_FEATURE_ENABLED", 1):
                continue
            n_active += 1
            try:
                remote_type = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            except (pynvml.NVMLError, AttributeError):
                remote_type = None
            if remote_type == getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                switched.add(name)
                continue
            try:
                remote = _norm_bdf(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId))
            except pynvml.NVMLError:
                continue
            peer = by_bus.get(remote)
            if peer is not None and peer != name:
                key = (name, peer) if name < peer else (peer, name)
                peer_links[key] = peer_links.get(key, 0) + 1
            elif peer is None:
                switched.add(name)  # remote is not a GPU we know: an NVSwitch
        active[name] = n_active
    topo.facts["nvlink_active"] = dict(active)
    if switched:
        topo.facts.setdefault("nvswitch_count", 0)

    p2p: Dict[str, str] = {}
    for i in range(count):
        for j in range(i + 1, count):
            a, b = f"GPU{i}", f"GPU{j}"
            model = topo.device(a).model
            # Each direction was counted once per side; the pair count is the per-side count.
            direct = peer_links.get((a, b) if a < b else (b, a), 0) // 2 if peer_links else 0
            if a in switched and b in switched:
                nv = min(active[a], active[b])
            else:
                nv = direct
            if nv > 0:
                cls, raw = LinkClass.NVLINK, f"NV{nv}"
                gbps = nominal_gbps(cls, model, num_nvlinks=nv)
            else:
                level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                cls = _NVML_LEVELS.get(int(level), LinkClass.UNKNOWN)
                raw = _CLASS_TOKEN.get(cls, str(level))
                gbps = nominal_gbps(cls, model)
            topo.add_link(Link(a, b, cls, raw=raw, gbps=gbps, source="nvml"), replace=True)
            try:
                # NVML_P2P_CAPS_INDEX_READ is the tuple (0,) in nvidia-ml-py 13.615.71 (a stray
                # comma): pass the int.
                status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], 0)
                p2p[f"{a}-{b}"] = _P2P_STATUS.get(int(status), str(status))
            except pynvml.NVMLError:
                pass
    if p2p:
        topo.facts["p2p"] = p2p
    _probe_fabric(pynvml, handles, topo, notes)
    notes.append(f"nvml: {count} GPU(s)")
    return True


def _probe_fabric(pynvml, handles, topo: Topology, notes: List[str]) -> None:
    """``facts["fabric_manager"]`` from NVML's GPU fabric state (Hopper and later)."""
    if not handles or not hasattr(pynvml, "nvmlDeviceGetGpuFabricInfo"):
        return
    try:
        import ctypes

        info = pynvml.c_nvmlGpuFabricInfo_t()
        pynvml.nvmlDeviceGetGpuFabricInfo(handles[0], ctypes.byref(info))
        state = int(info.state)
    except Exception as e:  # NotSupported before Hopper, or an older binding
        notes.append(f"nvml: fabric state unavailable ({type(e).__name__})")
        return
    # NOT_SUPPORTED 0 / NOT_STARTED 1 / IN_PROGRESS 2 / COMPLETED 3 (topology-notes §7).
    if state == 3:
        topo.facts["fabric_manager"] = "running"
    elif state in (1, 2):
        topo.facts["fabric_manager"] = "not-running"


def _probe_npu_smi(topo: Topology, notes: List[str]) -> bool:
    """Run ``npu-smi info`` and ``npu-smi info -t topo``; merge what the parsers make of them.

    Returns True when at least one output was parsed.
    """
    exe = shutil.which("npu-smi")
    if exe is None:
        notes.append("npu-smi: not on PATH (no Ascend driver)")
        return False
    try:
        from hetcomm.topo.parse import parse_text
    except ImportError as e:
        notes.append(f"npu-smi: parsers unavailable ({e})")
        return False
    parsed_any = False
    for args, fmt in ((["info"], "npu-smi-info"), (["info", "-t", "topo"], "npu-smi-topo")):
        cmd = [exe, *args]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=_NPU_SMI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            notes.append(f"npu-smi: '{' '.join(cmd)}' timed out after {_NPU_SMI_TIMEOUT_S:.0f} s")
            continue
        except OSError as e:
            notes.append(f"npu-smi: cannot run '{' '.join(cmd)}' ({e})")
            continue
        if out.returncode != 0:
            notes.append(
                f"npu-smi: '{' '.join(cmd)}' exited {out.returncode}: {out.stderr.strip()[:200]}"
            )
            continue
        try:
            parsed = parse_text(out.stdout, path=" ".join(cmd), fmt=fmt)
        except Exception as e:  # a parse error must not stop the probe
            notes.append(f"npu-smi: could not parse '{' '.join(cmd)}' ({e})")
            continue
        topo.merge(parsed)
        parsed_any = True
        notes.append(f"npu-smi: parsed '{' '.join(cmd)}' ({fmt})")
    return parsed_any


# -- entry points ---------------------------------------------------------------------------


def local_vendors(sysfs_root: str = "/") -> Set[str]:
    """Accelerator vendors present on this machine (``{"nvidia", "ascend"}`` subsets), from PCI.

    Cheap (a sysfs listing, no library), so the CLI can decide which device kinds of a cluster
    file are only labels here.
    """
    found: Set[str] = set()
    for p in _scan_pci(sysfs_root, []):
        if _is_nvidia_gpu(p):
            found.add("nvidia")
        elif _is_ascend_npu(p):
            found.add("ascend")
    return found


def probe_local(
    sysfs_root: str = "/",
    *,
    use_nvml: bool = True,
    use_npu_smi: bool = True,
) -> Topology:
    """The topology of this machine, from sysfs, NVML and npu-smi; never raises on a bare host.

    Args:
        sysfs_root: the file-system root to read ``sys/`` and ``proc/`` under (``"/"`` for the
            real machine; a prepared tree in tests).
        use_nvml: query NVML when ``pynvml`` imports and ``nvmlInit`` succeeds.
        use_npu_smi: run ``npu-smi`` when it is on ``PATH``.

    Returns:
        A :class:`Topology` with GPUs (``GPU<i>``), NPUs (``NPU<i>``), RDMA ports, the links
        between them, ``facts["host"]``, ``facts["peermem"]``, ``facts["probe_notes"]``; on a
        host without accelerators, a single device ``cpu0`` (vendor ``cpu``).
    """
    notes: List[str] = []
    topo = Topology()
    host = _probe_host(sysfs_root, notes)
    hostname = host.get("hostname")
    topo.facts["host"] = host
    sources = ["probe:sysfs"]

    pci = _scan_pci(sysfs_root, notes)
    chains = _add_pci_devices(topo, pci, hostname)
    chains.update(_probe_infiniband(sysfs_root, topo, hostname, notes))
    _add_pcie_links(topo, chains, "sysfs")

    # NVML and npu-smi describe the real machine: never mix them into a prepared tree.
    real_root = os.path.realpath(sysfs_root) == "/"
    nvml_ok = False
    if use_nvml and real_root:
        nvml_ok = _probe_nvml(topo, hostname, host.get("cpus"), notes)  # type: ignore[arg-type]
        if nvml_ok:
            sources.append("probe:nvml")
    if not nvml_ok and sum(d.vendor == "nvidia" for d in topo.devices) >= 2:
        # sysfs knows PCIe paths only: like `nvidia-smi topo -mp`, NVLink is invisible here, so
        # a PCIe class between two SXM GPUs is not evidence that NVLink is missing.
        topo.facts["pcie_view"] = True
        notes.append(
            "gpu: GPU<->GPU classes are sysfs PCIe paths; NVLink needs NVML "
            "(pip install 'hetcomm[nvidia]')"
        )
    if use_npu_smi and real_root:
        if _probe_npu_smi(topo, notes):
            sources.append("probe:npu-smi")
    _probe_peermem(sysfs_root, topo, notes)
    if "peermem" in topo.facts:
        for nic in topo.nics:
            nic.gdr = topo.facts["peermem"]

    if not any(d.vendor in ("nvidia", "ascend") for d in topo.devices):
        numa_nodes = host.get("numa_nodes")
        topo.add_device(
            Device(
                name="cpu0",
                vendor="cpu",
                model=host.get("cpu_model"),  # type: ignore[arg-type]
                index=0,
                numa=0 if numa_nodes == 1 else None,
                cpu_affinity=host.get("cpulist"),  # type: ignore[arg-type]
                host=hostname,  # type: ignore[arg-type]
            )
        )
        notes.append("no GPU or NPU found: CPU-only host")
    topo.facts["probe_notes"] = notes
    topo.facts["sources"] = sources
    topo.facts["formats"] = ["live-probe"]
    return topo
