"""Measured speed and the paging rule on a CUDA device (marker ``gpu``; skipped without CUDA):
timing events on the compute stream, the host-to-device bandwidth, page_budget="auto"."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_event_timer_measures_device_compute_not_the_enqueue():
    from hetcomm.moe.speed import EventTimer, timer_for

    dev = torch.device("cuda", 0)
    timer = timer_for(dev)
    assert isinstance(timer, EventTimer)
    a = torch.randn(4096, 4096, device=dev)
    mark = timer.begin()
    for _ in range(20):
        a = a @ a / 4096
    timer.end(mark, rows=4096)
    (rows, seconds, learn), = timer.collect(wait=True)
    assert rows == 4096 and seconds > 0 and learn


@needs_cuda
def test_layer_on_cuda_agrees_measured_speed_and_auto_budget_does_not_page_what_fits():
    from hetcomm.moe import MoELayer
    from hetcomm.moe.paging_rule import measure_h2d_bytes_per_s

    dev = torch.device("cuda", 0)
    with torch.device(dev):
        layer = MoELayer(64, 8, speed_every=2, page_budget="auto", calibrate=False)
    assert layer.config.page_budget == 0.0  # 8 small experts fit any GPU
    for _ in range(8):  # events land a step or two late: enough measured steps for a noise estimate
        layer(torch.randn(256, 64, device=dev)).sum().backward()
    st = layer.step_stats()
    assert st.speed_measured and st.speed_local_rows_per_s > 0
    assert st.speed_differ is False and st.speed_noise[0] is not None  # one rank: a verdict, nothing differs
    assert measure_h2d_bytes_per_s(dev) > 1e8
