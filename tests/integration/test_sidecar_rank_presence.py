"""The controller counts a pod's ranks as its sidecar sees them (issue 20).

A `rebalancer serve` process (metrics on), 2 sidecar processes (pods a and b, 2 ranks
each) and 4 gloo rank processes. The engines then die (SIGKILL of every rank process)
while the sidecars live on and keep their group streams to the controller open: the
controller's `rebalancer_connected_ranks` and its admin status must drop to what the
sidecars report (0) within a bounded time, so `RebalancerRanksDisconnected` can fire,
and a forced plan is refused with the missing ranks named instead of being started and
then aborted by the sidecars ("rank 0 is not connected to the sidecar"). Ranks started
again are counted again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rebalancer.controller.store import Store
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from tests.integration.test_end_to_end import small_config
from tests.integration.test_restart import CONFIG, status
from tests.integration.test_sidecar import PODS, Cluster, wait_for

pytestmark = pytest.mark.slow

# Plans here are forced only: the policy stays out of the way.
PAUSED = CONFIG.replace("[policy]\n", "[policy]\npaused = true\n")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def serve_with_metrics(cluster: Cluster, port: int, metrics_port: int) -> subprocess.Popen[str]:
    tmp = cluster.tmp
    (tmp / "c.toml").write_text(PAUSED)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--config",
            str(tmp / "c.toml"),
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--db",
            str(tmp / "c.sqlite"),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    cluster.procs.append(proc)
    assert proc.stdout is not None
    assert "serving on" in proc.stdout.readline()
    return proc


def connected_metric(metrics_port: int) -> float | None:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    for line in text.splitlines():
        if line.startswith('rebalancer_connected_ranks{deployment="demo"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def force(address: str) -> pb.ForceRebalanceResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AdminServiceStub(channel).ForceRebalance(
            pb.ForceRebalanceRequest(deployment="demo"), timeout=10
        )


def test_engines_dead_behind_live_sidecars_are_not_counted_and_no_plan_starts(
    cluster: Cluster, tmp_path: Path
) -> None:
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    serve_with_metrics(cluster, port, metrics_port)
    pods = {name: cluster.sidecar(name, address) for name in PODS}
    config = small_config(steps=100_000, timeout_seconds=300.0)
    workers = cluster.workers(config, ["--step-sleep", "0.02"])
    wait_for(
        lambda: (
            (s := status(address)) is not None
            and s.connected_ranks == 4
            and s.windows_ingested >= 2
        ),
        90,
        "4 ranks streaming windows through both pods",
    )
    assert connected_metric(metrics_port) == 4

    for proc in workers:  # the engines die; the sidecars live on, their group streams open
        proc.send_signal(signal.SIGKILL)
    for proc in workers:
        proc.wait(30)
    wait_for(
        lambda: all(p.metrics()["rebalancer_sidecar_ranks_connected"] == 0 for p in pods.values()),
        15,
        "the sidecars see their ranks gone",
    )
    # What the sidecars see, the controller shows within a bounded time: metric and status.
    wait_for(lambda: connected_metric(metrics_port) == 0, 10, "rebalancer_connected_ranks 0")
    s = status(address)
    assert s is not None and s.connected_ranks == 0
    assert all(
        p.metrics()["rebalancer_sidecar_upstream_up"] == 1 for p in pods.values()
    )  # still linked

    reply = force(address)
    decision = reply.decision
    assert decision.outcome == "skip_ranks" and decision.plan_version == 0, decision
    assert decision.reason == "only 0 of 4 ranks connected (missing: ranks 0-3)", decision.reason
    s = status(address)
    assert s is not None and s.plan_in_flight == 0
    assert Store(tmp_path / "c.sqlite").plans("demo") == []  # never started, so never aborted

    # The engines restart: their ranks count again.
    workers = cluster.workers(config, ["--step-sleep", "0.02"])
    wait_for(lambda: connected_metric(metrics_port) == 4, 90, "the restarted ranks counted again")
    s = status(address)
    assert s is not None and s.connected_ranks == 4
    for proc in workers:
        proc.kill()
