"""Cold experts on the measured-slow ranks, coldest by global load, not by id.

Pure functions of agreed numbers (the multi-rank move is in
tests/moe/test_token_split.py::test_ranks_agree_one_measured_speed_vector)."""

from __future__ import annotations

import pytest

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.placement.assign import cold_on_slow, place_experts, slow_ranks


def test_slow_ranks_are_those_slower_than_another_beyond_noise():
    # Datasheet figures are exact (no noise): the floor decides.
    assert slow_ranks([100.0, 97.0, 96.0, 100.0]) == []  # within MIN_SPREAD: nothing moves
    assert slow_ranks([100.0, 100.0, 100.0, 50.0]) == [3]  # the half-speed 910B
    assert slow_ranks([100.0, 80.0, 100.0, 50.0]) == [1, 3]
    # Measured: 25% apart is noise when the ranks' estimates scatter by 10% each
    assert slow_ranks([100.0, 80.0, 100.0, 100.0], [0.1] * 4) == []
    assert slow_ranks([100.0, 80.0, 100.0, 100.0], [0.02] * 4) == [1]


def test_coldest_by_load_go_to_the_slow_rank_with_the_fewest_moves():
    # the initial assignment gives the weak rank 3 the highest ids (7 experts: 2/2/2/1 by weight)
    owner = place_experts(7, 4, rank_weights=[2, 2, 2, 1]).owner
    assert owner == (0, 0, 1, 1, 2, 2, 3)
    load = [5.0, 1.0, 9.0, 0.5, 7.0, 3.0, 8.0]  # expert 6 (on rank 3) is hot, 3 the coldest
    new = cold_on_slow(owner, load, [3])
    assert new == [0, 0, 1, 3, 2, 2, 1]  # 3 and 6 trade places; nothing else moves
    assert sum(1 for a, b in zip(owner, new) if a != b) == 2
    assert [new.count(r) for r in range(4)] == [2, 2, 2, 1]  # every rank keeps its count


def test_two_slow_ranks_take_the_coldest_hottest_leaving_first_and_ties_by_id():
    owner = [0, 0, 1, 1, 2, 2]
    load = [1.0, 1.0, 6.0, 9.0, 4.0, 1.0]
    # slow ranks 1 and 2 hold four experts: the four coldest are 0, 1, 5 (1.0) and 4 (4.0)
    new = cold_on_slow(owner, load, [1, 2])
    assert sorted(e for e in range(6) if new[e] in (1, 2)) == [0, 1, 4, 5]
    # hottest leaving first, coldest arriving first (ties by id): 3 (9.0) trades with 0, 2 (6.0) with 1
    assert new == [1, 1, 0, 0, 2, 2]
    assert cold_on_slow(owner, load, []) == owner  # no slow rank: nothing moves
    assert cold_on_slow(owner, [1.0] * 6, [2]) == owner  # all equally cold: whoever is there stays


def test_bad_load_and_replication_off_name_the_key():
    with pytest.raises(ConfigError) as e:
        cold_on_slow([0, 1], [1.0], [1])
    assert e.value.key == "moe.expert_load"
    layer = MoELayer(8, 4, calibrate=False)
    assert not MoELayer(8, 4, calibrate=False, replicate=True).cold_placement_due()  # one rank: never
    with pytest.raises(ConfigError) as e:
        layer.place_cold_on_slow()
    assert e.value.key == "moe.replicate"
