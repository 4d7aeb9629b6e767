"""The audit: what is wrong with a topology, and what a buyer of the cluster should expect.

:func:`audit` checks a :class:`~hetcomm.topo.model.Topology` (parsed tool output, a live probe,
a cluster file, or all merged) against the misconfiguration signatures of topology-notes §6 and
returns :class:`~hetcomm.topo.model.Finding` objects with stable codes (:data:`FINDING_CODES`).
Rules look only at *observed* evidence: devices that are labels (``label_only``) and links a
cluster YAML declares (``source == "cluster"``) are claims, used to compare against, never
audited as hardware.

The module is the audit's face: the finding table is :mod:`hetcomm.topo.findings`, the
topology rules :mod:`hetcomm.topo.rules`, the measurement and version rules
:mod:`hetcomm.topo.rules_measured`, the three answers :mod:`hetcomm.topo.estimate`; their public
names are re-exported here.

Three questions are answered beside the findings (:mod:`hetcomm.topo.estimate` has the model):
(a) the expected all-to-all time per link class, (b) whether NVIDIA <-> Ascend traffic moves by
GPUDirect RDMA or is staged through host memory, (c) the measured nccl-tests table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from hetcomm.units import format_bytes, parse_size  # re-exported: the one size parser/formatter
from hetcomm.topo.estimate import (
    AlltoallEstimate,
    ClassEstimate,
    CrossVendorAnswer,
    cross_vendor_path,
    estimate_alltoall,
    measurement_rows,
)
from hetcomm.topo.findings import FINDING_CODES, SEVERITY_ORDER, FindingSpec
from hetcomm.topo.linkcost import LATENCY_US
from hetcomm.topo.model import Finding, LinkClass, Topology
from hetcomm.topo.rules import RuleContext, topology_rules
from hetcomm.topo.rules_measured import measured_rules

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.topo.cluster import Cluster

__all__ = [
    "FINDING_CODES",
    "FindingSpec",
    "ALPHA_US",
    "LATENCY_US",
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

#: The per-class latencies of the α term (kept under its old name; see :mod:`hetcomm.topo.linkcost`).
ALPHA_US: Dict[LinkClass, float] = LATENCY_US


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
    ctx = RuleContext(topology, cluster)
    found: List[Finding] = topology_rules(ctx)
    found += measured_rules(ctx)
    seen = {(f.code, f.subject, f.message) for f in topology.findings}
    for f in found:
        if (f.code, f.subject, f.message) not in seen:
            topology.findings.append(f)
            seen.add((f.code, f.subject, f.message))
    topology.findings.sort(key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    return list(topology.findings)


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
                "model": a.model,
                "alpha_beta_time_us": a.alpha_beta_time_us,
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

