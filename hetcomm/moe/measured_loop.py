"""The measured loop: what a training step needs after ``optimizer.step()`` on unequal ranks, as one call.

``hetcomm train`` and a user's own loop call it the same way::

    loop = MeasuredLoop(model, optimizer)          # after the optimizer exists
    for step in range(1, steps + 1):
        ...forward, backward, optimizer.step()...
        for event in loop.after_step(step):        # collective: every rank, same step
            print(event)

:meth:`MeasuredLoop.after_step` runs, in this order (every rank at the same point, so each
collective lines up):

1. each layer's replica refresh from the owners (``MoELayer.sync_replicas(force=True)``: the
   step has just moved the owners' weights, so no rank needs to ask whether it is due);
2. each layer's paging step end (``MoELayer.end_page_step``: evictions and prefetch read the
   refreshed weights);
3. the policy's speed verdict (:func:`~hetcomm.moe.policy.speed_verdict`) and the experts'
   share of the MoE forward (:func:`~hetcomm.moe.policy.expert_share`), agreed values only, and a
   ``policy`` event when they changed a lever; the ``token_split`` lever is applied to every
   layer built with ``token_split="auto"`` (``MoELayer.use_token_split``);
4. the cold move (:class:`~hetcomm.moe.cold.ColdMoves`) when the policy's ``cold_placement``
   lever is on;
5. a step planner's plans (``hetcomm train --balance``: the migration balancer), when given.

What a restart must not lose -- the placement changed at run time and which layers had their
cold move -- is :meth:`MeasuredLoop.state_dict` (``Stateful``), or the two entries of
:meth:`MeasuredLoop.extras` for checkpoint code that takes named ``Stateful`` objects. Load it
*before* the model's state: it re-places the layers, so their experts load under the global ids
they were saved with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Union

import torch

from hetcomm.errors import ConfigError
from hetcomm.moe.cold import ColdMoves
from hetcomm.moe.placement.state import LayerPlacements
from hetcomm.moe.policy import Policy, expert_share, policy_of_layers, speed_verdict

__all__ = ["MeasuredLoop", "LoopEvent", "StepPlanner"]


class StepPlanner(Protocol):
    """Something that plans after the optimizer step (``hetcomm.train.balance.TrainBalancer``)."""

    def after_step(self, step: int) -> List[str]:
        """Plan (collective), returning one line per change."""
        ...


@dataclass(frozen=True)
class LoopEvent:
    """Something :meth:`MeasuredLoop.after_step` did: ``kind`` is ``migration`` (experts moved)
    or ``policy`` (the agreed speed verdict changed a lever; ``detail`` is the record's line)."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def moe_layers_of(model_or_layers: Union[torch.nn.Module, Sequence[Any]]) -> List[Any]:
    """The :class:`~hetcomm.moe.MoELayer` s of a model (in module order), or the given list."""
    from hetcomm.moe.layer import MoELayer

    if isinstance(model_or_layers, torch.nn.Module):
        layers = [m for m in model_or_layers.modules() if isinstance(m, MoELayer)]
    else:
        layers = list(model_or_layers)
    if not layers or not all(isinstance(m, MoELayer) for m in layers):
        raise ConfigError("MeasuredLoop needs a model holding MoELayer modules, or a list of them; "
                          f"got {type(model_or_layers).__name__} with {len(layers)} MoE layer(s)", key="moe.layers")
    return layers


class MeasuredLoop:
    """The per-step work after ``optimizer.step()`` (see the module), and its checkpointable state.

    Args:
        model_or_layers: the model (its :class:`~hetcomm.moe.MoELayer` modules are found in module
            order) or the MoE layers themselves, in the same order on every rank.
        optimizer: the optimizer over the layers' parameters (a cold move carries their state).
        policy: the levers (:func:`hetcomm.moe.policy.decide`); None: decided from the layers'
            configuration (:func:`~hetcomm.moe.policy.policy_of_layers`, ``balance="auto"``).
        planner: a step planner run last (``hetcomm train --balance``); it then owns the expert
            map and carries it in its own state, and :meth:`extras` holds no placement.
    """

    def __init__(self, model_or_layers: Union[torch.nn.Module, Sequence[Any]], optimizer: Optional[torch.optim.Optimizer],
                 policy: Optional[Policy] = None, planner: Optional[StepPlanner] = None) -> None:
        self.layers = moe_layers_of(model_or_layers)
        self.optimizer = optimizer
        given = policy if policy is not None else policy_of_layers(self.layers)
        self.policy: Policy = self._redecided(given)  # given speeds: known now
        self._apply_token_split()
        self.planner = planner
        self.cold = ColdMoves(self.layers, enabled=self.policy.cold_placement.on)
        self.placements = LayerPlacements(self.layers, optimizer)

    def after_step(self, step: int, carry: Optional[List[torch.Tensor]] = None) -> List[LoopEvent]:
        """The step's refresh, paging end, verdict, cold move and plans (collective; call on every
        rank after ``optimizer.step()`` with the same ``step``).

        Args:
            step: the optimizer step just taken (1-based, as the events name it).
            carry: tensors the first refresh over the whole group may sum in its own all-reduce
                (``HotExpertReplicator.sync``: a ``[W]`` loss-slot vector); what it summed is
                removed from the list, so a caller all-reduces what is left.
        Returns:
            What happened, in order (empty on most steps).
        """
        for m in self.layers:
            m.sync_replicas(force=True, carry=carry)
            m.end_page_step()  # after the refresh read the owners' weights: evictions, prefetch
        events: List[LoopEvent] = []
        before = self.policy
        self.policy = self._redecided(before)
        if self.policy.levers() != before.levers():
            events.append(LoopEvent("policy", self.policy.line()))
            self._apply_token_split()
        for line in self.cold.after_step(step, self.optimizer, allowed=self.policy.cold_placement.on):
            events.append(LoopEvent("migration", line))
        if self.planner is not None:
            events.extend(LoopEvent("migration", line) for line in self.planner.after_step(step))
        return events

    def _redecided(self, policy: Policy) -> Policy:
        meters = [m.speed for m in self.layers]
        return policy.with_verdict(speed_verdict(meters), expert_share(meters))

    def _apply_token_split(self) -> None:
        for m in self.layers:
            if m.config.token_split == "auto" and m.splitter is not None:
                m.use_token_split(self.policy.token_split.on)

    def extras(self) -> Dict[str, Any]:
        """The ``Stateful`` objects a checkpoint or snapshot carries beside the model:
        ``placement`` (every layer's expert map; not with a planner, which carries its own) and
        ``cold_moves`` (which layers moved)."""
        if self.planner is not None:
            return {}
        return {"placement": self.placements, "cold_moves": self.cold}

    def state_dict(self) -> Dict[str, Any]:
        """``{"placement": ..., "cold_moves": ...}`` (:meth:`extras`' states; host tensors)."""
        return {name: obj.state_dict() for name, obj in self.extras().items()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Re-place the layers and restore the cold moves (before the model's state loads).

        Raises:
            ConfigError: a saved map that does not fit this model (:class:`LayerPlacements`).
        """
        for name, obj in self.extras().items():
            if name in state_dict:
                obj.load_state_dict(state_dict[name])
