"""The audit: what is wrong with a topology, and what a buyer of the cluster should expect.

:func:`audit` checks a :class:`~hetcomm.topo.model.Topology` (parsed tool output, a live probe,
a cluster file, or all merged) against the misconfiguration signatures of topology-notes §6 and
returns :class:`~hetcomm.topo.model.Finding` objects with stable codes (:data:`FINDING_CODES`).
Rules look only at *observed* evidence: devices that are labels (``label_only``) and links a
cluster YAML declares (``source == "cluster"``) are claims, used to compare against, never
audited as hardware.

Three questions are answered beside the findings:

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

``α_c`` are order-of-magnitude start-up latencies (:data:`ALPHA_US`); at MiB sizes the β term
dominates.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

from hetcomm.errors import UsageError
from hetcomm.units import format_bytes, parse_size  # re-exported: the one size parser/formatter
from hetcomm.topo.bandwidth import canonical_model, is_sxm_model, nvlink_links_for_model
from hetcomm.topo.model import Device, Finding, Link, LinkClass, Nic, Topology
from hetcomm.topo.pci_ids import NVIDIA_GPU_IDS

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.topo.cluster import Cluster

__all__ = [
    "FINDING_CODES",
    "FindingSpec",
    "ALPHA_US",
    "audit",
    "ClassEstimate",
    "AlltoallEstimate",
    "estimate_alltoall",
    "CrossVendorAnswer",
    "cross_vendor_path",
    "measurement_rows",
    "AuditReport",
    "run_audit",
    "parse_size",
    "format_bytes",
]


@dataclass(frozen=True)
class FindingSpec:
    """What a finding code means, for reports and docs/TOPOLOGY.md.

    Attributes:
        code: the stable code.
        severity: the usual severity (a rule may lower it, e.g. GNS on GeForce is ``info``).
        title: one line.
        meaning: why it matters for training traffic.
    """

    code: str
    severity: str
    title: str
    meaning: str


FINDING_CODES: Dict[str, FindingSpec] = {
    s.code: s
    for s in (
        FindingSpec(
            "pcie-not-sxm",
            "error",
            "SXM-class GPU behaves like a PCIe card",
            "A part sold or labelled as SXM (A100/A800/H100/H800/H20/H200) has no NVLink to its "
            "peers: GPU<->GPU traffic falls from hundreds of GB/s to PCIe speed.",
        ),
        FindingSpec(
            "nvlink-degraded",
            "warning",
            "fewer NVLinks than the model has",
            "Some NVLinks are down or missing: NVLink bandwidth is lower than the model's "
            "nominal and the GPU may be uneven with its peers.",
        ),
        FindingSpec(
            "nic-numa-mismatch",
            "warning",
            "GPU/NPU's nearest RDMA NIC is across sockets",
            "Every RDMA NIC is reachable only over the inter-socket link (SYS): network traffic "
            "crosses QPI/UPI/xGMI and NCCL usually turns GPUDirect RDMA off for such a pair.",
        ),
        FindingSpec(
            "numa-unknown",
            "warning",
            "NUMA placement unknown or flattened",
            "The NUMA node of the devices is not reported (N/A, -1) or every device claims NUMA "
            "0 with all CPUs: processes cannot be pinned near their device and NIC.",
        ),
        FindingSpec(
            "no-gdr",
            "error",
            "GPUDirect RDMA unavailable or unused",
            "RDMA NICs are present but data is bounced through host memory: nvidia_peermem is "
            "not loaded/bound, or NCCL reports GDR 0 / NET/IB without GDRDMA.",
        ),
        FindingSpec(
            "nccl-ib-disabled",
            "error",
            "NCCL uses TCP sockets instead of RDMA",
            "NCCL_IB_DISABLE=1 or a failed IB plugin makes NCCL use NET/Socket: inter-node "
            "bandwidth drops to a fraction of the RDMA NICs' rate and CPU load rises.",
        ),
        FindingSpec(
            "nccl-p2p-shm-fallback",
            "warning",
            "GPU<->GPU traffic staged through host memory",
            "NCCL moves data between GPUs of one node via SHM instead of P2P (NVLink/PCIe), "
            "typically because NCCL_P2P_LEVEL or NCCL_P2P_DISABLE is set too strictly.",
        ),
        FindingSpec(
            "p2p-not-supported",
            "warning",
            "GPU peer-to-peer not supported",
            "The p2p matrix reports CNS/GNS/TNS/NS for some pairs: those pairs fall back to host "
            "memory. GNS on GeForce cards is expected (info).",
        ),
        FindingSpec(
            "rdma-port-down",
            "warning",
            "RDMA port not active",
            "A verbs port is Down/Init/Polling: any rail planned over it carries nothing.",
        ),
        FindingSpec(
            "fabric-manager-missing",
            "error",
            "NVSwitch present, fabric not up",
            "NVSwitch systems need nvidia-fabricmanager before CUDA can use NVLink; without it "
            "CUDA init fails (error 802, system not yet initialized) or NVLink is unusable.",
        ),
        FindingSpec(
            "hccs-missing",
            "error",
            "Ascend 910B pair not connected by HCCS",
            "910B NPUs in one node form an HCCS full mesh (56 GB/s per pair); a pair shown as "
            "PCIe/unknown loses most of its bandwidth.",
        ),
        FindingSpec(
            "cluster-mismatch",
            "error",
            "cluster file contradicts the probed machines",
            "The cluster YAML declares a device model, node membership or intra-node link class "
            "that the live probe (or the captures) does not show, e.g. NVLink where the GPUs are "
            "PCIe cards: plans, wire dtypes and placement then assume bandwidth that is not there "
            "(hetcomm.topo.discover.compare_with_cluster).",
        ),
    )
}

# Start-up latency per class in microseconds: order-of-magnitude assumptions for the α term
# (NCCL's tuning tables use base latencies in the same few-µs range for NVLink/PCIe and tens
# of µs for sockets). Bandwidth, not these, decides the estimate at MiB sizes.
ALPHA_US: Dict[LinkClass, float] = {
    LinkClass.NVLINK: 2.0,
    LinkClass.HCCS: 3.0,
    LinkClass.PCIE_PIX: 3.0,
    LinkClass.PCIE_PXB: 3.0,
    LinkClass.PCIE_PHB: 4.0,
    LinkClass.PCIE_NODE: 4.0,
    LinkClass.PCIE_SYS: 5.0,
    LinkClass.P2P: 3.0,
    LinkClass.SHM: 5.0,
    LinkClass.NET_IB_GDR: 5.0,
    LinkClass.NET_IB: 7.0,
    LinkClass.NET_ROCE_GDR: 6.0,
    LinkClass.NET_ROCE: 8.0,
    LinkClass.NET_EFA: 15.0,
    LinkClass.NET_SOCKET: 50.0,
    LinkClass.HOST_BRIDGE: 30.0,
}

_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
# Names of verbs (RDMA) devices; a bare netdev (eth0, ens32) is not one. EFA is libfabric,
# not verbs RDMA as NCCL's IB transport sees it, so it is left out.
_RDMA_NAME = re.compile(
    r"^(mlx\d+_|irdma|bnxt_re|rxe|siw|qedr|hns_?\d|hns_roce|erdma|ionic|cxgb|NIC\d)"
)
_GEFORCE = re.compile(r"RTX|GEFORCE|GTX|TITAN", re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")


# -- context --------------------------------------------------------------------------------


class _Context:
    """Indexes of a topology the rules share: what is observed, what is declared."""

    def __init__(self, topo: Topology, cluster: Optional["Cluster"]) -> None:
        self.topo = topo
        self.cluster = cluster
        # What a cluster file declares (Cluster.to_topology names: rank<r>, <node>/nic<i>) is a
        # claim, not an observation. A rank an NCCL log also saw (a non-cluster link) is observed.
        declared_devices: Set[str] = set()
        declared_nics: Set[str] = set()
        if cluster is not None:
            observed_ends = {n for ln in topo.links if ln.source != "cluster" for n in (ln.a, ln.b)}
            declared_devices = {f"rank{r}" for r in range(cluster.num_ranks)} - observed_ends
            declared_nics = {
                f"{node.name}/nic{i}" for node in cluster.nodes for i in range(node.num_nics)
            }
        self.declared_devices = declared_devices
        self.devices = [
            d for d in topo.devices if not d.label_only and d.name not in declared_devices
        ]
        self.accel = [d for d in self.devices if d.vendor in ("nvidia", "ascend")]
        self.device_names = {d.name for d in self.devices}
        self.nics = [n for n in topo.nics if n.name not in declared_nics]
        self.nic_names = {n.name for n in self.nics}
        self.rdma_nics = [n for n in self.nics if _is_rdma_nic(n)]
        self.links = [ln for ln in topo.links if ln.source != "cluster"]
        self.facts = topo.facts

    def links_of(self, name: str) -> List[Link]:
        return [ln for ln in self.links if name in (ln.a, ln.b)]

    @staticmethod
    def other(link: Link, name: str) -> str:
        return link.b if link.a == name else link.a

    @property
    def rdma_present(self) -> bool:
        """RDMA NICs seen, or NCCL moving data over verbs (``NET/IB``)."""
        return bool(self.rdma_nics) or any(ln.link_class.is_rdma for ln in self.links)

    @property
    def nccl_env(self) -> Dict[str, str]:
        env = self.facts.get("nccl_env") or {}
        return {str(k): str(v) for k, v in env.items()}


def _is_rdma_nic(nic: Nic) -> bool:
    if nic.name.lower().startswith("efa"):
        return False
    if (nic.link_layer or "").lower() == "infiniband" or nic.gdr is not None:
        return True
    if _RDMA_NAME.match(nic.name):
        return True
    # An ibstat/sysfs port: it has a port number and a verbs link layer.
    return nic.port is not None and (nic.link_layer or "").lower() in ("ethernet", "infiniband")


def _pci_model(device: Device) -> Tuple[Optional[str], Optional[str]]:
    """``(model, form factor)`` from the device's PCI id, or ``(None, None)``."""
    if not device.pci_device_id or ":" not in device.pci_device_id:
        return None, None
    vendor, dev_id = device.pci_device_id.lower().split(":", 1)
    if vendor != "10de":
        return None, None
    return NVIDIA_GPU_IDS.get(dev_id, (None, None))


