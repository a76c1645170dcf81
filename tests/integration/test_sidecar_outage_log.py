"""One controller outage, one "controller link lost" line in the sidecar's log, as
docs/operations.md says (issue 34: there were two: the lost stream, then the refused
connection of the next try, whose words differ).

Real parts: a controller on a fixed loopback port, stopped and started again in place;
`rebalancer sidecar` as a process; one rank's agent on its Unix socket.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from worker_hooks.agent import AgentConfig, WorkerAgent

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=1, num_nodes=1
)


class _Handlers:
    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_one_outage_is_one_link_lost_line(tmp_path: Path) -> None:
    port = free_port()
    config = ControllerConfig(
        port=port, db_path=str(tmp_path / "c.sqlite"), policy=PolicyConfig(), drain_seconds=0.0
    )
    sockets = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{sockets}/agent.sock"
    log_path = tmp_path / "sidecar.log"
    ctl: EmbeddedController | None = EmbeddedController(config)
    ctl.start()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                target,
                "--controller",
                f"127.0.0.1:{port}",
                "--ranks",
                "0",
                "--grace",
                "0.5",
                "--log-level",
                "INFO",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    agent: WorkerAgent | None = None

    def lines(word: str) -> list[str]:
        return [line for line in log_path.read_text().splitlines() if word in line]

    try:
        assert proc.stdout is not None and "sidecar serving on" in proc.stdout.readline()
        agent = WorkerAgent(
            AgentConfig(Link(target, deployment="prod"), 0, shape_of(SHAPE)), _Handlers(), lambda: 0
        )  # type: ignore[arg-type]
        agent.start()
        wait_for(lambda: lines("registered ranks"), 30, "the pod's group registered")
        ctl.stop()
        ctl = None
        # Several tries while the controller is away (the sidecar retries at most every 1 s).
        time.sleep(4.0)
        ctl = EmbeddedController(config)
        ctl.start()
        wait_for(
            lambda: len(lines("registered ranks")) >= 2, 30, "the pod's group registered again"
        )
    finally:
        if agent is not None:
            agent.stop()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if ctl is not None:
                ctl.stop()
            shutil.rmtree(sockets, ignore_errors=True)
    lost = lines("controller link lost")
    assert len(lost) == 1 and " WARNING " in lost[0], log_path.read_text()
