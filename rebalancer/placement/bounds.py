"""How good a placement could possibly be.

Every placement reports its gap to these bounds, so an operator can tell "the load is
hard" from "the algorithm is weak". Per layer, the max GPU load of any placement is at
least the mean (total / G) and at least the smallest possible max replica load (the
greedy replication is optimal for that); the GPU holding that replica also fills its
other S - 1 slots, each with at least the smallest replica any expert can have.

A linear relaxation that treats GPUs alike adds nothing: averaging any fractional
solution over GPU permutations gives every GPU total / G, so it only restates the mean.
"""

from __future__ import annotations

import numpy as np

from rebalancer.placement.greedy import replicate_greedy
from rebalancer.placement.hierarchical import uses_hierarchy
from rebalancer.placement.metrics import mean_balancedness
from rebalancer.placement.types import check_layout, check_load


def max_load_lower_bound(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    replication: bool = True,
) -> np.ndarray:
    """Per layer, a value no placement's max GPU load can go below (no hierarchical
    placement, when the groups put it in hierarchical mode).

    replication=False leaves out the largest-replica term (steps 2-3), which costs a
    replication; what remains is still a bound, only a weaker one, for callers that
    only need to know whether a peak is near the bound.

    load: [L, E] float64. Returns: [L] float64.
    """
    # 1. the mean: the load has to go somewhere
    bound = load.sum(axis=1) / num_gpus
    if replication:
        # 2. some GPU carries the largest replica; greedy replication minimises that
        _, logcnt = replicate_greedy(load, num_slots)
        largest_replica = (load / logcnt).max(axis=1)
        # 3. ... and S - 1 more replicas, none below an expert's load over its most
        #    replicas
        most_replicas = 1 + num_slots - load.shape[1]
        smallest_replica = load.min(axis=1) / most_replicas
        per_gpu = num_slots // num_gpus
        bound = np.maximum(bound, largest_replica + (per_gpu - 1) * smallest_replica)
    # 4. hierarchical: whole groups per node, so the busiest node's load spreads over
    #    its G/N GPUs at best; two groups per node are best paired heaviest-lightest
    if uses_hierarchy(load.shape[1], num_nodes, num_groups):
        assert num_groups is not None
        group = np.sort(load.reshape(load.shape[0], num_groups, -1).sum(axis=2), axis=1)
        per_node = num_groups // num_nodes
        node = np.maximum(
            group.sum(axis=1) / num_nodes,
            group[:, -1] + (per_node - 1) * group[:, 0],
        )
        if per_node == 2:
            node = np.maximum(node, (group + group[:, ::-1]).max(axis=1))
        if per_node == 1:
            node = np.maximum(node, group[:, -1])
        bound = np.maximum(bound, node / (num_gpus // num_nodes))
    return bound


def lower_bound_balancedness_per_layer(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
) -> np.ndarray:
    """Best reachable balancedness per layer (NaN for layers without load); with
    num_groups in hierarchical mode, best reachable by a hierarchical placement.

    load: [L, E]. Returns: [L] float64.
    """
    load_arr = check_load(load)
    check_layout(load_arr.shape[1], num_slots, num_gpus, num_nodes)
    bound = max_load_lower_bound(load_arr, num_slots, num_gpus, num_nodes, num_groups)
    mean = load_arr.sum(axis=1) / num_gpus
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(bound > 0, mean / bound, np.nan)


def lower_bound_balancedness(
    load: np.ndarray,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
) -> float:
    """Best reachable balancedness, averaged over layers with load (an upper limit on
    what any placement achieves; "lower bound" refers to the max GPU load). It costs
    about as much as one replication, so a decision loop can afford it.

    load: [L, E].
    """
    return mean_balancedness(
        lower_bound_balancedness_per_layer(load, num_slots, num_gpus, num_nodes, num_groups)
    )