def _nv_count(link: Link) -> Optional[int]:
    match = re.fullmatch(r"NV(\d+)", link.raw.strip().upper()) if link.raw else None
    return int(match.group(1)) if match else None


def _subject(names: Sequence[str], limit: int = 4) -> str:
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" (+{len(names) - limit} more)"


# -- rules ----------------------------------------------------------------------------------


def _rule_pcie_not_sxm(ctx: _Context) -> List[Finding]:
    claims: Dict[str, Tuple[str, str]] = {}  # family -> (group, model) a cluster labels SXM
    if ctx.cluster is not None:
        for g in ctx.cluster.groups:
            if g.vendor == "nvidia" and is_sxm_model(g.model):
                claims.setdefault(canonical_model(g.model) or "", (g.name, g.model))
    pcie_view = bool(ctx.facts.get("pcie_view"))
    nvlink_active = ctx.facts.get("nvlink_active") or {}
    form_factors = ctx.facts.get("form_factor") or {}
    out = []
    for d in ctx.accel:
        if d.vendor != "nvidia":
            continue
        pci_model, form = _pci_model(d)
        form = form or form_factors.get(d.name)  # lspci's verdict when the id is not in our table
        family = canonical_model(d.model) or canonical_model(pci_model)
        if is_sxm_model(d.model):
            claim = f"it reports the SXM model {d.model}"
        elif form == "SXM":
            claim = f"its PCI id {d.pci_device_id} is {pci_model or 'an SXM part'} (SXM, pci.ids)"
        elif family in claims:
            group, model = claims[family]
            where = ctx.cluster.path or ctx.cluster.name  # type: ignore[union-attr]
            claim = f"cluster file {where} labels node group '{group}' as {model}"
        else:
            continue
        evidence = []
        if form == "PCIe":
            evidence.append(f"its PCI id {d.pci_device_id} is {pci_model}, a PCIe card (pci.ids)")
        if d.model and "PCIE" in d.model.upper():
            evidence.append(f"the GPU reports itself as {d.model}")
        if nvlink_active.get(d.name) == 0:
            evidence.append("nvidia-smi nvlink reports no active NVLink")
        gpu_links = [
            ln
            for ln in ctx.links_of(d.name)
            if (peer := ctx.topo.device(ctx.other(ln, d.name))) is not None
            and peer.vendor == "nvidia"
            and peer.name in ctx.device_names
        ]
        if gpu_links and not pcie_view and all(ln.link_class.is_pcie for ln in gpu_links):
            raws = sorted({ln.raw or ln.link_class.name for ln in gpu_links})
            evidence.append(
                f"its {len(gpu_links)} GPU peer link(s) are PCIe ({'/'.join(raws)}), no NV#"
            )
        if not evidence:
            continue
        out.append(
            Finding(
                code="pcie-not-sxm",
                severity="error",
                subject=d.name,
                message=f"{d.name}: {claim}, but {'; '.join(evidence)}. An SXM part has NVLink to "
                f"its peers; this one would move GPU<->GPU traffic over PCIe.",
                fix="Check the delivered hardware against the order (`nvidia-smi -q | grep -i "
                "'product name'`, `lspci -nn -d 10de:`): a PCIe card in place of SXM is a supply "
                "problem; if it is SXM, check the baseboard/NVSwitch and fabric manager, and in "
                "a VM pass the NVLink topology through (UVM/vGPU shows PIX instead of NV#). Fix "
                "the cluster YAML model if the card really is PCIe.",
            )
        )
    return out


