"""Which heterogeneity levers are on, and why: one record decided from agreed inputs.

The levers of an MoE job on unequal ranks, each with its rule (:func:`decide`):

=================  =======================================================================================
lever              on when
=================  =======================================================================================
initial_weights    more than one rank, not ``--no-balance`` (speed-blind: equal contiguous shares), and
                   either ``oracle`` speeds (shares by them) or a cluster whose ranks differ (strong flags,
                   device models or datasheet speeds): the first placement gives the strong ranks more experts.
replica_holders    replication on and more than one rank: hot experts are copied onto the strong ranks
                   with room, re-chosen by the agreed measured speed (by the datasheet's strong flags
                   when speeds are not measured; by the oracle's speeds with ``oracle``).
token_split        ``token_split`` True, or ``auto`` once the agreed speed verdict says the ranks differ
                   (measured beyond noise, or the given speeds) and, when measured, the experts are at
                   least :data:`SPLIT_MIN_EXPERT_SHARE` of a rank's MoE forward (:func:`expert_share`);
                   balancing not off; needs replication, more than one rank and no paging. Device
                   labels alone never turn it on.
migrations         ``balance`` True (``--balance``) and more than one rank: the expert balancer moves
                   experts by measured speed.
cold_placement     ``balance`` auto, speeds measured (or given as true, ``oracle``), more than one rank,
                   no paging, no replica PowerSGD, and the agreed verdict not "equal": once per layer
                   the experts are re-placed to even the measured busy time, the slow ranks keeping
                   fewer, the coldest (:mod:`hetcomm.moe.cold`).
chunks             ``chunks`` > 1, or ``auto`` on a CUDA/NPU device (measured at the start).
paging             a page budget above 0.
=================  =======================================================================================

Every input is the same on every rank (the flags, the cluster file, the world size and the agreed
speed verdict), so the record is too: a decision taken from it never needs another message.

The verdict ``differ`` (the agreed speed vector says the ranks differ beyond noise; None before
the first agreement) is read in one place, :func:`speed_verdict`; the experts' share of the MoE
forward in one, :func:`expert_share`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional, Sequence, Tuple, Union

from hetcomm.errors import ConfigError

__all__ = ["Lever", "PolicyInputs", "Policy", "decide", "policy_of_layers", "cluster_is_mixed", "cluster_kind",
           "speed_verdict", "expert_share", "LEVERS", "SPEEDS", "SPLIT_MIN_EXPERT_SHARE"]

#: Where rank speeds come from: measured on each rank and agreed; the datasheet's, fixed (every
#: decision depends on the data alone); given and taken as true (an emulation's known speeds).
SPEEDS = ("measured", "datasheet", "oracle")
#: The levers, in the order the record prints them.
LEVERS = ("initial_weights", "replica_holders", "token_split", "migrations", "cold_placement", "chunks", "paging")
#: The split evens expert time at the price of a blocking count exchange per layer and step and of
#: copies that travel instead of staying with a local replica; where expert compute is less than
#: this share of a rank's MoE forward there is too little to even (the jobs on either side of it:
#: benchmarks/README.md, het_testbed.py and moe_workloads_layer.py).
SPLIT_MIN_EXPERT_SHARE = 0.25


@dataclass(frozen=True)
class Lever:
    """One lever's setting: ``on`` and a short sentence saying why."""

    on: bool
    reason: str

    def __str__(self) -> str:
        return ("on" if self.on else "off") + f" ({self.reason})"


