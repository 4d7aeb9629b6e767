"""Kernel names for hetcomm's threads, so ``/proc/PID/task/*/comm`` (``top -H``, ``ps -L``) and
``benchmarks/het_train_emulated.py --threads`` can tell a rank's rail, executor and heartbeat
threads apart (Python < 3.14 leaves every thread named after the process)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from typing import Optional

__all__ = ["name_native_thread"]

_PR_SET_NAME = 15
_libc: Optional[ctypes.CDLL] = None


def name_native_thread(name: Optional[str] = None) -> bool:
    """Give the calling thread the kernel name ``name`` (default: its ``threading`` name),
    truncated to the kernel's 15 bytes; ``hetcomm-`` is shortened to ``hc-`` so the rest fits.
    Returns False where it cannot (not Linux, no libc): the name only helps a reader of /proc."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    name = name or threading.current_thread().name
    if name.startswith("hetcomm-"):
        name = "hc-" + name[len("hetcomm-"):]
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