def _rule_nvlink_degraded(ctx: _Context, skip: Set[str]) -> List[Finding]:
    nvlink_active = ctx.facts.get("nvlink_active") or {}
    out = []
    for d in ctx.accel:
        if d.vendor != "nvidia" or d.name in skip:
            continue
        model = d.model if is_sxm_model(d.model) else _pci_model(d)[0]
        expected = nvlink_links_for_model(model)
        if not expected:
            continue
        seen: List[str] = []
        observed: List[int] = []
        active = nvlink_active.get(d.name)
        if active is not None and 0 < int(active) < expected:
            seen.append(f"nvidia-smi nvlink shows {active} active link(s)")
            observed.append(int(active))
        counts = [c for ln in ctx.links_of(d.name) if (c := _nv_count(ln)) is not None]
        if counts:
            # Through NVSwitch, NV# is the GPU's whole link count (same to every peer); in a
            # direct mesh the links are split over peers and add up.
            total = sum(counts) if sum(counts) <= expected else max(counts)
            if total < expected:
                tokens = "/".join(f"NV{c}" for c in sorted(set(counts)))
                seen.append(f"the matrix shows {total} link(s) ({tokens})")
                observed.append(total)
        if seen:
            out.append(
                Finding(
                    code="nvlink-degraded",
                    severity="warning",
                    subject=d.name,
                    message=f"{d.name} ({model}) should have {expected} NVLinks but "
                    f"{'; '.join(seen)}: "
                    f"its NVLink bandwidth is about {min(observed)}/{expected} of nominal.",
                    fix=f"Run `nvidia-smi nvlink -s -i "
                    f"{d.index if d.index is not None else '<gpu>'}` "
                    "and `nvidia-smi nvlink -e` (error counters); reseat or RMA the GPU/baseboard; "
                    "on NVSwitch systems check `nvidia-smi -q | grep -A3 Fabric`.",
                )
            )
    return out


