"""Group sessions (a pod's sidecar speaking for several ranks) against a real controller:
registration rules with precise statuses that change nothing, windows covering every rank
of the group, a group's reports standing for all its ranks, a group's disconnect aborting
a plan still preparing, and the newest aborted plan told again to a session that comes
back (what lets a restarted sidecar's ranks drop staging)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from tests.integration.test_worker_api import code_of, snapshot

L, E, P, G = 2, 4, 8, 4
SHAPE = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=P,
    num_gpus=G,
    num_nodes=1,
    expert_bytes=1000,
)


def register(
    stub: pb_grpc.WorkerServiceStub,
    ranks: tuple[int, ...] = (),
    rank: int = 0,
    pod: str = "",
    version: int = 0,
) -> pb.RegisterResponse:
    return stub.Register(
        pb.RegisterRequest(
            deployment="dep",
            rank=rank,
            ranks=ranks,
            pod=pod,
            shape=SHAPE,
            placement_version=version,
        ),
        timeout=5,
    )


def window(seq: int, hot: int = 0, tokens: int = 100) -> pb.WorkerMessage:
    counts = np.ones((L, E), np.int64)
    counts[:, hot] += tokens
    return pb.WorkerMessage(
        window=pb.Window(seq=seq, num_steps=4, logical_count=codec.encode(counts))
    )


class Link:
    """One session's stream, read on a thread: `send` messages, `expect` what comes down."""

    def __init__(self, stub: pb_grpc.WorkerServiceStub, session_id: str) -> None:
        self._out: queue.Queue[pb.WorkerMessage | None] = queue.Queue()
        self.inbox: queue.Queue[pb.ControllerMessage] = queue.Queue()
        self.error: grpc.RpcError | None = None

        def requests() -> Iterator[pb.WorkerMessage]:
            yield pb.WorkerMessage(hello=pb.Hello(session_id=session_id))
            while (msg := self._out.get()) is not None:
                yield msg

        self.call = stub.Stream(requests())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put(msg)
        except grpc.RpcError as exc:
            self.error = exc

    def send(self, *messages: pb.WorkerMessage) -> None:
        for m in messages:
            self._out.put(m)

    def plan_messages(self, seconds: float = 1.0) -> list[tuple[str, int]]:
        """Plan phases received within `seconds` (acks and planned losses skipped), as
        (kind, version)."""
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                break
            kind = str(msg.WhichOneof("body"))
            if kind not in (
                "window_ack",
                "planned_loss",
            ):  # survivor placements: test_contingency_told.py
                out.append((kind, getattr(msg, kind).version))
        return out

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(5)

    def cancel(self) -> None:
        self.call.cancel()
        self._out.put(None)  # gRPC's thread reading `requests` waits on the queue: end it
        self._thread.join(5)


def on_loop(controller: EmbeddedController, fn: Callable[[Any], Any]) -> Any:
    return controller.call(lambda: fn(controller.server.controller))  # type: ignore[union-attr]


def wait_for(predicate: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def two_pods(
    controller: EmbeddedController, stub: pb_grpc.WorkerServiceStub
) -> tuple[dict[str, str], dict[str, Link]]:
    """Pods a (ranks 0-1) and b (ranks 2-3), streaming, a window of seq 0 each, paused."""
    ids = {
        "a": register(stub, (0, 1), pod="ns/a").session_id,
        "b": register(stub, (2, 3), pod="ns/b").session_id,
    }
    on_loop(controller, lambda c: c.set_paused("dep", True))  # plans only when the test forces one
    links = {pod: Link(stub, sid) for pod, sid in ids.items()}
    for link in links.values():
        link.send(window(0))
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].estimator.windows) == 1,
        "a folded window",
    )
    return ids, links


def report(stub: pb_grpc.WorkerServiceStub, session: str, version: int, phase: int) -> None:
    stub.ReportPlan(pb.PlanReport(session_id=session, version=version, phase=phase), timeout=5)


