"""``hetcomm train --shrink-in-place``: a lost rank dropped without restarting the survivors.

torch >= 2.14 lets a group drop members in place (``dist.shrink_group``; a hetcomm group
implements it, :mod:`hetcomm.backends.reconfigure`). This module is what the training loop does
with it when a step fails (:func:`shrink`):

1. **Only a confirmed loss.** The step's error alone proves nothing (a survivor's collective
   may fail because *another survivor* raised and left it). The default group's heartbeat
   (:mod:`hetcomm.backends.heartbeat`) must have seen a peer exit or stop through ``/proc``
   (its definitive causes); every survivor watches every peer, so every survivor drops the same
   ranks. No confirmed loss within :data:`CONFIRM_S`: the error is raised as before.
2. **The old job is let go** without a collective (its snapshot thread and probe get a short
   join; nothing is removed from shared memory: the restore reads it).
3. ``dist.shrink_group(lost)``: the survivors agree on the new membership through the store and
   get a new default group numbered in their old order (every other group is destroyed).
4. **The job is rebuilt on the smaller world by the restart's own code**: the survivors' cluster
   (:func:`hetcomm.ops.job_cluster.survivors_cluster_yaml`), the loop's ``_build`` (placement by the
   snapshots' measured speeds, MoE layers, optimizer, levers, a new snapshotter), the restore
   from the in-memory snapshots resharded by global expert id (the lost rank's state from its
   own file or its buddy's copy), and ``_start`` with the membership record, whose cause names
   the lost rank(s) as the heartbeat saw them. Training goes on from the restored step.

The processes stay the same (pids, imported modules, the launcher's store), so the store must
not live in a lost process: hetcomm's own launcher hosts it (``hetcomm train``, and ``hetcomm
launch --shrink-in-place``, whose job phase runs on it: :mod:`hetcomm.train.local_ranks`). Under
torchrun (``hetcomm launch`` without the flag) the agent stops every worker of a node when one
fails, so there the restart path stays (docs/OPERATIONS.md, "In place or by restart").
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["enabled", "confirmed_losses", "shrink", "rebuild", "outcome_code", "CONFIRM_S"]

#: Seconds a failed step waits for the heartbeat to confirm a lost peer (it sees an exited
#: process within a beat; a loaded machine delays beats, never the /proc check's verdict long).
CONFIRM_S = 10.0
#: Beats to wait after the first confirmed loss, so that ranks lost together are dropped together.
_SETTLE_BEATS = 3


def enabled(cfg) -> bool:
    """Whether ``cfg`` asks for in-place shrinking and this process can do it: torch >= 2.14
    (``shrink_group``), the ``hetcomm`` backend, a cluster file (the survivors' cluster is
    derived from it), and not a torchrun worker (:func:`_under_torchrun`)."""
    from hetcomm.backends.reconfigure import supported

    return (bool(cfg.shrink_in_place) and cfg.backend == "hetcomm" and cfg.cluster != "detect" and supported()
            and not _under_torchrun())


def _under_torchrun() -> bool:
    """Whether torchrun's agent runs this process (``hetcomm launch``): it stops every worker of
    the node when one fails, so survivors would be stopped in the middle of their shrink."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def why_not(cfg) -> Optional[str]:
    """Why ``--shrink-in-place`` is off for ``cfg`` although asked for (None: it is on, or not asked)."""
    if not cfg.shrink_in_place or enabled(cfg):
        return None
    import torch

    if cfg.backend != "hetcomm":
        return f"--shrink-in-place needs the hetcomm backend (this job runs on {cfg.backend})"
    if cfg.cluster == "detect":
        return "--shrink-in-place needs a cluster file (the survivors' cluster is derived from it), not detect"
    if _under_torchrun():
        return ("--shrink-in-place is off under torchrun: its agent stops every worker of the node when one fails "
                "and restarts them; run `hetcomm launch --shrink-in-place` (one machine) or `hetcomm train "
                "--shrink-in-place`")
    return (f"--shrink-in-place needs torch >= 2.14 (dist.shrink_group); this is torch {torch.__version__}: "
            "a lost rank ends the run as before (hetcomm launch restarts it)")


