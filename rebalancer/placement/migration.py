"""Placement that minds what it costs to get there from the current one.

A from-scratch refit changes almost every slot (93% on the DeepSeek-V3 workload pairs,
76% even after the best relabelling of GPUs). Here the current placement is repaired instead: hot
experts get replicas taken from experts that can spare one, then replicas are swapped between the
busiest and the lightest GPUs, each change paid from a budget of slots, until every
layer is about as balanced as a fresh placement would be. A fresh placement, relabelled
onto the old GPUs by overlap, is the fallback for a layer the repair cannot fix.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.metrics import gather, logcnt_of, pack_sums, rows_cols


def gpu_overlap(old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """Experts shared by each (old GPU, new GPU) pair.

    old, new: [L, P]. Returns: [L, G, G] int64, [l, old_gpu, new_gpu].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    gpu = np.arange(num_slots) // per_gpu
    layers = np.arange(num_layers)[:, None]
    old_has = np.zeros((num_layers, num_gpus, num_logical), dtype=np.float32)
    new_has = np.zeros_like(old_has)
    old_has[layers, gpu[None, :], old] = 1
    new_has[layers, gpu[None, :], new] = 1
    return np.matmul(old_has, new_has.transpose(0, 2, 1)).astype(np.int64)


def relabel_gpus(old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """Rename the new placement's GPUs so each lands on the old GPU it overlaps most.

    old, new: [L, P]. Returns: new placement with whole GPUs permuted [L, P].
    """
    # Imported here: scipy.optimize is most of a controller's start (1.1 of 1.8 s wall on a
    # loaded 2-core node), and the controller's decisions, which call this, run in the
    # child process of controller/decision_process.py (which imports it as it starts).
    from scipy.optimize import linear_sum_assignment

    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    overlap = gpu_overlap(old, new, num_gpus, num_logical)
    target = np.empty((num_layers, num_gpus), dtype=np.int64)
    for layer in range(num_layers):
        old_gpu, new_gpu = linear_sum_assignment(overlap[layer], maximize=True)
        target[layer, old_gpu] = new_gpu
    blocks = new.reshape(num_layers, num_gpus, per_gpu)
    return np.take_along_axis(blocks, target[:, :, None], axis=1).reshape(num_layers, num_slots)


def align_slots(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder slots inside each GPU so experts that stay keep their old slot.

    old, new: [L, P], new already on its final GPUs. Returns: [L, P].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    big = int(max(old.max(), new.max())) + 1
    gpu = np.arange(num_slots) // per_gpu

    # 1. key = (gpu, expert, occurrence) for the old slots and the new items
    def keys(phy2log: np.ndarray) -> np.ndarray:
        base = gpu[None, :] * big + phy2log
        order = np.argsort(base, axis=1, kind="stable")
        sorted_base = np.take_along_axis(base, order, axis=1)
        first = np.maximum.accumulate(
            np.where(np.diff(sorted_base, axis=1, prepend=-1) != 0, np.arange(num_slots), 0),
            axis=1,
        )
        occurrence = np.empty_like(order)
        np.put_along_axis(occurrence, order, np.arange(num_slots) - first, axis=1)
        return base * num_slots + occurrence

    old_key, new_key = keys(old), keys(new)
    out = np.empty_like(new)
    for layer in range(num_layers):
        # 2. matched items keep their old slot; the rest fill the freed slots of their GPU
        kept = np.isin(old_key[layer], new_key[layer])
        placed = np.isin(new_key[layer], old_key[layer])
        row = np.where(kept, old[layer], -1)
        free_slots = np.flatnonzero(~kept)
        movers = np.flatnonzero(~placed)
        # both lists are in slot order, so they pair up GPU by GPU
        row[free_slots] = new[layer, movers]
        out[layer] = row
    return out


def keep_in_place(old: np.ndarray, new: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """The new placement's GPU contents, relabelled and aligned to the old slots.

    old, new: [L, P]. Returns: [L, P] with the same per-GPU expert sets as `new` up to a
    GPU permutation, and as few changed slots as that relabelling allows.
    """
    return align_slots(old, relabel_gpus(old, new, num_gpus, num_logical), num_gpus)


def _slot_load(phy2log: np.ndarray, load: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """Per-slot load [L, P] of phy2log [L, P] under load [L, E] and counts [L, E]."""
    return gather(load / np.maximum(logcnt, 1), phy2log)


def move_replicas(
    phy2log: np.ndarray,
    old: np.ndarray,
    load: np.ndarray,
    threshold: np.ndarray,
    quota: np.ndarray,
    per_gpu: int,
    max_steps: int = 256,
    logcnt: np.ndarray | None = None,
) -> np.ndarray:
    """Give replicas to experts whose load per replica is above threshold, taking them
    from experts that stay at or below it, one slot per layer per step.

    The replica given up is the one on the busiest GPU that does not already hold the
    receiving expert. phy2log: [L, P] (updated in place), old: [L, P], load: [L, E],
    threshold: [L], quota: [L] slots each layer may still change (updated in place).
    logcnt: [L, E] the replica counts of phy2log if known (not changed).
    Returns: phy2log.
    """
    num_layers, num_slots = phy2log.shape
    num_gpus = num_slots // per_gpu
    logcnt = logcnt_of(phy2log, load.shape[1]) if logcnt is None else logcnt.copy()
    # a layer changes only when it acts, so one that cannot act now never will: the
    # steps run on the few that can
    may = np.flatnonzero(((load / logcnt).max(axis=1) > threshold) & (quota > 0))
    if may.size < num_layers:
        if may.size:
            sub, sub_quota = phy2log[may], quota[may]
            move_replicas(
                sub, old[may], load[may], threshold[may], sub_quota, per_gpu, max_steps, logcnt[may]
            )
            phy2log[may], quota[may] = sub, sub_quota
        return phy2log
    rows = np.arange(num_layers)
    for _ in range(max_steps):
        # 1. the expert most in need and the one that can best spare a replica
        per_replica = load / logcnt
        taker = per_replica.argmax(axis=1)
        need = per_replica[rows, taker]
        spare = np.where(logcnt >= 2, load / np.maximum(logcnt - 1, 1), np.inf)
        giver = spare.argmin(axis=1)
        act = (need > threshold) & (spare[rows, giver] <= threshold) & (quota > 0)
        if not act.any():
            break
        layer = rows[act]
        taker, giver = taker[act], giver[act]
        # 2. the giver's replica on the busiest GPU that lacks the taker
        p2l = phy2log[layer]
        gpu_load = _slot_load(p2l, load[layer], logcnt[layer])
        gpu_load = gpu_load.reshape(layer.size, num_gpus, per_gpu).sum(axis=2)
        has_taker = (p2l == taker[:, None]).reshape(layer.size, num_gpus, per_gpu).any(axis=2)
        slot_gpu = np.arange(num_slots) // per_gpu
        score = np.where(
            (p2l == giver[:, None]) & ~has_taker[:, slot_gpu],
            gpu_load[:, slot_gpu],
            -np.inf,
        )
        slot = score.argmax(axis=1)
        ok = np.isfinite(score[np.arange(layer.size), slot])
        if not ok.any():
            break
        layer, taker, giver, slot = layer[ok], taker[ok], giver[ok], slot[ok]
        # 3. overwrite; a slot going back to its old expert refunds its cost
        was_changed = phy2log[layer, slot] != old[layer, slot]
        now_changed = taker != old[layer, slot]
        quota[layer] -= now_changed.astype(np.int64) - was_changed
        phy2log[layer, slot] = taker
        logcnt[layer, giver] -= 1
        logcnt[layer, taker] += 1
    return phy2log


def swap_to_target(
    phy2log: np.ndarray,
    old: np.ndarray,
    load: np.ndarray,
    target: np.ndarray,
    quota: np.ndarray,
    per_gpu: int,
    num_pairs: int = 4,
    max_rounds: int = 64,
    slot_load: np.ndarray | None = None,
) -> np.ndarray:
    """Swap replicas between the busiest GPUs and the lightest ones until each layer's
    max GPU load is at most its target, no swap helps, or its quota is spent.

    Pairs the i-th busiest GPU with the i-th lightest (only busiest GPUs above target);
    each pair takes the swap that evens it most, never duplicating an expert on a GPU.
    phy2log: [L, P] (updated in place), old: [L, P], load: [L, E], target: [L] max GPU
    load, quota: [L] (updated in place). slot_load: [L, P] float64 the load each slot
    carries (`replica_load` of phy2log) if known: swapped along (updated in place).
    Returns: phy2log.
    """
    num_layers, num_slots = phy2log.shape
    num_gpus = num_slots // per_gpu
    num_pairs = max(1, min(num_pairs, num_gpus // 2))
    if slot_load is None:
        slot_load = _slot_load(phy2log, load, logcnt_of(phy2log, load.shape[1]))
    # read and written flat, by slot index (layer * P + slot): views, so swaps land in
    # phy2log and slot_load (reshape raises rather than copy)
    flat_weight = np.reshape(slot_load, -1, copy=False)
    flat_expert = np.reshape(phy2log, -1, copy=False)
    flat_old = np.ascontiguousarray(old).reshape(-1)
    by_gpu_weight = flat_weight.reshape(num_layers * num_gpus, per_gpu)
    by_gpu_expert = flat_expert.reshape(num_layers * num_gpus, per_gpu)
    gpu_load = slot_load.reshape(num_layers, num_gpus, per_gpu).sum(axis=2)
    flat_gpu = gpu_load.reshape(-1)
    # a layer that takes no swap in a round is left as it was, so it would take none in
    # any later round either: it drops out of the rounds
    live = np.ones(num_layers, dtype=bool)
    for _ in range(max_rounds):
        active = np.flatnonzero(live & (gpu_load.max(axis=1) > target) & (quota > 0))
        if active.size == 0:
            break
        sub_load = gpu_load[active]
        # 1. busiest and lightest GPUs, paired [A, k]
        order = np.argsort(sub_load, axis=1)
        heavy = order[:, : -num_pairs - 1 : -1]
        light = order[:, :num_pairs]
        heavy_load = np.take_along_axis(sub_load, heavy, axis=1)
        half_gap = (heavy_load - np.take_along_axis(sub_load, light, axis=1)) / 2
        # the pair's slots, layers last: [k, c, A] (numpy loops over the last axis, so
        # the c x c candidate swaps below run as long loops over layers, not short ones)
        # (whole GPUs taken as rows of the [L * G, c] views, then turned layers last)
        gpu_heavy = (active[:, None] * num_gpus + heavy).T  # [k, A]
        gpu_light = (active[:, None] * num_gpus + light).T
        hw, lw = (_layers_last(by_gpu_weight.take(at, axis=0)) for at in (gpu_heavy, gpu_light))
        he, le = (_layers_last(by_gpu_expert.take(at, axis=0)) for at in (gpu_heavy, gpu_light))
        first_heavy, first_light = gpu_heavy.T * per_gpu, gpu_light.T * per_gpu  # [A, k]
        # 2. best swap per pair: the pair's peak ends at mean + miss
        best, best_miss = _best_pair_swaps(hw, lw, he, le, half_gap)
        useful = (best_miss < half_gap * (1 - 1e-9)) & (heavy_load > target[active, None])
        # 3. what each swap costs in changed slots, paid pair by pair, busiest first
        sa, sb = first_heavy + best // per_gpu, first_light + best % per_gpu  # [A, k] slots
        cur_a, cur_b = flat_expert[sa], flat_expert[sb]
        old_a, old_b = flat_old[sa], flat_old[sb]
        cost = (
            (cur_b != old_a).astype(np.int64)
            + (cur_a != old_b)
            - (cur_a != old_a)
            - (cur_b != old_b)
        )
        spend = np.cumsum(np.where(useful, np.maximum(cost, 0), 0), axis=1)
        useful &= spend <= quota[active, None]
        if not useful.any():
            break
        live[active[~useful.any(axis=1)]] = False
        r, k = rows_cols(useful)
        layer = active[r]
        np.subtract.at(quota, layer, cost[r, k])  # a layer may pay for several pairs
        sa, sb = sa[r, k], sb[r, k]
        # 4. apply: the pairs of a layer share no GPU
        for state in (flat_weight, flat_expert):
            a_val = state[sa]
            state[sa] = state[sb]
            state[sb] = a_val
        moved = flat_weight[sb] - flat_weight[sa]
        flat_gpu[sa // per_gpu] -= moved
        flat_gpu[sb // per_gpu] += moved
    return phy2log


def _layers_last(by_gpu: np.ndarray) -> np.ndarray:
    """[k, A, c] per-GPU rows as [k, c, A], contiguous."""
    return np.ascontiguousarray(by_gpu.transpose(0, 2, 1))


# Layers per chunk of `_best_pair_swaps`' [k, c, c, A] candidate tables, and elements
# per chunk of `_best_peak_swaps`' [A, c, P] ones: a few hundred KB each, so the dozen
# passes over them run in cache instead of memory.
PAIR_CHUNK = 1 << 16


def _best_pair_swaps(
    hw: np.ndarray,
    lw: np.ndarray,
    he: np.ndarray,
    le: np.ndarray,
    half_gap: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """For each (busy GPU, light GPU) pair, the swap of one item of each that brings the
    pair closest to even (first in (busy slot, light slot) order on ties), never putting
    an expert on a GPU that already holds it.

    hw, lw: [k, c, A] the items' loads on the k busy and k light GPUs of A layers, he, le:
    [k, c, A] their experts, half_gap: [A, k] half each pair's load difference.
    Returns: best [A, k] busy slot * c + light slot, miss [A, k] how far from even it
    leaves the pair (inf when no swap is allowed). Worked out a chunk of layers at a time."""
    num_pairs, per_gpu, num_active = hw.shape
    step = max(1, PAIR_CHUNK // (num_pairs * per_gpu * per_gpu))
    best = np.empty((num_pairs, num_active), dtype=np.int64)
    best_miss = np.empty((num_pairs, num_active))
    gap = half_gap.T
    for lo in range(0, num_active, step):
        cut = slice(lo, lo + step)
        n = min(step, num_active - lo)
        # [k, c_heavy, c_light, n] layers last: numpy loops over the last axis, so the
        # c x c candidate swaps run as long loops over layers, not short ones
        miss = np.abs(hw[:, :, None, cut] - (lw[:, :, cut] + gap[:, None, cut])[:, None, :, :])
        same = he[:, :, None, cut] == le[:, None, :, cut]
        dup = same.any(axis=1)[:, None, :, :] | same.any(axis=2)[:, :, None, :]
        np.copyto(miss, np.inf, where=dup)
        miss = miss.reshape(num_pairs, per_gpu * per_gpu, n)
        pick = miss.argmin(axis=1)
        best[:, cut] = pick
        best_miss[:, cut] = np.take_along_axis(miss, pick[:, None, :], axis=1)[:, 0, :]
    return best.T, best_miss.T


# Elements of a chunk of `_best_peak_swaps`' [A, c, P] candidate tables: a few hundred
# KB each, so the dozen passes over them run in cache instead of memory.
PEAK_CHUNK = 1 << 15


def swap_peak(
    phy2log: np.ndarray,
    old: np.ndarray,
    load: np.ndarray,
    target: np.ndarray,
    quota: np.ndarray,
    per_gpu: int,
    max_rounds: int = 256,
    slot_load: np.ndarray | None = None,
) -> np.ndarray:
    """Swap an item of each layer's busiest GPU with the item of any other GPU that
    lowers the pair's peak most, one swap per layer per round, until the layer meets its
    target, no swap helps or its quota is spent. Slower than `swap_to_target` but not
    limited to the lightest GPUs, which matters with few slots per GPU.

    phy2log: [L, P] (updated in place), old: [L, P], load: [L, E], target: [L],
    quota: [L] (updated in place). slot_load: as `swap_to_target`'s. Returns: phy2log.
    """
    num_layers, num_slots = phy2log.shape
    num_gpus = num_slots // per_gpu
    if slot_load is None:
        slot_load = _slot_load(phy2log, load, logcnt_of(phy2log, load.shape[1]))
    weight = slot_load
    gpu_load = weight.reshape(num_layers, num_gpus, per_gpu).sum(axis=2)
    # a layer at its target (or out of quota) now never changes: the rounds run on the rest
    may = np.flatnonzero((gpu_load.max(axis=1) > target) & (quota > 0))
    if may.size < num_layers:
        if may.size:
            sub, sub_quota, sub_load = phy2log[may], quota[may], weight[may]
            swap_peak(
                sub, old[may], load[may], target[may], sub_quota, per_gpu, max_rounds, sub_load
            )
            phy2log[may], quota[may], weight[may] = sub, sub_quota, sub_load
        return phy2log
    # a layer that takes no swap in a round is left as it was, so it would take none in
    # any later round either: it drops out of the rounds
    live = np.ones(num_layers, dtype=bool)
    for _ in range(max_rounds):
        peak_gpu = gpu_load.argmax(axis=1)
        peak = gpu_load[np.arange(num_layers), peak_gpu]
        active = np.flatnonzero(live & (peak > target) & (quota > 0))
        if active.size == 0:
            break
        a, b, new_peak = _best_peak_swaps(
            phy2log, weight, gpu_load, active, peak_gpu[active], per_gpu
        )
        layer = active
        cost = (
            (phy2log[layer, b] != old[layer, a]).astype(np.int64)
            + (phy2log[layer, a] != old[layer, b])
            - (phy2log[layer, a] != old[layer, a])
            - (phy2log[layer, b] != old[layer, b])
        )
        ok = (new_peak < peak[active] * (1 - 1e-9)) & (cost <= quota[layer])
        if not ok.any():
            break
        live[active[~ok]] = False
        layer, a, b, cost = layer[ok], a[ok], b[ok], cost[ok]
        quota[layer] -= cost
        moved = weight[layer, a] - weight[layer, b]
        gpu_load[layer, a // per_gpu] -= moved
        gpu_load[layer, b // per_gpu] += moved
        for state in (weight, phy2log):
            a_val = state[layer, a]
            state[layer, a] = state[layer, b]
            state[layer, b] = a_val
    return phy2log


def _best_peak_swaps(
    phy2log: np.ndarray,
    weight: np.ndarray,
    gpu_load: np.ndarray,
    active: np.ndarray,
    peak_gpu: np.ndarray,
    per_gpu: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each active layer, the swap of an item of its busiest GPU with an item of
    another GPU that leaves the pair's peak lowest (first in (item, slot) order on ties),
    never duplicating an expert on either GPU and only moving load off the peak GPU.

    phy2log, weight: [L, P], gpu_load: [L, G], active: [A] layers, peak_gpu: [A].
    Returns: slot on the peak GPU [A], slot swapped with [A], the pair's new peak [A]
    (inf where no swap is allowed). Worked out a chunk of layers at a time (PEAK_CHUNK)."""
    num_slots = phy2log.shape[1]
    num_gpus = num_slots // per_gpu
    gpu_of = np.arange(num_slots) // per_gpu
    step = max(1, PEAK_CHUNK // (per_gpu * num_slots))
    a = np.empty(active.size, dtype=np.int64)
    b = np.empty(active.size, dtype=np.int64)
    best_peak = np.empty(active.size)
    for lo in range(0, active.size, step):
        rows, g = active[lo : lo + step], peak_gpu[lo : lo + step]
        n = rows.size
        own = g[:, None] * per_gpu + np.arange(per_gpu)  # [n, c]
        own_w = weight[rows[:, None], own]
        own_e = phy2log[rows[:, None], own]
        other_w = weight[rows]  # [n, P]
        other_e = phy2log[rows]
        other_load = gpu_load[rows][:, gpu_of]
        peak = gpu_load[rows, g]
        delta = own_w[:, :, None] - other_w[:, None, :]  # [n, c, P]
        new_peak = np.subtract(peak[:, None, None], delta)
        np.maximum(new_peak, other_load[:, None, :] + delta, out=new_peak)
        # no duplicate on either GPU, nothing from the peak GPU itself: which GPUs hold
        # each own item [n, c, G] from where it matches (no reductions over a GPU's
        # few slots, which numpy runs slowly)
        same = other_e[:, None, :] == own_e[:, :, None]  # [n, c, P]
        on_peak = same.any(axis=1)  # [n, P]
        row, item, slot = np.unravel_index(np.flatnonzero(same), same.shape)
        own_there = np.zeros((n, per_gpu, num_gpus), dtype=bool)
        own_there[row, item, slot // per_gpu] = True
        own_there[np.arange(n), :, g] = True
        barred = own_there.take(gpu_of, axis=2)  # [n, c, P]: anything but load off the peak GPU
        barred |= on_peak[:, None, :]
        barred |= delta <= 0
        np.copyto(new_peak, np.inf, where=barred)
        new_peak = new_peak.reshape(n, -1)
        best = new_peak.argmin(axis=1)
        a[lo : lo + n] = own[np.arange(n), best // num_slots]
        b[lo : lo + n] = best % num_slots
        best_peak[lo : lo + n] = new_peak[np.arange(n), best]
    return a, b, best_peak


def peak_load(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Max GPU load per layer [L]."""
    logcnt = logcnt_of(phy2log, load.shape[1])
    slot = _slot_load(phy2log, load, logcnt)
    return pack_sums(slot, num_gpus).max(axis=1)


def migrate(
    load: np.ndarray,
    old: np.ndarray,
    fresh: np.ndarray,
    num_gpus: int,
    budget_slots: int | None = None,
    gap: float = 0.005,
    passes: int = 3,
    replica_share: float = 0.5,
) -> np.ndarray:
    """Repair `old` for `load` until every layer is within `gap` of the balancedness of
    `fresh` (a from-scratch placement for the same load), changing at most
    `budget_slots` slots in all. replica_share: an expert gets replicas from others
    only while its load per replica is above this share of a GPU's target load.

    load: [L, E] float64, old, fresh: [L, P]. Returns: phy2log [L, P].
    """
    num_layers, num_slots = old.shape
    per_gpu = num_slots // num_gpus
    mean = load.sum(axis=1) / num_gpus
    loaded = mean > 0
    # 1. what to aim for, from the fresh placement: its balance, less the gap
    fresh_peak = peak_load(fresh, load, num_gpus)
    goal = np.where(loaded, mean / np.where(loaded, fresh_peak, 1), 1.0)
    target = np.where(loaded, mean / np.maximum(goal - gap, 1e-9), np.inf)
    # replica moves only for experts whose replicas are too large to even out by swaps
    # (above both the fresh placement's largest replica and a share of a GPU's target);
    # below that, swaps buy more balance per changed slot
    fresh_cnt = logcnt_of(fresh, load.shape[1])
    largest = (load / fresh_cnt).max(axis=1)
    threshold = np.where(loaded, np.maximum(largest, replica_share * target), np.inf)
    phy2log = np.ascontiguousarray(old, dtype=np.int64).copy()
    unlimited = budget_slots is None
    remaining = 2 * num_slots * num_layers if budget_slots is None else int(budget_slots)
    # 2. repair in passes; a pass splits what is left of the budget over the layers
    #    that still miss their target
    for _ in range(passes):
        behind = loaded & (peak_load(phy2log, load, num_gpus) > target)
        if not behind.any() or remaining <= 0:
            break
        quota = np.zeros(num_layers, dtype=np.int64)
        quota[behind] = 2 * num_slots if unlimited else remaining // int(behind.sum())
        if quota.max() == 0:
            quota[np.flatnonzero(behind)[:remaining]] = 1
        spent_before = int((phy2log != old).sum())
        move_replicas(phy2log, old, load, threshold, quota, per_gpu)
        swap_to_target(phy2log, old, load, target, quota, per_gpu)
        swap_peak(phy2log, old, load, target, quota, per_gpu)
        if not unlimited:
            remaining -= int((phy2log != old).sum()) - spent_before
    # 3. a layer still far off may take the fresh placement relabelled onto the old
    #    GPUs, when the budget allows it
    peak = peak_load(phy2log, load, num_gpus)
    behind = np.flatnonzero(loaded & (peak > target))
    # (a relabelled refit changes well over half of a layer's slots, so a budget below
    # that cannot pay for one and the matching is not even tried)
    if behind.size and (unlimited or remaining >= num_slots // 2):
        relabelled = keep_in_place(old[behind], fresh[behind], num_gpus, load.shape[1])
        extra = (relabelled != old[behind]).sum(axis=1) - (phy2log[behind] != old[behind]).sum(1)
        better = peak_load(relabelled, load[behind], num_gpus) < peak[behind]
        for i in np.flatnonzero(better):
            if unlimited or extra[i] <= remaining:
                phy2log[behind[i]] = relabelled[i]
                remaining -= int(extra[i])
    # 4. never hand back a layer worse than it was
    worse = peak_load(phy2log, load, num_gpus) > peak_load(old, load, num_gpus)
    phy2log[worse] = old[worse]
    return phy2log
