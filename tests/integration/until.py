"""Waiting for events, not for a number of steps.

A test waits for the event it is about (a plan in PREPARE, then the kill; a plan aborted),
bounded by a timeout, and only then stops its ranks: a run of a fixed number of steps
proves nothing on a machine fast enough to finish them before the event (a loaded
machine ran the rank-killed test's 200 steps with no plan started: the fault never
fired). Ranks run open-ended (worker_hooks.examples.cpu_worker `--stop-file`) and all stop
at one step ahead of every rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    """Until `predicate()` is true; fails the test after `seconds`, naming `what`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds:g} s waiting for {what}")


def progress(stop_file: Path, rank: int) -> int | None:
    """The step rank `rank` last wrote next to `stop_file` (None before its first)."""
    try:
        return int((stop_file.parent / f"{stop_file.name}.rank{rank}").read_text())
    except (OSError, ValueError):
        return None


def stop_together(
    stop_file: Path, ranks: Sequence[int], ahead: int = 64, seconds: float = 60.0
) -> int:
    """Make `ranks` stop at one step, `ahead` steps past the furthest of them (a rank
    writes its step every 8 and reads the stop file every 8); returns that step."""
    wait_for(
        lambda: all(progress(stop_file, r) is not None for r in ranks),
        seconds,
        f"ranks {list(ranks)} stepping",
    )
    furthest = max(progress(stop_file, r) or 0 for r in ranks)
    step = (furthest + ahead + 7) // 8 * 8
    tmp = stop_file.parent / f"{stop_file.name}.tmp"
    tmp.write_text(str(step))
    tmp.rename(stop_file)
    return step
