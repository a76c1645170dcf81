"""MigrationExecutor over real gloo processes, all transports: after prepare + commit
every slot holds exactly the expert the new placement says; abort leaves weights
untouched; pacing holds the rate; the shared-memory transports refuse what they cannot
map on every rank. Each transport class also keeps the contract of the one interface
the executor sees (`WeightTransport.receive`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rebalancer.placement import transfers, trivial_placement
from worker_hooks.config import TRANSPORTS, MigrationConfig, Transport
from worker_hooks.migration import MigrationExecutor
from worker_hooks.rows import RowMap
from worker_hooks.transports import make_transport, transport_class
from worker_hooks.transports.base import PlanMoves
from worker_hooks.transports.ipc import IpcTransport
from worker_hooks.transports.outbox import OutboxTransport
from worker_hooks.transports.p2p import P2PTransport
from worker_hooks.transports.shared_memory import in_shared_memory, outbox_schedule
from worker_hooks.weights import MigrationAborted, RankWeights

L, E, P, G = 5, 8, 12, 3
S = P // G
EXPERT_BYTES = 2 * 6 * 4  # two float32 tensors of 2 x 3 per expert


def expert_value(layer: int, expert: int) -> torch.Tensor:
    return torch.full((2, 3), float(layer * 100 + expert))


def weights_for(phy2log: np.ndarray, rank: int) -> dict[str, torch.Tensor]:
    w = torch.stack(
        [
            torch.stack([expert_value(layer, int(phy2log[layer, rank * S + s])) for s in range(S)])
            for layer in range(L)
        ]
    )
    return {"w1": w.clone(), "w2": (w * -1).clone()}


def weights_of(
    transport: Transport, phy2log: np.ndarray, rank: int, out: str, spare: int = 0
) -> dict[str, torch.Tensor]:
    """The rank's weights plus `spare` free rows per layer; in shared-memory files (in
    `out`) where the transport maps them ("ipc")."""
    weights = {
        name: torch.cat([w, torch.full((L, spare, 2, 3), -7.0)], dim=1)
        for name, w in weights_for(phy2log, rank).items()
    }
    if transport_class(transport).maps_live_weights:
        return in_shared_memory(weights, f"rank{rank}", out)[0]
    return weights


def held(weights: dict[str, torch.Tensor], rows: RowMap, rank: int) -> dict[str, torch.Tensor]:
    """What the rank serves: each slot's row, through the row map, as [L, S, ...]."""
    index = torch.as_tensor(rows.rows[rank])
    return {
        name: torch.stack([w[layer, index[layer]] for layer in range(L)])
        for name, w in weights.items()
    }


def join(rank: int, out: str) -> dist.ProcessGroup:
    """Join the G-rank gloo group rendezvousing in `out`; returns a group for transfers."""
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=G)
    return dist.new_group(backend="gloo")


def spawn(worker: Callable[..., None], out: Path, *args: Any) -> None:
    """Run worker(rank, out, *args) in G processes."""
    mp.spawn(worker, args=(str(out), *args), nprocs=G, join=True)


def _moves() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    old = trivial_placement(L, E, P, G)
    new = np.stack([rng.permutation(old[layer]) for layer in range(L)])
    return old, new, transfers(old, new, G, 1)


