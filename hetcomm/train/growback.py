"""``hetcomm train --shrink-in-place --grow-back``: a killed rank's slot taken back in place.

After an in-place shrink (:mod:`hetcomm.train.inplace`) the job runs on fewer ranks. With
``--grow-back`` it gets them back through torch's ``dist._reconfigure`` (a hetcomm group
implements it: :mod:`hetcomm.backends.reconfigure`), without restarting anyone:

1. **The launcher starts a replacement.** hetcomm's launcher (it hosts the store and sees the
   death) starts one new process in the slot of a rank killed by a signal, once per slot
   (``LaunchOptions.rejoin``), with ``HETCOMM_JOIN=1`` and the slot's own ``RANK`` and the
   original ``WORLD_SIZE``.
2. **The replacement joins** (:func:`join`): it creates its default group as a group of one with
   ``enable_reconfigure=True`` over the launcher's store, publishes its reconfigure handle under
   ``hetcomm/grow-back/<slot>/handle`` and waits for the survivors' plan (a timeout names them).
3. **The survivors take it in at an agreed step** (:func:`maybe_grow`): after every step of a
   shrunk job, rank 0 checks the store without blocking and broadcasts what it saw (one small
   broadcast), so every survivor acts after the same step. Only when *every* missing slot has a
   replacement: a list of handles numbers the new ranks by position, and a joiner's handle
   carries no slot, so the new numbering equals the original one only with every slot filled.
   The survivors gather their handles; rank 0 orders them by slot with the joiners' (survivors
   in their old order, each joiner in its own slot), picks a fresh uuid and publishes the plan
   (for the joiners) while broadcasting it (for the survivors); everyone calls
   ``dist._reconfigure``, agrees on c10d's group counter (the next groups' names), and rebuilds
   the job on the original world exactly as the shrink does (:func:`hetcomm.train.inplace.rebuild`:
   ``_build``, the restore from the in-memory snapshots resharded by global expert id, ``_start``
   with a membership record whose cause names the joiner). The joiner restores from the same
   snapshots: it has none of its own, the reshard gives it its experts by global id.

No hangs: a replacement that dies before publishing its handle is never waited for (the
survivors finish on the smaller world and rank 0 says so at the end); one that dies after
publishing makes the reconfigure's agreement time out on every survivor (``PeerTimeout`` naming
its handle), and the survivors go on with the old job, which the failed change left untouched,
and do not try that slot again. A replacement that starts after the job finished finds the
survivors' end mark and exits 0.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import uuid as uuid_mod
from typing import Any, Callable, Dict, List, Set, Tuple

__all__ = ["joining", "join", "maybe_grow", "finished", "grows", "KEY"]

#: Store prefix of the grow-back's keys (the launcher's store; one launch, one job).
KEY = "hetcomm/grow-back"


class _State:
    """This process's grow-back bookkeeping (one job per process)."""

    store: Any = None
    given_up: Set[int] = set()
    grows: int = 0
    worlds: Dict[str, int] = {}  # cluster path -> its ranks (read once, not every step)


def joining() -> bool:
    """Whether this process was started to take a killed rank's slot back (``HETCOMM_JOIN``)."""
    from hetcomm import settings

    return bool(settings.JOIN.get())


def _store(timeout_s: float):
    """The launcher's store (``MASTER_ADDR``/``MASTER_PORT``), as a client; one per process."""
    from hetcomm.ops.worker import master_store

    if _State.store is None:
        _State.store = master_store(timeout_s)
    return _State.store


def _original_world(cfg) -> int:
    """The cluster file's ranks: the world the job grows back to."""
    from hetcomm.topo.cluster import load_cluster

    if cfg.cluster not in _State.worlds:
        _State.worlds[cfg.cluster] = load_cluster(cfg.cluster).num_ranks
    return _State.worlds[cfg.cluster]


def _agree_group_count(count: int) -> None:
    """c10d's group counter names the next ``new_group``s (hence their store prefixes): the joiner's
    starts from its group of one, the survivors' from their job's; all go on from the largest."""
    import torch
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    t = torch.tensor([max(count, c10d._world.group_count)], dtype=torch.int64)  # host: a CPU default group
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c10d._world.group_count = int(t.item())


