"""Views of a placement and how well it balances a load.

A placement is `phy2log [L, P]`; everything else (replica counts, replica lists,
per-GPU load, balancedness) is derived from it here, so the engine, the CLI, the
controller and the tests all measure the same thing.
"""

from __future__ import annotations

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement.types import check_load
from rebalancer.wire.layout import (  # noqa: F401  (re-exported: the placement API)
    check_layout,
    check_phy2log,
    gather,
    log2phy_of,
    logcnt_of,
    trivial_placement,
)


def pack_sums(values: np.ndarray, num_packs: int) -> np.ndarray:
    """Sum of each pack's run of values (pack k owns columns [k*c, (k+1)*c)).

    A product with a vector of ones: numpy's sum over a short last axis loops per pack
    and is up to 20 times slower at two or nine slots per GPU.

    values: [X, n] float64 with n % num_packs == 0. Returns: [X, num_packs] float64.
    """
    num_rows, width = values.shape
    per_pack = width // num_packs
    flat = np.ascontiguousarray(values, dtype=np.float64).reshape(num_rows * num_packs, per_pack)
    return (flat @ np.ones(per_pack)).reshape(num_rows, num_packs)


def argsort_rows(values: np.ndarray, descending: bool = False) -> np.ndarray:
    """Column order of each row by value, ties by column index, via one `np.sort`.

    The bits of a non-negative float64 order like the float; with the column index in
    the low bits, one sort of int64 keys (SIMD in numpy, several times faster than
    argsort) gives the order. Values closer than 2^-(52-b) relative, b = bits of the
    column index, count as ties.

    values: [X, n] non-negative finite floats. Returns: [X, n] int64.
    """
    num_cols = values.shape[1]
    bits = max(1, (num_cols - 1).bit_length())
    low = (1 << bits) - 1
    keys = np.ascontiguousarray(values, dtype=np.float64).view(np.int64)
    # clear the sign (a -0.0 sorts as 0.0) and the low bits, which take the index
    keys = keys & np.int64(0x7FFF_FFFF_FFFF_FFFF ^ low)
    if descending:
        np.negative(keys, out=keys)
    keys |= np.arange(num_cols, dtype=np.int64)
    keys.sort(axis=1)
    keys &= low
    return keys


def rows_cols(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.nonzero` of a 2-D mask through the flat one, which numpy does ~10x faster.

    mask: [X, n] bool. Returns: row, column [K] int64, in row-major order.
    """
    return np.divmod(np.flatnonzero(mask), mask.shape[1])




def replica_load(
    phy2log: np.ndarray, load: np.ndarray, logcnt: np.ndarray | None = None
) -> np.ndarray:
    """Load carried by each physical slot: its expert's load over its replica count.

    phy2log: [L, P], load: [L, E], logcnt: [L, E] if already known. Returns: [L, P].
    """
    if logcnt is None:
        logcnt = logcnt_of(phy2log, load.shape[1])
    per_replica = load / np.maximum(logcnt, 1)
    return gather(per_replica, phy2log)


def _checked(phy2log: object, load: object, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    load_arr = check_load(load)
    p2l = check_phy2log(phy2log, load_arr.shape[1])
    if p2l.shape[0] != load_arr.shape[0]:
        raise InputError(
            f"placement has {p2l.shape[0]} layers but the load has {load_arr.shape[0]}"
        )
    check_layout(load_arr.shape[1], p2l.shape[1], num_gpus)
    return p2l, load_arr


def gpu_load(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Load of every GPU (a replica carries its expert's load / replica count).

    phy2log: [L, P], load: [L, E]. Returns: [L, G] float64.
    """
    p2l, load_arr = _checked(phy2log, load, num_gpus)
    per_slot = replica_load(p2l, load_arr)
    return pack_sums(per_slot, num_gpus)


def balancedness_per_layer(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Mean GPU load over max GPU load, per layer; NaN for a layer without load.

    phy2log: [L, P], load: [L, E]. Returns: [L] float64.
    """
    p2l, load_arr = _checked(phy2log, load, num_gpus)
    return balancedness_of(p2l, load_arr, num_gpus)


def balancedness_of(
    phy2log: np.ndarray, load: np.ndarray, num_gpus: int, logcnt: np.ndarray | None = None
) -> np.ndarray:
    """`balancedness_per_layer` without input checks, for the engine's own placements.

    phy2log: [L, P] int64, load: [L, E] float64, logcnt: [L, E] if known. Returns: [L].
    """
    per_slot = replica_load(phy2log, load, logcnt)
    return balancedness_of_gpu_loads(pack_sums(per_slot, num_gpus))


def balancedness_of_gpu_loads(loads: np.ndarray) -> np.ndarray:
    """Mean GPU load over max GPU load, per layer, of loads already summed per GPU (as
    measured on the GPUs, or `gpu_load`); NaN for a layer without load.

    loads: [L, G] float64. Returns: [L] float64.
    """
    peak = loads.max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(peak > 0, loads.mean(axis=1) / peak, np.nan)


def balancedness(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> float:
    """Balancedness averaged over layers with non-zero load (1.0 when none has load).

    phy2log: [L, P], load: [L, E].
    """
    return mean_balancedness(balancedness_per_layer(phy2log, load, num_gpus))


def mean_balancedness(per_layer: np.ndarray) -> float:
    """Average of per-layer balancedness, skipping NaN (layers without load)."""
    valid = per_layer[~np.isnan(per_layer)]
    return float(valid.mean()) if valid.size else 1.0


def moved_fraction(old: np.ndarray, new: np.ndarray) -> float:
    """Share of slots whose logical expert differs between two placements.

    old, new: [L, P].
    """
    old_arr = check_phy2log(old, name="old placement")
    new_arr = check_phy2log(new, name="new placement")
    if old_arr.shape != new_arr.shape:
        raise InputError(f"placements differ in shape: {old_arr.shape} vs {new_arr.shape}")
    return float(np.mean(old_arr != new_arr))
