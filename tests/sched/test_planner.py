"""The strategies: structure of flat / hier / multirail / auto plans, options and errors."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from hetcomm.errors import UsageError
from hetcomm.sched import plan_all_to_all, simulate
from hetcomm.sched.cost import resource_model
from hetcomm.sched.planner import STRATEGIES
from hetcomm.sched.traffic import uniform, zipf
from hetcomm.topo.cluster import load_cluster
from hetcomm.topo.model import LinkClass
from tests.sched.clusters import BIG, MINI, cluster_yaml, load


@pytest.fixture(scope="module")
def big():
    return load_cluster(BIG)


@pytest.fixture(scope="module")
def mini():
    return load_cluster(MINI)


def replay(plan):
    """Move real bytes as the plan says, stage by stage, and return each rank's output."""
    T = plan.traffic_matrix
    n = plan.num_ranks
    rng = np.random.default_rng(0)
    seg = {(i, j): rng.integers(0, 256, int(T[i, j]), dtype=np.uint8) for i in range(n) for j in range(n) if i != j}
    held = {}  # (rank, transfer index) -> bytes it holds after receiving that chunk
    out = defaultdict(dict)
    for s in range(plan.num_stages):
        for t in plan.stage(s):
            if t.src == t.origin:
                data = seg[(t.origin, t.final_dst)][t.offset_bytes : t.offset_bytes + t.num_bytes]
            else:
                dep = next(d for d in t.deps if (t.src, d) in held)
                have = plan.transfers[dep]
                lo = t.offset_bytes - have.offset_bytes
                data = held[(t.src, dep)][lo : lo + t.num_bytes]
            held[(t.dst, t.index)] = data.copy()
            if t.dst == t.final_dst:
                out[(t.origin, t.final_dst)][t.offset_bytes] = data
    for (i, j), want in seg.items():
        parts = out.get((i, j), {})
        got = np.concatenate([parts[k] for k in sorted(parts)]) if parts else np.zeros(0, np.uint8)
        assert np.array_equal(got, want), f"segment {i}->{j} differs"


def test_flat_is_every_pair_direct_in_one_stage(mini):
    T = uniform(4, 4000)
    plan = plan_all_to_all(mini, T, "flat")
    plan.check()
    assert plan.num_stages == 1 and plan.num_transfers == 12
    for t in plan.transfers:
        assert (t.src, t.dst) == (t.origin, t.final_dst)
        assert t.link_class == mini.link_class(t.src, t.dst)
    replay(plan)


@pytest.mark.parametrize("strategy", ["hier", "multirail", "auto"])
def test_staged_plans_move_the_same_bytes_as_flat_on_the_mini_cluster(mini, strategy):
    T = np.array([[0, 1000, 17, 3], [5, 0, 999, 0], [64, 1, 0, 77], [0, 2, 300, 5]])
    plan = plan_all_to_all(mini, T, strategy)
    plan.check()
    replay(plan)


def test_hier_aggregates_one_lane_per_node_pair_over_three_tiers(big):
    plan = plan_all_to_all(big, uniform(80, 8 << 20), "hier")
    plan.check()
    model = resource_model(big)
    node = model.rank_node
    msgs = plan.messages
    x = msgs.stage == 1
    # gather, exchange, scatter of network lanes, scatter of bridge lanes
    assert plan.num_stages == 4
    assert (node[msgs.src[x]] != node[msgs.dst[x]]).all()
    assert (node[msgs.src[~x]] == node[msgs.dst[~x]]).all()
    cross = resource_model(big).is_cross_vendor
    s2, s3 = plan.table.stage == 2, plan.table.stage == 3
    dep = plan.table.dep_idx  # one dependency per forwarded chunk: the lane that brought it
    fwd_of = np.full(plan.num_transfers, -1)
    fwd_of[np.repeat(np.arange(plan.num_transfers), np.diff(plan.table.dep_ptr))] = dep
    lanes = fwd_of[s2 | s3]
    lane_cross = cross(plan.table.src[lanes], plan.table.dst[lanes])
    assert (lane_cross == s3[s2 | s3]).all()
    # one exchange message per ordered node pair, 10 nodes
    assert x.sum() == 90
    classes = {LinkClass(c).name for c in plan.table.link_class[plan.table.stage == 1].tolist()}
    assert classes == {"NET_ROCE_GDR", "HOST_BRIDGE"}
    for t in plan.stage(1)[:200]:
        assert t.link_class == big.link_class(t.src, t.dst)


def test_hier_handles_uneven_nodes_and_cross_vendor_pairs():
    c = load(cluster_yaml([
        {"name": "a", "model": "A100-SXM4-80GB", "devices": 3, "nics": [{"class": "NET_IB_GDR", "gbps": 200, "count": 1}]},
        {"name": "b", "model": "H800", "devices": 1, "count": 2, "nics": [{"class": "NET_IB_GDR", "gbps": 200, "count": 2}]},
        {"name": "c", "model": "910B", "devices": 2},
        {"name": "d", "model": "cpu", "devices": 1},
    ]))
    T = zipf(c.num_ranks, 10007, 1.2, seed=1)
    for strategy in STRATEGIES:
        plan = plan_all_to_all(c, T, strategy)
        plan.check()
        replay(plan)


