"""The packed P2P exchange harness (bench/p2p_exchange.py) on 2 gloo ranks: every
moved slot ends up holding exactly the source slot's weights, local moves included."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.p2p_exchange import packed_exchange
from rebalancer.launch.processes import free_port

LAYERS, SLOTS = 3, 5


def _plan() -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = []
    for layer in range(LAYERS):
        for dst in range(2):
            for dst_slot in rng.choice(SLOTS, 3, replace=False):
                rows.append(
                    (
                        layer,
                        dst,
                        int(dst_slot),
                        int(rng.integers(0, 2)),
                        int(rng.integers(0, SLOTS)),
                    )
                )
    return np.array(rows, dtype=np.int32)


def _weights(rank: int) -> dict[str, torch.Tensor]:
    return {
        "w13": torch.arange(LAYERS * SLOTS * 4, dtype=torch.float32).view(LAYERS, SLOTS, 4)
        + 1000 * rank,
        "w2": torch.arange(LAYERS * SLOTS * 6, dtype=torch.float32).view(LAYERS, SLOTS, 2, 3)
        + 1000 * rank,
    }


def _worker(rank: int, port: int, result: dict) -> None:  # type: ignore[type-arg]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    weights = _weights(rank)
    plan = _plan()
    staged = packed_exchange(rank, 2, weights, plan, dist.group.WORLD, chunk_experts=2)
    for k, w in weights.items():  # commit: staged rows into their flat rows, in place
        w.view(LAYERS * SLOTS, *w.shape[2:]).index_copy_(0, staged.dst_rows, staged.tensors[k])
    origin = [_weights(r) for r in range(2)]
    wrong = 0
    for layer, dst, dst_slot, src, src_slot in plan:
        if dst != rank:
            continue
        for k in weights:
            wrong += int(
                not torch.equal(weights[k][layer, dst_slot], origin[src][k][layer, src_slot])
            )
    result[rank] = (wrong, int((plan[:, 1] == rank).sum()), staged.bytes_received)
    dist.destroy_process_group()


def test_packed_exchange_moves_the_right_experts() -> None:
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_worker, args=(free_port(), result), nprocs=2, join=True)
        got = dict(result)
    plan = _plan()
    for rank in range(2):
        wrong, incoming, received = got[rank]
        assert incoming > 0 and wrong == 0
        remote = int(((plan[:, 1] == rank) & (plan[:, 3] != rank)).sum())
        assert received == remote * (4 + 6) * 4
