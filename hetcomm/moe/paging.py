"""Expert paging: a device working set of experts under a memory budget, the rest in a host pool.

Notation: ``E`` experts of one layer; ``S`` device slots (one expert each); ``B`` bytes of one
slot (an expert's parameters plus room for its per-element optimizer state, rounded up to whole
pages).

Memory layout. Every expert owns one region of ``B`` bytes in a host pool (``[E * B]`` uint8,
pinned when the device is CUDA/NPU); the device pool is ``[S * B]`` uint8 with
``S = floor(budget_fraction * E)``. Inside a region, parameter ``i`` sits at a 64-byte aligned
offset, and per-element optimizer state ``j`` (Adam's ``exp_avg``, ``exp_avg_sq``) at the same
offset in the ``j+1``-th copy of the parameter area, so a region moves with one contiguous copy
and the host and device layouts are identical. A parameter (and its state) is always a *view*
of whichever region is current: the device slot while resident, its host region otherwise.
Gradients and optimizer updates therefore land on the current copy, and eviction writes the
slot back to the host region byte for byte before anything else may use the slot: weights are
bit-identical after any number of evict/reload cycles (``tests/moe/test_paging.py``).

Pages. ``page_bytes`` (64 MiB) is the allocation unit of both pools; experts under 64 MiB use
``small_page_bytes`` (8 MiB), and experts under 8 MiB one page of their own size rounded up to
4 KiB (a page never holds parts of two experts, so a fault moves exactly one expert).

One step (the layer, or a benchmark, drives it)::

    order = pager.begin_step(counts)        # counts: [E] tokens per expert from the gate
    for grant in pager.grants(order):       # resident experts first, loads as they land
        y = run(grant.expert, rows_of(grant.requested))   # or the stale/stand-in answer
        pager.release(grant.requested)
    ... backward, optimizer.step(), zero_grad ...
    pager.end_step()                        # predictor, L2, watermark eviction, soft prefetch

``begin_step`` starts the loads of the routed experts that are not resident (the gate's output
is known before the tokens arrive, so the loads overlap the dispatch) and returns the compute
order. Then, as ``training=True`` keeps every expert used in a step resident until ``end_step``
(autograd saved its weights), the working set of one step must fit the budget, unless the step
is begun with ``hold=False``: released experts can then be evicted within the step (written
back, as in training), and a backward that needs one again takes it with :meth:`acquire` and
gives it back with :meth:`release` (``hetcomm.moe.layer``'s waves recompute each expert that
way). With ``training=False`` (inference, or forward-only measurement) every step streams, so
more experts than slots go through.

Policy (defaults from the MegaScale-MoE notes):
- predicted use ``u_e = max(EMA of "used this step", hint_e)`` where ``hint`` is the gate's
  confidence-weighted top-k share for the coming step, when the caller has one;
- **soft prefetch**: an expert with ``u_e >= standby_threshold`` (0.7) is standby and is loaded
  only while more than ``prefetch_min_free`` (40%) of the slots are free;
- **eviction** when fewer than ``evict_below_free`` (20%) of the slots are free, lowest
  ``u_e * recency_e`` first, ``recency_e = 1 / (1 + steps since last use)``; a load started for
  this step evicts only experts predicted colder than itself, else it waits for a slot released
  in this step.

Transfers run on two worker threads (host->device and device->host, as PCIe is full duplex),
each throttled to ``transfer_bytes_per_s`` when set; on CUDA/NPU they are asynchronous copies on
side streams from pinned memory. Written by hand: torch has no paged parameter pool (FSDP's
offload moves whole flat parameters every step, not a predicted working set).
"""

from __future__ import annotations

import atexit
import math
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe.paging_parts import Grant, PagingConfig, PagingError, _accel, _Copier, _Job, pages_for
from hetcomm.moe.degrade import (
    DegradeCounters,
    StaleOutputs,
    flat_weights,
    log_substitution,
    most_similar,
)

__all__ = ["PagingConfig", "ExpertPager", "Grant", "PagingError", "pages_for"]

_ALIGN = 64
MiB = 1 << 20

