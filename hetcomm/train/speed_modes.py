"""Where ``hetcomm train`` takes rank speeds from, at the two ends of the scale: none at all
(``--no-balance``, speed-blind) and the truth (``--speed oracle``).

- **Speed-blind** (``TrainConfig.balance`` False): no decision reads a speed, datasheet or
  measured. Experts are placed equally and contiguously (not the strong flag's 2:1 weights), the
  layers measure nothing (``speed_every`` 0, so replica holders are never re-chosen by speed and
  stay the cluster's strong ranks: which ranks *may* hold copies is the cluster file's choice of
  links, not a speed), and the cold move, the per-step token split and the
  balancer are off (:func:`hetcomm.cli.train.train_config`, :func:`hetcomm.train.loop._add_levers`).
  A resume onto another membership still places by the weights its record carries
  (:mod:`hetcomm.train.elastic`): that restores an earlier run's decision.
- **Oracle** (``TrainConfig.speed`` ``oracle``): the speeds ``hetcomm emulate --compute`` gives
  each node (``emulation.compute_scale`` of the cluster file, else its datasheet ratio:
  :func:`hetcomm.emulate.spec.node_compute_scale`) are used wherever measured speeds would be --
  the initial placement's weights, the replica holders (:func:`~hetcomm.moe.placement.replicate.choose_holders`),
  the layers' speed vector that the per-step token split reads and its verdict (given: it
  stays, ``SpeedMeter.set_prior(given=True)``). The layers still agree what only a run
  measures, each rank's busy seconds per step and per expert row, so the placement by speed
  (:mod:`hetcomm.moe.cold`) runs at the first agreement instead of waiting for a noise
  estimate. A benchmark aid: it shows what the levers reach when the speeds are known, on a
  cluster whose labels hide them (``configs/clusters/mislabelled-halfspeed.yaml``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from hetcomm.errors import ConfigError

__all__ = ["oracle_speeds", "placement_weights", "layer_speed_every", "apply_oracle",
           "speed_record"]


def oracle_speeds(cluster: Any, world_size: int) -> List[float]:
    """``[W]`` relative compute speed of each rank as ``hetcomm emulate --compute`` sets it
    (1 = the fastest node; the cluster file's ``emulation.compute_scale``, else datasheet ratios).

    Raises:
        ConfigError: no cluster file (``--cluster detect``), or a bad ``emulation`` mapping
            (naming the file and key).
    """
    if cluster is None:
        raise ConfigError("--speed oracle reads the emulation's compute factors from a cluster file; "
                          "give one with --cluster", key="train.speed")
    from hetcomm.emulate.spec import node_compute_scale, settings_from_cluster

    settings = settings_from_cluster(cluster)
    return [float(node_compute_scale(cluster, settings, cluster.node_of(r))) for r in range(world_size)]


def placement_weights(cfg: Any, cluster: Any, world_size: int,
                      elastic_weights: Optional[List[float]]) -> Optional[List[float]]:
    """The initial placement's ``[W]`` weights, or None for the layer's own (the strong flag's):
    a resume's recorded weights when there are any, else equal ones when speed-blind, else the
    oracle's speeds with ``--speed oracle``."""
    if elastic_weights is not None:
        return elastic_weights
    if cfg.balance is False:
        return [1.0] * world_size
    if cfg.speed == "oracle":
        return oracle_speeds(cluster, world_size)
    return None


def layer_speed_every(cfg: Any, default: int) -> int:
    """``MoEConfig.speed_every`` for the run: ``default`` when speeds are measured or given by
    the oracle (whose agreements bring only the busy times the placement by speed balances),
    0 (the prior stays, nothing agreed) when speed-blind or with the datasheet's speeds."""
    return default if cfg.speed in ("measured", "oracle") and cfg.balance is not False else 0


def apply_oracle(layers: Sequence[Any], speeds: Sequence[float]) -> None:
    """Give each MoE layer the oracle's speeds before its first forward: the speed vector in
    force (its prior; nothing is measured) and the replica holders chosen from it among the
    candidates."""
    from hetcomm.moe.placement.replicate import choose_holders

    for m in layers:
        group_speeds = [float(speeds[g]) for g in m.global_ranks]
        m.speed.set_prior(group_speeds, given=True)
        if m.replicator is not None:
            room = [r in m.replicator.candidates for r in range(len(group_speeds))]
            m.replicator.set_hot(m.replicator.hot, holders=choose_holders(group_speeds, room, m.replicator.candidates))


def speed_record(layers: Sequence[Any], cold: Any) -> Dict[str, Any]:
    """What a run decided that a speed could have changed, for its summary (``last_summary()``):
    per MoE layer the expert owners, the speed vector in force, whether it was measured and in
    how many agreements, and the replica holders; whether the cold move was on."""
    return {
        "owners": [list(m.placement.owner) for m in layers],
        "speeds": [list(m.speed.speeds) for m in layers],
        "measured": [bool(m.speed.measured) for m in layers],
        "agreements": [int(m.speed.agreements) for m in layers],
        "holders": [list(m.replicator.holders) if m.replicator is not None else [] for m in layers],
        "cold_enabled": bool(cold.enabled),
    }