def confirmed_losses(wait_s: float = CONFIRM_S) -> List[Tuple[int, str]]:
    """``(default-group rank, verdict)`` of the peers the heartbeat saw exit or stop, waiting up
    to ``wait_s`` for a first one, then a few beats more for others lost with it. Empty: none
    confirmed (no heartbeat, or only silence, which is a judgement, never a loss)."""
    from hetcomm.backends import heartbeat

    hb = heartbeat.active()
    if hb is None:
        return []
    deadline = time.monotonic() + wait_s
    settle: Optional[float] = None
    while True:
        found = sorted((r, loss.verdict) for r, loss in list(hb.lost.items()) if loss.cause in heartbeat.DEFINITIVE)
        now = time.monotonic()
        if found and settle is None:
            settle = now + _SETTLE_BEATS * hb.interval_s
        if (settle is not None and now >= settle) or (settle is None and now >= deadline):
            return found
        time.sleep(hb.interval_s / 2)


def _let_go(job) -> None:
    """The old job's threads and files, without a collective: its group has a dead member."""
    if job.snap is not None:
        job.snap.abandon()
    if job.probe is not None:
        try:
            job.probe.close(timeout_s=2.0)
        except TypeError:  # the null probe takes no timeout
            job.probe.close()
    if job.mc is not None:
        job.mc.close()  # rank 0's metrics: the membership record reads the last finished step


def _cause(lost: List[Tuple[int, str]], cluster, slots: List[int], err: BaseException) -> str:
    """The membership record's cause: each lost rank (its old rank, device and node) as the
    heartbeat saw it, and the error this rank's step raised."""
    parts = []
    for r, verdict in lost:
        who = cluster.rank(slots[r]) if slots[r] < cluster.num_ranks else None
        where = f" ({who.model} on {who.node.name})" if who is not None else ""
        parts.append(f"{verdict}{where}")
    first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return (f"{'; '.join(parts)} (seen by the heartbeat); the survivors shrank the group in place "
            f"(dist.shrink_group) after {type(err).__name__}: {first}")


def shrink(job, err: BaseException, build: Callable[[int, int, Any], Any],
           start: Callable[..., None]) -> Tuple[Any, int]:
    """Drop the ranks the heartbeat saw exit and rebuild ``job`` on the survivors (module
    docstring). Called by every survivor whose step raised ``err``.

    Args:
        build: ``(rank, world size, cluster) -> job``, the loop's own build of a rank's job.
        start: the loop's ``_start(job, start_step, resumed_from, cause=..., down_s=...)``.

    Returns:
        ``(new job, next step)``: the job on the smaller world, restored from memory, and the
        step after the one restored.

    Raises:
        BaseException: ``err`` itself when no peer loss is confirmed (the old failure path).
    """
    import torch.distributed as dist

    from hetcomm import settings
    from hetcomm.topo.cluster import load_cluster

    failed_at = time.time()
    lost = confirmed_losses()
    if not lost:
        raise err
    cfg = job.cfg
    slots = list(job.slots) if job.slots else list(range(job.world_size))
    original = load_cluster(cfg.cluster)
    cause = _cause(lost, original, slots, err)
    if job.rank == min(r for r in range(job.world_size) if r not in dict(lost)):  # one line per job
        print(f"hetcomm train: {cause}", file=sys.stderr, flush=True)
    _let_go(job)
    c10d = dist.distributed_c10d
    count = c10d._world.group_count
    dist.shrink_group([r for r, _ in lost])
    # Shrinking the default group destroys it, and torch then resets its group counter: the
    # next new_group would take an old group's name, hence its store prefix, and read the dead
    # group's keys (hetcomm's rank claim refuses them). Names go on from where they were.
    c10d._world.group_count = max(c10d._world.group_count, count)
    slots = [s for r, s in enumerate(slots) if r not in dict(lost)]
    if job.snap is not None and not settings.LAUNCH_NONCE.get():
        # Outside hetcomm launch the launch's nonce is rank 0's process mark, agreed at start; the
        # new rank 0 may be another process (old rank 0 lost), and a nonce other than the
        # directory's record would take the snapshots for a dead launch's and delete them.
        os.environ[settings.LAUNCH_NONCE.name] = job.snap.launch.nonce
    # From the last step this process finished (or from the failure, when it finished none):
    # the shrink's whole cost in time, as the membership record counts a restart's.
    since = job.step_done_at if job.step_done_at is not None else failed_at
    new, start_step = rebuild(cfg, slots, cause, since, build, start)
    # The losses of the steps kept (the ones after the restored step are trained again).
    new.losses = list(job.losses[: max(0, start_step - job.start_step)])
    new.start_step = job.start_step
    new.shrinks = job.shrinks + 1
    return new, start_step + 1


