"""Warm start in the hook (HookConfig.pool, a PoolConfig): the pool placement offered at Register is
installed in `start`, before the first step; without a controller, or with a rank that
cannot load it, the rank starts on its start placement, waiting no longer than the bound.
(Groups of ranks agreeing on it, through a sidecar: tests/integration/test_pools.py.)"""

from __future__ import annotations

import time

import numpy as np
import torch

from rebalancer.placement import trivial_placement
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import HookConfig, Link, PoolConfig, RebalanceHook

L, E, P, G = 2, 4, 6, 1


def expert(layer: int, e: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1,), float(100 * layer + e))}


def hook(seconds: float, source: object = expert) -> tuple[RebalanceHook, np.ndarray]:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d", pool="p"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
        pool=PoolConfig(seconds),
    )
    start = trivial_placement(L, E, P, G)
    weights = {
        "w": torch.tensor([[[float(100 * layer + e)] for e in start[layer]] for layer in range(L)])
    }
    return RebalanceHook(config, start, weights, None, None, expert_source=source), start  # type: ignore[arg-type]


def offered(start: np.ndarray, version: int = 3) -> tuple[pb.Placement, np.ndarray]:
    new = np.stack([np.roll(start[layer], 1) for layer in range(L)])
    return pb.Placement(version=version, phy2log=codec.encode(new.astype(np.int32))), new


def test_without_a_controller_the_rank_starts_as_without_a_pool_within_the_bound() -> None:
    h, start = hook(0.5)
    t0 = time.monotonic()
    h.start()
    try:
        assert time.monotonic() - t0 < 3.0
        assert h.version == 0 and np.array_equal(h.phy2log, start)
    finally:
        h.stop()


def test_an_offer_is_installed_before_the_first_step_and_reported_committed() -> None:
    h, start = hook(5.0)
    placement, new = offered(start)
    h.agent._offer(placement)  # as the Register answer (or the sidecar's message) delivers it
    h.start()
    try:
        assert h.version == 3 and np.array_equal(h.phy2log, new) and h.step == 0
        # Every slot now holds the expert its map names (weights loaded from the source).
        assert all(
            float(h.weights["w"][layer, s, 0]) == 100 * layer + new[layer, s]
            for layer in range(L)
            for s in range(P)
        )
        # Dispatch goes to the new slots: expert new[0, 0] is served by slot 0.
        phys = h.route(0, torch.tensor([[int(new[0, 0])]]))
        assert int(new[0, int(phys[0, 0])]) == int(new[0, 0])
        assert h.stats.commits == [(0, 3)]
        reports = list(h.agent._reports)
        assert [(r.version, r.phase, r.step) for r in reports] == [(3, pb.PLAN_PHASE_COMMITTED, 0)]
    finally:
        h.stop()


def test_a_rank_that_cannot_load_the_offer_keeps_its_start_placement() -> None:
    def broken(layer: int, e: int) -> dict[str, torch.Tensor]:
        raise OSError("checkpoint shard missing")

    h, start = hook(5.0, broken)
    before = h.weights["w"].clone()
    h.agent._offer(offered(start)[0])
    h.start()
    try:
        assert (
            h.version == 0
            and np.array_equal(h.phy2log, start)
            and torch.equal(h.weights["w"], before)
        )
        assert not list(h.agent._reports)
    finally:
        h.stop()
