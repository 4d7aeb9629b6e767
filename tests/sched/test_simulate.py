"""The simulator on plans small enough to time by hand."""

from __future__ import annotations

import pytest

from hetcomm.sched import CostParams, simulate
from hetcomm.sched.plan import Plan, Transfer
from hetcomm.topo.model import LinkClass
from tests.sched.clusters import cluster_yaml, load

TWO_NODES = cluster_yaml([
    {"name": "n", "count": 2, "model": "H800", "devices": 2, "fabric_gbps": 1600,
     "nics": [{"class": "NET_IB_GDR", "gbps": 200, "count": 1}]},
])
NO_GAP = CostParams.make(overhead_us={"NVLINK": 0, "NET_IB_GDR": 0}, latency_us={"NVLINK": 1, "NET_IB_GDR": 5})


def test_one_message_is_latency_plus_bytes_over_the_slowest_resource():
    c = load(TWO_NODES)
    T = [[0, 0, 10**8, 0], [0] * 4, [0] * 4, [0] * 4]
    plan = Plan("flat", T, [Transfer(0, 0, 2, 0, 2, 0, 10**8, LinkClass.NET_IB_GDR)])
    sim = simulate(plan, c, NO_GAP)
    # the 200 Gb/s port (25 GB/s) is slower than PCIe Gen5 and the uplink
    assert sim.time_s == pytest.approx(5e-6 + 10**8 / 25e9)
    assert sim.busiest[0] in ("n-0/nic0 tx", "n-1/nic0 rx", "n-0 uplink out", "n-1 uplink in")
    # with the default per-message occupancy, a bit more
    with_gap = CostParams.make(latency_us={"NET_IB_GDR": 5})
    assert simulate(plan, c, with_gap).time_s == pytest.approx(sim.time_s + 2e-6)


def test_messages_sharing_a_port_split_it_and_stages_follow_dependencies():
    c = load(TWO_NODES)
    T = [[0, 0, 10**8, 10**8], [0] * 4, [0] * 4, [0] * 4]
    flat = Plan("flat", T, [
        Transfer(0, 0, 2, 0, 2, 0, 10**8, LinkClass.NET_IB_GDR),
        Transfer(1, 0, 3, 0, 3, 0, 10**8, LinkClass.NET_IB_GDR),
    ])
    assert simulate(flat, c, NO_GAP).time_s == pytest.approx(5e-6 + 2e8 / 25e9)
    # the same bytes as one message to rank 2, which passes rank 3's share on over NVLink
    hier = Plan("hier", T, [
        Transfer(0, 0, 2, 0, 2, 0, 10**8, LinkClass.NET_IB_GDR),
        Transfer(1, 0, 2, 0, 3, 0, 10**8, LinkClass.NET_IB_GDR),
        Transfer(2, 2, 3, 0, 3, 0, 10**8, LinkClass.NVLINK, stage=1, deps=(1,)),
    ])
    hier.check()
    sim = simulate(hier, c, NO_GAP)
    first = 5e-6 + 2e8 / 25e9
    # stage 1: NVLink 1600 Gb/s and the copy out of the staging buffer (H800: 3350/2 GB/s)
    second = 1e-6 + max(1e8 / 200e9, 1e8 / 1675e9)
    assert sim.stage_end_s == pytest.approx((first, first + second))
    assert sim.time_s == pytest.approx(first + second)
    assert sim.num_messages == 2 and sim.bytes_by_class == {"NET_IB_GDR": 2 * 10**8, "NVLINK": 10**8}
