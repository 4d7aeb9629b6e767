"""The one rank-speed source (hetcomm.moe.speed): the noise rule, the busy clock, the agreement."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.speed import (
    MIN_SPREAD, NOISE_SIGMAS, BusyClock, CpuTimer, SpeedMeter, agree_table, differs, slow_ranks, speeds_differ,
)
from tests.backends.ranks import run_ranks
from tests.moe import speed_cases

HAS_SCHEDSTAT = BusyClock().source == "schedstat"


# -- the rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("speeds, noise, differ", [
    ([100.0, 92.0, 108.0, 97.0], [0.06] * 4, False),          # equal ranks with noise
    ([100.0, 100.0, 100.0, 50.0], [0.02] * 4, True),          # a half-speed rank, low noise
    ([100.0, 80.0, 100.0, 100.0], [0.10] * 4, False),         # 25% apart, under high noise
    ([100.0, 80.0, 100.0, 100.0], [0.02] * 4, True),          # the same spread, measured precisely
    ([100.0, 97.0], [0.0, 0.0], False),                       # exact numbers within the floor
    ([100.0, 50.0], [0.02, math.inf], False),                 # a rank without an estimate never differs
    ([100.0, 100.0, 100.0, 50.0], None, True),                # datasheet figures (exact)
])
def test_speeds_differ_only_beyond_their_noise(speeds, noise, differ):
    assert speeds_differ(speeds, noise) is differ
    assert bool(slow_ranks(speeds, noise)) is differ


def test_the_rule_is_the_floor_or_the_combined_noise():
    assert NOISE_SIGMAS == 3.0 and MIN_SPREAD == 0.05
    assert differs(1.06, 0.0, 1.0, 0.0) and not differs(1.04, 0.0, 1.0, 0.0)
    n = 0.05  # combined noise hypot(0.05, 0.05) = 0.0707: the bar is 3 x that = 21.2%
    assert not differs(1.21, n, 1.0, n) and differs(1.22, n, 1.0, n)
    assert slow_ranks([100.0, 100.0, 100.0, 50.0], [0.02] * 4) == [3]
    with pytest.raises(ConfigError) as ei:
        slow_ranks([1.0, 2.0], [0.1])
    assert ei.value.key == "moe.speed_noise"


def test_agreed_verdict_and_equal_speeds_when_nothing_differs():
    row = lambda r, s, n: [r, s, 1.0, n, 5.0]  # noqa: E731  (rows_ema, seconds_ema, room, noise, steps)
    speeds, noise, differ = agree_table([row(100, 1, 0.1), row(92, 1, 0.1), row(108, 1, 0.1), row(0, 0, -1)],
                                        [1.0] * 4)
    assert differ is False and len(set(speeds)) == 1 and speeds[0] == 100.0  # the group's pooled speed
    assert math.isinf(noise[3])
    speeds, _, differ = agree_table([row(100, 1, 0.01), row(50, 1, 0.01)], [1.0, 1.0])
    assert differ is True and speeds == (100.0, 50.0)
    assert agree_table([row(100, 1, -1), row(50, 1, -1)], [1.0, 1.0])[2] is None  # no noise yet: no verdict


def test_meter_noise_is_the_larger_of_step_deviations_and_drift_between_agreements():
    m = SpeedMeter(1, 0, [1.0], every=1, alpha=0.5)
    assert m.differ is None and m.noise == (0.0,)  # before the first agreement: the prior, no verdict
    m.observe(100, 1.0)
    m.observe(100, 1.0)
    assert m.local_noise() is None  # NOISE_MIN_STEPS measured steps first
    m.observe(100, 1.0)
    assert m.local_noise() == 0.0
    m.observe(150, 1.0)  # 50% above the estimate of 100 rows/s
    d2 = 0.5 * math.log(1.5) ** 2 / (1 - 0.5 ** 3)  # the deviations' EMA (three of them), bias-corrected
    w, w2 = 1 - 0.5 ** 4, sum((0.5 * 0.5 ** k) ** 2 for k in range(4))  # four measured steps' weights
    assert m.local_noise() == pytest.approx(math.sqrt(d2 * w2) / w)
    m.observe(0, 0.0)  # a step without rows measures nothing
    assert m.measured_steps == 4 and m.last_step == (0, 0.0)
    snap = m.agree()
    assert snap.differ is None and math.isinf(snap.noise[0])  # the drift needs a second agreement
    assert snap.seconds_per_step == (pytest.approx(m.seconds_ema),)
    m.observe(100, 100 / m.local_speed() / 4)  # the estimate moves: four times faster this step
    moved = math.log(m.local_speed() / snap.own_rows_per_s[0])
    snap = m.agree()
    assert snap.differ is False and snap.agreements == 2  # one rank: nothing differs
    assert snap.noise == (pytest.approx(max(m.local_noise(), abs(moved) / math.sqrt(2))),)


# -- the clock -------------------------------------------------------------------------------------
def test_cpu_timer_counts_compute_not_sleeping():
    timer, a = CpuTimer(), torch.randn(256, 256)
    t = time.perf_counter()
    mark = timer.begin()
    time.sleep(0.3)
    spent = time.thread_time() + 0.05
    while time.thread_time() < spent:
        a = a * 1.0
    timer.end(mark, 7)
    wall = time.perf_counter() - t
    (rows, busy, learn), = timer.collect()
    assert rows == 7 and learn and 0.05 <= busy < wall - 0.25  # the sleep is not busy time


@pytest.mark.skipif(not HAS_SCHEDSTAT, reason="needs /proc/thread-self/schedstat (CONFIG_SCHEDSTATS)")
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_busy_clock_counts_the_run_queue_wait_of_a_shared_core():
    """A thread sharing its core with a spinning process computes half the time it is busy: its
    CPU time alone (what a thread clock reads) would call it twice as fast as it is."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    old = os.sched_getaffinity(0)
    spinner = subprocess.Popen([sys.executable, "-c", "import os,sys\nos.sched_setaffinity(0, {%d})\n"
                                "print('go', flush=True)\nwhile True: pass" % cpu], stdout=subprocess.PIPE)
    try:
        assert spinner.stdout.readline().strip() == b"go"
        os.sched_setaffinity(0, {cpu})
        clock = BusyClock()
        run0, ready0 = clock.parts()
        t = time.perf_counter()
        spent = time.thread_time() + 0.3
        while time.thread_time() < spent:
            pass
        run1, ready1 = clock.parts()
        wall = time.perf_counter() - t
    finally:
        os.sched_setaffinity(0, old)
        spinner.kill()
        spinner.wait()
    run, ready = run1 - run0, ready1 - ready0
    assert ready > 0.3 * run  # queued behind the spinner for a good share of the section
    assert run + ready >= 0.8 * wall  # what the section took: busy, never blocked


