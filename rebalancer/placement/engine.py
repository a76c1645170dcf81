"""The one entry point the controller calls: load in, placement and its quality out.

It validates, picks the algorithm by name from the registry (`register_algorithm`, as
vLLM keeps its EPLB policies by name), and wraps the result with what the caller needs
to decide and to ship (replica lists, balancedness, moved fraction).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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
        load: np.ndarray,
        num_slots: int,
        num_gpus: int,
        num_nodes: int = 1,
        num_groups: int | None = None,
        **options: float,
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
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
) -> np.ndarray:
    """DeepSeek's greedy, vectorised. load: [L, E]. Returns: phy2log [L, P]."""
    return place(
        load, num_slots, num_gpus, num_nodes, num_groups, _replicate_uncapped, pack_greedy_slots
    )


def balanced_placement(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    greedy_check_items: int = 64,
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
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    greedy_check_items: int = 64,
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
            load[rows],
            num_slots,
            num_gpus,
            num_nodes,
            num_groups,
            greedy_check_items,
            greedy_check_gap,
        )
    return phy2log, peak


def _balanced_rows(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int,
    num_groups: int | None,
    greedy_check_items: int,
    greedy_check_gap: float,
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
            load[check],
            num_slots,
            num_gpus,
            num_nodes,
            num_groups,
            _replicate_uncapped,
            pack_greedy_slots,
        )
        greedy_peak = peak_load(greedy, load[check], num_gpus)
        better = greedy_peak < peak[check]
        rows = np.flatnonzero(check)[better]
        phy2log[rows] = greedy[better]
        peak[rows] = greedy_peak[better]
    return phy2log, peak


@dataclass(frozen=True)
class PlacementRequest:
    """A validated placement problem, as every registered algorithm receives it."""

    load: np.ndarray  # [L, E]
    num_slots: int
    num_gpus: int
    num_nodes: int
    num_groups: int | None
    previous: np.ndarray | None  # [L, P], the current placement
    budget_slots: int | None  # at most this many slots may change (None: any)


# An algorithm: the placement [L, P] and, when it has it anyway, its max GPU load per
# layer [L] (None: `finish` computes it).
PlaceFn = Callable[[PlacementRequest], tuple[np.ndarray, np.ndarray | None]]


@dataclass(frozen=True)
class PlacementAlgorithm:
    name: str
    place: PlaceFn
    # Plans from the previous placement (needs one) and honours a move budget; the others
    # place from scratch and refuse a budget.
    migration_aware: bool = False


_REGISTRY: dict[str, PlacementAlgorithm] = {}


def register_algorithm(name: str, *, migration_aware: bool = False) -> Callable[[PlaceFn], PlaceFn]:
    """Register `fn` under `name` for `compute_placement(algorithm=name)`."""

    def register(fn: PlaceFn) -> PlaceFn:
        if name == "auto" or name in _REGISTRY:
            raise ValueError(f"placement algorithm {name!r} is already taken")
        _REGISTRY[name] = PlacementAlgorithm(name, fn, migration_aware)
        return fn

    return register


@register_algorithm("greedy")
def _greedy(req: PlacementRequest) -> tuple[np.ndarray, np.ndarray | None]:
    return greedy_placement(
        req.load, req.num_slots, req.num_gpus, req.num_nodes, req.num_groups
    ), None


@register_algorithm("balanced")
def _balanced(req: PlacementRequest) -> tuple[np.ndarray, np.ndarray | None]:
    return _balanced_and_peak(req.load, req.num_slots, req.num_gpus, req.num_nodes, req.num_groups)


@register_algorithm("migration", migration_aware=True)
def _migration(req: PlacementRequest) -> tuple[np.ndarray, np.ndarray | None]:
    """Walk from the previous placement toward the balanced one, within the budget."""
    assert req.previous is not None
    fresh = balanced_placement(req.load, req.num_slots, req.num_gpus, req.num_nodes, req.num_groups)
    return migrate(req.load, req.previous, fresh, req.num_gpus, req.budget_slots), None


