"""The cost model: per-link-class latency and bandwidth over a cluster's shared resources.

Notation (as in ``hetcomm.sched.plan``): ``n`` ranks, ``T[i][j]`` bytes from rank i to rank j;
a *message* is what one stage sends from one rank to another over one rail.

A message costs ``alpha + work``: ``alpha`` is the latency of its link class, ``work`` is the
time its bytes occupy the resources on its path, shared with the other messages of the same
stage (``hetcomm.sched.simulate``). The resources (every one per direction):

======================  ==========================================  =============================
resource                capacity                                    used by
======================  ==========================================  =============================
``rankR fabric out/in`` fabric rate (NVLink: the GPU's NVSwitch      messages inside a node
                        port; HCCS full mesh: (d-1) x pair rate)
``rankR:rankS hccs``    pair rate of a mesh fabric (HCCS)            that pair, inside a node
``rankR pcie up/down``  the device's PCIe x16 link (Gen4 / Gen5)     messages that leave the node
``rankR copy``          half the device memory bandwidth             forwarded messages (the
                        (one read + one write per byte)              copy out of the staging buffer)
``NODE sys out/in``     the inter-socket link (NCCL's SYS figure)    NIC traffic whose device sits
                                                                     on another NUMA node
``NODE/nicK tx/rx``     the port rate                                network messages
``NODE uplink out/in``  ``uplink_fraction`` x sum of the node's      network messages
                        ports (1.0 = non-blocking fabric)
``NODE bridge out/in``  ``interconnect.cross_vendor.gbps``          NVIDIA <-> Ascend messages
                                                                     (device -> host -> host NIC)
======================  ==========================================  =============================

Each message also pays a per-message occupancy (``overhead_us``, LogGP's gap) on every
resource of its path: the cost of one more descriptor, staging copy launch or proxy step. It
is what makes many small messages slower than few large ones at equal bytes.

Parameters start from the cluster's nominal rates (``hetcomm.topo.bandwidth``) and
:func:`load_cost_params` calibrates them from measured all-to-all output (``hetcomm bench
--json`` rows or nccl-tests ``alltoall_perf`` text).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hetcomm.errors import ConfigError
from hetcomm.topo.bandwidth import PCIE_GBPS, SYS_GBPS, canonical_model, nominal_gbps
from hetcomm.topo.cluster import Cluster
from hetcomm.topo.linkcost import LATENCY_US, OVERHEAD_US, UNKNOWN_LATENCY_US, UNKNOWN_OVERHEAD_US
from hetcomm.topo.model import LinkClass

__all__ = [
    "CostParams",
    "ResourceModel",
    "resource_model",
    "load_cost_params",
    "fit_alpha_beta",
    "DEFAULT_LATENCY_US",
    "DEFAULT_OVERHEAD_US",
]

# Latency (alpha) and per-message overhead by link class, microseconds: the one table that
# `hetcomm audit` reads too (hetcomm.topo.linkcost), keyed here by class name as CostParams
# overrides are. HOST_BRIDGE latency takes the cluster's own `interconnect.cross_vendor.latency_us`.
DEFAULT_LATENCY_US: Dict[str, float] = {
    **{c.name: v for c, v in LATENCY_US.items() if c != LinkClass.HOST_BRIDGE},
    "UNKNOWN": UNKNOWN_LATENCY_US,
}
DEFAULT_OVERHEAD_US: Dict[str, float] = {
    **{c.name: v for c, v in OVERHEAD_US.items()},
    "UNKNOWN": UNKNOWN_OVERHEAD_US,
}

# Device memory bandwidth, GB/s, by model family (datasheets: A100 80GB SXM4 2,039; H100/H800
# SXM5 3,350; H200 4,800; Ascend 910B about 1,600 (HBM2e, vendor figure, approximate)). A
# forwarding device copies each staged byte once (read + write), so the copy rate is half.
_HBM_GBYTES = {"A100": 2039.0, "A800": 2039.0, "H100": 3350.0, "H800": 3350.0, "H200": 4800.0, "910B": 1600.0}
_HBM_UNKNOWN_GBYTES = 1000.0  # conservative for an unlisted accelerator
_HOST_COPY_GBYTES = 20.0  # a CPU rank: one memcpy stream on a server socket


def _pairs(mapping: Mapping[str, float]) -> Tuple[Tuple[str, float], ...]:
    return tuple(sorted((str(k), float(v)) for k, v in mapping.items()))


@dataclass(frozen=True)
class CostParams:
    """Cost model parameters (all optional overrides of the cluster's nominal figures).

    Attributes:
        latency_us: ``(class name, us)`` pairs overriding :data:`DEFAULT_LATENCY_US`
            (``HOST_BRIDGE`` overrides the cluster's bridge latency).
        overhead_us: ``(class name, us)`` pairs overriding :data:`DEFAULT_OVERHEAD_US`.
        gbps: ``(class name, Gb/s)`` pairs replacing the nominal rate of that class: a fabric
            class sets the fabric rate, a network class the port rate, ``HOST_BRIDGE`` the
            per-node bridge rate.
        pcie_gbps: device PCIe rate, Gb/s per direction (None: by model, Gen4 256 / Gen5 512).
        sys_gbps: inter-socket rate for cross-NUMA NIC traffic, Gb/s per direction.
        uplink_fraction: a node's uplink as a fraction of its summed port rates (1.0 models a
            non-blocking network; 0.5 a 2:1 over-subscribed leaf).
        copy_gbps: device copy rate for forwarded bytes, Gb/s (None: half the memory bandwidth).
        source: where the numbers came from (for reports).
    """

    latency_us: Tuple[Tuple[str, float], ...] = ()
    overhead_us: Tuple[Tuple[str, float], ...] = ()
    gbps: Tuple[Tuple[str, float], ...] = ()
    pcie_gbps: Optional[float] = None
    sys_gbps: float = float(SYS_GBPS)
    uplink_fraction: float = 1.0
    copy_gbps: Optional[float] = None
    source: str = "nominal"

    def __post_init__(self) -> None:
        for name, table in (("latency_us", self.latency_us), ("overhead_us", self.overhead_us), ("gbps", self.gbps)):
            for cls_name, value in table:
                try:
                    LinkClass.parse(cls_name)
                except ValueError as e:
                    raise ConfigError(str(e), key=f"cost.{name}.{cls_name}") from None
                if not (value >= 0 and math.isfinite(value)) or (name == "gbps" and value <= 0):
                    raise ConfigError(f"expected a {'positive' if name == 'gbps' else 'non-negative'} number, got {value!r}", key=f"cost.{name}.{cls_name}")
        for name in ("pcie_gbps", "copy_gbps", "sys_gbps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"expected a positive number of Gb/s, got {v!r}", key=f"cost.{name}")
        if not 0 < self.uplink_fraction:
            raise ConfigError(f"expected a positive fraction, got {self.uplink_fraction!r}", key="cost.uplink_fraction")

    @classmethod
    def make(
        cls,
        *,
        latency_us: Mapping[str, float] = {},
        overhead_us: Mapping[str, float] = {},
        gbps: Mapping[str, float] = {},
        **kwargs: Any,
    ) -> "CostParams":
        """Build from plain dicts: ``CostParams.make(gbps={"NET_ROCE_GDR": 180})``."""
        return cls(latency_us=_pairs(latency_us), overhead_us=_pairs(overhead_us), gbps=_pairs(gbps), **kwargs)

    def merged(self, other: "CostParams") -> "CostParams":
        """These parameters with every value ``other`` sets taking precedence."""
        join = lambda a, b: _pairs({**dict(a), **dict(b)})  # noqa: E731
        return replace(
            self,
            latency_us=join(self.latency_us, other.latency_us),
            overhead_us=join(self.overhead_us, other.overhead_us),
            gbps=join(self.gbps, other.gbps),
            pcie_gbps=other.pcie_gbps if other.pcie_gbps is not None else self.pcie_gbps,
            copy_gbps=other.copy_gbps if other.copy_gbps is not None else self.copy_gbps,
            source=other.source if self.source == "nominal" else f"{self.source}+{other.source}",
        )

    def latency_s(self, link_class: LinkClass, cluster: Cluster) -> float:
        """Latency of one message over ``link_class``, seconds."""
        own = dict(self.latency_us)
        if link_class.name in own:
            return own[link_class.name] * 1e-6
        if link_class == cluster.interconnect.cross_vendor_class:
            return cluster.interconnect.cross_vendor_latency_us * 1e-6
        return DEFAULT_LATENCY_US.get(link_class.name, 50.0) * 1e-6

    def overhead_s(self, link_class: LinkClass) -> float:
        """Per-message occupancy on each resource crossed, seconds."""
        own = dict(self.overhead_us)
        return own.get(link_class.name, DEFAULT_OVERHEAD_US.get(link_class.name, 10.0)) * 1e-6

    def rate_gbps(self, link_class: LinkClass, nominal: float) -> float:
        """The rate of ``link_class``: the override when set, else ``nominal``."""
        return dict(self.gbps).get(link_class.name, nominal)


# -- calibration ------------------------------------------------------------------------------


def fit_alpha_beta(size_bytes: Sequence[float], time_us: Sequence[float]) -> Tuple[float, float]:
    """Least-squares fit of ``time = alpha + size / rate``.

    Args:
        size_bytes: bytes each measurement moved over the link (bus bytes).
        time_us: the measured times, microseconds.

    Returns:
        ``(alpha_us, rate_gbps)``; alpha is clamped at 0 (then the rate is refitted through
        the origin).

    Raises:
        ConfigError: fewer than one point, or times that do not grow with size.
    """
    x = np.asarray(size_bytes, float)
    y = np.asarray(time_us, float)
    keep = (x > 0) & (y > 0)
    x, y = x[keep], y[keep]
    if len(x) == 0:
        raise ConfigError("no measurement with a positive size and time to calibrate from")
    slope = alpha = None
    if len(x) >= 2 and np.ptp(x) > 0:
        slope, alpha = np.polyfit(x, y, 1)
    if slope is None or slope <= 0 or alpha < 0:
        alpha = 0.0
        slope = float((x * y).sum() / (x * x).sum())
    if slope <= 0:
        raise ConfigError("measured times do not grow with message size; cannot fit a bandwidth")
    rate_gbps = 8.0 / (slope * 1e-6) / 1e9
    return float(alpha), float(rate_gbps)


_ROWS_KEYS = ("measurements", "results", "rows")


def _rows_from_json(doc: Any) -> List[Dict[str, Any]]:
    raw: List[Any] = []
    if isinstance(doc, list):
        raw = doc
    elif isinstance(doc, dict):
        raw = next((doc[k] for k in _ROWS_KEYS if isinstance(doc.get(k), list)), [])
    rows = []
    for r in raw:
        if not isinstance(r, dict):
            continue
        if "size_bytes" not in r and "size" in r and isinstance(r.get("out_of_place"), dict):
            # `hetcomm bench --json` rows: nccl-tests' columns, out-of-place block nested
            oop = r["out_of_place"]
            r = {"size_bytes": r["size"], "time_us": oop.get("time_us"), "busbw_gbps": oop.get("busbw_gbps")}
        if r.get("size_bytes") is not None and r.get("time_us") is not None:
            rows.append(r)
    return rows


def _parse_nccl_tests(text: str, path: str) -> List[Dict[str, float]]:
    """Rows of one nccl-tests run (size, out-of-place time and busbw), read by the one nccl-tests
    parser (:mod:`hetcomm.topo.parse.nccl_tests`), launcher prefixes stripped like every input."""
    from hetcomm.errors import TopologyParseError
    from hetcomm.topo.parse import parse_text

    try:
        topo = parse_text(text, path=path, fmt="nccl-tests")
    except TopologyParseError as e:
        raise ConfigError(
            "not a cost file: expected JSON (cost parameters or bench rows with size_bytes and "
            f"time_us) or nccl-tests output with a '# size ... time algbw busbw' header ({e})",
            path=path,
        ) from None
    rows = [m for m in topo.measurements if not m.in_place]
    runs = sorted({(m.op, m.num_ranks) for m in rows}, key=str)
    if len(runs) > 1:
        # Two runs (say one node and two nodes) measure different links; fitting one line
        # through both would describe neither.
        raise ConfigError(
            f"holds {len(runs)} nccl-tests result tables ("
            + ", ".join(f"{op} on {n} ranks" for op, n in runs)
            + "); calibrate from a file with one run of one link class",
            path=path,
        )
    return [
        {"size_bytes": float(m.size_bytes), "time_us": float(m.time_us), "busbw_gbps": float(m.busbw_gbps)}
        for m in rows
    ]


def load_cost_params(path: str, link_class: Optional[str] = None) -> CostParams:
    """Cost parameters from a file.

    Accepted contents:
      * a parameter document: JSON ``{"latency_us": {...}, "overhead_us": {...}, "gbps": {...},
        "pcie_gbps": ..., "sys_gbps": ..., "uplink_fraction": ..., "copy_gbps": ...}``;
      * measured all-to-all rows: ``hetcomm bench --json`` output (``rows`` of ``size`` plus an
        ``out_of_place`` block with ``time_us`` and ``busbw_gbps``), or a list / an object with
        ``measurements``/``results``/``rows`` of rows with ``size_bytes`` and ``time_us``,
        optionally ``busbw_gbps`` (GB/s, as nccl-tests prints it) and ``link_class``;
      * nccl-tests ``alltoall_perf`` output.

    Measured rows calibrate one link class (``link_class``, or the rows' own ``link_class``):
    the bytes one rank moved over the link are ``busbw x time`` (nccl-tests' bus bandwidth
    already applies the ``(n-1)/n`` all-to-all factor), and ``time = alpha + bytes / rate`` is
    fitted by least squares (:func:`fit_alpha_beta`). For network classes the rate is per port:
    measure with one rank per NIC port, as nccl-tests does on rail-matched nodes.

    Raises:
        ConfigError: unreadable file, unknown keys or class, or no usable rows (with the path).
    """
    from hetcomm._input import capture_cap, decode_text, read_bounded

    # Bounded and decoded like every input (UTF-8 or UTF-16 with a BOM; see docs/INPUT_FORMATS.md).
    data = read_bounded(path, limit=capture_cap(), error=ConfigError, what="cost file")
    text = decode_text(data, path, ConfigError)
    doc: Any = None
    try:
        doc = json.loads(text)
    except ValueError:
        pass
    if isinstance(doc, dict) and not any(k in doc for k in _ROWS_KEYS):
        allowed = ("latency_us", "overhead_us", "gbps", "pcie_gbps", "sys_gbps", "uplink_fraction", "copy_gbps")
        for key in doc:
            if key not in allowed:
                raise ConfigError(f"unknown key '{key}'; allowed: {', '.join(allowed)}", path=path, key=key)
        try:
            return CostParams.make(
                latency_us=doc.get("latency_us", {}),
                overhead_us=doc.get("overhead_us", {}),
                gbps=doc.get("gbps", {}),
                **{k: doc[k] for k in ("pcie_gbps", "sys_gbps", "uplink_fraction", "copy_gbps") if k in doc},
                source=path,
            )
        except ConfigError as e:
            raise ConfigError(str(e), path=path) from None
        except (TypeError, AttributeError, ValueError) as e:
            raise ConfigError(f"malformed cost parameters: {e}", path=path) from None
    rows = _rows_from_json(doc) if doc is not None else _parse_nccl_tests(text, path)
    rows = [r for r in rows if "size_bytes" in r and "time_us" in r]
    if not rows:
        raise ConfigError("no measurement rows with size_bytes and time_us to calibrate from", path=path)
    cls_name = link_class or next((r.get("link_class") for r in rows if r.get("link_class")), None)
    if not cls_name:
        raise ConfigError(
            "measurements do not say which link class they measured; pass it (hetcomm simulate "
            "--calibrate NET_ROCE_GDR=FILE)",
            path=path,
        )
    try:
        cls = LinkClass.parse(str(cls_name))
    except ValueError as e:
        raise ConfigError(str(e), path=path) from None
    bus_bytes, times = [], []
    for r in rows:
        t = float(r["time_us"])
        if r.get("busbw_gbps") is not None:
            # GB/s, as nccl-tests prints it (hetcomm.topo.model.Measurement's unit)
            bus_bytes.append(float(r["busbw_gbps"]) * 1e9 * t * 1e-6)
        else:
            bus_bytes.append(float(r["size_bytes"]))
        times.append(t)
    try:
        alpha_us, rate = fit_alpha_beta(bus_bytes, times)
    except ConfigError as e:
        raise ConfigError(str(e), path=path) from None
    return CostParams.make(latency_us={cls.name: alpha_us}, gbps={cls.name: rate}, source=f"{path} ({cls.name})")


# -- resources of a cluster ---------------------------------------------------------------------

_VENDOR_CODE = {"nvidia": 0, "ascend": 1, "cpu": 2}
_PATH_WIDTH = 9


@dataclass(frozen=True, eq=False)
class ResourceModel:
    """Every shared resource of a cluster under a :class:`CostParams`, as arrays.

    Attributes:
        cluster, params: what it was built from.
        cap: ``[num_resources]`` float64 capacity, bytes per second.
        rank_node, rank_local, rank_numa, rank_vendor: ``[n]`` int64 per-rank facts.
        node_first, node_size: ``[num_nodes]`` int64 first rank and device count.
        node_nics: per node, the global NIC ids of its ports (YAML order).
        nic_node, nic_numa: ``[num_nics]`` int64 (numa ``-1`` = unknown).
        nic_gbps: ``[num_nics]`` float64 port rate after overrides.
        nic_class: ``[num_nics]`` int64 LinkClass values.
        default_nic: ``[n]`` int64 global NIC id a rank's network traffic uses when the plan
            names none (the nearest port: same NUMA node, spread over the devices there).
        nic_device: ``[num_nics]`` int64 the rank that forwards a multi-rail lane over each port.
        names: readable name of every resource (see :meth:`name`).
        node_mesh, pair_base: per node, whether its fabric is a mesh with per-pair resources
            (HCCS) and the id of its first pair resource.
        fab_cap, pcie_cap: ``[n]`` float64 bytes/s of each rank's fabric port and PCIe link.
        bridge_cap, uplink_cap: ``[num_nodes]`` float64 bytes/s of each node's bridge and uplink.
        base: first resource id of each resource kind.
        class_matrix: ``[num_nodes, num_nodes]`` int64 LinkClass of node pairs (the diagonal
            holds each node's fabric).
        latency: ``[len(LinkClass)]`` float64 seconds; ``overhead`` likewise.
    """

    cluster: Cluster
    params: CostParams
    cap: np.ndarray
    names: Tuple[str, ...]
    rank_node: np.ndarray
    rank_local: np.ndarray
    rank_numa: np.ndarray
    rank_vendor: np.ndarray
    node_first: np.ndarray
    node_size: np.ndarray
    node_names: Tuple[str, ...]
    node_nics: Tuple[Tuple[int, ...], ...]
    nic_node: np.ndarray
    nic_numa: np.ndarray
    nic_gbps: np.ndarray
    nic_class: np.ndarray
    default_nic: np.ndarray
    nic_device: np.ndarray
    node_mesh: np.ndarray
    pair_base: np.ndarray
    class_matrix: np.ndarray
    latency: np.ndarray
    overhead: np.ndarray
    fab_cap: np.ndarray
    pcie_cap: np.ndarray
    bridge_cap: np.ndarray
    uplink_cap: np.ndarray
    base: Dict[str, int] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return int(self.rank_node.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.node_first.shape[0])

    # -- resource ids ------------------------------------------------------------------------
    def fab_out(self, r):  # noqa: D102 - one-line id helpers
        return self.base["fab_out"] + r

    def fab_in(self, r):  # noqa: D102
        return self.base["fab_in"] + r

    def pcie_up(self, r):  # noqa: D102
        return self.base["pcie_up"] + r

    def pcie_dn(self, r):  # noqa: D102
        return self.base["pcie_dn"] + r

    def copy(self, r):  # noqa: D102
        return self.base["copy"] + r

    def node_res(self, v, k: int):  # noqa: D102 - k: 0 sys out, 1 sys in, 2 uplink out, 3 uplink in, 4 bridge out, 5 bridge in
        return self.base["node"] + 6 * v + k

    def nic_tx(self, g):  # noqa: D102
        return self.base["nic"] + 2 * g

    def nic_rx(self, g):  # noqa: D102
        return self.base["nic"] + 2 * g + 1

    def link_classes(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """``[m]`` LinkClass values of rank pairs (vectorized :meth:`Cluster.link_class`)."""
        va, vb = self.rank_vendor[src], self.rank_vendor[dst]
        cross = (va != vb) & (va != 2) & (vb != 2)
        out = self.class_matrix[self.rank_node[src], self.rank_node[dst]]
        return np.where(cross, int(self.cluster.interconnect.cross_vendor_class), out)

    def is_cross_vendor(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        va, vb = self.rank_vendor[src], self.rank_vendor[dst]
        return (va != vb) & (va != 2) & (vb != 2)

    def paths(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        nic: np.ndarray,
        forwarded: np.ndarray,
    ) -> np.ndarray:
        """Resources each message crosses.

        Args:
            src, dst: ``[m]`` int64 ranks (``src != dst``).
            nic: ``[m]`` int64 global NIC id the sender uses, ``-1`` = its default NIC.
            forwarded: ``[m]`` bool, the sender copies out of a staging buffer first.

        Returns:
            ``[m, 9]`` int64 resource ids, ``-1`` where a column does not apply.
        """
        m = src.shape[0]
        P = np.full((m, _PATH_WIDTH), -1, np.int64)
        na, nb = self.rank_node[src], self.rank_node[dst]
        same = na == nb
        cross = self.is_cross_vendor(src, dst) & ~same
        net = ~same & ~cross
        # inside a node: fabric ports, plus the pair link of a mesh fabric
        P[:, 0] = np.where(same, self.fab_out(src), self.pcie_up(src))
        P[:, 1] = np.where(same, self.fab_in(dst), self.pcie_dn(dst))
        mesh = same & self.node_mesh[na]
        pair = self.pair_base[na] + self.rank_local[src] * self.node_size[na] + self.rank_local[dst]
        col2 = np.where(mesh, pair, -1)
        # cross-vendor: device -> host -> bridge -> peer host -> device
        col2 = np.where(cross, self.node_res(na, 4), col2)
        col3 = np.where(cross, self.node_res(nb, 5), -1)
        # network: sender port, uplinks, receiver port, and the socket link when NUMA differs
        ks = np.where(nic >= 0, nic, self.default_nic[src])
        kr = self.default_nic[dst]
        col2 = np.where(net, self.nic_tx(ks), col2)
        col3 = np.where(net, self.nic_rx(kr), col3)
        P[:, 2], P[:, 3] = col2, col3
        P[:, 4] = np.where(net, self.node_res(na, 2), -1)
        P[:, 5] = np.where(net, self.node_res(nb, 3), -1)
        far_s = net & (self.nic_numa[ks] >= 0) & (self.nic_numa[ks] != self.rank_numa[src])
        far_r = net & (self.nic_numa[kr] >= 0) & (self.nic_numa[kr] != self.rank_numa[dst])
        P[:, 6] = np.where(far_s, self.node_res(na, 0), -1)
        P[:, 7] = np.where(far_r, self.node_res(nb, 1), -1)
        P[:, 8] = np.where(forwarded, self.copy(src), -1)
        return P

    def name(self, rid: int) -> str:
        """A readable name of resource ``rid`` (``ascend-0 bridge out``)."""
        return self.names[rid] if rid < len(self.names) else f"resource{rid}"

    def nearest_device(self, g: int) -> int:
        """The rank nearest to NIC ``g``: on its NUMA node, spread like :attr:`default_nic`."""
        return int(self.nic_device[g])


def _build(cluster: Cluster, params: CostParams) -> ResourceModel:
    nodes = cluster.nodes
    n, N = cluster.num_ranks, len(nodes)
    rank_node = np.empty(n, np.int64)
    rank_local = np.empty(n, np.int64)
    rank_numa = np.empty(n, np.int64)
    rank_vendor = np.empty(n, np.int64)
    node_first = np.array([v.first_rank for v in nodes], np.int64)
    node_size = np.array([v.num_devices for v in nodes], np.int64)
    for v in nodes:
        g = v.group
        per_numa = max(1, math.ceil(g.devices_per_node / g.numa_nodes))
        for local, r in enumerate(v.ranks):
            rank_node[r] = v.index
            rank_local[r] = local
            rank_numa[r] = local // per_numa
            rank_vendor[r] = _VENDOR_CODE.get(g.vendor, 2)
    # NIC ports, in YAML order per node; a node without ports gets one virtual TCP port at the
    # rate Cluster.link_gbps assumes for it (10 Gb/s), so its traffic still has a resource.
    nic_node, nic_numa, nic_gbps, nic_class, node_nics = [], [], [], [], []
    for v in nodes:
        ids = []
        specs = v.group.nics or ()
        ports = [(s.link_class, s.gbps, (s.numa[i] if s.numa else -1)) for s in specs for i in range(s.count)]
        if not ports:
            ports = [(LinkClass.NET_SOCKET, 10.0, -1)]
        for cls, gbps, numa in ports:
            ids.append(len(nic_node))
            nic_node.append(v.index)
            nic_numa.append(numa)
            nic_gbps.append(params.rate_gbps(cls, gbps))
            nic_class.append(int(cls))
        node_nics.append(tuple(ids))
    nic_node_a = np.array(nic_node, np.int64)
    nic_numa_a = np.array(nic_numa, np.int64)
    nic_gbps_a = np.array(nic_gbps, float)
    default_nic = np.empty(n, np.int64)
    for v in nodes:
        nics = node_nics[v.index]
        by_numa: Dict[int, List[int]] = {}
        for r in v.ranks:
            by_numa.setdefault(int(rank_numa[r]), []).append(r)
        for numa, ranks in by_numa.items():
            near = [g for g in nics if nic_numa_a[g] == numa] or [g for g in nics if nic_numa_a[g] < 0] or list(nics)
            for i, r in enumerate(ranks):
                default_nic[r] = near[i % len(near)]
    # the forwarding device of each port: a device on the port's NUMA node, ports and devices
    # there paired in order (8 ports / 8 GPUs: one each; 2 ports / 8 GPUs: the first per socket)
    nic_device = np.empty(len(nic_node), np.int64)
    for v in nodes:
        nics = node_nics[v.index]
        for g in nics:
            numa = int(nic_numa_a[g])
            devs = [r for r in v.ranks if numa < 0 or rank_numa[r] == numa] or list(v.ranks)
            peers = [h for h in nics if numa < 0 or nic_numa_a[h] == numa]
            nic_device[g] = devs[peers.index(g) % len(devs)]
    # class of every node pair; the diagonal is the node's fabric
    class_matrix = np.empty((N, N), np.int64)
    for a in nodes:
        for b in nodes:
            class_matrix[a.index, b.index] = int(a.group.fabric) if a.index == b.index else int(cluster.network_class(a, b))
    # per-device rates, Gb/s
    fab_gbps = np.empty(n)
    pcie_gbps = np.empty(n)
    copy_gbps = np.empty(n)
    node_mesh = np.zeros(N, bool)
    pair_base = np.zeros(N, np.int64)
    num_pairs = 0
    for v in nodes:
        g = v.group
        rate = params.rate_gbps(g.fabric, cluster.fabric_gbps(g))
        mesh = g.fabric == LinkClass.HCCS and g.devices_per_node > 1
        node_mesh[v.index] = mesh
        if mesh:
            pair_base[v.index] = num_pairs
            num_pairs += g.devices_per_node * g.devices_per_node
        fam = canonical_model(g.model)
        pcie = params.pcie_gbps or nominal_gbps(LinkClass.PCIE_PIX, g.model) or float(PCIE_GBPS[4])
        if g.vendor == "cpu":
            copy = _HOST_COPY_GBYTES * 8 / 2
        else:
            copy = _HBM_GBYTES.get(fam or "", _HBM_UNKNOWN_GBYTES) * 8 / 2
        for r in v.ranks:
            fab_gbps[r] = rate * (g.devices_per_node - 1) if mesh else rate
            pcie_gbps[r] = pcie
            copy_gbps[r] = params.copy_gbps or copy
    uplink_gbps = np.array([params.uplink_fraction * float(nic_gbps_a[list(node_nics[v])].sum()) for v in range(N)])
    bridge_gbps = params.rate_gbps(cluster.interconnect.cross_vendor_class, cluster.interconnect.cross_vendor_gbps)
    node_gbps = np.empty(6 * N)
    node_gbps[0::6] = params.sys_gbps
    node_gbps[1::6] = params.sys_gbps
    node_gbps[2::6] = uplink_gbps
    node_gbps[3::6] = uplink_gbps
    node_gbps[4::6] = bridge_gbps
    node_gbps[5::6] = bridge_gbps
    pair_gbps = np.empty(num_pairs)
    for v in nodes:
        if node_mesh[v.index]:
            d = v.num_devices
            pair_gbps[pair_base[v.index] : pair_base[v.index] + d * d] = params.rate_gbps(v.group.fabric, cluster.fabric_gbps(v.group))
    nic_gbps2 = np.repeat(nic_gbps_a, 2)
    base: Dict[str, int] = {}
    parts = []
    offset = 0
    for key, arr in (
        ("fab_out", fab_gbps),
        ("fab_in", fab_gbps),
        ("pcie_up", pcie_gbps),
        ("pcie_dn", pcie_gbps),
        ("copy", copy_gbps),
        ("node", node_gbps),
        ("nic", nic_gbps2),
        ("pair", pair_gbps),
    ):
        base[key] = offset
        parts.append(arr)
        offset += len(arr)
    pair_base = pair_base + base["pair"]
    cap = np.concatenate(parts) * 1e9 / 8.0
    # names, built once per cluster (used for "busiest resource" reports)
    names: List[str] = []
    names += [f"rank{r} fabric out" for r in range(n)]
    names += [f"rank{r} fabric in" for r in range(n)]
    names += [f"rank{r} pcie up" for r in range(n)]
    names += [f"rank{r} pcie down" for r in range(n)]
    names += [f"rank{r} copy" for r in range(n)]
    for v in nodes:
        names += [f"{v.name} {k}" for k in ("sys out", "sys in", "uplink out", "uplink in", "bridge out", "bridge in")]
    for g in range(len(nic_node)):
        v = nodes[nic_node[g]]
        local = node_nics[v.index].index(g)
        names += [f"{v.name}/nic{local} tx", f"{v.name}/nic{local} rx"]
    for v in nodes:
        if node_mesh[v.index]:
            d = v.num_devices
            names += [f"rank{v.first_rank + a}:rank{v.first_rank + b} {v.group.fabric.name.lower()}" for a in range(d) for b in range(d)]
    latency = np.array([params.latency_s(c, cluster) for c in LinkClass])
    overhead = np.array([params.overhead_s(c) for c in LinkClass])
    return ResourceModel(
        cluster=cluster,
        params=params,
        cap=cap,
        names=tuple(names),
        rank_node=rank_node,
        rank_local=rank_local,
        rank_numa=rank_numa,
        rank_vendor=rank_vendor,
        node_first=node_first,
        node_size=node_size,
        node_names=tuple(v.name for v in nodes),
        node_nics=tuple(node_nics),
        nic_node=nic_node_a,
        nic_numa=nic_numa_a,
        nic_gbps=nic_gbps_a,
        nic_class=np.array(nic_class, np.int64),
        default_nic=default_nic,
        nic_device=nic_device,
        node_mesh=node_mesh,
        pair_base=pair_base,
        class_matrix=class_matrix,
        latency=latency,
        overhead=overhead,
        fab_cap=fab_gbps * 1e9 / 8.0,
        pcie_cap=pcie_gbps * 1e9 / 8.0,
        bridge_cap=np.full(N, bridge_gbps * 1e9 / 8.0),
        uplink_cap=uplink_gbps * 1e9 / 8.0,
        base=base,
    )


# Keyed by the cluster object's identity: a Cluster may hold unhashable emulation values, and
# the same object is asked for again on every plan of a run.
_CACHE: "Dict[Tuple[int, CostParams], ResourceModel]" = {}
_CACHE_SIZE = 16


def resource_model(cluster: Cluster, params: Optional[CostParams] = None) -> ResourceModel:
    """The :class:`ResourceModel` of ``cluster`` under ``params`` (cached per pair)."""
    params = params or CostParams()
    key = (id(cluster), params)
    hit = _CACHE.get(key)
    if hit is not None and hit.cluster is cluster:
        return hit
    model = _build(cluster, params)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = model
    return model
