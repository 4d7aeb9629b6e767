"""This process's MoE traffic counters: the rows every dispatch/combine moved (forward and
backward, wire dtypes applied), in the names the MoE benchmarks and tests read."""

from __future__ import annotations

from typing import Dict

from hetcomm.backends import tokens

__all__ = ["counters", "reset_counters"]


def counters() -> Dict[str, int]:
    """``a2a_calls`` (row exchanges), ``a2a_bytes_sent`` / ``a2a_bytes_recv`` (row bytes to and
    from *other* ranks) of this process, from :func:`hetcomm.backends.tokens.counters`."""
    td = tokens.counters()
    return {"a2a_calls": td["calls"], "a2a_bytes_sent": td["bytes_sent"], "a2a_bytes_recv": td["bytes_recv"]}


def reset_counters() -> None:
    """Zero :func:`counters`."""
    tokens.reset_counters()
