"""A plan whose ranks are not all in it fails on every rank within 2 s, and the group's
next plan moves its weights: no rank waits in the backend for a peer that never comes.

Found by the chaos campaign (RELIABILITY.md, once an open finding): a rank that never ran
a plan's p2p transfers (its Prepare lost with its link, replaced in its sidecar by a newer
plan before it came back) left its peers waiting in gloo until the group's timeout (30 s),
and gloo then closed the group's pairs: every later plan failed on that group until it
restarted (39 `transfer_timeouts` in a 300 s campaign). Now every rank takes the plan
through the group's store before any weight moves (worker_hooks/fence.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rebalancer.placement import transfers, trivial_placement
from tests.unit.worker_hooks.test_migrate import E, G, L, P, S, held, spawn, weights_for
from worker_hooks.config import MigrationConfig
from worker_hooks.fence import ABORTED, TransferFence, TransfersDeclined
from worker_hooks.migration import MigrationExecutor
from worker_hooks.rows import RowMap

# ------------------------------------------------------------ the fence alone, on a TCPStore


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def fences(store: dist.Store, n: int, join_seconds: float = 1.0) -> list[TransferFence]:
    return [TransferFence(store, r, n, join_seconds, prefix="g/") for r in range(n)]


def run_all(calls: list) -> list[str]:
    """Run each call on a thread of its own: "go", or the TransfersDeclined message."""
    out = [""] * len(calls)

    def one(i: int) -> None:
        try:
            calls[i]()
            out[i] = "go"
        except TransfersDeclined as exc:
            out[i] = str(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_joins_and_all_go(store: dist.TCPStore) -> None:
    fs = fences(store, 3)
    assert run_all([lambda f=f: f.join(5) for f in fs]) == ["go"] * 3


def test_a_rank_that_never_joins_stops_the_others_in_time_and_late_it_stops_too(
    store: dist.TCPStore,
) -> None:
    fs = fences(store, 3, join_seconds=0.5)
    start = time.monotonic()
    out = run_all([lambda: fs[0].join(5), lambda: fs[1].join(5)])
    assert time.monotonic() - start < 2.0
    assert out == ["rank(s) [2] did not join its transfers within 0.5 s"] * 2
    with pytest.raises(
        TransfersDeclined, match="did not join"
    ):  # its Prepare came late: the decision stands
        fs[2].join(5)
    assert run_all([lambda f=f: f.join(6) for f in fs]) == ["go"] * 3  # the next plan


def test_a_rank_that_declines_stops_its_peers_at_once(store: dist.TCPStore) -> None:
    fs = fences(store, 3, join_seconds=20.0)
    start = time.monotonic()
    out = run_all(
        [
            lambda: fs[0].join(5),
            lambda: fs[1].join(5),
            lambda: (time.sleep(0.2), fs[2].decline(5, "plan is based on v3, rank serves v4")),
        ]
    )
    assert time.monotonic() - start < 2.0  # not the 20 s they would wait for a missing rank
    assert out[:2] == ["rank 2: plan is based on v3, rank serves v4"] * 2


def test_a_rank_told_to_stop_while_waiting_withdraws(store: dist.TCPStore) -> None:
    fs = fences(store, 2, join_seconds=20.0)
    out = run_all([lambda: fs[0].join(5, stop=lambda: ABORTED)])
    assert out == [f"rank 0: {ABORTED}"]
    with pytest.raises(TransfersDeclined) as declined:
        fs[1].join(5)
    assert declined.value.aborted  # its peer heard the Abort: an abort here too, not a failure


def test_the_first_decision_stands(store: dist.TCPStore) -> None:
    fs = fences(store, 2)
    assert run_all([lambda f=f: f.join(5) for f in fs]) == ["go", "go"]
    fs[1].decline(5, "too late")
    assert fs[0]._decision(5) == "go"
    fs[1].decline(6, "refused")
    with pytest.raises(TransfersDeclined, match="rank 1: refused"):
        fs[0].join(6)


# ------------------------------------------------------------ on real gloo processes


def _never_joins(
    rank: int, out: str, old: np.ndarray, first: np.ndarray, second: np.ndarray, new: np.ndarray
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=G)
    # The demo worker's timeout: a peer left waiting in gloo would wait this long.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    weights = weights_for(old, rank)
    rows = RowMap(G, L, S, 0)
    ex = MigrationExecutor(
        rank, G, weights, group, MigrationConfig("p2p", layers_per_chunk=1), row_map=rows
    )
    outcome, seconds = "none", 0.0
    if rank != 2:  # rank 2 never hears of plan 7 (its Prepare was lost with its link)
        start = time.monotonic()
        try:
            ex.prepare(7, first)
            outcome = "prepared"
        except TransfersDeclined:
            outcome = "declined"
        except RuntimeError:  # gloo timed out waiting for rank 2
            outcome = "timed out"
        seconds = time.monotonic() - start
    dist.barrier()
    if rank == 2:  # ... then its Prepare comes, late: it runs no transfer either
        try:
            ex.prepare(7, first)
            outcome = "prepared"
        except TransfersDeclined:
            outcome = "declined"
    ex.prepare(8, second)  # the next plan, on the same group: no restart
    ex.commit(8)
    served = held(weights, rows, rank)
    ok = all(torch.equal(served[k], weights_for(new, rank)[k]) for k in weights)
    np.save(f"{out}/{rank}.npy", np.array([outcome == "declined", seconds, ok]))
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_that_misses_a_plan_fails_it_within_2s_and_the_next_plan_commits(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(5)
    old = trivial_placement(L, E, P, G)
    shuffled = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    new = old.copy()
    new[:, [0, S]] = new[:, [S, 0]]
    spawn(
        _never_joins, tmp_path, old, transfers(old, shuffled, G, 1), transfers(old, new, G, 1), new
    )
    results = [np.load(tmp_path / f"{r}.npy") for r in range(G)]
    assert all(bool(declined) for declined, _, _ in results), results
    assert max(seconds for _, seconds, _ in results) < 2.0, results
    assert all(bool(ok) for _, _, ok in results), results
