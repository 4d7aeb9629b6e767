"""Detection: build the :class:`~hetcomm.topo.cluster.Cluster` a job runs on from what each host sees.

Without a cluster file, every rank of a group takes part in one exchange through the group's
store (:func:`discover_cluster`):

1. **one probe per host.** Each rank bumps a per-host counter (``store.add``); the rank that
   gets 1 probes the host (:func:`probe_host`: the live probe of ``hetcomm.topo.probe``, or, when
   ``$HETCOMM_PROBE_DIR`` names a directory of captured tool outputs, the parsers run on those)
   and publishes the result; the others read it.
2. **every rank publishes its facts**: host, pid, which of the host's devices it drives.
3. **every rank assembles the same cluster** from the facts (:func:`assemble_cluster`, a pure
   function, tested without processes).

Assembly rules (the classes of ``hetcomm.topo.model.LinkClass``):

* ranks on one host form one node; a node's devices are the devices its ranks drive, in rank
  order (torchrun numbers ranks node by node, so a host's ranks are contiguous);
* inside a node, each pair's class is what the probe saw between the two devices (``NV#``,
  ``HCCS``, a PCIe path class); the node's ``fabric`` is the *worst* of its pairs, so plans never
  assume more than the slowest pair has. CPU-only hosts are ``SHM``;
* the node's NIC rails are its RDMA ports that are not Down: InfiniBand -> ``NET_IB``, Ethernet
  -> ``NET_ROCE``, ``_GDR`` when GPUDirect RDMA is usable (``nvidia_peermem`` / NCCL's GDR / the
  NIC's ``gdr`` flag); a port whose link layer is unknown counts as RoCE and one whose GDR is
  unknown as without it (the cheaper assumption; a note says so);
* between nodes of one vendor the class follows the NICs (``Cluster.network_class``); across
  vendors it is ``HOST_BRIDGE``;
* a rank's strength is its device model's throughput (``hetcomm.topo.compute``): strong =
  at least half the fastest rank's.

A cluster file still wins when given (``HETCOMM_CLUSTER``): :func:`compare_with_cluster` then
reports where it contradicts the probe as ``cluster-mismatch`` findings naming the node, the pair
and both classes (a YAML that says NVLink where the probe sees PCIe is the costly mistake).

Written by hand: nothing in torch or the ecosystem turns per-host tool output into a rank map;
the exchange is three store keys per rank on c10d's own store.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from hetcomm import settings
from hetcomm._input import read_bounded
from hetcomm.errors import ConfigError, PeerTimeout
from hetcomm.topo.bandwidth import canonical_model, is_sxm_model, vendor_of_model
from hetcomm.topo.cluster import Cluster, Interconnect, NicSpec, NodeGroup
from hetcomm.topo.compute import STRONG_FRACTION, find_device_spec
from hetcomm.topo.model import Device, Finding, Link, LinkClass, Nic, Topology

__all__ = [
    "PROBE_DIR_ENV",
    "DiscoveredCluster",
    "probe_host",
    "probe_host_name",
    "resolve_probe_dir",
    "host_record",
    "topology_from_record",
    "assemble_cluster",
    "compare_with_cluster",
    "cluster_to_yaml",
    "discover_cluster",
]

#: A directory of captured tool outputs (``nvidia-smi topo -m``, ``npu-smi info``, ``ibstat``,
#: ...) to read instead of probing this machine: how tests give each rank a different host, and
#: how a user replays a node's captures. A file ``hostname`` in it names the host (else the
#: directory's name does).
PROBE_DIR_ENV = "HETCOMM_PROBE_DIR"
_KEY = "hetcomm/discover"
_DEFAULT_NIC_GBPS = 100.0
_VENDOR_FABRIC = {"nvidia": LinkClass.PCIE_SYS, "ascend": LinkClass.PCIE_SYS, "cpu": LinkClass.SHM}


# -- probing one host -----------------------------------------------------------------------


def resolve_probe_dir(rank: int, probe_dir: Optional[str] = None) -> Optional[str]:
    """``probe_dir`` or ``$HETCOMM_PROBE_DIR``, with ``{rank}`` replaced by ``rank``.

    The template lets one environment (torchrun gives every rank the same) hand each rank a
    different captured host: ``HETCOMM_PROBE_DIR=/captures/rank{rank}``.
    """
    value = probe_dir if probe_dir is not None else settings.PROBE_DIR.get()
    if value and "{rank}" in value:
        value = value.replace("{rank}", str(rank))
    return value


_HOSTNAME_MAX_BYTES = 4096


def probe_host_name(probe_dir: Optional[str] = None) -> str:
    """The host's name: ``<dir>/hostname`` or the directory's name with captures, else this host's."""
    if probe_dir:
        path = os.path.join(probe_dir, "hostname")
        if os.path.isfile(path):
            # A host name is one short line: read at most a page, never a whole stray file.
            data = read_bounded(path, limit=_HOSTNAME_MAX_BYTES, error=ConfigError, what="hostname file",
                                hint=f"; it should hold one line, the host's name (key {PROBE_DIR_ENV})")
            lines = data.decode("utf-8", errors="replace").strip().splitlines()
            if lines and lines[0].strip():
                return lines[0].strip()
        return os.path.basename(os.path.normpath(probe_dir))
    return socket.gethostname()


