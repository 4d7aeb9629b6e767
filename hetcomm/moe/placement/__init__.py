"""The expert-placement engine: which rank holds which expert, and how that changes.

One room, one job each:

* :mod:`~hetcomm.moe.placement.assign` -- the initial assignment (``place_experts``: experts in
  proportion to rank weights, hottest spread over strong ranks given a load prior; once speeds
  are measured, ``balance_busy_time``: the map that evens the ranks' predicted expert busy time) and the :class:`ExpertPlacement` map itself;
* :mod:`~hetcomm.moe.placement.balancer` -- the one placement policy
  (:class:`ExpertBalancer`: predicted load, capacity-aware packing, refinement, cooldown);
  ``MoELayer.rebalance`` and ``hetcomm train --balance`` both decide through it;
* :mod:`~hetcomm.moe.placement.replicate` -- hot-expert replicas on the measured-fastest strong ranks with room;
* :mod:`~hetcomm.moe.placement.migration` -- the one migration engine
  (:class:`ExpertMigrator`: parameters, optimizer state and gradients move asynchronously;
  :func:`migrate_now` is its start + finish at once).

A new map is adopted through the layer's public, validated
:meth:`hetcomm.moe.MoELayer.apply_placement`; nothing outside the layer touches its internals.
The layer's one load observer (its all-reduced global statistics,
:meth:`~hetcomm.moe.MoELayer.add_load_observer`) feeds the calibrator, the replicator and the
balancer; the pager's L2 migration requests reach the balancer through
:meth:`~hetcomm.moe.MoELayer.take_migration_requests`.
"""

from hetcomm.moe.placement.assign import ExpertPlacement, place_experts, split_by_weight

__all__ = ["ExpertPlacement", "place_experts", "split_by_weight"]
