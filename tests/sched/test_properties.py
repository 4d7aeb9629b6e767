"""Properties on random clusters and traffic: exactly-once delivery, bound <= time, monotonicity."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetcomm.sched import CostParams, lower_bound, plan_all_to_all, simulate
from hetcomm.sched.planner import PLAN_CHOICES
from tests.sched.clusters import cluster_specs, cluster_yaml, load, traffic_for

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_every_plan_delivers_every_byte_once_and_never_beats_the_bound(data):
    spec = data.draw(cluster_specs())
    cluster = load(cluster_yaml(**spec))
    T = data.draw(traffic_for(cluster.num_ranks))
    align = data.draw(st.sampled_from([1, 1, 4]))
    bound = lower_bound(cluster, T)
    for strategy in PLAN_CHOICES:
        plan = plan_all_to_all(cluster, T, strategy, align_bytes=align)
        plan.check()
        sim = simulate(plan, cluster)
        # 1e-12: the bound and the simulator add the same floats in different orders
        assert sim.time_s >= bound.time_s * (1 - 1e-9) - 1e-12, (strategy, sim.time_s, bound)
        if strategy != "flat" and plan.strategy != "flat":
            assert plan.num_stages <= 4  # gather, exchange, network scatter, bridge scatter


def _faster(spec, what):
    spec = copy.deepcopy(spec)
    if what == "bridge":
        spec["bridge_gbps"] *= 4
    for g in spec["groups"]:
        if what == "nic":
            for nic in g["nics"]:
                nic["gbps"] *= 2
        elif what == "fabric":
            g["fabric_gbps"] = (g.get("fabric_gbps") or 100) * 3 if g.get("fabric_gbps") else 4800
    return spec


@SETTINGS
@given(data=st.data(), what=st.sampled_from(["nic", "fabric", "bridge", "params"]))
def test_adding_bandwidth_never_makes_a_plan_slower(data, what):
    spec = data.draw(cluster_specs())
    slow = load(cluster_yaml(**spec))
    T = data.draw(traffic_for(slow.num_ranks))
    if what == "params":
        fast = slow
        slow_params = CostParams()
        fast_params = CostParams(pcie_gbps=2048.0, sys_gbps=1024.0, copy_gbps=50000.0)
    else:
        fast = load(cluster_yaml(**_faster(spec, what)))
        slow_params = fast_params = CostParams()
    for strategy in ("flat", "hier", "multirail"):
        plan = plan_all_to_all(slow, T, strategy)
        t_slow = simulate(plan, slow, slow_params).time_s
        t_fast = simulate(plan, fast, fast_params).time_s
        assert t_fast <= t_slow * (1 + 1e-12), (strategy, what, t_slow, t_fast)


@SETTINGS
@given(data=st.data())
def test_planning_is_deterministic(data):
    spec = data.draw(cluster_specs())
    text = cluster_yaml(**spec)
    T = data.draw(traffic_for(load(text).num_ranks))
    for strategy in PLAN_CHOICES:
        # separately loaded clusters, as separate ranks would load them
        a = plan_all_to_all(load(text), T, strategy).table
        b = plan_all_to_all(load(text), T, strategy).table
        for name in ("src", "dst", "origin", "final_dst", "offset_bytes", "num_bytes", "stage", "rail", "dep_idx"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), (strategy, name)
        assert a.rail_names == b.rail_names
