"""How much of a rank's busy time its expert FFNs take: forward and backward, measured.

The summary's ``per-rank MoE time max/mean`` row times the experts' *forward* only (the layer's
``expert_s``); whether a job is compute-dominated -- whether moving expert work between unequal
ranks can shorten a step at all -- needs the backward too, and the rest of what the rank
computes. :class:`ExpertCpuClock` measures both in one unit, CPU seconds:

- **expert**: the thread CPU time (``time.thread_time``) inside every expert module's forward
  and backward, by hooks the train loop's expert factory puts on each expert it builds (owned
  experts, replicas, spare slots alike). On CPU ranks the experts run on the calling thread and
  autograd runs their backward on the thread that called ``backward()``, so that thread's clock
  is their compute. Intervals that overlap (autograd may start one expert's backward before the
  previous one's input gradient is done) count once: the clock is open while any expert is.
- **busy**: the process's CPU time (``time.process_time``: every thread -- executor, gloo,
  heartbeat -- all under the rank's one CPU budget).

Under ``hetcomm emulate --compute`` a rank's CPU seconds are its quota's share of wall time, so
the ratio of the two is the experts' share of the rank's busy wall time as well. Steps in the
first tenth (allocation, first agreements) are left out. On CUDA/NPU the host clocks would not
see the device's work; the train loop runs its ranks on CPU.
"""

from __future__ import annotations

import threading
import time
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

__all__ = ["ExpertCpuClock", "parse_shares"]


class ExpertCpuClock:
    """Per-step CPU seconds of this rank's expert FFNs (forward + backward) and of its process."""

    def __init__(self) -> None:
        self.thread_id = threading.get_ident()
        self._depth = 0
        self._t0 = 0.0
        self._expert_s = 0.0
        self._process_s = time.process_time()
        #: ``[(expert CPU s, process CPU s)]`` per ended step.
        self.per_step: List[Tuple[float, float]] = []

    # -- hooks --------------------------------------------------------------------------------
    def instrument(self, module: torch.nn.Module) -> torch.nn.Module:
        """Put the timing hooks on ``module`` (an expert) and return it."""
        module.register_forward_pre_hook(lambda _m, _a: self._enter())
        module.register_forward_hook(lambda _m, _a, _o: self._leave())
        module.register_full_backward_pre_hook(lambda _m, _g: self._enter())
        module.register_full_backward_hook(lambda _m, _gi, _go: self._leave())
        return module

    def _enter(self) -> None:
        if threading.get_ident() != self.thread_id:
            return
        if self._depth == 0:
            self._t0 = time.thread_time()
        self._depth += 1

    def _leave(self) -> None:
        if threading.get_ident() != self.thread_id or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._expert_s += time.thread_time() - self._t0

    # -- per step -----------------------------------------------------------------------------
    def end_step(self) -> None:
        """Close the step: its expert and process CPU seconds (an interval left open -- a hook
        that never fired -- is dropped, not carried)."""
        now = time.process_time()
        self.per_step.append((self._expert_s, now - self._process_s))
        self._expert_s, self._process_s, self._depth = 0.0, now, 0

    def gather(self, world_size: int) -> List[List[Tuple[float, float]]]:
        """``[W][steps]`` of ``(expert_s, process_s)`` (collective: every rank once, after the
        last step, with the same number of steps)."""
        mine = torch.tensor(self.per_step, dtype=torch.float64).reshape(-1, 2)  # host: a few numbers per step
        if world_size > 1 and dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(parts, mine)
        else:
            parts = [mine]
        return [[(float(a), float(b)) for a, b in p.tolist()] for p in parts]

    @staticmethod
    def summary(table: List[List[Tuple[float, float]]]) -> str:
        """``E0/E1/.. % of busy CPU (expert e0/.. ms, busy b0/.. ms per step)``: per rank, the
        expert seconds over the process seconds summed over steps after the first tenth."""
        if not table or not table[0]:
            return "no steps"
        n = len(table[0])
        skip = min(n - 1, max(1, n // 10))
        expert = [sum(a for a, _ in rows[skip:]) / (n - skip) for rows in table]
        busy = [sum(b for _, b in rows[skip:]) / (n - skip) for rows in table]
        share = "/".join(f"{e / b * 100:.0f}" if b > 0 else "-" for e, b in zip(expert, busy))
        return (f"{share} % of busy CPU by rank (expert {'/'.join(f'{e * 1e3:.1f}' for e in expert)} ms, "
                f"busy {'/'.join(f'{b * 1e3:.1f}' for b in busy)} ms CPU per step, steps {skip + 1}-{n})")


def parse_shares(row: str) -> List[Any]:
    """The per-rank percentages of a :meth:`ExpertCpuClock.summary` row (None where ``-``)."""
    head = row.split("%", 1)[0].strip()
    return [None if v == "-" else float(v) for v in head.split("/")] if head and head != "no steps" else []
