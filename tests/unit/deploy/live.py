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
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rebalancer.launch.instant import DEPLOYMENT, E, G, InstantRank, L, P
from rebalancer.launch.processes import reap

# What each metric type of the text exposition puts after a family's name.
_SERIES_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
    "info": ("_info",),
    "gauge": ("",),
    "untyped": ("",),
    "unknown": ("",),
}


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

    ctl = start_controller(
        folder / "c.sqlite",
        PolicyConfig(paused=True, min_windows=1),
        metrics_port=0,
        per_layer_metrics=True,
    )
    sockets = Path(tempfile.mkdtemp(prefix="lv", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{sockets}/agent.sock"
    sidecar: subprocess.Popen[str] | None = None
    ranks: list[InstantRank] = []
    try:
        assert ctl.server is not None and ctl.server.metrics_port
        log = (folder / "sidecar.log").open("a")
        sidecar = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                target,
                "--controller",
                ctl.server.address,
                "--ranks",
                f"0-{G - 1}",
                "--pod",
                "ns/live-0",
                "--deployment",
                DEPLOYMENT,
                "--metrics-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
                "--grace",
                "1",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
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

        wait_for(
            lambda: DEPLOYMENT in ctl.call(lambda: controller.deployments) and folded() >= 3,
            30,
            "3 windows folded",
        )
        _, plan = ctl.call(lambda: controller.force(DEPLOYMENT))
        assert plan is not None, "the forced decision started no plan"
        wait_for(
            lambda: (
                ctl.call(lambda: controller.deployments[DEPLOYMENT].version) == plan.version
                and ctl.call(lambda: controller.deployments[DEPLOYMENT].plan) is None
            ),
            30,
            "the plan committed",
        )
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
