"""Per-step, time-proportional token split among the copies of an expert.

MoonEP and UltraEP give every rank the same number of token rows each micro-batch; on an A100
beside a 910B at half its speed, equal rows are unequal time. When an expert has copies on
several ranks (the hot replicas of :mod:`hetcomm.moe.replicate`: its owner and every strong rank), this module decides, each step,
how many of that expert's rows each holder computes, so that every rank's *predicted expert time*
``rows_r / speed_r`` (``speed`` = the agreed measured vector of :mod:`hetcomm.moe.speed`) is as
equal as the copies allow:

1. **Counts.** Every rank contributes its kept copies per expert (``[E]``, after capacity) and its
   last step's measured expert seconds to one exchange -> ``[W, E + 1]`` (an all-reduce of a table
   each rank fills one row of), identical on every rank, before any row moves. In a training
   forward the table rides in the layer's statistics all-reduce (made blocking then), so the
   split adds no collective: a small checked all-reduce on the hetcomm backend (cross-rank check
   + gloo) measured ~15-20 ms against gloo's ~6-7 ms at load 32 (``benchmarks/split_profile.py``).
2. **Quotas** (:func:`plan_split`): rows of single-copy experts are fixed load ``base_r``. The rows
   ``N_e`` of each multi-copy expert are spread over its holders minimising the makespan
   ``max_r (base_r + x_r) / speed_r`` -- the restricted-assignment problem. For a candidate time
   ``T`` it is feasible iff a max-flow source -> expert (cap ``N_e``) -> holder (inf) -> sink (cap
   ``floor(T * speed_h - base_h)``) saturates every expert; bisection on ``T`` (60 halvings) finds
   the least such ``T``, and the integral flow (integer capacities) *is* the split: integer rows,
   optimal within one row per holder. Hand-written because the graph is tiny (``m`` hot experts x
   ``W`` ranks), it must be bit-identical on every rank (pure integer/float Python, no solver
   tolerances), and it runs on the host every step; scipy's LP is the independent oracle the
   benchmark compares against (``benchmarks/moe_workloads.py``).
3. **Which rows** (:func:`assign_rows`): a holder keeps its own rows first (they never travel);
   the rest are dealt from the sources in rank order to the holders in rank order.
4. **Rewrite.** A copy bound for a non-owner holder ``h`` of expert ``e`` is renamed to a
   *virtual expert* ``E + j`` owned by ``h`` (``j`` numbers the (hot expert, non-owner holder)
   pairs in ascending order), so the unchanged token dispatch carries it there, and ``h`` computes
   it on its replica. The math is the same expert on the same rows (replicas are bit-identical to
   their owner), so outputs equal the unsplit layer's; replica gradients are summed into the
   owner's after backward (the replicator's end-of-backward reduction).

The split is on with ``MoEConfig(token_split=True)``, or with the default ``"auto"`` once the
policy's lever is on (:mod:`hetcomm.moe.policy`: the agreed speeds differ); it needs replication
(the copies to split among) and is not combined with paging (the pager indexes the rank's own experts).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.errors import UsageError

__all__ = ["SplitPlan", "plan_split", "assign_rows", "TokenSplitter", "SplitRoute", "max_over_mean"]


def max_over_mean(values: Sequence[float]) -> float:
    """``max / mean`` of ``values`` (1.0 for an all-zero or empty vector)."""
    vals = list(values)
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class SplitPlan:
    """The split of one step.

    Attributes:
        quota: ``quota[e][h]`` rows of multi-copy expert ``e`` computed by holder ``h``.
        rows: ``[W]`` rows each rank computes (single-copy experts included).
        predicted: ``[W]`` predicted expert time ``rows_r / speed_r`` (seconds once the speeds
            are measured rows/s; prior units before).
        makespan: ``max(predicted)``.
    """

    quota: Mapping[int, Mapping[int, int]]
    rows: Tuple[int, ...]
    predicted: Tuple[float, ...]
    makespan: float


def _whole(value: object, name: str, what: str) -> None:
    """``value`` is a finite whole number >= 0 (an int, or an integral float from the count table)."""
    try:
        ok = not isinstance(value, bool) and math.isfinite(float(value)) and float(value) >= 0  # type: ignore[arg-type]
        ok = ok and float(value) == int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UsageError(f"token split: {name} is {value!r}; it counts {what}: a whole number >= 0")


def _index_in(value: object, n: int) -> bool:
    """``value`` is an integer (int, numpy or 0-d tensor index) in ``0..n-1``, not a bool."""
    try:
        return not isinstance(value, bool) and 0 <= operator.index(value) < n  # type: ignore[arg-type]
    except TypeError:
        return False


def _check_plan_inputs(
    counts: Sequence[Sequence[int]], owner: Sequence[int], holders: Mapping[int, Sequence[int]], speeds: Sequence[float]
) -> None:
    """Every input of :func:`plan_split` against the others, before any arithmetic: a bad value
    used to surface as a ZeroDivisionError, an IndexError or a float-to-int ValueError."""
    W, E = len(speeds), len(owner)
    if W == 0:
        raise UsageError("plan_split: speeds is empty; pass one speed per rank of the group")
    for r, v in enumerate(speeds):
        try:
            ok = not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UsageError(f"plan_split: speeds[{r}] is {v!r}; every rank's speed must be a finite number > 0 "
                             f"(rows per second, e.g. the agreed vector of hetcomm.moe.speed)")
    if len(counts) != W:
        raise UsageError(f"plan_split: counts has {len(counts)} rows but speeds {W} ranks; pass one [E] row of "
                         f"kept copies per rank")
    for s_, row in enumerate(counts):
        if len(row) != E:
            raise UsageError(f"plan_split: counts[{s_}] has {len(row)} experts but owner {E}; pass one count per "
                             f"expert")
        for e, c in enumerate(row):
            _whole(c, f"counts[{s_}][{e}]", "token copies sent to that expert")
    for e, r in enumerate(owner):
        if not _index_in(r, W):
            raise UsageError(f"plan_split: owner[{e}] is {r!r}, not a rank of 0..{W - 1}")
    for e, hs in holders.items():
        if not _index_in(e, E):
            raise UsageError(f"plan_split: holders names expert {e!r}, not one of 0..{E - 1}")
        bad = [h for h in hs if not _index_in(h, W)]
        if bad:
            raise UsageError(f"plan_split: holders[{e}] has {bad[0]!r}, not a rank of 0..{W - 1}")
        if owner[e] not in hs:
            raise UsageError(f"plan_split: holders[{e}] is {list(hs)} without the expert's owner {owner[e]}; list "
                             f"every rank holding a copy, the owner included")


def max_flow(num_nodes: int, edges: Sequence[Tuple[int, int, float]], src: int, sink: int, eps: float = 0.0):
    """Dinic's max-flow on a small graph: ``edges`` are ``(u, v, capacity)``; returns
    ``(value, flows)`` with ``flows[i]`` the flow on ``edges[i]``. Integer capacities give an
    integral flow. Deterministic: edges are explored in the order given."""
    head: List[List[int]] = [[] for _ in range(num_nodes)]
    to: List[int] = []
    cap: List[float] = []
    for u, v, c in edges:
        head[u].append(len(to)); to.append(v); cap.append(c)
        head[v].append(len(to)); to.append(u); cap.append(0)
    orig = list(cap)
    total = 0
    while True:
        level = [-1] * num_nodes
        level[src] = 0
        q = deque([src])
        while q:
            u = q.popleft()
            for a in head[u]:
                if cap[a] > eps and level[to[a]] < 0:
                    level[to[a]] = level[u] + 1
                    q.append(to[a])
        if level[sink] < 0:
            break
        it = [0] * num_nodes

        def push(u: int, f):
            if u == sink:
                return f
            while it[u] < len(head[u]):
                a = head[u][it[u]]
                v = to[a]
                if cap[a] > eps and level[v] == level[u] + 1:
                    d = push(v, min(f, cap[a]))
                    if d > eps:
                        cap[a] -= d
                        cap[a ^ 1] += d
                        return d
                it[u] += 1
            return 0

        while True:
            f = push(src, float("inf"))
            if f <= eps:
                break
            total += f
    flows = [orig[2 * i] - cap[2 * i] for i in range(len(edges))]
    return total, flows


def plan_split(
    counts: Sequence[Sequence[int]],
    owner: Sequence[int],
    holders: Mapping[int, Sequence[int]],
    speeds: Sequence[float],
) -> SplitPlan:
    """Rows of every multi-copy expert per holder, minimising the slowest rank's predicted time.

    Args:
        counts: ``[W][E]`` rows each source rank sends to each expert (kept copies).
        owner: ``[E]`` owner rank of each expert (computes every row of a single-copy expert).
        holders: expert -> the ranks holding a copy (owner included); experts with one holder
            or absent are single-copy.
        speeds: ``[W]`` rows per second (any positive unit).
    Returns:
        The :class:`SplitPlan`.
    Raises:
        UsageError: inputs that do not describe one step of ``W`` ranks and ``E`` experts (lengths,
            ranges, a speed that is not finite and > 0, a count that is not a whole number >= 0,
            a holder list without its owner), naming the argument, the index and the value.
    """
    _check_plan_inputs(counts, owner, holders, speeds)
    W = len(speeds)
    E = len(owner)
    total = [sum(int(counts[s][e]) for s in range(W)) for e in range(E)]
    multi = sorted(e for e, hs in holders.items() if len(set(hs)) > 1 and total[e] > 0)
    base = [0] * W
    for e in range(E):
        if e not in multi:
            base[owner[e]] += total[e]
    quota: Dict[int, Dict[int, int]] = {e: {} for e in multi}
    if multi:
        hs_of = {e: sorted(set(int(h) for h in holders[e])) for e in multi}
        m = len(multi)
        src, sink = 0, m + W + 1  # nodes: 0 src, 1..m experts, m+1..m+W ranks, sink
        need = sum(total[e] for e in multi)
        pairs = [(i, e, h) for i, e in enumerate(multi) for h in hs_of[e]]

        def caps(T: float) -> List[int]:
            return [max(0, int(T * speeds[r] - base[r] + 1e-9)) for r in range(W)]

        def feasible(T: float):
            edges = [(src, 1 + i, total[e]) for i, e in enumerate(multi)]
            edges += [(1 + i, 1 + m + h, total[e]) for i, e, h in pairs]
            edges += [(1 + m + r, sink, c) for r, c in enumerate(caps(T))]
            value, flows = max_flow(m + W + 2, edges, src, sink)
            return value == need, flows[m : m + len(pairs)]

        # Upper bound: every row on its owner (always feasible); lower: the fixed load, or
        # everything spread in proportion to speed.
        own_rows = list(base)
        for e in multi:
            own_rows[owner[e]] += total[e]
        hi = max(own_rows[r] / speeds[r] for r in range(W))
        lo = max(max(base[r] / speeds[r] for r in range(W)), (sum(base) + need) / sum(speeds) * (1 - 1e-12))
        ok, flow = feasible(hi)
        assert ok, "every row on its owner must be feasible"
        # Capacities are integers floor(T s_r - base_r): once no rank's capacity changes between
        # lo and hi, hi's integral flow is the optimum.
        for _ in range(200):
            if caps(lo) == caps(hi) or hi - lo <= 1e-12 * hi:
                break
            mid = (lo + hi) / 2
            ok_mid, flow_mid = feasible(mid)
            if ok_mid:
                hi, flow = mid, flow_mid
            else:
                lo = mid
        for (i, e, h), q in zip(pairs, flow):
            if q > 0:
                quota[e][h] = int(q)
    rows = list(base)
    for e, q in quota.items():
        for h, n in q.items():
            rows[h] += n
    predicted = tuple(rows[r] / speeds[r] for r in range(W))
    return SplitPlan(quota=quota, rows=tuple(rows), predicted=predicted, makespan=max(predicted) if W else 0.0)


def assign_rows(counts_e: Sequence[int], quota_e: Mapping[int, int]) -> List[List[Tuple[int, int]]]:
    """Which holder computes which of one expert's rows, per source rank.

    Args:
        counts_e: ``[W]`` rows of the expert on each source rank.
        quota_e: holder -> rows it computes (sums to ``sum(counts_e)``).
    Returns:
        ``[W]`` lists of ``(holder, rows)`` in the order the source's rows are dealt: a holder's
        own rows first (kept local), then the rest from sources in rank order to holders in rank
        order.
    Raises:
        UsageError: a count or quota that is not a whole number >= 0, a holder outside
            ``0..W-1``, or quotas that do not add up to the rows (naming the values).
    """
    W = len(counts_e)
    for s_, c in enumerate(counts_e):
        _whole(c, f"counts_e[{s_}]", "rows of the expert on that source rank")
    for h, q in quota_e.items():
        if not _index_in(h, W):
            raise UsageError(f"assign_rows: quota_e has holder {h!r}, not a rank of 0..{W - 1}; "
                             f"pass the quota of plan_split for the same ranks")
        _whole(q, f"quota_e[{h}]", "rows that holder computes")
    if sum(int(q) for q in quota_e.values()) != sum(int(c) for c in counts_e):
        raise UsageError(f"assign_rows: the quotas add up to {sum(int(q) for q in quota_e.values())} rows but the "
                         f"expert has {sum(int(c) for c in counts_e)}; pass plan_split's quota of these counts")
    keep = {h: min(int(counts_e[h]), int(q)) for h, q in quota_e.items()}
    out: List[List[Tuple[int, int]]] = [[(s, keep[s])] if keep.get(s, 0) else [] for s in range(W)]
    room = [(h, int(quota_e[h]) - keep[h]) for h in sorted(quota_e) if int(quota_e[h]) - keep[h] > 0]
    hi = 0
    for s in range(W):
        left = int(counts_e[s]) - keep.get(s, 0)
        while left > 0:
            h, r = room[hi]
            n = min(left, r)
            out[s].append((h, n))
            left -= n
            if n == r:
                hi += 1
            else:
                room[hi] = (h, r - n)
    return out


@dataclass
class SplitRoute:
    """One step's split, as the layer uses it.

    Attributes:
        topk_idx: ``[T, k]`` int64 the dispatch's expert ids (virtual ids ``>= E`` for rows bound
            to a non-owner holder), ``-1`` where no copy travels.
        expert_to_rank: ``[E + V]`` owners, the ``V`` virtual experts' holders appended.
        modules: this rank's replica modules for its virtual experts, ascending virtual id.
        plan: the :class:`SplitPlan`.
        measured: ``[W]`` each rank's measured expert seconds of the previous step.
    """

    topk_idx: torch.Tensor
    expert_to_rank: List[int]
    modules: List[nn.Module]
    plan: SplitPlan
    measured: Tuple[float, ...]


class TokenSplitter:
    """Plans and applies the per-step split for one layer (see the module docstring).

    Args:
        world_size, rank, group: the expert-parallel group.
        num_experts: ``E``.
    """

    def __init__(self, world_size: int, rank: int, group: Optional[dist.ProcessGroup], num_experts: int) -> None:
        self.world_size, self.rank, self.group, self.num_experts = world_size, rank, group, num_experts
        #: This rank's expert seconds of the last forward (the layer sets it).
        self.last_expert_s = 0.0
        self.last: Optional[SplitRoute] = None

    def table_row(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``[W, E + 1]`` float64: this rank's row (kept copies per expert, last expert seconds),
        zeros elsewhere; summed over the group it is the step's table, exactly. The layer puts it
        into its statistics all-reduce (one collective per step, not two)."""
        E, W = self.num_experts, self.world_size
        table = torch.zeros(W, E + 1, dtype=torch.float64, device=send_counts.device)
        table[self.rank, :E] = send_counts.to(torch.float64)
        table[self.rank, E] = self.last_expert_s
        return table

    def _gather(self, send_counts: torch.Tensor) -> List[List[float]]:
        table = self.table_row(send_counts)
        if self.world_size > 1:
            # An all-reduce of a [W, E + 1] table each rank fills one row of (zeros elsewhere, so the
            # sum is exact): the backends' fast path, where a small all_gather is not everywhere.
            dist.all_reduce(table, group=self.group)
        return table.tolist()

    def route(
        self,
        idx_cm: torch.Tensor,
        send_counts: torch.Tensor,
        num_topk: int,
        owner: Sequence[int],
        holders: Mapping[int, Sequence[int]],
        replicas: Mapping[int, nn.Module],
        speeds: Sequence[float],
        table: Optional[List[List[float]]] = None,
    ) -> SplitRoute:
        """Collective (one all-reduce of the counts, unless ``table`` is given: the summed
        :meth:`table_row` s, e.g. from the layer's statistics all-reduce): plan this step's split
        and rename the copies.

        Args:
            idx_cm: ``[A]`` int64 choice-major expert of each copy that travels, -1 elsewhere.
            send_counts: ``[E]`` int64 copies of each expert in ``idx_cm``.
            num_topk: ``k`` (``A = T * k``).
            owner: ``[E]`` owners.
            holders: hot expert -> ranks holding a copy (owner included), identical on all ranks.
            replicas: expert -> this rank's replica module (the non-owned hot experts it holds).
            speeds: ``[W]`` agreed speeds.
        """
        E, W, me = self.num_experts, self.world_size, self.rank
        table = self._gather(send_counts) if table is None else table
        counts = [[int(row[e]) for e in range(E)] for row in table]
        measured = tuple(float(row[E]) for row in table)
        plan = plan_split(counts, owner, holders, speeds)
        # Virtual experts: (hot expert, non-owner holder) pairs, ascending.
        ext = list(owner)
        virtual: Dict[Tuple[int, int], int] = {}
        for e in sorted(holders):
            for h in sorted(set(holders[e])):
                if h != owner[e]:
                    virtual[(e, h)] = len(ext)
                    ext.append(h)
        idx = idx_cm.clone()
        for e, q in plan.quota.items():
            segs = assign_rows([counts[s][e] for s in range(W)], q)[me]
            if not segs or all(h == owner[e] for h, _ in segs):
                continue
            mask = idx_cm == e
            pos = torch.cumsum(mask.to(torch.int64), 0) - 1
            ends = torch.tensor(_cumsum(n for _, n in segs), dtype=torch.int64, device=idx_cm.device)
            ids = torch.tensor([e if h == owner[e] else virtual[(e, h)] for h, _ in segs], dtype=torch.int64, device=idx_cm.device)
            seg = torch.searchsorted(ends, pos, right=True).clamp_(max=len(segs) - 1)
            idx = torch.where(mask, ids[seg], idx)
        mods = [replicas[e] for (e, h), v in sorted(virtual.items(), key=lambda kv: kv[1]) if h == me]
        T = idx_cm.numel() // max(1, num_topk)
        self.last = SplitRoute(idx.view(num_topk, T).t(), ext, mods, plan, measured)
        return self.last

    def record(self) -> Dict[str, object]:
        """Step-record keys of the last split: ``split_experts``, ``moe_rows``,
        ``moe_time_predicted`` / ``moe_time_measured_s`` (per rank; measured = previous step's
        forward expert seconds) and their ``*_max_over_mean``."""
        if self.last is None:
            return {}
        p = self.last.plan
        return {
            "split_experts": tuple(sorted(p.quota)),
            "moe_rows": tuple(p.rows),
            "moe_time_predicted": tuple(p.predicted),
            "moe_time_predicted_max_over_mean": max_over_mean(p.predicted),
            "moe_time_measured_s": tuple(self.last.measured),
            "moe_time_measured_max_over_mean": max_over_mean(self.last.measured),
        }


def _cumsum(values) -> List[int]:
    out, acc = [], 0
    for v in values:
        acc += int(v)
        out.append(acc)
    return out
