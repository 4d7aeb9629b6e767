"""Recycled row buffers for the token data path (dispatch/combine and the MoE layer).

Lives in ``hetcomm.backends`` because :mod:`hetcomm.backends.tokens` uses it and
dependencies flow topo -> sched -> backends -> moe; the MoE layer imports it from here.

Every step the layer moves its ``[S, D]`` / ``[R, D]`` rows through a handful of full-size
temporaries (send and receive buffers of four all-to-alls, the expert-major copy, the combine's
scaled rows, the gradients of all of them). At D=1024 and 8,192 rows each is 32 MiB. glibc serves
allocations that large with a fresh ``mmap`` and unmaps them on free, so every step faults every
page of every temporary in again: in isolation a [8192, 1024] FP32 copy into a fresh tensor costs
~18 ms of CPU, into a reused one ~3.5 ms. The pool keeps such buffers and hands one out again as
soon as nothing references it any more.

"Nothing references it" is decided from the storage's reference count, which every tensor,
view and autograd saved-tensor slot sharing the memory holds: a buffer saved for backward, still
in flight in an async all-to-all, or kept by the user (say as ``x.grad``) is never reused. The
tensors handed out are plain tensors over the buffer's storage (not views), so autograd treats
them like any other tensor.

Small requests (under :data:`MIN_POOL_BYTES`) go to the ordinary allocator, which already
recycles them.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["BufferPool", "MIN_POOL_BYTES", "default_pool", "empty", "zeros"]

#: Requests smaller than this are not pooled: glibc's heap recycles them without page faults.
MIN_POOL_BYTES = 1 << 20

try:  # private, but stable across the torch versions hetcomm supports (2.13 pinned)
    _use_count = torch._C._storage_Use_Count
except AttributeError:  # pragma: no cover - a torch without it: no pooling, plain allocations
    _use_count = None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(1, s)
    return tuple(reversed(strides))


def _rounded(numel: int) -> int:
    """``numel`` rounded up to 1/8 of its power of two, so that slightly varying row counts
    (routing changes every step) land on the same buffer."""
    step = max(1, (1 << max(0, numel.bit_length() - 1)) >> 3)
    return (numel + step - 1) // step * step


class BufferPool:
    """Flat buffers per dtype, reused once their storage has no other user.

    Args:
        max_buffers: buffers kept per dtype; past it, the least recently handed-out free ones
            are dropped (a model with many MoE layers holds about two per layer between forward
            and backward).
    """

    def __init__(self, max_buffers: int = 64) -> None:
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        # dtype -> [(flat buffer, its storage object, use count when free, last use tick)]
        self._free: Dict[torch.dtype, List[list]] = {}
        self._tick = 0
        self.num_allocated = 0
        self.num_reused = 0

    def _is_free(self, entry: list) -> bool:
        return _use_count(entry[1]._cdata) == entry[2]

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype``.

        Args:
            shape: any shape.
            dtype: any dtype.
            device: None or CPU: pooled; any other device: a plain ``torch.empty`` (CUDA and NPU
                have caching allocators of their own).
        Returns:
            A tensor (not a view) whose memory may be a recycled buffer's.
        """
        shape = tuple(int(s) for s in shape)
        if device is not None and torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = _numel(shape)
        itemsize = _itemsize(dtype)
        if _use_count is None or numel * itemsize < MIN_POOL_BYTES:
            return torch.empty(shape, dtype=dtype, device="cpu")
        with self._lock:
            self._tick += 1
            entries = self._free.setdefault(dtype, [])
            best = None
            for e in entries:
                n = e[0].numel()
                # Best fit, at most 2x too big: a small request must not pin a big buffer that a
                # big request of the same step would then have to allocate again.
                if numel <= n <= 2 * numel and (best is None or n < best[0].numel()) and self._is_free(e):
                    best = e
            if best is None:
                buf = torch.empty(_rounded(numel), dtype=dtype, device="cpu")
                storage = buf.untyped_storage()
                best = [buf, storage, _use_count(storage._cdata), self._tick]
                entries.append(best)
                self.num_allocated += 1
                self._trim(entries, keep=best)
            else:
                self.num_reused += 1
            best[3] = self._tick
            # Attach under the lock: until ``out`` holds the storage, the entry still looks free
            # and another thread could hand the same buffer out.
            out = torch.empty(0, dtype=dtype, device="cpu")
            with torch.no_grad():
                out.set_(best[1], 0, shape, _contiguous_strides(shape))
        return out

    def zeros(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """:meth:`empty`, zero-filled."""
        return self.empty(shape, dtype, device).zero_()

    def _trim(self, entries: List[list], keep: list) -> None:
        """Drop the least recently used free buffers past ``max_buffers``; never ``keep`` (the
        buffer being handed out, which still looks free until it is attached)."""
        if len(entries) <= self.max_buffers:
            return
        free = sorted((e for e in entries if e is not keep and self._is_free(e)), key=lambda e: e[3])
        drop = {id(e) for e in free[: len(entries) - self.max_buffers]}
        # By identity: list.remove would compare the entries' tensors elementwise.
        entries[:] = [e for e in entries if id(e) not in drop]

    def release(self) -> int:
        """Drop every buffer nothing uses now (their memory goes back to the system).

        Returns:
            Bytes released.
        """
        released = 0
        with self._lock:
            for entries in self._free.values():
                free = [e for e in entries if self._is_free(e)]
                released += sum(e[0].numel() * e[0].element_size() for e in free)
                entries[:] = [e for e in entries if not any(e is f for f in free)]
        return released

    def held_bytes(self) -> Tuple[int, int]:
        """``(bytes held in total, bytes of those in use now)``."""
        total = used = 0
        with self._lock:
            for entries in self._free.values():
                for e in entries:
                    b = e[0].numel() * e[0].element_size()
                    total += b
                    if not self._is_free(e):
                        used += b
        return total, used


_default = BufferPool()


def default_pool() -> BufferPool:
    """The process-wide pool every MoE layer shares (buffers freed by one layer serve the next)."""
    return _default


def empty(shape: Sequence[int], dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """:meth:`BufferPool.empty` on the default pool."""
    return _default.empty(shape, dtype, device)


def zeros(shape: Sequence[int], dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """:meth:`BufferPool.zeros` on the default pool."""
    return _default.zeros(shape, dtype, device)
