"""The paged side of :class:`hetcomm.moe.MoELayer` (``page_budget > 0``): the pager's lifetime,
the experts run over it (resident first, faults as their loads land, waves when a step's
experts do not fit) and its per-step statistics. A mixin of the layer: it reads the layer's
``config``, ``experts``, ``pager`` and local expert ids, and nothing else reads it.

See ``docs/MOE.md`` ("Paging in the layer") and :mod:`hetcomm.moe.paging`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from hetcomm.errors import ConfigError
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




class PagedExperts:
    """Paging methods of :class:`~hetcomm.moe.MoELayer` (a mixin; the layer sets the state)."""

    def _check_page_budget(self) -> None:
        """A budget that holds no expert of this rank is a configuration error (now, not at
        the first forward)."""
        L = len(self.local_expert_ids)
        budget = self.config.page_budget
        if budget > 0 and L and int(budget * L + 1e-9) < 1:
            raise ConfigError(
                f"page_budget {budget} of rank {self.rank}'s {L} local experts holds no expert on the device; "
                f"raise it to at least {1 / L:.3f}",
                key="moe.page_budget",
            )

    def _ensure_pager(self, device: torch.device) -> Optional[ExpertPager]:
        if self.pager is None and self.config.page_budget > 0 and len(self.experts):
            # At least one slot: checked at construction, and kept when a migration leaves this
            # rank fewer experts than the budget holds one of (a running job must not stop there).
            budget = min(1.0, max(self.config.page_budget, 1.0 / len(self.experts)))
            pcfg = replace(self.config.paging or PagingConfig(), budget_fraction=budget)
            self.pager = ExpertPager(self._modules_by_id(), pcfg, device=device, optimizer=self._page_optimizer)
            self._page_mark = self._page_counters()
            if self._h2d_bytes_per_s is None:
                from hetcomm.moe.paging_rule import measure_h2d_bytes_per_s

                self._h2d_bytes_per_s = measure_h2d_bytes_per_s(device)
        return self.pager

    def _page_hide_stats(self, rows_per_expert: Sequence[int]) -> Dict[str, Any]:
        """Can paging's copies hide behind this step's compute (:mod:`hetcomm.moe.paging_rule`)?
        Tokens per used local expert against peak FLOPS / measured host-to-device bandwidth."""
        if self.pager is None:
            return {}
        from hetcomm.moe.paging_rule import copies_can_hide, hide_threshold_tokens

        used = [n for n in rows_per_expert if n]
        tokens = sum(used) / len(used) if used else 0.0
        flops = self.rank_tflops[self.rank] * 1e12
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
        if self.pager is not None:
            if self._page_open:
                self.end_page_step()
            self.pager.close()  # waits for write-backs: the modules' weights stay valid views
            for k, v in self._page_counters().items():
                self._page_retired[k] = self._page_retired.get(k, 0) + v
            self.pager = None

    def page_stats(self) -> Dict[str, float]:
        """This rank's pager counters since the layer was built (the pager's ``stats_total``
        keys: ``hits``, ``waits``, ``stall_s``, ``loads``, ``evictions``, ``prefetches``,
        ``reacquires``, ...), summed over the pagers a placement change replaced, plus
        ``slots`` and ``experts`` of the current one. Empty without paging."""
        if self.config.page_budget <= 0:
            return {}
        out = dict(self._page_retired)
        if self.pager is not None:
            for k, v in self._page_counters().items():
                out[k] = out.get(k, 0) + v
        out["slots"] = self.pager.num_slots if self.pager is not None else 0
        out["experts"] = len(self.local_expert_ids)
        return out

    def attach_optimizer(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Page ``optimizer``'s per-element state of the experts with their weights (Adam's
        moments move with each expert). Call it once the optimizer exists, before its first
        step; without it, a paged layer's optimizer state stays where the optimizer made it,
        which is only correct when host and device are the same memory (CPU)."""
        self._page_optimizer = optimizer
        if self.pager is not None:
            self.pager.optimizer = optimizer

    def end_page_step(self) -> None:
        """Close the paging step (after ``optimizer.step()``): the pager updates its
        predictor, evicts down to its watermark and starts soft prefetches. The next forward
        calls it when the loop did not; a training loop with more than one forward per
        optimizer step (gradient accumulation) must call it after each ``optimizer.step()``."""
        if self.pager is not None and self._page_open:
            self.pager.end_step()
        self._page_open = False

    def sync_pages(self) -> None:
        """Wait for every page transfer in flight (before reading expert weights outside a
        step: a checkpoint, a replica refresh, a comparison). No-op without paging."""
        if self.pager is not None:
            self.pager.sync()

    def warm_pages(self, expert_share: torch.Tensor) -> List[int]:
        """Seed the pager from a known routing (``hetcomm launch --warmup-from``: a previous
        run's per-expert load): hint the predictor and page in this rank's hottest experts, as
        many as the free slots take. Builds the pager on the experts' device if the first
        forward has not. No-op without paging.

        Args:
            expert_share: ``[E]`` float, any device: each global expert's share of the load.
        Returns:
            Global ids of the experts resident afterwards because of it, hottest first.
        Raises:
            ConfigError: ``expert_share`` is not ``[E]`` (``key='moe.page_budget'``).
        """
        E = self.config.num_experts
        if tuple(expert_share.shape) != (E,):
            raise ConfigError(
                f"expert_share has shape {tuple(expert_share.shape)}; expected ({E},), one share per global expert",
                key="moe.page_budget",
            )
        if self.config.page_budget <= 0 or not len(self.experts):
            return []
        pager = self._ensure_pager(next(self.experts.parameters()).device)
        assert pager is not None
        ids = self._sorted_local_ids()
        local = expert_share.detach().to("cpu", torch.float64)[ids]
        pager.hint(local / local.max().clamp_min(1e-12))  # hottest = certain to be used
        warmed = []
        for l in torch.argsort(local, descending=True, stable=True).tolist():
            if local[l] <= 0 or (not pager.resident(l) and not pager.prefetch(l)):
                break  # unused from here on, or no free slot and nothing colder to evict
            warmed.append(ids[l])
        pager.sync()
        return warmed

    def _paged_experts(self, recv_x: torch.Tensor, counts: Sequence[int], handle, work, times: PipelineTimes) -> torch.Tensor:
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
            mark = self.speed.begin(recv_x.device)
            for g in pager.grants([e for e in order if lo <= e < hi]):
                outs[g.requested] = self._run_grant(g, pieces[g.requested], waves)
                pager.release(g.requested)
            self.speed.end(mark, sum(counts[lo:hi]))
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
            if self.config.page_budget > 0:
                return {"page_hits": 0, "page_faults": 0, "page_stall_s": 0.0}  # a rank without experts
            return {}
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