@pytest.mark.timeout(240)
def test_a_rank_that_waits_in_a_collective_does_not_read_slow():
    res = run_ranks(speed_cases.wait_in_a_collective, world_size=2, backend="gloo", cluster=None, timeout=200)
    r1 = res[1]
    # Rank 1's timed sections held the wait for rank 0's 0.2 s sleep (on average: the two ranks'
    # compute takes the same time, however loaded the host); its busy time did not.
    unseen = [w - b for w, b in zip(r1["wall"], r1["busy"])]
    assert sum(unseen) / len(unseen) > 0.1, unseen
    # (Whether the two then differ is for the noise rule: a loaded host can slow one rank's core.)
    assert res[0]["differ"] is not None
    assert all(r["speeds"] == res[0]["speeds"] and r["noise"] == res[0]["noise"] for r in res)


@pytest.mark.timeout(400)
def test_four_equal_ranks_agree_one_snapshot_and_one_decision():
    # Whether four processes on a shared host read equal is the host's load, not the code's: the
    # count of runs that move nothing on equal ranks is a benchmark (benchmarks/het_equal.py).
    # Here: the decision comes at the second agreement, and every rank takes the same one.
    res = run_ranks(speed_cases.equal_ranks_cold_move, world_size=4, backend="gloo", cluster=None, timeout=360)
    for r in res:
        assert r["due_at"] == 10 and r["agreements"] == 2, r
        for key in ("speeds", "noise", "differ", "own", "agreements", "owner", "moved", "rows"):
            assert r[key] == res[0][key], (key, r[key], res[0][key])  # identical on every rank
    assert res[0]["differ"] is not None and all(0 < n < math.inf for n in res[0]["noise"])
    if res[0]["differ"] is False:  # equal within noise: one speed, and nothing moved
        assert len(set(res[0]["speeds"])) == 1 and res[0]["moved"] == [] and "nothing to move" in res[0]["rows"][0]


