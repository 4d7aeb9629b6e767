"""hetcomm train's heterogeneity parts (hetcomm.train.het_defaults): --chunks parsing; the
MoE-time row; the batch split. Which levers are on: tests/moe/test_policy.py."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from hetcomm.errors import ConfigError
from hetcomm.topo.cluster import load_cluster
from hetcomm.train.het_defaults import (
    BATCH_MIN_GAIN, SATURATED, BatchSplit, MoETimeTracker, speeds_differ,
)
from hetcomm.train.loop import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cluster(name):
    return load_cluster(os.path.join(REPO, "configs", "clusters", name))


def test_no_balance_and_chunks_reach_the_config():
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli.add_parser(sub)
    args = p.parse_args(["train", "--no-balance", "--chunks", "2"])
    assert args.no_balance and cli._chunks(args.chunks) == 2
    assert p.parse_args(["train", "--token-split", "auto"]).token_split == "auto"
    assert TrainConfig().token_split is False
    with pytest.raises(ConfigError) as ei:
        TrainConfig(token_split="sometimes")
    assert ei.value.key == "train.token_split"
    with pytest.raises(ConfigError) as ei:
        cli._chunks("two")
    assert ei.value.key == "train.chunks"
    with pytest.raises(ConfigError) as ei:
        TrainConfig(chunks=0)
    assert ei.value.key == "train.chunks"


def test_moe_time_row_is_the_median_max_over_mean():
    table = [[9.0, 1.0]] + [[1.0, 1.0]] * 5 + [[3.0, 1.0]] * 6  # the first step is skipped as warm-up
    assert MoETimeTracker.summary(table).startswith("1.50 ")


def test_balancing_defaults_and_their_knobs():
    assert TrainConfig().balance == "auto" and TrainConfig().speed == "measured"
    assert speeds_differ([1.0, 1.0, 1.0, 0.5]) and not speeds_differ([1.0, 1.05, 0.98, 1.0])
    for key, value in (("balance", "sometimes"), ("speed", "guessed")):
        with pytest.raises(ConfigError) as ei:
            TrainConfig(**{key: value})
        assert ei.value.key == f"train.{key}"
    from hetcomm.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    cfg = cli.train_config(p.parse_args(["train", "--no-balance"]))
    assert cfg.balance is False and cfg.token_split is False
    assert cli.train_config(p.parse_args(["train", "--speed", "datasheet"])).speed == "datasheet"


def test_batch_split_deals_by_busy_time_only_when_it_pays():
    half = [0.01, 0.01, 0.01, 0.02]  # per-sequence seconds: rank 3 at half speed
    no_fixed = [0.0] * 4
    sizes, gain, passed = BatchSplit.plan(64, [16] * 4, half, no_fixed, step_s=0.5)
    assert passed and sum(sizes) == 64 and sizes[3] < min(sizes[:3]) and gain > BATCH_MIN_GAIN * 0.5
    # per-sequence speeds within 10% (noise between equal ranks): the deal stays
    assert BatchSplit.plan(64, [16] * 4, [0.010, 0.0105, 0.0098, 0.0101], no_fixed, step_s=0.5)[0] == [16] * 4
    # a gain below 3% of the step: the deal stays
    assert BatchSplit.plan(64, [16] * 4, [1e-6, 1e-6, 1e-6, 2e-6], no_fixed, step_s=10.0)[:3:2] == ([16] * 4, False)
    # a 40% difference, but one rank's estimate is noisier than that (std 20%): the deal stays
    noisy = BatchSplit.plan(64, [16] * 4, [0.014, 0.01, 0.01, 0.01], no_fixed, step_s=0.1, noise=[0.2, 0.01, 0.01, 0.01])
    assert noisy[0] == [16] * 4 and not noisy[2]
    assert BatchSplit.plan(64, [16] * 4, [0.014, 0.01, 0.01, 0.01], no_fixed, step_s=0.1, noise=[0.05] * 4)[2]
    # back to equal once the speeds agree again
    assert BatchSplit.plan(64, [18, 18, 18, 10], [0.01] * 4, no_fixed, step_s=0.1)[0] == [16] * 4


def test_batch_split_with_fixed_work_deals_less_than_the_speed_ratio():
    """87% fixed work (the emulated half-speed cluster): a speed-proportional deal (16 -> 10 on
    the slow rank) would leave it the slowest; minimising the predicted max takes more away."""
    per_seq = [0.005, 0.005, 0.005, 0.010]
    fixed = [0.55, 0.55, 0.55, 0.60]
    sizes = BatchSplit.deal(64, per_seq, fixed)
    busy = [f + b * p for f, b, p in zip(fixed, sizes, per_seq)]
    assert sum(sizes) == 64 and min(sizes) >= 1 and sizes[3] < 10
    # no other deal has a smaller max (one sequence moved anywhere)
    for i in range(4):
        for j in range(4):
            if i != j and sizes[i] > 1:
                alt = list(sizes)
                alt[i] -= 1
                alt[j] += 1
                assert max(f + b * p for f, b, p in zip(fixed, alt, per_seq)) >= max(busy) - 1e-12
    # equal per-sequence speeds, unequal fixed work (a weak rank without replicas): no re-deal
    assert BatchSplit.plan(64, [16] * 4, [0.005] * 4, [0.55, 0.55, 0.55, 0.40], step_s=0.6)[0] == [16] * 4


def test_batch_split_needs_two_passing_agreements_in_a_row():
    live = BatchSplit(16, 4, 0)
    assert not live.adopt([13, 20, 15, 16]) and not live.adopt([17, 14, 16, 17]) and live.sizes == [16] * 4
    deal = [18, 18, 18, 10]
    assert not live.adopt(deal, passed=False) and not live.adopt(deal) and live.sizes == [16] * 4  # first one failed a gate
    assert live.adopt([19, 17, 18, 10]) and live.sizes == [19, 17, 18, 10] and live.changes == 1
    assert not live.adopt([16] * 4)  # a new deal needs two fresh agreements
    # the other ranks' shares may move (their fixed work differs by noise); the main giver's may not
    moved = BatchSplit(16, 4, 0)
    assert not moved.adopt([21, 29, 13, 1]) and moved.adopt([25, 20, 18, 1]) and moved.sizes == [25, 20, 18, 1]
    other = BatchSplit(16, 4, 0)
    assert not other.adopt([21, 29, 13, 1]) and not other.adopt([21, 26, 13, 4])  # the giver moved by 3
    third = BatchSplit(16, 4, 0)
    assert not third.adopt([20, 20, 20, 4]) and not third.adopt([10, 22, 22, 10])  # another rank gives most
    fixed = BatchSplit(16, 4, 3, fixed_speeds=[100.0, 100.0, 100.0, 50.0])  # --speed datasheet: dealt once
    assert fixed.mine < 16 and not fixed.maybe_agree(1.0)
    off = BatchSplit(16, 4, 3, enabled=False, fixed_speeds=[100.0, 100.0, 100.0, 50.0])
    assert off.mine == 16 and off.loss_scale() == 1.0


def test_batch_split_deals_ranks_of_one_device_class_alike():
    from hetcomm.train.het_defaults import device_classes

    assert device_classes(_cluster("mixed-mini-halfspeed.yaml"), 4) == [0, 0, 0, 1]  # 100 TFLOPS x3, 50
    assert device_classes(_cluster("mixed-mini.yaml"), 4) == [0, 0, 1, 2]  # A100 x2, H800, 910B
    # Per-rank estimates of equal CPU ranks measured on that cluster's emulation (ms per sequence,
    # fixed ms): alone, the "fast" rank 1 gets the most sequences; pooled, the equal ranks tie.
    per_seq, fixed = [1.5e-3, 1.1e-3, 1.6e-3, 6e-3], [0.10, 0.10, 0.10, 0.30]
    alone = BatchSplit(64, 4, 0).deal(256, per_seq, fixed)
    assert max(alone[:3]) - min(alone[:3]) > 20
    pooled = BatchSplit(64, 4, 0, classes=[0, 0, 0, 1])
    sizes = pooled.deal(256, pooled.pooled(per_seq), pooled.pooled(fixed))
    assert sum(sizes) == 256 and max(sizes[:3]) - min(sizes[:3]) <= 1 and sizes[3] < sizes[0]
    assert pooled.pooled([1.0, 2.0, 3.0, 9.0]) == [2.0, 2.0, 2.0, 9.0]
    with pytest.raises(ValueError, match="classes has 3 entries for 4 ranks"):
        BatchSplit(64, 4, 0, classes=[0, 0, 1])


def test_batch_split_agrees_the_table_single_process():
    class Clock:  # a fake RankClock: run seconds, ready seconds
        thread_id = None
        run = ready = 0.0

        def read(self):
            return self.run, self.ready

    clock = Clock()
    split = BatchSplit(16, 1, 0, clock=clock)
    assert not split.measuring  # one rank: nothing to balance
    split = BatchSplit(16, 4, 0, clock=clock, every=2)
    assert split.measuring
    for _ in range(2):
        split.begin_step()
        split.begin_forward()
        clock.run += 0.02  # dense forward: 20 ms on a CPU, 20 ms queued (dilation 2)
        clock.ready += 0.02
        split.end_forward()
        clock.run += 0.08  # the rest of the step
        clock.ready += 0.5  # waiting for a CPU after wake-ups in wait loops: not compute
        split.maybe_agree(1.0)
    assert split.agreements == 1 and split.table is not None
    busy, fixed, per_seq, num_seqs, steps, step_s, noise, proc, proc_noise = split.table[0]
    assert proc == 0.0 and proc_noise == 1.0  # no process clock: gate 1b stays shut
    assert noise == pytest.approx(0.0, abs=1e-6)  # the same every step
    assert busy == pytest.approx(0.2) and per_seq == pytest.approx(3 * 0.04 / 16)
    assert fixed == pytest.approx(0.2 - 0.12) and (num_seqs, steps, step_s) == (16, 2, 1.0)
    assert "in 1 agreements" in split.summary()
    # a rank that measured nothing (a 0 s dense section) still reaches the all-reduce at the
    # same step as the others: the schedule counts steps, not measurements
    idle = BatchSplit(16, 4, 1, clock=Clock(), every=2)
    for _ in range(2):
        idle.begin_step()
        idle.begin_forward()
        idle.end_forward()
        idle.maybe_agree(1.0)
    assert idle.agreements == 1 and idle.table[1][4] == 0 and idle.sizes == [16] * 4


def test_batch_split_loss_scale_gives_the_global_mean_gradient():
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    xs = torch.randn(64, 5)
    (xs @ w).pow(2).mean().backward()
    want, w.grad = w.grad.clone(), None
    split = [18, 18, 18, 10]
    lo = 0
    for r, b in enumerate(split):  # each rank's scaled mean loss, then the 1/W gradient average
        bs = BatchSplit(16, 4, r)
        bs.sizes = split
        ((xs[lo:lo + b] @ w).pow(2).mean() * bs.loss_scale() / 4).backward()
        lo += b
    assert torch.allclose(w.grad, want, atol=1e-6)


def test_measure_chunks_picks_a_candidate_and_leaves_the_layers_there():
    from hetcomm.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(16, 4, k=2, calibrate=False)
    x = torch.randn(32, 16)
    ref = layer(x).detach()
    from hetcomm.train.het_defaults import measure_chunks

    def step():
        layer(x).sum().backward()

    n, times = measure_chunks([layer], step, candidates=(1, 2), repeats=1)
    assert n in (1, 2) and set(times) == {1, 2} and layer.config.num_chunks == n
    assert torch.allclose(layer(x), ref, atol=1e-6)  # chunking never changes the result


def test_compute_bound_config_loads():
    from hetcomm.train.loop import load_train_config

    cfg = load_train_config(os.path.join(REPO, "configs", "train", "compute-bound.yaml"))
    assert cfg.hidden_dim > 4 * cfg.model_dim and os.path.exists(cfg.cluster)


def test_batch_split_reverts_a_deal_that_did_not_make_the_step_faster():
    split = BatchSplit(16, 4, 0)
    deal = [18, 18, 18, 10]
    split._trial = (0.5, [16] * 4)  # as after adopting a deal at a 0.5 s step
    split.sizes = deal
    assert not split.judge(0.45) and split.sizes == deal  # 10% faster: kept
    assert split.last_trial == (0.5, 0.45, True)
    assert "step 500.0 -> 450.0 ms, kept" in _summary_after_agreement(split)
    split._trial = (0.5, [16] * 4)
    assert split.judge(0.52) and split.sizes == [16] * 4 and split.reverts == 1 and split._hold == 2
    assert not split.judge(0.1)  # nothing on trial
    # Shorter, but by less than the gain the deal was proposed for (BATCH_MIN_GAIN): noise, reverted.
    split._trial, split.sizes = (0.5, [16] * 4), deal
    assert split.judge(0.5 * (1 - BATCH_MIN_GAIN) + 1e-4) and split.sizes == [16] * 4 and split.reverts == 2
    assert split.last_trial[2] is False and "reverted" in _summary_after_agreement(split)
    split._trial, split.sizes = (0.5, [16] * 4), deal
    assert not split.judge(0.5 * (1 - BATCH_MIN_GAIN)) and split.sizes == deal  # exactly the margin: kept


def _summary_after_agreement(split: BatchSplit) -> str:
    """The summary row as after one agreement (a table of equal, measured rows)."""
    split.measuring = True  # as with a busy clock (none on this host-only split)
    split.table = [[0.1, 0.08, 0.001, 16.0, 10.0, 0.3, 0.1, 0.2, 0.05]] * split.world_size
    return split.summary()


def test_batch_split_state_round_trips():
    a = BatchSplit(16, 4, 2)
    a.sizes, a._ema, a._steps, a._calls, a._step_s, a._sq = [18, 18, 18, 10], [0.1, 0.08, 0.001], 7, 9, 0.3, 2e-6
    b = BatchSplit(16, 4, 2)
    b.load_state_dict(a.state_dict())
    assert (b.sizes, b._ema, b._steps, b._calls, b._step_s, b._sq) == (a.sizes, a._ema, 7, 9, 0.3, 2e-6)


def test_batch_split_deals_off_a_saturated_process_only():
    """Gate 1b, fed numbers like the emulated half-speed cluster's (benchmarks/README.md, per
    thread): equal per-sequence speeds, but the 910B rank's whole process is busy ~90% of the
    step (its threads under one 0.25-CPU quota) and the others ~45%: sequences leave it."""
    per_seq = [0.0012, 0.0012, 0.0012, 0.0027]  # rank 3 slower per sequence too, as measured ...
    noise = [0.45, 0.45, 0.45, 0.12]  # ... but the noisiest estimate hides it: gate 1a alone would not deal
    step = 0.59
    proc = [0.27, 0.26, 0.28, 0.53]
    fixed = [p - 16 * q for p, q in zip(proc, per_seq)]
    sizes, gain, passed = BatchSplit.plan(64, [16] * 4, per_seq, fixed, step, noise=noise,
                                          process_busy=proc, process_noise=[0.05] * 4)
    assert passed and sum(sizes) == 64 and sizes[3] == 1 and gain > BATCH_MIN_GAIN * step
    busy = [f + b * q for f, b, q in zip(fixed, sizes, per_seq)]
    assert max(busy[:3]) <= busy[3]  # the others take its sequences and still finish first
    # without the process numbers (gate 1a only) the same step keeps equal batches
    assert BatchSplit.plan(64, [16] * 4, per_seq, fixed, step, noise=noise)[0] == [16] * 4
    # the slowest process busy only 45% of the step: it waits too, moving work is not sure to help
    slack = [0.17, 0.16, 0.18, 0.45 * step]
    assert not BatchSplit.process_saturated(slack, [0.05] * 4, step)
    assert BatchSplit.plan(64, [16] * 4, per_seq, [p - 16 * q for p, q in zip(slack, per_seq)], step, noise=noise,
                           process_busy=slack, process_noise=[0.05] * 4)[0] == [16] * 4
    # equal ranks, all saturated (a loaded host): within 10%, no deal
    busy = [0.50, 0.52, 0.49, 0.53]
    assert not BatchSplit.process_saturated(busy, [0.01] * 4, step)
    # a real-looking 2x spread, but a window estimate noisier than a third of it: no deal
    assert not BatchSplit.process_saturated(proc, [0.05, 0.05, 0.05, 0.4], step)
    assert BatchSplit.process_saturated(proc, [0.05] * 4, step) and SATURATED * step <= max(proc)
    # equal CPUs (the plain demo): the busiest process holds replicas and computes at the others'
    # speed per sequence; it is busier, not slower: no deal
    assert BatchSplit.process_saturated(proc, [0.05] * 4, step, per_seq, noise)
    equal = [0.0012, 0.0011, 0.0012, 0.00125]
    assert not BatchSplit.process_saturated(proc, [0.05] * 4, step, equal, [0.1] * 4)
    assert BatchSplit.plan(64, [16] * 4, equal, fixed, step, noise=[0.1] * 4,
                           process_busy=proc, process_noise=[0.05] * 4)[0] == [16] * 4


def test_batch_split_measures_the_whole_process_per_window():
    class Clock:  # fake RankClock: run seconds, ready seconds
        thread_id = None
        run = ready = 0.0

        def read(self):
            return self.run, self.ready

    class Cpu:  # fake ProcessClock: process CPU seconds
        run = 0.0

        def read(self):
            return self.run

    main, proc = Clock(), Cpu()
    split = BatchSplit(16, 4, 3, clock=main, every=2, process_clock=proc)
    for step in range(6):
        split.begin_step()
        split.begin_forward()
        main.run += 0.01
        main.ready += 0.01  # dense compute at dilation 2 (half its wall time queued)
        split.end_forward()
        main.run += 0.05
        proc.run += 0.25 if step else 5.0  # step 1: imports, first allocations (outside every window)
        split.maybe_agree(0.6)
    # windows: step 2 (the one after the first), 3-4, 5-6: 0.25 CPU s x dilation 2 per step each
    assert split._proc_windows == 3 and split._proc == pytest.approx(0.5)
    assert split.table[3][7] == pytest.approx(0.5) and split.table[3][8] == pytest.approx(0.0, abs=1e-6)
    assert "whole process busy" not in split.summary()  # the other ranks' rows are zeros here (one process)
    for r in range(3):
        split.table[r][5], split.table[r][7] = 0.6, 0.25
    assert "whole process busy 250.0/250.0/250.0/500.0 ms/step (42/42/42/83% of the step" in split.summary()
    # a clock without schedstat: nothing folded in, gate 1b shut
    class NoStat:
        def read(self):
            return None

    off = BatchSplit(16, 4, 0, clock=Clock(), every=2, process_clock=NoStat())
    for _ in range(4):
        off.begin_step()
        off.maybe_agree(0.6)
    assert off._proc_windows == 0 and off.process_noise() == 1.0
