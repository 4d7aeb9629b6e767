"""Per-rail counters of this process: what ``hetcomm.stats()`` returns.

Counters are per process (every rank keeps its own) and cumulative until
:func:`reset_stats`. ``seconds_busy`` is the wall time a rail had at least one transfer of a
collective in flight, summed over collectives (rails of one collective overlap, so the sum over
rails can exceed the collective's time).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator

__all__ = ["stats", "reset_stats", "record", "paused"]

_FIELDS = ("bytes_sent", "bytes_received", "chunks_sent", "chunks_received", "seconds_busy", "ops")
_lock = threading.Lock()
_counters: Dict[str, Dict[str, float]] = {}


_paused = threading.local()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Leave this thread's transfers out of the counters (the rails' calibration, which is no
    traffic of the user's)."""
    before = _paused.__dict__.get("on", False)
    _paused.on = True
    try:
        yield
    finally:
        _paused.on = before


def record(rail: str, **deltas: float) -> None:
    """Add ``deltas`` (keys from ``bytes_sent``, ``bytes_received``, ``chunks_sent``,
    ``chunks_received``, ``seconds_busy``, ``ops``) to the counters of ``rail``."""
    if _paused.__dict__.get("on", False):
        return
    with _lock:
        c = _counters.setdefault(rail, {f: 0 for f in _FIELDS})
        for k, v in deltas.items():
            c[k] += v


def stats() -> Dict[str, Dict[str, float]]:
    """A copy of every rail's counters, e.g. ``{"shm": {"bytes_sent": 4096, ...}, "gloo": {...}}``.

    Only rails that carried something since the last reset appear. Byte and chunk counts are
    ints; ``seconds_busy`` is a float.
    """
    with _lock:
        return {
            rail: {k: (float(v) if k == "seconds_busy" else int(v)) for k, v in c.items()}
            for rail, c in _counters.items()
        }


def reset_stats() -> None:
    """Zero every rail's counters of this process."""
    with _lock:
        _counters.clear()
