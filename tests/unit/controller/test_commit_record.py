"""A controller killed after its Commit went out. Found by the chaos campaign (reliability/chaos/,
store_torn_wal near the preparing phase, CI): the store still held the plan as preparing,
so the restarted controller voided it and told every session to abort it, while the ranks
had the Commit and switched; the ranks then served a version the controller and the
store did not hold as committed, for good (invariant 7), and an Abort reaching a rank
between the agreement and the switch could have split the ranks (invariant 2).

Now the store records "committing" before Commit goes out; a restarted controller holds
such a plan unconfirmed (never aborted), tells every session its Commit again, and adopts
the version once ranks serve it. A store that refuses that record aborts the plan
instead, before any Commit is sent. All on a real SQLite file, reopened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rebalancer.controller.coordinate import Plan, PlanState
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from tests.unit.controller.test_controller import SHAPE, SKEWED, FakeClock

POLICY = PolicyConfig(paused=True, min_windows=1, prepare_timeout_seconds=10.0)


def streaming(ctl: Controller, version: int = 0) -> tuple[list[str], list[tuple[int, str, int]]]:
    """Both ranks registered on `version`, streams open: their session ids and what each was
    sent."""
    sent: list[tuple[int, str, int]] = []
    sessions = []
    for rank in range(SHAPE.num_gpus):
        session, _ = ctl.register("d", rank, SHAPE, version, None, f"w{rank}")

        def send(kind: str, plan: Any, rank: int = rank) -> None:
            if kind != "planned_loss":  # told ahead of failures: test_contingency.py
                sent.append((rank, kind, plan.version))

        ctl.attach(session.session_id, send)
        sessions.append(session.session_id)
    return sessions, sent


def forced(
    db: Path, clock: FakeClock
) -> tuple[Controller, list[str], list[tuple[int, str, int]], Plan]:
    """A controller on `db` with both ranks streaming and a forced plan preparing."""
    ctl = Controller(Store(db), POLICY, clock=clock)
    sessions, sent = streaming(ctl)
    dep = ctl.deployment("d")
    for rank in range(SHAPE.num_gpus):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = ctl.force("d")
    assert plan is not None
    return ctl, sessions, sent, plan


def prepared_everywhere(
    db: Path, clock: FakeClock
) -> tuple[Controller, list[tuple[int, str, int]], int]:
    ctl, sessions, sent, plan = forced(db, clock)
    for sid in sessions:
        ctl.report(sid, plan.version, "prepared")
    return ctl, sent, plan.version


def test_the_store_knows_the_commit_before_any_rank_hears_it(tmp_path: Path) -> None:
    ctl, sent, version = prepared_everywhere(tmp_path / "c.sqlite", FakeClock(100.0))
    assert (0, "commit", version) in sent
    # Read as another process would, at the moment Commit is out.
    other = Store(tmp_path / "c.sqlite")
    assert other.plans("d")[0].state == "committing"
    other.close()
    ctl.store.close()


def test_a_restart_after_commit_tells_the_commit_again_and_adopts_the_switch(
    tmp_path: Path,
) -> None:
    db = tmp_path / "c.sqlite"
    ctl, _, version = prepared_everywhere(db, FakeClock(100.0))
    ctl.store.close()  # killed: no rank's confirmation reached it

    back = Controller(Store(db), POLICY, clock=FakeClock(200.0))
    (record, *_) = back.store.plans("d")
    assert (record.version, record.state) == (version, "unconfirmed")
    assert "Commit went out" in record.reason
    dep = back.deployment("d")
    assert dep.version == 0 and dep.plan is None and dep.last_aborted is None
    sessions, sent = streaming(back)  # the ranks come back before they switched
    assert sorted(sent) == [(0, "commit", version), (1, "commit", version)]  # never an abort
    back.report(sessions[0], version, "committed")  # they switch together and say so
    assert dep.version == version
    assert back.store.load_deployments()[0].committed_version == version
    assert back.store.plans("d")[0].state == "committed"
    back.store.close()


def test_ranks_back_already_switched_are_adopted(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    ctl, _, version = prepared_everywhere(db, FakeClock(100.0))
    ctl.store.close()
    back = Controller(Store(db), POLICY, clock=FakeClock(200.0))
    _, sent = streaming(back, version=version)
    dep = back.deployment("d")
    assert dep.version == version and not [s for s in sent if s[1] == "abort"]
    assert back.store.load_deployments()[0].committed_version == version
    back.store.close()


def test_ranks_that_restarted_on_the_base_version_move_on(tmp_path: Path) -> None:
    """The group restarted too (no staging left): the Commit told again changes nothing on
    them, and the next plan takes the next version."""
    db = tmp_path / "c.sqlite"
    ctl, _, version = prepared_everywhere(db, FakeClock(100.0))
    ctl.store.close()
    back = Controller(Store(db), POLICY, clock=FakeClock(200.0))
    streaming(back)
    dep = back.deployment("d")
    for rank in range(SHAPE.num_gpus):
        back.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = back.force("d")
    assert plan is not None and plan.version == version + 1 and plan.base_version == 0
    back.store.close()


def test_a_store_refusing_the_commit_record_aborts_before_any_commit(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    ctl, sessions, sent, plan = forced(tmp_path / "c.sqlite", clock)
    dep = ctl.deployment("d")
    ctl.report(sessions[0], plan.version, "prepared")
    ctl.store._db.execute("PRAGMA query_only = ON")  # SQLite now refuses every write
    ctl.report(sessions[1], plan.version, "prepared")
    assert plan.state is PlanState.ABORTED and "store refused to record the commit" in plan.reason
    assert not [s for s in sent if s[1] == "commit"]
    assert sorted(s for s in sent if s[1] == "abort") == [
        (0, "abort", plan.version),
        (1, "abort", plan.version),
    ]
    assert dep.plan is None and dep.version == 0
    ctl.store._db.execute("PRAGMA query_only = OFF")
    clock.now = 101.0
    ctl.tick()  # the abort's record, kept while refused, is written now
    assert ctl.store.plans("d")[0].state == "aborted"
    ctl.store.close()


def test_stale_windows_of_a_restarted_group_do_not_move_the_controller(tmp_path: Path) -> None:
    """Windows say which version their steps ran on, but a sidecar resends windows buffered
    before its group restarted: they carry the old version. Taking them as a confirmation
    (tried, and found by the 300 s campaign) put the controller back on v1 while the
    restarted ranks served v0. Only reports and registrations move the committed version."""
    db = tmp_path / "c.sqlite"
    ctl, _, version = prepared_everywhere(db, FakeClock(100.0))
    sessions = [s.session_id for s in ctl.deployment("d").sessions.values()]
    ctl.report(sessions[0], version, "committed")
    dep = ctl.deployment("d")
    assert dep.version == version
    for sid in set(sessions):  # the group dies and restarts on the placement it starts with
        ctl.detach(sid)
    streaming(ctl, version=0)
    assert dep.version == 0  # reconciled to what the ranks serve
    assert ctl.ingest(dep, 0, 1, version, SKEWED, None)  # a window from before the restart
    assert dep.version == 0 and ctl.store.load_deployments()[0].committed_version == 0
    ctl.store.close()


def test_ranks_registering_on_the_plan_they_switched_to_confirm_it(tmp_path: Path) -> None:
    """Both ranks switched, their links dropped and their COMMITTED reports went with them
    (the short chaos campaign in CI: ranks on v12, controller and store on v11 for good).
    They register again serving the plan's version: that is their confirmation, the plan
    is committed at once instead of left unconfirmed after its commit grace."""
    clock = FakeClock(100.0)
    ctl, _, version = prepared_everywhere(tmp_path / "c.sqlite", clock)
    dep = ctl.deployment("d")
    for sid in {s.session_id for s in dep.sessions.values()}:
        ctl.detach(sid)
    clock.now = 101.0
    ctl.register("d", 0, SHAPE, version, None, "w0")
    assert dep.plan is not None and dep.plan.committed == {0}
    assert dep.version == version  # the first confirmation commits, as a report would
    ctl.register("d", 1, SHAPE, version, None, "w1")
    assert dep.plan is None and dep.last_unconfirmed is None
    assert ctl.store.load_deployments()[0].committed_version == version
    assert ctl.store.plans("d")[0].state == "committed"
    ctl.store.close()
