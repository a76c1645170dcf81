"""The improved packing: whole rounds of replicas at once, then pairwise swaps.

The greedy places one replica per step, which cannot be fast in numpy. Here round r
hands the r-th heaviest batch of k replicas to the k GPUs, heaviest replica to the
lightest GPU, for every layer at once; second replicas of an expert on a GPU are then
spread out, and swaps between the heaviest and the lightest GPUs, many pairs at once,
lower the peak. No swap puts two replicas of an expert on one GPU.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.metrics import argsort_rows, gather, pack_sums, rows_cols


def pack_rounds(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Round-by-round packing: in round r every pack gets one item, the heaviest item
    of the round going to the currently lightest pack, into the pack's r-th slot.

    weight: [X, n] with n % num_packs == 0.
    Returns: item_at [X, n] int64, the item in each slot (pack k owns slots [k*c, (k+1)*c)).
    """
    num_rows, num_items = weight.shape
    per_pack = num_items // num_packs
    order = argsort_rows(weight, descending=True)
    sorted_weight = gather(weight, order)
    # by_round[r, x, k]: the item pack k of row x gets in round r (a contiguous [X, m]
    # per round, so each round is one flat scatter)
    by_round = np.empty((per_pack, num_rows, num_packs), dtype=np.int64)
    by_round[0] = order[:, :num_packs]  # round 0: every pack is empty, any order will do
    pack_load = sorted_weight[:, :num_packs].copy()
    offsets = np.arange(0, num_rows * num_packs, num_packs)[:, None]
    for r in range(1, per_pack):
        batch = slice(r * num_packs, (r + 1) * num_packs)
        if r == 1:
            # after round 0 pack k holds the k-th heaviest item: lightest is the last
            lightest = np.arange(num_packs - 1, -1, -1)
        else:
            lightest = np.argsort(pack_load, axis=1)
        lightest_first = (lightest + offsets).ravel()
        by_round[r].reshape(-1)[lightest_first] = order[:, batch].ravel()
        pack_load.reshape(-1)[lightest_first] += sorted_weight[:, batch].ravel()
    return by_round.transpose(1, 2, 0).reshape(num_rows, num_items)


