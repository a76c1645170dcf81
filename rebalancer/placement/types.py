"""The result type of the placement engine and the checks every entry point shares.

Validation lives here so that every public function refuses bad input the same way:
an `InputError` with one line naming the argument and what is wrong with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rebalancer.errors import InputError


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
        from rebalancer.placement.metrics import log2phy_of

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


def check_layout(num_logical: int, num_slots: int, num_gpus: int, num_nodes: int = 1) -> None:
    """Raise InputError unless E <= P, P % G == 0 and G % N == 0 (all positive)."""
    for name, value in (
        ("num_logical", num_logical),
        ("num_slots", num_slots),
        ("num_gpus", num_gpus),
        ("num_nodes", num_nodes),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if num_slots < num_logical:
        raise InputError(
            f"slots ({num_slots}) must be at least the number of logical experts ({num_logical})"
        )
    if num_slots % num_gpus:
        raise InputError(f"slots ({num_slots}) must be a multiple of GPUs ({num_gpus})")
    if num_gpus % num_nodes:
        raise InputError(f"GPUs ({num_gpus}) must be a multiple of nodes ({num_nodes})")


def check_phy2log(phy2log: object, num_logical: int | None = None, name: str = "phy2log") -> np.ndarray:
    """Return phy2log as int64 [L, P], or raise InputError.

    phy2log: [L, P] integers in [0, E); with num_logical given every expert must appear
    in every layer.
    """
    arr = np.asarray(phy2log)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{name} must be a non-empty 2-D [layers, slots] array, got {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.isfinite(arr).all() and (arr == np.round(arr)).all():
            arr = arr.astype(np.int64)
        else:
            raise InputError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if (arr < 0).any():
        raise InputError(f"{name} has a negative expert index")
    if num_logical is not None:
        if arr.max() >= num_logical:
            raise InputError(
                f"{name} refers to expert {int(arr.max())} but there are {num_logical} experts"
            )
        num_layers = arr.shape[0]
        offsets = np.arange(num_layers, dtype=np.int64)[:, None] * num_logical
        seen = np.bincount((arr + offsets).ravel(), minlength=num_layers * num_logical)
        missing = np.argwhere(seen.reshape(num_layers, num_logical) == 0)
        if len(missing):
            layer, expert = missing[0]
            raise InputError(f"{name} layer {layer} has no replica of expert {expert}")
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
