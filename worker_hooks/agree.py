"""Rank agreement on the step at which a plan is committed (invariant 2).

Every `every` steps each rank contributes the newest plan version it has been
told to commit and holds staging for; an all-reduce(MIN) over a small CPU
group of its own yields the version every rank can switch to. The collective
is started at step n*every and read at step (n+1)*every, so it overlaps
serving instead of blocking it, and since every rank reads the same result at
the same step index, all switch at the same step: no step runs with v on one
rank and v' on another.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("worker_hooks.agree")


class CommitAgreement:
    def __init__(self, group: dist.ProcessGroup | None, every: int = 4) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.group = group
        self.every = every
        self._buf = torch.zeros(1, dtype=torch.int64)
        self._work: dist.Work | None = None
        self.broken: str | None = None  # set when a peer failed: no commit is ever agreed again

    def close(self) -> None:
        """Wait for the last agreement in flight (every rank started it at the same step),
        so no collective is pending when the process group goes away."""
        if self._work is not None and self.broken is None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                self.broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._work = None

    def on_step(self, step: int, ready_version: int) -> int | None:
        """Call once per step boundary, on every rank, with the same `step`.

        Returns the agreed version at agreement steps (None otherwise)."""
        if self.broken is not None or step % self.every:
            return None
        agreed = None
        try:
            if self._work is not None:
                self._work.wait()
                agreed = int(self._buf.item())
            self._buf = torch.tensor([ready_version], dtype=torch.int64)
            self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        except RuntimeError as exc:  # a peer died: keep serving the committed placement
            self.broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.error("commit agreement lost its peers (%s); staying on the committed placement", self.broken)
            return None
        return agreed
