"""A :class:`hetcomm.moe.MoELayer`'s one load observer: each training forward's global load
statistics, summed over the layer's group in one all-reduce, and the subscribers they go to.

The vector is ``[probs (E), picks (E), tokens (1)]`` float64, plus the balancer's fast signal
(``[E]``) when a subscriber asked for it, plus the speed agreement's ``[W, 7]`` table at the
forwards it is due (:meth:`~hetcomm.moe.speed.SpeedMeter.agreement_row`) and the per-step
split's ``[W, E + 1]`` count table when the split runs (both ride in the same all-reduce and are
cut off before delivery). It is
launched after routing and awaited after the experts, so the all-reduce hides behind them;
then the gate's calibrator, the replicator and every subscriber
(:meth:`~hetcomm.moe.MoELayer.add_load_observer`) read the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from hetcomm.errors import ConfigError

__all__ = ["LoadObserver", "PendingLoad"]


@dataclass
class PendingLoad:
    """One forward's launched all-reduce: ``vec`` (the statistics, summed once ``work`` is
    waited for; ``work`` None when it already is) and where its parts start."""

    vec: torch.Tensor
    work: Any
    num_experts: int
    fast: bool
    num_stats: int  # elements of the statistics at the head of ``vec``
    speed_rows: int = 0  # elements of the speed agreement's rows after the statistics
    speed_table: Optional[torch.Tensor] = None  # those rows summed over the group (after deliver)


class LoadObserver:
    """The subscribers of a layer's global load statistics and the all-reduce that feeds them.

    Attributes:
        observers: ``f(global_picks, global_probs, num_tokens, global_fast)`` callables.
        fast_topk: the top-k of the fast signal a subscriber asked for, or None.
    """

    def __init__(self) -> None:
        self.observers: List[Callable[..., None]] = []
        self.fast_topk: Optional[int] = None

    def add(self, observer: Callable[..., None], fast_topk: Optional[int] = None) -> None:
        """Subscribe ``observer(global_picks, global_probs, num_tokens, global_fast)``, called
        after every training forward (:meth:`~hetcomm.moe.MoELayer.add_load_observer`) with
        ``global_picks`` ``[E]`` float64 picks per expert summed over the group, dropped ones
        included; ``global_probs`` ``[E]`` float64 summed router probabilities; ``num_tokens``
        the group's tokens; ``global_fast`` ``[E]`` float64 the summed ``fast_signal`` of the
        router's log probabilities over their top ``fast_topk``, or None when no subscriber
        asked for it. The calibrator and the replicator read the same numbers.

        Raises:
            ConfigError: another subscriber asked for the fast signal over another top-k
                (``key='moe.load_observer'``).
        """
        if fast_topk is not None:
            if self.fast_topk and self.fast_topk != fast_topk:
                raise ConfigError(
                    f"the layer's load observer already computes the fast signal over the top {self.fast_topk}; "
                    f"got another observer asking for {fast_topk}",
                    key="moe.load_observer",
                )
            self.fast_topk = int(fast_topk)
        self.observers.append(observer)

    def launch(self, probs: torch.Tensor, picks: torch.Tensor, num_tokens: int, group: Any, distributed: bool,
               split_row: Optional[torch.Tensor] = None, world_size: int = 1,
               speed_row: Optional[torch.Tensor] = None) -> Tuple[PendingLoad, Optional[list]]:
        """Start this forward's all-reduce.

        Args:
            probs: ``[T, E]`` float32 router probabilities (detached here).
            picks: ``[E]`` int64 copies routed to each expert by this rank, dropped ones included.
            num_tokens: ``T``.
            group: the layer's process group; ``distributed``: whether it has more than one rank.
            split_row: the per-step split's ``[W, E + 1]`` count-table row of this rank
                (:meth:`~hetcomm.moe.token_split.TokenSplitter.table_row`), or None. With it the
                all-reduce blocks (the split needs its table before the dispatch).
            world_size: ``W`` (shapes the split's table).
            speed_row: this rank's row of the speed agreement
                (:meth:`~hetcomm.moe.speed.SpeedMeter.agreement_row`), or None; summed here, it is
                :attr:`PendingLoad.speed_table` once delivered.
        Returns:
            The pending statistics, and the split's summed table (``[W][E + 1]`` lists) or None.
        """
        E = picks.numel()
        parts = [probs.detach().sum(0).double(), picks.double(),
                 torch.tensor([float(num_tokens)], dtype=torch.float64, device=probs.device)]
        if self.fast_topk:  # the balancer's fast timescale (add_load_observer(fast_topk=...))
            from hetcomm.moe.placement.balancer import fast_signal

            parts.append(fast_signal(torch.log(probs.detach().clamp_min(1e-30)), self.fast_topk).to(torch.float64))
        n_stat = sum(int(p.numel()) for p in parts)
        if speed_row is not None:  # the speed agreement rides along: no collective of its own
            parts.append(speed_row.to(probs.device))
        if split_row is not None:  # the split's [W, E + 1] count table rides in the same all-reduce
            parts.append(split_row.reshape(-1))
        vec = torch.cat(parts)
        work = None
        if distributed:
            # Blocking when the split needs its table before the dispatch (one small collective
            # instead of two: a checked hetcomm all-reduce costs ~3x gloo's at this size).
            work = dist.all_reduce(vec, group=group, async_op=split_row is None)
        table = None
        n_speed = int(speed_row.numel()) if speed_row is not None else 0
        if split_row is not None:
            table = vec[n_stat + n_speed:].view(world_size, E + 1).tolist()
        return PendingLoad(vec, work, E, bool(self.fast_topk), n_stat, speed_rows=n_speed), table

    def deliver(self, pending: PendingLoad, calibrator: Any, replicator: Any, row_bytes: int) -> torch.Tensor:
        """Wait for the all-reduce and hand the sums to the calibrator, the replicator (rows of
        ``row_bytes``) and every subscriber. Returns ``[E]`` float64 global picks."""
        if pending.work is not None:
            pending.work.wait()
        vec, E = pending.vec, pending.num_experts
        n_stat = pending.num_stats
        if pending.speed_rows:
            pending.speed_table = vec[n_stat:n_stat + pending.speed_rows]
        vec = vec[:n_stat]
        gp, gpicks, gT = vec[:E], vec[E : 2 * E], float(vec[2 * E])
        if calibrator is not None:
            calibrator.update(gp, gT)
        if replicator is not None:
            replicator.observe(gpicks, row_bytes=row_bytes)
        gfast = vec[2 * E + 1 :] if pending.fast else None
        for observer in self.observers:
            observer(gpicks, gp, gT, gfast)
        return gpicks
