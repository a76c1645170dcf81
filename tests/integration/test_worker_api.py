"""WorkerService against a real server on loopback: every kind of bad input gets a
precise status and leaves the controller's state as it was (invariant 6)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec

L, E, P, G = 2, 4, 6, 2
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
    rank: int,
    name: str = "dep",
    shape: pb.ModelShape = SHAPE,
    **kw: object,
) -> pb.RegisterResponse:
    return stub.Register(
        pb.RegisterRequest(deployment=name, rank=rank, shape=shape, **kw), timeout=5
    )  # type: ignore[arg-type]


def window(seq: int, counts: np.ndarray | None = None, **kw: object) -> pb.WorkerMessage:
    counts = np.ones((L, E), dtype=np.int64) if counts is None else counts
    return pb.WorkerMessage(
        window=pb.Window(seq=seq, num_steps=1, logical_count=codec.encode(counts), **kw)
    )  # type: ignore[arg-type]


def stream(
    stub: pb_grpc.WorkerServiceStub, session: str, *messages: pb.WorkerMessage
) -> list[pb.ControllerMessage]:
    def requests() -> Iterator[pb.WorkerMessage]:
        yield pb.WorkerMessage(hello=pb.Hello(session_id=session))
        yield from messages

    return list(stub.Stream(requests(), timeout=10))


def code_of(fn: object, *args: object, **kw: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)  # type: ignore[operator]
    return info.value.code(), info.value.details()


def snapshot(controller: EmbeddedController) -> tuple:
    def read() -> tuple:
        c = controller.server.controller  # type: ignore[union-attr]
        deps = tuple(
            sorted(
                (
                    d.name,
                    d.version,
                    d.stats.windows_ingested,
                    d.estimator.windows,
                    tuple(sorted(d.next_seq.items())),
                    d.plan.version if d.plan else 0,
                )
                for d in c.deployments.values()
            )
        )
        return deps, len(c.store.plans("dep")), len(c.store.decisions("dep"))

    return controller.call(read)  # type: ignore[return-value]


def test_good_windows_are_acked_and_counted_once(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    session = register(worker_stub, 0).session_id
    acks = stream(worker_stub, session, window(0), window(1), window(1))
    # Cumulative, paced acks: the first at once, the rest by the end of the stream.
    assert acks[0].window_ack.seq == 0 and acks[-1].window_ack.seq == 1
    assert all(m.window_ack.held_seconds >= 0 for m in acks)
    deps, _, _ = snapshot(controller)
    assert deps[0][2] == 2  # the replayed seq 1 was not counted again
    again = register(worker_stub, 0)
    assert again.next_window_seq == 2  # a reconnecting rank resumes after what was counted


@pytest.mark.parametrize(
    "request_kw, code, words",
    [
        (dict(name="bad name!"), grpc.StatusCode.INVALID_ARGUMENT, "deployment name"),
        (
            dict(
                shape=pb.ModelShape(
                    num_layers=L,
                    num_logical_experts=E,
                    num_physical_slots=5,
                    num_gpus=G,
                    num_nodes=1,
                )
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "slots",
        ),
        (dict(rank=2), grpc.StatusCode.INVALID_ARGUMENT, "rank 2 out of range"),
        (
            dict(
                initial_placement=pb.Placement(phy2log=codec.encode(np.zeros((L, P + 1), np.int32)))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "shape",
        ),
        (
            dict(initial_placement=pb.Placement(phy2log=codec.encode(np.zeros((L, P), np.int32)))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "has no replica of expert",
        ),
    ],
)
def test_register_refuses_bad_requests(
    controller: EmbeddedController,
    worker_stub: pb_grpc.WorkerServiceStub,
    request_kw: dict,
    code: grpc.StatusCode,
    words: str,
) -> None:
    before = snapshot(controller)
    kw = dict(request_kw)
    got, details = code_of(
        register,
        worker_stub,
        kw.pop("rank", 0),
        kw.pop("name", "dep"),
        kw.pop("shape", SHAPE),
        **kw,
    )
    assert got == code and words in details
    assert snapshot(controller) == before


def test_register_twice_and_shape_conflict(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    register(worker_stub, 0)
    before = snapshot(controller)
    got, details = code_of(register, worker_stub, 0)
    assert got == grpc.StatusCode.ALREADY_EXISTS and "already registered" in details
    other = pb.ModelShape(
        num_layers=L, num_logical_experts=E, num_physical_slots=8, num_gpus=G, num_nodes=1
    )
    got, details = code_of(register, worker_stub, 1, "dep", other)
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "shape" in details
    assert snapshot(controller) == before


def _bad_windows() -> list[tuple[pb.WorkerMessage, grpc.StatusCode, str]]:
    neg = np.ones((L, E), np.int64)
    neg[1, 2] = -5
    nan = np.ones((L, E), np.float32)
    nan[0, 0] = np.nan
    unspecified = pb.WorkerMessage(
        window=pb.Window(
            seq=0,
            logical_count=pb.Array(
                dtype=pb.DTYPE_UNSPECIFIED, shape=[L, E], data=b"\0" * 8 * L * E
            ),
        )
    )
    short = pb.WorkerMessage(
        window=pb.Window(
            seq=0, logical_count=pb.Array(dtype=pb.DTYPE_INT64, shape=[L, E], data=b"\0" * 7)
        )
    )
    return [
        (window(0, np.ones((L, E + 1), np.int64)), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (
            window(
                0,
                np.ones((L, E), np.int64),
                physical_count=codec.encode(np.ones((L, P - 1), np.int64)),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "physical_count",
        ),
        (unspecified, grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        (short, grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
        (window(0, neg), grpc.StatusCode.INVALID_ARGUMENT, "negative"),
        (window(0, nan), grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
        (window(5), grpc.StatusCode.FAILED_PRECONDITION, "expected 1"),
        (
            pb.WorkerMessage(hello=pb.Hello(session_id="x")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "only windows",
        ),
    ]


@pytest.mark.parametrize("case", range(len(_bad_windows())))
def test_bad_windows_are_refused_without_change(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub, case: int
) -> None:
    message, code, words = _bad_windows()[case]
    session = register(worker_stub, 0).session_id
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        stream(worker_stub, session, window(0))  # seq 0 counted, so 5 is a gap
        session = register(worker_stub, 0).session_id
    before = snapshot(controller)
    got, details = code_of(stream, worker_stub, session, message)
    assert got == code and words in details, details
    assert snapshot(controller) == before


def test_oversized_window_is_refused_by_the_server(controller: EmbeddedController) -> None:
    # A client that allows itself 64 MiB, so the refusal is the server's limit.
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    with grpc.insecure_channel(controller.server.address, options=options) as channel:  # type: ignore[union-attr]
        stub = pb_grpc.WorkerServiceStub(channel)
        session = register(stub, 0).session_id
        before = snapshot(controller)
        huge = pb.WorkerMessage(
            window=pb.Window(
                seq=0,
                logical_count=pb.Array(dtype=pb.DTYPE_INT64, shape=[L, E], data=b"\0" * (17 << 20)),
            )
        )
        got, details = code_of(stream, stub, session, huge)
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert snapshot(controller) == before


def test_unknown_session(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    got, details = code_of(stream, worker_stub, "no-such-session")
    assert got == grpc.StatusCode.NOT_FOUND and "register first" in details
    got, _ = code_of(
        worker_stub.ReportPlan,
        pb.PlanReport(session_id="nope", version=1, phase=pb.PLAN_PHASE_PREPARED),
        timeout=5,
    )
    assert got == grpc.StatusCode.NOT_FOUND


def test_plan_reports_for_unknown_or_old_versions(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    session = register(worker_stub, 0).session_id
    before = snapshot(controller)
    report = worker_stub.ReportPlan
    got, details = code_of(
        report,
        pb.PlanReport(session_id=session, version=7, phase=pb.PLAN_PHASE_PREPARED),
        timeout=5,
    )
    assert got == grpc.StatusCode.NOT_FOUND and "unknown" in details
    controller.call(lambda: setattr(controller.server.controller.deployments["dep"], "version", 3))  # type: ignore[union-attr]
    got, details = code_of(
        report,
        pb.PlanReport(session_id=session, version=2, phase=pb.PLAN_PHASE_COMMITTED),
        timeout=5,
    )
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "not in flight" in details
    got, details = code_of(
        report,
        pb.PlanReport(session_id=session, version=3, phase=pb.PLAN_PHASE_UNSPECIFIED),
        timeout=5,
    )
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    controller.call(lambda: setattr(controller.server.controller.deployments["dep"], "version", 0))  # type: ignore[union-attr]
    assert snapshot(controller) == before


def test_health_and_reflection(controller: EmbeddedController) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(controller.server.address) as channel:  # type: ignore[union-attr]
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rebalancer.v1.WorkerService", "rebalancer.v1.AdminService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {
            "rebalancer.v1.WorkerService",
            "rebalancer.v1.AdminService",
            "grpc.health.v1.Health",
        } <= names


def test_deployments_are_independent(
    controller: EmbeddedController, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    other = pb.ModelShape(
        num_layers=3, num_logical_experts=8, num_physical_slots=12, num_gpus=4, num_nodes=2
    )
    a = register(worker_stub, 0, "dep-a").session_id
    b = register(worker_stub, 3, "dep-b", other).session_id
    stream(worker_stub, a, window(0), window(1))
    stream(
        worker_stub,
        b,
        pb.WorkerMessage(
            window=pb.Window(seq=0, logical_count=codec.encode(np.ones((3, 8), np.uint32)))
        ),
    )

    def read() -> dict:
        deps = controller.server.controller.deployments  # type: ignore[union-attr]
        return {
            n: (d.shape.num_gpus, d.stats.windows_ingested, d.estimator.windows)
            for n, d in deps.items()
        }

    state = controller.call(read)
    assert state == {"dep-a": (G, 2, 0), "dep-b": (4, 1, 0)}  # nothing folds until every rank sent
    # A session speaks only for its own deployment: dep-b's shape is refused on dep-a's session.
    got, details = code_of(
        stream,
        worker_stub,
        register(worker_stub, 1, "dep-a").session_id,
        pb.WorkerMessage(
            window=pb.Window(seq=0, logical_count=codec.encode(np.ones((3, 8), np.uint32)))
        ),
    )
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "shape" in details
    assert controller.call(read) == state