def probe_host(probe_dir: Optional[str] = None) -> Topology:
    """What this host has: the live probe, or the parsed captures of ``probe_dir``.

    Raises:
        ConfigError: ``probe_dir`` is not a directory or holds no capture.
        TopologyParseError: a capture cannot be parsed (the parsers name the file and line).
    """
    if not probe_dir:
        from hetcomm.topo.probe import probe_local

        return probe_local()
    if not os.path.isdir(probe_dir):
        raise ConfigError(
            f"{probe_dir!r} is not a directory; point ${PROBE_DIR_ENV} at a directory of captured "
            f"tool outputs (nvidia-smi topo -m, npu-smi info, ibstat, ...) or unset it",
            key=PROBE_DIR_ENV,
        )
    files = sorted(
        os.path.join(probe_dir, n)
        for n in os.listdir(probe_dir)
        if n != "hostname" and not n.startswith(".") and os.path.isfile(os.path.join(probe_dir, n))
    )
    if not files:
        raise ConfigError(
            f"{probe_dir!r} holds no capture; put the host's tool outputs in it", key=PROBE_DIR_ENV
        )
    from hetcomm.topo.parse import join_ascend_chips, parse_file

    parts = [(path, parse_file(path)) for path in files]
    _check_captures_agree(parts, probe_dir)
    topo = Topology()
    for _, part in parts:
        topo.merge(part)
    join_ascend_chips(topo)
    if not topo.devices:  # NIC-only captures: the host's ranks are CPU ranks
        topo.add_device(Device(name="cpu0", vendor="cpu", model="cpu", index=0))
    return topo


def _check_captures_agree(parts: Sequence[Tuple[str, Topology]], probe_dir: str) -> None:
    """Refuse captures of one host that contradict each other (merged, they would describe a
    machine that does not exist: devices of two models, or the same NICs counted twice).

    Raises:
        ConfigError: two captures name different accelerator counts or models, or list the same
            number of NICs under disjoint names (one host's ports seen twice).
    """
    seen: List[Tuple[str, Dict[str, Optional[str]], List[str]]] = []
    for path, topo in parts:
        accel = {
            d.name: canonical_model(d.model)
            for d in topo.devices
            if d.vendor in ("nvidia", "ascend") and not d.name.startswith("rank")
        }
        nics = sorted(n.name for n in topo.nics)
        for other, other_accel, other_nics in seen:
            where = f"{os.path.basename(other)} and {os.path.basename(path)} in {probe_dir!r}"
            if accel and other_accel:
                models = {m for m in list(accel.values()) + list(other_accel.values()) if m}
                if len(accel) != len(other_accel) or len(models) > 1:
                    raise ConfigError(
                        f"captures {where} contradict: {len(other_accel)} accelerator(s) "
                        f"{sorted(m for m in set(other_accel.values()) if m)} vs {len(accel)} "
                        f"{sorted(m for m in set(accel.values()) if m)}; a probe directory holds one "
                        f"host's captures: move the other host's files to a directory of its own",
                        key=PROBE_DIR_ENV,
                    )
            if nics and other_nics and len(nics) == len(other_nics) and not set(nics) & set(other_nics):
                raise ConfigError(
                    f"captures {where} list {len(nics)} NICs each under different names "
                    f"({', '.join(other_nics[:3])}... vs {', '.join(nics[:3])}...): merged they would "
                    f"count the host's ports twice; keep one of them (or nvidia-smi topo -m with its "
                    f"NIC Legend, which names both)",
                    key=PROBE_DIR_ENV,
                )
        seen.append((path, accel, nics))


