"""Parse nccl-tests output (``alltoall_perf``, ``all_reduce_perf``, ...) into measurements.

One result block looks like this (current layout, NCCL >= 2.13; topology-notes §5.2)::

    # Collective test starting: alltoall_perf
    # nThread 1 nGpus 8 minBytes 524288 maxBytes 8589934592 step: 2(factor) ...
    #  Rank  0 Group  0 Pid 2380523 on    Node1 device  0 [0000:4e:00] NVIDIA H100 80GB HBM3
    #                                                  out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     8589934592   268435456     float    none      -1    11126  772.06  675.55      0    11206  766.58  670.76    N/A
    # Avg bus bandwidth    : 359.21
    # Collective test concluded: alltoall_perf

The parser keys on the header row, not on fixed positions: the old layout (nccl-tests#78) has no
``root`` column, says ``error`` (a max deviation, not a count) instead of ``#wrong``, and leaves the
``redop`` cell *blank* for alltoall. A row is therefore read from both ends: ``size count type``
first, the two ``time algbw busbw #wrong`` halves last, and whatever is between is ``redop``/``root``.

Per block:

- the op comes from ``# Collective test starting: <binary>``, else from a command line naming the
  binary (``./build/all_reduce_perf -b 8 ...``), else from the columns (``redop``/``root``/size vs
  count), else ``unknown``;
- the number of ranks is the number of distinct ``#  Rank N`` lines; when the block has none (an
  excerpt), it is solved from the bus-bandwidth factor nccl-tests applies
  (``busbw = algbw * (n-1)/n`` for alltoall/allgather/reducescatter, ``2(n-1)/n`` for allreduce)
  and kept only if one integer ``n`` explains every row to print precision; otherwise None;
- ``#  Rank`` lines also give devices ``rank<N>`` (model, host, CUDA device index).

Each data row gives two :class:`Measurement` objects (out-of-place, in-place). MPI prefixes such as
``[1,0]<stdout>:`` are stripped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from hetcomm.errors import TopologyParseError
from hetcomm.topo.model import Device, Measurement, Topology, Vendor
from hetcomm.topo.parse._text import numbered_lines, strip_source_header

__all__ = ["sniff_nccl_tests", "parse_nccl_tests", "normalize_op", "busbw_factor", "FORMATS"]

_MPI_PREFIX = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
_STARTING = re.compile(r"^#\s*Collective test (starting|concluded):\s*(\S+)")
_NTHREAD = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
_RANK = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)\s+\[[^\]]*\]\s+(.*?)\s*$"
)
_HEADER = re.compile(
    r"^#\s*(size|bytes)\s+(count|N)\s+type\b.*\btime\b.*\balgbw\b.*\bbusbw\b", re.I
)
_UNITS = re.compile(r"^#\s*\(B\)")
_ROW = re.compile(r"^\s*\d+\s+\d+\s+\S")
_BINARY = re.compile(r"\b([a-z_]+)_perf(?:_mpi)?\b")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:")
# Column aliases across nccl-tests generations (the NCCL 1.x tests said bytes/N/op/res).
_ALIASES = {
    "bytes": "size",
    "n": "count",
    "op": "redop",
    "error": "error",
    "res": "error",
    "#wrong": "#wrong",
}


def normalize_op(name: str) -> str:
    """An nccl-tests binary or op name as a short op: ``all_reduce_perf`` -> ``allreduce``,
    ``alltoall_perf_mpi`` -> ``alltoall``, ``reduce_scatter`` -> ``reducescatter``."""
    base = name.strip().split("/")[-1].lower()
    base = re.sub(r"_perf(_mpi)?$", "", base)
    return base.replace("_", "")


def busbw_factor(op: str, num_ranks: int) -> Optional[float]:
    """busbw / algbw for ``op`` on ``num_ranks`` ranks (nccl-tests doc/PERFORMANCE.md), or None
    for ops whose factor does not depend on the rank count."""
    n = num_ranks
    if op in ("alltoall", "allgather", "reducescatter"):
        return (n - 1) / n
    if op == "allreduce":
        return 2 * (n - 1) / n
    return None


@dataclass
class _Block:
    op: Optional[str] = None
    header: Optional[List[str]] = None
    header_line: int = 0
    ranks: Dict[int, Tuple[str, int, str]] = field(default_factory=dict)
    rows: List[Tuple[int, List[str]]] = field(default_factory=list)
    time_scale: float = 1.0  # to microseconds
    finished: bool = False  # the "# Avg bus bandwidth" footer was seen


def sniff_nccl_tests(text: str) -> bool:
    """True for nccl-tests output: a result header row (``#  size  count  type ... busbw``) or a
    ``# Collective test starting:`` / ``# nThread N nGpus M`` line."""
    text = strip_source_header(text)  # the provenance header is not tool output
    return bool(
        re.search(
            r"(?mi)^(\[\d+,\d+\]<stdout>:)?#\s*(size|bytes)\s+(count|N)\s+type\b.*\balgbw\b", text
        )
        or re.search(r"(?m)^(\[\d+,\d+\]<stdout>:)?#\s*Collective test starting:", text)
        or re.search(r"(?m)^(\[\d+,\d+\]<stdout>:)?#\s*nThread\s+\d+\s+nGpus\s+\d+", text)
    )


def _number(value: str, what: str, path: str, lineno: int, kind=float):
    try:
        return kind(value)
    except ValueError:
        raise TopologyParseError(
            f"column {what!r} holds {value!r}; expected a number "
            "(is the row misaligned or cut off?)",
            path=path,
            line=lineno,
        ) from None


def _infer_op(
    block: _Block, cells: Dict[str, str], size: int, count: int, dtype_bytes: Optional[int]
) -> str:
    """The op, from the only facts a result row has when no name was printed."""
    redop = cells.get("redop")
    root = cells.get("root")
    rooted = root is not None and root.lstrip("-").isdigit() and int(root) >= 0
    if redop in (None, "", "none"):
        return "broadcast" if rooted else "unknown"  # alltoall, allgather and sendrecv look alike
    if rooted:
        return "reduce"
    if dtype_bytes and size == count * dtype_bytes:
        return "allreduce"
    if dtype_bytes and size > count * dtype_bytes:
        return "reducescatter"
    return "unknown"


_DTYPE_BYTES = {
    "int8": 1,
    "char": 1,
    "uint8": 1,
    "int32": 4,
    "int": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}


def _solve_num_ranks(op: str, pairs: List[Tuple[float, float]]) -> Optional[int]:
    """The rank count ``n`` that makes ``busbw == algbw * factor(op, n)`` for every (algbw, busbw)
    pair to print precision (2 decimals), or None when no single ``n`` does."""
    usable = [(a, b) for a, b in pairs if a > 0.05]
    if not usable or busbw_factor(op, 2) is None:
        return None
    a, b = max(usable)  # the largest bandwidth has the smallest relative rounding error
    scale = 2.0 if op == "allreduce" else 1.0
    ratio = b / (a * scale)
    if ratio >= 1.0:
        return None
    guess = round(1.0 / (1.0 - ratio))
    for n in (guess - 1, guess, guess + 1):
        if n < 2:
            continue
        factor = busbw_factor(op, n)
        if all(abs(bb - aa * factor) <= 0.006 + 0.0005 * aa for aa, bb in usable):
            return n
    return None


def parse_nccl_tests(text: str, path: str = "<text>") -> Topology:
    """Parse every result block of nccl-tests output.

    Args:
        text: captured stdout of one or more nccl-tests runs (other text between blocks is fine).
        path: file name used in errors and in each measurement's ``source``.

    Returns:
        A :class:`Topology` whose ``measurements`` hold two rows (out-of-place, in-place) per
        result line, with ``num_ranks`` per block, and devices ``rank<N>`` from ``#  Rank`` lines.

    Raises:
        TopologyParseError: empty input, no result header, a data row before any header, a row
            whose cell count fits neither layout, a non-numeric cell, or a header with no rows
            (truncated output) — naming the line.
    """
    lines = numbered_lines(text)
    if not any(line.strip() for _, line in lines):
        raise TopologyParseError(
            "empty input; expected nccl-tests output (e.g. alltoall_perf)", path=path, line=1
        )
    blocks: List[_Block] = []
    block = _Block()
    pending_op: Optional[str] = None  # a binary named on a command line, for the next block

    def close() -> None:
        nonlocal block
        if block.header is not None or block.rows or block.ranks:
            blocks.append(block)
        block = _Block()

    for lineno, raw in lines:
        line = _MPI_PREFIX.sub("", raw)
        stripped = line.strip()
        if not stripped:
            continue
        start = _STARTING.match(stripped)
        if start:
            if start.group(1) == "starting":
                if block.rows:
                    close()
                block.op = normalize_op(start.group(2))
            else:
                if block.op is None:
                    block.op = normalize_op(start.group(2))
                close()
            continue
        if not stripped.startswith("#"):
            binary = _BINARY.search(stripped)
            if binary and not _ROW.match(line):
                pending_op = normalize_op(binary.group(1))
        if _NTHREAD.match(stripped):
            if block.rows:
                close()
            if block.op is None and pending_op:
                block.op = pending_op
            continue
        rank = _RANK.match(stripped)
        if rank:
            if block.rows:
                close()
            block.ranks[int(rank.group(1))] = (rank.group(2), int(rank.group(3)), rank.group(4))
            continue
        if _HEADER.match(stripped):
            if block.rows:
                close()
            tokens = [_ALIASES.get(t.lower(), t.lower()) for t in stripped.lstrip("#").split()]
            if tokens.count("time") < 1 or "algbw" not in tokens or "busbw" not in tokens:
                raise TopologyParseError(
                    "nccl-tests header row lacks time/algbw/busbw columns", path=path, line=lineno
                )
            block.header = tokens
            block.header_line = lineno
            if block.op is None and pending_op:
                block.op = pending_op
            continue
        if _UNITS.match(stripped):
            # "(us)" is the norm; the NCCL 1.x tests printed milliseconds.
            block.time_scale = 1000.0 if "(ms)" in stripped else 1.0
            continue
        if _AVG.match(stripped):
            block.finished = True
            continue
        if not stripped.startswith("#") and _ROW.match(line):
            if block.finished or (block.header is None and blocks):
                continue  # numbers printed after a table (other tools' output) are not results
            if block.header is None:
                raise TopologyParseError(
                    "result row before any nccl-tests header row "
                    "('#  size  count  type ... busbw'); "
                    "the output is truncated at the top",
                    path=path,
                    line=lineno,
                )
            block.rows.append((lineno, stripped.split()))
    close()

    headers = [b for b in blocks if b.header is not None]
    if not headers:
        raise TopologyParseError(
            "no nccl-tests result header found; expected a line like "
            "'#  size  count  type  redop  root  time  algbw  busbw  #wrong ...'",
            path=path,
            line=lines[0][0] if lines else 1,
        )
    topo = Topology()
    for b in blocks:
        if b.header is None:
            continue
        if not b.rows:
            raise TopologyParseError(
                "nccl-tests header row is not followed by any result row; the output is truncated "
                "(the run died or was cut before the first size)",
                path=path,
                line=b.header_line,
            )
        _add_block(topo, b, path)
    topo.facts["formats"] = ["nccl-tests"]
    topo.facts["sources"] = [path]
    return topo


def _add_block(topo: Topology, b: _Block, path: str) -> None:
    header = b.header or []
    first_time = header.index("time")
    prefix = header[:first_time]
    half = header[first_time:]
    if "time" in half[1:]:
        half = half[: half.index("time", 1)]
    num_halves = (len(header) - first_time) // len(half)
    suffix_len = len(half) * num_halves
    rows: List[Tuple[int, Dict[str, str], List[Dict[str, str]]]] = []
    for lineno, tokens in b.rows:
        middle = len(tokens) - suffix_len
        if middle < 3 or middle > len(prefix):
            raise TopologyParseError(
                f"result row has {len(tokens)} cells; the header at line {b.header_line} expects "
                f"{len(header)} ({' '.join(header)}), or fewer only where redop/root are blank",
                path=path,
                line=lineno,
            )
        cells = dict(zip(prefix[:3], tokens[:3]))
        # Between type and the halves: redop and/or root, some of which may be blank.
        for value in tokens[3:middle]:
            if re.fullmatch(r"-?\d+", value) and "root" in prefix:
                cells["root"] = value
            else:
                cells["redop"] = value
        halves = [
            dict(zip(half, tokens[middle + h * len(half) : middle + (h + 1) * len(half)]))
            for h in range(num_halves)
        ]
        rows.append((lineno, cells, halves))

    op = b.op
    if op is None:
        lineno, cells, _ = rows[-1]
        size = _number(cells.get("size", ""), "size", path, lineno, int)
        count = _number(cells.get("count", ""), "count", path, lineno, int)
        op = _infer_op(b, cells, size, count, _DTYPE_BYTES.get(cells.get("type", "")))
    num_ranks: Optional[int] = len(b.ranks) if b.ranks else None
    parsed: List[Measurement] = []
    pairs: List[Tuple[float, float]] = []
    for lineno, cells, halves in rows:
        size = _number(cells["size"], "size", path, lineno, int)
        count = _number(cells["count"], "count", path, lineno, int)
        root = cells.get("root")
        for h, values in enumerate(halves):
            time_us = _number(values["time"], "time", path, lineno) * b.time_scale
            algbw = _number(values["algbw"], "algbw", path, lineno)
            busbw = _number(values["busbw"], "busbw", path, lineno)
            wrong: Optional[int] = None
            if "#wrong" in values and values["#wrong"].upper() != "N/A":
                wrong = _number(values["#wrong"], "#wrong", path, lineno, int)
            elif "error" in values and values["error"].upper() != "N/A":
                # The old layout prints the max deviation: 0 means no wrong element; a non-zero
                # deviation is not a count (float sums legitimately deviate), so it stays None.
                wrong = 0 if _number(values["error"], "error", path, lineno) == 0.0 else None
            pairs.append((algbw, busbw))
            parsed.append(
                Measurement(
                    op=op,
                    size_bytes=size,
                    time_us=time_us,
                    algbw_gbps=algbw,
                    busbw_gbps=busbw,
                    in_place=h == 1,
                    count=count,
                    dtype=cells.get("type"),
                    redop=cells.get("redop") or None,
                    root=int(root) if root is not None else None,
                    wrong=wrong,
                    source=path,
                )
            )
    if num_ranks is None:
        num_ranks = _solve_num_ranks(op, pairs)
    for m in parsed:
        m.num_ranks = num_ranks
    topo.measurements.extend(parsed)
    for rank, (host, cuda_dev, model) in sorted(b.ranks.items()):
        topo.add_device(
            Device(
                name=f"rank{rank}",
                vendor=Vendor.NVIDIA.value,
                model=re.sub(r"^NVIDIA\s+", "", model) or None,
                index=cuda_dev,
                host=host,
            )
        )


FORMATS: List[Tuple[str, Callable[[str], bool], Callable[..., Topology]]] = [
    ("nccl-tests", sniff_nccl_tests, parse_nccl_tests),
]