def test_group_windows_cover_their_ranks_with_single_ranks_beside(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    singles = [register(worker_stub, rank=r).session_id for r in (0, 1)]
    group = register(worker_stub, (2, 3), pod="ns/b")
    assert group.next_window_seq == 0 and group.committed.version == 0
    links = [Link(worker_stub, s) for s in (*singles, group.session_id)]
    links[0].send(window(0))
    links[1].send(window(0))
    time.sleep(0.3)
    assert (
        on_loop(controller, lambda c: c.deployments["dep"].estimator.windows) == 0
    )  # ranks 2, 3 missing
    links[2].send(window(0))  # the group's window covers ranks 2 and 3: complete
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].estimator.windows) == 1,
        "the fold",
    )
    dep = on_loop(controller, lambda c: c.deployments["dep"])
    assert dict(dep.next_seq) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert dep.connected_ranks == 4 and len(dep.live_sessions()) == 3
    assert dep.stats.tokens_folded == 3 * int(np.ones((L, E)).sum() + L * 100)
    for link in links:
        link.close()
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks) == 0, "detach"
    )
    again = register(worker_stub, (2, 3), pod="ns/b")
    assert again.next_window_seq == 1  # the group resumes after what was counted


@pytest.mark.parametrize(
    "ranks, rank, code, words",
    [
        ((1, 1), 0, grpc.StatusCode.INVALID_ARGUMENT, "rank 1 more than once"),
        ((2, 4), 0, grpc.StatusCode.INVALID_ARGUMENT, "rank 4 out of range"),
        ((1, 2), 0, grpc.StatusCode.ALREADY_EXISTS, "rank 1 of 'dep' is already registered"),
        ((), 0, grpc.StatusCode.ALREADY_EXISTS, "ns/a"),  # a single rank of the live group
    ],
)
def test_group_registration_refusals_change_nothing(
    controller: EmbeddedController,
    worker_stub: pb_grpc.WorkerServiceStub,
    ranks: tuple[int, ...],
    rank: int,
    code: grpc.StatusCode,
    words: str,
) -> None:
    held = register(worker_stub, (0, 1), pod="ns/a")
    link = Link(worker_stub, held.session_id)
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks) == 2,
        "the stream",
    )
    before = snapshot(controller)
    sessions = on_loop(controller, lambda c: dict(c.deployments["dep"].sessions))
    got, details = code_of(register, worker_stub, ranks, rank)
    assert got == code and words in details, details
    assert snapshot(controller) == before
    assert on_loop(controller, lambda c: dict(c.deployments["dep"].sessions)) == sessions
    link.close()


def test_a_groups_reports_stand_for_all_its_ranks(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    ids, links = two_pods(controller, worker_stub)
    on_loop(controller, lambda c: c.force("dep"))
    assert links["a"].plan_messages() == [("prepare", 1)]  # once per group, not per rank
    assert links["b"].plan_messages() == [("prepare", 1)]
    report(worker_stub, ids["a"], 1, pb.PLAN_PHASE_PREPARED)
    assert on_loop(controller, lambda c: set(c.deployments["dep"].plan.prepared)) == {0, 1}
    report(worker_stub, ids["a"], 1, pb.PLAN_PHASE_PREPARED)  # again: a duplicate, harmless
    assert links["a"].plan_messages(0.3) == []
    report(worker_stub, ids["b"], 1, pb.PLAN_PHASE_PREPARED)
    assert links["a"].plan_messages() == [("commit", 1)] and links["b"].plan_messages() == [
        ("commit", 1)
    ]
    report(worker_stub, ids["a"], 1, pb.PLAN_PHASE_COMMITTED)
    assert on_loop(controller, lambda c: c.deployments["dep"].version) == 1  # stored at the first
    report(worker_stub, ids["b"], 1, pb.PLAN_PHASE_COMMITTED)
    assert on_loop(controller, lambda c: c.deployments["dep"].plan) is None
    for link in links.values():
        link.close()


def test_a_group_leaving_while_preparing_aborts_and_hears_the_abort_when_back(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    ids, links = two_pods(controller, worker_stub)
    on_loop(controller, lambda c: c.force("dep"))
    report(worker_stub, ids["b"], 1, pb.PLAN_PHASE_PREPARED)
    links["a"].cancel()  # the sidecar of pod a dies
    assert links["b"].plan_messages(2.0) == [("prepare", 1), ("abort", 1)]
    plans = on_loop(controller, lambda c: c.store.plans("dep"))
    assert (
        plans[0].state == "aborted"
        and "ranks 0-1 (pod ns/a) disconnected while preparing" in plans[0].reason
    )
    # A restarted sidecar registers the group again: told the aborted plan first thing.
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks) == 2,
        "the detach",
    )
    back = register(worker_stub, (0, 1), pod="ns/a")
    link = Link(worker_stub, back.session_id)
    assert link.plan_messages() == [("abort", 1)]
    report(worker_stub, back.session_id, 1, pb.PLAN_PHASE_ABORTED)  # confirmations are accepted
    got, details = code_of(report, worker_stub, back.session_id, 1, pb.PLAN_PHASE_PREPARED)
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "not in flight" in details
    # A direct rank coming back is told too; once a later plan commits, nobody is.
    links["b"].close()
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks) == 2, "b leaves"
    )
    single = Link(worker_stub, register(worker_stub, rank=2).session_id)
    assert single.plan_messages() == [("abort", 1)]
    single.close()
    link.close()


