"""hetcomm.train.rank_time: the busy clock counts compute, not sleeping; the layer timer times
only its modules' forwards."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hetcomm.train.rank_time import LayerCpuTimer, ProcessClock, RankClock, busy_clock_for, process_clock_for


def _spin(n: int = 200_000) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def test_clock_counts_compute_and_not_sleep():
    clock = RankClock()
    run0, ready0 = clock.read()
    time.sleep(0.05)
    run1, _ = clock.read()
    _spin()
    run2, ready2 = clock.read()
    assert run1 - run0 < 0.02  # 50 ms asleep: almost no run time
    assert run2 > run1 and ready2 >= ready0
    assert clock.source in ("schedstat", "thread_time")
    clock.close()


def test_clock_falls_back_without_schedstat(tmp_path):
    bad = tmp_path / "schedstat"
    bad.write_text("not numbers\n")
    clock = RankClock(str(bad))
    assert clock.source == "thread_time" and clock.read()[1] == 0.0
    good = tmp_path / "good"
    good.write_text("2500000000 500000000 7\n")
    assert RankClock(str(good)).read()[1] == 0.5  # ready from schedstat, run from the thread CPU clock


def test_layer_timer_times_only_its_modules():
    class Fake:
        thread_id = None
        t = 0.0

        def read(self):
            return self.t, self.t / 10

    clock = Fake()
    import threading

    clock.thread_id = threading.get_ident()

    class Slow(torch.nn.Module):
        def forward(self, x):
            clock.t += 1.0
            return x

    inner, other = Slow(), Slow()
    outer = torch.nn.Sequential(inner)
    timer = LayerCpuTimer([outer, inner], clock)  # nested: counted once
    outer(torch.zeros(1))
    other(torch.zeros(1))  # not timed
    assert timer.take() == (1.0, 0.1) and timer.take() == (0.0, 0.0)
    timer.remove()
    outer(torch.zeros(1))
    assert timer.take() == (0.0, 0.0)


def test_busy_clock_is_the_scheduler_clock_on_cpu_ranks():
    assert isinstance(busy_clock_for(torch.device("cpu")), RankClock)  # CPU behaviour unchanged
    assert busy_clock_for(torch.device("meta")) is None  # no clock: the batch split keeps equal batches
    # CUDA/NPU: DeviceClock over timing events (tests/gpu/test_rank_time_gpu.py)


def test_device_clock_adds_up_the_intervals_between_reads():
    # The DeviceClock's bookkeeping on CPU, over the host timer (on a device: EventTimer).
    from hetcomm.moe.speed import HostTimer
    from hetcomm.train.het_defaults import BatchSplit
    from hetcomm.train.rank_time import DeviceClock

    clock = DeviceClock(timer=HostTimer())
    assert clock.source == "host"
    first = clock.read()
    x = torch.randn(64, 64)
    for _ in range(50):
        x = torch.tanh(x @ x)
    second = clock.read()
    assert first[1] == second[1] == 0.0 and second[0] > first[0] >= 0.0
    # the batch split measures with it as with RankClock (two ranks' split, this process is rank 0)
    dense, moe = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    split = BatchSplit(2, 2, 0, clock=clock, every=100)
    split.attach([moe])
    for _ in range(3):
        split.begin_step()
        split.begin_forward()
        y = moe(torch.tanh(dense(torch.randn(split.mine * 16, 8))))
        split.end_forward()
        y.sum().backward()
        split.maybe_agree(0.01)
    assert split.measuring and split._steps == 3 and split._ema[2] > 0  # per-sequence seconds measured


def test_process_clock_counts_another_threads_compute():
    """CPU spent on a second thread shows in the process clock (the main-thread RankClock
    misses it)."""
    clock, main = ProcessClock(), RankClock()
    p0, (m0, _) = clock.read(), main.read()
    cpu = []

    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.1:
            pass
        cpu.append(time.thread_time() - t0)

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    p1, (m1, _) = clock.read(), main.read()
    assert p1 - p0 >= cpu[0]  # the other thread's CPU
    assert m1 - m0 < 0.5 * cpu[0]  # the main thread only waited
    assert process_clock_for(torch.device("meta")) is None and isinstance(process_clock_for(torch.device("cpu")), ProcessClock)
