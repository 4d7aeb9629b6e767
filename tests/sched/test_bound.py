"""The lower bound: hand-computed values and its independence from any plan."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.sched import lower_bound, plan_all_to_all, simulate
from hetcomm.sched.traffic import uniform
from hetcomm.topo.cluster import load_cluster
from tests.sched.clusters import BIG, MINI, cluster_yaml, load


def test_bound_of_the_big_cluster_is_the_ascend_bridge():
    big = load_cluster(BIG)
    T = uniform(80, 64 << 20)
    b = lower_bound(big, T)
    # 16 Ascend ranks (64..79) each send 64/80 of 64 MiB to the 64 NVIDIA ranks, through two
    # 200 Gb/s bridges, after the 30 us bridge latency
    nbytes = int(T[64:, :64].sum())
    assert abs(nbytes - 16 * 64 * (64 << 20) / 80) < 16 * 64
    assert b.binding.name == "ascend island -> nvidia (bridge egress)"
    assert b.binding.num_bytes == nbytes
    assert b.time_s == pytest.approx(30e-6 + nbytes / 50e9)


def test_bound_of_a_skewed_receiver_is_its_device_ingress():
    c = load(cluster_yaml([{"name": "n", "model": "H800", "devices": 4, "fabric_gbps": 800}]))
    T = np.zeros((4, 4), int)
    T[:, 2] = 10**9
    b = lower_bound(c, T)
    # 3 GB into rank 2 over its 800 Gb/s fabric port (one node: no PCIe to the network)
    assert b.binding.name == "rank2 device ingress"
    assert b.time_s == pytest.approx(3e9 / 100e9 + 3e-6)


def test_bound_is_the_same_for_every_plan_and_below_each(tmp_path):
    mini = load_cluster(MINI)
    T = uniform(4, 8 << 20)
    b = lower_bound(mini, T)
    for strategy in ("flat", "hier", "multirail", "auto"):
        assert simulate(plan_all_to_all(mini, T, strategy), mini).time_s >= b.time_s
    assert lower_bound(mini, np.zeros((4, 4), int)).time_s == 0