def test_a_group_failing_names_its_pod(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    ids, links = two_pods(controller, worker_stub)
    on_loop(controller, lambda c: c.force("dep"))
    worker_stub.ReportPlan(
        pb.PlanReport(
            session_id=ids["b"], version=1, phase=pb.PLAN_PHASE_FAILED, error="rank 3: injected"
        ),
        timeout=5,
    )
    assert links["a"].plan_messages() == [("prepare", 1), ("abort", 1)]
    (plan, *_) = on_loop(controller, lambda c: c.store.plans("dep"))
    assert plan.reason == "ranks 2-3 (pod ns/b) failed to prepare: rank 3: injected"
    for link in links.values():
        link.close()


def test_a_group_serving_another_version_is_reconciled_like_a_rank(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    link = Link(worker_stub, register(worker_stub, (0, 1), pod="ns/a").session_id)
    wait_for(
        lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks) == 2,
        "the stream",
    )
    before = snapshot(controller)
    got, details = code_of(register, worker_stub, (2, 3), 0, "ns/b", 5)
    assert got == grpc.StatusCode.FAILED_PRECONDITION
    assert "ranks 2-3 (pod ns/b) of 'dep' serves placement v5, the deployment is at v0" in details
    assert snapshot(controller) == before
    link.close()


def presence(stub: pb_grpc.WorkerServiceStub, session: str, connected: list[int]) -> None:
    stub.ReportRanks(pb.RankPresence(session_id=session, connected_ranks=connected), timeout=5)


def test_a_groups_absent_ranks_are_not_connected_and_no_plan_starts(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    """ReportRanks: the ranks a sidecar reports without a stream to it count as gone
    (metrics, status, plans) although its group stream is open; refusals change nothing."""
    ids, links = two_pods(controller, worker_stub)
    connected = lambda: on_loop(controller, lambda c: c.deployments["dep"].connected_ranks)  # noqa: E731
    assert connected() == 4
    presence(worker_stub, ids["a"], [1])  # rank 0's engine exited
    assert connected() == 3
    decision, plan = on_loop(controller, lambda c: c.force("dep"))
    assert plan is None and decision.outcome == "skip_ranks"
    assert decision.reason == "only 3 of 4 ranks connected (missing: rank 0)"
    presence(worker_stub, ids["b"], [])
    assert connected() == 1
    _, plan = on_loop(controller, lambda c: c.force("dep"))
    assert plan is None and on_loop(controller, lambda c: c.deployments["dep"].missing_ranks()) == [
        0,
        2,
        3,
    ]
    before = snapshot(controller)
    for session, ranks, code, says in (
        (
            ids["a"],
            [0, 2],
            grpc.StatusCode.INVALID_ARGUMENT,
            "rank 2 is not one of the session's ranks 0-1 (pod ns/a)",
        ),
        (
            ids["a"],
            [1, 1],
            grpc.StatusCode.INVALID_ARGUMENT,
            "connected_ranks name rank 1 more than once",
        ),
        ("nope", [0], grpc.StatusCode.NOT_FOUND, "unknown session 'nope'"),
    ):
        got, details = code_of(presence, worker_stub, session, ranks)
        assert (got, details) == (
            code,
            says + (": register first" if got == grpc.StatusCode.NOT_FOUND else ""),
        )
    assert snapshot(controller) == before and connected() == 1
    presence(worker_stub, ids["a"], [0, 1])
    presence(worker_stub, ids["b"], [2, 3])
    assert connected() == 4
    _, plan = on_loop(controller, lambda c: c.force("dep"))
    assert plan is not None  # every rank back: the plan starts
    for link in links.values():
        link.cancel()