def _worker(
    rank: int,
    out: str,
    old: np.ndarray,
    new: np.ndarray,
    moves: np.ndarray,
    transport: Transport,
    spare: int,
) -> None:
    group = join(rank, out)
    weights = weights_of(transport, old, rank, out, spare)
    rows = RowMap(G, L, S, spare)
    # Outboxes of 3 experts: the plan needs several steps through both outboxes.
    config = MigrationConfig(
        transport, layers_per_chunk=2, rounds_in_flight=2, outbox_bytes=3 * EXPERT_BYTES
    )
    ex = MigrationExecutor(rank, G, weights, group, config, row_map=rows)
    # Plan 1 is aborted after preparing: nothing served may change.
    ex.prepare(1, moves)
    ex.abort(1)
    served = held(weights, rows, rank)
    same = all(torch.equal(served[k], weights_for(old, rank)[k]) for k in weights)
    stats = ex.prepare(2, moves)
    before_commit_same = torch.equal(held(weights, rows, rank)["w1"], weights_for(old, rank)["w1"])
    dist.barrier()  # the coordinator: no rank commits before every rank prepared
    copied = ex.commit(2)
    served = held(weights, rows, rank)
    ok = all(torch.equal(served[k], weights_for(new, rank)[k]) for k in weights)
    # A second plan moves back, reading the peers' experts from their new rows.
    ex.prepare(3, transfers(new, old, G, 1))
    dist.barrier()
    copied += ex.commit(3)
    served = held(weights, rows, rank)
    back = all(torch.equal(served[k], weights_for(old, rank)[k]) for k in weights)
    ex.close()
    np.save(
        f"{out}/{rank}.npy",
        np.array([same, before_commit_same, ok, back, stats.experts_received, copied]),
    )
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("transport", "spare"),
    [("p2p", 0), ("outbox", 0), ("ipc", 0), ("p2p", 1), ("ipc", 1), ("ipc", S), ("outbox", S)],
)
def test_prepare_commit_abort_across_three_ranks(
    tmp_path: Path, transport: Transport, spare: int
) -> None:
    old, new, moves = _moves()
    assert outbox_schedule(moves, 3).steps >= 3  # both outboxes reused
    spawn(_worker, tmp_path, old, new, moves, transport, spare)
    results = [np.load(tmp_path / f"{r}.npy") for r in range(G)]
    for same, before_commit_same, ok, back, _received, _copied in results:
        assert same and before_commit_same and ok and back
    assert sum(int(r[4]) for r in results) == len(moves)
    copied = sum(int(r[5]) for r in results)
    back = transfers(new, old, G, 1)
    if spare == 0:  # every expert waits in staging and is copied in the pause
        assert copied == len(moves) + len(back)
    elif spare == S:  # every expert found a free row: the commits copied nothing
        assert copied == 0
    else:  # one free row per (rank, layer) and plan: the rest are copied at commit
        assert 0 < copied < len(moves) + len(back)


def _abort_worker(
    rank: int, out: str, old: np.ndarray, moves: np.ndarray, transport: Transport
) -> None:
    group = join(rank, out)
    weights = weights_of(transport, old, rank, out)
    ex = MigrationExecutor(
        rank, G, weights, group, MigrationConfig(transport, outbox_bytes=EXPERT_BYTES)
    )
    if rank == 1:  # only one rank hears of the abort: every rank must stop, none hangs
        ex.abort(7)
    outcome = "prepared"
    try:
        ex.prepare(7, moves)
    except MigrationAborted:
        outcome = "aborted"
    unchanged = all(torch.equal(weights[k], weights_for(old, rank)[k]) for k in weights)
    ex.close()
    np.save(f"{out}/{rank}.npy", np.array([outcome == "aborted", unchanged]))
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["outbox", "ipc"])
def test_abort_seen_by_one_rank_stops_all(tmp_path: Path, transport: Transport) -> None:
    old, _new, moves = _moves()
    spawn(_abort_worker, tmp_path, old, moves, transport)
    results = [np.load(tmp_path / f"{r}.npy") for r in range(G)]
    assert all(bool(aborted) and bool(unchanged) for aborted, unchanged in results)


def _paced_worker(
    rank: int, out: str, old: np.ndarray, moves: np.ndarray, transport: Transport, gbps: float
) -> None:
    group = join(rank, out)
    config = MigrationConfig(transport, outbox_bytes=2 * EXPERT_BYTES, max_gbps=gbps)
    ex = MigrationExecutor(rank, G, weights_of(transport, old, rank, out), group, config)
    t0 = time.perf_counter()
    stats = ex.prepare(1, moves)
    ex.close()
    np.save(f"{out}/{rank}.npy", np.array([time.perf_counter() - t0, stats.bytes_received]))
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_max_gbps_paces_the_transfers(tmp_path: Path, transport: Transport) -> None:
    old, _new, moves = _moves()
    gbps = 1e-6  # 1 kB/s: the plan's few hundred bytes per rank take a visible time
    spawn(_paced_worker, tmp_path, old, moves, transport, gbps)
    for seconds, received in (np.load(tmp_path / f"{r}.npy") for r in range(G)):
        assert received > 0
        assert seconds >= received / (gbps * 1e9) * 0.95


