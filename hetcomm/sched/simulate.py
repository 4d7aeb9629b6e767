"""Timing a plan on a cluster: an event-driven simulation over shared resources.

Notation (as in ``hetcomm.sched.plan``/``cost``): a plan's chunks are grouped into *messages*
(same stage, sender, receiver, rail); message ``m`` has bytes ``b_m``, link-class latency
``alpha_m``, and crosses the resources ``path(m)`` (``hetcomm.sched.cost.ResourceModel.paths``).

The model, per stage ``s`` in order:

* the *work* message ``m`` puts on resource ``r`` is ``w(m, r) = b_m / cap_r + o_m`` (bytes over
  capacity, plus the per-message occupancy ``o_m`` of its link class);
* resource ``r`` carries its stage-``s`` messages together: they share it in proportion to their
  work, so together they keep it busy for ``W[s, r] = sum of w(m, r)``;
* message ``m`` becomes ready at the latest of (a) the arrival of every message holding a chunk
  it forwards (its dependencies) and (b) the end of every earlier stage's traffic on each
  resource of its path; it arrives ``alpha_m + max over r in path(m) of W[s, r]`` later;
* it holds each resource of its path until it arrives, except the staging copies (the copy out
  of a forwarder's staging buffer, the device-to-host copy of a bridge message), which are done
  before the send and hold their resource for ``W[s, r]`` from the message's start.

Events are message arrivals: each stage's start times come from earlier arrivals, so nodes run
ahead of one another (node A may be exchanging while node B still aggregates) wherever their
resources allow, and a resource never carries two stages at once.

Two properties hold by construction, and the tests check them on random clusters and traffic:

* **feasible, hence never below the lower bound** — at any instant each message of stage ``s``
  uses at most ``w(m, r) / W[s, r]`` of resource ``r``, so the stage's messages never use more
  than its capacity, and stages on ``r`` do not overlap. Resource ``r`` therefore ends no earlier
  than ``alpha_min + sum_s W[s, r] >= alpha_min + bytes_r / cap_r``, which is at least every
  term of ``hetcomm.sched.bound`` (see there for the union terms);
* **monotone** — every time is built from sums and maxima of the work terms, each
  non-increasing in every capacity, so adding bandwidth never makes a plan slower.

The price of those guarantees: a message that starts late in a stage still takes the stage's
whole share window, so the model is pessimistic when one stage's messages are spread out in
time (fair-sharing simulators would hand the unused capacity to others). It is fast: numpy over
messages, a few passes per stage, so 1,024 ranks simulate in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from hetcomm.errors import UsageError
from hetcomm.sched.cost import CostParams, ResourceModel, resource_model
from hetcomm.sched.plan import Plan
from hetcomm.topo.cluster import Cluster

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True, eq=False)
class SimResult:
    """What :func:`simulate` predicts for one plan.

    Attributes:
        time_s: when the last byte arrives, seconds (0 for a plan that moves nothing).
        num_messages: messages the plan's chunks group into.
        num_stages: stages of the plan.
        bytes_by_class: bytes moved per link class name (forwarded bytes count per hop).
        busy_s: ``[num_resources]`` float64 seconds each resource is busy (``sum_s W[s, r]``).
        busiest: ``(name, busy seconds, busy / time)`` of the busiest resource.
        stage_end_s: arrival time of each stage's last message, seconds.
        finish_s: ``[num_messages]`` float64 arrival time of each message.
    """

    time_s: float
    num_messages: int
    num_stages: int
    bytes_by_class: Dict[str, int]
    busy_s: np.ndarray
    busiest: Tuple[str, float, float]
    stage_end_s: Tuple[float, ...]
    finish_s: np.ndarray


def _message_nics(plan: Plan, model: ResourceModel, src: np.ndarray, rail: np.ndarray) -> np.ndarray:
    """Global NIC ids for messages whose rail names a port (``nicK``), else -1."""
    out = np.full(len(src), -1, np.int64)
    names = plan.table.rail_names
    if not names or not len(src):
        return out
    local = np.array([int(s[3:]) if s.startswith("nic") and s[3:].isdigit() else -1 for s in names], np.int64)
    has = rail >= 0
    k = np.full(len(src), -1, np.int64)
    k[has] = local[rail[has]]
    node = model.rank_node[src]
    counts = np.array([len(x) for x in model.node_nics], np.int64)
    firsts = np.array([x[0] for x in model.node_nics], np.int64)
    ok = (k >= 0) & (k < counts[node])
    # a node's NIC ids are consecutive (built node by node), so port k is first + k
    out[ok] = firsts[node[ok]] + k[ok]
    return out


def simulate(plan: Plan, cluster: Cluster, params: Optional[CostParams] = None) -> SimResult:
    """Predict how long ``plan`` takes on ``cluster`` (see the module docstring for the model).

    Args:
        plan: the plan; its ranks are the cluster's ranks.
        cluster: the cluster.
        params: cost parameters (default: nominal).

    Returns:
        A :class:`SimResult`.
    """
    model = resource_model(cluster, params)
    if plan.num_ranks != model.num_ranks:
        raise UsageError(
            f"the plan is for {plan.num_ranks} ranks but cluster '{cluster.name}' has {model.num_ranks}; "
            f"simulate a plan on the cluster it was made for"
        )
    msgs = plan.messages
    m = len(msgs)
    num_res = len(model.cap)
    busy = np.zeros(num_res)
    classes = plan.bytes_by_class()
    if m == 0:
        return SimResult(0.0, 0, 0, classes, busy, ("(none)", 0.0, 0.0), (), np.zeros(0))
    src, dst = msgs.src, msgs.dst
    cls = model.link_classes(src, dst)
    nic = _message_nics(plan, model, src, msgs.rail)
    P = model.paths(src, dst, nic, msgs.forwarded)
    valid = P >= 0
    # Flatten to one entry per (message, resource), in message order: every message crosses at
    # least its two endpoint resources, so each message's entries are a non-empty run.
    cnt = valid.sum(axis=1)
    first = np.cumsum(cnt) - cnt
    e_res = P[valid]
    # Staging copies (out of a forwarder's staging buffer; device -> host for a bridge message)
    # finish before the send starts, so they hold their resource only for the stage's window on it.
    staging = np.zeros(P.shape, bool)
    staging[:, 8] = True
    staging[:, 0] = model.is_cross_vendor(src, dst) & (model.rank_node[src] != model.rank_node[dst])
    e_staging = staging[valid]
    e_msg = np.repeat(np.arange(m), cnt)
    e_work = msgs.num_bytes[e_msg] / model.cap[e_res] + model.overhead[cls][e_msg]
    alpha = model.latency[cls]
    finish = np.zeros(m)
    ready = np.zeros(m)
    res_end = np.zeros(num_res)
    stage_ends = []
    dep_stage = msgs.stage[msgs.dep_msg] if len(msgs.dep_msg) else np.zeros(0, np.int64)
    # message ids are numbered stage by stage, so each stage is a contiguous range
    bounds = np.flatnonzero(np.diff(msgs.stage)) + 1
    for m0, m1 in zip(np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [m]]).tolist()):
        a, b = int(first[m0]), int(first[m1 - 1] + cnt[m1 - 1])
        er, ew = e_res[a:b], e_work[a:b]
        runs = first[m0:m1] - a
        W = np.bincount(er, weights=ew, minlength=num_res)
        share = np.maximum.reduceat(W[er], runs)
        after = np.maximum.reduceat(res_end[er], runs)
        # dependencies (all in earlier stages, so their arrivals are known)
        sel = dep_stage == msgs.stage[m0]
        if sel.any():
            np.maximum.at(ready, msgs.dep_msg[sel], finish[msgs.dep_on[sel]])
        begin = np.maximum(ready[m0:m1], after) + alpha[m0:m1]
        fin = begin + share
        finish[m0:m1] = fin
        held = np.where(e_staging[a:b], np.repeat(begin, cnt[m0:m1]) + W[er], np.repeat(fin, cnt[m0:m1]))
        np.maximum.at(res_end, er, held)
        busy += W
        stage_ends.append(float(fin.max()))
    time_s = float(finish.max())
    top = int(np.argmax(busy))
    busiest = (model.name(top), float(busy[top]), float(busy[top] / time_s) if time_s > 0 else 0.0)
    return SimResult(
        time_s=time_s,
        num_messages=m,
        num_stages=plan.num_stages,
        bytes_by_class=classes,
        busy_s=busy,
        busiest=busiest,
        stage_end_s=tuple(stage_ends),
        finish_s=finish,
    )
