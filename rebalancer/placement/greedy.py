"""DeepSeek's greedy EPLB, vectorised across layers.

This is the baseline every other algorithm is measured against: replicate the expert
with the highest load per replica until the slots are used, then pack replicas
heaviest-first onto the lightest GPU that still has room. The per-layer result has
the same max GPU load as the per-item reference (`reference.py`); only ties may
resolve differently.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.metrics import gather, rows_cols


def replicate_greedy(
    weight: np.ndarray, num_phy: int, max_count: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Choose replica counts by repeatedly replicating the expert with the highest load
    per replica (lowest index on ties), all additions of a layer at once.

    weight: [X, n] float64, num_phy >= n. max_count: no expert gets more replicas than
    this (raised to ceil(num_phy / n) if needed); the reference has no cap, but a replica
    beyond the number of GPUs can only land beside another one.
    Returns: phy2log [X, num_phy] (slot i < n holds expert i, the extras follow in
    expert order), logcnt [X, n] int64.
    """
    num_rows, num_log = weight.shape
    num_extra = num_phy - num_log
    base = np.tile(np.arange(num_log, dtype=np.int64), (num_rows, 1))
    if num_extra == 0:
        return base, np.ones((num_rows, num_log), dtype=np.int64)
    # An expert replicated c times so far offers weight / c for its next replica; the
    # greedy takes the num_extra largest offers of the row (lowest expert first on ties).
    cap = num_extra
    if max_count is not None:
        cap = min(cap, max(max_count, -(-num_phy // num_log)) - 1)
    # 1. every offer of at least total / num_extra is taken: there are at most num_extra
    #    of them. The margin keeps float rounding from counting one more.
    total = np.where((total := weight.sum(axis=1, keepdims=True)) > 0, total, 1)
    sure = (weight * (num_extra / total * (1 - 1e-9))).astype(np.int64)  # a floor
    np.minimum(sure, cap, out=sure)
    left = num_extra - sure.sum(axis=1)
    if left.max() > num_log // 4:
        # many extras per expert: the first guess drops about `left` fractional
        # replicas, so try the threshold total / (num_extra + 0.8 left) too. A row keeps
        # it where even a slightly lower threshold counts at most num_extra offers.
        guess = (num_extra + 0.8 * left[:, None]) / total
        loose = np.minimum((weight * (guess * (1 + 1e-9))).astype(np.int64), cap)
        fits = loose.sum(axis=1) <= num_extra
        if fits.any():
            more = np.minimum((weight * (guess * (1 - 1e-9))).astype(np.int64), cap)
            sure = np.where(fits[:, None], more, sure)
            left = num_extra - sure.sum(axis=1)
    # 2. the rest are the `left` largest of the later offers. The left-th largest next
    #    offer (one per expert) is a floor for them: that many offers are at least it. So
    #    only offers at or above it are candidates, a short list per row.
    next_offer = weight / (sure + 1)
    if sure.max() >= cap:
        next_offer[sure >= cap] = -np.inf  # capped experts offer nothing more
    ranked = np.sort(next_offer, axis=1)
    floor = ranked[np.arange(num_rows), num_log - np.clip(left, 1, num_log)]
    # rows without load, or whose floor is a zero or capped offer, or that need more
    # offers than there are experts, take every offer into account (rare; the floor
    # gives no short list there)
    plain = (floor > 0) & np.isfinite(floor) & (left <= num_log)
    extras = sure
    if plain.all():
        extras += _top_offers(weight, sure, next_offer, floor, left, cap)
    else:
        rows = np.flatnonzero(plain)
        if rows.size:
            extras[rows] += _top_offers(
                weight[rows], sure[rows], next_offer[rows], floor[rows], left[rows], cap
            )
        rows = np.flatnonzero(~plain)
        extras[rows] = _top_offers(
            weight[rows],
            np.zeros_like(sure[rows]),
            None,
            None,
            np.full(rows.size, num_extra),
            cap,
        )
    # 3. lay out the extras in expert order after the identity block
    extra_experts = np.repeat(
        np.tile(np.arange(num_log, dtype=np.int64), num_rows), extras.ravel()
    ).reshape(num_rows, num_extra)
    return np.concatenate([base, extra_experts], axis=1), extras + 1


def _top_offers(
    weight: np.ndarray,
    taken: np.ndarray,
    next_offer: np.ndarray | None,
    floor: np.ndarray | None,
    count: np.ndarray,
    cap: int,
) -> np.ndarray:
    """How many of each expert's offers are among the row's `count` largest, given that
    the first `taken` offers of each expert are already out (lowest expert first on ties).

    weight, taken: [X, n]; next_offer: [X, n] weight / (taken + 1), -inf where capped;
    floor: [X], no offer below it can be among them (None: no floor known, every offer
    is a candidate); count: [X] int64; cap: at most this many offers per expert in all.
    Returns: [X, n] int64 offers taken per expert.
    """
    num_rows, num_log = weight.shape
    picked = np.zeros((num_rows, num_log), dtype=np.int64)
    # 1. the experts with a candidate (next offer at or above the floor, with a margin
    #    for rounding), and their candidates: offers weight / k, first < k <= last.
    #    The last errs high; an offer too many ranks below the floor and is not taken.
    if next_offer is None or floor is None:
        row, expert = np.divmod(np.arange(num_rows * num_log), num_log)
        first = taken.ravel()
        last = np.full(row.size, cap)
    else:
        row, expert = rows_cols(next_offer >= floor[:, None] * (1 - 1e-9))
        first = taken[row, expert]
        # capped as floats first: a tiny floor must not overflow the integer cast
        last = np.minimum(np.floor(weight[row, expert] / floor[row] * (1 + 1e-9)), cap)
        last = np.maximum(last.astype(np.int64), first + 1)
    per_expert = last - first
    owner = np.repeat(np.arange(row.size), per_expert)
    if owner.size == 0:
        return picked
    # 2. lay the candidates out row by row in expert order (the greedy's tie order)
    position = np.arange(owner.size)
    run_start = np.cumsum(per_expert) - per_expert
    divisor = position - (run_start - first)[owner] + 1
    owner_row = row[owner]
    per_row = np.bincount(owner_row, minlength=num_rows)
    width = int(per_row.max())
    flat = owner_row * width + position - (np.cumsum(per_row) - per_row)[owner_row]
    offers = np.full(num_rows * width, -np.inf)
    offers[flat] = weight[row, expert][owner] / divisor
    offers = offers.reshape(num_rows, width)
    # 3. threshold = the count-th largest offer; take everything above it and the
    #    lowest-index offers equal to it (a row that takes none gets an infinite one)
    ranked = np.sort(offers, axis=1)
    threshold = np.where(
        count > 0, ranked[np.arange(num_rows), np.clip(width - count, 0, width - 1)], np.inf
    )[:, None]
    above = offers > threshold
    tied = offers == threshold
    taken_here = above | tied
    need = count - np.count_nonzero(above, axis=1)
    for r in np.flatnonzero(np.count_nonzero(tied, axis=1) > need):
        taken_here[r] = above[r] | (tied[r] & (np.cumsum(tied[r]) <= need[r]))
    picked[row, expert] = np.bincount(owner[taken_here.ravel()[flat]], minlength=row.size)
    return picked


def pack_greedy(
    weight: np.ndarray, num_packs: int, item_expert: np.ndarray | None = None
) -> np.ndarray:
    """Pack n items into packs of n / num_packs items: heaviest first, each onto the
    lightest pack with room (lowest index on ties); one item per step for all rows.

    weight: [X, n]; item_expert is accepted for a common signature and ignored (the
    greedy does not avoid two replicas of an expert on one pack).
    Returns: pack of each item [X, n] int64.
    """
    num_rows, num_items = weight.shape
    capacity = num_items // num_packs
    if capacity == 1:
        return np.tile(np.arange(num_items, dtype=np.int64), (num_rows, 1))
    order = np.argsort(-weight, axis=1, kind="stable")
    sorted_weight = gather(weight, order)
    rows = np.arange(num_rows)
    pack_load = np.zeros((num_rows, num_packs))
    pack_fill = np.zeros((num_rows, num_packs), dtype=np.int64)
    pack_of = np.empty((num_rows, num_items), dtype=np.int64)
    full = np.inf
    for i in range(num_items):
        choice = np.where(pack_fill < capacity, pack_load, full).argmin(axis=1)
        pack_of[rows, order[:, i]] = choice
        pack_load[rows, choice] += sorted_weight[:, i]
        pack_fill[rows, choice] += 1
    return pack_of


def items_by_slot(pack_of: np.ndarray) -> np.ndarray:
    """The item in each slot when pack k owns slots [k*c, (k+1)*c), a pack's items in
    index order.

    pack_of: [X, n] int64 with the same number of items per pack. Returns: item_at [X, n].
    """
    small = pack_of.shape[1] <= np.iinfo(np.int16).max
    return np.argsort(pack_of.astype(np.int16) if small else pack_of, axis=1, kind="stable")


def pack_greedy_slots(
    weight: np.ndarray,
    num_packs: int,
    item_expert: np.ndarray | None = None,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """`pack_greedy` laid out by slot (item_expert and floor are ignored).

    weight: [X, n]. Returns: item_at [X, n].
    """
    return items_by_slot(pack_greedy(weight, num_packs, item_expert))
