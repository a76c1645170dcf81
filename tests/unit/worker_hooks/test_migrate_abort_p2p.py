"""A p2p plan aborted on one rank must leave the group fit for the next plan.
Found by the chaos campaign (reliability/chaos/, a rank's link to its sidecar dropped while
preparing): the rank that heard the abort stopped between rounds, its peers' buffers of
the aborted plan stayed on the wire, and the next plan's receives on the same gloo
channel took them ("Received data size doesn't match expected size", an uncaught
gloo::EnforceNotMet in gloo's thread: every rank of the group died of SIGABRT); had the
peers waited instead, their group would have timed out and gloo closes its pairs for
good. Now an abort heard before the plan's transfers start stops every rank before any
weight moves (worker_hooks/fence.py), and once they started every rank runs all their
rounds, the abort dropping the staging after; each plan's messages also carry their own
tag."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rebalancer.placement import transfers, trivial_placement
from tests.unit.worker_hooks.test_migrate import E, G, L, P, S, held, spawn, weights_for
from worker_hooks.config import MigrationConfig
from worker_hooks.fence import TransfersDeclined
from worker_hooks.migration import MigrationExecutor
from worker_hooks.rows import RowMap
from worker_hooks.weights import MigrationAborted


def _worker(
    rank: int,
    out: str,
    when: str,
    old: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    new: np.ndarray,
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=G)
    # Timeouts far above what a loaded machine needs: the outcome must not depend on
    # speed (a peer slower than the fence's wait would decline the plan, one slower than
    # the group's timeout would time it out; neither is what this test is about).
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    weights = weights_for(old, rank)
    rows = RowMap(G, L, S, 0)
    config = MigrationConfig("p2p", layers_per_chunk=1, rounds_in_flight=1, join_seconds=30.0)
    ex = MigrationExecutor(rank, G, weights, group, config, row_map=rows)
    if rank == 1 and when == "before":  # only rank 1 heard plan 7 was aborted, before its transfers
        ex.abort(7)
    if rank == 1 and when == "during":  # ... once every rank had started them
        join = ex._join

        def join_then_abort(version: int) -> None:
            join(version)
            if version == 7:
                ex.abort(version)

        ex._join = join_then_abort  # type: ignore[method-assign]
    outcome = "prepared"
    try:
        ex.prepare(7, first)
    except MigrationAborted:
        outcome = "aborted"
    except TransfersDeclined:  # a peer will not run the plan's transfers: nobody does
        outcome = "declined"
    except RuntimeError:  # a peer stopped half-way: the exchange timed out
        outcome = "timed out"
    dist.barrier()
    ex.abort(7)
    ex.prepare(8, second)  # a plan whose transfers differ in size from plan 7's
    dist.barrier()
    ex.commit(8)
    served = held(weights, rows, rank)
    ok = all(torch.equal(served[k], weights_for(new, rank)[k]) for k in weights)
    expected = "aborted" if rank == 1 or when == "before" else "prepared"
    np.save(f"{out}/{rank}.npy", np.array([outcome == expected, ok]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("when", ["before", "during"])
def test_an_abort_on_one_rank_leaves_nothing_for_the_next_plan(tmp_path: Path, when: str) -> None:
    rng = np.random.default_rng(3)
    old = trivial_placement(L, E, P, G)
    shuffled = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    new = old.copy()
    new[:, [0, S]] = new[:, [S, 0]]  # plan 8 swaps one slot per layer: fewer bytes per round
    spawn(
        _worker, tmp_path, when, old, transfers(old, shuffled, G, 1), transfers(old, new, G, 1), new
    )
    results = [np.load(tmp_path / f"{r}.npy") for r in range(G)]
    assert all(bool(expected) and bool(ok) for expected, ok in results), results
