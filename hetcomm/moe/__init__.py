"""Mixture-of-Experts layer over hetcomm.

``MoELayer`` is the entry point; the rest is exposed for the training loop and benchmarks
(placement, step statistics, metrics, replication) and for tests of the individual pieces.
"""

from hetcomm.moe.gate_calibration import LoadCalibrator
from hetcomm.moe.experts import ExpertBank, FFNExpert
from hetcomm.moe.gate import GateOutput, TopKGate, expert_capacity
from hetcomm.moe.layer import MoEConfig, MoELayer
from hetcomm.moe.routing_metrics import MetricsAccumulator, RoutingMetrics, routing_metrics
from hetcomm.moe.placement import ExpertPlacement, place_experts
from hetcomm.moe.placement.replicate import HotExpertReplicator
from hetcomm.moe.step_stats import StepStats
from hetcomm.moe.traffic import counters, reset_counters

__all__ = [
    "MoELayer",
    "MoEConfig",
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
