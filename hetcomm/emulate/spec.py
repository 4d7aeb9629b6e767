"""What an emulated cluster looks like: namespaces, veth pairs, addresses and shaped rates.

This module is pure: it turns a :class:`~hetcomm.topo.cluster.Cluster` plus its ``emulation:``
settings into a :class:`NetPlan` (names, addresses, rates) without touching the kernel, so the
whole layout can be checked without root. ``hetcomm.emulate.fabric`` applies a plan.

Layout (``mode: bridge``, the default)::

    hc<id>-a100-0 [nic0 10.213.0.1] ==veth== [n0r0 br0] hc<id>-fabric [br0 n1r0] ==veth== [nic0 ...]
                  [nic1 10.213.1.1] ==veth== [n0r1 br1]     (one bridge per rail)

- one network namespace per node (``hc<id>-<node>``), loopback up;
- one veth pair per emulated NIC port; port ``k`` of every node sits on rail ``k``: its own
  bridge ``br<k>`` in the fabric namespace ``hc<id>-fabric`` and its own /24-style subnet;
- a ``tbf`` shaper at the port rate on both ends of each veth (node end: what the node sends;
  fabric end: what it receives), so a node's NIC is a shared, contended resource;
- where a node has peers of the other vendor and the cluster's ``cross_vendor.gbps`` is below its
  port rate, an ``htb`` class under the tbf caps traffic to/from those peers' addresses at the
  bridge rate (split evenly over the node's ports: the bridge rate is per node).

``mode: p2p`` instead wires every pair of nodes with one veth (rate: the pair's
``Cluster.link_gbps``, which is the bridge rate across vendors); each node owns one address,
put on every one of its veths, with a host route per peer. It models per-pair links without NIC
contention and has no multi-rail.

Rates: ``gbps * scale`` Gb/s, e.g. a 200 Gb/s RoCE port at ``scale 1e-3`` is a 200 Mbit/s tbf.
Addresses come from ``emulation.subnet`` (default 10.213.0.0/16), which must be private: they
exist only inside namespaces this run creates and are never routed out of the machine.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from hetcomm._yaml import load_yaml
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import Cluster, Node
from hetcomm.topo.model import LinkClass

__all__ = [
    "EmulationSettings",
    "Iface",
    "Veth",
    "Shaper",
    "NodeNs",
    "NetPlan",
    "settings_from_cluster",
    "plan_network",
    "DEFAULT_SUBNET",
    "DEFAULT_SCALE",
    "NAME_PREFIX",
]

#: Every name this package creates starts with this, then the run id: ``hc3f9a1c-a100-0``.
NAME_PREFIX = "hc"
DEFAULT_SUBNET = "10.213.0.0/16"
# 1e-3 turns 200 Gb/s ports into 200 Mbit/s: fast enough to finish a test in seconds, slow enough
# that 2 shared cores can saturate every emulated link at once (the shaper, not the CPU, limits).
DEFAULT_SCALE = 1.0e-3
DEFAULT_MASTER_PORT = 29500
# A NIC-less node still needs a way out; Cluster.link_gbps uses 10 Gb/s for this case.
_FALLBACK_NIC_GBPS = 10.0
_SETTINGS_KEYS = ("subnet", "scale", "mode", "queue_ms", "master_port")
_MODES = ("bridge", "p2p")
# Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
_IFNAMSIZ = 15


@dataclass(frozen=True)
class EmulationSettings:
    """The ``emulation:`` mapping of a cluster YAML, checked.

    Attributes:
        subnet: private IPv4 range all emulated addresses come from.
        scale: factor applied to every nominal rate (``gbps * scale`` Gb/s on the veth).
        mode: ``bridge`` (NICs on per-rail bridges) or ``p2p`` (one veth per node pair).
        queue_ms: how long a packet may wait in a shaper (tbf ``latency``); a deep queue keeps
            TCP from losing packets, so the measured rate is the shaped rate.
        master_port: TCP port of rank 0's rendezvous store on the emulated network.
    """

    subnet: ipaddress.IPv4Network = ipaddress.IPv4Network(DEFAULT_SUBNET)
    scale: float = DEFAULT_SCALE
    mode: str = "bridge"
    queue_ms: float = 200.0
    master_port: int = DEFAULT_MASTER_PORT


@dataclass(frozen=True)
class Iface:
    """One emulated NIC port inside a node namespace.

    Attributes:
        name: interface name inside the node namespace (``nic0``; ``p<j>`` in p2p mode).
        address: IPv4 address with prefix (``10.213.0.1/24``; ``/32`` in p2p mode).
        rail: rail index (port number) in bridge mode; the peer node index in p2p mode.
        rate_bps: shaped rate, bits per second, per direction.
        link_class: the class of the port (``NET_ROCE_GDR``...), for reports.
        nominal_gbps: the unscaled rate, Gb/s.
    """

    name: str
    address: ipaddress.IPv4Interface
    rail: int
    rate_bps: int
    link_class: LinkClass
    nominal_gbps: float


@dataclass(frozen=True)
class Veth:
    """A veth pair ``(ns_a, name_a)`` <-> ``(ns_b, name_b)``, created right in the namespaces."""

    ns_a: str
    name_a: str
    ns_b: str
    name_b: str


@dataclass(frozen=True)
class Shaper:
    """The qdiscs on one interface end.

    Attributes:
        ns / dev: where.
        rate_bps: tbf rate for everything leaving ``dev``.
        bridge_rate_bps: rate of the cross-vendor class, or None when there is none.
        bridge_match: ``("dst"|"src", [cidr, ...])``: packets whose destination (node end) or
            source (fabric end) is one of these go to the cross-vendor class.
    """

    ns: str
    dev: str
    rate_bps: int
    bridge_rate_bps: Optional[int] = None
    bridge_match: Tuple[str, Tuple[str, ...]] = ("dst", ())


@dataclass(frozen=True)
class NodeNs:
    """One node's namespace.

    Attributes:
        ns: namespace name.
        node: the cluster node's name (``a100-0``).
        index: node index.
        vendor: ``nvidia``/``ascend``/``cpu``.
        ranks: global ranks placed here.
        ifaces: its emulated NICs; ``ifaces[0]`` carries gloo (``GLOO_SOCKET_IFNAME``).
        address: the node's primary address (``ifaces[0]``'s, without prefix).
    """

    ns: str
    node: str
    index: int
    vendor: str
    ranks: Tuple[int, ...]
    ifaces: Tuple[Iface, ...]

    @property
    def address(self) -> str:
        return str(self.ifaces[0].address.ip) if self.ifaces else "127.0.0.1"


@dataclass(frozen=True)
class NetPlan:
    """Everything one emulation creates, in creation order.

    Attributes:
        run_id: short hex id; every name carries ``prefix``.
        settings: the checked settings (after ``--scale`` and friends).
        nodes: one entry per cluster node.
        fabric_ns: the bridge namespace (bridge mode), else None.
        bridges: bridge names inside ``fabric_ns``.
        veths: every veth pair.
        shapers: every shaped interface end.
        routes: ``(ns, cidr, dev, src)`` host routes (p2p mode).
        notes: facts for reports (fallbacks taken, what could not be emulated).
    """

    run_id: str
    cluster_name: str
    settings: EmulationSettings
    nodes: Tuple[NodeNs, ...]
    fabric_ns: Optional[str]
    bridges: Tuple[str, ...]
    veths: Tuple[Veth, ...]
    shapers: Tuple[Shaper, ...]
    routes: Tuple[Tuple[str, str, str, str], ...]
    notes: Tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return f"{NAME_PREFIX}{self.run_id}-"

    @property
    def namespaces(self) -> List[str]:
        """Every namespace, fabric first (veths of node namespaces end in it)."""
        names = [self.fabric_ns] if self.fabric_ns else []
        return names + [n.ns for n in self.nodes]

    @property
    def num_ranks(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    def node_of_rank(self, rank: int) -> NodeNs:
        for n in self.nodes:
            if rank in n.ranks:
                return n
        raise ConfigError(f"rank {rank} is not placed in emulation {self.run_id}")


def settings_from_cluster(
    cluster: Cluster,
    *,
    scale: Optional[float] = None,
    mode: Optional[str] = None,
    subnet: Optional[str] = None,
) -> EmulationSettings:
    """Check the cluster's ``emulation:`` mapping; command-line values override it.

    Raises:
        ConfigError: unknown key, bad subnet (not IPv4, not private, too small), bad mode or
            scale, naming the file, line and key.
    """
    raw: Dict[str, Any] = cluster.emulation_settings()
    lines = _emulation_lines(cluster)

    def err(key: str, message: str) -> ConfigError:
        return ConfigError(message, key=f"emulation.{key}", path=cluster.path, line=lines.get(key))

    for k in raw:
        if k not in _SETTINGS_KEYS:
            raise err(str(k), f"unknown key '{k}'; allowed here: {', '.join(_SETTINGS_KEYS)}")

    subnet_text = subnet if subnet is not None else raw.get("subnet", DEFAULT_SUBNET)
    try:
        net = ipaddress.IPv4Network(str(subnet_text), strict=True)
    except ValueError as e:
        raise err("subnet", f"not an IPv4 network ({e}); write it like {DEFAULT_SUBNET}") from None
    if not net.is_private or net.is_loopback or net.is_link_local or net.is_multicast:
        raise err(
            "subnet",
            f"{net} is not a private range; emulated addresses must never be routable outside "
            f"this machine: use a 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16 range",
        )

    scale_v = scale if scale is not None else raw.get("scale", DEFAULT_SCALE)
    if isinstance(scale_v, bool) or not isinstance(scale_v, (int, float)) or not 0 < scale_v <= 1:
        raise err("scale", f"expected a number in (0, 1], e.g. 1.0e-3, got {scale_v!r}")

    mode_v = mode if mode is not None else raw.get("mode", "bridge")
    if mode_v not in _MODES:
        raise err("mode", f"unknown mode {mode_v!r}; expected one of {', '.join(_MODES)}")

    queue_ms = raw.get("queue_ms", 200.0)
    if isinstance(queue_ms, bool) or not isinstance(queue_ms, (int, float)) or not queue_ms > 0:
        raise err("queue_ms", f"expected a positive number of milliseconds, got {queue_ms!r}")
    port = raw.get("master_port", DEFAULT_MASTER_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise err("master_port", f"expected a TCP port in 1024..65535, got {port!r}")
    return EmulationSettings(
        subnet=net, scale=float(scale_v), mode=mode_v, queue_ms=float(queue_ms), master_port=port
    )


def _emulation_lines(cluster: Cluster) -> Dict[str, int]:
    """Line of each ``emulation.<key>`` in the cluster file (empty when not from a file)."""
    if not cluster.path:
        return {}
    try:
        src = load_yaml(cluster.path)
    except ConfigError:
        return {}
    return {k[len("emulation.") :]: v for k, v in src.lines.items() if k.startswith("emulation.")}


def _rate_bps(gbps: float, scale: float) -> int:
    return max(1000, int(round(gbps * scale * 1e9)))


def _node_ports(node: Node) -> List[Tuple[LinkClass, float]]:
    ports = [(spec.link_class, spec.gbps) for spec in node.group.nics for _ in range(spec.count)]
    return ports or [(LinkClass.NET_SOCKET, _FALLBACK_NIC_GBPS)]


def _check_run_id(run_id: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{6}", run_id):
        raise ConfigError(f"run id {run_id!r} must be 6 lowercase hex digits")


def plan_network(cluster: Cluster, settings: EmulationSettings, run_id: str) -> NetPlan:
    """Lay out namespaces, veths, addresses and shapers for ``cluster``.

    Args:
        cluster: the cluster to emulate (its ranks are placed node by node, as in the YAML).
        settings: from :func:`settings_from_cluster`.
        run_id: 6 hex digits; all names are ``hc<run_id>-...``.

    Raises:
        ConfigError: the subnet is too small for the nodes and rails.
    """
    _check_run_id(run_id)
    for g in cluster.groups:
        # Namespace names become file names under /run/netns and arguments of `ip`.
        if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", g.name) or len(g.name) > 64:
            raise ConfigError(
                f"node group name {g.name!r} cannot name a network namespace; use letters, digits, "
                f"'_', '.' and single '-' (at most 64 characters)",
                key="node_groups.name",
                path=cluster.path,
            )
    if settings.mode == "p2p":
        return _plan_p2p(cluster, settings, run_id)
    return _plan_bridge(cluster, settings, run_id)


def _ns_name(run_id: str, node: str) -> str:
    return f"{NAME_PREFIX}{run_id}-{node}"


def _cross_vendor(a: str, b: str) -> bool:
    return a != b and "cpu" not in (a, b)


def _plan_bridge(cluster: Cluster, settings: EmulationSettings, run_id: str) -> NetPlan:
    nodes = cluster.nodes
    ports = {n.index: _node_ports(n) for n in nodes}
    num_rails = max(len(p) for p in ports.values())
    notes: List[str] = []
    if any(not n.group.nics for n in nodes):
        notes.append(f"nodes without NICs get one NET_SOCKET port of {_FALLBACK_NIC_GBPS:g} Gb/s")
    # Rail k gets its own subnet so that a port only ever talks to the same port of other nodes.
    extra_bits = max(0, math.ceil(math.log2(num_rails))) if num_rails > 1 else 0
    if settings.subnet.prefixlen + extra_bits > 30:
        raise _subnet_error(cluster, settings, f"{num_rails} rails")
    rail_prefix = settings.subnet.prefixlen + extra_bits
    # Readable addresses where they fit: rail k of 10.213.0.0/16 is 10.213.k.0/24.
    if rail_prefix <= 24 and 254 >= len(nodes):
        rail_prefix = 24
    rail_nets = list(settings.subnet.subnets(new_prefix=rail_prefix))[:num_rails]
    if rail_nets[0].num_addresses - 2 < len(nodes):
        raise _subnet_error(cluster, settings, f"{len(nodes)} nodes on each of {num_rails} rails")
    if len(nodes) > 999 or num_rails > 99:
        raise ConfigError(
            f"cluster '{cluster.name}' has {len(nodes)} nodes and {num_rails} rails; the emulator "
            f"names fabric ports n<node>r<rail> in 15 bytes, so at most 999 nodes and 99 rails",
            path=cluster.path,
        )
    fabric = _ns_name(run_id, "fabric")
    bridges = tuple(f"br{k}" for k in range(num_rails))

    node_ns: List[NodeNs] = []
    for n in nodes:
        ifaces = []
        for k, (cls, gbps) in enumerate(ports[n.index]):
            host = rail_nets[k].network_address + 1 + n.index
            addr = ipaddress.IPv4Interface(f"{host}/{rail_nets[k].prefixlen}")
            ifaces.append(Iface(f"nic{k}", addr, k, _rate_bps(gbps, settings.scale), cls, gbps))
        node_ns.append(
            NodeNs(
                _ns_name(run_id, n.name),
                n.name,
                n.index,
                n.group.vendor,
                tuple(n.ranks),
                tuple(ifaces),
            )
        )

    veths: List[Veth] = []
    shapers: List[Shaper] = []
    ic = cluster.interconnect
    for nn in node_ns:
        others = [o for o in node_ns if _cross_vendor(nn.vendor, o.vendor)]
        other_cidrs = tuple(f"{i.address.ip}/32" for o in others for i in o.ifaces)
        for iface in nn.ifaces:
            fabric_port = f"n{nn.index}r{iface.rail}"
            veths.append(Veth(nn.ns, iface.name, fabric, fabric_port))
            bridge_bps = None
            if other_cidrs:
                per_port_gbps = ic.cross_vendor_gbps / len(nn.ifaces)
                if per_port_gbps < iface.nominal_gbps:
                    bridge_bps = _rate_bps(per_port_gbps, settings.scale)
            shapers.append(
                Shaper(nn.ns, iface.name, iface.rate_bps, bridge_bps, ("dst", other_cidrs))
            )
            shapers.append(
                Shaper(fabric, fabric_port, iface.rate_bps, bridge_bps, ("src", other_cidrs))
            )
    if any(s.bridge_rate_bps for s in shapers):
        notes.append(
            f"cross-vendor traffic is capped at {ic.cross_vendor_gbps:g} Gb/s per node "
            f"(x{settings.scale:g}) by an htb class under each port's tbf"
        )
    notes.append(
        f"cross-vendor latency ({ic.cross_vendor_latency_us:g} us) is not emulated: netem is not "
        f"available; only rates are shaped"
    )
    return NetPlan(
        run_id=run_id,
        cluster_name=cluster.name,
        settings=settings,
        nodes=tuple(node_ns),
        fabric_ns=fabric,
        bridges=bridges,
        veths=tuple(veths),
        shapers=tuple(shapers),
        routes=(),
        notes=tuple(notes),
    )


def _plan_p2p(cluster: Cluster, settings: EmulationSettings, run_id: str) -> NetPlan:
    nodes = cluster.nodes
    if settings.subnet.num_addresses - 2 < len(nodes):
        raise _subnet_error(cluster, settings, f"{len(nodes)} nodes")
    addrs = {n.index: settings.subnet.network_address + 1 + n.index for n in nodes}
    ifaces: Dict[int, List[Iface]] = {n.index: [] for n in nodes}
    veths: List[Veth] = []
    shapers: List[Shaper] = []
    routes: List[Tuple[str, str, str, str]] = []
    if len(nodes) > 9999:
        raise ConfigError(
            f"cluster '{cluster.name}' has too many nodes for p2p mode", path=cluster.path
        )
    for a in nodes:
        for b in nodes:
            if b.index <= a.index:
                continue
            gbps = cluster.link_gbps(a.first_rank, b.first_rank)
            cls = cluster.link_class(a.first_rank, b.first_rank)
            rate = _rate_bps(gbps, settings.scale)
            ns_a, ns_b = _ns_name(run_id, a.name), _ns_name(run_id, b.name)
            name_a, name_b = f"p{b.index}", f"p{a.index}"
            ifaces[a.index].append(
                Iface(
                    name_a,
                    ipaddress.IPv4Interface(f"{addrs[a.index]}/32"),
                    b.index,
                    rate,
                    cls,
                    gbps,
                )
            )
            ifaces[b.index].append(
                Iface(
                    name_b,
                    ipaddress.IPv4Interface(f"{addrs[b.index]}/32"),
                    a.index,
                    rate,
                    cls,
                    gbps,
                )
            )
            veths.append(Veth(ns_a, name_a, ns_b, name_b))
            shapers.append(Shaper(ns_a, name_a, rate))
            shapers.append(Shaper(ns_b, name_b, rate))
            routes.append((ns_a, f"{addrs[b.index]}/32", name_a, str(addrs[a.index])))
            routes.append((ns_b, f"{addrs[a.index]}/32", name_b, str(addrs[b.index])))
    node_ns = tuple(
        NodeNs(
            _ns_name(run_id, n.name),
            n.name,
            n.index,
            n.group.vendor,
            tuple(n.ranks),
            tuple(ifaces[n.index]),
        )
        for n in nodes
    )
    notes = [
        "p2p mode: one shaped veth per node pair at the pair's link rate; no NIC contention, "
        "no multi-rail",
    ]
    return NetPlan(
        run_id=run_id,
        cluster_name=cluster.name,
        settings=settings,
        nodes=node_ns,
        fabric_ns=None,
        bridges=(),
        veths=tuple(veths),
        shapers=tuple(shapers),
        routes=tuple(routes),
        notes=tuple(notes),
    )


def _subnet_error(cluster: Cluster, settings: EmulationSettings, need: str) -> ConfigError:
    lines = _emulation_lines(cluster)
    return ConfigError(
        f"subnet {settings.subnet} is too small for {need}; use a larger private range such as "
        f"{DEFAULT_SUBNET}",
        key="emulation.subnet",
        path=cluster.path,
        line=lines.get("subnet"),
    )
