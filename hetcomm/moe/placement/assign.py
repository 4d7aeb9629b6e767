"""Expert placement: which rank owns which expert.

Notation (shared by ``hetcomm.moe``):
    W          ranks in the expert-parallel group
    E          global experts (``num_experts``), numbered ``0 .. E-1``
    L_r        experts owned by rank ``r`` (``num_local_experts``); ``sum_r L_r == E``
    slot       an expert's position in rank-major order: rank 0's experts first, each rank's in
               local-index order. Dispatch sorts tokens by slot, so the rows bound for one rank
               (and, inside it, for one expert) are contiguous.

Experts per rank may differ: a strong device (A100/H800) can hold more experts than a weak one
(910B). Nothing here assumes ``E % W == 0``; a rank may even own no expert at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Tuple

from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe.speed import slow_ranks  # the one rule of "speeds differ" (re-exported)

__all__ = ["ExpertPlacement", "place_experts", "split_by_weight", "check_placement", "check_adopted_map", "slow_ranks",
           "busy_times", "balance_busy_time", "MIN_GAIN"]


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns each global expert.

    Attributes:
        owner: ``owner[e]`` is the group rank that owns expert ``e`` (length ``E``).
        world_size: ``W``, ranks in the group.
    """

    owner: Tuple[int, ...]
    world_size: int
    _experts_of: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _local_index: Tuple[int, ...] = field(init=False, repr=False, compare=False)
    _slot: Tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}", key="moe.placement")
        if not self.owner:
            raise ConfigError("a placement needs at least one expert", key="moe.placement")
        for e, r in enumerate(self.owner):
            if not 0 <= r < self.world_size:
                raise ConfigError(
                    f"expert {e} is placed on rank {r}, outside the group of {self.world_size} "
                    f"ranks; owners must be in 0..{self.world_size - 1}",
                    key=f"moe.placement.owner[{e}]",
                )
        experts_of: List[List[int]] = [[] for _ in range(self.world_size)]
        local_index = [0] * len(self.owner)
        for e, r in enumerate(self.owner):
            local_index[e] = len(experts_of[r])
            experts_of[r].append(e)
        offsets = [0]
        for r in range(self.world_size):
            offsets.append(offsets[-1] + len(experts_of[r]))
        slot = [offsets[self.owner[e]] + local_index[e] for e in range(len(self.owner))]
        object.__setattr__(self, "_experts_of", tuple(tuple(x) for x in experts_of))
        object.__setattr__(self, "_local_index", tuple(local_index))
        object.__setattr__(self, "_slot", tuple(slot))

    @property
    def num_experts(self) -> int:
        """``E``, the number of global experts."""
        return len(self.owner)

    def experts_of(self, rank: int) -> Tuple[int, ...]:
        """Global ids of the experts ``rank`` owns, in local-index order."""
        return self._experts_of[rank]

    def num_local_experts(self, rank: int) -> int:
        """``L_r``: how many experts ``rank`` owns."""
        return len(self._experts_of[rank])

    def local_index(self, expert: int) -> int:
        """Position of ``expert`` among its owner's experts."""
        return self._local_index[expert]

    @property
    def slots(self) -> Tuple[int, ...]:
        """``slots[e]``: expert ``e``'s position in rank-major order (see module notation)."""
        return self._slot

    @property
    def num_local_experts_per_rank(self) -> Tuple[int, ...]:
        """``(L_0, .., L_{W-1})``."""
        return tuple(len(x) for x in self._experts_of)

    def describe(self) -> str:
        """One line per rank: ``rank 2: 5 experts [3, 7, ...]``."""
        return "\n".join(
            f"rank {r}: {len(es)} experts {list(es)}" for r, es in enumerate(self._experts_of)
        )


def split_by_weight(total: int, weights: Sequence[float]) -> List[int]:
    """Split ``total`` items over bins in proportion to ``weights`` (largest remainder).

    Every bin with a positive weight gets at least one item while items last, so a weak rank is
    never left idle only by rounding.
    """
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"placement weights must be non-negative with a positive sum, got {list(weights)}",
            key="moe.rank_weights",
        )
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    out = [math.floor(x) for x in exact]
    # Guarantee one expert per positive-weight bin first (when there are enough experts).
    if total >= sum(1 for w in weights if w > 0):
        for i, w in enumerate(weights):
            if w > 0 and out[i] == 0:
                out[i] = 1
    # Then fix the total: add to the largest remainders, take from the smallest.
    while sum(out) < total:
        i = max(range(len(out)), key=lambda j: (exact[j] - out[j], weights[j], -j))
        out[i] += 1
    while sum(out) > total:
        i = max(
            (j for j in range(len(out)) if out[j] > 1 or (out[j] > 0 and total < len(out))),
            key=lambda j: (out[j] - exact[j], -weights[j], j),
        )
        out[i] -= 1
    return out


