"""The vLLM adapter on vLLM's real EPLB code: 4 gloo ranks, a real controller.

Each rank (tests/engines/vllm/worker.py, which names every stand-in) loads the plugin
through vLLM's own entry-point loader, counts into vLLM's load window, and lets vLLM's
`EplbState.step` -> `rearrange` -> policy call -> `rearrange_expert_weights_inplace`
(sync) or the async per-layer path move the weights between the ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from rebalancer.controller.cost import CostParams
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from tests.engines import planned_loss
from tests.engines.vllm import vllm_env
from tests.integration.conftest import start_controller
from worker_hooks.agent import AgentConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_env.available(), reason=vllm_env.MISSING),
]

WORLD = 4
# A step that waited on the unreachable controller would take at least the agent's RPC
# deadline (AgentConfig.rpc_timeout_seconds); no step may come near it.
RPC_TIMEOUT = AgentConfig.rpc_timeout_seconds
DEPLOYMENT = "vllm-test"
FAST_POLICY = PolicyConfig(
    min_interval_seconds=0.5,
    gain_threshold=0.03,
    horizon_seconds=60.0,
    max_moved_fraction=1.0,
    min_windows=2,
    decision_period_seconds=0.2,
    prepare_timeout_seconds=20.0,
    estimator=EstimatorConfig(decay=0.5),
    cost=CostParams(step_seconds=0.01),
)


def _run_ranks(
    tmp_path: Path,
    address: str,
    steps: int,
    extra: dict[int, list[str]] | None = None,
    common: list[str] | None = None,
    timeout: float = 240,
    during: Callable[[], None] | None = None,
    env_extra: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> tuple[list[int], dict[int, dict]]:
    env = vllm_env.environment(
        REBALANCER_ADDRESS=address,
        REBALANCER_DEPLOYMENT=DEPLOYMENT,
        REBALANCER_WINDOW_STEPS="4",
        **(env_extra or {}),
    )
    port = free_port()
    procs = []
    try:
        for rank in range(WORLD):
            cmd = [
                sys.executable,
                "-m",
                "tests.engines.vllm.worker",
                "--rank",
                str(rank),
                "--world",
                str(WORLD),
                "--port",
                str(port),
                "--steps",
                str(steps),
                "--out",
                str(tmp_path / f"rank{rank}.json"),
                *(common or []),
                *(extra or {}).get(rank, []),
            ]
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(
                (
                    vllm_env.rank_starter().popen(
                        cmd,
                        cwd=vllm_env.ROOT,
                        env={**env, **(rank_env or {}).get(rank, {})},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        if during is not None:
            during()
        codes = [p.wait(timeout=timeout) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    results = {
        r: json.loads((tmp_path / f"rank{r}.json").read_text())
        for r in range(WORLD)
        if codes[r] == 0
    }
    return codes, results


def _logs(tmp_path: Path) -> str:
    return "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD))


def _check_commits(tmp_path: Path, mode: list[str]) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(tmp_path, ctl.server.address, steps=120, common=mode)
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        tokens_folded = ctl.call(lambda: dep.stats.tokens_folded)
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1, _logs(tmp_path)
    committed = np.asarray(dep.phy2log)
    for r in results.values():
        assert r["policy"] == "ControllerEplbPolicy"  # the plugin replaced vLLM's default
        # vLLM's own map on every rank is the controller's placement, weights match it.
        assert r["version"] == dep.version
        assert np.array_equal(np.asarray(r["phy2log"]), committed)
        assert r["weights_match_map"]
        assert r["dispatch_mismatches"] == 0
        # Counts streamed from vLLM's window equal the tokens this rank routed.
        assert r["tokens_sent"] == r["routed"] == 120 * 3 * 16 * 2
    # The controller folded every routed (token, k) pair of every rank.
    assert tokens_folded == sum(r["routed"] for r in results.values())
    # All ranks switched at the same step to the same versions.
    assert len({json.dumps(r["commits"]) for r in results.values()}) == 1


def test_sync_plans_commit_through_vllm_rearrange(tmp_path: Path) -> None:
    _check_commits(tmp_path, [])


def test_async_plans_commit_layer_by_layer(tmp_path: Path) -> None:
    _check_commits(tmp_path, ["--async-mode"])


def test_v2_runner_plans_commit_through_eplb_utils(tmp_path: Path) -> None:
    """Model Runner V2, vLLM 0.33.0's default: it has no `eplb_step`; its forward methods
    step EPLB through `step_eplb_after` -> `EPLBController.step` (eplb_utils.py, real
    code here). The extension attaches there: windows go up, plans commit.

    Stand-ins left (tests/engines/vllm/worker.py says why each is safe): the runner object
    (V2's `GPUModelRunner` builds CUDA buffers and graphs) holding the real
    `EPLBController` as `eplb`, its forward under the real `step_eplb_after()`, its
    `load_model` making V2's EPLB calls in V2's order; `torch.accelerator.current_stream`
    and `torch.Event` (CPU no-ops); the EP/EPLB group coordinators (one gloo group);
    `ParallelConfig.enable_eplb` set after validation (refused off CUDA); the model
    (`TinyMoE`, routing done by the worker into vLLM's load view); `ModelConfig` (an
    object with `compute_hash()`); V2's async loop start (not called; sync mode here)."""
    _check_commits(tmp_path, ["--runner", "v2"])
    for r in (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(WORLD)):
        assert r["attach"] == {
            "attached": True,
            "runner": "v2",
            "reason": "",
            "failures": 0,
            "waiting": False,
        }


def test_a_drafter_is_balanced_with_the_model_and_never_fails_its_plans(tmp_path: Path) -> None:
    """An MTP-like MoE drafter registered with vLLM's EPLB beside the main model (V2's
    real `maybe_register_speculator`, drafter first as vLLM does): vLLM calls the policy
    for both at every rearrangement. The deployment is the layer set main + drafter (its
    shape registers both models' layers); plans commit one after the other (the load
    drifts), none is reported FAILED; the drafter's rows of every plan are what vLLM
    installs for the drafter, its weights matching its map, and the controller moved
    them (the drafter is balanced, not left to vLLM's default); the counts sent are what
    vLLM recorded, per (layer, expert), the drafter's layer included."""
    from tests.engines.vllm.worker import DRAFT_LAYERS, NUM_LAYERS

    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=160,
            common=["--runner", "v2", "--drafter", "--drift", "40"],
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        version, committed = ctl.call(lambda: (dep.version, np.asarray(dep.phy2log).copy()))
        plans = ctl.call(
            lambda: {p.version: p.state for p in ctl.server.controller.store.plans(DEPLOYMENT)}
        )  # type: ignore[union-attr]
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert (
        committed.shape[0] == NUM_LAYERS + DRAFT_LAYERS
    )  # main model's layers, then the drafter's
    # The newest plan may still be in flight when the ranks stop (its Commit on the way
    # at the last step, on a loaded machine): every other plan committed, none failed.
    newest = max(plans)
    done = sorted(v for v, state in plans.items() if state == "committed")
    assert len(done) >= 2 and set(done) >= set(plans) - {newest}, (plans, _logs(tmp_path))
    assert "failed" not in plans.values() and version == done[-1]
    for r in results.values():
        switched = [v for _, v in r["commits"]]
        assert switched in (done, done + [newest]) if newest not in done else switched == done
        assert not any("refused" in a or "error" in a for a in r["rearrangements"])
        if switched[-1] == version:
            assert np.array_equal(np.asarray(r["phy2log"]), committed[:NUM_LAYERS])
            assert np.array_equal(np.asarray(r["drafter"]["phy2log"]), committed[NUM_LAYERS:])
        assert not np.array_equal(
            np.asarray(r["drafter"]["phy2log"]), np.asarray(r["initial_phy2log"])[:DRAFT_LAYERS]
        )  # the drafter moved
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
        assert r["drafter_calls"] >= len(r["rearrangements"])
        assert r["drafter"]["weights_match_map"]
        recorded, sent = np.asarray(r["recorded_logical"]), np.asarray(r["sent_logical"])
        assert recorded[NUM_LAYERS:].sum() > 0
        np.testing.assert_array_equal(
            sent, recorded, err_msg=f"rank {r['rank']}: counts per expert"
        )
    assert len({json.dumps(r["commits"]) for r in results.values()}) == 1


def test_a_call_for_another_world_gets_that_worlds_shape(tmp_path: Path) -> None:
    """Elastic EP scale-down asks the policy (vLLM's interface: `rebalance_experts(weight,
    num_replicas, num_groups, num_nodes, num_ranks, old)`, as `EplbState.rearrange(
    rank_mapping=...)` calls it; that call itself needs vLLM's stateless TCP-store group
    coordinator, a stand-in) for world - 1 ranks: the answer is vLLM's default policy's,
    in the shape asked, never the old map."""
    codes, results = _run_ranks(
        tmp_path,
        f"127.0.0.1:{free_port()}",
        steps=8,
        common=["--runner", "v2", "--interval", "4", "--policy-probe"],
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        probe = r["policy_probe"]
        answer = np.asarray(probe["answer"])
        assert answer.shape == (len(r["phy2log"]), probe["num_replicas"])
        assert np.array_equal(answer, np.asarray(probe["default"]))
        assert r["other_world"] and r["other_world"][-1]["num_ranks"] == WORLD - 1


def _check_scaled_down(r: dict, lost: int) -> np.ndarray:
    """The map after vLLM's scale-down: the new world's shape, every expert served on
    every layer, and (on a survivor) the weights vLLM moved equal to it."""
    from tests.engines.vllm.worker import NUM_EXPERTS, NUM_LAYERS, REDUNDANT

    sd = r["scale_down"]
    new = np.asarray(sd["map"])
    assert new.shape == (NUM_LAYERS, (NUM_EXPERTS + REDUNDANT) // WORLD * (WORLD - 1)), new.shape
    assert all(set(row) == set(range(NUM_EXPERTS)) for row in new.tolist())
    if r["rank"] != lost:
        assert sd["survivor_weights_match_map"] is True
    return new


def test_a_scale_down_takes_the_planned_survivor_placement_with_the_controller_gone(
    tmp_path: Path,
) -> None:
    """Elastic EP drops rank 3 through vLLM's real `EplbState.rearrange(rank_mapping=...)`
    (stand-in: the StatelessGroupCoordinator, see worker.shrink). The controller planned
    the survivors' placement for that loss ahead and is stopped before the loss: the map
    vLLM installs is that placement, every expert served, the survivors' weights match."""
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True), ready=True)
    assert ctl.server is not None
    planned: list[Any] = []

    stop_controller_once_planned = planned_loss.go_once_planned(
        ctl, tmp_path, WORLD, DEPLOYMENT, (WORLD - 1,), planned
    )

    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=40,
            during=stop_controller_once_planned,
            common=["--runner", "v2", "--scale-down", "--wait-plan", "150"],
        )
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert len(planned) == 1 and planned[0] is not None
    for r in results.values():
        assert r["scale_down"]["planned"] is not None, _logs(tmp_path)
        new = _check_scaled_down(r, WORLD - 1)
        assert np.array_equal(new, planned[0])
        assert r["scale_down"]["other_world"][-1]["planned"] is True


