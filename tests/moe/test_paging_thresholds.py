"""The pager's standby and eviction thresholds (0.7 / 40% / 20%), each asserted on a real pager:
what loads and what stays after ``end_step``."""

from __future__ import annotations

import torch
from torch import nn

from hetcomm.moe.paging import ExpertPager, PagingConfig


def _pager(num_experts: int = 10, budget: float = 1.0) -> ExpertPager:
    torch.manual_seed(0)
    experts = [nn.Linear(8, 8) for _ in range(num_experts)]
    return ExpertPager(experts, PagingConfig(budget_fraction=budget, training=False), device=torch.device("cpu"))


def _hinted(pager: ExpertPager, values) -> None:
    p = torch.zeros(pager.num_experts, dtype=torch.float64)
    for e, v in values.items():
        p[e] = v
    pager.hint(p)
    pager.end_step()
    pager.sync()


def test_defaults_are_the_documented_thresholds():
    cfg = PagingConfig()
    assert (cfg.standby_threshold, cfg.prefetch_min_free, cfg.evict_below_free) == (0.7, 0.4, 0.2)


def test_standby_at_predicted_use_0_7_and_not_below():
    pager = _pager()
    for e in pager.resident_experts():
        pager.evict(e)
    pager.sync()
    _hinted(pager, {0: 0.70, 1: 0.69})
    assert pager.resident(0) and not pager.resident(1)
    assert pager.stats_total["prefetches"] == 1


def test_soft_prefetch_stops_at_40_percent_free():
    pager = _pager()
    for e in pager.resident_experts():
        pager.evict(e)
    pager.sync()
    _hinted(pager, {e: 0.9 for e in range(10)})
    # Loads start while more than 4 of the 10 slots are free: 6 loads, 4 slots stay free.
    assert len(pager.resident_experts()) == 6 and pager.free_slots() == 4


def test_eviction_down_to_20_percent_free():
    pager = _pager()
    for e in range(10):
        if not pager.resident(e):
            assert pager.prefetch(e)
    pager.sync()
    assert pager.free_slots() == 0
    _hinted(pager, {})
    # Nothing predicted: evict until 2 of the 10 slots (20%) are free, no further.
    assert pager.free_slots() == 2 and len(pager.resident_experts()) == 8
