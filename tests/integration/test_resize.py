"""A deployment's EP group resized by an elastic engine (vLLM's elastic EP scale-down):
the controller takes the new world (rebalancer/controller/resize.py, proto
RegisterRequest.resized_from) on a real server on loopback and a real SQLite store, and refuses
every resize that does not follow from what it holds, changing nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import client_options
from tests.integration.conftest import start_controller
from tests.integration.test_worker_api import code_of, stream, window

L, E = 2, 4
OLD = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=8,
    num_gpus=4,
    num_nodes=1,
    expert_bytes=1000,
)
NEW = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=6,
    num_gpus=3,
    num_nodes=1,
    expert_bytes=1000,
)
SURVIVORS = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3]], dtype=np.int32)


def _register(
    stub: pb_grpc.WorkerServiceStub, rank: int, shape: pb.ModelShape = OLD, **kw: object
) -> pb.RegisterResponse:
    return stub.Register(
        pb.RegisterRequest(deployment="dep", rank=rank, shape=shape, worker_id=f"w{rank}", **kw),
        timeout=5,
    )  # type: ignore[arg-type]


def _resized(
    stub: pb_grpc.WorkerServiceStub,
    rank: int,
    phy2log: np.ndarray = SURVIVORS,
    version: int = 0,
    num_gpus: int = 4,
    shape: pb.ModelShape = NEW,
) -> pb.RegisterResponse:
    return _register(
        stub,
        rank,
        shape,
        resized_from=pb.Resize(version=version, num_gpus=num_gpus),
        initial_placement=pb.Placement(phy2log=codec.encode(phy2log.astype(np.int32))),
    )


def _state(ctl: EmbeddedController) -> tuple:
    def read() -> tuple:
        c = ctl.server.controller  # type: ignore[union-attr]
        dep = c.deployments["dep"]
        return (
            dep.shape.num_gpus,
            dep.shape.num_slots,
            dep.version,
            dep.phy2log.tolist(),
            [(p.version, p.state, p.trigger) for p in c.store.plans("dep")],
            sorted(dep.sessions),
        )

    return ctl.call(read)  # type: ignore[return-value]


@pytest.fixture
def ctl(tmp_path: Path):  # noqa: ANN201
    controller = start_controller(tmp_path / "c.sqlite")
    yield controller
    controller.stop()


@pytest.fixture
def stub(ctl: EmbeddedController):  # noqa: ANN201
    assert ctl.server is not None
    with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
        yield pb_grpc.WorkerServiceStub(channel)


def test_the_first_resized_rank_resizes_the_deployment_and_its_peers_join_at_that_version(
    ctl: EmbeddedController, stub: pb_grpc.WorkerServiceStub, tmp_path: Path
) -> None:
    old_sessions = [_register(stub, r).session_id for r in range(4)]
    first = _resized(stub, 0)
    assert first.committed.version == 1
    assert np.array_equal(codec.decode(first.committed.phy2log, "committed"), SURVIVORS)
    assert first.next_window_seq == 0  # the new world's windows start afresh
    gpus, slots, version, phy2log, plans, ranks = _state(ctl)
    assert (gpus, slots, version) == (3, 6, 1) and np.array_equal(phy2log, SURVIVORS)
    assert plans == [(1, "committed", "resize")]
    assert ranks == [0]  # the old world's sessions ended
    for r in (1, 2):
        peer = _resized(stub, r)
        assert peer.committed.version == 1
    assert _state(ctl)[4] == [(1, "committed", "resize")]  # taken once
    # The old world's rank 3 and its sessions: refused, nothing changed.
    code, details = code_of(_register, stub, 3)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "registered with shape" in details
    code, details = code_of(stream, stub, old_sessions[3], window(0))
    assert code == grpc.StatusCode.NOT_FOUND
    ctl.stop()
    again = start_controller(tmp_path / "c.sqlite")  # what the store kept
    try:

        def read() -> tuple:
            dep = again.server.controller.deployments["dep"]  # type: ignore[union-attr]
            return dep.shape.num_gpus, dep.version, dep.phy2log.tolist()

        gpus, version, phy2log = again.call(read)  # type: ignore[misc]
        assert (gpus, version) == (3, 1) and np.array_equal(phy2log, SURVIVORS)
    finally:
        again.stop()


def test_the_new_worlds_windows_are_counted(
    ctl: EmbeddedController, stub: pb_grpc.WorkerServiceStub
) -> None:
    for r in range(4):
        _register(stub, r)
    sessions = [_resized(stub, r).session_id for r in range(3)]
    for session in sessions:
        acks = stream(stub, session, window(0, serving_version=1))
        assert acks[-1].window_ack.seq == 0

    def read() -> tuple:
        dep = ctl.server.controller.deployments["dep"]  # type: ignore[union-attr]
        return dep.stats.windows_ingested, dep.estimator.windows

    ingested, folded = ctl.call(read)  # type: ignore[misc]
    assert (
        ingested == 3 and folded == 1
    )  # one window of every rank of the new world: one complete window


@pytest.mark.parametrize(
    "kw, code, words",
    [
        (
            dict(version=7),
            grpc.StatusCode.FAILED_PRECONDITION,
            "resized from v7 on 4 GPUs; the deployment is at v0",
        ),
        (
            dict(num_gpus=8),
            grpc.StatusCode.FAILED_PRECONDITION,
            "the deployment is at v0 on 4 GPUs",
        ),
        (
            dict(
                shape=pb.ModelShape(
                    num_layers=L,
                    num_logical_experts=E,
                    num_physical_slots=6,
                    num_gpus=3,
                    num_nodes=1,
                    expert_bytes=2000,
                )
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "a resize changes only",
        ),
        (
            dict(phy2log=np.zeros((L, 6), np.int32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "has no replica of expert",
        ),
    ],
)
def test_a_resize_that_does_not_follow_from_the_deployment_is_refused_and_changes_nothing(
    ctl: EmbeddedController,
    stub: pb_grpc.WorkerServiceStub,
    kw: dict,
    code: grpc.StatusCode,
    words: str,
) -> None:
    for r in range(4):
        _register(stub, r)
    before = _state(ctl)
    got, details = code_of(_resized, stub, 0, **kw)
    assert got == code and words in details, details
    assert _state(ctl) == before


def test_a_resized_registration_without_its_placement_is_refused(
    ctl: EmbeddedController, stub: pb_grpc.WorkerServiceStub
) -> None:
    _register(stub, 0)
    before = _state(ctl)
    code, details = code_of(_register, stub, 0, NEW, resized_from=pb.Resize(version=0, num_gpus=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "initial_placement" in details
    assert _state(ctl) == before


def test_a_peer_serving_another_placement_than_the_resize_taken_is_refused(
    ctl: EmbeddedController, stub: pb_grpc.WorkerServiceStub
) -> None:
    _register(stub, 0)
    _resized(stub, 0)
    other = SURVIVORS[:, ::-1].copy()
    code, details = code_of(_resized, stub, 1, other)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "another placement" in details


def test_a_resize_while_a_decision_is_under_way_is_asked_again(
    ctl: EmbeddedController, stub: pb_grpc.WorkerServiceStub
) -> None:
    _register(stub, 0)
    dep = ctl.call(lambda: ctl.server.controller.deployments["dep"])  # type: ignore[union-attr]
    ctl.call(lambda: dep.decide(0.0))
    before = _state(ctl)
    code, details = code_of(_resized, stub, 0)
    assert code == grpc.StatusCode.UNAVAILABLE and "a decision is under way" in details
    assert _state(ctl) == before
    ctl.call(lambda: dep.decided(None, 0.0))
    assert _resized(stub, 0).committed.version == 1


def test_a_peer_of_a_resize_registering_after_a_controller_restart_joins(tmp_path: Path) -> None:
    """The resize is in the store: a peer that registers only after the controller
    restarted still joins at the resize's version (its plan row, trigger "resize")."""
    ctl = start_controller(tmp_path / "c.sqlite")
    try:
        assert ctl.server is not None
        with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            _register(stub, 0)
            assert _resized(stub, 0).committed.version == 1
    finally:
        ctl.stop()
    again = start_controller(tmp_path / "c.sqlite")
    try:
        assert again.server is not None
        with grpc.insecure_channel(again.server.address, options=client_options()) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            assert _resized(stub, 1).committed.version == 1
            code, details = code_of(_resized, stub, 2, version=1)  # a resize from v1: none was
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "is at v1 on 3 GPUs" in details
        assert [
            (p.version, p.trigger)
            for p in again.call(lambda: again.server.controller.store.plans("dep"))
        ] == [(1, "resize")]  # type: ignore[union-attr]
    finally:
        again.stop()
