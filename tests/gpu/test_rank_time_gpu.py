"""The batch split's busy clock on a CUDA rank (marker ``gpu``; skipped without CUDA): timing
events on the compute stream (:class:`hetcomm.train.rank_time.DeviceClock`), not host timers."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_rank_gets_an_event_clock_ordered_on_the_compute_stream():
    from hetcomm.train.rank_time import DeviceClock, busy_clock_for

    dev = torch.device("cuda", 0)
    clock = busy_clock_for(dev)
    assert isinstance(clock, DeviceClock) and clock.source == "events"
    t0, _ = clock.read()
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(20):
        a = a @ a / 4096
    t1, ready = clock.read()
    # the read returned only once the stream had run everything enqueued before its mark
    assert torch.cuda.current_stream(dev).query()
    assert t1 > t0 >= 0.0 and ready == 0.0


@needs_cuda
def test_batch_split_measures_a_cuda_rank():
    from hetcomm.train.het_defaults import BatchSplit
    from hetcomm.train.rank_time import busy_clock_for

    dev = torch.device("cuda", 0)
    dense, moe = torch.nn.Linear(256, 256).to(dev), torch.nn.Linear(256, 256).to(dev)
    split = BatchSplit(4, 2, 0, clock=busy_clock_for(dev), every=100)  # rank 0 of two; no collective before step 100
    split.attach([moe])
    for _ in range(3):
        split.begin_step()
        split.begin_forward()
        y = moe(torch.tanh(dense(torch.randn(split.mine * 64, 256, device=dev))))
        split.end_forward()
        y.sum().backward()
        split.maybe_agree(0.01)
    assert split.measuring and split._steps == 3 and split._ema[2] > 0
    assert "no busy clock" not in split.summary()
