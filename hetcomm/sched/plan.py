"""Plans: an all-to-all as a list of chunk transfers.

Notation (used across ``hetcomm.sched``):
    n          number of ranks in the group
    T[i][j]    bytes rank i must deliver to rank j (the traffic matrix; T[i][i] stays local)
    segment    the bytes of T[origin][final_dst]; a chunk is a byte range of one segment

A :class:`Plan` says which chunk moves from which rank to which rank, over what link class, in
which stage, after which other transfers. A direct (``flat``) plan has ``src == origin`` and
``dst == final_dst`` for every transfer; a hierarchical plan forwards chunks through
intermediate ranks, which hold them in staging buffers until a later stage sends them on.

The backend executes plans (``hetcomm.backends``) and the simulator times them
(``hetcomm.sched.simulate``); neither decides them. Deciding is ``hetcomm.sched.planner``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from hetcomm.topo.model import LinkClass

__all__ = ["Transfer", "Plan"]


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
            pair), or a NIC/rail id for multi-rail plans (``"nic3"``).
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


@dataclass(frozen=True)
class Plan:
    """A complete all-to-all plan.

    Attributes:
        strategy: ``flat``, ``hier``, ``multirail`` (``auto`` resolves to one of these).
        traffic: the traffic matrix ``T`` it delivers, ``n x n`` bytes.
        transfers: the chunk transfers, ``transfers[k].index == k``.
        notes: free-form facts for reports (which NIC carries what, why a choice was made).
    """

    strategy: str
    traffic: Tuple[Tuple[int, ...], ...]
    transfers: Tuple[Transfer, ...]
    notes: Tuple[str, ...] = field(default=())

    @property
    def num_ranks(self) -> int:
        return len(self.traffic)

    @property
    def num_stages(self) -> int:
        return 1 + max((t.stage for t in self.transfers), default=-1)

    def stage(self, s: int) -> List[Transfer]:
        """Transfers of stage ``s`` in index order."""
        return [t for t in self.transfers if t.stage == s]

    def bytes_by_class(self) -> Dict[str, int]:
        """Bytes moved per link class name (a chunk forwarded twice counts twice)."""
        out: Dict[str, int] = defaultdict(int)
        for t in self.transfers:
            out[t.link_class.name] += t.num_bytes
        return dict(out)

    def check(self) -> None:
        """Verify that the plan delivers every byte of ``traffic`` exactly once, to the right rank.

        Checks, for each segment ``(origin, final_dst)`` with ``origin != final_dst``: the chunks
        that arrive at ``final_dst`` tile ``[0, T[origin][final_dst])`` without gap or overlap;
        every forwarded chunk was first received by its sender (a dependency with the same byte
        range arriving at ``src``, or ``src == origin``); dependencies point to earlier stages.

        Raises:
            AssertionError: naming the first violated property (a planner bug, not user error).
        """
        n = self.num_ranks
        by_index = {t.index: t for t in self.transfers}
        assert len(by_index) == len(self.transfers), "duplicate transfer index"
        arrived: Dict[Tuple[int, int], List[Tuple[int, int]]] = defaultdict(list)
        for t in self.transfers:
            assert 0 <= t.src < n and 0 <= t.dst < n, f"transfer {t.index}: rank out of range"
            assert t.src != t.dst, f"transfer {t.index}: src == dst == {t.src}"
            assert t.num_bytes > 0, f"transfer {t.index}: empty chunk"
            for d in t.deps:
                assert d in by_index, f"transfer {t.index}: unknown dependency {d}"
                assert by_index[d].stage < t.stage, f"transfer {t.index}: dependency {d} not earlier"
            if t.src != t.origin:
                holders = [
                    by_index[d]
                    for d in t.deps
                    if by_index[d].dst == t.src
                    and by_index[d].origin == t.origin
                    and by_index[d].final_dst == t.final_dst
                    and by_index[d].offset_bytes <= t.offset_bytes
                    and t.offset_bytes + t.num_bytes <= by_index[d].offset_bytes + by_index[d].num_bytes
                ]
                assert holders, (
                    f"transfer {t.index}: rank {t.src} forwards bytes of segment "
                    f"{t.origin}->{t.final_dst} it never received"
                )
            if t.dst == t.final_dst:
                arrived[(t.origin, t.final_dst)].append((t.offset_bytes, t.num_bytes))
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                want = self.traffic[i][j]
                got = sorted(arrived.get((i, j), []))
                pos = 0
                for off, size in got:
                    assert off == pos, f"segment {i}->{j}: gap or overlap at byte {pos} (chunk at {off})"
                    pos += size
                assert pos == want, f"segment {i}->{j}: delivered {pos} of {want} bytes"


def traffic_from_splits(split_bytes: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...], ...]:
    """Freeze a nested list of byte counts into the tuple form :class:`Plan` stores."""
    return tuple(tuple(int(x) for x in row) for row in split_bytes)
