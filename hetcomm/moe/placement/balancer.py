"""Two-timescale, capacity-aware expert load balancer.

Notation: ``E`` experts, ``W`` ranks, ``c_r`` rank ``r``'s throughput (tokens/s or any unit
proportional to it: TFLOPS from :func:`hetcomm.topo.compute.rank_speeds`, or measured),
``w_e`` predicted tokens per step of expert ``e``, ``n_e`` its copies (1 = no replica).

Inputs, every step (identical on every rank, e.g. after the layer's count all-reduce):
- **slow timescale**: global tokens per expert, kept over a sliding window (``window`` = 100
  steps) whose mean is the load the next window will most likely see;
- **fast timescale**: the gate's per-step top-``fast_topk`` (20) logits per token, softmaxed
  over those 20 and weighted by the token's confidence (its top-1 probability), summed per
  expert: where the router is *heading* before the counts show it. The prediction is
  ``w = (1 - fast_weight) * window_mean + fast_weight * fast_share * tokens_per_step``.

Every ``every`` steps (50) the balancer proposes an expert->rank map:
1. **replicas** (EPLB's replica choice, DeepSeek ``eplb.py:replicate_experts``): ``redundant``
   extra copies, each given to the expert with the largest per-copy load ``w_e / n_e``;
2. **capacity-aware packing**: copies sorted by load, each placed on the rank (with a free slot,
   not already holding that expert) that finishes it first, ``(L_r + w_e/n_e) / c_r`` (LPT on
   uniform machines); the expert's current rank wins ties within ``stickiness`` (2%) so that
   equal plans do not move anything; experts still cooling down keep their ranks;
3. **refinement** (:func:`refine_placement`), from two starting points, the map in force and the
   fresh packing of step 2: local search on the slowest rank (move a copy off it, swap it for a
   lighter one, drop a replica it holds, or add a copy elsewhere). LPT fixes copy counts before
   placing them, so an expert given a copy on every rank puts one on the slowest rank too
   (capacity-unaware, EPLB's choice); refinement undoes that. Each change must shorten the
   predicted step by its transfer time plus ``min_gain`` (1%) of the step
   (:meth:`ExpertBalancer.lock_cost`: the cooldown locks every changed expert, and the next
   shift of the hot set may need it), +``lock_spread`` (10%) of that price per expert already
   locked on the receiving rank; of the two refined maps the one with the larger net gain is
   proposed. Starting from the map in force keeps plans small: on the issue's drifting
   trace, greedy LPT alone changed ~3x as many experts and then found hot experts locked on the
   910B (mean max/mean 1.23 over four seeds on the half-speed cluster, 1.10 with refinement);
4. **cost test**: the plan is adopted only when the predicted gain over the next window,
   ``window * (T(now) - T(plan))`` with ``T = max_r L_r / c_r * seconds_per_unit``, exceeds the
   time to move the experts it moves (``bytes_per_expert / link_bytes_per_s`` each), and still
   does after the ``min_gain`` price of each change;
5. **cooldown**: an expert whose copies changed may not change again for ``cooldown`` (1,000)
   steps; :meth:`ExpertBalancer.migrations` records every change so this can be checked.

A token of an expert with several copies goes to one of them, evenly over the copies (the split
the packing assumes; a fast rank gets more load by holding more copies, not a bigger split).

The map travels as CSR (:class:`ExpertMap`): ``indptr`` ``[E+1]`` and ``indices`` ``[nnz]``
(ranks; the first of each row is the primary owner), broadcast as one int32 tensor of
``2 + (E + 1) + nnz`` elements: for 64 experts on 80 ranks with 16 replicas that is
``2 + 65 + 80 = 147`` int32 = 588 bytes per layer.

Written by hand: EPLB (the reference, implemented in ``benchmarks/bench_balancer.py``) assumes
equal devices and ignores migration cost; no library does capacity-aware packing with a
migration budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hetcomm.errors import ConfigError

__all__ = [
    "BalancerConfig", "ExpertMap", "Move", "BalancePlan", "ExpertBalancer", "fast_signal",
    "pack_capacity_aware", "refine_placement", "replica_counts", "broadcast_map", "rank_loads",
]


@dataclass(frozen=True)
class BalancerConfig:
    """Knobs of :class:`ExpertBalancer`.

    Attributes:
        window: slow timescale: steps of global per-expert load kept (100).
        fast_topk: fast timescale: logits per token taken from each step's gate (20).
        fast_weight: share of the fast signal in the prediction (0.3: the window is the better
            estimate of a step's mean load; the fast signal mainly leads it when routing moves).
        every: steps between two plan evaluations (50).
        cooldown: steps before an expert that moved may move again (1,000).
        redundant: extra expert copies (replicas) across the group (0 = none).
        drift_threshold: when the fast signal and the window's shares differ by more than this
            total-variation distance (0.25), routing has moved: the window restarts from the
            fast signal and a plan is evaluated at once instead of at the next ``every``.
        stickiness: an expert stays on its current rank when that rank's finish time is within
            this fraction of the best (0.02), so equivalent plans move nothing.
        link_bytes_per_s: bandwidth a migration's copy gets (25e9, RDMA 200 Gb/s).
        seconds_per_unit: step seconds per unit of ``load / speed`` (converts the balance gain
            into seconds comparable with the transfer time; 1e-6 = 1 us per token on a speed-1
            rank).
        min_gain: every new copy must also shorten the predicted step by this fraction (0.01):
            the price of locking an expert for ``cooldown`` steps (see
            :meth:`ExpertBalancer.lock_cost`).
        lock_spread: that price grows by this fraction (0.1) per expert already locked on the
            receiving rank, so the locked experts spread over the ranks (several cooling
            experts on one rank, one of which turns hot, cannot be relieved).
    """

    window: int = 100
    fast_topk: int = 20
    fast_weight: float = 0.3
    every: int = 50
    cooldown: int = 1000
    redundant: int = 0
    drift_threshold: float = 0.25
    stickiness: float = 0.02
    link_bytes_per_s: float = 25e9
    seconds_per_unit: float = 1e-6
    min_gain: float = 0.01
    lock_spread: float = 0.1

    def __post_init__(self) -> None:
        for key in ("window", "fast_topk", "every"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"must be a whole number >= 1, got {v!r}", key=f"balance.{key}")
        for key in ("cooldown", "redundant"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"must be a whole number >= 0, got {v!r}", key=f"balance.{key}")
        if not 0.0 <= self.fast_weight <= 1.0:
            raise ConfigError(f"must be within [0, 1], got {self.fast_weight!r}", key="balance.fast_weight")
        if not 0.0 <= self.stickiness < 1.0:
            raise ConfigError(f"must be within [0, 1), got {self.stickiness!r}", key="balance.stickiness")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise ConfigError(f"must be within [0, 1), got {self.min_gain!r}", key="balance.min_gain")
        if isinstance(self.lock_spread, bool) or not isinstance(self.lock_spread, (int, float)) \
                or not 0 <= self.lock_spread < float("inf"):
            raise ConfigError(f"must be a number >= 0, got {self.lock_spread!r}", key="balance.lock_spread")
        for key in ("link_bytes_per_s", "seconds_per_unit"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"must be > 0, got {getattr(self, key)!r}", key=f"balance.{key}")


@dataclass(frozen=True)
class ExpertMap:
    """Expert -> ranks in CSR form.

    Attributes:
        indptr: ``[E+1]`` int32; expert ``e``'s ranks are ``indices[indptr[e]:indptr[e+1]]``.
        indices: ``[nnz]`` int32 ranks, the primary owner first, no rank twice per expert.
        world_size: ``W``.
    """

    indptr: Tuple[int, ...]
    indices: Tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if not self.indptr or self.indptr[0] != 0 or self.indptr[-1] != len(self.indices):
            raise ConfigError("indptr must start at 0 and end at len(indices)", key="balance.map.indptr")
        for e in range(len(self.indptr) - 1):
            ranks = self.ranks_of(e)
            if not ranks:
                raise ConfigError(f"expert {e} has no rank", key=f"balance.map[{e}]")
            if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
                raise ConfigError(
                    f"expert {e} has ranks {list(ranks)}; each must be distinct and in 0..{self.world_size - 1}",
                    key=f"balance.map[{e}]",
                )

    @classmethod
    def from_lists(cls, ranks: Sequence[Sequence[int]], world_size: int) -> "ExpertMap":
        indptr, indices = [0], []
        for rs in ranks:
            indices.extend(int(r) for r in rs)
            indptr.append(len(indices))
        return cls(tuple(indptr), tuple(indices), world_size)

    @property
    def num_experts(self) -> int:
        return len(self.indptr) - 1

    def ranks_of(self, e: int) -> Tuple[int, ...]:
        return self.indices[self.indptr[e] : self.indptr[e + 1]]

    def lists(self) -> List[Tuple[int, ...]]:
        return [self.ranks_of(e) for e in range(self.num_experts)]

    def owner(self) -> List[int]:
        """Primary owner of each expert (for a layer without replicas)."""
        return [self.indices[self.indptr[e]] for e in range(self.num_experts)]

    def experts_on(self, rank: int) -> List[int]:
        return [e for e in range(self.num_experts) if rank in self.ranks_of(e)]

    def to_tensor(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[2 + E + 1 + nnz]`` int32: ``E, nnz, indptr..., indices...`` (what is broadcast)."""
        data = [self.num_experts, len(self.indices), *self.indptr, *self.indices]
        return torch.tensor(data, dtype=torch.int32, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, world_size: int) -> "ExpertMap":
        v = t.to("cpu").tolist()
        E, nnz = v[0], v[1]
        return cls(tuple(v[2 : 3 + E]), tuple(v[3 + E : 3 + E + nnz]), world_size)

    def nbytes(self) -> int:
        return 4 * (3 + self.num_experts + len(self.indices))


def broadcast_map(m: Optional[ExpertMap], src: int = 0, group=None, max_nnz: Optional[int] = None,
                  num_experts: Optional[int] = None, world_size: Optional[int] = None,
                  device: Optional[torch.device] = None) -> ExpertMap:
    """Broadcast ``m`` from ``src`` (collective). Non-source ranks pass ``m=None`` with
    ``num_experts``/``world_size``/``max_nnz`` to size the receive buffer (one message, no
    separate size exchange; unused tail elements are ignored).
    """
    if m is not None:
        num_experts, world_size = m.num_experts, m.world_size
        max_nnz = max(max_nnz or 0, len(m.indices))
    if num_experts is None or world_size is None or max_nnz is None:
        raise ConfigError("non-source ranks must give num_experts, world_size and max_nnz", key="balance.broadcast")
    buf = torch.zeros(3 + num_experts + max_nnz, dtype=torch.int32, device=device)
    if m is not None:
        t = m.to_tensor(device)
        buf[: t.numel()] = t
    dist.broadcast(buf, src=src, group=group)
    return ExpertMap.from_tensor(buf, world_size)


@dataclass(frozen=True)
class Move:
    """One change of an expert's copies: ``src`` -> ``dst`` (``src`` None = a new replica
    copied from ``from_rank``; ``dst`` None = a replica dropped, nothing moves)."""

    expert: int
    src: Optional[int]
    dst: Optional[int]
    from_rank: int


@dataclass(frozen=True)
class BalancePlan:
    """A proposed map and what adopting it means.

    Attributes:
        step: the step it was computed at.
        new_map: the map.
        moves: the copies it creates or drops.
        predicted_gain_s: predicted seconds saved over the next window.
        cost_s: seconds of transfer the moves take.
        adopted: gain > cost (and something moves).
        imbalance_before / imbalance_after: max/mean of predicted ``L_r / c_r``.
    """

    step: int
    new_map: ExpertMap
    moves: Tuple[Move, ...]
    predicted_gain_s: float
    cost_s: float
    adopted: bool
    imbalance_before: float
    imbalance_after: float


def replica_counts(load: Sequence[float], total_copies: int, max_copies: int) -> List[int]:
    """EPLB's replica choice: each extra copy to the expert of largest per-copy load.

    Args:
        load: ``[E]`` predicted tokens per expert.
        total_copies: ``E + redundant``.
        max_copies: at most this many copies of one expert (``W``: one per rank).
    Returns:
        ``n_e`` per expert (sums to ``min(total_copies, E * max_copies)``).
    """
    n = [1] * len(load)
    for _ in range(len(load), total_copies):
        cands = [e for e in range(len(load)) if n[e] < max_copies]
        if not cands:
            break
        e = max(cands, key=lambda e: (load[e] / n[e], -e))
        n[e] += 1
    return n


def rank_loads(m: ExpertMap, load: Sequence[float]) -> List[float]:
    """Tokens per rank when each expert's tokens split evenly over its copies (the split the
    packing assumed: capacity enters through where copies go, not through uneven splits)."""
    out = [0.0] * m.world_size
    for e in range(m.num_experts):
        ranks = m.ranks_of(e)
        for r in ranks:
            out[r] += load[e] / len(ranks)
    return out


def finish_times(m: ExpertMap, load: Sequence[float], speeds: Sequence[float]) -> List[float]:
    return [L / s for L, s in zip(rank_loads(m, load), speeds)]


def pack_capacity_aware(
    load: Sequence[float],
    copies: Sequence[int],
    speeds: Sequence[float],
    slots: Sequence[int],
    current: Optional[ExpertMap] = None,
    fixed: Sequence[int] = (),
    stickiness: float = 0.02,
) -> ExpertMap:
    """Place ``copies[e]`` copies of each expert on ranks, LPT by finish time ``L_r / c_r``.

    Args:
        load: ``[E]`` predicted tokens per expert.
        copies: ``[E]`` copies per expert (:func:`replica_counts`).
        speeds: ``[W]`` throughput per rank (> 0).
        slots: ``[W]`` experts each rank can hold.
        current: the map in force; its ranks win near-ties and keep ``fixed`` experts.
        fixed: experts that keep exactly their current ranks (cooling down).
        stickiness: near-tie tolerance for staying put.
    Raises:
        ConfigError: fewer slots than copies.
    """
    E, W = len(load), len(speeds)
    if sum(slots) < sum(copies):
        raise ConfigError(
            f"{sum(copies)} expert copies do not fit {sum(slots)} slots ({list(slots)})", key="balance.slots"
        )
    # Copies share an expert's tokens evenly (w_e / n_e each); speed enters the finish times.
    L = [0.0] * W
    free = list(slots)
    placed: List[List[int]] = [[] for _ in range(E)]
    fixed_set = set(fixed)
    if current is not None:
        for e in fixed_set:
            for r in current.ranks_of(e):
                placed[e].append(r)
                free[r] -= 1
                L[r] += load[e] / len(current.ranks_of(e))
    items = sorted(
        ((load[e] / copies[e], e) for e in range(E) if e not in fixed_set for _ in range(copies[e])),
        key=lambda it: (-it[0], it[1]),
    )
    for w, e in items:
        cands = [r for r in range(W) if free[r] > 0 and r not in placed[e]]
        if not cands:
            raise ConfigError(f"no rank has room for a copy of expert {e}", key="balance.slots")
        best = min(cands, key=lambda r: ((L[r] + w) / speeds[r], r))
        best_t = (L[best] + w) / speeds[best]
        if current is not None:
            for r in current.ranks_of(e):
                if r in cands and r != best and (L[r] + w) / speeds[r] <= best_t * (1 + stickiness):
                    best = r
                    break
        placed[e].append(best)
        free[best] -= 1
        L[best] += w
    m = ExpertMap.from_lists(placed, W)
    return m if current is None else _keep_primary(m, current)


def _keep_primary(m: ExpertMap, current: ExpertMap) -> ExpertMap:
    """``m`` with each expert's current primary listed first when it stays, so an unchanged
    expert's row is unchanged (and ``diff_maps`` sees no move)."""
    rows = []
    for e in range(m.num_experts):
        rs = list(m.ranks_of(e))
        cur = current.ranks_of(e)
        if cur and cur[0] in rs:
            rs.remove(cur[0])
            rs.insert(0, cur[0])
        rows.append(rs)
    return ExpertMap.from_lists(rows, m.world_size)


def refine_placement(
    load: Sequence[float],
    placed: Sequence[Sequence[int]],
    speeds: Sequence[float],
    slots: Sequence[int],
    *,
    fixed: Sequence[int] = (),
    total_copies: Optional[int] = None,
    current: Optional[ExpertMap] = None,
    move_cost: float = 0.0,
    spread: float = 0.0,
    max_iters: int = 500,
) -> List[List[int]]:
    """Local search that lowers the slowest rank's finish time ``max_r L_r / c_r``.

    Each round looks at the bottleneck rank ``b`` and applies the best of: move a copy from
    ``b`` to another rank; swap a copy on ``b`` with a lighter one elsewhere; drop a replica
    held by ``b`` (its tokens spread over the remaining copies); add a copy of an expert ``b``
    holds on another rank (within ``total_copies``). Greedy LPT fixes copy counts before it
    places anything, so a hot expert given a copy on every rank puts one on the slowest rank
    too; these moves undo exactly that. A change is taken when it lowers the bottleneck by more
    than the cost of the copies it creates, or keeps it and lowers ``sum_r (L_r / c_r)^2`` (a
    tie at the top is broken one rank at a time).

    Args:
        load: ``[E]`` predicted tokens per expert.
        placed: ``[E]`` lists of ranks (the starting point; not modified).
        speeds: ``[W]`` rank throughput.
        slots: ``[W]`` experts each rank can hold.
        fixed: experts whose ranks may not change (cooling down).
        total_copies: at most this many copies in all (default: as many as ``placed`` has).
        current: the map in force: a copy on a rank it does not hold there costs ``move_cost``.
        move_cost: cost of one new copy, in units of finish time (``L / c``).
        spread: a new copy on rank ``r`` costs ``move_cost * (1 + spread * locked_r)``, with
            ``locked_r`` the experts already locked there (cooling, or added by this search):
            changes concentrated on one rank are what strands a newly hot expert there with
            companions that may not leave.
        max_iters: at most this many changes.
    Returns:
        ``[E]`` lists of ranks.
    """
    E, W = len(load), len(speeds)
    pl = [list(rs) for rs in placed]
    fixed_set = set(fixed)
    budget = sum(len(rs) for rs in pl) if total_copies is None else int(total_copies)
    held = [set(current.ranks_of(e)) for e in range(E)] if current is not None else None
    L = [0.0] * W
    free = list(slots)
    for e, rs in enumerate(pl):
        for r in rs:
            L[r] += load[e] / len(rs)
            free[r] -= 1
    n_copies = sum(len(rs) for rs in pl)

    def count_locked() -> List[int]:
        """Experts locked on each rank: those cooling there, plus copies new to that rank."""
        out = [0] * W
        for f in range(E):
            for q in pl[f]:
                if f in fixed_set or (held is not None and q not in held[f]):
                    out[q] += 1
        return out

    locked = count_locked()

    def new_cost(e: int, r: int) -> float:
        if held is None or r in held[e]:
            return 0.0
        return move_cost * (1 + spread * locked[r])

    def score(t: List[float]) -> Tuple[float, float]:
        return max(t), sum(x * x for x in t)

    for _ in range(max_iters):
        t = [L[r] / speeds[r] for r in range(W)]
        top, sq = score(t)
        b = max(range(W), key=lambda r: (t[r], -r))
        best = None  # (improvement, tie-gain, description)

        def consider(delta: Dict[int, float], cost: float, change) -> None:
            nonlocal best
            nt = list(t)
            for r, d in delta.items():
                nt[r] += d / speeds[r]
            m, s = score(nt)
            gain = top - m
            tie = (sq - s) / (2 * top) if top > 0 else 0.0
            if gain > cost + 1e-12 * top or (gain >= -1e-12 * top and tie > max(cost, 1e-12 * top)):
                key = (gain - cost, tie)
                if best is None or key > best[0]:
                    best = (key, change)

        movable = [[] for _ in range(W)]  # per rank: experts that may change, with their per-copy load
        for f in range(E):
            if f not in fixed_set:
                for q in pl[f]:
                    movable[q].append((f, load[f] / len(pl[f])))
        on_b = [e for e, _ in movable[b] if load[e] > 0]
        for e in on_b:
            n = len(pl[e])
            w = load[e] / n
            for r in range(W):
                if r == b or r in pl[e]:
                    continue
                if free[r] > 0:
                    consider({b: -w, r: w}, new_cost(e, r) - new_cost(e, b), ("move", e, b, r))
                    if n_copies < budget:
                        w1 = load[e] / (n + 1)
                        d = {q: w1 - w for q in pl[e]}
                        d[r] = w1
                        consider(d, new_cost(e, r), ("add", e, r))
                for f, wf in movable[r]:
                    if wf < w and b not in pl[f]:
                        cost = new_cost(e, r) + new_cost(f, b) - new_cost(e, b) - new_cost(f, r)
                        consider({b: wf - w, r: w - wf}, cost, ("swap", e, b, f, r))
            if n > 1:
                w1 = load[e] / (n - 1)
                d = {q: w1 - w for q in pl[e] if q != b}
                d[b] = -w
                consider(d, -new_cost(e, b), ("drop", e, b))
        if best is None:
            break
        change = best[1]
        kind, e = change[0], change[1]
        n = len(pl[e])
        for q in pl[e]:
            L[q] -= load[e] / n
        if kind == "move":
            pl[e][pl[e].index(change[2])] = change[3]
            free[change[2]] += 1
            free[change[3]] -= 1
        elif kind == "add":
            pl[e].append(change[2])
            free[change[2]] -= 1
            n_copies += 1
        elif kind == "drop":
            pl[e].remove(change[2])
            free[change[2]] += 1
            n_copies -= 1
        else:  # swap e (on b) with f (on r)
            _, _, b_, f, r = change
            for q in pl[f]:
                L[q] -= load[f] / len(pl[f])
            pl[e][pl[e].index(b_)] = r
            pl[f][pl[f].index(r)] = b_
            for q in pl[f]:
                L[q] += load[f] / len(pl[f])
        for q in pl[e]:
            L[q] += load[e] / len(pl[e])
        locked = count_locked()
    return pl


def fast_signal(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Confidence-weighted top-``topk`` share per expert of one step's gate logits.

    Args:
        logits: ``[T, E]`` float (any float dtype/device).
    Returns:
        ``[E]`` float64 on CPU, summing to 1: per token, softmax over its top-``topk`` logits,
        scaled by its confidence (top-1 probability over all experts), summed over tokens and
        normalised.
    """
    if logits.dim() != 2:
        raise ConfigError(f"logits must be [T, E], got shape {tuple(logits.shape)}", key="balance.logits")
    x = logits.detach().float()
    k = min(topk, x.shape[1])
    vals, idx = x.topk(k, dim=1)
    conf = torch.softmax(x, dim=1).max(dim=1).values  # [T]
    w = torch.softmax(vals, dim=1) * conf.unsqueeze(1)
    out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, idx.reshape(-1), w.reshape(-1))
    out = out.to("cpu", torch.float64)
    s = float(out.sum())
    return out / s if s > 0 else out


class ExpertBalancer:
    """Decides the expert->rank map (identical on every rank given identical inputs).

    Args:
        num_experts: ``E``.
        speeds: ``[W]`` rank throughput (e.g. ``rank_speeds(cluster)``); only ratios matter.
        config: :class:`BalancerConfig`.
        bytes_per_expert: bytes a migration moves per expert (parameters + optimizer state).
        slots: ``[W]`` experts each rank can hold (default: ``ceil(E / W) * 2`` each, so a
            fast rank can take twice its even share).
        initial: the map in force at step 0 (default: experts dealt contiguously, even counts).
    """

    def __init__(
        self,
        num_experts: int,
        speeds: Sequence[float],
        config: Optional[BalancerConfig] = None,
        *,
        bytes_per_expert: int = 0,
        slots: Optional[Sequence[int]] = None,
        initial: Optional[ExpertMap] = None,
    ) -> None:
        self.cfg = config or BalancerConfig()
        self.num_experts = E = int(num_experts)
        self.speeds = [float(s) for s in speeds]
        W = len(self.speeds)
        if E < 1 or W < 1:
            raise ConfigError(f"need experts and ranks, got E={E}, W={W}", key="balance")
        if any(not s > 0 for s in self.speeds):
            raise ConfigError(f"rank speeds must be > 0, got {self.speeds}", key="balance.speeds")
        self.world_size = W
        self.slots = list(slots) if slots is not None else [2 * -(-E // W)] * W
        if len(self.slots) != W:
            raise ConfigError(f"{len(self.slots)} slot counts for {W} ranks", key="balance.slots")
        self.bytes_per_expert = int(bytes_per_expert)
        self.map = initial or ExpertMap.from_lists([[e * W // E] for e in range(E)], W)
        if self.map.num_experts != E or self.map.world_size != W:
            raise ConfigError("initial map does not match num_experts/world size", key="balance.initial")
        # host: load history for host decisions (the map is chosen in Python, once per window).
        self._window = torch.zeros(self.cfg.window, E, dtype=torch.float64, device="cpu")
        self._filled = 0
        self._fast = torch.zeros(E, dtype=torch.float64, device="cpu")
        self._fast_slow = torch.zeros(E, dtype=torch.float64, device="cpu")  # window-long EMA of the fast signal
        self._drifted = False
        self.step = 0
        self.last_change = [-(10**9)] * E
        self.migrations: List[Tuple[int, Move]] = []  # (step, move), every change ever adopted
        self.plans: List[BalancePlan] = []
        self._requested: set = set()  # experts a pager asked to move (request_migration)
        self.num_requests = 0

    def set_speeds(self, speeds: Sequence[float], seconds_per_unit: Optional[float] = None) -> None:
        """New ``c_r`` (e.g. the layer's measured vector, identical on every rank) and, optionally,
        ``seconds_per_unit``; used from the next :meth:`propose`."""
        sp = [float(s) for s in speeds]
        if len(sp) != self.world_size or any(not s > 0 for s in sp) or not (seconds_per_unit or 1) > 0:
            raise ConfigError(f"need {self.world_size} speeds > 0 (got {sp}), seconds_per_unit > 0", key="balance.speeds")
        self.speeds = sp
        if seconds_per_unit is not None:
            self.cfg = replace(self.cfg, seconds_per_unit=float(seconds_per_unit))

    # -- inputs -------------------------------------------------------------------------------

    def observe(
        self, load: torch.Tensor, logits: Optional[torch.Tensor] = None, fast: Optional[torch.Tensor] = None
    ) -> None:
        """One step's global tokens per expert (``[E]``, any numeric dtype/device) and,
        optionally, the gate logits (``[T, E]``) for the fast timescale, or their
        :func:`fast_signal` already computed (``fast``, ``[E]``; e.g. all-reduced over ranks)."""
        if load.shape != (self.num_experts,):
            raise ConfigError(f"load has shape {tuple(load.shape)}; expected ({self.num_experts},)", key="balance.load")
        self._window[self.step % self.cfg.window] = load.detach().to("cpu", torch.float64)
        self._filled = min(self._filled + 1, self.cfg.window)
        self.step += 1
        self._drifted = False
        if logits is not None:
            fast = fast_signal(logits, self.cfg.fast_topk)
        if fast is not None:
            self._fast = fast.detach().to("cpu", torch.float64)
            # Drift test against the fast signal's own slow average (soft shares and hard
            # counts differ systematically, so they are not compared with each other).
            if float(self._fast_slow.sum()) == 0:
                self._fast_slow = self._fast.clone()
            tv = 0.5 * float((self._fast - self._fast_slow).abs().sum())
            a = 1.0 / self.cfg.window
            self._fast_slow = (1 - a) * self._fast_slow + a * self._fast
            if self._filled > 1:
                if tv > self.cfg.drift_threshold:
                    self._fast_slow = self._fast.clone()
                    # The old window describes routing that is gone: restart it from this step.
                    cur = self._window[(self.step - 1) % self.cfg.window].clone()
                    self._window.zero_()
                    self._window[(self.step - 1) % self.cfg.window] = cur
                    self._filled = 1
                    self._drifted = True

    def request_migration(self, experts: Sequence[int]) -> None:
        """Experts a pager could not keep resident (its L2 level,
        ``MoELayer.take_migration_requests``): the next :meth:`maybe_rebalance` evaluates a
        plan at once, as after a drift, instead of waiting for its ``every`` steps. The same
        requests must reach every rank's balancer (``hetcomm train --balance`` sums them)."""
        new = {int(e) for e in experts if 0 <= int(e) < self.num_experts}
        self.num_requests += len(new)
        self._requested |= new

    def predicted_load(self) -> List[float]:
        """``[E]`` predicted tokens per step (window mean blended with the fast signal)."""
        if self._filled == 0:
            return [0.0] * self.num_experts
        mean = self._window.sum(dim=0) / self._filled
        if float(self._fast.sum()) > 0:
            mean = (1 - self.cfg.fast_weight) * mean + self.cfg.fast_weight * self._fast * float(mean.sum())
        return mean.tolist()

    # -- decisions ----------------------------------------------------------------------------

    def step_time(self, m: ExpertMap, load: Sequence[float]) -> float:
        return max(finish_times(m, load, self.speeds)) * self.cfg.seconds_per_unit

    def imbalance(self, m: ExpertMap, load: Sequence[float]) -> float:
        t = finish_times(m, load, self.speeds)
        mean = sum(t) / len(t)
        return max(t) / mean if mean > 0 else 1.0

    def lock_cost(self, load: Sequence[float]) -> float:
        """The gain (finish-time units, ``L / c``) a new copy must bring on top of its transfer:
        ``min_gain`` of the current step's slowest finish time.

        Why: a changed expert may not change again for ``cooldown`` steps, so every change spends
        freedom that the next shift of the hot set may need (an expert moved as a filler that
        turns hot while it cools cannot leave a rank too slow for it). Many small moves that
        each buy a sliver are what exhausts that freedom."""
        return self.cfg.min_gain * max(finish_times(self.map, load, self.speeds))

    def propose(self) -> BalancePlan:
        """Compute (not adopt) the best map for the predicted load, respecting the cooldown."""
        load = self.predicted_load()
        E, W = self.num_experts, self.world_size
        cooling = [e for e in range(E) if self.step - self.last_change[e] < self.cfg.cooldown]
        copies = replica_counts(load, E + self.cfg.redundant, W)
        for e in cooling:
            copies[e] = len(self.map.ranks_of(e))
        budget = max(E + self.cfg.redundant, sum(copies))
        spw = self.cfg.window * self.cfg.seconds_per_unit  # seconds per finish-time unit over a window
        move_s = self.bytes_per_expert / self.cfg.link_bytes_per_s
        lock = self.lock_cost(load)
        # A new copy must pay its transfer and the price of locking the expert for the cooldown.
        move_cost = move_s / spw + lock
        fresh = pack_capacity_aware(load, copies, self.speeds, self.slots, self.map, cooling, self.cfg.stickiness)
        t_now = self.step_time(self.map, load)
        best = None
        # Two starting points, both refined: the map in force (few changes) and a fresh LPT
        # packing (a better optimum after a big shift); the one with the larger net gain wins.
        for start in (self.map.lists(), fresh.lists()):
            pl = refine_placement(load, start, self.speeds, self.slots, fixed=cooling, total_copies=budget,
                                  current=self.map, move_cost=move_cost, spread=self.cfg.lock_spread)
            new = _keep_primary(ExpertMap.from_lists(pl, W), self.map)
            moves = diff_maps(self.map, new)
            gain = self.cfg.window * (t_now - self.step_time(new, load))
            cost = sum(1 for mv in moves if mv.dst is not None) * move_s
            net = gain - sum(move_s + lock * spw for mv in moves if mv.dst is not None)
            key = (bool(moves), net)
            if best is None or key > best[0]:
                best = (key, new, moves, gain, cost)
        (_, net), new, moves, gain, cost = best
        adopted = bool(moves) and gain > cost and net > 0
        return BalancePlan(self.step, new, tuple(moves), gain, cost, adopted,
                           self.imbalance(self.map, load), self.imbalance(new, load))

    def maybe_rebalance(self) -> Optional[BalancePlan]:
        """Every ``every`` steps (once the window holds ``every`` steps): propose, and adopt
        when worth it (at once after a drift or a pager's migration request). Returns the adopted plan (its moves are what the migrator must carry
        out), else None."""
        if not self._drifted and not self._requested and (
            self.step % self.cfg.every or self._filled < min(self.cfg.every, self.cfg.window)
        ):
            return None
        self._requested.clear()
        plan = self.propose()
        self.plans.append(plan)
        del self.plans[:-20]
        if not plan.adopted:
            return None
        self.adopt(plan)
        return plan

    def adopt(self, plan: BalancePlan) -> None:
        """Make ``plan`` the map in force and start the cooldown of every expert it changes."""
        for mv in plan.moves:
            self.last_change[mv.expert] = self.step
            self.migrations.append((self.step, mv))
        self.map = plan.new_map

    def cooldown_violations(self) -> List[Tuple[int, int, int]]:
        """``(expert, step, previous step)`` for every change closer than ``cooldown`` to the
        previous change of the same expert (several moves of one plan count once)."""
        last: Dict[int, int] = {}
        bad = []
        for step, mv in self.migrations:
            prev = last.get(mv.expert)
            if prev is not None and prev != step and step - prev < self.cfg.cooldown:
                bad.append((mv.expert, step, prev))
            last[mv.expert] = step
        return bad

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {
            "step": self.step,
            "window": self._window.clone(),
            "filled": self._filled,
            "fast": self._fast.clone(),
            "fast_slow": self._fast_slow.clone(),
            "last_change": list(self.last_change),
            "map": self.map.to_tensor(),
            "migrations": [(s, mv.expert, mv.src, mv.dst, mv.from_rank) for s, mv in self.migrations],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["window"].shape != self._window.shape:
            raise ConfigError(
                f"balancer state of window/experts {tuple(state['window'].shape)}, this one {tuple(self._window.shape)}",
                key="balance.state_dict",
            )
        self.step = int(state["step"])
        self._window = state["window"].clone()
        self._filled = int(state["filled"])
        self._fast = state["fast"].clone()
        self._fast_slow = state["fast_slow"].clone()
        self.last_change = list(state["last_change"])
        self.map = ExpertMap.from_tensor(state["map"], self.world_size)
        self.migrations = [(s, Move(e, a, b, f)) for s, e, a, b, f in state["migrations"]]


def diff_maps(old: ExpertMap, new: ExpertMap) -> List[Move]:
    """The moves that turn ``old`` into ``new``: per expert, lost ranks pair with gained ranks
    (a move), extra gains are new replicas, extra losses dropped replicas."""
    moves: List[Move] = []
    for e in range(old.num_experts):
        a, b = old.ranks_of(e), new.ranks_of(e)
        lost = [r for r in a if r not in b]
        gained = [r for r in b if r not in a]
        keep = [r for r in a if r in b]
        for i in range(max(len(lost), len(gained))):
            src = lost[i] if i < len(lost) else None
            dst = gained[i] if i < len(gained) else None
            from_rank = src if src is not None else (keep[0] if keep else a[0])
            moves.append(Move(e, src, dst, from_rank))
    return moves
