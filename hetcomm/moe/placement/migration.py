"""Asynchronous expert migration: parameters and optimizer state move while training goes on.

Timeline of one plan (every rank runs the same calls, in the same order):

    opt.step()                              # step s
    mig.start(plan.moves, slots, opt)       # from_rank isends [params | state]; dst irecvs
    ... step s+1 forward/backward ...       # the OLD owner still serves the moving experts
    mig.finish(slots, opt)                  # before step s+1's opt.step(): wait for the copy,
                                            # the old owner sends this step's gradients, the new
                                            # owner installs params, state and gradients
    opt.step()                              # the new owner applies step s+1's update

The copy (3x the parameters for Adam) overlaps a whole forward/backward; only the gradients
(1x) move after it, so training continues exactly as if nothing had moved (tested bit for bit
against a twin that never migrates). The old owner's copy is dropped (its slot freed) when
``finish`` returns; a new replica (``Move.src is None``) is copied from ``from_rank`` the same
way and the source keeps its copy.

Slots: each rank keeps a fixed pool of expert modules (:class:`ExpertSlots`), all registered
with the optimizer from the start, so a migration never changes the optimizer's parameter
list; a free slot's parameters have no gradient and no state, so optimizers skip them.

Written by hand: torch has no primitive that moves one module and its optimizer state between
two ranks of a running job.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.errors import ConfigError, PeerTimeout
from hetcomm.moe.placement.balancer import BalancerConfig, ExpertBalancer, ExpertMap, Move

__all__ = ["ExpertSlots", "ExpertMigrator", "migrate_now", "resize_expert_modules", "state_layout",
           "speed_placement_due", "place_by_speed", "seconds_per_row", "given_spread",
           "FORWARD_AND_BACKWARD", "rebalance"]


def state_layout(optimizer: Optional[torch.optim.Optimizer]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(per-element state keys, scalar state keys) of a supported optimizer.

    Raises:
        ConfigError: an optimizer whose state layout hetcomm does not know.
    """
    if optimizer is None:
        return (), ()
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return ("exp_avg", "exp_avg_sq"), ("step",)
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",), ()
    raise ConfigError(
        f"expert migration knows the state of Adam, AdamW and SGD, not {type(optimizer).__name__}; "
        f"migrate without optimizer state or use one of those",
        key="balance.optimizer",
    )


class ExpertSlots:
    """A rank's pool of expert modules: ``expert_of[i]`` is the global expert in module ``i``
    (None = free).

    Args:
        modules: the slot modules (identical layouts).
        experts: the global expert of each module (None = free).
    """

    def __init__(self, modules: Sequence[nn.Module], experts: Sequence[Optional[int]]) -> None:
        if len(modules) != len(experts):
            raise ConfigError(f"{len(modules)} modules but {len(experts)} expert ids", key="balance.slots")
        self.modules = list(modules)
        self.expert_of: List[Optional[int]] = list(experts)

    def module(self, expert: int) -> nn.Module:
        return self.modules[self.expert_of.index(expert)]

    def holds(self, expert: int) -> bool:
        return expert in self.expert_of

    def experts(self) -> List[int]:
        return [e for e in self.expert_of if e is not None]

    def free_slot(self) -> int:
        try:
            return self.expert_of.index(None)
        except ValueError:
            raise ConfigError(
                f"no free expert slot on this rank (holds {self.experts()}); give it more slots",
                key="balance.slots",
            ) from None


