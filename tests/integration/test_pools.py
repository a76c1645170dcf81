"""A replica pool with real processes: a controller, one sidecar per deployment (its 2
ranks, `--pool p`), gloo worker groups of worker_hooks.examples.cpu_worker.

r1 and r2 serve one workload: the pool decides once and rolls the placement to both. r3
then joins on the same workload and serves its first window on the pool's placement
(warm start through its sidecar: installed before step 0, invariant 1 holds, its weights
equal what the map says). r4 joins on another workload: it is flagged diverged, leaves
the pool estimate and is balanced alone (its own policy's plan).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.store import Store
from rebalancer.launch.processes import free_port, reap
from rebalancer.launch.routing import routing_profiles
from tests.integration.conftest import start_controller
from tests.integration.test_end_to_end import FAST_POLICY, small_config
from worker_hooks.config import WindowConfig

pytestmark = pytest.mark.slow

CONFIG = small_config(
    workers=2, layers=4, experts=16, slots=24, tokens=32, windows=WindowConfig(steps=8)
)


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Fleet:
    """Every process of the test, reaped at the end whatever happened."""

    def __init__(self, tmp: Path, address: str) -> None:
        self.tmp = tmp
        self.address = address
        self.sockets = Path(tempfile.mkdtemp(prefix="pl", dir="/tmp"))  # short socket paths
        self.procs: list[subprocess.Popen[Any]] = []
        base = routing_profiles(CONFIG)[:1]  # one phase: members that start apart see the same mix
        self.profiles = {
            "A": self._profile("A", base),
            "B": self._profile("B", np.roll(base, CONFIG.experts // 2, axis=2)),
        }

    def _profile(self, name: str, profiles: np.ndarray) -> Path:
        path = self.tmp / f"profile-{name}.npz"
        np.savez(path, profiles=profiles, steps_per_phase=10_000)
        return path

    def deployment(self, name: str, profile: str, *extra: str) -> list[subprocess.Popen[Any]]:
        """A sidecar in pool p and the 2 ranks of deployment `name` behind it."""
        target = f"unix://{self.sockets}/{name}/agent.sock"
        log = (self.tmp / f"sidecar-{name}.log").open("a")
        sidecar = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                target,
                "--controller",
                self.address,
                "--ranks",
                "0-1",
                "--pod",
                f"ns/{name}",
                "--log-level",
                "INFO",
                "--grace",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "REBALANCER_POOL": "p"},
        )
        log.close()
        self.procs.append(sidecar)
        assert sidecar.stdout is not None
        assert "sidecar serving on" in sidecar.stdout.readline()
        port = free_port()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "REBALANCER_LOG": "INFO",
            "REBALANCER_POOL": "p",
        }
        workers = []
        for rank in range(2):
            cmd = [
                sys.executable,
                "-m",
                "worker_hooks.examples.cpu_worker",
                "--rank",
                str(rank),
                "--world",
                "2",
                "--port",
                str(port),
                "--controller",
                target,
                "--deployment",
                name,
                "--profile",
                str(self.profiles[profile]),
                "--tokens",
                str(CONFIG.tokens),
                "--experts",
                str(CONFIG.experts),
                "--slots",
                str(CONFIG.slots),
                "--layers",
                str(CONFIG.layers),
                "--top-k",
                str(CONFIG.top_k),
                "--window-steps",
                str(CONFIG.windows.steps),
                "--max-seconds",
                "150",
                "--warm-start-seconds",
                "20",
                "--out",
                str(self.tmp / f"{name}-rank{rank}.json"),
                *extra,
            ]
            err = (self.tmp / f"{name}-rank{rank}.log").open("w")
            workers.append(subprocess.Popen(cmd, env=env, stderr=err))
            err.close()
        self.procs += workers
        return workers

    def results(self, name: str) -> list[dict[str, Any]]:
        return [json.loads((self.tmp / f"{name}-rank{r}.json").read_text()) for r in range(2)]

    def close(self) -> None:
        reap(self.procs, terminate=False)
        shutil.rmtree(self.sockets, ignore_errors=True)


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[EmbeddedController]:
    # ready: the pool's decisions must not wait on the decision process's imports (a
    # loaded machine takes tens of seconds; the joiners' waits would run out meanwhile).
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, min_windows=3), ready=True)
    try:
        yield ctl
    finally:
        ctl.stop()


def on_loop(ctl: EmbeddedController, fn: Callable[[Any], Any]) -> Any:
    return ctl.call(lambda: fn(ctl.server.controller))  # type: ignore[union-attr]


def members_at_pool_placement(c: Any, names: tuple[str, ...]) -> bool:
    pool = c.fleet.pools.get("p")
    return (
        pool is not None
        and pool.phy2log is not None
        and all(
            n in c.deployments and np.array_equal(c.deployments[n].phy2log, pool.phy2log)
            for n in names
        )
    )


def same_math(results: list[dict[str, Any]]) -> None:
    assert all(r["max_output_diff"] == 0.0 for r in results)  # invariant 1
    assert all(r["weights_match_map"] for r in results)
    assert len({json.dumps(r["versions"]) for r in results}) == 1  # invariant 2


def test_pool_rolls_one_placement_warm_starts_a_joiner_and_flags_a_diverged_member(
    controller: EmbeddedController, tmp_path: Path
) -> None:
    assert controller.server is not None
    fleet = Fleet(tmp_path, controller.server.address)
    try:
        first = fleet.deployment(
            "r1", "A", "--steps", "120", "--wait-version", "1", "--step-sleep", "0.01"
        )
        first += fleet.deployment(
            "r2", "A", "--steps", "120", "--wait-version", "1", "--step-sleep", "0.01"
        )
        wait_for(
            lambda: on_loop(controller, lambda c: members_at_pool_placement(c, ("r1", "r2"))),
            120,
            "r1 and r2 on the pool placement",
        )
        assert [w.wait(timeout=150) for w in first] == [0] * 4
        pool_placement, pool_decisions = on_loop(
            controller,
            lambda c: (c.fleet.pools["p"].phy2log.copy(), c.fleet.pools["p"].stats.decisions),
        )
        joiners = fleet.deployment("r3", "A", "--steps", "64", "--step-sleep", "0.01")
        joiners += fleet.deployment(
            "r4", "B", "--steps", "64", "--wait-version", "2", "--step-sleep", "0.01"
        )
        wait_for(
            lambda: on_loop(controller, lambda c: c.fleet.pools["p"].diverged()) == ["r4"],
            120,
            "r4 flagged diverged",
        )
        assert [w.wait(timeout=150) for w in joiners] == [0] * 4
        status = on_loop(
            controller, lambda c: (c.fleet.pools["p"].following(), c.deployments["r4"].version)
        )
    finally:
        fleet.close()
    store = Store(tmp_path / "c.sqlite")
    # One pool decision served both first members: their plans carry the pool's placement.
    assert pool_decisions >= 1
    for name in ("r1", "r2"):
        plans = [p for p in store.plans(name) if p.state == "committed"]
        assert plans and all(p.trigger == "pool" for p in plans)
        same_math(fleet.results(name))
    # r3: the pool placement from its first step, installed before serving.
    r3 = fleet.results("r3")
    same_math(r3)
    ((first_step, warm),) = r3[0]["versions"][:1]
    assert first_step == 0 and warm >= 1 and r3[0]["commits"][0] == [0, warm]
    offered = store.placement("r3", warm)
    assert offered is not None and np.array_equal(offered, pool_placement)
    assert {p.version: (p.state, p.trigger) for p in store.plans("r3")}[warm] == (
        "committed",
        "warm_start",
    )
    # r4: another workload, flagged and balanced alone by its own policy.
    following, r4_version = status
    assert "r4" not in following and "r3" in following
    r4_plans = {p.version: p for p in store.plans("r4")}
    assert r4_plans[r4_version].trigger == "policy" and r4_plans[r4_version].state == "committed"
    assert any(d["outcome"] == "pool_diverged" for d in store.decisions("r4", 50))
    same_math(fleet.results("r4"))
