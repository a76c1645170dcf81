"""The simulator's serving clock; what plans cost comes from the controller's cost model.

A placement matters only through time: the busiest GPU of a layer sets that layer's step
time, stalls stop serving, and weight transfers beside serving slow it down.
- Serving (`CostModel`, `WindowClock`, here): per layer and step, time = fixed +
  per-token cost x (tokens routed to the busiest GPU). `fixed` covers what does not scale
  with a GPU's routed tokens (attention, norms, kernel launch and all-to-all latency);
  the per-token part covers the expert GEMMs and the dispatch/combine bytes. Unless
  given explicitly, both are calibrated per trace so that a perfectly balanced window
  takes `window_seconds`, of which `moe_fraction` scales with load. Counts are per
  window, so imbalance inside a window (per step) is not modelled.
- Migration (rebalancer/controller/cost.py, the one model the controller's gate uses
  too): the simulator charges every plan with `plan_cost` and `rank_receive_seconds` on
  the adaptive policy's `PolicyConfig.cost`: per-rank receive time at the
  intra- and inter-node bandwidths (a plan takes as long as its busiest receiver, plus
  `plan_overhead_seconds` for the prepare/commit round trips), serving `1 +
  overlap_penalty` times slower meanwhile, then the commit pause and the map swap.
  The parameters and their measured defaults are documented there (`CostParams`).
- Engines that rebalance in-process (`periodic`) stop serving for
  `max(periodic_stall_seconds, transfer time)` per rebalance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from rebalancer.controller.cost import CostParams
from rebalancer.errors import InputError

# Mixtral-8x7B expert in FP8: w1, w3 (4096 x 14336) and w2 (14336 x 4096).
MIXTRAL_8X7B_EXPERT_BYTES = 3 * 4096 * 14336
# Fields that may be None (calibrated from the trace).
OPTIONAL_FIELDS = ("fixed_seconds_per_layer", "seconds_per_token")


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class CostModel:
    """What the simulator adds to the migration-cost model: serving time and the engines'
    in-process stall. Step time, bandwidths, overlap, commit and swap are the adaptive
    policy's (`PolicyConfig.cost`, defaults in rebalancer/controller/cost.py)."""

    # Share of a balanced step that scales with the tokens routed to a GPU (the rest is
    # fixed per layer and step).
    moe_fraction: float = 0.6
    # Explicit per-layer costs; None calibrates them from the trace (see module docstring).
    fixed_seconds_per_layer: float | None = None
    seconds_per_token: float | None = None
    # Controller round trips of a plan (prepare, prepared reports, commit).
    plan_overhead_seconds: float = 0.1
    # Blocking stall of one in-process rebalance (SGLang ~1-2 s, vLLM 0.65-1.7 s at EP32).
    periodic_stall_seconds: float = 1.5

    def validate(self) -> None:
        """Raise InputError naming the first field of the wrong type or out of range (the
        fields come from `--cost KEY=VALUE`, parsed as JSON: any type may arrive)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(
                value, (int, float, np.integer, np.floating)
            ):
                kind = "a number or null" if f.name in OPTIONAL_FIELDS else "a number"
                raise InputError(f"cost {f.name} must be {kind}, got {_brief(value)}")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int beyond float's range
                finite = False
            if not finite:
                raise InputError(f"cost {f.name} must be finite, got {_brief(value)}")
            if f.name == "moe_fraction":
                if not 0.0 < value <= 1.0:
                    raise InputError(f"cost moe_fraction must be in (0, 1], got {value}")
            elif value < 0:
                raise InputError(f"cost {f.name} must be >= 0, got {value}")


@dataclass(frozen=True)
class WindowClock:
    """Serving time of windows under the cost model, calibrated for one trace."""

    steps_per_window: float
    fixed_seconds_per_layer: float
    seconds_per_token: float
    num_layers: int

    @classmethod
    def calibrate(
        cls,
        cost: CostModel,
        params: CostParams,
        counts: np.ndarray,
        window_seconds: float,
        num_gpus: int,
    ) -> WindowClock:
        """Per-layer costs so that a balanced average window takes `window_seconds`."""
        num_layers = counts.shape[1]
        steps = window_seconds / params.step_seconds
        fixed = cost.fixed_seconds_per_layer
        if fixed is None:
            fixed = (1.0 - cost.moe_fraction) * params.step_seconds / num_layers
        per_token = cost.seconds_per_token
        if per_token is None:
            # Mean over windows of sum over layers of the balanced per-GPU load.
            balanced_load = float(counts.sum(axis=(1, 2)).mean()) / num_gpus
            per_token = cost.moe_fraction * window_seconds / max(balanced_load, 1e-12)
        return cls(steps, float(fixed), float(per_token), num_layers)

    def seconds(self, max_load_sum: float) -> float:
        """Serving time of a window whose busiest-GPU loads sum (over layers) to this."""
        return (
            self.steps_per_window * self.num_layers * self.fixed_seconds_per_layer
            + self.seconds_per_token * max_load_sum
        )
