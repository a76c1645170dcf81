"""The sidecar's plan relay (invariant 5 across it): PREPARED for the pod only when every
rank prepared, FAILED when any rank fails or leaves while preparing, COMMITTED when every
rank switched; Abort reaches every rank, also after the sidecar restarted."""

from __future__ import annotations

import pytest

from rebalancer.errors import StateError
from rebalancer.sidecar.relay import Actions, Relay
from rebalancer.v1 import rebalancer_pb2 as pb

RANKS = (4, 5, 6)


def relay(connected: tuple[int, ...] = RANKS) -> Relay:
    t = iter(range(1000))
    r = Relay(RANKS, clock=lambda: float(next(t)))
    for rank in connected:
        r.attached(rank)
    return r


def prepare(version: int = 2) -> pb.Prepare:
    return pb.Prepare(version=version, base_version=version - 1, timeout_seconds=10)


def report(version: int, phase: int, **kw: object) -> pb.PlanReport:
    return pb.PlanReport(version=version, phase=phase, **kw)  # type: ignore[arg-type]


def kinds(a: Actions) -> list[tuple[int, str]]:
    return [(rank, str(m.WhichOneof("body"))) for rank, m in a.to_ranks]


def up(a: Actions) -> list[str]:
    return [pb.PlanPhase.Name(r.phase) for r in a.upstream]


def test_prepared_goes_up_only_when_every_rank_prepared() -> None:
    r = relay()
    a = r.prepare(prepare())
    assert kinds(a) == [(4, "prepare"), (5, "prepare"), (6, "prepare")]
    assert not a.upstream
    for rank in (4, 5):
        assert not r.report(
            rank, report(2, pb.PLAN_PHASE_PREPARED, bytes_received=10, seconds=1.0)
        ).upstream
    assert not r.report(
        4, report(2, pb.PLAN_PHASE_PREPARED, bytes_received=10)
    ).upstream  # again: once
    a = r.report(6, report(2, pb.PLAN_PHASE_PREPARED, bytes_received=5, seconds=3.0))
    (sent,) = a.upstream
    assert (
        sent.phase == pb.PLAN_PHASE_PREPARED and sent.bytes_received == 25 and sent.seconds == 3.0
    )
    assert r.phase == "prepared" and [e for e, _ in a.events] == ["prepared"]


def test_a_rank_failing_fails_the_pod_once_naming_the_rank() -> None:
    r = relay()
    r.prepare(prepare())
    r.report(4, report(2, pb.PLAN_PHASE_PREPARED))
    a = r.report(5, report(2, pb.PLAN_PHASE_FAILED, error="out of memory"))
    (sent,) = a.upstream
    assert sent.phase == pb.PLAN_PHASE_FAILED and sent.error == "rank 5: out of memory"
    assert not r.report(6, report(2, pb.PLAN_PHASE_FAILED, error="peer gone")).upstream
    # The others preparing after that never make the pod PREPARED.
    assert not r.report(6, report(2, pb.PLAN_PHASE_PREPARED)).upstream
    assert r.report(5, report(2, pb.PLAN_PHASE_PREPARED)).upstream == []


@pytest.mark.parametrize("after_prepared", [False, True])
def test_a_rank_leaving_while_preparing_fails_the_pod(after_prepared: bool) -> None:
    r = relay()
    r.prepare(prepare())
    if (
        after_prepared
    ):  # PREPARED already went up; the controller may still be waiting for other pods
        for rank in RANKS:
            r.report(rank, report(2, pb.PLAN_PHASE_PREPARED))
    a = r.detached(6)
    assert up(a) == ["PLAN_PHASE_FAILED"]
    assert "rank 6 disconnected" in a.upstream[0].error


def test_a_rank_not_connected_at_prepare_fails_the_pod_at_once() -> None:
    r = relay(connected=(4, 5))
    a = r.prepare(prepare())
    assert kinds(a) == [(4, "prepare"), (5, "prepare")]
    assert up(a) == ["PLAN_PHASE_FAILED"] and "rank 6 is not connected" in a.upstream[0].error
    # The plan is doomed, but its peers run its transfers with rank 6: it gets the Prepare
    # late, and the Abort when it comes.
    assert kinds(r.attached(6)) == [(6, "prepare")]


