"""The sidecar tests' worker: worker_hooks.examples.cpu_worker, with two test seams set from the
environment (the worker itself is unchanged; its hook is subclassed here).

SIDECAR_TEST_PREPARE_SECONDS: every prepare sleeps this long once its weights are staged
    (in `after_transfers`, before PREPARED is reported), so that a test can kill a sidecar
    while its ranks prepare; every rank still finishes its transfers with its peers.
SIDECAR_TEST_STEP_LOG: a folder; each rank writes steps<rank>.json there, the wall-clock
    time of every step end, to show that no step waited on anything.

    python -m tests.integration.sidecar_worker <worker_hooks.examples.cpu_worker flags>
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from worker_hooks.examples import cpu_worker

PREPARE_SECONDS = "SIDECAR_TEST_PREPARE_SECONDS"
STEP_LOG = "SIDECAR_TEST_STEP_LOG"


class SeamPlans(cpu_worker.FaultyPlans):
    prepare_seconds = float(os.environ.get(PREPARE_SECONDS, "0") or 0)

    def after_transfers(self, version: int) -> None:
        if self.prepare_seconds:
            time.sleep(self.prepare_seconds)
        super().after_transfers(version)


class SeamHook(cpu_worker.FaultyHook):
    step_log = os.environ.get(STEP_LOG, "")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_times: list[float] = []

    def step_end(self) -> None:
        super().step_end()
        self.step_times.append(time.time())

    def finish(self, timeout: float = 5.0, transfer_timeout: float = 30.0) -> bool:
        if self.step_log:
            path = Path(self.step_log) / f"steps{self.config.rank}.json"
            path.write_text(json.dumps(self.step_times))
        return super().finish(timeout, transfer_timeout)


def main() -> int:
    cpu_worker.FaultyHook = SeamHook  # type: ignore[misc]
    cpu_worker.FaultyPlans = SeamPlans  # type: ignore[misc]
    return cpu_worker.main()


if __name__ == "__main__":
    sys.exit(main())