def place_experts(
    num_experts: int,
    world_size: int,
    *,
    rank_weights: Optional[Sequence[float]] = None,
    strong_ranks: Optional[Sequence[int]] = None,
    expert_load: Optional[Sequence[float]] = None,
    num_local_experts: Optional[Sequence[int]] = None,
) -> ExpertPlacement:
    """Place ``num_experts`` experts on ``world_size`` ranks.

    Args:
        num_experts: ``E``.
        world_size: ``W``.
        rank_weights: relative capacity of each rank (length ``W``); a rank with weight 2 holds
            about twice the experts of one with weight 1. Default: all equal.
        strong_ranks: ranks allowed to hold replicas of hot experts (strong devices). Only used
            with ``expert_load``: the hottest experts go to strong ranks, the coldest to weak.
        expert_load: a prior of each expert's load (length ``E``), e.g. the replication EMA of a
            previous run. Without it experts are placed in contiguous blocks by id.
        num_local_experts: experts per rank, given exactly (overrides ``rank_weights``); used to
            re-place experts without changing how many each rank holds.

    Returns:
        The placement; ``owner`` is non-decreasing when ``expert_load`` is None.

    Raises:
        ConfigError: a length does not match, or the weights are unusable.
    """
    if num_experts < 1:
        raise ConfigError(f"num_experts must be >= 1, got {num_experts}", key="moe.num_experts")
    weights = list(rank_weights) if rank_weights is not None else [1.0] * world_size
    if len(weights) != world_size:
        raise ConfigError(
            f"rank_weights has {len(weights)} entries but the group has {world_size} ranks; give "
            f"one weight per rank",
            key="moe.rank_weights",
        )
    if num_local_experts is not None:
        sizes = [int(n) for n in num_local_experts]
        if len(sizes) != world_size or sum(sizes) != num_experts or min(sizes) < 0:
            raise ConfigError(
                f"num_local_experts {sizes} must have {world_size} non-negative entries summing "
                f"to {num_experts}",
                key="moe.num_local_experts",
            )
    else:
        sizes = split_by_weight(num_experts, weights)
    if expert_load is None:
        owner: List[int] = []
        for r, n in enumerate(sizes):
            owner.extend([r] * n)
        return ExpertPlacement(tuple(owner), world_size)
    if len(expert_load) != num_experts:
        raise ConfigError(
            f"expert_load has {len(expert_load)} entries for {num_experts} experts",
            key="moe.expert_load",
        )
    strong = set(strong_ranks if strong_ranks is not None else range(world_size))
    # Fill strong ranks with the hottest experts, weak ranks with the coldest: traffic to a weak
    # rank crosses the slow (often cross-vendor) links, so it should receive the fewest tokens.
    by_heat = sorted(range(num_experts), key=lambda e: (-float(expert_load[e]), e))
    weak = [r for r in range(world_size) if r not in strong]
    num_weak_slots = sum(sizes[r] for r in weak)
    hot_part = by_heat[: num_experts - num_weak_slots]
    cold_part = by_heat[num_experts - num_weak_slots :]
    owner_list = [0] * num_experts
    # Hot experts round-robin over strong ranks (spreading the heat), coldest last on weak ones.
    free = {r: sizes[r] for r in range(world_size) if r in strong}
    ring = [r for r in range(world_size) if r in strong]
    i = 0
    for e in hot_part:
        while free[ring[i % len(ring)]] == 0:
            i += 1
        r = ring[i % len(ring)]
        owner_list[e] = r
        free[r] -= 1
        i += 1
    it = iter(cold_part)
    for r in weak:
        for _ in range(sizes[r]):
            owner_list[next(it)] = r
    return ExpertPlacement(tuple(owner_list), world_size)


def check_placement(placement: ExpertPlacement, num_experts: int, world_size: int) -> ExpertPlacement:
    """``placement``, checked against a layer of ``num_experts`` experts on a group of
    ``world_size`` ranks.

    Raises:
        ConfigError: (``key='moe.placement'``) it is for another expert count or group size.
    """
    if placement.world_size != world_size or placement.num_experts != num_experts:
        raise ConfigError(
            f"placement is for {placement.num_experts} experts on {placement.world_size} ranks "
            f"but the layer has {num_experts} experts on a group of {world_size}",
            key="moe.placement",
        )
    return placement


def check_adopted_map(
    owner: Sequence[int],
    modules: Mapping[int, nn.Module],
    *,
    num_experts: int,
    world_size: int,
    rank: int,
    reference: nn.Module,
) -> List[int]:
    """Check a map a layer is about to adopt (``MoELayer.apply_placement``) before anything changes.

    Args:
        owner: ``[E]`` owner rank of each global expert.
        modules: global expert id -> module, for exactly the experts ``rank`` owns under ``owner``.
        num_experts, world_size, rank: the layer's ``E``, group size and own rank.
        reference: one of the layer's experts: every module must have its parameter shapes.
    Returns:
        The global ids ``rank`` owns under ``owner``, ascending.

    Raises:
        ConfigError: (``key='moe.placement'``) a map of the wrong length or with an owner outside
            the group, a module missing or extra for an expert, or one whose parameters do not
            match, naming the expert.
    """
    E, W = num_experts, world_size
    if len(owner) != E:
        raise ConfigError(f"the map names {len(owner)} experts but the layer has {E} (rank {rank})", key="moe.placement")
    for e, r in enumerate(owner):
        if not 0 <= r < W:
            raise ConfigError(f"expert {e} is mapped to rank {r}, outside the group of {W} ranks (rank {rank})",
                              key="moe.placement")
    mine = [e for e in range(E) if owner[e] == rank]
    for e in mine:
        if e not in modules:
            raise ConfigError(f"expert {e} is mapped to rank {rank} but no module for it was given; pass "
                              f"modules[{e}] (the migrated expert)", key="moe.placement")
    extra = sorted(set(modules) - set(mine))
    if extra:
        raise ConfigError(f"expert {extra[0]} has a module on rank {rank} but the map puts it on rank "
                          f"{owner[extra[0]] if 0 <= extra[0] < E else '(no such expert)'}", key="moe.placement")
    want = [tuple(p.shape) for p in reference.parameters()]
    for e in mine:
        m = modules[e]
        got = [tuple(p.shape) for p in m.parameters()] if isinstance(m, nn.Module) else None
        if got != want:
            raise ConfigError(f"expert {e}'s module has parameters {got} but this layer's experts have {want} "
                              f"(rank {rank})", key="moe.placement")
    return mine


