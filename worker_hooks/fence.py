"""Before a plan's weights move: every rank of the group runs its transfers, or none does.

A plan's transfers are collective on the migration group (p2p send/recv, the peer-memory
transports' all-gathers): a rank that never runs them (its Prepare was lost with its
link, it refused the plan, it heard the Abort first) leaves its peers waiting in the
backend until the group's timeout, and gloo then closes the group's pairs for good: every
later plan fails on that group until it restarts. So no rank starts moving weights before
every rank has said it will, through the key-value store the group was made with (never
through the group itself, which is what could hang):

- each rank that takes the plan adds itself to the plan's count; the rank that makes it
  whole sets the plan's decision to "go" (compare-and-set: the first decision stands);
- a rank that will not take part (refused, aborted, shutting down) or that has waited
  `join_seconds` since it joined without the decision being made sets it to "stop", with
  the reason and the ranks that never joined;
- every rank that joined waits for the decision: on "go" it runs every transfer of the
  plan (an Abort heard after that drops the staging afterwards, never half-way); on
  "stop" it runs none, and the plan fails on every rank within `join_seconds` of the
  first rank joining.

The decision is made once per plan and seen alike by all, so the group is never left with
a rank waiting for a peer that will not come, and the next plan needs no group restart.
Each plan's keys hold a few bytes and stay in the store (the group's life).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

GO = "go"
STOP = "stop"
# How often a rank that joined looks for the decision.
POLL_SECONDS = 0.005


# A rank's reason to stop when it heard the plan's Abort before its transfers: its peers
# take it as an abort too (MigrationAborted in weights.py), not as a failure.
ABORTED = "aborted before its transfers"


class TransfersDeclined(RuntimeError):
    """The plan's decision is "stop": no rank runs its transfers (the message says why;
    `aborted`: because a rank heard the plan's Abort first)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.aborted = reason.endswith(ABORTED)


class TransferFence:
    """One rank's side of the fence, on `store` (shared by every rank of the group;
    `prefix` keeps this group's keys apart from others on the same store)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        join_seconds: float = 1.5,
        prefix: str = "rebalancer/fence/",
    ) -> None:
        if not join_seconds > 0:
            raise ValueError(f"join_seconds must be > 0, got {join_seconds}")
        self.store = dist.PrefixStore(prefix, store)
        self.rank, self.world_size = rank, world_size
        self.join_seconds = join_seconds

    @staticmethod
    def _key(version: int, what: str) -> str:
        return f"v{version}/{what}"

    def join(self, version: int, stop: Callable[[], str] = lambda: "") -> None:
        """Take part in plan `version`'s transfers; returns once every rank will ("go").

        `stop()` is asked while waiting: a non-empty answer (the plan was aborted here, the
        rank is closing) withdraws this rank unless the decision was already "go".
        Raises TransfersDeclined when the decision is "stop"."""
        store = self.store
        why = stop()
        if why:  # withdrawn before joining: never the rank whose join completes the count
            self._settle(self._decide(version, f"{STOP}:rank {self.rank}: {why}"))
            return
        store.set(self._key(version, f"rank{self.rank}"), "1")
        if store.add(self._key(version, "joined"), 1) >= self.world_size:
            self._settle(self._decide(version, GO))
            return
        deadline = time.monotonic() + self.join_seconds
        while True:
            decided = self._decision(version)
            if decided:
                self._settle(decided)
                return
            why = stop()
            if why:
                self._settle(self._decide(version, f"{STOP}:rank {self.rank}: {why}"))
                return
            if time.monotonic() >= deadline:
                missing = self.missing(version)
                self._settle(
                    self._decide(
                        version,
                        f"{STOP}:rank(s) {missing} did not join its transfers within "
                        f"{self.join_seconds:g} s",
                    )
                )
                return
            time.sleep(POLL_SECONDS)

    def decline(self, version: int, reason: str) -> None:
        """This rank will not take part in plan `version`: the decision is "stop" (no
        rank can have gone without this one), its peers see it at once."""
        self._decide(version, f"{STOP}:rank {self.rank}: {reason}")

    def missing(self, version: int) -> list[int]:
        """Ranks that have not joined plan `version`."""
        keys = [self._key(version, f"rank{r}") for r in range(self.world_size)]
        return [r for r, key in enumerate(keys) if not self.store.check([key])]

    def _decision(self, version: int) -> str:
        key = self._key(version, "decision")
        if not self.store.check([key]):
            return ""
        return self.store.get(key).decode()

    def _decide(self, version: int, decision: str) -> str:
        """Set the plan's decision unless one was made; returns the one that stands."""
        # compare_set on a missing key with expected "" sets it; else it answers the value.
        return self.store.compare_set(self._key(version, "decision"), "", decision).decode()

    @staticmethod
    def _settle(decision: str) -> None:
        if decision != GO:
            raise TransfersDeclined(decision.removeprefix(f"{STOP}:"))


def group_store(group: dist.ProcessGroup | None) -> tuple[dist.Store, str] | None:
    """The key-value store every rank of `group` shares (the default group's, which every
    group is made from) and a prefix of the group's own; None without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    try:
        name = (
            dist.distributed_c10d._get_process_group_name(group) if group is not None else "world"
        )
    except (RuntimeError, ValueError, KeyError):
        name = "world"
    return store, f"rebalancer/fence/{name}/"