def _refused_worker(
    rank: int, out: str, old: np.ndarray, moves: np.ndarray, transport: Transport, fault: str
) -> None:
    """Prepare with one rank unfit for a shared-memory transport; write what it raised."""
    import worker_hooks.transports.shared_memory as outbox

    if fault == "unshared" and rank == 2:  # ordinary memory: no peer can map it
        weights = weights_for(old, rank)
    else:
        weights = in_shared_memory(weights_for(old, rank), f"rank{rank}", out)[0]
    if fault == "two_hosts" and rank == 1:  # as if rank 1 ran on another machine
        outbox.socket_host = lambda: "elsewhere"  # type: ignore[assignment]
    ex = MigrationExecutor(rank, G, weights, join(rank, out), MigrationConfig(transport))
    _write_refusal(ex, moves, rank, out)
    dist.destroy_process_group()


def _write_refusal(ex: MigrationExecutor, moves: np.ndarray, rank: int, out: str) -> None:
    """Prepare plan 1; write what it raised (empty if nothing) to out/<rank>.txt."""
    message = ""
    try:
        ex.prepare(1, moves)
    except RuntimeError as exc:
        message = str(exc)
    Path(out, f"{rank}.txt").write_text(message)


def test_ipc_refuses_unshared_cpu_weights_on_every_rank(tmp_path: Path) -> None:
    old, _new, moves = _moves()
    spawn(_refused_worker, tmp_path, old, moves, "ipc", "unshared")
    messages = [(tmp_path / f"{r}.txt").read_text() for r in range(G)]
    assert all("rank 2 cannot share its weights" in m for m in messages), messages


@pytest.mark.parametrize("transport", ["ipc", "outbox"])
def test_shared_transports_refuse_ranks_on_several_hosts(
    tmp_path: Path, transport: Transport
) -> None:
    old, _new, moves = _moves()
    spawn(_refused_worker, tmp_path, old, moves, transport, "two_hosts")
    messages = [(tmp_path / f"{r}.txt").read_text() for r in range(G)]
    assert all("on one host" in m and "elsewhere" in m for m in messages), messages


def _diverged_worker(rank: int, out: str, old: np.ndarray, moves: np.ndarray) -> None:
    """Rank 2's row map differs from its peers' (as if it restarted alone after plans)."""
    rows = RowMap(G, L, S, 1)
    if rank == 2:
        diverged = rows.rows.copy()
        diverged[0, 0, [0, 1]] = [S, 0]  # it believes rank 0 moved slot 0 to a spare row
        rows.switch(diverged)
    weights = in_shared_memory(weights_of("p2p", old, rank, out, 1), f"rank{rank}", out)[0]
    ex = MigrationExecutor(rank, G, weights, join(rank, out), MigrationConfig("ipc"), row_map=rows)
    _write_refusal(ex, moves, rank, out)
    ex.close()
    dist.destroy_process_group()


def test_ranks_that_disagree_on_the_rows_fail_the_plan_everywhere(tmp_path: Path) -> None:
    old, _new, moves = _moves()
    spawn(_diverged_worker, tmp_path, old, moves)
    messages = [(tmp_path / f"{r}.txt").read_text() for r in range(G)]
    assert all("row maps differ; rank(s) [2]" in m for m in messages), messages


