"""The decision worker: runs calls in a process of its own, survives a failing call,
restarts after a crash, and ends with `close` (or with its parent, see
tests/integration/test_process_lifetime.py)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from rebalancer.controller.decision_process import DecisionProcess


def _fail() -> None:
    raise ValueError("bad decision")


async def _run(proc: DecisionProcess, fn: Callable[[], Any]) -> Any:
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    proc.submit(fn, done.set_result)
    return await asyncio.wait_for(done, 60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_calls_run_in_the_worker_which_close_ends() -> None:
    async def main() -> tuple[list[Any], int, int]:
        pool = DecisionProcess()
        pool.start()
        first = pool.worker_pid
        assert first is not None
        results = [
            await _run(pool, os.getpid),
            await _run(pool, _fail),
            await _run(pool, functools.partial(sum, [1, 2])),
        ]
        os.kill(
            first, signal.SIGKILL
        )  # a crashed worker fails its call and is replaced at the next
        results.append(await _run(pool, os.getpid))
        results.append(await _run(pool, os.getpid))
        second = pool.worker_pid
        assert second is not None
        pool.close()
        return results, first, second

    results, first, second = asyncio.run(main())
    assert results[0] == first and results[0] != os.getpid()
    assert results[1] is None and results[2] == 3  # a failing call does not stop the next ones
    assert results[3] is None and results[4] == second != first
    assert not _alive(first) and not _alive(second)


def test_the_worker_runs_below_the_controllers_priority() -> None:
    """Decisions are background work: where cores are short, ingest is served first."""
    from rebalancer.controller.decision_process import DECISION_NICENESS

    async def main() -> int:
        pool = DecisionProcess()
        pool.start()
        try:
            return int(await _run(pool, functools.partial(os.nice, 0)))
        finally:
            pool.close()

    assert asyncio.run(main()) == min(os.nice(0) + DECISION_NICENESS, 19)


def test_close_does_not_wait_for_a_running_decision() -> None:
    """Found by the chaos campaign beside a CPU hog: a SIGTERM'd controller took 12-16 s to
    come back, its drain waiting for the decision its low-priority worker was running on a
    starved node (a result the draining controller drops anyway). Now close ends it."""
    import time

    async def main() -> tuple[float, int]:
        pool = DecisionProcess()
        pool.start()
        pid = pool.worker_pid
        assert pid is not None
        pool.submit(
            functools.partial(time.sleep, 30), lambda result: None
        )  # a decision that takes long
        await asyncio.sleep(1.0)  # it is running in the worker
        start = time.monotonic()
        pool.close()
        return time.monotonic() - start, pid

    seconds, pid = asyncio.run(main())
    assert seconds < 5.0, f"close waited {seconds:.1f} s for the running decision"
    assert not _alive(pid)
