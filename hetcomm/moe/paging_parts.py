"""The pieces of expert paging below the pager: its configuration (:class:`PagingConfig`), its
error, the page arithmetic, what a computation is granted (:class:`Grant`), and the copy
workers that move expert pages between the host pool and the device slots (``_Copier``: one
thread per direction, a CUDA/NPU stream each on a device, ordered by events).

:mod:`hetcomm.moe.paging` (the :class:`~hetcomm.moe.paging.ExpertPager`) builds on these and
re-exports the public names.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from hetcomm.errors import ConfigError, HetcommError
from hetcomm.moe.degrade import DegradeConfig
from hetcomm.backends.thread_name import name_native_thread

__all__ = ["PagingConfig", "Grant", "PagingError", "pages_for"]

MiB = 1 << 20


class PagingError(HetcommError, RuntimeError):
    """The pager cannot serve a step as asked (working set over budget, a transfer timed out).

    Args:
        message: what happened and how to fix it.
        expert: the expert concerned, when one is.
    """

    def __init__(self, message: str, *, expert: Optional[int] = None) -> None:
        self.expert = expert
        super().__init__(("" if expert is None else f"expert {expert}: ") + message)


@dataclass(frozen=True)
class PagingConfig:
    """Knobs of :class:`ExpertPager` (defaults from the MegaScale-MoE notes).

    Attributes:
        budget_fraction: device slots as a fraction of all experts (0.4: the notes report 99.2%
            hits at 37% of the experts' memory).
        page_bytes: pool page for experts of at least this size (64 MiB).
        small_page_bytes: page for smaller experts (8 MiB).
        standby_threshold: predicted use at which a non-resident expert is standby (0.7).
        prefetch_min_free: standby experts load only while more than this fraction of the slots
            is free (0.4), so prefetch never pushes out what the current steps use.
        evict_below_free: evict down to this free fraction after each step (0.2) to keep room
            for the next step's faults.
        history_decay: weight of the past in the EMA of use (0.8: a hot set that moves is
            followed within ~5 steps).
        transfer_bytes_per_s: throttle of each copy direction (None: as fast as copies go). The
            benchmark sets it so one expert's move costs the A100/PCIe multiple of its compute.
        training: keep every expert used in a step resident until ``end_step`` (autograd holds
            its weights); False lets released experts be evicted within the step.
        optimizer_state_per_param: room for this many per-element state tensors per parameter
            (2 = Adam/AdamW; 1 = SGD momentum; 0 = no optimizer state paged).
        timeout_s: longest wait for one transfer before :class:`PagingError`.
        degrade: the page-fault degradation levels (:class:`DegradeConfig`).
    """

    budget_fraction: float = 0.4
    page_bytes: int = 64 * MiB
    small_page_bytes: int = 8 * MiB
    standby_threshold: float = 0.7
    prefetch_min_free: float = 0.4
    evict_below_free: float = 0.2
    history_decay: float = 0.8
    transfer_bytes_per_s: Optional[float] = None
    training: bool = True
    optimizer_state_per_param: int = 2
    timeout_s: float = 60.0
    degrade: DegradeConfig = field(default_factory=DegradeConfig)

    def __post_init__(self) -> None:
        for key in ("budget_fraction", "standby_threshold", "prefetch_min_free", "evict_below_free", "history_decay"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"must be a number within [0, 1], got {v!r}", key=f"paging.{key}")
        if self.budget_fraction <= 0:
            raise ConfigError("must be > 0 (no device slot at all)", key="paging.budget_fraction")
        for key in ("page_bytes", "small_page_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 4096 or v % 4096:
                raise ConfigError(f"must be a positive multiple of 4096 bytes, got {v!r}", key=f"paging.{key}")
        if self.transfer_bytes_per_s is not None and not self.transfer_bytes_per_s > 0:
            raise ConfigError(f"must be > 0 or None, got {self.transfer_bytes_per_s!r}", key="paging.transfer_bytes_per_s")
        if not isinstance(self.optimizer_state_per_param, int) or self.optimizer_state_per_param < 0:
            raise ConfigError(
                f"must be a whole number >= 0, got {self.optimizer_state_per_param!r}",
                key="paging.optimizer_state_per_param",
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.timeout_s!r}", key="paging.timeout_s")


def pages_for(nbytes: int, cfg: PagingConfig) -> "tuple[int, int]":
    """(page size, pages) holding one expert region of ``nbytes`` bytes."""
    if nbytes >= cfg.page_bytes:
        page = cfg.page_bytes
    elif nbytes >= cfg.small_page_bytes:
        page = cfg.small_page_bytes
    else:
        page = max(4096, -(-nbytes // 4096) * 4096)
    return page, -(-nbytes // page)


@dataclass(frozen=True)
class Grant:
    """The pager's answer for one expert computation.

    Attributes:
        requested: the expert the tokens were routed to.
        expert: the expert to run (``requested``, or the L3 stand-in).
        kind: ``hit`` (resident when its turn came), ``waited`` (L1: waited ``waited_s`` for its
            load), ``stale`` (L1 opt-in: use :meth:`ExpertPager.stale_output`), ``substitute``
            (L3: ``expert`` is the most similar resident expert).
        waited_s: seconds this computation waited.
    """

    requested: int
    expert: int
    kind: str
    waited_s: float = 0.0


class _Job:
    __slots__ = ("src", "dst", "nbytes", "done", "after", "error", "compute_event", "event")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, after: List["_Job"], compute_event) -> None:
        self.src, self.dst, self.nbytes = src, dst, src.numel()
        self.done = threading.Event()
        self.after = after  # jobs that must finish first (the slot's or the region's write-back)
        self.error: Optional[BaseException] = None
        self.compute_event = compute_event
        self.event = None  # device event recorded after the copy (CUDA/NPU)


def _accel(device: torch.device):
    """torch's module for an accelerator device type (lazy: CPU never imports CUDA/NPU code)."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu  # type: ignore[attr-defined]
    return None


class _Copier:
    """One copy direction: a worker thread, FIFO, throttled to ``rate`` bytes/s."""

    def __init__(self, name: str, rate: Optional[float], device: torch.device) -> None:
        self.rate = rate
        self.device = device
        self.mod = _accel(device)
        self.stream = self.mod.Stream(device=device) if self.mod is not None else None
        self.q: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self.busy_s = 0.0
        self.thread = threading.Thread(target=self._run, name=f"hetcomm-pager-{name}", daemon=True)
        self.thread.start()

    def submit(self, job: _Job) -> _Job:
        self.q.put(job)
        return job

    def _run(self) -> None:
        name_native_thread()  # /proc shows which thread spends a rank's CPU
        while True:
            job = self.q.get()
            if job is None:
                return
            try:
                for before in job.after:
                    before.done.wait()
                t0 = time.perf_counter()
                if self.mod is not None:
                    with self.mod.stream(self.stream):
                        if job.compute_event is not None:
                            self.stream.wait_event(job.compute_event)  # the slot's last reader is done
                        job.dst.copy_(job.src, non_blocking=True)
                        job.event = self.mod.Event()
                        job.event.record(self.stream)
                    job.event.synchronize()
                else:
                    job.dst.copy_(job.src)
                if self.rate is not None:
                    # Emulated link: the copy may not finish sooner than the link would carry it.
                    rest = job.nbytes / self.rate - (time.perf_counter() - t0)
                    if rest > 0:
                        time.sleep(rest)
                self.busy_s += time.perf_counter() - t0
            except BaseException as e:  # surfaced to the waiting thread
                job.error = e
            job.done.set()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=10)
