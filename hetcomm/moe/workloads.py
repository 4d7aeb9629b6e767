"""Eight skew workloads W0-W7 and the exact time-balanced oracle.

After Megatron-Core's runtime token-imbalance benchmark (NVIDIA/Megatron-LM PR #7488, from the
MoE roadmap #6757): each workload is derived from ``(workload, seed, step)`` alone, so the same
logical routing is reproduced whatever the placement, and every row carries exactly ``k``
distinct experts. Each isolates one variable (the PR's table); the parameters below are ours (the
PR's text in the store names the workloads and what they isolate, not their constants):

| id | name | routing of one step |
|---|---|---|
| W0 | balanced | row ``t`` of rank ``s``: experts ``(s*T + t + j*E/k) mod E``: every expert the same count |
| W1 | hot_set | a hot set of ``E/8`` experts (drawn from the seed) takes 50% of the picks |
| W2 | hot_rank | the same heat on one rank's contiguous experts (the rank drawn from the seed) |
| W3 | spread | the same heat spread: one hot expert per rank |
| W4 | source_ragged | uniform experts, tokens per source rank from 0.25x to 1.75x the mean |
| W5 | zero_load_rank | one rank's experts get no picks (uniform over the others) |
| W6 | rotating_hotspot | W1's heat on a hot set that moves by ``E/8`` experts every 4 steps |
| W7 | burst | balanced, except every 8th step: one expert takes 50% of the picks |

Sampling: ``k`` distinct experts per row, without replacement, by ``torch.multinomial`` on a
generator seeded from ``(workload, seed, step, source rank)``.

**Oracle** (:func:`oracle_makespan`): for one step's global counts ``N_e``, the ranks holding a
copy of each expert and the ranks' speeds, the least possible makespan of any split of the rows
over the copies, fractional rows allowed -- the LP ``min T`` s.t. ``sum_h x_eh = N_e``,
``sum_e x_eh <= T * s_h``, ``x >= 0``. Solved with ``scipy.optimize.linprog`` (HiGHS) when scipy is
importable; otherwise by bisection on ``T`` with a real-valued max-flow feasibility test (the
same LP, solved to 1e-9 relative; scipy is not a dependency of hetcomm and the graph is tiny).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from hetcomm.errors import ConfigError

__all__ = ["WORKLOADS", "WorkloadSpec", "workload_routing", "global_counts", "oracle_makespan", "resolve_workload"]

WORKLOADS: Tuple[str, ...] = (
    "W0_balanced",
    "W1_hot_set",
    "W2_hot_rank",
    "W3_spread",
    "W4_source_ragged",
    "W5_zero_load_rank",
    "W6_rotating_hotspot",
    "W7_burst",
)

HOT_SHARE = 0.5


def resolve_workload(name: str) -> str:
    """``W3``, ``w3``, ``spread`` or ``W3_spread`` -> ``W3_spread``; ConfigError otherwise."""
    key = name.strip().lower()
    for w in WORKLOADS:
        if key in (w.lower(), w.split("_", 1)[0].lower(), w.split("_", 1)[1].lower()):
            return w
    raise ConfigError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}", key="workload")


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of a workload: ``num_experts`` over ``world_size`` ranks (contiguous blocks decide
    which experts are "one rank's" for W2/W3/W5), ``num_tokens`` per rank (mean), ``k``."""

    num_experts: int
    world_size: int
    num_tokens: int
    k: int = 2

    def block(self, rank: int) -> List[int]:
        E, W = self.num_experts, self.world_size
        return list(range(rank * E // W, (rank + 1) * E // W))


def _gen(workload: str, seed: int, step: int, rank: int) -> torch.Generator:
    key = f"{workload}/{seed}/{step}/{rank}".encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def _hot_weights(E: int, hot: Sequence[int]) -> torch.Tensor:
    """Sampling weights giving ``hot`` HOT_SHARE of the picks (of the first choice's mass)."""
    w = torch.ones(E, dtype=torch.float64, device="cpu")  # host: workloads are generated on the host
    cold = E - len(hot)
    if hot and cold:
        w[list(hot)] = HOT_SHARE / len(hot) * cold / (1 - HOT_SHARE)
    return w


def workload_routing(workload: str, spec: WorkloadSpec, seed: int, step: int, rank: int) -> torch.Tensor:
    """``[T_rank, k]`` int64 (host) expert ids of rank ``rank``'s tokens at ``step``: ``k``
    distinct experts per row, a pure function of ``(workload, seed, step, rank)`` and ``spec``."""
    workload = resolve_workload(workload)
    E, W, T, k = spec.num_experts, spec.world_size, spec.num_tokens, spec.k
    if k > E:
        raise ConfigError(f"k={k} exceeds num_experts={E}", key="workload.k")
    g0 = _gen(workload, seed, -1, -1)  # per-workload constants: the hot set, the hot rank
    nhot = max(1, E // 8)
    hot_set = torch.randperm(E, generator=g0, device="cpu")[:nhot].tolist()
    hot_rank = int(torch.randint(W, (1,), generator=g0, device="cpu"))
    g = _gen(workload, seed, step, rank)
    n = T
    weights: Optional[torch.Tensor] = torch.ones(E, dtype=torch.float64, device="cpu")
    if workload in ("W0_balanced",) or (workload == "W7_burst" and step % 8 != 7):
        t = torch.arange(T, dtype=torch.int64, device="cpu").unsqueeze(1) + rank * T
        j = torch.arange(k, dtype=torch.int64, device="cpu").unsqueeze(0) * max(1, E // k)
        return (t + j) % E
    if workload == "W1_hot_set":
        weights = _hot_weights(E, hot_set)
    elif workload == "W2_hot_rank":
        weights = _hot_weights(E, spec.block(hot_rank)[:nhot])
    elif workload == "W3_spread":
        # The same number of hot experts, dealt one per rank in turn (the i-th of rank i % W).
        weights = _hot_weights(E, [spec.block(i % W)[(i // W) % len(spec.block(i % W))] for i in range(nhot)])
    elif workload == "W4_source_ragged":
        n = int(round(T * (0.25 + 1.5 * rank / max(1, W - 1)))) if W > 1 else T
    elif workload == "W5_zero_load_rank":
        weights[spec.block(hot_rank)] = 0.0
        if int((weights > 0).sum()) < k:
            raise ConfigError(f"W5 leaves fewer than k={k} experts with load", key="workload")
    elif workload == "W6_rotating_hotspot":
        shift = (step // 4) * nhot
        weights = _hot_weights(E, [(e + shift) % E for e in hot_set])
    elif workload == "W7_burst":
        weights = _hot_weights(E, [hot_set[0]])
    if n == 0:
        return torch.zeros(0, k, dtype=torch.int64, device="cpu")
    return torch.multinomial(weights.expand(n, E), k, replacement=False, generator=g)


def global_counts(workload: str, spec: WorkloadSpec, seed: int, step: int) -> List[List[int]]:
    """``[W][E]`` picks per (source rank, expert) of one step."""
    out = []
    for r in range(spec.world_size):
        idx = workload_routing(workload, spec, seed, step, r)
        out.append(torch.bincount(idx.reshape(-1), minlength=spec.num_experts).tolist())
    return out


def _feasible_fractional(T: float, total: Sequence[float], holders: Sequence[Sequence[int]], speeds: Sequence[float]) -> bool:
    """Can every expert's rows be spread over its holders with rank ``r`` doing at most
    ``T * speeds[r]``? A real-valued max-flow on source -> experts -> ranks -> sink."""
    from hetcomm.moe.token_split import max_flow

    E, W = len(total), len(speeds)
    src, sink = 0, E + W + 1
    need = float(sum(total))
    edges = [(src, 1 + e, float(total[e])) for e in range(E)]
    edges += [(1 + e, 1 + E + h, float(total[e])) for e in range(E) for h in holders[e]]
    edges += [(1 + E + r, sink, T * speeds[r]) for r in range(W)]
    value, _ = max_flow(E + W + 2, edges, src, sink, eps=1e-12 * max(1.0, need))
    return value >= need * (1 - 1e-9)


def oracle_makespan(
    total: Sequence[float], holders: Mapping[int, Sequence[int]], owner: Sequence[int], speeds: Sequence[float]
) -> Tuple[float, str]:
    """The least makespan of one step (fractional rows): ``(T*, solver)``.

    Args:
        total: ``[E]`` rows of each expert (all sources).
        holders: expert -> ranks with a copy; an expert absent is held by ``owner[e]`` only.
        owner: ``[E]`` owners.
        speeds: ``[W]`` rows per unit time.
    Returns:
        ``T*`` and ``"scipy-highs"`` or ``"bisection-maxflow"``.
    """
    E, W = len(total), len(speeds)
    hs = [sorted(set(holders.get(e, (owner[e],))) | {owner[e]}) for e in range(E)]
    try:
        from scipy.optimize import linprog  # optional: the independent check
    except ImportError:
        linprog = None
    if linprog is not None:
        var: Dict[Tuple[int, int], int] = {}
        for e in range(E):
            for h in hs[e]:
                var[(e, h)] = len(var)
        nv = len(var) + 1  # last variable: T
        c = [0.0] * nv
        c[-1] = 1.0
        A_eq, b_eq = [], []
        for e in range(E):
            row = [0.0] * nv
            for h in hs[e]:
                row[var[(e, h)]] = 1.0
            A_eq.append(row)
            b_eq.append(float(total[e]))
        A_ub, b_ub = [], []
        for r in range(W):
            row = [0.0] * nv
            for (e, h), i in var.items():
                if h == r:
                    row[i] = 1.0
            row[-1] = -float(speeds[r])
            A_ub.append(row)
            b_ub.append(0.0)
        res = linprog(c, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=b_eq, bounds=[(0, None)] * nv, method="highs")
        if res.status == 0:
            return float(res.x[-1]), "scipy-highs"
    lo = sum(total) / sum(speeds) * (1 - 1e-12)
    hi = max(sum(total[e] for e in range(E) if owner[e] == r) / speeds[r] for r in range(W))
    for _ in range(200):
        if hi - lo <= 1e-10 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if _feasible_fractional(mid, total, hs, speeds):
            hi = mid
        else:
            lo = mid
    return hi, "bisection-maxflow"
