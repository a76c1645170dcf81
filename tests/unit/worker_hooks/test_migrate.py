"""MigrationExecutor over real gloo processes: after prepare + commit every slot
holds exactly the expert the new placement says; abort leaves weights untouched."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rebalancer.placement import transfers, trivial_placement
from worker_hooks.migrate import MigrationExecutor

L, E, P, G = 5, 8, 12, 3
S = P // G


def expert_value(layer: int, expert: int) -> torch.Tensor:
    return torch.full((2, 3), float(layer * 100 + expert))


def weights_for(phy2log: np.ndarray, rank: int) -> dict[str, torch.Tensor]:
    w = torch.stack([torch.stack([expert_value(layer, int(phy2log[layer, rank * S + s])) for s in range(S)]) for layer in range(L)])
    return {"w1": w.clone(), "w2": (w * -1).clone()}


def _worker(rank: int, init: str, old: np.ndarray, new: np.ndarray, moves: np.ndarray, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=G)
    group = dist.new_group(backend="gloo")
    weights = weights_for(old, rank)
    ex = MigrationExecutor(rank, G, weights, group, layers_per_chunk=2, rounds_in_flight=2)
    # Plan 1 is aborted after preparing: nothing may change.
    ex.prepare(1, moves)
    ex.abort(1)
    same = all(torch.equal(weights[k], weights_for(old, rank)[k]) for k in weights)
    stats = ex.prepare(2, moves)
    before_commit_same = torch.equal(weights["w1"], weights_for(old, rank)["w1"])
    ex.commit(2)
    ok = all(torch.equal(weights[k], weights_for(new, rank)[k]) for k in weights)
    np.save(f"{out}/{rank}.npy", np.array([same, before_commit_same, ok, stats.experts_received]))
    dist.destroy_process_group()


def test_prepare_commit_abort_across_three_ranks() -> None:
    rng = np.random.default_rng(0)
    old = trivial_placement(L, E, P, G)
    new = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    moves = transfers(old, new, G, 1)
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'rdzv')}"
        mp.spawn(_worker, args=(init, old, new, moves, out), nprocs=G, join=True)
        results = [np.load(f"{out}/{r}.npy") for r in range(G)]
    for same, before_commit_same, ok, _received in results:
        assert same and before_commit_same and ok
    assert sum(int(r[3]) for r in results) == len(moves)