_FACT_KEYS = ("peermem", "nvswitch_count", "nvlink_active", "pcie_view", "nccl_gdr", "host", "probe_notes", "sources", "formats")


def host_record(topo: Topology, host: str) -> Dict[str, Any]:
    """The JSON-able summary of one host's probe that travels through the store."""
    out = topo.to_dict()
    out.pop("findings", None)
    out.pop("measurements", None)
    out["host"] = host
    out["facts"] = {k: topo.facts[k] for k in _FACT_KEYS if k in topo.facts}
    return json.loads(json.dumps(out, default=str))


def topology_from_record(record: Mapping[str, Any]) -> Topology:
    """Inverse of :func:`host_record` (devices, NICs, links and the facts it kept)."""
    topo = Topology()
    for d in record.get("devices", []):
        topo.add_device(Device(**{k: d.get(k) for k in ("name", "vendor", "model", "index", "pci_bus_id", "pci_device_id", "numa", "cpu_affinity", "host")}))
    for n in record.get("nics", []):
        topo.add_nic(Nic(**{k: n.get(k) for k in ("name", "link_layer", "rate_gbps", "state", "numa", "gdr", "port", "pci_bus_id", "netdev", "host")}))
    for l in record.get("links", []):
        topo.add_link(Link(l["a"], l["b"], LinkClass[l["class"]], raw=l.get("raw", ""), gbps=l.get("gbps")))
    topo.facts.update(record.get("facts", {}))
    return topo


# -- assembly (pure) ------------------------------------------------------------------------


@dataclass
class DiscoveredCluster:
    """What the job observed.

    Attributes:
        cluster: the assembled :class:`Cluster` (ranks numbered as the job's).
        rank_hosts: host of each rank.
        rank_devices: the device (a probe's name: ``GPU3``, ``NPU0``, ``cpu0``) each rank drives.
        pair_classes: ``(a, b) -> class`` for every rank pair ``a < b``, from the probe inside a
            host, from the cluster between hosts.
        hosts: host name -> its probed :class:`Topology`.
        findings: audit findings of every host (subjects prefixed ``host:``), plus
            ``cluster-mismatch`` findings after :func:`compare_with_cluster`.
        notes: assumptions made (a NIC's unknown link layer, an unknown model, ...).
        probes: how many ranks probed each host (1 each in a correct exchange).
    """

    cluster: Cluster
    rank_hosts: Tuple[str, ...]
    rank_devices: Tuple[str, ...]
    pair_classes: Dict[Tuple[int, int], LinkClass]
    hosts: Dict[str, Topology]
    findings: List[Finding] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    probes: Dict[str, int] = field(default_factory=dict)

    def pair_class(self, a: int, b: int) -> LinkClass:
        """The class between ranks ``a`` and ``b`` as observed."""
        return self.pair_classes[(a, b) if a < b else (b, a)]

    def to_yaml(self) -> str:
        """The cluster as a YAML file ``load_cluster`` reads back (see :func:`cluster_to_yaml`)."""
        return cluster_to_yaml(self.cluster)

    def summary(self) -> str:
        """One line: ``4 ranks on 3 hosts (h800-box: 2x H800-SXM, ...)``."""
        parts = [
            f"{node.name}: {node.num_devices}x {node.model} ({node.group.fabric.name})"
            for node in self.cluster.nodes
        ]
        return f"{self.cluster.num_ranks} ranks on {self.cluster.num_nodes} hosts ({'; '.join(parts)})"


