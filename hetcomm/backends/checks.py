"""Cross-rank checks before any byte moves, and diagnosis of failed peers.

Every checked collective first shares a small int64 vector with every peer (``(16 + 2n) * 8``
bytes, through :mod:`hetcomm.backends.board` when the group shares memory, else over gloo or the
rails). The vector holds:

====  ===========================================================================================
0     the collective's kind (:data:`KINDS`)
1     its sequence number in the group (one counter over every checked collective)
2     the dtype (:func:`dtype_code`, the same on every rank and every run)
3     the per-rank element count (``numel`` of the piece each rank contributes or receives), or
      the bytes per row of an all-to-all
4     the reduce op (:data:`REDUCE_OPS`; 0 when the collective has none)
5     the root rank (-1 when the collective has none)
6     1 when this rank already refused its own arguments (the others then raise too)
7     the number of dimensions of the shape shown in messages
8-13  its first six sizes
14    a hash of the whole shape (only compared where shapes must agree: all-to-all rows)
15    ``n``, then ``n`` input and ``n`` output split sizes (all-to-all only; zeros elsewhere)
====  ===========================================================================================

Every rank checks the whole matrix, so every rank finds the *same* mismatches and raises the same
:class:`~hetcomm.errors.CrossRankMismatch` (a ``ValueError``): no rank proceeds to move bytes that
its peer does not expect (plain gloo aborts the receiving process on such a mismatch, or returns
garbage). The kind and the group-wide sequence number make a rank that skipped a collective, or
called them in a different order, fail at the first collective whose kind differs from its peers'.
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections import Counter
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from hetcomm.backends.rank_placement import Placement
from hetcomm.backends.liveness import pid_alive
from hetcomm.errors import CrossRankMismatch

__all__ = [
    "Meta",
    "KINDS",
    "REDUCE_OPS",
    "encode_meta",
    "encode_collective",
    "meta_width",
    "check_meta",
    "refusal",
    "dead_peers",
    "missing_peers",
    "DTYPE_NAMES",
    "dtype_code",
    "dtype_from_code",
    "splits_agreed",
    "splits_are_agreed",
]

#: Stable dtype codes: the index in this tuple. Append only, never reorder: ranks running
#: different hetcomm versions would otherwise disagree. A dtype missing here (a future torch)
#: gets ``1000 + crc32(str(dtype))``, also the same in every process (Python's ``hash`` of a
#: string is randomised per process, which is why it must not be used).
DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64",
    "bool", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "uint16", "uint32", "uint64", "complex32",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
)
_DTYPE_INDEX = {name: i for i, name in enumerate(DTYPE_NAMES)}

#: Collective kinds (append only, like the dtype codes).
KINDS = (
    "", "all_to_all_single", "all_to_all", "plan", "all_reduce", "broadcast", "reduce",
    "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "barrier", "all_reduce_coalesced", "all_gather_coalesced",
    # gloo's sparse all-reduce gathers indices and values, a dense one reduces in place: two
    # collectives on the wire, so a sparse tensor on one rank and a dense one on another must
    # not pass the check as the same call (they hung until the group timeout)
    "all_reduce_sparse",
    "gather_into_tensor",
)
_KIND = {k: i for i, k in enumerate(KINDS) if k}
#: Reduce ops by name (``dist.ReduceOp.SUM`` -> ``"SUM"``); 0 = the collective has none.
REDUCE_OPS = ("", "SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "UNUSED")
_REDUCE = {k: i for i, k in enumerate(REDUCE_OPS) if k}

_HEAD = 17
_DIMS = 6  # shape sizes carried verbatim (the hash covers the rest)
(_F_KIND, _F_SEQ, _F_DTYPE, _F_COUNT, _F_REDOP, _F_ROOT, _F_LOCAL, _F_NDIM) = range(8)
# _F_ADDR: the input's address, for the single-copy all-to-all (rails/cma.py); never compared.
_F_HASH, _F_N, _F_ADDR = 14, 15, 16


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer for ``dtype`` that every rank computes the same way, in every run."""
    name = str(dtype).rpartition(".")[2]
    code = _DTYPE_INDEX.get(name)
    if code is not None:
        return code
    return 1000 + zlib.crc32(name.encode())


def dtype_from_code(code: int) -> Optional[torch.dtype]:
    """The dtype :func:`dtype_code` maps to ``code``, if this torch has it."""
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and dtype_code(value) == code:
            return value
    return None


