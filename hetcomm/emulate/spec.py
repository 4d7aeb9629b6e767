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

import dataclasses
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from hetcomm._yaml import load_yaml
from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import Cluster, Node
from hetcomm.topo.compute import relative_speed
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
    "node_compute_scale",
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
_SETTINGS_KEYS = (
    "subnet",
    "scale",
    "mode",
    "queue_ms",
    "master_port",
    "compute",
    "compute_scale",
    "cpu_per_rank",
    "host_share",
)
_MODES = ("bridge", "p2p")
# A CPU-only node beside an H800 would get a thousandth of a core: floor it (the quota is at least
# the kernel's 1 ms per period, see cgroup.period_us_for) so that such a rank still starts within
# a test's patience.
_MIN_COMPUTE_SCALE = 0.01
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
        compute: emulate compute speed: each node's ranks run in a cpu cgroup limited to the
            node's share (see :mod:`hetcomm.emulate.cgroup`). Off by default: a throttled rank
            also imports torch and sets up its group more slowly, which only runs that study
            compute want to pay for.
        compute_scale: per node group or node name, the relative speed in [0.01, 1] (1 = the
            fastest device); overrides the device table for the nodes it names.
        cpu_per_rank: CPUs one rank of speed 1 may use (default: this machine's cores shared
            evenly by all ranks, at most 1, so the fastest ranks never wait for a core that
            another rank's quota already holds).
        host_share: the part of ``cpu_per_rank`` kept for a rank's host threads, in [0, 0.9].
            0 (the default): the whole process runs under its node's quota, communication
            threads included. Above 0: only the rank's training thread (its "device") is held
            to ``compute_scale x cpu_per_rank x (1 - host_share)``; its other threads share the
            rest of ``cpu_per_rank`` with it, so a slow node's host work is not slowed with its
            device, as on a real node (see :mod:`hetcomm.emulate.cgroup`).
    """

    subnet: ipaddress.IPv4Network = ipaddress.IPv4Network(DEFAULT_SUBNET)
    scale: float = DEFAULT_SCALE
    mode: str = "bridge"
    queue_ms: float = 200.0
    master_port: int = DEFAULT_MASTER_PORT
    compute: bool = False
    compute_scale: Tuple[Tuple[str, float], ...] = ()
    cpu_per_rank: float = 1.0
    host_share: float = 0.0


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
        compute_scale: relative compute speed (1 = fastest).
        cpus: CPU quota of each of the node's ranks (``compute_scale x cpu_per_rank``; with a
            ``host_share``, ``cpu_per_rank``), or None when compute speed is not emulated.
        device_cpus: with a ``host_share``, the quota of each rank's training thread
            (``compute_scale x cpu_per_rank x (1 - host_share)``); else None.
    """

    ns: str
    node: str
    index: int
    vendor: str
    ranks: Tuple[int, ...]
    ifaces: Tuple[Iface, ...]
    compute_scale: float = 1.0
    cpus: Optional[float] = None
    device_cpus: Optional[float] = None

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
    compute: Optional[bool] = None,
    cpu_per_rank: Optional[float] = None,
    num_cpus: Optional[int] = None,
) -> EmulationSettings:
    """Check the cluster's ``emulation:`` mapping; command-line values override it.

    Args:
        num_cpus: cores of this machine (default ``os.cpu_count()``), for the default
            ``cpu_per_rank``.

    Raises:
        ConfigError: unknown key, bad subnet (not IPv4, not private, too small), bad mode,
            scale, compute settings, naming the file, line and key.
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

    scales = _compute_scales(cluster, raw.get("compute_scale"), lines)
    compute_v = compute if compute is not None else raw.get("compute", bool(scales))
    if not isinstance(compute_v, bool):
        raise err("compute", f"expected true or false, got {compute_v!r}")
    cores = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
    default_cpr = min(1.0, cores / max(1, cluster.num_ranks))
    cpr = cpu_per_rank if cpu_per_rank is not None else raw.get("cpu_per_rank", default_cpr)
    if isinstance(cpr, bool) or not isinstance(cpr, (int, float)) or not 0.01 <= cpr <= cores:
        raise err(
            "cpu_per_rank",
            f"expected CPUs per rank in [0.01, {cores}] (this machine's cores), got {cpr!r}",
        )
    host_share = raw.get("host_share", 0.0)
    if isinstance(host_share, bool) or not isinstance(host_share, (int, float)) or not 0 <= host_share <= 0.9:
        raise err(
            "host_share",
            f"expected the part of a rank's CPU kept for its host threads, in [0, 0.9] "
            f"(0 = the whole process is slowed), got {host_share!r}",
        )
    return EmulationSettings(
        subnet=net,
        scale=float(scale_v),
        mode=mode_v,
        queue_ms=float(queue_ms),
        master_port=port,
        compute=compute_v,
        compute_scale=scales,
        cpu_per_rank=float(cpr),
        host_share=float(host_share),
    )


def _compute_scales(
    cluster: Cluster, raw: Any, lines: Dict[str, int]
) -> Tuple[Tuple[str, float], ...]:
    """Check ``emulation.compute_scale``: a mapping of node group or node name to a relative
    speed in (0, 1]."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(
            f"expected a mapping of node group or node name to relative speed, e.g. "
            f"{{{cluster.groups[0].name}: 0.5}}, got {raw!r}",
            key="emulation.compute_scale",
            path=cluster.path,
            line=lines.get("compute_scale"),
        )
    known = {g.name for g in cluster.groups} | {n.name for n in cluster.nodes}
    out = []
    for name, value in raw.items():
        key = f"compute_scale.{name}"
        if name not in known:
            raise ConfigError(
                f"no node group or node named {name!r}; known: {', '.join(sorted(known))}",
                key=f"emulation.{key}",
                path=cluster.path,
                line=lines.get(key, lines.get("compute_scale")),
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not _MIN_COMPUTE_SCALE <= value <= 1
        ):
            raise ConfigError(
                f"expected a relative speed in [0.01, 1] (1 = the fastest device, 0.5 = half its "
                f"speed), got {value!r}",
                key=f"emulation.{key}",
                path=cluster.path,
                line=lines.get(key, lines.get("compute_scale")),
            )
        out.append((str(name), float(value)))
    return tuple(out)


