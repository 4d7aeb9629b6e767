"""``hetcomm train --balance``, ``--powersgd`` and ``--powersgd-experts``: the balancer and the
slow-link compression wired into the training loop.

Per step (every rank, in the same order):

- each MoE layer's one load observer (:meth:`~hetcomm.moe.MoELayer.add_load_observer`: the
  statistics the layer all-reduces anyway, in the same all-reduce) gives the group's picks per
  expert (``[E]``) and the confidence-weighted top-20 share of its routing probabilities
  (``fast_signal`` of ``log probs``, the logits up to a per-token constant); the pager's L2
  migration requests (:meth:`~hetcomm.moe.MoELayer.take_migration_requests`) are collected too;
- after backward: in-flight migrations finish (the old owners computed this step; their
  gradients travel with the experts) and the layer adopts the new placement
  (:meth:`~hetcomm.moe.layer.MoELayer.apply_placement`, which counts the experts that landed in
  the layer's ``migrations`` step stat);
- after the optimizer step: one all-reduce of the requests (``[layers, E]``), then rank 0's
  loads, fast shares and requests broadcast (every rank decides from bitwise the same numbers),
  reach each layer's :class:`~hetcomm.moe.placement.balancer.ExpertBalancer`; every rank computes the same plan, rank 0 broadcasts its map in CSR form and the others
  check theirs against it; the moves start (asynchronous copies of parameters + Adam state).

Rank capacities are the datasheet's (``rank_speeds``) until the layers' measured speed vector
(:mod:`hetcomm.moe.speed`: forward expert rows/s, agreed identically on every rank every
``speed_every`` steps) exists; from then on each plan packs by the measured vector (equal on
every rank while no rank is slower than another beyond noise: the one rule,
:func:`hetcomm.moe.speed.slow_ranks`, so noise between equal ranks moves nothing), so expert
shares follow what the ranks do, and the coldest experts (by the group's load) end up where the
slowest ranks' time is short: LPT places copies hottest first, each on the rank that finishes it
soonest, and the refinement moves load off the slowest rank.

The layer owns one copy per expert (its hot-expert replicator adds replicas on its own), so the
balancer here makes no redundant copies. Each rank gets ``ceil(E / W)`` spare expert modules
(registered with the optimizer up front, so its parameter list never changes): a fast rank can
take up to that many more experts than it started with, so capacity decides both how many and
which experts a rank holds.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from hetcomm.errors import CollectiveError, ConfigError
from hetcomm.moe.placement.balancer import BalancerConfig, ExpertBalancer, ExpertMap, broadcast_map, diff_maps, fast_signal
from hetcomm.moe.placement.migration import ExpertMigrator, ExpertSlots
from hetcomm.moe.powersgd import SlowLinkPowerSGD, node_ids_of

__all__ = ["ReplicaPowerSGD", "TrainBalancer", "make_powersgd", "MEASURED_SECONDS_PER_UNIT"]

#: Training-step seconds per measured forward expert second (backward ~2x forward): the unit
#: of ``L / c`` once ``c`` is the layers' measured rows/s.
MEASURED_SECONDS_PER_UNIT = 3.0


class TrainBalancer:
    """One :class:`ExpertBalancer` per MoE layer of ``model``, with migrations.

    Args:
        model: the LM (``model.moe_layers``).
        optimizer: the optimizer over all parameters (its expert state migrates).
        speeds: ``[W]`` rank throughput (``rank_speeds(cluster)``).
        config: balancer knobs (``every``/``cooldown``/``window``...).
        flops_per_token: expert FLOPs per routed token (forward + backward), to turn load into
            modelled seconds for the gain-vs-cost test.
    """

    def __init__(self, model, optimizer, speeds, config: BalancerConfig, flops_per_token: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.layers = list(model.moe_layers)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Migration traffic on a gloo group of its own: its sends and receives stay pending
        # across a whole step, which the job's backend must not have to order against the
        # step's collectives (on the hetcomm backend a pending receive held up the all-to-alls).
        # Made at the first adopted plan (every rank adopts the same plan at the same step, so
        # creating it there is collective-safe): a run that never migrates never pays for it.
        self.p2p_group = None
        self._migrators: List[Optional[ExpertMigrator]] = []
        self.balancers: List[ExpertBalancer] = []
        self._picks: List[torch.Tensor] = []
        self._fast: List[torch.Tensor] = []
        self._requests: List[torch.Tensor] = []
        self._pending: List[Optional[tuple]] = []
        self._resume: List[Optional[List[int]]] = []  # target maps of migrations in flight at a loaded save
        self.migrations = 0
        self.plans = 0
        self.speed_source = "datasheet"  # until the layers' first agreed measurement
        self.paged = any(layer.config.page_budget > 0 for layer in self.layers)
        self.last: str = "-"
        tflops_unit = 1e12 * 0.5  # speeds are TFLOPS; 50% model-flops utilisation
        self.spares: List[List[torch.nn.Module]] = []
        for i, layer in enumerate(self.layers):
            E = layer.config.num_experts
            spare = [layer.make_expert(0) for _ in range(-(-E // self.world_size))]
            for m in spare:
                for p in m.parameters():
                    p.hetcomm_expert = True  # as the layer marks its own experts
                    p.grad = None
            optimizer.add_param_group({"params": [p for m in spare for p in m.parameters()]})
            self.spares.append(spare)
            per_param = 4 + 8  # fp32 weight + Adam's two fp32 moments
            nbytes = sum(p.numel() for p in layer.experts.experts[0].parameters()) * per_param if layer.experts.experts else 0
            cfg = BalancerConfig(**{**config.__dict__, "redundant": 0, "seconds_per_unit": flops_per_token / tflops_unit})
            self.balancers.append(ExpertBalancer(
                E, speeds, cfg, bytes_per_expert=nbytes,
                slots=[n + len(spare) for n in layer.placement.num_local_experts_per_rank],
                initial=ExpertMap.from_lists([[r] for r in layer.placement.owner], self.world_size),
            ))
            self._picks.append(torch.zeros(E, dtype=torch.float64))
            self._fast.append(torch.zeros(E, dtype=torch.float64))
            self._requests.append(torch.zeros(E, dtype=torch.float64))
            self._pending.append(None)
            self._migrators.append(None)
            layer.add_load_observer(self._observer(i), fast_topk=20)

    def migrator(self, i: int) -> ExpertMigrator:
        """Layer ``i``'s migrator (collective the first time any is asked for: the gloo group)."""
        if self.p2p_group is None:
            self.p2p_group = dist.new_group(backend="gloo")
        if self._migrators[i] is None:
            E = self.layers[i].config.num_experts
            self._migrators[i] = ExpertMigrator(self.p2p_group, timeout_s=120.0, tag_base=8 * E * i)
        return self._migrators[i]

    def _observer(self, i: int):
        def observe(picks: torch.Tensor, _probs: torch.Tensor, _num_tokens: float, fast: torch.Tensor) -> None:
            # The group's numbers already (the layer's statistics all-reduce); training forwards only.
            self._picks[i] += picks.detach().to("cpu", torch.float64)
            self._fast[i] += fast.detach().to("cpu", torch.float64)

        return observe

    def after_backward(self) -> None:
        """Finish the migrations started after the previous step (collective)."""
        for i, pend in enumerate(self._pending):
            if pend is None:
                continue
            plan, slots = pend
            self.migrator(i).finish(slots, self.optimizer)
            layer = self.layers[i]
            owner = plan.new_map.owner()
            layer.apply_placement(owner, {e: slots.module(e) for e, r in enumerate(owner) if r == self.rank})
            self.spares[i] = [m for m, e in zip(slots.modules, slots.expert_of) if e is None]
            self._pending[i] = None

    def after_step(self, step: int) -> List[str]:
        """Observe this step's loads, plan, start migrations. Returns event lines (for metrics)."""
        E = [b.num_experts for b in self.balancers]
        for i, layer in enumerate(self.layers):  # the pagers' L2 requests, this rank's
            for e in layer.take_migration_requests():
                self._requests[i][e] += 1
        reqs = torch.cat(self._requests)
        if self.paged:  # without a pager there are no requests anywhere: no all-reduce for them
            dist.all_reduce(reqs)
        vec = torch.cat([torch.cat([p, f]) for p, f in zip(self._picks, self._fast)] + [reqs])
        # Every rank must take the same decisions from bitwise the same numbers; an all-reduce
        # may sum in a different order on each rank (float shares), so rank 0's numbers win.
        dist.broadcast(vec, src=0)
        events = []
        off, roff = 0, 2 * sum(E)
        for i, bal in enumerate(self.balancers):
            n = E[i]
            load, fast = vec[off : off + n], vec[off + n : off + 2 * n] / self.world_size
            requested = (vec[roff : roff + n] > 0).nonzero().flatten().tolist()
            off += 2 * n
            roff += n
            self._picks[i].zero_()
            self._fast[i].zero_()
            self._requests[i].zero_()
            layer = self.layers[i]
            if layer.speed.measured:  # the agreed vector (identical on every rank) replaces the prior
                bal.set_speeds(layer.speed.speeds, seconds_per_unit=MEASURED_SECONDS_PER_UNIT)
                self.speed_source = "measured"
            bal.observe(load, fast=fast)
            if requested:
                bal.request_migration(requested)
            if self._migrators[i] is not None and self._migrators[i].busy:
                continue  # one migration per layer at a time
            old = bal.map
            plan = bal.maybe_rebalance()
            if plan is None:
                continue
            got = broadcast_map(plan.new_map if self.rank == 0 else None, src=0, num_experts=n,
                                world_size=self.world_size, max_nnz=n)
            if got != plan.new_map:
                raise CollectiveError(
                    f"layer {i}: this rank's balancer chose another expert map than rank 0's at step {step}; "
                    f"the load all-reduce should make them equal",
                    op="balance", rank=self.rank, peer=0,
                )
            slots = ExpertSlots(list(layer.experts.experts) + self.spares[i],
                                list(layer.local_expert_ids) + [None] * len(self.spares[i]))
            moves = diff_maps(old, plan.new_map)
            layer.sync_pages()  # start() copies the experts out: no page write-back half done
            self.migrator(i).start(moves, slots, self.optimizer)
            self._pending[i] = (plan, slots)
            self.migrations += len(moves)
            self.plans += 1
            self.last = (f"layer{i} step {step}: {len(moves)} moves, predicted max/mean "
                         f"{plan.imbalance_before:.2f} -> {plan.imbalance_after:.2f}")
            events.append(self.last)
        return events

    def spare_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters of the spare expert modules (expert-parallel: scale, never average)."""
        return [p for spare in self.spares for m in spare for p in m.parameters()]

    def finish_pending(self) -> None:
        """At the end of the run: land what is in flight (no gradients: grads are None)."""
        if any(p is not None for p in self._pending):
            for layer in self.layers:
                for p in layer.experts.experts.parameters():
                    p.grad = None
            self.after_backward()

    def summary_rows(self) -> List[tuple]:
        viol = sum(len(b.cooldown_violations()) for b in self.balancers)
        bal = self.balancers[0]
        evaluated = sum(len(b.plans) for b in self.balancers)
        last_eval = "-"
        if bal.plans:
            p = bal.plans[-1]
            last_eval = (f"layer0 step {p.step}: {len(p.moves)} moves, max/mean {p.imbalance_before:.2f} -> "
                         f"{p.imbalance_after:.2f}, gain {p.predicted_gain_s * 1e3:.3f} ms vs cost {p.cost_s * 1e3:.3f} ms, "
                         f"{'adopted' if p.adopted else 'not adopted'}")
        return [
            ("balancer plans", f"{evaluated} evaluated (last 20 kept per layer); last: {last_eval}"),
            ("balancer", f"{self.migrations} expert moves in {self.plans} plans (cooldown {bal.cfg.cooldown} steps, "
                         f"{viol} violations); last: {self.last}"),
            ("balancer speeds", f"{self.speed_source}: {[round(c, 1) for c in bal.speeds]}"),
            ("balancer map (CSR)", f"{bal.map.nbytes()} bytes per layer broadcast; layer0 experts per rank "
                                   f"{[len(bal.map.experts_on(r)) for r in range(self.world_size)]}"),
        ]

    def state_dict(self) -> Dict[str, Any]:
        # With the balancers' maps: each layer's placement as it computes now (a migration in
        # flight has moved the map, not yet the layer) and the map that migration lands on.
        sd: Dict[str, Any] = {f"layer{i}": b.state_dict() for i, b in enumerate(self.balancers)}
        for i, layer in enumerate(self.layers):
            pend = self._pending[i]
            sd[f"placement{i}"] = torch.tensor(list(layer.placement.owner), dtype=torch.int64)
            # [E] owners the in-flight migration lands on, or -1s (a fixed shape: DCP loads in place)
            target = pend[0].new_map.owner() if pend is not None else [-1] * layer.config.num_experts
            sd[f"pending{i}"] = torch.tensor(target, dtype=torch.int64)
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore the maps and give each layer the placement it had at the save (loaded before
        the model, so the model's expert keys follow it); :meth:`resume_pending` then restarts a
        migration that was in flight."""
        self._resume = []
        for i, b in enumerate(self.balancers):
            b.load_state_dict(sd[f"layer{i}"])
            owner = [int(r) for r in sd[f"placement{i}"].tolist()]
            pending = [int(r) for r in sd[f"pending{i}"].tolist()]
            self._place(i, owner)
            self._resume.append(pending if min(pending, default=-1) >= 0 else None)

    def _place(self, i: int, owner: List[int]) -> None:
        """Layer ``i`` takes ``owner`` with this rank's pool of modules (own experts + spares);
        their weights are the model load's to fill."""
        layer = self.layers[i]
        pool = list(layer.experts.experts) + self.spares[i]
        mine = [e for e, r in enumerate(owner) if r == self.rank]
        if len(mine) > len(pool):
            raise ConfigError(
                f"layer {i}: the checkpoint puts {len(mine)} experts on rank {self.rank}, which has {len(pool)} "
                f"expert slots; resume on the cluster it was saved on", key="balance.placement",
            )
        if owner != list(layer.placement.owner):
            layer.apply_placement(owner, {e: pool[j] for j, e in enumerate(mine)}, migrated=False)
        self.spares[i] = pool[len(mine):]

    def resume_pending(self) -> None:
        """After a resume: restart the migrations that were in flight at the save, from the
        loaded weights, as the saving run had started them after that step."""
        for i, owner in enumerate(self._resume):
            if owner is None:
                continue
            layer = self.layers[i]
            new_map = ExpertMap.from_lists([[r] for r in owner], self.world_size)
            old = ExpertMap.from_lists([[r] for r in layer.placement.owner], self.world_size)
            slots = ExpertSlots(list(layer.experts.experts) + self.spares[i],
                                list(layer.local_expert_ids) + [None] * len(self.spares[i]))
            layer.sync_pages()
            self.migrator(i).start(diff_maps(old, new_map), slots, self.optimizer)
            self._pending[i] = (_Resumed(new_map), slots)
        self._resume = []


