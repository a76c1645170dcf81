"""How busy the controller's one event loop is: wall time outside the selector's wait.

Everything the controller does runs on one asyncio loop (ARCHITECTURE.md), so the share
of wall time that loop spends running callbacks is what says how close a controller is to
lagging behind its ranks: near 1, windows queue and their latency grows without the CPU
figure of the process showing why (the loop's time also counts the moments it waited
for a core or for the GIL). The loop waits for I/O and timers only in its selector's
`select`; `TimedSelector` times those waits, and busy time is the rest of the wall time
since the loop started.

`rebalancer serve` and the embedded controller run their loop on one (`timed_loop`);
`for_loop(loop)` finds it again (None for a loop made elsewhere), and the metrics export
it as `rebalancer_event_loop_busy_seconds_total`.
"""

from __future__ import annotations

import asyncio
import selectors
import time
import weakref
from typing import Any

_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TimedSelector] = (
    weakref.WeakKeyDictionary()
)


class TimedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's default selector, with the time spent waiting in `select` added up."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self.started = clock()
        self.waited = 0.0  # seconds inside select()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        t0 = self._clock()
        try:
            return super().select(timeout)
        finally:
            self.waited += self._clock() - t0

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
