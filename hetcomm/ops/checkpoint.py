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
rest fresh. Replicas are not saved (they are copies of owners); the replicated set is restored
and refreshed from the owners at the next forward.

Every key of a checkpoint directory is committed together: rank 0 writes ``latest`` (the
step directory's name) only after DCP finished writing on every rank, so a rank killed during a
save leaves the previous checkpoint as the one to resume from.

Why by hand: DCP stores and reshards tensors by key but cannot know that expert ``3`` is rank
1's local expert 0 on 4 ranks and rank 0's local expert 3 on 2; this module names them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

from hetcomm.errors import ConfigError

__all__ = ["Stateful", "TrainState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "job_state_keys"]

_LATEST = "latest"


@dataclass
class TrainState:
    """The loop's own state: the step done and this rank's data generator (in place)."""

    step: int
    rng: torch.Generator


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
        hot[: len(rep.hot)] = torch.tensor(rep.hot, dtype=torch.int64)
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


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def save_checkpoint(
    root: str,
    step: int,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    rng: Optional[torch.Generator] = None,
    extras: Optional[Mapping[str, Stateful]] = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> str:
    """Save the job's state after ``step`` under ``root/step-<step>`` (collective).

    Args:
        root: checkpoint directory (created if missing; shared by every rank).
        step: the step just finished.
        model: the model holding :class:`~hetcomm.moe.MoELayer` s (experts saved by owner).
        optimizer: its optimizer (AdamW-style per-parameter state), or None.
        rng: this rank's data-stream generator, or None.
        extras: more :class:`Stateful` objects, e.g. a pager or balancer; their state must be
            identical on every rank or keyed by owner/rank inside their ``state_dict()``.
        process_group: group DCP coordinates over (default: the default group).
    Returns:
        The step directory.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = _step_dir(root, step)
    os.makedirs(path, exist_ok=True)
    train = TrainState(step, rng) if rng is not None else TrainState(step, torch.Generator())
    state = _state(model, optimizer, train, extras or {}, rank, create=False)
    if rng is None:
        state.pop(f"train/rng/{rank}")
    dcp.save(state, checkpoint_id=path, process_group=process_group, no_dist=not dist.is_initialized())
    if dist.is_initialized():
        dist.barrier(group=process_group)  # every shard is on disk before ``latest`` moves
    if rank == 0:
        tmp = os.path.join(root, _LATEST + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(os.path.basename(path) + "\n")
        os.replace(tmp, os.path.join(root, _LATEST))
    if dist.is_initialized():
        # ``latest`` names this step on every rank once save returns: a rank that reads it right
        # away (a resume, or a test) must not see the previous step, or none.
        dist.barrier(group=process_group)
    return path


def latest_checkpoint(root: str) -> Optional[str]:
    """The step directory ``root/latest`` names, or None when there is no checkpoint yet."""
    try:
        with open(os.path.join(root, _LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    if not os.path.isdir(path):
        raise ConfigError(
            f"'latest' names {name!r} but that directory is missing; point --checkpoint-dir at the "
            f"job's directory or delete 'latest' to start fresh",
            path=os.path.join(root, _LATEST),
        )
    return path


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
    forward. ``rng`` is restored when the checkpoint holds this rank's stream.

    Returns:
        The step the checkpoint was taken after (continue with the next one).

    Raises:
        ConfigError: a key this job needs is missing (another model shape, expert count or
            optimizer), naming the key and the directory.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, FileNotFoundError) as e:
        raise ConfigError(f"not a readable checkpoint directory: {e}", path=path) from None
    train = TrainState(0, rng if rng is not None else torch.Generator())
    state = _state(model, optimizer, train, extras or {}, rank, create=True)
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
    needed = {k for k, v in state.items() if not isinstance(v, Stateful)}
    missing = sorted(needed - saved)
    if missing:
        raise ConfigError(
            f"the checkpoint has no {missing[0]!r} ({len(missing)} key(s) missing): it was saved by a "
            f"job with another model, expert count or optimizer; load it with the same model settings",
            path=path,
            key=missing[0],
        )
    dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not dist.is_initialized())
    if rng is not None and rng_key in state:
        rng.set_state(state[rng_key])
    for lname, layer in _moe_layers(model):
        rep = layer.replicator
        if rep is None:
            continue
        hot = [int(e) for e in state[f"replicator/{lname}/hot"].tolist() if e >= 0]
        rep.steps = int(state[f"replicator/{lname}/steps"])
        rep.set_hot(hot)
        rep.sync(force=True)  # collective: replicas take the loaded owners' weights now
    return int(state["train/step"])
