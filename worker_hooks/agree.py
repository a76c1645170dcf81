"""Rank agreement on the step at which a plan is committed (invariant 2).

Every `every` steps each rank contributes the newest plan version it has been
told to commit and holds staging for; an all-reduce(MIN) over a small CPU
group of its own yields the version every rank can switch to. The collective
is started at step n*every and read at step (n+1)*every, so it overlaps
serving instead of blocking it, and since every rank reads the same result at
the same step index, all switch at the same step: no step runs with v on one
rank and v' on another.

An agreement to which a rank contributed no version newer than the one it serves
cannot switch any rank (the MIN is at most that), so that rank does not wait for
its result: with no plan ready, a peer whose side of the collective runs late (a
starved node, a frozen process) never holds the serving thread. Only a rank that
is ready to switch waits, as it must, to switch at the same step as its peers.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
import torch.distributed as dist

from worker_hooks import works

log = logging.getLogger("worker_hooks.agree")

# Agreements left running unread before the oldest is waited for (a peer that stopped
# for good; its group then times out).
MAX_UNREAD = 64
# How long `close` waits for the agreements in flight: a dead peer fails them at once; a
# live one answers within a step or two.
CLOSE_SECONDS = 10.0
# Agreements read (or reaped) that stay referenced here until this many newer ones were
# read: by then the gloo thread that ran one has long dropped its own reference, so ours is
# the last and the work is freed on a Python thread (works.py says why that matters).
RECENT = 16


class CommitAgreement:
    def __init__(self, group: dist.ProcessGroup | None, every: int = 4) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.group = group
        self.every = every
        # Agreements started and not yet read, oldest first: (work, its buffer, what this
        # rank contributed).
        self._running: deque[tuple[dist.Work, torch.Tensor, int]] = deque()
        self._recent: deque[tuple[dist.Work, tuple[torch.Tensor]]] = deque(maxlen=RECENT)
        self.broken: str | None = None  # set when a peer failed: no commit is ever agreed again

    def close(self, timeout: float = CLOSE_SECONDS) -> bool:
        """Wait up to `timeout` s for the agreements in flight (every rank started them at
        the same steps), so no collective is pending when the process group goes away,
        also after a peer failed. Every agreement, the recent ones read too, is then kept
        for the life of the process (works.py: one a gloo thread frees at exit aborts the
        process). False: one is still running (a peer frozen), and the process must not
        tear its groups down."""
        agreements = [*self._recent, *((work, (buf,)) for work, buf, _ in self._running)]
        self._running.clear()
        self._recent.clear()
        settled, error = works.settle(agreements, timeout)
        if error and self.broken is None:
            self.broken = error
        return settled

    def on_step(self, step: int, ready_version: int, serving: int | None = None) -> int | None:
        """Call once per step boundary, on every rank, with the same `step`.

        Returns the agreed version at agreement steps (None otherwise, and None when
        this rank had nothing newer than `serving`, the version it serves, to agree on:
        that agreement cannot switch it, and is not waited for)."""
        if self.broken is not None or step % self.every:
            return None
        agreed = None
        try:
            if self._running:
                work, buf, contributed = self._running[-1]
                if serving is None or contributed > serving:
                    work.wait()  # this rank may switch: every rank reads it at this step
                    agreed = int(buf.item())
                    self._running.pop()
                    self._recent.append((work, (buf,)))
            self._reap()
            buf = torch.tensor([ready_version], dtype=torch.int64)
            work = dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            self._running.append((work, buf, ready_version))
        except RuntimeError as exc:  # a peer died: keep serving the committed placement
            self.broken = works.reason(exc)
            log.error(
                "commit agreement lost its peers (%s); staying on the committed placement",
                self.broken,
            )
            return None
        return agreed

    def _reap(self) -> None:
        """Forget the unread agreements that completed (raising a peer's failure), and
        wait for the oldest beyond `MAX_UNREAD`."""
        while self._running and (
            self._running[0][0].is_completed() or len(self._running) >= MAX_UNREAD
        ):
            work, buf, _ = self._running.popleft()
            self._recent.append((work, (buf,)))
            work.wait()
