"""A lower bound on the time of any all-to-all plan, from the traffic matrix and the cluster.

Notation: ``T[i][j]`` bytes from rank i to rank j (``i != j``; the diagonal stays local),
``V(i)`` the node of rank i, ``cap`` capacities in bytes/s from ``hetcomm.sched.cost``,
``alpha`` latencies. Every byte of ``T[i][j]`` must cross, in whatever plan:

1. **device egress of i** — the first hop leaves device i over its fabric port or its PCIe
   link: ``out_i = sum_j T[i][j]`` over ``cap = fabric_i [d_V(i) > 1] + pcie_i [N > 1]``;
2. **device ingress of j** — likewise the last hop: ``in_j = sum_i T[i][j]``;
3. **node egress of v** — bytes from v's ranks to other nodes leave v over its NIC ports (behind
   its uplink) or its host bridge:
   ``sum_{i in v, j not in v} T[i][j]`` over ``min(uplink_v, sum of v's ports) + bridge_v [v has
   cross-vendor peers]``;
4. **node ingress of v** — symmetrically;
5. **vendor island egress/ingress** — bytes from NVIDIA ranks to Ascend ranks (and back) must
   cross a host bridge on the sending side (receiving side): ``sum over the island's nodes of
   bridge_v`` (plus their network capacity when CPU-only nodes could relay).

Each term ``k`` gives ``t_k = alpha_k + bytes_k / cap_k`` with ``alpha_k`` the smallest latency
of any message that can cross those resources, and

    ``bound = max_k t_k``.

Why it is a lower bound for the simulator (``hetcomm.sched.simulate``) and for any feasible
schedule: a term's bytes each cross at least one of its resources; resource ``r`` moves at most
``cap_r`` bytes/s and nothing before the first message's latency has passed, so moving
``bytes_k`` through resources of total capacity ``cap_k`` takes at least ``alpha_k +
bytes_k / cap_k``. Nothing in it depends on a plan, so it is the same number for every strategy.
It ignores per-message occupancy and pair links, so it can be loose; it is never tuned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from hetcomm.sched.cost import CostParams, resource_model
from hetcomm.topo.cluster import Cluster

__all__ = ["BoundTerm", "LowerBound", "lower_bound"]


@dataclass(frozen=True)
class BoundTerm:
    """One term of the bound: ``time_s = alpha_s + num_bytes / (gbps * 1e9 / 8)``."""

    name: str
    num_bytes: int
    gbps: float
    alpha_s: float
    time_s: float


@dataclass(frozen=True)
class LowerBound:
    """The bound and the terms that come closest to it.

    Attributes:
        time_s: the bound, seconds.
        binding: the largest term.
        terms: the largest terms, largest first (up to 5).
    """

    time_s: float
    binding: Optional[BoundTerm]
    terms: Tuple[BoundTerm, ...]


def lower_bound(cluster: Cluster, traffic: Any, params: Optional[CostParams] = None) -> LowerBound:
    """The lower bound of the module docstring for ``traffic`` (``[n, n]`` bytes) on ``cluster``."""
    model = resource_model(cluster, params)
    T = np.array(traffic, dtype=np.int64)
    np.fill_diagonal(T, 0)
    N = model.num_nodes
    node = model.rank_node
    lat = model.latency
    # the classes every node pair talks over (cross-vendor pairs: the bridge class)
    firsts = model.node_first
    pair_cls = model.link_classes(np.repeat(firsts, N), np.tile(firsts, N)).reshape(N, N)
    off = ~np.eye(N, dtype=bool)
    present = np.unique(pair_cls[off]) if N > 1 else np.zeros(0, np.int64)
    fabrics = np.unique(np.diag(model.class_matrix)[model.node_size > 1])
    alpha_any = float(lat[np.concatenate([present, fabrics]).astype(np.int64)].min()) if len(present) + len(fabrics) else 0.0
    vendor_of_node = model.rank_vendor[firsts]
    cross_node = (vendor_of_node[:, None] != vendor_of_node[None, :]) & (vendor_of_node[:, None] != 2) & (vendor_of_node[None, :] != 2)
    has_cross = cross_node.any(axis=1)
    terms: List[BoundTerm] = []

    def add(name: str, nbytes: float, cap: float, alpha: float) -> None:
        if nbytes > 0 and cap > 0:
            terms.append(BoundTerm(name, int(nbytes), float(cap * 8 / 1e9), float(alpha), float(alpha + nbytes / cap)))

    # 1-2: devices
    dev_cap = model.fab_cap * (model.node_size[node] > 1) + model.pcie_cap * (N > 1)
    out, inn = T.sum(axis=1), T.sum(axis=0)
    for r in np.argsort(-out / np.maximum(dev_cap, 1e-300))[:3].tolist():
        add(f"rank{r} device egress", out[r], dev_cap[r], alpha_any)
    for r in np.argsort(-inn / np.maximum(dev_cap, 1e-300))[:3].tolist():
        add(f"rank{r} device ingress", inn[r], dev_cap[r], alpha_any)
    if N > 1:
        # 3-4: nodes
        # ranks are numbered node by node, so node blocks are contiguous
        NT = np.add.reduceat(np.add.reduceat(T, firsts, axis=0), firsts, axis=1).astype(float)
        np.fill_diagonal(NT, 0)
        nic_sum = np.array([model.nic_gbps[list(ids)].sum() * 1e9 / 8 for ids in model.node_nics])
        node_cap = np.minimum(model.uplink_cap, nic_sum) + model.bridge_cap * has_cross
        lat_pair = np.where(off, lat[pair_cls], np.inf)
        alpha_out = lat_pair.min(axis=1)
        alpha_in = lat_pair.min(axis=0)
        for v in range(N):
            add(f"{model.node_names[v]} node egress", NT[v].sum(), node_cap[v], float(alpha_out[v]))
            add(f"{model.node_names[v]} node ingress", NT[:, v].sum(), node_cap[v], float(alpha_in[v]))
        # 5: vendor islands (only NVIDIA <-> Ascend is a cross-vendor pair)
        relay = bool((vendor_of_node == 2).any())
        bridge_lat = float(lat[int(cluster.interconnect.cross_vendor_class)])
        for x, y, xname, yname in ((0, 1, "nvidia", "ascend"), (1, 0, "ascend", "nvidia")):
            xs = vendor_of_node == x
            ys = vendor_of_node == y
            if not xs.any() or not ys.any():
                continue
            nbytes = NT[np.ix_(xs, ys)].sum()
            cap = float(model.bridge_cap[xs].sum())
            alpha = bridge_lat
            if relay:
                cap += float(np.minimum(model.uplink_cap, nic_sum)[xs].sum())
                alpha = min(alpha, float(lat_pair[xs].min()))
            add(f"{xname} island -> {yname} (bridge egress)", nbytes, cap, alpha)
            cap_in = float(model.bridge_cap[ys].sum()) + (float(np.minimum(model.uplink_cap, nic_sum)[ys].sum()) if relay else 0.0)
            add(f"{yname} island <- {xname} (bridge ingress)", nbytes, cap_in, alpha)
    terms.sort(key=lambda t: -t.time_s)
    if not terms:
        return LowerBound(0.0, None, ())
    return LowerBound(float(terms[0].time_s), terms[0], tuple(terms[:5]))