@pytest.mark.timeout(240)
def test_the_agreement_rides_in_the_load_all_reduce():
    res = run_ranks(speed_cases.agreement_collectives, world_size=2, backend="gloo", cluster=None, timeout=200)
    stats = 2 * 4 + 1  # the load statistics: probs and picks of 4 experts, the token count
    for r in res:
        assert r["agreements"] == 2, r
        # one all-reduce per forward, the [2, 7] table inside it at the 5th and 10th
        assert r["calls"] == [(stats,)] * 4 + [(stats + 14,)] + [(stats,)] * 4 + [(stats + 14,)], r["calls"]
        assert all(t > 0 for t in r["seconds"]) and all(v > 0 for v in r["rows"]), r
        # the layer's forward holds its expert compute: the experts' share of it is below 1
        assert all(0 < e < f for e, f in zip(r["seconds"], r["forward"])), r
        for key in ("seconds", "rows", "forward"):
            assert r[key] == res[0][key], key  # the same table on both ranks


def test_given_speeds_have_their_verdict_and_are_still_timed():
    m = SpeedMeter(2, 0, [100.0, 50.0], every=0)  # --speed datasheet / oracle: never agreed
    assert m.differ is True and m.agreed.slow() == [1] and not m.measured
    assert SpeedMeter(2, 0, [100.0, 97.0], every=0).differ is False  # exact figures within the floor
    mark = m.begin(torch.device("cpu"))
    spent = time.thread_time() + 0.01
    while time.thread_time() < spent:
        pass
    m.end(mark, 10)
    assert not m.finish_step()  # no agreement, no collective
    assert m.last_step[0] == 10 and m.last_step[1] >= 0.01  # the probe's and the metrics' busy seconds
    assert m.speeds == (100.0, 50.0)


def _spin(meter: SpeedMeter, seconds: float, rows: int, learn: bool = True) -> None:
    mark = meter.begin(torch.device("cpu"))
    spent = time.thread_time() + seconds
    while time.thread_time() < spent:
        pass
    meter.end(mark, rows, learn=learn)


def test_sections_that_do_not_learn_are_busy_time_but_not_speed():
    """A holder's replica rows (``learn=False``) read slow per row on a CPU rank: they count in
    the busy seconds the summary and the metrics show, and not in the speed or the probe's window."""
    m = SpeedMeter(1, 0, [1.0], every=1)
    _spin(m, 0.01, 100)
    _spin(m, 0.02, 10, learn=False)  # ten times slower per row than the owner's section
    m.finish_step()
    rows, secs = m.last_speed_step
    # busy time is at least the CPU each section spun (a loaded host only adds its wait)
    assert rows == 100 and secs >= 0.01 and m.last_step[0] == 110
    assert m.last_step[1] >= secs + 0.02  # the replica section's seconds are busy time
    assert m.local_speed() == pytest.approx(rows / secs)  # the owner's rows alone
    assert m.agreed.own_rows_per_s == (pytest.approx(rows / secs),)
    assert m.agreed.seconds_per_step == (pytest.approx(m.last_step[1]),)  # busy: both sections
    _spin(m, 0.01, 10, learn=False)  # a step of replica rows only: busy, nothing learned
    m.finish_step()
    assert m.measured_steps == 1 and m.last_speed_step == (0, 0.0) and m.last_step[0] == 10
