"""Mixture-of-Experts layer over hetcomm.

``MoELayer`` is the entry point, ``MeasuredLoop`` its one call per training step (replica refresh,
paging, the cold move) and ``Policy`` the record of which heterogeneity levers are on; the rest is exposed for the training loop and benchmarks
(placement, step statistics, metrics, replication) and for tests of the individual pieces.
"""

from hetcomm.moe.gate_calibration import LoadCalibrator
from hetcomm.moe.experts import ExpertBank, FFNExpert
from hetcomm.moe.gate import GateOutput, TopKGate, expert_capacity
from hetcomm.moe.layer import MoEConfig, MoELayer
from hetcomm.moe.measured_loop import LoopEvent, MeasuredLoop
from hetcomm.moe.policy import Lever, Policy, PolicyInputs, decide
from hetcomm.moe.routing_metrics import MetricsAccumulator, RoutingMetrics, routing_metrics
from hetcomm.moe.placement import ExpertPlacement, place_experts
from hetcomm.moe.placement.replicate import HotExpertReplicator
from hetcomm.moe.step_stats import StepStats
from hetcomm.moe.row_counters import counters, reset_counters

__all__ = [
    "MoELayer",
    "MoEConfig",
    "MeasuredLoop",
    "LoopEvent",
    "Policy",
    "PolicyInputs",
    "Lever",
    "decide",
    "TopKGate",
    "GateOutput",
    "expert_capacity",
    "LoadCalibrator",
    "FFNExpert",
    "ExpertBank",
    "ExpertPlacement",
    "place_experts",
    "HotExpertReplicator",
    "StepStats",
    "counters",
    "reset_counters",
    "MetricsAccumulator",
    "RoutingMetrics",
    "routing_metrics",
]