def _rule_nic_numa_mismatch(ctx: _Context) -> List[Finding]:
    out = []
    rdma_names = {n.name for n in ctx.rdma_nics}
    for d in ctx.accel:
        nic_links = [ln for ln in ctx.links_of(d.name) if ctx.other(ln, d.name) in rdma_names]
        if nic_links:
            best = min(ln.link_class for ln in nic_links)
            if best != LinkClass.PCIE_SYS:
                continue
            nearest = sorted(ctx.other(ln, d.name) for ln in nic_links if ln.link_class == best)
            msg = (
                f"{d.name} (NUMA {d.numa if d.numa is not None else '?'}) reaches every RDMA NIC "
                f"only via SYS ({_subject(nearest)}): its network traffic crosses the "
                f"inter-socket link, and NCCL disables GPUDirect RDMA beyond "
                f"NCCL_NET_GDR_LEVEL (PXB by default)."
            )
        else:
            if d.numa is None:
                continue
            same_host = [
                n
                for n in ctx.rdma_nics
                if n.numa is not None and (n.host is None or d.host is None or n.host == d.host)
            ]
            if not same_host or any(n.numa == d.numa for n in same_host):
                continue
            msg = (
                f"{d.name} is on NUMA {d.numa} but every RDMA NIC is on NUMA "
                f"{sorted({n.numa for n in same_host})}: traffic crosses sockets."
            )
        out.append(
            Finding(
                code="nic-numa-mismatch",
                severity="warning",
                subject=d.name,
                message=msg,
                fix="Put a NIC on each socket (ideally one per GPU behind the same PCIe switch, a "
                "PIX rail), or move the GPU/NIC to matching slots; until then pin the rank's "
                "process to the NIC's NUMA node and set NCCL_IB_HCA to the nearest NIC.",
            )
        )
    return out


