"""Collectives are never let go of where a gloo thread could hold the last reference
at interpreter shutdown.

A gloo worker thread drops its own reference to an asynchronous work just after the
collective ends (completed or failed). If Python let go of the work first, that drop is
the last one: the work's destructor, on the gloo thread, releases its tensors, and
releasing a tensor that has a Python object takes the GIL. During interpreter shutdown a
thread that asks for the GIL is ended by `pthread_exit`, whose unwinding crosses that
noexcept destructor: std::terminate, SIGABRT, "terminate called without an active
exception" (a surviving rank after a killed peer, beside a CPU hog; the core dumps'
aborting thread was in `~AsyncAllreduceWork` under `ProcessGroupGloo::runLoop`,
RELIABILITY.md defect 23). A work that already completed is not safe either: a starved
gloo thread may not have dropped its reference yet when the process starts to exit.

So at shutdown every work (with its tensors) is waited for, each wait bounded, and then
kept for the life of the process, never freed: the gloo threads' drops are never the
last. With a peer dead, every pending collective fails at once. A work still running
after the bound (a peer frozen, not dead) tells the caller this rank did not settle (the
hook's `finish` returns False: leave without tearing the groups down).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Works (with their tensors) their owners are done with at shutdown. The list is given one
# reference that is never returned, so that interpreter shutdown, which clears every
# module's globals, does not free it either.
_KEPT: list[tuple[dist.Work, tuple[Any, ...]]] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))


def settle(works: Iterable[tuple[dist.Work, tuple[Any, ...]]], timeout: float) -> tuple[bool, str]:
    """Wait up to `timeout` seconds in all for each `(work, tensors it uses)` (a failed
    work counts as done), and keep every one of them for the life of the process.
    Returns (every work completed, the first failure or "")."""
    deadline = time.monotonic() + timeout
    error = ""
    settled = True
    for work, tensors in works:
        try:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            error = error or reason(exc)
        _KEPT.append((work, tensors))
        settled = settled and work.is_completed()
    return settled, error


def reason(exc: BaseException) -> str:
    """One line for a log or a report: the exception's type and its message's first line
    (gloo's errors run to many lines, with a hint to read the peer's logs)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def none_running() -> bool:
    """Whether every work kept by `settle` has completed."""
    return all(work.is_completed() for work, _ in _KEPT)
