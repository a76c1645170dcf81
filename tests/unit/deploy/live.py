"""A live controller and a live sidecar, fed by real worker agents, scraped over HTTP: the
series names the deploy tests hold the dashboard and the alerts to.

The controller (in this process, metrics on, per-layer series on) serves deployment
`live` of 2 ranks; a `rebalancer sidecar` process stands for both, and two real
WorkerAgents (the worker library's gRPC client) speak to it on its Unix socket, prepare
and commit at once, and send windows with dispatch counts. A forced plan then runs to
its commit, so every event the metrics count has happened once before the scrape.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rebalancer.demo import reap
from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent

DEPLOYMENT = "live"
L, E, P, G = 3, 8, 12, 2
SHAPE = pb.ModelShape(num_layers=L, num_logical_experts=E, num_physical_slots=P, num_gpus=G,
                      num_nodes=1, expert_bytes=1 << 20)

# What each metric type of the text exposition puts after a family's name.
_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", ""), "info": ("_info",), "gauge": ("",),
                    "untyped": ("",), "unknown": ("",)}


class InstantRank(PlanHandlers):
    """Prepares and commits at once; a real agent carries the messages."""

    def __init__(self, rank: int, address: str, deployment: str = DEPLOYMENT, pool: str = "") -> None:
        self.version = 0
        self.agent = WorkerAgent(AgentConfig(address, deployment, rank, SHAPE, pool=pool), self, lambda: self.version)

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


def series_names(text: str) -> set[str]:
    """Every series name a Prometheus text exposition promises: the names of its samples,
    and for a family without samples yet (a labelled counter nothing counted) the names
    its type gives it (`# TYPE x counter` -> x_total). `_created` series are left out:
    prometheus_client's creation times are not part of the contract."""
    names = {m for m in re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":  # prometheus_client names a counter's family with its _total
            family = family.removesuffix("_total")
        names |= {family + suffix for suffix in _SERIES_SUFFIXES[kind]}
    return {n for n in names if not n.endswith("_created")}


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def wait_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def live_exposition(folder: Path) -> tuple[str, str]:
    """(controller's /metrics, sidecar's /metrics) after windows, a decision and a forced
    plan committed through the sidecar. Everything started is stopped before it returns."""
    from rebalancer.controller.decide import PolicyConfig
    from tests.integration.conftest import start_controller

    ctl = start_controller(folder / "c.sqlite", PolicyConfig(paused=True, min_windows=1),
                           metrics_port=0, per_layer_metrics=True)
    sockets = Path(tempfile.mkdtemp(prefix="lv", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{sockets}/agent.sock"
    sidecar: subprocess.Popen[str] | None = None
    ranks: list[InstantRank] = []
    try:
        assert ctl.server is not None and ctl.server.metrics_port
        log = (folder / "sidecar.log").open("a")
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "rebalancer", "sidecar", "--listen", target, "--controller", ctl.server.address,
             "--ranks", f"0-{G - 1}", "--pod", "ns/live-0", "--deployment", DEPLOYMENT, "--metrics-port", "0",
             "--metrics-host", "127.0.0.1", "--grace", "1", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
        log.close()
        assert sidecar.stdout is not None
        line = sidecar.stdout.readline()
        assert "sidecar serving on" in line and "metrics on" in line, line
        sidecar_port = int(line.rsplit(":", 1)[1])
        ranks = [InstantRank(r, target) for r in range(G)]
        for r in ranks:
            r.agent.start()
        for r in ranks:
            assert r.agent.connected.wait(30)
        rng = np.random.default_rng(1)
        for seq in range(3):
            logical = rng.integers(0, 50, (L, E)) * (1 + np.arange(E))  # skewed: a plan is worth it
            for r in ranks:
                physical = rng.integers(0, 50, (L, P))
                r.agent.submit_window(seq * 4, 4, 0, logical, physical)
        controller = ctl.server.controller

        def folded() -> int:
            return int(ctl.call(lambda: controller.deployments[DEPLOYMENT].estimator.windows))  # type: ignore[no-any-return]
        wait_for(lambda: DEPLOYMENT in ctl.call(lambda: controller.deployments) and folded() >= 3, 30, "3 windows folded")
        _, plan = ctl.call(lambda: controller.force(DEPLOYMENT))
        assert plan is not None, "the forced decision started no plan"
        wait_for(lambda: ctl.call(lambda: controller.deployments[DEPLOYMENT].version) == plan.version
                 and ctl.call(lambda: controller.deployments[DEPLOYMENT].plan) is None, 30, "the plan committed")
        return scrape(ctl.server.metrics_port), scrape(sidecar_port)
    finally:
        for r in ranks:
            r.agent.stop()
        if sidecar is not None:
            reap([sidecar], seconds=30)
        ctl.stop()
        for leftover in sockets.glob("*"):
            leftover.unlink()
        sockets.rmdir()
