"""Windows of expert counts on their way up: one merge rule for ranks, sidecars and the
controller.

`SeqMerger` sums the windows a group of ranks sends under one sequence number (each rank
numbers its windows 0, 1, 2, ... from the cursor it was given) and releases a merged
window, oldest first, once every rank sent its own, or once some rank is `fold_lag`
windows ahead: a rank that lags or left does not hold the others back. A resent window
(below the rank's cursor) is recognised and dropped, a gap is refused. A window that
arrives after its sequence number was released is added to the oldest one still open,
so its counts are not lost. A sidecar's group session sends one window per sequence
number for all its ranks, already summed: it covers each of them and moves each one's
cursor. Memory stays bounded: at most `fold_lag` + 1 sequence numbers are open.
The pod's sidecar merges its ranks' windows with it; the controller merges the windows
of every rank (or sidecar) of a deployment with it.

`BoundedWindows` holds windows until a link takes them (a rank's agent, a sidecar's
upstream). While the link is down it fills; past `limit` its two oldest windows are
merged into one (counts summed, steps added), so memory stays bounded however long the
outage (invariant 3: merged, never queued unbounded).

Dispatched (physical) counts of windows on different placement versions add up: a
slot's GPU never changes, so the sum is the GPUs' load over both. A merged window has
them only when every part had them (a partial sum would misstate the GPUs' load).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from rebalancer.errors import StateError

# The most forward steps one window may hold: its steps travel as a uint32
# (Window.num_steps), so the sidecar and the controller refuse more. Settings that choose
# a window's length (HookConfig.windows.steps, the adapters' REBALANCER_WINDOW_STEPS) are
# held to it.
MAX_WINDOW_STEPS = 2**32 - 1


# Windows a rank may run ahead of a silent one before the silent one's are released.
FOLD_LAG = 2


# One rank, or a sidecar's group of ranks that speaks for all of them.
Ranks = int | Collection[int]


def rank_set(ranks: Ranks) -> frozenset[int]:
    return frozenset((ranks,) if isinstance(ranks, int) else ranks)


def who(ranks: Ranks, pod: str = "") -> str:
    """`rank 3`, or `ranks 4-7 (pod ns/name)` for a group: for logs and refusals."""
    rs = sorted(rank_set(ranks))
    if len(rs) == 1:
        return f"rank {rs[0]}"
    span = f"{rs[0]}-{rs[-1]}" if rs[-1] - rs[0] == len(rs) - 1 else ", ".join(map(str, rs))
    return f"ranks {span}" + (f" (pod {pod})" if pod else "")


@dataclass
class CountWindow:
    """Counts over one window of some ranks (or several windows, once merged in a buffer).

    logical: [L, E], physical: [L, P] or None, both of the merger's dtype."""

    seq: int
    first_step: int
    num_steps: int
    version: int  # newest placement version its parts ran on
    logical: np.ndarray
    physical: np.ndarray | None
    ranks: set[int] = field(default_factory=set)
    parts: int = 0  # windows summed into it

    def add(
        self,
        first_step: int,
        num_steps: int,
        version: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
    ) -> None:
        """Sum one more part (a rank's window of this seq) into this window."""
        if self.parts == 0:
            self.first_step, self.num_steps = first_step, num_steps
        else:
            self.first_step = min(self.first_step, first_step)
            self.num_steps = max(self.num_steps, num_steps)
        self.version = max(self.version, version)
        self.logical += logical
        if physical is None or (self.physical is None and self.parts):
            self.physical = None
        elif self.physical is None:
            self.physical = physical.astype(self.logical.dtype)
        else:
            self.physical += physical
        self.parts += 1

    def followed_by(self, newer: CountWindow) -> CountWindow:
        """This window and the `newer` one after it, as one window."""
        physical = None
        if self.physical is not None and newer.physical is not None:
            physical = self.physical + newer.physical
        return CountWindow(
            self.seq,
            self.first_step,
            self.num_steps + newer.num_steps,
            max(self.version, newer.version),
            self.logical + newer.logical,
            physical,
            self.ranks | newer.ranks,
            self.parts + newer.parts,
        )