def _accelerators(topo: Topology) -> List[Device]:
    devs = [d for d in topo.devices if d.vendor in ("nvidia", "ascend")]
    return sorted(devs, key=lambda d: (d.vendor != "nvidia", d.index if d.index is not None else 1 << 30, d.name))


def _group_name(host: str, taken: set) -> str:
    # Cluster files cap names (hetcomm.topo.cluster.MAX_NAME_CHARS): keep room for "-<n>-0".
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", host).strip("-")[:48] or "host"
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    taken.add(name)
    return name


def _nic_class(nic: Nic, host_gdr: Optional[bool], vendor: str) -> Tuple[LinkClass, List[str]]:
    """The network class of one RDMA port, and the assumptions it took (as note texts)."""
    notes = []
    layer = (nic.link_layer or "").lower()
    if not layer:
        notes.append("link layer unknown (no ibstat/sysfs capture); counted as RoCE")
    gdr = nic.gdr if nic.gdr is not None else host_gdr
    if gdr is None and vendor == "nvidia":
        notes.append("GPUDirect RDMA unknown (no lsmod/sysfs/NCCL evidence); counted as without")
    ib = layer == "infiniband"
    if gdr:
        return (LinkClass.NET_IB_GDR if ib else LinkClass.NET_ROCE_GDR), notes
    return (LinkClass.NET_IB if ib else LinkClass.NET_ROCE), notes


def _is_rail(nic: Nic) -> bool:
    """An RDMA port that can carry a rail: not Down, and not a plain TCP netdev."""
    state = (nic.state or "").lower()
    if state and state not in ("active", "linkup", "up"):
        return False
    name = nic.name.lower()
    return bool(re.match(r"(mlx\d|mlx5|irdma|bnxt_re|hns|erdma|rxe|efa|npu\d+-roce|ib)", name)) or nic.link_layer is not None


def _host_gdr(topo: Topology) -> Optional[bool]:
    if "peermem" in topo.facts:
        return bool(topo.facts["peermem"])
    gdr = topo.facts.get("nccl_gdr")
    if isinstance(gdr, list) and gdr:
        return all(str(g) == "1" for g in gdr)
    return None