@dataclass(frozen=True)
class PolicyInputs:
    """What the levers are decided from (identical on every rank).

    Attributes:
        world_size: ranks in the expert-parallel group.
        cluster_kind: ``"none"`` (no cluster file), ``"equal"`` (one kind of rank), ``"strong"``
            (ranks differ only in the strong flag) or ``"mixed"`` (device models or datasheet
            speeds differ: :func:`cluster_is_mixed`).
        balance: True (``--balance``), False (``--no-balance``) or ``"auto"``.
        speed: one of :data:`SPEEDS`.
        replicate: hot-expert replication.
        page_budget: expert paging's budget fraction (0: off; ``"auto"``: decided by the layer).
        powersgd_experts: PowerSGD rank of the replicas' gradient sums (0: exact).
        token_split: True, False or ``"auto"``.
        chunks: pipelined dispatch chunks, or ``"auto"``.
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        differ: the agreed speed verdict: True (the ranks differ), False (equal within noise),
            None (not agreed yet).
        expert_share: the largest share of a rank's MoE forward spent in expert compute (every
            layer; :func:`expert_share`), or None: not measured (yet).
    """

    world_size: int
    cluster_kind: str = "none"
    balance: Union[bool, str] = "auto"
    speed: str = "measured"
    replicate: bool = True
    page_budget: Union[float, str] = 0.0
    powersgd_experts: int = 0
    token_split: Union[bool, str] = "auto"
    chunks: Union[int, str] = "auto"
    device_type: str = "cpu"
    differ: Optional[bool] = None
    expert_share: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"must be a positive whole number, got {self.world_size!r}", key="policy.world_size")
        if self.balance not in (True, False, "auto"):
            raise ConfigError(f"must be true, false or 'auto', got {self.balance!r}", key="policy.balance")
        if self.speed not in SPEEDS:
            raise ConfigError(f"must be one of {', '.join(SPEEDS)}, got {self.speed!r}", key="policy.speed")
        if self.token_split not in (True, False, "auto"):
            raise ConfigError(f"must be true, false or 'auto', got {self.token_split!r}", key="policy.token_split")
        if self.cluster_kind not in ("none", "equal", "strong", "mixed"):
            raise ConfigError(f"must be none, equal, strong or mixed, got {self.cluster_kind!r}",
                              key="policy.cluster_kind")


@dataclass(frozen=True)
class Policy:
    """The levers of one job (:func:`decide`), and the inputs they were decided from.

    Attributes:
        inputs: what :func:`decide` read.
        num_chunks: the chunk count to build the layers with, or None: measure it at the start.
    """

    inputs: PolicyInputs
    initial_weights: Lever
    replica_holders: Lever
    token_split: Lever
    migrations: Lever
    cold_placement: Lever
    chunks: Lever
    paging: Lever
    num_chunks: Optional[int]

    def levers(self) -> List[Tuple[str, Lever]]:
        """``(name, lever)`` in :data:`LEVERS` order."""
        return [(name, getattr(self, name)) for name in LEVERS]

    def rows(self) -> List[Tuple[str, str]]:
        """Summary rows: ``("policy: <lever>", "on (why)")``."""
        return [(f"policy: {name.replace('_', ' ')}", str(lever)) for name, lever in self.levers()]

    def line(self) -> str:
        """One line for a metrics event: ``lever on|off (why); ...`` and the verdict."""
        verdict = {None: "not agreed yet", True: "ranks differ", False: "ranks equal"}[self.inputs.differ]
        return "; ".join(f"{n} {lv}" for n, lv in self.levers()) + f"; speed verdict: {verdict}"

    def with_verdict(self, differ: Optional[bool], share: Optional[float] = None) -> "Policy":
        """The policy re-decided with the agreed speed verdict ``differ`` and the experts' share
        of the MoE forward ``share`` (:func:`expert_share`; None keeps the one decided with),
        self when no lever changes."""
        share = self.inputs.expert_share if share is None else share
        if differ == self.inputs.differ and share == self.inputs.expert_share:
            return self  # the inputs of this record (decide is pure): no decision to take each step
        again = decide(replace(self.inputs, differ=differ, expert_share=share))
        # A share that moves without moving a lever is not a new decision (no event, same reasons).
        same = differ == self.inputs.differ and [lv.on for _, lv in again.levers()] == [lv.on for _, lv in self.levers()]
        return self if same else again


def cluster_is_mixed(cluster: Any, world_size: int) -> bool:
    """More than one device model among the first ``world_size`` ranks, or datasheet speeds
    (:func:`hetcomm.topo.compute.rank_speeds`) that differ by the one rule
    (:func:`hetcomm.moe.speed.speeds_differ`; datasheet figures are exact: no noise)."""
    from hetcomm.moe.speed import speeds_differ
    from hetcomm.topo.compute import rank_speeds

    models = {cluster.rank(r).model for r in range(world_size)}
    return len(models) > 1 or speeds_differ(rank_speeds(cluster, range(world_size)))


