"""Cluster descriptions: which nodes exist, what is in them, and how they reach each other.

A cluster YAML (``configs/clusters/*.yaml``) describes a cluster by node *groups*; ranks are
assigned node by node, device by device, the way torchrun numbers them. The same file drives
the backend (which rail reaches which peer), the planner and simulator (link classes,
bandwidths, shared NICs), the MoE layer (strong ranks, wire dtypes) and the emulator.

Schema (every key is checked; unknown keys are rejected with the file, line and key; every number
is type- and range-checked and sizes are capped: the rules and limits, such as 1,024 ranks, are
in ``docs/TOPOLOGY.md``, "Cluster files: validation and limits")::

    name: mixed-mini                  # required
    description: free text            # optional
    node_groups:                      # required, in rank order
      - name: a100                    # required, unique; nodes are named a100-0, a100-1, ...
        count: 1                      # nodes in the group (default 1)
        device:
          model: A100-SXM4-80GB       # required; vendor follows from the model
          count: 2                    # devices (= ranks) per node, required
          strong: true                # may hold replicas of hot experts (default: nvidia)
          numa_nodes: 2               # NUMA nodes the devices are spread over (default 1)
          tflops: 312                 # dense FP16 TFLOPS per device (default: hetcomm.topo.compute)
        fabric: NVLINK                # device-to-device class inside a node (default by vendor)
        fabric_gbps: 2400             # per-direction Gb/s of that fabric (default: nominal)
        nics:                         # network ports of one node (default: none)
          - class: NET_ROCE_GDR
            gbps: 200                 # per port, per direction
            count: 8
            numa: [0, 0, 0, 0, 1, 1, 1, 1]   # optional, NUMA node of each port
    interconnect:
      same_vendor: auto               # class between nodes of one vendor; auto = best NIC class
      cross_vendor:                   # NVIDIA <-> Ascend always stages through host memory
        class: HOST_BRIDGE
        gbps: 100                     # per node, per direction (host staging + host NIC)
        latency_us: 30
    wire_dtype:                       # per link class, for MoE activations (fp32/fp16/bf16)
      HOST_BRIDGE: fp16
    emulation:                        # used by `hetcomm emulate` only (see docs/EMULATE.md)
      subnet: 10.213.0.0/16
      scale: 1.0e-3
      mode: bridge                    # or p2p

Rank placement comes from this file, not from hostnames: on one machine, CPU processes stand
for the devices it lists (their kinds are *labels*; the transports between them are real).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hetcomm._yaml import SourcedYaml, load_yaml, load_yaml_text, reject_unknown_keys
from hetcomm.errors import ConfigError
from hetcomm.topo.bandwidth import canonical_model, nominal_gbps, vendor_of_model
from hetcomm.topo.model import Device, Link, LinkClass, Nic, Topology
from hetcomm.wire_dtypes import LINK_SPELLINGS, parse_wire_dtype

__all__ = [
    "NicSpec",
    "NodeGroup",
    "Node",
    "RankInfo",
    "Interconnect",
    "Cluster",
    "load_cluster",
    "cluster_from_env",
    "CLUSTER_ENV",
]

CLUSTER_ENV = "HETCOMM_CLUSTER"  # declared in hetcomm.settings (CLUSTER); the name, for child environments
#: The default wire dtype across vendors, and the CANN release it protects against (BF16
#: ``dsd_copy`` precision bug of CANN 7.0.RC1, fixed in 7.0.RC2; see ``wire_dtype_for``).
CROSS_VENDOR_WIRE_DTYPE = "fp16"
CROSS_VENDOR_WIRE_PROTECTS_AGAINST = "CANN 7.0.RC1 (BF16 dsd_copy precision bug, fixed in 7.0.RC2)"
_DEFAULT_FABRIC = {"nvidia": LinkClass.NVLINK, "ascend": LinkClass.HCCS, "cpu": LinkClass.SHM}


@dataclass(frozen=True)
class NicSpec:
    """A set of identical network ports on every node of a group.

    Attributes:
        link_class: a network class (``NET_*``).
        gbps: rate of one port, Gb/s per direction.
        count: ports per node.
        numa: NUMA node of each port (``len == count``), or None when not given.
    """

    link_class: LinkClass
    gbps: float
    count: int = 1
    numa: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class NodeGroup:
    """``count`` identical nodes (one entry of ``node_groups``)."""

    name: str
    count: int
    model: str
    vendor: str
    devices_per_node: int
    strong: bool
    numa_nodes: int
    fabric: LinkClass
    fabric_gbps: Optional[float]
    nics: Tuple[NicSpec, ...]
    #: dense FP16/BF16 TFLOPS of one device, overriding the compute table
    #: (``hetcomm.topo.compute``); None = the table's figure for ``model``.
    tflops: Optional[float] = None


@dataclass(frozen=True)
class Node:
    """One node of the cluster, after expanding the groups.

    Attributes:
        index: node index in rank order.
        name: ``<group>-<i>``.
        group: the :class:`NodeGroup` it came from.
        first_rank: global rank of its first device.
    """

    index: int
    name: str
    group: NodeGroup
    first_rank: int

    @property
    def num_devices(self) -> int:
        """Devices (= ranks) on this node."""
        return self.group.devices_per_node

    @property
    def ranks(self) -> range:
        """Global ranks on this node."""
        return range(self.first_rank, self.first_rank + self.group.devices_per_node)

    @property
    def vendor(self) -> str:
        return self.group.vendor

    @property
    def model(self) -> str:
        return self.group.model

    @property
    def nic_gbps_total(self) -> float:
        """Sum of every NIC port's rate on this node, Gb/s per direction."""
        return float(sum(n.gbps * n.count for n in self.group.nics))

    @property
    def num_nics(self) -> int:
        """Network ports on this node."""
        return sum(n.count for n in self.group.nics)


