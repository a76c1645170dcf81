"""What the migration executor sees of a transport: `WeightTransport` (connect, receive,
close; what it needs: `one_host`, `maps_live_weights`, `group_backend`), the plan it moves
(`PlanMoves`) and what it hands back (`Received`)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch

from worker_hooks.config import MigrationConfig, Transport
from worker_hooks.weights import RankWeights


@dataclass(frozen=True)
class PlanMoves:
    """What a transport moves for one plan.

    transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), checked, the same
        on every rank.
    new_rows: [G, L, S] every rank's rows once the plan commits (rows.RowMap.plan): an
        incoming expert whose row differs from today's goes to that free row.
    start: `time.perf_counter()` when prepare began (pacing counts from there).
    """

    version: int
    transfers: np.ndarray
    new_rows: np.ndarray
    start: float


@dataclass
class Received:
    """A transport's result: `incoming` [n, 5] transfer rows and their experts in
    `staging` (name -> [n, ...]), plus bytes moved. Experts a transport wrote straight
    into their free rows are left out; the executor writes the returned ones that have
    a free row into it and keeps the rest for commit."""

    staging: dict[str, torch.Tensor]
    incoming: np.ndarray
    bytes_sent: int
    bytes_received: int


class WeightTransport(ABC):
    """How one rank receives a plan's experts: the interface the executor sees.

    `receive` runs on the migration thread, inside the side stream on GPU; it is
    collective on the group (every rank calls it for the same plan) and raises
    MigrationAborted once the plan is aborted. `connect` does any collective setup once
    (mapping the peers' memory), `close` releases it."""

    name: ClassVar[Transport]
    # Every rank of the group on one host, the group a gloo group (peers' memory is mapped).
    one_host: ClassVar[bool] = False
    # Peers map this rank's live weights: on CPU they must live in shared-memory files
    # (worker_hooks.transports.shared_memory.in_shared_memory).
    maps_live_weights: ClassVar[bool] = False

    def __init__(self, ctx: RankWeights, config: MigrationConfig) -> None:
        self.ctx = ctx
        self.config = config

    @classmethod
    def group_backend(cls, device: torch.device) -> Literal["nccl", "gloo"]:
        """The backend of the process group this transport needs for weights on `device`."""
        return "nccl" if device.type == "cuda" and not cls.one_host else "gloo"

    @abstractmethod
    def connect(self) -> None:
        """Collective setup, done by the first `receive` unless called earlier (at startup,
        say); a no-op once connected or when there is nothing to set up."""

    @abstractmethod
    def receive(self, plan: PlanMoves) -> Received:
        """This rank's incoming experts of `plan` (see `Received`)."""

    @abstractmethod
    def close(self) -> None:
        """Release what `connect` set up."""

    def _settle(self) -> None:
        """Wait until what was queued so far has moved."""
        if self.ctx.stream is not None:
            self.ctx.stream.synchronize()

    def _pace(self, start: float, bytes_done: int) -> None:
        """Sleep until `bytes_done` is within the `max_gbps` budget since `start`."""
        if self.config.max_gbps > 0 and bytes_done:
            self._settle()  # pace what has moved, not what is queued
            ahead = bytes_done / (self.config.max_gbps * 1e9) - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)
