"""DeepSeek's greedy EPLB, vectorised across layers.

This is the baseline every other algorithm is measured against: replicate the expert
with the highest load per replica until the slots are used, then pack replicas
heaviest-first onto the lightest GPU that still has room. The per-layer result has
the same max GPU load as the per-item reference (`reference.py`); only ties may
resolve differently.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.metrics import gather


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
    # 1. An expert replicated c times so far offers weight / c for its next replica;
    #    the greedy takes the num_extra largest offers of the row. The last one taken is
    #    at least total / P, so only offers weight / k with k <= weight * P / total
    #    can be taken: a short ragged list of candidates per row.
    total = weight.sum(axis=1, keepdims=True)
    share = weight / np.where(total > 0, total, 1)
    limit = np.floor(share * num_phy + 1e-9).astype(np.int64)
    if max_count is not None:
        limit = np.minimum(limit, max(max_count, -(-num_phy // num_log)) - 1)
    if (limit.sum(axis=1) < num_extra).any():
        # rows without load (or caps): every expert offers up to num_extra replicas
        limit = np.full_like(limit, num_extra)
        if max_count is not None:
            limit = np.minimum(limit, max(max_count, -(-num_phy // num_log)) - 1)
    per_row = limit.sum(axis=1)
    width = int(per_row.max())
    flat_limit = limit.ravel()
    owner = np.repeat(np.arange(num_rows * num_log), flat_limit)  # row * n + expert
    run_start = np.cumsum(flat_limit) - flat_limit
    divisor = np.arange(owner.size) - np.repeat(run_start, flat_limit) + 1
    row = owner // num_log
    column = np.arange(owner.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    offers = np.full((num_rows, width), -np.inf)
    offers[row, column] = weight.ravel()[owner] / divisor
    # 2. threshold = the num_extra-th largest offer; take everything above it and the
    #    lowest-index offers equal to it (the greedy's tie order: candidates are laid
    #    out in expert order)
    kth = width - num_extra
    threshold = np.partition(offers, kth, axis=1)[:, kth : kth + 1]
    above = offers > threshold
    tied = offers == threshold
    taken = above | tied
    need = num_extra - np.count_nonzero(above, axis=1)
    for r in np.flatnonzero(np.count_nonzero(tied, axis=1) > need):
        taken[r] = above[r] | (tied[r] & (np.cumsum(tied[r]) <= need[r]))
    extras = np.bincount(owner[taken[row, column]], minlength=num_rows * num_log)
    extras = extras.reshape(num_rows, num_log)
    logcnt = 1 + extras
    # 3. lay out the extras in expert order after the identity block
    extra_experts = np.repeat(
        np.tile(np.arange(num_log, dtype=np.int64), num_rows), extras.ravel()
    ).reshape(num_rows, num_extra)
    return np.concatenate([base, extra_experts], axis=1), logcnt.astype(np.int64)


def pack_greedy(weight: np.ndarray, num_packs: int, item_expert: np.ndarray | None = None) -> np.ndarray:
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
