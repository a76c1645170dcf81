"""Load estimate: what the controller believes each expert's load is now.

Windows of counts arrive one at a time (already summed over ranks). A single window is
noisy and the traffic mix drifts, so decisions are taken on a smoothed rate instead: an
exponentially decayed mean (default) or the plain mean of the last `window` windows. The
estimate is a rate in tokens per window, so it is on the same scale as one window's
counts whatever the number of windows folded. The same class runs in the live
controller and in the simulator, so both see the same numbers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from rebalancer.errors import InputError


@dataclass(frozen=True)
class EstimatorConfig:
    # Weight of the old estimate each time a window is folded in, in [0, 1]: 0 keeps only
    # the last window, 1 is the plain mean of every window since the start.
    decay: float = 0.7
    # > 0: mean of the last `window` windows instead of the exponential decay.
    window: int = 0

    def validate(self) -> None:
        if not (isinstance(self.decay, (int, float)) and math.isfinite(self.decay)):
            raise InputError(f"estimator decay must be a number in [0, 1], got {self.decay!r}")
        if not 0.0 <= self.decay <= 1.0:
            raise InputError(f"estimator decay must be in [0, 1], got {self.decay}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise InputError(f"estimator window must be an integer >= 0, got {self.window!r}")


class LoadEstimator:
    """Smoothed per-(layer, logical expert) load over the windows folded so far."""

    def __init__(
        self, num_layers: int, num_experts: int, config: EstimatorConfig = EstimatorConfig()
    ) -> None:
        if num_layers <= 0 or num_experts <= 0:
            raise InputError(f"estimator shape must be positive, got [{num_layers}, {num_experts}]")
        config.validate()
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.config = config
        self.windows = 0
        # Decay mode: est = weighted_sum / weight_total with both decayed per window, which
        # is the decayed mean with no start-up bias toward zero.
        self._weighted_sum = np.zeros((num_layers, num_experts), dtype=np.float64)
        self._weight_total = 0.0
        self._weight_sq_total = 0.0  # sum of squared weights: for the effective sample size
        # Sliding mode: the last `window` windows and their running sum.
        self._recent: deque[np.ndarray] = deque()
        self._recent_sum = np.zeros((num_layers, num_experts), dtype=np.float64)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_layers, self.num_experts)

    def _check(self, counts: np.ndarray) -> np.ndarray:
        arr = np.asarray(counts)
        if arr.shape != self.shape:
            raise InputError(f"counts have shape {list(arr.shape)}, expected {list(self.shape)}")
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise InputError(f"counts must be numeric, got dtype {arr.dtype}")
        arr = arr.astype(np.float64, copy=False)
        if not np.all(np.isfinite(arr)):
            raise InputError("counts contain NaN or infinity")
        if np.any(arr < 0):
            raise InputError("counts contain negative values")
        return arr

    def add(self, counts: np.ndarray) -> None:
        """Fold one window of counts `[L, E]` (summed over ranks) into the estimate."""
        arr = self._check(counts)
        self.windows += 1
        if self.config.window > 0:
            window = arr.copy()
            self._recent.append(window)
            self._recent_sum += window
            if len(self._recent) > self.config.window:
                self._recent_sum -= self._recent.popleft()
                # Re-sum now and then so float error from add/subtract cannot build up.
                if self.windows % (16 * self.config.window) == 0:
                    self._recent_sum = np.sum(np.stack(list(self._recent)), axis=0)
            return
        decay = self.config.decay
        self._weighted_sum *= decay
        self._weighted_sum += arr
        self._weight_total = self._weight_total * decay + 1.0
        self._weight_sq_total = self._weight_sq_total * decay * decay + 1.0

    def estimate(self) -> np.ndarray:
        """The load estimate `[L, E]` float64, in tokens per window; zeros before any window."""
        if self.config.window > 0:
            if not self._recent:
                return np.zeros(self.shape, dtype=np.float64)
            return self._recent_sum / len(self._recent)
        if self._weight_total == 0.0:
            return np.zeros(self.shape, dtype=np.float64)
        return self._weighted_sum / self._weight_total

    @property
    def effective_windows(self) -> float:
        """How many windows' worth of independent counts the estimate holds.

        Kish's effective sample size of the window weights: the plain count for a sliding
        window, (sum w)^2 / sum w^2 for the decay (about (1 + d) / (1 - d) windows in the
        long run). The decision policy uses it to tell signal from sampling noise.
        """
        if self.config.window > 0:
            return float(len(self._recent))
        if self._weight_sq_total == 0.0:
            return 0.0
        return self._weight_total**2 / self._weight_sq_total

    def reset(self) -> None:
        """Forget every window (e.g. after the model shape changed)."""
        self.windows = 0
        self._weighted_sum[:] = 0.0
        self._weight_total = 0.0
        self._weight_sq_total = 0.0
        self._recent.clear()
        self._recent_sum[:] = 0.0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the estimator, as JSON-ready plain values."""
        return {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "decay": float(self.config.decay),
            "window": int(self.config.window),
            "windows": int(self.windows),
            "weighted_sum": self._weighted_sum.tolist(),
            "weight_total": float(self._weight_total),
            "weight_sq_total": float(self._weight_sq_total),
            "recent": [w.tolist() for w in self._recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`; the shape must match, the config is taken from state."""
        shape = (int(state["num_layers"]), int(state["num_experts"]))
        if shape != self.shape:
            raise InputError(
                f"estimator state has shape {list(shape)}, expected {list(self.shape)}"
            )
        config = EstimatorConfig(decay=float(state["decay"]), window=int(state["window"]))
        config.validate()
        weighted_sum = np.asarray(state["weighted_sum"], dtype=np.float64)
        recent = [np.asarray(w, dtype=np.float64) for w in state.get("recent", [])]
        if weighted_sum.shape != shape or any(w.shape != shape for w in recent):
            raise InputError("estimator state arrays do not match its shape")
        self.config = config
        self.windows = int(state["windows"])
        self._weighted_sum = weighted_sum.copy()
        self._weight_total = float(state["weight_total"])
        self._weight_sq_total = float(state.get("weight_sq_total", self._weight_total))
        self._recent = deque(w.copy() for w in recent)
        self._recent_sum = (
            np.sum(np.stack(recent), axis=0) if recent else np.zeros(shape, dtype=np.float64)
        )
