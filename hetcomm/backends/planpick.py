"""Which path an ``all_to_all_single`` takes: the direct route or a planned one.

With ``plan="adaptive"`` (the default) a group asks the planner (``hetcomm.sched.planner``) and
runs a staged plan (``hier`` / ``multirail``) only where the cost model (``hetcomm.sched.simulate``)
predicts it at least :data:`MIN_GAIN` faster than the direct path (the ``flat`` plan, which is
what the direct route does); otherwise the call takes the direct route. A pinned plan
(``direct``, ``auto``, ``flat``, ``hier``, ``multirail``; ``HETCOMM_PLAN`` / ``pg_options``) is
taken as it is.

Notation (as in ``hetcomm.sched.plan``): ``n`` ranks of the group, ``T[i][j]`` bytes group rank
i sends to group rank j.

**Any group.** The planner works on a cluster whose rank ``k`` is group rank ``k``
(:func:`group_cluster`): the whole cluster for the default group, else a sub-cluster with one
node per node the group touches, holding as many devices as the group has ranks there (an
expert-parallel group of a larger job: its ranks' nodes, fabrics and NIC ports). A group whose
ranks are not node by node in group-rank order (only a hand-made rank order can do that;
``new_group`` sorts its ranks) or that has no cluster has no planner: it takes the direct route.

**Agreement.** Every input of the decision is the same on every rank: the split matrix
(exchanged in every planned call, the same ``n`` vectors on every rank), the cluster (agreed
by content hash at group creation), the placement (agreed) and the cost model's rate scale
(``plan_model``, agreed too). Decisions are pure functions of those, so every rank runs the same
path; a rank-divergent choice would deadlock (each side posting a different stage's transfers).

**Cached per shape class.** A decision is made once per *shape class* of the traffic: every
off-diagonal ``T[i][j]`` rounded to a half octave (``0`` stays ``0``), and is taken on the class's
representative matrix, not on the call's own bytes, so it depends on the class alone. The plan
itself is built from the call's real bytes (it must cover them), cached for the last
:data:`_PLANS_KEPT` distinct matrices.

**Conservative.** The simulator models links, not the executor: every stage of a plan ends
with a wait for all of its transfers, a fixed software cost per stage that a one-step direct
call does not pay. Measured on the emulated 8-rank cluster here, a pinned ``hier`` (4 stages)
was 2.3x slower than direct at 256 B per pair where the simulator predicted 0.8x
(``benchmarks/README.md``, ``planned_default.py``). So the
decision charges every stage after the first ``HETCOMM_PLAN_STAGE_US`` (default 500 us); the
simulator's own predictions (``hetcomm simulate``) do not include it.

**Gate.** A group is *eligible* only if it spans two or more nodes and the model predicts the gain
for uniform traffic at some size in :data:`GATE_PAIR_BYTES`. Eligible groups exchange the split
matrix on every call (with the split check on, the default, that exchange happens anyway); the
others never do and always take the direct route.

The planner is not torch's: torch.distributed has no all-to-all planner; NCCL's PXN is the
closest idea and is internal to NCCL (one vendor).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hetcomm import settings
from hetcomm.backends.rank_placement import Placement
from hetcomm.topo.cluster import Cluster, NodeGroup

__all__ = ["PlanChooser", "group_cluster", "scaled_cluster", "plan_model", "MIN_GAIN", "GATE_PAIR_BYTES"]

#: A staged plan runs only when predicted at least this much faster than the direct path
#: (``t_plan <= (1 - MIN_GAIN) * t_direct``).
MIN_GAIN = 0.10
#: Per-pair bytes of the uniform matrices that decide whether a group is eligible at all.
GATE_PAIR_BYTES: Tuple[int, ...] = (1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 24)
_STAGED = ("hier", "multirail")
_PLANS_KEPT = 8
_CLASSES_KEPT = 4096


def plan_model() -> str:
    """The decision model's inputs from the environment, as text for the agreement: the rate
    scale (``nominal``, or ``scale=<s>`` under ``hetcomm emulate``: network and bridge rates
    scaled as the emulated links are) and the per-stage cost (``HETCOMM_PLAN_STAGE_US``)."""
    scale = settings.EMULATE_SCALE.get()
    rates = "nominal" if scale is None else f"scale={scale!r}"
    return f"{rates};stage_us={settings.PLAN_STAGE_US.get()!r}"


def scaled_cluster(cluster: Cluster, scale: float) -> Cluster:
    """``cluster`` with every NIC port and the cross-vendor bridge at ``scale`` x their rate
    (fabrics inside a node unchanged): the links ``hetcomm emulate`` shapes."""
    groups = tuple(
        dataclasses.replace(g, nics=tuple(dataclasses.replace(n, gbps=n.gbps * scale) for n in g.nics))
        for g in cluster.groups
    )
    ic = dataclasses.replace(cluster.interconnect, cross_vendor_gbps=cluster.interconnect.cross_vendor_gbps * scale)
    return dataclasses.replace(cluster, groups=groups, interconnect=ic, name=f"{cluster.name}-x{scale:g}")


def group_cluster(placement: Placement) -> Optional[Cluster]:
    """The cluster whose rank ``k`` is group rank ``k``, or None (no cluster, or the group's ranks
    are not node by node in group-rank order).

    The default group gets its cluster as it is; a subgroup a sub-cluster: one single-node group
    per node it touches, in group-rank order, with that node's device model, fabric and ports and
    as many devices as the group has ranks there.
    """
    cluster = placement.cluster
    if cluster is None:
        return None
    globals_ = [p.global_rank for p in placement.ranks]
    if globals_ == list(range(cluster.num_ranks)):
        return cluster
    runs: List[Tuple[int, int]] = []  # (node index, ranks of the group on it)
    for g in globals_:
        node = cluster.node_of(g).index
        if runs and runs[-1][0] == node:
            runs[-1] = (node, runs[-1][1] + 1)
        elif any(r[0] == node for r in runs):
            return None  # the node's ranks are not contiguous in group order
        else:
            runs.append((node, 1))
    nodes = cluster.nodes
    groups = []
    for node, count in runs:
        g: NodeGroup = nodes[node].group
        numa = max(1, min(g.numa_nodes, count))
        nics = tuple(
            dataclasses.replace(n, numa=None if n.numa is None else tuple(min(x, numa - 1) for x in n.numa))
            for n in g.nics
        )
        groups.append(dataclasses.replace(g, name=nodes[node].name, count=1, devices_per_node=count, numa_nodes=numa, nics=nics))
    return dataclasses.replace(cluster, groups=tuple(groups), name=f"{cluster.name}[{len(globals_)} ranks]", path=None)


def shape_class(traffic: np.ndarray) -> np.ndarray:
    """``[n, n]`` uint8: 0 where ``T[i][j] == 0`` (and on the diagonal), else ``1 + round(2 log2 T)``."""
    t = np.asarray(traffic, dtype=np.float64)
    out = np.zeros(t.shape, np.uint8)
    nz = t > 0
    out[nz] = 1 + np.rint(2.0 * np.log2(t[nz])).astype(np.int64)
    np.fill_diagonal(out, 0)
    return out


def representative(cls: np.ndarray) -> np.ndarray:
    """The bytes a shape class stands for: ``2 ** ((c - 1) / 2)`` per nonzero entry."""
    c = cls.astype(np.float64)
    return np.where(cls > 0, np.rint(np.exp2((c - 1.0) / 2.0)), 0).astype(np.int64)


class PlanChooser:
    """The plan decisions of one group (same answers on every rank: see the module docstring).

    Args:
        placement: the group's placement (its cluster, global ranks).
        strategy: the group's ``plan`` option.
    """

    def __init__(self, placement: Placement, strategy: str):
        self.strategy = strategy
        base = group_cluster(placement) if strategy != "direct" else None
        scale = settings.EMULATE_SCALE.get()
        #: The cluster the planner and the cost model see (None: direct route only).
        self.cluster: Optional[Cluster] = None if base is None or scale is None else scaled_cluster(base, scale)
        if self.cluster is None:
            self.cluster = base
        #: seconds charged per stage after the first (HETCOMM_PLAN_STAGE_US)
        self.stage_s = settings.PLAN_STAGE_US.get() * 1e-6
        self._eligible: Optional[bool] = None
        #: shape class (bytes of the uint8 matrix) -> (strategy or None, predicted s of direct, of it)
        self.decisions: "OrderedDict[bytes, Tuple[Optional[str], float, float]]" = OrderedDict()
        self._plans: "OrderedDict[Tuple[str, bytes], object]" = OrderedDict()
        #: calls per path taken (``direct``, ``hier``, ...) on this rank
        self.taken: Dict[str, int] = {}

    # -- what the group may do --------------------------------------------------------------
    @property
    def needs_traffic(self) -> bool:
        """Whether calls must exchange the split matrix (a plan may run)."""
        if self.cluster is None or self.strategy == "direct":
            return False
        if self.strategy != "adaptive":
            return True
        return self.eligible

    @property
    def eligible(self) -> bool:
        """``adaptive`` only: two or more nodes, and a gain predicted for some uniform size."""
        if self._eligible is None:
            c = self.cluster
            ok = c is not None and c.num_nodes >= 2
            if ok:
                n = c.num_ranks
                ok = any(self._decide(np.full((n, n), b, np.int64))[0] is not None for b in GATE_PAIR_BYTES)
            self._eligible = ok
        return self._eligible

    # -- per call ---------------------------------------------------------------------------
    def choose(self, traffic: Sequence[Sequence[int]]) -> Optional[str]:
        """The strategy for this call's ``[n, n]`` bytes, or None for the direct route."""
        if self.strategy == "direct" or self.cluster is None:
            return None
        if self.strategy != "adaptive":
            return self.strategy
        if not self.eligible:
            return None
        cls = shape_class(np.asarray(traffic, np.int64))
        key = cls.tobytes()
        hit = self.decisions.get(key)
        if hit is None:
            hit = self._decide(representative(cls))
            if len(self.decisions) >= _CLASSES_KEPT:
                self.decisions.popitem(last=False)
            self.decisions[key] = hit
        return hit[0]

    def note(self, path: str) -> None:
        """Count the path a call took."""
        self.taken[path] = self.taken.get(path, 0) + 1

    def plan(self, strategy: str, traffic: Sequence[Sequence[int]]):
        """The :class:`~hetcomm.sched.plan.Plan` of ``strategy`` for these exact bytes."""
        from hetcomm.sched.planner import plan_all_to_all

        t = np.asarray(traffic, np.int64)
        key = (strategy, t.tobytes())
        hit = self._plans.get(key)
        if hit is None:
            hit = plan_all_to_all(self.cluster, t, strategy=strategy)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.popitem(last=False)
            self._plans[key] = hit
        else:
            self._plans.move_to_end(key)
        return hit

    def _decide(self, traffic: np.ndarray) -> Tuple[Optional[str], float, float]:
        """``(best staged strategy or None, predicted direct s, predicted s of the choice)``."""
        from hetcomm.sched.planner import plan_all_to_all
        from hetcomm.sched.simulate import simulate

        def t(strategy: str) -> float:
            plan = plan_all_to_all(self.cluster, traffic, strategy=strategy)
            # The executor ends every stage with a wait for all of it (a barrier per stage, not
            # modelled by the simulator): charge each extra stage a fixed cost.
            return simulate(plan, self.cluster).time_s + max(0, plan.num_stages - 1) * self.stage_s

        direct = t("flat")
        best, best_t = None, direct
        for s in _STAGED:
            ts = t(s)
            if ts < best_t:
                best, best_t = s, ts
        if best is None or not best_t <= (1.0 - MIN_GAIN) * direct or math.isnan(best_t):
            return None, direct, direct
        return best, direct, best_t