def test_the_same_prepare_told_again_is_not_relayed_twice() -> None:
    r = relay()
    r.prepare(prepare())
    assert kinds(r.prepare(prepare())) == []
    r.detached(5)
    # A rank back on its stream may have lost the Prepare with its link: told again (a rank
    # that has it runs its transfers once: worker_hooks/hook.py).
    assert kinds(r.attached(5)) == [(5, "prepare")]


def test_commit_goes_up_when_every_rank_committed() -> None:
    r = relay()
    r.prepare(prepare())
    for rank in RANKS:
        r.report(rank, report(2, pb.PLAN_PHASE_PREPARED))
    a = r.commit(2)
    assert kinds(a) == [(4, "commit"), (5, "commit"), (6, "commit")]
    assert not r.report(4, report(2, pb.PLAN_PHASE_COMMITTED, step=40)).upstream
    assert not r.report(5, report(2, pb.PLAN_PHASE_COMMITTED, step=40)).upstream
    a = r.report(6, report(2, pb.PLAN_PHASE_COMMITTED, step=40))
    assert up(a) == ["PLAN_PHASE_COMMITTED"] and a.upstream[0].step == 40
    assert r.versions == {4: 2, 5: 2, 6: 2}


def test_commit_told_again_after_the_pod_committed_sends_committed_again() -> None:
    """The controller tells Commit again when it did not hear the pod's COMMITTED (lost
    with the link, found by the short chaos campaign): the pod says it again, with the
    step, and the ranks, already switched, hear nothing."""
    r = relay()
    r.prepare(prepare())
    for rank in RANKS:
        r.report(rank, report(2, pb.PLAN_PHASE_PREPARED))
    r.commit(2)
    for rank in RANKS:
        r.report(rank, report(2, pb.PLAN_PHASE_COMMITTED, step=40))
    a = r.commit(2)
    assert up(a) == ["PLAN_PHASE_COMMITTED"] and a.upstream[0].step == 40
    assert kinds(a) == [] and r.plan is not None and r.plan.phase == "committed"


def test_a_rank_leaving_after_commit_is_not_waited_for() -> None:
    r = relay()
    r.prepare(prepare())
    for rank in RANKS:
        r.report(rank, report(2, pb.PLAN_PHASE_PREPARED))
    r.commit(2)
    r.report(4, report(2, pb.PLAN_PHASE_COMMITTED, step=8))
    r.report(5, report(2, pb.PLAN_PHASE_COMMITTED, step=8))
    a = r.detached(6)  # nothing can abort the plan now
    assert up(a) == ["PLAN_PHASE_COMMITTED"]


def test_abort_reaches_every_rank_and_a_rank_that_missed_it_hears_it_on_return() -> None:
    r = relay()
    r.prepare(prepare())
    r.report(4, report(2, pb.PLAN_PHASE_PREPARED))
    r.detached(6)  # FAILED went up
    a = r.abort(2, "ranks 4-6 (pod p) failed to prepare: rank 6 disconnected")
    assert kinds(a) == [(4, "abort"), (5, "abort")] and a.drop_reports == 2
    assert r.phase == "aborted"
    r.report(4, report(2, pb.PLAN_PHASE_ABORTED))
    # The Prepare again first (its stream may have lost it; a rank runs a plan's
    # transfers once), then the Abort.
    assert kinds(r.attached(6)) == [(6, "prepare"), (6, "abort")]
    r.detached(4)
    assert kinds(r.attached(4)) == []  # it confirmed already
    assert kinds(r.abort(2, "again")) == [(5, "abort"), (6, "abort")]  # told again: the unconfirmed


def test_a_restarted_sidecar_relays_an_abort_it_never_saw() -> None:
    """The controller tells a group that reconnects its newest aborted plan: the ranks of a
    sidecar that died mid-prepare drop what they staged."""
    r = relay(connected=(4,))
    a = r.abort(7, "ranks 4-6 (pod p) disconnected while preparing")
    assert kinds(a) == [(4, "abort")]
    assert kinds(r.attached(5)) == [(5, "abort")]  # ranks reconnecting later hear it too
    # A report the ranks queued for the dead sidecar goes nowhere: the plan is over.
    assert not r.report(4, report(7, pb.PLAN_PHASE_PREPARED)).upstream
    assert not r.report(4, report(7, pb.PLAN_PHASE_ABORTED)).upstream
    assert kinds(r.attached(6)) == [(6, "abort")] and r.phase == "aborted"


