"""The placement engine: where each expert's replicas live, and what that achieves.

Pure numpy/scipy functions over `load [L, E]` and `phy2log [L, P]`; see
docs/placement.md for the algorithms, the bound and the migration mode.
"""

from __future__ import annotations

from rebalancer.placement.bounds import (
    lower_bound_balancedness,
    lower_bound_balancedness_per_layer,
)
from rebalancer.placement.engine import (
    ALGORITHMS,
    balanced_placement,
    compute_placement,
    greedy_placement,
)
from rebalancer.placement.metrics import (
    balancedness,
    balancedness_per_layer,
    gpu_load,
    log2phy_of,
    logcnt_of,
    moved_fraction,
    trivial_placement,
)
from rebalancer.placement.reference import reference_placement
from rebalancer.placement.transfers import transfers
from rebalancer.placement.types import PlacementResult

__all__ = [
    "ALGORITHMS",
    "PlacementResult",
    "balanced_placement",
    "balancedness",
    "balancedness_per_layer",
    "compute_placement",
    "gpu_load",
    "greedy_placement",
    "log2phy_of",
    "logcnt_of",
    "lower_bound_balancedness",
    "lower_bound_balancedness_per_layer",
    "moved_fraction",
    "reference_placement",
    "transfers",
    "trivial_placement",
]
