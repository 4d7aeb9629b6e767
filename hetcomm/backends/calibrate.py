"""Which rail carries CPU tensors between same-host peers: ``shm`` or ``gloo``, per host.

(First step: no measurement yet; every host keeps the shared-memory rail.)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict

__all__ = ["same_host_rails"]


def same_host_rails(store, rails, options, placement, rank: int, size: int, timeout: timedelta) -> Dict[str, str]:
    """``host -> rail`` for same-host pairs (empty: shm wherever it may be used)."""
    return {}
