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


def _lp_relaxation_max_load(weight: np.ndarray, num_gpus: int, per_gpu: int) -> float:
    """The natural LP relaxation of placement, solved by HiGHS: x[e, g] share of expert
    e's load on GPU g, y[e, g] its (fractional) slot there; min T subject to every load
    placed, x <= y, at most `per_gpu` slots per GPU, every GPU's load <= T."""
    from scipy.optimize import linprog

    E, G = len(weight), num_gpus
    n = 2 * E * G + 1  # x, y, T
    x = lambda e, g: e * G + g  # noqa: E731
    y = lambda e, g: E * G + e * G + g  # noqa: E731
    a_ub, b_ub, a_eq, b_eq = [], [], [], []
    for e in range(E):
        row = np.zeros(n)
        row[[x(e, g) for g in range(G)]] = 1
        a_eq.append(row)
        b_eq.append(1.0)
        for g in range(G):
            row = np.zeros(n)
            row[x(e, g)], row[y(e, g)] = 1, -1
            a_ub.append(row)
            b_ub.append(0.0)
    for g in range(G):
        row = np.zeros(n)
        row[[y(e, g) for e in range(E)]] = 1
        a_ub.append(row)
        b_ub.append(per_gpu)
        row = np.zeros(n)
        row[[x(e, g) for e in range(E)]] = weight
        row[-1] = -1
        a_ub.append(row)
        b_ub.append(0.0)
    cost = np.zeros(n)
    cost[-1] = 1
    res = linprog(
        cost,
        A_ub=np.array(a_ub),
        b_ub=b_ub,
        A_eq=np.array(a_eq),
        b_eq=b_eq,
        bounds=[(0, 1)] * (2 * E * G) + [(0, None)],
        method="highs",
    )
    assert res.status == 0
    return float(res.fun)


@pytest.mark.parametrize("seed", range(3))
def test_lp_relaxation_only_restates_the_mean_and_our_bound_is_stronger(seed):
    # Why bounds.py has no LP: with GPUs alike, HiGHS's optimum of the LP relaxation is
    # total / G on every input, while the combinatorial bound is at least that and
    # strictly above it on skewed loads.
    rng = np.random.default_rng(seed)
    weight = rng.pareto(1.2, size=6) * 100 + 1
    num_gpus, per_gpu = 3, 3
    lp = _lp_relaxation_max_load(weight, num_gpus, per_gpu)
    assert lp == pytest.approx(weight.sum() / num_gpus, rel=1e-7)
    ours = max_load_lower_bound(weight[None, :], num_gpus * per_gpu, num_gpus)[0]
    assert ours >= lp * (1 - 1e-12)
    skewed = np.array([100.0, 1, 1, 1, 1, 1])
    # no spare slot: the hot expert cannot split, so some GPU carries >= 100; the LP
    # spreads it over fractional slots and says 35
    assert _lp_relaxation_max_load(skewed, 3, 2) == pytest.approx(35.0)
    assert max_load_lower_bound(skewed[None, :], 6, 3)[0] >= 100.0
