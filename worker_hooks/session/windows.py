"""A rank's counts windows: the counts an engine (or the project's hook) recorded, closed
into windows and handed to the agent without the serving thread waiting for the device.

The close rule, the same for every engine and the hook: a window holds the counts of one
placement (its version and map are those the passes ran on), so a rank closes it before a
placement changes and whenever `window_steps` passes went by (`window_due`). A close
starts a device-to-host copy of the open window's buffer (pinned memory and an event on
the current stream, then the buffer zeroed in place behind the copy: a CUDA graph that
adds to it stays valid) and returns at once; the window goes to the agent when its copy
is done (`poll`, called at every pass), in close order. Only `wait=True` waits for the
device, where a rank needs the window sent before what it reports next (the plan it
commits).

`WindowPipeline` is that pipeline over any buffer, with what a window's host counts mean
told at its close (`Read`); `CountWindows` is it over slot counts `[L, P]`, what the
engine adapters record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rebalancer.wire.layout import logical_counts
from worker_hooks.agent import WorkerAgent

# A closed window's host counts (the buffer's shape) -> what goes up: counts per logical
# expert [L, E] and per slot [L, P] (None: the logical counts only).
Read = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]


def window_due(step: int, start: int, steps: int) -> bool:
    """The close rule's count part, for every rank of every engine (the project's hook
    included): the window opened at pass `start` is due at pass `step` once it ran
    `steps` passes."""
    return step - start >= steps


@dataclass
class _Closed:
    """A closed window whose counts are on their way to the host."""

    first: int  # first step
    steps: int
    version: int  # the placement the passes ran on
    host: torch.Tensor  # the buffer's counts on the host (filled when `done` fires)
    done: torch.cuda.Event | None  # None: already on the host
    read: Read  # what they mean, under that placement


class WindowPipeline:
    """The open window's counts in a buffer on the device they are recorded on, and the
    closed windows still being copied (module docstring). `counts`: the buffer (int64,
    e.g. a recorder's static counters); None: made at the first `add`."""

    def __init__(self, agent: WorkerAgent, counts: torch.Tensor | None = None) -> None:
        self.agent = agent
        self.start = 0  # first step of the open window
        self.sent = 0  # windows handed to the agent
        self.tokens_sent = 0  # routed (token, k) pairs in them
        self._counts = counts
        self._closed: deque[_Closed] = deque()

    @property
    def in_flight(self) -> int:
        """Closed windows not yet handed to the agent."""
        return len(self._closed)

    def add(self, counts: torch.Tensor) -> None:
        """Add one pass's (or step's) counts, the buffer's shape, on any device."""
        if self._counts is None:
            self._counts = torch.zeros(counts.shape, dtype=torch.int64, device=counts.device)
        self._counts += counts

    def close_as(self, end: int, version: int, read: Read, wait: bool = False) -> None:
        """End the open window at step `end` (exclusive): its counts were taken on
        placement `version`, and `read` tells what they are. Nothing counted: the window
        stays open (it then spans the steps with no count, which is what they recorded)."""
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
            self._closed.append(_Closed(self.start, end - self.start, version, host, done, read))
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
            logical, physical = window.read(window.host.numpy().astype(np.int64))
            self.agent.submit_window(window.first, window.steps, window.version, logical, physical)
            self.sent += 1
            self.tokens_sent += int(logical.sum())


class CountWindows(WindowPipeline):
    """The pipeline over slot counts `[L, P]`, read with the map the passes ran on.

    `divide_by`: how many ranks count each routed token (the counts sent are divided by
    it, rounded)."""

    def __init__(self, agent: WorkerAgent, num_logical: int, divide_by: int = 1) -> None:
        super().__init__(agent)
        self.num_logical = num_logical
        self.divide_by = divide_by

    def close(
        self, end: int, version: int, phy2log: np.ndarray, mixed: bool = False, wait: bool = False
    ) -> None:
        """`close_as` with slot counts taken on map `phy2log` `[L, P]`; `mixed`: a map no
        version names, whose logical counts only go up."""
        held = np.array(phy2log, dtype=np.int64, copy=True)

        def read(physical: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            if self.divide_by > 1:
                physical = np.rint(physical / self.divide_by).astype(np.int64)
            return logical_counts(physical, held, self.num_logical), None if mixed else physical

        self.close_as(end, version, read, wait)