# Pagers not closed yet. Their copy workers are daemon threads; one still inside a torch copy
# when the interpreter finalises would abort the process ("terminate called without an active
# exception": CPython ends the thread inside pybind11's GIL release). atexit runs before that.
_LIVE: "weakref.WeakSet[ExpertPager]" = weakref.WeakSet()


@atexit.register
def _close_live_pagers() -> None:
    for pager in list(_LIVE):
        try:
            pager.close()
        except Exception:  # exiting anyway: a failed transfer must not hide the real exit status
            pass


class ExpertPager:
    """Holds ``E`` experts' weights in a host pool and a budgeted device working set.

    Args:
        experts: the ``E`` expert modules of one layer (global ids = positions), all of the
            same parameter layout. Their parameters become views into the pools.
        config: :class:`PagingConfig`.
        device: the compute device (the device pool lives there); default: the device of the
            first expert's parameters.
        optimizer: optimizer whose per-element state of these parameters is paged with them
            (None: parameters only).

    Raises:
        ConfigError: experts of different layouts, a budget below one expert, or an optimizer
            with more per-element state than ``optimizer_state_per_param`` reserves.
    """

    def __init__(
        self,
        experts: Sequence[nn.Module],
        config: Optional[PagingConfig] = None,
        *,
        device: Optional[torch.device] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        self.cfg = config or PagingConfig()
        self.experts = list(experts)
        self.num_experts = E = len(self.experts)
        if E < 1:
            raise ConfigError("no experts to page", key="paging.experts")
        self.params: List[List[nn.Parameter]] = [list(m.parameters()) for m in self.experts]
        first = self.params[0]
        if not first:
            raise ConfigError("expert 0 has no parameters to page", key="paging.experts")
        layout = [(tuple(p.shape), p.dtype) for p in first]
        for e, ps in enumerate(self.params):
            if [(tuple(p.shape), p.dtype) for p in ps] != layout:
                raise ConfigError(
                    f"expert {e} has parameters {[(tuple(p.shape), str(p.dtype)) for p in ps]} but expert 0 has "
                    f"{[(s, str(d)) for s, d in layout]}; page the experts of one layer together",
                    key="paging.experts",
                )
        self.device = torch.device(device) if device is not None else first[0].device
        self.optimizer = optimizer
        # Offsets of each parameter inside the parameter area of a region.
        self._offsets: List[int] = []
        off = 0
        for p in first:
            self._offsets.append(off)
            off += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        self.param_area = off
        region = off * (1 + self.cfg.optimizer_state_per_param)
        self.page_bytes, self.pages_per_expert = pages_for(region, self.cfg)
        self.slot_bytes = self.page_bytes * self.pages_per_expert
        self.num_slots = int(math.floor(self.cfg.budget_fraction * E + 1e-9))
        if self.num_slots < 1:
            raise ConfigError(
                f"a budget of {self.cfg.budget_fraction:.0%} of {E} experts holds no expert; raise it to at least "
                f"{1 / E:.3f}",
                key="paging.budget_fraction",
            )
        self.num_slots = min(self.num_slots, E)
        mod = _accel(self.device)
        pin = mod is not None
        self.host = torch.empty(E * self.slot_bytes, dtype=torch.uint8, device="cpu", pin_memory=pin)  # host: the paged-out store
        self.pool = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._mod = mod
        self._views: Dict["tuple[str, int]", List[List[torch.Tensor]]] = {}
        # Residency: slot_of[e] is the slot holding e (or None); owner[s] the expert in slot s.
        self.slot_of: List[Optional[int]] = [None] * E
        self.owner: List[Optional[int]] = [None] * self.num_slots
        self._loading: Dict[int, _Job] = {}
        self._writeback: Dict[int, _Job] = {}  # slot -> the write-back that must finish before reuse
        self._host_ready: Dict[int, _Job] = {}  # expert -> the write-back filling its host region
        self._pending: List[int] = []          # loads waiting for a slot
        self._busy: set = set()                # experts this step still needs (or holds, training)
        self._hold = self.cfg.training         # this step keeps its experts until end_step
        self._used_step: set = set()
        self._faulted_step: set = set()
        self.l2_pinned: set = set()
        self.migration_requests: List[int] = []
        self.step = 0
        # host: the pager's statistics drive host decisions (which expert to load or evict).
        self.predicted = torch.zeros(E, dtype=torch.float64, device="cpu")  # predicted use probability u_e
        self._ema = torch.zeros(E, dtype=torch.float64, device="cpu")       # EMA of "used this step"
        self._share = torch.zeros(E, dtype=torch.float64, device="cpu")     # EMA of the token share (tie-break)
        # Python copies of predicted/_share: the victim search reads them O(E) times per load,
        # and a tensor element read costs ~1 us where a list's costs ~30 ns.
        self._pred_l: List[float] = [0.0] * E
        self._share_l: List[float] = [0.0] * E
        # Experts whose optimizer state is bound into the pools (views): Adam creates its state
        # once per parameter and updates it in place, so only these need no re-binding.
        self._state_seen: set = set()
        self._hint = torch.zeros(E, dtype=torch.float64, device="cpu")
        self.last_used = [-(10**9)] * E
        self._fault_streak = [0] * E
        self.counters = DegradeCounters()
        self.stale = StaleOutputs(E)
        self._counts = torch.zeros(E, dtype=torch.float64, device="cpu")  # host: as above
        self._sim_cache: Optional[torch.Tensor] = None
        self._sim_step = -(10**9)
        self.stats_total: Dict[str, float] = {
            "computations": 0, "hits": 0, "gate_hits": 0, "waits": 0, "stall_s": 0.0,
            "loads": 0, "prefetches": 0, "evictions": 0, "writebacks": 0, "bytes_in": 0, "bytes_out": 0,
            "reacquires": 0, "reacquire_stall_s": 0.0,
        }
        for e in range(E):
            self._bind(e, ("host", e), copy=True)
        rate = self.cfg.transfer_bytes_per_s
        self._h2d = _Copier("h2d", rate, self.device)
        self._d2h = _Copier("d2h", rate, self.device)
        self._closed = False
        _LIVE.add(self)

    # -- regions and binding --------------------------------------------------------------

    def _host_region(self, e: int) -> torch.Tensor:
        return self.host[e * self.slot_bytes : (e + 1) * self.slot_bytes]

    def _slot_region(self, s: int) -> torch.Tensor:
        return self.pool[s * self.slot_bytes : (s + 1) * self.slot_bytes]

    def _state_tensors(self, p: nn.Parameter) -> List[torch.Tensor]:
        """Per-element optimizer state of ``p``, in key order (the order fixes their place)."""
        if self.optimizer is None:
            return []
        st = self.optimizer.state.get(p, {})
        out = [st[k] for k in sorted(st) if torch.is_tensor(st[k]) and st[k].numel() == p.numel() and p.numel() > 1]
        if len(out) > self.cfg.optimizer_state_per_param:
            raise ConfigError(
                f"{type(self.optimizer).__name__} keeps {len(out)} per-element state tensors per parameter but "
                f"the pager reserves {self.cfg.optimizer_state_per_param}; raise optimizer_state_per_param",
                key="paging.optimizer_state_per_param",
            )
        return out

    def _region_views(self, key: "tuple[str, int]") -> List[List[torch.Tensor]]:
        """Per parameter, its views in region ``key`` (``("host", e)`` or ``("slot", s)``): the
        parameter itself, then each optimizer-state place (cached: views cost more than copies
        of these small tensors)."""
        views = self._views.get(key)
        if views is None:
            region = self._host_region(key[1]) if key[0] == "host" else self._slot_region(key[1])
            views = []
            for p, off in zip(self.params[0], self._offsets):
                nbytes = p.numel() * p.element_size()
                views.append([
                    region[j * self.param_area + off : j * self.param_area + off + nbytes].view(p.dtype).view(p.shape)
                    for j in range(1 + self.cfg.optimizer_state_per_param)
                ])
            self._views[key] = views
        return views

    def _bind(self, e: int, key: "tuple[str, int]", copy: bool) -> None:
        """Make expert ``e``'s parameters (and state) views of region ``key``, copying their
        values in first when ``copy`` (values already there when the region was just loaded)."""
        with torch.no_grad():  # once per expert: entering it per tensor was a third of the cost
            for p, views in zip(self.params[e], self._region_views(key)):
                state = self._state_tensors(p)
                if state:
                    self._state_seen.add(e)
                for t, view in zip([p] + state, views):
                    if t.data_ptr() == view.data_ptr():
                        continue
                    if t.dtype != view.dtype:
                        raise ConfigError(
                            f"optimizer state of dtype {t.dtype} beside a {p.dtype} parameter cannot be paged",
                            key="paging.optimizer",
                        )
                    if copy:
                        view.copy_(t.detach())
                    t.data = view
                if p.grad is not None and p.grad.device != p.device:
                    # A gradient accumulated while the expert was elsewhere follows it: the
                    # optimizer updates a parameter, its gradient and its state on one device.
                    p.grad = p.grad.to(p.device)

    # -- slots ------------------------------------------------------------------------------

    def free_slots(self) -> int:
        return sum(1 for s in range(self.num_slots) if self.owner[s] is None)

    def resident(self, e: int) -> bool:
        """True when ``e`` is in the device pool and no load of it is in flight."""
        return self.slot_of[e] is not None and e not in self._loading

    def resident_experts(self) -> List[int]:
        return [e for e in range(self.num_experts) if self.resident(e)]

    def _score(self, e: int) -> float:
        recency = 1.0 / (1 + max(0, self.step - self.last_used[e]))
        return self._pred_l[e] * recency

    def _evictable(self, e: int, allow_busy: bool = False) -> bool:
        return (
            self.slot_of[e] is not None
            and e not in self._loading
            and (allow_busy or e not in self._busy)
            and e not in self.l2_pinned
        )

    def _key(self, e: int) -> "tuple[float, float, int]":
        # u_e * recency_e first; among equals (every expert used every step) the smaller
        # token share goes first, since it has the shortest computation to hide a reload behind.
        return (self._score(e), self._share_l[e], self.last_used[e])

    def _victim(self, below: Optional["tuple[float, float, int]"] = None, allow_busy: bool = False) -> Optional[int]:
        cands = [e for e in range(self.num_experts) if self._evictable(e, allow_busy)]
        if below is not None:
            cands = [e for e in cands if self._key(e) < below]
        if not cands:
            return None
        return min(cands, key=lambda e: (self._key(e), e))

    def _evict(self, e: int) -> None:
        s = self.slot_of[e]
        assert s is not None and e not in self._loading
        if self.cfg.training:
            # Pull in state the optimizer created since the load, then write the slot back
            # byte for byte; the parameters point at the host region from now on.
            # The host region is complete once the write-back lands: a reload of ``e`` and the
            # next load into ``s`` both wait for it (``_Job.after``); ``sync()`` before reading.
            if e not in self._state_seen:
                self._bind(e, ("slot", s), copy=True)
            ev = self._record_compute()
            job = self._d2h.submit(_Job(self._slot_region(s), self._host_region(e), [], ev))
            self._writeback[s] = job
            self._host_ready[e] = job
            self.stats_total["writebacks"] += 1
            self.stats_total["bytes_out"] += self.slot_bytes
            self._bind(e, ("host", e), copy=False)
        else:
            self._bind(e, ("host", e), copy=False)  # unchanged since the load: drop it
        self.slot_of[e] = None
        self.owner[s] = None
        self.stats_total["evictions"] += 1

    def _record_compute(self):
        if self._mod is None:
            return None
        ev = self._mod.Event()
        ev.record(self._mod.current_stream(self.device))
        return ev

    def _check(self, job: _Job, e: int) -> None:
        if not job.done.is_set():
            raise PagingError(
                f"a transfer of {job.nbytes} bytes did not finish within {self.cfg.timeout_s:.0f} s; the copy "
                f"worker is stuck or the throttle ({self.cfg.transfer_bytes_per_s} B/s) is far too low",
                expert=e,
            )
        if job.error is not None:
            raise PagingError(f"transfer failed: {job.error!r}", expert=e) from job.error

    def _start_load(
        self, e: int, below: Optional["tuple[float, float, int]"] = None, allow_busy: bool = False
    ) -> bool:
        """Start loading ``e`` into a free slot (or one freed by evicting a colder expert;
        ``allow_busy``: even one this step still needs, which then reloads when its turn comes)."""
        if self.slot_of[e] is not None:
            return True
        slot = next((s for s in range(self.num_slots) if self.owner[s] is None), None)
        if slot is None:
            victim = self._victim(below, allow_busy)
            if victim is None:
                return False
            slot = self.slot_of[victim]
            self._evict(victim)
        ev = self._record_compute()
        after = [j for j in (self._writeback.pop(slot, None), self._host_ready.pop(e, None)) if j is not None]
        job = _Job(self._host_region(e), self._slot_region(slot), after, ev)
        self._h2d.submit(job)
        self._loading[e] = job
        self.slot_of[e] = slot
        self.owner[slot] = e
        self.stats_total["loads"] += 1
        self.stats_total["bytes_in"] += self.slot_bytes
        return True

    def _finish_load(self, e: int, timeout: Optional[float]) -> bool:
        job = self._loading[e]
        if not job.done.wait(timeout):
            if timeout is not None and timeout > 0:
                self._check(job, e)
            return False
        self._check(job, e)
        if self._mod is not None and job.event is not None:
            self._mod.current_stream(self.device).wait_event(job.event)
        del self._loading[e]
        self._bind(e, ("slot", self.slot_of[e]), copy=False)
        return True

    def _poll(self) -> None:
        for e in [e for e, j in self._loading.items() if j.done.is_set()]:
            self._finish_load(e, 0)

    def _issue_pending(self) -> None:
        while self._pending:
            e = self._pending[0]
            if not self._start_load(e):
                return
            self._pending.pop(0)

    def _incoming_key(self, e: int) -> "tuple[float, float, int]":
        # An expert needed now counts as used now (recency 1); it displaces only colder ones.
        return (max(self._pred_l[e], 1e-12), self._share_l[e], self.step)

    # -- the step ---------------------------------------------------------------------------

    def hint(self, use_probability: torch.Tensor) -> None:
        """Tell the predictor the coming step's use probability per expert (``[E]``, any float
        dtype/device), e.g. the confidence-weighted top-k share of the gate's logits."""
        if use_probability.shape != (self.num_experts,):
            raise ConfigError(
                f"hint has shape {tuple(use_probability.shape)}; expected ({self.num_experts},)", key="paging.hint"
            )
        self._hint = use_probability.detach().to("cpu", torch.float64).clamp(0, 1)

    def begin_step(self, counts: torch.Tensor, hold: Optional[bool] = None) -> List[int]:
        """Start a step whose gate routed ``counts[e]`` tokens to expert ``e``.

        Args:
            counts: ``[E]`` integer tensor (any device) of token copies per expert.
            hold: keep every expert used in this step resident until :meth:`end_step` (autograd
                holds its weights); default ``config.training``. ``False`` streams the step's
                experts through the slots (a forward without autograd, or the layer's waves,
                whose backward re-acquires each expert with :meth:`acquire`); evicted experts are
                still written back when ``config.training``.
        Returns:
            The compute order of the used experts: resident ones first (most tokens first, so
            the longest computations cover the loads), then the loading ones in load order.
        Raises:
            PagingError: in training mode, more experts used in one step than device slots.
        """
        if counts.shape != (self.num_experts,):
            raise ConfigError(f"counts has shape {tuple(counts.shape)}; expected ({self.num_experts},)", key="paging.counts")
        c = counts.detach().to("cpu").tolist()
        used = [e for e in range(self.num_experts) if c[e] > 0]
        self._hold = self.cfg.training if hold is None else bool(hold)
        if self._hold and len(used) > self.num_slots:
            raise PagingError(
                f"step {self.step + 1} routes tokens to {len(used)} experts but the budget holds {self.num_slots} "
                f"(budget_fraction {self.cfg.budget_fraction}); in training every expert of a step stays resident "
                f"until end_step: raise budget_fraction or lower the tokens per step"
            )
        self.step += 1
        self._poll()
        self._used_step = set(used)
        self._faulted_step = set()
        self._busy = set(used)
        for e in used:
            self.last_used[e] = self.step
        resident = sorted((e for e in used if self.resident(e)), key=lambda e: (-c[e], e))
        self.stats_total["gate_hits"] += len(resident)
        in_flight = [e for e in used if e in self._loading]
        missing = sorted((e for e in used if self.slot_of[e] is None), key=lambda e: (-c[e], e))
        # In training every used expert must get a slot now (they all stay until end_step):
        # L2-pinned experts not used this step give theirs up if there is no other way.
        self._counts = torch.tensor(c, dtype=torch.float64, device="cpu")  # host: pager statistics
        for e in missing:
            if self._start_load(e):
                continue
            if not self._hold:
                self._pending.append(e)  # waits for a slot released within this step
            elif not self._start_load(e):
                # Slots held by prefetches in flight or by L2 pins: let those land or go.
                for x in [x for x in self._loading if x not in self._used_step]:
                    self._finish_load(x, self.cfg.timeout_s)
                while not self._start_load(e) and self._unpin_one():
                    pass
                if self.slot_of[e] is None:
                    raise PagingError("no slot could be freed for it in this step", expert=e)
        in_flight = sorted(in_flight, key=lambda e: self._loading[e].nbytes)  # earlier loads first
        return resident + in_flight + [e for e in missing]

    def _unpin_one(self) -> bool:
        cands = [e for e in self.l2_pinned if e not in self._busy]
        if cands:
            self.l2_pinned.discard(min(cands, key=self._key))
        return bool(cands)

    def grants(self, order: Sequence[int], strict: bool = False) -> Iterator[Grant]:
        """Yield one :class:`Grant` per expert of ``order``: ready experts as soon as possible
        (the given order among them), a waiting fault only when nothing else is ready.
        ``strict=True`` keeps the given order exactly (a fault waits even if later experts are
        ready; the benchmark's baseline).

        The caller computes each granted expert, then calls :meth:`release` with
        ``grant.requested`` before asking for the next one.
        """
        remaining = list(order)
        streamed = {e for e in remaining if not self.resident(e)}
        while remaining:
            self._poll()
            self._issue_pending()
            window = remaining[: 1 if strict else None]
            # A load that just landed goes before the experts resident from the start: computing
            # it frees its slot for the next load, which keeps the transfers streaming.
            pick = next((e for e in window if e in streamed and self.resident(e)), None)
            if pick is None:
                pick = next((e for e in window if self.resident(e)), None)
            if pick is not None:
                remaining.remove(pick)
                self._account(pick, waited=False)
                yield Grant(pick, pick, "hit")
                continue
            # Nothing ready: a fault. Earliest started load first.
            loading = [e for e in remaining[: 1 if strict else None] if e in self._loading]
            if not loading:
                # Everything left waits for a slot: free one (this step's released experts).
                e = remaining[0]
                # Forward-only: a slot of an expert needed later this step may go (it reloads
                # at its turn); training keeps them, autograd holds their weights.
                if not self._start_load(e) and not (
                    not self._hold and self._start_load(e, allow_busy=True)
                ):
                    if self._loading:  # every slot is mid-load: let the earliest land, retry
                        first = next(iter(self._loading))
                        t0 = time.perf_counter()
                        self._finish_load(first, self.cfg.timeout_s)
                        self.stats_total["stall_s"] += time.perf_counter() - t0
                        continue
                    raise PagingError(
                        f"no device slot can be freed: all {self.num_slots} slots hold experts still in use this "
                        f"step; release experts after computing them, or raise budget_fraction",
                        expert=e,
                    )
                if e in self._pending:
                    self._pending.remove(e)
                continue
            e = min(loading, key=lambda x: order.index(x))
            remaining.remove(e)
            yield self._fault(e)

    def _fault(self, e: int) -> Grant:
        dcfg = self.cfg.degrade
        self._faulted_step.add(e)
        if dcfg.reuse_stale and self.stale.has(e):
            self.counters.l1_stale += 1
            self._account(e, waited=True)
            return Grant(e, e, "stale")
        if dcfg.substitute:
            stand_in = self._stand_in(e)
            if stand_in is not None:
                who, cos = stand_in
                log_substitution(self.counters, self.step, e, who, cos)
                self._account(e, waited=True)
                return Grant(e, who, "substitute")
        t0 = time.perf_counter()
        self._finish_load(e, self.cfg.timeout_s)
        waited = time.perf_counter() - t0
        self.counters.l1_waits += 1
        self.stats_total["stall_s"] += waited
        self._account(e, waited=True)
        return Grant(e, e, "waited", waited)

    def _stand_in(self, e: int) -> Optional["tuple[int, float]"]:
        cands = [x for x in self.resident_experts() if x != e]
        if not cands:
            return None
        if self._sim_cache is None or self.step - self._sim_step >= self.cfg.degrade.similarity_refresh_steps:
            self._sim_cache = torch.stack([flat_weights(ps).to("cpu") for ps in self.params])
            self._sim_step = self.step
        row, cos = most_similar(self._sim_cache[cands], self._sim_cache[e])
        return cands[row], cos

    def _account(self, e: int, waited: bool) -> None:
        self.stats_total["computations"] += 1
        if waited:
            self.stats_total["waits"] += 1
        else:
            self.stats_total["hits"] += 1

    def release(self, e: int) -> None:
        """Expert ``e``'s computation of this step is done (forward-only mode: its slot may be
        reused within the step; training mode: it stays until :meth:`end_step`)."""
        if not self._hold:
            self._busy.discard(e)
            self._issue_pending()

    def acquire(self, e: int) -> float:
        """Make ``e`` resident now and keep it until :meth:`release` (a streamed step's
        backward: the layer recomputes ``e`` on the device to get its gradients). Loads it when
        it is not resident, evicting the coldest expert nobody holds. Returns seconds waited.

        Raises:
            PagingError: every slot is held (nothing can be evicted), or the load timed out.
        """
        t0 = time.perf_counter()
        self._poll()
        loaded = self.slot_of[e] is None or e in self._loading
        while self.slot_of[e] is None and not self._start_load(e):
            if any(x != e for x in self._loading):
                self._finish_load(next(x for x in self._loading if x != e), self.cfg.timeout_s)
            elif not self._unpin_one():
                raise PagingError(
                    f"no device slot can be freed: all {self.num_slots} slots hold experts in use; release "
                    f"acquired experts after computing them, or raise budget_fraction",
                    expert=e,
                )
        if e in self._loading:
            self._finish_load(e, self.cfg.timeout_s)
        self._busy.add(e)
        waited = time.perf_counter() - t0
        if loaded:
            self.stats_total["reacquires"] += 1
            self.stats_total["reacquire_stall_s"] += waited
        return waited

    def stale_output(self, e: int, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """L1 opt-in: ``[num_rows, D]`` rows of ``e``'s previous output (``like``'s dtype/device)."""
        return self.stale.output(e, num_rows, like)

    def record_output(self, e: int, output: torch.Tensor) -> None:
        """Remember ``e``'s output (``[N, D]``) for L1's stale reuse (only when enabled)."""
        if self.cfg.degrade.reuse_stale:
            self.stale.record(e, output)

    def end_step(self) -> None:
        """Close the step (after ``optimizer.step()``): pull new optimizer state into the slots,
        update the predictor and L2, evict to the watermark, start soft prefetches."""
        self._poll()
        for e in list(self._pending):
            self._pending.remove(e)
        self._busy = set()
        for e in self._used_step:
            if self.slot_of[e] is None:
                # Streamed out within the step (hold=False): the optimizer updated the host copy;
                # state it created goes into the host region, after the write-back that fills it.
                job = self._host_ready.get(e)
                if job is not None:
                    job.done.wait(self.cfg.timeout_s)
                    self._check(job, e)
                self._bind(e, ("host", e), copy=True)
            elif e not in self._loading and e not in self._state_seen:
                self._bind(e, ("slot", self.slot_of[e]), copy=True)
        used = torch.zeros(self.num_experts, dtype=torch.float64, device="cpu")  # host: pager statistics
        if self._used_step:
            used[list(self._used_step)] = 1.0
        d = self.cfg.history_decay
        self._ema = self._ema * d + used * (1 - d)
        total = float(self._counts.sum())
        if total > 0:
            self._share = self._share * d + (self._counts / total) * (1 - d)
        self.predicted = torch.maximum(self._ema, self._hint)
        self._pred_l, self._share_l = self.predicted.tolist(), self._share.tolist()
        self._hint = torch.zeros_like(self._hint)
        self._update_l2()
        S = self.num_slots
        while self.free_slots() < self.cfg.evict_below_free * S:
            v = self._victim()
            if v is None:
                break
            self._evict(v)
        standby = [
            e for e in range(self.num_experts)
            if self.slot_of[e] is None and float(self.predicted[e]) >= self.cfg.standby_threshold
        ]
        standby.sort(key=lambda e: -float(self.predicted[e]))
        for e in standby:
            if self.free_slots() <= self.cfg.prefetch_min_free * S:
                break
            self._start_load(e)
            self.stats_total["prefetches"] += 1
        self._used_step = set()

    def _update_l2(self) -> None:
        dcfg = self.cfg.degrade
        for e in range(self.num_experts):
            if e in self._faulted_step:
                self._fault_streak[e] += 1
            elif e in self._used_step:
                self._fault_streak[e] = 0
            if dcfg.pin_after and self._fault_streak[e] >= dcfg.pin_after and e not in self.l2_pinned:
                self._fault_streak[e] = 0
                if len(self.l2_pinned) + 1 <= dcfg.max_pinned_fraction * self.num_slots:
                    self.l2_pinned.add(e)
                    self.counters.l2_pins += 1
                    if self.slot_of[e] is None:
                        self._start_load(e)
                else:
                    self.counters.l2_migration_requests += 1
                    self.migration_requests.append(e)

    def sync(self) -> None:
        """Wait for every transfer in flight (call before reading weights, e.g. a checkpoint)."""
        for e in list(self._loading):
            self._finish_load(e, self.cfg.timeout_s)
        for e, job in list(self._host_ready.items()):
            job.done.wait(self.cfg.timeout_s)
            self._check(job, e)

    def evict(self, e: int) -> None:
        """Evict ``e`` now (tests, and a balancer moving it elsewhere). No-op when not resident."""
        if e in self._loading:
            self._finish_load(e, self.cfg.timeout_s)
        if self.slot_of[e] is not None:
            if e in self._busy or e in self.l2_pinned:
                raise PagingError("is in use this step or pinned; it cannot be evicted now", expert=e)
            self._evict(e)

    def prefetch(self, e: int) -> bool:
        """Start loading ``e`` if a slot is free or a colder expert can go. Returns whether it started."""
        return self._start_load(e, below=self._incoming_key(e))

    # -- reporting and checkpoints ----------------------------------------------------------

    def stats(self) -> Dict[str, Any]:
        """Cumulative counters: computations, ``hit_rate`` (started without waiting),
        ``gate_hit_rate`` (resident when the gate routed), stall seconds, transfers, L1/L2/L3."""
        s = dict(self.stats_total)
        n = max(1, s["computations"])
        s["hit_rate"] = s["hits"] / n
        s["gate_hit_rate"] = s["gate_hits"] / n
        s["num_slots"] = self.num_slots
        s["slot_bytes"] = self.slot_bytes
        s["page_bytes"] = self.page_bytes
        s["l2_pinned"] = sorted(self.l2_pinned)
        s.update(self.counters.as_dict())
        return s

    def state_dict(self) -> Dict[str, Any]:
        """The pager's own state (predictor, pins, counters); the weights stay in the modules."""
        return {
            "step": self.step,
            "ema": self._ema.clone(),
            "share": self._share.clone(),
            "last_used": list(self.last_used),
            "fault_streak": list(self._fault_streak),
            "l2_pinned": sorted(self.l2_pinned),
            "counters": self.counters.as_dict(),
            "stats": dict(self.stats_total),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the working set starts cold and refills from the predictor)."""
        if len(state["last_used"]) != self.num_experts:
            raise ConfigError(
                f"pager state for {len(state['last_used'])} experts, this layer has {self.num_experts}",
                key="paging.state_dict",
            )
        self.step = int(state["step"])
        self._ema = state["ema"].to(torch.float64).clone()
        self._share = state["share"].to(torch.float64).clone()
        self.predicted = self._ema.clone()
        self._pred_l, self._share_l = self.predicted.tolist(), self._share.tolist()
        self.last_used = list(state["last_used"])
        self._fault_streak = list(state["fault_streak"])
        self.l2_pinned = set(state["l2_pinned"])
        for k, v in state["counters"].items():
            setattr(self.counters, k, int(v))
        self.stats_total.update(state["stats"])

    def close(self) -> None:
        """Finish transfers, stop the copy workers. Weights stay valid (host views)."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            self.sync()
        finally:
            self._h2d.close()
            self._d2h.close()

    def __enter__(self) -> "ExpertPager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
