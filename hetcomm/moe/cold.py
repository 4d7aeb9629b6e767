"""The one-time placement by speed of the measured loop (:class:`~hetcomm.moe.measured_loop.MeasuredLoop`):
once per MoE layer, as soon as the agreed speeds have a verdict and every rank's busy time is
measured, the experts are re-placed so the ranks' predicted busy time per step evens out
(:func:`hetcomm.moe.placement.migration.place_by_speed`), when the policy's ``cold_placement``
lever is on (:mod:`hetcomm.moe.policy`). A slow rank ends with fewer experts, the coldest among
them: it is slow at its dense work too, which no move takes away.

The prediction per rank is its dense seconds per step (the speed source's whole-step clock,
:attr:`~hetcomm.moe.speed.SpeedSnapshot.step_seconds`, minus every layer's measured expert
seconds) plus each layer's experts' rows at the rank's measured seconds per row. Layers due at
the same step are placed in order, each against the prediction the earlier ones left. The rows
per expert are the layer's mean global picks per training forward, from its load observer. With
given speeds (``--speed oracle``) the dense and per-row seconds are pooled over the ranks at full
speed and spread by the given factors (:func:`~hetcomm.moe.placement.migration.given_spread`).

Which layers have had their move is training state: it travels in checkpoints and snapshots
(as an ``extras`` entry beside :class:`~hetcomm.moe.placement.state.LayerPlacements`, which
carries the maps themselves and restores a changed expert count), so a restarted job neither
moves a layer twice nor forgets that it moved.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from hetcomm.moe.placement.assign import busy_times
from hetcomm.moe.placement.migration import FORWARD_AND_BACKWARD, dense_seconds, seconds_per_row

__all__ = ["ColdMoves"]


class ColdMoves:
    """The placement by speed of each layer in ``layers``, at most once per layer (``Stateful``).

    Args:
        layers: the model's MoE layers.
        enabled: False: no layer moves and the summary says "off".
    """

    def __init__(self, layers: Sequence, enabled: bool) -> None:
        self.layers = list(layers)
        self.enabled = enabled
        self.done = [not enabled] * len(self.layers)
        self.rows: List[str] = []
        self._picks: List[Optional[torch.Tensor]] = [None] * len(self.layers)
        self._forwards = [0] * len(self.layers)
        if enabled:
            for i, layer in enumerate(self.layers):
                layer.add_load_observer(self._observer(i))

    def _observer(self, i: int):
        def observe(global_picks: torch.Tensor, global_probs, num_tokens, global_fast) -> None:
            if not self.done[i]:
                p = self._picks[i]
                self._picks[i] = global_picks.detach().double().clone() if p is None else p + global_picks.double()
                self._forwards[i] += 1
        return observe

    def expert_rows(self, i: int) -> List[float]:
        """``[E]`` layer ``i``'s mean global picks per training forward since the start (identical
        on every rank); empty before its first."""
        p = self._picks[i]
        return [] if p is None or self._forwards[i] == 0 else (p / self._forwards[i]).tolist()

    def after_step(self, step: int, optimizer, allowed: bool = True) -> List[str]:
        """Place each layer whose move is due (collective when due: the conditions are agreed
        values and step counts, the same on every rank). ``allowed``: the policy's verdict at
        this step (False: a due layer is done with nothing moved, the agreed speeds being
        equal). Returns one line per layer moved."""
        due = [i for i, layer in enumerate(self.layers)
               if not self.done[i] and layer.speed_placement_due() and self.expert_rows(i)]
        if not due:
            return []
        W = self.layers[due[0]].world_size
        one_group = all(m.world_size == W for m in self.layers)
        # each rank's step: its dense seconds plus every layer's expert seconds (the model's where
        # the load is known, the measured ones elsewhere); each layer is placed against the rest
        dense = dense_seconds(self.layers if one_group else [self.layers[due[0]]])
        experts = [self._expert_seconds(j) for j in range(len(self.layers))] if one_group else []
        events = []
        for i in due:
            layer = self.layers[i]
            self.done[i] = True
            moved: List[int] = []
            if allowed:
                rows, per_row = self.expert_rows(i), seconds_per_row(layer)
                others = [sum(e[r] for j, e in enumerate(experts) if j != i) for r in range(W)]
                fixed = [d + o for d, o in zip(dense, others)] if one_group else dense
                moved = layer.place_by_speed(rows, fixed, optimizer)
                if one_group:
                    experts[i] = busy_times(layer.placement.owner, rows, per_row, [0.0] * W)
            counts = [list(layer.placement.owner).count(r) for r in range(layer.world_size)]
            self.rows.append(f"layer {i} at step {step}: " + (f"experts {moved} moved, {counts} per rank"
                                                               if moved else "nothing to move"))
            if moved:
                events.append(f"layer {i}: experts re-placed by measured busy time, moved {moved}, "
                              f"experts per rank {counts}")
        return events

    def _expert_seconds(self, j: int) -> List[float]:
        """``[W]`` layer ``j``'s expert seconds per step on each rank: its rows at the ranks'
        seconds per row where its load and speeds are known, else its measured seconds."""
        layer = self.layers[j]
        rows = self.expert_rows(j)
        if rows and layer.speed_placement_due():
            return busy_times(layer.placement.owner, rows, seconds_per_row(layer), [0.0] * layer.world_size)
        return [FORWARD_AND_BACKWARD * t for t in layer.speed.agreed.seconds_per_step] or [0.0] * layer.world_size

    def summary(self) -> str:
        if not self.enabled:
            return "off"
        if self.rows:
            return "; ".join(self.rows)
        return "not yet measured"

    def state_dict(self) -> Dict[str, object]:
        # host: which layers moved, a host decision saved beside the other host state
        return {"done": torch.tensor(self.done, dtype=torch.bool), "rows": list(self.rows)}  # host

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        done = state_dict["done"].tolist()  # type: ignore[attr-defined]
        if len(done) != len(self.layers):
            from hetcomm.errors import ConfigError

            raise ConfigError(f"the saved cold-move state covers {len(done)} MoE layers, this model has "
                              f"{len(self.layers)}; resume with the model it was saved with", key="moe.cold_moves")
        self.done = [bool(d) or not self.enabled for d in done]
        self.rows = [str(r) for r in state_dict["rows"]]  # type: ignore[union-attr]