def _dtype_name(code: int) -> str:
    dt = dtype_from_code(code)
    return str(dt) if dt is not None else f"an unknown dtype (code {code})"


def _shape_hash(shape: Sequence[int]) -> int:
    h = 1469598103934665603
    for d in shape:
        h = ((h ^ int(d)) * 1099511628211) % (1 << 61)
    return (h ^ len(shape)) % (1 << 61)


def meta_width(n: int) -> int:
    """Length of the metadata vector of a group of ``n`` ranks."""
    return _HEAD + 2 * n


def _vector(
    kind: str, seq: int, dtype: Optional[torch.dtype], count: int, shape: Sequence[int], reduce_op: Optional[str],
    root: Optional[int], local_problem: bool, input_sizes: Sequence[int], output_sizes: Sequence[int], n: int,
    addr: int = 0,
) -> torch.Tensor:
    dims = [int(d) for d in shape]
    head = [0] * _HEAD
    head[_F_KIND] = _KIND[kind]
    head[_F_SEQ] = seq
    head[_F_DTYPE] = dtype_code(dtype) if dtype is not None else -1
    head[_F_COUNT] = int(count)
    head[_F_REDOP] = _REDUCE[reduce_op] if reduce_op else 0
    head[_F_ROOT] = -1 if root is None else int(root)
    head[_F_LOCAL] = 1 if local_problem else 0
    head[_F_NDIM] = len(dims)
    head[_F_NDIM + 1 : _F_NDIM + 1 + min(len(dims), _DIMS)] = dims[:_DIMS]
    head[_F_HASH] = _shape_hash(dims)
    head[_F_N] = n
    head[_F_ADDR] = int(addr)
    sizes = list(input_sizes) + list(output_sizes)
    if not sizes:
        sizes = [0] * (2 * n)
    # A device tensor would cost a host sync to read back: the vector is built and read on the host.
    return torch.tensor(head + sizes, dtype=torch.int64, device="cpu")


def encode_meta(
    op: str, seq: int, dtype: torch.dtype, row_bytes: int, row_shape: Sequence[int],
    input_sizes: Sequence[int], output_sizes: Sequence[int], addr: int = 0,
) -> torch.Tensor:
    """This rank's metadata vector for an all-to-all: ``[17 + 2n]``, ``torch.int64``.

    Args:
        op: ``all_to_all_single``, ``all_to_all`` or ``plan``.
        seq: the collective's sequence number in the group.
        row_bytes / row_shape: bytes and shape of one row (``input.shape[1:]``; ``()`` for the
            list form, whose sizes are elements).
        input_sizes / output_sizes: rows (``all_to_all_single``) or elements (``all_to_all``)
            this rank sends to / receives from each rank.
        addr: the input's host address when the peers may read it in place (the single-copy
            path, :mod:`hetcomm.backends.rails.cma`); 0 otherwise. Not compared across ranks.
    """
    assert len(input_sizes) == len(output_sizes), (input_sizes, output_sizes)
    return _vector(op, seq, dtype, row_bytes, row_shape, None, None, False, input_sizes, output_sizes, len(input_sizes), addr)


def encode_collective(
    kind: str, seq: int, n: int, dtype: Optional[torch.dtype] = None, count: int = 0,
    shape: Sequence[int] = (), reduce_op: Optional[str] = None, root: Optional[int] = None,
    local_problem: bool = False,
) -> torch.Tensor:
    """This rank's metadata vector for any other collective: ``[17 + 2n]``, ``torch.int64``.

    Args:
        kind: one of :data:`KINDS` (e.g. ``all_reduce``).
        seq: the collective's sequence number in the group.
        n: the group size.
        dtype / count / shape: dtype, element count and shape of the piece every rank must
            agree on (the tensor of an all_reduce/broadcast/reduce, the input of an all_gather
            or gather, the output of a scatter or reduce_scatter); ``None``/``0``/``()`` for a
            barrier.
        reduce_op: name of the reduce op (``"SUM"``...), for reducing collectives.
        root: the root rank, for rooted collectives.
        local_problem: this rank found its own arguments invalid (it raises its own message;
            the others raise naming it).
    """
    return _vector(kind, seq, dtype, count, shape, reduce_op, root, local_problem, (), (), n)


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

    def addr(self, r: int) -> int:
        """Rank r's input address (0 unless it offered its input for single-copy reads)."""
        return self.rows[r][_F_ADDR]


