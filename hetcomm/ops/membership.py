"""Membership of a fault-tolerant job: who trained, who left at a restart, what it cost.

Under ``hetcomm launch --nnodes MIN:MAX`` a node that does not come back is simply absent from
torchrun's next rendezvous: the survivors' workers write the job's cluster YAML without it
(:mod:`hetcomm.ops.job_cluster`) and ``--resume`` loads the checkpoint on the smaller world
(DCP reshards; experts are keyed by global id, :mod:`hetcomm.ops.checkpoint`). This module makes
that change visible and places the experts for it:

* **The record of who trained.** ``<checkpoint dir>/membership.json`` (rank 0, mode 0600): the
  world size, every rank's device model and node, when this attempt started and at which step,
  and — rewritten at each checkpoint — the agreed measured expert speed per device model
  (layer 0's :class:`~hetcomm.moe.speed.SpeedMeter`, rows/s, once measured).
* **Placement for the new world** (:func:`placement_weights`, before the model is built): when
  a resume finds a different membership, each rank's expert share is the *measured* speed of its
  device model in the previous membership (median over that model's ranks) when every model of
  the new job was measured there; else None: the layer places by its own ``rank_weights`` rule
  (:class:`~hetcomm.moe.layer_config.MoEConfig`; ``hetcomm train`` keeps the default ``strong``:
  the cluster YAML's strong ranks weigh ``strong_expert_weight``, 2.0, the others 1; only
  ``throughput`` takes each device's TFLOPS, ``device.tflops`` or the device table,
  :func:`hetcomm.topo.compute.rank_speeds`). "Datasheet" in the ``how`` phrases means that
  rule: declared, not measured. An unchanged membership keeps it, so a plain restart resumes
  bit for bit.
* **Placement without a checkpoint directory** (:func:`snapshot_placement`): the same speeds
  travel in every in-memory snapshot's header (:mod:`hetcomm.ops.snapshot_format`, ``placement``),
  so a memory-only restore onto another membership places by the speeds measured up to the
  snapshot it restores; when ``membership.json`` has no speeds (none written, no checkpoint
  directory, not measured before the last checkpoint) the snapshots' are used.
* **The change** (:func:`on_start`, after the resume): which ranks/nodes left or joined, the cause
  (the previous attempt's end marks in the launch directory, :mod:`hetcomm.ops.rank_marks`: the
  rank that died without a word, or the peer the survivors' errors named — e.g. a heartbeat's
  "stopped"), the cost (steps redone: the last step the previous attempt finished, from the
  metrics file, minus the checkpoint's step; seconds from that step to the restored state), and
  the expert census (:func:`expert_census`: every global expert owned by exactly one rank, per
  layer). It goes to the metrics file (an ``event`` line ``membership``), the health records
  (:mod:`hetcomm.ops.ops_records`, ``kind: membership``), stderr and the job summary.
* **The change without a checkpoint directory** (no ``membership.json``): the previous
  membership is the one the restored in-memory snapshots' headers name (each rank's node and
  device model, :func:`snapshot_members`), so a memory-only shrink or grow is recorded the same
  way; the steps redone come from the metrics file, else from the snapshots' own count (the
  newest step any surviving rank finished minus the step restored). The seconds from the last
  finished step to the restored state need the previous attempt's start time, which only
  ``membership.json`` keeps: the record says they are unknown rather than guess them. Nothing
  is written: there is no directory to write ``membership.json`` to.

Why a restart and not an in-place change: on torch >= 2.14 a hetcomm group itself can shrink
(``dist.shrink_group``) and take a new process in (``dist._reconfigure``;
:mod:`hetcomm.backends.reconfigure`), as torchft's reconfigurable groups do. ``hetcomm launch``
still restarts the workers through torchrun, whose agent stops every worker of a node when one
fails, and ``hetcomm train`` builds its world-size-shaped state once at start; so what is left to
do here is recording and placement (docs/OPERATIONS.md, "In place or by restart").
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "MEMBERSHIP_FILE", "MembershipChange", "ExpertCensus", "members", "read_membership", "write_membership",
    "placement_weights", "snapshot_placement", "snapshot_members", "measured_speeds_by_model", "expert_census",
    "on_start", "after_checkpoint", "summary_rows",
]

MEMBERSHIP_FILE = "membership.json"
_MAX_BYTES = 1 << 20


def members(cluster, world_size: int) -> Dict[str, Any]:
    """``{"world_size", "ranks": [{"rank", "model", "node"}], "nodes": [...]}`` of this job."""
    ranks = [{"rank": r, "model": cluster.rank(r).model, "node": cluster.rank(r).node.name} for r in range(world_size)]
    nodes: List[str] = []
    for r in ranks:
        if r["node"] not in nodes:
            nodes.append(r["node"])
    return {"world_size": world_size, "ranks": ranks, "nodes": nodes}


def read_membership(ck_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """The previous attempt's ``membership.json`` in ``ck_dir``, or None (none, unreadable, damaged)."""
    if not ck_dir:
        return None
    from hetcomm.ops.safe_fs import read_nofollow

    try:
        obj = json.loads(read_nofollow(os.path.join(ck_dir, MEMBERSHIP_FILE), limit=_MAX_BYTES, what="membership record"))
    except (OSError, ValueError, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - UnsafePathError and friends: advisory, never fatal
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("ranks"), list) or not isinstance(obj.get("world_size"), int):
        return None
    return obj


