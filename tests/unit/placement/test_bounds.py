from __future__ import annotations

import numpy as np
import pytest

from rebalancer.placement import (
    balancedness_per_layer,
    compute_placement,
    lower_bound_balancedness,
)
from rebalancer.placement.bounds import lower_bound_balancedness_per_layer, max_load_lower_bound

from .conftest import LAYOUTS


def test_uniform_load_bound_is_one():
    assert lower_bound_balancedness(np.ones((3, 16)), 16, 4) == pytest.approx(1.0)


def test_single_hot_expert_limits_balance():
    # 4 experts on 4 GPUs, no spare slot: the hot expert's GPU carries 10 of 13
    load = np.array([[10.0, 1.0, 1.0, 1.0]])
    assert max_load_lower_bound(load, 4, 4)[0] == pytest.approx(10.0)  # one slot per GPU
    assert lower_bound_balancedness(load, 4, 4) == pytest.approx(13 / 4 / 10)
    # with 4 spare slots the hot expert splits (10/5 = 2), so only the mean is left
    assert max_load_lower_bound(load, 8, 4)[0] == pytest.approx(13 / 4)


def test_zero_layers_are_skipped():
    load = np.zeros((2, 8))
    load[1] = [8, 0, 0, 0, 0, 0, 0, 0]
    per_layer = lower_bound_balancedness_per_layer(load, 8, 4)
    assert np.isnan(per_layer[0])
    assert per_layer[1] == pytest.approx(0.25)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_placement_beats_the_bound(deepseek, layout):
    num_slots, num_gpus, num_nodes, num_groups = layout
    for load in deepseek.values():
        bound = lower_bound_balancedness(load, num_slots, num_gpus, num_nodes, num_groups)
        for algorithm in ("greedy", "balanced"):
            result = compute_placement(
                load, num_slots, num_gpus, num_nodes, num_groups, algorithm=algorithm
            )
            assert result.balancedness <= bound + 1e-9


def test_bound_counts_the_partners_of_the_largest_replica():
    # no spare slot, two slots per GPU: the hot expert's GPU also holds a load >= 1
    load = np.array([[10.0, 1.0, 1.0, 1.0]])
    assert max_load_lower_bound(load, 4, 2)[0] == pytest.approx(11.0)
    assert lower_bound_balancedness(load, 4, 2) == pytest.approx(6.5 / 11)
    result = compute_placement(load, 4, 2)
    assert result.balancedness == pytest.approx(6.5 / 11)


@pytest.mark.parametrize("seed", range(3))
def test_bound_is_valid_on_random_loads(seed):
    rng = np.random.default_rng(seed)
    load = np.floor(rng.pareto(1.0, size=(4, 12)) * 10) + 1
    for slots, gpus in ((12, 4), (24, 4), (24, 6)):
        bound = lower_bound_balancedness_per_layer(load, slots, gpus)
        for algorithm in ("greedy", "balanced"):
            per_layer = compute_placement(load, slots, gpus, algorithm=algorithm)
            assert (balancedness_per_layer(per_layer.phy2log, load, gpus) <= bound + 1e-9).all()


def test_hierarchical_bound_sees_the_busiest_node():
    # 4 groups of 2 experts on 2 nodes: groups weigh 10, 1, 1, 1 -> best node pair 11
    load = np.array([[5.0, 5.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    flat = max_load_lower_bound(load, 16, 4)[0]
    nested = max_load_lower_bound(load, 16, 4, num_nodes=2, num_groups=4)[0]
    assert flat == pytest.approx(13 / 4)
    assert nested == pytest.approx(11 / 2)
    result = compute_placement(load, 16, 4, 2, 4)
    assert result.balancedness <= (13 / 4) / nested + 1e-9
