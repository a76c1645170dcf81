"""Survivor placements: where the experts go when some GPUs of the group are lost.

Planned ahead (the controller keeps one for every single-rank and single-node loss), so
the engine's own recovery path can take it at the worst moment instead of improvising.
The survivors keep their slots in order (new rank i is the i-th surviving old rank, as
vLLM's `rank_mapping` and SGLang's active ranks number them), so a plan starts from
`phy2log[:, surviving slots]`:

1. every expert that lost its last replica is re-homed (`rehome_lost`), heaviest first,
   into a slot of the expert that can best spare a replica, on the lightest GPU among
   that expert's replicas; an expert no survivor holds is counted: its weights come from
   storage, not from a peer.
2. the busiest GPUs are then evened out by replica swaps and moves toward a target
   (`placement.migration`), within a small budget of slots, so experts already on the
   survivors stay unless a move pays.

With fewer surviving slots than experts no placement can serve them all: the plan says
how many experts are left without a slot and holds no placement.
Shapes: load [L, E], phy2log [L, P]; the plan's map is [L, P'] with P' = P / G * G'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rebalancer.placement.metrics import (
    balancedness,
    balancedness_of_gpu_loads,
    logcnt_of,
    mean_balancedness,
    pack_sums,
    replica_load,
    rows_cols,
)
from rebalancer.placement.migration import move_replicas, swap_peak, swap_to_target
from rebalancer.wire.layout import gather

# Slots a plan may change per layer beyond the re-homed ones, as a share of the slots a
# GPU holds: enough to even out what the lost GPU carried, far from a refit.
REFINE_SHARE = 5.0
# An expert gets a replica from others only while its load per replica is above this
# share of a GPU's target load (as placement.migration's replica_share).
REPLICA_SHARE = 0.5


@dataclass(frozen=True)
class SurvivorPlan:
    """A survivor placement for the loss of `lost` GPUs.

    phy2log: [L, P'] or None when the survivors' slots cannot hold every expert.
    balancedness: on the load it was planned for (NaN without a placement).
    slots_moved: slots whose expert differs from what the survivors hold now (the
    weights they must receive). from_storage: (layer, expert) pairs no survivor holds.
    unserved: experts per layer left without a slot (0 when a placement exists)."""

    lost: tuple[int, ...]
    phy2log: np.ndarray | None
    balancedness: float
    slots_moved: int
    from_storage: int
    unserved: int

    @property
    def feasible(self) -> bool:
        return self.phy2log is not None


def surviving_slots(num_slots: int, num_gpus: int, lost: tuple[int, ...]) -> np.ndarray:
    """Indices [P'] of the slots on surviving GPUs, in GPU order."""
    per_gpu = num_slots // num_gpus
    alive = np.ones(num_gpus, dtype=bool)
    alive[list(lost)] = False
    return (np.flatnonzero(alive)[:, None] * per_gpu + np.arange(per_gpu)).ravel()


def rehome_lost(phy2log: np.ndarray, load: np.ndarray, per_gpu: int) -> np.ndarray:
    """Give every expert without a replica one slot, taken from the expert that can best
    spare one (lowest load per replica once it has one fewer), on the lightest GPU among
    that expert's replicas; heaviest lost expert first, one per layer per step.

    Only a few experts are lost and a few can give (those with >= 2 replicas), so a step
    works on small tables of them ([L, T] takers in order, [L, R] givers) and on the rows
    of the layers still re-homing; a GPU's load is summed from per-slot loads kept up to
    date.

    phy2log: [L, P'] (updated in place; every expert must fit: P' >= E), load: [L, E].
    Returns: phy2log."""
    work = np.ascontiguousarray(phy2log, dtype=np.int64)
    phy2log[...] = _rehome(work, np.asarray(load, dtype=np.float64), per_gpu)[0]
    return phy2log


def _rehome(
    phy2log: np.ndarray,
    load: np.ndarray,
    per_gpu: int,
    logcnt: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`rehome_lost`, and the load each slot carries afterwards ([L, P'] float64).

    logcnt: [L, E] the replica counts of phy2log if known: updated in place, to the
    counts of the result. order: [L, P'] its slots grouped by expert in slot order if
    known (`_kept_order`)."""
    num_layers, num_slots = phy2log.shape
    num_logical = load.shape[1]
    logcnt = logcnt_of(phy2log, num_logical) if logcnt is None else logcnt
    num_lost = (logcnt == 0).sum(axis=1)
    slot_load = gather(load / np.maximum(logcnt, 1), phy2log)  # [L, P']
    if not num_lost.any():
        return phy2log, slot_load
    # 1. takers [L, T] in the order served: heaviest first, ties by expert; a lost expert
    #    without load still needs a slot: rank it just above nothing
    urgency = load + 1e-9 * (load.max(axis=1, keepdims=True) + 1)
    row, expert = rows_cols(logcnt == 0)
    by = np.lexsort((expert, -urgency[row, expert], row))
    takers = np.zeros((num_layers, int(num_lost.max())), dtype=np.int64)
    takers[row, _rank_in_row(row, num_lost)] = expert[by]
    # 2. givers [L, R]: experts with >= 2 replicas in expert order (argmin ties as over
    #    all experts), the load per replica each would have with one fewer
    giving = logcnt >= 2
    row, expert = rows_cols(giving)
    num_giving = giving.sum(axis=1)
    col = _rank_in_row(row, num_giving)
    givers = np.zeros((num_layers, int(num_giving.max())), dtype=np.int64)
    givers[row, col] = expert
    spare = np.full(givers.shape, np.inf)
    spare[row, col] = load[row, expert] / (logcnt[row, expert] - 1)
    # slots grouped by expert in slot order (a stable sort; radix on 16-bit keys) and
    # where each expert's run starts: a giver's slots are its run ([L, P'], [L, E])
    if order is None:
        keys = phy2log.astype(np.int16) if num_logical <= np.iinfo(np.int16).max else phy2log
        order = np.argsort(keys, axis=1, kind="stable")
    order = order.reshape(-1)
    start = (np.cumsum(logcnt, axis=1) - logcnt).reshape(-1)
    held = logcnt.reshape(-1).copy()  # run lengths; a giver only loses slots, never gains one
    width = np.arange(int(logcnt.max()))
    # the [L, P'] and [L, E] arrays read and written flat, at layer * P' + slot and
    # layer * E + expert (views: the writes land in phy2log, logcnt and slot_load)
    flat_map, flat_slot_load = (
        np.reshape(phy2log, -1, copy=False),
        np.reshape(slot_load, -1, copy=False),
    )
    flat_count, flat_load = np.reshape(logcnt, -1, copy=False), load.reshape(-1)
    for step in range(takers.shape[1]):
        rows = np.flatnonzero(num_lost > step)
        here = np.arange(rows.size)
        pick = spare[rows].argmin(axis=1)
        taker = rows * num_logical + takers[rows, step]  # flat
        giver = rows * num_logical + givers[rows, pick]
        first_slot = (rows * num_slots)[:, None]
        # 3. the giver's replica on the lightest GPU (first slot on ties): [l, W] its
        #    slots, those it still holds, the load of each one's GPU
        count = held[giver]
        run = width[: count.max()] < count[:, None]  # as wide as the largest run picked
        options = order[
            first_slot + start[giver][:, None] + np.where(run, width[: run.shape[1]], 0)
        ]
        holds = run & (flat_map[options + first_slot] == (giver - rows * num_logical)[:, None])
        on_gpu = flat_slot_load[
            (options // per_gpu * per_gpu + first_slot)[:, :, None] + np.arange(per_gpu)
        ]
        gpu = pack_sums(on_gpu.reshape(-1, per_gpu), 1).reshape(options.shape)
        which = np.where(holds, gpu, np.inf).argmin(axis=1)
        taken = options[here, which] + first_slot[:, 0]  # flat
        flat_map[taken] = taker - rows * num_logical
        # 4. counts, what the giver can still spare, and the per-slot loads
        left = flat_count[giver] - 1
        flat_count[giver] = left
        flat_count[taker] = 1
        giver_load = flat_load[giver]
        spare[rows, pick] = np.where(left >= 2, giver_load / np.maximum(left - 1, 1), np.inf)
        flat_slot_load[taken] = flat_load[taker]
        holds[here, which] = False
        rest, col = rows_cols(holds)
        flat_slot_load[options[rest, col] + first_slot[rest, 0]] = (giver_load / left)[rest]
    return phy2log, slot_load


def _take_rows(values: np.ndarray, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """values[rows[i], index[i, ...]] for each i, without copying the rows out.

    values: [X, n], rows: [l], index: [l, ...] integers in [0, n). Returns: [l, ...]."""
    width = values.shape[1]
    offsets = (rows * width).reshape((rows.size,) + (1,) * (index.ndim - 1))
    return np.take(values.reshape(-1), index + offsets)


def _rank_in_row(row: np.ndarray, per_row: np.ndarray) -> np.ndarray:
    """Position of each entry within its row, for entries sorted by row.

    row: [K] sorted row of each entry, per_row: [L] entries per row. Returns: [K]."""
    return np.arange(row.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)


def survivor_placement(
    load: np.ndarray,
    phy2log: np.ndarray,
    num_gpus: int,
    lost: tuple[int, ...],
    goal: float | None = None,
    gap: float = 0.01,
) -> SurvivorPlan:
    """The planned placement on the survivors of losing GPUs `lost` (module docstring).

    load: [L, E] the current estimate, phy2log: [L, P] the placement in use. goal: the
    balancedness to aim for (default: the current placement's on `load`), less `gap`."""
    return survivor_placements(load, phy2log, num_gpus, [tuple(lost)], goal, gap)[0]


def survivor_placements(
    load: np.ndarray,
    phy2log: np.ndarray,
    num_gpus: int,
    losses: list[tuple[int, ...]],
    goal: float | None = None,
    gap: float = 0.01,
) -> list[SurvivorPlan]:
    """`survivor_placement` for each loss in `losses`, in that order. Losses of as many
    GPUs are planned together, their layers stacked ([K * L, P']): the placement math is
    vectorised over layers, so 32 plans cost a few times one, not 32 times."""
    load = np.asarray(load, dtype=np.float64)
    num_layers, num_slots = phy2log.shape
    aim = balancedness(phy2log, load, num_gpus) if goal is None else goal
    plans: dict[tuple[int, ...], SurvivorPlan] = {}
    for size in sorted({len(lost) for lost in losses}):
        batch = [tuple(lost) for lost in losses if len(lost) == size]
        for lost, plan in zip(
            batch, _plan_batch(load, phy2log, num_gpus, batch, aim, gap), strict=True
        ):
            plans[lost] = plan
    return [plans[tuple(lost)] for lost in losses]


def _plan_batch(
    load: np.ndarray,
    phy2log: np.ndarray,
    num_gpus: int,
    batch: list[tuple[int, ...]],
    aim: float,
    gap: float,
) -> list[SurvivorPlan]:
    """Plans for losses of the same number of GPUs, planned as one stack of layers."""
    num_layers, num_slots = phy2log.shape
    num_logical = load.shape[1]
    per_gpu = num_slots // num_gpus
    survivors = num_gpus - len(batch[0])
    # the survivors' slots of every loss, in one gather: [K, L, P'] flat -> [K * L, P']
    cols = np.stack([surviving_slots(num_slots, num_gpus, lost) for lost in batch])  # [K, P']
    flat = np.asarray(phy2log, dtype=np.int64).reshape(-1)
    kept = flat.take((np.arange(num_layers) * num_slots)[None, :, None] + cols[:, None, :])
    kept = kept.reshape(len(batch) * num_layers, -1)
    stacked = np.tile(load, (len(batch), 1))  # [K * L, E]
    logcnt = _kept_counts(phy2log, num_gpus, batch, num_logical)  # [K * L, E]
    from_storage = (logcnt == 0).reshape(len(batch), -1).sum(axis=1)
    if kept.shape[1] < num_logical:
        short = num_logical - kept.shape[1]
        return [
            SurvivorPlan(lost, None, float("nan"), 0, int(n), short)
            for lost, n in zip(batch, from_storage, strict=True)
        ]
    order = _kept_order(phy2log, num_logical, cols) if from_storage.any() else None
    rehomed, slot_load = _rehome(kept.copy(), stacked, per_gpu, logcnt, order)
    gpu_rehomed = pack_sums(slot_load, survivors)
    new = rehomed.copy()
    # even out what the lost GPUs carried, toward the balance the group had
    mean = stacked.sum(axis=1) / survivors
    loaded = mean > 0
    target = np.where(loaded, mean / max(aim - gap, 1e-3), np.inf)
    quota = np.full(new.shape[0], int(REFINE_SHARE * per_gpu) + 1, dtype=np.int64)
    move_replicas(
        new,
        kept,
        stacked,
        np.where(loaded, REPLICA_SHARE * target, np.inf),
        quota,
        per_gpu,
        logcnt=logcnt,
    )
    given = np.flatnonzero((new != rehomed).any(axis=1))  # replica counts changed: slot loads too
    slot_load[given] = replica_load(new[given], stacked[given])
    swap_to_target(new, kept, stacked, target, quota, per_gpu, slot_load=slot_load)
    swap_peak(new, kept, stacked, target, quota, per_gpu, slot_load=slot_load)
    gpu = pack_sums(slot_load, survivors)
    worse = gpu.max(axis=1) > gpu_rehomed.max(axis=1)
    new[worse], gpu[worse] = (
        rehomed[worse],
        gpu_rehomed[worse],
    )  # never worse than the re-homing alone
    per_layer = balancedness_of_gpu_loads(gpu).reshape(len(batch), num_layers)
    moved = (new != kept).sum(axis=1).reshape(len(batch), num_layers).sum(axis=1)
    return [
        SurvivorPlan(
            lost,
            new[k * num_layers : (k + 1) * num_layers],
            mean_balancedness(per_layer[k]),
            int(moved[k]),
            int(from_storage[k]),
            0,
        )
        for k, lost in enumerate(batch)
    ]


def _kept_order(phy2log: np.ndarray, num_logical: int, cols: np.ndarray) -> np.ndarray:
    """The survivors' slots of each loss grouped by expert in slot order (what a stable
    sort of each survivors' map gives), from one sort of the whole group's map: its order
    less the lost slots, renumbered as the survivors number them.

    phy2log: [L, P], cols: [K, P'] each loss's surviving slots, ascending.
    Returns: [K * L, P'] int64."""
    num_layers, num_slots = phy2log.shape
    keys = phy2log.astype(np.int16) if num_logical <= np.iinfo(np.int16).max else phy2log
    order = np.argsort(keys, axis=1, kind="stable")  # [L, P]
    renumber = np.full((cols.shape[0], num_slots), -1, dtype=np.int64)
    np.put_along_axis(renumber, cols, np.arange(cols.shape[1]), axis=1)  # [K, P]: -1 when lost
    mapped = renumber[:, order]  # [K, L, P]
    return mapped[mapped >= 0].reshape(-1, cols.shape[1])


def _kept_counts(
    phy2log: np.ndarray, num_gpus: int, batch: list[tuple[int, ...]], num_logical: int
) -> np.ndarray:
    """Replicas per expert on the survivors of each loss: the whole group's counts, less
    those on the lost GPUs (a few slots each), instead of counting every survivor's slots.

    phy2log: [L, P]. Returns: [K * L, E] int64, loss k's layers at rows k * L onward."""
    num_layers, num_slots = phy2log.shape
    per_gpu = num_slots // num_gpus
    lost = np.array(
        [[g * per_gpu + i for g in gone for i in range(per_gpu)] for gone in batch]
    )  # [K, s]
    counts = np.tile(logcnt_of(phy2log, num_logical), (len(batch), 1))
    row = np.arange(len(batch) * num_layers).reshape(len(batch), num_layers, 1)
    where = row * num_logical + phy2log[:, lost].transpose(1, 0, 2)  # [K, L, s]
    np.subtract.at(counts.reshape(-1), where.reshape(-1), 1)
    return counts


def repair_placement(
    phy2log: np.ndarray, num_gpus: int, lost: tuple[int, ...], num_logical: int
) -> np.ndarray | None:
    """The >= 1-replica repair an engine improvises (vLLM's fault-tolerance path): each
    expert no survivor holds takes, round-robin over the survivors, a slot of a replicated
    expert; no balancing. The baseline of `survivor_placement`. [L, P'] or None."""
    kept = np.ascontiguousarray(
        phy2log[:, surviving_slots(phy2log.shape[1], num_gpus, lost)], dtype=np.int64
    ).copy()
    if kept.shape[1] < num_logical:
        return None
    per_gpu = kept.shape[1] // (num_gpus - len(lost))
    survivors = num_gpus - len(lost)
    for layer in range(kept.shape[0]):
        logcnt = np.bincount(kept[layer], minlength=num_logical)
        gpu = 0
        for expert in np.flatnonzero(logcnt == 0):
            for _ in range(survivors):  # the next survivor holding a spare replica
                slots = np.arange(gpu * per_gpu, (gpu + 1) * per_gpu)
                spare = slots[logcnt[kept[layer, slots]] >= 2]
                gpu = (gpu + 1) % survivors
                if spare.size:
                    logcnt[kept[layer, spare[0]]] -= 1
                    kept[layer, spare[0]] = expert
                    logcnt[expert] += 1
                    break
    return kept
