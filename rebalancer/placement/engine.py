"""The one entry point the controller calls: load in, placement and its quality out.

It validates, picks the algorithm, and wraps the result with what the caller needs to
decide and to ship (replica lists, balancedness, moved fraction).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement.balanced import pack_balanced
from rebalancer.placement.bounds import max_load_lower_bound
from rebalancer.placement.greedy import pack_greedy_slots, replicate_greedy
from rebalancer.placement.hierarchical import place, uses_hierarchy
from rebalancer.placement.metrics import (
    logcnt_of,
    mean_balancedness,
    pack_sums,
    replica_load,
)
from rebalancer.placement.migration import migrate, peak_load
from rebalancer.placement.reference import reference_placement
from rebalancer.placement.types import (
    PlacementResult,
    check_fraction,
    check_layout,
    check_load,
    check_phy2log,
)

ALGORITHMS = ("auto", "greedy", "balanced", "migration", "reference")


PlaceRows = Callable[..., np.ndarray]


def _loaded_rows(load: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray | slice | None]:
    """The contiguous placement of every layer [L, P], to overwrite on the layers with
    load: their indices, a slice when they are one run (a view of the load, no copy), or
    None when no layer has load."""
    loaded = np.flatnonzero(load.sum(axis=1) > 0)
    out = np.empty((load.shape[0], num_slots), dtype=np.int64)
    out[:] = np.arange(num_slots, dtype=np.int64) % load.shape[1]
    if loaded.size == 0:
        return out, None
    if loaded[-1] - loaded[0] + 1 == loaded.size:
        # one run of layers (dense layers first, as in DeepSeek-V3)
        return out, slice(int(loaded[0]), int(loaded[-1]) + 1)
    return out, loaded


def _loaded_rows_only(place_rows: PlaceRows) -> PlaceRows:
    """Run a placement function on the layers with load only; layers without load (dense
    layers) get the contiguous placement."""

    @functools.wraps(place_rows)
    def wrapped(
        load: np.ndarray, num_slots: int, num_gpus: int, num_nodes: int = 1,
        num_groups: int | None = None, **options: float,
    ) -> np.ndarray:
        out, rows = _loaded_rows(load, num_slots)
        if rows is not None:
            out[rows] = place_rows(
                load[rows], num_slots, num_gpus, num_nodes, num_groups, **options
            )
        return out

    return wrapped


def _replicate_uncapped(
    weight: np.ndarray, num_phy: int, num_packs: int
) -> tuple[np.ndarray, np.ndarray]:
    """The reference's replication: no cap on replicas per expert."""
    return replicate_greedy(weight, num_phy)