@register_algorithm("reference")
def _reference(req: PlacementRequest) -> tuple[np.ndarray, np.ndarray | None]:
    """The slow per-item port of DeepSeek's eplb.py (tests and benches compare with it)."""
    return reference_placement(
        req.load, req.num_slots, req.num_gpus, req.num_nodes, req.num_groups
    ), None


def algorithm_names() -> tuple[str, ...]:
    """The names `compute_placement` accepts: "auto" (balanced, or migration with a
    previous placement), then every registered algorithm."""
    return ("auto", *_REGISTRY)


# The product's algorithms (a test keeps the Literal and the registry equal).
AlgorithmName = Literal["auto", "greedy", "balanced", "migration", "reference"]
ALGORITHMS: tuple[str, ...] = algorithm_names()


def check_algorithm_name(name: object) -> None:
    """InputError listing the accepted names unless `name` is one of `algorithm_names()`."""
    if not isinstance(name, str) or name not in algorithm_names():
        raise InputError(
            f"unknown algorithm {name!r}; expected one of {', '.join(algorithm_names())}"
        )


def _pick_algorithm(name: str, previous: np.ndarray | None, limited: bool) -> PlacementAlgorithm:
    """The registered algorithm a checked `name` names ("auto" resolved); InputError,
    naming what is accepted, when it cannot serve this request."""
    if name == "auto":
        name = "migration" if previous is not None else "balanced"
    algorithm = _REGISTRY[name]
    if algorithm.migration_aware and previous is None:
        raise InputError(f"algorithm {name!r} needs a previous placement")
    if limited and previous is not None and not algorithm.migration_aware:
        aware = ["auto", *(a.name for a in _REGISTRY.values() if a.migration_aware)]
        raise InputError(
            f"a move budget needs algorithm {' or '.join(map(repr, aware))}, not {name!r}"
        )
    return algorithm


def compute_placement(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    previous: np.ndarray | None = None,
    max_moved_fraction: float | None = None,
    algorithm: AlgorithmName | str = "auto",
    max_moved_bytes: int | None = None,
    expert_bytes: int | None = None,
) -> PlacementResult:
    """Place P slots of E experts on G GPUs (N nodes) for the given load.

    load: [L, E] float or int, non-negative; rows of zeros (dense layers) get any valid
    placement. previous: [L, P] current placement, enables migration-aware planning and
    `moved_fraction`. max_moved_bytes / expert_bytes: a budget in bytes (each changed
    slot ships one expert's weights), combined with max_moved_fraction (the smaller
    wins). max_moved_fraction: at most this share of all slots may change
    (needs `previous`). algorithm: one of `algorithm_names()`: "auto" (balanced, or migration
    with `previous`), "greedy", "balanced", "migration" or "reference" (the slow
    per-item port).
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
    check_algorithm_name(algorithm)
    old = None
    if previous is not None:
        old = check_phy2log(previous, num_logical, name="previous placement")
        if old.shape != (num_layers, num_slots):
            raise InputError(
                f"previous placement has shape {old.shape}, expected {(num_layers, num_slots)}"
            )
    chosen = _pick_algorithm(algorithm, old, budget is not None or byte_slots is not None)
    budget_slots = None
    if chosen.migration_aware and old is not None:
        budget_slots = None if budget is None else int(np.floor(budget * old.size + 1e-9))
        if byte_slots is not None:
            budget_slots = byte_slots if budget_slots is None else min(budget_slots, byte_slots)
    # 2. compute
    request = PlacementRequest(
        load_arr, num_slots, num_gpus, num_nodes, num_groups, old, budget_slots
    )
    phy2log, peak = chosen.place(request)
    return finish(phy2log, load_arr, num_gpus, num_nodes, old, chosen.name, peak)


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
