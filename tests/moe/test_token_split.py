"""Per-step, time-proportional token split (hetcomm.moe.token_split) and measured speed
(hetcomm.moe.speed): the planner against an independent LP, and the layer against the same layer
without copies on 1, 2 and 4 real rank processes."""

from __future__ import annotations

import itertools
import math
import re
import random
import statistics

import pytest
import torch

from hetcomm.errors import ConfigError, UsageError
from hetcomm.moe import MoELayer
from hetcomm.moe.speed import CpuTimer, SpeedMeter, agree_table, timer_for
from hetcomm.moe.token_split import assign_rows, max_over_mean, plan_split
from tests.backends.ranks import run_ranks
from tests.moe import split_cases

TOL = 1e-5


def _brute_makespan(counts, owner, holders, speeds):
    """Best integer makespan by enumerating every split of small experts (the test's oracle)."""
    W, E = len(speeds), len(owner)
    total = [sum(c[e] for c in counts) for e in range(E)]
    base = [0] * W
    multi = [e for e in sorted(holders) if len(holders[e]) > 1]
    for e in range(E):
        if e not in multi:
            base[owner[e]] += total[e]
    best = float("inf")

    def splits(n, hs):
        if len(hs) == 1:
            yield {hs[0]: n}
            return
        for i in range(n + 1):
            for rest in splits(n - i, hs[1:]):
                yield {hs[0]: i, **rest}

    for combo in itertools.product(*[list(splits(total[e], list(holders[e]))) for e in multi]):
        rows = list(base)
        for q in combo:
            for h, n in q.items():
                rows[h] += n
        best = min(best, max(rows[r] / speeds[r] for r in range(W)))
    return best


def test_plan_split_is_optimal_on_random_small_cases():
    rng = random.Random(7)
    for _ in range(40):
        W = rng.choice([2, 3, 4])
        E = rng.randint(2, 5)
        owner = [rng.randrange(W) for _ in range(E)]
        counts = [[rng.randint(0, 5) for _ in range(E)] for _ in range(W)]
        hot = rng.sample(range(E), rng.randint(1, 2))
        holders = {e: tuple(sorted({owner[e], *rng.sample(range(W), rng.randint(1, W))})) for e in hot}
        speeds = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(W)]
        plan = plan_split(counts, owner, holders, speeds)
        assert plan.makespan == pytest.approx(_brute_makespan(counts, owner, holders, speeds), rel=1e-9)
        for e, q in plan.quota.items():
            assert sum(q.values()) == sum(c[e] for c in counts)
            assert set(q) <= set(holders[e])
        assert sum(plan.rows) == sum(map(sum, counts))


def test_time_proportional_not_row_equal():
    # One expert with 300 rows, copies on both ranks; rank 0 twice as fast: 200 / 100 rows.
    plan = plan_split([[150], [150]], [0], {0: (0, 1)}, [2.0, 1.0])
    assert plan.quota[0] == {0: 200, 1: 100}
    assert max_over_mean(plan.predicted) == pytest.approx(1.0)


def test_a_rank_too_slow_to_help_gets_nothing_and_sends_its_rows_away():
    plan = plan_split([[10, 0], [10, 0]], [0, 0], {0: (0, 1)}, [1.0, 1e-9])
    assert plan.quota[0] == {0: 20}
    segs = assign_rows([10, 10], plan.quota[0])
    assert segs == [[(0, 10)], [(0, 10)]]


def test_assign_rows_keeps_own_rows_local_first():
    segs = assign_rows([4, 6, 2], {0: 3, 2: 9})
    assert segs[0] == [(0, 3), (2, 1)]
    assert segs[1] == [(2, 6)]
    assert segs[2] == [(2, 2)]
    for s, c in enumerate([4, 6, 2]):
        assert sum(n for _, n in segs[s]) == c


def _row(rows, secs, noise=0.01, room=1.0):
    return [rows, secs, room, noise, 5.0]


def test_agreed_table_fills_unmeasured_ranks_from_the_prior():
    # Rank 2 measured nothing: prior x the median measured/prior ratio (here 100).
    speeds, noise, differ = agree_table([_row(100.0, 1.0), _row(50.0, 1.0), _row(0.0, 0.0, -1.0)], [1.0, 1.0, 2.0])
    assert speeds == (100.0, 50.0, 150.0) and differ is True and math.isinf(noise[2])
    assert agree_table([_row(0.0, 0.0, -1.0)] * 2, [3.0, 1.0]) == ((3.0, 1.0), (0.0, 0.0), None)
    assert isinstance(timer_for(torch.device("cpu")), CpuTimer)


