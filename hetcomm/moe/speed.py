"""Measured expert speed of every rank, agreed across the expert-parallel group.

The datasheet (:mod:`hetcomm.topo.compute`) says what a device *should* do; CPU processes standing
in for GPUs, a throttled GPU or a 910B on older firmware do something else. Every consumer of
per-rank speed (the per-step token split, :mod:`hetcomm.moe.token_split`; placement weights; the
balancer) reads one vector, measured:

- **Per call.** Each expert computation of a forward is timed with the rows it processed. On
  CPU ranks the experts run synchronously on the calling thread, so a host timer
  (``time.perf_counter``) is the compute time. On CUDA/NPU the host only enqueues kernels, so the
  timer records a pair of timing events on the current (compute) stream and reads them once they
  have completed (``event.query()``, never a sync on the hot path): a measurement lands a step or
  two late, which an EMA does not mind.
- **Per step.** A step's rows and seconds are folded into exponential moving averages
  (``alpha``): ``rows_ema``, ``seconds_ema``; this rank's speed is ``rows_ema / seconds_ema``
  (rows per second: a fixed per-call overhead stays in, as it does in the step).
- **Agreed.** Every ``every`` steps each rank contributes ``(rows_ema, seconds_ema, room)`` to
  one all-reduce on the group (a ``[W, 3]`` float64 table each rank fills one row of; ``room`` is
  1 when the rank has room for hot-expert replicas, :mod:`hetcomm.moe.placement.replicate`), so
  every rank holds the identical vector (and room flags) afterwards: decisions taken from it (the split) are identical on every rank without
  another message. Before the first agreement the vector is the *prior* (datasheet TFLOPS, or
  equal speeds without a cluster), in arbitrary units; only ratios matter for a split. A rank that
  has not measured anything yet (no expert received rows) is given the prior scaled by the median
  measured/prior ratio of the ranks that have.

- **Pooled by device (optional).** With ``classes`` (``MoEConfig.speed_pool="device"``: ranks with
  one datasheet speed share a class), a class's speed is the sum of its ranks' ``rows_ema`` over
  the sum of their ``seconds_ema``, the same number on each of them. Host timers of equal CPU
  ranks sharing cores measured 211k-265k rows/s (25 % apart) on the emulated half-speed cluster,
  and the balancer moved experts between equal ranks for that noise; pooled, only a class's
  difference moves anything. The price: a straggler inside a class is not seen.

Knobs (``MoEConfig``): ``speed_every`` (steps between agreements, 0 = never measure: the prior is
kept), ``speed_alpha`` (EMA decay), ``speed_pool`` (``"rank"``: each rank its own; ``"device"``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetcomm.errors import ConfigError

__all__ = ["ComputeTimer", "HostTimer", "EventTimer", "timer_for", "SpeedMeter", "speed_classes"]


def speed_classes(speeds: Sequence[float]) -> List[int]:
    """``[W]`` class id per rank: ranks of one (datasheet) speed share an id, numbered by first
    appearance (``[100, 100, 50]`` -> ``[0, 0, 1]``)."""
    first: Dict[float, int] = {}
    return [first.setdefault(float(s), len(first)) for s in speeds]


class ComputeTimer:
    """Times expert computations on one device: ``mark = begin()`` ... ``end(mark, rows)``;
    ``collect()`` returns the ``(rows, seconds)`` of the computations whose timing is known."""

    def begin(self) -> Any:
        raise NotImplementedError

    def end(self, mark: Any, rows: int) -> None:
        raise NotImplementedError

    def collect(self, wait: bool = False) -> List[Tuple[int, float]]:
        raise NotImplementedError


class HostTimer(ComputeTimer):
    """``time.perf_counter`` around the call: right where compute is synchronous (CPU ranks)."""

    def __init__(self) -> None:
        self._done: List[Tuple[int, float]] = []

    def begin(self) -> float:
        return time.perf_counter()

    def end(self, mark: float, rows: int) -> None:
        self._done.append((int(rows), time.perf_counter() - mark))

    def collect(self, wait: bool = False) -> List[Tuple[int, float]]:
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
        self._pending: List[Tuple[Any, Any, int]] = []

    def begin(self) -> Any:
        ev = self._module.Event(enable_timing=True)
        ev.record(self._module.current_stream(self._device))
        return ev

    def end(self, mark: Any, rows: int) -> None:
        ev = self._module.Event(enable_timing=True)
        ev.record(self._module.current_stream(self._device))
        self._pending.append((mark, ev, int(rows)))

    def collect(self, wait: bool = False) -> List[Tuple[int, float]]:
        done, keep = [], []
        for start, stop, rows in self._pending:
            if wait:
                stop.synchronize()
            if stop.query():
                done.append((rows, start.elapsed_time(stop) / 1e3))
            else:
                keep.append((start, stop, rows))
        self._pending = keep
        return done


def timer_for(device: torch.device) -> ComputeTimer:
    """The timer that measures compute on ``device``: events on CUDA/NPU, the host clock on CPU."""
    if device.type == "cuda":
        return EventTimer(torch.cuda, device)
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return EventTimer(torch.npu, device)  # type: ignore[attr-defined]
    return HostTimer()


@dataclass(frozen=True)
class SpeedSnapshot:
    """What the step record shows: the agreed vector and where it came from."""

    rows_per_s: Tuple[float, ...]
    measured: bool
    agreements: int
    local_rows_per_s: Optional[float]


class SpeedMeter:
    """This rank's EMA of expert rows and seconds, and the group's agreed speed vector.

    Args:
        world_size, rank: the group's size and this rank's index in it.
        prior: ``[W]`` speeds before the first measurement (datasheet TFLOPS; any unit).
        group: the process group of the agreement (None: the default group).
        every: steps between agreements (one all-reduce); 0 = never measure (keep the prior).
        alpha: EMA decay per step.
        room: this rank has room for hot-expert replicas (allowed to hold them and its own
            experts fit its device, i.e. it does not page); agreed with the speeds into
            :attr:`room`, which the replica holders' choice reads.
        classes: ``[W]`` class id per rank: ranks of one class pool their measurements
            (:meth:`combine`); None: every rank its own.
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
        self.speeds: Tuple[float, ...] = self.prior
        self.measured = False
        #: This rank's room flag, and every rank's as agreed (identical on every rank; all True
        #: before the first agreement, when no rank knows the others' flags).
        self.room_here = bool(room)
        self.room: Tuple[bool, ...] = (True,) * world_size
        self.agreements = 0
        self.steps = 0
        self.rows_ema = 0.0
        self.seconds_ema = 0.0
        self._weight = 0.0  # bias correction of the EMAs (they start at 0)
        self._step_rows = 0
        self._step_seconds = 0.0
        self._timer: Optional[ComputeTimer] = None
        self._timer_device: Optional[torch.device] = None

    # -- measuring ---------------------------------------------------------------------------
    def set_prior(self, speeds: Sequence[float]) -> None:
        """Replace the prior (and the vector in force, until the next agreement)."""
        if len(speeds) != self.world_size or not all(float(s) > 0 for s in speeds):
            raise ConfigError(
                f"speed prior must be {self.world_size} positive numbers, got {list(speeds)}", key="moe.speed_prior"
            )
        self.prior = tuple(float(s) for s in speeds)
        if not self.measured:
            self.speeds = self.prior

    def begin(self, device: torch.device) -> Any:
        """Start timing one expert computation on ``device`` (returns the mark for :meth:`end`)."""
        if self.every == 0:
            return None
        if self._timer is None or self._timer_device != device:
            self._timer, self._timer_device = timer_for(device), device
        return self._timer.begin()

    def end(self, mark: Any, rows: int) -> None:
        """Stop timing the computation begun at ``mark``, which processed ``rows`` rows."""
        if mark is not None and self._timer is not None:
            self._timer.end(mark, rows)

    def local_speed(self) -> Optional[float]:
        """This rank's measured rows/s (EMA), or None before any measured row."""
        if self.rows_ema <= 0 or self.seconds_ema <= 0:
            return None
        return self.rows_ema / self.seconds_ema

    def finish_step(self) -> bool:
        """End of one forward: fold its timings into the EMA; every ``every`` steps agree the
        vector (collective on the group: every rank calls this at the same forward). Returns
        True when an agreement ran."""
        if self.every == 0:
            return False
        self.steps += 1
        agree = self.steps % self.every == 0
        timer = self._timer
        rows = secs = 0.0
        if timer is not None:
            for r, s in timer.collect(wait=agree):
                rows += r
                secs += s
        if rows > 0 and secs > 0:
            a = self.alpha
            self.rows_ema = a * self.rows_ema + (1 - a) * rows
            self.seconds_ema = a * self.seconds_ema + (1 - a) * secs
        if agree:
            self.agree()
        return agree

    def agree(self) -> Tuple[float, ...]:
        """Exchange every rank's ``(rows_ema, seconds_ema, room)`` and set the vector (collective)."""
        mine = torch.tensor([self.rows_ema, self.seconds_ema, float(self.room_here)], dtype=torch.float64, device="cpu")  # host: three scalars
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dev = self._timer_device if self._timer_device is not None else torch.device("cpu")
            if dist.get_backend(self.group) == "nccl" and dev.type == "cpu":
                dev = torch.device("cuda", torch.cuda.current_device())
            # All-reduce of a [W, 3] table each rank fills one row of (exact: zeros elsewhere).
            buf = torch.zeros(self.world_size, 3, dtype=torch.float64, device=dev)
            buf[self.rank] = mine.to(dev)
            dist.all_reduce(buf, group=self.group)
            rows3 = buf.tolist()
        else:
            rows3 = [mine.tolist()]
        table = [(float(r), float(t)) for r, t, _ in rows3]
        self.room = tuple(float(f) > 0.5 for _, _, f in rows3)
        self.speeds = self.combine(table, self.prior, self.classes)
        self.measured = any(r > 0 and s > 0 for r, s in table)
        self.agreements += 1
        return self.speeds

    @staticmethod
    def combine(table: Sequence[Tuple[float, float]], prior: Sequence[float],
                classes: Optional[Sequence[int]] = None) -> Tuple[float, ...]:
        """The agreed vector from every rank's ``(rows_ema, seconds_ema)``: measured rows/s, and
        for a rank without a measurement its prior times the median measured/prior ratio (the
        prior itself when nobody measured). With ``classes``, each rank's pair is first replaced
        by its class's sums over the ranks that measured (a class where nobody measured stays
        unmeasured)."""
        if classes is not None:
            sums: Dict[int, List[float]] = {}
            for c, (r, s) in zip(classes, table):
                if r > 0 and s > 0:
                    acc = sums.setdefault(c, [0.0, 0.0])
                    acc[0] += r
                    acc[1] += s
            table = [tuple(sums.get(c, (0.0, 0.0))) for c in classes]
        measured = {i: r / s for i, (r, s) in enumerate(table) if r > 0 and s > 0}
        if not measured:
            return tuple(float(p) for p in prior)
        scale = statistics.median(measured[i] / prior[i] for i in measured)
        return tuple(measured.get(i, prior[i] * scale) for i in range(len(table)))

    def snapshot(self) -> SpeedSnapshot:
        return SpeedSnapshot(tuple(self.speeds), self.measured, self.agreements, self.local_speed())

    def record(self) -> Dict[str, Any]:
        """The step-record keys: ``speed_rows_per_s`` (agreed vector), ``speed_measured``,
        ``speed_agreements``, ``speed_local_rows_per_s``, ``speed_max_over_min``."""
        s = self.speeds
        return {
            "speed_rows_per_s": tuple(s),
            "speed_measured": self.measured,
            "speed_agreements": self.agreements,
            "speed_local_rows_per_s": self.local_speed(),
            "speed_max_over_min": max(s) / min(s),
        }
