"""Views of a placement and how well it balances a load.

A placement is `phy2log [L, P]`; everything else (replica counts, replica lists,
per-GPU load, balancedness) is derived from it here, so the engine, the CLI, the
controller and the tests all measure the same thing.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement.types import check_load
from rebalancer.wire.dispatch import (
    WATERFILL_DAMPING,
    WATERFILL_PASSES,
    WATERFILL_UNITS,
    check_dispatch_mode,
    check_waterfill_passes,
    waterfill_tables,
)
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


# -- balance under a dispatch mode ---------------------------------------------------------
#
# A placement fixes which GPUs hold an expert; the dispatch mode (rebalancer.wire.dispatch)
# decides how each step's tokens of the expert are divided among them. The functions below
# give a step's per-GPU loads under each mode from every rank's per-expert counts of that
# step; worker_hooks/waterfill.py runs the same water-fill in torch inside CUDA graphs (a
# test holds the two to the same allocations).


# Units a layer's average load is scaled to before `expected_gpu_loads` water-fills it.
EXPECTED_UNITS_PER_LAYER = 1 << 32


def gpu_replicas(phy2log: np.ndarray, num_logical: int, num_gpus: int) -> np.ndarray:
    """Replicas of each logical expert on each GPU.

    phy2log: [L, P] int64 (slot p on GPU p // (P / G)). Returns: [L, E, G] int64.
    """
    num_layers, num_slots = phy2log.shape
    gpu = np.arange(num_slots) // (num_slots // num_gpus)  # [P]
    out = np.zeros((num_layers, num_logical, num_gpus), dtype=np.int64)
    layer = np.repeat(np.arange(num_layers), num_slots)
    np.add.at(out, (layer, phy2log.reshape(-1), np.tile(gpu, num_layers)), 1)
    return out


def split_allocation(counts: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """Tokens each GPU computes of each expert under the hash split (`split` mode).

    1. A rank holding replicas of an expert keeps its own tokens of it.
    2. Other ranks' tokens of it spread evenly over all its replicas (the hash cycles
       consecutive tokens through them; the fractional share is its expectation).

    counts: [L, G, E] tokens each rank routed to each expert this step.
    replicas: [L, E, G] (`gpu_replicas`). Returns: [L, E, G] float64.
    """
    per_rank = np.swapaxes(counts, 1, 2).astype(np.float64)  # [L, E, G]
    local = replicas > 0
    kept = np.where(local, per_rank, 0.0)
    remote = (per_rank - kept).sum(axis=2, keepdims=True)  # [L, E, 1]
    total = np.maximum(replicas.sum(axis=2, keepdims=True), 1)
    return kept + remote * replicas / total


def split_units(counts: np.ndarray, tables: np.ndarray) -> np.ndarray:
    """`split_allocation` in water-fill units (integers, floor of the remote share).

    counts: [L, G, E] int64; tables: [L, 5, E, G] (`waterfill_tables`).
    Returns: [L, E, G] int64, WATERFILL_UNITS per token.
    """
    per_rank = np.swapaxes(counts, 1, 2).astype(np.int64)  # [L, E, G]
    kept = per_rank * tables[:, 0]
    remote = per_rank.sum(axis=2) - kept.sum(axis=2)  # [L, E]
    return kept * WATERFILL_UNITS + remote[..., None] * tables[:, 2] // tables[:, 3]


def waterfill(
    demand: np.ndarray,
    start: np.ndarray,
    far: np.ndarray,
    base: np.ndarray,
    passes: int = WATERFILL_PASSES,
    damping: Fraction = WATERFILL_DAMPING,
) -> np.ndarray:
    """Divide each expert's tokens among its GPUs to even out the per-GPU loads.

    All in integer units (rebalancer.wire.dispatch: exact, so worker_hooks/waterfill.py
    gives the same bits). A fixed number of passes, each over all experts at once:
    1. GPU loads = base + every expert's current share; `other` = the load of the
       other experts on each GPU (+ WATERFILL_FAR where the expert is not held).
    2. Each expert's water level over its GPUs: sort `other`; filling the k lowest gives
       (demand + their sum) // k; the level is min over k of max(that, k-th lowest)
       (the fill of the largest k it covers; larger k fall below their own GPU).
    3. Each expert moves `damping` of the way to that fill (all moving fully at once
       would pile onto the same idle GPU).
    4. The result is kept, per layer, only if its peak load is below `start`'s.

    demand: [L, X] units; start: [L, X, G] units summing to about demand over G;
    far: [L, X, G] (`waterfill_tables`); base: [L, G] units no expert moves.
    Returns: [L, X, G] int64 units, zero where not held.
    """
    num_gpus = far.shape[2]
    k = np.arange(1, num_gpus + 1, dtype=np.int64)
    share = start
    for _ in range(passes):
        masked = (base + share.sum(axis=1))[:, None, :] - share + far
        ordered = np.sort(masked, axis=2)
        levels = (np.cumsum(ordered, axis=2) + demand[..., None]) // k
        level = np.maximum(levels, ordered).min(axis=2)  # [L, X]
        target = np.maximum(level[..., None] - masked, 0)
        share = share + (target - share) * damping.numerator // damping.denominator
    better = (base + share.sum(axis=1)).max(axis=1) < (base + start.sum(axis=1)).max(axis=1)
    return np.where(better[:, None, None], share, start)


def round_allocation(share: np.ndarray, demand: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """Whole tokens per (expert, GPU), summing exactly to each expert's demand.

    Cumulative rounding along the GPUs: each GPU's share moves by less than one token,
    and the remainder lands on the expert's last GPU, never on a GPU that lacks it.

    share: [L, X, G] units; demand: [L, X] tokens; tail: [L, X, G] (`waterfill_tables` row 4).
    Returns: [L, X, G] int64.
    """
    cum = (np.cumsum(share, axis=2) + WATERFILL_UNITS // 2) // WATERFILL_UNITS
    cum = np.where(tail > 0, demand[..., None], np.minimum(cum, demand[..., None]))
    cum = np.maximum.accumulate(cum, axis=2)
    return np.diff(cum, axis=2, prepend=0)


def _with_shared_row(tables: np.ndarray) -> np.ndarray:
    """`waterfill_tables` with one more expert held once by every GPU (the shared one)."""
    num_layers, _, _, num_gpus = tables.shape
    row = waterfill_tables(np.ones((num_layers, 1, num_gpus), dtype=np.int64))
    return np.concatenate([tables, row], axis=2)


def dispatch_allocation(
    counts: np.ndarray,
    replicas: np.ndarray,
    mode: str,
    shared: np.ndarray | None = None,
    passes: int = WATERFILL_PASSES,
) -> np.ndarray:
    """Tokens each GPU computes of each expert in one step under a dispatch mode.

    1. split: `split_allocation`.
    2. load: water-fill every expert's step total over the GPUs holding it, starting
       from the split, with the shared expert's tokens (if any) as fixed local load.
    3. load+shared: as load, with the shared expert as expert X = E, held by every GPU,
       starting local (each rank's own tokens).

    counts: [L, G, E] tokens each rank routed to each expert; replicas: [L, E, G];
    shared: [L, G] tokens of each rank that go through the shared expert (None: the
    model has none). Returns: [L, X, G] int64 for load modes (X = E + 1 with a shared
    expert, its row last), float64 expectation for split (same rows).
    """
    check_dispatch_mode(mode)
    check_waterfill_passes(passes)
    num_layers, num_gpus, _ = counts.shape
    if mode == "split":
        split = split_allocation(counts, replicas)
        if shared is None:
            return split
        return np.concatenate([split, np.asarray(shared, dtype=np.float64)[:, None, :]], axis=1)
    counts = np.asarray(counts, dtype=np.int64)
    tables = waterfill_tables(replicas)
    start = split_units(counts, tables)
    demand = counts.sum(axis=1)  # [L, E]
    local = None if shared is None else np.rint(shared).astype(np.int64)  # [L, G]
    if mode == "load" or local is None:
        base = (
            np.zeros((num_layers, num_gpus), dtype=np.int64)
            if local is None
            else local * WATERFILL_UNITS
        )
        share = waterfill(demand * WATERFILL_UNITS, start, tables[:, 1], base, passes)
        out = round_allocation(share, demand, tables[:, 4])
        return out if local is None else np.concatenate([out, local[:, None, :]], axis=1)
    tables = _with_shared_row(tables)
    demand = np.concatenate([demand, local.sum(axis=1, keepdims=True)], axis=1)
    start = np.concatenate([start, local[:, None, :] * WATERFILL_UNITS], axis=1)
    base = np.zeros((num_layers, num_gpus), dtype=np.int64)
    share = waterfill(demand * WATERFILL_UNITS, start, tables[:, 1], base, passes)
    return round_allocation(share, demand, tables[:, 4])


def expected_gpu_loads(
    phy2log: np.ndarray,
    load: np.ndarray,
    num_gpus: int,
    mode: str,
    shared: np.ndarray | None = None,
) -> np.ndarray:
    """Per-GPU load of an average load (not one step's) under a dispatch mode: what the
    controller predicts a placement's balance with.

    1. split: each replica carries its expert's load / replicas (`gpu_load`), the shared
       expert's load spread evenly (every rank serves alike on average).
    2. load, load+shared: the water-fill of `dispatch_allocation` on the average load
       (fractional, not rounded), the shared load fixed per GPU or movable.

    phy2log: [L, P]; load: [L, E]; shared: [L] shared-expert load per layer (all ranks
    together), or None. Returns: [L, G] float64.
    """
    check_dispatch_mode(mode)
    p2l = np.asarray(phy2log, dtype=np.int64)
    load_arr = np.asarray(load, dtype=np.float64)
    num_layers, num_logical = load_arr.shape
    per_gpu_shared = np.zeros((num_layers, num_gpus))
    if shared is not None:
        per_gpu_shared = np.repeat(
            np.asarray(shared, dtype=np.float64)[:, None] / num_gpus, num_gpus, axis=1
        )
    replicas = gpu_replicas(p2l, num_logical, num_gpus)
    total = np.maximum(replicas.sum(axis=2, keepdims=True), 1)
    split = load_arr[..., None] * replicas / total  # [L, E, G]
    if mode == "split":
        return split.sum(axis=1) + per_gpu_shared
    # The water-fill is in integer units: scale each layer to EXPECTED_UNITS_PER_LAYER
    # (fine enough, far from int64's range), fill, and scale back.
    total = load_arr.sum(axis=1) + per_gpu_shared.sum(axis=1)  # [L]
    scale = np.where(total > 0, EXPECTED_UNITS_PER_LAYER / np.where(total > 0, total, 1.0), 0.0)[
        :, None
    ]
    tables = waterfill_tables(replicas)
    demand = np.rint(load_arr * scale).astype(np.int64)
    start = np.rint(split * scale[..., None]).astype(np.int64)
    base = np.rint(per_gpu_shared * scale).astype(np.int64)
    if mode == "load" or shared is None:
        share = waterfill(demand, start, tables[:, 1], base)
    else:
        tables = _with_shared_row(tables)
        demand = np.concatenate([demand, base.sum(axis=1, keepdims=True)], axis=1)
        start = np.concatenate([start, base[:, None, :]], axis=1)
        share = waterfill(demand, start, tables[:, 1], np.zeros_like(base))
        base = np.zeros_like(base)
    loads = (share.sum(axis=1) + base).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(scale > 0, loads / np.where(scale > 0, scale, 1.0), 0.0)
