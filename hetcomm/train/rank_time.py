"""A rank's busy time: what it computes, not what it waits (the batch split's clock).

Wall-clock timers around a rank's work include the time it waits for the others; on unequal
ranks the fast ones wait the most, so a wall-clock speed calls them slow (measured on the
emulated half-speed cluster: the dense split saw the 910B rank as the *fastest* and never
re-dealt). The Linux scheduler keeps, per thread, the two numbers that separate the cases
(``/proc/thread-self/schedstat``, nanoseconds):

- ``run``: time on a CPU;
- ``ready``: time runnable but not running -- queued behind other processes, or held back by
  a cgroup's CPU quota (``hetcomm emulate --compute``'s half-speed 910B). A section of pure
  compute takes ``run + ready`` of wall time.

Time blocked in a collective's wait (a futex, a sleep) is in neither. The hetcomm backend's
wait loop yields and sleeps in short steps (:func:`hetcomm.backends.executor.drive`), and each
wake-up costs a little ``run`` and, on a loaded host, some ``ready``; so:

- :class:`RankClock` reads ``(run, ready)`` of this thread (``run`` from the thread CPU clock,
  which schedstat's run field lags by up to a scheduler tick; ``ready`` 0 without schedstat);
- :class:`LayerCpuTimer` accumulates ``(run, ready)`` inside chosen modules' forwards (hooks),
  e.g. the MoE layers, so the model's forward minus them is the dense compute, which holds no
  collective: ``dilation = (run + ready) / run`` there is this rank's wall seconds per CPU
  second when it computes;
- a step's busy time is its ``run`` (wait loops add little of it) times that dilation.

Devices: on CUDA/NPU the host thread only enqueues kernels, so its CPU time says nothing
about the device's busy time. :func:`busy_clock_for` gives those ranks a :class:`DeviceClock`
instead: timing events on the compute stream (:func:`hetcomm.moe.speed.timer_for`, the
:class:`~hetcomm.moe.speed.EventTimer` the layers' measured speed uses), so a section's time is
the stream's time between two marks -- stream-ordered, after the kernels enqueued before it.
``ready`` is 0 there (the dilation is 1): a device is not shared with other processes' threads
the way the emulation's CPUs are. What the events cannot separate: the stream's time between two
marks includes its waits for a collective in between, so a step's busy time on a device contains
the rank's waits (the dense forward, which holds no collective, is pure compute); the batch
split's last gate (a deal is kept only when the measured step got 3% shorter) is the guard.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterable, List, Optional, Tuple

import torch

__all__ = ["RankClock", "DeviceClock", "LayerCpuTimer", "ProcessClock", "busy_clock_for", "process_clock_for", "SCHEDSTAT"]

#: Per-thread scheduler statistics: ``run_ns ready_ns timeslices``.
SCHEDSTAT = "/proc/thread-self/schedstat"


class RankClock:
    """``(run_s, ready_s)`` of the thread that created it, monotonic.

    ``run_s`` from ``time.thread_time()``; ``ready_s`` from ``/proc/thread-self/schedstat``
    (``/proc/self/task/TID/schedstat`` on kernels without ``thread-self``) through a descriptor
    opened once: ~1 us a read. Without schedstat (other systems, a kernel built without
    ``CONFIG_SCHEDSTATS``) ``ready_s`` stays 0, so the dilation is 1 (CPU time only).

    Args:
        path: the schedstat file (tests pass a fake one).
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self._fd: Optional[int] = None
        self.thread_id = threading.get_ident()
        for candidate in ([path] if path else [SCHEDSTAT, f"/proc/self/task/{threading.get_native_id()}/schedstat"]):
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:
                continue
            if self._parse(fd) is not None:
                self._fd = fd
                break
            os.close(fd)
        #: ``schedstat`` or ``thread_time``: where the numbers come from.
        self.source = "schedstat" if self._fd is not None else "thread_time"

    @staticmethod
    def _parse(fd: int) -> Optional[float]:
        try:
            parts = os.pread(fd, 128, 0).split()
            int(parts[0])
            return int(parts[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    def read(self) -> Tuple[float, float]:
        """``(run_s, ready_s)`` so far; call it on the thread it measures (the creating one).

        ``run_s`` is ``time.thread_time()``: schedstat's run field is brought up to date only at
        scheduler ticks and switches (4 ms steps at 250 Hz; a short section reads 0), the
        thread CPU clock includes the running slice. ``ready_s`` is schedstat's: a thread that
        reads it is running, so every wait for a CPU it had is already added."""
        ready = self._parse(self._fd) if self._fd is not None else None
        return time.thread_time(), (ready or 0.0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a descriptor per clock: give it back
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


class LayerCpuTimer:
    """``(run_s, ready_s)`` spent inside the forwards of ``modules`` (forward pre/post hooks).

    Nested or repeated calls add up; a module whose forward raises leaves its interval open
    until its next call (that step's share is then lost, not double-counted). Only the
    creating thread is timed: calls from another thread (none in training) are ignored.

    Args:
        modules: the modules to time (e.g. ``model.moe_layers``).
        clock: the clock to read (shared with the caller's own reads).
    """

    def __init__(self, modules: Iterable[torch.nn.Module], clock: RankClock) -> None:
        self.clock = clock
        self.run_s = 0.0
        self.ready_s = 0.0
        self._open: List[Tuple[float, float]] = []
        self._handles: List[Any] = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._leave))

    def _enter(self, _module, _args) -> None:
        if threading.get_ident() == self.clock.thread_id:
            self._open.append(self.clock.read())

    def _leave(self, _module, _args, _out) -> None:
        if threading.get_ident() != self.clock.thread_id or not self._open:
            return
        run0, ready0 = self._open.pop()
        if self._open:
            return  # nested: the outer interval counts it
        run1, ready1 = self.clock.read()
        self.run_s += run1 - run0
        self.ready_s += ready1 - ready0

    def take(self) -> Tuple[float, float]:
        """``(run_s, ready_s)`` since the last take, and reset."""
        out = (self.run_s, self.ready_s)
        self.run_s = self.ready_s = 0.0
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class DeviceClock:
    """``(busy_s, 0.0)`` of a device rank's compute stream, monotonic: :class:`RankClock`'s
    interface (``read``, ``thread_id``, ``source``, ``close``) for CUDA/NPU ranks.

    Each :meth:`read` closes the interval opened by the previous one with a timing event on the
    device's current (compute) stream, opens the next, and adds the closed interval's stream
    time. The value is needed on the host at once (the batch split subtracts readings), so a
    read waits for *that event* (``event.synchronize()``: the host waits until the stream has
    run what was enqueued before the mark; other streams and later work are not waited for).
    The train loop reads it a few times a step at points where the host waits for the device
    anyway (the MoE layers' count exchange, the loss all-reduce), so the waits add little.

    Args:
        device: the rank's device (``cuda``/``npu``); its timer is :func:`hetcomm.moe.speed.timer_for`'s.
        timer: the :class:`~hetcomm.moe.speed.ComputeTimer` to read instead (tests give a
            :class:`~hetcomm.moe.speed.HostTimer` to run this on CPU).
    """

    def __init__(self, device: Optional[torch.device] = None, timer: Any = None) -> None:
        from hetcomm.moe.speed import EventTimer, timer_for  # lazy: torch_npu only where asked for

        if timer is None:
            if device is None:
                from hetcomm.errors import ConfigError

                raise ConfigError("DeviceClock needs the rank's device (cuda/npu) or a timer", key="train.busy_clock")
            timer = timer_for(device)
        self.timer = timer
        self.thread_id = threading.get_ident()
        #: ``events``: stream time from timing events (a host timer given by a test: ``host``).
        self.source = "events" if isinstance(timer, EventTimer) else "host"
        self._busy_s = 0.0
        self._mark = timer.begin()

    def read(self) -> Tuple[float, float]:
        """``(busy_s, 0.0)``: the stream's seconds from this clock's creation to this mark."""
        self.timer.end(self._mark, 0)
        self._mark = self.timer.begin()
        for _rows, seconds in self.timer.collect(wait=True):
            self._busy_s += seconds
        return self._busy_s, 0.0

    def close(self) -> None:
        """Nothing to give back (events are freed with their last reference)."""


def busy_clock_for(device: torch.device) -> Optional[Any]:
    """The clock of a rank computing on ``device``: :class:`RankClock` on CPU ranks (thread CPU
    and scheduler time), :class:`DeviceClock` on CUDA/NPU (timing events on the compute stream);
    None on other devices (the batch split then keeps equal batches)."""
    if device.type == "cpu":
        return RankClock()
    if device.type in ("cuda", "npu"):
        return DeviceClock(device)
    return None


class ProcessClock:
    """CPU seconds of every thread of this process (``time.process_time()``).

    The main thread's clock (:class:`RankClock`) misses much of what a rank spends: on the
    emulated half-speed cluster the 910B rank's main thread was ~60 % of its process CPU, the
    rest on its executor, gloo-wait and gloo's/torch's native threads (benchmarks/README.md,
    het_train_emulated.py, per thread) -- all under the same CPU quota.
    :class:`~hetcomm.train.het_defaults.BatchSplit` turns it into wall seconds with the dilation
    of the rank's dense compute (as it does the main thread's), once per agreement window.

    Two other conversions were tried and measured useless on the emulation:
    ``run + ready`` summed over threads (with ~15 threads runnable side by side
    every rank summed to 108-144 % of the wall step), and the CPU over the cgroup's quota (a
    rank started by ``ip netns exec`` sees a fresh sysfs without the cgroup mounts, so the
    quota cannot be read from inside it).

    Device note: on CUDA/NPU the host CPU is not the device's time (:func:`process_clock_for`
    gives None there).
    """

    def read(self) -> float:
        """Process CPU seconds so far (all threads, user + system)."""
        return time.process_time()


def process_clock_for(device: torch.device) -> Optional[ProcessClock]:
    """The whole-process clock of a rank computing on ``device``: :class:`ProcessClock` on CPU
    ranks; None on CUDA/NPU (host threads are not the device's busy time)."""
    return ProcessClock() if device.type == "cpu" else None
