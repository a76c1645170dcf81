from __future__ import annotations

import numpy as np
import pytest

from rebalancer.placement import compute_placement, lower_bound_balancedness
from rebalancer.placement.bounds import lower_bound_balancedness_per_layer, max_load_lower_bound

from .conftest import LAYOUTS


def test_uniform_load_bound_is_one():
    assert lower_bound_balancedness(np.ones((3, 16)), 16, 4) == pytest.approx(1.0)


def test_single_hot_expert_limits_balance():
    # 4 experts on 4 GPUs, no spare slot: the hot expert's GPU carries 10 of 13
    load = np.array([[10.0, 1.0, 1.0, 1.0]])
    assert max_load_lower_bound(load, 4, 4)[0] == pytest.approx(10.0)
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
        bound = lower_bound_balancedness(load, num_slots, num_gpus, num_nodes)
        for algorithm in ("greedy", "balanced"):
            result = compute_placement(
                load, num_slots, num_gpus, num_nodes, num_groups, algorithm=algorithm
            )
            assert result.balancedness <= bound + 1e-9
