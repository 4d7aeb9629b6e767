"""Hot-expert replication policy (single process: the decision needs no communication)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe.placement import ExpertPlacement
from hetcomm.moe.placement.replicate import HotExpertReplicator

D, F = 8, 16
P = 2 * D * F + F + D  # parameters of Linear(D,F) + Linear(F,D)


def _replicator(policy: str, holders=(0, 1, 2)) -> HotExpertReplicator:
    placement = ExpertPlacement(owner=(0, 1, 2, 3, 0, 1, 2, 3), world_size=4)
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    owned = {e: make(e) for e in placement.experts_of(0)}
    return HotExpertReplicator(placement, 0, holders, make, owned, None, num_hot=3, every=1, alpha=0.0, policy=policy)


def _picks(hot_count: float) -> torch.Tensor:
    # experts 0, 1, 2 hot (owned by holders 0, 1, 2), the rest cold
    return torch.tensor([hot_count, hot_count * 0.9, hot_count * 0.8, 1, 1, 1, 1, 1], dtype=torch.float64)


def test_always_takes_the_top_n():
    rep = _replicator("always")
    rep.observe(_picks(10.0), row_bytes=4)  # tiny rows: replication is a loss, but "always"
    assert rep._pending_hot == (0, 1, 2)


def test_profitable_replicates_only_what_saves_more_bytes_than_it_costs():
    row_bytes = D * 4
    # Per step: saved = picks * (holders other than the owner = 2) / 4 ranks * row_bytes * 4;
    # spent = 2 reductions * 2 (m - 1 = 2) * P * 4 bytes, with m = 3 ranks holding or owning it.
    spent = 2 * 2 * 2 * P * 4
    break_even = spent / (2 / 4 * row_bytes * 4)
    rep = _replicator("profitable")  # alpha = 0: the EMA is the last step's picks
    rep.observe(_picks(break_even * 0.99), row_bytes=row_bytes)
    assert rep._pending_hot == ()
    saved, cost = rep.last_decision[0]
    assert cost == pytest.approx(spent) and saved == pytest.approx(0.99 * spent)

    rep.observe(_picks(break_even / 0.85), row_bytes=row_bytes)  # 0 and 1 pay off, 2 (x0.8) not
    assert rep._pending_hot == (0, 1)

    rep.observe(_picks(break_even * 10), row_bytes=row_bytes)
    assert rep._pending_hot == (0, 1, 2)


def test_unknown_policy_names_the_key():
    with pytest.raises(ConfigError) as e:
        _replicator("sometimes")
    assert e.value.key == "moe.replicate_policy"


def test_profitable_uses_the_bias_corrected_ema():
    placement = ExpertPlacement(owner=(0, 1, 2, 3), world_size=4)
    make = lambda e: nn.Sequential(nn.Linear(D, F), nn.Linear(F, D))  # noqa: E731
    rep = HotExpertReplicator(
        placement, 0, (0, 1, 2), make, {0: make(0)}, None, num_hot=1, every=1, alpha=0.99, policy="profitable"
    )
    picks = torch.tensor([1000.0, 1, 1, 1], dtype=torch.float64)
    for _ in range(3):
        rep.observe(picks, row_bytes=64)
    saved, _ = rep.last_decision[0]
    # after 3 steps the raw EMA holds only 3 % of the true 1000 picks per step; corrected, all
    assert saved == pytest.approx(1000 * 2 / 4 * 64 * 4)
