"""The SGLang plugin on SGLang's real EPLB code: 4 gloo ranks, a real controller.

Each rank (tests/engines/sglang/worker.py) loads the plugin through SGLang's own
entry-point loader, records with SGLang's recorder, dispatches with SGLang's dispatch,
and installs the controller's plans with SGLang's EPLBManager and ExpertLocationUpdater.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench import sglang_cpu
from rebalancer.controller.cost import CostParams
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.controller.store import Store
from rebalancer.launch.processes import free_port, reap
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from tests.engines.sglang import sglang_env
from tests.integration.conftest import start_controller
from worker_hooks.engines.sglang.warm_start import STOP_SECONDS

pytestmark = [
    pytest.mark.slow,
    sglang_env.needed(),
]

WORLD = 4
RUN_SECONDS = 480.0  # the bound on one run of the ranks
DEPLOYMENT = "sglang-test"
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
    settings: dict[str, str] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    world: int = WORLD,
) -> tuple[list[int], dict[int, dict]]:
    """`world` SGLang ranks; their temporary files go to a folder of the test's own (TMPDIR),
    which _no_temporary_files_left checks."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = sglang_cpu.environment(
        REBALANCER_ADDRESS=address,
        REBALANCER_DEPLOYMENT=DEPLOYMENT,
        REBALANCER_WINDOW_STEPS="4",
        REBALANCER_AGREE_EVERY="2",
        REBALANCER_AGREE_TIMEOUT_SECONDS="15",
        TMPDIR=str(tmp_path / "tmp"),
        **(settings or {}),
    )
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            cmd = [
                sys.executable,
                "-m",
                "tests.engines.sglang.worker",
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--steps",
                str(steps),
                "--out",
                str(tmp_path / f"rank{rank}.json"),
                *(extra or {}).get(rank, []),
            ]
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(
                (
                    sglang_env.rank_starter().popen(
                        cmd,
                        cwd=sglang_cpu.ROOT,
                        env={**env, **(rank_env or {}).get(rank, {})},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        # Generous: four processes import SGLang at once, on a machine that may be loaded.
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
        for r in range(world)
        if codes[r] == 0
    }
    return codes, results


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("rank*.log")))


def _every_rank(flags: list[str]) -> dict[int, list[str]]:
    return {rank: flags for rank in range(WORLD)}


def _no_temporary_files_left(tmp_path: Path) -> None:
    """Issue 20: each run left one model folder per rank in /tmp (sgl-model-*)."""
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []


# Tokens x top-k each rank routes per pass: 3 MoE layers x worker.TOKENS x sglang_cpu.TOP_K.
ROUTED_PER_PASS = 3 * 16 * 2


SGLANG_UPDATER = {"REBALANCER_UPDATER": "sglang"}
# One expert of worker.py's model: (4 x 3 + 3 x 2) float32.
EXPERT_BYTES = (4 * 3 + 3 * 2) * 4