def test_outbox_schedule_covers_every_remote_move_once() -> None:
    _old, _new, moves = _moves()
    plan = outbox_schedule(moves, 4)
    remote = moves[moves[:, 1] != moves[:, 3]]
    assert len(plan.remote) == len(remote)
    assert sorted(map(tuple, plan.remote)) == sorted(map(tuple, remote))
    # Per sender: positions 0..n-1; every step's rows fit one outbox.
    for src in range(G):
        pos = plan.position[plan.remote[:, 3] == src]
        assert np.array_equal(pos, np.arange(len(pos)))
    assert plan.steps == int(plan.position.max()) // 4 + 1
    with pytest.raises(ValueError, match="at least one expert"):
        outbox_schedule(moves, 0)


def _receive_worker(
    rank: int,
    out: str,
    old: np.ndarray,
    new: np.ndarray,
    moves: np.ndarray,
    transport: Transport,
) -> None:
    """One plan through `make_transport(...).receive` alone, one spare row per layer (so
    some experts get a free row and some do not): write what the contract needs."""
    group = join(rank, out)
    weights = weights_of(transport, old, rank, out, spare=1)
    rows = RowMap(G, L, S, 1)
    ctx = RankWeights(rank, G, weights, group, rows)
    mover = make_transport(
        MigrationConfig(transport, layers_per_chunk=2, outbox_bytes=3 * EXPERT_BYTES), ctx
    )
    mover.connect()
    after = rows.plan(moves)
    got = mover.receive(PlanMoves(1, moves, after, time.perf_counter()))
    mine = moves[moves[:, 1] == rank]
    returned = {tuple(row) for row in got.incoming.tolist()}
    # A returned expert sits at its index in staging; any other went to its free row.
    staged_ok = all(
        torch.equal(
            got.staging["w1"][i], expert_value(int(layer), int(new[layer, rank * S + slot]))
        )
        and torch.equal(got.staging["w2"][i], -got.staging["w1"][i])
        for i, (layer, _dst, slot, _src, _src_slot) in enumerate(got.incoming.tolist())
    )
    written_ok = all(
        after[rank, layer, slot] != rows.rows[rank, layer, slot]
        and torch.equal(
            weights["w1"][layer, after[rank, layer, slot]],
            expert_value(int(layer), int(new[layer, rank * S + slot])),
        )
        for layer, _dst, slot, _src, _src_slot in mine.tolist()
        if (layer, _dst, slot, _src, _src_slot) not in returned
    )
    remote = int((mine[:, 3] != rank).sum())
    kind = {"p2p": P2PTransport, "ipc": IpcTransport, "outbox": OutboxTransport}[transport]
    mover.close()
    np.save(
        f"{out}/{rank}.npy",
        np.array(
            [
                type(mover) is kind and mover.name == transport,
                returned <= {tuple(row) for row in mine.tolist()}
                and len(returned) == len(got.incoming),
                staged_ok,
                written_ok,
                got.bytes_received == remote * EXPERT_BYTES,
                len(mine) - len(returned),
            ]
        ),
    )
    dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_keeps_the_receive_contract(tmp_path: Path, transport: Transport) -> None:
    old, new, moves = _moves()
    spawn(_receive_worker, tmp_path, old, new, moves, transport)
    results = [np.load(tmp_path / f"{r}.npy") for r in range(G)]
    for right_class, subset, staged_ok, written_ok, bytes_ok, _written in results:
        assert right_class and subset and staged_ok and written_ok and bytes_ok
    written = sum(int(r[5]) for r in results)
    # ipc reads straight into the free rows; the others leave that to the executor.
    assert written > 0 if transport == "ipc" else written == 0


def test_bad_transport_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="transport must be one of p2p, ipc, outbox, got 'rdma'"):
        MigrationConfig(transport="rdma")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_gbps"):
        MigrationConfig(max_gbps=-1.0)
    with pytest.raises(ValueError, match="max_gbps"):
        MigrationConfig(max_gbps=float("nan"))
    for name in ("layers_per_chunk", "rounds_in_flight", "outbox_bytes", "copy_streams"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            MigrationConfig(**{name: 0})  # type: ignore[arg-type]
    weights = weights_for(trivial_placement(L, E, P, G), 0)
    ex = MigrationExecutor(0, G, weights, None)
    assert isinstance(ex.transport, P2PTransport)  # the default
