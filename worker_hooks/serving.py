"""What a rank serves now, and what its hook has counted: state the serving thread owns.

`ServedPlacement` is the placement in force (SGLang calls it the expert location): its
version, its map and the weight row of every slot. Only the hot path changes it, at the
step the ranks agreed on (`RebalanceHook.step_end`); the plan driver reads it to check a
Prepare's base, the agent to tell the controller which version the rank serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class ServedPlacement:
    """The placement a rank serves: `version`, `phy2log` `[L, P]` and `row_ids` `[L, P]`
    (the weight row of each slot, worker_hooks/rows.py). Changed by `switch` alone."""

    def __init__(self, phy2log: np.ndarray, row_ids: np.ndarray) -> None:
        self.version = 0
        self.phy2log = phy2log
        self.row_ids = row_ids

    def current_version(self) -> int:
        """The version served (read from other threads: an int, read whole)."""
        return self.version

    def current_map(self) -> np.ndarray:
        """The map served (read from other threads after `current_version`: switch
        replaces the array whole, never writes into it)."""
        return self.phy2log

    def switch(self, version: int, phy2log: np.ndarray, row_ids: np.ndarray) -> None:
        """Serve `version` from now on (the serving thread, at the agreed step)."""
        self.version, self.phy2log, self.row_ids = version, phy2log, row_ids


@dataclass
class HookStats:
    """A rank's counters. The serving thread writes the steps, windows, commits and
    totals; the plan driver (agent and migration threads) the plans' outcomes."""

    steps: int = 0
    windows: int = 0
    commits: list[tuple[int, int]] = field(default_factory=list)  # (step, version)
    prepared: int = 0
    failed: int = 0
    aborted: int = 0
    bytes_received: int = 0
    swap_seconds: list[float] = field(default_factory=list)
    copied_at_commit: int = 0  # experts copied in commit pauses (none with enough spare rows)
    # Everything recorded so far (windows handed to the agent, summed): logical [L, X]
    # (X = E, +1 with the shared expert) and per GPU [L, G (+ G shared)] picks sent.
    logical_total: np.ndarray | None = None
    gpu_total: np.ndarray | None = None
