"""Heterogeneity in ``hetcomm train``: the batch split, the per-rank MoE time the summary
reports and the start-up chunk measurement. Which levers are on is decided by the policy
record (:mod:`hetcomm.moe.policy`), not here.

- :class:`BatchSplit`: the per-rank sequences of a step, dealt by each rank's measured busy
  time (:mod:`hetcomm.train.rank_time`: what it computes, not what it waits) so that the
  predicted slowest rank finishes soonest; on unless ``--no-balance`` or ``--speed datasheet`` (``--speed oracle``: dealt once by the given speeds).
- :class:`MoETimeTracker`: each step's forward expert seconds of this rank, summed over layers;
  at the end one ``all_gather`` gives every step's per-rank vector, and the summary row
  ``per-rank MoE time max/mean`` is the median over steps of ``max / mean``.
- :func:`measure_chunks`: ``--chunks auto`` on CUDA/NPU (the policy's ``chunks`` lever; 1 on
  CPU ranks, where chunking was measured slower): a short measurement at the start (1, 2, 4
  chunks, 3 timed forward + backward steps each, the group's slowest rank decides) picks the count.
"""

from __future__ import annotations

import heapq
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetcomm.train.rank_time import LayerCpuTimer, ProcessClock, RankClock

__all__ = ["SPEED_SPREAD", "NOISE_SIGMAS", "device_classes", "speeds_differ",
           "BatchSplit", "BATCH_MIN_GAIN", "SATURATED", "MoETimeTracker", "measure_chunks", "CHUNK_CANDIDATES"]

#: Datasheet speeds further apart than this (max / min - 1) make a cluster "mixed".
SPEED_SPREAD = 0.10
#: A batch re-deal must shorten the step by this fraction of it (:meth:`BatchSplit.plan`).
BATCH_MIN_GAIN = 0.03
#: A per-sequence speed difference counts only beyond this many standard deviations of the
#: noisiest rank's estimate (:meth:`BatchSplit.noise`).
NOISE_SIGMAS = 3.0
#: Forward + backward seconds per forward second of the dense part.
FWD_BWD = 3.0
#: Gate 1b opens only when the busiest rank's whole process (all its threads' CPU times the
#: dense compute's dilation, :class:`~hetcomm.train.rank_time.ProcessClock`) was busy for at
#: least this fraction of the wall step: below it every rank waits most of the step and work
#: moved between them is not sure to shorten it. Not higher: the dilation of short compute
#: sections under a 20 ms CFS period understates a quota (measured 2.6 on the 910B rank's
#: 0.25-CPU quota, where 4 would be exact), so that rank measured 54% of the step.
SATURATED = 0.5
#: EMA weight of the previous windows' process busy time (one window = one agreement).
PROCESS_ALPHA = 0.5


def device_classes(cluster, world_size: int) -> List[int]:
    """``[W]`` class id per rank: ranks at one datasheet speed (``device.tflops``, else the
    model's, :func:`hetcomm.topo.compute.rank_speeds`) share an id, numbered by first appearance.
    :class:`BatchSplit` pools their measurements."""
    from hetcomm.moe.speed import speed_classes
    from hetcomm.topo.compute import rank_speeds

    return speed_classes(rank_speeds(cluster, range(world_size)))


def speeds_differ(speeds: Sequence[float]) -> bool:
    """Measured speeds more than :data:`SPEED_SPREAD` apart (max / min - 1)."""
    return bool(speeds) and max(speeds) > (1 + SPEED_SPREAD) * min(speeds)


