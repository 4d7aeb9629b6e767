"""Load-aware calibration on a badly skewed gate (one process; the global history is checked in
test_distributed.py)."""

from __future__ import annotations

import torch

from hetcomm.moe import LoadCalibrator, MoELayer

E = 32
D = 1 + E


def skewed_layer(calibrate: bool) -> MoELayer:
    """A layer whose gate sends ~92% of top-2 picks to experts 0-4 (logits = bias + N(0, 1))."""
    layer = MoELayer(D, E, k=2, calibrate=calibrate, expert=lambda d: torch.nn.Linear(d, d))
    with torch.no_grad():
        w = torch.zeros(E, D)
        w[:5, 0] = 2.2  # feature 0 is constant 1: a bias of 2.2 on the five hot experts
        w[:, 1:] = torch.eye(E)  # features 1..E are N(0, 1) noise, one per expert
        layer.gate.wg.weight.copy_(w)
    return layer


def batches(num_steps: int, num_tokens: int = 2048):
    g = torch.Generator().manual_seed(0)
    for _ in range(num_steps):
        x = torch.randn(num_tokens, D, generator=g)
        x[:, 0] = 1.0
        yield x


def run(layer: MoELayer, num_steps: int, window: int):
    layer.train()
    with torch.no_grad():
        for step, x in enumerate(batches(num_steps)):
            if step == num_steps - window:
                layer.metrics.reset()
            layer(x)
    return layer.metrics.metrics()


def test_calibrator_flattens_a_92_percent_top5_gate():
    before = run(skewed_layer(calibrate=False), 6, 5)
    assert 0.89 <= before.top5_share <= 0.95, before  # the premise: ~92% on the top 5
    assert before.min_expert_rate < 0.004
    after = run(skewed_layer(calibrate=True), 50, 20)
    assert after.top5_share <= 0.68, after
    assert after.min_expert_rate >= 0.008, after


def test_calibration_weight_is_a_frozen_parameter_and_switchable():
    layer = skewed_layer(calibrate=True)
    cal = layer.gate.calibrator
    names = dict(layer.named_parameters())
    assert "gate.calibrator.weight" in names and not names["gate.calibrator.weight"].requires_grad
    assert "gate.calibrator.history" in layer.state_dict()
    run(layer, 5, 5)
    assert cal.history[:5].min() > cal.history[5:].max()  # it saw the skew
    assert abs(cal.lag_factor() - (1 + 0.1 * float(cal.history.max() - cal.history.min()))) < 1e-6
    x = next(iter(batches(1)))
    assert not torch.allclose(cal.apply(x[:, :E]), x[:, :E])
    cal.enabled = False
    assert torch.equal(cal.apply(x[:, :E]), x[:, :E])


def test_history_update_is_the_field_recipe():
    cal = LoadCalibrator(4)
    probs_sum = torch.tensor([50.0, 30.0, 15.0, 5.0])  # 100 tokens
    cal.update(probs_sum, 100)
    expected = 0.95 * torch.ones(4) + 0.05 * probs_sum * 4 / 100
    assert torch.allclose(cal.history, expected)
    lag = 1 + 0.1 * float(expected.max() - expected.min())
    assert torch.allclose(cal.penalty(), lag * cal.weight * torch.log1p(expected))
    assert torch.equal(cal.weight, torch.full((4,), 1.5))
