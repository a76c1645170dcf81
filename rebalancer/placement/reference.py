"""A plain per-item port of DeepSeek's greedy, as the reference and vLLM run it.

It exists as the yardstick: the benchmark times it in the same run as the vectorised
engine, and the tests check that the vectorised greedy reaches the same per-layer max
GPU load. Deliberately loop-by-loop; do not use it in the controller.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.hierarchical import uses_hierarchy


def _replicate(weight: list[float], num_phy: int) -> tuple[list[int], list[int]]:
    """Add one replica at a time to the expert with the highest load per replica."""
    logcnt = [1] * len(weight)
    phy2log = list(range(len(weight)))
    for _ in range(num_phy - len(weight)):
        best = 0
        for e in range(1, len(weight)):
            if weight[e] / logcnt[e] > weight[best] / logcnt[best]:
                best = e
        phy2log.append(best)
        logcnt[best] += 1
    return phy2log, logcnt


def _pack(weight: list[float], num_packs: int) -> list[int]:
    """Heaviest item first onto the lightest pack that still has room."""
    capacity = len(weight) // num_packs
    if capacity == 1:
        return list(range(len(weight)))
    order = sorted(range(len(weight)), key=lambda i: -weight[i])
    pack_load = [0.0] * num_packs
    pack_fill = [0] * num_packs
    pack_of = [0] * len(weight)
    for item in order:
        best = -1
        for k in range(num_packs):
            if pack_fill[k] < capacity and (best < 0 or pack_load[k] < pack_load[best]):
                best = k
        pack_of[item] = best
        pack_load[best] += weight[item]
        pack_fill[best] += 1
    return pack_of


def _slots(pack_of: list[int], num_packs: int) -> list[int]:
    """Slot of each item: pack k owns a run of slots, filled in item order."""
    capacity = len(pack_of) // num_packs
    fill = [0] * num_packs
    slot = [0] * len(pack_of)
    for item, k in enumerate(pack_of):
        slot[item] = k * capacity + fill[k]
        fill[k] += 1
    return slot


def _layer(
    weight: list[float],
    num_slots: int,
    num_gpus: int,
    num_nodes: int,
    num_groups: int,
) -> list[int]:
    num_logical = len(weight)
    group_size = num_logical // num_groups
    # 1. groups onto nodes
    group_weight = [sum(weight[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_of_group = _pack(group_weight, num_nodes)
    node_experts: list[list[int]] = [[] for _ in range(num_nodes)]
    for g in range(num_groups):
        node_experts[node_of_group[g]].extend(range(g * group_size, (g + 1) * group_size))
    phy2log: list[int] = []
    gpus_per_node = num_gpus // num_nodes
    for experts in node_experts:
        # 2. replicas within the node
        local_weight = [weight[e] for e in experts]
        phy2local, cnt = _replicate(local_weight, num_slots // num_nodes)
        # 3. replicas onto the node's GPUs
        item_weight = [local_weight[x] / cnt[x] for x in phy2local]
        slot = _slots(_pack(item_weight, gpus_per_node), gpus_per_node)
        by_slot = [0] * len(phy2local)
        for item, s in enumerate(slot):
            by_slot[s] = experts[phy2local[item]]
        phy2log.extend(by_slot)
    return phy2log


def reference_placement(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
) -> np.ndarray:
    """DeepSeek's greedy one layer and one item at a time.

    load: [L, E]. Returns: phy2log [L, P] int64.
    """
    num_logical = load.shape[1]
    if not uses_hierarchy(num_logical, num_nodes, num_groups):
        num_nodes, num_groups = 1, 1
    assert num_groups is not None
    rows = [
        _layer([float(x) for x in row], num_slots, num_gpus, num_nodes, num_groups)
        for row in np.asarray(load, dtype=np.float64)
    ]
    return np.asarray(rows, dtype=np.int64)
