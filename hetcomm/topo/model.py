"""The topology model: devices, NICs, the links between them, findings and measurements.

Everything hetcomm decides — which rail carries a peer, how an all-to-all is planned, where a hot
expert is replicated — starts from a :class:`Topology`. Parsers (``hetcomm.topo.parse``), live
probes (``hetcomm.topo.probe``) and cluster YAML files (``hetcomm.topo.cluster``) all produce one;
``hetcomm.topo.audit`` turns one into findings.

Link classes form one ordered enum (:class:`LinkClass`), closest first, as NCCL orders its path
types (``LOC < NVL < PIX < PXB < PHB < SYS < NET``): a policy is a comparison
(``link.link_class <= LinkClass.PCIE_PXB``). Class says *what* the link is; how fast it is comes
from ``gbps`` (see ``hetcomm.topo.bandwidth``).

Units: ``gbps`` is always gigabits per second, per direction (the unit NIC rates are sold in);
``GB/s`` appears only in human-readable output.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

__all__ = [
    "LinkClass",
    "Vendor",
    "Device",
    "Nic",
    "Link",
    "Finding",
    "Measurement",
    "Topology",
    "SEVERITIES",
]


class LinkClass(enum.IntEnum):
    """How two endpoints are connected, ordered from closest to farthest.

    The order follows latency rank (NCCL's path order, then the network classes, then the
    cross-vendor bridge): ``a < b`` means ``a`` is the closer, lower-latency kind of path. Ties in
    technology generation are broken by the listed order; bandwidth is a separate number.
    """

    NVLINK = 0  #: NVLink, direct or through NVSwitch (``NV#``).
    HCCS = 1  #: Huawei Cache Coherence System between Ascend NPUs.
    PCIE_PIX = 2  #: PCIe through at most one bridge (one switch).
    PCIE_PXB = 3  #: PCIe through several bridges, not through the host bridge.
    PCIE_PHB = 4  #: PCIe through a host bridge (the CPU root complex).
    PCIE_NODE = 5  #: PCIe across host bridges within one NUMA node.
    PCIE_SYS = 6  #: PCIe plus the inter-socket link (QPI/UPI/xGMI).
    P2P = 7  #: GPU peer access seen in an NCCL log, NVLink vs PCIe unknown.
    SHM = 8  #: Staged through host shared memory (NCCL SHM transport, or our shm rail).
    NET_IB_GDR = 9  #: InfiniBand with GPUDirect RDMA.
    NET_IB = 10  #: InfiniBand, bounced through host memory.
    NET_ROCE_GDR = 11  #: RoCE with GPUDirect RDMA.
    NET_ROCE = 12  #: RoCE, bounced through host memory.
    NET_EFA = 13  #: AWS EFA / libfabric.
    NET_SOCKET = 14  #: TCP sockets.
    HOST_BRIDGE = 15  #: Cross-vendor path (NVIDIA <-> Ascend) staged through host memory.
    UNKNOWN = 16  #: Not known (npu-smi ``NA``, missing data).

    @property
    def is_network(self) -> bool:
        """True for classes that leave the node (``NET_*``)."""
        return LinkClass.NET_IB_GDR <= self <= LinkClass.NET_SOCKET

    @property
    def is_rdma(self) -> bool:
        """True for verbs-based classes (IB or RoCE, with or without GDR)."""
        return LinkClass.NET_IB_GDR <= self <= LinkClass.NET_ROCE

    @property
    def is_gdr(self) -> bool:
        """True when the class moves device memory straight to the NIC (GPUDirect RDMA)."""
        return self in (LinkClass.NET_IB_GDR, LinkClass.NET_ROCE_GDR)

    @property
    def is_pcie(self) -> bool:
        """True for the PCIe path classes ``PCIE_PIX`` .. ``PCIE_SYS``."""
        return LinkClass.PCIE_PIX <= self <= LinkClass.PCIE_SYS

    @property
    def is_device_fabric(self) -> bool:
        """True for vendor device-to-device fabrics (NVLink, HCCS)."""
        return self in (LinkClass.NVLINK, LinkClass.HCCS)

    @classmethod
    def parse(cls, name: str) -> "LinkClass":
        """Look a class up by name, case-insensitively (``"nvlink"`` -> ``NVLINK``).

        Raises:
            ValueError: the name is not in the vocabulary; the message lists the valid names.
        """
        try:
            return cls[name.strip().upper()]
        except KeyError:
            valid = ", ".join(c.name for c in cls)
            raise ValueError(f"unknown link class {name!r}; expected one of: {valid}") from None


class Vendor(str, enum.Enum):
    """Who made a device. ``cpu`` stands for a host with no accelerator (or a CPU rank)."""

    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CPU = "cpu"


SEVERITIES = ("error", "warning", "info")


@dataclass
class Device:
    """One accelerator (or a CPU host) as a tool reported it.

    Attributes:
        name: the tool's own name: ``GPU0``, ``NPU3``, ``rank5`` (NCCL logs), ``cpu0``.
        vendor: ``nvidia``, ``ascend`` or ``cpu``.
        model: marketing name when known (``A100-SXM4-80GB``, ``H800``, ``910B3``), else None.
        index: the tool's index (``GPU3`` -> 3), when there is one.
        pci_bus_id: PCI address ``0000:18:00.0``, when known.
        pci_device_id: ``vendor:device`` in hex, e.g. ``10de:20b2``, when known.
        numa: NUMA node, or None when unknown / ``N/A``.
        cpu_affinity: CPU list as the tool printed it (``0-55,112-167``), or None.
        host: the node/host the device is on, when known.
        label_only: True when the device is a label (a CPU process standing for this model).
    """

    name: str
    vendor: str = Vendor.NVIDIA.value
    model: Optional[str] = None
    index: Optional[int] = None
    pci_bus_id: Optional[str] = None
    pci_device_id: Optional[str] = None
    numa: Optional[int] = None
    cpu_affinity: Optional[str] = None
    host: Optional[str] = None
    label_only: bool = False


@dataclass
class Nic:
    """One network port (an RDMA HCA port, a bond, a TCP interface).

    Attributes:
        name: ``mlx5_0``, ``mlx5_bond_0``, ``eth0``, ``NIC3`` when only a legend-less index is known.
        link_layer: ``InfiniBand``, ``Ethernet`` or None when unknown.
        rate_gbps: port rate in Gb/s (``200``), or None.
        state: ``Active``, ``Down``, ``Init``, ``Polling`` ... or None.
        numa: NUMA node of the NIC's PCI device, or None.
        gdr: True if GPUDirect RDMA is usable with this NIC, False if known unusable, None unknown.
        port: port number (``1``), when known.
        pci_bus_id: PCI address, when known.
        netdev: the Linux netdev (``ens108np0``), when known.
        host: the node/host, when known.
    """

    name: str
    link_layer: Optional[str] = None
    rate_gbps: Optional[float] = None
    state: Optional[str] = None
    numa: Optional[int] = None
    gdr: Optional[bool] = None
    port: Optional[int] = None
    pci_bus_id: Optional[str] = None
    netdev: Optional[str] = None
    host: Optional[str] = None


@dataclass
class Link:
    """A connection between two endpoints (device-device, device-NIC, or rank-rank).

    Attributes:
        a, b: endpoint names (device or NIC names). Stored with ``a`` < ``b`` is not required, but
            a :class:`Topology` keeps at most one link per unordered pair.
        link_class: the :class:`LinkClass`.
        raw: the token it came from (``NV8``, ``PIX``, ``HCCS``, ``P2P/IPC``, ``NET/IB/0/GDRDMA``).
        gbps: nominal per-direction bandwidth in Gb/s, or None when no table entry applies.
        source: where the link was learned (a file name, ``nvml``, ``cluster``), for reports.
    """

    a: str
    b: str
    link_class: LinkClass
    raw: str = ""
    gbps: Optional[float] = None
    source: Optional[str] = None

    @property
    def key(self) -> Tuple[str, str]:
        """The unordered pair as a sorted tuple."""
        return (self.a, self.b) if self.a <= self.b else (self.b, self.a)


@dataclass
class Finding:
    """One problem (or fact worth knowing) found by the audit.

    Attributes:
        code: stable machine-readable code, e.g. ``nic-numa-mismatch`` (see ``docs/TOPOLOGY.md``).
        severity: ``error``, ``warning`` or ``info``.
        subject: what it is about: a device, NIC, pair (``GPU0-GPU1``) or file.
        message: what was seen and what it means.
        fix: how to fix it (a command, a setting, a BIOS option), or an empty string.
    """

    code: str
    severity: str
    subject: str
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        assert self.severity in SEVERITIES, f"bad severity {self.severity!r}"


@dataclass
class Measurement:
    """One row of an nccl-tests style result table (parsed, or measured by ``hetcomm bench``).

    Attributes:
        op: ``alltoall``, ``allreduce``, ...
        size_bytes: total bytes per rank (the nccl-tests ``size`` column).
        time_us: time in microseconds.
        algbw_gbps / busbw_gbps: algorithm and bus bandwidth **in GB/s** as nccl-tests prints them
            (kept in the tool's unit so that tables compare one to one).
        in_place: True for the in-place half of the row.
        count, dtype, redop, root: the other nccl-tests columns, when present.
        wrong: the ``#wrong`` column (None for ``N/A``).
        num_ranks: number of ranks of the run, when known.
        source: file or command it came from.
    """

    op: str
    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    in_place: bool = False
    count: Optional[int] = None
    dtype: Optional[str] = None
    redop: Optional[str] = None
    root: Optional[int] = None
    wrong: Optional[int] = None
    num_ranks: Optional[int] = None
    source: Optional[str] = None


@dataclass
class Topology:
    """Devices, NICs and the links between them, plus what the audit and benchmarks found.

    ``facts`` carries observations that are not links, under documented keys, so that parsers
    and the audit stay decoupled. Keys in use:

    - ``nccl_env``: dict of ``NCCL_*`` overrides seen in an NCCL log (``{"NCCL_IB_DISABLE": "1"}``).
    - ``nccl_network``: the net plugin NCCL chose (``IB``, ``Socket``, ``Libfabric``).
    - ``nccl_gdr``: list of ``GDR 0|1`` values seen in ``Connected all rings`` lines.
    - ``peermem``: True/False, nvidia_peermem (or nv_peer_mem) loaded and bound to ib_core.
    - ``nvswitch_count``: number of NVSwitch bridges seen in lspci / NVML / NCCL XML.
    - ``fabric_manager``: ``running`` / ``not-running`` / ``unknown``.
    - ``p2p``: dict ``"GPU0-GPU1" -> "OK"|"CNS"|"GNS"|"TNS"|"NS"|...`` from ``topo -p2p``.
    - ``nvlink_active``: dict device name -> number of active NVLinks (``nvidia-smi nvlink -s``).
    - ``nvlink_gbps_per_link``: dict device name -> GB/s per link as printed.
    - ``pcie_view``: True when the matrix came from ``topo -mp`` (NVLink hidden).
    - ``host``: dict with ``hostname``, ``cpus``, ``numa_nodes``, ``memory_bytes`` (live probe).
    - ``sources``: list of input files / probes that contributed.
    - ``formats``: list of detected input formats.
    - ``form_factor``: dict device -> ``SXM`` / ``PCIe`` (from PCI ids or names).
    - ``persistence_mode``, ``mig``, ``power_limit_w``, ``gpu_numa_id``: dicts device -> value.
    - ``nic_models``: dict NIC -> part name; ``fabric_manager_errors``: list of log lines.
    - ``parse_warnings``: list of ``file:line: message`` for input parsed only in part.

    Parser-specific keys (``nccl_*``, ``npu_*``, ``hccn*``, ``roce_gids``, ...) are listed in
    ``docs/INPUT_FORMATS.md``.
    """

    devices: List[Device] = field(default_factory=list)
    nics: List[Nic] = field(default_factory=list)
    links: List[Link] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)
    measurements: List[Measurement] = field(default_factory=list)
    facts: Dict[str, Any] = field(default_factory=dict)

    # -- lookups -----------------------------------------------------------------------------
    def device(self, name: str) -> Optional[Device]:
        """The device called ``name``, or None."""
        for d in self.devices:
            if d.name == name:
                return d
        return None

    def nic(self, name: str) -> Optional[Nic]:
        """The NIC called ``name``, or None."""
        for n in self.nics:
            if n.name == name:
                return n
        return None

    def _pair_index(self) -> Dict[Tuple[str, str], int]:
        """Position in ``links`` of each unordered pair, rebuilt when ``links`` was changed directly."""
        cache = self.__dict__.get("_pair_cache")
        if cache is None or cache[0] is not self.links or cache[1] != len(self.links):
            index = {link.key: i for i, link in enumerate(self.links)}
            cache = (self.links, len(self.links), index)
            self.__dict__["_pair_cache"] = cache
        return cache[2]

    def link(self, a: str, b: str) -> Optional[Link]:
        """The link between ``a`` and ``b`` (either order), or None."""
        i = self._pair_index().get((a, b) if a <= b else (b, a))
        return None if i is None else self.links[i]

    def links_of(self, name: str) -> List[Link]:
        """Every link with ``name`` as one endpoint."""
        return [l for l in self.links if name in (l.a, l.b)]

    # -- building ----------------------------------------------------------------------------
    def add_device(self, device: Device) -> Device:
        """Add ``device``, or fill the unknown fields of the existing device of that name."""
        existing = self.device(device.name)
        if existing is None:
            self.devices.append(device)
            return device
        _fill_missing(existing, device)
        return existing

    def add_nic(self, nic: Nic) -> Nic:
        """Add ``nic``, or fill the unknown fields of the existing NIC of that name."""
        existing = self.nic(nic.name)
        if existing is None:
            self.nics.append(nic)
            return nic
        _fill_missing(existing, nic)
        return existing

    def add_link(self, link: Link, *, replace: bool = False) -> Link:
        """Add ``link``; each unordered pair is kept once.

        Args:
            link: the link to add.
            replace: when a link for the pair exists, overwrite it (True) or keep the first
                (False). Observed evidence (an NCCL log) replaces expected evidence (a matrix)
                only when the caller says so.
        """
        assert link.a != link.b, f"self link {link.a}"
        index = self._pair_index()
        i = index.get(link.key)
        if i is not None:
            if replace:
                self.links[i] = link
                return link
            return self.links[i]
        index[link.key] = len(self.links)
        self.links.append(link)
        self.__dict__["_pair_cache"] = (self.links, len(self.links), index)
        return link

    def merge(self, other: "Topology") -> "Topology":
        """Fold ``other`` into this topology (in place) and return self.

        Devices and NICs of the same name are unified; links keep the first seen per pair;
        findings and measurements are appended; list facts are concatenated, dict facts merged.
        """
        for d in other.devices:
            self.add_device(dataclasses.replace(d))
        for n in other.nics:
            self.add_nic(dataclasses.replace(n))
        for l in other.links:
            self.add_link(dataclasses.replace(l))
        self.findings.extend(other.findings)
        self.measurements.extend(other.measurements)
        for key, value in other.facts.items():
            mine = self.facts.get(key)
            if isinstance(mine, list) and isinstance(value, list):
                mine.extend(v for v in value if v not in mine)
            elif isinstance(mine, dict) and isinstance(value, dict):
                mine.update(value)
            elif isinstance(mine, bool) and isinstance(value, bool):
                # Health flags (peermem, ...): one node without it is a problem for the cluster.
                self.facts[key] = mine and value
            elif mine is None:
                self.facts[key] = value if not isinstance(value, (list, dict)) else type(value)(value)
            else:
                self.facts[key] = value
        return self

    # -- output ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """The JSON document ``hetcomm topo --json`` prints (schema in docs/TOPOLOGY.md)."""
        return {
            "devices": [
                {
                    "name": d.name,
                    "vendor": d.vendor,
                    "model": d.model,
                    "numa": d.numa,
                    "index": d.index,
                    "pci_bus_id": d.pci_bus_id,
                    "pci_device_id": d.pci_device_id,
                    "cpu_affinity": d.cpu_affinity,
                    "host": d.host,
                    "label_only": d.label_only,
                }
                for d in self.devices
            ],
            "nics": [
                {
                    "name": n.name,
                    "link_layer": n.link_layer,
                    "rate_gbps": n.rate_gbps,
                    "state": n.state,
                    "numa": n.numa,
                    "gdr": n.gdr,
                    "port": n.port,
                    "pci_bus_id": n.pci_bus_id,
                    "netdev": n.netdev,
                    "host": n.host,
                }
                for n in self.nics
            ],
            "links": [
                {
                    "a": l.a,
                    "b": l.b,
                    "class": l.link_class.name,
                    "raw": l.raw,
                    "gbps": l.gbps,
                }
                for l in self.links
            ],
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "measurements": [
                {
                    "op": m.op,
                    "size_bytes": m.size_bytes,
                    "time_us": m.time_us,
                    "algbw_gbps": m.algbw_gbps,
                    "busbw_gbps": m.busbw_gbps,
                    "in_place": m.in_place,
                    "num_ranks": m.num_ranks,
                    "wrong": m.wrong,
                }
                for m in self.measurements
            ],
        }


def _fill_missing(target: Any, source: Any) -> None:
    """Copy each field of ``source`` into ``target`` where ``target`` has None."""
    for f in dataclasses.fields(target):
        if getattr(target, f.name) is None and getattr(source, f.name) is not None:
            setattr(target, f.name, getattr(source, f.name))


def sorted_pairs(names: Iterable[str]) -> List[Tuple[str, str]]:
    """All unordered pairs of ``names`` in a stable order (helper for matrix parsers)."""
    names = list(names)
    return [(names[i], names[j]) for i in range(len(names)) for j in range(i + 1, len(names))]