def rebuild(cfg, slots: List[int], cause: str, since: float, build: Callable[[int, int, Any], Any],
            start: Callable[..., None]) -> Tuple[Any, int]:
    """The job rebuilt on the default group's new membership, whose rank ``i`` stands for the
    cluster file's rank ``slots[i]``: the cluster of those slots, the loop's ``build``, the
    restore from the in-memory snapshots (resharded by global expert id when the world size
    changed) and ``start`` with the membership record naming ``cause``. Collective over the new
    membership; the in-place shrink and the grow-back (:mod:`hetcomm.train.growback`) both end here.

    Args:
        since: ``time.time()`` the membership record counts the change's cost from.

    Returns:
        ``(new job, step restored)``; the caller sets what the old job carried (losses, counts).
    """
    import torch.distributed as dist

    from hetcomm.ops import hooks
    from hetcomm.ops.job_cluster import survivors_cluster_yaml
    from hetcomm.topo.cluster import load_cluster, load_cluster_text

    rank, world = dist.get_rank(), dist.get_world_size()
    original = load_cluster(cfg.cluster)
    if list(slots) == list(range(original.num_ranks)):
        cluster = original  # every rank back: the file's own cluster
    else:
        text = survivors_cluster_yaml(cfg.cluster, slots)
        cluster = load_cluster_text(text, path=f"{cfg.cluster} (survivors: cluster ranks {list(slots)})")
    new = build(rank, world, cluster)
    new.slots = list(slots)
    start_step, resumed_from = hooks.restore(cfg, new.model, new.opt, new.gen, new.extras or None, new.snap)
    start(new, start_step, resumed_from, cause=cause, down_s=time.time() - since)
    return new, start_step


def outcome_code(outcome, who: str = "hetcomm train") -> Optional[int]:
    """The job's exit code when it shrank in place: every rank that failed was killed by a signal
    and every other rank finished; then the lowest survivor's verdict (0 or 1), after one line
    (prefixed ``who``) naming each rank that died and each that finished in place, with the pid
    the launcher started it as (a survivor's is the pid that finished). None: not that (the
    caller reports the failure as before)."""
    dead = [r for r in outcome.ranks if not r.ok]
    alive = [r for r in outcome.ranks if r.ok]
    if not dead or not alive or any(r.exitcode is None or r.exitcode >= 0 for r in dead):
        return None
    print(f"{who}: rank(s) {[r.rank for r in dead]} died "
          f"({', '.join(f'rank {r.rank} (pid {r.pid}): signal {-r.exitcode}' for r in dead)}); ranks "
          f"{[r.rank for r in alive]} shrank the group in place and finished "
          f"(pids {', '.join(f'{r.rank}:{r.pid}' for r in alive)})", file=sys.stderr, flush=True)
    return 0 if alive[0].result == 0 else 1