def write_membership(ck_dir: str, record: Dict[str, Any]) -> None:
    """Write ``record`` as ``membership.json`` (atomically, 0600; rank 0 only)."""
    from hetcomm.ops.safe_fs import write_private

    write_private(os.path.join(ck_dir, MEMBERSHIP_FILE), json.dumps(record, sort_keys=True), fsync=False)


def _same(prev: Optional[Dict[str, Any]], cur: Dict[str, Any]) -> bool:
    if prev is None:
        return True
    key = lambda m: [(r.get("model"), r.get("node")) for r in m.get("ranks", [])]  # noqa: E731
    return key(prev) == key(cur)


def _will_resume(cfg) -> bool:
    if not (cfg.checkpoint_dir and cfg.resume):
        return False
    from hetcomm.ops.checkpoint import latest_checkpoint

    try:
        return latest_checkpoint(cfg.checkpoint_dir) is not None
    except Exception:  # noqa: BLE001 - the resume itself reports a bad directory
        return False


def placement_weights(cfg, cluster, world_size: int) -> Tuple[Optional[List[float]], str]:
    """Expert-placement weights for a resume onto a changed membership (see the module docstring).

    Returns:
        ``(weights, how)``: ``[world_size]`` weights (measured rows/s of each rank's device model)
        or None (the layer's own ``rank_weights`` rule: declared, not measured), and a phrase saying which.
    """
    if not _will_resume(cfg):
        return None, "datasheet"
    prev = read_membership(cfg.checkpoint_dir)
    cur = members(cluster, world_size)
    if prev is None or _same(prev, cur):
        return None, "datasheet"
    speeds = prev.get("speeds_by_model") or {}
    models = [r["model"] for r in cur["ranks"]]
    try:
        weights = [float(speeds[m]) for m in models]
    except (KeyError, TypeError, ValueError):
        missing = sorted({m for m in models if m not in speeds})
        return None, f"datasheet (no measured speed of {', '.join(missing)} in the previous membership)"
    if not all(w > 0 for w in weights):
        return None, "datasheet (a measured speed was not positive)"
    return weights, "measured speeds of the previous membership (rows/s per device model)"


@dataclass(frozen=True)
class ExpertCensus:
    """Every layer's experts over the ranks: ``present[i]`` of ``total[i]`` owned, ``missing`` /
    ``doubled`` global ids per layer (owned by no rank / by more than one)."""

    present: List[int]
    total: List[int]
    missing: List[List[int]]
    doubled: List[List[int]]

    @property
    def complete(self) -> bool:
        return all(p == t for p, t in zip(self.present, self.total)) and not any(self.doubled)

    def line(self) -> str:
        head = f"{sum(self.present)} of {sum(self.total)} ({', '.join(f'{p}/{t}' for p, t in zip(self.present, self.total))} per layer)"
        bad = [f"layer {i}: missing {m}" for i, m in enumerate(self.missing) if m]
        bad += [f"layer {i}: owned twice {d}" for i, d in enumerate(self.doubled) if d]
        return head + ("; " + "; ".join(bad) if bad else "; every expert owned by exactly one rank")


