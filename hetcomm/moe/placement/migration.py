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
from hetcomm.moe.placement.balancer import Move

__all__ = ["ExpertSlots", "ExpertMigrator", "migrate_now", "state_layout", "cold_placement_due", "place_cold_on_slow"]


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
    (after ``optimizer.step()``). Every rank keeps its expert modules (the optimizer holds
    them): a rank may not end up with more experts than it holds now.

    Args:
        layer: a :class:`~hetcomm.moe.MoELayer`.
        expert_to_rank: ``[E]`` new owner of each expert, identical on every rank.
        optimizer: the optimizer over the layer's parameters (None: parameters only).
        timeout_s: longest wait for one transfer.
    Returns:
        Global ids of the experts that changed owner.
    Raises:
        ConfigError: a map of the wrong size, a rank given more experts than it holds, or an
            optimizer whose state the engine does not know.
        PeerTimeout: a transfer did not complete within ``timeout_s``.
    """
    old = list(layer.placement.owner)
    new = [int(r) for r in expert_to_rank]
    E, W, rank = len(old), layer.world_size, layer.rank
    if len(new) != E:
        raise ConfigError(f"the map names {len(new)} experts but the layer has {E} (rank {rank})", key="moe.placement")
    have = [old.count(r) for r in range(W)]
    want = [new.count(r) for r in range(W)]
    over = [r for r in range(W) if want[r] > have[r]]
    if over:
        raise ConfigError(
            f"a migration keeps every rank's expert modules: rank {over[0]} holds {have[over[0]]} experts but "
            f"the new map gives it {want[over[0]]} (experts per rank now {have}, asked {want})",
            key="moe.placement",
        )
    moves = [Move(e, old[e], new[e], old[e]) for e in range(E) if old[e] != new[e]]
    slots = ExpertSlots(list(layer.experts.experts), list(layer.local_expert_ids))
    if moves and W > 1:
        layer.sync_pages()  # start() copies the experts out: no page write-back half done
        mig = ExpertMigrator(layer.group, timeout_s=timeout_s)
        mig.start(moves, slots, optimizer)
        mig.finish(slots, optimizer)
    layer.apply_placement(new, {e: slots.module(e) for e in range(E) if new[e] == rank})
    return [mv.expert for mv in moves]


def cold_placement_due(layer) -> bool:
    """Whether :func:`place_cold_on_slow` has what it needs for ``layer`` (a
    :class:`~hetcomm.moe.MoELayer`): an agreed speed vector (measured, or given: a meter that
    never measures, ``speed_every=0``, holds its prior as the final vector) and a full hot-set
    window of the replication EMA (the layer's global load), more than one rank, no paging.
    Identical on every rank (agreed values and step counts)."""
    rep = layer.replicator
    agreed = layer.speed.measured or layer.speed.every == 0
    return (rep is not None and layer.world_size > 1 and agreed and rep.steps >= rep.every
            and layer.config.page_budget == 0)


def place_cold_on_slow(layer, optimizer=None) -> List[int]:
    """Move ``layer``'s coldest experts onto the slowest ranks, now (collective; between steps).

    Slow ranks: more than :data:`~hetcomm.moe.placement.assign.SLOW_SPREAD` (10%) slower than
    the fastest by the agreed measured speed (``layer.speed``; the prior before it is measured);
    coldest: by the replication EMA of global token counts (identical on every rank), not by
    expert id. Each rank keeps its number of experts and the fewest experts move
    (:func:`~hetcomm.moe.placement.assign.cold_on_slow`), through :func:`migrate_now`
    (parameters, optimizer state and gradients travel, so training continues exactly).
    ``hetcomm train`` calls it once per layer, when :func:`cold_placement_due` first holds.

    Args:
        layer: a :class:`~hetcomm.moe.MoELayer` with replication on.
        optimizer: the optimizer holding the layer's parameters, or None.
    Returns:
        Global ids of the experts that moved (none when the agreed speeds are within 10%).

    Raises:
        ConfigError: replication is off (its EMA is the load).
    """
    from hetcomm.moe.placement.assign import cold_on_slow, slow_ranks

    if layer.replicator is None:
        raise ConfigError("place_cold_on_slow() reads the replication EMA as the layer's global load; "
                          "set replicate=True", key="moe.replicate")
    if layer.world_size == 1:
        return []
    owner = list(layer.placement.owner)
    new = cold_on_slow(owner, layer.replicator.ema.tolist(), slow_ranks(layer.speed.speeds))
    if new == owner:
        return []
    return migrate_now(layer, new, optimizer)