def test_multirail_stripes_by_port_rate_through_the_nearest_device():
    c = load(cluster_yaml([
        {"name": "n", "count": 2, "model": "H800", "devices": 4, "numa_nodes": 2,
         "nics": [{"class": "NET_ROCE_GDR", "gbps": 100, "count": 2, "numa": [0, 1]},
                  {"class": "NET_ROCE_GDR", "gbps": 200, "count": 1, "numa": [1]}]},
    ]))
    plan = plan_all_to_all(c, uniform(8, 8 << 20), "multirail")
    plan.check()
    tb = plan.table
    x = tb.stage == 1
    per_rail = defaultdict(int)
    senders = defaultdict(set)
    for r, s, b in zip(tb.rail[x].tolist(), tb.src[x].tolist(), tb.num_bytes[x].tolist()):
        per_rail[tb.rail_names[r]] += b
        senders[tb.rail_names[r]].add(s % 4)
    total = sum(per_rail.values())
    # ports 100, 100, 200 Gb/s: a quarter, a quarter, a half of the bytes
    assert abs(per_rail["nic0"] / total - 0.25) < 1e-6
    assert abs(per_rail["nic1"] / total - 0.25) < 1e-6
    assert abs(per_rail["nic2"] / total - 0.5) < 1e-6
    # nic0 sits on NUMA 0 (devices 0,1), nic1 and nic2 on NUMA 1 (devices 2,3)
    assert senders == {"nic0": {0}, "nic1": {2}, "nic2": {3}}


def test_multirail_uses_every_port_of_the_big_cluster(big):
    plan = plan_all_to_all(big, uniform(80, 8 << 20), "multirail")
    tb = plan.table
    net = (tb.stage == 1) & (tb.link_class == int(LinkClass.NET_ROCE_GDR))
    assert set(tb.rail_names) == {f"nic{k}" for k in range(8)}
    # forwarder of nicK is local device K (ports and devices 4 per NUMA node)
    for r, s in set(zip(tb.rail[net].tolist(), tb.src[net].tolist())):
        assert tb.rail_names[r] == f"nic{s % 8}"


def test_auto_picks_the_fastest_and_says_why(big):
    T = uniform(80, 1 << 20)
    plan = plan_all_to_all(big, T, "auto")
    plan.check()
    times = {s: simulate(plan_all_to_all(big, T, s), big).time_s for s in STRATEGIES}
    assert plan.strategy == min(times, key=times.get)
    assert plan.notes[0].startswith(f"auto: chose {plan.strategy}")
    assert "flat" in plan.notes[0] and "receive skew" in plan.notes[0]


def test_align_bytes_keeps_cuts_on_element_boundaries(big):
    T = uniform(80, 4 * 100003, align_bytes=4)
    for strategy in ("hier", "multirail"):
        tb = plan_all_to_all(big, T, strategy, align_bytes=4).table
        assert (tb.offset_bytes % 4 == 0).all() and (tb.num_bytes % 4 == 0).all()


def test_bad_input_is_a_usage_error(mini):
    good = uniform(4, 100)
    with pytest.raises(UsageError, match="must be 4 x 4"):
        plan_all_to_all(mini, uniform(3, 100))
    with pytest.raises(UsageError, match=r"traffic\[0\]\[1\] = -5"):
        plan_all_to_all(mini, [[0, -5, 0, 0]] + [[0] * 4] * 3)
    with pytest.raises(UsageError, match="unknown plan strategy 'ring'"):
        plan_all_to_all(mini, good, "ring")
    with pytest.raises(UsageError, match="unknown option 'chunk'"):
        plan_all_to_all(mini, good, chunk=3)
    with pytest.raises(UsageError, match="align_bytes"):
        plan_all_to_all(mini, good, align_bytes=0)
    with pytest.raises(UsageError, match="whole byte counts"):
        plan_all_to_all(mini, good + 0.5)


def test_no_traffic_is_an_empty_plan(mini):
    for strategy in ("flat", "hier", "multirail", "auto"):
        plan = plan_all_to_all(mini, np.diag([5, 5, 5, 5]), strategy)
        plan.check()
        assert plan.num_transfers == 0 and simulate(plan, mini).time_s == 0


def test_plans_stay_exact_at_320_ranks():
    import yaml

    with open(BIG) as f:
        doc = yaml.safe_load(f)
    for g, count in zip(doc["node_groups"], (16, 16, 8)):
        g["count"] = count
    c = load(yaml.safe_dump(doc))
    assert c.num_ranks == 320
    T = zipf(320, (4 << 20) + 3, 1.2, seed=5)
    from hetcomm.sched import lower_bound

    bound = lower_bound(c, T).time_s
    for strategy in ("hier", "multirail"):
        plan = plan_all_to_all(c, T, strategy)
        plan.check()
        assert simulate(plan, c).time_s >= bound
