"""A group that restarts between Commit and any confirmation. Found by the chaos campaign
(reliability/chaos/, sigterm_worker at the commit_sent phase): the killed group's ranks never
switched, the restarted ranks came back on the base version, and the plan stayed in
flight as "committing" until its commit grace ran out (over a minute), refusing every
plan meanwhile. Now ranks that come back on the base version with no other rank connected
finish it as unconfirmed at once; a rank that is still connected keeps it in flight."""

from __future__ import annotations

from rebalancer.controller.coordinate import PlanState
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from tests.unit.controller.test_controller import SHAPE, SKEWED, FakeClock, connected


def committing(clock: FakeClock) -> tuple[Controller, list[str], int]:
    ctl, _ = connected(
        clock, PolicyConfig(paused=True, min_windows=1, prepare_timeout_seconds=10.0)
    )
    dep = ctl.deployment("d")
    for rank in range(SHAPE.num_gpus):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = ctl.force("d")
    assert plan is not None
    sessions = [dep.sessions[r].session_id for r in range(SHAPE.num_gpus)]
    for sid in sessions:
        ctl.report(sid, plan.version, "prepared")
    assert plan.state is PlanState.COMMITTING
    return ctl, sessions, plan.version


def test_ranks_back_on_the_base_version_finish_an_unconfirmed_commit() -> None:
    clock = FakeClock(100.0)
    ctl, sessions, version = committing(clock)
    for sid in sessions:  # the group dies before its ranks agree on the switch
        ctl.detach(sid)
    clock.now = 101.0
    first, _ = ctl.register("d", 0, SHAPE, 0, None, "w0-restarted")
    dep = ctl.deployment("d")
    assert dep.plan is None and dep.version == 0
    (record,) = ctl.store.plans("d")
    assert record.version == version and record.state == "unconfirmed"
    assert "rank 0 came back on v0" in record.reason
    second, _ = ctl.register("d", 1, SHAPE, 0, None, "w1-restarted")
    for session in (first, second):
        ctl.attach(session.session_id, lambda kind, plan: None)
    _, plan = ctl.force("d")  # the next plan is not held back
    assert plan is not None and plan.version == version + 1


def test_a_rank_still_connected_keeps_the_commit_in_flight() -> None:
    clock = FakeClock(100.0)
    ctl, sessions, _ = committing(clock)
    ctl.detach(sessions[0])  # rank 0's link broke; rank 1 may be switching
    clock.now = 101.0
    ctl.register("d", 0, SHAPE, 0, None, "w0")
    assert ctl.deployment("d").plan is not None
