"""The paged expert store (``page_budget > 0``): a :class:`hetcomm.moe.MoELayer`'s local
experts kept in a host pool and a device working set by an
:class:`~hetcomm.moe.paging.ExpertPager`: the pager's lifetime, the experts run over it
(resident first, faults as their loads land, waves when a step's experts do not fit) and its
per-step statistics.

See ``docs/MOE.md`` ("Paging in the layer"), :mod:`hetcomm.moe.expert_store` for the interface
and :mod:`hetcomm.moe.paging` for the pager.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from hetcomm.backends import tokens as token_dispatch
from hetcomm.errors import ConfigError
from hetcomm.moe.expert_store import ExpertOutput, ResidentExperts
from hetcomm.moe.experts import cat_rows, split_rows
from hetcomm.moe.overlap import PipelineTimes
from hetcomm.moe.paging import ExpertPager, Grant, PagingConfig

__all__ = ["PagedExperts"]


class _StreamedExpert(torch.autograd.Function):
    """One paged expert in a step whose experts do not all fit the budget (a *wave* step).

    Forward runs the expert without keeping its weights (its slot may go to the next expert);
    backward acquires it again from the pager (a reload when it was evicted meanwhile),
    recomputes its output with autograd on and returns the gradients of the rows and of its
    parameters, so they land on the paged copy. Backward runs in reverse order, so the experts
    computed last, still resident, go first. Experts must be deterministic (no dropout): the
    recomputation must give the forward's output.

    ``rows``: ``[N, D]``; returns ``[N, D]``, same dtype.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, pager: ExpertPager, e: int, module: nn.Module, *params):  # type: ignore[override]
        ctx.pager, ctx.e, ctx.module = pager, e, module
        ctx.save_for_backward(rows)
        return module(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        ctx.pager.acquire(ctx.e)
        try:
            params = [p for p in ctx.module.parameters() if p.requires_grad]
            with torch.enable_grad():
                x = rows.detach().requires_grad_(ctx.needs_input_grad[0])
                y = ctx.module(x)
                inputs = ([x] if ctx.needs_input_grad[0] else []) + params
                grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
        finally:
            ctx.pager.release(ctx.e)
        gx = grads[0] if ctx.needs_input_grad[0] else None
        return (gx, None, None, None) + tuple(grads[1 if ctx.needs_input_grad[0] else 0 :])


class PagedExperts(ResidentExperts):
    """This rank's experts over an :class:`~hetcomm.moe.paging.ExpertPager` (``page_budget >
    0``). The pager is built at the first forward, on the input's device, over the experts in
    dispatch order (ascending global id); a placement change drops it and the next forward
    builds another. Until then (and on a rank without experts) the experts run as resident.

    Args:
        experts: the local experts, in local order; ``ids`` their global ids.
        page_budget: fraction of the local experts kept on the device, in ``(0, 1]``.
        paging: the pager's other knobs (its ``budget_fraction`` is replaced), or None.
        rank: this rank in the layer's group (error messages).
        peak_flops: this rank's device's dense FLOP/s (the "can the copies hide" rule).
    Raises:
        ConfigError: the budget holds none of this rank's experts (``key='moe.page_budget'``).
    """

    def __init__(self, experts: Sequence[nn.Module], ids: Sequence[int], page_budget: float,
                 paging: Optional[PagingConfig], *, rank: int, peak_flops: float) -> None:
        super().__init__(experts, ids)
        self.page_budget = float(page_budget)
        self.paging = paging
        self.rank = rank
        self.peak_flops = peak_flops
        self._pager: Optional[ExpertPager] = None
        self._page_optimizer: Optional[torch.optim.Optimizer] = None
        self._page_open = False            # a step began and end_step has not closed it
        self._page_mark: Dict[str, float] = {}
        self._page_retired: Dict[str, float] = {}  # counters of pagers replaced by a placement change
        self._page_last: Dict[str, Any] = {}
        self._h2d_bytes_per_s: Optional[float] = None  # measured when a pager is built on a device
        # A budget that holds no expert of this rank is a configuration error (now, not at
        # the first forward).
        L = len(self.ids)
        if L and int(page_budget * L + 1e-9) < 1:
            raise ConfigError(
                f"page_budget {page_budget} of rank {rank}'s {L} local experts holds no expert on the device; "
                f"raise it to at least {1 / L:.3f}",
                key="moe.page_budget",
            )

    @property
    def pager(self) -> Optional[ExpertPager]:
        return self._pager

    def _ensure_pager(self, device: torch.device) -> Optional[ExpertPager]:
        if self._pager is None and len(self.experts):
            # At least one slot: checked at construction, and kept when a migration leaves this
            # rank fewer experts than the budget holds one of (a running job must not stop there).
            budget = min(1.0, max(self.page_budget, 1.0 / len(self.experts)))
            pcfg = replace(self.paging or PagingConfig(), budget_fraction=budget)
            self._pager = ExpertPager(self.modules_by_id(), pcfg, device=device, optimizer=self._page_optimizer)
            self._page_mark = self._page_counters()
            if self._h2d_bytes_per_s is None:
                from hetcomm.moe.paging_rule import measure_h2d_bytes_per_s

                self._h2d_bytes_per_s = measure_h2d_bytes_per_s(device)
        return self._pager

    # -- one forward -------------------------------------------------------------------------
    def begin_forward(self, device: torch.device) -> None:
        self.end_step()  # the previous step's, when the loop did not close it
        self._ensure_pager(device)

    def sync(self) -> None:
        """Wait for every page transfer in flight. No-op before the pager is built."""
        if self._pager is not None:
            self._pager.sync()

    def prefetch_own(self, send_counts: torch.Tensor) -> None:
        """Page in the experts this rank's own tokens go to (sure to be used) before the count
        exchange tells what the other ranks send. Only into free slots: an eviction here could
        push out an expert the other ranks route to, which the counts would have said a moment
        later."""
        pager = self._pager
        if pager is None:
            return
        free = pager.free_slots()
        own = send_counts[list(self.sorted_ids())].tolist()
        for l, n in enumerate(own):
            if not free:
                break
            if n and pager.slot_of[l] is None and pager.prefetch(l):
                free -= 1

    def dispatch_modules(self, extra: Sequence[nn.Module]) -> List[nn.Module]:
        # Over the pager the rows arrive as one block: the pager decides the experts' order.
        return [] if self._pager is not None else super().dispatch_modules(extra)

    def compute(self, res: token_dispatch.DispatchResult, mods: Sequence[nn.Module], times: PipelineTimes,
                speed: Any, device: torch.device) -> ExpertOutput:
        if self._pager is None:
            return super().compute(res, mods, times, speed, device)
        return self._paged_experts(res.recv_x, res.recv_counts, res.handle, res.work, times, speed)

    def backward_callback(self) -> Optional[Callable[[], None]]:
        # Backward of a wave step evicts experts with write-backs in flight, whose host copies
        # the optimizer step then updates: land them first.
        if self._pager is not None and self._page_last.get("page_waves"):
            return self._pager.sync
        return None

    def step_stats(self, rows_per_expert: Sequence[int]) -> Dict[str, Any]:
        return {**self._page_step_stats(), **self._page_hide_stats(rows_per_expert)}

    def adopt(self, modules: Sequence[nn.Module], ids: Sequence[int]) -> None:
        self._drop_pager()  # its slots index the old local experts; the next forward builds one
        super().adopt(modules, ids)

    def _page_hide_stats(self, rows_per_expert: Sequence[int]) -> Dict[str, Any]:
        """Can paging's copies hide behind this step's compute (:mod:`hetcomm.moe.paging_rule`)?
        Tokens per used local expert against peak FLOPS / measured host-to-device bandwidth."""
        if self.pager is None:
            return {}
        from hetcomm.moe.paging_rule import copies_can_hide, hide_threshold_tokens

        used = [n for n in rows_per_expert if n]
        tokens = sum(used) / len(used) if used else 0.0
        flops = self.peak_flops
        bw = self._h2d_bytes_per_s
        return {
            "page_can_hide": copies_can_hide(tokens, flops, bw),
            "page_hide_threshold_tokens": hide_threshold_tokens(flops, bw) if bw else None,
        }

    def _page_counters(self) -> Dict[str, float]:
        """The current pager's cumulative counters: transfers and hits, and L1/L2/L3."""
        assert self.pager is not None
        return {**self.pager.stats_total, **self.pager.counters.as_dict()}

    def _drop_pager(self) -> None:
        if self._pager is not None:
            if self._page_open:
                self.end_step()
            self._pager.close()  # waits for write-backs: the modules' weights stay valid views
            for k, v in self._page_counters().items():
                self._page_retired[k] = self._page_retired.get(k, 0) + v
            self._pager = None

    def page_stats(self) -> Dict[str, float]:
        """This rank's pager counters since the layer was built (the pager's ``stats_total``
        keys: ``hits``, ``waits``, ``stall_s``, ``loads``, ``evictions``, ``prefetches``,
        ``reacquires``, ...), summed over the pagers a placement change replaced, plus
        ``slots`` and ``experts`` of the current one."""
        out = dict(self._page_retired)
        if self.pager is not None:
            for k, v in self._page_counters().items():
                out[k] = out.get(k, 0) + v
        out["slots"] = self.pager.num_slots if self.pager is not None else 0
        out["experts"] = len(self.ids)
        return out

    def attach_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Page ``optimizer``'s per-element state of the experts with their weights (Adam's
        moments move with each expert). Call it once the optimizer exists, before its first
        step; without it, a paged layer's optimizer state stays where the optimizer made it,
        which is only correct when host and device are the same memory (CPU)."""
        self._page_optimizer = optimizer
        if self.pager is not None:
            self.pager.optimizer = optimizer

    def end_step(self) -> None:
        """Close the paging step (after ``optimizer.step()``): the pager updates its
        predictor, evicts down to its watermark and starts soft prefetches. The next forward
        calls it when the loop did not; a training loop with more than one forward per
        optimizer step (gradient accumulation) must call it after each ``optimizer.step()``."""
        if self.pager is not None and self._page_open:
            self.pager.end_step()
        self._page_open = False

    def _warm(self, expert_share: torch.Tensor) -> List[int]:
        """Hint the predictor with ``expert_share`` and page in this rank's hottest experts."""
        if not len(self.experts):
            return []
        pager = self._ensure_pager(next(self.experts.parameters()).device)
        assert pager is not None
        ids = self.sorted_ids()
        local = expert_share.detach().to("cpu", torch.float64)[ids]
        pager.hint(local / local.max().clamp_min(1e-12))  # hottest = certain to be used
        warmed = []
        for l in torch.argsort(local, descending=True, stable=True).tolist():
            if local[l] <= 0 or (not pager.resident(l) and not pager.prefetch(l)):
                break  # unused from here on, or no free slot and nothing colder to evict
            warmed.append(ids[l])
        pager.sync()
        return warmed

    def _paged_experts(self, recv_x: torch.Tensor, counts: Sequence[int], handle, work, times: PipelineTimes,
                       speed: Any) -> torch.Tensor:
        """The local experts over the pager: resident experts first, page faults as their
        loads land (loads started when the counts arrived, overlapping the token rows' transfer).

        ``recv_x``: ``[R, D]`` rows grouped by local expert (``counts``); returns ``[R, D]``.
        A training step whose experts do not all fit the budget runs in waves
        (:class:`_StreamedExpert`): the experts stream through the slots and backward pages
        each in again.
        """
        pager = self.pager
        assert pager is not None
        grad = torch.is_grad_enabled()
        used = sum(1 for n in counts if n)
        waves = grad and used > pager.num_slots
        counts_t = torch.tensor(list(counts), dtype=torch.int64, device="cpu")  # host: the pager plans on the host
        order = pager.begin_step(counts_t, hold=grad and not waves)
        self._page_open = True
        self._page_last = {"page_waves": waves, "page_experts_used": used}
        if not sum(counts):
            return recv_x * 0  # keep the rows in the graph (every rank's backward matches)
        pieces = split_rows(recv_x, counts)
        outs: List[torch.Tensor] = list(pieces)
        for c in range(len(handle.chunk_rows)):
            work.wait_chunk(c)
            lo, hi = handle.chunk_experts[c]
            te = time.perf_counter()
            mark = speed.begin(recv_x.device)
            for g in pager.grants([e for e in order if lo <= e < hi]):
                outs[g.requested] = self._run_grant(g, pieces[g.requested], waves)
                pager.release(g.requested)
            speed.end(mark, sum(counts[lo:hi]))
            times.expert_s += time.perf_counter() - te
        return cat_rows(outs)

    def _run_grant(self, g: Grant, rows: torch.Tensor, waves: bool) -> torch.Tensor:
        pager = self.pager
        assert pager is not None
        if g.kind == "stale":  # L1 opt-in: the expert's previous output, no compute
            return pager.stale_output(g.requested, rows.size(0), like=rows)
        module = pager.experts[g.expert]  # g.expert != g.requested: the L3 stand-in
        if waves:
            y = _StreamedExpert.apply(rows, pager, g.expert, module, *[p for p in module.parameters() if p.requires_grad])
        else:
            y = module(rows)
        pager.record_output(g.requested, y.detach())
        return y

    def _page_step_stats(self) -> Dict[str, Any]:
        """This rank's paging counters since the previous forward (see :meth:`step_stats`)."""
        pager = self.pager
        if pager is None:
            return {"page_hits": 0, "page_faults": 0, "page_stall_s": 0.0}  # a rank without experts
        now = self._page_counters()
        d = {k: now[k] - self._page_mark.get(k, 0) for k in now}
        self._page_mark = now
        return {
            "page_hits": int(d["hits"]),
            "page_faults": int(d["waits"]),
            "page_stall_s": float(d["stall_s"] + d["reacquire_stall_s"]),
            "page_loads": int(d["loads"]),
            "page_evictions": int(d["evictions"]),
            "page_prefetches": int(d["prefetches"]),
            "page_reacquires": int(d["reacquires"]),
            "page_resident": len(pager.resident_experts()),
            "page_slots": pager.num_slots,
            # Degradation levels (hetcomm.moe.degrade), this step's share of each.
            "page_l1_waits": int(d["l1_waits"]),
            "page_l1_stale": int(d["l1_stale"]),
            "page_l2_pins": int(d["l2_pins"]),
            "page_l2_migration_requests": int(d["l2_migration_requests"]),
            "page_l3_substitutions": int(d["l3_substitutions"]),
            **self._page_last,
        }

    def take_migration_requests(self) -> List[int]:
        """Global ids of the experts the pager asked to move since the last call (its L2 level:
        an expert that keeps faulting when pinning it would exceed the pin budget,
        :mod:`hetcomm.moe.degrade`)."""
        if self._pager is None or not self._pager.migration_requests:
            return []
        ids = self.sorted_ids()
        out = [ids[l] for l in self._pager.migration_requests]
        self._pager.migration_requests.clear()
        return out
