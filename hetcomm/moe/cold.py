"""The one-time cold move of the measured loop (:class:`~hetcomm.moe.measured_loop.MeasuredLoop`):
once per MoE layer, as soon as its speed vector is agreed and its load EMA has a full window, the
coldest experts by global load move onto the ranks measured slower
(:func:`hetcomm.moe.placement.migration.place_cold_on_slow`), when the policy's
``cold_placement`` lever is on (:mod:`hetcomm.moe.policy`).

Which layers have had their move is training state: it travels in checkpoints and snapshots
(as an ``extras`` entry beside :class:`~hetcomm.moe.placement.state.LayerPlacements`, which
carries the maps themselves), so a restarted job neither moves a layer twice nor forgets that
it moved.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

__all__ = ["ColdMoves"]


class ColdMoves:
    """The cold move of each layer in ``layers``, at most once per layer (``Stateful``).

    Args:
        layers: the model's MoE layers.
        enabled: False: no layer moves and the summary says "off".
    """

    def __init__(self, layers: Sequence, enabled: bool) -> None:
        self.layers = list(layers)
        self.enabled = enabled
        self.done = [not enabled] * len(self.layers)
        self.rows: List[str] = []

    def after_step(self, step: int, optimizer, allowed: bool = True) -> List[str]:
        """Move each layer whose move is due (collective when due: the conditions are agreed
        values and step counts, the same on every rank). ``allowed``: the policy's verdict at
        this step (False: a due layer is done with nothing moved, the agreed speeds being
        equal). Returns one line per layer moved."""
        events = []
        for i, layer in enumerate(self.layers):
            if self.done[i] or not layer.cold_placement_due():
                continue
            self.done[i] = True
            moved = layer.place_cold_on_slow(optimizer) if allowed else []
            self.rows.append(f"layer {i} at step {step}: " + (f"experts {moved} moved" if moved else "nothing to move"))
            if moved:
                events.append(f"layer {i}: coldest experts onto the measured-slow ranks, moved {moved}")
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
