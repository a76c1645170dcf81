"""The plans a rank holds: each staged map by version, and the newest version the
controller said to commit.

Written by the agent thread (Prepare stages, Commit commits, Abort drops), read by the
serving thread (which version it may switch to, the map it takes at the agreed step):
one lock, held only for the dict and the integer.
"""

from __future__ import annotations

import threading

import numpy as np


class PlanBook:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: dict[int, np.ndarray] = {}  # [L, P] map of each staged plan
        self._committed = 0  # newest version the controller committed

    @property
    def committed(self) -> int:
        """The newest version the controller said to commit (0: none yet)."""
        return self._committed

    def stage(self, version: int, phy2log: np.ndarray, serving: int, alone: bool = False) -> None:
        """Hold plan `version`'s map; plans at or below `serving` (the version served) are
        dropped: no rank can switch to them any more. `alone`: every other plan is dropped
        too (a rank whose weights are staged for one plan at a time)."""
        with self._lock:
            kept = {} if alone else {v: p for v, p in self._staged.items() if v > serving}
            self._staged = {**kept, version: phy2log}

    def commit(self, version: int) -> None:
        with self._lock:
            self._committed = max(self._committed, version)

    def ready(self, serving: int) -> int:
        """The newest version this rank may switch to: the committed one when its map is
        staged here, else `serving`."""
        with self._lock:
            committed = self._committed
            return committed if committed > serving and committed in self._staged else serving

    def get(self, version: int) -> np.ndarray | None:
        with self._lock:
            return self._staged.get(version)

    def take(self, version: int) -> np.ndarray | None:
        """Plan `version`'s map, no longer held (None: not staged)."""
        with self._lock:
            return self._staged.pop(version, None)

    def drop(self, version: int) -> None:
        with self._lock:
            self._staged.pop(version, None)

    def clear(self) -> None:
        with self._lock:
            self._staged.clear()

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return version in self._staged

    def __len__(self) -> int:
        with self._lock:
            return len(self._staged)
