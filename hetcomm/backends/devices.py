"""Device streams and events for hetcomm's collectives: the stream contract, in one place.

torch's device collectives (ProcessGroupNCCL, torch_npu's HCCL) order their work after the
caller's *current stream* at the call and make ``Work.wait()`` block the waiting thread's
current stream, not the host. hetcomm runs its routed collectives on the group's executor
thread, whose current stream is not the caller's, so the position in the caller's stream is
carried across the thread hand-off explicitly, in three steps:

1. :func:`capture` — on the caller's thread, at the call: an event recorded on the caller's
   current stream of the tensors' device (a :class:`StreamOrder`). Everything the caller
   queued before the collective, on whatever stream it made current (a side stream too), is
   before that event.
2. :meth:`RailStreams.scope` — when the job runs (the executor thread, or the caller's own
   thread when a blocking call runs inline): the group's *rail stream* for that device waits on
   the event and is the current stream while the job runs, so everything the rails queue from
   there is ordered after the caller's work: the bridge's copy stream waits on an event of the
   rail stream, ProcessGroupNCCL/HCCL sync their streams with the current one, the executor's
   local copies run on it. The tensors are ``record_stream``-ed on the rail stream first (see
   below). When the job ends, an event ``done`` is recorded on the rail stream: every device
   write of the collective is before it.
3. :func:`join` — in ``Work.wait()`` / ``synchronize()``: the waiting thread's current stream
   waits on ``done``. The host blocks only until the job's host side finished (the executor is
   host-driven: a bridge round is a host transfer); it never waits for the device.

Memory: the caching allocators (CUDA's, NPU's) hand a freed block to the next allocation on the
stream that allocated it, without looking at other streams. The caller's tensors are used on the
rail stream (and the bridge's copy stream) while the caller may already have dropped them, so
each is ``record_stream``-ed on the stream that uses it: the allocator then waits for that
stream's queued work before it reuses the block. The order keeps references to the tensors only
until that is done (the Work keeps its outputs anyway). Pinned host buffers need nothing: the
host caching allocator records an event for every non-blocking copy from or to pinned memory.

Device modules (``torch.cuda``, ``torch.npu``) are reached lazily through
``torch.get_device_module``: importing hetcomm never imports ``torch_npu`` nor initialises CUDA;
``torch_npu`` is imported on the first NPU tensor. The per-backend module rather than
``torch.accelerator``: it has the same spelling (``Stream``, ``Event``, ``current_stream``,
``stream`` context) on every torch hetcomm meets (2.13 here, 2.11 on the GPU image) and in
torch_npu, and its stream context switches the current device with the stream.

CPU tensors have no streams: the same three calls happen and do nothing with streams. With
:func:`tracing` on they log which thread made them, for which collective: that is how the CPU
tests check that the event is taken on the caller's thread at the call, the wait on the rail
side, and the join on the waiting thread (tests/backends/test_devices.py).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch

__all__ = [
    "StreamOrder",
    "RailStreams",
    "TraceEntry",
    "capture",
    "join",
    "completed",
    "on_rail_stream",
    "device_module",
    "tracing",
]


def device_module(device: torch.device) -> Optional[Any]:
    """``torch.cuda`` / ``torch.npu`` / ... for a device, imported lazily; None for CPU (and meta)."""
    if device.type in ("cpu", "meta"):
        return None
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu; only ever for an NPU tensor)
    return torch.get_device_module(device)


class TraceEntry(NamedTuple):
    """One step of the contract, as :func:`tracing` logs it.

    Attributes:
        step: ``"capture"`` (event on the caller's stream), ``"rail-wait"`` (rail stream waits
            on it), ``"rail-done"`` (done event recorded), ``"join"`` (waiting stream waits on done).
        thread: name of the thread that took the step.
        device: device type of the collective's tensors (``"cpu"``, ``"cuda"``, ...).
        tag: the collective's sequence number in its group.
    """

    step: str
    thread: str
    device: str
    tag: int


_trace: Optional[List[TraceEntry]] = None


@contextlib.contextmanager
def tracing() -> Iterator[List[TraceEntry]]:
    """Log every step of the contract in this process while the block runs (for tests).

    Yields:
        The list the entries are appended to, in the order they happened.
    """
    global _trace
    log: List[TraceEntry] = []
    previous, _trace = _trace, log
    try:
        yield log
    finally:
        _trace = previous


def _log(step: str, order: "StreamOrder") -> None:
    log = _trace  # read once: tracing() may end on another thread meanwhile
    if log is not None:
        log.append(TraceEntry(step, threading.current_thread().name, order.device.type, order.tag))


@dataclass(eq=False)
class StreamOrder:
    """Where one collective's device work sits between the caller's streams.

    Attributes:
        device: the device of the collective's tensors (``cpu`` when they are host tensors).
        tag: the collective's sequence number (for the trace).
        ready: event recorded on the caller's current stream at the call (None on CPU).
        tensors: the device tensors to ``record_stream`` on the rail stream; emptied once done.
        rail_stream: the stream the job ran on (set by :meth:`RailStreams.scope`).
        done: event recorded on ``rail_stream`` when the job ended (set by the scope).
    """

    device: torch.device
    tag: int
    ready: Any = None
    tensors: Sequence[torch.Tensor] = ()
    rail_stream: Any = None
    done: Any = None


#: The order of every host collective while nothing traces (nothing in it is ever set).
_CPU_ORDER = StreamOrder(torch.device("cpu"), 0)


_CPU = torch.device("cpu")
_NOTHING = contextlib.nullcontext()


def capture(tensors: Sequence[torch.Tensor], tag: int = 0) -> StreamOrder:
    """Step 1, on the caller's thread at the call: where the collective's device work goes.

    Args:
        tensors: every tensor the collective reads or writes (inputs, outputs, the contiguous
            copies made for it); all on one device, which the collectives check first.
        tag: the collective's sequence number.

    Returns:
        A :class:`StreamOrder`; for device tensors with ``ready`` recorded on the current stream.
        Host tensors get one shared, empty order while nothing traces (this runs once per
        collective, and the CPU path is the latency-sensitive one).
    """
    for t in tensors:
        if not t.is_cpu:
            device = t.device
            mod = device_module(device)
            ready = mod.Event()
            ready.record(mod.current_stream(device))
            order = StreamOrder(device, tag, ready, tuple(x for x in tensors if x.device == device))
            break
    else:
        if _trace is None:
            return _CPU_ORDER
        order = StreamOrder(_CPU, tag)
    _log("capture", order)
    return order


class _TracedHostScope:
    """The scope of host work while :func:`tracing` is on: logs, nothing else."""

    def __init__(self, order: StreamOrder):
        self.order = order

    def __enter__(self) -> None:
        _log("rail-wait", self.order)

    def __exit__(self, *exc) -> None:
        _log("rail-done", self.order)


class _DeviceScope:
    """The scope of device work (see :meth:`RailStreams.scope`)."""

    def __init__(self, stream: Any, order: StreamOrder):
        self.stream, self.order = stream, order
        self.ctx = None

    def __enter__(self) -> None:
        order, s = self.order, self.stream
        _log("rail-wait", order)
        s.wait_event(order.ready)
        for t in order.tensors:
            t.record_stream(s)  # the caller may drop them before the rail stream is done with them
        order.tensors = ()
        order.rail_stream = s
        self.ctx = device_module(order.device).stream(s)
        self.ctx.__enter__()

    def __exit__(self, *exc) -> None:
        order, s = self.order, self.stream
        try:
            self.ctx.__exit__(*exc)
        finally:
            done = device_module(order.device).Event()
            done.record(s)
            order.done = done
            _log("rail-done", order)


class RailStreams:
    """The rail streams of one executor: one per device, made on first use.

    One per executor (that is, per group), not per process: two groups' jobs then never queue
    behind each other on a shared stream, whose waits could chain one group's collective to
    another group's peers.
    """

    def __init__(self) -> None:
        self._streams: Dict[torch.device, Any] = {}

    def stream(self, device: torch.device) -> Any:
        """The rail stream for ``device`` (a device tensor's device)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = device_module(device).Stream(device=device)
        return s

    def scope(self, order: Optional[StreamOrder]):
        """Step 2: a context that runs a job ordered after ``order``'s caller stream.

        Inside: the rail stream waited on ``order.ready`` and is the current stream of
        ``order.device``. On exit (errors too): ``order.done`` is recorded on it. ``None`` or a
        host order: nothing to do (logged only, while tracing).
        """
        if order is None or order.ready is None:
            return _NOTHING if _trace is None or order is None else _TracedHostScope(order)
        return _DeviceScope(self.stream(order.device), order)


def join(order: Optional[StreamOrder]) -> None:
    """Step 3, on the waiting thread: its current stream waits for the collective's device work.

    Call only after the job ended (``Work.wait()`` waits for that first)."""
    if order is None:
        return
    if _trace is not None:
        _log("join", order)
    if order.done is not None:
        device_module(order.device).current_stream(order.device).wait_event(order.done)


def completed(order: Optional[StreamOrder]) -> bool:
    """Has the collective's device work finished (True for CPU work, whose job is all of it)?
    Call only after the job ended."""
    return order is None or order.done is None or bool(order.done.query())


def on_rail_stream(order: Optional[StreamOrder]):
    """A context in which the current stream of ``order.device`` is the stream the job ran on
    (for recording events after its done event, e.g. a device-aware future's); a no-op for
    CPU work."""
    if order is None or order.rail_stream is None:
        return contextlib.nullcontext()
    return device_module(order.device).stream(order.rail_stream)
