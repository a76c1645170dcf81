"""The pod's windows: merged per sequence number, then held in a bounded buffer.

`WindowMerge` sums the windows the pod's ranks send under one (rank-local) sequence number
and releases a merged window, oldest first, once every rank sent its own, or once some
rank is `fold_lag` windows ahead: a rank that lags or left does not hold the others back
(the controller's rule, ingest.py). A window that arrives after its sequence number was
released is added to the oldest one still open, so its counts are not lost.

`WindowBuffer` holds merged windows until the upstream stream takes them. While the
controller is unreachable it fills; past `limit` its two oldest windows are merged into
one (counts summed, steps added), so memory stays bounded however long the outage
(invariant 3: merged, never queued unbounded).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from rebalancer.sidecar.errors import SidecarError


@dataclass
class MergedWindow:
    """Counts of the pod's ranks over one window (or several, once merged in the buffer)."""

    first_step: int
    num_steps: int
    version: int                       # newest placement version its ranks served
    logical: np.ndarray                # [L, E] int64, summed over ranks
    physical: np.ndarray | None        # [L, P] int64, None unless every part had one
    ranks: set[int] = field(default_factory=set)
    parts: int = 0                     # rank windows summed into it

    def add(self, first_step: int, num_steps: int, version: int,
            logical: np.ndarray, physical: np.ndarray | None) -> None:
        if self.parts == 0:
            self.first_step, self.num_steps = first_step, num_steps
        else:
            self.first_step = min(self.first_step, first_step)
            self.num_steps = max(self.num_steps, num_steps)
        self.version = max(self.version, version)
        self.logical += logical
        if physical is None or (self.physical is None and self.parts):
            self.physical = None  # a part without dispatched counts: none for the sum
        elif self.physical is None:
            self.physical = physical.astype(np.int64)
        else:
            self.physical += physical
        self.parts += 1


class WindowMerge:
    """Merges the ranks' windows per (rank-local) sequence number.

    Each rank numbers its windows from the `next_seq` the sidecar gave it at Register; a
    resent window (below the rank's cursor) is dropped, a gap is refused."""

    def __init__(self, ranks: tuple[int, ...], fold_lag: int = 2) -> None:
        self.ranks = frozenset(ranks)
        self.fold_lag = fold_lag
        self.next_seq: dict[int, int] = {}  # rank -> next seq it may send
        self.newest_seq = -1
        self._pending: dict[int, MergedWindow] = {}

    def cursor(self, rank: int) -> int:
        """The seq a (re)registering rank numbers its next window with (fixed from now on):
        its own cursor, or for a rank not seen yet, the newest seq any rank sent plus one
        (so the pod's ranks start aligned)."""
        return self.next_seq.setdefault(rank, self.newest_seq + 1)

    def add(self, rank: int, seq: int, first_step: int, num_steps: int, version: int,
            logical: np.ndarray, physical: np.ndarray | None) -> bool:
        """Merge one rank's window; False for a duplicate. Raises SidecarError on a gap."""
        if rank not in self.ranks:
            raise SidecarError("INVALID_ARGUMENT", f"rank {rank} is not one of this pod's ranks")
        expected = self.next_seq.get(rank, seq)
        if seq < expected:
            return False
        if seq > expected:
            raise SidecarError("FAILED_PRECONDITION", f"window seq {seq} from rank {rank}: expected {expected}")
        self.next_seq[rank] = seq + 1
        self.newest_seq = max(self.newest_seq, seq)
        if self._pending and seq < min(self._pending):
            target = self._pending[min(self._pending)]  # its seq was released: count it now
        else:
            target = self._pending.get(seq) or self._open(seq, logical.shape)
        target.add(first_step, num_steps, version, logical, physical)
        target.ranks.add(rank)
        return True

    def _open(self, seq: int, shape: tuple[int, ...]) -> MergedWindow:
        window = MergedWindow(0, 0, 0, np.zeros(shape, np.int64), None)
        self._pending[seq] = window
        return window

    def ready(self) -> Iterator[MergedWindow]:
        """Release, oldest first, the windows that are complete or left behind."""
        while self._pending:
            seq = min(self._pending)
            window = self._pending[seq]
            if window.ranks < self.ranks and self.newest_seq - seq < self.fold_lag:
                return
            del self._pending[seq]
            yield window

    def flush(self) -> list[MergedWindow]:
        """Everything still open, oldest first (on shutdown)."""
        out = [self._pending[s] for s in sorted(self._pending)]
        self._pending.clear()
        return out

    @property
    def open_windows(self) -> int:
        return len(self._pending)


class WindowBuffer:
    """Merged windows waiting for the upstream stream; at most `limit`."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._windows: deque[MergedWindow] = deque()
        self.merged = 0  # times the two oldest were merged to stay within the limit

    def __len__(self) -> int:
        return len(self._windows)

    def push(self, window: MergedWindow) -> None:
        self._windows.append(window)
        while len(self._windows) > self.limit:
            self._merge_oldest()

    def _merge_oldest(self) -> None:
        a = self._windows.popleft()
        b = self._windows[0]
        physical = None
        if a.physical is not None and b.physical is not None:
            physical = a.physical + b.physical  # slot -> GPU is fixed: any versions add up
        self._windows[0] = MergedWindow(
            a.first_step, a.num_steps + b.num_steps, max(a.version, b.version),
            a.logical + b.logical, physical, a.ranks | b.ranks, a.parts + b.parts,
        )
        self.merged += 1

    def take(self) -> list[MergedWindow]:
        out = list(self._windows)
        self._windows.clear()
        return out