def expert_census(model: torch.nn.Module) -> ExpertCensus:
    """Count every MoE layer's owned experts over the job (collective: one all-reduce).

    ``[layers, E]`` int64 counts, each rank adding 1 for each expert it owns (replicas excluded).
    """
    layers = list(model.moe_layers)
    if not layers:
        return ExpertCensus([], [], [], [])
    E = max(int(m.config.num_experts) for m in layers)
    counts = torch.zeros(len(layers), E, dtype=torch.int64, device="cpu")  # host: a count table for gloo/hetcomm CPU groups
    for i, m in enumerate(layers):
        for e in m.local_expert_ids:
            counts[i, int(e)] += 1
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    present, total, missing, doubled = [], [], [], []
    for i, m in enumerate(layers):
        n = int(m.config.num_experts)
        row = counts[i, :n].tolist()
        present.append(sum(1 for c in row if c > 0))
        total.append(n)
        missing.append([e for e, c in enumerate(row) if c == 0])
        doubled.append([e for e, c in enumerate(row) if c > 1])
    return ExpertCensus(present, total, missing, doubled)


@dataclass(frozen=True)
class MembershipChange:
    """One change of the job's ranks, seen at a resume (see the module docstring).

    Attributes:
        step: the checkpoint's step the job resumed after.
        before / after: world sizes.
        left / joined: ``{"rank", "model", "node"}`` of the ranks gone / new (previous / new numbering).
        nodes_left / nodes_joined: node names.
        cause: what the previous attempt's marks say ended it (or that they are not at hand).
        steps_redone: steps the previous attempt had finished after the checkpoint (None: unknown,
            no metrics file).
        down_s: seconds from the previous attempt's last finished step to the restored state
            (None: unknown).
        placement: where this job's expert shares came from (measured speeds or datasheet).
        experts: :meth:`ExpertCensus.line` after the restore.
        experts_present / experts_total: the census's sums.
        owners: each layer's new owner map (global expert id -> rank).
        previous: where the previous membership was read: ``membership.json`` or ``snapshots``
            (the restored in-memory snapshots' headers; no checkpoint directory).
        down_unknown: why ``down_s`` is None, said in :meth:`line` ("" when it is known).
    """

    step: int
    before: int
    after: int
    left: List[Dict[str, Any]]
    joined: List[Dict[str, Any]]
    nodes_left: List[str]
    nodes_joined: List[str]
    cause: str
    steps_redone: Optional[int]
    down_s: Optional[float]
    placement: str
    experts: str
    experts_present: int
    experts_total: int
    owners: List[List[int]] = field(default_factory=list)
    previous: str = MEMBERSHIP_FILE
    down_unknown: str = ""

    def line(self) -> str:
        who = []
        if self.nodes_left:
            who.append(f"node(s) {', '.join(self.nodes_left)} left")
        if self.nodes_joined:
            who.append(f"node(s) {', '.join(self.nodes_joined)} joined")
        if not who:
            who.append("ranks renumbered")
        cost = (f"{self.steps_redone} step(s) redone" if self.steps_redone is not None else "steps redone unknown (no metrics)")
        if self.down_s is not None:
            cost += f", {self.down_s:.1f} s from the last finished step to the restored state"
        elif self.down_unknown:
            cost += f", seconds from the last finished step to the restored state unknown ({self.down_unknown})"
        return (f"{self.before} -> {self.after} ranks after step {self.step}: {'; '.join(who)}; cause: {self.cause}; "
                f"cost: {cost}; experts {self.experts}; placement from {self.placement}")

    def record(self) -> Dict[str, Any]:
        return {"kind": "membership", **asdict(self), "line": self.line()}


