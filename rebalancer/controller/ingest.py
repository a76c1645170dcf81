"""Merging the windows of every rank of a deployment into one window per sequence number.

Each rank numbers its windows 0, 1, 2, ... A window is ingested once: a resent one
(sequence number below the rank's cursor) is recognised and dropped, a gap is refused.
The windows of one sequence number are summed over ranks and released, in order, once
every rank sent its own, or once some rank is `fold_lag` windows ahead (a rank that lags
or left must not hold the others back). Memory stays bounded: at most `fold_lag` + 1
sequence numbers are pending.

A group session (a pod's sidecar) sends one window per sequence number for all its
ranks, already summed: it covers each of them and moves each one's cursor; the group
resumes from the highest cursor of its ranks (`expected`), so nothing counts twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from rebalancer.controller.coordinate import Ranks, rank_set, who
from rebalancer.controller.errors import StateError

FOLD_LAG = 2


@dataclass
class MergedWindow:
    seq: int
    logical: np.ndarray               # [L, E] float64, summed over ranks
    physical: np.ndarray | None       # [L, P] float64 when ranks sent dispatched counts
    ranks: set[int] = field(default_factory=set)


class WindowMerger:
    def __init__(self, num_ranks: int, fold_lag: int = FOLD_LAG) -> None:
        self.num_ranks = num_ranks
        self.fold_lag = fold_lag
        self.next_seq: dict[int, int] = {}  # rank -> next window it may send
        self.newest_seq = -1                # highest sequence number any rank sent
        self._pending: dict[int, MergedWindow] = {}

    def restore(self, next_seq: dict[int, int]) -> None:
        """Resume from a saved cursor (windows below it were counted before)."""
        self.next_seq = dict(next_seq)
        self.newest_seq = max(next_seq.values(), default=0) - 1

    def expected(self, rank: Ranks) -> int:
        """The next seq a rank (or a group: the highest cursor of its ranks) may send."""
        return max(self.next_seq.get(r, 0) for r in rank_set(rank))

    def add(self, rank: Ranks, seq: int, logical: np.ndarray, physical: np.ndarray | None) -> bool:
        """Merge one rank's window (or a group's, summed over its ranks); False when it is a
        duplicate. Raises StateError on a gap.

        logical: [L, E] counts, physical: [L, P] or None (any integer or float dtype)."""
        ranks = rank_set(rank)
        expected = self.expected(ranks)
        if seq < expected:
            return False
        if seq > expected and any(r in self.next_seq for r in ranks):
            raise StateError("FAILED_PRECONDITION", f"window seq {seq} from {who(ranks)}: expected {expected}")
        for r in ranks:
            self.next_seq[r] = seq + 1
        self.newest_seq = max(self.newest_seq, seq)
        window = self._pending.get(seq)
        if window is None:  # the first window of a seq is copied (as float64), not added to zeros
            window = self._pending[seq] = MergedWindow(seq, logical.astype(np.float64), None)
        else:
            window.logical += logical
        if physical is not None:  # slot -> GPU is fixed, so any version's slots add up
            if window.physical is None:
                window.physical = physical.astype(np.float64)
            else:
                window.physical += physical
        window.ranks |= ranks
        return True

    def ready(self) -> Iterator[MergedWindow]:
        """Release, oldest first, the windows that are complete or left behind."""
        while self._pending:
            seq = min(self._pending)
            window = self._pending[seq]
            if len(window.ranks) < self.num_ranks and self.newest_seq - seq < self.fold_lag:
                return
            del self._pending[seq]
            yield window