def test_the_controller_takes_the_scaled_down_world_and_the_survivors_serve_its_version(
    tmp_path: Path,
) -> None:
    """The same planned scale-down with the controller up: the survivors step on through
    vLLM's `EplbState.step` on the new world (stand-in: their gloo group as vLLM's resized
    EP group, worker.rejoin); the plugin's next adapter registers as the resized group
    (RegisterRequest.resized_from) and the controller takes the new world: the deployment
    has 3 GPUs and 9 slots, its committed placement is the one the survivors serve (the
    planned one) under a new version stored with trigger "resize", and every survivor
    serves that version. Before this, the controller refused the new world's Register
    (another shape) and never rebalanced the group again."""
    ctl = start_controller(tmp_path / "c.sqlite", replace(FAST_POLICY, paused=True), ready=True)
    assert ctl.server is not None
    planned: list[Any] = []
    go = planned_loss.go_once_planned(
        ctl, tmp_path, WORLD, DEPLOYMENT, (WORLD - 1,), planned, stop_controller=False
    )
    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=40,
            during=go,
            common=["--runner", "v2", "--scale-down", "--wait-plan", "150", "--rejoin"],
        )

        def read() -> tuple:
            c = ctl.server.controller  # type: ignore[union-attr]
            dep = c.deployments[DEPLOYMENT]
            return (
                dep.shape.num_gpus,
                dep.shape.num_slots,
                dep.version,
                dep.phy2log.copy(),
                [(p.version, p.state, p.trigger) for p in c.store.plans(DEPLOYMENT)],
            )

        gpus, slots, version, committed, plans = ctl.call(read)  # type: ignore[misc]
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert len(planned) == 1 and planned[0] is not None
    assert (gpus, slots) == (WORLD - 1, 9), _logs(tmp_path)
    assert plans[0] == (version, "committed", "resize")
    assert np.array_equal(committed, planned[0])
    for rank, r in results.items():
        rejoined = r["scale_down"]["rejoined"]
        if rank == WORLD - 1:
            assert rejoined is None  # the rank that left
            continue
        assert np.array_equal(_check_scaled_down(r, WORLD - 1), planned[0])
        assert rejoined["num_gpus"] == WORLD - 1 and rejoined["rank"] == rank
        assert rejoined["version"] == version > 0, _logs(tmp_path)
        assert np.array_equal(np.asarray(rejoined["phy2log"]), committed)