def failures(rows: Sequence[Sequence[int]]) -> List[Tuple[int, int, int]]:
    """``[(rank, peer, errno)]`` of the ranks whose closing vector of a single-copy all-to-all
    (:func:`hetcomm.backends.rails.cma.finish`) flags a failed read of ``peer``."""
    return [(r, row[_F_ROOT], row[_F_COUNT]) for r, row in enumerate(rows) if row[_F_LOCAL]]


def _shape_text(row: Sequence[int]) -> str:
    ndim = row[_F_NDIM]
    dims = list(row[_F_NDIM + 1 : _F_NDIM + 1 + min(ndim, _DIMS)])
    body = ", ".join(str(d) for d in dims) + (", ..." if ndim > _DIMS else "")
    return f"({body}{',' if ndim == 1 else ''})"


def _odd_ones(rows: List[List[int]], key) -> Tuple[object, int, List[int]]:
    """``(reference value, a rank that has it, ranks that differ)``: the reference is the most
    common value (ties: the lowest rank's), so one wrong rank is named alone."""
    values = [key(row) for row in rows]
    counts = Counter(values)
    best = max(counts.values())
    ref_rank = next(r for r, v in enumerate(values) if counts[v] == best)
    ref = values[ref_rank]
    return ref, ref_rank, [r for r, v in enumerate(values) if v != ref]


def check_meta(
    op: str, rank: int, gathered: Sequence[torch.Tensor], unit: str = "rows", local_error: Optional[str] = None
) -> Meta:
    """Verify the gathered vectors agree; raise the same error on every rank if not.

    Args:
        op: the collective (for messages).
        rank: this rank.
        gathered: every rank's vector (from :func:`encode_meta` or :func:`encode_collective`).
        unit: what the split sizes count (``rows``, ``elements``).
        local_error: this rank's own complaint about its arguments, when it set
            ``local_problem``; it becomes part of this rank's message.

    Raises:
        CrossRankMismatch (a ``ValueError``): with ``field`` the first class of problem found
            (``order``, ``layout``, ``arguments``, ``dtype``, ``shape``, ``count``, ``reduce_op``, ``root``,
            ``splits``), ``ranks`` the ranks at odds with the others, and a message naming each
            of them with both values and how to fix it.
    """
    rows = [t.tolist() for t in gathered]
    meta = Meta(rows)
    kind = lambda row: (row[_F_KIND], row[_F_SEQ])
    ref, ref_rank, odd = _odd_ones(rows, kind)
    dense_sparse = {_KIND["all_reduce"], _KIND["all_reduce_sparse"]}
    if odd and {row[_F_KIND] for row in rows} == dense_sparse and len({row[_F_SEQ] for row in rows}) == 1:
        parts = [
            f"rank {r} passes a {'sparse COO' if rows[r][_F_KIND] == _KIND['all_reduce_sparse'] else 'dense (strided)'} "
            f"tensor of shape {_shape_text(rows[r])}"
            for r in range(len(rows))
        ]
        _raise(op, rank, "layout", odd, parts,
               "every rank must pass a tensor of the same layout: call .to_dense() (or .to_sparse_coo()) "
               "on the ranks named before the call")
    if odd:
        parts = [
            f"rank {r} is in collective #{rows[r][_F_SEQ]} ({_kind_name(rows[r][_F_KIND])}) while rank {ref_rank} is in "
            f"#{ref[1]} ({_kind_name(ref[0])})"
            for r in odd
        ]
        _raise(op, rank, "order", odd, parts,
               "a rank skipped a collective, or the ranks called collectives in different orders; every rank "
               "of a group must make the same collective calls in the same order")
    refused = [r for r, row in enumerate(rows) if row[_F_LOCAL]]
    if refused:
        parts = [f"rank {r} refused its own arguments" for r in refused]
        if local_error is not None:
            parts.append(f"here (rank {rank}): {local_error}")
        _raise(op, rank, "arguments", refused, parts, "fix the arguments on the rank(s) named (each says what is wrong)")
    is_a2a = rows[0][_F_KIND] in (_KIND["all_to_all_single"], _KIND["all_to_all"], _KIND["plan"])
    ref, ref_rank, odd = _odd_ones(rows, lambda row: row[_F_DTYPE])
    if odd:
        parts = [f"rank {r} has dtype {_dtype_name(rows[r][_F_DTYPE])}" for r in odd]
        parts.append(f"rank {ref_rank} and the others have {_dtype_name(ref)}" if len(odd) < len(rows) - 1 else f"rank {ref_rank} has {_dtype_name(ref)}")
        _raise(op, rank, "dtype", odd, parts, "every rank must pass tensors of the same dtype (cast before the call)")
    if is_a2a:
        ref, ref_rank, odd = _odd_ones(rows, lambda row: (row[_F_COUNT], row[_F_HASH]))
        if odd:
            parts = [f"rank {r} has rows of shape {_shape_text(rows[r])} ({rows[r][_F_COUNT]} bytes)" for r in odd]
            parts.append(f"rank {ref_rank} has rows of shape {_shape_text(rows[ref_rank])} ({ref[0]} bytes)")
            _raise(op, rank, "shape", odd, parts,
                   "every rank must pass input and output tensors of the same size(1), size(2), ... "
                   "(the row shape) and dtype; only size(0) may differ")
    else:
        ref, ref_rank, odd = _odd_ones(rows, lambda row: row[_F_COUNT])
        if odd:
            parts = [f"rank {r} has {rows[r][_F_COUNT]} elements (shape {_shape_text(rows[r])})" for r in odd]
            parts.append(f"rank {ref_rank} has {ref} (shape {_shape_text(rows[ref_rank])})")
            _raise(op, rank, "count", odd, parts, f"every rank must pass {_piece(op)} of the same number of elements")
        ref, ref_rank, odd = _odd_ones(rows, lambda row: row[_F_REDOP])
        if odd:
            parts = [f"rank {r} reduces with {REDUCE_OPS[rows[r][_F_REDOP]] or 'no op'}" for r in odd]
            parts.append(f"rank {ref_rank} with {REDUCE_OPS[ref] or 'no op'}")
            _raise(op, rank, "reduce_op", odd, parts, "pass the same op= on every rank")
        ref, ref_rank, odd = _odd_ones(rows, lambda row: row[_F_ROOT])
        if odd:
            parts = [f"rank {r} names root {rows[r][_F_ROOT]}" for r in odd]
            parts.append(f"rank {ref_rank} names root {ref}")
            _raise(op, rank, "root", odd, parts, "pass the same src=/dst= (group rank) on every rank")
        return meta
    n = len(rows)
    problems: List[str] = []
    bad = set()
    for src in range(n):
        for dst in range(n):
            sent, expected = meta.sends(src)[dst], meta.recvs(dst)[src]
            if sent != expected:
                bad.update((src, dst))
                problems.append(
                    f"rank {src} sends {sent} {unit} to rank {dst}, but rank {dst} expects "
                    f"{expected} (its output_split_sizes[{src}]={expected})"
                )
    if problems:
        _raise(op, rank, "splits", sorted(bad), problems,
               "fix the callers so that input_split_sizes[j] on rank i equals output_split_sizes[i] on rank j",
               title="split size mismatch across ranks")
    return meta