def assemble_cluster(
    rank_facts: Sequence[Mapping[str, Any]],
    hosts: Mapping[str, Topology],
    *,
    name: str = "detected",
) -> DiscoveredCluster:
    """The cluster the ranks describe (pure: no store, no processes).

    Args:
        rank_facts: one mapping per rank, in rank order, with ``host`` (a key of ``hosts``) and
            optionally ``device`` (the probe's device name the rank drives; default: the
            host's ``i``-th accelerator for the host's ``i``-th rank) and ``pid``.
        hosts: host name -> its probed topology.
        name: the cluster's name.

    Raises:
        ConfigError: a host's ranks are not contiguous in rank order (the cluster numbers ranks
            node by node), or a rank names a host nobody probed.
    """
    n = len(rank_facts)
    if n == 0:
        raise ConfigError("no ranks to assemble a cluster from", key="discover")
    rank_hosts = [str(f["host"]) for f in rank_facts]
    order: List[str] = []
    for r, h in enumerate(rank_hosts):
        if h not in hosts:
            raise ConfigError(f"rank {r} is on host {h!r}, which no rank probed", key="discover")
        if h in order and order[-1] != h:
            first = rank_hosts.index(h)
            raise ConfigError(
                f"host {h!r} holds ranks {first} and {r} but not every rank between them: ranks "
                f"must be numbered host by host (torchrun does this); relaunch with contiguous "
                f"ranks per host or give a cluster file (HETCOMM_CLUSTER)",
                key="discover",
            )
        if h not in order:
            order.append(h)
    notes: List[str] = []
    taken: set = set()
    groups: List[NodeGroup] = []
    rank_devices: List[str] = []
    rank_models: List[str] = []
    host_nic_rates: List[float] = []
    pair_classes: Dict[Tuple[int, int], LinkClass] = {}
    for h in order:
        topo = hosts[h]
        ranks = [r for r in range(n) if rank_hosts[r] == h]
        accels = _accelerators(topo)
        devices: List[Device] = []
        for i, r in enumerate(ranks):
            want = rank_facts[r].get("device")
            dev = topo.device(want) if want else None
            if dev is None and i < len(accels):
                dev = accels[i]
            if dev is None:
                if accels:
                    notes.append(f"{h}: rank {r} has no accelerator of its own ({len(accels)} on the host for {len(ranks)} ranks); counted as a CPU rank")
                dev = Device(name=f"cpu{i}", vendor="cpu", model="cpu", index=i, host=h)
            devices.append(dev)
            rank_devices.append(dev.name)
        vendors = {d.vendor for d in devices}
        vendor = "cpu" if vendors != {devices[0].vendor} else devices[0].vendor
        if len(vendors) > 1:
            notes.append(f"{h}: ranks drive devices of several vendors {sorted(vendors)}; the node is modelled as CPU ranks")
        model = devices[0].model or ("cpu" if vendor == "cpu" else None)
        models = {d.model for d in devices}
        if len(models) > 1:
            notes.append(f"{h}: mixed device models {sorted(str(m) for m in models)}; the node uses {model}")
        if model is None:
            # nvidia-smi topo -m names no model. Writing a guess would give a cluster file that
            # load_cluster rejects (or, worse, a wrong one): refuse, before anything is written.
            tool = {"nvidia": "nvidia-smi (or nvidia-smi -L)", "ascend": "npu-smi info"}.get(vendor, "the device tool")
            raise ConfigError(
                f"host {h}: the captures show {len(devices)} {vendor} device(s) but not their model, "
                f"so no cluster file can be written; add the output of {tool} to the host's captures",
                key="discover",
            )
        if vendor != "cpu" and find_device_spec(model) is None:
            notes.append(f"{h}: no compute figures for {model!r}; set node_groups[].device.tflops in a cluster file")
        rank_models.extend([model] * len(ranks))
        # intra-node pairs
        worst: Optional[LinkClass] = None
        worst_gbps: Optional[float] = None
        for i in range(len(ranks)):
            for j in range(i + 1, len(ranks)):
                a, b = devices[i], devices[j]
                if vendor == "cpu":
                    cls, gbps = LinkClass.SHM, None
                else:
                    link = topo.link(a.name, b.name)
                    if link is None:
                        cls, gbps = LinkClass.PCIE_SYS, None
                        notes.append(f"{h}: no link seen between {a.name} and {b.name}; assumed PCIE_SYS")
                    else:
                        cls, gbps = link.link_class, link.gbps
                pair_classes[(ranks[i], ranks[j])] = cls
                if worst is None or cls > worst:
                    worst, worst_gbps = cls, gbps
                elif cls == worst and gbps is not None and (worst_gbps is None or gbps < worst_gbps):
                    worst_gbps = gbps
        if worst is None:  # a one-rank node: the best fabric its device has to a host peer
            if vendor == "cpu":
                worst = LinkClass.SHM
            else:
                own = [l.link_class for l in topo.links_of(devices[0].name) if topo.device(l.a if l.b == devices[0].name else l.b) is not None]
                worst = min(own) if own else _VENDOR_FABRIC[vendor]
        # NIC rails
        host_gdr = _host_gdr(topo)
        rails = [nic for nic in topo.nics if _is_rail(nic)]
        classes = {}
        unknown: Dict[str, List[str]] = {}
        for nic in rails:
            cls, nic_notes = _nic_class(nic, host_gdr, vendor)
            classes[nic.name] = cls
            for what in nic_notes:
                unknown.setdefault(what, []).append(nic.name)
        known_rate: Dict[LinkClass, float] = {}
        for nic in rails:
            if nic.rate_gbps:
                known_rate[classes[nic.name]] = max(known_rate.get(classes[nic.name], 0.0), float(nic.rate_gbps))
        specs: Dict[Tuple[LinkClass, float], List[Optional[int]]] = {}
        for nic in rails:
            cls = classes[nic.name]
            rate = nic.rate_gbps
            if not rate:
                # Ports of one kind on one host are bought together: a sibling's rate is the best guess.
                rate = known_rate.get(cls, _DEFAULT_NIC_GBPS)
                unknown.setdefault(f"rate unknown; assumed {rate:.0f} Gb/s", []).append(nic.name)
            specs.setdefault((cls, float(rate)), []).append(nic.numa)
        for what, names in unknown.items():
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            notes.append(f"{h}: {shown}: {what}")
        nics = tuple(
            NicSpec(
                link_class=cls,
                gbps=rate,
                count=len(numas),
                numa=tuple(int(x) for x in numas) if all(x is not None for x in numas) else None,
            )
            for (cls, rate), numas in sorted(specs.items(), key=lambda kv: (kv[0][0], -kv[0][1]))
        )
        if nics:
            host_nic_rates.append(max(s.gbps for s in nics))
        numa_nodes = len({d.numa for d in devices if d.numa is not None}) or 1
        # The probe's per-link figure (NV8 -> 8 links' rate); None lets Cluster use its nominal.
        fabric_gbps = worst_gbps if worst_gbps else None
        groups.append(
            NodeGroup(
                name=_group_name(h, taken),
                count=1,
                model=model,
                vendor=vendor_of_model(model) if vendor != "cpu" else "cpu",
                devices_per_node=len(ranks),
                strong=False,  # set below, from throughput over the whole job
                numa_nodes=numa_nodes,
                fabric=worst,
                fabric_gbps=fabric_gbps,
                nics=nics,
            )
        )
    # strength from throughput
    speeds = []
    for g in groups:
        spec = find_device_spec(g.model)
        speeds.append(spec.tflops if spec is not None else 0.0)
    top = max(speeds) if speeds else 0.0
    groups = [
        _replace_group(g, strong=(top <= 0 or s >= STRONG_FRACTION * top)) for g, s in zip(groups, speeds)
    ]
    cross_gbps = min(host_nic_rates) if host_nic_rates else Interconnect().cross_vendor_gbps
    cluster = Cluster(
        name=name,
        groups=tuple(groups),
        interconnect=Interconnect(cross_vendor_gbps=float(min(cross_gbps, Interconnect().cross_vendor_gbps))),
        wire_dtype=(("HOST_BRIDGE", "fp16"),),
        description=f"detected from {len(order)} host(s): " + ", ".join(order),
    )
    for a in range(n):
        for b in range(a + 1, n):
            if (a, b) not in pair_classes:
                pair_classes[(a, b)] = cluster.link_class(a, b)
    findings = _host_findings(hosts, order)
    return DiscoveredCluster(
        cluster=cluster,
        rank_hosts=tuple(rank_hosts),
        rank_devices=tuple(rank_devices),
        pair_classes=pair_classes,
        hosts=dict(hosts),
        findings=findings,
        notes=list(dict.fromkeys(notes)),
    )


