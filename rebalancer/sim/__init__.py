"""Trace-driven simulator: what each placement policy buys and costs on real routing.

`load_trace` reads traces, `make_trace` builds drifting ones from real summed counts,
`simulate` replays a trace through the policies (the `adaptive` one through the live
controller's `PolicyLoop`: its estimator, `decide` and placement engine) under a
`CostModel` (the serving clock) and the controller's migration-cost model
(rebalancer.controller.cost, on the policy's `cost` section).
"""

from __future__ import annotations

from rebalancer.sim.cost import CostModel
from rebalancer.sim.engine import (
    FIT_ALGORITHMS,
    POLICIES,
    STARTS,
    FitAlgorithm,
    PeriodicConfig,
    PolicyName,
    PolicyResult,
    SimConfig,
    Simulator,
    Start,
    simulate,
)
from rebalancer.sim.generate import TraceGenConfig, deepseek_v3_sources, make_trace
from rebalancer.sim.trace import Trace, load_trace

__all__ = [
    "FIT_ALGORITHMS",
    "POLICIES",
    "STARTS",
    "CostModel",
    "FitAlgorithm",
    "PeriodicConfig",
    "PolicyName",
    "PolicyResult",
    "SimConfig",
    "Simulator",
    "Start",
    "Trace",
    "TraceGenConfig",
    "deepseek_v3_sources",
    "load_trace",
    "make_trace",
    "simulate",
]
