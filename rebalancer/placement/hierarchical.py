"""The placement pipeline: expert groups to nodes, replicas within nodes, packing onto GPUs.

DeepSeek's hierarchical EPLB keeps every replica of a group's experts on the node that
hosts the group, so group-limited routing crosses few nodes. With one node (or groups
that do not divide evenly over the nodes) it is the global policy. The replication and
packing steps are arguments, so the greedy baseline and the improved algorithm share
this one pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rebalancer.placement.metrics import gather

# replicate(weight [X, n], num_phy, num_packs) -> (phy2log [X, num_phy], logcnt [X, n])
Replicate = Callable[[np.ndarray, int, int], tuple[np.ndarray, np.ndarray]]
# pack(weight [X, n], num_packs, item_expert [X, n], floor [X] | None) -> item_at [X, n],
# the item in each slot, pack k owning slots [k*c, (k+1)*c); floor is a peak the row's
# layer reaches anyway, so a pack may stop refining a row below it
Pack = Callable[[np.ndarray, int, np.ndarray, "np.ndarray | None"], np.ndarray]


def uses_hierarchy(num_logical: int, num_nodes: int, num_groups: int | None) -> bool:
    """True when groups can be spread evenly over several nodes (the reference's rule)."""
    return (
        num_groups is not None
        and num_nodes > 1
        and num_groups % num_nodes == 0
        and num_logical % num_groups == 0
    )


def place_in_nodes(
    weight: np.ndarray,
    num_slots: int,
    num_gpus: int,
    node_experts: np.ndarray | None,
    replicate: Replicate,
    pack: Pack,
) -> np.ndarray:
    """Replicate and pack each node's own experts onto that node's GPUs.

    weight: [L, E]; node_experts: [L, N, E/N], the experts each node hosts, or None for
    one node holding every expert (the global policy).
    Returns: phy2log [L, P], node n owning slots [n*P/N, (n+1)*P/N).
    """
    num_layers = weight.shape[0]
    if node_experts is None:
        num_nodes, per_node = 1, weight.shape[1]
        node_weight = weight
    else:
        num_nodes, per_node = node_experts.shape[1:]
        # 1. one row per (layer, node): the node's experts and their load
        node_weight = gather(weight, node_experts.reshape(num_layers, -1))
        node_weight = node_weight.reshape(num_layers * num_nodes, per_node)
    # 2. replicate within the node's slot share
    phy2local, localcnt = replicate(node_weight, num_slots // num_nodes, num_gpus // num_nodes)
    # 3. pack the node's replicas onto its GPUs; GPU k owns the k-th run of slots
    replica_weight = gather(node_weight / localcnt, phy2local)
    # a layer's peak is at least its busiest node's mean GPU load
    node_mean = node_weight.sum(axis=1).reshape(num_layers, num_nodes) / (num_gpus // num_nodes)
    floor = np.repeat(node_mean.max(axis=1), num_nodes)
    item_at = pack(replica_weight, num_gpus // num_nodes, phy2local, floor)
    local_by_slot = gather(phy2local, item_at)
    if node_experts is None:
        return local_by_slot
    # 4. back to logical expert ids
    phy2log = gather(node_experts.reshape(num_layers * num_nodes, per_node), local_by_slot)
    return phy2log.reshape(num_layers, num_slots)


def assign_groups(weight: np.ndarray, num_nodes: int, num_groups: int, pack: Pack) -> np.ndarray:
    """Spread expert groups over nodes, the same number of groups on each.

    weight: [L, E] with E % num_groups == 0.
    Returns: node_experts [L, N, E/N], each node's experts, its groups in pack order.
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    group_weight = weight.reshape(num_layers, num_groups, group_size).sum(axis=2)
    group_ids = np.tile(np.arange(num_groups, dtype=np.int64), (num_layers, 1))
    groups_by_node = pack(group_weight, num_nodes, group_ids, None)
    experts = groups_by_node[:, :, None] * group_size + np.arange(group_size)
    return experts.reshape(num_layers, num_nodes, num_logical // num_nodes)


def place(
    weight: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int,
    num_groups: int | None,
    replicate: Replicate,
    pack: Pack,
) -> np.ndarray:
    """Full pipeline; hierarchical when `uses_hierarchy`, otherwise global.

    weight: [L, E]. Returns: phy2log [L, P] int64.
    """
    node_experts = None
    if uses_hierarchy(weight.shape[1], num_nodes, num_groups):
        assert num_groups is not None
        node_experts = assign_groups(weight, num_nodes, num_groups, pack)
    return place_in_nodes(weight, num_slots, num_gpus, node_experts, replicate, pack)