def _replace_group(g: NodeGroup, **changes: Any) -> NodeGroup:
    from dataclasses import replace

    return replace(g, **changes)


def _host_findings(hosts: Mapping[str, Topology], order: Sequence[str]) -> List[Finding]:
    """The audit of every host, subjects prefixed with the host's name."""
    from hetcomm.topo.audit import audit

    out: List[Finding] = []
    for h in order:
        topo = hosts[h]
        copy = Topology(devices=list(topo.devices), nics=list(topo.nics), links=list(topo.links), facts=dict(topo.facts))
        for f in audit(copy):
            out.append(Finding(f.code, f.severity, f"{h}:{f.subject}", f.message, f.fix))
    return out


# -- a cluster file against the probe ---------------------------------------------------------


def compare_with_cluster(discovered: DiscoveredCluster, declared: Cluster) -> List[Finding]:
    """``cluster-mismatch`` findings where ``declared`` (a YAML) contradicts what was probed.

    Checked for every rank the probe saw a real device for (CPU ranks standing for a labelled
    device are not evidence): the device family, whether two ranks share a node, and each
    same-node pair's class. The findings are added to ``discovered.findings`` and returned.
    """
    found: List[Finding] = []
    n = min(declared.num_ranks, discovered.cluster.num_ranks)
    fix = (
        "correct the cluster file (node_groups[].fabric / device.model) to what the machines have, "
        "or fix the machines (NVLink bridge/fabric manager, HCCS); `hetcomm discover` writes the observed YAML"
    )
    if declared.num_ranks != discovered.cluster.num_ranks:
        found.append(Finding(
            "cluster-mismatch", "error", f"cluster '{declared.name}'",
            f"the cluster file has {declared.num_ranks} ranks, the job {discovered.cluster.num_ranks}", fix,
        ))
    real = [discovered.cluster.rank(r).vendor != "cpu" for r in range(n)]
    for r in range(n):
        if not real[r]:
            continue
        want = canonical_model(declared.rank(r).model)
        seen = canonical_model(discovered.cluster.rank(r).model)
        form_differs = is_sxm_model(declared.rank(r).model) and not is_sxm_model(discovered.cluster.rank(r).model)
        if want and seen and (want != seen or form_differs):
            node = declared.rank(r).node.name
            found.append(Finding(
                "cluster-mismatch", "error", f"node {node}: rank{r}",
                f"cluster file says {declared.rank(r).model} on node {node} (rank {r}); the probe of "
                f"host {discovered.rank_hosts[r]} sees {discovered.cluster.rank(r).model} ({discovered.rank_devices[r]})",
                fix,
            ))
    groups: Dict[Tuple[str, str, str], List[Tuple[int, int]]] = {}
    for a in range(n):
        for b in range(a + 1, n):
            if not (real[a] and real[b]):
                continue
            same_declared = declared.node_of(a).index == declared.node_of(b).index
            same_seen = discovered.rank_hosts[a] == discovered.rank_hosts[b]
            if same_declared != same_seen:
                found.append(Finding(
                    "cluster-mismatch", "error", f"rank{a}-rank{b}",
                    f"cluster file puts ranks {a} and {b} on {'one node' if same_declared else 'different nodes'} "
                    f"({declared.node_of(a).name}, {declared.node_of(b).name}); the probe sees hosts "
                    f"{discovered.rank_hosts[a]} and {discovered.rank_hosts[b]}",
                    fix,
                ))
                continue
            if not same_declared:
                continue
            want_cls = declared.link_class(a, b)
            seen_cls = discovered.pair_class(a, b)
            if want_cls != seen_cls:
                node = declared.node_of(a).name
                key = (node, want_cls.name, seen_cls.name)
                groups.setdefault(key, []).append((a, b))
    for (node, want_cls, seen_cls), pairs in groups.items():
        texts = [f"rank{a}-rank{b} ({discovered.rank_devices[a]}-{discovered.rank_devices[b]})" for a, b in pairs]
        shown = ", ".join(texts[:4]) + (f" and {len(texts) - 4} more" if len(texts) > 4 else "")
        a0, b0 = pairs[0]
        host = discovered.rank_hosts[a0]
        worse = LinkClass[seen_cls] > LinkClass[want_cls]
        found.append(Finding(
            "cluster-mismatch", "error" if worse else "warning", f"node {node}: rank{a0}-rank{b0}",
            f"cluster file says {want_cls} on node {node} for {shown}; the probe of host {host} sees "
            f"{seen_cls}" + (" (slower than declared: plans and wire dtypes assume bandwidth that is not there)" if worse else ""),
            fix,
        ))
    discovered.findings.extend(found)
    return found