class _Resumed:
    """A plan restored from a checkpoint: only its target map is needed to land it."""

    def __init__(self, new_map: ExpertMap) -> None:
        self.new_map = new_map


def make_powersgd(cluster, world_size: int, matrix_rank: int, seed: int, steps: int = 100) -> SlowLinkPowerSGD:
    """The dense-gradient averager of ``hetcomm train --powersgd RANK`` (collective).

    Its node and leader groups use the job's backend (hetcomm): collectives started from
    completion callbacks, as torch's PowerSGD hook does, run on hetcomm groups, so
    the compressed bytes travel on hetcomm's rails and count in ``hetcomm.stats()``.
    """
    # Compression starts after the first 10% of the run (at least 10 steps), as torch advises
    # for start_powerSGD_iter: the early, fast-changing gradients go uncompressed.
    return SlowLinkPowerSGD(node_ids_of(cluster, world_size), matrix_approximation_rank=matrix_rank, seed=seed,
                            start_iter=max(10, steps // 10))


class ReplicaPowerSGD:
    """The compressed replica-gradient sums of ``hetcomm train --powersgd-experts`` (built by
    each layer's :class:`~hetcomm.moe.placement.replicate.HotExpertReplicator`): their
    checkpointed state (error feedback and warm-start factors of every layer, this rank's) and
    the summary row."""

    def __init__(self, model) -> None:
        self.replicators = [m.replicator for m in model.moe_layers if m.replicator is not None]

    def state_dict(self) -> Dict[str, Any]:
        return {f"layer{i}": r.powersgd_state() for i, r in enumerate(self.replicators)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        for i, r in enumerate(self.replicators):
            if f"layer{i}" in sd:
                r.load_powersgd_state(sd[f"layer{i}"])

    def totals(self) -> Dict[str, float]:
        """This rank's sums over layers: PowerSGD's bytes on the leader pairs of its compressed
        reductions (before/after), its compressed calls, and every reduction's rail bytes."""
        out = {"calls": 0.0, "compressed_calls": 0.0, "uncompressed_bytes": 0.0, "compressed_bytes": 0.0,
               "rail_bytes": 0.0, "compressed_rail_bytes": 0.0}
        for r in self.replicators:
            out["calls"] += r.grad_reductions
            out["rail_bytes"] += sum(r.grad_rail_bytes.values())
            for c in r.powersgd.values():
                st = c.stats()
                out["compressed_calls"] += st["compressed_calls"]
                out["uncompressed_bytes"] += st["uncompressed_bytes"]
                out["compressed_bytes"] += st["compressed_bytes"]
                out["compressed_rail_bytes"] += sum(c.rail_bytes.values())
        return out

    def summary(self) -> str:
        from hetcomm.units import format_bytes

        t = self.totals()
        if not t["compressed_bytes"]:
            return f"{int(t['calls'])} reductions, none compressed on this rank (a single node, or before the start)"
        return (f"{int(t['compressed_calls'])} of {int(t['calls'])} reductions compressed: "
                f"{format_bytes(t['compressed_bytes'])} instead of {format_bytes(t['uncompressed_bytes'])} on the "
                f"leader links ({t['uncompressed_bytes'] / t['compressed_bytes']:.1f}x fewer); hetcomm rails sent "
                f"{format_bytes(t['compressed_rail_bytes'])} in them")
