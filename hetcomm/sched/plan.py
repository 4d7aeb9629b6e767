"""Plans: an all-to-all as a list of chunk transfers.

Notation (used across ``hetcomm.sched``):
    n          number of ranks in the group
    T[i][j]    bytes rank i must deliver to rank j (the traffic matrix; T[i][i] stays local)
    segment    the bytes of T[origin][final_dst]; a chunk is a byte range of one segment
    message    the chunks of one stage that move between the same two ranks over the same rail;
               the simulator times messages, the backend may send one as a single operation

A :class:`Plan` says which chunk moves from which rank to which rank, over what link class, in
which stage, after which other transfers. A direct (``flat``) plan has ``src == origin`` and
``dst == final_dst`` for every transfer; a hierarchical plan forwards chunks through
intermediate ranks, which hold them in staging buffers until a later stage sends them on.

Plans are stored column-wise (:class:`ChunkTable`, numpy arrays, one row per chunk) because a
1,024-rank hierarchical plan has millions of chunks; :attr:`Plan.transfers` builds the
:class:`Transfer` objects on first use, which is what the backend's executor reads for the
small groups it runs.

The backend executes plans (``hetcomm.backends``) and the simulator times them
(``hetcomm.sched.simulate``); neither decides them. Deciding is ``hetcomm.sched.planner``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from hetcomm.topo.model import LinkClass

__all__ = ["Transfer", "Plan", "ChunkTable", "MessageTable", "traffic_from_splits"]

TrafficLike = Union[Sequence[Sequence[int]], np.ndarray]


@dataclass(frozen=True)
class Transfer:
    """One chunk moving between two ranks.

    Attributes:
        index: position in ``Plan.transfers`` (dependencies refer to it).
        src: rank sending the chunk in this step.
        dst: rank receiving it in this step.
        origin: rank whose input the bytes come from.
        final_dst: rank whose output the bytes end in.
        offset_bytes: start of the chunk inside segment ``T[origin][final_dst]``.
        num_bytes: chunk length in bytes (> 0).
        link_class: class of the ``src -> dst`` path.
        stage: execution stage (0-based); every transfer of stage s may start once its
            dependencies (all in earlier stages) are done.
        deps: indices of transfers that must complete first (e.g. the one that brought this
            chunk to ``src``).
        rail: rail name to use (``shm``, ``gloo``, ...; ``None`` = the backend's choice for the
            pair), or a NIC/rail id for multi-rail plans (``"nic3"``: the sender's 4th NIC port,
            counted over the node's ``nics`` entries in YAML order).
    """

    index: int
    src: int
    dst: int
    origin: int
    final_dst: int
    offset_bytes: int
    num_bytes: int
    link_class: LinkClass
    stage: int = 0
    deps: Tuple[int, ...] = ()
    rail: Optional[str] = None


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """A plan's chunks, column-wise: row ``k`` is transfer ``k``.

    Attributes:
        src, dst, origin, final_dst: ``[num_chunks]`` int64 ranks.
        offset_bytes, num_bytes: ``[num_chunks]`` int64.
        link_class: ``[num_chunks]`` int64 :class:`LinkClass` values.
        stage: ``[num_chunks]`` int64.
        rail: ``[num_chunks]`` int64 index into ``rail_names``, ``-1`` = None.
        dep_ptr: ``[num_chunks + 1]`` int64; the dependencies of chunk k are
            ``dep_idx[dep_ptr[k]:dep_ptr[k + 1]]`` (CSR layout).
        dep_idx: ``[num_deps]`` int64 chunk indices.
        rail_names: the rail strings ``rail`` indexes.
        message: ``[num_chunks]`` int64 message id of each chunk, ids numbered stage by stage
            (planners know their messages; ``None``: :attr:`Plan.messages` groups the chunks).
    """

    src: np.ndarray
    dst: np.ndarray
    origin: np.ndarray
    final_dst: np.ndarray
    offset_bytes: np.ndarray
    num_bytes: np.ndarray
    link_class: np.ndarray
    stage: np.ndarray
    rail: np.ndarray
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    rail_names: Tuple[str, ...] = ()
    message: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @classmethod
    def build(
        cls,
        *,
        src: np.ndarray,
        dst: np.ndarray,
        origin: np.ndarray,
        final_dst: np.ndarray,
        offset_bytes: np.ndarray,
        num_bytes: np.ndarray,
        link_class: np.ndarray,
        stage: np.ndarray,
        rail: Optional[np.ndarray] = None,
        dep: Optional[np.ndarray] = None,
        rail_names: Tuple[str, ...] = (),
        message: Optional[np.ndarray] = None,
    ) -> "ChunkTable":
        """A table whose chunks have at most one dependency each (``dep[k] = -1``: none)."""
        n = int(np.asarray(src).shape[0])
        as64 = lambda a: np.ascontiguousarray(np.asarray(a, dtype=np.int64))  # noqa: E731
        dep = np.full(n, -1, np.int64) if dep is None else as64(dep)
        has = dep >= 0
        dep_ptr = np.zeros(n + 1, np.int64)
        np.cumsum(has, out=dep_ptr[1:])
        return cls(
            src=as64(src),
            dst=as64(dst),
            origin=as64(origin),
            final_dst=as64(final_dst),
            offset_bytes=as64(offset_bytes),
            num_bytes=as64(num_bytes),
            link_class=as64(link_class),
            stage=as64(stage),
            rail=np.full(n, -1, np.int64) if rail is None else as64(rail),
            dep_ptr=dep_ptr,
            dep_idx=dep[has],
            rail_names=tuple(rail_names),
            message=None if message is None else as64(message),
        )

    @classmethod
    def from_transfers(cls, transfers: Sequence[Transfer]) -> "ChunkTable":
        """The table of an explicit transfer list (``transfers[k].index`` must be ``k``)."""
        for k, t in enumerate(transfers):
            assert t.index == k, f"transfer at position {k} has index {t.index}"
        names: List[str] = []
        rail_ids = []
        for t in transfers:
            if t.rail is None:
                rail_ids.append(-1)
            else:
                if t.rail not in names:
                    names.append(t.rail)
                rail_ids.append(names.index(t.rail))
        deps = [d for t in transfers for d in t.deps]
        dep_ptr = np.zeros(len(transfers) + 1, np.int64)
        np.cumsum([len(t.deps) for t in transfers], out=dep_ptr[1:])
        col = lambda f: np.array([f(t) for t in transfers], dtype=np.int64)  # noqa: E731
        return cls(
            src=col(lambda t: t.src),
            dst=col(lambda t: t.dst),
            origin=col(lambda t: t.origin),
            final_dst=col(lambda t: t.final_dst),
            offset_bytes=col(lambda t: t.offset_bytes),
            num_bytes=col(lambda t: t.num_bytes),
            link_class=col(lambda t: int(t.link_class)),
            stage=col(lambda t: t.stage),
            rail=np.array(rail_ids, dtype=np.int64),
            dep_ptr=dep_ptr,
            dep_idx=np.array(deps, dtype=np.int64),
            rail_names=tuple(names),
        )


@dataclass(frozen=True, eq=False)
class MessageTable:
    """A plan's chunks grouped into messages: same stage, sender, receiver and rail.

    Attributes:
        stage, src, dst, rail: ``[num_messages]`` int64 (``rail`` as in :class:`ChunkTable`).
        num_bytes: ``[num_messages]`` int64, the sum of the message's chunks.
        forwarded: ``[num_messages]`` bool, True when some chunk's ``src`` is not its origin
            (the sender copies it out of a staging buffer first).
        chunk_message: ``[num_chunks]`` int64, the message each chunk travels in.
        dep_msg, dep_on: ``[num_pairs]`` int64; message ``dep_msg[p]`` may start only after
            message ``dep_on[p]`` has arrived (one pair per chunk dependency; pairs may repeat).

    Message ids are numbered stage by stage: the messages of one stage are a contiguous range.
    """

    stage: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    rail: np.ndarray
    num_bytes: np.ndarray
    forwarded: np.ndarray
    chunk_message: np.ndarray
    dep_msg: np.ndarray
    dep_on: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])


class Plan:
    """A complete all-to-all plan (immutable once built).

    Args:
        strategy: ``flat``, ``hier``, ``multirail`` (``auto`` resolves to one of these).
        traffic: the traffic matrix ``T`` it delivers, ``n x n`` bytes (nested sequences or an
            int array).
        transfers: the chunk transfers, ``transfers[k].index == k`` (or give ``table``).
        notes: free-form facts for reports (which NIC carries what, why a choice was made).
        table: the chunks column-wise; planners build this instead of ``transfers``.

    Attributes:
        strategy, notes: as given.
        traffic: ``T`` as a tuple of tuples (built on first use).
        traffic_matrix: ``T`` as a read-only ``[n, n]`` int64 array.
        transfers: the :class:`Transfer` objects (built on first use from the table).
        table: the :class:`ChunkTable`.
    """

    def __init__(
        self,
        strategy: str,
        traffic: TrafficLike,
        transfers: Optional[Sequence[Transfer]] = None,
        notes: Sequence[str] = (),
        *,
        table: Optional[ChunkTable] = None,
    ) -> None:
        if (transfers is None) == (table is None):
            raise TypeError("Plan needs exactly one of 'transfers' and 'table'")
        matrix = np.array(traffic, dtype=np.int64, copy=True)
        if matrix.size == 0:
            matrix = matrix.reshape(0, 0)
        matrix.setflags(write=False)
        self.strategy = strategy
        self.traffic_matrix = matrix
        self.notes: Tuple[str, ...] = tuple(notes)
        if transfers is not None:
            self.__dict__["transfers"] = tuple(transfers)
            self.table = ChunkTable.from_transfers(self.transfers)
        else:
            self.table = table

    def __repr__(self) -> str:
        return (
            f"Plan(strategy={self.strategy!r}, num_ranks={self.num_ranks}, "
            f"num_transfers={len(self.table)}, num_stages={self.num_stages})"
        )

    @functools.cached_property
    def traffic(self) -> Tuple[Tuple[int, ...], ...]:
        """``T`` as nested tuples of ints (what the executor indexes)."""
        return tuple(tuple(int(x) for x in row) for row in self.traffic_matrix.tolist())

    @functools.cached_property
    def transfers(self) -> Tuple[Transfer, ...]:
        """Every chunk as a :class:`Transfer`, ``transfers[k].index == k``."""
        tb = self.table
        cols = zip(
            tb.src.tolist(),
            tb.dst.tolist(),
            tb.origin.tolist(),
            tb.final_dst.tolist(),
            tb.offset_bytes.tolist(),
            tb.num_bytes.tolist(),
            tb.link_class.tolist(),
            tb.stage.tolist(),
            tb.rail.tolist(),
        )
        ptr = tb.dep_ptr.tolist()
        deps = tb.dep_idx.tolist()
        classes = list(LinkClass)
        out = []
        for k, (s, d, o, f, off, nb, lc, st, rl) in enumerate(cols):
            out.append(
                Transfer(
                    index=k,
                    src=s,
                    dst=d,
                    origin=o,
                    final_dst=f,
                    offset_bytes=off,
                    num_bytes=nb,
                    link_class=classes[lc],
                    stage=st,
                    deps=tuple(deps[ptr[k] : ptr[k + 1]]),
                    rail=None if rl < 0 else tb.rail_names[rl],
                )
            )
        return tuple(out)

    @property
    def num_ranks(self) -> int:
        return int(self.traffic_matrix.shape[0])

    @property
    def num_transfers(self) -> int:
        return len(self.table)

    @property
    def num_stages(self) -> int:
        return 1 + int(self.table.stage.max()) if len(self.table) else 0

    def stage(self, s: int) -> List[Transfer]:
        """Transfers of stage ``s`` in index order."""
        idx = np.flatnonzero(self.table.stage == s)
        tr = self.transfers
        return [tr[k] for k in idx.tolist()]

    def bytes_by_class(self) -> Dict[str, int]:
        """Bytes moved per link class name (a chunk forwarded twice counts twice)."""
        tb = self.table
        sums = np.bincount(tb.link_class, weights=tb.num_bytes, minlength=len(LinkClass))
        # bincount sums in float64: exact below 2**53 bytes, far above any plan's volume.
        return {LinkClass(c).name: int(round(v)) for c, v in enumerate(sums) if v > 0}

    @functools.cached_property
    def messages(self) -> MessageTable:
        """The chunks grouped into messages (see :class:`MessageTable`)."""
        tb = self.table
        if tb.message is not None:
            mid = tb.message
            num = int(mid.max()) + 1 if len(mid) else 0
            cols = {}
            for name in ("stage", "src", "dst", "rail"):
                col = np.zeros(num, np.int64)
                col[mid] = getattr(tb, name)
                cols[name] = col
            assert (np.diff(cols["stage"]) >= 0).all(), "planner message ids are not numbered stage by stage"
        else:
            n = max(self.num_ranks, 1)
            num_rails = len(tb.rail_names) + 1
            # stage-major key, so that unique ids come out numbered stage by stage
            key = ((tb.stage * n + tb.src) * n + tb.dst) * num_rails + (tb.rail + 1)
            uniq, mid = np.unique(key, return_inverse=True)
            mid = mid.reshape(-1).astype(np.int64)
            num = len(uniq)
            rest = uniq // num_rails
            cols = {"rail": uniq % num_rails - 1, "dst": rest % n}
            rest //= n
            cols["src"] = rest % n
            cols["stage"] = rest // n
        num_bytes = np.bincount(mid, weights=tb.num_bytes, minlength=num)
        forwarded = np.bincount(mid, weights=(tb.src != tb.origin), minlength=num) > 0
        counts = np.diff(tb.dep_ptr)
        return MessageTable(
            stage=cols["stage"],
            src=cols["src"],
            dst=cols["dst"],
            rail=cols["rail"],
            # bincount sums in float64: exact below 2**53 bytes per message
            num_bytes=np.rint(num_bytes).astype(np.int64),
            forwarded=forwarded,
            chunk_message=mid,
            dep_msg=np.repeat(mid, counts),
            dep_on=mid[tb.dep_idx] if len(tb.dep_idx) else np.zeros(0, np.int64),
        )

    def check(self) -> None:
        """Verify that the plan delivers every byte of ``traffic`` exactly once, to the right rank.

        Checks, for each segment ``(origin, final_dst)`` with ``origin != final_dst``: the chunks
        that arrive at ``final_dst`` tile ``[0, T[origin][final_dst])`` without gap or overlap;
        every forwarded chunk was first received by its sender (a dependency with the same byte
        range arriving at ``src``, or ``src == origin``); dependencies point to earlier stages.

        Raises:
            AssertionError: naming the first violated property (a planner bug, not user error).
        """
        tb = self.table
        n = self.num_ranks
        m = len(tb)
        assert self.traffic_matrix.shape == (n, n), "traffic matrix is not square"
        assert (self.traffic_matrix >= 0).all(), "traffic matrix has negative entries"
        _first(
            (tb.src < 0) | (tb.src >= n) | (tb.dst < 0) | (tb.dst >= n)
            | (tb.origin < 0) | (tb.origin >= n) | (tb.final_dst < 0) | (tb.final_dst >= n),
            "rank out of range",
        )
        _first(tb.src == tb.dst, "src == dst")
        _first(tb.num_bytes <= 0, "empty chunk")
        _first(tb.offset_bytes < 0, "negative offset")
        _first(tb.origin == tb.final_dst, "chunk of a local segment (origin == final_dst)")
        counts = np.diff(tb.dep_ptr)
        owner = np.repeat(np.arange(m, dtype=np.int64), counts)
        dep = tb.dep_idx
        bad_dep = (dep < 0) | (dep >= m)
        if bad_dep.any():
            k = int(np.flatnonzero(bad_dep)[0])
            raise AssertionError(f"transfer {int(owner[k])}: unknown dependency {int(dep[k])}")
        late = tb.stage[dep] >= tb.stage[owner]
        if late.any():
            k = int(np.flatnonzero(late)[0])
            raise AssertionError(f"transfer {int(owner[k])}: dependency {int(dep[k])} not earlier")
        holds = (
            (tb.dst[dep] == tb.src[owner])
            & (tb.origin[dep] == tb.origin[owner])
            & (tb.final_dst[dep] == tb.final_dst[owner])
            & (tb.offset_bytes[dep] <= tb.offset_bytes[owner])
            & (tb.offset_bytes[owner] + tb.num_bytes[owner] <= tb.offset_bytes[dep] + tb.num_bytes[dep])
        )
        has_holder = np.bincount(owner[holds], minlength=m) > 0
        orphan = (tb.src != tb.origin) & ~has_holder
        if orphan.any():
            k = int(np.flatnonzero(orphan)[0])
            raise AssertionError(
                f"transfer {k}: rank {int(tb.src[k])} forwards bytes of segment "
                f"{int(tb.origin[k])}->{int(tb.final_dst[k])} it never received"
            )
        if tb.message is not None and m:
            msgs = self.messages
            for name in ("stage", "src", "dst", "rail"):
                differs = getattr(msgs, name)[tb.message] != getattr(tb, name)
                if differs.any():
                    k = int(np.flatnonzero(differs)[0])
                    raise AssertionError(f"transfer {k}: its message {int(tb.message[k])} has another {name}")
        # Arrivals at the final destination must tile each segment exactly.
        arr = np.flatnonzero(tb.dst == tb.final_dst)
        seg = tb.origin[arr] * n + tb.final_dst[arr]
        order = np.lexsort((tb.offset_bytes[arr], seg))
        arr, seg = arr[order], seg[order]
        off, size = tb.offset_bytes[arr], tb.num_bytes[arr]
        if len(arr):
            first = np.ones(len(arr), bool)
            first[1:] = seg[1:] != seg[:-1]
            expect = np.empty(len(arr), np.int64)
            expect[0] = 0
            expect[1:] = off[:-1] + size[:-1]
            expect[first] = 0
            bad = np.flatnonzero(off != expect)
            if len(bad):
                k = int(bad[0])
                i, j = divmod(int(seg[k]), n)
                raise AssertionError(
                    f"segment {i}->{j}: gap or overlap at byte {int(expect[k])} (chunk at {int(off[k])})"
                )
        delivered = np.zeros(n * n, np.int64)
        np.add.at(delivered, seg, size)
        want = self.traffic_matrix.reshape(-1).copy()
        want[:: n + 1] = 0
        diff = np.flatnonzero(delivered != want)
        if len(diff):
            i, j = divmod(int(diff[0]), n)
            raise AssertionError(f"segment {i}->{j}: delivered {int(delivered[diff[0]])} of {int(want[diff[0]])} bytes")


def _first(mask: np.ndarray, what: str) -> None:
    if mask.any():
        k = int(np.flatnonzero(mask)[0])
        raise AssertionError(f"transfer {k}: {what}")


def traffic_from_splits(split_bytes: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...], ...]:
    """Freeze a nested list of byte counts into the tuple form :attr:`Plan.traffic` has."""
    return tuple(tuple(int(x) for x in row) for row in split_bytes)