def _affinity_size(text: Optional[str]) -> int:
    total = 0
    for part in (text or "").split(","):
        part = part.strip()
        if re.fullmatch(r"\d+-\d+", part):
            lo, hi = map(int, part.split("-"))
            total += hi - lo + 1
        elif part.isdigit():
            total += 1
    return total


def _rule_numa_unknown(ctx: _Context) -> List[Finding]:
    gpus = [d for d in ctx.accel if d.vendor == "nvidia"]
    out = []
    # nvidia-smi prints the CPU affinity and "NUMA Affinity N/A" when the kernel has no NUMA
    # node for the device (sysfs numa_node = -1); npu-smi never prints NUMA, so Ascend is exempt.
    unknown = [d.name for d in gpus if d.numa is None and d.cpu_affinity]
    if unknown:
        out.append(
            Finding(
                code="numa-unknown",
                severity="warning",
                subject=_subject(unknown),
                message=f"NUMA node unknown (N/A) for {len(unknown)} GPU(s): the kernel does not "
                "know which socket the PCIe slots hang off, so ranks cannot be pinned near "
                "their GPU and NIC.",
                fix="Enable NUMA/ACPI SRAT in the BIOS (on AMD: NPS1/NPS4 rather than NPS0), or on "
                "a VM expose the vNUMA topology; check `cat /sys/bus/pci/devices/<bdf>/numa_node` "
                "(-1 = unknown).",
            )
        )
    known = [d for d in gpus if d.numa is not None]
    if len(known) >= 4 and all(d.numa == 0 for d in known):
        affinities = {d.cpu_affinity for d in known}
        if len(affinities) == 1 and _affinity_size(next(iter(affinities))) >= 64:
            cpus = next(iter(affinities))
            out.append(
                Finding(
                    code="numa-unknown",
                    severity="warning",
                    subject=_subject([d.name for d in known]),
                    message=f"All {len(known)} GPUs report NUMA 0 with every CPU ({cpus}) as "
                    "affinity on a box that size is almost always multi-socket: NUMA is "
                    "flattened (BIOS NPS0 / SNC off, or a VM), so GPU/NIC locality is hidden.",
                    fix="Expose NUMA (BIOS: NPS1/NPS4 on AMD, SNC/NUMA on Intel; VMs: vNUMA), then "
                    "pin each rank with `numactl --cpunodebind=<gpu numa>`; ignore if the box "
                    "really has one socket.",
                )
            )
    return out


def _rule_no_gdr(ctx: _Context) -> List[Finding]:
    if not ctx.rdma_present:
        return []
    if ctx.devices and not any(d.vendor == "nvidia" for d in ctx.devices):
        # GPUDirect RDMA concerns NVIDIA GPUs: not a CPU-only or Ascend-only host (Ascend's
        # NICs are on the NPU). Captures without devices (lsmod + ibstat) still count.
        return []
    why = []
    if ctx.facts.get("peermem") is False:
        why.append("unavailable: nvidia_peermem is not loaded or not bound to ib_core")
    gdr_values = [str(v) for v in (ctx.facts.get("nccl_gdr") or [])]
    if gdr_values and "1" not in gdr_values and "0" in gdr_values:
        why.append("unused: NCCL reports 'GDR 0' when connecting rings")
    plain = sorted(
        {
            ln.raw or ln.link_class.name
            for ln in ctx.links
            if ln.link_class in (LinkClass.NET_IB, LinkClass.NET_ROCE)
        }
    )
    if plain:
        why.append(f"unused: NCCL channels go via {_subject(plain, 3)} without /GDRDMA")
    if not why:
        return []
    nics = _subject([n.name for n in ctx.rdma_nics]) if ctx.rdma_nics else "NCCL's IB transport"
    return [
        Finding(
            code="no-gdr",
            severity="error",
            subject=nics,
            message=f"RDMA NICs are present but GPUDirect RDMA is {'; '.join(why)}: every network "
            "transfer is bounced through host memory (extra copy, lower bandwidth).",
            fix="`sudo modprobe nvidia_peermem` (in-driver since R470/CUDA 11.4; the old "
            "nv_peer_mem is deprecated) and check `lsmod | grep nvidia_peermem` shows ib_core "
            "using it, or "
            "use DMA-BUF (NCCL logs 'DMA-BUF is available'); keep GPUs and NICs within "
            "NCCL_NET_GDR_LEVEL (PXB) of each other.",
        )
    ]


