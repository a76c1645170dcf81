"""Level-triggered reconciliation: the controller converges to what every rank states it
serves in its windows, whatever plan reports were lost (issue: every served version is
recorded; RELIABILITY.md defect 24).

The shape the short chaos campaign failed on in CI: plan v1's Commit went out, the ranks
agreed and switched, and every COMMITTED report was lost with the links that carried it
(a report refused for a session that had ended is not sent again). The plan then ran out
of commit grace and ended unconfirmed: store and controller at v0 with the ranks on v1,
for good. Here the ranks' windows state (v1, digest of v1's placement), and that is
enough. On a real SQLite file."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.coordinate import COMMIT_GRACE_SECONDS
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.layout import placement_digest
from tests.unit.controller.test_commit_record import POLICY, forced
from tests.unit.controller.test_controller import SHAPE, SKEWED, FakeClock


def committing(tmp_path: Path) -> tuple[Controller, list[str], int, np.ndarray, FakeClock]:
    """Plan v1 prepared on both ranks; its Commit went out; no rank's report arrives."""
    clock = FakeClock(100.0)
    ctl, sessions, sent, plan = forced(tmp_path / "c.sqlite", clock)
    for sid in sessions:
        ctl.report(sid, plan.version, "prepared")
    assert (0, "commit", plan.version) in sent and (1, "commit", plan.version) in sent
    return ctl, sessions, plan.version, plan.phy2log, clock


def past_the_commit_grace(ctl: Controller, clock: FakeClock) -> None:
    """Time runs out for the plan whose Commit went out: it ends unconfirmed."""
    clock.now += POLICY.prepare_timeout_seconds + COMMIT_GRACE_SECONDS + 1
    ctl.tick()


def window(ctl: Controller, rank: int, seq: int, version: int, phy2log: np.ndarray) -> None:
    dep = ctl.deployment("d")
    ctl.ingest(dep, rank, seq, version, SKEWED, None, (version, placement_digest(phy2log)))


def test_a_switch_whose_every_report_was_lost_is_recorded_from_the_windows(tmp_path: Path) -> None:
    ctl, _, version, new, clock = committing(tmp_path)
    past_the_commit_grace(ctl, clock)  # unconfirmed: no rank's word reached the controller
    dep = ctl.deployment("d")
    assert dep.plan is None and dep.version == 0  # unconfirmed: the edge path lost it
    window(ctl, 0, 1, version, new)
    assert dep.version == 0  # one rank's statement is not every rank's
    window(ctl, 1, 1, version, new)
    assert dep.version == version
    assert np.array_equal(dep.phy2log, new)
    ctl.store.close()
    again = Store(tmp_path / "c.sqlite")  # what a restarted controller reads
    (row,) = [d for d in again.load_deployments() if d.name == "d"]
    assert row.committed_version == version
    assert again.plans("d")[0].state == "committed"
    again.close()


def test_the_statements_confirm_the_plan_in_flight(tmp_path: Path) -> None:
    ctl, _, version, new, _ = committing(tmp_path)
    dep = ctl.deployment("d")
    window(ctl, 0, 1, version, new)
    window(ctl, 1, 1, version, new)
    assert dep.plan is None and dep.version == version
    assert ctl.store.plans("d")[0].state == "committed"
    ctl.store.close()


def test_a_statement_that_matches_no_plan_is_refused_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ctl, _, version, new, clock = committing(tmp_path)
    past_the_commit_grace(ctl, clock)  # unconfirmed: no rank's word reached the controller
    dep = ctl.deployment("d")
    other = new[:, ::-1].copy()  # v1's number, another map
    with caplog.at_level(logging.WARNING, "rebalancer.controller"):
        for seq in (1, 2):
            window(ctl, 0, seq, version, other)
            window(ctl, 1, seq, version, other)
        window(ctl, 0, 3, version + 5, new)  # a version the controller never started
        window(ctl, 1, 3, version + 5, new)
    assert dep.version == 0
    refusals = [r.message for r in caplog.records if "matches no plan" in r.message]
    assert len(refusals) == 2, refusals
    assert "another placement" in refusals[0] and "unknown version" in refusals[1]
    ctl.store.close()


def test_a_late_resent_window_never_takes_a_statement_back(tmp_path: Path) -> None:
    ctl, _, version, new, clock = committing(tmp_path)
    past_the_commit_grace(ctl, clock)  # unconfirmed: no rank's word reached the controller
    dep = ctl.deployment("d")
    base = dep.phy2log.copy()
    window(ctl, 0, 1, version, new)
    window(ctl, 0, 1, 0, base)  # a duplicate of an older window, resent late
    window(ctl, 1, 1, version, new)
    assert dep.version == version
    ctl.store.close()


def test_a_register_states_its_version_outright(tmp_path: Path) -> None:
    """A rank that restarts registers on what it serves: its old statement is void."""
    ctl, sessions, version, new, clock = committing(tmp_path)
    past_the_commit_grace(ctl, clock)  # unconfirmed: no rank's word reached the controller
    dep = ctl.deployment("d")
    window(ctl, 0, 1, version, new)
    ctl.detach(sessions[0])
    clock.now += 60
    ctl.register("d", 0, SHAPE, 0, None, "w0-restarted")
    window(ctl, 1, 1, version, new)
    assert dep.version == 0 and dep.plan is None
    assert dep.stated[0] == (0, 0)
    ctl.store.close()


def test_a_plan_some_ranks_confirmed_ends_when_the_group_restarts_on_an_older_version(
    tmp_path: Path,
) -> None:
    """Seed 106 of the short campaign beside a 4-process hog (RELIABILITY.md defect 24):
    rank 0 confirmed plan v1, then the whole group restarted on v0. The controller took v0
    (reconcile) but held v1 in flight until its commit grace ran out, 30 s and more."""
    ctl, sessions, version, _, clock = committing(tmp_path)
    dep = ctl.deployment("d")
    ctl.report(sessions[0], version, "committed")
    assert dep.version == version and dep.plan is not None  # waiting for rank 1's word
    for sid in sessions:
        ctl.detach(sid)
    clock.now += 1.0
    for rank in range(SHAPE.num_gpus):
        ctl.register("d", rank, SHAPE, 0, None, f"w{rank}-restarted")
    assert dep.version == 0
    assert dep.plan is None  # nothing is left to confirm: the next plan may start
    ctl.store.close()


def test_a_late_commit_report_from_ranks_that_restarted_is_refused(tmp_path: Path) -> None:
    """Seed 213 of the short campaign beside a 4-process hog: the group restarted on v0
    (the controller took v0), then a COMMITTED of v1 queued before the restart arrived on
    the new session, which was never sent v1's Commit; the controller adopted v1 while
    every rank served v0, for good. A report of a commit the session was never told is
    stale: refused, and the controller stays on what the ranks serve."""
    ctl, sessions, version, _, clock = committing(tmp_path)
    dep = ctl.deployment("d")
    past_the_commit_grace(ctl, clock)  # unconfirmed: no rank's word reached the controller
    for sid in sessions:
        ctl.detach(sid)
    clock.now += 1.0
    ctl.store.close()
    back = Controller(
        Store(tmp_path / "c.sqlite"), POLICY, clock=clock
    )  # and the controller restarted
    fresh = [
        back.register("d", rank, SHAPE, 0, None, f"w{rank}-restarted")[0]
        for rank in range(SHAPE.num_gpus)
    ]
    dep = back.deployment("d")
    assert dep.version == 0
    with pytest.raises(StateError, match="never sent the commit"):
        back.report(fresh[0].session_id, version, "committed")
    assert dep.version == 0
    back.store.close()
