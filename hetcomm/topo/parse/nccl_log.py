"""Parser for NCCL ``NCCL_DEBUG=INFO`` logs: the transports NCCL actually chose.

A matrix says which paths exist; the log says which one NCCL used, so ``hetcomm audit`` compares
the two (topology-notes §3.3, §8.2 step 6). Logs are usually mixed with the training program's
own output and with the lines of several processes, so every line is matched on its own and
anything that is not an NCCL line is skipped.

Format name: ``nccl-log``. What it produces:

- devices ``rank<r>`` (vendor ``nvidia``, ``index`` = CUDA device, ``host`` from the
  ``host:pid:tid`` prefix, ``pci_bus_id`` from ``ncclCommInitRank ... busId``);
- one link per rank pair from ``Channel NN/NN : a[da] -> b[db] [send|receive] via X`` lines:
  ``P2P/*`` -> ``P2P``, ``SHM/*`` -> ``SHM``, ``NET/IB/N/GDRDMA`` -> ``NET_IB_GDR`` or
  ``NET_ROCE_GDR`` (RoCE when NCCL listed that HCA as ``/RoCE``), ``NET/IB/N`` -> ``NET_IB`` /
  ``NET_ROCE``, ``NET/Socket/N`` -> ``NET_SOCKET``, ``NET/Libfabric|OFI/N`` -> ``NET_EFA``; when
  a pair shows several transports the closest class is kept (``raw`` says which);
- NICs from ``NET/IB : Using [0]mlx5_0:1/RoCE ...`` and ``NET/Socket : Using [0]ens32:...``;
- facts ``nccl_env``, ``nccl_network``, ``nccl_gdr``, ``nccl_gdr_hca``, ``nccl_version``,
  ``nccl_net_class``, ``nccl_transports``, ``nccl_comms``, ``nccl_dmabuf``, ``nccl_nvls``,
  ``nccl_warnings`` (see :func:`parse_nccl_log`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError
from hetcomm.topo.bandwidth import nominal_gbps
from hetcomm.topo.model import Device, Link, LinkClass, Nic, Topology, Vendor
from hetcomm.topo.parse._text import numbered_lines

__all__ = ["FORMATS", "classify_transport", "sniff_nccl_log", "parse_nccl_log"]

# `host:pid:tid [cudaDev] NCCL INFO msg`, optionally after a `[date time]` stamp (WARN lines).
# finditer, not match: interleaved writers can glue two records onto one line.
_PREFIX = re.compile(
    r"(?:\[[^\]]*\]\s*)?(?P<host>[^\s:\[\]]+):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+"
    r"NCCL\s+(?P<level>INFO|WARN|TRACE)\s"
)
_BARE = re.compile(r"(?:^|\s)NCCL\s+(?P<level>INFO|WARN)\s")
_SNIFF = re.compile(r"\bNCCL (INFO|WARN) ")

_CHANNEL = re.compile(
    r"Channel\s+\d+(?:/\d+)?\s*:\s*(\d+)\[(\d+)\]\s*->\s*(\d+)\[(\d+)\]\s*"
    r"(?:\[(send|receive)\]\s*)?via\s+(.+?)\s*$"
)
_INIT = re.compile(
    # NCCL < 2.13 prints the same fields without the function name.
    r"(?:ncclCommInitRank\w*\s+)?comm\s+(0x[0-9a-fA-F]+)\s+rank\s+(\d+)\s+nranks\s+(\d+)\s+"
    r"cudaDev\s+(\d+)(?:\s+nvmlDev\s+\d+)?\s+busId\s+([0-9a-fA-F]+)(?:\s+commId\s+(0x[0-9a-fA-F]+))?"
)
_COMM = re.compile(r"^comm\s+0x[0-9a-fA-F]+\s+rank\s+\d+\s+nRanks\s+(\d+)\s+nNodes\s+(\d+)")
_ENV = re.compile(r"^(NCCL_\w+)\s+set\s+(?:by environment\s+)?to\s?(.*)$")
_NETWORK = re.compile(r"^Using network\s+(.+?)\s*$")
_GDR = re.compile(r"Connected all rings.*?\bGDR\s+(\d)")
# Newer NCCL puts the mechanism in parentheses: "GPU Direct RDMA (DMABUF) enabled for HCA ...".
_GDR_HCA = re.compile(
    r"GPU Direct RDMA\s+(?:\([^)]*\)\s+)?(Enabled|Disabled)\s+for HCA\s+(\d+)\s+'([^']+)'",
    re.IGNORECASE,
)
# NET/IB, or the SHARP plugin's NET/IBext / NET/IBext_v8.
_IB_USING = re.compile(r"^NET/IB\w*\s*:\s*Using\s+(.*)$")
# The device segment of a NET transport: "0", or "0(1)" when PXN proxies through rank 1's NIC.
_NET_DEV = re.compile(r"^(\d+)(?:\(\d+\))?$")
_IB_DEV = re.compile(r"\[(\d+)\]([\w.-]+):(\d+)/(RoCE|IB)\b")
_SOCK_USING = re.compile(r"^NET/Socket\s*:\s*Using\s+(.*)$")
_SOCK_DEV = re.compile(r"\[(\d+)\]([\w.-]+):([0-9a-fA-F.:%\w]+)<")
_VERSION = re.compile(r"^NCCL version\s+(\S+)")
# Network plugins (aws-ofi-nccl / libfabric, the HPC-X IBext/SHARP plugin): their NICs and GDR
# state are in lines of their own.
_OFI_PROVIDER = re.compile(r"^NET/OFI Selected [Pp]rovider is (\S+?),?(?:\s+fabric is \S+)?\s*\(found (\d+) nics?\)")
_OFI_NIC = re.compile(r"^NET/OFI NIC group (\d+) device #(\d+) ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d)")
_GDR_OFF = re.compile(r"disabling GDR|GDR not supported|GDR (?:is )?disabled|GDR unsupported", re.IGNORECASE)
_PXN_GDR = re.compile(r"\bPXN\s+\d+\s+GDR\s+(\d)")
_PLUGIN = re.compile(r"^(?:NET/Plugin\s*:\s*Loaded (net|collnet) plugin (.+?)\s*(?:\(v\d+\))?$|P2P plugin (\S+))")
_DRIVER = re.compile(r"^cudaDriverVersion\s+(\d+)")

_VERBS = "verbs"  # IB or RoCE, with or without GDR: decided per HCA


def _plugin_class(plugin: str):
    """Class of a net plugin name (``IB``, ``IBext_v8``, ``Socket``, ``AWS Libfabric``), the
    marker ``_VERBS`` for verbs plugins, or None when unknown."""
    p = plugin.strip().upper()
    if p.startswith("IB"):
        return _VERBS
    if p == "SOCKET":
        return LinkClass.NET_SOCKET
    if "LIBFABRIC" in p or p == "OFI":
        return LinkClass.NET_EFA
    return None


def sniff_nccl_log(text: str) -> bool:
    """True when ``text`` has at least one ``NCCL INFO`` or ``NCCL WARN`` record."""
    return bool(_SNIFF.search(text))


def classify_transport(raw: str, roce: Optional[bool] = None) -> Optional[LinkClass]:
    """The class of a channel's ``via`` transport string, or None when it is not one NCCL uses.

    Args:
        raw: what follows ``via``: ``P2P/IPC``, ``P2P/CUMEM/read``, ``P2P/direct pointer``,
            ``SHM/direct/direct``, ``NET/IB/0/GDRDMA``, ``NET/Socket/1``, ``NET/Libfabric/0``.
        roce: for ``NET/IB``, True when that HCA is RoCE (``/RoCE`` in the ``NET/IB : Using``
            line), False for InfiniBand, None when unknown (taken as InfiniBand).
    """
    parts = raw.split("/")
    head = parts[0].upper()
    if head == "P2P":
        return LinkClass.P2P
    if head == "SHM":
        return LinkClass.SHM
    if head != "NET" or len(parts) < 3:
        return None
    # Whole path segments, so NET/IB/1 is never read out of NET/IB/10/GDRDMA.
    fixed = _plugin_class(parts[1])
    if not _NET_DEV.match(parts[2]) or fixed is None:
        return None
    if fixed is not _VERBS:
        return fixed
    gdr = "GDRDMA" in (p.upper() for p in parts[3:])
    if roce:
        return LinkClass.NET_ROCE_GDR if gdr else LinkClass.NET_ROCE
    return LinkClass.NET_IB_GDR if gdr else LinkClass.NET_IB


def _records(text: str):
    """Yield ``(line_no, host, cuda_dev, level, message)`` for every NCCL record in ``text``.

    A record glued to the end of another writer's text (``...via P2P/IPCnode1:7:7 [1] NCCL
    INFO ...``) has no separator, so the host name would swallow the tail of the text before
    it; it is cut back to the longest host seen at the start of a line.
    """
    lines = [(no, line) for no, line in numbered_lines(text) if "NCCL" in line]
    known_hosts = set()
    for _, line in lines:
        m = _PREFIX.match(line)
        if m:
            known_hosts.add(m.group("host"))
    for line_no, line in lines:
        found = []
        first = _PREFIX.match(line)
        if first is not None and line.count("NCCL ", first.end()) == 0:
            # the common case: one record, prefix at the start of the line
            yield (
                line_no,
                first.group("host"),
                int(first.group("dev")),
                first.group("level"),
                (line[first.end() :].strip()),
            )
            continue
        for m in _PREFIX.finditer(line):
            host, start = m.group("host"), m.start()
            if start > 0 and host not in known_hosts:
                tails = [h for h in known_hosts if host.endswith(h)]
                if tails:
                    cut = len(host) - len(max(tails, key=len))
                    host, start = host[cut:], m.start("host") + cut
            found.append((start, m.end(), host, int(m.group("dev")), m.group("level")))
        if not found:
            bare = _BARE.search(line)
            if bare:
                yield line_no, None, None, bare.group("level"), line[bare.end() :].strip()
            continue
        for i, (_start, end, host, dev, level) in enumerate(found):
            stop = found[i + 1][0] if i + 1 < len(found) else len(line)
            yield line_no, host, dev, level, line[end:stop].strip()


def _bus_id(nccl_bus_id: str) -> str:
    """NCCL's int64 bus id (``18000``, ``101c0``) as a PCI address (``0000:18:00.0``)."""
    v = int(nccl_bus_id, 16)
    return f"{v >> 20:04x}:{(v >> 12) & 0xFF:02x}:{(v >> 4) & 0xFF:02x}.{v & 0xF:x}"


