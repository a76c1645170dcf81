"""SGLang's elastic-EP fault path with the plugin, on SGLang's real code: 4 gloo ranks,
rank 3 lost (tests/engines/sglang/fault_worker.py; its docstring names the stand-ins:
SGLang's own ElasticEPState installed without its mooncake backend, the lost rank's
process kept for the fault path's collectives, and storage reads of the tiny model's
reference weights).

The survivors run SGLang's `maybe_rebalance_after_rank_fault(eplb_manager=...)`, the
function `ModelRunner._maybe_rebalance_after_rank_fault` calls: SGLang's EPLBManager,
`init_by_eplb`, elasticity-aware algorithm (unless the plan answers), updater and
recorder, with the plugin's hooks installed by SGLang's HookRegistry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import sglang_cpu
from rebalancer.launch.processes import free_port
from tests.engines import planned_loss
from tests.engines.sglang import sglang_env
from tests.engines.sglang.test_plugin import DEPLOYMENT, FAST_POLICY
from tests.integration.conftest import start_controller
from tests.integration.test_sidecar import Cluster

pytestmark = [pytest.mark.slow, sglang_env.needed()]

WORLD = 4
LOST = 3
SLOTS = 3  # per rank: worker.py's 8 experts + 4 redundant over 4 ranks
NUM_EXPERTS = 8
RUN_SECONDS = 300.0
MOE = slice(1, None)  # layer 0 is dense: SGLang's update leaves its row as it was


def _run_ranks(
    tmp_path: Path, address: str, flags: list[str], during: Callable[[], None] | None = None
) -> tuple[list[int], dict[int, dict]]:
    env = sglang_cpu.environment(
        REBALANCER_ADDRESS=address,
        REBALANCER_DEPLOYMENT=DEPLOYMENT,
        REBALANCER_WINDOW_STEPS="4",
        REBALANCER_AGREE_EVERY="2",
        REBALANCER_AGREE_TIMEOUT_SECONDS="15",
    )
    port = free_port()
    procs = []
    try:
        for rank in range(WORLD):
            cmd = [
                sys.executable,
                "-m",
                "tests.engines.sglang.fault_worker",
                "--rank",
                str(rank),
                "--world",
                str(WORLD),
                "--port",
                str(port),
                "--lost",
                str(LOST),
                "--out",
                str(tmp_path / f"rank{rank}.json"),
                *flags,
            ]
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(
                (
                    sglang_env.rank_starter().popen(
                        cmd, cwd=sglang_cpu.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                    ),
                    log,
                )
            )
        helper = threading.Thread(target=during, daemon=True) if during else None
        if helper is not None:
            helper.start()
        deadline = time.monotonic() + RUN_SECONDS
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    results = {
        r: json.loads((tmp_path / f"rank{r}.json").read_text())
        for r in range(WORLD)
        if (tmp_path / f"rank{r}.json").exists()
    }
    return codes, results


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("rank*.log")))


def _check_survivors_serve(r: dict[str, Any]) -> np.ndarray:
    """The placement SGLang installed: every expert on an active rank, the lost rank's slots
    expert 0 and in no expert's replicas, its weights and dispatch consistent; returned."""
    phy2log = np.asarray(r["installed"]["phy2log"])[MOE]
    log2phy = np.asarray(r["installed"]["log2phy"])[MOE]
    assert r["rebalanced"]
    lost_slots = set(range(LOST * SLOTS, (LOST + 1) * SLOTS))
    assert (phy2log[:, sorted(lost_slots)] == 0).all()
    for layer in range(phy2log.shape[0]):
        for expert in range(NUM_EXPERTS):
            replicas = [int(s) for s in log2phy[layer, expert] if s >= 0]
            assert replicas, (layer, expert)
            assert not lost_slots & set(replicas)
            assert all(phy2log[layer, s] == expert for s in replicas)
    assert r["weights_match_map"]
    assert r["dispatch_mismatches"] == 0 and r["tokens_to_lost"] == 0
    assert np.array_equal(np.asarray(r["final"]), np.asarray(r["installed"]["phy2log"]))
    # The adapter serves (and states) what SGLang installed on the survivors' slots: the
    # world of 3 ranks (survivor i = rank i here), SGLang's full width without rank 3's slots.
    assert np.array_equal(np.asarray(r["adapter_phy2log"]), _survivors_map(r))
    assert r["adapter_rank"] == r["rank"]
    return phy2log


def _survivors_map(r: dict[str, Any]) -> np.ndarray:
    """What SGLang installed, on the survivors' slots only `[L, 3 * SLOTS]`."""
    return np.asarray(r["installed"]["phy2log"])[:, : LOST * SLOTS]


