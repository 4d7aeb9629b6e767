"""The training loop's operations hooks: resume, per-step metrics, periodic checkpoints.

``hetcomm.train.loop`` calls these three so that the loop itself stays a loop; each is a no-op
when its setting is off (``TrainConfig.metrics``, ``checkpoint_dir``/``checkpoint_every``,
``resume``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch
from torch import nn

from hetcomm.ops.checkpoint import Stateful, latest_checkpoint, load_checkpoint, save_checkpoint
from hetcomm.ops.metrics import MetricsCollector, RunHeader, StepRecord, comm_env

if TYPE_CHECKING:  # pragma: no cover
    from hetcomm.moe.paging import ExpertPager

__all__ = [
    "NullCollector", "metrics_collector", "experts_per_rank", "checkpoint_group", "resume", "warmup", "maybe_checkpoint",
    "record_verdict", "nothing_to_train", "finish_checkpoints", "snapshotter", "restore", "maybe_snapshot", "close_snapshots",
]

_GROUP: list = []


def checkpoint_group():
    """The gloo group DCP coordinates over (collective on first call; None without a job).

    A plain gloo group of the whole job: DCP's object collectives (plans, metadata) then never
    share a queue with the job's own collectives on the ``hetcomm`` group.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    if not _GROUP or _GROUP[0][0] is not dist.group.WORLD:
        _GROUP[:] = [(dist.group.WORLD, dist.new_group(backend="gloo"))]
    return _GROUP[0][1]


class NullCollector:
    """The collector's interface doing nothing (``--metrics`` not given): no timers, no
    collective, so a run without metrics costs exactly what it did before."""

    def start_step(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def end_step(self, step: int, loss: float, tokens: int) -> Optional[StepRecord]:
        return None

    def event(self, step: int, event: str, detail: str = "", marks=None) -> None:
        pass

    def close(self) -> None:
        pass


def metrics_collector(cfg, rank: int, world_size: int, cluster, model: nn.Module, start_step: int,
                      resumed_from: Optional[str] = None):
    """A :class:`MetricsCollector` writing ``cfg.metrics``, or a :class:`NullCollector`.
    ``resumed_from``: what :func:`restore` restored (the ``resume`` event's detail)."""
    if not cfg.metrics:
        return NullCollector()
    ranks = [
        {"rank": r, "model": cluster.rank(r).model, "node": cluster.rank(r).node.name} for r in range(world_size)
    ]
    header = RunHeader(
        world_size=world_size, cluster=cluster.name, ranks=ranks, config=asdict(cfg), start_step=start_step,
        env=comm_env(),
    )
    mc = MetricsCollector(cfg.metrics, rank, world_size, cluster, model.moe_layers, header, backend=cfg.backend)
    if start_step or resumed_from:  # a restart from step 0 (nothing held) is a resume too
        from hetcomm.ops.rank_marks import startup_marks

        detail = resumed_from or f"from {latest_checkpoint(cfg.checkpoint_dir)}"
        mc.event(start_step, "resume", detail + experts_per_rank(model.moe_layers, world_size), marks=startup_marks())
    return mc


def experts_per_rank(layers: Sequence[nn.Module], world_size: int) -> str:
    """``"; experts per rank: layer 0 [3, 5, 5, 3], layer 1 [...]"``: the placement a restarted
    job trains on, as restored (a placement by speed changes the counts; a restore must bring
    them back), for the ``resume`` event; empty without MoE layers. Host lists, no collective:
    every rank holds every layer's owner map."""
    rows = [f"layer {i} {[list(m.placement.owner).count(r) for r in range(world_size)]}" for i, m in enumerate(layers)]
    return "; experts per rank: " + ", ".join(rows) if rows else ""


def resume(
    cfg, model: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Generator,
    extras: Optional[Mapping[str, Stateful]] = None,
) -> int:
    """Load the latest checkpoint when ``cfg.resume`` and one exists; returns the step it was
    taken after (0 for a fresh start). Collective when it loads."""
    if not cfg.checkpoint_dir:
        return 0
    group = checkpoint_group()  # made here, at the same point on every rank
    if not cfg.resume:
        return 0
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        return 0
    step = load_checkpoint(path, model, optimizer, rng, extras, process_group=group)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"hetcomm train: resumed from {path} (after step {step})", file=sys.stderr, flush=True)
    return step