def parse_nccl_log(text: str, path: str = "<text>") -> Topology:
    """Parse an NCCL ``NCCL_DEBUG=INFO`` log (possibly mixed with other output).

    Facts written:

    - ``nccl_env``: ``{"NCCL_IB_DISABLE": "1", ...}`` from ``X set by environment to Y.`` (the
      trailing ``.`` removed) and ``X set to Y``.
    - ``nccl_network``: the net plugin from ``Using network X`` (most frequent when several).
    - ``nccl_gdr``: sorted distinct values of ``GDR N`` in ``Connected all rings`` lines.
    - ``nccl_gdr_hca``: ``{"mlx5_0": "Enabled"}`` from ``GPU Direct RDMA X for HCA N 'dev'``.
    - ``nccl_version``; ``nccl_comms``: ``{commId: nranks}``; ``nccl_nnodes``: largest nNodes.
    - ``nccl_transports``: ``{"P2P/IPC": 240, ...}`` channel lines per transport.
    - ``nccl_net_class``: class name (``NET_SOCKET``, ``NET_ROCE_GDR`` ...) of the inter-node
      transport: from ``via NET/...`` lines when there are some, else from ``Using network``
      (the p4d socket log has no ``via NET/Socket`` line), the HCAs' link layer and GDR.
    - ``nccl_dmabuf``: True when ``DMA-BUF is available`` was logged; ``nccl_nvls``: False when
      ``NVLS multicast support is not available``; ``nccl_warnings``: distinct WARN messages.

    Raises:
        TopologyParseError: no NCCL record at all (not an NCCL log, or NCCL_DEBUG was not INFO).
    """
    topo = Topology()
    topo.facts["formats"] = ["nccl-log"]
    topo.facts["sources"] = [path]
    env: Dict[str, str] = {}
    networks: Counter = Counter()
    gdr_values = set()
    gdr_hca: Dict[str, str] = {}
    transports: Counter = Counter()
    comms: Dict[str, int] = {}
    nnodes = 0
    warnings: List[str] = []
    ib_devs: Dict[Tuple[Optional[str], int], Tuple[str, int, str]] = {}  # (host, idx) -> dev
    sock_devs: Dict[Tuple[Optional[str], int], str] = {}
    hosts = set()
    # rank -> (host, cudaDev, busId, commId, nranks, line) from ncclCommInitRank
    ranks: Dict[int, Tuple[Optional[str], int, str, str, int, int]] = {}
    channels: List[Tuple[int, Optional[str], int, int, int, int, str]] = []
    num_records = 0
    ofi_provider: Dict[Optional[str], Tuple[str, int]] = {}
    ofi_nics: Dict[Tuple[Optional[str], int, int], str] = {}
    gdr_off: List[str] = []
    plugins: Dict[str, str] = {}

    for line_no, host, _dev, level, msg in _records(text):
        num_records += 1
        if host:
            hosts.add(host)
        if level == "WARN":
            if msg not in warnings and len(warnings) < 50:
                warnings.append(msg)
            continue
        m = _CHANNEL.search(msg)
        if m:
            a, da, b, db, _direction, raw = m.groups()
            channels.append((line_no, host, int(a), int(da), int(b), int(db), raw))
            continue
        m = _INIT.search(msg)
        if m:
            _, rank, nranks, cuda_dev, bus, comm_id = m.groups()
            comm_id = comm_id or "?"
            comms[comm_id] = int(nranks)
            rank, nranks = int(rank), int(nranks)
            prev = ranks.get(rank)
            entry = (host, int(cuda_dev), bus, comm_id, nranks, line_no)
            if prev is None or nranks > prev[4]:
                ranks[rank] = entry
            elif (prev[0], prev[1]) != (host, int(cuda_dev)) and nranks == prev[4]:
                topo.facts.setdefault("parse_warnings", []).append(
                    f"{path}:{line_no}: rank {rank} is {host}[{cuda_dev}] in communicator "
                    f"{comm_id} but {prev[0]}[{prev[1]}] in {prev[3]} (line {prev[5]}); device "
                    f"rank{rank} follows the first, and channel lines cannot be told apart"
                )
            continue
        m = _COMM.match(msg)
        if m:
            nnodes = max(nnodes, int(m.group(2)))
            continue
        m = _ENV.match(msg)
        if m:
            value = m.group(2).strip()
            if value.endswith(".") and not value.endswith(".."):
                value = value[:-1]
            env[m.group(1)] = value
            continue
        m = _NETWORK.match(msg)
        if m:
            networks[m.group(1)] += 1
            continue
        m = _GDR.search(msg) or _PXN_GDR.search(msg)
        if m:
            gdr_values.add(int(m.group(1)))
            continue
        m = _OFI_PROVIDER.match(msg)
        if m:
            ofi_provider[host] = (m.group(1), int(m.group(2)))
            if _GDR_OFF.search(msg):
                gdr_off.append(msg)
            continue
        m = _OFI_NIC.match(msg)
        if m:
            ofi_nics[(host, int(m.group(1)), int(m.group(2)))] = m.group(3).lower()
            continue
        if _GDR_OFF.search(msg):
            if msg not in gdr_off and len(gdr_off) < 20:
                gdr_off.append(msg)
            continue
        m = _PLUGIN.match(msg)
        if m:
            kind = "collnet" if m.group(1) == "collnet" else "net"
            plugins.setdefault(kind, m.group(2) or m.group(3))
            continue
        m = _DRIVER.match(msg)
        if m:
            topo.facts.setdefault("cuda_driver_version", m.group(1))
            continue
        m = _GDR_HCA.search(msg)
        if m:
            gdr_hca[m.group(3)] = m.group(1).capitalize()
            continue
        m = _IB_USING.match(msg)
        if m:
            for idx, name, port, layer in _IB_DEV.findall(m.group(1)):
                ib_devs[(host, int(idx))] = (name, int(port), layer)
            continue
        m = _SOCK_USING.match(msg)
        if m:
            for idx, name, _addr in _SOCK_DEV.findall(m.group(1)):
                sock_devs[(host, int(idx))] = name
            continue
        m = _VERSION.match(msg)
        if m:
            topo.facts.setdefault("nccl_version", m.group(1))
            continue
        if msg.startswith("DMA-BUF is available"):
            topo.facts["nccl_dmabuf"] = True
        elif msg.startswith("NVLS multicast support is not available"):
            topo.facts["nccl_nvls"] = False

    if not num_records:
        lines = numbered_lines(text)
        first = lines[0][0] if lines else 1
        raise TopologyParseError(
            "no NCCL log records found: expected lines like 'host:pid:tid [0] NCCL INFO ...'; "
            "run the job with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH)",
            path=path,
            line=first,
        )

    # NIC names are per host; with several hosts in one log, qualify them so that two hosts'
    # mlx5_0 stay two NICs.
    multi_host = len(hosts) > 1

    def qualified(name: str, host: Optional[str]) -> str:
        return f"{name}@{host}" if multi_host and host else name

    # The OFI plugin's NICs count only when NCCL moves data through it: a log may load it (and
    # have it find 58 verbs devices) and then use its own NET/IB transport.
    ofi_used = any(k.lower().replace(" ", "") in ("libfabric", "awslibfabric", "ofi") for k in networks) or (
        not networks and any(p == "efa" for p, _ in ofi_provider.values())
    )
    if not ofi_used:
        ofi_provider, ofi_nics = {}, {}
    _add_plugin_facts(topo, ofi_provider, ofi_nics, gdr_off, plugins, qualified)

    for (host, _idx), (name, port, layer) in ib_devs.items():
        nic_name = name if port == 1 else f"{name}:{port}"
        topo.add_nic(
            Nic(
                name=qualified(nic_name, host),
                link_layer="Ethernet" if layer == "RoCE" else "InfiniBand",
                port=port,
                host=host,
                gdr={"Enabled": True, "Disabled": False}.get(gdr_hca.get(name, "")),
            )
        )
    for (host, _idx), name in sock_devs.items():
        topo.add_nic(Nic(name=qualified(name, host), link_layer="Ethernet", netdev=name, host=host))

    for rank, (host, cuda_dev, bus, _comm, _n, _line) in sorted(ranks.items()):
        topo.add_device(
            Device(
                name=f"rank{rank}",
                vendor=Vendor.NVIDIA.value,
                index=cuda_dev,
                pci_bus_id=_bus_id(bus),
                host=host,
            )
        )

    def is_roce(host: Optional[str], raw: str) -> Optional[bool]:
        parts = raw.split("/")
        dev_seg = _NET_DEV.match(parts[2]) if len(parts) >= 3 else None
        if dev_seg is None:
            return None
        idx = int(dev_seg.group(1))
        dev = ib_devs.get((host, idx))
        if dev is None:  # the line's host logged no `NET/IB : Using`; any host's list will do
            dev = next((d for (h, i), d in ib_devs.items() if i == idx), None)
        return None if dev is None else dev[2] == "RoCE"

    best: Dict[Tuple[int, int], Tuple[LinkClass, str]] = {}
    net_classes: Counter = Counter()
    channel_ranks: Dict[int, int] = {}  # rank -> CUDA device, for ranks with no init line
    for line_no, host, a, da, b, db, raw in channels:
        channel_ranks.setdefault(a, da)
        channel_ranks.setdefault(b, db)
        transports[raw] += 1
        link_class = classify_transport(raw, is_roce(host, raw))
        if link_class is None:
            topo.facts.setdefault("parse_warnings", []).append(
                f"{path}:{line_no}: unknown NCCL transport {raw!r}; recorded as UNKNOWN"
            )
            link_class = LinkClass.UNKNOWN
        if link_class.is_network:
            net_classes[link_class] += 1
        if a == b:
            continue
        key = (min(a, b), max(a, b))
        if key not in best or link_class < best[key][0]:
            best[key] = (link_class, raw)
    for rank, dev in sorted(channel_ranks.items()):
        if rank not in ranks:
            topo.add_device(Device(name=f"rank{rank}", vendor=Vendor.NVIDIA.value, index=dev))
    for (a, b), (link_class, raw) in sorted(best.items()):
        gbps = (
            None
            if link_class.is_network or link_class == LinkClass.UNKNOWN
            else nominal_gbps(link_class)
        )
        topo.add_link(Link(f"rank{a}", f"rank{b}", link_class, raw=raw, gbps=gbps, source=path))

    if env:
        topo.facts["nccl_env"] = env
    if networks:
        topo.facts["nccl_network"] = networks.most_common(1)[0][0]
        if len(networks) > 1:
            topo.facts.setdefault("parse_warnings", []).append(
                f"{path}: several NCCL networks in one log ({dict(networks)}); "
                f"nccl_network = {topo.facts['nccl_network']} (most frequent)"
            )
    if gdr_values:
        topo.facts["nccl_gdr"] = sorted(gdr_values)
    if gdr_hca:
        topo.facts["nccl_gdr_hca"] = gdr_hca
    if transports:
        topo.facts["nccl_transports"] = dict(transports)
    if comms:
        topo.facts["nccl_comms"] = comms
    if nnodes:
        topo.facts["nccl_nnodes"] = nnodes
    if warnings:
        topo.facts["nccl_warnings"] = warnings
    net_class = _net_class(
        net_classes, topo.facts.get("nccl_network"), ib_devs, gdr_values, gdr_hca
    )
    if net_class is not None:
        topo.facts["nccl_net_class"] = net_class.name
    return topo


