"""kill -9 of the controller mid-run (invariant 7): committed placements and history
survive, workers keep serving, reconnect and resume, and no count is counted twice. The
restarted controller then stops on SIGTERM: it drains, saves its ingest cursor (which
only the drain path writes by then) and exits 0 on its own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rebalancer.controller.store import Store
from rebalancer.launch.processes import free_port
from rebalancer.launch.routing import write_profile
from rebalancer.launch.workers import launch_workers
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.windows import FOLD_LAG
from tests.integration.test_end_to_end import small_config
from tests.integration.until import stop_together

pytestmark = pytest.mark.slow

CONFIG = """
[server]
host = "127.0.0.1"
persist_seconds = 0.0
[policy]
min_interval_seconds = 0.5
gain_threshold = 0.03
horizon_seconds = 60.0
max_moved_fraction = 1.0
decay = 0.5
min_windows = 2
decision_period_seconds = 0.2
prepare_timeout_seconds = 20.0
step_seconds = 0.01
"""


def start(tmp: Path, port: int, config: str = "c.toml") -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--config",
            str(tmp / config),
            "--port",
            str(port),
            "--db",
            str(tmp / "c.sqlite"),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert "serving on" in proc.stdout.readline()
    return proc


def status(address: str) -> pb.DeploymentStatus | None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = pb_grpc.AdminServiceStub(channel).Status(
                pb.StatusRequest(deployment="demo"), timeout=2
            )
        except grpc.RpcError:
            return None
        return reply.deployments[0]


def wait_for(predicate, seconds: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_mid_run_keeps_history_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(CONFIG)
    # The restarted controller saves its cursor at its first fold, then only when it drains.
    (tmp_path / "drain.toml").write_text(
        CONFIG.replace("persist_seconds = 0.0", "persist_seconds = 3600.0")
    )
    port = free_port()
    address = f"127.0.0.1:{port}"
    # The ranks serve open-ended until the restarted controller ingests their windows
    # (then all stop at one step): a fixed number of steps could end before the restart.
    config = small_config(steps=10**9, timeout_seconds=150.0)
    stop = tmp_path / "stop"
    first = start(tmp_path, port)
    workers = launch_workers(
        config,
        address,
        write_profile(config, tmp_path),
        tmp_path,
        {r: ["--step-sleep", "0.02", "--stop-file", str(stop)] for r in range(config.workers)},
    )
    second = None
    try:
        wait_for(
            lambda: (
                (s := status(address)) is not None
                and s.plans_committed >= 1
                and not s.plan_in_flight
            ),
            90,
            "a commit",
        )
        before = Store(tmp_path / "c.sqlite")
        committed_before = [
            (p.version, p.state) for p in before.plans("demo") if p.state == "committed"
        ]
        version_before = before.load_deployments()[0].committed_version
        before.close()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        time.sleep(1.5)  # workers serve on without a controller
        assert all(w.poll() is None for w in workers)
        second = start(tmp_path, port, "drain.toml")
        wait_for(
            lambda: (s := status(address)) is not None and s.connected_ranks == config.workers,
            30,
            "reconnect",
        )
        after = status(address)
        assert after is not None and after.placement_version >= version_before
        windows_then = after.windows_ingested
        wait_for(
            lambda: (
                (s := status(address)) is not None
                and s.windows_ingested > windows_then + config.workers
            ),
            30,
            "new windows",
        )
        stop_together(stop, range(config.workers))
        codes = [w.wait(timeout=200) for w in workers]
        assert codes == [0] * config.workers
        second.send_signal(signal.SIGTERM)  # graceful this time: drain, save, exit 0
        assert second.wait(30) == 0
    finally:
        for p in (*workers, first, *([second] if second else [])):
            if p.poll() is None:
                p.kill()
                p.wait()
    store = Store(tmp_path / "c.sqlite")
    plans = {p.version: p.state for p in store.plans("demo", 1000)}
    for version, state in committed_before:
        assert plans[version] == state  # history intact
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(config.workers)]
    assert (
        len({json.dumps(r["versions"]) for r in results}) == 1
    )  # all ranks switched together throughout
    assert all(r["max_output_diff"] == 0.0 and r["weights_match_map"] for r in results)
    assert store.load_deployments()[0].committed_version == results[0]["version"]
    # Counts: every routed (token, expert) pair counted at most once.
    routed = sum(r["steps"] for r in results) * config.tokens * config.top_k * config.layers
    state = store.ingest_state("demo")
    assert state is not None
    # The crash may lose the few windows merged but not yet folded (acked, so not resent),
    # at most FOLD_LAG + 2 sequence numbers of every rank; a double count would exceed `routed`.
    # The lower bound holds only if the drain saved the cursor (see drain.toml).
    window_tokens = (
        config.windows.steps * config.tokens * config.top_k * config.layers * config.workers
    )
    assert routed - (FOLD_LAG + 2) * window_tokens <= state["tokens_folded"] <= routed
