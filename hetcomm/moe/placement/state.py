"""The layers' expert placement as checkpointable state.

A placement changed at run time (:func:`~hetcomm.moe.placement.migration.migrate_now`, the cold
move of ``hetcomm train``) renames each rank's expert modules: the same modules now hold other
global experts. A checkpoint or snapshot keys the experts by global id, so a restore into a layer
built with the *initial* placement asks for experts this rank no longer saved ("taken by another
model") or, through a resharding load, silently undoes the move. :class:`LayerPlacements` is the
``Stateful`` that carries each layer's map: pass it in a checkpoint's ``extras`` (loaded before
the model's keys are chosen) and a restore re-places the layers first, so the experts load under
the names they were saved with.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from hetcomm.errors import ConfigError

__all__ = ["LayerPlacements", "restore_placement"]


def restore_placement(layer, owner: Sequence[int], optimizer=None) -> bool:
    """Give ``layer`` (a :class:`~hetcomm.moe.MoELayer`) the expert -> rank map ``owner`` with
    the expert modules this rank holds now, renamed in ascending global id; their weights are the
    checkpoint load's to fill (local, not collective; every rank calls it with the same map).

    A run-time move may have changed how many experts a rank holds: a rank the map gives more
    experts builds fresh modules for them (the load fills them), one it gives fewer drops the
    surplus; ``optimizer`` (the one whose state loads next) gains and loses their parameters the
    way :func:`~hetcomm.moe.placement.migration.migrate_now` does.

    Args:
        layer: the MoE layer.
        owner: ``[E]`` owner rank of each global expert, identical on every rank.
        optimizer: the optimizer over the layer's parameters, or None.
    Returns:
        Whether the map differed from the layer's (False: nothing changed).

    Raises:
        ConfigError: (``key='moe.placement'``) the map leaves this rank without an expert.
    """
    from hetcomm.moe.placement.migration import resize_expert_modules

    owner = [int(r) for r in owner]
    if owner == list(layer.placement.owner):
        return False
    mine = [e for e, r in enumerate(owner) if r == layer.rank]
    if not mine:
        raise ConfigError(
            f"the saved placement gives rank {layer.rank} no expert: the state was saved by a job with another "
            f"cluster or expert count; resume with the settings it was saved with", key="moe.placement")
    modules = resize_expert_modules(layer, list(layer.experts.experts), len(mine), optimizer)
    layer.apply_placement(owner, dict(zip(mine, modules)), migrated=False)
    return True


class LayerPlacements:
    """``Stateful`` over MoE layers' expert placements (one ``[E]`` int64 owner tensor per layer,
    identical on every rank).

    Args:
        layers: the model's :class:`~hetcomm.moe.MoELayer` s, in a fixed order.
        optimizer: the optimizer over their parameters (a restore that changes a rank's expert
            count adds or drops parameters in it), or None.
    """

    def __init__(self, layers: Sequence, optimizer=None) -> None:
        self.layers = list(layers)
        self.optimizer = optimizer
        #: Layers whose placement the last :meth:`load_state_dict` changed.
        self.restored: List[int] = []

    def state_dict(self) -> Dict[str, torch.Tensor]:
        owners = [list(layer.placement.owner) for layer in self.layers]
        # host: the maps are host decisions, saved beside the other host state
        return {f"owner{i}": torch.tensor(owner, dtype=torch.int64) for i, owner in enumerate(owners)}  # host

    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Re-place every layer as saved (:func:`restore_placement`).

        Raises:
            ConfigError: a saved map missing or of the wrong size, or one that does not fit this
                rank's experts, naming the layer.
        """
        self.restored = []
        for i, layer in enumerate(self.layers):
            key = f"owner{i}"
            if key not in state_dict:
                raise ConfigError(f"the saved state has no placement of MoE layer {i} ({len(self.layers)} in this "
                                  f"model); resume with the model it was saved with", key="moe.placement")
            owner = state_dict[key].tolist()
            if len(owner) != layer.config.num_experts:
                raise ConfigError(f"MoE layer {i}: the saved placement names {len(owner)} experts, this layer has "
                                  f"{layer.config.num_experts}; resume with the expert count it was saved with",
                                  key="moe.placement")
            try:
                changed = restore_placement(layer, owner, self.optimizer)
            except ConfigError as e:
                raise ConfigError(f"MoE layer {i}: {e.detail}", key="moe.placement") from None
            if changed:
                self.restored.append(i)