class SeqMerger:
    """Merges the windows of a group of ranks per sequence number (module doc)."""

    def __init__(
        self, ranks: Iterable[int], fold_lag: int = FOLD_LAG, dtype: type[np.generic] = np.int64
    ) -> None:
        self.ranks = frozenset(ranks)
        self.fold_lag = fold_lag
        self.dtype = dtype
        self.next_seq: dict[int, int] = {}  # rank -> next seq it may send
        self.newest_seq = -1  # highest seq any rank sent
        self._open: dict[int, CountWindow] = {}

    def restore(self, next_seq: dict[int, int]) -> None:
        """Resume from a saved cursor (windows below it were counted before)."""
        self.next_seq = dict(next_seq)
        self.newest_seq = max(next_seq.values(), default=0) - 1

    def cursor(self, rank: int) -> int:
        """The seq a (re)registering rank numbers its next window with (fixed from now on):
        its own cursor, or for a rank not seen yet, the newest seq any rank sent plus one
        (so the group's ranks start aligned)."""
        return self.next_seq.setdefault(rank, self.newest_seq + 1)

    def expected(self, ranks: Iterable[int]) -> int:
        """The next seq a rank (or a group: the highest cursor of its ranks) may send."""
        get = self.next_seq.get  # once per window: a list is cheaper than a generator
        return max([get(r, 0) for r in ranks])

    def add(
        self,
        ranks: Ranks,
        seq: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
        first_step: int = 0,
        num_steps: int = 0,
        version: int = 0,
    ) -> bool:
        """Merge one window of `ranks` (one rank's, or a group's already summed); False for
        a duplicate. Raises StateError on a gap or a rank outside the group, changing nothing.

        logical: [L, E], physical: [L, P] or None (any integer or float dtype)."""
        group = rank_set(ranks)
        if not group or not group <= self.ranks:
            raise StateError(
                "INVALID_ARGUMENT",
                f"{who(group - self.ranks or group)} is not one "
                f"of the {len(self.ranks)} ranks of this group",
            )
        expected = self.expected(group)
        if seq < expected:
            return False
        if seq > expected and any(r in self.next_seq for r in group):
            raise StateError(
                "FAILED_PRECONDITION", f"window seq {seq} from {who(group)}: expected {expected}"
            )
        for r in group:
            self.next_seq[r] = seq + 1
        self.newest_seq = max(self.newest_seq, seq)
        late = bool(self._open) and seq < min(self._open)
        target: CountWindow | None
        if late:  # its seq was released: count it now, in the oldest window still open
            target = self._open[min(self._open)]
        else:
            target = self._open.get(seq)
        if target is None:  # the seq's first part: a cast copy, not zeros then a sum
            target = self._open[seq] = CountWindow(
                seq,
                first_step,
                num_steps,
                version,
                logical.astype(self.dtype),
                None if physical is None else physical.astype(self.dtype),
                parts=1,
            )
        else:
            target.add(first_step, num_steps, version, logical, physical)
        if not late:  # a late part is not these ranks' window of that seq: still awaited
            target.ranks |= group
        return True

    def ready(self) -> Iterator[CountWindow]:
        """Release, oldest first, the windows that are complete or left behind."""
        while self._open:
            seq = min(self._open)
            window = self._open[seq]
            if window.ranks < self.ranks and self.newest_seq - seq < self.fold_lag:
                return
            del self._open[seq]
            yield window

    def flush(self) -> list[CountWindow]:
        """Everything still open, oldest first (on shutdown)."""
        out = [self._open[s] for s in sorted(self._open)]
        self._open.clear()
        return out

    @property
    def open_windows(self) -> int:
        return len(self._open)


class BoundedWindows:
    """Windows waiting for a link, oldest first; at most `limit` (module doc)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._windows: deque[CountWindow] = deque()
        self.merged = 0  # times the two oldest were merged to stay within the limit

    def __len__(self) -> int:
        return len(self._windows)

    def __iter__(self) -> Iterator[CountWindow]:
        """The waiting windows, oldest first (a look; `take` removes them)."""
        return iter(self._windows)

    def push(self, window: CountWindow) -> None:
        self._windows.append(window)
        while len(self._windows) > self.limit:
            oldest = self._windows.popleft()
            self._windows[0] = oldest.followed_by(self._windows[0])
            self.merged += 1

    def take(self) -> list[CountWindow]:
        out = list(self._windows)
        self._windows.clear()
        return out