def _rule_nccl_ib_disabled(ctx: _Context) -> List[Finding]:
    env = ctx.nccl_env
    network = str(ctx.facts.get("nccl_network") or "")
    socket_used = network.lower() == "socket" or any(
        ln.link_class == LinkClass.NET_SOCKET for ln in ctx.links
    )
    ib_disabled = env.get("NCCL_IB_DISABLE", "").strip().lower() in _TRUE
    if ib_disabled:
        if network and network.lower() not in ("socket", "ib") and not socket_used:
            severity, tail = (
                "info",
                f"NCCL uses '{network}' (not verbs), so IB is off on purpose here",
            )
        else:
            severity, tail = (
                "error",
                (
                    "NCCL fell back to TCP sockets (Using network Socket)"
                    if socket_used
                    else "NCCL cannot use any verbs (IB/RoCE) NIC"
                ),
            )
        message = f"NCCL_IB_DISABLE set by environment to {env['NCCL_IB_DISABLE']}: {tail}."
    elif socket_used and ctx.rdma_present:
        severity = "error"
        message = (
            "NCCL uses TCP sockets (NET/Socket) although RDMA NICs exist "
            f"({_subject([n.name for n in ctx.rdma_nics])}): the IB plugin did not load or "
            "found no usable HCA."
        )
    else:
        return []
    return [
        Finding(
            code="nccl-ib-disabled",
            severity=severity,
            subject="NCCL",
            message=message,
            fix="Unset NCCL_IB_DISABLE; check NCCL_IB_HCA names existing ports (`ibv_devinfo`), "
            "that the ports are Active, and that libibverbs/rdma-core are in the container; on AWS "
            "EFA make sure aws-ofi-nccl loads (NCCL_NET_PLUGIN).",
        )
    ]


def _rule_p2p_shm(ctx: _Context) -> List[Finding]:
    pairs = []
    for ln in ctx.links:
        if ln.link_class != LinkClass.SHM:
            continue
        da, db = ctx.topo.device(ln.a), ctx.topo.device(ln.b)
        if (
            da is None
            or db is None
            or da.name not in ctx.device_names
            or db.name not in ctx.device_names
        ):
            continue
        if da.vendor != "nvidia" or db.vendor != "nvidia":
            continue
        pairs.append((ln, da, db))
    if not pairs:
        return []
    env = ctx.nccl_env
    overrides = [f"{k}={env[k]}" for k in ("NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE") if k in env]
    p2p = ctx.facts.get("p2p") or {}
    geforce = all(_GEFORCE.search(d.model or "") for _, da, db in pairs for d in (da, db))
    gns = any(
        str(p2p.get(f"{da.name}-{db.name}", p2p.get(f"{db.name}-{da.name}", ""))).upper() == "GNS"
        for _, da, db in pairs
    )
    severity = "info" if (geforce or gns) and not overrides else "warning"
    names = [f"{ln.a}-{ln.b}" for ln, _, _ in pairs]
    cause = (
        f"set by environment: {', '.join(overrides)}"
        if overrides
        else "no NCCL_P2P_* override seen (P2P unsupported or disabled by the driver/ACS)"
    )
    return [
        Finding(
            code="nccl-p2p-shm-fallback",
            severity=severity,
            subject=_subject(names),
            message=f"{len(pairs)} GPU pair(s) exchange data via SHM (host memory) instead of "
            f"P2P/NVLink; {cause}.",
            fix="Unset NCCL_P2P_LEVEL / NCCL_P2P_DISABLE (or set NCCL_P2P_LEVEL=SYS for PCIe "
            "boxes); if P2P is really unsupported (GeForce, ACS on), disable ACS on the PCIe "
            "switches "
            "(NCCL troubleshooting: PCI ACS) or accept SHM.",
        )
    ]


