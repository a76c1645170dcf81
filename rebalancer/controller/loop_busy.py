"""How busy the controller's one event loop is: wall time outside the selector's wait.

Everything the controller does runs on one asyncio loop (ARCHITECTURE.md), so the share
of wall time that loop spends running callbacks is what says how close a controller is to
lagging behind its ranks: near 1, windows queue and their latency grows without the CPU
figure of the process showing why (the loop's time also counts the moments it waited
for a core or for the GIL). The loop waits for I/O and timers only in its selector's
`select`; `TimedSelector` times those waits, and busy time is the rest of the wall time
since the loop started.

The busy share says how much; how long at once is the other half. Between two waits the
loop runs every callback that became ready, one after another: a window that arrives
meanwhile waits for all of them (a decision's result, a plan's fan-out, a store write), so
a long iteration is a latency spike even on a loop that is mostly idle. The selector
counts each iteration's length into ITERATION_BUCKETS.

`rebalancer serve` and the embedded controller run their loop on one (`timed_loop`);
`for_loop(loop)` finds it again (None for a loop made elsewhere), and the metrics export
it as `rebalancer_event_loop_busy_seconds_total` and
`rebalancer_event_loop_iteration_seconds`.
"""

from __future__ import annotations

import asyncio
import bisect
import selectors
import time
import weakref
from typing import Any

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TimedSelector] = (
    weakref.WeakKeyDictionary()
)


# Upper bounds (seconds) of the histogram of loop iterations; the last bucket is +Inf.
ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class TimedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's default selector, with the time spent waiting in `select` added up,
    and the time between two waits (one loop iteration) counted into ITERATION_BUCKETS."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self.started = clock()
        self.waited = 0.0  # seconds inside select()
        self._left = self.started  # when the last select() returned
        # Iterations per bucket (ITERATION_BUCKETS, then +Inf; not cumulative) and their sum.
        self.iterations = [0] * (len(ITERATION_BUCKETS) + 1)
        self.iteration_seconds = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        t0 = self._clock()
        ran = t0 - self._left
        self.iterations[bisect.bisect_left(ITERATION_BUCKETS, ran)] += 1
        self.iteration_seconds += ran
        try:
            return super().select(timeout)
        finally:
            self._left = self._clock()
            self.waited += self._left - t0

    def busy_seconds(self) -> float:
        """Wall seconds since the selector was made that the loop spent outside select()."""
        return max(0.0, self._clock() - self.started - self.waited)


def timed_loop() -> asyncio.AbstractEventLoop:
    """A new selector event loop whose waits are timed (a loop factory for asyncio.Runner)."""
    selector = TimedSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _BY_LOOP[loop] = selector
    return loop


def for_loop(loop: asyncio.AbstractEventLoop) -> TimedSelector | None:
    """The timed selector of `loop`, if `timed_loop` made it."""
    return _BY_LOOP.get(loop)