def _replicate_capped(
    weight: np.ndarray, num_phy: int, num_packs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy replication with at most one replica per GPU where the slots allow it."""
    return replicate_greedy(weight, num_phy, max_count=num_packs)


@_loaded_rows_only
def greedy_placement(
    load: np.ndarray, num_slots: int, num_gpus: int, num_nodes: int = 1,
    num_groups: int | None = None,
) -> np.ndarray:
    """DeepSeek's greedy, vectorised. load: [L, E]. Returns: phy2log [L, P]."""
    return place(
        load, num_slots, num_gpus, num_nodes, num_groups, _replicate_uncapped, pack_greedy_slots
    )


def balanced_placement(
    load: np.ndarray, num_slots: int, num_gpus: int, num_nodes: int = 1,
    num_groups: int | None = None, greedy_check_items: int = 64,
    greedy_check_gap: float = 0.01,
) -> np.ndarray:
    """Capped greedy replication, round packing and swaps, checked against the greedy.

    The greedy is run too, and a layer keeps whichever placement is better, on every
    layer whose peak is more than `greedy_check_gap` above the lower bound, and on all
    layers when a packing row has at most `greedy_check_items` replicas. A layer within
    the gap of the bound is within the gap of anything the greedy can reach. With two
    slots per GPU and no replica cap in force the packing is the optimal pairing of the
    greedy's own replicas, so the check is skipped. Layers without load get the
    contiguous placement.

    load: [L, E]. Returns: phy2log [L, P].
    """
    return _balanced_and_peak(
        load, num_slots, num_gpus, num_nodes, num_groups, greedy_check_items, greedy_check_gap
    )[0]


def _balanced_and_peak(
    load: np.ndarray, num_slots: int, num_gpus: int, num_nodes: int = 1,
    num_groups: int | None = None, greedy_check_items: int = 64,
    greedy_check_gap: float = 0.01,
) -> tuple[np.ndarray, np.ndarray]:
    """`balanced_placement` and its max GPU load per layer (0 without load), which the
    greedy check computes anyway and the result's balancedness needs.

    load: [L, E]. Returns: phy2log [L, P], peak [L].
    """
    phy2log, rows = _loaded_rows(load, num_slots)
    peak = np.zeros(len(load))
    if rows is not None:
        phy2log[rows], peak[rows] = _balanced_rows(
            load[rows], num_slots, num_gpus, num_nodes, num_groups, greedy_check_items,
            greedy_check_gap,
        )
    return phy2log, peak


def _balanced_rows(
    load: np.ndarray, num_slots: int, num_gpus: int, num_nodes: int, num_groups: int | None,
    greedy_check_items: int, greedy_check_gap: float,
) -> tuple[np.ndarray, np.ndarray]:
    """`_balanced_and_peak` on layers that all have load."""
    phy2log = place(
        load, num_slots, num_gpus, num_nodes, num_groups, _replicate_capped, pack_balanced
    )
    nodes = num_nodes if uses_hierarchy(load.shape[1], num_nodes, num_groups) else 1
    gpus_per_node = num_gpus // nodes
    peak = peak_load(phy2log, load, num_gpus)
    if num_slots // nodes <= greedy_check_items:
        check = np.ones(len(load), dtype=bool)
    elif num_slots // num_gpus <= 2 and logcnt_of(phy2log, load.shape[1]).max() < gpus_per_node:
        check = np.zeros(len(load), dtype=bool)
    else:
        # the cheap terms of the bound first: a layer within the gap of them is within the
        # gap of the full bound, so only the others pay for the bound's replication
        cheap = max_load_lower_bound(
            load, num_slots, num_gpus, num_nodes, num_groups, replication=False
        )
        check = peak > cheap * (1 + greedy_check_gap)
        if check.any():
            bound = max_load_lower_bound(load[check], num_slots, num_gpus, num_nodes, num_groups)
            check[check] = peak[check] > bound * (1 + greedy_check_gap)
    if check.any():
        greedy = place(
            load[check], num_slots, num_gpus, num_nodes, num_groups, _replicate_uncapped,
            pack_greedy_slots,
        )
        greedy_peak = peak_load(greedy, load[check], num_gpus)
        better = greedy_peak < peak[check]
        rows = np.flatnonzero(check)[better]
        phy2log[rows] = greedy[better]
        peak[rows] = greedy_peak[better]
    return phy2log, peak


def compute_placement(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    previous: np.ndarray | None = None,
    max_moved_fraction: float | None = None,
    algorithm: str = "auto",
    max_moved_bytes: int | None = None,
    expert_bytes: int | None = None,
) -> PlacementResult:
    """Place P slots of E experts on G GPUs (N nodes) for the given load.

    load: [L, E] float or int, non-negative; rows of zeros (dense layers) get any valid
    placement. previous: [L, P] current placement, enables migration-aware planning and
    `moved_fraction`. max_moved_bytes / expert_bytes: a budget in bytes (each changed
    slot ships one expert's weights), combined with max_moved_fraction (the smaller
    wins). max_moved_fraction: at most this share of all slots may change
    (needs `previous`). algorithm: "auto" (balanced, or migration with `previous`),
    "greedy", "balanced", "migration" or "reference" (the slow per-item port).
    """
    # 1. validate everything before doing anything
    load_arr = check_load(load)
    num_layers, num_logical = load_arr.shape
    check_layout(num_logical, num_slots, num_gpus, num_nodes)
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
            raise InputError(f"num_groups must be a positive integer, got {num_groups!r}")
        if num_groups <= 0 or num_logical % num_groups:
            raise InputError(
                f"groups ({num_groups}) must be positive and divide the experts ({num_logical})"
            )
    budget = check_fraction(max_moved_fraction)
    if (max_moved_bytes is None) != (expert_bytes is None):
        raise InputError("max_moved_bytes and expert_bytes go together")
    if max_moved_bytes is not None and expert_bytes is not None:
        for name, value in (("max_moved_bytes", max_moved_bytes), ("expert_bytes", expert_bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise InputError(f"{name} must be a non-negative integer, got {value!r}")
        if expert_bytes == 0:
            raise InputError("expert_bytes must be positive")
    byte_slots = None
    if max_moved_bytes is not None and expert_bytes is not None:
        byte_slots = int(max_moved_bytes) // int(expert_bytes)
    if algorithm not in ALGORITHMS:
        raise InputError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    old = None
    if previous is not None:
        old = check_phy2log(previous, num_logical, name="previous placement")
        if old.shape != (num_layers, num_slots):
            raise InputError(
                f"previous placement has shape {old.shape}, expected {(num_layers, num_slots)}"
            )
    if algorithm == "migration" and old is None:
        raise InputError("algorithm 'migration' needs a previous placement")
    limited = budget is not None or byte_slots is not None
    if limited and old is not None and algorithm not in ("auto", "migration"):
        raise InputError(f"a move budget needs algorithm 'auto' or 'migration', not {algorithm!r}")
    if algorithm == "auto":
        algorithm = "migration" if old is not None else "balanced"
    # 2. compute
    peak = None
    if algorithm == "greedy":
        phy2log = greedy_placement(load_arr, num_slots, num_gpus, num_nodes, num_groups)
    elif algorithm == "reference":
        phy2log = reference_placement(load_arr, num_slots, num_gpus, num_nodes, num_groups)
    elif algorithm == "balanced":
        phy2log, peak = _balanced_and_peak(load_arr, num_slots, num_gpus, num_nodes, num_groups)
    else:
        assert old is not None
        fresh = balanced_placement(load_arr, num_slots, num_gpus, num_nodes, num_groups)
        budget_slots = None if budget is None else int(np.floor(budget * old.size + 1e-9))
        if byte_slots is not None:
            budget_slots = byte_slots if budget_slots is None else min(budget_slots, byte_slots)
        phy2log = migrate(load_arr, old, fresh, num_gpus, budget_slots)
    return finish(phy2log, load_arr, num_gpus, num_nodes, old, algorithm, peak)


def finish(
    phy2log: np.ndarray,
    load: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    previous: np.ndarray | None,
    algorithm: str,
    peak: np.ndarray | None = None,
) -> PlacementResult:
    """Wrap a placement with its derived maps and figures.

    peak: [L] the placement's max GPU load per layer, when already known.
    """
    num_logical = load.shape[1]
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    logcnt = logcnt_of(phy2log, num_logical)
    if peak is None:
        peak = pack_sums(replica_load(phy2log, load, logcnt), num_gpus).max(axis=1)
    # balancedness per layer: the mean GPU load over the peak (NaN without load)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = np.where(peak > 0, load.sum(axis=1) / num_gpus / peak, np.nan)
    return PlacementResult(
        phy2log=phy2log,
        logcnt=logcnt,
        balancedness=mean_balancedness(per_layer),
        moved_fraction=0.0 if previous is None else float(np.mean(previous != phy2log)),
        algorithm=algorithm,
        num_gpus=num_gpus,
        num_nodes=num_nodes,
    )
