"""Two ranks told to commit at different steps switch at one step (invariant 2), the
later one's: a rank ready early waits for the agreement, never switches alone.

Two gloo processes, each the real hook (plan driver, executor moving the weights between
the ranks over p2p, the commit agreement on its own group); the Commit reaches rank 0 at
step 2 and rank 1 at step 9, as two links that deliver it apart would. The agent is
built, not started (no controller): the test calls the plan handlers the agent would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rebalancer.placement import transfers, trivial_placement
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import CommitConfig, HookConfig, Link, RebalanceHook, WindowConfig

L, E, P, G = 2, 4, 6, 2
COMMIT_AT = {0: 2, 1: 9}
STEPS = 24


def _prepare(old: np.ndarray, new: np.ndarray) -> pb.Prepare:
    msg = pb.Prepare(version=1, base_version=0)
    msg.placement.phy2log.CopyFrom(codec.encode(new.astype(np.int32)))
    msg.transfers.CopyFrom(codec.encode(transfers(old, new, G, 1).astype(np.int32)))
    return msg


def _rank(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=G)
    try:
        config = HookConfig(
            link=Link("127.0.0.1:1", deployment="d"),
            rank=rank,
            shape=ClusterShape(
                num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0
            ),
            windows=WindowConfig(steps=10**6),
            commit=CommitConfig(agree_every=2),
        )
        old = trivial_placement(L, E, P, G)
        new = np.stack([np.roll(old[layer], 1) for layer in range(L)])  # experts cross ranks
        S = P // G
        weights = {
            "w": torch.tensor(
                [[float(old[layer, rank * S + s]) for s in range(S)] for layer in range(L)]
            ).reshape(L, S, 1)
        }
        hook = RebalanceHook(
            config, old, weights, dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        )
        hook.plans._prepare(_prepare(old, new))  # both ranks: the transfers pair up
        assert hook.stats.prepared == 1, hook.stats
        versions = []
        for step in range(STEPS):
            if step == COMMIT_AT[rank]:
                hook.plans.on_commit(1)
            hook.step_end()
            versions.append(hook.version)
        served = hook.phy2log[:, rank * S : (rank + 1) * S]
        match = bool(np.array_equal(weights["w"][..., 0].numpy(), served.astype(np.float32)))
        hook.agreement.close()
        np.save(f"{out}/{rank}.npy", np.array([*versions, int(match)]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_ready_at_different_steps_switch_at_the_same_step(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=G, join=True)
    r0, r1 = (np.load(tmp_path / f"{r}.npy") for r in range(G))
    assert r0[-1] == 1 and r1[-1] == 1  # each rank's weights are what its map says
    v0, v1 = list(r0[:-1]), list(r1[:-1])
    assert v0 == v1, f"rank 0 served {v0}, rank 1 {v1}"
    switched = v0.index(1)
    assert switched >= COMMIT_AT[1] and v0[-1] == 1  # not before the later rank was told
