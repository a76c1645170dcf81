"""A store that refuses writes (disk full, read-only file system: here SQLite's own
query_only refusal) while a plan finishes. Found by the chaos campaign (reliability/chaos/,
store_disk_full at a plan's prepared phase): the abort's record failed, the exception left
the plan in flight in state ABORTED for good, and no plan ever started again. Now the
plan finishes in memory and on the ranks, and its record is written once the store takes
writes again (at a tick)."""

from __future__ import annotations

from pathlib import Path

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from tests.unit.controller.test_controller import SHAPE, SKEWED, FakeClock


def started(tmp_path: Path) -> tuple[Controller, FakeClock, list[str], int]:
    clock = FakeClock(100.0)
    ctl = Controller(
        Store(tmp_path / "c.sqlite"),
        PolicyConfig(paused=True, min_windows=1, prepare_timeout_seconds=10.0),
        clock=clock,
    )
    sessions = []
    for rank in range(SHAPE.num_gpus):
        session, _ = ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")
        ctl.attach(session.session_id, lambda kind, plan: None)
        sessions.append(session.session_id)
    dep = ctl.deployment("d")
    for rank in range(SHAPE.num_gpus):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = ctl.force("d")
    assert plan is not None
    return ctl, clock, sessions, plan.version


def refuse_writes(store: Store, refuse: bool) -> None:
    store._db.execute(f"PRAGMA query_only={'ON' if refuse else 'OFF'}")


def test_abort_while_the_store_refuses_writes_frees_the_plan_and_is_recorded_later(
    tmp_path: Path,
) -> None:
    ctl, clock, _, version = started(tmp_path)
    dep = ctl.deployment("d")
    refuse_writes(ctl.store, True)
    clock.now = 111.0  # past the prepare deadline
    ctl.tick()
    assert dep.plan is None  # not stuck in flight: the next plan can start
    assert dep.stats.plans_aborted == 1
    assert ctl.store.plans("d")[0].state == "preparing"  # the record waits
    refuse_writes(ctl.store, False)
    ctl.tick()
    assert ctl.store.plans("d")[0].state == "aborted"
    _, plan = ctl.force("d")
    assert plan is not None and plan.version == version + 1


def test_commit_while_the_store_refuses_writes_is_recorded_later(tmp_path: Path) -> None:
    ctl, clock, sessions, version = started(tmp_path)
    dep = ctl.deployment("d")
    for sid in sessions:
        ctl.report(sid, version, "prepared")
    refuse_writes(ctl.store, True)
    ctl.report(sessions[0], version, "committed")  # the first confirmation commits
    assert dep.version == version
    assert ctl.store.load_deployments()[0].committed_version == 0
    ctl.report(sessions[1], version, "committed")
    assert dep.plan is None
    refuse_writes(ctl.store, False)
    ctl.tick()
    assert ctl.store.load_deployments()[0].committed_version == version
    assert ctl.store.plans("d")[0].state == "committed"


def test_a_late_confirmation_while_the_store_refuses_writes_is_adopted_and_recorded_later(
    tmp_path: Path,
) -> None:
    """Found by the short chaos campaign on a loaded machine: the ranks switched to a plan
    the controller had finished unconfirmed, their one COMMITTED report came while the
    store's disk was full, the adoption's write raised, the report was refused (and never
    told again), and the controller stayed on the older version with no plan in flight
    for good (store v6, controller v6, ranks on v7)."""
    ctl, clock, sessions, version = started(tmp_path)
    dep = ctl.deployment("d")
    for sid in sessions:
        ctl.report(sid, version, "prepared")
    for rank, sid in enumerate(sessions):  # every link dropped after Commit went out
        ctl.detach(sid)
        session, _ = ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")
        ctl.attach(session.session_id, lambda kind, plan: None)
        sessions[rank] = session.session_id
    assert dep.plan is None and dep.version == 0  # finished unconfirmed: the ranks came back on v0
    refuse_writes(ctl.store, True)
    ctl.report(sessions[0], version, "committed")  # they switched after all: told once
    assert dep.version == version
    refuse_writes(ctl.store, False)
    ctl.tick()
    assert ctl.store.load_deployments()[0].committed_version == version
