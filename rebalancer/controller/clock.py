"""The controller's one clock.

Everything the controller times (plan deadlines, session ages, the ingest cursor's save
interval, ack pacing, decision periods) and every time it stores (plan and decision
history) reads one injected callable, so a test or a replay substitutes one function and
the whole controller follows. The default counts seconds since the epoch yet never goes
back: the monotonic clock, offset once to the wall clock when it is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


def system_clock() -> Clock:
    """Epoch seconds that never go back (a wall-clock step does not move deadlines)."""
    offset = time.time() - time.monotonic()

    def now() -> float:
        return time.monotonic() + offset

    return now