class BatchSplit:
    """Per-rank sequences per step by each rank's measured *busy* time (:mod:`hetcomm.train.rank_time`).

    The data-parallel part of a step (embedding, attention, norms, output projection, loss:
    everything outside the MoE layers) runs on each rank's own sequences, and every rank waits
    for the slowest at the first collective; on unequal ranks equal batches leave the fast ones
    idle. Wall-clock timers cannot see that: the fast ranks' timers include their waiting. So
    each rank reads its thread's scheduler clock (:class:`~hetcomm.train.rank_time.RankClock`:
    time on a CPU, and time runnable but held back -- by other processes or a cgroup quota) and
    models its step as

        busy(b) = fixed + b * per_seq          (seconds of the rank's own work per step)

    - ``per_seq``: the forward outside the MoE layers (the model's forward minus the layers',
      timed by :class:`~hetcomm.train.rank_time.LayerCpuTimer`; no collective runs there), run
      plus ready time, times :data:`FWD_BWD` for the backward, per sequence;
    - ``busy``: the step's CPU time times the dilation ``(run + ready) / run`` of that dense
      compute (a wait loop's wake-ups add CPU time but little, and their ready time is not
      compute: only the dilation of pure compute converts CPU seconds to a rank's wall seconds);
    - ``fixed = busy - b * per_seq``: the rest (MoE experts on the rows the rank receives,
      replica and gradient syncs' copies, the optimizer): ~87% of the step on the emulated
      half-speed cluster, which is why a speed-proportional deal overshoots.

    EMAs (``alpha``) of each; every ``every`` steps one all-reduce of a ``[W, 9]``
    float64 table (:data:`TABLE_COLUMNS`; each rank fills its row, so the sum is exact) gives
    every rank the same numbers, and :meth:`plan` deals the ``W * batch_size`` sequences so the
    predicted max busy is minimal (at least one each). Gates, so that equal ranks never re-deal:

    1. only when (a) the per-sequence speeds ``1 / per_seq`` differ by more than
       :data:`SPEED_SPREAD` and by more than :data:`NOISE_SIGMAS` standard deviations of the
       noisiest rank's estimate (the ``per_seq_noise`` column; ranks that differ only in fixed work -- a replica holder and a
       weak rank on equal CPUs -- do that work in other phases of the step, between other
       collectives, so moving sequences would not shorten it: on the plain demo such a deal
       passed the gain gate and cost throughput), or (b) the whole process of the slowest rank
       (:class:`~hetcomm.train.rank_time.ProcessClock`: CPU time of all its threads times the
       dilation of its dense compute, per step over an agreement window) was busy for at least :data:`SATURATED` of
       the wall step, and the ranks' process busy times differ by more than
       :data:`SPEED_SPREAD` and by more than :data:`NOISE_SIGMAS` standard deviations of the
       noisiest window estimate: that rank's threads share one CPU budget (a cgroup quota, a
       slow core), so any work taken off it shortens the step whatever phase it is in. Then
       ``fixed`` is the process busy time minus the dense work, so the deal sees the rails',
       executor's and gloo's threads too (on the emulated half-speed cluster they are ~35% of
       the 910B rank's CPU, benchmarks/README.md);
    2. only when the predicted max busy drops by more than :data:`BATCH_MIN_GAIN` of the step;
    3. only when the previous agreement passed both gates too and proposed the same deal:
       the same rank gives the most sequences away, its share within one sequence of the
       previous proposal (noise between equal ranks proposes a different deal each time; the
       other ranks may share the rest differently -- their fixed work differs by noise, and on the emulated
       half-speed cluster that spread took every second proposal apart: 0 re-deals in 6 with
       the 910B rank's process busy 76% of the step and a predicted gain of 65 ms);
    4. a deal is a trial: the next agreement keeps it only when the group's measured wall step
       got shorter by :data:`BATCH_MIN_GAIN` at least (the gain gate 2 proposed it for), else it
       is reverted and proposals wait ``2 ** reverts`` agreements (:meth:`judge`).

    Ranks of one device class (``classes``, :func:`device_classes`: one datasheet speed) are
    dealt alike: the plan sees each rank's ``per_seq``, ``fixed`` and process
    busy time as its class's mean, so their shares differ by at most one sequence. Measured on
    the emulated half-speed cluster (3 equal CPU ranks and the 910B rank), per-rank estimates
    of equal ranks were 1.1 and 1.4-1.7 ms per sequence -- the phase a rank computes in decides
    how much it competes for the cores -- and the deal gave the "fast" one the most sequences,
    which made it the busiest process of the step (``[31, 122, 102, 1]``; benchmarks/README.md).
    A straggler among ranks of one class is therefore not found here; the cluster file names
    the classes.

    The total, and so tokens per step, never changes. Exact in expectation: rank ``r``'s mean
    loss is scaled by ``W * b_r / sum(b)`` (:meth:`loss_scale`), so after the usual ``1 / W``
    gradient average the gradients are those of the mean loss over all ``sum(b)`` sequences.
    """

    #: Columns of the agreed table, one row per rank.
    TABLE_COLUMNS = ("busy_s", "fixed_s", "per_seq_s", "num_seqs", "steps", "step_s", "per_seq_noise",
                     "process_busy_s", "process_noise")

    def __init__(self, batch_size: int, world_size: int, rank: int, *, enabled: bool = True,
                 every: int = 10, alpha: float = 0.8, fixed_speeds: Optional[Sequence[float]] = None,
                 clock: Optional[RankClock] = None, process_clock: Optional[ProcessClock] = None,
                 classes: Optional[Sequence[int]] = None) -> None:
        self.world_size, self.rank, self.every, self.alpha = world_size, rank, every, alpha
        if classes is not None and len(classes) != world_size:
            raise ValueError(f"classes has {len(classes)} entries for {world_size} ranks")
        #: ``[W]`` device class per rank (:func:`device_classes`); None: every rank its own.
        self.classes: Optional[List[int]] = list(classes) if classes is not None else None
        self.enabled = enabled and world_size > 1
        self.total = batch_size * world_size
        self.sizes: List[int] = [batch_size] * world_size
        #: ``[W]`` sequences/s (``1 / per_seq``) of the last agreement, or the datasheet's.
        self.speeds: Optional[List[float]] = None
        #: The last agreed table (``[W][9]``, :data:`TABLE_COLUMNS`), or None.
        self.table: Optional[List[List[float]]] = None
        self.changes = 0
        self.agreements = 0
        self.reverts = 0  # deals taken back by :meth:`judge`
        self._trial: Optional[Tuple[float, List[int]]] = None  # (step_s before, sizes before) of the last deal
        self._hold = 0  # agreements to wait before the next proposal
        self._ema = [0.0, 0.0, 0.0]  # busy_s, fixed_s, per_seq_s
        self._sq = 0.0  # EMA of per_seq_s squared: the noise of the estimate
        self._step_s = 0.0
        self._steps = 0  # steps observed (measured)
        self._calls = 0  # steps ended (maybe_agree calls): the agreement's schedule
        self.last_gain_s = 0.0
        #: The last trial :meth:`judge` closed: (wall step before, after, kept), or None.
        self.last_trial: Optional[Tuple[float, float, bool]] = None
        self._last: Optional[Tuple[List[int], bool]] = None  # the previous agreement's (proposal, passed)
        self.clock = clock
        self.process_clock = process_clock
        self._proc_mark: Optional[Tuple[int, float]] = None  # (steps ended, process CPU seconds) at the window's start
        self._proc = 0.0  # EMA over windows of the process busy seconds per step
        self._proc_sq = 0.0
        self._proc_windows = 0
        self._dilation = 0.0  # EMA of the dense compute's (run + ready) / run
        self._timer: Optional[LayerCpuTimer] = None
        self._t_step: Optional[Tuple[float, float]] = None
        self._t_fwd: Optional[Tuple[float, float]] = None
        self._dense: Optional[Tuple[float, float]] = None
        # Datasheet speeds (TrainConfig.speed="datasheet"): dealt once, nothing measured.
        self.fixed = fixed_speeds is not None and self.enabled
        if self.fixed:
            self.speeds = [float(v) for v in fixed_speeds]
            per_seq = [1.0 / v for v in self.speeds]
            self.sizes, self.last_gain_s, _ = self.plan(self.total, self.sizes, per_seq, [0.0] * world_size, 0.0)
        self.measuring = self.enabled and not self.fixed and self.clock is not None

    @property
    def mine(self) -> int:
        """Sequences this rank runs this step."""
        return self.sizes[self.rank]

    def loss_scale(self) -> float:
        return self.world_size * self.mine / self.total

    # -- measuring (each step, on this rank) ------------------------------------------------------
    def attach(self, moe_layers: Sequence[torch.nn.Module]) -> None:
        """Time the MoE layers' forwards, so the rest of the model's forward is the dense part."""
        if self.measuring and self._timer is None:
            self._timer = LayerCpuTimer(moe_layers, self.clock)

    def begin_step(self) -> None:
        if self.measuring:
            self._t_step = self.clock.read()

    def begin_forward(self) -> None:
        if self.measuring:
            self._t_fwd = self.clock.read()
            if self._timer is not None:
                self._timer.take()

    def end_forward(self) -> None:
        if not self.measuring or self._t_fwd is None:
            return
        run, ready = self.clock.read()
        moe_run, moe_ready = self._timer.take() if self._timer is not None else (0.0, 0.0)
        self._dense = (run - self._t_fwd[0] - moe_run, ready - self._t_fwd[1] - moe_ready)

    def observe(self, busy_s: float, dense_busy_s: float) -> None:
        """Fold one step in: ``busy_s`` of the rank's own work (wall-equivalent seconds), of which
        ``dense_busy_s`` the forward outside the MoE layers, for :attr:`mine` sequences."""
        if not self.enabled or self.fixed or busy_s <= 0 or dense_busy_s <= 0:
            return
        per_seq = FWD_BWD * dense_busy_s / self.mine
        step = [busy_s, max(0.0, busy_s - self.mine * per_seq), per_seq]
        a = self.alpha if self._steps else 0.0
        self._ema = [a * old + (1 - a) * new for old, new in zip(self._ema, step)]
        self._sq = a * self._sq + (1 - a) * per_seq * per_seq
        self._steps += 1

    def _observe_clock(self) -> None:
        if not self.measuring or self._t_step is None or self._dense is None:
            return
        run, _ = self.clock.read()
        step_run = run - self._t_step[0]
        dense_run, dense_ready = self._dense
        self._t_step = self._dense = None
        if dense_run <= 0:
            return
        # wall seconds per CPU second while this rank computes (queued, or held by a quota)
        dilation = max(1.0, (dense_run + max(0.0, dense_ready)) / dense_run)
        self._dilation = dilation if not self._dilation else self.alpha * self._dilation + (1 - self.alpha) * dilation
        self.observe(step_run * dilation, dense_run * dilation)

    # -- agreeing (collective every ``every`` observed steps) -------------------------------------
    def maybe_agree(self, step_seconds: float) -> bool:
        """End of a step that took ``step_seconds`` (wall) on this rank: fold in the step's clock
        readings, and every ``every`` observed steps agree the table and re-deal when the gates
        pass (collective on the default group). Returns True when the split changed."""
        if not self.enabled or self.fixed:
            return False
        self._observe_clock()
        a = self.alpha if self._step_s else 0.0
        self._step_s = a * self._step_s + (1 - a) * step_seconds
        # The collective's schedule counts steps, never what a rank managed to measure: every
        # rank must reach the all-reduce at the same step (a rank with nothing measured sends
        # steps = 0 in its row and nothing is dealt).
        self._calls += 1
        if self._proc_mark is None or self._calls % self.every == 0:
            self._observe_process()  # the first step ends the warm-up; then once per window
        if self._calls % self.every:
            return False
        return self.agree()

    def _observe_process(self) -> None:
        """Fold the window since the last read into the process busy EMA (per step)."""
        if self.process_clock is None or not self.measuring:
            return
        total = self.process_clock.read()
        if total is None:
            return
        if self._proc_mark is not None:
            calls0, total0 = self._proc_mark
            n = self._calls - calls0
            if n > 0 and total > total0 and self._dilation > 0:
                # wall seconds the process's work needed: its CPU at the pace its compute gets
                self.observe_process((total - total0) / n * self._dilation)
        self._proc_mark = (self._calls, total)

    def observe_process(self, busy_s: float) -> None:
        """Fold one window in: ``busy_s`` per step of the whole process (all threads' CPU times
        the dense compute's dilation, :class:`~hetcomm.train.rank_time.ProcessClock`)."""
        a = PROCESS_ALPHA if self._proc_windows else 0.0
        self._proc = a * self._proc + (1 - a) * busy_s
        self._proc_sq = a * self._proc_sq + (1 - a) * busy_s * busy_s
        self._proc_windows += 1

    def process_noise(self) -> float:
        """Relative standard deviation of the process busy EMA; 1.0 (block gate 1b) before two windows."""
        if self._proc_windows < 2 or self._proc <= 0:
            return 1.0
        var = max(0.0, self._proc_sq - self._proc * self._proc) * (1 - PROCESS_ALPHA) / (1 + PROCESS_ALPHA)
        return var ** 0.5 / self._proc

    def agree(self) -> bool:
        """One all-reduce of the ``[W, 9]`` table (:data:`TABLE_COLUMNS`), then :meth:`plan` and
        :meth:`adopt` on the identical numbers. Returns True when the split changed."""
        table = torch.zeros(self.world_size, len(self.TABLE_COLUMNS), dtype=torch.float64)  # host: scalars
        table[self.rank] = torch.tensor([*self._ema, float(self.mine), float(self._steps), self._step_s,
                                         self.noise(), self._proc, self.process_noise()], dtype=torch.float64)  # host
        if dist.is_initialized():
            dist.all_reduce(table)  # exact: each entry is one rank's number plus zeros
        rows = table.tolist()
        self.table = rows
        self.agreements += 1
        if any(r[2] <= 0 or r[4] <= 0 for r in rows):
            return False  # a rank has measured nothing yet
        per_seq = self.pooled([r[2] for r in rows])
        fixed = [r[1] for r in rows]
        self.speeds = [1.0 / p for p in per_seq]
        step_s = sum(r[5] for r in rows) / self.world_size
        if self.judge(step_s):
            return True  # the last deal did not make the step faster: reverted
        if self._hold > 0:
            self._hold -= 1
            return False
        proc = [r[7] for r in rows]
        if min(proc) > 0:  # every rank measured its whole process: its fixed work is all of it
            fixed = [max(0.0, p - r[3] * r[2]) for p, r in zip(proc, rows)]
            proc = self.pooled(proc)
        fixed = self.pooled(fixed)
        proposal, self.last_gain_s, passed = self.plan(
            self.total, self.sizes, per_seq, fixed, step_s, noise=[r[6] for r in rows],
            process_busy=proc if min(proc) > 0 else None, process_noise=[r[8] for r in rows])
        before = list(self.sizes)
        if self.adopt(proposal, passed):
            self._trial = (step_s, before)
            return True
        return False

    def pooled(self, values: Sequence[float]) -> List[float]:
        """``values`` (``[W]``) with each rank's entry replaced by its class's mean."""
        if self.classes is None:
            return list(values)
        sums: Dict[int, List[float]] = {}
        for c, v in zip(self.classes, values):
            sums.setdefault(c, []).append(v)
        return [statistics.fmean(sums[c]) for c in self.classes]

    def judge(self, step_s: float) -> bool:
        """Close the loop on measured time: the agreement after a re-deal compares the group's
        wall step (``step_s``, the mean of the ranks' EMAs: identical on every rank) with the
        one before it; a deal that did not make it faster by :data:`BATCH_MIN_GAIN` -- the gain
        gate 2 proposed it for -- is reverted, and the next proposal waits ``2 ** reverts``
        agreements (on an oversubscribed host a rank's busy time carries contention that depends
        on the phase it computes in, so a prediction can pass every gate and still be wrong; and
        "any shorter" would keep a deal that changed nothing about half the time, by the step's
        noise alone). Returns True when it reverted."""
        if self._trial is None:
            return False
        before_s, old_sizes = self._trial
        self._trial = None
        kept = step_s <= (1.0 - BATCH_MIN_GAIN) * before_s
        self.last_trial = (before_s, step_s, kept)
        if kept:
            return False
        self.sizes = old_sizes
        self.reverts += 1
        self._hold = 2 ** self.reverts
        self._last = None
        return True

    def adopt(self, proposal: List[int], passed: bool = True) -> bool:
        """Take ``proposal`` when this agreement and the previous one both passed the gates and
        proposed the same deal -- the same rank gives the most sequences away, and its share is
        within one sequence of the previous proposal; the other ranks' shares may differ: a
        real speed difference proposes it again, noise between equal ranks does not. Returns
        True when the deal changed."""
        last, self._last = self._last, (list(proposal), bool(passed))
        if not passed or proposal == self.sizes or last is None or not last[1]:
            return False
        def giver(p: Sequence[int]) -> int:  # the rank the deal takes most from (ties: the lowest)
            return max(range(len(p)), key=lambda r: (self.sizes[r] - p[r], -r))

        g = giver(proposal)
        if g != giver(last[0]) or abs(proposal[g] - last[0][g]) > 1:
            return False
        self.sizes = list(proposal)
        self.changes += 1
        self._last = None  # the next deal needs two fresh agreements
        return True

    @staticmethod
    def deal(total: int, per_seq_s: Sequence[float], fixed_s: Sequence[float]) -> List[int]:
        """``total`` sequences, at least one each, minimising ``max_r fixed_r + b_r per_seq_r``
        (greedy: each next sequence to the rank that would finish it soonest; optimal for
        increasing per-rank costs; ties to the lower rank, so every rank deals alike)."""
        W = len(per_seq_s)
        sizes = [1] * W
        heap = [(fixed_s[r] + 2 * per_seq_s[r], r) for r in range(W)]
        heapq.heapify(heap)
        for _ in range(total - W):
            _, r = heapq.heappop(heap)
            sizes[r] += 1
            heapq.heappush(heap, (fixed_s[r] + (sizes[r] + 1) * per_seq_s[r], r))
        return sizes

    def noise(self) -> float:
        """Relative standard deviation of this rank's ``per_seq`` EMA: the per-step spread
        scaled by the EMA's ``sqrt((1 - alpha) / (1 + alpha))``."""
        mean = self._ema[2]
        if mean <= 0 or self._steps < 2:
            return 0.0
        var = max(0.0, self._sq - mean * mean) * (1 - self.alpha) / (1 + self.alpha)
        return var ** 0.5 / mean

    @staticmethod
    def plan(total: int, sizes: Sequence[int], per_seq_s: Sequence[float], fixed_s: Sequence[float],
             step_s: float, noise: Optional[Sequence[float]] = None,
             process_busy: Optional[Sequence[float]] = None,
             process_noise: Optional[Sequence[float]] = None) -> Tuple[List[int], float, bool]:
        """``(proposal, predicted gain in s/step, passed)``: the deal minimising the predicted max
        busy (:meth:`deal`) when the per-sequence speeds differ by more than
        :data:`SPEED_SPREAD` and by more than :data:`NOISE_SIGMAS` x the noisiest rank's
        relative ``noise`` (its estimate's standard deviation), else equal batches; ``passed``
        when it differs from ``sizes`` and shortens the predicted max busy by more than
        :data:`BATCH_MIN_GAIN` of the step (``step_s``). Otherwise the proposal is ``sizes``.

        ``process_busy`` (``[W]`` seconds per step of each rank's whole process, with its
        relative ``process_noise``) opens the deal too (gate 1b, see the class): when the
        busiest process was busy for at least :data:`SATURATED` of ``step_s`` and the busy
        times differ by more than :data:`SPEED_SPREAD` and :data:`NOISE_SIGMAS` x the noisiest."""
        W = len(per_seq_s)
        speeds = [1.0 / p for p in per_seq_s]
        spread = max(speeds) / min(speeds) - 1
        if (speeds_differ(speeds) and spread > NOISE_SIGMAS * max(noise or [0.0])) or \
                BatchSplit.process_saturated(process_busy, process_noise, step_s, per_seq_s, noise):
            new = BatchSplit.deal(total, per_seq_s, fixed_s)
        else:
            new = [total // W + (1 if r < total % W else 0) for r in range(W)]
        t_now = max(f + b * p for b, p, f in zip(sizes, per_seq_s, fixed_s))
        t_new = max(f + b * p for b, p, f in zip(new, per_seq_s, fixed_s))
        gain = t_now - t_new
        if list(new) != list(sizes) and gain > BATCH_MIN_GAIN * step_s:
            return list(new), gain, True
        return list(sizes), gain, False

    @staticmethod
    def process_saturated(process_busy: Optional[Sequence[float]], process_noise: Optional[Sequence[float]],
                          step_s: float, per_seq_s: Optional[Sequence[float]] = None,
                          noise: Optional[Sequence[float]] = None) -> bool:
        """Gate 1b: the busiest rank's process was busy >= :data:`SATURATED` of the wall step
        ``step_s``, the ranks' process busy seconds (``[W]``) differ by more than
        :data:`SPEED_SPREAD` and :data:`NOISE_SIGMAS` x the noisiest relative noise, and (with
        ``per_seq_s``) the busiest rank also computes slower per sequence than the others'
        median by more than :data:`SPEED_SPREAD` and :data:`NOISE_SIGMAS` x its own ``noise``:
        a slow CPU budget shows in both, while on equal CPUs the busiest ranks are the ones
        with more fixed work (replica holders on the plain demo) at a normal speed, and moving
        sequences off them was measured to cost throughput (see the class, gate 1a)."""
        if not process_busy or min(process_busy) <= 0 or step_s <= 0:
            return False
        spread = max(process_busy) / min(process_busy) - 1
        if not (max(process_busy) >= SATURATED * step_s and spread > SPEED_SPREAD
                and spread > NOISE_SIGMAS * max(process_noise or [0.0])):
            return False
        if per_seq_s is None or len(per_seq_s) < 2:
            return True
        slow = max(range(len(process_busy)), key=lambda r: process_busy[r])
        others = statistics.median(p for r, p in enumerate(per_seq_s) if r != slow)
        margin = max(SPEED_SPREAD, NOISE_SIGMAS * (noise[slow] if noise else 0.0))
        return per_seq_s[slow] > (1 + margin) * others

    def summary(self) -> str:
        if not self.enabled:
            return "off"
        if self.fixed:
            sp = "/".join(f"{s:,.3g}" for s in self.speeds) + " (given: datasheet or oracle)"
            return f"sequences per rank {self.sizes} (of {self.total}); speeds {sp}"
        if not self.measuring:
            return f"sequences per rank {self.sizes} (of {self.total}); no busy clock on this device"
        if self.table is None:
            return f"sequences per rank {self.sizes} (of {self.total}); no agreement yet"
        col = lambda i, scale=1e3: "/".join(f"{r[i] * scale:.1f}" for r in self.table)  # noqa: E731
        proc = ""
        if min(r[7] for r in self.table) > 0:
            step = sum(r[5] for r in self.table) / len(self.table)
            frac = "/".join(f"{r[7] / step * 100:.0f}" for r in self.table) if step > 0 else "-"
            proc = f"; whole process busy {col(7)} ms/step ({frac}% of the step, noise {col(8, 100)}%)"
        trial = ""
        if self.last_trial is not None:
            before, after, kept = self.last_trial
            verdict = "kept" if kept else "reverted"
            trial = f"; last trial: step {before * 1e3:.1f} -> {after * 1e3:.1f} ms, {verdict}"
        return (f"sequences per rank {self.sizes} (of {self.total}); busy {col(0)} ms/step, fixed {col(1)}, "
                f"per sequence {col(2)} ms (noise {col(6, 100)}%); {self.changes} re-deals "
                f"({self.reverts} reverted, not {BATCH_MIN_GAIN:.0%} faster{trial}) in {self.agreements} "
                f"agreements (last predicted gain {self.last_gain_s * 1e3:.1f} ms/step){proc}")

    def state_dict(self) -> Dict[str, Any]:
        return {"sizes": torch.tensor(self.sizes, dtype=torch.int64),
                "ema": torch.tensor([*self._ema, float(self._steps), self._step_s, float(self._calls), self._sq],
                                    dtype=torch.float64)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.sizes = [int(v) for v in sd["sizes"].tolist()]
        busy, fixed, per_seq, steps, self._step_s, calls, self._sq = sd["ema"].tolist()
        self._ema = [busy, fixed, per_seq]
        self._steps, self._calls = int(steps), int(calls)


#: Chunk counts ``--chunks auto`` tries on a device.
CHUNK_CANDIDATES = (1, 2, 4)


def measure_chunks(layers: Sequence[torch.nn.Module], run_step: Callable[[], None],
                   candidates: Sequence[int] = CHUNK_CANDIDATES, repeats: int = 3,
                   group: Optional[dist.ProcessGroup] = None) -> Tuple[int, Dict[int, float]]:
    """Pick the chunk count of ``layers`` from a short measurement (collective when distributed).

    For each candidate every layer is set to it (``MoELayer.set_num_chunks``), ``run_step()`` (one
    forward + backward of a sample batch, no optimizer step) runs once to warm up and ``repeats``
    times timed; a candidate's time is the median, and the group's time the maximum over ranks
    (one all-reduce of ``[len(candidates)]``), so every rank picks the same, fastest, count
    (ties: the fewest chunks). The layers are left at that count.

    Returns:
        ``(num_chunks, {candidate: seconds per step})``.
    """
    times = []
    for c in candidates:
        for m in layers:
            m.set_num_chunks(int(c))
        run_step()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            run_step()
            ts.append(time.perf_counter() - t)
        times.append(statistics.median(ts))
    vec = torch.tensor(times, dtype=torch.float64)  # host: a few scalars
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    best = min(range(len(candidates)), key=lambda i: (float(vec[i]), candidates[i]))
    for m in layers:
        m.set_num_chunks(int(candidates[best]))
    return int(candidates[best]), {int(c): float(v) for c, v in zip(candidates, vec.tolist())}


class MoETimeTracker:
    """Per-step forward expert seconds of this rank (summed over MoE layers)."""

    def __init__(self) -> None:
        self.per_step: List[float] = []

    def observe(self, layers: Sequence[torch.nn.Module]) -> None:
        self.per_step.append(sum(float(m.last_stats.get("expert_s", 0.0)) for m in layers))

    def gather(self, world_size: int) -> List[List[float]]:
        """``[steps][W]`` (collective: every rank calls it once, after the last step)."""
        mine = torch.tensor(self.per_step, dtype=torch.float64)
        if world_size > 1 and dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(parts, mine)
            table = torch.stack(parts, 1)
        else:
            table = mine.unsqueeze(1)
        return table.tolist()

    @staticmethod
    def summary(table: List[List[float]]) -> str:
        from hetcomm.moe.token_split import max_over_mean

        if not table:
            return "no steps"
        skip = min(len(table) - 1, max(1, len(table) // 10))  # warm-up steps (allocation, first agreement)
        mm = [max_over_mean(row) for row in table[skip:]]
        means = [sum(row) / len(row) for row in table[skip:]]
        return (f"{statistics.median(mm):.2f} (median over steps {skip + 1}-{len(table)}; mean forward expert time "
                f"{statistics.median(means) * 1e3:.1f} ms/step per rank)")
