"""Survivor placements (rebalancer.placement.survivors) on the shipped DeepSeek-V3 routing
data: G = 32 in 4 nodes of 8, P = 288 (9 slots a GPU) and P = 352 (11)."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.datasets import deepseek_v3_files, load_deepseek_v3
from rebalancer.placement import balancedness, compute_placement, logcnt_of
from rebalancer.placement.survivors import (
    rehome_lost,
    repair_placement,
    surviving_slots,
    survivor_placement,
    survivor_placements,
)

G, N = 32, 4


@pytest.fixture(scope="module")
def deepseek() -> tuple[np.ndarray, np.ndarray]:
    load = load_deepseek_v3(deepseek_v3_files()[4]).astype(
        np.float64
    )  # prefill_in4096: the most skewed
    return load, compute_placement(load, 288, G, N).phy2log


def test_every_rank_loss_keeps_every_expert_balanced_and_moves_little(
    deepseek: tuple[np.ndarray, np.ndarray],
) -> None:
    load, healthy = deepseek
    losses = [(g,) for g in range(0, G, 4)]
    plans = survivor_placements(load, healthy, G, losses)
    before = balancedness(healthy, load, G)
    fresh = compute_placement(
        load, 279, G - 1
    ).phy2log  # SGLang's path: from scratch on the survivors
    for plan in plans:
        assert (
            plan.feasible
            and plan.phy2log is not None
            and plan.phy2log.shape == (load.shape[0], 279)
        )
        assert (logcnt_of(plan.phy2log, 256) >= 1).all()  # every expert still served
        repair = repair_placement(healthy, G, plan.lost, 256)
        assert repair is not None
        assert plan.balancedness > balancedness(repair, load, G - 1)
        kept = healthy[:, surviving_slots(288, G, plan.lost)]
        assert plan.slots_moved == int((plan.phy2log != kept).sum())
        assert plan.slots_moved <= 0.25 * int((fresh != kept).sum())
    assert np.mean([p.balancedness for p in plans]) >= 0.95 * before


def test_a_node_loss_at_9_slots_a_gpu_cannot_serve_every_expert_and_says_so(
    deepseek: tuple[np.ndarray, np.ndarray],
) -> None:
    load, healthy = deepseek
    plan = survivor_placement(load, healthy, G, tuple(range(8, 16)))
    assert not plan.feasible and plan.unserved == 256 - 216
    assert plan.from_storage > 0


def test_a_node_loss_at_11_slots_a_gpu_is_planned(deepseek: tuple[np.ndarray, np.ndarray]) -> None:
    load, _ = deepseek
    healthy = compute_placement(load, 352, G, N).phy2log
    plan = survivor_placement(load, healthy, G, tuple(range(24, 32)))
    assert plan.feasible and plan.phy2log is not None and plan.phy2log.shape == (load.shape[0], 264)
    assert (logcnt_of(plan.phy2log, 256) >= 1).all()
    assert plan.balancedness >= 0.9 * balancedness(healthy, load, G)


def test_rehoming_gives_each_lost_expert_one_slot_from_a_spare_replica() -> None:
    # one layer, 4 experts, 2 GPUs of 3 slots: expert 3 lost, expert 0 has two replicas
    phy2log = np.array([[0, 0, 1, 2, 1, 2]])
    load = np.array([[10.0, 1.0, 1.0, 5.0]])
    out = rehome_lost(phy2log.copy(), load, per_gpu=3)
    assert sorted(out[0].tolist()) != sorted(phy2log[0].tolist())
    assert (logcnt_of(out, 4) >= 1).all()
    assert int((out != phy2log).sum()) == 1  # one slot changed: the lost expert's


def test_the_lost_gpus_are_dropped_and_the_order_of_the_others_kept() -> None:
    assert surviving_slots(8, 4, (1,)).tolist() == [0, 1, 4, 5, 6, 7]
    assert surviving_slots(8, 4, (0, 3)).tolist() == [2, 3, 4, 5]
