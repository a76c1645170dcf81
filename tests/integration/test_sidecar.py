"""The pod sidecar with real processes: a controller, 2 sidecar processes (pods a and b, each
on its own Unix socket, speaking for 2 ranks), 4 gloo worker processes
(worker_hooks.examples.cpu_worker through tests/integration/sidecar_worker.py) whose hooks point at
their pod's socket.

(a) plans commit through the relay, with invariants 1 (outputs equal the reference), 2
    (every step one version on all ranks, all switch at the same step) and 5;
(b) a sidecar SIGKILLed while its ranks prepare aborts the plan on every rank, which keep
    serving v; the restarted sidecar brings its ranks back and the next plan commits;
(c) with the controller gone for 10 s no step waits and windows resume after, counted once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rebalancer.controller.coordinate import PlanState
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.store import Store
from rebalancer.launch.config import DemoConfig
from rebalancer.launch.processes import free_port
from rebalancer.launch.routing import write_profile
from tests.integration.conftest import start_controller
from tests.integration.sidecar_worker import PREPARE_SECONDS, STEP_LOG
from tests.integration.test_end_to_end import FAST_POLICY, small_config
from tests.integration.test_restart import CONFIG, status
from tests.integration.test_restart import start as start_serve
from tests.integration.until import stop_together

pytestmark = pytest.mark.slow

PODS = {"a": (0, 1), "b": (2, 3)}
GROUPS = {"ranks 0-1 (pod ns/a)", "ranks 2-3 (pod ns/b)"}


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class Sidecar:
    name: str
    proc: subprocess.Popen[str]
    target: str
    metrics_port: int

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        return {
            k: float(v)
            for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")
        }

    def stop(self) -> int:
        """SIGTERM: drain and exit 0."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def probe(target: str) -> int:
    """`rebalancer sidecar --check`: what a startup probe runs."""
    return subprocess.run(
        [sys.executable, "-m", "rebalancer", "sidecar", "--check", target, "--timeout", "2"],
        capture_output=True,
        timeout=60,
    ).returncode


