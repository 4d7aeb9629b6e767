"""The one-time placement by speed of the measured loop (:class:`~hetcomm.moe.measured_loop.MeasuredLoop`):
once per MoE layer, as soon as the agreed speeds have a verdict and every rank's expert rows are
measured, the layer's experts are re-placed so its ranks' predicted expert busy time per step
evens out (:func:`hetcomm.moe.placement.migration.place_by_speed`), when the policy's
``cold_placement`` lever is on (:mod:`hetcomm.moe.policy`). A slow rank ends with fewer experts,
the coldest among them.

Each layer is evened on its own, and a rank's dense work is left out, because every layer's
dispatch and combine are points every rank waits at: a slow rank's dense work delays the others
at the next dispatch whatever the experts are, so fewer experts there only leave it idle inside
the layer (on the half-speed testbed the speed-proportional ``[5, 5, 4, 2]`` of each layer ran
faster than maps that also took the dense work off the slow rank). The prediction per rank is the
layer's experts' rows at the rank's measured seconds per row; the rows per expert are the layer's
mean global picks per training forward, from its load observer. With given speeds
(``--speed oracle``) the per-row seconds are pooled over the ranks at full speed and spread by
the given factors (:func:`~hetcomm.moe.placement.migration.given_spread`).

Which layers have had their move is training state: it travels in checkpoints and snapshots
(as an ``extras`` entry beside :class:`~hetcomm.moe.placement.state.LayerPlacements`, which
carries the maps themselves and restores a changed expert count), so a restarted job neither
moves a layer twice nor forgets that it moved.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

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
        events = []
        for i in due:
            layer = self.layers[i]
            self.done[i] = True
            moved: List[int] = []
            if allowed:
                moved = layer.place_by_speed(self.expert_rows(i), optimizer)
            counts = [list(layer.placement.owner).count(r) for r in range(layer.world_size)]
            self.rows.append(f"layer {i} at step {step}: " + (f"experts {moved} moved, {counts} per rank"
                                                               if moved else "nothing to move"))
            if moved:
                events.append(f"layer {i}: experts re-placed by measured busy time, moved {moved}, "
                              f"experts per rank {counts}")
        return events

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
