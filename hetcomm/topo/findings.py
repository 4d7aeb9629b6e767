"""The audit's finding codes: what each means, how severe it usually is (docs/TOPOLOGY.md).

One table, :data:`FINDING_CODES`, read by the rules (:mod:`hetcomm.topo.rules`,
:mod:`hetcomm.topo.rules_measured`), the renderer and ``hetcomm doctor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

__all__ = ["FindingSpec", "FINDING_CODES", "SEVERITY_ORDER"]


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
        FindingSpec(
            "bandwidth-shortfall",
            "warning",
            "measured bus bandwidth far below the link class's nominal",
            "The topology looks right but a measured run (nccl-tests, hetcomm bench) reaches less "
            "than 70 % (NVLink/NVSwitch/HCCS) or 60 % (PCIe, network) of the nominal bandwidth at its "
            "largest size: a PCIe card sold as SXM, SR-IOV/ACS/IOMMU settings, a degraded NVLink, "
            "NUMA placement or GDR off. Every collective on this machine runs that much slower.",
        ),
        FindingSpec(
            "known-bad-version",
            "error",
            "a driver or CANN release known to be bad",
            "The NVIDIA driver or the CANN toolkit is a release listed in "
            "hetcomm.topo.rules_measured.KNOWN_BAD_VERSIONS (each entry names its source).",
        ),
    )
}

#: Sort order of severities (errors first).
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