def _net_class(
    seen: Counter,
    network: Optional[str],
    ib_devs: Dict[Tuple[Optional[str], int], Tuple[str, int, str]],
    gdr_values: set,
    gdr_hca: Dict[str, str],
) -> Optional[LinkClass]:
    """The inter-node class: observed channels first, else inferred from the chosen plugin."""
    if seen:
        return seen.most_common(1)[0][0]
    if network is None:
        return None
    fixed = _plugin_class(network)
    if fixed is None:
        return None
    if fixed is not _VERBS:
        return fixed
    roce = bool(ib_devs) and all(layer == "RoCE" for _, _, layer in ib_devs.values())
    # GDR: the per-HCA decision when logged, else the rings' GDR flag; unknown counts as no GDR
    # (the cautious reading for an audit).
    if gdr_hca:
        gdr = all(v == "Enabled" for v in gdr_hca.values())
    else:
        gdr = bool(gdr_values) and min(gdr_values) == 1
    if roce:
        return LinkClass.NET_ROCE_GDR if gdr else LinkClass.NET_ROCE
    return LinkClass.NET_IB_GDR if gdr else LinkClass.NET_IB


def _add_plugin_facts(topo, ofi_provider, ofi_nics, gdr_off, plugins, qualified) -> None:
    """NICs and GDR state reported by a network plugin (aws-ofi-nccl, HPC-X IBext/SHARP).

    aws-ofi-nccl lists its devices as ``NIC group G device #D <bus>`` (``ofiG.D``); without those
    lines only the count of ``Selected provider is efa ... (found N nics)`` is known
    (``ofi0 .. ofiN-1``). Their GDR state: ``False`` when the plugin said ``disabling GDR`` /
    ``GDR not supported`` (facts ``nccl_gdr_off``), else unknown.
    """
    off = bool(gdr_off)
    if gdr_off:
        topo.facts["nccl_gdr_off"] = list(gdr_off)
    if plugins:
        topo.facts["nccl_plugins"] = dict(plugins)
    if ofi_provider:
        topo.facts["nccl_ofi_provider"] = sorted({p for p, _ in ofi_provider.values()})
    seen_hosts = set()
    for (host, group, dev), bus in sorted(ofi_nics.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        seen_hosts.add(host)
        provider = ofi_provider.get(host, ("ofi", 0))[0]
        topo.add_nic(
            Nic(
                name=qualified(f"ofi{group}.{dev}", host),
                link_layer=provider.upper() if provider == "efa" else provider,
                pci_bus_id=bus,
                gdr=False if off else None,
                host=host,
            )
        )
    for host, (provider, count) in ofi_provider.items():
        if host in seen_hosts:
            continue
        for k in range(count):
            topo.add_nic(
                Nic(
                    name=qualified(f"ofi{k}", host),
                    link_layer=provider.upper() if provider == "efa" else provider,
                    gdr=False if off else None,
                    host=host,
                )
            )


FORMATS = [("nccl-log", sniff_nccl_log, parse_nccl_log)]
