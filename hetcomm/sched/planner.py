"""Deciding an all-to-all: which chunk goes where, over what, in which stage.

Notation (as in ``hetcomm.sched.plan``): ``n`` ranks, ``T[i][j]`` bytes from rank i to rank j,
``d_v`` devices on node v, ``N`` nodes. A *node pair stream* is the bytes of every segment
``i -> j`` with ``i`` on node ``a`` and ``j`` on node ``b != a``, laid end to end in the order
``(i, j)``; a *lane* is a contiguous byte range of that stream carried by one forwarding rank
``f`` on ``a`` to one receiving rank ``g`` on ``b``.

Strategies:

``flat``
    Every segment goes straight from ``i`` to ``j`` in one stage, all at once, over the pair's
    own path (fabric inside a node, the sender's nearest NIC between nodes, the host bridge
    across vendors). This is what NCCL's all-to-all does.
``hier``
    Three tiers in up to four stages. Stage 0: segments inside a node go direct; every other
    segment goes over the node's fabric to the forwarder ``f`` its destination node is assigned
    to (aggregation). Stage 1: one lane per node pair, ``f -> g``, over the network tier
    (same vendor) or the host-bridge tier (NVIDIA <-> Ascend). Stages 2 and 3: ``g`` scatters
    over its fabric to the final ranks, first what came over the network (it lands early),
    then what came over the slower bridge. Forwarders rotate over a node's devices by destination node, so
    uneven node sizes and any number of nodes work; a chunk already on its forwarder (or
    receiver) skips that hop.
``multirail``
    ``hier`` with each node pair stream striped over lanes in proportion to bandwidth: between
    nodes of one vendor one lane per NIC port of the sending node, weighted by its rate, carried
    by the device nearest that port (same NUMA node) and named ``nicK`` in ``Transfer.rail``;
    across vendors ``ceil(bridge / PCIe)`` lanes over distinct devices, so that the
    device-to-host staging copies do not queue on one PCIe link.
``auto``
    Builds all three, times each with the simulator (``hetcomm.sched.simulate``) under the cost
    model, and returns the fastest; ``Plan.notes`` records every prediction and the traffic
    facts the choice was made on. Ties go to the plan with fewer messages.

Planning is deterministic: the same cluster, traffic and options give the same plan on every
rank, so every rank plans locally and no plan is ever sent.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from hetcomm.errors import UsageError
from hetcomm.sched.cost import CostParams, ResourceModel, resource_model
from hetcomm.sched.plan import ChunkTable, Plan
from hetcomm.topo.cluster import Cluster

__all__ = ["plan_all_to_all", "STRATEGIES", "PLAN_CHOICES"]

STRATEGIES = ("flat", "hier", "multirail")
PLAN_CHOICES = STRATEGIES + ("auto",)
_OPTIONS = ("params", "align_bytes")


def plan_all_to_all(
    cluster: Cluster,
    traffic: Any,
    strategy: str = "auto",
    **options: Any,
) -> Plan:
    """Plan an all-to-all over ``cluster``.

    Args:
        cluster: the cluster; group rank ``k`` is cluster rank ``k`` (the group is the whole
            cluster).
        traffic: ``[n, n]`` bytes, ``traffic[i][j]`` from rank i to rank j (nested sequences or
            an int array; the diagonal stays local and is not planned).
        strategy: ``auto``, ``flat``, ``hier`` or ``multirail``.
        **options: ``params`` (:class:`~hetcomm.sched.cost.CostParams`, the cost model ``auto``
            decides by), ``align_bytes`` (lane cuts fall on multiples of this, e.g. the element
            size; default 1).

    Returns:
        A :class:`Plan` that passes ``Plan.check()``.

    Raises:
        UsageError: unknown strategy or option, a traffic matrix that is not ``n x n`` for the
            cluster's ``n`` ranks, or negative / non-integer entries.
    """
    for key in options:
        if key not in _OPTIONS:
            raise UsageError(f"plan_all_to_all: unknown option {key!r}; options are {', '.join(_OPTIONS)}")
    if strategy not in PLAN_CHOICES:
        raise UsageError(f"unknown plan strategy {strategy!r}; choose from {', '.join(PLAN_CHOICES)}")
    params: Optional[CostParams] = options.get("params")
    align = options.get("align_bytes", 1)
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
        raise UsageError(f"plan_all_to_all: align_bytes must be a whole number >= 1, got {align!r}")
    T = _traffic(traffic, cluster)
    model = resource_model(cluster, params)
    if strategy == "flat":
        return _flat(model, T)
    if strategy == "hier":
        return _staged(model, T, "hier", int(align))
    if strategy == "multirail":
        return _staged(model, T, "multirail", int(align))
    return _auto(model, T, int(align))


def _traffic(traffic: Any, cluster: Cluster) -> np.ndarray:
    try:
        T = np.asarray(traffic)
    except Exception as e:  # ragged nested lists
        raise UsageError(f"traffic is not a matrix of byte counts: {e}") from None
    n = cluster.num_ranks
    if T.ndim != 2 or T.shape != (n, n):
        raise UsageError(
            f"traffic has shape {tuple(T.shape)}; cluster '{cluster.name}' has {n} ranks, so the "
            f"matrix must be {n} x {n} (traffic[i][j] = bytes rank i sends to rank j)"
        )
    if T.dtype.kind not in "iu":
        if T.dtype.kind != "f" or not np.all(np.isfinite(T)) or not np.all(T == np.floor(T)):
            raise UsageError("traffic entries must be whole byte counts")
    T = T.astype(np.int64)
    if (T < 0).any():
        i, j = map(int, np.argwhere(T < 0)[0])
        raise UsageError(f"traffic[{i}][{j}] = {int(T[i, j])}; byte counts must be >= 0")
    return T


def _offdiag(T: np.ndarray) -> np.ndarray:
    out = T.copy()
    np.fill_diagonal(out, 0)
    return out


def _flat(model: ResourceModel, T: np.ndarray) -> Plan:
    ii, jj = np.nonzero(_offdiag(T))
    table = ChunkTable.build(
        src=ii,
        dst=jj,
        origin=ii,
        final_dst=jj,
        offset_bytes=np.zeros(len(ii), np.int64),
        num_bytes=T[ii, jj],
        link_class=model.link_classes(ii, jj),
        stage=np.zeros(len(ii), np.int64),
        message=np.arange(len(ii)),  # every (i, j) pair is its own message
    )
    notes = (f"flat: {len(ii)} segments sent direct in one stage (fabric inside a node, the sender's "
             f"nearest NIC between nodes, the host bridge across vendors)",)
    return Plan("flat", T, table=table, notes=notes)


# -- lanes --------------------------------------------------------------------------------------


def _lanes(model: ResourceModel, strategy: str, ga: np.ndarray, gb: np.ndarray, by_dest: bool = False):
    """The lanes of node pairs ``(ga[k], gb[k])``, grouped by pair, in cut order.

    Returns:
        ``(group, weight, fwd, rcv, nic)`` arrays, one entry per lane: the pair's index ``k``,
        its share weight, forwarding rank, receiving rank and sender NIC id (-1: none named).
    """
    N = model.num_nodes
    first, size = model.node_first, model.node_size
    # "distance" of b from a, so that a node's remote nodes rotate over its devices
    ka, kb = (gb - ga - 1) % N, (ga - gb - 1) % N
    k = np.arange(len(ga))
    if strategy == "hier":
        fwd = first[ga] + ka % size[ga]
        rcv = first[gb] + kb % size[gb]
        return k, np.ones(len(ga)), fwd, rcv, np.full(len(ga), -1, np.int64)
    cross = model.is_cross_vendor(first[ga], first[gb])
    # across vendors: enough lanes over distinct devices that device->host staging (PCIe)
    # keeps up with the per-node bridge
    pcie = np.minimum(model.pcie_cap[first[ga]], model.pcie_cap[first[gb]])
    count = np.maximum(1, np.minimum(np.minimum(size[ga], size[gb]), np.ceil(model.bridge_cap[ga] / pcie))).astype(np.int64)
    count = np.where(cross, count, 0)
    cg = np.repeat(k, count)
    lane = np.arange(len(cg)) - np.repeat(np.cumsum(count) - count, count)
    a, b = ga[cg], gb[cg]
    step_a = np.maximum(1, size[a] // count[cg])
    step_b = np.maximum(1, size[b] // count[cg])
    c_fwd = first[a] + (ka[cg] + lane * step_a) % size[a]
    c_rcv = first[b] + (kb[cg] + lane * step_b) % size[b]
    # same vendor: one lane per NIC port of the sender, weighted by its rate, carried by the
    # device nearest that port; ports pair up by index (rail-aligned) when both ends have as many
    nic_first = np.array([ids[0] for ids in model.node_nics], np.int64)
    nic_count = np.array([len(ids) for ids in model.node_nics], np.int64)
    ncount = np.where(cross, 0, nic_count[ga])
    ng = np.repeat(k, ncount)
    port = np.arange(len(ng)) - np.repeat(np.cumsum(ncount) - ncount, ncount)
    a, b = ga[ng], gb[ng]
    gnic = nic_first[a] + port
    aligned = nic_count[a] == nic_count[b]
    h = nic_first[b] + np.where(aligned, port, (port + a) % nic_count[b])
    n_fwd = model.nic_device[gnic]
    n_rcv = model.nic_device[h]
    group = np.concatenate([cg, ng])
    weight = np.concatenate([np.ones(len(cg)), model.nic_gbps[gnic]])
    fwd = np.concatenate([c_fwd, n_fwd])
    rcv = np.concatenate([c_rcv, n_rcv])
    nic = np.concatenate([np.full(len(cg), -1, np.int64), gnic])
    # lanes of a pair in the order of their forwarders: the origin-ordered stream then lands on
    # the sender itself wherever the forwarder is the origin (no gather hop)
    order = np.lexsort((nic, rcv, group) if by_dest else (nic, fwd, group))
    return group[order], weight[order], fwd[order], rcv[order], nic[order]


def _staged(model: ResourceModel, T: np.ndarray, strategy: str, align: int, by_dest: bool = False) -> Plan:
    n = model.num_ranks
    T0 = _offdiag(T)
    node = model.rank_node
    ii, jj = np.nonzero(T0)
    same = node[ii] == node[jj]
    # stage 0, direct: segments inside a node
    li, lj = ii[same], jj[same]
    # the rest, as node pair streams in (node a, node b, i, j) order
    ri, rj = ii[~same], jj[~same]
    order = np.lexsort((ri, rj, node[rj], node[ri]) if by_dest else (rj, ri, node[rj], node[ri]))
    ri, rj = ri[order], rj[order]
    rb = T0[ri, rj]
    na, nb = node[ri], node[rj]
    seg_end = np.cumsum(rb)
    seg_start = seg_end - rb
    # groups: consecutive equal (na, nb)
    if len(ri):
        new = np.ones(len(ri), bool)
        new[1:] = (na[1:] != na[:-1]) | (nb[1:] != nb[:-1])
        gstart_idx = np.flatnonzero(new)
    else:
        gstart_idx = np.zeros(0, np.int64)
    gend_idx = np.append(gstart_idx[1:], len(ri)).astype(np.int64)
    ga, gb = na[gstart_idx], nb[gstart_idx]
    base = seg_start[gstart_idx]
    total = seg_end[gend_idx - 1] - base if len(gstart_idx) else np.zeros(0, np.int64)
    group, weight, lane_fwd, lane_rcv, lane_nic = _lanes(model, strategy, ga, gb, by_dest)
    # cut each pair's stream in proportion to its lanes' weights, on multiples of align (every
    # pair has at least one lane, and lanes come grouped by pair in pair order)
    num_lanes = len(group)
    excl = np.cumsum(weight) - weight
    starts = np.searchsorted(group, np.arange(len(ga)))
    frac = (excl - excl[starts][group]) / np.bincount(group, weights=weight, minlength=len(ga))[group]
    cut = (np.floor(total[group] * frac).astype(np.int64) // align) * align
    istart_a = base[group] + np.minimum(cut, total[group])
    iend_a = np.append(istart_a[1:], int(seg_end[-1]) if len(ri) else 0).astype(np.int64)
    # split every remote segment at the lane cuts inside it
    m0 = np.searchsorted(istart_a, seg_start, side="right") - 1
    m1 = np.searchsorted(istart_a, seg_end, side="left") - 1
    counts = np.maximum(m1 - m0 + 1, 0)
    rep = np.repeat(np.arange(len(ri)), counts)
    offs = np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts)
    mi = m0[rep] + offs
    p_start = np.maximum(seg_start[rep], istart_a[mi]) if len(rep) else np.zeros(0, np.int64)
    p_end = np.minimum(seg_end[rep], iend_a[mi]) if len(rep) else np.zeros(0, np.int64)
    keep = p_end > p_start
    rep, mi, p_start, p_end = rep[keep], mi[keep], p_start[keep], p_end[keep]
    p_origin, p_final = ri[rep], rj[rep]
    p_off = p_start - seg_start[rep]
    p_bytes = p_end - p_start
    fwd = lane_fwd[mi]
    rcv = lane_rcv[mi]
    nic = lane_nic[mi]
    # rails: "nicK" with K the port's index on its node
    rail = np.full(len(mi), -1, np.int64)
    rail_names: Tuple[str, ...] = ()
    if strategy == "multirail" and len(mi):
        local_nic = np.full(len(model.nic_node), -1, np.int64)
        for ids in model.node_nics:
            for k, g in enumerate(ids):
                local_nic[g] = k
        has = nic >= 0
        used = np.unique(local_nic[nic[has]])
        rail_names = tuple(f"nic{k}" for k in used.tolist())
        rail[has] = np.searchsorted(used, local_nic[nic[has]])
    # assemble: [direct][gather][exchange][scatter]
    n_direct = len(li)
    gather = np.flatnonzero(p_origin != fwd)
    scatter = np.flatnonzero(rcv != p_final)
    n_g, n_x = len(gather), len(p_origin)
    gather_idx = np.full(n_x, -1, np.int64)
    gather_idx[gather] = n_direct + np.arange(n_g)
    x_idx = n_direct + n_g + np.arange(n_x)
    fabric_cls = model.class_matrix[node, node]  # per rank: its node's fabric
    src = np.concatenate([li, p_origin[gather], fwd, rcv[scatter]])
    dst = np.concatenate([lj, fwd[gather], rcv, p_final[scatter]])
    cols = dict(
        src=src,
        dst=dst,
        origin=np.concatenate([li, p_origin[gather], p_origin, p_origin[scatter]]),
        final_dst=np.concatenate([lj, p_final[gather], p_final, p_final[scatter]]),
        offset_bytes=np.concatenate([np.zeros(n_direct, np.int64), p_off[gather], p_off, p_off[scatter]]),
        num_bytes=np.concatenate([T0[li, lj], p_bytes[gather], p_bytes, p_bytes[scatter]]),
        link_class=np.concatenate(
            [fabric_cls[li], fabric_cls[p_origin[gather]], model.link_classes(fwd, rcv), fabric_cls[rcv[scatter]]]
        ),
        # Scatter what came over the network (stage 2) before what came over the bridge
        # (stage 3): network lanes land long before bridge lanes, and their scatter then runs
        # while the bridge is still busy instead of queueing behind it.
        stage=np.concatenate(
            [
                np.zeros(n_direct + n_g, np.int64),
                np.ones(n_x, np.int64),
                np.where(model.is_cross_vendor(fwd[scatter], rcv[scatter]), 3, 2),
            ]
        ),
        rail=np.concatenate([np.full(n_direct + n_g, -1, np.int64), rail, np.full(len(scatter), -1, np.int64)]),
        dep=np.concatenate([np.full(n_direct + n_g, -1, np.int64), gather_idx, x_idx[scatter]]),
    )
    # message ids, numbered stage by stage without sorting: stage 0 and 2 messages stay inside
    # a node, so (sender, receiver's local index) is a dense key; stage 1 messages are lanes
    dmax = int(model.node_size.max()) if len(model.node_size) else 1
    local = model.rank_local
    k0 = n * dmax
    key = np.concatenate([
        cols["src"][: n_direct + n_g] * dmax + local[cols["dst"][: n_direct + n_g]],
        k0 + mi,
        k0 + num_lanes + (cols["stage"][n_direct + n_g + n_x :] - 2) * k0 + rcv[scatter] * dmax + local[p_final[scatter]],
    ])
    used = np.zeros(3 * k0 + num_lanes, bool)
    used[key] = True
    cols["message"] = (np.cumsum(used) - 1)[key]
    # number the stages that occur consecutively (a plan without bridge pairs has no stage 3)
    present = np.unique(cols["stage"])
    cols["stage"] = np.searchsorted(present, cols["stage"])
    table = ChunkTable.build(rail_names=rail_names, **cols)
    pairs = len(gstart_idx)
    if strategy == "hier":
        notes = [
            f"hier: {pairs} node pairs, one forwarder per node pair; stage 0 aggregates {n_g} chunks "
            f"over the fabric, stage 1 sends {n_x} over network/bridge, then {len(scatter)} are "
            f"scattered (network lanes' first, bridge lanes' last)"
        ]
    else:
        notes = [
            f"multirail: {pairs} node pairs striped over {num_lanes} lanes (NIC ports weighted by rate; "
            f"bridge pairs over PCIe staging devices); {n_g} gather, {n_x} exchange, {len(scatter)} scatter chunks"
        ]
        for v, ids in enumerate(model.node_nics):
            if len(ids) > 1 and v < 3:
                fw = ", ".join(f"nic{k}->rank{model.nearest_device(g)}" for k, g in enumerate(ids))
                notes.append(f"multirail: {model.node_names[v]} forwarders {fw}")
    return Plan(strategy, T, table=table, notes=tuple(notes))


def _auto(model: ResourceModel, T: np.ndarray, align: int) -> Plan:
    from hetcomm.sched.simulate import simulate  # same package; avoids a cycle at import

    T0 = _offdiag(T)
    n = model.num_ranks
    results = []
    for strategy in STRATEGIES:
        plan = _flat(model, T) if strategy == "flat" else _staged(model, T, strategy, align)
        sim = simulate(plan, model.cluster, model.params)
        results.append((sim.time_s, sim.num_messages, STRATEGIES.index(strategy), plan, sim))
    results.sort(key=lambda r: (r[0], r[1], r[2]))
    best = results[0][3]
    col = T0.sum(axis=0)
    row = T0.sum(axis=1)
    skew = float(col.max() / col.mean()) if n and col.mean() > 0 else 1.0
    per_rank = float(row.mean()) if n else 0.0
    preds = ", ".join(f"{r[3].strategy} {r[0] * 1e3:.3f} ms ({r[1]} messages)" for r in results)
    why = (
        f"auto: chose {best.strategy}: fastest under the cost model for {per_rank / 2**20:.3f} MiB sent "
        f"per rank (off-diagonal mean), receive skew max/mean {skew:.2f}, {n} ranks on {model.num_nodes} "
        f"nodes; predicted {preds}"
    )
    out = Plan(best.strategy, T, table=best.table, notes=(why,) + best.notes)
    out.__dict__["messages"] = best.messages  # already grouped while timing it
    return out
