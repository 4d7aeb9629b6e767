"""The one size parser and the one byte formatter every command and option uses.

``hetcomm simulate --size``, ``hetcomm audit --size``, ``hetcomm bench -b/-e/-i``,
``HETCOMM_CHUNK_BYTES``/``HETCOMM_SHM_RING_BYTES`` and the input caps all read sizes with
:func:`parse_size`, and every table prints bytes with :func:`format_bytes`, so ``1.5M`` means the
same thing everywhere (before, ``simulate --size 1.5M`` worked and ``bench -b 1.5M`` failed).

Units are binary, as nccl-tests reads ``-b/-e``: ``K`` = 1024, ``M`` = 1024², ``G``, ``T``; an
optional ``B``/``iB`` after the unit is accepted (``64M``, ``64MB``, ``64MiB``, ``64 mb``). A
fraction is accepted when it is a whole number of bytes (``1.5K`` = 1536) and refused when it is
not (``1.5``, ``0.1K``), rather than rounded. The arithmetic is exact (``fractions``), so a
20-digit size is never wrapped or rounded by a float: it is refused against ``maximum``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

from hetcomm.errors import UsageError

__all__ = ["parse_size", "format_bytes", "UNITS", "MAX_SIZE"]

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: Default upper bound of a parsed size: 1 TiB (a message, buffer or file larger than this is a
#: typo on any machine hetcomm targets). Callers pass their own ``maximum`` where it is smaller.
MAX_SIZE = 1 << 40

_SIZE_RE = re.compile(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*")
_FORMS = "a byte count like 4096, 64K, 64M, 1.5G or 256MiB (binary units)"


def parse_size(
    text: str,
    *,
    what: str = "size",
    minimum: int = 1,
    maximum: Optional[int] = MAX_SIZE,
    error: type = UsageError,
) -> int:
    """Bytes from ``4096``, ``64K``, ``1MiB``, ``256MB`` or ``1.5G``.

    Args:
        text: the value as typed.
        what: the flag, variable or key it came from, named in every error (``-b/--minbytes``).
        minimum: the smallest size accepted (0 allows ``0``).
        maximum: the largest size accepted, or None for no bound.
        error: the exception type (:class:`UsageError` for flags; ``ConfigError`` for options).

    Raises:
        ``error``: not a size, not a whole number of bytes, or outside ``[minimum, maximum]``;
        the message names ``what`` and the accepted forms.
    """
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise error(f"{what}: bad size {text!r}; expected {_FORMS}")
    value = Fraction(m.group(1)) * UNITS[m.group(2).upper()]
    if value.denominator != 1:
        raise error(
            f"{what}: bad size {text!r} is {float(value):g} bytes, not a whole number of bytes; "
            f"give whole bytes (e.g. {int(value)} or {int(value) + 1}) or a unit (1.5K = 1536)"
        )
    n = int(value)
    if n < minimum:
        raise error(f"{what}: bad size {text!r}; must be at least {minimum} byte{'s' if minimum != 1 else ''}")
    if maximum is not None and n > maximum:
        raise error(f"{what}: bad size {text!r}; must be at most {format_bytes(maximum)} ({maximum} bytes)")
    return n


def format_bytes(num_bytes: float) -> str:
    """``67108864`` -> ``64 MiB``; ``1536`` -> ``1.50 KiB``; ``12`` -> ``12 B`` (binary units)."""
    value = float(num_bytes)
    if value != value or value in (float("inf"), float("-inf")):
        return f"{value} B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value == int(value) else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
