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

from rebalancer.placement.metrics import balancedness, logcnt_of, pack_sums
from rebalancer.placement.migration import move_replicas, peak_load, swap_peak, swap_to_target
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

    phy2log: [L, P'] (updated in place; every expert must fit: P' >= E), load: [L, E].
    Returns: phy2log."""
    num_layers, num_slots = phy2log.shape
    num_logical = load.shape[1]
    num_gpus = num_slots // per_gpu
    rows = np.arange(num_layers)
    logcnt = logcnt_of(phy2log, num_logical)
    # a lost expert without load still needs a slot: rank it just above nothing
    urgency = load + 1e-9 * (load.max(axis=1, keepdims=True) + 1)
    for _ in range(num_logical):
        lost = logcnt == 0
        if not lost.any():
            break
        act = lost.any(axis=1)
        taker = np.where(lost, urgency, -1.0).argmax(axis=1)
        spare = np.where(logcnt >= 2, load / np.maximum(logcnt - 1, 1), np.inf)
        giver = spare.argmin(axis=1)
        layer, taker, giver = rows[act], taker[act], giver[act]
        p2l = phy2log[layer]
        share = load[layer] / np.maximum(logcnt[layer], 1)
        gpu = pack_sums(gather(share, p2l), num_gpus)  # [l, G]
        slot_gpu = np.arange(num_slots) // per_gpu
        score = np.where(p2l == giver[:, None], gpu[:, slot_gpu], np.inf)
        slot = score.argmin(axis=1)
        phy2log[layer, slot] = taker
        logcnt[layer, giver] -= 1
        logcnt[layer, taker] += 1
    return phy2log


def survivor_placement(
    load: np.ndarray, phy2log: np.ndarray, num_gpus: int, lost: tuple[int, ...],
    goal: float | None = None, gap: float = 0.01,
) -> SurvivorPlan:
    """The planned placement on the survivors of losing GPUs `lost` (module docstring).

    load: [L, E] the current estimate, phy2log: [L, P] the placement in use. goal: the
    balancedness to aim for (default: the current placement's on `load`), less `gap`."""
    return survivor_placements(load, phy2log, num_gpus, [tuple(lost)], goal, gap)[0]


def survivor_placements(
    load: np.ndarray, phy2log: np.ndarray, num_gpus: int, losses: list[tuple[int, ...]],
    goal: float | None = None, gap: float = 0.01,
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
        for lost, plan in zip(batch, _plan_batch(load, phy2log, num_gpus, batch, aim, gap), strict=True):
            plans[lost] = plan
    return [plans[tuple(lost)] for lost in losses]


def _plan_batch(
    load: np.ndarray, phy2log: np.ndarray, num_gpus: int, batch: list[tuple[int, ...]],
    aim: float, gap: float,
) -> list[SurvivorPlan]:
    """Plans for losses of the same number of GPUs, planned as one stack of layers."""
    num_layers, num_slots = phy2log.shape
    num_logical = load.shape[1]
    per_gpu = num_slots // num_gpus
    survivors = num_gpus - len(batch[0])
    kept = np.concatenate([phy2log[:, surviving_slots(num_slots, num_gpus, lost)] for lost in batch])
    kept = np.ascontiguousarray(kept, dtype=np.int64)
    stacked = np.tile(load, (len(batch), 1))                        # [K * L, E]
    held = (logcnt_of(kept, num_logical) > 0).reshape(len(batch), num_layers, num_logical)
    from_storage = (~held).sum(axis=(1, 2))
    if kept.shape[1] < num_logical:
        short = num_logical - kept.shape[1]
        return [SurvivorPlan(lost, None, float("nan"), 0, int(n), short)
                for lost, n in zip(batch, from_storage, strict=True)]
    rehomed = rehome_lost(kept.copy(), stacked, per_gpu)
    new = rehomed.copy()
    # even out what the lost GPUs carried, toward the balance the group had
    mean = stacked.sum(axis=1) / survivors
    loaded = mean > 0
    target = np.where(loaded, mean / max(aim - gap, 1e-3), np.inf)
    quota = np.full(new.shape[0], int(REFINE_SHARE * per_gpu) + 1, dtype=np.int64)
    move_replicas(new, kept, stacked, np.where(loaded, REPLICA_SHARE * target, np.inf), quota, per_gpu)
    swap_to_target(new, kept, stacked, target, quota, per_gpu)
    swap_peak(new, kept, stacked, target, quota, per_gpu)
    worse = peak_load(new, stacked, survivors) > peak_load(rehomed, stacked, survivors)
    new[worse] = rehomed[worse]  # never worse than the re-homing alone
    plans = []
    for k, lost in enumerate(batch):
        rows = slice(k * num_layers, (k + 1) * num_layers)
        plans.append(SurvivorPlan(lost, new[rows], balancedness(new[rows], load, survivors),
                                  int((new[rows] != kept[rows]).sum()), int(from_storage[k]), 0))
    return plans


def repair_placement(phy2log: np.ndarray, num_gpus: int, lost: tuple[int, ...], num_logical: int) -> np.ndarray | None:
    """The >= 1-replica repair an engine improvises (vLLM's fault-tolerance path): each
    expert no survivor holds takes, round-robin over the survivors, a slot of a replicated
    expert; no balancing. The baseline of `survivor_placement`. [L, P'] or None."""
    kept = np.ascontiguousarray(phy2log[:, surviving_slots(phy2log.shape[1], num_gpus, lost)],
                                dtype=np.int64).copy()
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