#: A change to the expert map must shorten the predicted slowest rank's step by this fraction.
MIN_GAIN = 0.02


def busy_times(owner: Sequence[int], expert_rows: Sequence[float], seconds_per_row: Sequence[float]) -> List[float]:
    """``[W]`` predicted expert busy seconds per step of each rank under the map ``owner``: the
    rows of the experts it owns at its ``seconds_per_row``."""
    t = [0.0] * len(seconds_per_row)
    for e, r in enumerate(owner):
        t[r] += float(expert_rows[e]) * float(seconds_per_row[r])
    return t


def balance_busy_time(owner: Sequence[int], expert_rows: Sequence[float], seconds_per_row: Sequence[float],
                      min_gain: float = MIN_GAIN) -> List[int]:
    """The expert map that evens the ranks' predicted expert busy time per step, found from
    ``owner``.

    Rank ``r``'s time is ``sum(expert_rows[e] * seconds_per_row[r])`` over the experts it owns
    (:func:`busy_times`): a rank at half speed ends with about half the rows. Local search from
    the map in force: while the slowest rank can hand one of its experts to another rank (or
    trade it for a colder one there) so that both end more than ``min_gain`` below the slowest
    rank's time now, the change that leaves the two the shortest is made (ties: the less busy
    receiver, the coldest expert, the lowest ids). Each change lowers the sorted vector of rank
    times, so the search ends. Every rank keeps at least one expert (its speed stays measured). The same
    inputs give the same map on every rank.

    Args:
        owner: ``[E]`` current owner of each expert.
        expert_rows: ``[E]`` rows per step of each expert over the group (its load).
        seconds_per_row: ``[W]`` each rank's busy seconds per expert row, forward and backward.
        min_gain: the least relative gain a change must bring.
    Returns:
        ``[E]`` new owner of each expert (``owner`` itself when nothing pays).

    Raises:
        ConfigError: inputs of the wrong length, or a negative or non-finite figure.
    """
    E, W = len(owner), len(seconds_per_row)
    if len(expert_rows) != E:
        raise ConfigError(f"expert_rows has {len(expert_rows)} entries for {E} experts", key="moe.expert_load")
    for name, xs in (("expert_rows", expert_rows), ("seconds_per_row", seconds_per_row)):
        bad = [i for i, x in enumerate(xs) if not (math.isfinite(float(x)) and float(x) >= 0)]
        if bad:
            raise ConfigError(f"{name}[{bad[0]}] is {xs[bad[0]]!r}; it must be a finite number >= 0", key="moe.busy_time")
    new = [int(r) for r in owner]
    t = busy_times(new, expert_rows, seconds_per_row)
    for _ in range(E * W):  # each accepted change shortens the slowest step: a bound, not a budget
        slowest = max(range(W), key=lambda r: (t[r], -r))
        here = [e for e in range(E) if new[e] == slowest]
        if len(here) <= 1:
            break
        best = None  # (the pair's new max, the receiver's new time, expert rows moved, e, q, f)
        for e in here:
            out = float(expert_rows[e]) * seconds_per_row[slowest]
            for q in range(W):
                if q == slowest:
                    continue
                into = float(expert_rows[e]) * seconds_per_row[q]
                cands = [(None, t[slowest] - out, t[q] + into)]
                for f in (f for f in range(E) if new[f] == q and expert_rows[f] < expert_rows[e]):
                    back = float(expert_rows[f])
                    cands.append((f, t[slowest] - out + back * seconds_per_row[slowest],
                                  t[q] + into - back * seconds_per_row[q]))
                for f, ts, tq in cands:
                    key = (max(ts, tq), tq, float(expert_rows[e]), e, q, -1 if f is None else f)
                    if best is None or key < best[0]:
                        best = (key, e, q, f, ts, tq)
        if best is None or best[0][0] > t[slowest] * (1.0 - min_gain):
            break
        _, e, q, f, ts, tq = best
        new[e] = q
        if f is not None:
            new[f] = slowest
        t[slowest], t[q] = ts, tq
    return new
