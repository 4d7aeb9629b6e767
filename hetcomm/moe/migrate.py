"""Move expert ownership between ranks during a run (cold experts to weak ranks).

Each rank keeps the same *number* of experts, so every rank keeps its parameter objects (the
optimizer holds references to them): an expert that moves from rank A to rank B is written into
the module B just freed, together with its optimizer state (momentum, Adam moments, step), so
training continues exactly as if nothing had moved. One all-reduce of ``[num_moved, P']``
float64 (parameters plus state; float64 holds float32 values and step counts exactly) carries
everything; only the old owner of each moved expert contributes non-zeros.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.errors import ConfigError

__all__ = ["migrate_experts"]


def _state_keys(modules: List[nn.Module], optimizer) -> List[Tuple[str, str, str]]:
    """(key, kind, dtype) of every optimizer-state entry of these modules' parameters."""
    keys = set()
    if optimizer is None:
        return []
    for m in modules:
        for p in m.parameters():
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    if v.numel() == p.numel():
                        keys.add((k, "full", str(v.dtype)))
                    elif v.numel() == 1:
                        keys.add((k, "scalar", str(v.dtype)))
                    else:
                        raise ConfigError(
                            f"optimizer state '{k}' has {v.numel()} elements for a parameter of "
                            f"{p.numel()}; migration moves per-element or scalar state only "
                            f"({type(optimizer).__name__})",
                            key="moe.rebalance",
                        )
                elif isinstance(v, (int, float)):
                    keys.add((k, "py", type(v).__name__))
    return sorted(keys)


def migrate_experts(layer, new_placement, optimizer=None) -> List[int]:
    """Make ``layer``'s ownership follow ``new_placement`` (collective).

    Args:
        layer: a :class:`~hetcomm.moe.layer.MoELayer`.
        new_placement: the target :class:`~hetcomm.moe.placement.ExpertPlacement`, identical on
            every rank, with the same number of experts per rank as the current one.
        optimizer: the optimizer over ``layer``'s parameters, whose per-parameter state moves with
            the experts (None: parameters only; moved experts then start with fresh state).
    Returns:
        The global ids of the experts that changed owner.

    Raises:
        ConfigError: a different number of experts per rank, or optimizer state of a shape
            that cannot follow its parameter.
    """
    old = layer.placement
    rank, W, E = layer.rank, old.world_size, old.num_experts
    if new_placement.num_local_experts_per_rank != old.num_local_experts_per_rank:
        raise ConfigError(
            f"a migration keeps the number of experts per rank: now "
            f"{list(old.num_local_experts_per_rank)}, asked {list(new_placement.num_local_experts_per_rank)}",
            key="moe.placement",
        )
    moved = [e for e in range(E) if old.owner[e] != new_placement.owner[e]]
    if not moved:
        layer._set_placement(new_placement, list(layer.experts.experts))
        return []
    mods: Dict[int, nn.Module] = {e: layer.experts.experts[i] for i, e in enumerate(old.experts_of(rank))}
    outgoing = [e for e in old.experts_of(rank) if new_placement.owner[e] != rank]
    incoming = [e for e in new_placement.experts_of(rank) if old.owner[e] != rank]
    assert len(outgoing) == len(incoming)

    template = layer._make_expert(0)
    shapes = [tuple(p.shape) for p in template.parameters()]
    for e, m in mods.items():
        if [tuple(p.shape) for p in m.parameters()] != shapes:
            raise ConfigError(
                f"expert {e} has parameter shapes {[tuple(p.shape) for p in m.parameters()]}, "
                f"expert 0 {shapes}; migration needs experts of one shape",
                key="moe.rebalance",
            )
    local_keys = _state_keys([mods[e] for e in outgoing], optimizer)
    if dist.is_initialized() and W > 1:
        gathered: List[Optional[List]] = [None] * W
        dist.all_gather_object(gathered, local_keys, group=layer.group)
        keys = sorted({tuple(k) for ks in gathered for k in ks})
    else:
        keys = local_keys
    numels = [int(torch.Size(s).numel()) for s in shapes]
    # Per parameter: values, then per state key: a presence flag and the values (n or 1).
    per_param = [n + sum(1 + (n if kind == "full" else 1) for _, kind, _ in keys) for n in numels]
    row_len = sum(per_param)
    buf = torch.zeros(len(moved), row_len, dtype=torch.float64, device=layer.gate.wg.weight.device)
    row_of = {e: i for i, e in enumerate(moved)}
    for e in outgoing:
        row, off = buf[row_of[e]], 0
        for p, n in zip(mods[e].parameters(), numels):
            row[off : off + n] = p.detach().reshape(-1).double()
            off += n
            st = optimizer.state.get(p, {}) if optimizer is not None else {}
            for k, kind, _ in keys:
                width = n if kind == "full" else 1
                if k in st:
                    row[off] = 1.0
                    v = st[k]
                    row[off + 1 : off + 1 + width] = (
                        v.detach().reshape(-1).double() if torch.is_tensor(v) else float(v)
                    )
                off += 1 + width
    if dist.is_initialized() and W > 1:
        dist.all_reduce(buf, group=layer.group)

    freed = [mods[e] for e in outgoing]
    with torch.no_grad():
        for e, m in zip(incoming, freed):
            row, off = buf[row_of[e]], 0
            for p, n in zip(m.parameters(), numels):
                p.copy_(row[off : off + n].view(p.shape).to(p.dtype))
                p.grad = None
                off += n
                if optimizer is not None:
                    optimizer.state.pop(p, None)
                    st = {}
                    for k, kind, dt in keys:
                        width = n if kind == "full" else 1
                        if row[off] > 0:
                            vals = row[off + 1 : off + 1 + width]
                            if kind == "full":
                                st[k] = vals.view(p.shape).to(getattr(torch, dt.split(".")[-1])).clone()
                            elif kind == "scalar":
                                st[k] = vals.view(()).to(getattr(torch, dt.split(".")[-1])).clone()
                            else:
                                st[k] = int(vals[0]) if dt == "int" else float(vals[0])
                        off += 1 + width
                    if st:
                        optimizer.state[p] = st
                else:
                    off += sum(1 + (n if kind == "full" else 1) for _, kind, _ in keys)
    for e, m in zip(incoming, freed):
        mods[e] = m
    layer._set_placement(new_placement, [mods[e] for e in new_placement.experts_of(rank)])
    return moved
