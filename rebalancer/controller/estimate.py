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
    """The estimator's settings: the `estimator` section of a deployment's PolicyConfig
    (flat names on the wire and in TOML: decay, estimate_window, prior_decay, shrink), so
    a deployment and a bare estimator smooth alike."""

    decay: float = 0.3
    """Weight of the old estimate each time a window is folded in, in [0, 1]: 0 keeps only
    the last window, 1 is the plain mean of every window since the start."""

    window: int = 0
    """> 0: mean of the last `window` windows instead of the exponential decay."""

    prior_decay: float = 0.99
    """Weight of the old long-run estimate (the prior of `shrunk`) per window: 0.99 keeps
    about 200 windows, so the prior accumulates evidence but still follows slow drift."""

    shrink: bool = True
    """`estimate` returns the empirical-Bayes estimate (`shrunk`) instead of the smoothed
    one: short-run shares that differ from the long-run prior by no more than sampling
    noise are replaced by it, so sparse counts neither trigger a refit on noise nor keep
    a placement fitted on noise."""

    def validate(self) -> None:
        if not (isinstance(self.decay, (int, float)) and math.isfinite(self.decay)):
            raise InputError(f"estimator decay must be a number in [0, 1], got {self.decay!r}")
        if not 0.0 <= self.decay <= 1.0:
            raise InputError(f"estimator decay must be in [0, 1], got {self.decay}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise InputError(f"estimator window must be an integer >= 0, got {self.window!r}")
        prior = self.prior_decay
        if isinstance(prior, bool) or not isinstance(prior, (int, float)):
            raise InputError(f"estimator prior_decay must be a number, got {prior!r}")
        if not (math.isfinite(prior) and 0.0 <= prior <= 1.0):
            raise InputError(f"estimator prior_decay must be in [0, 1], got {prior}")
        if not isinstance(self.shrink, bool):
            raise InputError(f"estimator shrink must be a boolean, got {self.shrink!r}")


def shrink_shares(counts: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, pull observed shares toward `prior` by the share of their spread that is noise.

    `counts [L, E]` are (effective) token counts, `prior [L, E]` or `[E]` shares that sum
    to 1 per layer. Under the prior alone, Pearson's chi-square of a layer's counts has
    mean E - 1; what it holds beyond that is signal. The method-of-moments empirical-Bayes
    weight on the prior is B = min(1, (E - 1) / chi2) (positive-part James-Stein): pure
    noise is replaced by the prior, a deviation far beyond noise is kept. Returns the shares [L, E]
    and B [L] (1 for a layer without counts).
    """
    counts = np.asarray(counts, dtype=np.float64)
    prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), counts.shape)
    total = counts.sum(axis=1, keepdims=True)
    expected = total * prior
    if expected.size and float(expected.min()) > 0.0:
        # The usual case (every layer loaded, no expert the prior rules out): the same
        # numbers as below without the masks, which are most of a decision's estimate.
        terms = counts - expected
        terms *= terms
        terms /= expected
        observed = counts / total
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(
                expected > 0,
                (counts - expected) ** 2 / np.where(expected > 0, expected, 1.0),
                np.where(counts > 0, np.inf, 0.0),  # counts where the prior says none: signal
            )
            observed = np.where(total > 0, counts / np.where(total > 0, total, 1.0), prior)
    chi2 = terms.sum(axis=1)
    df = float(counts.shape[1] - 1)
    weight = np.ones(counts.shape[0])
    seen = total[:, 0] > 0
    signal = seen & (chi2 > df)
    weight[signal] = df / chi2[signal]
    shares = prior + (1.0 - weight)[:, None] * (observed - prior)
    return shares, weight


@dataclass(frozen=True)
class EstimateSums:
    """What an estimate is computed from (`LoadEstimator.sums`): the short-run sum of
    windows and its weight, the long-run (prior) sum and its weights. The estimate's math
    lives here, so the controller's loop can hand a copy to the decision worker."""

    shrink: bool
    """EstimatorConfig.shrink: `estimate` is `shrunk` (else `smoothed`)."""

    fast_sum: np.ndarray
    """[L, E]: the decayed sum of windows, or the sliding window's plain sum."""

    fast_weight: float
    """What `fast_sum` divides by for a rate: the decayed weight total, or how many
    windows the sliding window holds (0: no window yet)."""

    fast_windows: float
    """`LoadEstimator.effective_windows` of the short-run level."""

    prior_sum: np.ndarray
    """[L, E]: the long-run decayed sum of windows."""

    prior_weight: float
    prior_weight_sq: float
    """The long-run sum's weight total and its sum of squared weights."""

    def smoothed(self) -> np.ndarray:
        """The decayed (or sliding-window) mean rate `[L, E]`; zeros before any window."""
        if self.fast_weight == 0.0:
            return np.zeros(self.fast_sum.shape, dtype=np.float64)
        return self.fast_sum / self.fast_weight

    def estimate(self) -> np.ndarray:
        """`LoadEstimator.estimate`."""
        return self.shrunk()[0] if self.shrink else self.smoothed()

    def estimate_and_noise(self) -> tuple[np.ndarray, np.ndarray]:
        """`LoadEstimator.estimate_and_noise`."""
        if self.shrink:
            return self.shrunk()
        return self.smoothed(), np.full(self.fast_sum.shape[0], self.fast_windows)

    def shrunk(self) -> tuple[np.ndarray, np.ndarray]:
        """The estimate with its noise shrunk away, and how many windows it is worth per layer.

        Two levels of `shrink_shares`: the long-run rate's shares toward uniform (weight
        B0), then the short-run shares toward those (weight B); each layer keeps the
        short-run total, so only the split between experts changes. The returned
        effective windows [L] are those of the blend's sampling noise,
        1 / ((1 - B)^2 / n_short + B^2 (1 - B0)^2 / n_long) with Kish's n of each level
        (inf where the estimate is the uniform prior exactly): what the decision's noise
        margin needs. Zeros and zero windows before any window.
        """
        L, E = self.fast_sum.shape
        fast = self.smoothed()
        n_fast = self.fast_windows
        if n_fast <= 0.0 or self.prior_weight == 0.0:
            return fast, np.zeros(L)
        n_long = self.prior_weight**2 / self.prior_weight_sq
        long_rate = self.prior_sum / self.prior_weight
        prior, b0 = shrink_shares(long_rate * n_long, np.full(E, 1.0 / E))
        shares, b = shrink_shares(fast * n_fast, prior)
        variance = (1.0 - b) ** 2 / n_fast + (b * (1.0 - b0)) ** 2 / n_long
        with np.errstate(divide="ignore"):
            windows = np.where(variance > 0, 1.0 / np.where(variance > 0, variance, 1.0), np.inf)
        return shares * fast.sum(axis=1, keepdims=True), windows


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
        # Long-run decayed sums: the prior `shrunk` falls back on (kept in both modes).
        self._prior_sum = np.zeros((num_layers, num_experts), dtype=np.float64)
        self._prior_weight = 0.0
        self._prior_weight_sq = 0.0

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

    def add(self, counts: np.ndarray, checked: bool = False) -> None:
        """Fold one window of counts `[L, E]` (summed over ranks) into the estimate.
        `checked`: a sum of windows already validated (the controller's merged windows,
        each part checked by the wire codec: finite, non-negative, at most 2^53), so only
        its shape is checked again, not every count."""
        if checked:
            arr = np.asarray(counts)
            if arr.shape != self.shape:
                raise InputError(
                    f"counts have shape {list(arr.shape)}, expected {list(self.shape)}"
                )
            arr = arr.astype(np.float64, copy=False)
        else:
            arr = self._check(counts)
        self.windows += 1
        prior = self.config.prior_decay
        self._prior_sum *= prior
        self._prior_sum += arr
        self._prior_weight = self._prior_weight * prior + 1.0
        self._prior_weight_sq = self._prior_weight_sq * prior * prior + 1.0
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
        """The load estimate `[L, E]` float64, in tokens per window; zeros before any window.

        `shrunk` with config.shrink, else `smoothed`."""
        return self.sums().estimate()

    def estimate_and_noise(self) -> tuple[np.ndarray, np.ndarray]:
        """`estimate` and, per layer [L], how many windows of sampling noise it carries
        (`effective_windows` for every layer unless shrunk): what a decision needs."""
        return self.sums().estimate_and_noise()

    def smoothed(self) -> np.ndarray:
        """The decayed (or sliding-window) mean rate `[L, E]`; zeros before any window."""
        return self.sums().smoothed()

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

    def shrunk(self) -> tuple[np.ndarray, np.ndarray]:
        """The estimate with its noise shrunk away, and how many windows it is worth per
        layer (`EstimateSums.shrunk`)."""
        return self.sums().shrunk()

    def sums(self, copy: bool = False) -> EstimateSums:
        """The running sums every estimate is computed from; `copy`: a snapshot that
        windows folded later do not change (a decision computes its estimate from it in
        the decision worker, off the event loop: two array copies instead of the
        estimate's dozens of passes)."""
        sliding = self.config.window > 0
        fast = self._recent_sum if sliding else self._weighted_sum
        return EstimateSums(
            shrink=self.config.shrink,
            fast_sum=fast.copy() if copy else fast,
            fast_weight=float(len(self._recent)) if sliding else self._weight_total,
            fast_windows=self.effective_windows,
            prior_sum=self._prior_sum.copy() if copy else self._prior_sum,
            prior_weight=self._prior_weight,
            prior_weight_sq=self._prior_weight_sq,
        )

    def state(self) -> dict[str, Any]:
        """Everything needed to rebuild the estimator, arrays kept as numpy arrays (the
        store writes their bytes; `load_state_dict` takes this as it is)."""
        return {
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "decay": float(self.config.decay),
            "window": int(self.config.window),
            "windows": int(self.windows),
            "weighted_sum": self._weighted_sum,
            "weight_total": float(self._weight_total),
            "weight_sq_total": float(self._weight_sq_total),
            "recent": list(self._recent),
            "prior_decay": float(self.config.prior_decay),
            "shrink": bool(self.config.shrink),
            "prior_sum": self._prior_sum,
            "prior_weight": float(self._prior_weight),
            "prior_weight_sq": float(self._prior_weight_sq),
        }

    def state_dict(self) -> dict[str, Any]:
        """`state()` as JSON-ready plain values."""
        return {
            k: [w.tolist() for w in v]
            if k == "recent"
            else v.tolist()
            if isinstance(v, np.ndarray)
            else v
            for k, v in self.state().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`; the shape must match, the config is taken from state."""
        shape = (int(state["num_layers"]), int(state["num_experts"]))
        if shape != self.shape:
            raise InputError(
                f"estimator state has shape {list(shape)}, expected {list(self.shape)}"
            )
        config = EstimatorConfig(
            decay=float(state["decay"]),
            window=int(state["window"]),
            prior_decay=float(state.get("prior_decay", EstimatorConfig.prior_decay)),
            shrink=bool(state.get("shrink", False)),
        )
        config.validate()
        weighted_sum = np.asarray(state["weighted_sum"], dtype=np.float64)
        recent = [np.asarray(w, dtype=np.float64) for w in state.get("recent", [])]
        # State saved before the long-run prior existed starts the prior afresh.
        prior_sum = np.asarray(state.get("prior_sum", np.zeros(shape)), dtype=np.float64)
        if (
            weighted_sum.shape != shape
            or prior_sum.shape != shape
            or any(w.shape != shape for w in recent)
        ):
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
        self._prior_sum = prior_sum.copy()
        self._prior_weight = float(state.get("prior_weight", 0.0))
        self._prior_weight_sq = float(state.get("prior_weight_sq", 0.0))