def test_a_scale_down_with_no_plan_gets_vllms_default_on_the_new_shape(tmp_path: Path) -> None:
    """No controller ever answered: vLLM's default policy places the survivors, in the
    new world's shape (never the old map)."""
    codes, results = _run_ranks(
        tmp_path,
        f"127.0.0.1:{free_port()}",
        steps=8,
        common=["--runner", "v2", "--interval", "4", "--scale-down"],
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        _check_scaled_down(r, WORLD - 1)
        assert r["scale_down"]["other_world"][-1]["planned"] is False


def test_a_rank_whose_commit_comes_late_holds_every_rank_to_one_step(tmp_path: Path) -> None:
    """Rank 3 takes each Commit a second after it arrives (5 of vLLM's rearrangements at
    this interval): the others hold the committed plan but the agreement (MIN of the
    ready versions) keeps every rank on the old map until rank 3 has it; every plan is
    installed by every rank at the same step."""
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=200,
            extra={3: ["--late-commit", "1.0"]},
            common=["--drift", "50"],
        )
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    commits = {rank: r["commits"] for rank, r in results.items()}
    assert commits[0], _logs(tmp_path)
    assert all(c == commits[0] for c in commits.values()), commits
    maps = [np.asarray(r["phy2log"]) for r in results.values()]
    assert all(np.array_equal(m, maps[0]) for m in maps)
    for r in results.values():
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0


