"""Page-fault degradation: what the layer does when an expert's weights are not there in time.

Three levels, each counted (:class:`DegradeCounters`) and reported by the pager's ``stats()``:

- **L1 (always):** a fault waits for the asynchronous load that the gate's output already
  started. Opt-in ``reuse_stale=True``: instead of waiting, the expert's tokens get its
  previous output (the mean of the rows it produced the last time it ran, one ``[D]`` vector per
  expert, kept by :class:`StaleOutputs`), the way the seed layer did; the load keeps going, so
  the next step finds the expert resident.
- **L2 (always):** ``pin_after`` (default 3) consecutive faulting steps of one expert pin it
  resident; the pager never evicts a pinned expert. When the pinned set would exceed
  ``max_pinned_fraction`` of the budget the expert is put on ``migration_requests`` instead, for
  the balancer to move it to a rank with room.
- **L3 (opt-in ``substitute=True``):** stand in the most similar *resident* expert, by cosine
  similarity of the flattened weights (:func:`most_similar`), and log every substitution.

A "fault" here is an expert computation that would have had to wait: an expert whose load was
started at gate time and landed before its turn is a hit (that is what prefetch is for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import torch

from hetcomm.errors import ConfigError

__all__ = ["DegradeConfig", "DegradeCounters", "StaleOutputs", "most_similar", "flat_weights"]

log = logging.getLogger("hetcomm.moe.degrade")


@dataclass(frozen=True)
class DegradeConfig:
    """Knobs of the three degradation levels.

    Attributes:
        reuse_stale: L1 opt-in: serve a faulting expert's tokens with its previous output
            instead of waiting (approximate; default off because it changes the math).
        pin_after: L2: consecutive faulting steps that pin an expert resident (0 disables L2).
        max_pinned_fraction: L2: at most this fraction of the budget's slots may be pinned;
            beyond it the expert becomes a migration request.
        substitute: L3 opt-in: run the most similar resident expert in place of a faulting one.
        similarity_refresh_steps: L3: steps between recomputations of the cosine matrix (the
            weights drift slowly; recomputing every step would cost a full pass over all experts).
    """

    reuse_stale: bool = False
    pin_after: int = 3
    max_pinned_fraction: float = 0.5
    substitute: bool = False
    similarity_refresh_steps: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.pin_after, bool) or not isinstance(self.pin_after, int) or self.pin_after < 0:
            raise ConfigError(f"must be a whole number >= 0, got {self.pin_after!r}", key="paging.degrade.pin_after")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError(
                f"must be within [0, 1], got {self.max_pinned_fraction!r}", key="paging.degrade.max_pinned_fraction"
            )
        if self.similarity_refresh_steps < 1:
            raise ConfigError(
                f"must be >= 1, got {self.similarity_refresh_steps!r}", key="paging.degrade.similarity_refresh_steps"
            )
        if self.reuse_stale and self.substitute:
            raise ConfigError(
                "reuse_stale (L1) and substitute (L3) both answer a fault; enable one of them",
                key="paging.degrade.substitute",
            )


@dataclass
class DegradeCounters:
    """How often each level acted (cumulative; ``as_dict()`` for reports)."""

    l1_waits: int = 0            # faults that waited for their load
    l1_stale: int = 0            # faults served with the previous output (opt-in)
    l2_pins: int = 0             # experts pinned after consecutive faults
    l2_migration_requests: int = 0  # experts that should have been pinned but the budget was full
    l3_substitutions: int = 0    # faults served by the most similar resident expert (opt-in)
    substitutions: List[tuple] = field(default_factory=list)  # (step, expert, stand-in, cosine), last 100

    def as_dict(self) -> Dict[str, int]:
        return {
            "l1_waits": self.l1_waits,
            "l1_stale": self.l1_stale,
            "l2_pins": self.l2_pins,
            "l2_migration_requests": self.l2_migration_requests,
            "l3_substitutions": self.l3_substitutions,
        }


class StaleOutputs:
    """The last output of every expert, as one ``[D]`` mean row (L1's opt-in answer to a fault).

    One row per expert, not the full ``[N, D]`` output: token counts change from step to step, so
    rows cannot be matched token by token, and the mean is what a stale expert can honestly offer.
    """

    def __init__(self, num_experts: int) -> None:
        self._rows: Dict[int, torch.Tensor] = {}
        self.num_experts = num_experts

    def record(self, expert: int, output: torch.Tensor) -> None:
        """Remember ``output`` (``[N, D]``, any float dtype) of ``expert``; N = 0 is ignored."""
        if output.shape[0] > 0:
            self._rows[expert] = output.detach().float().mean(dim=0)

    def has(self, expert: int) -> bool:
        return expert in self._rows

    def output(self, expert: int, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """``[num_rows, D]`` in ``like``'s dtype and device: the expert's last mean output row."""
        row = self._rows[expert].to(device=like.device, dtype=like.dtype)
        return row.unsqueeze(0).expand(num_rows, -1).clone()


def flat_weights(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """All of one expert's parameters as one float32 vector ``[P]`` on their device."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def most_similar(candidates: torch.Tensor, target: torch.Tensor) -> "tuple[int, float]":
    """Row of ``candidates`` (``[C, P]`` float32) with the largest cosine to ``target`` (``[P]``).

    Returns:
        (row index, cosine).
    """
    if candidates.shape[0] == 0:
        raise ConfigError("no resident expert to stand in", key="paging.degrade.substitute")
    sims = torch.nn.functional.cosine_similarity(candidates, target.unsqueeze(0).to(candidates.device), dim=1)
    best = int(torch.argmax(sims))
    return best, float(sims[best])


def log_substitution(counters: DegradeCounters, step: int, expert: int, stand_in: int, cosine: float) -> None:
    """Count and log one L3 substitution (every one is logged: it changes the model's output)."""
    counters.l3_substitutions += 1
    counters.substitutions.append((step, expert, stand_in, cosine))
    del counters.substitutions[:-100]
    log.warning("hetcomm paging L3: step %d expert %d not resident in time; expert %d (cosine %.3f) stood in",
                step, expert, stand_in, cosine)
