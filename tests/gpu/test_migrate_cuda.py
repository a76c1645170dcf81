"""MigrationExecutor between two GPUs, every transport (skipped without two GPUs):
NCCL point-to-point, and peers' live weights or outboxes mapped through CUDA IPC and
read by the copy engines. After prepare + commit every slot holds its new expert's weights bit for
bit; an aborted plan leaves the live weights untouched. With spare rows the experts land in
free rows during prepare and the commit copies none."""

from __future__ import annotations

import datetime
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rebalancer.placement import transfers, trivial_placement
from worker_hooks.config import Transport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

L, E, P, G = 6, 16, 24, 2
S = P // G
SHAPE = (64, 96)


def expert(layer: int, e: int, dev: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=dev).manual_seed(layer * 1000 + e)
    return torch.randn(SHAPE, generator=gen, device=dev, dtype=torch.bfloat16)


def live(
    phy2log: np.ndarray, rank: int, dev: torch.device, spare: int = 0
) -> dict[str, torch.Tensor]:
    """Each slot's expert in row = slot, then `spare` free (zero) rows per layer."""
    w = torch.stack(
        [
            torch.stack(
                [expert(layer, int(phy2log[layer, rank * S + s]), dev) for s in range(S)]
                + [torch.zeros(SHAPE, device=dev, dtype=torch.bfloat16)] * spare
            )
            for layer in range(L)
        ]
    )
    return {"w13": w.contiguous(), "w2": (w * 2).contiguous()}


def served(weights: dict[str, torch.Tensor], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Each slot's row ([L, S] of this rank) gathered into [L, S, ...]."""
    index = torch.as_tensor(rows, device=next(iter(weights.values())).device)
    return {
        k: torch.stack([w[layer, index[layer]] for layer in range(L)]) for k, w in weights.items()
    }


def _worker(
    rank: int,
    init: str,
    old: np.ndarray,
    new: np.ndarray,
    transport: Transport,
    out: str,
    spare: int,
) -> None:
    from worker_hooks.config import MigrationConfig
    from worker_hooks.migration import MigrationExecutor
    from worker_hooks.rows import RowMap
    from worker_hooks.transports import transport_class

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=init,
        rank=rank,
        world_size=G,
        device_id=dev,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.new_group(backend=transport_class(transport).group_backend(dev))
    weights = live(old, rank, dev, spare)
    rows = RowMap(G, L, S, spare)
    before = served(weights, rows.rows[rank])
    pointers = {k: v.data_ptr() for k, v in weights.items()}
    expert_bytes = 2 * SHAPE[0] * SHAPE[1] * 2
    config = MigrationConfig(transport, layers_per_chunk=2, outbox_bytes=5 * expert_bytes)
    ex = MigrationExecutor(rank, G, weights, group, config, row_map=rows)
    moves = transfers(old, new, G, 1)
    ex.prepare(1, moves)
    ex.abort(1)
    untouched = all(torch.equal(served(weights, rows.rows[rank])[k], before[k]) for k in weights)
    stats = ex.prepare(2, moves)
    dist.barrier()  # the coordinator: no rank commits before every rank prepared
    copied = ex.commit(2)
    torch.cuda.synchronize()
    want = live(new, rank, dev)
    now = served(weights, rows.rows[rank])
    exact = all(torch.equal(now[k], want[k]) for k in weights)
    same_storage = all(weights[k].data_ptr() == pointers[k] for k in weights)
    ex.close()
    np.save(
        f"{out}/{rank}.npy",
        np.array([untouched, exact, same_storage, stats.experts_received, copied]),
    )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("transport", "spare"), [("p2p", 0), ("outbox", 0), ("ipc", 0), ("p2p", S), ("ipc", S)]
)
def test_migration_between_two_gpus_is_exact(transport: Transport, spare: int) -> None:
    rng = np.random.default_rng(3)
    old = trivial_placement(L, E, P, G)
    new = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    moves = transfers(old, new, G, 1)
    assert (moves[:, 1] != moves[:, 3]).sum() > 10  # several outbox steps each way
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'rdzv')}"
        mp.spawn(_worker, args=(init, old, new, transport, out, spare), nprocs=G, join=True)
        results = [np.load(f"{out}/{r}.npy") for r in range(G)]
    for untouched, exact, same_storage, _n, _copied in results:
        assert untouched and exact and same_storage
    assert sum(int(r[3]) for r in results) == len(moves)
    copied = sum(int(r[4]) for r in results)
    assert copied == (0 if spare else len(moves))