@dataclass(frozen=True)
class RankInfo:
    """Where one rank is and what it stands for.

    Attributes:
        rank: global rank.
        node: the :class:`Node` it is on.
        local_rank: index among the node's devices.
        model / vendor / strong: the device it stands for.
        numa: NUMA node of the device (devices are spread evenly over ``numa_nodes``).
    """

    rank: int
    node: Node
    local_rank: int
    model: str
    vendor: str
    strong: bool
    numa: int

    @property
    def device_name(self) -> str:
        """``GPU<local>`` for NVIDIA, ``NPU<local>`` for Ascend, ``CPU<local>`` otherwise."""
        prefix = {"nvidia": "GPU", "ascend": "NPU"}.get(self.vendor, "CPU")
        return f"{prefix}{self.local_rank}"


@dataclass(frozen=True)
class Interconnect:
    """How nodes reach each other.

    Attributes:
        same_vendor: class between nodes of one vendor, or None for "best common NIC class".
        cross_vendor_class: class of the NVIDIA <-> Ascend path (``HOST_BRIDGE``).
        cross_vendor_gbps: per-node bridge bandwidth, Gb/s per direction.
        cross_vendor_latency_us: extra latency of the staging hop, microseconds.
    """

    same_vendor: Optional[LinkClass] = None
    cross_vendor_class: LinkClass = LinkClass.HOST_BRIDGE
    cross_vendor_gbps: float = 100.0
    cross_vendor_latency_us: float = 30.0


