"""Checks of command-line values that several subcommands share (``--nprocs``).

Sizes are read by :func:`hetcomm.units.parse_size`; this module holds the other shared bounds.
"""

from __future__ import annotations

from typing import Optional

from hetcomm.errors import UsageError

__all__ = ["MAX_LOCAL_RANKS", "RANK_BASELINE_BYTES", "check_nprocs"]

#: Most ranks one command starts on this machine. Every rank is a Python process with torch
#: loaded (~150-200 MB before any buffer): 65 of them took 10 GB within 50 s. A larger job runs
#: under torchrun on several machines, or on an emulated cluster.
MAX_LOCAL_RANKS = 64
#: Memory one idle rank process holds (interpreter, torch, gloo), for memory checks.
RANK_BASELINE_BYTES = 200 << 20


def check_nprocs(value: Optional[int], flag: str = "--nprocs") -> Optional[int]:
    """``value`` when it is a usable number of local ranks (None passes through).

    Raises:
        UsageError: fewer than 1 or more than :data:`MAX_LOCAL_RANKS`.
    """
    if value is None:
        return None
    if value < 1:
        raise UsageError(f"{flag} {value}: need at least 1 rank")
    if value > MAX_LOCAL_RANKS:
        raise UsageError(
            f"{flag} {value}: at most {MAX_LOCAL_RANKS} ranks are started on one machine (each is "
            f"a process with torch loaded, ~200 MB); run a larger job under torchrun across machines"
        )
    return value