def _piece(op: str) -> str:
    if op in ("all_gather", "all_gather_into_tensor", "gather", "gather_into_tensor", "all_gather_coalesced"):
        return "inputs"
    if op in ("scatter", "reduce_scatter", "reduce_scatter_tensor"):
        return "outputs"
    return "tensors"


_TITLES = {
    "order": "collectives out of step across ranks",
    "arguments": "invalid arguments",
    "dtype": "dtype mismatch across ranks",
    "shape": "row shape mismatch across ranks",
    "count": "size mismatch across ranks",
    "reduce_op": "reduce op mismatch across ranks",
    "root": "root mismatch across ranks",
    "layout": "sparse/dense layout mismatch across ranks",
}


def _raise(op: str, rank: int, field: str, ranks: Sequence[int], parts: List[str], fix: str, title: str = "") -> None:
    shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
    raise CrossRankMismatch(
        f"hetcomm {op}: {title or _TITLES[field]}, detected on rank {rank} before any data moved: {shown}. "
        f"Fix: {fix}.",
        op=op, rank=rank, ranks=list(ranks), field=field,
    )


def refusal(op: str, rank: int, text: str) -> CrossRankMismatch:
    """The error of a rank that refuses its own arguments while the cross-rank check is off (the
    other ranks are not told: with the check off they wait for this rank and time out)."""
    return CrossRankMismatch(
        f"hetcomm {op} (rank {rank}): {text}", op=op, rank=rank, ranks=[rank], field="arguments"
    )


def _kind_name(kind: int) -> str:
    return KINDS[kind] if 0 < kind < len(KINDS) else f"kind {kind}"


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