def refine_swaps(
    weight: np.ndarray,
    expert: np.ndarray,
    item: np.ndarray,
    load: np.ndarray,
    lowest: np.ndarray | None = None,
    max_rounds: int = 8,
    max_pairs: int = 8,
) -> None:
    """Even out packs by swapping items between heavy and light packs, in place.

    Each round pairs the i-th heaviest pack with the i-th lightest and, in every pair at
    once, makes the one swap that lowers the pair's peak most, so the highest load only
    falls; no swap places a second replica of an expert on a pack. A row stops when no
    pair of it improves or its peak is at `lowest`; all stop after max_rounds.

    weight, expert, item: [X, m, c] item weight, expert and id by pack and slot;
    load: [X, m] pack loads; lowest: [X] a peak the row cannot go below (all updated in
    place, rows' items swapped together).
    """
    num_rows, num_packs, per_pack = weight.shape
    if num_packs == 1 or per_pack <= 1:
        return
    num_pairs = min(max_pairs, num_packs // 2)
    weight_by_pack = weight.reshape(num_rows * num_packs, per_pack)
    expert_by_pack = expert.reshape(num_rows * num_packs, per_pack)
    load_flat = load.reshape(-1)
    rows = np.arange(num_rows)
    for round_ in range(max_rounds):
        # 1. pair the i-th heaviest pack with the i-th lightest: flat pack ids [2, Q]
        #    (heavy, light), Q = A*m pairs in (row, pair) order; one gather for both sides
        order = np.argsort(load if rows.size == num_rows else load[rows], axis=1)
        pairs = np.empty((2, rows.size, num_pairs), dtype=np.int64)
        pairs[0] = order[:, : -num_pairs - 1 : -1]
        pairs[1] = order[:, :num_pairs]
        pairs += (rows * num_packs)[:, None]
        pairs = pairs.reshape(2, -1)
        heavy, light = pairs
        pair_weight = weight_by_pack[pairs]  # [2, Q, c]
        pair_load = load_flat[pairs]
        half_gap = (pair_load[0] - pair_load[1]) / 2
        # 2. swapping heavy item i with light item j (moving d = w_i - w_j) leaves the
        #    pair's peak at their mean + |d - half_gap|: it helps when that is below
        #    half_gap. Searched in float32 for speed (the chosen swap is checked in
        #    float64), laid out [i, j, pair] so numpy's inner loops run over the pairs.
        by_item = pair_weight.transpose(0, 2, 1)  # [2, c, Q] view
        h = np.ascontiguousarray(by_item[0], dtype=np.float32)
        s = np.ascontiguousarray(by_item[1] + half_gap, dtype=np.float32)
        miss = h[:, None, :] - s[None, :, :]
        np.abs(miss, out=miss)  # [c(i), c(j), Q]
        # 3. no swap may put a second replica of an expert on either pack: where the two
        #    packs share an expert, rule out moving it off one pack and anything onto
        #    the pack that has it
        pair_expert = np.ascontiguousarray(expert_by_pack[pairs].transpose(0, 2, 1))
        same = pair_expert[0][:, None, :] == pair_expert[1][None, :, :]
        if same.any():
            forbid = same.any(axis=1)[:, None, :] | same.any(axis=0)[None, :, :]
            np.copyto(miss, np.inf, where=forbid)
        miss = np.ascontiguousarray(miss.reshape(per_pack * per_pack, -1).T)  # [Q, c*c]
        best = miss.argmin(axis=1)
        pair = np.arange(best.size)
        found = np.isfinite(miss[pair, best])
        item_a, item_b = best // per_pack, best % per_pack
        moved_load = pair_weight[0][pair, item_a] - pair_weight[1][pair, item_b]
        improves = found & (np.abs(moved_load - half_gap) < half_gap * (1 - 1e-9))
        chosen = np.flatnonzero(improves)
        if chosen.size == 0:
            break
        # 4. apply every chosen swap; the pairs of a row share no pack
        pack_a, pack_b = heavy[chosen], light[chosen]
        flat_a = pack_a * per_pack + item_a[chosen]
        flat_b = pack_b * per_pack + item_b[chosen]
        for state in (weight, expert, item):
            flat = state.reshape(-1)
            flat[flat_a], flat[flat_b] = flat[flat_b], flat[flat_a]
        moved = moved_load[chosen]
        load_flat[pack_a] -= moved
        load_flat[pack_b] += moved
        if round_ == max_rounds - 1:
            break
        # 5. rows go on while some pair improved and their peak is above what they can reach
        busy = improves.reshape(rows.size, num_pairs).any(axis=1)
        if lowest is not None:
            busy &= load[rows].max(axis=1) > lowest[rows] * (1 + 1e-12)
        rows = rows[busy]
        if rows.size == 0:
            break


def duplicate_slots(expert: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    """Slots whose pack holds their expert in an earlier slot too.

    expert: [X, m, c]; weight: [X, m, c] when every pack's items are in non-increasing
    weight order (as the round packing leaves them): replicas of an expert weigh the
    same, so a duplicate then sits in a run of equal weights and only slots d apart
    within such runs are compared, d = 1, 2, ... while any run is that long.
    Returns: [X, m, c] bool.
    """
    num_rows, num_packs, per_pack = expert.shape
    if per_pack == 2:
        dup = np.zeros(expert.shape, dtype=bool)
        np.equal(expert[:, :, 0], expert[:, :, 1], out=dup[:, :, 1])
        return dup
    if weight is not None:
        # on whole rows (numpy is slow on a short last axis), pairs across packs masked
        num_items = num_packs * per_pack
        flat_weight = weight.reshape(num_rows, num_items)
        flat_expert = expert.reshape(num_rows, num_items)
        place = np.arange(num_items) % per_pack
        dup = np.zeros((num_rows, num_items), dtype=bool)
        for d in range(1, per_pack):
            equal = (flat_weight[:, d:] == flat_weight[:, :-d]) & (place[d:] >= d)
            if not equal.any():
                break
            dup[:, d:] |= equal & (flat_expert[:, d:] == flat_expert[:, :-d])
        return dup.reshape(expert.shape)
    if per_pack <= 4:
        # few slot pairs: compare them directly
        dup = np.zeros(expert.shape, dtype=bool)
        for j in range(1, per_pack):
            for i in range(j):
                dup[:, :, j] |= expert[:, :, i] == expert[:, :, j]
        return dup
    # one sort per row of (pack, expert) keys with the slot in the low bits: equal
    # neighbours are replicas on one pack, the later slot the duplicate
    num_items = num_packs * per_pack
    bits = (num_items - 1).bit_length()
    num_experts = int(expert.max()) + 1
    # int32 keys sort faster (twice the SIMD lanes) where they fit
    small = (num_packs * num_experts) << bits < 2**31
    dtype = np.int32 if small else np.int64
    flat = expert.reshape(num_rows, num_items).astype(dtype)
    pack = np.arange(num_items, dtype=dtype) // per_pack
    keys = ((pack * num_experts + flat) << bits) | np.arange(num_items, dtype=dtype)
    keys.sort(axis=1)
    row, at = rows_cols((keys[:, 1:] >> bits) == (keys[:, :-1] >> bits))
    dup = np.zeros((num_rows, num_items), dtype=bool)
    dup[row, keys[row, at + 1] & ((1 << bits) - 1)] = True
    return dup.reshape(expert.shape)


def spread_duplicates(
    weight: np.ndarray,
    expert: np.ndarray,
    item: np.ndarray,
    load: np.ndarray,
    floor: np.ndarray | None = None,
    max_sweeps: int = 16,
    descending: bool = False,
) -> None:
    """Move second replicas of an expert off a pack by swapping each with the item of
    closest weight on a pack that lacks that expert (and whose expert the first pack
    lacks), never raising the row's peak load. A duplicate stays only where no such swap
    exists (e.g. an expert with more replicas than packs).

    All duplicates are handled at once; two swaps of one row that would touch a common
    pack are not independent, so the later one waits for the next sweep.

    weight, expert, item: [X, m, c] item weight, expert and id by pack and slot;
    load: [X, m] pack loads (all updated in place); floor: [X], a peak the row's layer
    reaches anyway, up to which a pack may rise. descending: every pack's items are in
    non-increasing weight order (finding the duplicates is then cheaper).
    """
    num_rows, num_packs, per_pack = weight.shape
    if per_pack == 1:
        return
    num_items = num_packs * per_pack
    # 1. the duplicates, found once (a swap never creates one)
    found = duplicate_slots(expert, weight if descending else None)
    dup_row, dup_slot_all = rows_cols(found.reshape(num_rows, num_items))
    if dup_row.size == 0:
        return
    weight2 = weight.reshape(num_rows, num_items)
    expert2 = expert.reshape(num_rows, num_items)
    item2 = item.reshape(num_rows, num_items)
    peak = load.max(axis=1)
    if floor is not None:
        peak = np.maximum(peak, floor)
    num_experts = int(expert.max()) + 1
    for _ in range(max_sweeps):
        rows = dup_row  # [D], sorted, a row once per duplicate
        local = np.arange(rows.size)
        dup_pack = dup_slot_all // per_pack
        row_experts = expert2[rows]  # [D, n]
        row_weight = weight2[rows]
        dup_expert = row_experts[local, dup_slot_all]
        # 2. the packs holding the duplicate's expert (a few slots); it is still a
        #    duplicate unless a swap of an earlier sweep fixed it
        at_d, at_slot = rows_cols(row_experts == dup_expert[:, None])
        at_pack = at_slot // per_pack
        at_home = at_pack == dup_pack[at_d]
        still_dup = np.bincount(at_d[at_home], minlength=rows.size) > 1
        # 3. partners: slots on packs without that expert, holding an expert the
        #    duplicate's pack lacks, that keep both packs at or under the row's peak;
        #    closest weight wins. A pack holding the expert counts as full (infinite
        #    load), so the peak test rules it out too.
        row_load = load[rows]
        row_peak = peak[rows, None]
        home_load = row_load[local, dup_pack][:, None]
        row_load[at_d, at_pack] = np.inf
        home = row_experts.reshape(rows.size, num_packs, per_pack)[local, dup_pack]  # [D, c]
        in_home = np.zeros((rows.size, num_experts), dtype=bool)
        in_home[local[:, None], home] = True
        clash = gather(in_home, row_experts)
        shift = row_weight - row_weight[local, dup_slot_all][:, None]  # the dup's pack gains
        fits = (shift <= row_peak - home_load) & (
            np.repeat(row_load, per_pack, axis=1) - row_peak <= shift
        )
        fits &= ~clash
        distance = np.where(fits, np.abs(shift), np.inf)
        partner = distance.argmin(axis=1)
        ok = np.isfinite(distance[local, partner]) & still_dup
        # 4. swaps of one row must touch disjoint packs to be made together; one that
        #    shares a pack with an earlier swap of its row waits for the next sweep
        #    (a row's duplicates are adjacent; lag d compares each with the d-th before)
        wait = np.zeros(rows.size, dtype=bool)
        pack_b = partner // per_pack
        for d in range(1, rows.size):
            same_row = rows[d:] == rows[:-d]
            if not same_row.any():
                break
            pairs = same_row & ok[d:] & ok[:-d]
            wait[d:] |= pairs & (
                (dup_pack[d:] == dup_pack[:-d])
                | (dup_pack[d:] == pack_b[:-d])
                | (pack_b[d:] == dup_pack[:-d])
                | (pack_b[d:] == pack_b[:-d])
            )
        ok &= ~wait
        r, a, b = rows[ok], dup_slot_all[ok], partner[ok]
        moved = shift[local[ok], b]
        load[r, a // per_pack] += moved
        load[r, b // per_pack] -= moved
        for state in (weight2, expert2, item2):
            a_val = state[r, a]
            state[r, a] = state[r, b]
            state[r, b] = a_val
        if not wait.any():
            break
        dup_row, dup_slot_all = dup_row[wait], dup_slot_all[wait]


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
    descending: bool = False,
) -> np.ndarray:
    """Spread duplicates, then swap heavy against light packs (swaps never add one).

    item_at, weight, item_expert: [X, n]. floor: [X], a peak each row's layer reaches
    anyway (its busiest node's mean); rows already at or below it are not swapped.
    Rows still more than extra_gap above what they could reach after max_rounds get
    extra_rounds more. descending: each pack's items come in non-increasing weight
    order (the round packing's). Returns: item_at [X, n].
    """
    num_rows, num_items = item_at.shape
    shape = (num_rows, num_packs, num_items // num_packs)
    # 1. the packing state by pack and slot; every step swaps items in it in place
    slot_weight = gather(weight, item_at)
    slot_expert = gather(item_expert, item_at)
    if slot_expert.max() < 2**15:
        # smaller keys: cheaper gathers and compares in the swaps
        slot_expert = slot_expert.astype(np.int16)
    load = pack_sums(slot_weight, num_packs)
    state = (slot_weight.reshape(shape), slot_expert.reshape(shape), item_at.reshape(shape))
    if "spread" in steps:
        spread_duplicates(*state, load, floor=floor, descending=descending)
    if "swap" not in steps or max_rounds == 0:
        return item_at
    # 2. a row's peak cannot go below its mean, its largest item or its layer's floor;
    #    rows already there (within float noise) skip the swaps
    lowest = np.maximum(load.sum(axis=1) / num_packs, slot_weight.max(axis=1))
    if floor is not None:
        lowest = np.maximum(lowest, floor)
    rows = np.flatnonzero(load.max(axis=1) > lowest * (1 + 1e-12))
    for rounds in (max_rounds, extra_rounds):
        if rows.size == 0 or rounds == 0:
            break
        # first a few rounds for every row, then more for the rows still far off
        if rows.size == num_rows:
            refine_swaps(*state, load, lowest, rounds)
        else:
            part = (state[0][rows], state[1][rows], state[2][rows])
            part_load = load[rows]
            refine_swaps(*part, part_load, lowest[rows], rounds)
            for whole, piece in zip(state, part, strict=True):
                whole[rows] = piece
            load[rows] = part_load
        rows = rows[load[rows].max(axis=1) > lowest[rows] * (1 + extra_gap)]
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
        return polish(
            item_at, weight, item_expert, num_packs, 0, ("spread",), floor, descending=True
        )
    return polish(item_at, weight, item_expert, num_packs, max_rounds, floor=floor, descending=True)