# -- YAML out -------------------------------------------------------------------------------


def cluster_to_yaml(cluster: Cluster) -> str:
    """A cluster file for ``cluster`` that :func:`hetcomm.topo.cluster.load_cluster` reads back."""
    groups = []
    for g in cluster.groups:
        device: Dict[str, Any] = {"model": g.model, "count": g.devices_per_node, "strong": g.strong}
        if g.numa_nodes != 1:
            device["numa_nodes"] = g.numa_nodes
        if g.tflops is not None:
            device["tflops"] = g.tflops
        entry: Dict[str, Any] = {"name": g.name, "count": g.count, "device": device, "fabric": g.fabric.name}
        if g.fabric_gbps is not None:
            entry["fabric_gbps"] = g.fabric_gbps
        if g.nics:
            entry["nics"] = []
            for s in g.nics:
                nic: Dict[str, Any] = {"class": s.link_class.name, "gbps": s.gbps, "count": s.count}
                if s.numa is not None:
                    nic["numa"] = list(s.numa)
                entry["nics"].append(nic)
        groups.append(entry)
    ic = cluster.interconnect
    doc = {
        "name": cluster.name,
        "description": cluster.description,
        "node_groups": groups,
        "interconnect": {
            "same_vendor": ic.same_vendor.name if ic.same_vendor is not None else "auto",
            "cross_vendor": {"class": ic.cross_vendor_class.name, "gbps": ic.cross_vendor_gbps, "latency_us": ic.cross_vendor_latency_us},
        },
        "wire_dtype": dict(cluster.wire_dtype) or {"HOST_BRIDGE": "fp16"},
    }
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120)


