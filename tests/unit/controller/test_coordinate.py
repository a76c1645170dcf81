"""The plan state machine: all-or-nothing (invariant 5), harmless duplicates."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.controller import coordinate as c
from rebalancer.errors import StateError


def plan(num_ranks: int = 3, deadline: float = 10.0) -> c.Plan:
    return c.Plan(
        version=2,
        base_version=1,
        phy2log=np.zeros((1, 3), np.int64),
        transfers=np.zeros((0, 5), np.int32),
        num_ranks=num_ranks,
        trigger="policy",
        created=0.0,
        deadline=deadline,
        slots_moved=0,
        bytes_moved=0,
    )


def test_commit_is_sent_only_when_every_rank_prepared() -> None:
    p = plan()
    assert not c.on_prepared(p, 0, 1.0).send_commit
    assert c.on_prepared(p, 0, 1.0).duplicate
    assert not c.on_prepared(p, 1, 1.0).send_commit
    assert c.on_prepared(p, 2, 1.0).send_commit
    assert p.state is c.PlanState.COMMITTING


def test_one_failure_aborts_and_nothing_commits_after() -> None:
    p = plan()
    c.on_prepared(p, 0, 1.0)
    t = c.on_failed(p, 1, "out of memory")
    assert t.send_abort and t.finished and p.state is c.PlanState.ABORTED
    assert "rank 1" in p.reason and "out of memory" in p.reason
    with pytest.raises(StateError):
        c.on_prepared(p, 2, 1.0)
    with pytest.raises(StateError):
        c.on_committed(p, 0, 1.0)


def test_timeout_and_disconnect_abort_only_while_preparing() -> None:
    p = plan(deadline=5.0)
    assert not c.on_tick(p, 4.0).send_abort
    t = c.on_tick(p, 6.0)
    assert t.send_abort and "timeout" in p.reason and "[0, 1, 2]" in p.reason
    q = plan()
    for r in range(3):
        c.on_prepared(q, r, 1.0)
    assert not c.on_disconnect(q, 1).send_abort  # commit already sent: cannot abort
    assert c.on_disconnect(plan(), 1).send_abort


def test_commit_confirmations() -> None:
    p = plan(num_ranks=2)
    c.on_prepared(p, 0, 1.0)
    with pytest.raises(StateError):
        c.on_committed(p, 0, 1.0)  # no commit was sent yet
    c.on_prepared(p, 1, 1.0)
    first = c.on_committed(p, 1, 2.0)
    assert first.became_committed and not first.finished
    assert c.on_committed(p, 1, 2.0).duplicate
    assert c.on_committed(p, 0, 2.0).finished
    with pytest.raises(StateError):
        c.on_failed(p, 0, "late")  # a committed plan cannot be failed


def test_unconfirmed_commit_frees_the_slot_after_grace() -> None:
    p = plan(num_ranks=2, deadline=5.0)
    c.on_prepared(p, 0, 1.0)
    c.on_prepared(p, 1, 1.0)
    assert not c.on_tick(p, 5.0 + c.COMMIT_GRACE_SECONDS - 1).finished
    t = c.on_tick(p, 5.0 + c.COMMIT_GRACE_SECONDS + 1)
    assert t.finished and t.unconfirmed and not t.send_abort


def test_a_failure_after_the_commit_ends_the_plan_applied_in_part() -> None:
    """Issue 20: refused before (FAILED_PRECONDITION), so the controller never learnt that
    the ranks serve a mix; a rank that confirmed the switch still cannot fail it."""
    p = plan(num_ranks=3)
    for rank in range(3):
        c.on_prepared(p, rank, 1.0)
    c.on_committed(p, 0, 2.0)
    with pytest.raises(StateError, match="confirmed it committed"):
        c.on_failed(p, 0, "late")
    t = c.on_failed(p, 1, "update lost a peer at layer 2")
    assert t.partial and t.finished and not t.send_abort and p.state is c.PlanState.PARTIAL
    assert p.reason == "rank 1 failed after the commit: update lost a peer at layer 2"
    assert c.on_failed(p, 2, "the same").duplicate
