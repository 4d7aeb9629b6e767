"""Replica holders by measured speed: the fastest ranks with room.

Single process: the choice is a pure function of agreed numbers (the multi-rank agreement is in
tests/moe/test_token_split.py::test_ranks_agree_one_measured_speed_vector)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.placement import ExpertPlacement
from hetcomm.moe.placement.replicate import HotExpertReplicator, choose_holders
from hetcomm.moe.speed import SpeedMeter
from hetcomm.topo.compute import STRONG_FRACTION

D, F = 8, 16


def test_fastest_ranks_within_the_fraction_of_the_fastest():
    assert choose_holders([4.0, 1.0, 3.0, 2.0], [True] * 4) == (0, 2, 3)  # 1.0 < 0.5 x 4.0
    assert choose_holders([4.0, 1.0, 3.0, 2.0], [True] * 4, fraction=0.7) == (0, 2)
    assert STRONG_FRACTION == 0.5
    # Below the fraction but not slower beyond its noise (the one rule): it keeps holding.
    assert choose_holders([4.0, 1.0, 3.0, 2.0], [True] * 4, noise=[0.1, 1.0, 0.1, 0.1]) == (0, 1, 2, 3)
    assert choose_holders([4.0, 1.0, 3.0, 2.0], [True] * 4, noise=[0.1, 0.2, 0.1, 0.1]) == (0, 2, 3)


def test_ranks_without_room_are_skipped_and_the_fastest_with_room_sets_the_bar():
    # rank 0 is fastest but pages its experts: the bar is 0.5 x rank 2's speed
    assert choose_holders([4.0, 1.0, 3.0, 1.4], [False, True, True, True]) == (2,)
    assert choose_holders([4.0, 1.0, 3.0, 1.6], [False, True, True, True]) == (2, 3)
    assert choose_holders([4.0, 1.0], [False, False]) == ()  # nobody has room: owners compute all


def test_only_candidates_hold_and_ties_go_to_the_lower_rank():
    assert choose_holders([1.0, 5.0, 5.0, 5.0], [True] * 4, candidates=[0, 2, 3]) == (2, 3)
    # equal speeds, two places: ranks 1 and 2 before 3 (the same answer on every rank)
    assert choose_holders([1.0, 2.0, 2.0, 2.0], [True] * 4, limit=2) == (1, 2)
    with pytest.raises(ConfigError):
        choose_holders([1.0, 2.0], [True])


def _replicator(rank: int, agreed):
    placement = ExpertPlacement(owner=(0, 1, 2, 3, 0, 1, 2, 3), world_size=4)
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    owned = {e: make(e) for e in placement.experts_of(rank)}
    return HotExpertReplicator(placement, rank, (0, 1, 2), make, owned, None, num_hot=2, every=1, alpha=0.0,
                               measured=lambda: agreed[0])


def test_hot_set_refresh_moves_replicas_to_the_measured_fastest_ranks():
    agreed = [None]
    picks = torch.tensor([1, 1, 1, 50, 1, 1, 40, 1], dtype=torch.float64)  # hot: 3 (rank 3), 6 (rank 2)
    rep = _replicator(0, agreed)
    rep.observe(picks)
    rep.sync()
    assert rep.holders == (0, 1, 2) and set(rep.replicas) == {3, 6}  # before any measurement: the prior
    # measured: rank 0 is the slowest candidate (datasheet-strong but throttled), 1 pages (no room)
    agreed[0] = ([100.0, 900.0, 1000.0, 400.0], [True, False, True, True], [0.01] * 4)
    rep.observe(picks)
    rep.sync()
    assert rep.holders == (2,)  # rank 3 is fast enough but no candidate; 0 is below 0.5 x 1000
    assert rep.replicas == {}  # rank 0 dropped its copies
    assert rep.holders_of_hot() == {3: (2, 3), 6: (2,)}
    agreed[0] = ([1000.0, 900.0, 1000.0, 400.0], [True, True, True, True], [0.01] * 4)  # rank 0 recovered
    rep.observe(picks)
    rep.sync()
    assert rep.holders == (0, 1, 2) and set(rep.replicas) == {3, 6}


def test_a_rank_measured_too_slow_stops_holding_replicas():
    agreed = [([1.0, 1.0, 1.0, 1.0], [True, True, True, True], [0.01] * 4)]
    rep = _replicator(1, agreed)
    picks = torch.tensor([50, 1, 1, 1, 1, 1, 1, 1], dtype=torch.float64)  # hot: 0 (rank 0), 5 (rank 1)
    rep.observe(picks)
    assert rep._pending_holders == (0, 1, 2)
    agreed[0] = ([1.0, 0.1, 1.0, 1.0], [True, True, True, True], [0.01] * 4)
    rep.observe(picks)
    rep.sync()
    assert rep.holders == (0, 2) and rep.replicas == {}  # rank 1 is too slow to hold copies


def test_speed_meter_agrees_room_with_the_speeds():
    m = SpeedMeter(1, 0, [1.0], None, every=1, room=False)
    assert m.room == (True,)  # before the first agreement nobody knows the others' flags
    m.agree()
    assert m.room == (False,)


def test_layer_wires_measured_speed_and_paging_into_room():
    layer = MoELayer(D, 4, replicate=True, replicate_top=1, calibrate=False)
    assert layer.speed.room_here and layer.replicator.measured() is None  # not measured yet
    paged = MoELayer(D, 4, replicate=True, replicate_top=1, calibrate=False, page_budget=0.5)
    assert not paged.speed.room_here  # its own experts do not fit: no room for copies


def test_a_moving_hot_set_reuses_its_replica_modules_and_refreshes_them_from_the_owners():
    built = []

    def make(e):
        built.append(e)
        return nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))

    placement = ExpertPlacement(owner=(0, 1, 2, 3, 0, 1, 2, 3), world_size=4)
    rep = HotExpertReplicator(placement, 0, (0, 1, 2), make, {0: make(0), 4: make(4)}, None, num_hot=2,
                              every=1, alpha=0.0)
    built.clear()
    rep.observe(torch.tensor([1, 1, 1, 50, 1, 1, 40, 1], dtype=torch.float64))  # hot: 3, 6
    assert rep.sync() and set(rep.replicas) == {3, 6} and sorted(built) == [3, 6]
    first = {id(m) for m in rep.replicas.values()}
    rep.observe(torch.tensor([1, 40, 1, 1, 1, 50, 1, 1], dtype=torch.float64))  # moved: 1, 5
    assert rep.sync()  # new experts on the old modules: refreshed
    assert set(rep.replicas) == {1, 5} and {id(m) for m in rep.replicas.values()} == first
    assert sorted(built) == [3, 6]  # nothing built for the move
    assert not rep.sync()  # nothing changed since
    # Away and back before any refresh: the same set as the last refresh, but the modules may
    # have swapped experts, so the next sync refreshes all the same.
    rep.set_hot([3, 6])
    rep.set_hot([1, 5])
    assert rep.sync()


def test_hot_sets_wait_for_the_speed_verdict_and_a_held_refresh_runs_right_after_it():
    placement = ExpertPlacement(owner=(0, 1, 2, 3, 0, 1, 2, 3), world_size=4)
    verdict = []
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    rep = HotExpertReplicator(placement, 0, (0, 1, 2), make, {0: make(0), 4: make(4)}, None, num_hot=2,
                              every=3, alpha=0.0, ready=lambda: bool(verdict))
    load = torch.tensor([1, 1, 1, 50, 1, 1, 40, 1], dtype=torch.float64)
    for _ in range(4):  # a refresh falls due at the third step: held, no verdict yet
        rep.observe(load)
        assert rep.next_hot == ()
    verdict.append(True)
    rep.observe(load)  # the fifth step: not due by the cadence, but the held refresh runs
    assert rep.next_hot == (3, 6)
    rep.set_hot([1])
    rep.observe(load)  # the sixth: due by the cadence
    assert rep.next_hot == (3, 6)
    rep.set_hot([1])
    rep.observe(load)  # the seventh: nothing held, not due
    assert rep.next_hot == (1,)


def test_the_layer_copies_only_after_its_speed_verdict():
    measured = MoELayer(D, 4, replicate=True, replicate_top=1, calibrate=False)
    assert not measured.replicator.ready()  # measured speeds: their verdict comes at the second agreement
    given = MoELayer(D, 4, replicate=True, replicate_top=1, calibrate=False, speed_every=0)
    assert given.replicator.ready()  # the prior is kept: its verdict holds from the start