class Cluster:
    """Every process of a test, reaped at the end whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sockets = Path(
            tempfile.mkdtemp(prefix="sc", dir="/tmp")
        )  # short: 107-byte socket paths
        self.procs: list[subprocess.Popen[Any]] = []

    def target(self, pod: str) -> str:
        return f"unix://{self.sockets}/{pod}/agent.sock"

    def sidecar(
        self, pod: str, controller: str, *extra: str, ranks: tuple[int, ...] | None = None
    ) -> Sidecar:
        """Pod `pod`'s sidecar, serving its ranks (PODS) or `ranks`."""
        ranks = ranks or PODS[pod]
        log = (self.tmp / f"sidecar-{pod}.log").open("a")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                self.target(pod),
                "--controller",
                controller,
                "--ranks",
                f"{ranks[0]}-{ranks[-1]}",
                "--pod",
                f"ns/{pod}",
                "--metrics-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
                "--grace",
                "1",
                "--log-level",
                "INFO",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "sidecar serving on" in line, (
            line,
            (self.tmp / f"sidecar-{pod}.log").read_text()[-3000:],
        )
        assert probe(self.target(pod)) == 0  # ready: the startup probe passes
        return Sidecar(pod, proc, self.target(pod), int(line.rsplit(":", 1)[1]))

    def controller(self, port: int) -> subprocess.Popen[str]:
        proc = start_serve(self.tmp, port)
        self.procs.append(proc)
        return proc

    def workers(
        self, config: DemoConfig, extra: list[str], env: dict[str, str] | None = None
    ) -> list[subprocess.Popen[bytes]]:
        """The 4 ranks of one gloo group, each pointed at its pod's socket."""
        profile = write_profile(config, self.tmp)
        port = free_port()
        env = {
            **os.environ,
            "REBALANCER_LOG": config.worker_log,
            "OMP_NUM_THREADS": "1",
            STEP_LOG: str(self.tmp),
            **(env or {}),
        }
        procs = []
        for rank in range(config.workers):
            pod = next(p for p, ranks in PODS.items() if rank in ranks)
            cmd = [
                sys.executable,
                "-m",
                "tests.integration.sidecar_worker",
                "--rank",
                str(rank),
                "--world",
                str(config.workers),
                "--port",
                str(port),
                "--controller",
                self.target(pod),
                "--profile",
                str(profile),
                "--steps",
                str(config.steps),
                "--tokens",
                str(config.tokens),
                "--experts",
                str(config.experts),
                "--slots",
                str(config.slots),
                "--layers",
                str(config.layers),
                "--top-k",
                str(config.top_k),
                "--window-steps",
                str(config.windows.steps),
                "--max-seconds",
                str(config.timeout_seconds),
                "--out",
                str(self.tmp / f"rank{rank}.json"),
                *extra,
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        self.procs += procs
        return procs

    def results(self, config: DemoConfig) -> list[dict[str, Any]]:
        return [json.loads((self.tmp / f"rank{r}.json").read_text()) for r in range(config.workers)]

    def step_times(self, rank: int) -> np.ndarray:
        return np.array(json.loads((self.tmp / f"steps{rank}.json").read_text()))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def on_loop(ctl: EmbeddedController, fn: Callable[[Any], Any]) -> Any:
    return ctl.call(lambda: fn(ctl.server.controller))  # type: ignore[union-attr]


def sessions(ctl: EmbeddedController) -> set[str]:
    return on_loop(
        ctl,
        lambda c: (
            {s.label for s in c.deployments["demo"].live_sessions() if s.streaming}
            if "demo" in c.deployments
            else set()
        ),
    )


def assert_same_math_and_one_version_per_step(results: list[dict[str, Any]]) -> None:
    assert all(r["max_output_diff"] == 0.0 for r in results)  # invariant 1, every step
    assert all(r["weights_match_map"] for r in results)  # weights really where the map says
    assert len({json.dumps(r["versions"]) for r in results}) == 1  # invariant 2
    assert len({json.dumps(r["commits"]) for r in results}) == 1  # same versions, same steps


def test_plans_commit_through_sidecars(cluster: Cluster, tmp_path: Path) -> None:
    config = small_config(steps=200)
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY)
    try:
        assert ctl.server is not None
        pods = [cluster.sidecar(pod, ctl.server.address) for pod in PODS]
        workers = cluster.workers(config, ["--wait-version", "1"])  # past its steps, until a commit
        wait_for(lambda: sessions(ctl) == GROUPS, 60, "both pods as group sessions")
        for m in (pod.metrics() for pod in pods):
            assert m["rebalancer_sidecar_ranks_connected"] == 2
            assert m['rebalancer_sidecar_upstream_state{state="connected"}'] == 1
        assert [w.wait(timeout=200) for w in workers] == [0] * 4
        seen = [pod.metrics() for pod in pods]
        assert [pod.stop() for pod in pods] == [0, 0]  # SIGTERM drains
        dep = on_loop(ctl, lambda c: c.deployments["demo"])
    finally:
        ctl.stop()
    results = cluster.results(config)
    assert dep.stats.plans_committed >= 1
    # the sidecars forwarded the ranks' dispatch mode and top_k in their group Register
    assert (dep.shape.dispatch_mode, dep.shape.top_k) == ("split", config.top_k)
    assert_same_math_and_one_version_per_step(results)
    assert results[0]["commits"] and results[0]["version"] == dep.version
    assert sum(r["bytes_received"] for r in results) > 0  # weights moved, rank to rank
    plans = Store(tmp_path / "c.sqlite").plans("demo")
    assert [p.state for p in plans].count("committed") == dep.stats.plans_committed
    assert all("shutting down" in p.reason for p in plans if p.state == "aborted")  # invariant 5
    for m in seen:
        assert (
            m["rebalancer_sidecar_windows_in_total"] > 0
            and m["rebalancer_sidecar_windows_out_total"] > 0
        )
        assert m['rebalancer_sidecar_plans_total{outcome="committed"}'] == dep.stats.plans_committed
        assert m['rebalancer_sidecar_plan_phase_seconds_count{phase="prepare"}'] >= 1


