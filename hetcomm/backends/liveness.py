"""Whether a process on this host still runs: the one liveness test of the shared-memory rail,
the board and the split checks.

A module of its own (it was in ``rails/shm.py``) so that ``checks`` can ask without importing a
rail: ``checks -> rails/shm -> rails/cma -> checks`` was an import cycle.
"""

from __future__ import annotations

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host still runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone, or being reaped right now
        return False
    except (OSError, IndexError):  # no /proc: cannot tell, assume alive and rely on the timeout
        return True
    return state not in ("Z", "X")
