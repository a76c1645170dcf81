"""The result type of the placement engine and the input checks its entry points share.

Validation lives here so that every public function refuses bad input the same way:
an `InputError` with one line naming the argument and what is wrong with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rebalancer.errors import InputError
from rebalancer.wire.layout import check_layout, check_phy2log  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class PlacementResult:
    """A placement of physical expert slots, with what it achieves.

    phy2log: [L, P] int64, the logical expert held by each physical slot
        (slot p lives on GPU p // (P / G)).
    logcnt: [L, E] int64, replicas per logical expert.
    log2phy: [L, E, R] int64, replica slots of each expert, -1 padded.
    balancedness: mean/max GPU load averaged over layers with load, on the input load.
    moved_fraction: share of slots whose expert differs from `previous` (0 without it).
    algorithm: the algorithm that produced it.
    """

    phy2log: np.ndarray
    logcnt: np.ndarray
    balancedness: float
    moved_fraction: float
    algorithm: str
    num_gpus: int
    num_nodes: int

    @functools.cached_property
    def log2phy(self) -> np.ndarray:
        """[L, E, R] replica slots of each expert, -1 padded; built on first use (the
        controller ships phy2log, so most callers never need it)."""
        from rebalancer.wire.layout import log2phy_of

        return log2phy_of(self.phy2log, self.logcnt.shape[1], logcnt=self.logcnt)


def check_load(load: object) -> np.ndarray:
    """Return load as a float64 [L, E] array, or raise InputError.

    load: [L, E], non-negative finite numbers.
    """
    arr = np.asarray(load)
    if arr.ndim != 2:
        raise InputError(f"load must be 2-D [layers, experts], got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"load must have at least one layer and one expert, got {arr.shape}")
    if arr.dtype.kind not in "iufb":
        raise InputError(f"load must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all():
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise InputError(f"load has a NaN or infinite value at layer {bad[0]}, expert {bad[1]}")
    if (arr < 0).any():
        bad = np.argwhere(arr < 0)[0]
        raise InputError(f"load has a negative value at layer {bad[0]}, expert {bad[1]}")
    return arr


def check_fraction(value: float | None, name: str = "max_moved_fraction") -> float | None:
    """Return value unless it is outside [0, 1] or not a number."""
    if value is None:
        return None
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number in [0, 1], got {value!r}") from None
    if not np.isfinite(fraction) or fraction < 0 or fraction > 1:
        raise InputError(f"{name} must be in [0, 1], got {value!r}")
    return fraction
