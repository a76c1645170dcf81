"""The decision worker process, which never outlives the controller.

Decisions (placement math, ~0.1 s for DeepSeek-V3 at EP32) run in a process of their
own, so ingest keeps the event loop and the GIL to itself. That process must die with
the controller, however the controller ends, SIGKILL included. So it is a plain child
(`python -m rebalancer.controller.decision_process`, no multiprocessing machinery: no resource
tracker or semaphores that could outlive anything) fed pickled calls on its stdin:
- the kernel sends it SIGKILL when the controller dies (PR_SET_PDEATHSIG, Linux);
- its stdin reaches end of file when the controller dies or closes it (the
  controller holds the only write end), and it exits there;
- `close` is the clean path: queued decisions are cancelled, the running one is
  waited for, stdin is closed and the process reaped.
One thread of the controller writes a call and waits for its result, one at a time, so
the event loop never blocks on the worker. A worker that died is started afresh at the
next decision.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("rebalancer.server")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The worker's niceness above the controller's: decisions are background work, so where
# cores are short the scheduler serves ingest first (windows wait behind decisions
# otherwise: issue 12's latency with 512 deployments deciding on 2 cores).
DECISION_NICENESS = 10
_WATCH_SECONDS = 1.0
_EXIT_SECONDS = 5.0


class DecisionError(RuntimeError):
    """A decision raised in the worker (the message carries its traceback), or the
    worker died while computing it."""


class _Worker:
    """One child process and the pipes to it."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # The child imports this package wherever the controller found it.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer.controller.decision_process",
                "--parent",
                str(os.getpid()),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.broken = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the child and return its result; on `DecisionProcess`'s thread only."""
        if self.broken:
            raise DecisionError("the decision process died")
        payload = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)  # all or nothing on the pipe
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            ok, value = pickle.load(self.proc.stdout)
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self.broken = True
            raise DecisionError(
                f"the decision process died (exit code {self.proc.poll()})"
            ) from exc
        if not ok:
            raise DecisionError(value)
        return value

    def close(self) -> None:
        """End of file on its stdin ends it; killed if it does not exit in time."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class DecisionProcess:
    """The decision worker and the thread that talks to it; `submit` is the
    controller's `Background`. Call everything but the work itself on the event loop."""

    def __init__(self) -> None:
        self._calls = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="decisions"
        )
        self._worker: _Worker | None = None
        self._closing = False

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def start(self) -> None:
        """Start the worker now, not at the first decision (it imports numpy, scipy and
        the placement engine as it starts: a second or two)."""
        self._ensure_worker()

    def _ensure_worker(self) -> _Worker:
        # Spawned from the event loop's thread, which lives as long as the controller
        # (PR_SET_PDEATHSIG fires when the thread that started the child ends).
        if self._worker is None or self._worker.broken:
            if self._worker is not None:
                self._worker.close()
            self._worker = _Worker()
        return self._worker

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the started worker answers a call (its imports done: a second or
        two, longer on a loaded machine), for a caller that must not race them (a test
        whose ranks stream at once). From any thread but the event loop's: the call runs
        in turn on this object's own thread."""
        worker = self._worker
        if worker is None:
            raise RuntimeError("the decision process is not started")
        self._calls.submit(worker.call, int).result(timeout)

    def submit(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Run `fn` in the worker, then `done(result)` (None if it raised) on this event
        loop. Once closing, nothing new runs and results are dropped (the store may be
        closed already)."""
        if self._closing:
            return
        worker = self._ensure_worker()
        future = asyncio.get_running_loop().run_in_executor(self._calls, worker.call, fn)

        def finish(f: asyncio.Future[Any]) -> None:
            if self._closing or f.cancelled():
                return
            try:
                result = f.result()
            except Exception:
                log.exception("background decision failed")
                result = None
            done(result)

        future.add_done_callback(finish)

    def stop_accepting(self) -> None:
        """Draining: run no new decision, act on none that comes back."""
        self._closing = True

    def close(self) -> None:
        """Cancel queued decisions, end the worker process, running decision and all.

        A decision running now is killed, not waited for: its result would be dropped
        (closing), and the worker runs at a lower priority, so on a starved node it could
        hold a draining controller for many seconds (a SIGTERM'd controller took 12-16 s
        to come back beside a CPU hog, RELIABILITY.md defect 21)."""
        self._closing = True
        if self._worker is not None:
            with contextlib.suppress(ProcessLookupError):
                self._worker.proc.kill()  # the call in flight ends at once (end of file)
        self._calls.shutdown(wait=True, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()
            self._worker = None


# ---------------------------------------------------------------- in the worker process


def bind_to_parent(parent: int) -> None:
    """Die with `parent`, the controller: SIGKILL from the kernel when it ends (Linux),
    else a thread that exits when the parent pid changes."""
    try:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent:  # it died before the request took effect
                    os._exit(1)
                return
    except (OSError, AttributeError):
        pass
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    os._exit(1)


def serve_calls(calls: IO[bytes], results: IO[bytes]) -> None:
    """Run pickled calls from `calls` one by one, each answered on `results` with
    (True, result) or (False, traceback text), until end of file."""
    while True:
        try:
            fn = pickle.load(calls)
        except EOFError:
            return
        try:
            reply: tuple[bool, Any] = (True, fn())
        except Exception:
            reply = (False, traceback.format_exc())
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = pickle.dumps((False, traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
        results.write(data)
        results.flush()


def main(argv: list[str]) -> None:
    parent = int(argv[argv.index("--parent") + 1]) if "--parent" in argv else os.getppid()
    bind_to_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the controller's to handle
    try:
        os.nice(DECISION_NICENESS)
    except OSError:
        pass  # not allowed here: decisions still run, at the controller's priority
    # Results travel on the original stdout; anything printed goes to stderr instead.
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import scipy.optimize  # noqa: F401  (warm up: what every decision needs)

    import rebalancer.controller.decide  # noqa: F401

    serve_calls(sys.stdin.buffer, results)


if __name__ == "__main__":
    main(sys.argv[1:])
