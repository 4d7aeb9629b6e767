"""Scheduling all-to-all: plans, the cost model, the lower bound and the simulator."""

from hetcomm.sched.plan import Plan, Transfer

__all__ = ["Plan", "Transfer"]
