"""One table of per-link-class latency and per-message overhead, for every time hetcomm predicts.

``hetcomm audit``'s α–β estimate (:mod:`hetcomm.topo.estimate`) and the scheduler's cost model
behind ``hetcomm simulate`` (:mod:`hetcomm.sched.cost`) both read these figures, so one cluster
and one size get one prediction (``tests/sched/test_audit_simulate_agree.py``). Bandwidths come
from :mod:`hetcomm.topo.bandwidth` (nominal rates by model and link), likewise shared.

Latency (alpha) is per message, microseconds: order-of-magnitude figures for a large-message
protocol (one-way time to first byte, including software launch): device fabrics a few µs, RDMA
with GPUDirect under 10 µs, host-bounced paths more, TCP tens of µs (NCCL's tuning tables use
base latencies in the same ranges). They are assumptions, not measurements: calibrate with
``hetcomm bench`` output (``hetcomm simulate --calibrate``). ``HOST_BRIDGE`` takes a cluster's
own ``interconnect.cross_vendor.latency_us`` where one is given.

Overhead is the per-message occupancy (LogGP's gap) on every resource a message crosses:
posting a work request, launching a copy. Host-staged paths (SHM, non-GDR NICs, the cross-vendor
bridge) need a device<->host copy per message driven by a host proxy, hence more.
"""

from __future__ import annotations

from typing import Dict

from hetcomm.topo.model import LinkClass

__all__ = ["LATENCY_US", "OVERHEAD_US", "UNKNOWN_LATENCY_US", "UNKNOWN_OVERHEAD_US", "latency_us"]

#: Start-up latency per message by link class, microseconds.
LATENCY_US: Dict[LinkClass, float] = {
    LinkClass.NVLINK: 3.0,
    LinkClass.HCCS: 4.0,
    LinkClass.PCIE_PIX: 5.0,
    LinkClass.PCIE_PXB: 5.0,
    LinkClass.PCIE_PHB: 6.0,
    LinkClass.PCIE_NODE: 6.0,
    LinkClass.PCIE_SYS: 8.0,
    LinkClass.P2P: 5.0,
    LinkClass.SHM: 8.0,
    LinkClass.NET_IB_GDR: 6.0,
    LinkClass.NET_IB: 9.0,
    LinkClass.NET_ROCE_GDR: 8.0,
    LinkClass.NET_ROCE: 11.0,
    LinkClass.NET_EFA: 15.0,
    LinkClass.NET_SOCKET: 50.0,
    LinkClass.HOST_BRIDGE: 30.0,
}

#: Per-message occupancy on every resource of the path, microseconds.
OVERHEAD_US: Dict[LinkClass, float] = {
    LinkClass.NVLINK: 1.0,
    LinkClass.HCCS: 1.0,
    LinkClass.PCIE_PIX: 2.0,
    LinkClass.PCIE_PXB: 2.0,
    LinkClass.PCIE_PHB: 2.0,
    LinkClass.PCIE_NODE: 2.0,
    LinkClass.PCIE_SYS: 2.0,
    LinkClass.P2P: 2.0,
    LinkClass.SHM: 4.0,
    LinkClass.NET_IB_GDR: 2.0,
    LinkClass.NET_IB: 4.0,
    LinkClass.NET_ROCE_GDR: 2.0,
    LinkClass.NET_ROCE: 4.0,
    LinkClass.NET_EFA: 4.0,
    LinkClass.NET_SOCKET: 10.0,
    LinkClass.HOST_BRIDGE: 10.0,
}

#: For a class missing above (``UNKNOWN``): as slow as a socket.
UNKNOWN_LATENCY_US = 50.0
UNKNOWN_OVERHEAD_US = 10.0


def latency_us(link_class: LinkClass) -> float:
    """The latency of ``link_class`` in microseconds (:data:`UNKNOWN_LATENCY_US` if unlisted)."""
    return LATENCY_US.get(link_class, UNKNOWN_LATENCY_US)
