"""Scheduling all-to-all: plans, the cost model, the lower bound and the simulator.

``plan_all_to_all(cluster, traffic, strategy)`` decides a :class:`Plan`; ``simulate`` times it
under a :class:`CostParams` cost model; ``lower_bound`` says how fast any plan could be.
"""

from hetcomm.sched.bound import LowerBound, lower_bound
from hetcomm.sched.cost import CostParams, load_cost_params
from hetcomm.sched.plan import ChunkTable, Plan, Transfer
from hetcomm.sched.planner import PLAN_CHOICES, STRATEGIES, plan_all_to_all
from hetcomm.sched.simulate import SimResult, simulate

__all__ = [
    "Plan",
    "Transfer",
    "ChunkTable",
    "plan_all_to_all",
    "STRATEGIES",
    "PLAN_CHOICES",
    "CostParams",
    "load_cost_params",
    "simulate",
    "SimResult",
    "lower_bound",
    "LowerBound",
]