def test_sidecar_killed_while_its_ranks_prepare_aborts_everywhere_and_restart_recovers(
    cluster: Cluster, tmp_path: Path
) -> None:
    config = small_config(steps=300, timeout_seconds=150.0)
    prepare_seconds = 3.0  # each rank stays preparing this long after its transfers
    ctl = start_controller(
        tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True)
    )  # plans: forced here
    try:
        assert ctl.server is not None
        address = ctl.server.address
        a, b = (cluster.sidecar(pod, address) for pod in PODS)
        workers = cluster.workers(
            config,
            ["--step-sleep", "0.02", "--wait-version", "2"],
            {PREPARE_SECONDS: str(prepare_seconds)},
        )
        wait_for(
            lambda: (
                sessions(ctl) == GROUPS
                and on_loop(ctl, lambda c: c.deployments["demo"].estimator.windows) >= 2
            ),
            60,
            "both pods streaming windows",
        )
        _, plan = on_loop(ctl, lambda c: c.force("demo"))
        forced_at = time.monotonic()
        assert plan is not None and plan.version == 1
        wait_for(
            lambda: a.metrics()['rebalancer_sidecar_plan_phase{phase="preparing"}'] == 1,
            10,
            "a relays v1",
        )
        time.sleep(0.5)
        assert on_loop(ctl, lambda c: c.deployments["demo"].plan.state) is PlanState.PREPARING
        a.proc.send_signal(signal.SIGKILL)  # while its ranks prepare
        a.proc.wait(10)
        wait_for(
            lambda: on_loop(ctl, lambda c: c.deployments["demo"].plan) is None, 10, "the abort"
        )
        (aborted,) = Store(tmp_path / "c.sqlite").plans("demo")
        assert (
            aborted.state == "aborted"
            and "ranks 0-1 (pod ns/a) disconnected while preparing" in aborted.reason
        )
        assert probe(a.target) != 0  # not ready while it is down
        a = cluster.sidecar("a", address)  # restarted in place: same socket
        wait_for(lambda: sessions(ctl) == GROUPS, 60, "pod a's ranks back through the new sidecar")
        # Every rank's v1 prepare (transfers, then the delay) is over before the next plan.
        time.sleep(max(0.0, forced_at + prepare_seconds + 2.0 - time.monotonic()))
        _, plan = on_loop(ctl, lambda c: c.force("demo"))
        assert plan is not None and plan.version == 2
        wait_for(
            lambda: on_loop(ctl, lambda c: c.deployments["demo"].version) == 2, 90, "v2 committed"
        )
        assert [w.wait(timeout=200) for w in workers] == [0] * 4
        assert [a.stop(), b.stop()] == [0, 0]
    finally:
        ctl.stop()
    results = cluster.results(config)
    assert_same_math_and_one_version_per_step(results)
    for r in results:
        assert r["aborted"] >= 1, r  # every rank dropped its staging of v1 (invariant 5)
        assert [v for _, v in r["commits"]] == [2]  # v1 never went live anywhere
        assert [v for _, v in r["versions"]] == [0, 2]  # served v0 throughout, then v2
    for rank in range(4):  # serving never stopped for the sidecar's death
        assert np.diff(cluster.step_times(rank)).max() < 2.0
    states = {p.version: p.state for p in Store(tmp_path / "c.sqlite").plans("demo")}
    assert states == {1: "aborted", 2: "committed"}


def test_controller_gone_for_10s_no_step_waits_and_windows_resume(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "c.toml").write_text(CONFIG)
    port = free_port()
    address = f"127.0.0.1:{port}"
    # The ranks serve open-ended, through the outage, until the windows resumed (then all
    # stop at one step): a fixed number of steps could end before the outage does.
    config = small_config(steps=10**9, timeout_seconds=150.0)
    stop = tmp_path / "stop"
    first = cluster.controller(port)
    pods = [cluster.sidecar(pod, address, "--max-buffered-windows", "4") for pod in PODS]
    workers = cluster.workers(config, ["--step-sleep", "0.02", "--stop-file", str(stop)])
    wait_for(
        lambda: (
            (s := status(address)) is not None
            and s.connected_ranks == 4
            and s.windows_ingested >= 4
        ),
        90,
        "windows through both pods",
    )
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    down_at = time.time()
    time.sleep(9.0)
    during = [pod.metrics() for pod in pods]
    time.sleep(max(0.0, down_at + 10.0 - time.time()))
    second = cluster.controller(port)
    up_at = time.time()
    wait_for(
        lambda: (s := status(address)) is not None and s.connected_ranks == 4, 30, "pods reconnect"
    )
    s = status(address)
    assert s is not None
    windows_then = s.windows_ingested
    wait_for(
        lambda: (s := status(address)) is not None and s.windows_ingested > windows_then + 2,
        30,
        "windows resume",
    )
    last_step = stop_together(stop, range(4))
    assert [w.wait(timeout=200) for w in workers] == [0] * 4
    after = [pod.metrics() for pod in pods]
    assert [pod.stop() for pod in pods] == [0, 0]
    second.send_signal(signal.SIGTERM)  # drains and saves its ingest cursor
    assert second.wait(30) == 0

    for m in during:  # the controller away: upstream down, windows merged in a bounded buffer
        assert m["rebalancer_sidecar_upstream_up"] == 0
        assert 1 <= m["rebalancer_sidecar_buffer_depth"] <= 4
        assert m["rebalancer_sidecar_windows_merged_total"] > 0
    for m in after:
        assert m["rebalancer_sidecar_upstream_reconnects_total"] >= 1
        assert m["rebalancer_sidecar_upstream_up"] == 1
    results = cluster.results(config)
    assert all(r["steps"] == last_step for r in results)
    assert_same_math_and_one_version_per_step(results)
    for rank in range(4):  # invariant 3: no step waited, serving went on at its pace
        times = cluster.step_times(rank)
        gaps = np.diff(times)
        assert gaps.max() < 2.0, f"rank {rank}: a step took {gaps.max():.1f} s"
        during_outage = int(((times > down_at) & (times < up_at)).sum())
        assert during_outage >= (up_at - down_at) / (3 * float(np.median(gaps)))
    # Counted once: the buffered windows arrived after the outage, none twice.
    routed = sum(r["steps"] for r in results) * config.tokens * config.top_k * config.layers
    state = Store(tmp_path / "c.sqlite").ingest_state("demo")
    assert state is not None
    assert 0.8 * routed <= state["tokens_folded"] <= routed
