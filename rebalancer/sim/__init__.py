"""Trace-driven simulator: what each placement policy buys and costs on real routing.

`load_trace` reads traces, `make_trace` builds drifting ones from real summed counts,
`simulate` replays a trace through the policies (the `adaptive` one through the live
controller's estimator, decision policy and placement engine) under a `CostModel`.
"""

from __future__ import annotations

from rebalancer.sim.cost import CostModel
from rebalancer.sim.engine import (
    POLICIES,
    STARTS,
    PeriodicConfig,
    PolicyResult,
    SimConfig,
    Simulator,
    simulate,
)
from rebalancer.sim.generate import TraceGenConfig, deepseek_v3_sources, make_trace
from rebalancer.sim.trace import Trace, load_trace

__all__ = [
    "POLICIES",
    "STARTS",
    "CostModel",
    "PeriodicConfig",
    "PolicyResult",
    "SimConfig",
    "Simulator",
    "Trace",
    "TraceGenConfig",
    "deepseek_v3_sources",
    "load_trace",
    "make_trace",
    "simulate",
]