def _survivors(results: dict[int, dict]) -> list[dict[str, Any]]:
    return [results[r] for r in range(WORLD) if r != LOST]


def test_a_rank_fault_takes_the_planned_survivor_placement_with_the_controller_gone(
    tmp_path: Path,
) -> None:
    """The controller planned the survivors' placement for losing rank 3 and is stopped
    before the loss: SGLang's fault path installs exactly that placement (the survivors'
    blocks of slots in place, rank 3's slots filled and out of every expert's replicas),
    every expert served by an active rank, weights and dispatch consistent. Today's tree:
    SGLang's own from-scratch placement."""
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True), ready=True)
    assert ctl.server is not None
    planned: list[Any] = []

    stop_controller_once_planned = planned_loss.go_once_planned(
        ctl, tmp_path, WORLD, DEPLOYMENT, (LOST,), planned
    )

    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            ["--wait-plan", "150"],
            during=stop_controller_once_planned,
        )
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert len(planned) == 1 and planned[0] is not None, _logs(tmp_path)
    per = SLOTS
    for r in _survivors(results):
        assert r["planned"] is not None and np.array_equal(np.asarray(r["planned"]), planned[0])
        # Survivor i's block of the plan is rank i's block of slots (ranks 0..2 survive).
        installed = np.asarray(r["installed"]["phy2log"])[MOE]
        assert np.array_equal(installed[:, : LOST * per], planned[0][MOE]), _logs(tmp_path)
        phy2log = _check_survivors_serve(r)
        assert r["rank_faults"] == [
            {"step": r["rank_faults"][0]["step"], "lost": [LOST], "planned": True}
        ]
        # ...which is not what SGLang's own algorithm places (the test tells them apart).
        assert not np.array_equal(phy2log, np.asarray(r["own_phy2log"])[MOE])


@pytest.mark.parametrize("through", ["direct", "sidecar"])
def test_a_rank_fault_with_no_plan_takes_sglangs_own_placement_and_the_controller_commits_it(
    tmp_path: Path, through: str
) -> None:
    """No survivor placement planned yet (the loss comes before any window): SGLang's own
    elasticity-aware algorithm places the survivors, unchanged, and the survivors' adapters
    register the smaller world as a resize: the controller commits the placement they
    serve as a new version of 3 GPUs (trigger "resize"), the survivors serve that version
    and state it in their windows (no silent drift, no mixed placement). The tree before:
    a FAILED report, the placement recorded as mixed. Through a sidecar serving the 4 ranks
    (a real `rebalancer sidecar` process), which relays the resize (rebalancer/sidecar/resize.py):
    the same outcome; the tree before refused the resized ranks there."""
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True), ready=True)
    assert ctl.server is not None
    cluster = Cluster(tmp_path)
    try:
        address = ctl.server.address
        if through == "sidecar":
            address = cluster.sidecar("all", address, ranks=tuple(range(WORLD))).target
        codes, results = _run_ranks(
            tmp_path, address, ["--before", "2", "--after", "12", "--wait-joined", "60"]
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        plans = ctl.call(lambda: ctl.server.controller.store.plans(DEPLOYMENT, limit=1))  # type: ignore[union-attr]
        stated = ctl.call(lambda: dict(dep.stated))
    finally:
        cluster.close()
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    survivors = _survivors(results)
    assert len(survivors) == WORLD - 1
    for r in survivors:
        phy2log = _check_survivors_serve(r)
        own_log2phy = np.asarray(r["own_log2phy"])[MOE]
        assert np.array_equal(phy2log, np.asarray(r["own_phy2log"])[MOE])
        installed = np.asarray(r["installed"]["log2phy"])[MOE]
        assert np.array_equal(installed[..., : own_log2phy.shape[-1]], own_log2phy)
        assert (installed[..., own_log2phy.shape[-1] :] == -1).all()
        assert r["rank_faults"][0]["planned"] is False
        assert r["adapter_version"] == 1, _logs(tmp_path)
    # The controller committed what the survivors serve, as the resized world's v1.
    assert dep.mixed is None, _logs(tmp_path)
    assert (dep.version, dep.shape.num_gpus, dep.shape.num_slots) == (
        1,
        WORLD - 1,
        (WORLD - 1) * SLOTS,
    )
    assert np.array_equal(np.asarray(dep.phy2log), _survivors_map(survivors[0]))
    assert plans[0].version == 1 and plans[0].trigger == "resize" and plans[0].base_version == 0
    assert "from 4 to 3 GPUs" in plans[0].reason
    # Their windows state it: every survivor serves v1, and the controller knows.
    assert {rank: version for rank, (version, _) in stated.items()} == {0: 1, 1: 1, 2: 1}, stated