def maybe_grow(job, step: int, build: Callable[[int, int, Any], Any],
               start: Callable[..., None]) -> Tuple[Any, int]:
    """After a step of a shrunk job: take the replacements in when every missing slot has one
    (module docstring). Called by every survivor with the next step ``step``; collective (one
    broadcast) while slots are missing and ``step`` is still to be trained.

    Returns:
        ``(job, step)`` unchanged, or the job rebuilt on the grown world and its next step.
    """
    import torch
    import torch.distributed as dist

    cfg = job.cfg
    slots = list(job.slots) if job.slots else list(range(job.world_size))
    missing = [s for s in range(_original_world(cfg)) if s not in slots]
    if not missing or step > cfg.steps or set(missing) & _State.given_up:
        return job, step
    ready = 0
    if job.rank == 0:
        store = _store(cfg.timeout_s)
        ready = int(all(store.check([f"{KEY}/{s}/handle"]) for s in missing))
    flag = torch.tensor([ready], dtype=torch.int64)  # host: a CPU default group
    dist.broadcast(flag, src=0)
    if not int(flag.item()):
        return job, step
    if job.snap is not None:
        job.snap.settle()  # the last step's peer copies are complete before the old groups go
    mine: List[Any] = [None] * job.world_size
    dist.all_gather_object(mine, dist._get_reconfigure_handle())
    plan: List[Any] = [None]
    if job.rank == 0:
        plan[0] = _plan(job, cfg, slots, missing, mine, step)
    dist.broadcast_object_list(plan, src=0)
    return _grow(job, plan[0], missing, build, start)


def _plan(job, cfg, slots: List[int], missing: List[int], mine: List[str], step: int) -> Dict[str, Any]:
    """Rank 0's plan of the grow: the handles by slot, a fresh uuid, what the joiners need to
    rebuild as the survivors do (the losses so far, the group counter, the cause); published
    under ``<KEY>/<slot>/plan`` for each joiner."""
    import torch.distributed as dist

    from hetcomm.topo.cluster import load_cluster

    store = _store(cfg.timeout_s)
    joiners = {s: store.get(f"{KEY}/{s}/handle").decode() for s in missing}
    for s in missing:  # taken: a later loss of the same slot must not find this process's handle
        store.delete_key(f"{KEY}/{s}/handle")
    new_slots = sorted(slots + missing)
    handles = [mine[slots.index(s)] if s in slots else joiners[s] for s in new_slots]
    cluster = load_cluster(cfg.cluster)
    who = ", ".join(f"cluster rank {s} ({cluster.rank(s).model} on {cluster.rank(s).node.name})" for s in missing)
    cause = (f"{who} rejoined: the launcher started a replacement for the killed process and the survivors took it "
             f"in after step {step - 1} (dist._reconfigure, --grow-back)")
    plan = {"uuid": uuid_mod.uuid4().int >> 66, "handles": handles, "slots": new_slots, "cause": cause,
            "losses": list(job.losses), "start_step": job.start_step, "shrinks": job.shrinks,
            "group_count": dist.distributed_c10d._world.group_count, "step": step}
    for s in missing:
        store.set(f"{KEY}/{s}/plan", json.dumps(plan))
    return plan


def _grow(job, plan: Dict[str, Any], missing: List[int], build, start) -> Tuple[Any, int]:
    """Every survivor: the reconfigure of ``plan`` and the rebuild on the grown world; a failed
    reconfigure leaves the old job as it was (the slot is not tried again)."""
    import torch.distributed as dist

    from hetcomm.errors import HetcommError
    from hetcomm.train import inplace

    cfg = job.cfg
    since = time.time()
    try:
        dist._reconfigure(uuid=plan["uuid"], handles=plan["handles"],
                          timeout=datetime.timedelta(seconds=cfg.timeout_s)).wait()
    except HetcommError as e:
        _State.given_up.update(missing)
        if job.rank == 0:
            first = str(e).splitlines()[0][:300]
            print(f"hetcomm train: --grow-back: the replacement(s) for cluster rank(s) {missing} did not join "
                  f"({type(e).__name__}: {first}); going on with {job.world_size} ranks", file=sys.stderr, flush=True)
        return job, plan["step"]
    if job.rank == 0:
        print(f"hetcomm train: {plan['cause']}", file=sys.stderr, flush=True)
    _agree_group_count(plan["group_count"])
    inplace._let_go(job)
    new, start_step = inplace.rebuild(cfg, plan["slots"], plan["cause"], since, build, start)
    new.losses = list(job.losses[: max(0, start_step - job.start_step)])
    new.start_step, new.shrinks = job.start_step, job.shrinks
    _State.grows += 1
    return new, start_step + 1


