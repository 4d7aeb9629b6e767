"""page_budget="auto" and the copies-can-hide rule (hetcomm.moe.paging_rule)."""

from __future__ import annotations

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe import MoELayer
from hetcomm.moe.paging_rule import auto_page_budget, copies_can_hide, hide_threshold_tokens


def test_auto_pages_only_when_the_experts_do_not_fit():
    gib = 1 << 30
    assert auto_page_budget(10 * gib, 8, None) == 0.0  # CPU rank: never by itself
    assert auto_page_budget(1 * gib, 8, 80 * gib) == 0.0  # 4 GiB of training state fits in 64 GiB
    # 40 GiB of parameters -> 160 GiB with grads and Adam; 0.8 x 80 GiB fits 40% of them.
    assert auto_page_budget(40 * gib, 8, 80 * gib) == pytest.approx(0.4)
    assert auto_page_budget(400 * gib, 8, 80 * gib) == pytest.approx(1 / 8)  # at least one expert


def test_the_hide_rule_is_flops_over_bandwidth():
    # A100 over PCIe Gen4: 312 TFLOPS / 25 GB/s = 12,480 tokens per expert (the issue's ~12.5k).
    assert hide_threshold_tokens(312e12, 25e9) == pytest.approx(12480)
    assert copies_can_hide(13000, 312e12, 25e9) is True
    assert copies_can_hide(12000, 312e12, 25e9) is False
    assert copies_can_hide(1e9, 312e12, None) is None  # no host-to-device link to measure


def test_layer_auto_on_cpu_does_not_page_and_an_explicit_budget_still_does():
    layer = MoELayer(8, 4, page_budget="auto", calibrate=False)
    assert layer.page_budget_auto and layer.config.page_budget == 0.0
    layer(torch.randn(16, 8)).sum().backward()
    assert layer.pager is None and layer.step_stats().page_can_hide is None
    paged = MoELayer(8, 4, page_budget=0.5, calibrate=False)
    paged(torch.randn(16, 8)).sum().backward()
    assert paged.pager is not None
    assert paged.step_stats().page_can_hide is None  # CPU rank: host and device are one memory
    with pytest.raises(ConfigError) as ei:
        MoELayer(8, 4, page_budget="sometimes")
    assert ei.value.key == "moe.page_budget"