def test_stale_plan_on_one_rank_keeps_every_rank_on_the_old_map(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path, ctl.server.address, steps=120, extra={3: ["--stale-plan"]}, timeout=240
        )
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    refused = [
        [a for a in r["rearrangements"] if a.get("agreed_version") == 1] for r in results.values()
    ]
    assert all(len(a) >= 1 for a in refused), _logs(tmp_path)
    for per_rank in refused:
        assert "refused" in per_rank[0] and "installed" not in per_rank[0]
    # No rank switched to v1; every rank serves one map that matches its weights.
    maps = [np.asarray(r["phy2log"]) for r in results.values()]
    assert all(np.array_equal(m, maps[0]) for m in maps)
    for r in results.values():
        assert all(v != 1 for _, v in r["commits"])
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0


def _unblocked(results: dict[int, dict], steps: int) -> float:
    """Every rank ran every step on one map matching its weights; the largest step gap
    after the first (the first builds the adapter: imports and the agent thread)."""
    for r in results.values():
        assert r["steps"] == steps
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    maps = [np.asarray(r["phy2log"]) for r in results.values()]
    assert all(np.array_equal(m, maps[0]) for m in maps)
    first = max(r["first_step_seconds"] for r in results.values())
    print(f"first step (adapter start): {first:.3f} s")
    return max(r["max_step_seconds"] for r in results.values())


