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


def test_a_half_speed_rank_keeps_its_speed_share_of_the_rows():
    # The testbed's shape: 16 experts of equal load on 4 ranks, rank 3 at half speed. Its expert
    # time evens out at half the rows of a fast rank: 2 of 16 ([5, 5, 4, 2]; which fast rank keeps
    # 4 follows from the order of the search).
    per_row = [0.001, 0.001, 0.001, 0.002]
    new = balance_busy_time(OWNER, ROWS, per_row)
    assert sorted(new.count(r) for r in range(3)) == [4, 5, 5] and new.count(3) == 2
    before, after = busy_times(OWNER, ROWS, per_row), busy_times(new, ROWS, per_row)
    assert max(before) == pytest.approx(0.8) and max(after) == pytest.approx(0.5)
    assert all(new[e] == OWNER[e] for e in range(16) if OWNER[e] != 3)  # only rank 3's experts left it


def test_the_hottest_expert_leaves_the_slow_rank_and_nothing_moves_for_less_than_the_gain():
    rows = [100.0] * 12 + [400.0, 50.0, 300.0, 200.0]  # rank 3 holds experts 12-15
    per_row = [0.001] * 3 + [0.002]
    new = balance_busy_time(OWNER, rows, per_row)
    # within 10 % of a perfect split of the 2,150 rows at 1,000 / 1,000 / 1,000 / 500 rows/s
    assert max(busy_times(new, rows, per_row)) <= 1.1 * 2150 / 3500 < 0.4 * max(busy_times(OWNER, rows, per_row))
    # the hottest expert left the slow rank, which keeps about half a fast rank's rows
    assert new[12] != 3 and sum(rows[e] for e in range(16) if new[e] == 3) <= 0.5 * 1.1 * 2150 / 3.5
    # equal ranks with equal work: nothing pays
    assert balance_busy_time(OWNER, ROWS, [0.001] * 4) == OWNER
    # 1 % apart does not beat the 2 % a change must gain
    assert balance_busy_time(OWNER, ROWS, [0.001, 0.001, 0.001, 0.00101]) == OWNER
    # the same inputs give the same map (every rank computes it alone)
    assert balance_busy_time(OWNER, rows, [0.001] * 3 + [0.002]) == new


def test_bad_inputs_name_the_figure_and_one_rank_never_moves():
    with pytest.raises(ConfigError) as e:
        balance_busy_time([0, 1], [1.0], [0.1, 0.1])
    assert e.value.key == "moe.expert_load"
    with pytest.raises(ConfigError, match=r"seconds_per_row\[1\] is nan"):
        balance_busy_time([0, 1], [1.0, 1.0], [0.1, float("nan")])
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
