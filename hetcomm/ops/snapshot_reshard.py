"""In-memory snapshots restored on another world size: a shrunk or grown job loses at most a step.

A job that goes on with fewer ranks (a node lost for good under ``hetcomm launch --nnodes
MIN:MAX``) or more (the node came back at the next rendezvous) finds the previous membership's
snapshots on the nodes that are still there: each old rank's own file
(``r<rank>-w<old world>-s<step>.snap``) where its node survived, else its buddy's copy
(``p<rank>-...``) on another node. :meth:`hetcomm.ops.snapshot.Snapshotter.restore` picks the
newest step for which every *old* rank's state is held somewhere (:func:`newest_complete`);
:func:`reshard` rebuilds every *new* rank's state from it. Without this a shrink reloaded the
last disk checkpoint and redid every step since; now it redoes at most the step the failure
interrupted (the peer copies of step ``n`` exist once any rank finished step ``n + 1``). The
same path serves a job of the same world size on other nodes (a lost node replaced by a new
one): its experts may be placed otherwise, so each rank's own file may not hold its experts.

What a new rank gets, key by key (the keys of :mod:`hetcomm.ops.checkpoint`):

==================================  ========================================================
``model/<fqn>``, ``optim/model/..``  identical on every old rank (data parallel, replicator
``replicator/..``, ``train/step``    heat agreed): from one old snapshot, one this rank reads
                                     itself when its node holds any
``expert/<l>/<e>/..``,               by global id, from the one old snapshot that holds expert
``optim/expert/<l>/<e>/..``          ``e`` (its old owner's), wherever that file survived;
                                     the new owner map is the layer's, built for the new world
                                     before the restore (:mod:`hetcomm.ops.membership`)
``train/rng/<r>``                    old rank ``r``'s data stream for ``r`` < old world size;
                                     a rank the old job did not have keeps its fresh stream
``extra/<name>``                     not restored: re-initialised (below)
==================================  ========================================================

That is what :func:`hetcomm.ops.checkpoint.load_checkpoint` does with a DCP checkpoint of the
same step on the new world; ``tests/ops/test_snapshot_reshard.py`` asserts that both give the
same state, bit for bit, and the same losses after it, for 4 -> 3 and 3 -> 4 ranks.

**Re-initialised, because it is per rank of the old world and has no meaning on the new one**:
the balancer (``--balance``: per-layer maps and a placement over the old ranks; its fresh state
is the placement the model was built with) and PowerSGD's error feedback and warm-start factors
(:class:`~hetcomm.ops.checkpoint.PerRank`: one blob per old rank, keyed by buckets of the old
group; compression starts again from its warm-up). Each starts as on a fresh job; the next
snapshot holds the new state. (DCP's reshard loads such state by rank number where the shapes
allow, which maps old rank 2's state onto new rank 2 whatever it was, and fails on the batch
split's sizes.) Paged layers are restored like the others: their experts are synced before
every snapshot (:func:`hetcomm.ops.hooks.maybe_snapshot`).

**Protocol** (collective over the snapshot group; every rank computes the same plan from the
same gathered facts, so every rank raises the same error before any byte moves):

1. each old rank's snapshot gets a *holder*: the new rank of the same number when its node
   holds the file (the common case: ranks before the lost one keep their numbers), else the
   lowest new rank whose node holds the old rank's own file, else the lowest holding a peer
   copy (:func:`choose_holders`). The holder reads it; one all-gather spreads every old
   snapshot's key list and header;
2. every new rank names the keys it needs from each old rank (:func:`plan_requests`; one
   all-gather);
3. each holder sends every other rank one packed message (:func:`hetcomm.ops.snapshot_format.pack`)
   with everything that rank asked of the holder's snapshots, and receives its own in holder
   order. On the wire: the experts a rank now owns that lived on another node, and the dense
   state for a rank whose node holds no old snapshot (a returning node).

Why not DCP's planner here: DCP reshards from files it wrote itself through its metadata; these
snapshots are one flat file per rank in shared memory (written in milliseconds every step,
:mod:`hetcomm.ops.snapshot`), and the mapping by global expert id is hetcomm's own either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.errors import CheckpointError
from hetcomm.ops import checkpoint as ck
from hetcomm.ops.checkpoint import TrainState
from hetcomm.ops.snapshot_format import Restored, apply_state, pack, read_bytes, unpack

__all__ = ["newest_complete", "choose_holders", "plan_requests", "reshard", "Resharded"]

#: ``(world size, old rank, step) -> {new rank whose node holds it: "r" own file | "p" peer copy}``
Held = Mapping[Tuple[int, int, int], Mapping[int, str]]

_EXPERT_PREFIXES = ("expert/", "optim/expert/")


def newest_complete(held: Held, world_size: int, below: Optional[int] = None) -> Optional[Tuple[int, int]]:
    """The newest step whose snapshots are complete for some world size: every rank of that
    world held somewhere.

    Args:
        held: what the ranks' nodes hold (see :data:`Held`).
        world_size: this job's world size: preferred when two world sizes are complete at the
            same step.
        below: only steps before this one (None: any).

    Returns:
        ``(world size, step)``, or None when no step is complete.
    """
    best: Optional[Tuple[int, int]] = None
    for w, s in sorted({(w, s) for (w, _, s) in held}):
        if below is not None and s >= below:
            continue
        if not all((w, r, s) in held for r in range(w)):
            continue
        if best is None or s > best[1] or (s == best[1] and w == world_size):
            best = (w, s)
    return best


def choose_holders(held: Held, old_world: int, step: int) -> List[int]:
    """``old rank -> the new rank that reads its snapshot and serves it`` (step 1 above).

    Raises:
        KeyError: an old rank of ``step`` is held nowhere (the caller chose an incomplete step).
    """
    out = []
    for o in range(old_world):
        where = held[(old_world, o, step)]
        if o in where:
            out.append(o)
            continue
        own = [r for r, kind in where.items() if kind == "r"]
        out.append(min(own) if own else min(where))
    return out


def plan_requests(
    want: Sequence[str], keys_of: Mapping[int, Set[str]], rank: int, local: Sequence[int]
) -> Tuple[Dict[int, List[str]], List[str]]:
    """Which old snapshot each key this rank needs comes from (step 2 above).

    Args:
        want: the tensor keys of this rank's state on the new world (``_state(create=True)``).
        keys_of: ``old rank -> its snapshot's tensor keys``.
        rank: this rank.
        local: the old ranks whose snapshots this rank holds (dense keys come from these first).

    Returns:
        ``({old rank: [keys]}, keys found nowhere)``. This rank's data stream is asked of old
        rank ``rank`` only; optimizer keys found nowhere belong to parameters that had no state
        at the snapshot (the caller drops their state, as a same-world restore does).
    """
    old_ranks = sorted(keys_of)
    order = [o for o in old_ranks if o in set(local)] + [o for o in old_ranks if o not in set(local)]
    requests: Dict[int, List[str]] = {}
    missing: List[str] = []
    for key in want:
        if key.startswith("train/rng/"):
            src = rank if key in keys_of.get(rank, ()) else None
        elif key.startswith(_EXPERT_PREFIXES):
            src = next((o for o in old_ranks if key in keys_of[o]), None)  # one owner: checked before
        else:
            src = next((o for o in order if key in keys_of[o]), None)
        if src is None:
            missing.append(key)
        else:
            requests.setdefault(src, []).append(key)
    return requests, missing


def _doubled(keys_of: Mapping[int, Set[str]]) -> Dict[str, List[int]]:
    """Expert keys held by more than one old snapshot (a bug, or snapshots of two jobs)."""
    seen: Dict[str, List[int]] = {}
    for o in sorted(keys_of):
        for key in keys_of[o]:
            if key.startswith(_EXPERT_PREFIXES):
                seen.setdefault(key, []).append(o)
    return {k: v for k, v in seen.items() if len(v) > 1}


@dataclass(frozen=True)
class Resharded:
    """What :func:`reshard` restored, and the job's counts the old snapshots carried (restores
    and steps lost before this restore) for the Snapshotter to continue from."""

    restored: Restored
    lost_before: int
    restores_before: int


def reshard(group: dist.ProcessGroup, rank: int, world: int, old_world: int, step: int, held: Held,
            paths: Mapping[Tuple[int, int, int], str], finished: int, model: nn.Module,
            optimizer: Optional[torch.optim.Optimizer], rng: torch.Generator) -> Resharded:
    """Rebuild this rank's state from the ``old_world``-rank snapshots of ``step`` (collective
    over ``group``, the snapshot group; see the module docstring).

    Args:
        group / rank / world: the snapshot group, this rank in it and its size (the new world).
        old_world / step: what :func:`newest_complete` chose.
        held: every rank's report of its node's snapshots.
        paths: ``(world, old rank, step) -> file`` of this rank's node.
        finished: the newest step any rank recorded as finished.
        model / optimizer / rng: this rank's objects on the new world (filled in place).

    Returns:
        What was restored (``resharded_from`` = ``old_world``) and the carried counts.

    Raises:
        CheckpointError: on every rank alike, before any tensor moves: an expert held by two old
            snapshots, a key of this model that no old snapshot holds (another model or expert
            count) or holds in another shape.
    """
    where = f"<in-memory snapshots of step {step}, {old_world} ranks>"
    holder = choose_holders(held, old_world, step)
    mine = {o: unpack(read_bytes(paths[(old_world, o, step)])) for o in range(old_world) if holder[o] == rank}
    box: List[object] = [None] * world
    index = {o: ({k: tuple(t.shape) for k, t in p["tensors"].items()}, p["meta"]) for o, p in mine.items()}
    dist.all_gather_object(box, index, group=group)
    keys_of: Dict[int, Set[str]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    metas: Dict[int, Mapping[str, object]] = {}
    for part in box:
        for o, (keys, meta) in part.items():  # type: ignore[union-attr]
            keys_of[int(o)], metas[int(o)] = set(keys), meta
            shapes.update(keys)
    doubled = _doubled(keys_of)
    for key in sorted(doubled)[:1]:
        raise CheckpointError(f"expert state {key!r} is held by the snapshots of old ranks {doubled[key]}: they are "
                              f"not of one job; delete the job's snapshot directory to resume from disk",
                              path=where, key=key, reason="mismatch")
    state = ck._state(model, optimizer, TrainState(0, rng), {}, rank, create=True)
    want = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
    requests, missing = plan_requests(want, keys_of, rank, sorted(mine))
    missing = [k for k in missing if not k.startswith("optim/") and k != f"train/rng/{rank}"]
    other = [(k, shapes[k], tuple(state[k].shape)) for ks in requests.values() for k in ks  # type: ignore[union-attr]
             if k != f"train/rng/{rank}" and shapes[k] != tuple(state[k].shape)]  # type: ignore[union-attr]
    asks: List[object] = [None] * world
    dist.all_gather_object(asks, (requests, missing[:1], len(missing), other[:1]), group=group)
    for r, (_, miss, n, bad) in enumerate(asks):  # type: ignore[misc]
        if n:
            raise CheckpointError(f"has no {miss[0]!r} that rank {r} of the new job needs ({n} key(s) missing): "
                                  f"taken by another model or expert count; start the job afresh or resume "
                                  f"from disk", path=where, key=miss[0], reason="mismatch")
        if bad:
            raise CheckpointError(f"holds {bad[0][0]!r} of shape {bad[0][1]}, rank {r} of the new job has "
                                  f"{bad[0][2]}: taken by another model; start the job afresh or resume from disk",
                                  path=where, key=bad[0][0], reason="mismatch")
    saved: Dict[str, torch.Tensor] = {}
    sends, keep = [], []
    for dst, (req, *_) in enumerate(asks):  # type: ignore[misc]
        part = {k: mine[o]["tensors"][k] for o, ks in req.items() if holder[o] == rank for k in ks}
        if dst == rank:
            saved.update(part)
        elif part:
            blob = pack(part, {})
            data = torch.frombuffer(blob, dtype=torch.uint8)  # host: bytes on the wire
            head = torch.tensor([len(blob)], dtype=torch.int64)  # host: header
            keep += [blob, data, head]  # alive until the sends complete
            sends += [dist.isend(head, dst, group=group), dist.isend(data, dst, group=group)]
    for src in sorted({holder[o] for o, ks in requests.items() if ks and holder[o] != rank}):
        head = torch.empty(1, dtype=torch.int64)  # host: header
        dist.recv(head, src, group=group)
        got = torch.empty(int(head[0]), dtype=torch.uint8)  # host: bytes off the wire
        dist.recv(got, src, group=group)
        saved.update(unpack(got.numpy().tobytes())["tensors"])  # type: ignore[arg-type]
    for w in sends:
        w.wait()
    del keep
    rng_key = f"train/rng/{rank}"
    if rng_key not in saved:  # a rank the old job did not have: its fresh stream, as DCP's load
        saved[rng_key] = rng.get_state()
    apply_state({"meta": {}, "extras": {}, "tensors": saved}, where, model, optimizer, rng, None, rank)
    peers = tuple(o for o in range(old_world) if held[(old_world, o, step)][holder[o]] == "p")
    restored = Restored(step, "memory+peer" if peers else "memory", max(0, finished - step), peers,
                        resharded_from=old_world)
    return Resharded(restored, max(int(m.get("lost", 0)) for m in metas.values()),  # type: ignore[call-overload]
                     max(int(m.get("restores", 0)) for m in metas.values()))  # type: ignore[call-overload]