def cluster_kind(cluster: Any, world_size: int) -> str:
    """``none``, ``equal``, ``strong`` or ``mixed`` (:class:`PolicyInputs`) for ``cluster``."""
    if cluster is None:
        return "none"
    if cluster_is_mixed(cluster, world_size):
        return "mixed"
    strong = set(cluster.strong_ranks)
    return "strong" if 0 < len(strong & set(range(world_size))) < world_size else "equal"


def speed_verdict(meters: Sequence[Any]) -> Optional[bool]:
    """The agreed verdict of the layers' speed meters: None until every meter has one
    (:attr:`hetcomm.moe.speed.SpeedSnapshot.differ`: some rank slower than another beyond noise,
    the one rule the cold move places by), then whether any of them says the ranks differ. A
    meter that never measures (``every == 0``) holds given speeds: its verdict is theirs from the
    start. Identical on every rank (agreed values only)."""
    verdicts = [m.differ for m in meters]
    if not verdicts or any(v is None for v in verdicts):
        return None
    return any(verdicts)


def expert_share(meters: Sequence[Any]) -> Optional[float]:
    """The largest share of a rank's MoE forward spent in expert compute, from the layers' agreed
    speed snapshots: per rank, the busy expert seconds per forward summed over layers, over the
    layers' forward wall seconds summed; the maximum over ranks. A layer's forward is where the
    split both costs (its blocking count exchange, travelling copies) and saves (the rows it
    moves off slow ranks). None until every meter agreed measurements with forward times.
    Identical on every rank (agreed values)."""
    snaps = [m.agreed for m in meters]
    if not snaps or not all(s.measured and s.forward_seconds and all(t > 0 for t in s.forward_seconds) for s in snaps):
        return None
    ranks = range(len(snaps[0].forward_seconds))
    return round(max(sum(s.seconds_per_step[r] for s in snaps) / sum(s.forward_seconds[r] for s in snaps)
                     for r in ranks), 3)


def decide(inputs: PolicyInputs) -> Policy:
    """Every lever from ``inputs`` (pure: the same inputs give the same record on every rank)."""
    x = inputs
    multi = x.world_size > 1
    paging = x.page_budget == "auto" or float(x.page_budget) > 0
    off = x.balance is False

    if not multi:
        weights = Lever(False, "one rank: it holds every expert")
    elif off:
        weights = Lever(False, "--no-balance: speed-blind, equal contiguous expert shares")
    elif x.speed == "oracle":
        weights = Lever(True, "the given (oracle) speeds weigh each rank's expert share")
    elif x.cluster_kind == "none":
        weights = Lever(False, "no cluster file: every rank counts as equal")
    elif x.cluster_kind == "equal":
        weights = Lever(False, "the cluster's ranks are alike: equal expert shares")
    else:
        weights = Lever(True, "the cluster's strong ranks start with more experts")

    if not x.replicate:
        holders = Lever(False, "replication is off")
    elif not multi:
        holders = Lever(False, "one rank: nowhere to copy to")
    elif off:
        holders = Lever(True, "hot experts copied onto the strong ranks, never re-chosen by speed (--no-balance)")
    elif x.speed == "measured":
        holders = Lever(True, "hot experts copied onto the strong ranks with room, re-chosen by measured speed")
    else:
        holders = Lever(True, f"hot experts copied onto the strong ranks, chosen by the {x.speed} speeds")

    if x.token_split is False:
        split = Lever(False, "--token-split off")
    elif not x.replicate or not multi:
        split = Lever(False, "needs replicas on more than one rank to split among")
    elif paging:
        split = Lever(False, "not with paging (a split row could fault on a paged-out copy)")
    elif x.token_split is True:
        split = Lever(True, "asked for: hot experts' rows split among their copies by speed")
    elif off:
        split = Lever(False, "--no-balance")
    elif x.differ is None:
        split = Lever(False, "auto: waits for the agreed speeds")
    elif not x.differ:
        split = Lever(False, "auto: the agreed speeds are equal, equal rows are equal time")
    elif x.expert_share is None:  # given speeds: nothing measured to weigh the split against
        split = Lever(True, "auto, the agreed speeds differ: hot experts' rows split among their copies by speed")
    elif x.expert_share < SPLIT_MIN_EXPERT_SHARE:
        split = Lever(False, f"auto: the speeds differ, but experts are {x.expert_share:.0%} of the MoE "
                             f"forward (< {SPLIT_MIN_EXPERT_SHARE:.0%}): too little to even")
    else:
        split = Lever(True, f"auto: the speeds differ, experts are {x.expert_share:.0%} of the MoE forward: "
                            "hot rows split among copies by speed")

    if x.balance is not True:
        migrations = Lever(False, "--no-balance" if off else
                           "only with --balance: noisy measured speeds of equal ranks drove costly moves")
    elif not multi:
        migrations = Lever(False, "one rank: nowhere to move to")
    else:
        migrations = Lever(True, "--balance: the expert balancer moves experts by measured speed")

    cold = _cold(x, multi, paging)

    if x.chunks != "auto":
        n = int(x.chunks)
        chunks = Lever(n > 1, f"given: {n} chunk{'s' if n != 1 else ''}")
        num_chunks: Optional[int] = n
    elif x.device_type == "cpu":
        chunks = Lever(False, "auto on CPU ranks: chunking measured slower there")
        num_chunks = 1
    else:
        chunks = Lever(True, f"auto on {x.device_type}: 1, 2 or 4 chunks measured at the start")
        num_chunks = None

    if x.page_budget == "auto":
        page = Lever(True, "auto: pages only where the experts do not fit the device")
    elif paging:
        page = Lever(True, f"budget {float(x.page_budget):g} of each rank's experts on the device, the rest in host memory")
    else:
        page = Lever(False, "every expert stays on its device")

    return Policy(x, weights, holders, split, migrations, cold, chunks, page, num_chunks)


