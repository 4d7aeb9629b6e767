"""The audit's rules that compare what was measured and installed with what was expected.

``bandwidth-shortfall``: a machine whose topology looks right and whose bandwidth
is not. For each measured run (nccl-tests or ``hetcomm bench`` rows), the out-of-place bus
bandwidth at the largest measured size is compared with the nominal per-rank bandwidth of the
link class that bounds it: one node, the slowest accelerator-to-accelerator class observed (an
``nvidia-smi topo -m`` in the inputs) or else the model's own (SXM parts: NVLink; others: PCIe);
several nodes, the network (the NICs' rates when the inputs name them; without rates the run is
not judged). Below 70 % of nominal for NVLink/NVSwitch/HCCS, 60 % for PCIe and the network, the
finding names measured and expected numbers and the likely causes in order, each with the
command that confirms it. For an all-to-all it also gives the expected and measured time at
that size (the notes' alarm: an all-to-all far slower than its topology predicts).

``known-bad-version``: a driver or CANN release in :data:`KNOWN_BAD_VERSIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from hetcomm.topo.bandwidth import is_sxm_model, nominal_gbps
from hetcomm.topo.model import Finding, LinkClass, Measurement
from hetcomm.topo.rules import RuleContext

__all__ = ["measured_rules", "SHORTFALL_THRESHOLDS", "KNOWN_BAD_VERSIONS", "KnownBadVersion"]

#: Fraction of nominal below which a class is short.
SHORTFALL_THRESHOLDS: Dict[str, float] = {"fabric": 0.70, "pcie": 0.60, "network": 0.60}

_CAUSES: Dict[str, List[Tuple[str, str]]] = {
    "fabric": [
        ("a PCIe card where an SXM part was expected", "nvidia-smi --query-gpu=name,power.limit --format=csv"),
        ("a degraded NVLink (links down or missing)", "nvidia-smi nvlink -s"),
        ("NVSwitch / fabric manager not serving the GPUs", "systemctl status nvidia-fabricmanager; nvidia-smi -q | grep -A2 Fabric"),
        ("GPUs not running at full clocks or power", "nvidia-smi -q -d CLOCK,POWER"),
    ],
    "pcie": [
        ("a PCIe card where an SXM part was expected", "nvidia-smi --query-gpu=name,power.limit --format=csv"),
        ("SR-IOV / ACS / IOMMU settings forcing P2P through the root complex", "nvidia-smi topo -p2p r; lspci -vvv | grep -i acsctl; cat /proc/cmdline"),
        ("a link trained below x16 or below its generation", "nvidia-smi -q | grep -A3 'Link Width'; lspci -vv | grep LnkSta"),
        ("NUMA placement: GPUs behind different sockets", "nvidia-smi topo -m"),
    ],
    "network": [
        ("GPUDirect RDMA off (traffic bounced through host memory)", "lsmod | grep nvidia_peermem; NCCL_DEBUG=INFO (look for /GDRDMA)"),
        ("NICs on the wrong NUMA node for their GPUs", "nvidia-smi topo -m"),
        ("a port down or trained below its rate", "ibstat; ibv_devinfo"),
        ("SR-IOV / ACS / IOMMU settings on the NIC path", "lspci -vvv | grep -i acsctl; cat /proc/cmdline"),
    ],
}


@dataclass(frozen=True)
class KnownBadVersion:
    """A software release that cost real clusters.

    Attributes:
        component: ``nvidia-driver`` or ``cann``.
        version: the bad release as the tools print it.
        fixed_in: the release that fixed it.
        problem: what goes wrong.
        source: where it is documented.
    """

    component: str
    version: str
    fixed_in: str
    problem: str
    source: str


KNOWN_BAD_VERSIONS: Tuple[KnownBadVersion, ...] = (
    KnownBadVersion(
        "nvidia-driver",
        "470.82.01",
        "470.129.06",
        "a driver release the heterogeneous all-to-all notes name as costing real clusters",
        "hetcomm issue #22 (the heterogeneous all-to-all notes: 470.82.01, fixed in 470.129.06)",
    ),
    KnownBadVersion(
        "cann",
        "7.0.RC1",
        "7.0.RC2",
        "BF16 dsd_copy precision bug: BF16 tensors copied between chips lose precision (the "
        "reason hetcomm's cross-vendor wire rule sends FP16, not BF16)",
        "hetcomm issue #22 (the heterogeneous all-to-all notes: CANN 7.0.RC1 BF16 dsd_copy, fixed in 7.0.RC2)",
    ),
)

_VERSION_FACTS = {"nvidia-driver": "nvidia_driver_version", "cann": "cann_version"}


def _rank_of(name: str) -> Optional[int]:
    return int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else None


def _expectation(ctx: RuleContext, run: List[Measurement]) -> Optional[Tuple[str, LinkClass, float, int]]:
    """(kind, class, nominal GB/s per rank, nodes) bounding ``run``, or None when unknown."""
    n = run[0].num_ranks or 0
    ranks = [d for d in ctx.devices if _rank_of(d.name) is not None and _rank_of(d.name) < n]
    hosts = {d.host for d in ranks if d.host}
    model = next((d.model for d in ranks if d.model), None)
    if len(hosts) > 1:
        rates = [nic.rate_gbps for nic in ctx.nics if nic.rate_gbps]
        if not rates:
            return None
        per_node = len(ranks) / len(hosts)
        share = min(sum(rates) / max(len({nic.host for nic in ctx.nics}), 1) / per_node, min(rates))
        # an all-to-all over N nodes: a rank's traffic to the other nodes is (N-1)/N of it
        nodes = len(hosts)
        return "network", LinkClass.NET_IB_GDR, share / 8 * nodes / (nodes - 1), nodes
    accel = [ln for ln in ctx.links if ln.a in ctx.device_names and ln.b in ctx.device_names
             and not ln.link_class.is_network and ln.gbps]
    if accel:
        slowest = min(accel, key=lambda ln: ln.gbps)
        cls = slowest.link_class
        kind = "fabric" if cls in (LinkClass.NVLINK, LinkClass.HCCS) else "pcie"
        return kind, cls, slowest.gbps / 8, 1
    if model is None:
        return None
    cls = LinkClass.NVLINK if is_sxm_model(model) else LinkClass.PCIE_PXB
    g = nominal_gbps(cls, model)
    if g is None:
        return None
    return ("fabric" if cls == LinkClass.NVLINK else "pcie"), cls, g / 8, 1


def _rule_bandwidth_shortfall(ctx: RuleContext) -> List[Finding]:
    runs: Dict[Tuple[str, Optional[int], Optional[str]], List[Measurement]] = {}
    for m in ctx.topo.measurements:
        if not m.in_place and m.busbw_gbps is not None:
            runs.setdefault((m.op, m.num_ranks, m.source), []).append(m)
    out = []
    for (op, num_ranks, _source), rows in sorted(runs.items(), key=lambda kv: str(kv[0])):
        if not num_ranks or num_ranks < 2:
            continue
        exp = _expectation(ctx, rows)
        if exp is None:
            continue
        kind, cls, nominal, nodes = exp
        if nodes > 1 and op != "alltoall":
            continue  # multi-node allreduce & co: the bound depends on the algorithm
        top = max(rows, key=lambda m: m.size_bytes)
        ratio = top.busbw_gbps / nominal
        if ratio >= SHORTFALL_THRESHOLDS[kind]:
            continue
        causes = "; ".join(f"{i}. {c} (check: `{cmd}`)" for i, (c, cmd) in enumerate(_CAUSES[kind], 1))
        timing = ""
        if op == "alltoall":
            expected_us = top.size_bytes * (num_ranks - 1) / num_ranks / (nominal * 1e9) * 1e6
            timing = f" At this size an all-to-all should take about {expected_us:,.0f} us; it took {top.time_us:,.0f} us."
        out.append(
            Finding(
                code="bandwidth-shortfall",
                severity="error" if ratio < 0.5 * SHORTFALL_THRESHOLDS[kind] else "warning",
                subject=f"{op}, {num_ranks} ranks, {cls.name}",
                message=f"measured bus bandwidth {top.busbw_gbps:.2f} GB/s at {top.size_bytes} B is "
                f"{ratio:.0%} of the nominal {nominal:.1f} GB/s per rank over {cls.name} (threshold "
                f"{SHORTFALL_THRESHOLDS[kind]:.0%}).{timing}",
                fix=f"Likely causes, most likely first: {causes}.",
            )
        )
    return out


def _version_key(v: str) -> str:
    return v.strip().lower()


def _rule_known_bad_version(ctx: RuleContext) -> List[Finding]:
    out = []
    for entry in KNOWN_BAD_VERSIONS:
        seen = ctx.facts.get(_VERSION_FACTS[entry.component])
        if seen and _version_key(str(seen)) == _version_key(entry.version):
            out.append(
                Finding(
                    code="known-bad-version",
                    severity="error",
                    subject=f"{entry.component} {entry.version}",
                    message=f"{entry.component} {entry.version}: {entry.problem} (source: {entry.source}).",
                    fix=f"Upgrade to {entry.fixed_in} or later.",
                )
            )
    return out


def measured_rules(ctx: RuleContext) -> List[Finding]:
    """Findings of the measurement and version rules."""
    return _rule_bandwidth_shortfall(ctx) + _rule_known_bad_version(ctx)
