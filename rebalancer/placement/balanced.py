"""The improved packing: whole rounds of replicas at once, then pairwise swaps.

The greedy places one replica per step, which cannot be fast in numpy. Here round r
hands the r-th heaviest batch of k replicas to the k GPUs, heaviest replica to the
lightest GPU, for every layer at once; then swaps between the busiest GPU and any other
lower the peak until no swap helps. Swaps never put two replicas of an expert on one GPU
(unless an expert has more replicas than there are GPUs).
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.greedy import slots_from_packs


def pack_rounds(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Round-by-round packing: in each round every pack gets one item, the heaviest
    item of the round going to the currently lightest pack.

    weight: [X, n] with n % num_packs == 0. Returns: pack of each item [X, n] int64.
    """
    num_rows, num_items = weight.shape
    order = np.argsort(-weight, axis=1, kind="stable")
    sorted_weight = np.take_along_axis(weight, order, axis=1)
    rows = np.arange(num_rows)[:, None]
    pack_load = np.zeros((num_rows, num_packs))
    pack_of = np.empty((num_rows, num_items), dtype=np.int64)
    for start in range(0, num_items, num_packs):
        lightest_first = np.argsort(pack_load, axis=1, kind="stable")
        pack_of[rows, order[:, start : start + num_packs]] = lightest_first
        pack_load[rows, lightest_first] += sorted_weight[:, start : start + num_packs]
    return pack_of


def refine_swaps(
    slot_weight: np.ndarray,
    slot_expert: np.ndarray,
    num_packs: int,
    max_rounds: int = 200,
    num_experts: int | None = None,
) -> np.ndarray:
    """Lower each row's busiest pack by swapping one of its items with an item of another
    pack, the swap that leaves the lower peak of the two, until no swap helps.

    slot_weight: [X, n] item weight by slot, pack k owning slots [k*c, (k+1)*c);
    slot_expert: [X, n] expert id of each slot (no swap may duplicate one on a pack).
    Returns: permutation [X, n]: new slot s takes the item of old slot perm[s].
    """
    num_rows, num_items = slot_weight.shape
    per_pack = num_items // num_packs
    width = int(slot_expert.max()) + 1 if num_experts is None else num_experts
    perm = np.tile(np.arange(num_items, dtype=np.int64), (num_rows, 1))
    if per_pack == num_items:
        return perm
    weight = slot_weight.copy()
    expert = slot_expert.copy()
    pack_of_slot = np.arange(num_items) // per_pack
    rows_all = np.arange(num_rows)
    presence = np.zeros((num_rows, num_packs, width), dtype=np.int32)
    np.add.at(presence, (rows_all[:, None], pack_of_slot[None, :], expert), 1)
    load = weight.reshape(num_rows, num_packs, per_pack).sum(axis=2)
    active = rows_all
    for _ in range(max_rounds):
        if active.size == 0:
            break
        rows = active
        sub_load = load[rows]
        peak_pack = sub_load.argmax(axis=1)
        peak = sub_load[np.arange(rows.size), peak_pack]
        # 1. items on the busiest pack [A, c] against every item [A, n]
        own_slots = peak_pack[:, None] * per_pack + np.arange(per_pack)
        own_weight = np.take_along_axis(weight[rows], own_slots, axis=1)
        own_expert = np.take_along_axis(expert[rows], own_slots, axis=1)
        delta = own_weight[:, :, None] - weight[rows][:, None, :]
        other_load = sub_load[np.arange(rows.size)[:, None], pack_of_slot[None, :]]
        new_peak = np.maximum(peak[:, None, None] - delta, other_load[:, None, :] + delta)
        # 2. a swap must move load off the peak, onto another pack, without duplicates
        other_expert = expert[rows]
        dup_here = presence[rows[:, None], peak_pack[:, None], other_expert] > 0
        dup_there = (
            presence[rows[:, None, None], pack_of_slot[None, None, :], own_expert[:, :, None]] > 0
        )
        same = own_expert[:, :, None] == other_expert[:, None, :]
        allowed = (
            (delta > 0)
            & (pack_of_slot[None, None, :] != peak_pack[:, None, None])
            & ~dup_here[:, None, :]
            & ~dup_there
            & ~same
        )
        new_peak = np.where(allowed, new_peak, np.inf).reshape(rows.size, -1)
        best = new_peak.argmin(axis=1)
        gain = peak - new_peak[np.arange(rows.size), best]
        improves = gain > 1e-12 * np.maximum(peak, 1e-300)
        if not improves.any():
            break
        rows = rows[improves]
        best = best[improves]
        own = own_slots[improves, best // num_items]
        other = best % num_items
        _swap(weight, expert, perm, presence, load, rows, own, other, per_pack)
        active = rows
    return perm


def _swap(
    weight: np.ndarray,
    expert: np.ndarray,
    perm: np.ndarray,
    presence: np.ndarray,
    load: np.ndarray,
    rows: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    per_pack: int,
) -> None:
    """Exchange slots a and b of each row in place, keeping load and presence current."""
    pack_a, pack_b = a // per_pack, b // per_pack
    wa, wb = weight[rows, a], weight[rows, b]
    ea, eb = expert[rows, a], expert[rows, b]
    load[rows, pack_a] += wb - wa
    load[rows, pack_b] += wa - wb
    presence[rows, pack_a, ea] -= 1
    presence[rows, pack_a, eb] += 1
    presence[rows, pack_b, eb] -= 1
    presence[rows, pack_b, ea] += 1
    weight[rows, a], weight[rows, b] = wb, wa
    expert[rows, a], expert[rows, b] = eb, ea
    pa, pb = perm[rows, a], perm[rows, b]
    perm[rows, a], perm[rows, b] = pb, pa


def pack_balanced(
    weight: np.ndarray, num_packs: int, item_expert: np.ndarray, max_rounds: int = 200
) -> np.ndarray:
    """Round packing refined by swaps.

    weight: [X, n] replica loads, item_expert: [X, n] expert of each replica.
    Returns: pack of each item [X, n] int64.
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == num_items:
        return np.zeros((num_rows, num_items), dtype=np.int64)
    # 1. rounds, then lay items out by slot
    slot = slots_from_packs(pack_rounds(weight, num_packs), num_packs)
    item_at = np.empty_like(slot)
    np.put_along_axis(item_at, slot, np.arange(num_items)[None, :].repeat(num_rows, 0), axis=1)
    slot_weight = np.take_along_axis(weight, item_at, axis=1)
    slot_expert = np.take_along_axis(item_expert, item_at, axis=1)
    # 2. swaps, then read the pack of every item back
    perm = refine_swaps(slot_weight, slot_expert, num_packs, max_rounds)
    final_item_at = np.take_along_axis(item_at, perm, axis=1)
    pack_of = np.empty_like(slot)
    np.put_along_axis(
        pack_of, final_item_at, (np.arange(num_items) // per_pack)[None, :].repeat(num_rows, 0),
        axis=1,
    )
    return pack_of
