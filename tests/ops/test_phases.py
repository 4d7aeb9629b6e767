"""Launch phases 2 and 3 in one process: warm-up from a previous run's record, grouped start."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.ops import hooks, worker
from hetcomm.train.loop import TrainConfig

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces", "demo_clean.jsonl")


def _model(experts: int = 8):
    from hetcomm.moe import MoELayer
    from hetcomm.train.lm import LMConfig, MoETransformerLM

    cfg = LMConfig(vocab_size=32, seq_len=8, model_dim=16, num_layers=2, num_experts=experts, hidden_dim=32)
    return MoETransformerLM(cfg, lambda i: MoELayer(16, experts, k=2, replicate=True, seed=i))


def test_warmup_seeds_calibrator_history_and_hot_experts():
    from hetcomm.ops.metrics import read_metrics

    model = _model()
    cfg = replace(TrainConfig(), warmup_from=TRACE)
    assert hooks.warmup(cfg, model, start_step=0)
    steps = read_metrics(TRACE).steps[-50:]
    for i, layer in enumerate(model.moe_layers):
        load = torch.tensor([sum(s.expert_load[i][e] for s in steps) for e in range(8)], dtype=torch.float64)
        share = load / load.sum()
        assert torch.allclose(layer.gate.calibrator.history.double(), share * 8, atol=1e-6)
        assert set(layer.replicator.hot) == set(torch.topk(load, layer.replicator.num_hot).indices.tolist())
    fresh = _model()
    assert not hooks.warmup(cfg, fresh, start_step=40)  # after a resume the checkpoint rules
    assert torch.equal(fresh.moe_layers[0].gate.calibrator.history, torch.ones(8))


def test_warmup_refuses_another_model():
    with pytest.raises(ConfigError) as e:
        hooks.warmup(replace(TrainConfig(), warmup_from=TRACE), _model(experts=4), start_step=0)
    assert e.value.key == "expert_load" and e.value.path == TRACE


def test_grouped_start_waits_by_rank_group(monkeypatch):
    monkeypatch.setenv(worker.GROUP_SIZE_ENV, "2")
    monkeypatch.setenv(worker.GROUP_DELAY_ENV, "0.2")
    waits = {}
    for rank in (0, 1, 2, 3, 5):
        monkeypatch.setenv("RANK", str(rank))
        t0 = time.perf_counter()
        waits[rank] = worker.stagger()
        assert time.perf_counter() - t0 >= waits[rank] - 0.01
    assert waits == {0: 0.0, 1: 0.0, 2: 0.2, 3: 0.2, 5: pytest.approx(0.4)}
    monkeypatch.delenv(worker.GROUP_SIZE_ENV)
    assert worker.stagger() == 0.0


def test_warmup_pages_in_the_hottest_experts():
    from hetcomm.moe.paging import ExpertPager, PagingConfig
    from hetcomm.ops.metrics import read_metrics

    model = _model()
    experts = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)) for _ in range(8)]
    pager = ExpertPager(experts, PagingConfig(budget_fraction=0.5))  # 4 device slots for 8 experts
    try:
        assert pager.resident_experts() == []
        assert hooks.warmup(replace(TrainConfig(), warmup_from=TRACE), model, 0, pagers=[pager])
        steps = read_metrics(TRACE).steps[-50:]
        load = torch.tensor([sum(s.expert_load[0][e] for s in steps) for e in range(8)])
        assert set(pager.resident_experts()) == set(torch.topk(load, 4).indices.tolist())
    finally:
        pager.close()