def test_a_restarted_sidecar_counts_ranks_that_already_switched() -> None:
    """Commit of a plan it never relayed (resent by the controller after the restart): ranks
    that registered serving that version have committed; the others are sent Commit."""
    r = Relay(RANKS)
    r.serves(4, 3)
    r.serves(5, 3)
    r.serves(6, 2)
    for rank in RANKS:
        r.attached(rank)
    a = r.commit(3)
    assert kinds(a) == [(6, "commit")] and not a.upstream
    a = r.report(6, report(3, pb.PLAN_PHASE_COMMITTED, step=12))
    assert up(a) == ["PLAN_PHASE_COMMITTED"]


def test_reports_that_fit_no_plan() -> None:
    r = relay()
    with pytest.raises(StateError) as info:
        r.report(4, report(9, pb.PLAN_PHASE_PREPARED))
    assert "plan v9 is not in flight" in str(info.value)
    assert not r.report(4, report(9, pb.PLAN_PHASE_COMMITTED)).upstream  # noted, not refused
    assert r.versions[4] == 9
    r.prepare(prepare())
    with pytest.raises(StateError):
        r.report(4, report(2, pb.PLAN_PHASE_COMMITTED))  # no commit was sent
    with pytest.raises(StateError) as info:
        r.report(4, report(2, pb.PLAN_PHASE_UNSPECIFIED))
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_new_prepare_supersedes_one_never_resolved() -> None:
    r = relay()
    r.prepare(prepare(2))
    a = r.prepare(prepare(3))
    assert kinds(a) == [
        (4, "abort"),
        (5, "abort"),
        (6, "abort"),
        (4, "prepare"),
        (5, "prepare"),
        (6, "prepare"),
    ]
    assert a.drop_reports == 2 and r.plan is not None and r.plan.version == 3


def test_a_rank_that_missed_the_prepare_gets_it_then_the_abort() -> None:
    """Found by the chaos campaign (a rank's link to the sidecar dropped as a plan went
    out): its peers ran the plan's p2p transfers with it and waited, until their gloo group
    timed out, for a rank that never heard of the plan. It now gets the Prepare when it is
    back, then the Abort."""
    r = relay(connected=(4, 5))
    a = r.prepare(prepare(7))
    assert kinds(a) == [(4, "prepare"), (5, "prepare")] and up(a) == ["PLAN_PHASE_FAILED"]
    r.abort(7, "rank 6 is not connected to the sidecar")
    assert kinds(r.attached(6)) == [(6, "prepare"), (6, "abort")]
    r.detached(6)
    assert kinds(r.attached(6)) == [
        (6, "prepare"),
        (6, "abort"),
    ]  # its transfers run once (the hook)
    r.report(6, report(7, pb.PLAN_PHASE_ABORTED))
    r.detached(6)
    assert kinds(r.attached(6)) == []  # it confirmed: nothing more to tell
    r.prepare(prepare(8))
    r.detached(6)
    assert [m.prepare.version for _, m in r.attached(6).to_ranks] == [8]  # only the current plan


def test_a_failure_after_the_commit_goes_up_once_with_the_placement_served() -> None:
    """Issue 20: a rank whose engine applied the plan in part (SGLang's updater lost a peer
    midway) reports FAILED after the Commit with what it serves; the sidecar dropped it,
    so the controller never learnt of the mixed placement."""
    r = relay()
    r.prepare(prepare())
    for rank in RANKS:
        r.report(rank, report(2, pb.PLAN_PHASE_PREPARED))
    r.commit(2)
    serving = pb.Placement(phy2log=pb.Array(dtype=pb.DTYPE_INT32, shape=[1, 2], data=b"\0" * 8))
    a = r.report(
        4, report(2, pb.PLAN_PHASE_FAILED, error="update lost a peer at layer 2", serving=serving)
    )
    assert up(a) == ["PLAN_PHASE_FAILED"]
    assert a.upstream[0].error == "rank 4: update lost a peer at layer 2"
    assert a.upstream[0].serving == serving
    assert not r.report(
        5, report(2, pb.PLAN_PHASE_FAILED, error="the same", serving=serving)
    ).upstream
