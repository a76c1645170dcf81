"""Test guards: no process started by the tests outlives the session, and no thread
started by a test outlives that test (no_thread_left_behind, below).

Every process the suite starts (controllers, worker processes, the controller's decision
pool, multiprocessing helpers) inherits a marker variable set here. When the session ends,
any live process still carrying this session's marker leaked, even one that was orphaned
and re-parented to init: it is killed and the session fails with its command line.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

MARKER = "REBALANCER_TEST_SESSION"


def marked_processes(token: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds MARKER=token."""
    needle = f"{MARKER}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            status = (entry / "status").read_text()
            if "\nState:\tZ" in status:  # a zombie holds nothing; its parent reaps it
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        parent = int(status.split("\nPPid:\t", 1)[1].split("\n", 1)[0])
        if parent == os.getpid() and "multiprocessing.resource_tracker" in cmd:
            # torch.multiprocessing's tracker for this very process: it reads a pipe from
            # us and exits when pytest does, so it is ours to keep, not a leak.
            continue
        found[int(entry.name)] = cmd.strip()
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    if not Path("/proc/self/environ").exists():  # not Linux: nothing to check with
        yield
        return
    token = uuid.uuid4().hex
    os.environ[MARKER] = token
    yield
    deadline = time.monotonic() + 5.0  # let processes on their way out finish exiting
    leaked = marked_processes(token)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = marked_processes(token)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not leaked, "processes outlived the test session (killed now):\n" + "\n".join(
        f"  {pid}: {cmd}" for pid, cmd in sorted(leaked.items())
    )


# Threads this suite may leave behind, by their target, each with why it is not ours to stop:
THREADS_NOT_OURS = (
    # gRPC's asyncio poller: one per process, started by the first asyncio call of any test
    # and kept by gRPC for the process's life (no API ends it).
    "grpc._cython.cygrpc.PollerCompletionQueue._poll_wrapper",
    # torch.compile's (the GPU dispatch test, `compile_dispatch`): Inductor's compile-worker
    # pool reader and tqdm's monitor, both started by the first compile and kept for the
    # process's life by torch (seen on the H100, tests/gpu/test_dispatch_modes.py).
    "torch._inductor.compile_worker.subproc_pool.SubprocPool._read_thread",
    "tqdm._monitor.TMonitor",
)
THREAD_GRACE_SECONDS = 2.0


def thread_target(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    where = getattr(target, "__qualname__", None) or type(thread).__qualname__
    module = getattr(target, "__module__", None) or type(thread).__module__
    return f"{module}.{where}"


def describe_thread(thread: threading.Thread) -> str:
    return (
        f"{thread.name!r} (target {thread_target(thread)}, "
        f"{'daemon' if thread.daemon else 'non-daemon'})"
    )


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """Every test ends the threads it started: one still alive after a short grace fails the
    test, named with its target. A thread left running outlives its test's objects and can
    take pytest down at exit (issue 34)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE_SECONDS
    left = [
        t
        for t in threading.enumerate()
        if t not in before and thread_target(t) not in THREADS_NOT_OURS
    ]
    if left:  # an object dropped in a cycle (an exception's frames) may own one: collect it first
        gc.collect()
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t for t in left if t.is_alive()]
    if left:
        pytest.fail(
            "threads the test started are still running:\n"
            + "\n".join(f"  {describe_thread(t)}" for t in left),
            pytrace=False,
        )
