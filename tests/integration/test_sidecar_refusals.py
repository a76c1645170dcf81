"""A rank the sidecar turns down (its deployment is not the pod's) gets the sidecar's
status and message once, as an error that says so, and asks again at the slowest pace: no
"controller link lost" every few seconds, which would send an operator after the network.

Real parts: `rebalancer sidecar` as a process, two ranks' agents on its Unix socket.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from worker_hooks.agent import AgentConfig, WorkerAgent

pytestmark = pytest.mark.slow

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=2, num_nodes=1
)
REFUSAL = "FAILED_PRECONDITION: rank 1 registers for deployment 'canary', this pod serves 'prod'"


class _Handlers:
    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def test_a_rank_of_a_second_deployment_is_told_once_why(caplog: pytest.LogCaptureFixture) -> None:
    sockets = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    target = f"unix://{sockets}/run/agent.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            target,
            "--controller",
            "127.0.0.1:1",
            "--ranks",
            "0-1",
            "--grace",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    agents: list[WorkerAgent] = []
    try:
        assert proc.stdout is not None and "sidecar serving on" in proc.stdout.readline()
        caplog.set_level(logging.DEBUG, logger="worker_hooks.agent")
        fast = dict(backoff_initial_seconds=0.05, backoff_max_seconds=0.2)  # many tries, quickly
        agents = [
            WorkerAgent(
                AgentConfig(Link(target, deployment=dep), rank, shape_of(SHAPE), **fast),  # type: ignore[arg-type]
                _Handlers(),
                lambda: 0,
            )
            for rank, dep in ((0, "prod"), (1, "canary"))
        ]
        agents[0].start()
        assert agents[0].connected.wait(30)  # the pod is prod's
        agents[1].start()
        deadline = time.monotonic() + 30
        while agents[1].reconnects < 6:  # asked again and again
            assert time.monotonic() < deadline, "rank 1 did not ask again"
            time.sleep(0.05)
        assert agents[1].refused == REFUSAL and not agents[1].connected.is_set()
    finally:
        for agent in agents:
            agent.stop()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(sockets, ignore_errors=True)
    said = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "worker_hooks.agent"
        and r.levelno >= logging.INFO
        and "rank 1" in r.getMessage()
    ]
    assert said == [
        (
            "ERROR",
            f"rank 1: refused by {target} ({REFUSAL}); serving on without rebalancing, "
            "asking again every ~0.2 s",
        )
    ], said
    assert not [r for r in caplog.records if "link lost" in r.getMessage()]
