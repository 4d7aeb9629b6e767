"""Sharded checkpoints of an expert-parallel job through ``torch.distributed.checkpoint`` (DCP).

The format is DCP's own (a directory of ``.distcp`` shards plus ``.metadata``); hetcomm only
decides the *keys*, so that the state is sharded by owner and loads on another world size or
placement:

==================================  =================================================  ============
key                                 what                                               saved by
==================================  =================================================  ============
``model/<fqn>``                     dense parameters and buffers (embedding,           one copy (DCP
                                    attention, norms, gates, calibrator history)       dedups)
``expert/<layer>/<e>/<name>``       expert ``e``'s parameters, by *global* expert id   its owner
``optim/<param key>/<state>``       AdamW state (``step``, ``exp_avg``,                 the param's
                                    ``exp_avg_sq``) of every parameter above           holder
``replicator/<layer>/{ema,steps,    hot-expert heat and the replicated set             one copy
hot}``
``extra/<name>/...``                any :class:`Stateful` passed in ``extras`` (pager,  as keyed by
                                    balancer, communicator state)                      the object
``train/step``                      the step the checkpoint was taken after            one copy
``train/rng/<rank>``                rank ``<rank>``'s data-stream generator            that rank
==================================  =================================================  ============

Loading asks DCP for the keys the *new* job holds: each rank requests the experts it owns
under its own placement, wherever they were saved (resharding); a world size that differs from
the saved one keeps the saved data streams of the ranks that exist on both sides and seeds the
rest fresh, and starts the ``extras`` afresh (their state is per rank of the saved world: the
balancer's maps over its ranks, PowerSGD's blob per rank), as a
restore of the in-memory snapshots does (:mod:`hetcomm.ops.snapshot_reshard`). Replicas are not saved (they are copies of owners); the replicated set is restored
and refreshed from the owners at the next forward.

Every key of a checkpoint directory is committed together: the shards go to a staging
directory, rank 0 commits it (checksums, rename) and moves ``latest`` only after DCP finished
writing on every rank, so a rank killed during a save leaves the previous checkpoint as the one to
resume from; a load verifies every file first (:mod:`hetcomm.ops.checkpoint_files`).

Why by hand: DCP stores and reshards tensors by key but cannot know that expert ``3`` is rank
1's local expert 0 on 4 ranks and rank 0's local expert 3 on 2; this module names them.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

from hetcomm.errors import CheckpointError
from hetcomm.ops import checkpoint_files as files

__all__ = ["Stateful", "PerRank", "TrainState", "save_checkpoint", "save_checkpoint_async", "finish_save", "PendingSave",
           "load_checkpoint", "latest_checkpoint", "job_state_keys", "finish_replicators"]


@dataclass
class TrainState:
    """The loop's own state: the step done and this rank's data generator (in place)."""

    step: int
    rng: torch.Generator


class PerRank:
    """A :class:`Stateful` whose state differs between ranks and whose entries a fresh object
    does not have yet (PowerSGD's per-bucket error feedback and warm-start factors, empty until
    the first compressed step), saved as one blob under ``rank<r>``.

    DCP loads a nested state only into the entries the loading object already has, and keeps
    one copy of equal keys; a blob per rank restores every rank's own state whole.

    Args:
        obj: the object (``state_dict()`` / ``load_state_dict()``).
        rank: this process's rank.
    """

    def __init__(self, obj: Stateful, rank: int) -> None:
        self.obj = obj
        self.rank = rank

    def state_dict(self) -> Dict[str, object]:
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        buf.seek(0)
        return {f"rank{self.rank}": buf}

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        buf = state_dict[f"rank{self.rank}"]
        buf.seek(0)
        # weights_only=False: numpy's RandomState inside; the checkpoint passed its checksums and
        # sits in a directory only this user can write (its .metadata is a pickle anyway).
        self.obj.load_state_dict(torch.load(buf, weights_only=False))


#: The flag that adds an extra's state to a job (for the missing-state error).
_ADDED_BY = {
    "balancer": "--balance, or the default balancing on a mixed cluster: --no-balance resumes without it",
}


def _moe_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    from hetcomm.moe import MoELayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def _local_experts(layer) -> Dict[int, nn.Module]:
    """``{global expert id: module}`` of the experts this rank owns (replicas excluded)."""
    return {int(e): layer.experts.experts[i] for i, e in enumerate(layer.local_expert_ids)}


def _param_keys(model: nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[int, str]]:
    """(key -> tensor for every model entry, id(param) -> key for the optimizer)."""
    expert_prefix: Dict[str, str] = {}  # fqn prefix of an expert module -> key prefix
    for lname, layer in _moe_layers(model):
        ids = {id(m): e for e, m in _local_experts(layer).items()}
        for sub, mod in layer.named_modules():
            if id(mod) in ids:
                expert_prefix[f"{lname}.{sub}."] = f"expert/{lname}/{ids[id(mod)]}/"
    out: Dict[str, torch.Tensor] = {}
    by_param: Dict[int, str] = {}
    named = dict(model.named_parameters())
    for fqn, t in model.state_dict(keep_vars=True).items():
        key = f"model/{fqn}"
        for pre, kpre in expert_prefix.items():
            if fqn.startswith(pre):
                key = kpre + fqn[len(pre):]
                break
        out[key] = t.detach()
        if fqn in named:
            by_param[id(named[fqn])] = key
    return out, by_param


def _optim_entries(optimizer: torch.optim.Optimizer, model: nn.Module, by_param: Dict[int, str], create: bool) -> Dict[str, torch.Tensor]:
    """``optim/<param key>/<state>`` tensors; with ``create``, zero state for params without any
    (an optimizer that has not stepped yet), so that DCP has a tensor to load into."""
    out: Dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            key = by_param.get(id(p))
            if key is None:
                continue
            st = optimizer.state[p]
            if not st and create:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for name, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{key}/{name}"] = value
    return out


def _replicator_entries(model: nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for lname, layer in _moe_layers(model):
        rep = layer.replicator
        if rep is None:
            continue
        E = layer.config.num_experts
        hot = torch.full((E,), -1, dtype=torch.int64)
        # A hot set decided at this step's observe is applied at the next forward: save that one,
        # so that a resume replicates what the uninterrupted run's next step does.
        hot[: len(rep.next_hot)] = torch.tensor(rep.next_hot, dtype=torch.int64)
        out[f"replicator/{lname}/ema"] = rep.ema
        out[f"replicator/{lname}/steps"] = torch.tensor(rep.steps, dtype=torch.int64)
        out[f"replicator/{lname}/hot"] = hot
    return out


def job_state_keys(model: nn.Module) -> List[str]:
    """The model keys this rank would save (for tests and docs)."""
    return sorted(_param_keys(model)[0])


def _state(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    train: Optional[TrainState],
    extras: Mapping[str, Stateful],
    rank: int,
    create: bool,
) -> Dict[str, object]:
    params, by_param = _param_keys(model)
    state: Dict[str, object] = dict(params)
    if optimizer is not None:
        state.update(_optim_entries(optimizer, model, by_param, create))
    state.update(_replicator_entries(model))
    for name, obj in extras.items():
        state[f"extra/{name}"] = obj  # DCP calls its state_dict()/load_state_dict()
    if train is not None:
        state["train/step"] = torch.tensor(train.step, dtype=torch.int64)
        state[f"train/rng/{rank}"] = train.rng.get_state()
    return state


def _barrier(process_group) -> None:
    if dist.is_initialized():
        dist.barrier(group=process_group)


def _begin_save(root, step, model, optimizer, rng, extras, process_group):
    """The part both saves share (collective): a private root, rank 0's fresh staging directory,
    and this rank's state for DCP. Returns ``(rank, staging directory, state)``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    files.prepare_root(root)  # every rank: each refuses an unsafe directory itself, none hangs
    if rank == 0:
        files.begin_staging(root, step)
    _barrier(process_group)
    staging = files.staging_dir(root, step)
    train = TrainState(step, rng) if rng is not None else TrainState(step, torch.Generator())
    state = _state(model, optimizer, train, extras or {}, rank, create=False)
    if rng is None:
        state.pop(f"train/rng/{rank}")
    return rank, staging, state