def maybe_checkpoint(
    cfg, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Generator, mc,
    extras: Optional[Mapping[str, Stateful]] = None,
) -> Optional[str]:
    """Save after ``step`` when it is a multiple of ``cfg.checkpoint_every`` (collective)."""
    if not (cfg.checkpoint_dir and cfg.checkpoint_every) or step % cfg.checkpoint_every:
        return None
    if cfg.checkpoint_async:  # written in the background, committed at the next one
        from hetcomm.ops.checkpoint import save_checkpoint_async

        done = finish_checkpoints(mc)
        _PENDING.append(save_checkpoint_async(cfg.checkpoint_dir, step, model, optimizer, rng, extras,
                                              process_group=checkpoint_group(), keep=cfg.keep_checkpoints))
        return done
    path = save_checkpoint(cfg.checkpoint_dir, step, model, optimizer, rng, extras, process_group=checkpoint_group(),
                           keep=cfg.keep_checkpoints)
    mc.event(step, "checkpoint", os.path.basename(path))
    return path


_PENDING: list = []  # the background checkpoint in flight (at most one)


def finish_checkpoints(mc=None) -> Optional[str]:
    """Wait for the background checkpoint in flight and commit it (rank 0); a no-op without one.
    Called before the next one and at the end of the run (``--checkpoint-async``)."""
    from hetcomm.ops.checkpoint import finish_save

    path = None
    while _PENDING:
        pending = _PENDING.pop()
        path = finish_save(pending)
        if mc is not None and path is not None:
            mc.event(pending.step, "checkpoint", os.path.basename(path) + " (written in the background)")
    return path


def record_verdict(cfg, rank: int, summary: Mapping[str, object]) -> None:
    """Rank 0 at the end of a run with a checkpoint directory: keep the verdict, so that a
    resume with nothing left to train reports it (:func:`nothing_to_train`)."""
    if not cfg.checkpoint_dir or rank != 0:
        return
    from hetcomm.ops.checkpoint_files import write_verdict

    write_verdict(cfg.checkpoint_dir, {
        "step": cfg.steps, "ok": bool(summary["ok"]), "verdict": str(summary["verdict"]),
        "first": float(summary["first"]), "last": float(summary["last"]),
    })


def nothing_to_train(cfg, rank: int, start_step: int) -> int:
    """A resume whose checkpoint is at or past ``cfg.steps``: no step runs. Reports the verdict
    the run recorded when it finished that step (its exit code: 0 pass, 1 fail).

    Raises:
        UsageError: there is no recorded verdict for that step (``--steps`` lowered below the
            checkpoint, or a run that stopped before its summary): nothing was trained.
    """
    from hetcomm.errors import UsageError
    from hetcomm.ops.checkpoint_files import read_verdict

    rec = read_verdict(cfg.checkpoint_dir)
    if start_step != cfg.steps or rec is None or rec.get("step") != start_step or not isinstance(rec.get("ok"), bool):
        raise UsageError(
            f"nothing to train: the latest checkpoint in {cfg.checkpoint_dir} is after step {start_step} and "
            f"--steps is {cfg.steps}; pass --steps larger than {start_step} to train on, or another --checkpoint-dir"
        )
    if rank == 0:
        print(f"hetcomm train: nothing to train: the checkpoint is after step {start_step} of {cfg.steps}; "
              f"the run's recorded verdict: {rec.get('verdict')}", file=sys.stderr, flush=True)
    return 0 if rec["ok"] else 1


