"""A rank's counts windows: the slot counts an engine recorded, closed into windows and
handed to the agent without the serving thread waiting for the device.

The close rule, the same for every engine: a window holds the counts of one placement
(its version and map are those the passes ran on), so an adapter closes it before a
placement changes and whenever `window_steps` passes went by. A close starts a
device-to-host copy (pinned memory and an event on CUDA) and returns at once; the window
goes to the agent when its copy is done (`poll`, called at every pass), in close order.
Only `close(..., wait=True)` waits for the device, where the adapter needs the window sent
before what it reports next (the plan it commits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from rebalancer.wire.layout import logical_counts
from worker_hooks.agent import WorkerAgent


def window_due(step: int, start: int, steps: int) -> bool:
    """The close rule's count part, for every rank of every engine (the project's hook
    included): the window opened at pass `start` is due at pass `step` once it ran
    `steps` passes."""
    return step - start >= steps


@dataclass
class _Closed:
    """A closed window whose counts are on their way to the host."""

    first: int                       # first step
    steps: int
    version: int                     # the placement the passes ran on
    phy2log: np.ndarray              # [L, P] its map
    host: torch.Tensor               # [L, P] int64 on the host (filled when `done` fires)
    done: torch.cuda.Event | None    # None: already on the host
    mixed: bool                      # a map no version names: only the logical counts go up


class CountWindows:
    """Slot counts `[L, P]` of the open window on the device they were recorded on, and
    the closed windows still being copied (module docstring).

    `divide_by`: how many ranks count each routed token (the counts sent are divided by
    it, rounded)."""

    def __init__(self, agent: WorkerAgent, num_logical: int, divide_by: int = 1) -> None:
        self.agent = agent
        self.num_logical = num_logical
        self.divide_by = divide_by
        self.start = 0                 # first step of the open window
        self.sent = 0                  # windows handed to the agent
        self.tokens_sent = 0           # routed (token, k) pairs in them
        self._counts: torch.Tensor | None = None
        self._closed: deque[_Closed] = deque()

    def add(self, counts: torch.Tensor) -> None:
        """One pass's (or step's) counts per physical slot, `[L, P]`, on any device."""
        if self._counts is None:
            self._counts = torch.zeros(counts.shape, dtype=torch.int64, device=counts.device)
        self._counts += counts

    def close(self, end: int, version: int, phy2log: np.ndarray, mixed: bool = False,
              wait: bool = False) -> None:
        """End the open window at step `end` (exclusive): its counts were taken on
        placement `version` with map `phy2log`. Nothing counted: the window stays open
        (it then spans the steps with no count, which is what they recorded)."""
        counts = self._counts
        if counts is not None and end > self.start:
            if counts.device.type == "cuda":
                host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
                host.copy_(counts, non_blocking=True)
                done: torch.cuda.Event | None = torch.cuda.Event()
                assert done is not None
                done.record()
            else:
                host, done = counts.clone(), None
            counts.zero_()  # stream-ordered after the copy: the buffer is reused
            self._closed.append(_Closed(self.start, end - self.start, version,
                                        np.array(phy2log, dtype=np.int64, copy=True), host, done, mixed))
            self.start = end
        self.poll(wait)

    def poll(self, wait: bool = False) -> None:
        """Hand the agent every closed window whose copy is done, oldest first; with
        `wait`, all of them (waiting for the device)."""
        while self._closed:
            window = self._closed[0]
            if window.done is not None and not window.done.query():
                if not wait:
                    return
                window.done.synchronize()
            self._closed.popleft()
            physical = window.host.numpy().astype(np.int64)
            if self.divide_by > 1:
                physical = np.rint(physical / self.divide_by).astype(np.int64)
            logical = logical_counts(physical, window.phy2log, self.num_logical)
            self.agent.submit_window(window.first, window.steps, window.version, logical,
                                     None if window.mixed else physical)
            self.sent += 1
            self.tokens_sent += int(logical.sum())
