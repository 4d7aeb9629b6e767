"""Routing metrics: how skewed the load is, how much overflowed, how much stayed local.

Definitions (all over token *copies*, i.e. ``k`` per token):
    top5_share           share of picks taken by the 5 most-picked experts
    min_expert_rate      share of picks of the least-picked expert (0.0 = an idle expert)
    overflow_rate        copies dropped by the capacity limit / all copies
    local_fraction       kept copies computed on the rank that routed them (own experts plus
                         local replicas) / all kept copies
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

import torch

__all__ = ["RoutingMetrics", "MetricsAccumulator", "routing_metrics"]


@dataclass(frozen=True)
class RoutingMetrics:
    """Metrics of one step or of a window of steps (see module docstring).

    Attributes:
        num_copies: token copies routed (``tokens * k``).
        num_dropped: copies dropped by capacity.
        top5_share: in ``[0, 1]``.
        min_expert_rate: in ``[0, 1]``.
        overflow_rate: in ``[0, 1]``.
        local_fraction: in ``[0, 1]``.
    """

    num_copies: int
    num_dropped: int
    top5_share: float
    min_expert_rate: float
    overflow_rate: float
    local_fraction: float

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def routing_metrics(
    picks: torch.Tensor, num_dropped: int, num_local: int, num_kept: Optional[int] = None
) -> RoutingMetrics:
    """Compute :class:`RoutingMetrics`.

    Args:
        picks: ``[E]`` picks per expert (dropped included).
        num_dropped: copies dropped.
        num_local: kept copies computed locally.
        num_kept: kept copies (default ``picks.sum() - num_dropped``).
    """
    picks = picks.double()
    total = float(picks.sum())
    kept = int(total - num_dropped) if num_kept is None else num_kept
    if total <= 0:
        return RoutingMetrics(0, 0, 0.0, 0.0, 0.0, 0.0)
    top = torch.topk(picks, min(5, picks.numel())).values
    return RoutingMetrics(
        num_copies=int(total),
        num_dropped=int(num_dropped),
        top5_share=float(top.sum() / total),
        min_expert_rate=float(picks.min() / total),
        overflow_rate=float(num_dropped / total),
        local_fraction=float(num_local / kept) if kept > 0 else 0.0,
    )


@dataclass
class MetricsAccumulator:
    """Sums picks, drops and local copies over steps, for windowed metrics.

    Attributes:
        picks: ``[E]`` float64 summed picks (None until the first step).
        num_dropped / num_local / num_kept: summed counts.
        steps: steps accumulated.
    """

    picks: Optional[torch.Tensor] = None
    num_dropped: int = 0
    num_local: int = 0
    num_kept: int = 0
    steps: int = 0

    def add(self, picks: torch.Tensor, num_dropped: int, num_local: int, num_kept: int) -> None:
        p = picks.double()
        self.picks = p.clone() if self.picks is None else self.picks + p
        self.num_dropped += int(num_dropped)
        self.num_local += int(num_local)
        self.num_kept += int(num_kept)
        self.steps += 1

    def metrics(self) -> RoutingMetrics:
        if self.picks is None:
            return RoutingMetrics(0, 0, 0.0, 0.0, 0.0, 0.0)
        return routing_metrics(self.picks, self.num_dropped, self.num_local, self.num_kept)

    def reset(self) -> None:
        self.picks = None
        self.num_dropped = self.num_local = self.num_kept = self.steps = 0
