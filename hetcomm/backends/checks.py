"""Cross-rank checks before any byte moves, and diagnosis of failed peers.

``all_to_all_single`` and ``all_to_all`` first share a small int64 vector with every peer
(``(6 + 2n) * 8`` bytes, through :mod:`hetcomm.backends.board` or over the rails): the collective's kind and
sequence number, dtype, bytes per row, a hash of the row shape, and the rank's input and output
split sizes. Every rank then checks the whole ``n x n`` matrix, so every rank finds the *same*
mismatches and raises the same ``ValueError``: no rank proceeds to move bytes that its peer does
not expect (plain gloo aborts the receiving process on such a mismatch).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.placement import Placement
from hetcomm.backends.rails.shm import pid_alive
from hetcomm.errors import UsageError

__all__ = [
    "Meta",
    "encode_meta",
    "meta_width",
    "check_meta",
    "dead_peers",
    "missing_peers",
    "DTYPES",
    "dtype_code",
    "splits_agreed",
    "splits_are_agreed",
]

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_KIND = {"all_to_all_single": 1, "all_to_all": 2}
_HEAD = 6


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer for ``dtype`` that every rank computes the same way."""
    try:
        return DTYPES.index(dtype)
    except ValueError:
        return 100 + (hash(str(dtype)) % 1000)


def _shape_hash(shape: Sequence[int]) -> int:
    h = 1469598103934665603
    for d in shape:
        h = ((h ^ int(d)) * 1099511628211) % (1 << 61)
    return h


def meta_width(n: int) -> int:
    """Length of the metadata vector of a group of ``n`` ranks."""
    return _HEAD + 2 * n


def encode_meta(
    op: str, seq: int, dtype: torch.dtype, row_bytes: int, row_shape: Sequence[int],
    input_sizes: Sequence[int], output_sizes: Sequence[int],
) -> torch.Tensor:
    """This rank's metadata vector: ``[6 + 2n]``, ``torch.int64``.

    Args:
        input_sizes / output_sizes: rows (``all_to_all_single``) or bytes (``all_to_all``) this
            rank sends to / receives from each rank.
    """
    head = [_KIND[op], seq, dtype_code(dtype), row_bytes, _shape_hash(row_shape), len(input_sizes)]
    return torch.tensor(head + list(input_sizes) + list(output_sizes), dtype=torch.int64)


class Meta:
    """The gathered metadata of every rank (``rows[r]`` is rank r's vector)."""

    def __init__(self, rows: List[List[int]]):
        self.rows = rows
        self.n = len(rows)

    def sends(self, r: int) -> List[int]:
        """Rank r's input split sizes."""
        return self.rows[r][_HEAD : _HEAD + self.n]

    def recvs(self, r: int) -> List[int]:
        """Rank r's output split sizes."""
        return self.rows[r][_HEAD + self.n : _HEAD + 2 * self.n]


def check_meta(op: str, rank: int, gathered: Sequence[torch.Tensor], unit: str = "rows") -> Meta:
    """Verify the gathered vectors agree; raise the same ``ValueError`` on every rank if not.

    Raises:
        UsageError (a ``ValueError``): naming every (sender, receiver) pair whose sizes
            disagree, and any rank whose dtype, row size or collective differs from rank 0's.
    """
    rows = [t.tolist() for t in gathered]
    n = len(rows)
    problems: List[str] = []
    ref = rows[0]
    for r, row in enumerate(rows):
        if row[0] != ref[0] or row[1] != ref[1]:
            problems.append(
                f"rank {r} is in collective #{row[1]} ({_name(row[0])}) while rank 0 is in "
                f"#{ref[1]} ({_name(ref[0])}): the ranks called collectives in different orders"
            )
        elif row[2] != ref[2]:
            problems.append(f"rank {r} has dtype {_dtype_name(row[2])} but rank 0 has {_dtype_name(ref[2])}")
        elif row[3] != ref[3] or row[4] != ref[4]:
            problems.append(
                f"rank {r} has rows of {row[3]} bytes/shape#{row[4] % 10000} but rank 0 has "
                f"{ref[3]} bytes/shape#{ref[4] % 10000}: every rank needs the same size(1..) and dtype"
            )
    meta = Meta(rows)
    if not problems:
        for src in range(n):
            for dst in range(n):
                sent, expected = meta.sends(src)[dst], meta.recvs(dst)[src]
                if sent != expected:
                    problems.append(
                        f"rank {src} sends {sent} {unit} to rank {dst}, but rank {dst} expects "
                        f"{expected} (its output_split_sizes[{src}]={expected})"
                    )
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise UsageError(
            f"hetcomm {op}: split size mismatch across ranks, detected on rank {rank} before any data "
            f"moved: {shown}. Fix the callers so that input_split_sizes[j] on rank i equals "
            f"output_split_sizes[i] on rank j."
        )
    return meta


def _name(kind: int) -> str:
    return {v: k for k, v in _KIND.items()}.get(kind, f"kind {kind}")


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]) if 0 <= code < len(DTYPES) else f"dtype#{code}"


def dead_peers(placement: Placement, me: int, peers: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """``(rank, pid)`` of peers on this host whose process has exited (remote ones are not checked)."""
    out = []
    for r in (range(len(placement)) if peers is None else peers):
        if r != me and placement.same_host(me, r) and not pid_alive(placement.ranks[r].pid):
            out.append((r, placement.ranks[r].pid))
    return out


def missing_peers(store, rank: int, size: int, wait_s: float) -> Optional[List[int]]:
    """Ranks that did not report a failure (store key ``hetcomm/diag/failed/<rank>``) within
    ``wait_s`` seconds.

    Called by every rank whose collective failed: it leaves its own mark in the store, then
    looks for the others'. A rank that is dead, hung or never called the collective leaves no
    mark; so does a rank that has not *yet* hit the failure (it will at its next collective),
    which is why callers prefer :func:`dead_peers` when it names someone.

    Returns:
        The ranks without a mark, or None when the store itself is unreachable (e.g. it lived in
        the dead rank).
    """
    try:
        store.set(f"hetcomm/diag/failed/{rank}", "1")
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(size) if r != rank]
        while missing:
            missing = [r for r in missing if not store.check([f"hetcomm/diag/failed/{r}"])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return missing
    except Exception:  # the store is gone too: nothing more to learn
        return None


_agreed = threading.local()


@contextlib.contextmanager
def splits_agreed() -> Iterator[None]:
    """Skip the cross-rank split check for ``all_to_all_single`` calls made inside this block.

    For callers whose split sizes are consistent across ranks by construction, e.g. an MoE
    dispatch whose receive counts came from an all-to-all of the send counts just before (that
    exchange itself is checked). Every rank must make the same calls inside the block: the check
    is a collective step, skipped on all ranks or on none. Plans still exchange metadata (they
    need the whole traffic matrix).
    """
    previous = getattr(_agreed, "on", False)
    _agreed.on = True
    try:
        yield
    finally:
        _agreed.on = previous


def splits_are_agreed() -> bool:
    """True inside :func:`splits_agreed` on this thread."""
    return getattr(_agreed, "on", False)