def test_agreed_table_pools_a_device_class_only_when_its_ranks_agree():
    # Ranks 0 and 1 share a class and agree within their noise (150 and 133 rows/s, 10% noise
    # each): their rows and seconds are summed (300 rows in 2.1 s); rank 2 is its own class.
    table = [_row(150.0, 1.0, 0.1), _row(200.0, 1.5, 0.1), _row(50.0, 1.0, 0.01), _row(0.0, 0.0, -1.0)]
    speeds, _, differ = agree_table(table, [2.0, 2.0, 1.0, 1.0], classes=[0, 0, 1, 2])
    assert speeds[:3] == (350.0 / 2.5, 350.0 / 2.5, 50.0) and differ
    assert speeds[3] == 1.0 * statistics.median([70.0, 70.0, 50.0])  # its prior x the median ratio
    # Precise measurements: 150 vs 133 is a real difference, each keeps its own (a straggler in a class).
    table[0][3] = table[1][3] = 0.01
    speeds, _, _ = agree_table(table, [2.0, 2.0, 1.0, 1.0], classes=[0, 0, 1, 2])
    assert speeds[:2] == (150.0, 200.0 / 1.5)
    # Nobody slower than another beyond noise: every rank gets the group's pooled speed.
    speeds, _, differ = agree_table([_row(100.0, 1.0, 0.1), _row(90.0, 1.0, 0.1)], [1.0, 1.0])
    assert speeds == (95.0, 95.0) and differ is False
    # The layer derives the classes from the datasheet prior (device.tflops overrides).
    layer = MoELayer(8, 4)
    assert layer.speed.classes == (0,) and layer.config.speed_pool == "device"
    assert MoELayer(8, 4, speed_pool="rank").speed.classes is None
    with pytest.raises(ConfigError) as ei:
        MoELayer(8, 4, speed_pool="node")
    assert ei.value.key == "moe.speed_pool"
    with pytest.raises(ConfigError, match="one device class per rank"):
        SpeedMeter(2, 0, [1.0, 1.0], classes=[0])


def test_speed_knobs_and_token_split_need_replication():
    with pytest.raises(ConfigError) as ei:
        MoELayer(8, 4, token_split=True)
    assert ei.value.key == "moe.token_split"
    with pytest.raises(ConfigError) as ei:
        MoELayer(8, 4, speed_every=-1)
    assert ei.value.key == "moe.speed_every"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("speeds,on", [([2.0, 1.0], True), ([1.0, 1.0], False)], ids=["differ", "equal"])
def test_auto_split_is_on_exactly_when_the_agreed_speeds_differ(speeds, on):
    res = run_ranks(split_cases.auto_split_follows_the_verdict, world_size=2, backend="gloo", cluster=None,
                    timeout=200, args=(speeds,))
    for r in res:
        assert r["on"] is on and r["lever"].startswith("on" if on else "off"), r
        # the rows of both hot experts are split every step when on; no split record when off
        assert r["split_experts"] == ([(0, 1)] * 2 if on else [None] * 2), r
    layer = MoELayer(8, 4, calibrate=False)  # token_split="auto" without replication: nothing to turn on
    assert layer.splitter is None and not layer.token_split_on
    with pytest.raises(UsageError, match="no token split to turn on"):
        layer.use_token_split(True)


def test_one_rank_split_layer_equals_static_and_measures():
    res = split_cases.split_vs_static(0, 1, [1.0], hot=[0, 1])
    assert res["out"] < TOL and res["x_grad"] < TOL and res["grad"] < TOL and res["param"] < TOL, res
    layer = MoELayer(8, 4, speed_every=1, calibrate=False)
    layer(torch.randn(16, 8)).sum().backward()
    st = layer.step_stats()
    assert st["speed_measured"] and st["speed_agreements"] == 1 and st["speed_local_rows_per_s"] > 0


def _check(res):
    for rank, r in enumerate(res):
        for key in ("out", "x_grad", "grad", "param"):
            assert r[key] < TOL, (rank, key, r)


@pytest.mark.timeout(240)
def test_two_ranks_split_equals_static_every_rank_holds_every_hot_expert():
    # No cluster: both ranks are replica holders, so each hot expert has a copy on every rank.
    res = run_ranks(split_cases.split_vs_static, world_size=2, backend="gloo", cluster=None, timeout=200,
                    args=([3.0, 1.0], [0, 1, 2]))
    _check(res)
    assert all(tuple(r["split_experts"][0]) == (0, 1, 2) for r in res)
    # Time-proportional: rank 0 (3x faster) computes more rows than rank 1.
    rows = res[0]["rows"][0]
    assert rows == res[1]["rows"][0] and rows[0] > rows[1]


