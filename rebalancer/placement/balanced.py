"""The improved packing: whole rounds of replicas at once, then pairwise swaps.

The greedy places one replica per step, which cannot be fast in numpy. Here round r
hands the r-th heaviest batch of k replicas to the k GPUs, heaviest replica to the
lightest GPU, for every layer at once; second replicas of an expert on a GPU are then
spread out, and swaps between the heaviest and the lightest GPUs, many pairs at once,
lower the peak. No swap puts two replicas of an expert on one GPU.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.metrics import gather


def pack_rounds(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Round-by-round packing: in round r every pack gets one item, the heaviest item
    of the round going to the currently lightest pack, into the pack's r-th slot.

    weight: [X, n] with n % num_packs == 0.
    Returns: item_at [X, n] int64, the item in each slot (pack k owns slots [k*c, (k+1)*c)).
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    order = np.argsort(-weight, axis=1)
    sorted_weight = gather(weight, order)
    rows = np.arange(num_rows)[:, None]
    pack_load = np.zeros((num_rows, num_packs))
    item_at = np.empty((num_rows, num_items), dtype=np.int64)
    for r in range(per_pack):
        batch = slice(r * num_packs, (r + 1) * num_packs)
        lightest_first = np.argsort(pack_load, axis=1)
        item_at[rows, lightest_first * per_pack + r] = order[:, batch]
        pack_load[rows, lightest_first] += sorted_weight[:, batch]
    return item_at


def refine_swaps(
    slot_weight: np.ndarray,
    slot_expert: np.ndarray,
    num_packs: int,
    max_rounds: int = 8,
    max_pairs: int = 8,
) -> np.ndarray:
    """Even out packs by swapping items between heavy and light packs.

    Each round pairs the i-th heaviest pack with the i-th lightest and, in every pair at
    once, makes the one swap that lowers the pair's peak most, so the highest load only
    falls; no swap places a second replica of an expert on a pack. Stops when no pair of
    any row improves, or after max_rounds.

    slot_weight: [X, n] item weight by slot, pack k owning slots [k*c, (k+1)*c);
    slot_expert: [X, n] expert id of each slot.
    Returns: permutation [X, n]: new slot s takes the item of old slot perm[s].
    """
    num_rows, num_items = slot_weight.shape
    per_pack = num_items // num_packs
    perm = np.tile(np.arange(num_items, dtype=np.int64), (num_rows, 1))
    if num_packs == 1:
        return perm
    if per_pack <= 1:
        return perm
    num_pairs = min(max_pairs, num_packs // 2)
    weight = slot_weight.reshape(num_rows, num_packs, per_pack).copy()
    expert = slot_expert.reshape(num_rows, num_packs, per_pack).copy()
    load = weight.sum(axis=2)
    active = np.arange(num_rows)
    for _ in range(max_rounds):
        if active.size == 0:
            break
        rows = active
        everyone = rows.size == num_rows
        sub_load = load if everyone else load[rows]
        # 1. pair the i-th heaviest pack with the i-th lightest [A, m]
        order = np.argsort(sub_load, axis=1)
        heavy = order[:, : -num_pairs - 1 : -1]
        light = order[:, :num_pairs]
        by_load = gather(
            (weight if everyone else weight[rows]).reshape(rows.size, -1),
            order[:, :, None] * per_pack + np.arange(per_pack),
        )
        heavy_weight = by_load[:, : -num_pairs - 1 : -1]  # [A, m, c]
        light_weight = by_load[:, :num_pairs]
        heavy_load = heavy_weight.sum(axis=2)
        half_gap = (heavy_load - light_weight.sum(axis=2)) / 2
        # 2. swapping heavy item i with light item j (moving d = w_i - w_j) leaves the
        #    pair's peak at their mean + |d - half_gap|: it helps when that is below half_gap
        #    (searched in float32 for speed; the chosen swap is checked in float64)
        shifted = (light_weight + half_gap[:, :, None]).astype(np.float32)
        miss = heavy_weight.astype(np.float32)[:, :, :, None] - shifted[:, :, None, :]
        np.abs(miss, out=miss)
        miss = miss.reshape(rows.size, num_pairs, -1)
        best = miss.argmin(axis=2)
        moved_load = (
            gather(heavy_weight.reshape(-1, per_pack), (best // per_pack).reshape(-1, 1))
            - gather(light_weight.reshape(-1, per_pack), (best % per_pack).reshape(-1, 1))
        ).reshape(best.shape)
        improves = np.abs(moved_load - half_gap) < half_gap * (1 - 1e-9)
        row_idx, pair_idx = np.nonzero(improves)
        if row_idx.size == 0:
            break
        choice = best[row_idx, pair_idx]
        row = rows[row_idx]
        pack_a, pack_b = heavy[row_idx, pair_idx], light[row_idx, pair_idx]
        item_a, item_b = choice // per_pack, choice % per_pack
        # 3. no swap may put a second replica of an expert on either pack; the rare pair
        #    whose best swap would, takes its best clean swap instead (or none)
        expert_a = expert[row, pack_a, item_a]
        expert_b = expert[row, pack_b, item_b]
        clash = (expert[row, pack_a] == expert_b[:, None]).any(axis=1) | (
            expert[row, pack_b] == expert_a[:, None]
        ).any(axis=1)
        if clash.any():
            keep = _clean_choices(
                miss, half_gap, expert, row_idx, pair_idx, row, pack_a, pack_b, clash, choice
            )
            row_idx, pair_idx, row, pack_a, pack_b, choice = (
                x[keep] for x in (row_idx, pair_idx, row, pack_a, pack_b, choice)
            )
            item_a, item_b = choice // per_pack, choice % per_pack
            # the replacement was picked in float32: keep it only if it truly helps
            gap = half_gap[row_idx, pair_idx]
            moved_ab = heavy_weight[row_idx, pair_idx, item_a] - light_weight[row_idx, pair_idx, item_b]
            sure = np.abs(moved_ab - gap) < gap * (1 - 1e-9)
            row, pack_a, pack_b, item_a, item_b = (
                x[sure] for x in (row, pack_a, pack_b, item_a, item_b)
            )
            improves[row_idx[~sure], pair_idx[~sure]] = False
        # 4. apply every chosen swap; the pairs of a row share no pack
        flat_a = (row * num_packs + pack_a) * per_pack + item_a
        flat_b = (row * num_packs + pack_b) * per_pack + item_b
        for state in (weight.reshape(-1), expert.reshape(-1), perm):
            flat = state.reshape(-1)
            flat[flat_a], flat[flat_b] = flat[flat_b], flat[flat_a]
        moved = weight.reshape(-1)[flat_a] - weight.reshape(-1)[flat_b]
        load_flat = load.reshape(-1)
        load_flat[row * num_packs + pack_a] += moved
        load_flat[row * num_packs + pack_b] -= moved
        active = rows[improves.any(axis=1)]
    return perm


def _clean_choices(
    miss: np.ndarray,
    half_gap: np.ndarray,
    expert: np.ndarray,
    row_idx: np.ndarray,
    pair_idx: np.ndarray,
    row: np.ndarray,
    pack_a: np.ndarray,
    pack_b: np.ndarray,
    clash: np.ndarray,
    choice: np.ndarray,
) -> np.ndarray:
    """For pairs whose best swap duplicates an expert, pick the best swap that does not
    (in place in `choice`); returns which pairs still have a helpful swap.

    miss: [A, m, c*c]; the other arrays are per chosen pair [Q].
    """
    keep = np.ones(row_idx.size, dtype=bool)
    k = np.flatnonzero(clash)
    heavy_experts = expert[row[k], pack_a[k]]  # [K, c]
    light_experts = expert[row[k], pack_b[k]]
    same = heavy_experts[:, :, None] == light_experts[:, None, :]  # [K, i, j]
    forbidden = same.any(axis=1)[:, None, :] | same.any(axis=2)[:, :, None]
    candidates = np.where(
        forbidden.reshape(k.size, -1), np.inf, miss[row_idx[k], pair_idx[k]]
    )
    pick = candidates.argmin(axis=1)
    helps = candidates[np.arange(k.size), pick] < half_gap[row_idx[k], pair_idx[k]] * (1 - 1e-9)
    choice[k] = pick
    keep[k] = helps
    return keep


def spread_duplicates(
    slot_weight: np.ndarray,
    slot_expert: np.ndarray,
    num_packs: int,
    max_sweeps: int = 16,
    floor: np.ndarray | None = None,
) -> np.ndarray | None:
    """Move second replicas of an expert off a pack by swapping each with the item of
    closest weight on a pack that lacks that expert (and whose expert the first pack
    lacks), never raising the row's peak load. A duplicate stays only where no such swap
    exists (e.g. an expert with more replicas than packs). One duplicate per row per step.

    slot_weight, slot_expert: [X, n], pack k owning slots [k*c, (k+1)*c); floor: [X], a
    peak the row's layer reaches anyway, up to which a pack may rise.
    Returns: permutation [X, n]: new slot s takes the item of old slot perm[s]; None
    when there is no duplicate.
    """
    total_rows, num_items = slot_weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        return None
    # only rows with a duplicate somewhere take part (sorting finds them cheaply)
    keys = slot_expert.astype(np.int16) if slot_expert.max() < 2**15 else slot_expert
    by_pack = np.sort(keys.reshape(total_rows, num_packs, per_pack), axis=2, kind="stable")
    with_dup = np.flatnonzero((np.diff(by_pack, axis=2) == 0).any(axis=(1, 2)))
    if with_dup.size == 0:
        return None
    num_rows = with_dup.size
    weight = slot_weight[with_dup]
    expert = slot_expert[with_dup]
    perm = np.tile(np.arange(num_items, dtype=np.int64), (num_rows, 1))
    slot_pack = np.arange(num_items) // per_pack
    load = weight.reshape(num_rows, num_packs, per_pack).sum(axis=2)
    peak = load.max(axis=1)
    if floor is not None:
        peak = np.maximum(peak, floor[with_dup])
    # 1. the duplicates, found once: a slot whose pack holds its expert in an earlier slot;
    #    the k-th duplicate of every row is handled in step k (a swap never creates one)
    packed = expert.reshape(num_rows, num_packs, per_pack)
    earlier = np.tril(np.ones((per_pack, per_pack), dtype=bool), -1)
    is_dup = ((packed[:, :, :, None] == packed[:, :, None, :]) & earlier).any(axis=3)
    dup_row, dup_slot_all = np.nonzero(is_dup.reshape(num_rows, num_items))
    first = np.searchsorted(dup_row, dup_row, side="left")
    step_of = np.arange(dup_row.size) - first
    for step in range(min(int(step_of.max()) + 1, max_sweeps)):
        pick = step_of == step
        rows, dup_slot = dup_row[pick], dup_slot_all[pick]
        local = np.arange(rows.size)
        dup_pack = dup_slot // per_pack
        dup_expert = expert[rows, dup_slot]
        dup_weight = weight[rows, dup_slot]
        # 2. partners: slots on packs without that expert, holding an expert the
        #    duplicate's pack lacks, that keep both packs at or under the row's peak;
        #    closest weight wins
        row_experts = expert[rows]  # [D, n]
        row_weight = weight[rows]
        pack_has = (row_experts == dup_expert[:, None]).reshape(rows.size, num_packs, per_pack)
        still_dup = pack_has.sum(axis=2)[local, dup_pack] > 1  # an earlier swap may have fixed it
        pack_has = pack_has.any(axis=2)[:, slot_pack]  # [D, n]
        home = gather(row_experts, dup_pack[:, None] * per_pack + np.arange(per_pack))
        in_home = np.zeros((rows.size, int(expert.max()) + 1), dtype=bool)
        in_home[local[:, None], home] = True
        clash = gather(in_home, row_experts)
        shift = row_weight - dup_weight[:, None]  # load the duplicate's pack gains
        row_load = load[rows]
        fits = (row_load[local, dup_pack][:, None] + shift <= peak[rows, None]) & (
            row_load[:, slot_pack] - shift <= peak[rows, None]
        )
        distance = np.where(~pack_has & ~clash & fits, np.abs(shift), np.inf)
        partner = distance.argmin(axis=1)
        ok = np.isfinite(distance[local, partner]) & still_dup
        r, a, b = rows[ok], dup_slot[ok], partner[ok]
        moved = shift[local[ok], b]
        load[r, a // per_pack] += moved
        load[r, b // per_pack] -= moved
        for state in (weight, expert, perm):
            a_val = state[r, a]
            state[r, a] = state[r, b]
            state[r, b] = a_val
    full = np.tile(np.arange(num_items, dtype=np.int64), (total_rows, 1))
    full[with_dup] = perm
    return full


def polish(
    item_at: np.ndarray,
    weight: np.ndarray,
    item_expert: np.ndarray,
    num_packs: int,
    max_rounds: int,
    steps: tuple[str, ...] = ("spread", "swap"),
    floor: np.ndarray | None = None,
    extra_rounds: int = 8,
    extra_gap: float = 0.004,
) -> np.ndarray:
    """Spread duplicates, then swap heavy against light packs (swaps never add one).

    item_at, weight, item_expert: [X, n]. floor: [X], a peak each row's layer reaches
    anyway (its busiest node's mean); rows already at or below it are not swapped.
    Rows still more than extra_gap above what they could reach after max_rounds get
    extra_rounds more. Returns: item_at [X, n].
    """
    for step in steps:
        slot_weight = gather(weight, item_at)
        slot_expert = gather(item_expert, item_at)
        if step == "spread":
            perm = spread_duplicates(slot_weight, slot_expert, num_packs, floor=floor)
            if perm is not None:
                item_at = gather(item_at, perm)
            continue
        num_rows = item_at.shape[0]
        # a row's peak cannot go below its mean, its largest item or its layer's floor
        lowest = np.maximum(slot_weight.sum(axis=1) / num_packs, slot_weight.max(axis=1))
        if floor is not None:
            lowest = np.maximum(lowest, floor)
        rows = np.arange(num_rows)
        for rounds in (max_rounds, extra_rounds):
            peak = slot_weight.reshape(num_rows, num_packs, -1).sum(axis=2).max(axis=1)
            gap = 1e-12 if rounds == max_rounds else extra_gap
            rows = rows[peak[rows] > lowest[rows] * (1 + gap)]
            if rows.size == 0 or rounds == 0:
                break
            # first a few rounds for every row, then more for the rows still far off
            perm = refine_swaps(slot_weight[rows], slot_expert[rows], num_packs, rounds)
            item_at[rows] = gather(item_at[rows], perm)
            slot_weight[rows] = gather(slot_weight[rows], perm)
            slot_expert[rows] = gather(slot_expert[rows], perm)
    return item_at


def pack_balanced(
    weight: np.ndarray,
    num_packs: int,
    item_expert: np.ndarray,
    floor: np.ndarray | None = None,
    max_rounds: int = 2,
) -> np.ndarray:
    """Round packing, duplicates spread, then refined by swaps (with two items per pack
    the rounds alone are already the optimal pairing).

    weight: [X, n] replica loads, item_expert: [X, n] expert of each replica, floor: [X]
    peak the row's layer cannot go below anyway (rows under it skip the swaps).
    Returns: item_at [X, n] int64, the item in each slot (pack k owns slots [k*c, (k+1)*c)).
    """
    item_at = pack_rounds(weight, num_packs)
    if weight.shape[1] // num_packs <= 2:
        # two items per pack: the rounds pair heaviest with lightest, which is optimal;
        # only duplicates are left to spread
        return polish(item_at, weight, item_expert, num_packs, 0, ("spread",), floor)
    return polish(item_at, weight, item_expert, num_packs, max_rounds, floor=floor)
