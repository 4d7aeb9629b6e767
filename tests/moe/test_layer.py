"""MoELayer in one process: equality with the reference, capacity, dropless, errors."""

from __future__ import annotations

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer, expert_capacity
from tests.moe.cases import equivalence


def test_world_size_1_matches_reference_outputs_and_grads():
    res = equivalence(
        0,
        1,
        [
            {"name": "drop", "kwargs": {}},
            {"name": "dropless", "kwargs": {"dropless": True}},
            {"name": "chunks", "kwargs": {"num_chunks": 3}},
            {"name": "k1", "k": 1, "num_experts": 5, "kwargs": {}},
        ],
    )
    for name, r in res.items():
        assert r["dropped"] == r["ref_dropped"], (name, r)
        for key in ("out", "x_grad", "gate_grad", "expert_grad"):
            assert r[key] < 1e-5, (name, key, r)
    assert res["drop"]["dropped"] > 0, "the capacity case must actually drop something"
    assert res["dropless"]["dropped"] == 0


def test_capacity_formula_and_overflow_is_counted():
    assert expert_capacity(100, 8, 2, 1.25) == 32  # ceil(100*2/8*1.25) = ceil(31.25)
    torch.manual_seed(0)
    layer = MoELayer(8, 4, k=1, capacity_factor=0.5, calibrate=False)
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.weight[0, 0] = 10.0  # everything to expert 0
    x = torch.randn(40, 8)
    x[:, 0] = 1.0
    y = layer(x)
    st = layer.step_stats()
    cap = expert_capacity(40, 4, 1, 0.5)
    assert st["dropped"] == 40 - cap
    assert st["overflow_rate"] == pytest.approx((40 - cap) / 40)
    # Dropped tokens come out as zeros: the block's residual x + moe(x) passes them through.
    assert torch.all(y[cap:] == 0)
    assert torch.any(y[:cap] != 0)
    assert layer.metrics.metrics().num_dropped == 40 - cap


def test_dropless_drops_nothing_under_total_skew():
    layer = MoELayer(8, 4, k=2, dropless=True, calibrate=False)
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.weight[0, 0] = 10.0
        layer.gate.wg.weight[1, 0] = 9.0
    x = torch.randn(64, 8)
    x[:, 0] = 1.0
    y = layer(x)
    assert layer.step_stats()["dropped"] == 0
    assert torch.all(y.abs().sum(1) > 0)


def test_shape_dtype_and_l_aux():
    layer = MoELayer(12, 6, k=2)
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    layer.double()
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert layer.l_aux.dim() == 0 and layer.l_aux.requires_grad
    layer.l_aux.backward()
    assert layer.gate.wg.weight.grad is not None


def test_same_seed_same_weights_whatever_the_expert_spec():
    a = MoELayer(8, 4, expert=torch.nn.Linear(8, 8), seed=3)
    b = MoELayer(8, 4, expert=lambda d: torch.nn.Linear(d, d), seed=3)
    for ma, mb in zip(a.experts.experts, b.experts.experts):
        assert torch.equal(ma.weight, mb.weight)
    # Experts differ from each other (a deep copy alone would make them identical).
    assert not torch.equal(a.experts.experts[0].weight, a.experts.experts[1].weight)


def test_bad_input_is_reported_before_anything_moves():
    layer = MoELayer(8, 4)
    with pytest.raises(ConfigError, match=r"last dimension 7 but model_dim is 8"):
        layer(torch.randn(3, 7))
    with pytest.raises(ConfigError, match=r"moe\.k"):
        MoELayer(8, 4, k=5)
    with pytest.raises(ConfigError, match=r"unknown MoELayer option"):
        MoELayer(8, 4, capacity=3)
    with pytest.raises(ConfigError, match=r"wire dtype"):
        MoELayer(8, 4, wire_dtype="fp8")
    with pytest.raises(ConfigError, match="nn.Module"):
        MoELayer(8, 4, expert=lambda d: 42)


def test_one_load_observer_feeds_subscribers_and_the_record_is_typed():
    from hetcomm.moe import StepStats

    layer = MoELayer(8, 4, k=2, calibrate=False)
    seen = []
    layer.add_load_observer(lambda picks, probs, n, fast: seen.append((picks.clone(), float(n), fast.clone())), fast_topk=3)
    x = torch.randn(32, 8)
    layer(x)
    g = layer.gate(x)
    assert len(seen) == 1
    picks, n, fast = seen[0]
    assert torch.equal(picks, torch.bincount(g.topk_idx.reshape(-1), minlength=4).double()) and n == 32.0
    assert fast.shape == (4,) and float(fast.sum()) > 0
    st = layer.step_stats()
    assert isinstance(st, StepStats) and st.copies == 64 and st["copies"] == 64
    assert st.page_hits is None and "page_hits" not in st and dict(st)["tokens"] == 32
    layer.eval()
    layer(x)
    assert len(seen) == 1  # evaluation forwards do not count
    assert layer.take_migration_requests() == []  # no pager


def test_the_pagers_l2_requests_come_out_as_global_expert_ids():
    from hetcomm.moe import ExpertPlacement

    # One rank owning all 8 experts; its pager indexes them in ascending global id.
    layer = MoELayer(8, 8, k=2, calibrate=False, page_budget=0.5, placement=ExpertPlacement(tuple([0] * 8), 1))
    layer(torch.randn(16, 8))
    assert layer.pager is not None
    layer.pager.migration_requests.extend([0, 3])  # what the pager's L2 level records (local indices)
    assert layer.take_migration_requests() == [0, 3]
    assert layer.take_migration_requests() == []  # handed over once
