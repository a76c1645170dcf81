"""The chaos harness's worker: worker_hooks.examples.cpu_worker with a step log that survives
SIGKILL.

The worker itself is unchanged (its hook and model classes are subclassed here, as
tests/integration/sidecar_worker.py does). Every step appends one line to
CHAOS_STEP_LOG/steps<rank>.jsonl, flushed at once, so the harness checks the invariants
from the rank's own record even when the rank is killed mid-run:

    [step, version, ready, prepared, aborted, staged, hook_ms, diff, wall, hook_runq_ms]

step: index of the step; version: the placement version the step ran on; ready: the
newest version the controller said to commit; prepared / aborted: the hook's counters;
staged: 1 while a plan's weights are staged; hook_ms: milliseconds the step spent in the
rebalancer's code (route + step_end: where a step would wait on a sidecar or the
controller); diff: max |output - unbalanced reference| of the step (invariant 1);
wall: unix time at the step's end; hook_runq_ms: of hook_ms, the time spent waiting for a
CPU (the kernel's run-queue delay, /proc schedstat): the serving thread's own during the
hook, and for a step whose hook took over CLOSER_MS besides that, up to the run-queue
delay of all the process's threads over the step (the serving thread also waits for the
GIL, or the agent's lock, held by a thread that waits for a CPU). On a starved node that
is the node's doing, not a wait on the rebalancer.

CHAOS_PREPARE_SECONDS: each prepare sleeps rank-dependent time once its weights are
staged (rank r: s * (r + 1) / world), so a plan spends a while in each phase and the
harness can hit preparing and prepared (some ranks done, others not).

    python -m reliability.chaos_worker <worker_hooks.examples.cpu_worker flags>
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from worker_hooks.examples import cpu_worker

STEP_LOG = "CHAOS_STEP_LOG"
PREPARE_SECONDS = "CHAOS_PREPARE_SECONDS"
# A step whose hook took longer than this besides its thread's own wait for a CPU is
# looked at closer: the wait of every thread of the process counts.
CLOSER_MS = 20.0

# The step's max output difference, across its layers (one serving thread per process).
_step: dict[str, Any] = {"out": None, "diff": 0.0}


class RecordingMoE(cpu_worker.ExpertParallelMoE):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        _step["out"] = out
        return out


class CheckingReference(cpu_worker.ReferenceMoE):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        ref = super().forward(*args, **kwargs)
        out = _step["out"]
        if isinstance(out, torch.Tensor):
            _step["diff"] = max(float(_step["diff"]), float((out - ref).abs().max()))
        return ref


class SlowPlans(cpu_worker.FaultyPlans):
    prepare_seconds = float(os.environ.get(PREPARE_SECONDS, "0") or 0)

    def after_transfers(self, version: int) -> None:
        if self.prepare_seconds:
            time.sleep(self.prepare_seconds * (self.config.rank + 1) / self.config.shape.num_gpus)
        super().after_transfers(version)


class LoggingHook(cpu_worker.FaultyHook):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        folder = os.environ.get(STEP_LOG, "")
        path = Path(folder) / f"steps{self.config.rank}.jsonl" if folder else Path(os.devnull)
        self._log = path.open("a", buffering=1)
        self._hook_seconds = 0.0
        self._hook_runq_ns = 0
        # The serving thread's schedstat (this constructor runs on it): cpu ns, run-queue ns.
        self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self._all_runq_ns = all_threads_runq_ns()

    def _runq_ns(self) -> int:
        """Nanoseconds the serving thread has waited on a run queue so far."""
        return int(os.pread(self._schedstat, 128, 0).split()[1])

    def route(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        t0, q0 = time.perf_counter(), self._runq_ns()
        try:
            return super().route(layer, topk_ids)
        finally:
            self._hook_seconds += time.perf_counter() - t0
            self._hook_runq_ns += self._runq_ns() - q0

    def step_end(self) -> None:
        step, version = self.step, self.version
        t0, q0 = time.perf_counter(), self._runq_ns()
        super().step_end()
        hook_ms = 1e3 * (self._hook_seconds + time.perf_counter() - t0)
        runq_ms = 1e-6 * (self._hook_runq_ns + self._runq_ns() - q0)
        self._hook_seconds, self._hook_runq_ns = 0.0, 0
        all_runq_ns = all_threads_runq_ns()
        if hook_ms - runq_ms > CLOSER_MS:
            runq_ms = max(runq_ms, 1e-6 * (all_runq_ns - self._all_runq_ns))
        self._all_runq_ns = all_runq_ns
        line = [
            step,
            version,
            self.plans.commit_ready,
            self.stats.prepared,
            self.stats.aborted,
            int(bool(len(self.plans.book))),
            round(hook_ms, 3),
            float(_step["diff"]),
            round(time.time(), 4),
            round(min(runq_ms, hook_ms), 3),
        ]
        _step["diff"] = 0.0
        self._log.write(json.dumps(line) + "\n")


def all_threads_runq_ns() -> int:
    """Nanoseconds the threads of this process have waited on run queues so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total


def main() -> int:
    cpu_worker.FaultyHook = LoggingHook  # type: ignore[misc]
    cpu_worker.FaultyPlans = SlowPlans  # type: ignore[misc]
    cpu_worker.ExpertParallelMoE = RecordingMoE  # type: ignore[misc]
    cpu_worker.ReferenceMoE = CheckingReference  # type: ignore[misc]
    return cpu_worker.main()


if __name__ == "__main__":
    sys.exit(main())