def _cold(x: PolicyInputs, multi: bool, paging: bool) -> Lever:
    if x.balance is True:
        return Lever(False, "--balance: the balancer owns the expert map")
    if x.balance is False:
        return Lever(False, "--no-balance")
    if x.speed == "datasheet":
        return Lever(False, "datasheet speeds: nothing measured to place by")
    if not multi:
        return Lever(False, "one rank: nowhere to move to")
    if paging:
        return Lever(False, "not with paging")
    if x.powersgd_experts:
        return Lever(False, "not with replica PowerSGD (its error feedback follows the replicas' rows)")
    if x.differ is None:
        return Lever(True, "waits for the agreed speeds, then evens the measured busy time once per layer")
    if x.differ:
        return Lever(True, "the agreed speeds differ: experts re-placed once per layer to even the measured busy time")
    return Lever(False, "the agreed speeds are equal: nothing to move")


def policy_of_layers(layers: Sequence[Any], balance: Union[bool, str] = "auto", speed: Optional[str] = None) -> Policy:
    """The policy the layers' own configuration implies (for a user's loop without flags):
    their cluster, group size, replication, paging, split, chunks and whether they measure
    speed, with the agreed verdict so far.

    Args:
        layers: the model's :class:`~hetcomm.moe.MoELayer` s.
        balance: as ``hetcomm train --balance`` (the migration balancer is ``hetcomm train``'s).
        speed: one of :data:`SPEEDS`; None: ``measured`` when the layers measure
            (``speed_every > 0``), else ``datasheet``. ``oracle``: the layers' prior (the cluster's
            ``device.tflops``, kept with ``speed_every=0``) is the truth the speed levers act on.
    """
    if not layers:
        raise ConfigError("no MoE layers to decide a policy for: pass the model that holds them", key="policy.layers")
    first = layers[0]
    cfg = first.config
    params = list(first.parameters())
    inputs = PolicyInputs(
        world_size=first.world_size,
        cluster_kind=cluster_kind(first.cluster, first.world_size) if first.cluster is not None else "none",
        balance=balance,
        speed=speed if speed is not None else ("measured" if cfg.speed_every > 0 else "datasheet"),
        replicate=cfg.replicate,
        page_budget=cfg.page_budget,
        powersgd_experts=cfg.replicate_powersgd,
        token_split=cfg.token_split,
        chunks=cfg.num_chunks,
        device_type=params[0].device.type if params else "cpu",
        differ=speed_verdict([m.speed for m in layers]),
        expert_share=expert_share([m.speed for m in layers]),
    )
    return decide(inputs)