def test_controller_lost_mid_run_never_blocks_a_step(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None

    def stop_once_counting() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:

            def ingested() -> int:
                dep = ctl.server.controller.deployments.get(DEPLOYMENT)  # type: ignore[union-attr]
                return dep.stats.windows_ingested if dep is not None else 0

            if ctl.call(ingested) >= 8:
                break
            time.sleep(0.2)
        ctl.stop()
        stopped.append(True)

    stopped: list[bool] = []
    try:
        codes, results = _run_ranks(
            tmp_path, ctl.server.address, steps=160, during=stop_once_counting
        )
    finally:
        if not stopped:
            ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    gap = _unblocked(results, 160)
    print(f"largest step gap with the controller lost mid-run: {gap:.3f} s")
    assert gap < RPC_TIMEOUT


def test_controller_unreachable_never_blocks_a_step(tmp_path: Path) -> None:
    # Nothing listens at this address, from the start to the end of the run.
    codes, results = _run_ranks(tmp_path, f"127.0.0.1:{free_port()}", steps=80)
    assert codes == [0] * WORLD, _logs(tmp_path)
    gap = _unblocked(results, 80)
    print(f"largest step gap with the controller unreachable: {gap:.3f} s")
    for r in results.values():
        assert r["version"] == 0 and r["commits"] == []
        # vLLM reached its rearrangement point 4 times; each kept the served map.
        assert len(r["rearrangements"]) == 80 // 20
        assert all("installed" not in a for a in r["rearrangements"])
    assert np.array_equal(
        np.asarray(results[0]["phy2log"]), np.asarray(results[0]["initial_phy2log"])
    )
    assert gap < RPC_TIMEOUT


# ---------------------------------------------------------------- warm start (pools)

POOL = "p"
# Deployments start paused in these runs: the pool then rolls no plan of its own to the
# new member (fleet.roll skips paused ones), so what it installs is the warm start, which
# a pause does not hold back. Unpaused, the pool rolls its placement as a plan as soon as
# the group has connected, and under load that plan can reach vLLM's first policy call
# before it: the same placement, installed at the same call, as version W+1.
QUIET_POLICY = replace(FAST_POLICY, paused=True)


def _pool_placement() -> np.ndarray:
    """A placement of the worker's shape unlike vLLM's start map (hot experts 0 and 1
    held twice, every layer permuted differently)."""
    from tests.engines.vllm.worker import NUM_EXPERTS, NUM_LAYERS, REDUNDANT

    rows = []
    for layer in range(NUM_LAYERS):
        order = np.roll(np.arange(NUM_EXPERTS)[::-1], layer)
        rows.append(np.concatenate([order, [0, 1, 0, 1]]))
    placement = np.asarray(rows, dtype=np.int64)
    assert placement.shape[1] == NUM_EXPERTS + REDUNDANT
    return placement


def _seed_pool(ctl: EmbeddedController, placement: np.ndarray) -> None:
    """Pool `p` holding `placement`: a seed member of the worker's shape registers over
    gRPC, then the pool takes the placement as a pool decision would."""
    from tests.engines.vllm.worker import NUM_EXPERTS, NUM_LAYERS, REDUNDANT, SHAPES

    assert ctl.server is not None
    expert_bytes = sum(int(np.prod(shape)) for shape in SHAPES) * 4  # float32
    shape = pb.ModelShape(
        num_layers=NUM_LAYERS,
        num_logical_experts=NUM_EXPERTS,
        num_physical_slots=NUM_EXPERTS + REDUNDANT,
        num_gpus=WORLD,
        num_nodes=1,
        expert_bytes=expert_bytes,
    )
    with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
        pb_grpc.WorkerServiceStub(channel).Register(
            pb.RegisterRequest(deployment="seed", rank=0, shape=shape, pool=POOL), timeout=30
        )
    ctl.call(lambda: ctl.server.controller.fleet.pools[POOL].take(placement))  # type: ignore[union-attr]


def _warm_run(
    tmp_path: Path, rank_env: dict[int, dict[str, str]] | None = None
) -> tuple[list[int], dict[int, dict], Any, np.ndarray]:
    ctl = start_controller(tmp_path / "c.sqlite", QUIET_POLICY, ready=True)
    assert ctl.server is not None
    placement = _pool_placement()
    try:
        _seed_pool(ctl, placement)
        # vLLM's first policy call at step 4: the offer must be there by then (bounded wait).
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=24,
            common=["--interval", "4"],
            env_extra={"REBALANCER_POOL": POOL, "REBALANCER_WARM_START_SECONDS": "20"},
            rank_env=rank_env,
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        state = ctl.call(lambda: (dep.version, np.asarray(dep.phy2log).copy()))
        plans = ctl.call(
            lambda: {
                p.version: (p.state, p.trigger)
                for p in ctl.server.controller.store.plans(DEPLOYMENT)
            }
        )  # type: ignore[union-attr]
    finally:
        ctl.stop()
    return codes, results, (state, plans), placement


def test_a_fresh_group_in_a_pool_installs_its_placement_at_the_first_policy_call(
    tmp_path: Path,
) -> None:
    codes, results, ((version, committed), plans), placement = _warm_run(tmp_path)
    assert codes == [0] * WORLD, _logs(tmp_path)
    warm = results[0]["rearrangements"][0].get("warm_start")
    assert warm is not None and warm >= 1, _logs(tmp_path)
    for r in results.values():
        first = r["rearrangements"][0]
        # The first policy call answered with the pool placement, on every rank.
        assert first["warm_start"] == warm and first["installed"] == warm
        assert r["commits"][0][1] == warm
        assert np.array_equal(np.asarray(r["phy2log"]), placement)
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    # The controller adopted the offered version on the ranks' COMMITTED.
    assert version == warm and np.array_equal(committed, placement)
    assert plans[warm] == ("committed", "warm_start")


def test_a_rank_without_the_offer_keeps_every_rank_on_its_start_map(tmp_path: Path) -> None:
    # Rank 3 never waits for the offer (0 s): it contributes no version, so none installs.
    codes, results, ((version, _), plans), _ = _warm_run(
        tmp_path, rank_env={3: {"REBALANCER_WARM_START_SECONDS": "0"}}
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        assert r["rearrangements"][0]["warm_start"] == 0
        assert r["version"] == 0 and r["commits"] == []
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        assert r["weights_match_map"]
    assert version == 0
    assert [state for state, trigger in plans.values() if trigger == "warm_start"] == ["offered"]


def test_a_pool_member_without_a_controller_starts_as_today_within_the_bound(
    tmp_path: Path,
) -> None:
    bound = 2.0
    codes, results = _run_ranks(
        tmp_path,
        f"127.0.0.1:{free_port()}",
        steps=24,
        common=["--interval", "4"],
        env_extra={"REBALANCER_POOL": POOL, "REBALANCER_WARM_START_SECONDS": str(bound)},
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        assert r["rearrangements"][0]["warm_start"] == 0
        assert r["version"] == 0 and r["commits"] == []
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        # The one wait, at the first policy call, never longer than the bound (slack: load).
        assert max(r["step_seconds"]) < bound + 1.5
