"""A resize of the EP group through the pods' sidecars (rebalancer/sidecar/resize.py): a
controller on loopback (real server, real SQLite), 2 sidecar processes (pods a: ranks 0-1,
b: ranks 2-3) and 4 real rank agents (worker_hooks.agent.WorkerAgent, in this process,
each on its pod's socket; the stand-in for an engine's adapter is the test itself, which
resizes the group as SGLang's elastic fault path or vLLM's scale-down makes the adapters
do: the old world's agents stop, the survivors' agents register the new world with the
placement they serve and `resized_from`).

Rank 1 is lost: pod a keeps old rank 0 (still rank 0), pod b's old ranks 2 and 3 become
ranks 1 and 2 of 3. The controller commits the survivors' placement as v1 of the 3-GPU
world, each pod registers its part of it, and every survivor is told v1 and states it in
its windows. The tree before: the sidecar refused every resized rank ("does not relay a
resize yet") and the controller kept the 4-GPU world.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from tests.integration.conftest import start_controller
from tests.integration.test_end_to_end import FAST_POLICY
from tests.integration.test_resize import NEW, OLD, SURVIVORS, E, L
from tests.integration.test_sidecar import PODS, Cluster, wait_for
from worker_hooks.agent import AgentConfig, WorkerAgent

pytestmark = pytest.mark.slow

LOST = 1
NEW_RANK = {0: 0, 2: 1, 3: 2}  # old rank -> its rank in the new world


class Rank:
    """One rank's agent and the version it serves (what an engine adapter holds)."""

    def __init__(
        self,
        target: str,
        rank: int,
        shape: pb.ModelShape,
        phy2log: np.ndarray,
        worker: str,
        resized_from: tuple[int, int] | None = None,
    ) -> None:
        self.version = 0
        self.phy2log = phy2log
        self.agent = WorkerAgent(
            AgentConfig(
                Link(target, deployment="dep", worker_id=worker),
                rank,
                shape_of(shape),
                resized_from=resized_from,
                backoff_initial_seconds=0.1,
                backoff_max_seconds=1.0,
            ),
            self,
            lambda: self.version,
            initial_phy2log=phy2log,
            served_map=lambda: self.phy2log,
        )
        self.agent.start()

    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def test_a_resized_group_is_relayed_by_the_sidecars_and_every_survivor_serves_the_new_version(
    tmp_path: Path,
) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True))
    cluster = Cluster(tmp_path)
    ranks: list[Rank] = []
    try:
        assert ctl.server is not None
        for pod in PODS:
            cluster.sidecar(pod, ctl.server.address)
        target = {
            rank: cluster.target(pod) for pod, pod_ranks in PODS.items() for rank in pod_ranks
        }
        start = trivial_placement(L, E, 8, 4)
        old = {rank: Rank(target[rank], rank, OLD, start, f"worker {rank}") for rank in range(4)}
        ranks += old.values()

        def controller() -> tuple[int, int, list[int], dict[int, int]]:
            def read() -> tuple[int, int, list[int], dict[int, int]]:
                dep = ctl.server.controller.deployments.get("dep")  # type: ignore[union-attr]
                if dep is None:
                    return -1, 0, [], {}
                return (
                    dep.version,
                    dep.shape.num_gpus,
                    sorted(dep.sessions),
                    {rank: version for rank, (version, _) in dep.stated.items()},
                )

            return ctl.call(read)  # type: ignore[return-value]

        wait_for(lambda: controller()[2] == [0, 1, 2, 3], 60, "both pods registered upstream")

        # The resize: every old agent stops (the lost rank's process is gone; a survivor's
        # adapter ends its old world's agent), the survivors register the new world.
        for rank in old.values():
            rank.agent.stop(timeout=2.0)
        new = {
            old_rank: Rank(
                target[old_rank],
                new_rank,
                NEW,
                SURVIVORS,
                f"worker {old_rank}",
                resized_from=(0, 4),
            )
            for old_rank, new_rank in NEW_RANK.items()
        }
        ranks += new.values()
        wait_for(
            lambda: all(r.agent.committed_version == 1 for r in new.values()),
            90,
            "every survivor told the version the controller committed the resize under",
        )
        version, gpus, sessions, _ = controller()
        assert (version, gpus, sessions) == (1, 3, [0, 1, 2])
        for rank in new.values():
            assert np.array_equal(rank.agent.committed_placement, SURVIVORS)
            rank.version = 1  # what RankSession._join_resized_world does
        plans = ctl.call(
            lambda: [
                (p.version, p.trigger, p.base_version)
                for p in ctl.server.controller.store.plans("dep")
            ]
        )  # type: ignore[union-attr]
        assert plans[0] == (1, "resize", 0)
        # Their windows state v1 through the sidecars: the controller knows what they serve.
        for step in range(3):
            for rank in new.values():
                rank.agent.submit_window(
                    step, 1, 1, np.ones((L, E), dtype=np.int64), np.ones((L, 6), dtype=np.int64)
                )
            time.sleep(0.2)
        wait_for(
            lambda: controller()[3] == {0: 1, 1: 1, 2: 1}, 30, "the survivors' statements of v1"
        )
    finally:
        for rank in ranks:
            rank.agent.stop(timeout=1.0)
        cluster.close()
        ctl.stop()
