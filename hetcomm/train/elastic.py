"""``hetcomm train``'s side of elastic membership and the in-training probe
(:mod:`hetcomm.ops.membership`, :mod:`hetcomm.ops.probe`): where a resume onto other ranks
places the experts, and what the job records when it starts."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["placement", "placement_kwargs", "start"]


def placement(cfg, cluster, world_size: int, snap=None) -> Tuple[Optional[List[float]], str, Any]:
    """Placement weights for a resume onto other ranks (measured speeds), or (None, "datasheet"):
    the checkpoint directory's ``membership.json`` first, else the headers of the in-memory
    snapshots the restore will read (collective when ``snap`` is on). Returns ``(weights, how,
    record)``: ``record`` is those snapshots' placement record (None: none), which also names
    the previous membership when no ``membership.json`` does (:func:`start`)."""
    from hetcomm.ops import hooks
    from hetcomm.ops.membership import placement_weights, snapshot_placement

    weights, how = placement_weights(cfg, cluster, world_size)
    if snap is None:
        return weights, how, None
    record = snap.placement_record(not_before=hooks.disk_step(cfg), below=cfg.steps)  # every rank: collective
    if weights is not None or record is None:
        return weights, how, record
    got, from_snap = snapshot_placement(record, cluster, world_size)
    return (got, from_snap, record) if got is not None or how == "datasheet" else (None, how, record)


def placement_kwargs(weights: Optional[List[float]], experts: int, world_size: int) -> Dict[str, Any]:
    """``MoELayer`` keyword arguments placing the experts by ``weights`` (none: the layer's own)."""
    if weights is None:
        return {}
    from hetcomm.moe.placement import place_experts

    return {"placement": place_experts(experts, world_size, rank_weights=weights)}


def start(cfg, rank: int, world_size: int, cluster, model, start_step: int, mc,
          placement_from: str, snap_record=None, snap=None, cause: Optional[str] = None,
          down_s: Optional[float] = None):
    """After the resume: the membership record/change (collective with a checkpoint directory or
    a restore from snapshots of another membership; ``cause`` and ``down_s``: why, and the seconds
    from the last finished step to the restored state, when the caller knows) and
    the job's probe. Returns ``(change, probe)``."""
    from hetcomm.ops.membership import on_start
    from hetcomm.ops.probe import probe_for

    restored = snap.restored if snap is not None else None
    lost = restored.lost if restored is not None and restored.step == start_step else None
    change = on_start(cfg, rank, world_size, cluster, model, start_step, mc, placement_from,
                      snapshots=snap_record, snapshot_lost=lost, cause=cause,
                      down_s=down_s)
    return change, probe_for(cfg, rank, world_size, cluster, model)
