"""Each rank's measured compute speed, agreed across the expert-parallel group: the one source.

The datasheet (:mod:`hetcomm.topo.compute`) says what a device *should* do; CPU processes standing
in for GPUs, a throttled GPU or a 910B on older firmware do something else. Every consumer of
per-rank speed reads :class:`SpeedMeter` (``MoELayer.speed``): the initial placement of a
restarted job (the speeds travel in the snapshot headers and the membership record), the
replica holders, the per-step token split, the cold move, the migration balancer, the health
probe, the step records and the training summary. Whether speeds differ is decided in one place,
:func:`slow_ranks` (a noise test), for all of them.

**The clock.** A rank's expert computations are timed with what the rank *computes*, never what
it waits for:

- CPU ranks: :class:`BusyClock`, the thread's CPU time (``time.thread_time``) plus its run-queue
  wait (``ready``, from ``/proc/thread-self/schedstat``: runnable but not running -- queued
  behind other processes, or held back by a cgroup's CPU quota). A section of pure compute takes
  ``run + ready`` of wall time; a sleep or a blocked wait in a collective is in neither.
- CUDA/NPU ranks: :class:`EventTimer`, a pair of timing events on the compute stream, read once
  they completed (``event.query()``, never a sync on the hot path): a measurement lands a step
  or two late, which the EMA does not mind. ``torch_npu`` is imported only on an NPU rank.

**Per rank.** A step's rows and seconds are folded into EMAs (``alpha``); this rank's speed is
``rows_ema / seconds_ema`` (rows/s). Only the sections that run the way every rank's do teach the
speed: an owner's experts on the rows the dispatch delivered. A holder's replica rows, computed
while the dispatch is still in flight (its rail threads share the cores) and in a few small calls
(fixed costs spread over few rows), read several times slower per row on a CPU rank; counted, they
would make the ranks that hold copies look slow. Their seconds count as busy time
(``busy_seconds_ema``, :attr:`SpeedSnapshot.seconds_per_step`) and not toward the speed
(:meth:`SpeedMeter.end` with ``learn=False``). Its *noise* is the relative standard deviation of that
estimate, the larger of two spreads: an EMA of the squared deviation of each step's speed from
the estimate, in logarithms (``ln(step / estimate)``: a step the scheduler stalled tenfold counts
as much as one ten times faster, not a hundred times more), times the EMA's averaging of
independent steps (the square root of its bias-corrected weights' squared sum:
``sqrt((1 - alpha) / (1 + alpha))`` after many steps, more after few); and the drift of the
estimate between agreements (a load that comes and goes over many steps moves it more than the
step-to-step spread says). It is known from the second agreement with measurements on, once
:data:`NOISE_MIN_STEPS` steps were measured.

**Agreed.** Every ``every`` steps each rank contributes one row ``(rows_ema, seconds_ema, room,
noise, steps, forward_seconds_ema, busy_seconds_ema)`` to one all-reduce of a ``[W, 7]`` float64 table (riding in the layer's load
all-reduce where it runs, :meth:`SpeedMeter.agreement_row`; zeros elsewhere: the sum is
exact), so every rank holds
the identical :class:`SpeedSnapshot` afterwards and the decisions taken from it are identical
without another message. Before the first agreement the vector is the *prior* (datasheet TFLOPS, or
equal speeds without a cluster), in arbitrary units; a rank that measured nothing yet is given its
prior times the median measured/prior ratio.

**The rule.** Rank ``s`` is slower than rank ``f`` when ``speed_f / speed_s - 1`` exceeds
``max(MIN_SPREAD, NOISE_SIGMAS * hypot(noise_f, noise_s))`` (:func:`differs`); the speeds of a
group *differ* when any rank is slower than another (:func:`slow_ranks`). A rank without a
noise estimate never differs.

**Pooled.** Ranks of one device class (one prior speed: ``speed_pool="device"``, the default)
whose measurements agree by the rule share one speed, their summed rows over their summed
seconds; a class whose members differ keeps each rank's own, so a straggler inside a class is
seen. When no rank differs from another, every rank gets the group's pooled speed: consumers
then see equal speeds and act on none of the noise.

Knobs (``MoEConfig``): ``speed_every`` (steps between agreements, 0 = never agree: the prior is
kept), ``speed_alpha`` (EMA decay), ``speed_pool`` (``"device"``; ``"rank"``: never pool).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetcomm.errors import ConfigError

__all__ = ["NOISE_SIGMAS", "MIN_SPREAD", "NOISE_MIN_STEPS", "differs", "slow_ranks", "speeds_differ",
           "speed_classes", "BusyClock", "ComputeTimer", "CpuTimer", "EventTimer", "timer_for", "SpeedSnapshot",
           "SpeedMeter", "agree_table", "SCHEDSTAT"]

#: Speeds differ only beyond this many standard deviations of their combined relative noise.
NOISE_SIGMAS = 3.0
#: ... and never below this relative spread (estimates of a few steps understate the noise).
MIN_SPREAD = 0.05
#: Measured steps before a rank's noise is known (two deviations from its running estimate).
NOISE_MIN_STEPS = 3
#: Per-thread scheduler statistics: ``run_ns ready_ns timeslices``.
SCHEDSTAT = "/proc/thread-self/schedstat"
#: Columns of the agreed table, one row per rank.
TABLE_COLUMNS = ("rows_ema", "seconds_ema", "room", "noise", "steps", "forward_seconds_ema", "busy_seconds_ema")


# -- the rule ------------------------------------------------------------------------------------
def differs(fast: float, fast_noise: float, slow: float, slow_noise: float) -> bool:
    """Whether ``slow`` is slower than ``fast`` beyond noise: ``fast / slow - 1`` exceeds
    ``max(MIN_SPREAD, NOISE_SIGMAS * hypot(fast_noise, slow_noise))``.

    Args:
        fast, slow: two speeds (any positive unit).
        fast_noise, slow_noise: their relative standard deviations (0 for exact numbers such as
            datasheet figures; ``inf`` when unknown: then nothing differs).
    """
    if not (fast > 0 and slow > 0) or math.isinf(fast_noise) or math.isinf(slow_noise):
        return False
    return fast / slow - 1.0 > max(MIN_SPREAD, NOISE_SIGMAS * math.hypot(fast_noise, slow_noise))


def slow_ranks(speeds: Sequence[float], noise: Optional[Sequence[float]] = None) -> List[int]:
    """Ranks slower than some other rank by :func:`differs`, ascending; none when the speeds agree
    within their noise (equal ranks).

    Args:
        speeds: ``[W]`` speed of each rank (the agreed vector, or datasheet figures).
        noise: ``[W]`` relative noise of each (:attr:`SpeedSnapshot.noise`); None: exact numbers.
    """
    n = [0.0] * len(speeds) if noise is None else [float(v) for v in noise]
    if len(n) != len(speeds):
        raise ConfigError(f"{len(speeds)} speeds but {len(n)} noise figures; give one of each per rank",
                          key="moe.speed_noise")
    sp = [float(v) for v in speeds]
    return [s for s in range(len(sp)) if any(differs(sp[f], n[f], sp[s], n[s]) for f in range(len(sp)) if f != s)]


def speeds_differ(speeds: Sequence[float], noise: Optional[Sequence[float]] = None) -> bool:
    """Some rank is slower than another beyond noise (:func:`slow_ranks` is not empty)."""
    return bool(slow_ranks(speeds, noise))


def speed_classes(speeds: Sequence[float]) -> List[int]:
    """``[W]`` class id per rank: ranks of one (datasheet) speed share an id, numbered by first
    appearance (``[100, 100, 50]`` -> ``[0, 0, 1]``)."""
    first: Dict[float, int] = {}
    return [first.setdefault(float(s), len(first)) for s in speeds]


# -- the clock -----------------------------------------------------------------------------------
class BusyClock:
    """``run_s + ready_s`` of the thread that created it, monotonic (seconds).

    ``run_s`` from ``time.thread_time()`` (schedstat's run field is brought up to date only at
    scheduler ticks, so a short section would read 0); ``ready_s`` from schedstat through a
    descriptor opened once (``/proc/self/task/TID/schedstat`` on kernels without
    ``thread-self``). A thread that reads it is running, so every wait for a CPU it had is
    already added. Without schedstat (other systems, a kernel without ``CONFIG_SCHEDSTATS``)
    ``ready_s`` stays 0 (:attr:`source` says ``thread_time``).

    Args:
        path: the schedstat file (tests pass a fake one).
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self._fd: Optional[int] = None
        for candidate in ([path] if path else [SCHEDSTAT, f"/proc/self/task/{threading.get_native_id()}/schedstat"]):
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:
                continue
            if self._ready(fd) is not None:
                self._fd = fd
                break
            os.close(fd)
        #: ``schedstat`` or ``thread_time``: where the numbers come from.
        self.source = "schedstat" if self._fd is not None else "thread_time"

    @staticmethod
    def _ready(fd: int) -> Optional[float]:
        try:
            parts = os.pread(fd, 128, 0).split()
            int(parts[0])
            return int(parts[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def parts(self) -> Tuple[float, float]:
        """``(run_s, ready_s)`` so far; call it on the thread it measures (the creating one)."""
        ready = self._ready(self._fd) if self._fd is not None else None
        return time.thread_time(), (ready or 0.0)

    def read(self) -> float:
        """Busy seconds so far: ``run_s + ready_s``."""
        run, ready = self.parts()
        return run + ready

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a descriptor per clock: give it back
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


class ComputeTimer:
    """Times expert computations on one device: ``mark = begin()`` ... ``end(mark, rows, learn)``;
    ``collect()`` returns the ``(rows, seconds, learn)`` of the computations whose timing is known
    (``learn``: the section teaches the speed, :meth:`SpeedMeter.end`)."""

    def begin(self) -> Any:
        raise NotImplementedError

    def end(self, mark: Any, rows: int, learn: bool = True) -> None:
        raise NotImplementedError

    def collect(self, wait: bool = False) -> List[Tuple[int, float, bool]]:
        raise NotImplementedError


class CpuTimer(ComputeTimer):
    """:class:`BusyClock` around the call, one clock per calling thread: right where compute is
    synchronous on the calling thread (CPU ranks)."""

    def __init__(self) -> None:
        self._done: List[Tuple[int, float, bool]] = []
        self._local = threading.local()

    def clock(self) -> BusyClock:
        """The calling thread's clock (made at its first use)."""
        c = getattr(self._local, "clock", None)
        if c is None:
            c = self._local.clock = BusyClock()
        return c

    def begin(self) -> float:
        return self.clock().read()

    def end(self, mark: float, rows: int, learn: bool = True) -> None:
        self._done.append((int(rows), max(0.0, self.clock().read() - mark), bool(learn)))

    def collect(self, wait: bool = False) -> List[Tuple[int, float, bool]]:
        done, self._done = self._done, []
        return done


class EventTimer(ComputeTimer):
    """Timing events on the device's current stream (the compute stream the experts run on).

    ``module`` is ``torch.cuda`` or ``torch_npu``'s ``torch.npu``: both expose
    ``Event(enable_timing=True)``, ``.record()``, ``.query()`` and ``.elapsed_time()`` (ms).
    Imported lazily by :func:`timer_for`; nothing here runs on a CPU-only host.
    """

    def __init__(self, module: Any, device: torch.device) -> None:
        self._module, self._device = module, device
        self._pending: List[Tuple[Any, Any, int, bool]] = []

    def begin(self) -> Any:
        ev = self._module.Event(enable_timing=True)
        ev.record(self._module.current_stream(self._device))
        return ev

    def end(self, mark: Any, rows: int, learn: bool = True) -> None:
        ev = self._module.Event(enable_timing=True)
        ev.record(self._module.current_stream(self._device))
        self._pending.append((mark, ev, int(rows), bool(learn)))

    def collect(self, wait: bool = False) -> List[Tuple[int, float, bool]]:
        done, keep = [], []
        for start, stop, rows, learn in self._pending:
            if wait:
                stop.synchronize()
            if stop.query():
                done.append((rows, start.elapsed_time(stop) / 1e3, learn))
            else:
                keep.append((start, stop, rows, learn))
        self._pending = keep
        return done


def timer_for(device: torch.device) -> ComputeTimer:
    """The timer that measures compute on ``device``: events on CUDA/NPU, the busy clock on CPU."""
    if device.type == "cuda":
        return EventTimer(torch.cuda, device)
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return EventTimer(torch.npu, device)  # type: ignore[attr-defined]
    return CpuTimer()


# -- the agreed snapshot -------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeedSnapshot:
    """The group's agreed speeds: identical on every rank after each agreement.

    Attributes:
        rows_per_s: ``[W]`` the speed every consumer reads (pooled as the module says; the prior
            before the first agreement).
        noise: ``[W]`` each rank's relative noise (``inf``: no estimate yet; 0 for the prior).
        differ: whether some rank is slower than another beyond noise (:func:`slow_ranks`);
            None before an agreement with a noise estimate (given speeds, ``every == 0``: known from the start).
        measured: some rank has measured (else ``rows_per_s`` is the prior).
        agreements: agreements so far.
        own_rows_per_s: ``[W]`` each rank's own measured speed, unpooled (0: none yet).
        seconds_per_step: ``[W]`` each rank's EMA of busy expert seconds per measured step, every
            timed section (replica rows too).
        forward_seconds: ``[W]`` each rank's EMA of the layer's forward wall seconds (gate,
            exchanges and experts; 0 where the layer does not report it).
        room: ``[W]`` the rank has room for hot-expert replicas.
    """

    rows_per_s: Tuple[float, ...]
    noise: Tuple[float, ...]
    differ: Optional[bool]
    measured: bool = False
    agreements: int = 0
    own_rows_per_s: Tuple[float, ...] = ()
    seconds_per_step: Tuple[float, ...] = ()
    room: Tuple[bool, ...] = field(default=())
    forward_seconds: Tuple[float, ...] = ()

    def slow(self) -> List[int]:
        """The slow ranks by the rule (:func:`slow_ranks`): none before a verdict."""
        return slow_ranks(self.rows_per_s, self.noise) if self.differ else []


def agree_table(rows: Sequence[Sequence[float]], prior: Sequence[float],
                classes: Optional[Sequence[int]] = None) -> Tuple[Tuple[float, ...], Tuple[float, ...], Optional[bool]]:
    """``(speeds, noise, differ)`` from the agreed ``[W, 7]`` table (:data:`TABLE_COLUMNS`).

    Measured ranks get ``rows_ema / seconds_ema``; with ``classes``, the members of a class whose
    measurements agree (:func:`speeds_differ` is False among them) get the class's summed rows
    over summed seconds, members that measured nothing included; ranks still without a speed get
    their prior times the median measured/prior ratio. When no rank is slower than another by
    the rule, every rank gets the group's summed rows over summed seconds. ``differ`` is None
    while no rank has a noise estimate."""
    W = len(prior)
    meas = [r[0] > 0 and r[1] > 0 for r in rows]
    if not any(meas):
        return tuple(float(p) for p in prior), (0.0,) * W, None
    noise = [float(r[3]) if m and r[3] >= 0 else math.inf for m, r in zip(meas, rows)]
    own: List[Optional[float]] = [r[0] / r[1] if m else None for m, r in zip(meas, rows)]
    speed = list(own)
    for c in sorted(set(classes)) if classes is not None else ():
        members = [i for i in range(W) if classes[i] == c and meas[i]]
        if members and not speeds_differ([own[i] for i in members], [noise[i] for i in members]):
            pooled = sum(rows[i][0] for i in members) / sum(rows[i][1] for i in members)
            for i in range(W):
                if classes[i] == c:
                    speed[i] = pooled
    ratios = [speed[i] / prior[i] for i in range(W) if speed[i] is not None]
    scale = statistics.median(ratios)
    full = [s if s is not None else prior[i] * scale for i, s in enumerate(speed)]
    if all(math.isinf(n) for n in noise):
        return tuple(full), tuple(noise), None
    if speeds_differ(full, noise):
        return tuple(full), tuple(noise), True
    group = sum(r[0] for r, m in zip(rows, meas) if m) / sum(r[1] for r, m in zip(rows, meas) if m)
    return (group,) * W, tuple(noise), False


# -- the meter -----------------------------------------------------------------------------------
class SpeedMeter:
    """This rank's EMA of expert rows, busy seconds and noise, and the group's agreed snapshot.

    Args:
        world_size, rank: the group's size and this rank's index in it.
        prior: ``[W]`` speeds before the first measurement (datasheet TFLOPS; any unit).
        group: the process group of the agreement (None: the default group).
        every: steps between agreements (one all-reduce); 0 = never agree (keep the prior; the step is still timed).
        alpha: EMA decay per step.
        room: this rank has room for hot-expert replicas (allowed to hold them and its own
            experts fit its device, i.e. it does not page); agreed with the speeds into
            :attr:`room`, which the replica holders' choice reads.
        classes: ``[W]`` class id per rank: ranks of one class pool their measurements when they
            agree (:func:`agree_table`); None: every rank its own.
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        prior: Sequence[float],
        group: Optional[dist.ProcessGroup] = None,
        *,
        every: int = 10,
        alpha: float = 0.8,
        room: bool = True,
        classes: Optional[Sequence[int]] = None,
    ) -> None:
        if len(prior) != world_size or not all(float(s) > 0 for s in prior):
            raise ConfigError(
                f"speed prior must be {world_size} positive numbers (one per rank), got {list(prior)}", key="moe.speed_prior"
            )
        if not isinstance(every, int) or every < 0:
            raise ConfigError(f"must be an integer >= 0 (0 = keep the prior), got {every!r}", key="moe.speed_every")
        if not 0.0 <= alpha < 1.0:
            raise ConfigError(f"must be in [0, 1), got {alpha!r}", key="moe.speed_alpha")
        if classes is not None and len(classes) != world_size:
            raise ConfigError(f"needs one device class per rank ({world_size}), got {list(classes)}", key="moe.speed_pool")
        self.classes: Optional[Tuple[int, ...]] = tuple(classes) if classes is not None else None
        self.world_size, self.rank, self.group = world_size, rank, group
        self.every, self.alpha = every, alpha
        self.prior: Tuple[float, ...] = tuple(float(s) for s in prior)
        #: This rank's room flag (agreed into :attr:`SpeedSnapshot.room`).
        self.room_here = bool(room)
        #: The prior is the truth (:meth:`set_prior` with ``given``): agreements carry only the magnitudes.
        self.given = False
        #: The agreed snapshot every consumer reads (the prior until the first agreement).
        self.agreed = self._prior_snapshot((True,) * world_size)
        self.steps = 0
        #: Steps that measured rows on this rank.
        self.measured_steps = 0
        #: This step's ``(rows, busy seconds)`` on this rank, every timed section.
        self.last_step: Tuple[int, float] = (0, 0.0)
        #: This step's ``(rows, seconds)`` of the sections that teach the speed (the health probe's
        #: window reads it).
        self.last_speed_step: Tuple[int, float] = (0, 0.0)
        self._rows = self._secs = self._w = 0.0  # EMAs from 0 and their weight (bias correction)
        self._busy = self._busy_w = 0.0  # EMA of every section's seconds, and its weight
        self._w2 = 0.0  # sum of the EMA's squared step weights (its averaging of independent steps)
        self._var = self._var_w = 0.0
        self._agreed_local: Optional[float] = None  # this rank's estimate at the previous agreement
        self._drift = self._drift_w = 0.0  # EMA of squared log-changes between agreements
        self._fwd_secs = self._fwd_w = 0.0  # EMA of the layer's forward wall seconds, and its weight
        self._timer: Optional[ComputeTimer] = None
        self._timer_device: Optional[torch.device] = None

    # -- the agreed view (attributes the consumers read) --------------------------------------
    @property
    def speeds(self) -> Tuple[float, ...]:
        return self.agreed.rows_per_s

    @property
    def noise(self) -> Tuple[float, ...]:
        return self.agreed.noise

    @property
    def differ(self) -> Optional[bool]:
        return self.agreed.differ

    @property
    def measured(self) -> bool:
        return self.agreed.measured

    @property
    def agreements(self) -> int:
        return self.agreed.agreements

    @property
    def room(self) -> Tuple[bool, ...]:
        return self.agreed.room

    # -- measuring ---------------------------------------------------------------------------
    def set_prior(self, speeds: Sequence[float], given: bool = False) -> None:
        """Replace the prior (and the vector in force, until the next agreement).

        Args:
            speeds: ``[W]`` positive speeds, any unit.
            given: the speeds are the truth (an emulation's known factors): they and their
                verdict stay in force, and agreements (with ``every > 0``) only bring the
                measured magnitudes (:attr:`SpeedSnapshot.seconds_per_step`).
        """
        if len(speeds) != self.world_size or not all(float(s) > 0 for s in speeds):
            raise ConfigError(
                f"speed prior must be {self.world_size} positive numbers, got {list(speeds)}", key="moe.speed_prior"
            )
        self.prior = tuple(float(s) for s in speeds)
        self.given = bool(given)
        if not self.measured:
            self.agreed = self._prior_snapshot(self.agreed.room)

    def _prior_snapshot(self, room: Tuple[bool, ...]) -> SpeedSnapshot:
        """The prior as the snapshot in force: no verdict while measurements are to come; given
        speeds (``every == 0``: never agreed, or :attr:`given`) are exact, and their verdict holds
        from the start."""
        differ = speeds_differ(self.prior) if self.every == 0 or self.given else None
        return SpeedSnapshot(self.prior, (0.0,) * self.world_size, differ, room=room)

    def begin(self, device: torch.device) -> Any:
        """Start timing one expert computation on ``device`` (returns the mark for :meth:`end`).
        Timed with ``every == 0`` too: the step's busy seconds (:attr:`last_step`) feed the
        health probe and the metrics even when the speeds are given."""
        if self._timer is None or self._timer_device != device:
            self._timer, self._timer_device = timer_for(device), device
        return self._timer.begin()

    def end(self, mark: Any, rows: int, learn: bool = True) -> None:
        """Stop timing the computation begun at ``mark``, which processed ``rows`` rows.

        ``learn=False``: its seconds are busy time but do not teach the speed (a holder's replica
        rows; the module docstring says why)."""
        if mark is not None and self._timer is not None:
            self._timer.end(mark, rows, learn)

    @property
    def rows_ema(self) -> float:
        return self._rows / self._w if self._w > 0 else 0.0

    @property
    def seconds_ema(self) -> float:
        return self._secs / self._w if self._w > 0 else 0.0

    def local_speed(self) -> Optional[float]:
        """This rank's measured rows/s (EMA), or None before any measured row."""
        if self._rows <= 0 or self._secs <= 0:
            return None
        return self._rows / self._secs

    def local_noise(self) -> Optional[float]:
        """This rank's relative noise (see the module docstring), or None before
        :data:`NOISE_MIN_STEPS` measured steps."""
        if self._var_w <= 0 or self.measured_steps < NOISE_MIN_STEPS:
            return None
        return math.sqrt(self._var / self._var_w * self._w2) / self._w

    def agreement_noise(self) -> Optional[float]:
        """This rank's noise as it enters an agreement: the larger of :meth:`local_noise` and
        its drift, the change of its estimate since the previous agreement (an EMA of squared
        log-changes, halved: the variance of a difference of two estimates). A host whose load
        comes and goes over many steps moves the estimate between agreements more than the
        step-to-step spread says; equal ranks then read apart by that much. None until both are
        known (from the second agreement with measurements, once :data:`NOISE_MIN_STEPS` steps
        were measured). Call it once per agreement: it advances the drift."""
        local, ema_noise = self.local_speed(), self.local_noise()
        if local is not None and self._agreed_local is not None:
            a, d = self.alpha, math.log(local / self._agreed_local)
            self._drift = a * self._drift + (1 - a) * d * d
            self._drift_w = a * self._drift_w + (1 - a)
        if local is not None:
            self._agreed_local = local
        if ema_noise is None or self._drift_w <= 0:
            return None
        return max(ema_noise, math.sqrt(self._drift / self._drift_w / 2))

    def observe(self, rows: float, seconds: float, busy_rows: Optional[float] = None,
                busy_seconds: Optional[float] = None) -> None:
        """Fold one step into the EMAs and the noise: ``rows`` and ``seconds`` of the sections
        that teach the speed; ``busy_rows`` and ``busy_seconds`` of every section (default: the
        same)."""
        busy_rows = rows if busy_rows is None else busy_rows
        busy_seconds = seconds if busy_seconds is None else busy_seconds
        self.last_step = (int(busy_rows), float(busy_seconds))
        self.last_speed_step = (int(rows), float(seconds))
        a = self.alpha
        if busy_rows > 0 and busy_seconds > 0:
            self._busy = a * self._busy + (1 - a) * busy_seconds
            self._busy_w = a * self._busy_w + (1 - a)
        if rows <= 0 or seconds <= 0:
            return
        prev = self.local_speed()
        if prev is not None:
            d = math.log(rows / seconds / prev)
            self._var = a * self._var + (1 - a) * d * d
            self._var_w = a * self._var_w + (1 - a)
        self._rows = a * self._rows + (1 - a) * rows
        self._secs = a * self._secs + (1 - a) * seconds
        self._w = a * self._w + (1 - a)
        self._w2 = a * a * self._w2 + (1 - a) ** 2
        self.measured_steps += 1

    def _due(self) -> bool:
        """Whether the forward about to finish (:meth:`finish_step`) is an agreement's."""
        return self.every > 0 and (self.steps + 1) % self.every == 0

    def agreement_row(self, device: torch.device) -> Optional[torch.Tensor]:
        """This rank's row of the ``[W, 7]`` table, flattened (``[W * 7]`` float64 on ``device``,
        zeros elsewhere), when this forward is an agreement's and the group has several ranks;
        else None. A caller whose own all-reduce sums it over the group (the layer's load
        statistics, :mod:`hetcomm.moe.load_observer`) hands the sum to :meth:`finish_step`: the
        agreement then costs no collective of its own. The row holds the EMAs through the
        previous forward."""
        if not self._due() or self.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        buf = torch.zeros(self.world_size, len(TABLE_COLUMNS), dtype=torch.float64, device=device)
        buf[self.rank] = torch.tensor(self._my_row(), dtype=torch.float64, device=device)
        return buf.reshape(-1)

    def finish_step(self, table: Optional[torch.Tensor] = None, forward_s: Optional[float] = None) -> bool:
        """End of one forward: fold its timings in; every ``every`` steps agree the snapshot
        (collective on the group: every rank calls this at the same forward; never with
        ``every == 0``). ``table``: the group's sum of :meth:`agreement_row` when the caller's
        all-reduce carried it (no collective here then); ``forward_s``: the forward's wall
        seconds (the layer's; :attr:`SpeedSnapshot.forward_seconds`). Returns True when an
        agreement ran."""
        agree = self._due()
        self.steps += 1
        if forward_s is not None:
            a = self.alpha
            self._fwd_secs = a * self._fwd_secs + (1 - a) * float(forward_s)
            self._fwd_w = a * self._fwd_w + (1 - a)
        rows = secs = busy_rows = busy = 0.0
        if self._timer is not None:
            for r, s, learn in self._timer.collect(wait=agree):
                busy_rows += r
                busy += s
                if learn:
                    rows += r
                    secs += s
        self.observe(rows, secs, busy_rows, busy)
        if agree and table is not None:
            self._adopt(table.reshape(self.world_size, len(TABLE_COLUMNS)).tolist())
        elif agree:
            self.agree()
        return agree

    def _my_row(self) -> List[float]:
        noise = self.agreement_noise()  # advances the drift: once per agreement
        forward_s = self._fwd_secs / self._fwd_w if self._fwd_w > 0 else 0.0
        busy_s = self._busy / self._busy_w if self._busy_w > 0 else 0.0
        return [self.rows_ema, self.seconds_ema, float(self.room_here), -1.0 if noise is None else noise,
                float(self.measured_steps), forward_s, busy_s]

    def agree(self) -> SpeedSnapshot:
        """Exchange every rank's row of the ``[W, 7]`` table and set :attr:`agreed` (collective)."""
        mine = self._my_row()
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dev = self._timer_device if self._timer_device is not None else torch.device("cpu")
            if dist.get_backend(self.group) == "nccl" and dev.type == "cpu":
                dev = torch.device("cuda", torch.cuda.current_device())
            # Each rank fills its row; zeros elsewhere make the sum exact.
            buf = torch.zeros(self.world_size, len(TABLE_COLUMNS), dtype=torch.float64, device=dev)
            buf[self.rank] = torch.tensor(mine, dtype=torch.float64, device=dev)
            dist.all_reduce(buf, group=self.group)
            table = buf.tolist()
        else:
            table = [mine]
        return self._adopt(table)

    def _adopt(self, table: List[List[float]]) -> SpeedSnapshot:
        """Set :attr:`agreed` from the group's ``[W, 7]`` table (identical on every rank)."""
        if self.given:
            speeds, noise_v, differ = self.prior, (0.0,) * self.world_size, speeds_differ(self.prior)
        else:
            speeds, noise_v, differ = agree_table(table, self.prior, self.classes)
        self.agreed = SpeedSnapshot(
            speeds, noise_v, differ, measured=not self.given and any(r[0] > 0 and r[1] > 0 for r in table),
            agreements=self.agreements + 1,
            own_rows_per_s=tuple(r[0] / r[1] if r[0] > 0 and r[1] > 0 else 0.0 for r in table),
            seconds_per_step=tuple(float(r[6]) for r in table), room=tuple(float(r[2]) > 0.5 for r in table),
            forward_seconds=tuple(float(r[5]) for r in table))
        return self.agreed

    def snapshot(self) -> SpeedSnapshot:
        """The agreed snapshot (identical on every rank)."""
        return self.agreed

    def record(self) -> Dict[str, Any]:
        """The step-record keys: ``speed_rows_per_s`` (agreed vector), ``speed_noise`` (None where
        unknown), ``speed_differ``, ``speed_measured``, ``speed_agreements``,
        ``speed_local_rows_per_s``, ``speed_max_over_min``."""
        s = self.speeds
        return {
            "speed_rows_per_s": tuple(s),
            "speed_noise": tuple(None if math.isinf(n) else n for n in self.noise),
            "speed_differ": self.differ,
            "speed_measured": self.measured,
            "speed_agreements": self.agreements,
            "speed_local_rows_per_s": self.local_speed(),
            "speed_max_over_min": max(s) / min(s),
        }