@dataclass(frozen=True)
class Cluster:
    """A whole cluster, loaded from YAML (:func:`load_cluster`).

    Attributes:
        name: the cluster's name.
        groups: node groups in rank order.
        interconnect: how nodes reach each other.
        wire_dtype: per link class, the dtype MoE activations travel in (``fp32/fp16/bf16``).
        emulation: the raw ``emulation`` mapping (interpreted by ``hetcomm.emulate``).
        description: free text.
        path: the file it was loaded from, if any.
    """

    name: str
    groups: Tuple[NodeGroup, ...]
    interconnect: Interconnect = field(default_factory=Interconnect)
    wire_dtype: Tuple[Tuple[str, str], ...] = ()
    emulation: Tuple[Tuple[str, Any], ...] = ()
    description: str = ""
    path: Optional[str] = None

    # -- derived structure ------------------------------------------------------------------
    @property
    def nodes(self) -> List[Node]:
        """Every node, groups expanded, in rank order."""
        return list(self._node_table)

    @functools.cached_property
    def _node_table(self) -> Tuple[Node, ...]:
        return tuple(self._nodes())

    @functools.cached_property
    def _rank_to_node(self) -> Tuple[Node, ...]:
        return tuple(node for node in self._node_table for _ in node.ranks)

    def _nodes(self):
        index, rank = 0, 0
        for g in self.groups:
            for i in range(g.count):
                yield Node(index=index, name=f"{g.name}-{i}", group=g, first_rank=rank)
                index += 1
                rank += g.devices_per_node

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def num_ranks(self) -> int:
        return sum(g.count * g.devices_per_node for g in self.groups)

    def node_of(self, rank: int) -> Node:
        """The node holding global ``rank``."""
        self._check_rank(rank)
        return self._rank_to_node[rank]

    def rank(self, rank: int) -> RankInfo:
        """What global ``rank`` stands for and where it is."""
        node = self.node_of(rank)
        g = node.group
        local = rank - node.first_rank
        per_numa = max(1, math.ceil(g.devices_per_node / g.numa_nodes))
        return RankInfo(
            rank=rank,
            node=node,
            local_rank=local,
            model=g.model,
            vendor=g.vendor,
            strong=g.strong,
            numa=local // per_numa,
        )

    @property
    def strong_ranks(self) -> List[int]:
        """Ranks whose devices may hold replicas of hot experts."""
        return [r for node in self._node_table if node.group.strong for r in node.ranks]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(
                f"rank {rank} is outside cluster '{self.name}', which has {self.num_ranks} ranks "
                f"(0..{self.num_ranks - 1}); launch with WORLD_SIZE={self.num_ranks} or pick "
                f"another cluster file",
                path=self.path,
            )

    # -- links ------------------------------------------------------------------------------
    def network_class(self, a: Node, b: Node) -> LinkClass:
        """The class two different nodes of one vendor talk over."""
        if self.interconnect.same_vendor is not None:
            return self.interconnect.same_vendor
        classes_a = {n.link_class for n in a.group.nics}
        classes_b = {n.link_class for n in b.group.nics}
        common = classes_a & classes_b
        if common:
            return min(common)
        if classes_a or classes_b:
            # Different NIC technologies on the two ends: they meet at the worse of the two.
            return max(min(classes_a or classes_b), min(classes_b or classes_a))
        return LinkClass.NET_SOCKET

    def link_class(self, a: int, b: int) -> LinkClass:
        """The class of the path between global ranks ``a`` and ``b`` (``a != b``)."""
        ra, rb = self.rank(a), self.rank(b)
        if ra.vendor != rb.vendor and "cpu" not in (ra.vendor, rb.vendor):
            return self.interconnect.cross_vendor_class
        if ra.node.index == rb.node.index:
            return ra.node.group.fabric
        return self.network_class(ra.node, rb.node)

    def link_gbps(self, a: int, b: int) -> float:
        """Nominal per-direction Gb/s of the path between ranks ``a`` and ``b``.

        Inside a node this is the fabric rate; between nodes it is one port's rate (a pair's
        traffic uses one port; striping over several is the planner's business); across vendors
        it is the bridge rate.
        """
        cls = self.link_class(a, b)
        ra, rb = self.rank(a), self.rank(b)
        if cls == self.interconnect.cross_vendor_class and ra.vendor != rb.vendor:
            return self.interconnect.cross_vendor_gbps
        if ra.node.index == rb.node.index:
            return self.fabric_gbps(ra.node.group)
        ports = [n.gbps for n in ra.node.group.nics] + [n.gbps for n in rb.node.group.nics]
        return float(min(ports)) if ports else 10.0

    @staticmethod
    def fabric_gbps(group: NodeGroup) -> float:
        """Per-direction Gb/s of a group's intra-node fabric (given, or nominal by model)."""
        if group.fabric_gbps is not None:
            return group.fabric_gbps
        nominal = nominal_gbps(group.fabric, group.model)
        # A CPU "fabric" (SHM) with no model: host memory copy, ~10 GB/s, a conservative guess.
        return nominal if nominal is not None else 80.0

    def wire_dtype_for(self, link_class: LinkClass) -> str:
        """The dtype activations travel in over ``link_class`` (default fp16 across vendors).

        Across vendors (``HOST_BRIDGE``) the default is FP16, not BF16: CANN 7.0.RC1's BF16
        ``dsd_copy`` precision bug (fixed in 7.0.RC2; ``KNOWN_BAD_VERSIONS`` in
        :mod:`hetcomm.topo.rules_measured`, where ``hetcomm audit`` flags that release) corrupts
        BF16 tensors copied between chips, and FP16 is exact on both vendors' wire for
        activations in range. A cluster file's ``wire_dtype`` entry overrides it.
        """
        policy = dict(self.wire_dtype)
        if link_class.name in policy:
            return policy[link_class.name]
        if link_class == LinkClass.HOST_BRIDGE:
            return CROSS_VENDOR_WIRE_DTYPE
        return policy.get("default", "fp32")

    def emulation_settings(self) -> Dict[str, Any]:
        """The ``emulation`` mapping as a dict (empty when absent)."""
        return dict(self.emulation)

    # -- as a topology ----------------------------------------------------------------------
    def to_topology(self, *, label_only: bool = False) -> Topology:
        """Devices named ``rank<N>`` with their nodes, NICs per node, and every rank pair's link.

        Args:
            label_only: mark the devices as labels (CPU processes standing for them).
        """
        topo = Topology()
        for r in range(self.num_ranks):
            info = self.rank(r)
            topo.add_device(
                Device(
                    name=f"rank{r}",
                    vendor=info.vendor,
                    model=info.model,
                    index=info.local_rank,
                    numa=info.numa,
                    host=info.node.name,
                    label_only=label_only,
                )
            )
        for node in self._node_table:
            port = 0
            for spec in node.group.nics:
                for i in range(spec.count):
                    layer = "InfiniBand" if spec.link_class in (LinkClass.NET_IB, LinkClass.NET_IB_GDR) else "Ethernet"
                    topo.add_nic(
                        Nic(
                            name=f"{node.name}/nic{port}",
                            link_layer=layer,
                            rate_gbps=spec.gbps,
                            state="Active",
                            numa=spec.numa[i] if spec.numa else None,
                            gdr=spec.link_class.is_gdr,
                            host=node.name,
                        )
                    )
                    port += 1
        for a in range(self.num_ranks):
            for b in range(a + 1, self.num_ranks):
                cls = self.link_class(a, b)
                topo.add_link(
                    Link(f"rank{a}", f"rank{b}", cls, raw=cls.name, gbps=self.link_gbps(a, b), source="cluster")
                )
        topo.facts["sources"] = [self.path or f"cluster:{self.name}"]
        topo.facts["formats"] = ["cluster-yaml"]
        return topo