def node_compute_scale(cluster: Cluster, settings: EmulationSettings, node: Node) -> float:
    """Relative compute speed of ``node``: its own ``emulation.compute_scale`` entry, else its
    group's, else its devices' throughput over the fastest node's (the device table of
    :mod:`hetcomm.topo.compute`, or the group's ``device.tflops``), at least 0.01."""
    scales = dict(settings.compute_scale)
    if node.name in scales:
        return scales[node.name]
    if node.group.name in scales:
        return scales[node.group.name]
    return max(_MIN_COMPUTE_SCALE, relative_speed(cluster)[node.name])


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
    for gi, g in enumerate(cluster.groups):
        # Namespace names become file names under /run/netns and arguments of `ip`.
        if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", g.name) or len(g.name) > 64:
            key = f"node_groups[{gi}].name"
            raise ConfigError(
                f"node group name {g.name!r} cannot name a network namespace; use letters, digits, "
                f"'_', '.' and single '-' (at most 64 characters)",
                key=key,
                path=cluster.path,
                line=_cluster_lines(cluster).get(key),
            )
    if settings.mode == "p2p":
        plan = _plan_p2p(cluster, settings, run_id)
    else:
        plan = _plan_bridge(cluster, settings, run_id)
    return _with_compute(cluster, settings, plan)


def _with_compute(cluster: Cluster, settings: EmulationSettings, plan: NetPlan) -> NetPlan:
    """Give every node its relative speed and, with ``settings.compute``, its CPU quota."""
    by_name = {n.name: n for n in cluster.nodes}
    nodes = []
    for nn in plan.nodes:
        s = node_compute_scale(cluster, settings, by_name[nn.node])
        cpus = device_cpus = None
        if settings.compute and settings.host_share > 0:
            cpus = settings.cpu_per_rank
            device_cpus = s * settings.cpu_per_rank * (1 - settings.host_share)
        elif settings.compute:
            cpus = s * settings.cpu_per_rank
        nodes.append(dataclasses.replace(nn, compute_scale=s, cpus=cpus, device_cpus=device_cpus))
    notes = list(plan.notes)
    if settings.compute:
        if settings.host_share > 0:
            notes.append(
                "compute speed: "
                + ", ".join(f"{n.node} x{n.compute_scale:.3g} ({n.device_cpus:.3g} CPUs)" for n in nodes)
                + f" for each rank's training thread; its other threads share the rank's "
                f"{settings.cpu_per_rank:.3g} CPUs with it (host_share {settings.host_share:g})"
            )
        else:
            notes.append(
                "compute speed: "
                + ", ".join(
                    f"{n.node} x{n.compute_scale:.3g} ({n.cpus:.3g} CPUs per rank)" for n in nodes
                )
                + f"; {settings.cpu_per_rank:.3g} CPUs per rank at x1"
            )
    elif settings.compute_scale:
        notes.append("compute_scale given but compute emulation is off (emulation.compute: false)")
    return dataclasses.replace(plan, nodes=tuple(nodes), notes=tuple(notes))


def _cluster_lines(cluster: Cluster) -> Dict[str, int]:
    if not cluster.path:
        return {}
    try:
        return dict(load_yaml(cluster.path).lines)
    except ConfigError:
        return {}


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