def save_checkpoint(
    root: str,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    rng: Optional[torch.Generator] = None,
    extras: Optional[Mapping[str, Stateful]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    keep: int = 0,
) -> str:
    """Save the job's state after ``step`` under ``root/step-<step>`` (collective).

    The shards are written into a fresh staging directory and committed by rank 0 once every
    rank has finished (:mod:`hetcomm.ops.checkpoint_files`: checksums, ``0600``/``0700``, a
    rename to a name nothing has, then ``latest``): a kill during the save leaves the previous
    checkpoint, and the directory ``latest`` names is never written into.

    Args:
        root: checkpoint directory (created ``0700`` if missing, else it must be private to the
            caller; shared by every rank).
        step: the step just finished.
        model: the model holding :class:`~hetcomm.moe.MoELayer` s (experts saved by owner).
        optimizer: its optimizer (AdamW-style per-parameter state), or None.
        rng: this rank's data-stream generator, or None.
        extras: more :class:`Stateful` objects, e.g. a pager or balancer; their state must be
            identical on every rank or keyed by owner/rank inside their ``state_dict()``.
        process_group: group DCP coordinates over (default: the default group).
        keep: once this one is committed, delete all but the ``keep`` newest checkpoints
            (:func:`hetcomm.ops.checkpoint_files.prune`); 0 keeps all.
    Returns:
        The committed step directory (``step-<step>``, or ``step-<step>.<n>`` when a directory
        of that step existed already).

    Raises:
        UnsafePathError: ``root`` is a link, someone else's, or writable by group or others.
    """
    rank, staging, state = _begin_save(root, step, model, optimizer, rng, extras, process_group)
    dcp.save(state, checkpoint_id=staging, process_group=process_group, no_dist=not dist.is_initialized())
    _barrier(process_group)  # every shard is on disk before rank 0 commits
    if rank == 0:
        files.commit(root, staging, step, keep)
    # ``latest`` names this step on every rank once save returns: a rank that reads it right
    # away (a resume, or a test) must not see the previous step, or none.
    _barrier(process_group)
    path = files.latest_checkpoint(root)
    assert path is not None
    return path


@dataclass
class PendingSave:
    """A checkpoint :func:`save_checkpoint_async` is writing in the background."""

    root: str
    step: int
    staging: str
    future: object  # concurrent.futures.Future of DCP's write
    rank: int
    keep: int = 0  # checkpoints kept once this one is committed (0: all)


def save_checkpoint_async(
    root: str,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    rng: Optional[torch.Generator] = None,
    extras: Optional[Mapping[str, Stateful]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
    keep: int = 0,
) -> PendingSave:
    """:func:`save_checkpoint` whose files are written in the background (collective).

    ``torch.distributed.checkpoint.async_save`` copies the state into host memory before it
    returns (the step may change the model right after) and writes the shards in a thread, over
    ``process_group`` (a gloo group that nothing else uses meanwhile). :func:`finish_save`
    commits it; call it (on every rank) before the next save and at the end: until then
    ``latest`` names the previous checkpoint, and a kill leaves the staging directory, removed
    by the next save, as with a synchronous save.
    """
    rank, staging, state = _begin_save(root, step, model, optimizer, rng, extras, process_group)
    future = dcp.async_save(state, checkpoint_id=staging, process_group=process_group,
                            no_dist=not dist.is_initialized())
    return PendingSave(root, step, staging, future, rank, keep)


def finish_save(pending: PendingSave) -> Optional[str]:
    """Wait for a background save; rank 0 then commits it (checksums, rename, ``latest``).

    No collective: DCP's coordinator (rank 0) finishes only after every rank's shards are
    written (it gathers their write results before it writes ``.metadata``).

    Returns:
        The committed step directory on rank 0, None elsewhere.
    """
    pending.future.result()  # type: ignore[attr-defined]
    if pending.rank == 0:
        return files.commit(pending.root, pending.staging, pending.step, pending.keep)
    return None


def latest_checkpoint(root: str) -> Optional[str]:
    """The step directory ``root/latest`` names, or None when there is no checkpoint yet.

    Raises:
        UnsafePathError: the directory, ``latest`` or the step directory is a link, someone
            else's or writable by group or others (:func:`hetcomm.ops.checkpoint_files.latest_checkpoint`).
        CheckpointError / ConfigError: ``latest`` names no step directory, or a missing one.
    """
    return files.latest_checkpoint(root)


def _check_against_metadata(path: str, metadata, state: Mapping[str, object]) -> None:
    """Refuse, before DCP loads anything, what DCP would fail on with a raw error: a tensor of
    another shape (another hidden size or expert count), a key or optional state it lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    meta_file = os.path.join(path, ".metadata")
    for key, value in state.items():
        if isinstance(value, Stateful):
            name = key.split("/", 1)[1]
            if not any(k == key or k.startswith(key + ".") for k in saved):
                raise CheckpointError(
                    f"was saved without the {name!r} state this job needs (a resume that adds "
                    f"{_ADDED_BY.get(name, '--' + name.replace('_', '-'))}): resume with the settings it was saved "
                    f"with, or start a fresh --checkpoint-dir",
                    path=meta_file, key=key, reason="missing-state",
                )
            continue
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if tuple(meta.size) != tuple(value.shape):
                raise CheckpointError(
                    f"holds {key!r} of shape {tuple(meta.size)} but this job's is {tuple(value.shape)}: it was "
                    f"saved by another model (hidden size, experts, layers); resume with the same model settings",
                    path=meta_file, key=key, reason="mismatch",
                )


def _dcp_load(path: str, state: Dict[str, object], process_group) -> None:
    try:
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not dist.is_initialized())
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"DCP could not load it ({type(e).__name__}: {first}); resume from an earlier step or start fresh",
            path=path, reason="shard",
        ) from None


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    rng: Optional[torch.Generator] = None,
    extras: Optional[Mapping[str, Stateful]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` into this job (collective).

    Works on any world size and placement: each rank loads the experts it owns now.
    Replicated sets are restored and their replicas refreshed from the owners at the next
    forward. ``rng`` is restored when the checkpoint holds this rank's stream. ``extras`` are
    loaded first, so that one may change the model's layout before the model's keys are chosen
    (the balancer restores the layers' expert placement); on another world size than the saved
    one they are not loaded (they start afresh: their state is per rank of the saved world).

    Every file is checked against the checksums recorded at save before DCP reads it (its
    ``.metadata`` is a pickle), and shapes against the metadata before any tensor is loaded.

    Returns:
        The step the checkpoint was taken after (continue with the next one).

    Raises:
        CheckpointError: a damaged checkpoint (missing, truncated or altered file, bad metadata),
            one saved by another model (a missing key, another shape) or without optional state
            this job needs — naming the file, the key and the fix.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    files.verify_checkpoint(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind (the checksums passed)
        raise CheckpointError(
            f"unreadable DCP metadata ({type(e).__name__}); resume from an earlier step or start fresh",
            path=os.path.join(path, ".metadata"), reason="metadata",
        ) from None
    saved = set(metadata.state_dict_metadata)
    extra_state = {f"extra/{name}": obj for name, obj in (extras or {}).items()}
    saved_world = sum(1 for k in saved if k.startswith("train/rng/"))  # one stream per saved rank
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if saved_world and saved_world != world:
        extra_state = {}  # per rank of another world size (see the module docstring): start afresh
    _check_against_metadata(path, metadata, extra_state)
    if extra_state:
        _dcp_load(path, dict(extra_state), process_group)
    train = TrainState(0, rng if rng is not None else torch.Generator())
    state = _state(model, optimizer, train, {}, rank, create=True)
    rng_key = f"train/rng/{rank}"
    if rng is None or rng_key not in saved:
        state.pop(rng_key)  # a rank the saved job did not have: its stream starts fresh
    if optimizer is not None:
        # A parameter without optimizer state when the checkpoint was taken (frozen, or never
        # given a gradient) has none after loading either.
        unsaved = {k.split("/", 1)[1].rsplit("/", 1)[0] for k in state if k.startswith("optim/") and k not in saved}
        for k in [k for k in state if k.startswith("optim/") and k.split("/", 1)[1].rsplit("/", 1)[0] in unsaved]:
            state.pop(k)
        _, by_param = _param_keys(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if by_param.get(id(p)) in unsaved:
                    optimizer.state.pop(p, None)
    missing = sorted(set(state) - saved)
    if missing:
        raise CheckpointError(
            f"the checkpoint has no {missing[0]!r} ({len(missing)} key(s) missing): it was saved by a "
            f"job with another model, expert count or optimizer; load it with the same model settings",
            path=path,
            key=missing[0],
            reason="mismatch",
        )
    _check_against_metadata(path, metadata, state)
    _dcp_load(path, state, process_group)
    if rng is not None and rng_key in state:
        rng.set_state(state[rng_key])
    finish_replicators(model, state)
    return int(state["train/step"])


def finish_replicators(model: nn.Module, state: Mapping[str, object]) -> None:
    """After the tensors of :func:`_state` were loaded in place: give each replicator its step
    count and hot set, and refresh the replicas from the loaded owners (collective)."""
    for lname, layer in _moe_layers(model):
        rep = layer.replicator
        if rep is None:
            continue
        hot = [int(e) for e in state[f"replicator/{lname}/hot"].tolist() if e >= 0]
        rep.steps = int(state[f"replicator/{lname}/steps"])
        rep.set_hot(hot)
        rep.sync(force=True)  # collective: replicas take the loaded owners' weights now