# -- loading --------------------------------------------------------------------------------

# Limits (docs/TOPOLOGY.md, "Cluster limits"). The planner, simulator and `hetcomm topo` hold
# every rank pair (n^2 links): 512 ranks take ~12 s and 0.5 GB to simulate on a loaded 2-core
# machine, 2048 ranks ~155 s and 5 GB, so larger clusters are refused up front with a message
# rather than ending in a MemoryError minutes later.
MAX_RANKS = 1024
MAX_DEVICES_PER_NODE = 64
MAX_NICS_PER_NODE = 64
MAX_NUMA_NODES = 64
#: Any rate (fabric, NIC, bridge), Gb/s per direction: 1 Pb/s is beyond every real link.
MAX_GBPS = 1e6
#: A device's dense TFLOPS: 100 PFLOPS is far beyond every real accelerator.
MAX_TFLOPS = 1e5
#: The bridge's extra latency, microseconds (1 s).
MAX_LATENCY_US = 1e6
MAX_NAME_CHARS = 64
MAX_DESCRIPTION_CHARS = 4096

_TOP_KEYS = ("name", "description", "node_groups", "interconnect", "wire_dtype", "emulation")
_GROUP_KEYS = ("name", "count", "device", "fabric", "fabric_gbps", "nics")
_DEVICE_KEYS = ("model", "count", "strong", "numa_nodes", "tflops")
_NIC_KEYS = ("class", "gbps", "count", "numa")
_INTERCONNECT_KEYS = ("same_vendor", "cross_vendor")
_CROSS_KEYS = ("class", "gbps", "latency_us")


