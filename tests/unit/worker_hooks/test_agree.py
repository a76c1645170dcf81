"""The commit agreement never holds the serving thread while no rank can switch.

Found by the chaos campaign beside a CPU hog (reliability.chaos --hog 2): both ranks spent
~210 ms of one step in the hook, in the agreement's wait for the all-reduce started one
agreement earlier, whose other side ran late on a starved peer, while neither rank had a
plan to switch to. Now a rank that contributed no newer version than the one it serves
does not wait for that agreement (it cannot switch anyone); a rank ready to switch still
waits, and every rank switches at the same step (invariant 2)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from worker_hooks.agree import CommitAgreement

EVERY = 4


def _worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rdzv", rank=rank, world_size=2)
    agreement = CommitAgreement(dist.new_group(backend="gloo"), EVERY)
    # 1. Nothing to switch to; rank 1 is starved for 1.5 s before its side of step 4's.
    if rank == 1:
        time.sleep(1.5)
    agreement.on_step(4, 0, serving=0)
    start = time.monotonic()
    results = [agreement.on_step(8, 0, serving=0)]
    waited = time.monotonic() - start
    # 2. Both ready for v1 from step 12: both read the agreement at step 16 and switch.
    results.append(agreement.on_step(12, 1, serving=0))
    results.append(agreement.on_step(16, 1, serving=0))
    # 3. Rank 0 ready for v2, rank 1 not yet: no switch, rank 1 does not wait for it.
    results.append(agreement.on_step(20, 2 if rank == 0 else 1, serving=1))
    results.append(agreement.on_step(24, 2 if rank == 0 else 1, serving=1))
    agreement.close()
    np.save(
        f"{out}/{rank}.npy",
        np.array([waited, *[-1 if r is None else r for r in results], agreement.broken is None]),
    )
    dist.barrier()
    dist.destroy_process_group()


def test_an_agreement_no_rank_can_switch_on_is_not_waited_for(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    r0, r1 = (np.load(tmp_path / f"{r}.npy") for r in range(2))
    assert r0[0] < 0.5, (
        f"rank 0 waited {r0[0]:.2f} s for its starved peer with nothing to switch to"
    )
    assert list(r0[1:]) == [
        -1,
        -1,
        1,
        -1,
        1,
        True,
    ]  # steps 8, 12, 16 (switch to v1), 20, 24 (MIN 1: none)
    assert list(r1[1:]) == [
        -1,
        -1,
        1,
        -1,
        -1,
        True,
    ]  # rank 1 had nothing newer at step 24: not read