def _cause(prev: Dict[str, Any]) -> str:
    """What ended the previous attempt, from its end marks in the launch directory."""
    from hetcomm import settings

    work = settings.LAUNCH_DIR.get()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if not work or not restart.isdigit() or int(restart) == 0:
        return "the previous run ended (no launch marks here to say why)"
    from hetcomm.ops.rank_marks import culprits, describe, read_marks

    marks = read_marks(work, "job", int(restart) - 1, int(prev.get("world_size", 0)))
    if not marks:
        return f"attempt {int(restart) - 1} left no marks on this node"
    bad = culprits(marks, None)
    witness = next((m for m in sorted(marks.values(), key=lambda m: m.rank)
                    if m.status == "failed" and m.peer in bad and m.error), None)
    if bad and witness is not None and all(b not in marks for b in bad):
        # The culprit ran on another node (its marks are there): say what this node's ranks saw.
        ranks = prev.get("ranks", [])
        where = ", ".join(f"rank {b}" + (f" ({ranks[b].get('model')} on {ranks[b].get('node')})" if b < len(ranks) else "")
                          for b in bad)
        return f"{where} named by rank {witness.rank}: {witness.error.splitlines()[0]}"
    return describe(marks, None)


def _joined_cause(joined: List[Dict[str, Any]]) -> str:
    """A grow: the previous attempt ended because torchrun's agents stopped its workers to admit
    the joining node(s) (its marks then name whichever peer the survivors saw go first, which is
    no fault)."""
    nodes = sorted({str(r.get("node")) for r in joined})
    return f"node(s) {', '.join(nodes)} joined at torchrun's next rendezvous (the agents stopped the workers to admit them)"


def _last_finished(cfg) -> Tuple[Optional[int], Optional[float]]:
    """The previous attempt's last finished step and its ``time_s``, from the metrics file."""
    if not cfg.metrics or not os.path.exists(cfg.metrics):
        return None, None
    from hetcomm.ops.metrics import read_metrics

    try:
        log = read_metrics(cfg.metrics)
    except Exception:  # noqa: BLE001 - advisory
        return None, None
    if not log.all_steps:
        return None, None
    last = log.all_steps[-1]
    return last.step, last.time_s