def _flat(params: List[nn.Parameter], tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else params[0].new_zeros(0)


class ExpertMigrator:
    """Carries out a balancer's moves over ``group`` with point-to-point transfers.

    Args:
        group: the expert-parallel process group (None = default).
        timeout_s: longest wait for a copy or a gradient before :class:`PeerTimeout` naming
            the peer.
        tag_base: offset of this migrator's message tags (one migrator per MoE layer: give
            each a different multiple of ``4 * num_experts``).
    """

    def __init__(self, group=None, timeout_s: float = 120.0, tag_base: int = 0) -> None:
        self.group = group
        self.tag_base = tag_base  # distinct per layer, so two layers' transfers never match up
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self._inflight: List[dict] = []
        self.stats = {"copies": 0, "bytes_sent": 0, "bytes_received": 0, "wait_s": 0.0}

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def start(self, moves: Sequence[Move], slots: ExpertSlots, optimizer=None) -> None:
        """Post the copies of ``moves`` (call right after ``optimizer.step()``)."""
        if self._inflight:
            raise ConfigError("a migration is still in flight; call finish() first", key="balance.migrate")
        keys, scalars = state_layout(optimizer)
        for i, mv in enumerate(m for m in moves if m.dst is not None):
            tag = self.tag_base + 1 + 4 * mv.expert
            entry = {"move": mv, "keys": keys, "scalars": scalars}
            if self.rank == mv.from_rank:
                mod = slots.module(mv.expert)
                params = list(mod.parameters())
                state = [optimizer.state.get(p, {}) if optimizer is not None else {} for p in params]
                has = all(all(k in st for k in keys + scalars) for st in state) and bool(keys + scalars)
                per = [p for p in params] + [
                    (st[k] if has else torch.zeros_like(p)) for k in keys for p, st in zip(params, state)
                ]
                buf = _flat(params, per)
                flags = [1.0 if has else 0.0] + [float(state[0][k]) if has else 0.0 for k in scalars]
                sc = torch.tensor(flags, dtype=torch.float64, device=buf.device)
                entry["works"] = [dist.isend(buf, self._peer(mv.dst), group=self.group, tag=tag),
                                  dist.isend(sc, self._peer(mv.dst), group=self.group, tag=tag + 1)]
                entry["keep"] = (buf, sc)
                self.stats["bytes_sent"] += buf.numel() * buf.element_size()
            if self.rank == mv.dst:
                proto = list(slots.modules[0].parameters())
                n = sum(p.numel() for p in proto) * (1 + len(keys))
                buf = torch.empty(n, dtype=proto[0].dtype, device=proto[0].device)
                sc = torch.empty(1 + len(scalars), dtype=torch.float64, device=buf.device)
                entry["works"] = [dist.irecv(buf, self._peer(mv.from_rank), group=self.group, tag=tag),
                                  dist.irecv(sc, self._peer(mv.from_rank), group=self.group, tag=tag + 1)]
                entry["recv"] = (buf, sc)
                self.stats["bytes_received"] += buf.numel() * buf.element_size()
            self._inflight.append(entry)
            self.stats["copies"] += 1

    def _wait(self, work, mv: Move, what: str) -> None:
        peer = mv.from_rank if self.rank == mv.dst else mv.dst
        try:
            ok = work.wait(timeout=_td(self.timeout_s))
        except RuntimeError as ex:  # gloo raises on timeout or a dead peer
            raise PeerTimeout(
                f"expert {mv.expert}'s migration {what} did not complete within {self.timeout_s:.0f} s ({ex})",
                op="expert migration", rank=self.rank, peer=peer,
            ) from ex
        if ok is False:
            raise PeerTimeout(
                f"expert {mv.expert}'s migration {what} did not complete within {self.timeout_s:.0f} s",
                op="expert migration", rank=self.rank, peer=peer,
            )

    def landed(self) -> bool:
        """True when every copy this rank receives has arrived (non-blocking)."""
        return all(w.is_completed() for e in self._inflight if "recv" in e for w in e["works"])

    def finish(self, slots: ExpertSlots, optimizer=None) -> List[Move]:
        """Wait for the copies, move this step's gradients, install on the new owners, free the
        old owners' slots (call after backward, before ``optimizer.step()``). Collective.

        Returns:
            The moves carried out (the caller switches its expert map to the plan's).
        Raises:
            PeerTimeout: a copy or a gradient did not arrive within ``timeout_s``.
        """
        t0 = time.perf_counter()
        for e in self._inflight:
            for w in e.get("works", []):
                mv = e["move"]
                self._wait(w, mv, "copy")
        self.stats["wait_s"] += time.perf_counter() - t0
        # Gradients of this step, computed by the old owner, go with the expert.
        grad_works = []
        for e in self._inflight:
            mv: Move = e["move"]
            tag = self.tag_base + 3 + 4 * mv.expert
            if self.rank == mv.from_rank:
                params = list(slots.module(mv.expert).parameters())
                g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
                grad_works.append((dist.isend(g, self._peer(mv.dst), group=self.group, tag=tag), g, None, mv))
            if self.rank == mv.dst:
                proto = list(slots.modules[0].parameters())
                g = torch.empty(sum(p.numel() for p in proto), dtype=proto[0].dtype, device=proto[0].device)
                grad_works.append((dist.irecv(g, self._peer(mv.from_rank), group=self.group, tag=tag), g, e, mv))
        for w, g, e, mv in grad_works:
            self._wait(w, mv, "gradient")
        done: List[Move] = []
        # Old owners free their slots first (a rank may send one expert and receive another).
        for e in self._inflight:
            mv = e["move"]
            if self.rank == mv.src and mv.src is not None:
                i = slots.expert_of.index(mv.expert)
                for p in slots.modules[i].parameters():
                    p.grad = None
                    if optimizer is not None:
                        optimizer.state.pop(p, None)
                slots.expert_of[i] = None
        for w, g, e, mv in grad_works:
            if e is None:
                continue
            buf, sc = e["recv"]
            i = slots.free_slot()
            params = list(slots.modules[i].parameters())
            P = sum(p.numel() for p in params)
            off = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(buf[off : off + p.numel()].view_as(p))
                    p.grad = g[off : off + p.numel()].view_as(p).clone()
                    off += p.numel()
            if optimizer is not None and sc[0] > 0:
                for j, k in enumerate(e["keys"]):
                    base = P * (1 + j)
                    o = 0
                    for p in params:
                        optimizer.state.setdefault(p, {})[k] = buf[base + o : base + o + p.numel()].view_as(p).clone()
                        o += p.numel()
                for j, k in enumerate(e["scalars"]):
                    for p in params:
                        # host: non-capturable optimizers keep scalar state (Adam's step) on the CPU.
                        optimizer.state[p][k] = torch.tensor(float(sc[1 + j]), dtype=torch.float32, device="cpu")
            slots.expert_of[i] = mv.expert
        for e in self._inflight:
            done.append(e["move"])
        self._inflight = []
        return done

    def drop(self, moves: Sequence[Move], slots: ExpertSlots, optimizer=None) -> None:
        """Free the slots of dropped replicas (``Move.dst is None``); nothing moves."""
        for mv in moves:
            if mv.dst is None and mv.src == self.rank and slots.holds(mv.expert):
                i = slots.expert_of.index(mv.expert)
                for p in slots.modules[i].parameters():
                    p.grad = None
                    if optimizer is not None:
                        optimizer.state.pop(p, None)
                slots.expert_of[i] = None


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def migrate_now(layer, expert_to_rank: Sequence[int], optimizer=None, *, timeout_s: float = 120.0) -> List[int]:
    """Make ``layer`` follow ``expert_to_rank`` at once (collective): the asynchronous engine's
    :meth:`ExpertMigrator.start` and :meth:`ExpertMigrator.finish` back to back, then the
    layer's public :meth:`~hetcomm.moe.MoELayer.apply_placement`.

    Parameters, optimizer state (Adam/AdamW moments and step, SGD momentum) and gradients move
    with each expert, so training continues as if nothing had moved. Call it between steps
    (after ``optimizer.step()``). A rank may end with another number of experts: one that
    receives more than it gives builds fresh modules for them (:meth:`~hetcomm.moe.MoELayer.make_expert`,
    on its experts' device and dtype) and adds their parameters to ``optimizer``'s param group
    that holds the layer's experts; one that gives more than it receives drops the modules left
    free, from the layer and from ``optimizer``. Every rank keeps at least one expert.

    Args:
        layer: a :class:`~hetcomm.moe.MoELayer`.
        expert_to_rank: ``[E]`` new owner of each expert, identical on every rank.
        optimizer: the optimizer over the layer's parameters (None: parameters only).
        timeout_s: longest wait for one transfer.
    Returns:
        Global ids of the experts that changed owner.
    Raises:
        ConfigError: a map of the wrong size, a rank left without an expert, or an optimizer
            whose state the engine does not know or that does not hold this rank's experts.
        PeerTimeout: a transfer did not complete within ``timeout_s``.
    """
    old = list(layer.placement.owner)
    new = [int(r) for r in expert_to_rank]
    E, W, rank = len(old), layer.world_size, layer.rank
    if len(new) != E:
        raise ConfigError(f"the map names {len(new)} experts but the layer has {E} (rank {rank})", key="moe.placement")
    empty = [r for r in range(W) if r not in new]
    if empty:
        raise ConfigError(f"the new map leaves rank {empty[0]} without an expert; every rank keeps at least one "
                          f"(rank {rank})", key="moe.placement")
    moves = [Move(e, old[e], new[e], old[e]) for e in range(E) if old[e] != new[e]]
    modules = list(layer.experts.experts)
    have = len(modules)
    if new.count(rank) > have:  # fresh slots for what arrives beyond what leaves
        modules = resize_expert_modules(layer, modules, new.count(rank), optimizer)
    slots = ExpertSlots(modules, list(layer.local_expert_ids) + [None] * (len(modules) - have))
    if moves and W > 1:
        layer.sync_pages()  # start() copies the experts out: no page write-back half done
        mig = ExpertMigrator(layer.group, timeout_s=timeout_s)
        mig.start(moves, slots, optimizer)
        mig.finish(slots, optimizer)
    kept = [m for m, e in zip(slots.modules, slots.expert_of) if e is not None]
    if len(kept) < len(slots.modules):  # the slots left free leave the layer and the optimizer
        resize_expert_modules(layer, slots.modules, len(kept), optimizer, keep=kept)
    layer.apply_placement(new, {e: slots.module(e) for e in range(E) if new[e] == rank})
    return [mv.expert for mv in moves]


def resize_expert_modules(layer, modules: Sequence[nn.Module], count: int, optimizer=None,
                          keep: Optional[Sequence[nn.Module]] = None) -> List[nn.Module]:
    """``count`` expert modules for this rank of ``layer``: ``modules`` (or, when shrinking, the
    ``keep`` among them, else the first ``count``) plus fresh ones
    (:meth:`~hetcomm.moe.MoELayer.make_expert`, on ``modules[0]``'s device and dtype). The
    param group of ``optimizer`` holding the layer's experts loses the dropped modules'
    parameters (and their state) and gains the fresh ones'.

    Raises:
        ConfigError: ``optimizer`` does not hold this layer's expert parameters (naming the rank).
    """
    modules = list(modules)
    ref = next(modules[0].parameters())
    group = None
    if optimizer is not None:
        group = next((g for g in optimizer.param_groups if any(p is ref for p in g["params"])), None)
        if group is None:
            raise ConfigError(f"the optimizer does not hold this MoE layer's expert parameters (rank {layer.rank}); "
                              f"pass the optimizer built over the model's parameters", key="moe.optimizer")
    if count <= len(modules):
        out = list(keep) if keep is not None else modules[:count]
        dropped = [m for m in modules if all(m is not k for k in out)]
        if group is not None:
            gone = {id(p) for m in dropped for p in m.parameters()}
            group["params"] = [p for p in group["params"] if id(p) not in gone]
            for m in dropped:
                for p in m.parameters():
                    optimizer.state.pop(p, None)
        return out
    fresh = [layer.make_expert(0).to(device=ref.device, dtype=ref.dtype) for _ in range(count - len(modules))]
    if group is not None:
        group["params"].extend(p for m in fresh for p in m.parameters())
    return modules + fresh


#: An expert row's forward and backward cost over its forward alone: the backward of each of the
#: FFN's matmuls is two matmuls of the forward's size (the input's and the weight's gradients).
FORWARD_AND_BACKWARD = 3.0


def speed_placement_due(layer) -> bool:
    """Whether :func:`place_by_speed` has what it needs for ``layer`` (a
    :class:`~hetcomm.moe.MoELayer`): a verdict on the speeds (:attr:`SpeedSnapshot.differ
    <hetcomm.moe.speed.SpeedSnapshot>` is not None: agreed measurements with a noise estimate, or
    given speeds) and an agreement that measured every rank's expert rows, more than one rank,
    no paging. Identical on every rank (agreed values)."""
    snap = layer.speed.agreed
    W = layer.world_size
    measured = (len(snap.own_rows_per_s) == len(snap.seconds_per_step) == W
                and all(v > 0 for v in snap.own_rows_per_s) and all(t > 0 for t in snap.seconds_per_step))
    return W > 1 and snap.differ is not None and measured and layer.config.page_budget == 0


def seconds_per_row(layer) -> List[float]:
    """``[W]`` each rank's busy seconds per expert row of ``layer``, forward and backward
    (:data:`FORWARD_AND_BACKWARD` times the agreed measured forward), spread by the given speeds
    when the layer's speeds are given (:func:`given_spread`)."""
    own = layer.speed.agreed.own_rows_per_s
    return given_spread(layer.speed, [FORWARD_AND_BACKWARD / v if v > 0 else 0.0 for v in own])


def given_spread(meter, values: Sequence[float]) -> List[float]:
    """``values`` (``[W]`` seconds per rank) as they are, or -- when ``meter``'s speeds are given
    (``SpeedMeter.given``: the oracle) -- pooled at full speed over the ranks and spread by the
    given speeds, so the known factors decide and one run's noise does not."""
    if not meter.given:
        return [float(v) for v in values]
    top = max(meter.prior)
    scale = [p / top for p in meter.prior]  # 1 at full speed
    full = sum(float(v) * s for v, s in zip(values, scale)) / len(scale)
    return [full / s for s in scale]


def place_by_speed(layer, expert_rows: Sequence[float], optimizer=None) -> List[int]:
    """Re-place ``layer``'s experts so the ranks' predicted busy time in its experts evens out,
    now (collective; between steps). Only the layer's own expert time counts: its dispatch and
    combine are points every rank waits at, so a rank's work outside them cannot be traded
    against its experts (:mod:`hetcomm.moe.cold`).

    The map comes from :func:`~hetcomm.moe.placement.assign.balance_busy_time` with each rank's
    measured seconds per row (:func:`seconds_per_row`); a rank may end with more or fewer
    experts, and :func:`migrate_now` carries parameters, optimizer state and gradients, so
    training continues exactly.

    Args:
        layer: a :class:`~hetcomm.moe.MoELayer` (:func:`speed_placement_due` holds).
        expert_rows: ``[E]`` rows per step of each expert over the group, identical on every rank.
        optimizer: the optimizer holding the layer's parameters, or None.
    Returns:
        Global ids of the experts that moved (none when no change pays).
    """
    from hetcomm.moe.placement.assign import balance_busy_time

    owner = list(layer.placement.owner)
    new = balance_busy_time(owner, expert_rows, seconds_per_row(layer))
    if new == owner:
        return []
    return migrate_now(layer, new, optimizer)


def rebalance(layer, expert_load: Optional[Sequence[float]] = None, optimizer=None) -> List[int]:
    """Re-place ``layer``'s experts by load, now (collective), with the one placement policy
    (:meth:`hetcomm.moe.MoELayer.rebalance`).

    The map comes from :class:`~hetcomm.moe.placement.balancer.ExpertBalancer` (the policy
    of ``hetcomm train --balance``: capacity-aware packing by rank speed, refined, moves
    only where they shorten the slowest rank's step), fed this one load; every rank keeps
    its number of experts; the moves are carried out by :func:`migrate_now` (parameters,
    optimizer state and gradients travel with each expert), so training continues unchanged.

    Args:
        layer: a :class:`~hetcomm.moe.MoELayer`.
        expert_load: ``[E]`` load per expert, identical on every rank (default: the
            replication EMA of global token counts, which is).
        optimizer: the optimizer holding the layer's parameters, or None.
    Returns:
        Global ids of the experts that moved.

    Raises:
        ConfigError: no load given and replication off.
    """
    if expert_load is None:
        if layer.replicator is None:
            raise ConfigError(
                "rebalance() needs expert_load=[E loads] when replication is off (the "
                "replication EMA is the default load)",
                key="moe.rebalance",
            )
        expert_load = layer.replicator.ema.tolist()
    E, W = layer.config.num_experts, layer.world_size
    balancer = ExpertBalancer(
        E,
        layer.speed.speeds if layer.speed.measured else layer.rank_weights,  # measured once agreed
        BalancerConfig(window=1, every=1, cooldown=1),
        slots=list(layer.placement.num_local_experts_per_rank),
        initial=ExpertMap.from_lists([[r] for r in layer.placement.owner], W),
    )
    balancer.observe(torch.tensor([float(v) for v in expert_load], dtype=torch.float64))  # host: planning state
    plan = balancer.propose()
    if not plan.adopted:
        return []
    return migrate_now(layer, plan.new_map.owner(), optimizer)