def _rule_p2p_not_supported(ctx: _Context) -> List[Finding]:
    p2p = ctx.facts.get("p2p") or {}
    by_status: Dict[str, List[str]] = defaultdict(list)
    for pair, status in p2p.items():
        s = str(status).strip().upper()
        if s and s not in ("OK", "X", "-"):
            by_status[s].append(pair)
    meaning = {
        "CNS": "chipset not supported",
        "GNS": "GPU not supported",
        "TNS": "topology not supported",
        "NS": "not supported",
        "DR": "disabled by regkey",
        "U": "unknown",
    }
    out = []
    for status, pairs in sorted(by_status.items()):
        names = {n for p in pairs for n in p.split("-")}
        models = [ctx.topo.device(n).model or "" for n in names if ctx.topo.device(n) is not None]
        geforce = bool(models) and all(_GEFORCE.search(m) for m in models)
        severity = "info" if (status == "GNS" and geforce) or status == "U" else "warning"
        note = " (expected on GeForce cards)" if status == "GNS" else ""
        out.append(
            Finding(
                code="p2p-not-supported",
                severity=severity,
                subject=_subject(sorted(pairs)),
                message=f"P2P status {status} ({meaning.get(status, 'not OK')}){note} for "
                f"{len(pairs)} GPU pair(s): NCCL stages their traffic through host memory.",
                fix="For CNS/TNS: disable PCIe ACS on the switches (`setpci -s <bdf> "
                "ECAP_ACS+0x6.w=0000`) "
                "or set IOMMU to passthrough (`iommu=pt`); for DR: remove the registry key; for "
                "GNS: use data-center GPUs for P2P or accept SHM.",
            )
        )
    return out


def _rule_rdma_port_down(ctx: _Context) -> List[Finding]:
    out = []
    for n in ctx.rdma_nics:
        if n.state is None or n.state.strip().lower() in ("active", "up"):
            continue
        rate = f", rate {n.rate_gbps:g} Gb/s" if n.rate_gbps else ""
        out.append(
            Finding(
                code="rdma-port-down",
                severity="warning",
                subject=n.name,
                message=f"RDMA port {n.name} is {n.state}{rate} "
                f"({n.link_layer or 'link layer unknown'}): "
                "a rail planned over it carries nothing (any rate it shows is not live).",
                fix=f"Check the cable/transceiver and switch port (`ibstat "
                f"{n.name.split(':')[0]}`, "
                "`mlxlink`); for InfiniBand an SM must be running (`sminfo`); if the port is "
                "unused on purpose, leave it out of NCCL_IB_HCA.",
            )
        )
    return out


def _rule_fabric_manager(ctx: _Context) -> List[Finding]:
    switches = int(ctx.facts.get("nvswitch_count") or 0)
    if switches <= 0:
        return []
    state = ctx.facts.get("fabric_manager")
    if state == "running":
        return []
    known = state == "not-running"
    return [
        Finding(
            code="fabric-manager-missing",
            severity="error" if known else "info",
            subject="nvswitch",
            message=(
                f"{switches} NVSwitch device(s) present and the NVLink fabric is not up "
                "(fabric manager not running): CUDA fails with error 802 or NVLink is unusable."
                if known
                else f"{switches} NVSwitch device(s) present; the inputs do not say whether "
                "nvidia-fabricmanager is running, which NVSwitch systems need."
            ),
            fix="`systemctl enable --now nvidia-fabricmanager` with the same version as the "
            "driver; check `nvidia-smi -q | grep -A3 Fabric` shows State Completed.",
        )
    ]


def _rule_hccs_missing(ctx: _Context) -> List[Finding]:
    npus = {
        d.name: d for d in ctx.accel if d.vendor == "ascend" and canonical_model(d.model) == "910B"
    }
    bad = []
    for ln in ctx.links:
        if ln.a in npus and ln.b in npus and ln.link_class != LinkClass.HCCS:
            da, db = npus[ln.a], npus[ln.b]
            if da.host is not None and db.host is not None and da.host != db.host:
                continue
            bad.append(f"{ln.a}-{ln.b} ({ln.raw or ln.link_class.name})")
    if not bad:
        return []
    return [
        Finding(
            code="hccs-missing",
            severity="error",
            subject=_subject(bad),
            message=f"{len(bad)} Ascend 910B pair(s) are not connected by HCCS: a 910B node is a "
            f"full HCCS mesh, so these pairs run at PCIe speed or not at all.",
            fix="Check `npu-smi info -t topo` and `hccn_tool -i <npu> -link -g`; an NPU without "
            "HCCS usually means a board fault or a missing firmware/driver upgrade: reseat or RMA.",
        )
    ]