def join(slot: int, world_size: int, cfg, build: Callable[[int, int, Any], Any], start: Callable[..., None],
         loop: Callable[[Any, int], int]) -> int:
    """The replacement's side (``HETCOMM_JOIN``): its group of one (already created with
    ``enable_reconfigure=True``) publishes its handle, waits for the survivors' plan, joins
    through ``dist._reconfigure``, rebuilds the job as they do, and trains on with them.

    Args:
        slot / world_size: the cluster slot it stands for and the job's original world.
        loop: the loop's ``(job, next step) -> exit code``.

    Returns:
        The job's exit code (0 without training when the survivors had already finished).

    Raises:
        PeerTimeout: no plan within twice the job's timeout, naming the survivors.
        ConfigError: the reconfigure gave this process another rank than its slot.
    """
    import torch.distributed as dist

    from hetcomm.errors import ConfigError, PeerTimeout
    from hetcomm.train import inplace

    store = _store(cfg.timeout_s)
    store.set(f"{KEY}/{slot}/handle", dist._get_reconfigure_handle())
    wait_s = 2 * cfg.timeout_s + inplace.CONFIRM_S
    deadline = time.monotonic() + wait_s
    plan_key, done_key = f"{KEY}/{slot}/plan", f"{KEY}/done"
    while not store.check([plan_key]):
        if store.check([done_key]):
            print(f"hetcomm train: --grow-back: the replacement for cluster rank {slot} started after the job "
                  f"finished ({store.get(done_key).decode()}); nothing to join", file=sys.stderr, flush=True)
            return 0
        if time.monotonic() > deadline:
            others = [r for r in range(world_size) if r != slot]
            raise PeerTimeout(
                f"--grow-back: the survivors (cluster ranks {others}) did not take the replacement for cluster rank "
                f"{slot} in within {wait_s:g} s (no plan under the launcher store's key {plan_key!r}): they failed, "
                f"hung, or run without --grow-back; the job goes on without this slot",
                op="grow-back", rank=slot, peer=others[0] if others else None)
        time.sleep(0.1)
    plan = json.loads(store.get(plan_key).decode())
    since = time.time()
    dist._reconfigure(uuid=plan["uuid"], handles=plan["handles"],
                      timeout=datetime.timedelta(seconds=cfg.timeout_s)).wait()
    if dist.get_rank() != plan["slots"].index(slot):
        raise ConfigError(f"--grow-back: the replacement for cluster rank {slot} became rank {dist.get_rank()} of "
                          f"{dist.get_world_size()} (slots {plan['slots']}); the plan must put it in its slot",
                          key="grow_back")
    _agree_group_count(plan["group_count"])
    job, start_step = inplace.rebuild(cfg, plan["slots"], plan["cause"], since, build, start)
    job.losses = list(plan["losses"][: max(0, start_step - plan["start_step"])])
    job.start_step, job.shrinks = plan["start_step"], plan["shrinks"]
    _State.grows += 1
    return loop(job, start_step + 1)


def finished(job) -> None:
    """At the end of training (every rank): rank 0 marks the job finished for a replacement that
    comes too late, and says which slots never came back."""
    from hetcomm.train import inplace

    cfg = job.cfg
    if not cfg.grow_back or job.rank != 0 or not inplace.enabled(cfg):
        return
    slots = list(job.slots) if job.slots else list(range(job.world_size))
    _store(cfg.timeout_s).set(f"{KEY}/done", f"at step {cfg.steps} with {job.world_size} ranks")
    missing = [s for s in range(_original_world(cfg)) if s not in slots]
    if missing:
        print(f"hetcomm train: --grow-back: cluster rank(s) {missing} did not come back (no replacement joined); "
              f"finished with {job.world_size} ranks", file=sys.stderr, flush=True)


def grows() -> int:
    """How many grow-backs this process took part in."""
    return _State.grows
