"""Parse an NCCL topology XML (``NCCL_TOPO_DUMP_FILE`` output, or an ``NCCL_TOPO_FILE``).

The file is NCCL's own view of the node (topology-notes §4)::

    <system version="1">
      <cpu numaid="0" affinity="0000ffff,..." arch="x86_64" ...>
        <pci busid="0000:08:00.0" class="0x060400" vendor="0x1000" device="0xc030" ...>   bridge
          <pci busid="0000:0f:00.0" class="0x030200" vendor="0x10de" device="0x2330" ...> GPU
            <gpu dev="0" sm="90" rank="0" gdr="1">
              <nvlink target="0000:1c:00.0" count="5" tclass="0x068000"/>             to NVSwitch
          ...
          <pci busid="0000:0c:00.0" class="0x020000" vendor="0x15b3" device="0x1021" ...> NIC
            <nic><net name="mlx5_0" dev="0" speed="180000" port="1" gdr="1"/></nic>

What the parser derives:

- GPUs ``GPU<dev>`` with bus id, PCI id, model (from the PCI id table in
  :mod:`hetcomm.topo.parse.lspci`), NUMA node and CPU list (from the ``<cpu>`` they hang under).
- NVLink: ``<nvlink>`` counts are summed per GPU (``facts["nvlink_active"]``). Links whose target
  class is ``0x068000`` go to an NVSwitch, so every pair of switch-attached GPUs is connected
  through the switch: one NVLINK link per pair with the smaller of the two link counts (``raw`` is
  ``NV<count>``, as nvidia-smi would print). A target of GPU class is a direct GPU-GPU NVLink.
  Distinct switch targets give ``facts["nvswitch_count"]``.
- NICs from ``<net>`` (``speed`` is in Mb/s; the link layer comes from the NIC's PCI class:
  ``0x0207xx`` InfiniBand, ``0x0200xx`` Ethernet).
- PCIe path class for every other pair (GPU-GPU without NVLink, GPU-NIC, NIC-NIC), from the tree,
  as NCCL and nvidia-smi derive it: a shared PCIe switch -> ``PIX`` (one switch on the path) or
  ``PXB`` (several); only the CPU in common -> ``PHB``; different CPUs -> ``SYS``. A switch is a
  bridge together with its child bridges of the same vendor:device (its upstream and downstream
  ports); NCCL flattens Broadcom PEX switches the same way.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Callable, Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError
from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import Device, Link, LinkClass, Nic, Topology, Vendor
from hetcomm.topo.parse._text import strip_source_header
from hetcomm.topo.parse.lspci import gpu_model_for_id, normalize_bus_id

__all__ = ["sniff_nccl_xml", "parse_nccl_xml", "cpu_mask_to_list", "FORMATS"]

_NVSWITCH_CLASS = "0x068000"
_GPU_CLASSES = ("0x030200", "0x030000")
_BRIDGE_CLASS_PREFIX = "0x0604"


def cpu_mask_to_list(mask: str) -> Optional[str]:
    """An NCCL affinity mask (comma-separated 32-bit hex words, most significant first) as a
    CPU list: ``"000000ff,ffffffff"`` -> ``"0-39"``. None when the mask is not hex."""
    words = mask.strip().split(",")
    if not words or not all(re.fullmatch(r"[0-9a-fA-F]+", w) for w in words):
        return None
    value = int("".join(w.zfill(8) for w in words), 16)
    ranges: List[str] = []
    cpu = 0
    start: Optional[int] = None
    while value or start is not None:
        bit = value & 1
        if bit and start is None:
            start = cpu
        elif not bit and start is not None:
            ranges.append(f"{start}-{cpu - 1}" if cpu - 1 > start else str(start))
            start = None
        value >>= 1
        cpu += 1
    return ",".join(ranges) or None


def sniff_nccl_xml(text: str) -> bool:
    """True for an NCCL topology XML (a ``<system`` root with ``<cpu``/``<pci``/``<gpu`` nodes)."""
    text = strip_source_header(text)  # the provenance header is not tool output
    return bool(re.search(r"<system\b[^>]*>", text)) and bool(
        re.search(r"<(cpu|pci|gpu|nic)\b", text)
    )


class _Endpoint:
    """A GPU or NIC port with the chain of PCIe bridges above it (top first) and its CPU."""

    def __init__(self, name: str, cpu: Optional[ET.Element], bridges: List[ET.Element]) -> None:
        self.name = name
        self.cpu = cpu
        self.bridges = bridges


def _switch_ids(bridges: List[ET.Element]) -> List[int]:
    """Label each bridge of a top-down chain with a switch number: a bridge with the same
    vendor:device as its parent bridge is another port of the same switch chip."""
    labels: List[int] = []
    for i, bridge in enumerate(bridges):
        key = (bridge.get("vendor"), bridge.get("device"))
        if i > 0 and key == (bridges[i - 1].get("vendor"), bridges[i - 1].get("device")) and key[1]:
            labels.append(labels[-1])
        else:
            labels.append(id(bridge))
    return labels


def _pcie_class(a: _Endpoint, b: _Endpoint) -> Tuple[LinkClass, str]:
    """The PCIe path class between two endpoints and the token nvidia-smi would print."""
    if a.cpu is None or b.cpu is None or a.cpu is not b.cpu:
        return LinkClass.PCIE_SYS, "SYS"
    common = 0
    while common < min(len(a.bridges), len(b.bridges)) and a.bridges[common] is b.bridges[common]:
        common += 1
    if common == 0:
        return LinkClass.PCIE_PHB, "PHB"
    # Bridges traversed: each side below the common point, plus the deepest common bridge.
    ids_a = _switch_ids(a.bridges)
    ids_b = _switch_ids(b.bridges)
    switches = set(ids_a[common - 1 :]) | set(ids_b[common - 1 :])
    if len(switches) <= 1:
        return LinkClass.PCIE_PIX, "PIX"
    return LinkClass.PCIE_PXB, "PXB"


def _hex_id(value: Optional[str]) -> str:
    return (value or "").lower().replace("0x", "").zfill(4)[-4:]


def parse_nccl_xml(text: str, path: str = "<text>") -> Topology:
    """Parse an NCCL topology XML into GPUs, NICs and links.

    Args:
        text: the XML document (a leading ``<!-- source: ... -->`` comment is fine).
        path: file name used in errors and ``facts["sources"]``.

    Returns:
        A :class:`Topology` with ``GPU<dev>`` devices, one NIC per ``<net>`` port, an NVLINK link
        per NVLink-connected GPU pair and a PCIe-class link for every other GPU/NIC pair;
        ``facts["nvlink_active"]``, ``facts["nvswitch_count"]``.

    Raises:
        TopologyParseError: empty input, XML that does not parse (with its line), a root that is
            not ``<system>``, a ``<gpu>`` outside a ``<pci>`` node, or non-numeric attributes.
    """
    body = strip_source_header(text)
    if not body.strip():
        raise TopologyParseError(
            "empty input; expected an NCCL topology XML (<system version=...>)", path=path, line=1
        )
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        line = exc.position[0] if getattr(exc, "position", None) else None
        raise TopologyParseError(
            f"not well-formed XML ({exc}); expected a complete NCCL topology XML — a truncated "
            "NCCL_TOPO_DUMP_FILE ends before </system>",
            path=path,
            line=line,
        ) from None
    if root.tag != "system":
        raise TopologyParseError(
            f"root element is <{root.tag}>, expected <system>: this is not an NCCL topology XML",
            path=path,
            line=1,
        )

    topo = Topology()
    gpus: List[Tuple[_Endpoint, ET.Element, ET.Element]] = []  # (endpoint, <gpu>, its <pci>)
    nics: List[_Endpoint] = []
    gpu_by_bus: Dict[str, str] = {}
    static: List[ET.Element] = []  # bare <pci> leaves of a static topology file

    def walk(node: ET.Element, cpu: Optional[ET.Element], chain: List[ET.Element]) -> None:
        for child in node:
            if child.tag == "cpu":
                walk(child, child, [])
            elif child.tag == "pci":
                is_bridge = (child.get("class") or "").lower().startswith(_BRIDGE_CLASS_PREFIX)
                walk(child, cpu, chain + [child] if is_bridge else chain)
                if not is_bridge:
                    _device(child, cpu, chain)
            elif child.tag == "nic" and node.tag != "pci":
                # A NIC without a PCI parent (virtual or plugin-provided): attached to the CPU.
                for net in child.iter("net"):
                    nics.append(_add_net(net, None, cpu))
            elif child.tag not in ("gpu", "nic", "net", "nvlink"):
                walk(child, cpu, chain)

    def _device(pci: ET.Element, cpu: Optional[ET.Element], chain: List[ET.Element]) -> None:
        cls = (pci.get("class") or "").lower()
        if len(pci) == 0 and (cls in _GPU_CLASSES or cls.startswith(("0x0207", "0x0200"))):
            # A static NCCL_TOPO_FILE, as clouds ship them (AWS p4d, Azure NDv4/v5), lists GPUs and
            # NICs as bare <pci> leaves by class; NCCL fills in <gpu>/<nic> at run time. Number
            # them in document order, as the file's comments do (GPU 0, GPU 1, ...).
            static.append(pci)
            if cls in _GPU_CLASSES:
                gpu = ET.Element("gpu", {"dev": str(len(gpus))})
                name = f"GPU{len(gpus)}"
                gpus.append((_Endpoint(name, cpu, chain), gpu, pci))
                if pci.get("busid"):
                    gpu_by_bus[normalize_bus_id(pci.get("busid", ""))] = name
            else:
                efa = _hex_id(pci.get("vendor")) == "1d0f"  # Amazon EFA
                ep = _add_net(ET.Element("net", {"name": f"{'efa' if efa else 'nic'}{len(nics)}"}), pci, cpu)
                ep.bridges = chain
                nics.append(ep)
            return
        for child in pci:
            if child.tag == "gpu":
                dev = child.get("dev")
                if dev is None or not dev.isdigit():
                    raise TopologyParseError(
                        f"<gpu> under <pci busid={pci.get('busid')!r}> has dev={dev!r}; expected a "
                        'GPU index (dev="0")',
                        path=path,
                    )
                name = f"GPU{int(dev)}"
                gpus.append((_Endpoint(name, cpu, chain), child, pci))
                if pci.get("busid"):
                    gpu_by_bus[normalize_bus_id(pci.get("busid", ""))] = name
            elif child.tag == "nic":
                for net in child.iter("net"):
                    ep = _add_net(net, pci, cpu)
                    ep.bridges = chain
                    nics.append(ep)

    def _add_net(
        net: ET.Element, pci: Optional[ET.Element], cpu: Optional[ET.Element]
    ) -> _Endpoint:
        name = net.get("name") or f"net{net.get('dev', len(nics))}"
        speed = net.get("speed")
        try:
            rate = float(speed) / 1000.0 if speed else None  # NCCL writes Mb/s
        except ValueError:
            raise TopologyParseError(
                f"<net name={name!r}> has speed={speed!r}; expected a number of Mb/s", path=path
            ) from None
        cls = ((pci.get("class") if pci is not None else "") or "").lower()
        layer = (
            "InfiniBand"
            if cls.startswith("0x0207")
            else "Ethernet"
            if cls.startswith("0x0200")
            else None
        )
        port = net.get("port")
        gdr = net.get("gdr")
        topo.add_nic(
            Nic(
                name=name,
                link_layer=layer,
                rate_gbps=rate,
                numa=_numa(cpu),
                gdr=None if gdr is None else gdr == "1",
                port=int(port) if port and port.isdigit() else None,
                pci_bus_id=normalize_bus_id(pci.get("busid", ""))
                if pci is not None and pci.get("busid")
                else None,
            )
        )
        return _Endpoint(name, cpu, [])

    def _numa(cpu: Optional[ET.Element]) -> Optional[int]:
        value = cpu.get("numaid") if cpu is not None else None
        return (
            int(value)
            if value is not None and value.lstrip("-").isdigit() and int(value) >= 0
            else None
        )

    walk(root, None, [])
    if not gpus and not nics:
        raise TopologyParseError(
            "the XML has no <gpu> and no <net> nodes; expected an NCCL topology dump "
            "(NCCL_TOPO_DUMP_FILE) with <cpu>/<pci>/<gpu> nodes",
            path=path,
            line=1,
        )

    gpus.sort(key=lambda g: int(g[1].get("dev", "0")))
    names_seen: Dict[str, int] = {}
    for ep in [g[0] for g in gpus] + nics:
        names_seen[ep.name] = names_seen.get(ep.name, 0) + 1
    repeated = sorted(name for name, count in names_seen.items() if count > 1)
    if repeated:
        raise TopologyParseError(
            f"{', '.join(repeated)} appear(s) more than once (<gpu dev> and <net name> must be "
            "unique in one NCCL topology dump)",
            path=path,
        )
    nvlink_total: Dict[str, int] = {}
    switch_links: Dict[str, int] = {}
    direct: Dict[Tuple[str, str], int] = {}
    switches = set()
    for ep, gpu, pci in gpus:
        vendor, device = _hex_id(pci.get("vendor")), _hex_id(pci.get("device"))
        known = gpu_model_for_id(device) if vendor == "10de" else None
        topo.add_device(
            Device(
                name=ep.name,
                vendor=Vendor.NVIDIA.value,
                model=known[0] if known else None,
                index=int(gpu.get("dev", "0")),
                pci_bus_id=normalize_bus_id(pci.get("busid", "")) if pci.get("busid") else None,
                pci_device_id=f"{vendor}:{device}" if pci.get("device") else None,
                numa=_numa(ep.cpu),
                cpu_affinity=cpu_mask_to_list(ep.cpu.get("affinity", ""))
                if ep.cpu is not None
                else None,
            )
        )
        total = 0
        for nvl in gpu.findall("nvlink"):
            count_text = nvl.get("count", "")
            if not count_text.isdigit():
                raise TopologyParseError(
                    f"<nvlink> of {ep.name} has count={count_text!r}; expected a link count",
                    path=path,
                )
            count = int(count_text)
            total += count
            tclass = (nvl.get("tclass") or "").lower()
            target = normalize_bus_id(nvl.get("target", ""))
            if tclass == _NVSWITCH_CLASS:
                switches.add(target)
                switch_links[ep.name] = switch_links.get(ep.name, 0) + count
            elif tclass in _GPU_CLASSES:
                direct[(ep.name, target)] = direct.get((ep.name, target), 0) + count
        nvlink_total[ep.name] = total

    def model_of(name: str) -> Optional[str]:
        dev = topo.device(name)
        return dev.model if dev is not None else None

    # NVLink pairs: through the switches, then direct GPU-GPU links.
    pair_counts: Dict[Tuple[str, str], List[int]] = {}
    for (name, target), count in direct.items():
        peer = gpu_by_bus.get(target)
        if peer is None or peer == name:
            continue  # a link to a CPU (POWER9) or to a GPU outside this dump
        a, b = sorted((name, peer))
        pair_counts.setdefault((a, b), []).append(count)
    for (a, b), counts in pair_counts.items():
        num = min(counts)  # each side lists the same links; disagreement means a dead end
        topo.add_link(
            Link(
                a,
                b,
                LinkClass.NVLINK,
                raw=f"NV{num}",
                gbps=nominal_gbps(LinkClass.NVLINK, model_of(a), num_nvlinks=num),
                source=path,
            )
        )
    names = [ep.name for ep, _, _ in gpus]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a in switch_links and b in switch_links and topo.link(a, b) is None:
                num = min(switch_links[a], switch_links[b])
                topo.add_link(
                    Link(
                        a,
                        b,
                        LinkClass.NVLINK,
                        raw=f"NV{num}",
                        gbps=nominal_gbps(LinkClass.NVLINK, model_of(a), num_nvlinks=num),
                        source=path,
                    )
                )
    # Everything else: the PCIe path through the tree.
    endpoints = [ep for ep, _, _ in gpus] + nics
    for i, a in enumerate(endpoints):
        for b in endpoints[i + 1 :]:
            if a.name == b.name or topo.link(a.name, b.name) is not None:
                continue
            cls, raw = _pcie_class(a, b)
            model = model_of(a.name) or model_of(b.name)
            topo.add_link(
                Link(a.name, b.name, cls, raw=raw, gbps=nominal_gbps(cls, model), source=path)
            )

    if static:
        # NVLink is not described in a static file (NCCL reads it from NVML): like `topo -mp`,
        # a PCIe class between two SXM GPUs here is no evidence that NVLink is missing.
        topo.facts["nccl_topo_static"] = True
        topo.facts["pcie_view"] = True
    if gpus and not static:
        topo.facts["nvlink_active"] = nvlink_total
        topo.facts["nvswitch_count"] = len(switches)
    topo.facts["formats"] = ["nccl-xml"]
    topo.facts["sources"] = [path]
    return topo


FORMATS: List[Tuple[str, Callable[[str], bool], Callable[..., Topology]]] = [
    ("nccl-xml", sniff_nccl_xml, parse_nccl_xml),
]