def load_cluster(path: str) -> Cluster:
    """Load a cluster YAML file.

    Raises:
        ConfigError: naming the file, line and key of the first problem (unknown key, missing
            key, wrong type, unknown link class, non-positive count, ...).
    """
    return _build(load_yaml(path))


def load_cluster_text(text: str, path: str = "<text>") -> Cluster:
    """Load a cluster description from YAML text (tests, generated clusters)."""
    return _build(load_yaml_text(text, path))


def cluster_from_env() -> Optional[Cluster]:
    """The cluster named by ``$HETCOMM_CLUSTER``, or None when the variable is unset."""
    from hetcomm import settings

    path = settings.CLUSTER.get()
    if not path:
        return None
    return load_cluster(path)


def _require(src: SourcedYaml, mapping: Dict[str, Any], key: str, name: str) -> Any:
    if name not in mapping or mapping[name] is None:
        raise src.error(f"{key}.{name}" if key else name, f"missing required key '{name}'")
    return mapping[name]


def _mapping(src: SourcedYaml, value: Any, key: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise src.error(key, f"expected a mapping, got {type(value).__name__} {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """``repr`` of a value, shortened: an error must not print a 100 KB string back."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive_int(src: SourcedYaml, value: Any, key: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise src.error(key, f"expected a positive whole number, got {_shown(value)}")
    if value > maximum:
        raise src.error(key, f"{value} is more than the {maximum} hetcomm accepts here (see docs/TOPOLOGY.md, cluster limits)")
    return value


def _number(src: SourcedYaml, value: Any, key: str, *, unit: str, minimum: float, maximum: float, positive: bool) -> float:
    """A finite int or float in ``(0, maximum]`` (``positive``) or ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise src.error(key, f"expected a number of {unit}, got {type(value).__name__} {_shown(value)}")
    value = float(value) if not isinstance(value, int) or abs(value) < 1 << 63 else float("inf")
    if not math.isfinite(value) or (positive and not value > 0) or value < minimum or value > maximum:
        low = "greater than 0" if positive else f"at least {minimum:g}"
        raise src.error(key, f"expected {unit} {low} and at most {maximum:g}, got {value:g}")
    return value


def _positive_float(src: SourcedYaml, value: Any, key: str) -> float:
    """A rate in Gb/s per direction (a device's TFLOPS is read by ``_number`` in its own unit)."""
    return _number(src, value, key, unit="Gb/s", minimum=0.0, maximum=MAX_GBPS, positive=True)


def _text(src: SourcedYaml, value: Any, key: str, what: str, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise src.error(key, f"expected {what} (a non-empty string), got {_shown(value)}")
    if len(value) > limit:
        raise src.error(key, f"{what} is {len(value)} characters long; at most {limit} are accepted")
    return value


def _link_class(src: SourcedYaml, value: Any, key: str) -> LinkClass:
    if not isinstance(value, str):
        raise src.error(key, f"expected a link class name, got {_shown(value)}")
    try:
        return LinkClass.parse(value)
    except ValueError as e:
        raise src.error(key, str(e)) from None


def _build(src: SourcedYaml) -> Cluster:
    top = _mapping(src, src.data, "")
    reject_unknown_keys(src, top, "", _TOP_KEYS)
    name = _text(src, _require(src, top, "", "name"), "name", "a cluster name", MAX_NAME_CHARS)
    groups_raw = _require(src, top, "", "node_groups")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise src.error("node_groups", "expected a non-empty list of node groups")

    groups: List[NodeGroup] = []
    seen_names = set()
    total_ranks = 0
    for gi, graw in enumerate(groups_raw):
        gkey = f"node_groups[{gi}]"
        g = _mapping(src, graw, gkey)
        reject_unknown_keys(src, g, gkey, _GROUP_KEYS)
        gname = _text(src, _require(src, g, gkey, "name"), f"{gkey}.name", "a group name", MAX_NAME_CHARS)
        if "/" in gname:
            raise src.error(f"{gkey}.name", f"expected a name without '/', got {gname!r}")
        if gname in seen_names:
            raise src.error(f"{gkey}.name", f"node group '{gname}' is defined twice")
        seen_names.add(gname)
        count = _positive_int(src, g.get("count", 1), f"{gkey}.count", MAX_RANKS)
        dev = _mapping(src, _require(src, g, gkey, "device"), f"{gkey}.device")
        reject_unknown_keys(src, dev, f"{gkey}.device", _DEVICE_KEYS)
        model = _require(src, dev, f"{gkey}.device", "model")
        if isinstance(model, bool) or not isinstance(model, (str, int)):
            raise src.error(f"{gkey}.device.model", f"expected a model name, got {_shown(model)}")
        model = _text(src, str(model), f"{gkey}.device.model", "a model name", MAX_NAME_CHARS)
        vendor = vendor_of_model(model)
        if vendor == "nvidia" and canonical_model(model) is None:
            raise src.error(
                f"{gkey}.device.model",
                f"unknown device model {model!r}; use an NVIDIA data-center name (A100-SXM4-80GB, "
                f"H800, H100, ...), an Ascend name (910B, 910B3) or 'cpu'",
            )
        per_node = _positive_int(
            src, _require(src, dev, f"{gkey}.device", "count"), f"{gkey}.device.count", MAX_DEVICES_PER_NODE
        )
        total_ranks += count * per_node
        if total_ranks > MAX_RANKS:
            raise src.error(
                f"{gkey}.count",
                f"the cluster reaches {total_ranks} ranks at this group, more than the {MAX_RANKS} "
                f"hetcomm plans and simulates (every rank pair is modelled); describe one island "
                f"of at most {MAX_RANKS} ranks",
            )
        strong = dev.get("strong", vendor == "nvidia")
        if not isinstance(strong, bool):
            raise src.error(f"{gkey}.device.strong", f"expected true or false, got {_shown(strong)}")
        numa_nodes = _positive_int(src, dev.get("numa_nodes", 1), f"{gkey}.device.numa_nodes", MAX_NUMA_NODES)
        tflops = (_number(src, dev["tflops"], f"{gkey}.device.tflops", unit="TFLOPS", minimum=0.0, maximum=MAX_TFLOPS,
                          positive=True) if "tflops" in dev else None)
        fabric = (
            _link_class(src, g["fabric"], f"{gkey}.fabric") if "fabric" in g else _DEFAULT_FABRIC[vendor]
        )
        if fabric.is_network or fabric == LinkClass.HOST_BRIDGE:
            raise src.error(f"{gkey}.fabric", f"{fabric.name} is not an intra-node fabric; use NVLINK, HCCS, PCIE_* or SHM")
        fabric_gbps = (
            _positive_float(src, g["fabric_gbps"], f"{gkey}.fabric_gbps") if "fabric_gbps" in g else None
        )
        nics: List[NicSpec] = []
        ports = 0
        nics_raw = g.get("nics", []) or []
        if not isinstance(nics_raw, list):
            raise src.error(f"{gkey}.nics", "expected a list of NIC entries")
        for ni, nraw in enumerate(nics_raw):
            nkey = f"{gkey}.nics[{ni}]"
            n = _mapping(src, nraw, nkey)
            reject_unknown_keys(src, n, nkey, _NIC_KEYS)
            cls = _link_class(src, _require(src, n, nkey, "class"), f"{nkey}.class")
            if not cls.is_network:
                raise src.error(f"{nkey}.class", f"{cls.name} is not a network class; use one of NET_IB_GDR, NET_IB, NET_ROCE_GDR, NET_ROCE, NET_EFA, NET_SOCKET")
            gbps = _positive_float(src, _require(src, n, nkey, "gbps"), f"{nkey}.gbps")
            ncount = _positive_int(src, n.get("count", 1), f"{nkey}.count", MAX_NICS_PER_NODE)
            ports += ncount
            if ports > MAX_NICS_PER_NODE:
                raise src.error(f"{nkey}.count", f"a node of group '{gname}' would have {ports} NIC ports; at most {MAX_NICS_PER_NODE} are accepted")
            numa = n.get("numa")
            if numa is not None:
                if (
                    not isinstance(numa, list)
                    or len(numa) != ncount
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_NUMA_NODES for x in numa)
                ):
                    raise src.error(
                        f"{nkey}.numa",
                        f"expected a list of {ncount} NUMA node numbers 0..{MAX_NUMA_NODES - 1} (one per port), got {_shown(numa)}",
                    )
                numa = tuple(numa)
            nics.append(NicSpec(link_class=cls, gbps=gbps, count=ncount, numa=numa))
        groups.append(
            NodeGroup(
                name=gname,
                count=count,
                model=model,
                vendor=vendor,
                devices_per_node=per_node,
                strong=strong,
                numa_nodes=numa_nodes,
                fabric=fabric,
                fabric_gbps=fabric_gbps,
                nics=tuple(nics),
                tflops=tflops,
            )
        )

    interconnect = Interconnect()
    if "interconnect" in top and top["interconnect"] is not None:
        ic = _mapping(src, top["interconnect"], "interconnect")
        reject_unknown_keys(src, ic, "interconnect", _INTERCONNECT_KEYS)
        same = ic.get("same_vendor", "auto")
        same_cls = None
        if same != "auto":
            same_cls = _link_class(src, same, "interconnect.same_vendor")
            if not same_cls.is_network:
                raise src.error("interconnect.same_vendor", f"{same_cls.name} is not a network class")
        cross = ic.get("cross_vendor") or {}
        cross = _mapping(src, cross, "interconnect.cross_vendor")
        reject_unknown_keys(src, cross, "interconnect.cross_vendor", _CROSS_KEYS)
        cross_cls = (
            _link_class(src, cross["class"], "interconnect.cross_vendor.class")
            if "class" in cross
            else LinkClass.HOST_BRIDGE
        )
        interconnect = Interconnect(
            same_vendor=same_cls,
            cross_vendor_class=cross_cls,
            cross_vendor_gbps=_positive_float(src, cross.get("gbps", 100.0), "interconnect.cross_vendor.gbps"),
            cross_vendor_latency_us=_number(
                src,
                cross.get("latency_us", 30.0),
                "interconnect.cross_vendor.latency_us",
                unit="microseconds",
                minimum=0.0,
                maximum=MAX_LATENCY_US,
                positive=False,
            ),
        )

    wire: List[Tuple[str, str]] = []
    if top.get("wire_dtype") is not None:
        w = _mapping(src, top["wire_dtype"], "wire_dtype")
        for cls_name, dtype in w.items():
            key = f"wire_dtype.{cls_name}"
            if cls_name != "default":
                _link_class(src, cls_name, key)
            parse_wire_dtype(dtype, allowed=LINK_SPELLINGS, key=key, error=lambda msg, key=key: src.error(key, msg))
            wire.append((LinkClass.parse(cls_name).name if cls_name != "default" else "default", dtype))

    emulation: Tuple[Tuple[str, Any], ...] = ()
    if top.get("emulation") is not None:
        emulation = tuple(_mapping(src, top["emulation"], "emulation").items())

    description = top.get("description", "")
    if description is None:
        description = ""
    if isinstance(description, bool) or not isinstance(description, (str, int, float)):
        raise src.error("description", f"expected free text, got {type(description).__name__} {_shown(description)}")
    description = str(description)
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise src.error("description", f"is {len(description)} characters long; at most {MAX_DESCRIPTION_CHARS} are accepted")
    return Cluster(
        name=name,
        groups=tuple(groups),
        interconnect=interconnect,
        wire_dtype=tuple(wire),
        emulation=emulation,
        description=description,
        path=src.path,
    )
