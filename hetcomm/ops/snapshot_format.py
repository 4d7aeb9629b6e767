"""The bytes of one in-memory snapshot and how they load into a rank (:mod:`hetcomm.ops.snapshot`).

Shared by the same-world restore (:mod:`hetcomm.ops.snapshot`) and the restore on another world
size (:mod:`hetcomm.ops.snapshot_reshard`), so that neither imports the other's module.

Layout of a file (:func:`pack`): the header's length (8 bytes, little endian), a ``torch.save``d
header (``meta``, ``extras``, and the tensor index: key, dtype, shape, byte offset, numel), then
every tensor's bytes back to back.

``meta`` of a snapshot (:meth:`hetcomm.ops.snapshot.Snapshotter.take`): ``step``, ``rank``,
``world_size``, ``lost``, ``restores``, ``nodes`` (each rank's node) and, since the measured
speeds travel with the snapshots, ``placement``: ``{"models": each rank's device model,
"weights": the placement weights the job's experts were built with (None: the datasheet),
"speeds_by_model": the agreed measured expert speed per device model, rows/s (None: not measured
yet), "speed": layer 0's agreed speed snapshot -- speeds, noise, the ``differ`` verdict
(:func:`hetcomm.ops.membership.agreed_speed_record`; None: not measured yet)}``
(:func:`hetcomm.ops.membership.snapshot_placement` places by it;
:func:`~hetcomm.ops.membership.snapshot_members` takes the previous membership from it). A
snapshot of an older hetcomm has no ``placement``: it still restores, the new world's experts
are placed by the datasheet, and no membership change is recorded from it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from hetcomm.errors import CheckpointError
from hetcomm.ops import checkpoint as ck
from hetcomm.ops.checkpoint import Stateful, TrainState

__all__ = ["Restored", "pack", "unpack", "read_bytes", "read_head", "apply_state"]


@dataclass(frozen=True)
class Restored:
    """What a restore found: the step, where each rank's state came from, the steps lost."""

    step: int
    # "memory" (every rank its own), "memory+peer" (some from a buddy's copy); "disk" (a
    # checkpoint) and "nothing" (a fresh start) when no snapshot held every rank's state
    source: str
    lost: int  # steps finished before the failure and redone now
    from_peer: Tuple[int, ...] = ()  # ranks (of the snapshots' world) restored from a buddy's copy
    resharded_from: Optional[int] = None  # the snapshots' world size when it differs from this job's

    def line(self) -> str:
        """``from memory after step S (memory+peer, ...); lost N step(s)``: the ``resume`` event."""
        who = "old ranks" if self.resharded_from is not None else "ranks"
        how = f", resharded from {self.resharded_from} ranks" if self.resharded_from is not None else ""
        peer = f", {who} {','.join(map(str, self.from_peer))} from peer copies" if self.from_peer else ""
        return f"from memory after step {self.step} ({self.source}{how}{peer}); lost {self.lost} step(s)"


def pack(tensors: Mapping[str, torch.Tensor], head: Mapping[str, object]) -> bytearray:
    """One snapshot's bytes: the header's length (8 bytes), ``torch.save(head + tensor index)``,
    then every tensor's bytes back to back, written by one ``torch.cat`` (``torch.save`` of the
    demo's ~500 small tensors took 6x as long: a zip record per storage)."""
    index, parts, off = [], [], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        index.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, t.numel()))
        if nbytes:
            parts.append(t.detach().reshape(-1).view(torch.uint8).cpu())
        off += nbytes
    hb = io.BytesIO()
    torch.save({**head, "index": index}, hb)
    h = hb.getvalue()
    start = 8 + len(h)
    out = bytearray(start + off)
    out[:8] = len(h).to_bytes(8, "little")
    out[8:start] = h
    if parts:
        with torch.no_grad():
            torch.cat(parts, out=torch.frombuffer(out, dtype=torch.uint8, offset=start))  # host: the file's bytes
    return out


def unpack(blob: bytes) -> Dict[str, object]:
    """:func:`pack`'s inverse: ``{**head, "tensors": {key: tensor}}`` (tensors share one copy)."""
    buf = bytearray(blob)
    start = 8 + int.from_bytes(buf[:8], "little")
    # weights_only=False: numpy state of the data stream inside; the file is this job's own, in a
    # 0700 directory of this user.
    head = torch.load(io.BytesIO(bytes(buf[8:start])), weights_only=False)
    tensors = {}
    for key, dtype, shape, off, numel in head.pop("index"):
        dt = getattr(torch, dtype)
        if numel:
            tensors[key] = torch.frombuffer(buf, dtype=dt, count=numel, offset=start + off).reshape(shape)  # host: file bytes
        else:
            tensors[key] = torch.empty(shape, dtype=dt)  # host: an empty tensor of the saved shape
    head["tensors"] = tensors
    return head


def read_bytes(path: str) -> bytes:
    """The whole file (a snapshot: tens of MB at most)."""
    with open(path, "rb") as f:
        return f.read()


def read_head(path: str) -> Dict[str, object]:
    """A snapshot file's header without its tensors: ``{"meta": ..., "extras": ...}`` (reads the
    header's bytes only; the placement reads the previous job's measured speeds before the model
    exists).

    Raises:
        OSError / ValueError: an unreadable or truncated file (the caller skips it).
    """
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = f.read(n)
    if len(h) != n:
        raise ValueError(f"{path}: header cut short ({len(h)} of {n} bytes)")
    # weights_only=False: as unpack (numpy state of the data stream); this job's own 0700 file.
    head = torch.load(io.BytesIO(h), weights_only=False)
    head.pop("index", None)
    return head


def apply_state(payload: Mapping[str, object], path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
           rng: torch.Generator, extras: Optional[Mapping[str, Stateful]], rank: int) -> None:
    """Load a snapshot's state into this rank's objects (extras first: the balancer's placement
    decides the model's expert keys), as :func:`hetcomm.ops.checkpoint.load_checkpoint` does."""
    saved_extras = payload["extras"]
    for name, obj in (extras or {}).items():
        if name not in saved_extras:  # type: ignore[operator]
            raise CheckpointError(f"was taken without the {name!r} state this job needs; start the job afresh",
                                  path=path, key=f"extra/{name}", reason="missing-state")
        obj.load_state_dict(saved_extras[name])  # type: ignore[index]
    saved: Mapping[str, torch.Tensor] = payload["tensors"]  # type: ignore[assignment]
    state = ck._state(model, optimizer, TrainState(0, rng), {}, rank, create=True)
    if optimizer is not None:  # a parameter without optimizer state at the snapshot has none now
        _, by_param = ck._param_keys(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                key = by_param.get(id(p))
                if key is not None and f"optim/{key}/step" not in saved:
                    for k in [k for k in state if k.startswith(f"optim/{key}/")]:
                        state.pop(k)
                    optimizer.state.pop(p, None)
    missing = sorted(k for k in state if k not in saved)
    for key in missing[:1]:
        raise CheckpointError(f"has no {key!r} ({len(missing)} key(s) missing): taken by another model", path=path,
                              key=key, reason="mismatch")
    with torch.no_grad():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                src = saved[key]
                if tuple(src.shape) != tuple(value.shape):
                    raise CheckpointError(f"holds {key!r} of shape {tuple(src.shape)}, this job's is "
                                          f"{tuple(value.shape)}", path=path, key=key, reason="mismatch")
                value.copy_(src)
    rng.set_state(state[f"train/rng/{rank}"])  # type: ignore[arg-type]
    ck.finish_replicators(model, state)
