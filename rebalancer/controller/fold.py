"""Windows in: merge each rank's window, fold what became complete, decide when due.

A window a rank (or a pod's sidecar, for its ranks) sends is merged with the other
ranks' windows of the same sequence number (ingest.py); a complete (or left-behind) one is folded
into the deployment's load estimate, measured (routed balancedness on the GPUs), shown to the window
observers, and may make a policy decision due. The ingest cursor (per-rank next seq + the estimate
built from them) is saved every `persist_seconds`, or less often when the fleet's cursors
would write more than `cursor_bytes_per_second` to the store (`Folder.persist_interval`:
at 2,048 DeepSeek-V3 deployments a cursor round is 245 MB), so a crash loses at most one
interval of counting and never counts a window twice.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from rebalancer import placement
from rebalancer.controller.clock import Clock
from rebalancer.controller.decision_runner import DecisionRunner
from rebalancer.controller.deployment import Deployment, Observers, WindowEvent
from rebalancer.controller.store import Store
from rebalancer.placement.metrics import balancedness_of_gpu_loads, mean_balancedness, pack_sums
from rebalancer.wire.windows import CountWindow, Ranks

# (deployment, window, now) -> True when the deployment's replica pool decides for it
# (replica_pools/fleet.py `Fleet.folded`).
# (deployment, its merged window's counts [L, E], their per-layer sums [L], now)
Pooled = Callable[[Deployment, np.ndarray, np.ndarray, float], bool]


# Cursor bytes the periodic saves may hand the store per second, all deployments together
# (ServerConfig.cursor_mb_per_second): 8 MB/s keeps 5 s saves up to 330 DeepSeek-V3
# deployments (~120 kB a cursor) and saves 2,048 of them every 31 s.
DEFAULT_CURSOR_BYTES_PER_SECOND = 8e6


class Folder:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        decisions: DecisionRunner,
        observers: Observers,
        persist_seconds: float,
        pooled: Pooled | None = None,
        cursor_bytes_per_second: float = DEFAULT_CURSOR_BYTES_PER_SECOND,
    ) -> None:
        self.store = store
        self.clock = clock
        self.decisions = decisions
        self.observers = observers
        self.persist_seconds = persist_seconds
        self.cursor_bytes_per_second = cursor_bytes_per_second
        self.pooled = pooled
        # The newest cursor row's bytes per deployment and their sum: one round of saves.
        self._cursor_bytes: dict[str, int] = {}
        self._cursor_round = 0
        # Rank windows folded into estimates, all deployments (a merged window counts each
        # rank it holds): what the controller kept up with (bench.ingest reads it).
        self.rank_windows_folded = 0

    def ingest(
        self,
        dep: Deployment,
        rank: Ranks,
        seq: int,
        version: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
    ) -> bool:
        """Merge one rank's window (or a group's, summed over its ranks) and fold what
        became complete; False for a duplicate. `logical` / `physical`: as
        `codec.decode_counts` returns them, validated (the estimate does not check the
        merged counts again)."""
        if not dep.ingest(rank, seq, logical, physical):
            return False
        for window in dep.ready_windows():
            self._fold(dep, window)
        return True

    def _fold(self, dep: Deployment, window: CountWindow) -> None:
        logical = window.logical
        self.rank_windows_folded += len(window.ranks)
        G = dep.shape.num_gpus
        actual, gpu_load = float("nan"), None
        if window.physical is not None:
            gpu_load = pack_sums(window.physical, G)
            actual = routed_balancedness(gpu_load)
        picks = logical.sum(axis=1)  # per layer, read by the fold and the pool's test
        dep.fold(logical, gpu_load, actual, picks)
        now = self.clock()
        if now - dep.persisted_at >= self.persist_interval():
            self.persist(dep, now, background=True)
        if self.observers.window:
            best = float("nan")
            if logical.sum() > 0:
                best = placement.compute_placement(
                    logical, dep.shape.num_slots, G, dep.shape.num_nodes
                ).balancedness
            event = WindowEvent(
                dep.name,
                window.seq,
                len(window.ranks),
                dep.version,
                int(logical.sum()),
                actual,
                placement.balancedness(dep.phy2log, dep.estimate(), G),
                best,
            )
            for observer in self.observers.window:
                observer(event)
        if self.pooled is not None and self.pooled(dep, logical, picks, now):
            return  # a pool member following its pool: the pool decides (replica_pools/)
        if self.decisions.due(dep, now):
            self.decisions.run(dep, now)

    def persist_interval(self) -> float:
        """Seconds between two saves of one deployment's cursor: `persist_seconds`, or as
        long as one round of every deployment's cursor takes at `cursor_bytes_per_second`
        (the store's writer and its lock are shared with the plan rows the event loop
        writes)."""
        return max(self.persist_seconds, self._cursor_round / self.cursor_bytes_per_second)

    def persist(self, dep: Deployment, now: float | None = None, background: bool = False) -> None:
        """Save the ingest cursor: per-rank next window seq with the estimate built from them.
        `background`: written by the store's writer thread (the periodic saves of `_fold`,
        so the event loop never waits for SQLite); the drain path saves in line.

        The first save (at the deployment's first fold) sets its phase: the next one comes
        up to one period early, by a fraction fixed by its name, so the saves of deployments
        that started together spread over the period instead of stalling the event loop
        all at once every period (an interval is never longer than `persist_interval`)."""
        now = self.clock() if now is None else now
        first = dep.persisted_at == -float("inf")
        stagger = (
            min(self.persist_interval(), MAX_STAGGER_SECONDS) * _phase(dep.name) if first else 0.0
        )
        dep.saved(now - stagger)
        size = self.store.save_ingest_state(dep.name, dep.cursor(), background=background) or 0
        self._cursor_round += size - self._cursor_bytes.get(dep.name, 0)
        self._cursor_bytes[dep.name] = size


# The first save's phase spreads the next ones over at most this many seconds.
MAX_STAGGER_SECONDS = 10.0


def _phase(name: str) -> float:
    """A fraction in [0, 1) fixed by the deployment's name."""
    return zlib.crc32(name.encode()) / 2**32


def routed_balancedness(gpu_load: np.ndarray) -> float:
    """Balancedness of the GPUs' dispatched load [L, G] (`pack_sums` of the slot counts
    [L, P]); NaN without load."""
    per_layer = balancedness_of_gpu_loads(gpu_load)
    return mean_balancedness(per_layer) if np.isfinite(per_layer).any() else float("nan")
