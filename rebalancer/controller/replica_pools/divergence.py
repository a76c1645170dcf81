"""Whether a member's windows still match its pool: the statistic and the run of windows.

Each member window is compared with the pool's reference distribution (a decayed sum of
the following members' windows); a member whose windows stop matching is taken out of the
pool estimate and balanced alone until its windows match again (`ReplicaPool.test_window`
moves a member across the line; bench/pool_divergence.py measures the threshold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DivergenceConfig:
    """When a member's windows stop matching the pool's estimate (docs/operations.md
    "Pools" justifies the numbers).

    The statistic of one window is its excess total variation: per layer, the total
    variation distance between the window's routed-count distribution and the pool
    estimate's, minus what multinomial sampling noise of that many picks gives on
    average (`sampling_tv`), averaged over layers. A member is diverged after `windows`
    windows in a row above `threshold`, and follows the pool again after `windows` in a
    row below `threshold / 2` (hysteresis: a member near the line does not flap)."""

    threshold: float = 0.05
    windows: int = 3

    def validate(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"divergence threshold must be in (0, 1), got {self.threshold}")
        if self.windows < 1:
            raise ValueError(f"divergence windows must be >= 1, got {self.windows}")


def sampling_tv(p: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Expected total variation between an empirical distribution of `picks` multinomial
    draws from `p` [L, E] and `p` itself, per layer (normal approximation of each count:
    E|X - np| = sqrt(2 n p (1-p) / pi))."""
    n = np.maximum(picks, 1.0)
    return 0.5 * np.sqrt(2.0 / (math.pi * n)) * np.sqrt(p * (1.0 - p)).sum(axis=1)


@dataclass(frozen=True)
class Expected:
    """The pool's reference as the test reads it: per layer the routed-count distribution
    `p` [L, E] (zeros on a layer without load), whether the layer has load `loaded` [L],
    and `spread` [L] = sum over experts of sqrt(p (1 - p)), what `sampling_tv` scales."""

    p: np.ndarray
    loaded: np.ndarray
    spread: np.ndarray


def expected_of(reference: np.ndarray) -> Expected:
    """The reference [L, E] (any positive scale per layer) normalised once for many tests."""
    mass = reference.sum(axis=1)
    loaded = mass > 0
    p = np.zeros(reference.shape, dtype=np.float64)
    p[loaded] = reference[loaded] / mass[loaded, None]
    return Expected(p, loaded, np.sqrt(p * (1.0 - p)).sum(axis=1))


def excess_tv_of(window: np.ndarray, expected: Expected, picks: np.ndarray | None = None) -> float:
    """The divergence statistic of one window [L, E] against the pool's expected
    distribution (DivergenceConfig); `picks`: the window's sums per layer [L], when the
    caller has them. NaN when either has no load on every layer. Three passes over
    [L, E]: it runs for every member window."""
    if picks is None:
        picks = window.sum(axis=1)
    layers = (picks > 0) & expected.loaded
    if layers.all():  # the usual case: no masked copies of the window and of p
        n, p, spread = picks, expected.p, expected.spread
    elif layers.any():
        n, window, p, spread = (
            picks[layers],
            window[layers],
            expected.p[layers],
            expected.spread[layers],
        )
    else:
        return float("nan")
    gap = window / n[:, None]
    gap -= p
    tv = 0.5 * np.abs(gap, out=gap).sum(axis=1)
    noise = 0.5 * np.sqrt(2.0 / (math.pi * n)) * spread
    tv -= noise
    return float(tv.sum()) / tv.size  # the mean, without np.mean's Python-level dispatch


def excess_tv(window: np.ndarray, reference: np.ndarray) -> float:
    """`excess_tv_of` against `reference` [L, E] itself (any positive scale per layer)."""
    return excess_tv_of(window, expected_of(reference))


# The pool's reference distribution for the divergence test is a decayed sum of its
# following members' windows, remembering about this many rounds of windows (one round:
# a window from each following member). Cheaper than the pool estimate (which shrinks
# and weighs), and recomputed per window, it costs ~0.1 ms at DeepSeek-V3's [58, 256].
REFERENCE_ROUNDS = 4


@dataclass
class MemberTrack:
    """A member's run of windows above (or below) the divergence line."""

    diverged: bool = False
    run: int = 0  # windows in a row on the other side of the line
    last_statistic: float = float("nan")
