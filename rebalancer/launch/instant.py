"""The instant rank: a minimal in-process rank that registers through a real worker agent,
streams windows, and prepares and commits every plan at once; `PoolMember`, a deployment of
them in a replica pool, so every pool series exists.
"""

from __future__ import annotations

import threading

import numpy as np

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent

# Ranks that prepare and commit at once, through real worker agents: with a pool member
# beside the fleet every pool series of the dashboard exists.

DEPLOYMENT = "live"  # the instant ranks' deployment unless told another
L, E, P, G = 3, 8, 12, 2
SHAPE = ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=1 << 20)


class InstantRank(PlanHandlers):
    """Prepares and commits at once; a real agent carries the messages."""

    def __init__(
        self,
        rank: int,
        address: str,
        deployment: str = DEPLOYMENT,
        pool: str = "",
        shape: ClusterShape = SHAPE,
    ) -> None:
        self.version = 0
        self.agent = WorkerAgent(
            AgentConfig(Link(address, deployment=deployment, pool=pool), rank, shape),
            self,
            lambda: self.version,
        )

    def on_prepare(self, prepare: pb.Prepare) -> None:
        self.agent.report(prepare.version, pb.PLAN_PHASE_PREPARED)

    def on_commit(self, version: int) -> None:
        self.version = version
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED)

    def on_abort(self, version: int, reason: str) -> None:
        self.agent.report(version, pb.PLAN_PHASE_ABORTED)


class PoolMember:
    """A deployment of G instant ranks in a replica pool, straight to the controller at
    `address`, sending skewed windows every `every` seconds until closed: the pool
    decides, takes a placement and rolls it to the member, so every pool series exists."""

    def __init__(self, address: str, deployment: str, pool: str, every: float = 0.5) -> None:
        self.ranks = [InstantRank(r, address, deployment, pool) for r in range(G)]
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, name="pool-member", daemon=True)

    def __enter__(self) -> PoolMember:
        for r in self.ranks:
            r.agent.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for r in self.ranks:
            r.agent.stop()

    def _send(self) -> None:
        rng = np.random.default_rng(2)
        profile = (1 + np.arange(E)) / np.sum(1 + np.arange(E))  # skewed: a placement pays
        seq = 0
        while not self._stop.wait(self.every):
            # Tokens drawn from one profile, as routing is: the pool's divergence test sees
            # sampling noise only, and the member follows its pool.
            logical = rng.multinomial(4000, profile, size=L)
            for r in self.ranks:
                r.agent.submit_window(seq * 4, 4, r.version, logical, None)
            seq += 1
