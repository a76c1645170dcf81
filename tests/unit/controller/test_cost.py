"""The one migration-cost model: its arithmetic, its defaults, and who uses it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rebalancer.controller import cost
from rebalancer.controller.cost import (
    DEFAULT_COST,
    REFERENCE,
    CostParams,
    commit_pause_seconds,
    derived_timing,
    plan_cost,
    rank_receive_seconds,
    reference_transfers,
    transfer_seconds,
)
from rebalancer.controller.decide import PolicyConfig, decide
from rebalancer.errors import InputError
from rebalancer.placement import transfers, trivial_placement
from rebalancer.wire.layout import DST_RANK, SRC_RANK
from rebalancer.wire.shape import ClusterShape

PARAMS = CostParams(intra_node_gbps=100.0, inter_node_gbps=10.0, commit_gbps=1000.0)
# 4 GPUs on 2 nodes: rank 0 receives one expert from its node and one from the other
# node; rank 3 copies one of its own experts (free to transfer, not to commit).
ROWS = np.array([[0, 0, 0, 1, 0], [0, 0, 1, 2, 0], [0, 3, 0, 3, 1]])


def test_transfer_time_is_set_by_the_busiest_receiver() -> None:
    per_rank = rank_receive_seconds(ROWS, 4, 2, 10**9, PARAMS)
    np.testing.assert_allclose(per_rank, [1 / 100 + 1 / 10, 0.0, 0.0, 0.0])
    assert transfer_seconds(ROWS, 4, 2, 10**9, PARAMS) == pytest.approx(0.11)
    # One node: both of rank 0's experts come over the intra-node links.
    assert transfer_seconds(ROWS, 4, 1, 10**9, PARAMS) == pytest.approx(2 / 100)


def test_plan_cost_adds_overlap_commit_and_swap() -> None:
    c = plan_cost(ROWS, 4, 2, 10**9, PARAMS)
    assert c.transfer_seconds == pytest.approx(0.11)
    # Commit: rank 0 copies its 2 staged experts (rank 3 only 1) at 1000 GB/s.
    assert c.commit_pause_seconds == pytest.approx(2 / 1000)
    assert c.commit_pause_seconds == commit_pause_seconds(ROWS, 4, 10**9, PARAMS)
    assert c.swap_seconds == PARAMS.swap_seconds
    assert c.bytes_between_gpus == 2 * 10**9
    assert c.seconds == pytest.approx(0.11 * PARAMS.overlap_penalty + 0.002 + PARAMS.swap_seconds)
    empty = plan_cost(np.zeros((0, 5), dtype=np.int64), 4, 2, 10**9, PARAMS)
    assert (empty.seconds, empty.transfer_seconds, empty.bytes_between_gpus) == (0.0, 0.0, 0)
    with pytest.raises(InputError, match=r"\[K, 5\]"):
        plan_cost(np.zeros((3, 4)), 4, 2, 10**9, PARAMS)


def test_params_are_validated() -> None:
    DEFAULT_COST.validate()
    for change in (
        {"intra_node_gbps": 0.0},
        {"overlap_penalty": 1.5},
        {"swap_seconds": -1.0},
        {"step_seconds": math.nan},
        {"commit_gbps": True},
    ):
        with pytest.raises(InputError):
            dataclasses.replace(DEFAULT_COST, **change).validate()


def test_policy_defaults_are_the_cost_model() -> None:
    """No second literal: PolicyConfig's cost section defaults to DEFAULT_COST, its timing
    fields to what the model derives, and the flat setting names reach the section."""
    policy = PolicyConfig()
    assert policy.cost == DEFAULT_COST
    # link_bandwidth_gbps (proto field 9) is the inter-node figure.
    assert policy.to_flat()["link_bandwidth_gbps"] == DEFAULT_COST.inter_node_gbps
    timing = derived_timing(
        policy.estimator.decay, policy.gain_threshold, policy.max_moved_fraction
    )
    assert policy.min_interval_seconds == timing.min_interval_seconds
    assert policy.decision_period_seconds == timing.decision_period_seconds
    changed = PolicyConfig().with_settings(
        dict(link_bandwidth_gbps=5.0, intra_node_gbps=50.0, swap_seconds=0.0)
    )
    assert changed.cost == dataclasses.replace(
        DEFAULT_COST, inter_node_gbps=5.0, intra_node_gbps=50.0, swap_seconds=0.0
    )


def test_derived_timing_arithmetic() -> None:
    t = derived_timing(decay=0.3, gain_threshold=0.02, max_moved_fraction=0.25)
    # The reference plan: every rank receives 25% of its 9 slots in each of 58 layers,
    # 24 of every 31 experts across nodes.
    rows = reference_transfers(REFERENCE, 0.25)
    per_rank = np.bincount(rows[:, DST_RANK], minlength=REFERENCE.shape.num_gpus)
    assert set(per_rank.tolist()) == {130}
    assert not np.any(rows[:, DST_RANK] == rows[:, SRC_RANK])
    expected = plan_cost(rows, 32, 4, REFERENCE.shape.expert_bytes, DEFAULT_COST)
    assert t.plan == expected
    assert 0.2 < expected.transfer_seconds < 0.25 and 0.03 < expected.seconds < 0.05
    # The estimate's half-life: 0.58 windows at decay 0.3.
    half_life = math.log(2) / math.log(1 / 0.3)
    assert t.half_life_windows == pytest.approx(half_life)
    # Min interval: the plan's cost repaid at the threshold's gain (2.13 s), at least one
    # window plus the half-life (1.58 s), rounded up to 0.1 s.
    assert t.repay_seconds == pytest.approx(expected.seconds / 0.02)
    assert t.settle_seconds == pytest.approx(1 + half_life)
    assert t.min_interval_seconds == math.ceil(t.repay_seconds * 10) / 10 == pytest.approx(2.2)
    # Decision period: the half-life, at least one window: every window.
    assert t.decision_period_seconds == REFERENCE.window_seconds
    slow = derived_timing(decay=0.9, gain_threshold=0.02, max_moved_fraction=0.25)
    assert slow.decision_period_seconds == pytest.approx(6.6)  # 6.58 windows, rounded up
    assert slow.min_interval_seconds == pytest.approx(7.6)  # settling binds: 7.58 windows
    # Five-second windows: settling binds (7.9 s) and a decision on every window (5 s).
    five = derived_timing(
        0.3, 0.02, 0.25, deployment=dataclasses.replace(REFERENCE, window_seconds=5.0)
    )
    assert (five.min_interval_seconds, five.decision_period_seconds) == (7.9, 5.0)
    # The sliding mean of N windows moves half-way in N / 2.
    sliding = derived_timing(0.3, 0.02, 0.25, estimate_window=6)
    assert sliding.half_life_windows == 3.0 and sliding.decision_period_seconds == 3.0
    # A slower link or a lower threshold: a longer interval.
    slower = derived_timing(0.3, 0.02, 0.25, dataclasses.replace(DEFAULT_COST, inter_node_gbps=5.0))
    assert slower.min_interval_seconds > t.min_interval_seconds
    assert derived_timing(0.3, 0.01, 0.25).min_interval_seconds > t.min_interval_seconds


def test_policy_timing_for_a_deployment_and_its_windows() -> None:
    reference = REFERENCE.shape
    policy = PolicyConfig()
    assert policy.for_windows(reference, REFERENCE.window_seconds) == policy
    five = policy.for_windows(reference, 5.0)
    assert (five.min_interval_seconds, five.decision_period_seconds) == (7.9, 5.0)
    assert (
        dataclasses.replace(five, min_interval_seconds=2.2, decision_period_seconds=1.0) == policy
    )
    # One GPU moves nothing: settling alone sets the interval.
    single = ClusterShape(num_layers=2, num_logical=4, num_slots=4, num_gpus=1)
    assert policy.for_windows(single, 1.0).min_interval_seconds == 1.6
    with pytest.raises(InputError):
        policy.for_windows(reference, 0.0)


def test_decide_charges_the_plan_cost_of_its_transfers() -> None:
    L, E, P, G, N = 4, 16, 24, 4, 2
    shape = ClusterShape(
        num_layers=L, num_logical=E, num_slots=P, num_gpus=G, num_nodes=N, expert_bytes=10**8
    )
    load = np.random.default_rng(0).pareto(1.2, size=(L, E)) * 1000 + 10
    current = trivial_placement(L, E, P, G)
    policy = PolicyConfig(
        max_moved_fraction=1.0, cost=CostParams(inter_node_gbps=7.0, intra_node_gbps=70.0)
    )
    d = decide(load, current, shape, policy, now=0.0, last_rebalance=None, windows=10, forced=True)
    assert d.candidate is not None
    rows = np.asarray(transfers(current, d.candidate, G, N))
    c = plan_cost(rows, G, N, shape.expert_bytes, policy.cost)
    assert d.migration_cost_seconds == c.seconds
    assert d.transfer_seconds == c.transfer_seconds
    assert d.bytes_to_move == c.bytes_between_gpus
    assert d.predicted_gain_seconds == pytest.approx(
        policy.horizon_seconds
        * (cost.imbalance_ratio(current, load, G) - cost.imbalance_ratio(d.candidate, load, G))
    )
