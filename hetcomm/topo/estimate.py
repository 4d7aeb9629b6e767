"""The audit's three answers beside the findings.

(a) :func:`estimate_alltoall`: the time an all-to-all of ``S`` bytes per rank should take on this
    topology, per link class, from nominal bandwidths (an α–β model, formula below);
(b) :func:`cross_vendor_path`: whether NVIDIA <-> Ascend traffic moves by GPUDirect RDMA or is
    staged through host memory;
(c) :func:`measurement_rows`: the parsed (or benchmarked) nccl-tests results as a table.

All-to-all model (a). ``n`` ranks each send ``S`` bytes, ``S/n`` to every rank (nccl-tests'
``size``; the self chunk stays local). For a link class ``c`` let ``k_i,c`` be the number of
peers rank ``i`` reaches over ``c`` and ``B_i,c`` the slowest nominal bandwidth among those links
(with a cluster file: at most the rank's share of per-node resources, the bridge and the NICs).
A rank's traffic over one class shares that bandwidth (right for NVSwitch, NIC rails and host
bridges; pessimistic for direct point-to-point NVLink meshes), and classes run concurrently::

    t_c = α_c + max_i  k_i,c · (S / n) / B_i,c
    t   = max_c t_c             (expected; the slowest class bounds the collective)
    t_serial = Σ_c t_c          (upper bound if classes did not overlap)

``α_c`` are the per-class latencies of :data:`hetcomm.topo.linkcost.LATENCY_US`, the table the
scheduler's cost model (``hetcomm simulate``) reads too; at MiB sizes the β term dominates.
With a cluster file ``hetcomm audit`` reports the cost model's prediction of the flat plan
instead (the same number ``hetcomm simulate`` prints), this α–β table beside it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from hetcomm.errors import UsageError
from hetcomm.topo.linkcost import LATENCY_US
from hetcomm.topo.model import LinkClass, Topology

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.topo.cluster import Cluster

__all__ = [
    "ClassEstimate",
    "AlltoallEstimate",
    "estimate_alltoall",
    "with_predicted_time",
    "CrossVendorAnswer",
    "cross_vendor_path",
    "measurement_rows",
]

ALPHA_US = LATENCY_US



@dataclass(frozen=True)
class ClassEstimate:
    """One link class's share of an all-to-all.

    Attributes:
        link_class: the class.
        num_pairs: unordered rank pairs connected by this class.
        num_peers: peers reached over this class by the rank that takes longest over it.
        bytes_per_rank: bytes that rank sends over this class (``k · S/n``).
        gbps: that rank's bandwidth over this class, Gb/s per direction: the slowest of its
            links' nominal rates, capped by its share of per-node resources when a cluster is
            given; None when unknown.
        alpha_us: start-up latency assumed (:data:`ALPHA_US`).
        time_us: ``α + bytes / bandwidth`` for that rank, None when a bandwidth is unknown.
    """

    link_class: LinkClass
    num_pairs: int
    num_peers: int
    bytes_per_rank: int
    gbps: Optional[float]
    alpha_us: float
    time_us: Optional[float]


@dataclass(frozen=True)
class AlltoallEstimate:
    """Answer (a): expected all-to-all time at one size.

    Attributes:
        size_bytes: ``S``, bytes each rank sends in total (nccl-tests' ``size``).
        num_ranks: ``n``.
        ranks: the rank/device names used.
        rows: one :class:`ClassEstimate` per class present, closest class first.
        time_us: expected time (slowest class), None when nothing is known.
        serial_time_us: sum over classes (no overlap), None when nothing is known.
        bottleneck: the class that bounds the time.
        algbw_gbs: ``S / time`` in GB/s, nccl-tests' algbw, for comparison with a measured table.
        busbw_gbs: ``algbw · (n-1)/n``.
        notes: caveats (labels, missing links, unknown bandwidths).
        model: ``alpha-beta`` (this module's table), or ``cost-model`` when ``time_us`` is the
            scheduler's prediction for the flat plan (``hetcomm audit --cluster``: the number
            ``hetcomm simulate`` prints for the same cluster and size).
        alpha_beta_time_us: the α–β table's own time when ``model`` is ``cost-model``.
    """

    size_bytes: int
    num_ranks: int
    ranks: Tuple[str, ...]
    rows: Tuple[ClassEstimate, ...]
    time_us: Optional[float]
    serial_time_us: Optional[float]
    bottleneck: Optional[LinkClass]
    algbw_gbs: Optional[float]
    busbw_gbs: Optional[float]
    notes: Tuple[str, ...] = ()
    model: str = "alpha-beta"
    alpha_beta_time_us: Optional[float] = None


def with_predicted_time(estimate: AlltoallEstimate, time_us: float, how: str) -> AlltoallEstimate:
    """``estimate`` with ``time_us`` replaced by a cost-model prediction (the α–β time kept)."""
    n = estimate.num_ranks
    algbw = estimate.size_bytes / (time_us * 1e-6) / 1e9 if time_us > 0 else None
    return replace(
        estimate,
        time_us=time_us,
        algbw_gbs=algbw,
        busbw_gbs=algbw * (n - 1) / n if algbw is not None and n else None,
        model="cost-model",
        alpha_beta_time_us=estimate.time_us,
        notes=estimate.notes + (how,),
    )


def _estimate_ranks(topology: Topology, cluster: Optional["Cluster"]) -> List[str]:
    if cluster is not None:
        names = [f"rank{r}" for r in range(cluster.num_ranks)]
        if all(topology.device(n) is not None for n in names):
            return names
    endpoints = {n for ln in topology.links for n in (ln.a, ln.b)}
    devices = [d.name for d in topology.devices if d.name in endpoints]
    linked = {
        n for ln in topology.links if ln.a in devices and ln.b in devices for n in (ln.a, ln.b)
    }
    return [n for n in devices if n in linked]


def _apply_node_shares(
    cluster: "Cluster", slowest: Dict[LinkClass, Dict[str, Optional[float]]]
) -> List[str]:
    """Cap each cluster rank's bandwidth by its share of per-node resources (in place).

    A cluster file gives the cross-vendor bridge's rate per node, and a node's NICs are shared
    by its ranks: a rank gets ``bridge_gbps / ranks_on_node`` and at most
    ``sum(NIC rates) / ranks_on_node`` over the network. Returns notes for the caps applied.
    """
    applied: Dict[Tuple[str, str], Tuple[float, int, float]] = {}
    for cls, per_rank in slowest.items():
        for name, gbps in per_rank.items():
            match = re.fullmatch(r"rank(\d+)", name)
            if gbps is None or match is None or int(match.group(1)) >= cluster.num_ranks:
                continue
            node = cluster.node_of(int(match.group(1)))
            if cls == cluster.interconnect.cross_vendor_class and not cls.is_network:
                total = cluster.interconnect.cross_vendor_gbps
            elif cls.is_network and node.nic_gbps_total > 0:
                total = node.nic_gbps_total
            else:
                continue
            share = total / node.num_devices
            if share < gbps:
                per_rank[name] = share
                applied[(cls.name, node.group.name)] = (total, node.num_devices, share)
    return [
        f"{cls} on '{group}' nodes: {total:g} Gb/s per node shared by {count} ranks = "
        f"{share:g} Gb/s per rank"
        for (cls, group), (total, count, share) in sorted(applied.items())
    ]


def estimate_alltoall(
    topology: Topology,
    size_bytes: int,
    *,
    cluster: Optional["Cluster"] = None,
    ranks: Optional[Sequence[str]] = None,
) -> AlltoallEstimate:
    """Answer (a): the α–β all-to-all estimate described in the module docstring.

    Args:
        topology: the topology (device-to-device links carry class and nominal gbps).
        size_bytes: ``S``, total bytes each rank sends (nccl-tests' ``size``).
        cluster: when given, its ranks (``rank0..``) are the participants.
        ranks: explicit participant names (overrides the choice above).
    """
    if size_bytes <= 0:
        raise UsageError(f"all-to-all size must be positive, got {size_bytes} bytes")
    names = list(ranks) if ranks is not None else _estimate_ranks(topology, cluster)
    n = len(names)
    notes: List[str] = []
    if n < 2:
        return AlltoallEstimate(
            size_bytes,
            n,
            tuple(names),
            (),
            None,
            None,
            None,
            None,
            None,
            ("fewer than two connected devices: an all-to-all is a local copy",),
        )
    alpha_bridge = cluster.interconnect.cross_vendor_latency_us if cluster is not None else None
    chunk = size_bytes / n
    peers: Dict[LinkClass, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    slowest: Dict[LinkClass, Dict[str, Optional[float]]] = defaultdict(dict)
    pairs: Dict[LinkClass, int] = defaultdict(int)
    missing = 0
    index = {name: i for i, name in enumerate(names)}
    links = {ln.key: ln for ln in topology.links if ln.a in index and ln.b in index}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            link = links.get((a, b) if a <= b else (b, a))
            if link is None:
                missing += 1
                continue
            cls = link.link_class
            pairs[cls] += 1
            for x in (a, b):
                peers[cls][x] += 1
                prev = slowest[cls].get(x, float("inf"))
                g = link.gbps
                slowest[cls][x] = None if g is None or prev is None else min(prev, g)
    if missing:
        notes.append(f"{missing} rank pair(s) have no known link and are left out")
    if cluster is not None:
        notes.extend(_apply_node_shares(cluster, slowest))
    rows: List[ClassEstimate] = []
    for cls in sorted(pairs):
        alpha = ALPHA_US.get(cls, 0.0)
        if cls == LinkClass.HOST_BRIDGE and alpha_bridge is not None:
            alpha = alpha_bridge
        # The rank that takes longest over this class decides the row (the collective waits
        # for it); a rank with an unknown bandwidth makes the class's time unknown.
        worst: Optional[Tuple[float, int, float]] = None  # (time, peers, gbps)
        unknown = any(g is None for g in slowest[cls].values())
        if not unknown:
            for rank, k in peers[cls].items():
                g = slowest[cls][rank]
                t = alpha + k * chunk * 8 / (g * 1e9) * 1e6  # type: ignore[operator]
                if worst is None or t > worst[0]:
                    worst = (t, k, g)  # type: ignore[assignment]
        else:
            notes.append(f"{cls.name}: no nominal bandwidth for some links, time unknown")
        k = worst[1] if worst else max(peers[cls].values())
        rows.append(
            ClassEstimate(
                link_class=cls,
                num_pairs=pairs[cls],
                num_peers=k,
                bytes_per_rank=int(round(k * chunk)),
                gbps=worst[2] if worst else None,
                alpha_us=alpha,
                time_us=worst[0] if worst else None,
            )
        )
    timed = [r for r in rows if r.time_us is not None]
    labels = sorted(
        {d.model or d.vendor for d in topology.devices if d.name in index and d.label_only}
    )
    if labels:
        notes.append(
            f"device kinds {', '.join(labels)} are labels (cluster file); bandwidths are nominal, "
            "not measured"
        )
    if not timed:
        return AlltoallEstimate(
            size_bytes, n, tuple(names), tuple(rows), None, None, None, None, None, tuple(notes)
        )
    worst = max(timed, key=lambda r: r.time_us)  # type: ignore[arg-type,return-value]
    total = sum(r.time_us for r in timed)  # type: ignore[misc]
    algbw = size_bytes / (worst.time_us * 1e-6) / 1e9  # type: ignore[operator]
    return AlltoallEstimate(
        size_bytes=size_bytes,
        num_ranks=n,
        ranks=tuple(names),
        rows=tuple(rows),
        time_us=worst.time_us,
        serial_time_us=total,
        bottleneck=worst.link_class,
        algbw_gbs=algbw,
        busbw_gbs=algbw * (n - 1) / n,
        notes=tuple(notes),
    )


# -- (b) cross-vendor path ------------------------------------------------------------------


@dataclass(frozen=True)
class CrossVendorAnswer:
    """Answer (b): how NVIDIA <-> Ascend traffic moves.

    Attributes:
        verdict: ``gdr`` (GPUDirect RDMA), ``host-staged`` (through host memory), ``mixed``,
            ``unknown`` (both vendors, no path described) or ``none`` (one vendor only).
        num_pairs: cross-vendor device pairs with a known link.
        classes: link classes of those pairs, with counts.
        declared: True when the path comes from a cluster file rather than observation.
        message: the answer in one paragraph.
    """

    verdict: str
    num_pairs: int
    classes: Tuple[Tuple[str, int], ...]
    declared: bool
    message: str


def cross_vendor_path(topology: Topology) -> CrossVendorAnswer:
    """Answer (b) from the NVIDIA <-> Ascend links (cluster ``HOST_BRIDGE``, or observed)."""
    vendors = {d.name: d.vendor for d in topology.devices}
    has = {v for v in vendors.values()}
    counts: Dict[LinkClass, int] = defaultdict(int)
    declared = True
    for ln in topology.links:
        va, vb = vendors.get(ln.a), vendors.get(ln.b)
        if {va, vb} == {"nvidia", "ascend"}:
            counts[ln.link_class] += 1
            declared = declared and ln.source == "cluster"
    classes = tuple((c.name, k) for c, k in sorted(counts.items()))
    num = sum(counts.values())
    if not num:
        if {"nvidia", "ascend"} <= has:
            return CrossVendorAnswer(
                "unknown",
                0,
                (),
                False,
                "NVIDIA and Ascend devices are both present but no path between them is described; "
                "pass the cluster file (--cluster) that says how the node groups connect.",
            )
        return CrossVendorAnswer("none", 0, (), False, "No cross-vendor pair in this topology.")
    src = "declared in the cluster file" if declared else "observed"
    if set(counts) == {LinkClass.HOST_BRIDGE}:
        verdict = "host-staged"
        message = (
            f"Staged through host memory ({num} NVIDIA<->Ascend pair(s), HOST_BRIDGE, {src}): "
            "device -> host RAM -> NIC/socket -> host RAM -> device. GPUDirect RDMA cannot "
            "span vendors: nvidia_peermem registers NVIDIA memory only, and the Ascend NICs "
            "sit on the NPU; expect the host path's bandwidth and extra latency per hop."
        )
    elif all(c.is_gdr for c in counts):
        verdict = "gdr"
        message = f"GPUDirect RDMA on every NVIDIA<->Ascend pair ({num} pair(s), {src})."
    else:
        verdict = "mixed"
        message = (
            f"{num} NVIDIA<->Ascend pair(s) over {', '.join(c for c, _ in classes)} ({src}); "
            f"{'some' if any(c.is_gdr for c in counts) else 'none'} use GPUDirect RDMA."
        )
    return CrossVendorAnswer(verdict, num, classes, declared, message)


# -- (c) measurements -----------------------------------------------------------------------


def measurement_rows(topology: Topology, op: Optional[str] = None) -> List[Dict[str, object]]:
    """Answer (c): the topology's measurements as rows, sorted by op, ranks and size.

    Args:
        topology: its ``measurements`` (parsed nccl-tests output, or ``hetcomm bench``).
        op: keep only this op (``alltoall``), or every op when None.

    Returns:
        One dict per row with ``op, num_ranks, size_bytes, count, dtype, time_us, algbw_gbps,
        busbw_gbps, wrong, in_place, source``.
    """
    rows = []
    for m in topology.measurements:
        if op is not None and m.op != op:
            continue
        rows.append(
            {
                "op": m.op,
                "num_ranks": m.num_ranks,
                "size_bytes": m.size_bytes,
                "count": m.count,
                "dtype": m.dtype,
                "time_us": m.time_us,
                "algbw_gbps": m.algbw_gbps,
                "busbw_gbps": m.busbw_gbps,
                "wrong": m.wrong,
                "in_place": m.in_place,
                "source": m.source,
            }
        )
    rows.sort(
        key=lambda r: (
            str(r["op"]),
            r["num_ranks"] or 0,
            str(r["source"] or ""),
            r["size_bytes"],
            r["in_place"],
        )
    )
    return rows