# -- the store exchange ---------------------------------------------------------------------


def _wait(store, keys: List[str], timeout: timedelta, what: str, rank: int) -> None:
    """``store.wait`` that names whose keys are missing when it times out."""
    try:
        store.wait(keys, timeout)
    except Exception as e:  # DistStoreError / RuntimeError on timeout
        missing = [k for k in keys if not store.check([k])]
        raise PeerTimeout(
            f"discovery: no {what} within {timeout.total_seconds():.0f} s for {', '.join(m.rsplit('/', 1)[-1] for m in missing) or '?'} "
            f"({type(e).__name__}); check that every rank started and can reach the store",
            op="discover",
            rank=rank,
        ) from None


def discover_cluster(
    store: "Any",
    rank: int,
    world_size: int,
    timeout: timedelta,
    *,
    probe_dir: Optional[str] = None,
    name: str = "detected",
) -> DiscoveredCluster:
    """Probe each host once, exchange every rank's facts through ``store``, assemble the cluster.

    Args:
        store: the group's (prefixed) c10d store.
        rank / world_size: this process in the group.
        timeout: how long to wait for another rank's facts or a host's probe.
        probe_dir: captures to read instead of this machine (default ``$HETCOMM_PROBE_DIR``).
        name: the cluster's name.

    Returns:
        The same :class:`DiscoveredCluster` on every rank.

    Raises:
        PeerTimeout: a rank or a host's prober did not publish in time (named).
        ConfigError / TopologyParseError: bad captures, non-contiguous ranks per host.
    """
    probe_dir = resolve_probe_dir(rank, probe_dir)
    host = probe_host_name(probe_dir)
    claim = int(store.add(f"{_KEY}/claim/{host}", 1))
    if claim == 1:
        try:
            record = host_record(probe_host(probe_dir), host)
        except Exception as e:
            # The others wait on this host's record: tell them why it will not come.
            store.set(f"{_KEY}/host/{host}", json.dumps({"error": f"{type(e).__name__}: {e}", "rank": rank}))
            raise
        store.set(f"{_KEY}/host/{host}", json.dumps(record))
    # Which of the host's devices this rank drives: the host's i-th accelerator for its i-th
    # rank (torchrun's LOCAL_RANK = CUDA/NPU device index convention); None lets assembly decide.
    mine = {"rank": rank, "host": host, "pid": os.getpid(), "prober": claim == 1, "device": None}
    store.set(f"{_KEY}/rank/{rank}", json.dumps(mine))
    keys = [f"{_KEY}/rank/{r}" for r in range(world_size)]
    _wait(store, keys, timeout, "facts", rank)
    facts = [json.loads(store.get(k).decode()) for k in keys]
    names = list(dict.fromkeys(f["host"] for f in facts))
    host_keys = [f"{_KEY}/host/{h}" for h in names]
    _wait(store, host_keys, timeout, "host probe", rank)
    hosts: Dict[str, Topology] = {}
    for h, k in zip(names, host_keys):
        record = json.loads(store.get(k).decode())
        if "error" in record:
            raise ConfigError(f"rank {record.get('rank')} could not probe host {h}: {record['error']}", key="discover")
        hosts[h] = topology_from_record(record)
    out = assemble_cluster(facts, hosts, name=name)
    out.probes = {h: sum(1 for f in facts if f["host"] == h and f["prober"]) for h in names}
    return out
