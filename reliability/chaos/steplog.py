"""The ranks' step logs (reliability/chaos_worker.py writes them), read as they grow."""

from __future__ import annotations

import json
from pathlib import Path

# Columns of a step-log row (reliability/chaos_worker.py).
STEP, VERSION, READY, PREPARED, ABORTED, STAGED, HOOK_MS, DIFF, WALL, HOOK_RUNQ_MS = range(10)
STEP_LOG_COLUMNS = 10


class StepLog:
    """One rank's step log, read as it grows (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[list[float]] = []
        self._offset = 0

    def read(self) -> list[list[float]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.rows
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            self.rows.append(json.loads(line))
        self._offset += end
        return self.rows

    @property
    def last(self) -> list[float] | None:
        return self.rows[-1] if self.rows else None
