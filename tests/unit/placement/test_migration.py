"""Migration-aware placement: budgets, balance reached, transfer lists."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.placement import (
    balancedness,
    compute_placement,
    logcnt_of,
    moved_fraction,
    transfers,
)

from .conftest import random_load


@pytest.fixture(scope="module")
def pair(deepseek):
    """Fit on decode, re-plan for a long-prefill workload."""
    first = deepseek["decode_in1000out1000"]
    second = deepseek["prefill_in4096"]
    fitted = compute_placement(first, 288, 32, 4)
    return first, second, fitted


def test_replan_reaches_balance_with_few_moves(pair):
    _, second, fitted = pair
    stale = balancedness(fitted.phy2log, second, 32)
    result = compute_placement(second, 288, 32, 4, previous=fitted.phy2log)
    assert result.algorithm == "migration"
    assert stale < 0.8
    assert result.balancedness >= 0.98
    assert result.moved_fraction <= 0.25
    assert result.moved_fraction == pytest.approx(moved_fraction(fitted.phy2log, result.phy2log))
    assert (logcnt_of(result.phy2log, 256) >= 1).all()


@pytest.mark.parametrize("budget", [0.0, 0.01, 0.05, 0.1, 0.2])
def test_budget_is_honoured(pair, budget):
    _, second, fitted = pair
    result = compute_placement(
        second, 288, 32, 4, previous=fitted.phy2log, max_moved_fraction=budget
    )
    assert result.moved_fraction <= budget + 1e-12
    assert (logcnt_of(result.phy2log, 256) >= 1).all()
    # a budget never makes things worse than standing still
    assert result.balancedness >= balancedness(fitted.phy2log, second, 32) - 1e-12


def test_more_budget_buys_more_balance(pair):
    _, second, fitted = pair
    figures = [
        compute_placement(second, 288, 32, 4, previous=fitted.phy2log, max_moved_fraction=b)
        for b in (0.02, 0.1, 0.3)
    ]
    assert figures[0].balancedness < figures[1].balancedness < figures[2].balancedness


def test_same_load_moves_nothing(deepseek):
    load = deepseek["prefill_in1024"]
    fitted = compute_placement(load, 288, 32, 4)
    again = compute_placement(load, 288, 32, 4, previous=fitted.phy2log)
    assert again.moved_fraction == 0.0
    assert (again.phy2log == fitted.phy2log).all()


@pytest.mark.parametrize("seed", range(5))
def test_random_migration_is_valid(seed):
    old_load, new_load = random_load(seed, experts=16), random_load(seed + 50, experts=16)
    old = compute_placement(old_load, 24, 4).phy2log
    for budget in (None, 0.1, 0.5):
        result = compute_placement(new_load, 24, 4, previous=old, max_moved_fraction=budget)
        assert (logcnt_of(result.phy2log, 16) >= 1).all()
        if budget is not None:
            assert result.moved_fraction <= budget + 1e-12


def apply(old, rows, per_gpu):
    """What the workers do with a transfer list: copy old slots into new ones."""
    new = old.copy()
    for layer, dst_rank, dst_slot, src_rank, src_slot in rows:
        new[layer, dst_rank * per_gpu + dst_slot] = old[layer, src_rank * per_gpu + src_slot]
    return new


def test_transfers_rebuild_the_new_placement(pair):
    _, second, fitted = pair
    new = compute_placement(second, 288, 32, 4, previous=fitted.phy2log).phy2log
    rows = transfers(fitted.phy2log, new, 32, 4)
    assert rows.dtype == np.int32 and rows.shape[1] == 5
    assert len(rows) == int((fitted.phy2log != new).sum())
    assert (rows[:, 2] < 9).all() and (rows[:, 4] < 9).all() and (rows[:, [1, 3]] < 32).all()
    assert (apply(fitted.phy2log, rows, 9) == new).all()
    # every row really changes its destination
    dst = rows[:, 1].astype(np.int64) * 9 + rows[:, 2]
    assert (fitted.phy2log[rows[:, 0], dst] != new[rows[:, 0], dst]).all()


def test_transfers_prefer_same_rank_then_node_and_spread():
    # 2 nodes x 2 GPUs x 2 slots; expert 0 lives on GPU 0 and GPU 3
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 0]])
    new = np.array([[0, 0, 0, 3, 0, 5, 0, 0]])
    rows = transfers(old, new, 4, 2)
    by_dst = {(int(r[1]), int(r[2])): (int(r[3]), int(r[4])) for r in rows}
    assert by_dst[(0, 1)] == (0, 0)  # same rank
    assert by_dst[(1, 0)] == (0, 0)  # same node
    assert by_dst[(3, 0)] == (3, 1)  # same rank
    assert by_dst[(2, 0)] == (3, 1)  # same node (GPU 2 and 3 are node 1)
    assert len(rows) == 4


def test_transfers_spread_over_replicas():
    # expert 0 on GPUs 0 and 1 of a node; four other GPUs in another node want it
    old = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    new = np.array([[0, 1, 0, 2, 0, 4, 0, 6, 0, 8, 0, 10]])
    rows = transfers(old, new, 6, 2)
    sources = sorted(int(r[3]) for r in rows)
    assert sources == [0, 0, 1, 1]


def test_no_transfers_without_change():
    p2l = np.tile(np.arange(8), (3, 1))
    assert transfers(p2l, p2l, 4).shape == (0, 5)


def test_byte_budget(pair):
    _, second, fitted = pair
    expert_bytes = 44 * 2**20  # one DeepSeek-V3 expert in fp8, roughly
    slots = 500
    result = compute_placement(
        second,
        288,
        32,
        4,
        previous=fitted.phy2log,
        max_moved_bytes=slots * expert_bytes + expert_bytes // 2,
        expert_bytes=expert_bytes,
    )
    assert int((result.phy2log != fitted.phy2log).sum()) <= slots
    both = compute_placement(
        second,
        288,
        32,
        4,
        previous=fitted.phy2log,
        max_moved_fraction=0.01,
        max_moved_bytes=10**15,
        expert_bytes=expert_bytes,
    )
    assert both.moved_fraction <= 0.01
    with pytest.raises(InputError, match="go together"):
        compute_placement(second, 288, 32, 4, previous=fitted.phy2log, max_moved_bytes=1)