def test_controller_plans_commit_through_sglang_updater(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path, ctl.server.address, steps=160, settings=SGLANG_UPDATER
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1
    committed = np.asarray(dep.phy2log)
    for r in results.values():
        # Every rank runs the controller's committed placement, in SGLang's own metadata.
        assert r["version"] == dep.version
        assert np.array_equal(np.asarray(r["phy2log"]), committed)
        assert r["weights_match_map"]  # SGLang's updater moved the weights to match
        assert r["dispatch_mismatches"] == 0  # every token reached a slot holding its expert
        assert r["steps"] == 160 and r["windows"] >= 160 // 4 - 1
    # All ranks switched at the same forward pass to the same versions.
    assert len({json.dumps(r["commits"]) for r in results.values()}) == 1
    assert [v for _, v in results[0]["commits"]] == list(range(1, dep.version + 1))
    plans = Store(tmp_path / "c.sqlite").plans(DEPLOYMENT)
    assert [p.state for p in plans].count("committed") == dep.version


def _staged_run(
    tmp_path: Path,
    steps: int,
    settings: dict[str, str] | None = None,
    extra: dict[int, list[str]] | None = None,
) -> tuple[list[int], dict[int, dict], object]:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path, ctl.server.address, steps=steps, extra=extra, settings=settings
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
    finally:
        ctl.stop()
    return codes, results, dep


def _check_staged_commits(results: dict[int, dict], dep: object) -> None:
    committed = np.asarray(dep.phy2log)  # type: ignore[attr-defined]
    for r in results.values():
        assert r["version"] == dep.version  # type: ignore[attr-defined]
        assert np.array_equal(np.asarray(r["phy2log"]), committed)
        # After every pass (between groups too), every layer's weights are its map's.
        assert r["weight_mismatch_passes"] == 0 and r["weights_match_map"]
        assert r["dispatch_mismatches"] == 0
    assert len({json.dumps([r["commits"], r["groups"]]) for r in results.values()}) == 1


def test_staged_plans_keep_every_ranks_weights_equal_to_its_map(tmp_path: Path) -> None:
    """The default (staged) update: each plan's experts are received beside serving over
    the adapter's own group and swapped at one agreed pass; after every pass of a run
    with several plans each rank's weights are what SGLang's map says."""
    codes, results, dep = _staged_run(tmp_path, steps=160)
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1  # type: ignore[attr-defined]
    _check_staged_commits(results, dep)
    for r in results.values():
        assert len(r["commits"]) == dep.stats.plans_committed  # type: ignore[attr-defined]
        assert r["update_seconds"] == []  # SGLang's updater never ran
        assert all(g == 1 for g in r["groups"])  # within the default budget: one swap per plan
    _no_temporary_files_left(tmp_path)


def test_layer_groups_commit_a_plan_larger_than_the_staging_budget(tmp_path: Path) -> None:
    """A budget of two experts per rank: the plans commit in several layer groups, each
    staged and swapped at an agreed pass of its own, every map matching its weights."""
    # Up to 8 groups a plan, each agreed and swapped at a pass of its own: 400 passes let
    # a large plan finish on a loaded machine (160 did not, beside the CI's hog).
    codes, results, dep = _staged_run(
        tmp_path, steps=400, settings={"REBALANCER_STAGING_BUDGET_BYTES": str(2 * EXPERT_BYTES)}
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1  # type: ignore[attr-defined]
    _check_staged_commits(results, dep)
    r = results[0]
    assert max(r["groups"]) > 1, r["groups"]
    assert len(r["swap_seconds"]) == sum(r["groups"])


def test_lp_dispatch_follows_every_staged_swap(tmp_path: Path) -> None:
    """Issue 29: with `--ep-dispatch-algorithm lp` the staged swap changed SGLang's expert
    location metadata but left SGLang's per-layer LP solvers on the replicas of the start,
    so the dispatch weighed replicas that had moved (a column the new map leaves -1, or a
    slot now holding another expert). Now every swap (layer groups too: a budget of two
    experts) rebuilds them as SGLang's own update does: after the run each rank's solvers
    are the map's, and every token of every pass reached a slot holding its expert.
    Stood in (GPU-only, bench.sglang_cpu._lp_stand_ins): the solver's JIT warm-up, its fused LP
    solve and the CUDA dispatch kernel; SGLang's LPLBSolver, init_lplb_solvers and
    dispatch info are real."""
    codes, results, dep = _staged_run(
        tmp_path,
        steps=400,
        settings={"REBALANCER_STAGING_BUDGET_BYTES": str(2 * EXPERT_BYTES)},
        extra=_every_rank(["--dispatch", "lp"]),
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert dep.stats.plans_committed >= 1  # type: ignore[attr-defined]
    _check_staged_commits(results, dep)
    for r in results.values():
        assert r["updater"] == "staged" and r["update_seconds"] == []
        assert not np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        assert r["lp_solvers_match"] is True
    assert max(results[0]["groups"]) > 1, results[0]["groups"]


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_a_recorder_mode_without_counts_is_refused_loudly_and_sglang_serves(
    tmp_path: Path, mode: str
) -> None:
    """Issue 29: with SGLang's recorder in per_pass or per_token mode the adapter ran and
    never sent a window, without a word. Now it is off from the first pass on every rank,
    with one ERROR line naming the setting and the one to use, and SGLang serves every pass
    on its placement. (per_token reads the batch's tokens: the worker hands the recorder a
    stand-in ForwardBatch with the fields it reads.)"""
    steps = 6
    codes, results = _run_ranks(
        tmp_path,
        f"127.0.0.1:{free_port()}",
        steps=steps,
        world=2,
        extra={r: ["--recorder-mode", mode] for r in range(2)},
    )
    assert codes == [0, 0], _logs(tmp_path)
    for rank, r in results.items():
        assert r.get("adapter") is False and r["served"] == steps, r
        assert (
            r["disabled"] is not None
            and f"--expert-distribution-recorder-mode is {mode}" in r["disabled"]
        )
        assert r["dispatch_mismatches"] == 0 and r["weights_match_map"]
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        errors = [
            line
            for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()
            if "rebalancer adapter DISABLED on this rank" in line
        ]
        assert len(errors) == 1, errors
        assert "use --expert-distribution-recorder-mode stat" in errors[0]


def test_rank_killed_mid_staging_aborts_the_plan_with_no_live_change(tmp_path: Path) -> None:
    """Rank 3 exits inside the first plan's weight transfer (every rank had taken the
    plan): the survivors' transfers fail, the plan aborts on every rank, and nothing
    live changed anywhere: SGLang's maps and the weights are still the initial ones."""
    codes, results, dep = _staged_run(tmp_path, steps=120, extra={3: ["--die-in-staging"]})
    store = Store(tmp_path / "c.sqlite")
    (plan_v1,) = [p for p in store.plans(DEPLOYMENT) if p.version == 1]
    assert codes[3] == 3 and codes[:3] == [0, 0, 0], _logs(tmp_path)
    assert plan_v1.state == "aborted", plan_v1
    assert dep.version == 0 and dep.mixed is None  # type: ignore[attr-defined]
    for r in (results[x] for x in range(3)):
        assert r["version"] == 0 and r["commits"] == [] and r["swap_seconds"] == []
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        assert r["weight_mismatch_passes"] == 0 and r["weights_match_map"]
        assert r["dispatch_mismatches"] == 0 and r["served"] == 120
    _no_temporary_files_left(tmp_path)


def test_rank_killed_mid_update_leaves_survivors_on_one_placement(tmp_path: Path) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        # Rank 3 exits inside SGLang's updater at the second MoE layer of the first plan.
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=120,
            extra={3: ["--die-at-layer", "2"]},
            settings=SGLANG_UPDATER,
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
    finally:
        ctl.stop()
    store = Store(tmp_path / "c.sqlite")
    (plan_v1,) = [p for p in store.plans(DEPLOYMENT) if p.version == 1]
    placement_v1 = store.placement(DEPLOYMENT, 1)
    assert codes[3] == 3 and codes[:3] == [0, 0, 0], _logs(tmp_path)
    # The controller told every rank to commit plan v1 (it can never abort after that);
    # the move lost rank 3 and the survivors reported FAILED with what they serve.
    assert plan_v1.state == "partial" and placement_v1 is not None, plan_v1
    assert "layer 2" in plan_v1.reason
    survivors = [results[r] for r in range(3)]
    maps = [np.asarray(r["phy2log"]) for r in survivors]
    assert all(np.array_equal(m, maps[0]) for m in maps)  # one placement on every survivor
    # The controller holds what the survivors serve (issue 20: it refused their report and
    # held v0), in its store too, and started no plan on top of it.
    mixed = store.mixed(DEPLOYMENT)
    assert mixed is not None and mixed.version == 1 and mixed.phy2log is not None
    assert np.array_equal(mixed.phy2log, maps[0])
    assert dep.mixed is not None and np.array_equal(dep.phy2log, maps[0])
    assert store.max_version(DEPLOYMENT) == 1
    _no_temporary_files_left(tmp_path)
    for r in survivors:
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
        assert r["version"] == 0 and r["commits"] == []
        assert "layer 2" in r["broken"]
        assert np.array_equal(np.asarray(r["adapter_phy2log"]), maps[0])
    # Which placement: v1 on MoE layer 1 (finished before rank 3 died), v0 from layer 2 on.
    initial = np.asarray(json.loads((tmp_path / "rank0.json").read_text())["initial_phy2log"])
    assert not np.array_equal(placement_v1[1], initial[1])
    assert np.array_equal(maps[0][1], placement_v1[1])
    assert np.array_equal(maps[0][2:], initial[2:])


def test_every_pass_reaches_the_controller_without_an_explicit_finish(tmp_path: Path) -> None:
    """Issue 20: the first pass's counts were dropped (recorded before the adapter existed)
    though the first window claimed its steps, and only the test worker called finish():
    a production process lost its last window at exit. Here no rank calls finish(); 10
    passes in windows of 4: every routed token is folded, the last 2 passes' too."""
    steps = 10
    ctl = start_controller(
        tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1), ready=True
    )
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path, ctl.server.address, steps=steps, extra=_every_rank(["--no-finish"])
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        folded = ctl.call(lambda: (dep.stats.tokens_folded, dep.estimator.windows))
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    assert folded == (WORLD * steps * ROUTED_PER_PASS, 3)
    _no_temporary_files_left(tmp_path)


def test_an_adapter_error_disables_it_and_sglang_keeps_serving(tmp_path: Path) -> None:
    """Issue 20: an exception of the adapter went up into SGLang's forward loop. Now it
    turns the adapter off on that rank (loud log, its agent stops: the controller sees the
    rank leave) and SGLang serves every pass on the placement it holds."""
    steps = 24
    ctl = start_controller(tmp_path / "c.sqlite", FAST_POLICY, ready=True)
    assert ctl.server is not None
    try:
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=steps,
            extra=_every_rank(["--adapter-error-at-pass", "6"]),
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        folded = ctl.call(lambda: dep.stats.tokens_folded)
    finally:
        ctl.stop()
    assert codes == [0] * WORLD, _logs(tmp_path)
    for rank, r in results.items():
        assert r["served"] == steps and r["dispatch_mismatches"] == 0
        assert r["disabled"] == "pass counts: RuntimeError: injected adapter error", r
        assert not r["agent_running"]  # gone from the controller while SGLang serves
        assert (
            "rebalancer adapter DISABLED on this rank" in (tmp_path / f"rank{rank}.log").read_text()
        )
    assert folded <= WORLD * 5 * ROUTED_PER_PASS  # nothing after the error


# Warm start in a replica pool (issue 24): SGLang's initial expert location.
POOL = "p"
QUIET_POLICY = replace(FAST_POLICY, paused=True)  # no plan of the controller's own in between


def _pool_placement() -> np.ndarray:
    """A placement of the worker's shape unlike SGLang's trivial one (hot experts 0 and 1
    held twice, every layer permuted differently)."""
    from bench.sglang_cpu import NUM_EXPERTS, NUM_LAYERS, REDUNDANT

    rows = [
        np.concatenate([np.roll(np.arange(NUM_EXPERTS)[::-1], layer), [0, 1, 0, 1]])
        for layer in range(NUM_LAYERS)
    ]
    placement = np.asarray(rows, dtype=np.int64)
    assert placement.shape[1] == NUM_EXPERTS + REDUNDANT
    return placement


def _expert_bytes() -> int:
    from tests.engines.sglang.worker import SHAPES

    return sum(int(np.prod(shape)) for shape in SHAPES) * 4  # float32, as the adapter reports


def _seed_pool(ctl: EmbeddedController, placement: np.ndarray) -> None:
    """Pool `p` holding `placement`: a seed member of the worker's shape registers over
    gRPC, then the pool takes the placement as a pool decision would."""
    from bench.sglang_cpu import NUM_EXPERTS, NUM_LAYERS, REDUNDANT

    assert ctl.server is not None
    shape = pb.ModelShape(
        num_layers=NUM_LAYERS,
        num_logical_experts=NUM_EXPERTS,
        num_physical_slots=NUM_EXPERTS + REDUNDANT,
        num_gpus=WORLD,
        num_nodes=1,
        expert_bytes=_expert_bytes(),
    )
    with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
        pb_grpc.WorkerServiceStub(channel).Register(
            pb.RegisterRequest(deployment="seed", rank=0, shape=shape, pool=POOL), timeout=30
        )
    ctl.call(lambda: ctl.server.controller.fleet.pools[POOL].take(placement))  # type: ignore[union-attr]


def _warm_run(
    tmp_path: Path,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> tuple[
    list[int], dict[int, dict], tuple[int, np.ndarray, int], dict[int, tuple[str, str]], np.ndarray
]:
    ctl = start_controller(tmp_path / "c.sqlite", QUIET_POLICY, ready=True)
    assert ctl.server is not None
    placement = _pool_placement()
    try:
        _seed_pool(ctl, placement)
        codes, results = _run_ranks(
            tmp_path,
            ctl.server.address,
            steps=24,
            settings={"REBALANCER_POOL": POOL, "REBALANCER_WARM_START_SECONDS": "20"},
            rank_env=rank_env,
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        state = ctl.call(
            lambda: (dep.version, np.asarray(dep.phy2log).copy(), dep.shape.expert_bytes)
        )
        plans = ctl.call(
            lambda: {
                p.version: (p.state, p.trigger)
                for p in ctl.server.controller.store.plans(DEPLOYMENT)
            }
        )  # type: ignore[union-attr]
    finally:
        ctl.stop()
    return codes, results, state, plans, placement


def test_a_fresh_group_in_a_pool_starts_on_the_pool_placement(tmp_path: Path) -> None:
    codes, results, (version, committed, expert_bytes), plans, placement = _warm_run(tmp_path)
    assert codes == [0] * WORLD, _logs(tmp_path)
    warm = results[0]["warm_start"]
    assert warm >= 1, _logs(tmp_path)
    for r in results.values():
        assert r["warm_start"] == warm
        # SGLang's expert location metadata was the pool's before its weights were loaded
        # (the worker loads each slot's expert from it, as load_model does) ...
        assert np.array_equal(np.asarray(r["initial_phy2log"]), placement)
        # ... and stays it; the adapter serves it as version W.
        assert np.array_equal(np.asarray(r["phy2log"]), placement)
        assert np.array_equal(np.asarray(r["adapter_phy2log"]), placement)
        assert r["version"] == warm and r["commits"] == []
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    # The controller adopted W on the ranks' COMMITTED, and learned the expert bytes the
    # early registration could not tell.
    assert version == warm and np.array_equal(committed, placement)
    assert plans[warm] == ("committed", "warm_start")
    assert expert_bytes == _expert_bytes()


def test_a_rank_without_the_offer_keeps_every_rank_on_sglangs_start(tmp_path: Path) -> None:
    # Rank 3 never waits for the offer (0 s): it contributes no version, so none installs.
    codes, results, (version, _, _), plans, placement = _warm_run(
        tmp_path, rank_env={3: {"REBALANCER_WARM_START_SECONDS": "0"}}
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        assert r["warm_start"] == 0 and r["version"] == 0 and r["commits"] == []
        assert not np.array_equal(np.asarray(r["initial_phy2log"]), placement)
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    assert version == 0
    assert [state for state, trigger in plans.values() if trigger == "warm_start"] == ["offered"]


def test_a_pool_member_without_a_controller_starts_as_today_within_the_bound(
    tmp_path: Path,
) -> None:
    bound = 2.0
    codes, results = _run_ranks(
        tmp_path,
        f"127.0.0.1:{free_port()}",
        steps=8,
        settings={"REBALANCER_POOL": POOL, "REBALANCER_WARM_START_SECONDS": str(bound)},
    )
    assert codes == [0] * WORLD, _logs(tmp_path)
    for r in results.values():
        assert r["warm_start"] == 0 and r["version"] == 0
        assert np.array_equal(np.asarray(r["phy2log"]), np.asarray(r["initial_phy2log"]))
        # SGLang's trivial start (the worker's --init-expert-location is "trivial").
        assert np.array_equal(
            np.asarray(r["initial_phy2log"]), np.asarray(results[0]["initial_phy2log"])
        )
        # The one wait, in SGLang's expert-location step, never longer than the bound
        # (slack: warm_start.STOP_SECONDS for the early agent, the agreement, a loaded machine).
        assert r["started_seconds"] < bound + STOP_SECONDS + 1.5


def test_a_fresh_group_behind_its_pods_sidecar_starts_on_the_pool_placement(tmp_path: Path) -> None:
    """The offer relayed by the pod's sidecar (ControllerMessage.warm_start); the ranks'
    expert bytes, unknown at the early registration, reach the controller through the
    group's next registration."""
    ctl = start_controller(tmp_path / "c.sqlite", QUIET_POLICY, ready=True)
    assert ctl.server is not None
    placement = _pool_placement()
    sockets = Path(tempfile.mkdtemp(prefix="sgw", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{sockets}/agent.sock"
    log = (tmp_path / "sidecar.log").open("a")
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
            f"0-{WORLD - 1}",
            "--pod",
            "ns/a",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--grace",
            "1",
            "--pool",
            POOL,
            "--log-level",
            "INFO",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=sglang_cpu.ROOT,
    )
    log.close()
    try:
        assert sidecar.stdout is not None
        assert "sidecar serving on" in sidecar.stdout.readline(), (
            tmp_path / "sidecar.log"
        ).read_text()[-3000:]
        _seed_pool(ctl, placement)
        codes, results = _run_ranks(
            tmp_path,
            target,
            steps=40,
            settings={"REBALANCER_POOL": POOL, "REBALANCER_WARM_START_SECONDS": "20"},
        )
        dep = ctl.call(lambda: ctl.server.controller.deployments[DEPLOYMENT])  # type: ignore[union-attr]
        deadline = time.monotonic() + 30  # the sidecar's last registration may still be on its way
        while (
            ctl.call(lambda: dep.shape.expert_bytes) != _expert_bytes()
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        version, committed, expert_bytes = ctl.call(
            lambda: (dep.version, np.asarray(dep.phy2log).copy(), dep.shape.expert_bytes)
        )
    finally:
        reap([sidecar], seconds=30)
        ctl.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    logs = _logs(tmp_path) + (tmp_path / "sidecar.log").read_text()[-3000:]
    assert codes == [0] * WORLD, logs
    warm = results[0]["warm_start"]
    assert warm >= 1, logs
    for r in results.values():
        assert r["warm_start"] == warm and r["version"] == warm
        assert np.array_equal(np.asarray(r["initial_phy2log"]), placement)
        assert np.array_equal(np.asarray(r["phy2log"]), placement)
        assert r["weights_match_map"] and r["dispatch_mismatches"] == 0
    assert version == warm and np.array_equal(committed, placement), logs
    assert expert_bytes == _expert_bytes(), logs
