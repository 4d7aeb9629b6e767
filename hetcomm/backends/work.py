"""Work objects returned by hetcomm collectives.

``HetcommWork`` is completed by the group's executor thread: ``wait()`` blocks until then and
re-raises the collective's error (``ValueError`` for a cross-rank mismatch, ``CollectiveError`` /
``PeerTimeout`` for a failed or silent peer); ``get_future()`` gives a torch Future that carries
the same error at the C++ level (a Python ``Future.set_exception`` would not, see the torch
backend notes), so DDP and functional collectives see failures too.

Device tensors follow torch's stream contract (:mod:`hetcomm.backends.devices`): a routed
collective's Work carries a :class:`~hetcomm.backends.devices.StreamOrder` captured on the
caller's thread at the call; ``wait()`` and ``synchronize()`` make the *waiting thread's current
stream* wait for the collective's device work (the host waits only for the job's host side, as
c10d's ProcessGroupNCCL blocks the stream, not the CPU); ``is_completed()`` also asks whether the
device work has finished; ``get_future()`` of CUDA work is a device-aware torch Future, whose
``wait()``/``value()``/callbacks synchronise with the current streams like NCCL's futures.

``FutureWork`` wraps one inner future plus a finalizer (e.g. the division of an AVG all_reduce).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from hetcomm.backends import devices

__all__ = ["HetcommWork", "FutureWork"]


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def __reduce__(self):
        # A device-aware Future finds the tensors of its value by pickling it; an error holds
        # none, and its fields need not be picklable: it pickles as an empty stand-in.
        return (_Failure, (None,))


def _unwrap(fut: "torch.futures.Future") -> Any:
    value = fut.value()
    if isinstance(value, _Failure):
        raise value.exc  # raised inside .then: a real (C++-level) error of the chained future
    return value


def _fresh(exc: BaseException) -> BaseException:
    """A copy of ``exc`` to raise (same type, fields, message and cause).

    Raising the stored object itself would attach the caller's frames to it, and the caller's
    frame holds this Work (c10d's ``work.wait()``): a reference cycle that keeps the Work, and
    through the caller's frames the process group, alive after ``destroy_process_group`` until
    the cyclic GC runs (see :func:`hetcomm.backends.faults.release_frames`).
    """
    new = type(exc).__new__(type(exc))
    new.__dict__.update(exc.__dict__)
    new.args = exc.args
    new.__cause__ = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return new


class HetcommWork(dist.Work):
    """A collective run by the executor thread.

    Args:
        result: the tensors ``get_future().value()`` returns on success (the outputs).
        seq: the collective's sequence number in its group (fault diagnosis keys on it).
        order: where its device work goes (:func:`hetcomm.backends.devices.capture`, taken on
            the caller's thread at the call); the executor runs the job in
            ``RailStreams.scope(order)``. None: no stream handling (host-only work, or work
            completed by someone else, such as the delegated collectives' gloo futures).
    """

    def __init__(self, result: List[torch.Tensor], seq: int = 0, order: Optional[devices.StreamOrder] = None):
        super().__init__()
        self._result = result
        self.seq = seq
        self.order = order
        self._done = threading.Event()
        self._exc: Optional[BaseException] = None
        # The torch Future is made on first get_future() only: most callers just wait().
        self._lock = threading.Lock()
        self._base: Optional[torch.futures.Future] = None
        self._future: Optional[torch.futures.Future] = None

    # -- executor side ---------------------------------------------------------------------
    def _complete(self, exc: Optional[BaseException] = None, before_callbacks: Optional[Callable[[], None]] = None) -> None:
        """Record the outcome; set the future's result (running its callbacks on this thread).

        ``before_callbacks`` runs first when there is a future (decided under the lock, so a
        ``get_future()`` racing with this call either sees the outcome or has its future set
        here): the executor hands its queue to a new thread there (:class:`~hetcomm.backends.
        executor.Executor`), so callbacks that start collectives do not wait for themselves.
        """
        with self._lock:
            self._exc = exc
            self._done.set()
            base = self._base
        if base is not None:
            if before_callbacks is not None:
                before_callbacks()
            # On the rail stream, just after the job's done event: a device-aware future records
            # its own event on the current stream here (see get_future).
            with devices.on_rail_stream(self.order):
                base.set_result(_Failure(exc) if exc is not None else self._result)

    # -- user side ---------------------------------------------------------------------------
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the collective's host side finished; raise its error if it failed; then
        make this thread's current stream wait for its device work (device tensors: the outputs
        are ready for whatever is queued on that stream next; the host does not wait for the
        device).

        The executor enforces the group timeout itself (every wait names the silent peer), so
        this wait needs no timeout of its own; a non-zero ``timeout`` bounds it anyway.
        """
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            from hetcomm.errors import PeerTimeout

            raise PeerTimeout(f"Work.wait timed out after {seconds:.1f} s")
        if self._exc is not None:
            raise _fresh(self._exc)
        devices.join(self.order)
        return True

    def synchronize(self) -> None:
        """torch's ``Work.synchronize()``: later work on this thread's current stream is ordered
        after the collective (as :meth:`wait`; the host waits for the job's host side, which
        the executor drives, but not for the device)."""
        self.wait()

    def is_completed(self) -> bool:
        """True once the job ended and, for device work, its device work has finished too."""
        return self._done.is_set() and devices.completed(self.order)

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        return self._exc

    def get_future(self) -> "torch.futures.Future":
        """A torch Future of the outputs (the collective's error raised from ``wait()``/``value()``).

        For CUDA work it is device-aware (``Future(devices=[device])``), like ProcessGroupNCCL's:
        its completion event is recorded after the collective's device work, and ``wait()``,
        ``value()`` and ``then`` callbacks make their current streams wait for it.
        """
        with self._lock:
            if self._future is None:
                order = self.order
                cuda = order is not None and order.device.type == "cuda"
                self._base = torch.futures.Future(devices=[order.device]) if cuda else torch.futures.Future()
                self._future = self._base.then(_unwrap)
                if self._done.is_set():
                    # Completed already: the future's event goes on the rail stream, after the
                    # job's done event (and after whatever later jobs queued there since: a
                    # later point than needed, never an earlier one).
                    with devices.on_rail_stream(order):
                        self._base.set_result(_Failure(self._exc) if self._exc is not None else self._result)
        return self._future

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._result


class FutureWork(dist.Work):
    """A Work over one torch Future (already chained with any finalizer)."""

    def __init__(self, future: "torch.futures.Future", errors: Optional[List[BaseException]] = None):
        super().__init__()
        self._future = future
        self._errors = errors if errors is not None else []

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            self._future.wait()
        except Exception:
            # torch re-raises a callback's error as RuntimeError("Got the following error ...");
            # give Python callers the original (a CollectiveError naming the peer) instead.
            if self._errors:
                raise self._errors[0] from None
            raise
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> "torch.futures.Future":
        return self._future

    def result(self):
        return self._future.wait()
