"""The audit's topology rules: misconfiguration signatures of topology-notes §6.

Each rule reads a :class:`RuleContext` (what is observed, what a cluster file only declares)
and returns :class:`~hetcomm.topo.model.Finding` objects whose codes are in
:data:`~hetcomm.topo.findings.FINDING_CODES`. Rules look only at *observed* evidence: devices
that are labels (``label_only``) and links a cluster YAML declares (``source == "cluster"``)
are claims, used to compare against, never audited as hardware. The rules that compare
measurements and software versions with expectations are in :mod:`hetcomm.topo.rules_measured`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

from hetcomm.topo.bandwidth import canonical_model, is_sxm_model, nvlink_links_for_model
from hetcomm.topo.model import Device, Finding, Link, LinkClass, Nic, Topology
from hetcomm.topo.pci_ids import NVIDIA_GPU_IDS

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.topo.cluster import Cluster

__all__ = ["RuleContext", "topology_rules", "subject_of"]

# Names of verbs (RDMA) devices; a bare netdev (eth0, ens32) is not one. EFA is libfabric,
# not verbs RDMA as NCCL's IB transport sees it, so it is left out.
_RDMA_NAME = re.compile(
    r"^(mlx\d+_|irdma|bnxt_re|rxe|siw|qedr|hns_?\d|hns_roce|erdma|ionic|cxgb|NIC\d)"
)
_GEFORCE = re.compile(r"RTX|GEFORCE|GTX|TITAN", re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")


# -- context --------------------------------------------------------------------------------


class RuleContext:
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


def _rule_pcie_not_sxm(ctx: RuleContext) -> List[Finding]:
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


def _rule_nvlink_degraded(ctx: RuleContext, skip: Set[str]) -> List[Finding]:
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


def _rule_nic_numa_mismatch(ctx: RuleContext) -> List[Finding]:
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


def _rule_numa_unknown(ctx: RuleContext) -> List[Finding]:
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


def _rule_no_gdr(ctx: RuleContext) -> List[Finding]:
    plugin_off = [str(m) for m in (ctx.facts.get("nccl_gdr_off") or [])]
    if not ctx.rdma_present and not plugin_off:
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
    if plugin_off:
        # aws-ofi-nccl / libfabric: the plugin turns GDR off itself and says so.
        why.append(f"off: the network plugin says '{plugin_off[0]}'")
    if not why:
        return []
    ofi = [n.name for n in ctx.nics if n.name.split("@")[0].startswith("ofi")]
    nics = (
        _subject([n.name for n in ctx.rdma_nics])
        if ctx.rdma_nics
        else _subject(ofi) if ofi else "NCCL's network transport"
    )
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
            "NCCL_NET_GDR_LEVEL (PXB) of each other. On EFA (aws-ofi-nccl): GDR needs an "
            "RDMA-capable instance (p4d/p5: `fi_info -p efa -v | grep FI_HMEM`), "
            "FI_EFA_USE_DEVICE_RDMA=1 and a current aws-ofi-nccl/EFA installer.",
        )
    ]


def _rule_nccl_ib_disabled(ctx: RuleContext) -> List[Finding]:
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


def _rule_p2p_shm(ctx: RuleContext) -> List[Finding]:
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


def _rule_p2p_not_supported(ctx: RuleContext) -> List[Finding]:
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


def _rule_rdma_port_down(ctx: RuleContext) -> List[Finding]:
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


def _rule_fabric_manager(ctx: RuleContext) -> List[Finding]:
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


def _rule_hccs_missing(ctx: RuleContext) -> List[Finding]:
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


_Context = RuleContext  # the name the rules were written with
subject_of = _subject


def topology_rules(ctx: RuleContext) -> List[Finding]:
    """Every topology rule's findings, in the order they are reported."""
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
    return found