def snapshot_members(record: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The previous membership as the in-memory snapshots' headers name it (no ``membership.json``).

    Args:
        record: :meth:`hetcomm.ops.snapshot.Snapshotter.placement_record` of the snapshots the
            restore chose, or None.

    Returns:
        ``{"world_size", "ranks": [{"rank", "model", "node"}], "nodes"}`` as :func:`members`, or
        None: no record, or one of an older hetcomm (no device models in its header: a change
        could not be told from a renumbering, so none is claimed).
    """
    if record is None:
        return None
    place, nodes, world = record.get("placement"), record.get("nodes"), record.get("world_size")
    models = place.get("models") if isinstance(place, dict) else None
    if not (isinstance(models, list) and isinstance(nodes, list) and isinstance(world, int)
            and len(models) == len(nodes) == world):
        return None
    ranks = [{"rank": r, "model": str(m), "node": str(n)} for r, (m, n) in enumerate(zip(models, nodes))]
    return {"world_size": world, "ranks": ranks, "nodes": list(dict.fromkeys(r["node"] for r in ranks))}


def on_start(cfg, rank: int, world_size: int, cluster, model: torch.nn.Module, start_step: int, mc,
             placement: str = "datasheet", snapshots: Optional[Dict[str, Any]] = None,
             snapshot_lost: Optional[int] = None, cause: Optional[str] = None,
             down_s: Optional[float] = None) -> Optional[MembershipChange]:
    """After the resume: record this attempt's membership, and the change if there is one.

    Collective when ``cfg.checkpoint_dir`` is set, or when the state came from in-memory
    snapshots of another membership (the expert census); rank 0 writes. Call it before the first
    step, after the metrics collector exists (its ``resume`` event comes first).

    Args:
        placement: where the experts' shares came from (the ``how`` of :func:`placement_weights`
            / :func:`snapshot_placement`).
        snapshots: the :meth:`~hetcomm.ops.snapshot.Snapshotter.placement_record` of the
            snapshots the restore read (the same on every rank), or None: without
            ``membership.json`` its headers are the previous membership (:func:`snapshot_members`).
        snapshot_lost: the snapshots' count of steps redone at that restore
            (:attr:`hetcomm.ops.snapshot_format.Restored.lost`), for a job without metrics.
        cause: why the membership changed, when the caller knows (an in-place shrink: the lost
            ranks the heartbeat saw); None: the previous attempt's end marks say.
        down_s: the seconds from the last finished step to the restored state, when the caller
            measured them (an in-place shrink); None: from ``membership.json`` and the metrics.

    Returns:
        The change, or None (every rank gets the same answer; the ``cause`` is read on rank 0 only).
    """
    prev = read_membership(cfg.checkpoint_dir)
    previous = MEMBERSHIP_FILE
    if prev is None and snapshots is not None and start_step and int(snapshots.get("step", -1)) == start_step:
        prev, previous = snapshot_members(snapshots), "snapshots"
    cur = members(cluster, world_size)
    changed = bool(start_step) and prev is not None and not _same(prev, cur)
    if not cfg.checkpoint_dir and not changed:
        return None  # nothing to record, nowhere to write: no collective either (same on every rank)
    census = expert_census(model)
    change = None
    if changed and prev is not None:
        before = {(r.get("model"), r.get("node")) for r in prev["ranks"]}
        after = {(r["model"], r["node"]) for r in cur["ranks"]}
        left = [r for r in prev["ranks"] if (r.get("model"), r.get("node")) not in after]
        joined = [r for r in cur["ranks"] if (r["model"], r["node"]) not in before]
        last_step, last_t = _last_finished(cfg)
        redone = max(0, last_step - start_step) if last_step is not None else None
        if redone is None and previous == "snapshots":
            redone = snapshot_lost
        down, down_unknown = None, ""
        started = prev.get("started_at")
        if down_s is not None:
            down = max(0.0, float(down_s))
        elif last_t is not None and isinstance(started, (int, float)):
            down = max(0.0, time.time() - (float(started) + float(last_t)))
        elif previous == "snapshots":
            down_unknown = f"without a checkpoint directory no {MEMBERSHIP_FILE} records when the previous attempt started"
        change = MembershipChange(
            step=start_step, before=int(prev["world_size"]), after=world_size, left=left, joined=joined,
            nodes_left=[n for n in prev.get("nodes", []) if n not in cur["nodes"]],
            nodes_joined=[n for n in cur["nodes"] if n not in prev.get("nodes", [])],
            cause=(cause if cause is not None else _cause(prev) if left or not joined else _joined_cause(joined))
            if rank == 0 else "",
            steps_redone=redone, down_s=down, placement=placement,
            experts=census.line(), experts_present=sum(census.present), experts_total=sum(census.total),
            owners=[list(m.placement.owner) for m in model.moe_layers], previous=previous, down_unknown=down_unknown,
        )
    if rank == 0:
        if change is not None:
            mc.event(start_step, "membership", change.line())
            from hetcomm.ops.ops_records import append_records, record_paths

            append_records(record_paths(cfg.metrics), [change.record()])
            print(f"hetcomm train: membership changed: {change.line()}", file=sys.stderr, flush=True)
        if cfg.checkpoint_dir:
            rec = dict(cur, started_at=time.time(), start_step=start_step)
            if prev is not None and prev.get("speeds_by_model") and _same(prev, cur):
                rec["speeds_by_model"] = prev["speeds_by_model"]
            try:
                from hetcomm.ops.checkpoint_files import prepare_root

                prepare_root(cfg.checkpoint_dir)  # the first save would make it; the record comes first
                write_membership(cfg.checkpoint_dir, rec)
            except Exception as e:  # noqa: BLE001 - advisory: the job trains on
                print(f"hetcomm train: could not write {MEMBERSHIP_FILE}: {e}", file=sys.stderr, flush=True)
    return change


def measured_speeds_by_model(model: torch.nn.Module, models: Sequence[str]) -> Optional[Dict[str, float]]:
    """The agreed measured expert speed per device model: the median over that model's ranks of
    layer 0's agreed :class:`~hetcomm.moe.speed.SpeedMeter` vector (rows/s), or None before it measured.

    Args:
        model: a model with ``moe_layers`` (a model without MoE layers has no speeds).
        models: each rank's device model, in rank order (``len`` = the meter's world size).
    """
    layers = list(getattr(model, "moe_layers", []) or [])
    if not layers or not layers[0].speed.measured:
        return None
    by_model: Dict[str, List[float]] = {}
    for r, s in enumerate(layers[0].speed.speeds):
        by_model.setdefault(models[r], []).append(float(s))
    return {m: statistics.median(v) for m, v in by_model.items()}


def agreed_speed_record(model: torch.nn.Module) -> Optional[Dict[str, Any]]:
    """Layer 0's agreed speed snapshot (:class:`hetcomm.moe.speed.SpeedSnapshot`) as plain JSON:
    ``{"rows_per_s": [W], "noise": [W] (None: no estimate yet), "differ": bool | None,
    "agreements": int}``, or None before it measured (or without MoE layers)."""
    layers = list(getattr(model, "moe_layers", []) or [])
    if not layers or not layers[0].speed.measured:
        return None
    snap = layers[0].speed.agreed
    return {"rows_per_s": [float(v) for v in snap.rows_per_s],
            "noise": [None if math.isinf(n) else float(n) for n in snap.noise],
            "differ": snap.differ, "agreements": int(snap.agreements)}


def after_checkpoint(cfg, rank: int, world_size: int, cluster, model: torch.nn.Module) -> None:
    """After a checkpoint: rank 0 adds the measured expert speed per device model to the record
    (what :func:`placement_weights` uses if the next attempt runs on other ranks)."""
    if rank != 0 or not cfg.checkpoint_dir or not model.moe_layers:
        return
    speeds = measured_speeds_by_model(model, [cluster.rank(r).model for r in range(world_size)])
    if speeds is None:
        return
    rec = read_membership(cfg.checkpoint_dir)
    if rec is None:
        return
    rec["speeds_by_model"] = speeds
    rec["speeds_step"] = int(model.moe_layers[0].speed.agreements)
    rec["speed"] = agreed_speed_record(model)
    try:
        write_membership(cfg.checkpoint_dir, rec)
    except Exception:  # noqa: BLE001 - advisory
        pass


def snapshot_placement(record: Optional[Dict[str, Any]], cluster, world_size: int) -> Tuple[Optional[List[float]], str]:
    """Expert-placement weights from the in-memory snapshots a restore will read (a memory-only
    restore: no ``membership.json`` with speeds; see the module docstring).

    Args:
        record: :meth:`hetcomm.ops.snapshot.Snapshotter.placement_record`: ``{"world_size",
            "nodes", "placement": {"models", "weights", "speeds_by_model"} | None}`` of the
            snapshots the restore will choose, or None (nothing complete in memory).
        cluster / world_size: this job.

    Returns:
        ``(weights, how)`` as :func:`placement_weights`. The same membership (models and nodes
        rank by rank) keeps the weights the snapshots' job was built with (its experts are where
        its files say; None: the datasheet); another one takes the snapshots' measured speed of
        each rank's device model when every model of the new job was measured there.
    """
    if record is None:
        return None, "datasheet"
    place = record.get("placement")
    if not isinstance(place, dict):
        return None, "datasheet (the in-memory snapshots carry no measured speeds: taken by an older hetcomm)"
    cur = members(cluster, world_size)
    models, nodes = place.get("models") or [], record.get("nodes") or []
    prev = {"ranks": [{"model": m, "node": n} for m, n in zip(models, nodes)]}
    if len(models) == len(nodes) == int(record.get("world_size", -1)) and _same(prev, cur):
        weights = place.get("weights")
        if weights is None:
            return None, "datasheet"
        return [float(w) for w in weights], "the in-memory snapshots' placement (same membership)"
    speeds = place.get("speeds_by_model") or {}
    want = [r["model"] for r in cur["ranks"]]
    missing = sorted({m for m in want if m not in speeds})
    if missing:
        return None, f"datasheet (no measured speed of {', '.join(missing)} in the in-memory snapshots)"
    weights = [float(speeds[m]) for m in want]
    if not all(w > 0 for w in weights):
        return None, "datasheet (a measured speed was not positive)"
    return weights, "measured speeds of the in-memory snapshots (rows/s per device model)"


def summary_rows(change: Optional[MembershipChange], census: ExpertCensus) -> List[Tuple[str, str]]:
    """The job summary's rows: the experts present at the end, and the membership change."""
    rows = [("experts present", census.line())]
    if change is not None:
        rows.append(("membership change", change.line()))
    return rows
