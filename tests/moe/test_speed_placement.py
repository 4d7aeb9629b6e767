"""The placement by speed: experts re-placed to even the ranks' predicted busy time.

Pure functions of agreed numbers (the multi-rank move is in
tests/moe/test_token_split.py::test_ranks_agree_one_measured_speed_vector, the restore of a
changed expert count in tests/moe/test_placement_state.py)."""

from __future__ import annotations

import pytest

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.placement.assign import balance_busy_time, busy_times, slow_ranks

#: 16 experts on 4 ranks, 4 each; 100 rows per expert per step.
OWNER = [r for r in range(4) for _ in range(4)]
ROWS = [100.0] * 16


def test_slow_ranks_are_those_slower_than_another_beyond_noise():
    # Datasheet figures are exact (no noise): the floor decides.
    assert slow_ranks([100.0, 97.0, 96.0, 100.0]) == []  # within MIN_SPREAD: nothing moves
    assert slow_ranks([100.0, 100.0, 100.0, 50.0]) == [3]  # the half-speed 910B
    assert slow_ranks([100.0, 80.0, 100.0, 50.0]) == [1, 3]
    # Measured: 25% apart is noise when the ranks' estimates scatter by 10% each
    assert slow_ranks([100.0, 80.0, 100.0, 100.0], [0.1] * 4) == []
    assert slow_ranks([100.0, 80.0, 100.0, 100.0], [0.02] * 4) == [1]


def test_a_half_speed_rank_keeps_fewer_experts_than_its_speed_share():
    # The testbed's shape: a rank's dense work is a third of its step, and rank 3 is at half
    # speed at both. By speed alone it would keep 2 of 16 ([5, 5, 4, 2]); its dense time, which
    # no move takes away, leaves room for one.
    per_row = [0.001, 0.001, 0.001, 0.002]
    fixed = [0.2, 0.2, 0.2, 0.4]
    new = balance_busy_time(OWNER, ROWS, per_row, fixed)
    assert [new.count(r) for r in range(4)] == [5, 5, 5, 1]
    before, after = busy_times(OWNER, ROWS, per_row, fixed), busy_times(new, ROWS, per_row, fixed)
    assert max(before) == pytest.approx(1.2) and max(after) == pytest.approx(0.7)
    assert all(new[e] == OWNER[e] for e in range(16) if OWNER[e] != 3)  # only rank 3's experts left it


def test_the_slow_rank_keeps_its_coldest_and_nothing_moves_for_less_than_the_gain():
    rows = [100.0] * 12 + [400.0, 50.0, 300.0, 200.0]  # rank 3 holds experts 12-15
    per_row, fixed = [0.001] * 3 + [0.002], [0.2] * 3 + [0.4]
    new = balance_busy_time(OWNER, rows, per_row, fixed)
    assert max(busy_times(new, rows, per_row, fixed)) < 0.5 * max(busy_times(OWNER, rows, per_row, fixed))
    assert all(rows[e] <= 100.0 for e in range(16) if new[e] == 3)  # the hot experts left the slow rank
    # equal ranks with equal work: nothing pays
    assert balance_busy_time(OWNER, ROWS, [0.001] * 4, [0.2] * 4) == OWNER
    # 1 % apart does not beat the 2 % a change must gain
    assert balance_busy_time(OWNER, ROWS, [0.001] * 4, [0.2, 0.2, 0.2, 0.206]) == OWNER
    # the same inputs give the same map (every rank computes it alone)
    assert balance_busy_time(OWNER, rows, [0.001] * 3 + [0.002], [0.2] * 3 + [0.4]) == new


def test_bad_inputs_name_the_figure_and_one_rank_never_moves():
    with pytest.raises(ConfigError) as e:
        balance_busy_time([0, 1], [1.0], [0.1, 0.1], [0.0, 0.0])
    assert e.value.key == "moe.expert_load"
    with pytest.raises(ConfigError, match=r"seconds_per_row\[1\] is nan"):
        balance_busy_time([0, 1], [1.0, 1.0], [0.1, float("nan")], [0.0, 0.0])
    with pytest.raises(ConfigError, match="fixed_seconds has 1 entries for 2 ranks"):
        balance_busy_time([0, 1], [1.0, 1.0], [0.1, 0.1], [0.0])
    assert not MoELayer(8, 4, calibrate=False).speed_placement_due()  # one rank: never


def test_given_speeds_pool_the_measured_seconds_and_spread_them_by_the_known_factors():
    from hetcomm.moe.placement.migration import given_spread
    from hetcomm.moe.speed import SpeedMeter

    meter = SpeedMeter(4, 0, [100.0, 100.0, 100.0, 50.0], every=5)
    noisy = [0.9, 1.1, 1.0, 2.4]  # seconds; rank 3 at half speed, read 20 % slower still
    assert given_spread(meter, noisy) == noisy  # measured speeds: each rank's own
    meter.set_prior(meter.prior, given=True)
    # pooled at full speed (1.05 s), spread by the given factors: the noise is gone
    assert given_spread(meter, noisy) == pytest.approx([1.05, 1.05, 1.05, 2.1])