# -- entry point ----------------------------------------------------------------------------


def audit(topology: Topology, cluster: Optional["Cluster"] = None) -> List[Finding]:
    """Check ``topology`` and add the findings to ``topology.findings``.

    Args:
        topology: what was parsed/probed (may include a cluster's ranks, which are not audited
            as hardware).
        cluster: the cluster file the topology is meant to match; its SXM labels are checked
            against the observed GPUs (``pcie-not-sxm``).

    Returns:
        Every finding of the topology (those already there, e.g. from parsers, and the new
        ones), errors first. Running it twice adds nothing new.
    """
    ctx = _Context(topology, cluster)
    found: List[Finding] = []
    pcie = _rule_pcie_not_sxm(ctx)
    found += pcie
    found += _rule_nvlink_degraded(ctx, {f.subject for f in pcie})
    found += _rule_nic_numa_mismatch(ctx)
    found += _rule_numa_unknown(ctx)
    found += _rule_no_gdr(ctx)
    found += _rule_nccl_ib_disabled(ctx)
    found += _rule_p2p_shm(ctx)
    found += _rule_p2p_not_supported(ctx)
    found += _rule_rdma_port_down(ctx)
    found += _rule_fabric_manager(ctx)
    found += _rule_hccs_missing(ctx)
    seen = {(f.code, f.subject, f.message) for f in topology.findings}
    for f in found:
        if (f.code, f.subject, f.message) not in seen:
            topology.findings.append(f)
            seen.add((f.code, f.subject, f.message))
    topology.findings.sort(key=lambda f: _SEVERITY_ORDER.get(f.severity, 3))
    return list(topology.findings)


# -- (a) all-to-all estimate ----------------------------------------------------------------


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


# -- the whole report -----------------------------------------------------------------------


@dataclass
class AuditReport:
    """Everything ``hetcomm audit`` prints: topology, findings and the three answers."""

    topology: Topology
    findings: List[Finding]
    alltoall: AlltoallEstimate
    cross_vendor: CrossVendorAnswer
    measurements: List[Dict[str, object]] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        return sum(1 for f in self.findings if f.severity == "error")

    def answers_dict(self) -> Dict[str, object]:
        """The three answers as JSON-ready data (the ``answers`` key of ``audit --json``)."""
        a = self.alltoall
        return {
            "alltoall_estimate": {
                "size_bytes": a.size_bytes,
                "num_ranks": a.num_ranks,
                "time_us": a.time_us,
                "serial_time_us": a.serial_time_us,
                "bottleneck": a.bottleneck.name if a.bottleneck is not None else None,
                "algbw_gbs": a.algbw_gbs,
                "busbw_gbs": a.busbw_gbs,
                "per_class": [
                    {
                        "class": r.link_class.name,
                        "num_pairs": r.num_pairs,
                        "num_peers": r.num_peers,
                        "bytes_per_rank": r.bytes_per_rank,
                        "gbps": r.gbps,
                        "alpha_us": r.alpha_us,
                        "time_us": r.time_us,
                    }
                    for r in a.rows
                ],
                "notes": list(a.notes),
            },
            "cross_vendor": {
                "verdict": self.cross_vendor.verdict,
                "num_pairs": self.cross_vendor.num_pairs,
                "classes": dict(self.cross_vendor.classes),
                "declared": self.cross_vendor.declared,
                "message": self.cross_vendor.message,
            },
            "measurements": self.measurements,
        }


def run_audit(
    topology: Topology,
    cluster: Optional["Cluster"] = None,
    *,
    size_bytes: int = 64 << 20,
) -> AuditReport:
    """Findings plus the three answers for ``topology`` (the findings go into it too)."""
    findings = audit(topology, cluster)
    return AuditReport(
        topology=topology,
        findings=findings,
        alltoall=estimate_alltoall(topology, size_bytes, cluster=cluster),
        cross_vendor=cross_vendor_path(topology),
        measurements=measurement_rows(topology),
    )