@pytest.mark.timeout(300)
def test_four_ranks_split_equals_static_with_a_rank_that_receives_nothing():
    # Rank 3 owns no expert and is far too slow to be given any of the hot experts' rows: it
    # receives no rows at all, and still sends its own tokens and takes part in every reduction.
    owner = [0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 1, 2]
    res = run_ranks(split_cases.split_vs_static, world_size=4, backend="gloo", cluster=None, timeout=260,
                    args=([1.0, 1.0, 2.0, 1e-9], [0, 3, 6], owner))
    _check(res)
    assert all(n == 0 for n in res[3]["received"]), res[3]["received"]
    assert res[3]["num_replicas"] == 3
    assert all(r["rows"][0][3] == 0 for r in res)
    # Every rank holds a copy of every hot expert; the predicted times of the helping ranks are
    # as equal as the copies allow.
    assert all(r["num_replicas"] == 2 for r in res[:3])


@pytest.mark.timeout(180)
def test_ranks_agree_one_measured_speed_vector():
    res = run_ranks(split_cases.speed_agreement, world_size=2, backend="gloo", cluster=None, timeout=150, args=())
    for r in res:
        agreements, measured, speeds = r["seen"][-1]
        assert agreements == 3 and measured
        assert speeds == res[0]["seen"][-1][2]  # the identical vector on every rank
        assert r["seen"][0][1] is False  # before the first agreement: the prior
    speeds = res[0]["seen"][-1][2]
    assert speeds[1] < speeds[0]  # rank 1's experts spin 0.05 s per call
    assert all(r["differ"] for r in res) and res[0]["noise"] == res[1]["noise"]
    # Replica holders by the agreed measured speed (rank 1 is far below half of rank 0's): the
    # same choice on both ranks, and rank 1 keeps no copy.
    assert [r["room"] for r in res] == [(True, True)] * 2
    assert [r["holders"] for r in res] == [(0,), (0,)]
    assert res[0]["hot"] == res[1]["hot"] and len(res[0]["hot"]) == 1
    assert res[1]["replicas"] == []
    # The placement by measured busy time: the slow rank 1 keeps one expert (the least a rank
    # keeps), the same map on both ranks, from the same load.
    assert res[1]["rows"] == res[0]["rows"] and all(r["due"] for r in res)
    assert res[0]["owner"] == res[1]["owner"] and res[0]["before"] == [0, 0, 1, 1]
    assert res[0]["events"] and res[0]["events"] == res[1]["events"], res[0]["events"]
    assert res[0]["owner"].count(1) == 1 and res[0]["owner"].count(0) == 3, res[0]["owner"]


_GOOD = dict(counts=[[3, 1], [2, 2]], owner=[0, 1], holders={0: [0, 1]}, speeds=[1.0, 2.0])


@pytest.mark.parametrize("change, says", [
    # Each used to end in a raw ZeroDivisionError, IndexError, OverflowError or float-to-int error.
    (dict(speeds=[1.0, -1.0]), "speeds[1] is -1.0; every rank's speed must be a finite number > 0"),
    (dict(speeds=[0.0, 2.0]), "speeds[0] is 0.0"),
    (dict(speeds=[1.0, float("nan")]), "speeds[1] is nan"),
    (dict(speeds=[1.0, float("inf")]), "speeds[1] is inf"),
    (dict(speeds=[]), "speeds is empty"),
    (dict(counts=[[3, 1]]), "counts has 1 rows but speeds 2 ranks"),
    (dict(counts=[[3], [2, 2]]), "counts[0] has 1 experts but owner 2"),
    (dict(counts=[[float("nan"), 1], [2, 2]]), "counts[0][0] is nan"),
    (dict(counts=[[-3, 1], [2, 2]]), "counts[0][0] is -3"),
    (dict(owner=[0, 5]), "owner[1] is 5, not a rank of 0..1"),
    (dict(holders={0: [0, 7]}), "holders[0] has 7, not a rank of 0..1"),
    (dict(holders={5: [0, 1]}), "holders names expert 5, not one of 0..1"),
    (dict(holders={0: [1]}), "holders[0] is [1] without the expert's owner 0"),
])
def test_plan_split_refuses_bad_input_with_a_usage_error(change, says):
    args = {**_GOOD, **change}
    with pytest.raises(UsageError) as e:
        plan_split(args["counts"], args["owner"], args["holders"], args["speeds"])
    assert says in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("counts_e, quota_e, says", [
    ([3, 1], {0: 2}, "the quotas add up to 2 rows but the expert has 4"),
    ([3, 1], {0: -1, 1: 5}, "quota_e[0] is -1"),
    ([3, 1], {0: 1, 4: 3}, "holder 4, not a rank of 0..1"),
])
def test_assign_rows_refuses_quotas_that_do_not_fit(counts_e, quota_e, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        assign_rows(counts_e, quota_e)


def test_integral_float_counts_from_the_table_are_accepted():
    # route() reads the counts from a float64 table: 3.0 is three rows, not an error.
    assert plan_split([[3.0, 1.0], [2.0, 2.0]], [0, 1], {0: [0, 1]}, [1.0, 1.0]).rows == (4, 4)
