"""Traffic matrices for all-to-all: uniform, Zipf-skewed, or from split sizes.

Notation: ``T[i][j]`` is the number of bytes rank ``i`` sends to rank ``j`` (``T[i][i]`` stays
local). Sizes follow nccl-tests: ``size_bytes`` is what *each rank sends in total*, spread over
all ``n`` ranks including itself, so a uniform matrix has ``T[i][j] = size_bytes / n``.

A Zipf(s) matrix models MoE routing skew: destination popularity follows ``1 / k**s`` for the
k-th most popular rank, the same for every sender (hot experts are hot for every token), with
the order of ranks drawn from ``seed``. Every row still sums to exactly ``size_bytes``.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

import numpy as np

from hetcomm.errors import UsageError
from hetcomm.units import format_bytes, parse_size

__all__ = ["uniform", "zipf", "from_splits", "make_traffic", "parse_size", "parse_skew", "format_bytes"]

# One size parser and one byte formatter for every command (hetcomm.units); re-exported here
# because the CLI and tests have always imported them from this module.


def parse_skew(spec: Optional[str]) -> Tuple[str, float]:
    """``uniform`` / ``none`` -> ``("uniform", 0)``; ``zipf:1.2`` -> ``("zipf", 1.2)``.

    Raises:
        UsageError: anything else, or a Zipf exponent that is not a positive number.
    """
    if spec is None or spec.strip().lower() in ("", "uniform", "none"):
        return ("uniform", 0.0)
    m = re.fullmatch(r"\s*zipf\s*:\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*", spec, flags=re.IGNORECASE)
    if not m or not float(m.group(1)) > 0:
        raise UsageError(f"bad skew {spec!r}; expected 'uniform' or 'zipf:S' with S > 0, e.g. zipf:1.2")
    return ("zipf", float(m.group(1)))


def _split(total: int, weights: np.ndarray, align_bytes: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainder, in units
    of ``align_bytes``; the unaligned tail goes to the heaviest entry)."""
    units, tail = divmod(int(total), int(align_bytes))
    w = weights / weights.sum()
    raw = w * units
    out = np.floor(raw).astype(np.int64)
    short = units - int(out.sum())
    if short:
        # ties broken by index so that every rank computes the same matrix
        order = np.lexsort((np.arange(len(w)), -(raw - out)))
        out[order[:short]] += 1
    out *= align_bytes
    out[int(np.argmax(w))] += tail
    return out


def _check(num_ranks: int, size_bytes: int, align_bytes: int) -> None:
    if isinstance(num_ranks, bool) or int(num_ranks) < 1:
        raise UsageError(f"num_ranks must be a positive whole number, got {num_ranks!r}")
    if int(size_bytes) < 0:
        raise UsageError(f"size_bytes must be >= 0, got {size_bytes!r}")
    if int(align_bytes) < 1:
        raise UsageError(f"align_bytes must be >= 1, got {align_bytes!r}")


def uniform(num_ranks: int, size_bytes: int, *, align_bytes: int = 1) -> np.ndarray:
    """Every rank sends ``size_bytes`` in total, evenly to all ranks.

    Returns:
        ``[num_ranks, num_ranks]`` int64 bytes; rows sum to ``size_bytes``.
    """
    _check(num_ranks, size_bytes, align_bytes)
    row = _split(size_bytes, np.ones(num_ranks), align_bytes)
    return np.tile(row, (num_ranks, 1))


def zipf(num_ranks: int, size_bytes: int, s: float, *, seed: int = 0, align_bytes: int = 1) -> np.ndarray:
    """Every rank sends ``size_bytes``; destination ``perm[k]`` gets a share ``~ 1/(k+1)**s``.

    Args:
        num_ranks: ``n``.
        size_bytes: bytes each rank sends in total.
        s: the Zipf exponent (> 0; 1.2 is a typical MoE skew).
        seed: picks the popularity order ``perm`` (a permutation of the ranks).
        align_bytes: entries are multiples of this (element size), except one tail per row.

    Returns:
        ``[num_ranks, num_ranks]`` int64 bytes; rows sum to ``size_bytes``.
    """
    _check(num_ranks, size_bytes, align_bytes)
    if not s > 0:
        raise UsageError(f"the Zipf exponent must be > 0, got {s!r}")
    perm = np.random.default_rng(seed).permutation(num_ranks)
    weights = np.empty(num_ranks)
    # k**-s as exp(-s ln k): a steep skew (zipf:1000) underflows to 0 for k > 1 (all traffic to
    # the hottest rank) instead of overflowing k**s to inf with a numpy RuntimeWarning.
    # Past s = 1e4 every weight but the hottest is already 0, so clamping changes nothing (and
    # keeps s = inf from making 0 * inf = nan at k = 1).
    with np.errstate(under="ignore", over="ignore"):
        weights[perm] = np.exp(-min(float(s), 1e4) * np.log(np.arange(1, num_ranks + 1, dtype=float)))
    row = _split(size_bytes, weights, align_bytes)
    return np.tile(row, (num_ranks, 1))


def from_splits(split_bytes: Sequence[Sequence[int]]) -> np.ndarray:
    """A traffic matrix from per-rank split sizes in bytes (``split_bytes[i][j]`` = ``T[i][j]``).

    Raises:
        UsageError: not square, negative or non-integer entries (naming the first bad entry).
    """
    rows = list(split_bytes)
    n = len(rows)
    out = np.zeros((n, n), np.int64)
    for i, row in enumerate(rows):
        row = list(row)
        if len(row) != n:
            raise UsageError(f"split_bytes row {i} has {len(row)} entries; a traffic matrix for {n} ranks needs {n}")
        for j, x in enumerate(row):
            if isinstance(x, bool) or not float(x).is_integer() or x < 0:
                raise UsageError(f"split_bytes[{i}][{j}] = {x!r}; byte counts must be whole numbers >= 0")
            out[i, j] = int(x)
    return out


def make_traffic(num_ranks: int, size_bytes: int, skew: str = "uniform", *, seed: int = 0) -> np.ndarray:
    """:func:`uniform` or :func:`zipf` from a skew spec (``uniform``, ``zipf:1.2``)."""
    kind, s = parse_skew(skew)
    if kind == "uniform":
        return uniform(num_ranks, size_bytes)
    return zipf(num_ranks, size_bytes, s, seed=seed)
