"""A plan applied in part: its Commit went out, then a rank failed midway (issue 20).

SGLang's updater moves the live weights layer by layer after the Commit; a rank lost
midway leaves its survivors serving the plan on the layers before and the base from
there on, and they report FAILED with that placement. The controller refused that report
(FAILED_PRECONDITION: a failure can no longer abort it), held the base placement as what
the ranks serve, and went on planning on top of it. Now the plan ends "partial", the
deployment records the mixed placement (store, status, metric, history), starts no plan
on top of it, keeps it across its own restart, and clears it when the group restarts.
All on a real SQLite file, reopened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.admin import status_msg
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from tests.unit.controller.test_commit_record import POLICY, prepared_everywhere, streaming
from tests.unit.controller.test_controller import SHAPE, SKEWED, FakeClock


def mixed_of(ctl: Controller, version: int) -> np.ndarray:
    """The plan's placement on the first layer it changes, its base's on the others: what
    survivors serve when the update stopped after that layer."""
    base = ctl.store.placement("d", 0)
    planned = ctl.store.placement("d", version)
    assert base is not None and planned is not None
    (moved, *_) = np.flatnonzero((base != planned).any(axis=1))
    out = base.copy()
    out[moved] = planned[moved]
    assert not np.array_equal(out, base)
    return out


def partial(db: Path, clock: FakeClock) -> tuple[Controller, int, np.ndarray]:
    """Both ranks prepared and told to commit; both report FAILED at layer 1."""
    ctl, _, version = prepared_everywhere(db, clock)
    served = mixed_of(ctl, version)
    dep = ctl.deployment("d")
    sessions = [s.session_id for s in dep.live_sessions()]
    error = "update lost a peer at layer 1"
    ctl.report(sessions[0], version, "failed", error, served)  # FAILED_PRECONDITION before
    ctl.report(sessions[1], version, "failed", error, served)  # the other survivor: the same
    return ctl, version, served


def test_a_failure_after_the_commit_records_what_the_ranks_serve(tmp_path: Path) -> None:
    ctl, version, served = partial(tmp_path / "c.sqlite", FakeClock(100.0))
    dep = ctl.deployment("d")
    metrics = ControllerMetrics(ctl)
    assert dep.plan is None and dep.version == 0  # the ranks report serving v0 ...
    assert np.array_equal(dep.phy2log, served)  # ... with a mix of v0 and the plan
    assert dep.mixed is not None and dep.mixed.version == version
    (record, *_) = ctl.store.plans("d")
    assert (record.version, record.state) == (version, "partial")
    assert "failed after the commit: update lost a peer at layer 1" in record.reason
    status = status_msg(dep)
    assert f"plan v{version} applied in part over v0" in status.mixed
    text = metrics.render().decode()
    assert 'rebalancer_mixed_placement{deployment="d"} 1.0' in text
    assert 'rebalancer_plans_total{deployment="d",outcome="partial"} 1.0' in text
    assert dep.last_unconfirmed is None  # no Commit of it is retold: nothing can switch to it
    ctl.store.close()


def test_no_plan_starts_on_top_of_a_mixed_placement(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    ctl, _, _ = partial(tmp_path / "c.sqlite", clock)
    dep = ctl.deployment("d")
    clock.now = 1000.0
    assert not ctl.decisions.due(dep, clock.now)  # the policy does not decide
    with pytest.raises(StateError, match="mixed placement") as refused:
        ctl.force("d")  # nor may an operator
    assert refused.value.code == "FAILED_PRECONDITION"
    assert dep.plan is None and ctl.store.max_version("d") == 1
    # A policy decision already computed when the mix was recorded is recorded as skipped.
    decision = dep.loop.force(dep.phy2log, clock.now)
    assert ctl.decisions.act(dep, decision, "policy", clock.now) is None
    assert ctl.store.decisions("d", 1)[0]["outcome"] == "skip_mixed"
    ctl.store.close()


def test_the_record_survives_a_restart_and_clears_when_the_group_restarts(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    ctl, version, served = partial(db, FakeClock(100.0))
    ctl.store.close()  # the controller restarts; the survivors are still up

    back = Controller(Store(db), POLICY, clock=FakeClock(200.0))
    dep = back.deployment("d")
    assert dep.mixed is not None and np.array_equal(dep.phy2log, served)
    sessions, _ = streaming(back)  # the survivors reconnect (same workers, w0 and w1)
    assert dep.mixed is not None  # still the same processes: still mixed
    for sid in sessions:
        back.detach(sid)  # the group goes down ...
    for rank in range(SHAPE.num_gpus):  # ... and comes back: new processes, the base placement
        session, _ = back.register("d", rank, SHAPE, 0, None, f"w{rank}-restarted")
        back.attach(session.session_id, lambda kind, plan: None)
    assert dep.mixed is None and back.store.mixed("d") is None
    base = back.store.placement("d", 0)
    assert base is not None and np.array_equal(dep.phy2log, base)
    for rank in range(SHAPE.num_gpus):
        back.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = back.force("d")  # plans resume, on the placement the ranks serve
    assert plan is not None and plan.version == version + 1 and plan.base_version == 0
    back.store.close()


def test_a_failure_without_the_placement_is_recorded_as_unknown_until_told(tmp_path: Path) -> None:
    """A rank that cannot say what it serves (an older adapter, a relay that dropped it):
    the mix is recorded all the same, the placement as unknown, then filled in by the next
    survivor that says it."""
    ctl, _, version = prepared_everywhere(tmp_path / "c.sqlite", FakeClock(100.0))
    served = mixed_of(ctl, version)
    dep = ctl.deployment("d")
    sessions = [s.session_id for s in dep.live_sessions()]
    ctl.report(sessions[0], version, "failed", "update lost a peer")
    assert dep.mixed is not None and dep.mixed.phy2log is None
    assert "the placement served is unknown" in status_msg(dep).mixed
    ctl.report(sessions[1], version, "failed", "update lost a peer", served)
    stored = ctl.store.mixed("d")
    assert (
        stored is not None and stored.phy2log is not None and np.array_equal(stored.phy2log, served)
    )
    assert np.array_equal(dep.phy2log, served) and dep.stats.plans_partial == 1
    ctl.store.close()
