"""A rank told to commit a staged plan keeps that staging until it switched. Found by the
chaos campaign (reliability/chaos/, links dropped at the commit_sent phase): the controller
gave up on plan v14, sent Prepare v15, and every rank's v15 staging replaced v14's while
their commit agreement was already switching to v14; the switch then died with "commit of
v14 but staged is v15" on every rank (and with the dispatch maps restaged, it would have
installed v15's map under v14). Now such a Prepare is refused (the rank still takes part
in the plan's transfers, keeping nothing) and the switch goes on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rebalancer.placement import transfers, trivial_placement
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.shape import ClusterShape
from worker_hooks.hook import (
    CommitConfig,
    HookConfig,
    Link,
    PlanDriver,
    RebalanceHook,
    WindowConfig,
)

L, E, P, G = 2, 4, 6, 1


def prepare(version: int, base: int, old: np.ndarray, new: np.ndarray) -> pb.Prepare:
    msg = pb.Prepare(version=version, base_version=base)
    msg.placement.phy2log.CopyFrom(codec.encode(new.astype(np.int32)))
    msg.transfers.CopyFrom(codec.encode(transfers(old, new, G, 1).astype(np.int32)))
    return msg


def one_rank_hook(
    plans: type[PlanDriver] = PlanDriver,
) -> tuple[RebalanceHook, np.ndarray, np.ndarray]:
    """A hook of rank 0 of 1 whose plans a `plans` drives (gloo WORLD initialised by the
    test), its placement and a plan's placement (every layer's slots rolled by one)."""
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
        windows=WindowConfig(steps=10**6),
        commit=CommitConfig(agree_every=1),
    )
    old = trivial_placement(L, E, P, G)
    new = np.stack([np.roll(old[layer], 1) for layer in range(L)])
    hook = RebalanceHook(
        config,
        old,
        {"w": torch.zeros(L, P, 1)},
        dist.group.WORLD,
        dist.group.WORLD,
        plan_driver=plans,
    )
    return hook, old, new


def test_a_prepare_while_switching_is_refused_and_the_switch_completes(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        switch_completes()
    finally:
        dist.destroy_process_group()


def switch_completes() -> None:
    config = HookConfig(
        link=Link("127.0.0.1:1", deployment="d"),
        rank=0,
        shape=ClusterShape(num_layers=L, num_logical=E, num_slots=P, num_gpus=G, expert_bytes=0),
        windows=WindowConfig(steps=10**6),
        commit=CommitConfig(agree_every=1),
    )
    old = trivial_placement(L, E, P, G)
    v1 = np.stack([np.roll(old[layer], 1) for layer in range(L)])
    v2 = np.stack([np.roll(old[layer], 2) for layer in range(L)])
    weights = {"w": torch.arange(L * P, dtype=torch.float32).reshape(L, P, 1)}
    hook = RebalanceHook(
        config, old, weights, agree_group=dist.group.WORLD, migrate_group=dist.group.WORLD
    )
    hook.plans._prepare(prepare(1, 0, old, v1))
    assert hook.stats.prepared == 1
    hook.plans.on_commit(1)  # the controller said commit; the switch waits for the agreement
    hook.plans._prepare(prepare(2, 0, old, v2))  # the controller gave up on v1's confirmations
    assert hook.stats.failed == 1 and hook.stats.prepared == 1
    for _ in range(4):
        hook.step_end()
    assert hook.version == 1  # switched to v1, its own map
    np.testing.assert_array_equal(hook.phy2log, v1)


def test_a_prepare_that_comes_twice_runs_once(tmp_path: Path) -> None:
    """The sidecar (and the controller, to a rank back on its stream) tells a Prepare
    again when the stream may have lost it: a second run of the same plan's transfers would
    take its peers' messages twice."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        hook, old, new = one_rank_hook()
        for _ in range(2):
            hook.plans.on_prepare(prepare(1, 0, old, new))
            assert hook.plans.migration is not None
            hook.plans.migration.join(30)
        assert (hook.stats.prepared, hook.stats.failed) == (1, 0)
    finally:
        dist.destroy_process_group()


def test_finish_waits_for_every_plans_transfers(tmp_path: Path) -> None:
    """Found by the chaos campaign: ranks asked to stop died of SIGABRT at exit, because
    `finish` waited only for the newest plan's thread while an older one was still inside a
    gloo wait for a peer (a daemon thread in a C++ wait at interpreter exit terminates the
    process). Now it reports not settled while any plan's thread runs (the worker then
    leaves without tearing down its groups)."""
    import threading

    release = threading.Event()
    inside = threading.Event()

    class Stuck(PlanDriver):
        def after_transfers(self, version: int) -> None:
            if version == 1:
                inside.set()
                release.wait(30)  # stands in for a transfer waiting on a peer that left

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        hook, old, new = one_rank_hook(Stuck)
        hook.start()  # its agent retries a controller that is not there: no matter
        hook.plans.on_prepare(prepare(1, 0, old, new))  # stuck
        # v1 past its transfers first: a Prepare that came while they ran would abort them
        assert inside.wait(30)
        hook.plans.on_prepare(prepare(2, 0, old, new))  # the controller moved on (v1 timed out)
        assert hook.plans.migration is not None
        hook.plans.migration.join(30)
        assert not hook.finish(timeout=0.1, transfer_timeout=0.2)
        release.set()
    finally:
        release.set()
        dist.destroy_process_group()


def test_an_abort_right_after_the_transfers_is_no_failure(tmp_path: Path) -> None:
    """Found by the chaos campaign: an Abort that dropped the staging between the end of a
    plan's transfers and the staging of its maps failed an assertion, and the rank reported
    FAILED with an empty reason. Now the plan simply ends aborted (its Abort was reported)."""

    class AbortedThen(PlanDriver):
        def after_transfers(self, version: int) -> None:
            self.on_abort(
                version, "the controller gave up"
            )  # arrives on the agent thread right then

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        hook, old, new = one_rank_hook(AbortedThen)
        reports: list[tuple[int, int, str]] = []
        hook.plans.report_to(
            lambda version, phase, **kw: reports.append((version, phase, kw.get("error", "")))
        )
        hook.plans._prepare(prepare(1, 0, old, new))
        assert (hook.stats.prepared, hook.stats.failed, hook.stats.aborted) == (0, 0, 1)
        assert reports == [(1, pb.PLAN_PHASE_ABORTED, "")]
        assert 1 not in hook.plans.book
    finally:
        dist.destroy_process_group()


def test_a_plan_prepared_while_the_rank_stops_is_a_planned_stop(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 34: a rank stopping mid-plan failed it as a fault (an ERROR, counted failed);
    it still fails the plan everywhere (all or nothing), with SHUTTING_DOWN, at INFO."""
    import logging

    from rebalancer.errors import SHUTTING_DOWN

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        hook, old, new = one_rank_hook()
        reports: list[tuple[int, int, str]] = []
        hook.plans.report_to(
            lambda version, phase, **kw: reports.append((version, phase, kw.get("error", "")))
        )
        hook.plans.close()
        with caplog.at_level(logging.INFO, logger="worker_hooks.plans"):
            hook.plans._prepare(prepare(1, 0, old, new))
        assert reports == [(1, pb.PLAN_PHASE_FAILED, SHUTTING_DOWN)]
        assert (hook.stats.prepared, hook.stats.failed) == (0, 0) and 1 not in hook.plans.book
        assert [r.levelno for r in caplog.records] == [logging.INFO], caplog.records
    finally:
        dist.destroy_process_group()