def warmup(cfg, model: nn.Module, start_step: int, pagers: Sequence["ExpertPager"] = ()) -> bool:
    """Phase 2 of ``hetcomm launch``: seed each MoE layer from a previous run's record.

    From the last quarter of ``cfg.warmup_from``'s steps (at least 1): the expert load of layer
    ``i`` becomes its calibrator's history (in fair-share units, what the calibrator itself keeps)
    and its replicator's heat, and the hottest experts are replicated on the strong ranks at the
    first forward. With ``pagers`` (one :class:`~hetcomm.moe.paging.ExpertPager` per layer, in
    layer order) each pager gets the loads as its use hint and pages in the hottest experts, as
    many as its free slots take; a paged layer (``page_budget > 0``) does the same for its own
    pager (:meth:`~hetcomm.moe.layer.MoELayer.warm_pages`). Skipped after a resume (the checkpoint has the real state).
    Every rank reads the same file, so the seeded state is identical everywhere.

    Returns:
        True when it seeded something.

    Raises:
        ConfigError: the file does not parse, or its layers/experts do not match the model.
    """
    if not cfg.warmup_from or start_step:
        return False
    from hetcomm.errors import ConfigError
    from hetcomm.ops.metrics import read_metrics

    log = read_metrics(cfg.warmup_from)
    steps = log.steps[-max(1, len(log.steps) // 4):]
    if not steps:
        raise ConfigError("has no step records to warm up from", path=cfg.warmup_from)
    layers = model.moe_layers
    if len(steps[-1].expert_load) != len(layers):
        raise ConfigError(
            f"records {len(steps[-1].expert_load)} MoE layers but the model has {len(layers)}; "
            f"warm up from a run of the same model",
            path=cfg.warmup_from, key="expert_load",
        )
    for i, layer in enumerate(layers):
        E = layer.config.num_experts
        load = torch.tensor(
            [sum(s.expert_load[i][e] for s in steps) for e in range(len(steps[-1].expert_load[i]))], dtype=torch.float64
        )
        if load.numel() != E:
            raise ConfigError(
                f"layer {i} records {load.numel()} experts but the model has {E}", path=cfg.warmup_from, key="expert_load"
            )
        share = load / load.sum().clamp_min(1.0)
        cal = layer.gate.calibrator
        if cal is not None:
            with torch.no_grad():
                cal.history.copy_((share * E).to(cal.history.dtype))
        rep = layer.replicator
        if rep is not None:
            per_step = load / len(steps)
            rep.ema.copy_(per_step)
            rep.set_hot(torch.topk(per_step, min(rep.num_hot, E)).indices.tolist())
        layer.warm_pages(share)  # a paged layer (page_budget > 0) pages in its hottest experts
        if i < len(pagers):
            pager = pagers[i]
            pager.hint(share / share.max().clamp_min(1e-12))  # hottest = certain to be used
            for e in torch.argsort(share, descending=True).tolist():
                if not pager.resident(e) and not pager.prefetch(e):
                    break  # no free slot and nothing colder to evict: the working set is full
            pager.sync()
    return True


# -- in-memory snapshots (hetcomm.ops.snapshot) ---------------------------------------------------


def snapshotter(cfg, rank: int, world_size: int, cluster):
    """The rank's :class:`~hetcomm.ops.snapshot.Snapshotter`, or None when snapshots are off
    (``snapshot_every`` 0, or ``auto`` outside torchrun/``hetcomm launch``). Collective when on."""
    import torch.distributed as dist

    from hetcomm.ops.snapshot import Snapshotter, job_id

    every = cfg.snapshot_every
    if every == "auto":
        every = 1 if job_id() else 0  # a restart can only happen under torchrun
    if not every or not dist.is_initialized():
        return None
    nodes = [cluster.rank(r).node.name for r in range(world_size)]
    models = [cluster.rank(r).model for r in range(world_size)]
    return Snapshotter(rank, world_size, nodes, every=int(every), peer=cfg.snapshot_peer, timeout_s=cfg.timeout_s,
                       models=models)


def _disk_step(path: Optional[str]) -> int:
    import re

    m = re.match(r"step-(\d+)", os.path.basename(path or ""))
    return int(m.group(1)) if m else 0


def disk_step(cfg) -> int:
    """The step of the disk checkpoint ``--resume`` would load (0: none, or no ``--resume``)."""
    if not (cfg.checkpoint_dir and cfg.resume):
        return 0
    try:
        return _disk_step(latest_checkpoint(cfg.checkpoint_dir))
    except Exception:  # noqa: BLE001 - the resume itself reports a bad directory
        return 0


def restore(cfg, model: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Generator,
            extras: Optional[Mapping[str, Stateful]], snap) -> "tuple[int, Optional[str]]":
    """Memory first, disk second: the newest complete in-memory snapshot of this job (unless a
    disk checkpoint is newer), else :func:`resume`. Returns ``(step done, what was restored)``
    (``(0, None)``: a fresh start). Collective."""
    import torch.distributed as dist

    path = None
    if cfg.checkpoint_dir:
        checkpoint_group()  # made here, at the same point on every rank
        if cfg.resume:
            path = latest_checkpoint(cfg.checkpoint_dir)
    if snap is not None:
        got = snap.restore(model, optimizer, rng, extras, not_before=_disk_step(path), below=cfg.steps)
        if got is not None:
            what = got.line()
            if dist.get_rank() == 0:
                print(f"hetcomm train: restored {what}", file=sys.stderr, flush=True)
            return got.step, what
    step = resume(cfg, model, optimizer, rng, extras)
    lost = snap.count_lost(step) if snap is not None else None
    if not step:
        if not lost:
            return 0, None  # a first start
        what = (f"from nothing: no snapshot or checkpoint held every rank's state; started again from step 0; "
                f"lost {lost} step(s)")
        if dist.get_rank() == 0:
            print(f"hetcomm train: warning: {what}", file=sys.stderr, flush=True)
        return 0, what
    return step, f"from {path}" + (f"; lost {lost} step(s)" if lost is not None else "")


def maybe_snapshot(cfg, snap, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Generator,
                   extras: Optional[Mapping[str, Stateful]] = None, mc=None) -> None:
    """At the end of ``step``: record it as finished and, when due, snapshot (no-op when off).
    The first snapshot this rank could not write (a full file system) is a ``snapshot-skipped``
    event in ``mc``'s metrics."""
    if snap is None:
        return
    skipped = snap.skipped
    _snapshot(cfg, snap, step, model, optimizer, rng, extras)
    if mc is not None and snap.skipped and not skipped:
        mc.event(step, "snapshot-skipped", f"rank {snap.rank}: no space for in-memory snapshots ({snap.no_space})")


def _snapshot(cfg, snap, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, rng: torch.Generator,
              extras: Optional[Mapping[str, Stateful]]) -> None:
    if not snap.due(step):
        snap.mark_done(step)
        return
    if cfg.page_budget:
        for m in model.moe_layers:
            m.sync_pages()  # the snapshot reads the experts: no write-back half done
    snap.take(step, model, optimizer, rng, extras)


def close_snapshots(snap, mc, step: int, steps_run: int, elapsed_s: float) -> list:
    """A normal end: the summary's snapshot rows (also a ``snapshots`` metrics event), then every
    rank removes its snapshot files (collective). Returns the rows ([] when off)."""
    if snap is None:
        return []
    snap.close(remove=False)  # the last peer transfer is in: its time counts
    snap.gather_skipped()
    rows = snap.summary_rows(steps_run, elapsed_s)
    mc.event(step, "snapshots", "; ".join(f"{k}: {v}" for k, v in rows))
    snap.close(remove=True)
    return rows
