"""Closing the commit agreement never lets go of an all-reduce still running.

Found by a core dump of the example worker (tests/integration/test_end_to_end.py's killed
peer, beside a CPU hog): a surviving rank's `close` stopped waiting at the first
agreement that failed and dropped the rest; a gloo thread then ran one of them during
interpreter shutdown, destroyed it, and its tensor's release asked for the GIL: SIGABRT
("terminate called without an active exception", worker_hooks/works.py). Real gloo ranks
in real processes; every one of them must exit 0 through a normal interpreter shutdown."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from worker_hooks import works
from worker_hooks.agree import CommitAgreement


def _dead_peer(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=3)
    agreement = CommitAgreement(dist.new_group(backend="gloo"), every=4)
    # Every rank has finished connecting the group's mesh before the peer goes: a peer
    # that leaves while another rank still connects fails that rank's new_group instead.
    dist.barrier()
    if rank == 2:
        import os

        os._exit(0)  # the peer dies before any agreement
    time.sleep(0.5)
    for step in (4, 8, 12):  # nothing to switch to: started, never read
        agreement.on_step(step, 0, serving=0)
    # Unread, or already reaped as failed (on a fast machine the peer's death fails the
    # first agreement by the next step): close must wait for every one of them.
    started = [work for work, _ in agreement._recent] + [work for work, _, _ in agreement._running]
    settled = agreement.close(timeout=30.0)
    np.save(
        f"{out}/{rank}.npy",
        np.array(
            [
                settled,
                len(started),
                all(w.is_completed() for w in started),
                agreement.broken is not None,
                works.none_running(),
            ]
        ),
    )
    # No os._exit, no teardown: the interpreter shuts down with the gloo threads alive.


def test_after_a_dead_peer_every_agreement_is_waited_for_and_the_rank_exits_cleanly(
    tmp_path: Path,
) -> None:
    mp.spawn(
        _dead_peer, args=(str(tmp_path),), nprocs=3, join=True
    )  # raises on an exit code other than 0
    for rank in (0, 1):
        settled, started, completed, broken, none_running = np.load(tmp_path / f"{rank}.npy")
        assert started >= 1 and completed and settled and broken and none_running


def _frozen_peer(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=2)
    agreement = CommitAgreement(dist.new_group(backend="gloo"), every=4)
    dist.barrier()  # both ranks have connected the group before rank 0 goes quiet
    go = Path(out) / "go"
    if rank == 0:  # contributes at step 4, then stops answering until told
        agreement.on_step(4, 0, serving=0)
        while not go.exists():
            time.sleep(0.01)
        agreement.on_step(8, 0, serving=0)
        agreement.on_step(12, 0, serving=0)
        assert agreement.close(timeout=30.0)
        return
    for step in (4, 8, 12):
        agreement.on_step(step, 0, serving=0)
    start = time.monotonic()
    settled = agreement.close(timeout=0.5)
    waited = time.monotonic() - start
    kept_running = not works.none_running()
    go.touch()  # the peer answers: the kept agreements complete
    deadline = time.monotonic() + 30.0
    while not works.none_running() and time.monotonic() < deadline:
        time.sleep(0.01)
    np.save(f"{out}/{rank}.npy", np.array([settled, waited, kept_running, works.none_running()]))


def test_with_a_frozen_peer_close_returns_in_time_and_keeps_what_still_runs(tmp_path: Path) -> None:
    mp.spawn(_frozen_peer, args=(str(tmp_path),), nprocs=2, join=True)
    settled, waited, kept_running, none_running_after = np.load(tmp_path / "1.npy")
    assert not settled  # the caller must not tear the groups down
    assert waited < 5.0, f"close waited {waited:.1f} s with a bound of 0.5 s"
    assert kept_running and none_running_after
