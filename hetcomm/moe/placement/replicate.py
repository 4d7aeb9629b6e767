"""Hot-expert replication: compute the most popular experts on the fastest ranks with room.

A few experts take most tokens; every copy sent to them crosses the network twice (dispatch and
combine). Replicating the top-``N`` hot experts on the fast ranks lets those ranks compute their
own tokens for them locally.

- **Where (the holders).** Candidates are the ranks allowed to hold replicas (the cluster YAML's
  ``strong`` flag: A100/H800 by default; every rank without a cluster). Before the group has
  measured its speeds the holders are the layer's initial ones (all candidates, or with
  ``rank_weights="throughput"`` those within :data:`~hetcomm.topo.compute.STRONG_FRACTION` of the
  fastest by datasheet). Once the speed vector is agreed (:mod:`hetcomm.moe.speed`), every
  hot-set refresh re-chooses them with :func:`choose_holders`: among the candidates *with room*
  (the agreed flag: the rank does not page its own experts, so extra copies would only push them
  out), all but those below ``STRONG_FRACTION`` (0.5) of the fastest such rank *and* slower than
  it beyond noise (:func:`hetcomm.moe.speed.differs`, the one rule). A replica on a slow rank adds
  work where time is already short. The inputs are agreed (all-reduced) values, so every rank
  computes the same holders without another message.

- **Compute.** The layer sets aside the copies its gate routes to replicas held here (routing)
  and :meth:`HotExpertReplicator.compute_local` runs them while the dispatch is in flight.
- **Which experts.** An EMA (``alpha``, 0.25 by default) of each expert's *global* token count
  (the all-reduced picks, identical on every rank, so every rank picks the same hot set without
  talking about it). Every ``M`` steps (by default every step) the top-``N`` become the hot set.
  A new set costs no extra transfer: the replicas are refreshed after each optimizer step anyway,
  and the refresh that applies a new set brings its weights; a replica leaving the set is reused
  for one joining it. With ``alpha < 0.5`` a hot set that moved is followed after one step (the
  new experts' EMA passes the old ones' at the first step whenever ``(1 - 2 alpha) x`` the heat
  exceeds the noise): the copies hold the experts that are hot now, not those that were.
- **Not before the first speed verdict** (``ready``: the layer's speeds have one). Copies change
  the rows each owner computes: a holder computes its own tokens for the hot experts, the hot
  experts' owners receive fewer. The first verdict places the experts for the rest of the run
  (:mod:`hetcomm.moe.cold`), so it is taken on the placement as it is. With copies from the first
  step, equal CPU ranks read apart and moved experts (docs/MOE.md, "Only owners' rows teach the
  speed"). A refresh due before the verdict runs at the first step after it.
- **Weights.** A replica is a copy of the owner's expert, refreshed whenever the owner's
  parameters changed (their autograd version counters moved, i.e. an optimizer stepped) or the
  hot set changed: one all-reduce of ``[N, P]`` where only owners contribute non-zeros
  (``x + 0 == x`` exactly, so replicas are bit-identical to their owner).
- **Only where it pays (``policy="profitable"``).** A replica saves the bytes of the copies its
  holder would have sent to the owner and received back (dispatch and combine, forward and
  backward), and costs two reductions of the expert's ``P`` parameters per optimizer step (weights
  and gradients, a ring over the ``m`` ranks that hold or own it: ``2 (m - 1) P`` elements each).
  With ``"profitable"`` an expert of the top ``N`` is replicated only when the first estimate
  exceeds the second (bytes summed over ranks, per step; tokens assumed spread evenly over the
  ranks). Small batches or large experts make replication a loss; ``"always"`` (the default)
  replicates the top ``N`` regardless.
- **Gradients.** After backward, the replicas' gradients are summed into the owner's gradient
  (one all-reduce of ``[N, P]``, zeros from non-holders), run as an autograd end-of-backward
  callback so every rank reaches it at the same point. Replicas are *not* ``nn.Parameter`` s of
  the layer: the optimizer sees each expert once (through its owner), gradient clipping counts
  it once, and the next refresh brings every copy back to the owner's exact values, whatever the
  optimizer is (Adam state lives only with the owner).
- **Compressed gradients (``powersgd_rank > 0``, ``MoEConfig.replicate_powersgd``).** That
  gradient sum runs through :class:`~hetcomm.moe.powersgd.SlowLinkPowerSGD` instead: exact inside
  each node, torch's ``powerSGD_hook`` (error feedback, warm start) between the node leaders of
  the reduction's members, so only cross-node pairs carry compressed bytes. One bucket per
  layer, one row of ``P`` per hot expert; when the hot set changes, each expert that stays hot
  keeps its error-feedback row (:meth:`~hetcomm.moe.powersgd.SlowLinkPowerSGD.remap_rows`).
  Members on a single node, or a one-rank group, reduce exactly as without the option. The
  weight refresh stays exact (replicas must equal their owner bit for bit).

Metrics: fraction of copies computed on this rank (``local_fraction``), all-to-all bytes with
and without replication, and the replicas' extra memory (``extra_bytes``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.errors import ConfigError
from hetcomm.moe.powersgd import SlowLinkPowerSGD, node_ids_of, rail_bytes_sent
from hetcomm.topo.compute import STRONG_FRACTION

__all__ = ["HotExpertReplicator", "choose_holders"]


def choose_holders(
    speeds: Sequence[float],
    room: Sequence[bool],
    candidates: Optional[Sequence[int]] = None,
    *,
    noise: Optional[Sequence[float]] = None,
    fraction: float = STRONG_FRACTION,
    limit: Optional[int] = None,
) -> Tuple[int, ...]:
    """The replica holders: the fastest ranks that have room.

    Args:
        speeds: ``[W]`` agreed measured speed of each rank (rows/s, or any unit: only ratios count).
        room: ``[W]`` agreed flags: the rank has room for replicas (it does not page its experts).
        candidates: ranks allowed to hold replicas (the cluster's strong ranks); None: all.
        noise: ``[W]`` relative noise of each speed (:attr:`hetcomm.moe.speed.SpeedSnapshot.noise`);
            None: exact numbers.
        fraction: a rank below this fraction of the fastest eligible rank's speed (the
            datasheet's strong-rank rule, :data:`hetcomm.topo.compute.STRONG_FRACTION`, on measured
            speed) is left out, when it is slower beyond noise too
            (:func:`hetcomm.moe.speed.differs`): noise never drops a holder.
        limit: at most this many holders (the fastest first); None: no limit.
    Returns:
        The holders, ascending. Ranks are taken in ``(-speed, rank)`` order, so equal speeds go
        to the lower rank: the same inputs give the same holders on every rank. Empty when no
        candidate has room (the owners then compute every copy).
    """
    if len(speeds) != len(room):
        raise ConfigError(f"{len(speeds)} speeds but {len(room)} room flags; give one of each per rank", key="moe.replicate")
    allowed = range(len(speeds)) if candidates is None else sorted(set(int(r) for r in candidates))
    eligible = [r for r in allowed if 0 <= r < len(speeds) and room[r] and float(speeds[r]) > 0]
    if not eligible:
        return ()
    from hetcomm.moe.speed import differs

    n = [0.0] * len(speeds) if noise is None else [float(v) for v in noise]
    top = max(eligible, key=lambda r: (float(speeds[r]), -r))
    order = sorted((r for r in eligible if float(speeds[r]) >= fraction * float(speeds[top])
                    or not differs(float(speeds[top]), n[top], float(speeds[r]), n[r])),
                   key=lambda r: (-float(speeds[r]), r))
    if limit is not None:
        order = order[: max(0, int(limit))]
    return tuple(sorted(order))


class HotExpertReplicator:
    """Tracks expert heat, keeps replicas on the fastest ranks with room, and keeps them equal to their owners.

    Args:
        placement: the :class:`~hetcomm.moe.placement.ExpertPlacement`.
        rank: this rank in ``group``.
        holders: group ranks that may hold replicas (the candidates: the strong ranks); the
            reductions' holders group is built over them.
        make_expert: ``make_expert(e)`` builds a module shaped like expert ``e`` (its values are
            overwritten by the owner's).
        owned: ``owned[e]`` -> this rank's module for each expert it owns.
        group: the process group (None: default; unused when ``world_size == 1``).
        num_hot: ``N``, experts replicated (default 3).
        every: ``M``, steps between hot-set refreshes.
        alpha: EMA decay of the per-expert token counts.
        powersgd_rank: PowerSGD rank of the replica-gradient sums on cross-node pairs (0: exact).
        powersgd_start: exact sums for the first reductions (PowerSGD's ``start_iter``, >= 2).
        node_ids: ``[world]`` node index of every rank of the job
            (:func:`~hetcomm.moe.powersgd.node_ids_of`); needed when ``powersgd_rank > 0``.
        initial_holders: the holders before any measurement (default: all of ``holders``).
        measured: ``measured()`` -> ``(speeds [W], room [W], noise [W])`` once the group agreed its measured
            speed (identical on every rank), else None; each hot-set refresh then re-chooses the
            holders with :func:`choose_holders`. None: the holders never change.
        ready: ``ready()`` -> whether hot sets may be chosen (the layer: its speeds have a verdict;
            identical on every rank); refreshes due before are held until it is True. None:
            from the first step.
    """

    def __init__(
        self,
        placement,
        rank: int,
        holders: Sequence[int],
        make_expert: Callable[[int], nn.Module],
        owned: Dict[int, nn.Module],
        group: Optional[dist.ProcessGroup],
        *,
        num_hot: int = 3,
        every: int = 1,
        alpha: float = 0.25,
        policy: str = "always",
        powersgd_rank: int = 0,
        powersgd_start: int = 10,
        node_ids: Optional[Sequence[int]] = None,
        initial_holders: Optional[Sequence[int]] = None,
        measured: Optional[Callable[[], Optional[Tuple[Sequence[float], Sequence[bool], Sequence[float]]]]] = None,
        ready: Optional[Callable[[], bool]] = None,
    ) -> None:
        if num_hot < 0 or num_hot > placement.num_experts:
            raise ConfigError(
                f"replicate_top={num_hot} must be in 0..{placement.num_experts} (num_experts)",
                key="moe.replicate_top",
            )
        if every < 1:
            raise ConfigError(f"replicate_every must be >= 1, got {every}", key="moe.replicate_every")
        if policy not in ("always", "profitable"):
            raise ConfigError(
                f"replicate_policy must be 'always' or 'profitable', got {policy!r}", key="moe.replicate_policy"
            )
        if not 0.0 <= alpha < 1.0:
            raise ConfigError(f"replicate_alpha must be in [0, 1), got {alpha}", key="moe.replicate_alpha")
        self.placement = placement
        self.rank = rank
        #: Ranks that may hold replicas (fixed: the holders' reduction group is built over them).
        self.candidates = tuple(sorted(set(holders)))
        #: Ranks holding replicas now: a subset of the candidates, re-chosen by measured speed.
        self.holders = self.candidates if initial_holders is None else tuple(
            sorted(set(initial_holders) & set(self.candidates)))
        self.measured = measured
        self.ready = ready
        self._held = False  # a refresh fell due before ready()
        self._pending_holders: Optional[Tuple[int, ...]] = None
        self._synced_holders: Tuple[int, ...] = self.holders
        self.make_expert = make_expert
        self.owned = owned
        self.group = group
        self.num_hot = num_hot
        self.every = every
        self.alpha = alpha
        self.policy = policy
        #: Why each expert of the last top-N was or was not replicated (``policy="profitable"``):
        #: ``{expert: (bytes saved per step, bytes spent per step)}``.
        self.last_decision: Dict[int, Tuple[float, float]] = {}
        # host: the EMA drives host decisions (the hot set, sorted in Python) once per step.
        self.ema = torch.zeros(placement.num_experts, dtype=torch.float64, device="cpu")
        #: Device of the layer's tensors; the layer sets it every forward (replicas and the
        #: weight/gradient buffers live there).
        self.device = torch.device("cpu")
        self.steps = 0
        self.hot: Tuple[int, ...] = ()
        self.replicas: Dict[int, nn.Module] = {}
        self._synced_versions: Optional[Tuple[int, ...]] = None
        self._synced_hot: Tuple[int, ...] = ()
        self.sync_bytes = 0
        self.grad_bytes = 0
        self._numel: Optional[int] = None
        self._pending_hot: Optional[Tuple[int, ...]] = None
        # Replica weights and gradients only concern the holders and the owners. When every hot
        # expert is owned by a candidate (the usual case: cold experts go to weak ranks), the two
        # per-step reductions run over the candidates alone, so they never cross a weak rank's slow
        # link (on a mixed cluster, the cross-vendor bridge). Created here because new_group is
        # collective: every rank builds the same layers in the same order. Built over the
        # candidates, not the holders of the moment: those change with measured speed, and a
        # candidate that holds nothing adds zeros.
        self.holders_group: Optional[dist.ProcessGroup] = None
        world = placement.world_size
        # Only when the layer's group is the whole job: new_group needs every process of the
        # default group, and ranks outside a sub-group never build this layer.
        if dist.is_initialized() and world > 1 and 1 < len(self.candidates) < world and dist.get_world_size() == world:
            global_holders = [
                r if group is None else dist.get_global_rank(group, r) for r in self.candidates
            ]
            self.holders_group = dist.new_group(global_holders)
        #: Rail bytes (``hetcomm.stats()``) this process sent during its gradient reductions.
        self.grad_rail_bytes: Dict[str, int] = {}
        self.grad_reductions = 0
        # Compressors of the gradient sums, one per group _reduction_group may pick.
        self.powersgd: Dict[str, SlowLinkPowerSGD] = {}
        self._powersgd_hot: Dict[str, Tuple[int, ...]] = {}
        if powersgd_rank:
            self._make_compressors(powersgd_rank, powersgd_start, node_ids, world)


    @classmethod
    def for_layer(cls, cfg, placement, rank: int, candidates: Sequence[int], make_expert: Callable[[int], nn.Module],
                  owned: Dict[int, nn.Module], group: Optional[dist.ProcessGroup], cluster, *,
                  initial_holders: Sequence[int],
                  measured: Callable[[], Optional[Tuple[Sequence[float], Sequence[bool], Sequence[float]]]],
                  ready: Optional[Callable[[], bool]] = None) -> "HotExpertReplicator":
        """The replicator of a :class:`~hetcomm.moe.MoELayer` with ``cfg`` (its
        :class:`~hetcomm.moe.layer_config.MoEConfig`): ``replicate_*`` options as the knobs,
        ``cluster``'s nodes for PowerSGD (None: no cluster), the other arguments as for the
        constructor."""
        return cls(
            placement,
            rank,
            # Copies on strong ranks only, with or without the per-step split: their
            # weight and gradient reductions then run over the candidates' group and never
            # cross a weak rank's (often cross-vendor) link; the split balances among them.
            # Which strong ranks hold them follows the measured speed once agreed.
            candidates,
            make_expert,
            owned,
            group,
            num_hot=cfg.replicate_top,
            every=cfg.replicate_every,
            alpha=cfg.replicate_alpha,
            policy=cfg.replicate_policy,
            powersgd_rank=cfg.replicate_powersgd,
            powersgd_start=cfg.replicate_powersgd_start,
            node_ids=node_ids_of(cluster, cluster.num_ranks) if cluster is not None and cfg.replicate_powersgd else None,
            initial_holders=initial_holders,  # the datasheet's choice: the prior
            measured=measured,
            ready=ready,
        )
    def _make_compressors(self, rank: int, start: int, node_ids: Optional[Sequence[int]], world: int) -> None:
        """The SlowLinkPowerSGD of each candidate reduction group (collective, like new_group)."""
        if not dist.is_initialized() or world == 1:
            return  # one rank: nothing to reduce
        if dist.get_world_size() != world:
            raise ConfigError(
                "compressed replica gradients need the layer's group to be the whole job (their node and "
                f"leader groups are made with new_group); the group has {world} of {dist.get_world_size()} "
                "ranks; set replicate_powersgd=0",
                key="moe.replicate_powersgd",
            )
        if node_ids is None:
            raise ConfigError("compressing only cross-node pairs needs the cluster's nodes; pass a cluster "
                              "to the layer or set replicate_powersgd=0", key="moe.replicate_powersgd")
        to_global = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        candidates = {"all": [to_global(r) for r in range(world)]}
        if self.holders_group is not None:
            candidates["holders"] = [to_global(r) for r in self.candidates]
        for key, members in candidates.items():  # the same order on every rank
            comp = SlowLinkPowerSGD(node_ids, matrix_approximation_rank=rank, start_iter=start, members=members)
            if comp.compresses:
                self.powersgd[key] = comp

    # -- heat --------------------------------------------------------------------------------
    def observe(self, global_picks: torch.Tensor, row_bytes: int = 0) -> None:
        """Fold one step's global picks (``[E]``, identical on all ranks) into the EMA.

        Args:
            row_bytes: bytes of one routed row on the wire (``D`` x element size); used by
                ``policy="profitable"``.
        """
        self.ema.mul_(self.alpha).add_(global_picks.double().cpu(), alpha=1.0 - self.alpha)
        self.steps += 1
        due = self._held or self.steps % self.every == 0
        self._held = due and self.ready is not None and not self.ready()
        if self.num_hot and due and not self._held:
            # Ties broken by expert id (sort is by (-ema, id)) so every rank picks the same set.
            order = sorted(range(self.ema.numel()), key=lambda e: (-float(self.ema[e]), e))
            hot = order[: self.num_hot]
            if self.policy == "profitable":
                self.last_decision = {e: self._bytes_per_step(e, row_bytes) for e in hot}
                hot = [e for e in hot if self.last_decision[e][0] > self.last_decision[e][1]]
            # Applied at the next forward (sync), never between a forward and its backward:
            # the backward must reduce the gradients of the replicas that forward used.
            self._pending_hot = tuple(hot)
            agreed = self.measured() if self.measured is not None else None
            if agreed is not None:  # the fastest candidates with room, from agreed numbers
                speeds, room, noise = agreed
                self._pending_holders = choose_holders(speeds, room, self.candidates, noise=noise)

    def _bytes_per_step(self, e: int, row_bytes: int) -> Tuple[float, float]:
        """``(saved, spent)``: all-to-all bytes a replica set of expert ``e`` saves per step, and
        the bytes its weight refresh and gradient sum move per step (both summed over ranks)."""
        world = self.placement.world_size
        owner = self.placement.owner[e]
        copies = sum(1 for h in self.holders if h != owner)
        # Picks of e that start on a holder other than the owner, each crossing twice in forward
        # (dispatch, combine) and twice in backward (their gradients).
        # The EMA starts at zero: divide by (1 - alpha^steps) for its unbiased mean (as Adam does).
        picks = float(self.ema[e]) / (1.0 - self.alpha**self.steps) if self.steps else 0.0
        saved = picks * copies / world * row_bytes * 4
        members = copies + 1
        spent = 2.0 * 2 * (members - 1) * self._param_numel() * 4  # FP32 buffers, see sync()
        return saved, spent

    @property
    def next_hot(self) -> Tuple[int, ...]:
        """The hot set the next forward replicates: a decision taken at the last :meth:`observe`
        (applied at the next forward) or else the current one. What a checkpoint saves."""
        return self._pending_hot if self._pending_hot is not None else self.hot

    def set_hot(self, experts: Sequence[int], holders: Optional[Sequence[int]] = None) -> None:
        """Replicate exactly ``experts`` from the next forward on, on ``holders`` (default: the
        current ones; both must be equal on all ranks; holders outside the candidates are ignored).
        Replaces any decision still pending from :meth:`observe` or :meth:`adopt_placement` (a
        restored placement adopted before a checkpoint's hot set is set must not empty it again
        at the next forward)."""
        self._pending_hot = None
        if holders is None and self._pending_holders is not None:
            holders = self._pending_holders
        self._pending_holders = None
        hot = tuple(sorted(int(e) for e in experts))
        new_holders = self.holders if holders is None else tuple(sorted(set(int(r) for r in holders) & set(self.candidates)))
        if hot == self.hot and new_holders == self.holders:
            return
        self.hot, self.holders = hot, new_holders
        wanted = {e for e in hot if self.rank in self.holders and self.placement.owner[e] != self.rank}
        # A replica that leaves the hot set becomes one that joins it: the layer builds every
        # expert alike, and the refresh before its next use overwrites its values. A hot set that
        # moves every step then builds (and initialises) no module.
        spare = [self.replicas.pop(e) for e in sorted(self.replicas) if e not in wanted]
        for e in sorted(wanted):
            if e not in self.replicas:
                m = spare.pop() if spare else self.make_expert(e).to(self.device)
                for p in m.parameters():
                    p.requires_grad_(True)
                self.replicas[e] = m
        self._synced_hot = ()  # the next sync refreshes, even if the set came back to the synced one

    def adopt_placement(self, placement, owned: Dict[int, nn.Module]) -> None:
        """Experts changed owners (:mod:`hetcomm.moe.placement.migration`): drop every replica and rebuild
        the current hot set's replicas, with a forced weight sync, at the next forward."""
        self.placement = placement
        self.owned = owned
        pending = self._pending_hot if self._pending_hot is not None else self.hot
        if self._pending_holders is None:
            self._pending_holders = self.holders
        self.hot, self._synced_hot = (), ()
        self.replicas.clear()
        self._pending_hot = pending

    def replica_here(self) -> torch.Tensor:
        """``[E]`` bool: experts this rank computes on a local replica."""
        mask = torch.zeros(self.placement.num_experts, dtype=torch.bool, device=self.device)
        for e in self.replicas:
            mask[e] = True
        return mask

    def holders_of_hot(self) -> Dict[int, Tuple[int, ...]]:
        """Hot expert -> every rank with a copy of it (its owner and the replica holders),
        ascending; identical on every rank (the per-step split, :mod:`hetcomm.moe.token_split`)."""
        return {e: tuple(sorted({self.placement.owner[e], *self.holders})) for e in self.hot}

    @property
    def extra_bytes(self) -> int:
        """Bytes of replica parameters held on this rank (plus as much again for their grads)."""
        return sum(p.numel() * p.element_size() for m in self.replicas.values() for p in m.parameters())

    # -- weights -----------------------------------------------------------------------------
    def _param_numel(self) -> int:
        if self._numel is None:
            probe = next(iter(self.owned.values()), None)
            if probe is None:  # this rank owns no expert: build one to learn the shapes
                probe = self.make_expert(self.hot[0] if self.hot else 0)
            self._numel = sum(p.numel() for p in probe.parameters())
            self._shapes = [tuple(p.shape) for p in probe.parameters()]
        return self._numel

    def _check_shapes(self, m: nn.Module, e: int) -> None:
        shapes = [tuple(p.shape) for p in m.parameters()]
        if shapes != self._shapes:
            raise ConfigError(
                f"hot-expert replication needs experts with identical parameter shapes; expert "
                f"{e} has {shapes}, others {self._shapes}; turn replication off for this layer",
                key="moe.replicate",
            )

    def _reduction_group(self, hot: Tuple[int, ...]):
        """``(group, member)``: the group the replica reductions of ``hot`` run over, and
        whether this rank takes part. Every rank computes the same answer from the agreed hot set."""
        if self.holders_group is not None and all(self.placement.owner[e] in self.candidates for e in hot):
            return self.holders_group, self.rank in self.candidates
        return self.group, True

    def _versions(self) -> Tuple[int, ...]:
        return tuple(
            p._version for e in self.hot if e in self.owned for p in self.owned[e].parameters()
        )

    @torch.no_grad()
    def sync(self, force: bool = False, carry: Optional[List[torch.Tensor]] = None) -> bool:
        """Bring every replica to its owner's current values if anything changed.

        Collective: every rank of the group must call it at the same point (the layer does, at
        the start of each forward). Returns True when weights were copied.

        Args:
            force: refresh whether or not anything changed. Every rank must pass the same value:
                forced, the group skips the all-reduce that asks whether any rank changed (its
                answer could only be yes), one small collective fewer per call (the
                training loop refreshes after every optimizer step, when the owners' weights
                have moved anyway). A refresh of unchanged weights copies the same values.
            carry: float32 tensors (passed by every rank, in the same shapes) to sum over the
                whole group in the refresh's all-reduce instead of one of their own (the training
                loop's loss). Only a refresh that runs over the layer's whole group takes
                them; it sums them in place and empties the list, so the caller reduces what is
                left itself. Every element of the refresh buffer is one owner's value plus
                zeros, exact in any order, so its values do not depend on the extra length.
        """
        if self._pending_hot is not None:
            self.set_hot(self._pending_hot, self._pending_holders)
            self._pending_hot = self._pending_holders = None
        if not self.hot:
            return False
        P = self._param_numel()
        group, member = self._reduction_group(self.hot)
        if not member:
            # Not a candidate and owner of none of the hot experts: nothing to send or receive.
            self._synced_hot, self._synced_holders = self.hot, self.holders
            return False
        # New holders need the owners' weights too (their replicas were just built).
        changed = (force or self.hot != self._synced_hot or self.holders != self._synced_holders
                   or self._versions() != self._synced_versions)
        if not force and dist.is_initialized() and self.placement.world_size > 1:
            flag = torch.tensor([1 if changed else 0], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            changed = bool(flag.item())
        if not changed:
            return False
        distributed = dist.is_initialized() and self.placement.world_size > 1
        riders = list(carry) if carry and distributed and group is self.group else []
        # One buffer for the weights and the riders' tail: the riders cost no copy of the weights.
        size = len(self.hot) * P + sum(t.numel() for t in riders)
        flat = torch.zeros(size, dtype=torch.float32, device=self.device)
        buf = flat[: len(self.hot) * P].view(len(self.hot), P)
        for i, e in enumerate(self.hot):
            if e in self.owned:
                self._check_shapes(self.owned[e], e)
                params = list(self.owned[e].parameters())
                torch.cat([p.detach().float().reshape(-1) for p in params], out=buf[i])
        if distributed:
            off = buf.numel()
            for t in riders:
                flat[off : off + t.numel()].copy_(t.reshape(-1))
                off += t.numel()
            dist.all_reduce(flat, group=group)
            off = buf.numel()
            for t in riders:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()
            if riders:
                carry.clear()
            self.sync_bytes += buf.numel() * buf.element_size()
        for i, e in enumerate(self.hot):
            if e in self.replicas:
                off = 0
                for p in self.replicas[e].parameters():
                    n = p.numel()
                    p.copy_(buf[i, off : off + n].view_as(p))
                    off += n
        self._synced_hot = self.hot
        self._synced_holders = self.holders
        self._synced_versions = self._versions()
        return True

    # -- gradients ---------------------------------------------------------------------------
    def grad_reducer(self) -> Callable[[], None]:
        """A callable that reduces the gradients of the replicas in use *now* (snapshot)."""
        hot, replicas = self.hot, dict(self.replicas)
        return lambda: self.reduce_grads(hot, replicas)

    @torch.no_grad()
    def reduce_grads(self, hot: Optional[Tuple[int, ...]] = None, replicas: Optional[Dict[int, nn.Module]] = None) -> None:
        """Sum every replica's gradient into its owner's gradient; clear the replicas' grads.

        Collective (the layer queues it at the end of backward on every rank).

        Args:
            hot: the hot set of the forward being differentiated (default: the current one).
            replicas: the replica modules that forward used (default: the current ones).
        """
        hot = self.hot if hot is None else hot
        replicas = self.replicas if replicas is None else replicas
        if not hot:
            return
        group, member = self._reduction_group(hot)
        if not member:
            return  # holds no replica and owns none of these experts
        P = self._param_numel()
        buf = torch.zeros(len(hot), P, dtype=torch.float32, device=self.device)
        for i, e in enumerate(hot):
            if e in replicas:
                off = 0
                for p in replicas[e].parameters():
                    n = p.numel()
                    if p.grad is not None:
                        buf[i, off : off + n].copy_(p.grad.reshape(-1))
                        p.grad = None
                    off += n
        if dist.is_initialized() and self.placement.world_size > 1:
            rails0 = rail_bytes_sent()
            comp_key = "holders" if group is not None and group is self.holders_group else "all"
            comp = self.powersgd.get(comp_key)
            if comp is None:
                dist.all_reduce(buf, group=group)
            else:
                self._compressed_sum(comp_key, comp, hot, buf)
            self.grad_bytes += buf.numel() * buf.element_size()
            self.grad_reductions += 1
            for rail, b in rail_bytes_sent().items():
                self.grad_rail_bytes[rail] = self.grad_rail_bytes.get(rail, 0) + b - rails0.get(rail, 0)
        for i, e in enumerate(hot):
            if e in self.owned:
                off = 0
                for p in self.owned[e].parameters():
                    n = p.numel()
                    g = buf[i, off : off + n].view_as(p).to(p.dtype)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.add_(g)
                    off += n

    def _compressed_sum(self, key: str, comp: SlowLinkPowerSGD, hot: Tuple[int, ...], buf: torch.Tensor) -> None:
        """``buf`` (``[len(hot), P]`` float32) summed over ``comp``'s members in place, each
        expert's parameters as the matrices PowerSGD compresses."""
        P = buf.shape[1]
        old = self._powersgd_hot.get(key)
        if old is not None and old != hot:  # the bucket's rows follow the hot set
            comp.remap_rows([old.index(e) if e in old else None for e in hot], P)
        self._powersgd_hot[key] = hot
        views = []
        for i in range(len(hot)):
            off = 0
            for shape in self._shapes:
                n = int(torch.Size(shape).numel())
                views.append(buf[i, off : off + n].view(shape))
                off += n
        comp.all_reduce(views, average=False)

    def powersgd_state(self) -> Dict[str, object]:
        """The compressors' error feedback and warm-start factors (this rank's), for checkpoints."""
        return {key: {"comp": c.state_dict(), "hot": list(self._powersgd_hot.get(key, ()))}
                for key, c in self.powersgd.items()}

    def load_powersgd_state(self, sd: Dict[str, object]) -> None:
        for key, c in self.powersgd.items():
            if key in sd:
                c.load_state_dict(sd[key]["comp"])
                if sd[key]["hot"]:
                    self._powersgd_hot[key] = tuple(int(e) for e in sd[key]["hot"])

    def local_modules(self, experts: Sequence[int]) -> List[nn.Module]:
        """The replica modules of ``experts`` (all must be replicated here)."""
        return [self.replicas[e] for e in experts]

    def compute_local(self, x: torch.Tensor, route, key_of_expert: torch.Tensor, bank) -> torch.Tensor:
        """Compute the token copies the layer routed to replicas held here.

        Args:
            x: ``[T, D]`` the layer's tokens, any float dtype.
            route: the forward's :class:`~hetcomm.moe.routing.Routing`; its ``local_assign``
                (``[n]`` int64 copy indices, grouped by expert in ``key_of_expert`` order) and
                ``local_expert`` (``[n]`` their experts), ``n > 0``.
            key_of_expert: ``[E]`` int64 the dispatch order of each expert.
            bank: an :class:`~hetcomm.moe.experts.ExpertBank` (its ``forward_sorted`` runs them).
        Returns:
            ``[n, D]`` outputs in ``route.local_assign`` order, ``x.dtype``.
        """
        from hetcomm.moe.routing import gather_rows

        T = x.size(0)
        xs = gather_rows(x, route.local_assign % T)
        counts = torch.bincount(route.local_expert, minlength=key_of_expert.numel())
        order = sorted(set(route.local_expert.tolist()), key=lambda e: int(key_of_expert[e]))
        return bank.forward_sorted(xs, [int(counts[e]) for e in order], modules=self.local_modules(order))
