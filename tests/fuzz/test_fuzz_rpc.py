"""Fuzz every RPC of the WorkerService and the AdminService against a real controller on
loopback (invariant 6, ARCHITECTURE.md): random and mutated messages (wrong shapes and dtypes,
huge sizes, negative and NaN values, unknown enum values, out-of-order sequence numbers,
unknown deployments and sessions, stale versions). Each call is OK on valid input, or
refused with a status among REFUSALS and a message, never UNKNOWN / INTERNAL; after a
refusal, what the AdminService reports (Status, placement, policy, history) is unchanged.

One controller for the module, policy paused so nothing changes in the background
between two snapshots (no decision runs unless forced).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import MAX_MESSAGE_BYTES, client_options
from rebalancer.wire.layout import (
    MAX_EXPERT_BYTES,
    MAX_LAYER_SLOTS,
    MAX_LAYERS,
    MAX_SLOTS,
    MAX_SLOTS_PER_GPU,
)
from tests.fuzz.cli_helpers import check_run
from tests.fuzz.rpc_helpers import (
    NAME_RE,
    OK,
    SHAPE,
    TIMEOUT,
    U32,
    U64,
    E,
    G,
    L,
    P,
    arrays,
    assert_refusal,
    call,
    consume_sessions,
    describe_change,
    doubles,
    hello,
    mostly,
    names,
    settled_snapshot,
    snapshot,
    stream,
    u32,
    u64,
    valid_counts,
    window,
)
from tests.integration.conftest import start_controller

DEP = "dep"
HAS_GROUPS = "ranks" in pb.RegisterRequest.DESCRIPTOR.fields_by_name
# Plan and placement versions: any uint64; above 2**63 - 1 (what the store holds) they are
# refused with INVALID_ARGUMENT (test_versions_beyond_int64_are_refused).
versions = st.one_of(
    st.integers(0, 8), st.sampled_from([2**63 - 1, 2**63, U64, 2**32]), st.integers(0, U64)
)
# RPC examples cost a few round trips each: fewer than the profile's default.
rpc_settings = settings(max_examples=max(10, settings.default.max_examples * 2 // 3))


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedController]:
    ctl = start_controller(
        tmp_path_factory.mktemp("fuzz_rpc") / "controller.sqlite", policy=PolicyConfig(paused=True)
    )
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture(scope="module")
def channel(controller: EmbeddedController) -> Iterator[grpc.Channel]:
    assert controller.server is not None
    with grpc.insecure_channel(controller.server.address, options=client_options()) as ch:
        yield ch


@pytest.fixture(scope="module")
def worker(channel: grpc.Channel) -> pb_grpc.WorkerServiceStub:
    return pb_grpc.WorkerServiceStub(channel)


@pytest.fixture(scope="module")
def admin(channel: grpc.Channel) -> pb_grpc.AdminServiceStub:
    return pb_grpc.AdminServiceStub(channel)


def register(
    worker: pb_grpc.WorkerServiceStub, rank: int, name: str = DEP, **kw: Any
) -> pb.RegisterResponse:
    """A fresh session of `rank`; retried while the last stream of that rank is being
    detached (its status reaches the client just before the server detaches it)."""
    deadline = time.monotonic() + 2.0
    while True:
        code, details, reply = call(
            worker.Register, pb.RegisterRequest(deployment=name, rank=rank, shape=SHAPE, **kw)
        )
        if code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert code == OK, details
    return reply


@pytest.fixture(scope="module", autouse=True)
def seeded(worker: pb_grpc.WorkerServiceStub, admin: pb_grpc.AdminServiceStub) -> None:
    """DEP with windows from both ranks, so forced rebalances have an estimate."""
    rng = np.random.default_rng(0)
    for rank in range(G):
        reply = register(worker, rank)
        msgs = [hello(reply.session_id)] + [
            window(s, rng.integers(0, 50, (L, E))) for s in range(3)
        ]
        code, details, _ = stream(worker, msgs)
        assert code == OK, details
    status = admin.Status(pb.StatusRequest(deployment=DEP), timeout=10).deployments[0]
    assert 3 <= status.windows_folded < 3 * G and status.paused  # folded windows, not per rank
    assert status.windows_ingested == 3 * G  # received: one per rank's window


def refused_changes_nothing(
    admin: pb_grpc.AdminServiceStub,
    before: list[bytes],
    code: grpc.StatusCode,
    details: str,
    what: object,
    names: tuple[str, ...] = (DEP,),
) -> None:
    if currently_in_test_context():
        event(f"{code.name}: {details[:50]}")
    if code == OK:
        return
    assert_refusal(code, details, what)
    after = settled_snapshot(admin, before, names)
    assert after == before, (
        f"state changed by a refused call: {what}\n{describe_change(before, after)}"
    )


# ------------------------------------------------------------------ Register


def shape_valid(s: pb.ModelShape) -> bool:
    n = s.num_nodes or 1
    if not (s.num_layers > 0 and s.num_logical_experts > 0 and s.num_gpus > 0):
        return False
    if (
        s.num_physical_slots < s.num_logical_experts
        or s.num_physical_slots % s.num_gpus
        or s.num_gpus % n
    ):
        return False
    return not s.num_groups or s.num_logical_experts % s.num_groups == 0


@st.composite
def shapes(draw: st.DrawFn) -> pb.ModelShape:
    how = draw(st.sampled_from(["same", "same", "same", "one-field", "one-field", "random"]))
    if how != "random":
        shape = pb.ModelShape()
        shape.CopyFrom(SHAPE)
        if how == "one-field":
            field = draw(st.sampled_from([f.name for f in pb.ModelShape.DESCRIPTOR.fields]))
            setattr(shape, field, draw(u64 if field == "expert_bytes" else u32))
    else:
        shape = pb.ModelShape(
            **{f.name: draw(st.integers(0, 9)) for f in pb.ModelShape.DESCRIPTOR.fields}
        )
    if (
        shape_valid(shape)
        and max(shape.num_layers, shape.num_logical_experts, shape.num_physical_slots) > 16
    ):
        # Shapes beyond the limits are refused before anything is allocated
        # (test_register_huge_shape_is_refused, in a child process under a memory limit,
        # and test_shape_limits); kept small here all the same, so that a regression
        # fails those tests rather than making this one allocate gigabytes.
        layers = min(shape.num_layers, 16)
        shape.CopyFrom(SHAPE)
        shape.num_layers = layers
    return shape


@st.composite
def register_requests(draw: st.DrawFn) -> pb.RegisterRequest:
    req = pb.RegisterRequest(
        deployment=draw(mostly(st.sampled_from([DEP, "r0", "r1", "r2"]), names)),
        rank=draw(mostly(st.integers(0, G - 1), u32)),
        shape=draw(shapes()),
        placement_version=draw(mostly(st.just(0), versions)),
        worker_id=draw(st.text(max_size=10)),
    )
    shape = (req.shape.num_layers, req.shape.num_physical_slots)
    if draw(st.integers(0, 3)) == 0 and max(shape) <= 16:
        if (
            draw(st.booleans())
            and req.shape.num_logical_experts
            and shape[0]
            and shape[1] >= req.shape.num_logical_experts
        ):
            row = np.arange(shape[1]) % req.shape.num_logical_experts
            phy2log = np.tile(draw(st.permutations(list(row))), (shape[0], 1))
            if draw(st.booleans()):
                phy2log[0, 0] = draw(st.integers(-5, 20))
            dtype = draw(st.sampled_from([np.int32, np.int64, np.float32]))
            req.initial_placement.phy2log.CopyFrom(codec.encode(phy2log.astype(dtype)))
        else:
            req.initial_placement.phy2log.CopyFrom(draw(arrays(shape)))
        req.initial_placement.version = draw(u64)
    if HAS_GROUPS and draw(st.integers(0, 7)) == 0:
        req.ranks.extend(draw(st.lists(u32, max_size=4)))
        req.pod = draw(st.text(max_size=5) | st.just("x" * 300))
    return req


@rpc_settings
@given(register_requests())
@example(req=pb.RegisterRequest(deployment="bad name!", rank=0, shape=SHAPE))
@example(req=pb.RegisterRequest(deployment=DEP, rank=G, shape=SHAPE))
@example(
    req=pb.RegisterRequest(
        deployment=DEP,
        rank=0,
        shape=pb.ModelShape(
            num_layers=L, num_logical_experts=E, num_physical_slots=P + 1, num_gpus=G
        ),
    )
)
@example(
    req=pb.RegisterRequest(deployment=DEP, rank=0, shape=SHAPE, placement_version=2**63 - 1)
)  # future
@example(
    req=pb.RegisterRequest(deployment="r1", rank=0, shape=SHAPE, placement_version=2**63)
)  # beyond the store
@example(req=pb.RegisterRequest(deployment=DEP, rank=1, shape=SHAPE, placement_version=0))
@example(
    req=pb.RegisterRequest(
        deployment="r0",
        rank=0,
        shape=SHAPE,
        initial_placement=pb.Placement(
            phy2log=pb.Array(dtype=pb.DTYPE_INT32, shape=[0, U32, U32], data=b"")
        ),
    )
)
def test_register(
    worker: pb_grpc.WorkerServiceStub, admin: pb_grpc.AdminServiceStub, req: pb.RegisterRequest
) -> None:
    touched = (DEP, req.deployment)
    before = snapshot(admin, touched)
    code, details, reply = call(worker.Register, req)
    if code == OK:
        event("OK")
        assert NAME_RE.match(req.deployment) and shape_valid(req.shape), req
        assert req.placement_version < 2**63, req
        assert req.rank < req.shape.num_gpus or (HAS_GROUPS and req.ranks)
        consume_sessions(worker, [reply.session_id])
        return
    refused_changes_nothing(admin, before, code, details, req, touched)


# ------------------------------------------------------------------ Stream


@rpc_settings
@given(
    st.lists(
        st.one_of(
            st.builds(hello, st.text(max_size=40) | st.just("")),
            st.builds(lambda s: window(s), u64),
            st.just(pb.WorkerMessage()),
        ),
        max_size=3,
    )
)
def test_stream_without_a_session(
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    messages: list[pb.WorkerMessage],
) -> None:
    """No registered session behind the hello (or no hello first): always refused."""
    before = snapshot(admin, (DEP,))
    code, details, replies = stream(worker, messages)
    assert code != OK and not replies, (code, messages)
    refused_changes_nothing(admin, before, code, details, messages)


@st.composite
def windows(draw: st.DrawFn) -> tuple[int, pb.WorkerMessage]:
    """(seq offset from the expected one, a window message with fuzzed fields)."""
    offset = draw(st.sampled_from([0, 0, 0, -1, 1, 2]) | st.integers(-(2**20), 2**40))
    w = pb.Window(
        num_steps=draw(u32), first_step=draw(u64), placement_version=draw(u64 | st.just(0))
    )
    w.logical_count.CopyFrom(draw(arrays((L, E))))
    if draw(st.booleans()):
        w.physical_count.CopyFrom(draw(arrays((L, P))))
    msg = pb.WorkerMessage(window=w)
    other = draw(st.sampled_from(["window"] * 8 + ["hello", "empty"]))
    if other == "hello":
        msg = pb.WorkerMessage(hello=pb.Hello(session_id="again"))
    elif other == "empty":
        msg = pb.WorkerMessage()  # no body
    return offset, msg


@rpc_settings
@given(st.integers(0, G - 1), windows())
@example(rank=0, case=(0, window(0, np.full((L, E), -1, np.int64))))
@example(rank=0, case=(0, window(0, np.full((L, E), np.nan, np.float32))))
@example(rank=0, case=(0, window(0, np.ones((L, E + 1), np.int64))))
@example(rank=1, case=(5, window(0)))  # a gap: out of order
@example(
    rank=0,
    case=(
        0,
        pb.WorkerMessage(
            window=pb.Window(
                seq=0, logical_count=pb.Array(dtype=7, shape=[L, E], data=b"\0" * (8 * L * E))
            )
        ),
    ),
)
def test_stream_window(
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    rank: int,
    case: tuple[int, pb.WorkerMessage],
) -> None:
    """One fuzzed window on a fresh session: ingested when valid (a resent seq counts
    nothing), refused otherwise with nothing changed."""
    offset, msg = case
    reply = register(worker, rank)
    expected = reply.next_window_seq
    if msg.HasField("window"):
        msg.window.seq = max(0, min(U64, expected + offset))
    before = snapshot(admin, (DEP,))
    code, details, _ = stream(worker, [hello(reply.session_id), msg])
    if msg.HasField("window"):
        w = msg.window
        valid = valid_counts(w.logical_count, (L, E)) and (
            not w.HasField("physical_count") or valid_counts(w.physical_count, (L, P))
        )
        if not valid:
            assert code != OK, msg
        if code == OK and w.seq < expected:
            assert settled_snapshot(admin, before, (DEP,)) == before, (
                "a resent window was counted again"
            )
        if w.seq > expected:
            assert code != OK, "a gap in the sequence numbers was accepted"
    else:
        assert code != OK, msg
    refused_changes_nothing(admin, before, code, details, msg)


# ------------------------------------------------------------------ ReportPlan


@rpc_settings
@given(
    mostly(st.just(True), st.just(False)),
    st.integers(0, G - 1),
    mostly(st.integers(0, 3), versions),
    mostly(
        st.integers(1, 4),
        st.sampled_from(sorted(pb.PlanPhase.values())) | st.integers(-(2**31), 2**31 - 1),
    ),
    st.text(max_size=20),
    u64,
    doubles,
)
@example(
    registered=False,
    rank=0,
    version=1,
    phase=pb.PLAN_PHASE_PREPARED,
    error="",
    nbytes=0,
    seconds=0.0,
)
@example(
    registered=True,
    rank=0,
    version=2**63 - 1,
    phase=pb.PLAN_PHASE_COMMITTED,
    error="",
    nbytes=0,
    seconds=0.0,
)
@example(registered=True, rank=0, version=0, phase=99, error="", nbytes=0, seconds=float("nan"))
@example(
    registered=True,
    rank=1,
    version=1,
    phase=pb.PLAN_PHASE_FAILED,
    error="x" * 10_000,
    nbytes=U64,
    seconds=-1.0,
)
def test_report_plan(
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    registered: bool,
    rank: int,
    version: int,
    phase: int,
    error: str,
    nbytes: int,
    seconds: float,
) -> None:
    session = register(worker, rank).session_id if registered else "nosuch-session"
    before = snapshot(admin, (DEP,))
    req = pb.PlanReport(
        session_id=session,
        version=version,
        phase=phase,
        error=error,
        bytes_received=nbytes,
        seconds=seconds,
    )
    code, details, _ = call(worker.ReportPlan, req)
    if not registered or phase not in (1, 2, 3, 4):
        assert code != OK, req
    refused_changes_nothing(admin, before, code, details, req)
    if registered:
        consume_sessions(worker, [session])


# ------------------------------------------------------------------ AdminService


@st.composite
def policies(draw: st.DrawFn) -> pb.Policy:
    policy = pb.Policy()
    for field in pb.Policy.DESCRIPTOR.fields:
        if draw(st.integers(0, 2)) == 0:
            continue
        if field.type == field.TYPE_MESSAGE:  # NodeCounts: a list, present even when empty
            getattr(policy, field.name).counts.extend(draw(st.lists(u32, max_size=4)))
        elif field.type == field.TYPE_BOOL:
            setattr(policy, field.name, draw(st.booleans()))
        elif field.type == field.TYPE_UINT32:
            setattr(policy, field.name, draw(u32))
        else:
            setattr(policy, field.name, draw(doubles | st.floats(0, 1)))
    return policy


dep_names = mostly(st.just(DEP), names)
admin_calls = st.one_of(
    st.tuples(st.just("Status"), st.builds(pb.StatusRequest, deployment=dep_names)),
    st.tuples(st.just("GetPlacement"), st.builds(pb.DeploymentRef, deployment=dep_names)),
    st.tuples(st.just("GetPolicy"), st.builds(pb.DeploymentRef, deployment=dep_names)),
    st.tuples(st.just("History"), st.builds(pb.HistoryRequest, deployment=dep_names, limit=u32)),
    st.tuples(st.just("Pause"), st.builds(pb.DeploymentRef, deployment=dep_names)),
    st.tuples(st.just("Resume"), st.builds(pb.DeploymentRef, deployment=dep_names)),
    st.tuples(
        st.just("ForceRebalance"),
        st.builds(
            pb.ForceRebalanceRequest,
            deployment=dep_names,
            dry_run=st.booleans(),
            max_moved_fraction=doubles,
        ),
    ),
    st.tuples(
        st.just("SetPolicy"),
        st.builds(pb.SetPolicyRequest, deployment=dep_names, policy=policies()),
    ),
)


@rpc_settings
@given(admin_calls)
@example(
    case=(
        "ForceRebalance",
        pb.ForceRebalanceRequest(deployment=DEP, dry_run=True, max_moved_fraction=float("nan")),
    )
)
@example(
    case=("SetPolicy", pb.SetPolicyRequest(deployment=DEP, policy=pb.Policy(decay=float("nan"))))
)
@example(case=("SetPolicy", pb.SetPolicyRequest(deployment=DEP, policy=pb.Policy(min_windows=U32))))
@example(case=("History", pb.HistoryRequest(deployment=DEP, limit=U32)))
@example(case=("GetPlacement", pb.DeploymentRef(deployment="nosuch")))
def test_admin(admin: pb_grpc.AdminServiceStub, case: tuple[str, Any]) -> None:
    method, req = case
    before = snapshot(admin, (DEP, req.deployment))
    code, details, reply = call(getattr(admin, method), req)
    if method == "Resume" and code == OK and req.deployment:
        # keep every deployment paused: no decision may run between two snapshots
        assert call(admin.Pause, pb.DeploymentRef(deployment=req.deployment))[0] == OK
    if code == OK and method in ("GetPlacement", "ForceRebalance") and req.deployment == DEP:
        placements = (
            [reply]
            if method == "GetPlacement"
            else [reply.placement]
            if method == "ForceRebalance"
            else []
        )
        for placement in placements:
            if placement.phy2log.shape:
                codec.decode_phy2log(
                    placement.phy2log, L, P, E
                )  # what the controller sends decodes
    refused_changes_nothing(admin, before, code, details, case, (DEP, req.deployment))


# ------------------------------------------------------------------ undecodable and oversized

METHODS = [
    f"/rebalancer.v1.WorkerService/{m}" for m in ("Register", "ReportPlan", "ReportRanks")
] + [
    f"/rebalancer.v1.AdminService/{m.name}"
    for m in pb.DESCRIPTOR.services_by_name["AdminService"].methods
]


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    fn = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        fn(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


@rpc_settings
@given(st.sampled_from(METHODS), st.binary(max_size=64))
def test_raw_bytes(
    channel: grpc.Channel, admin: pb_grpc.AdminServiceStub, method: str, data: bytes
) -> None:
    """Bytes as a request: whatever protobuf parses is handled like any message; bytes it
    cannot parse are refused with INVALID_ARGUMENT (test_undecodable_request_is_refused)."""
    service, name = method.split("/")[1:]
    request_type = {
        m.name: m.input_type for m in pb.DESCRIPTOR.services_by_name[service.split(".")[-1]].methods
    }[name]
    from google.protobuf import message_factory
    from google.protobuf.message import DecodeError

    cls = message_factory.GetMessageClass(request_type)
    try:
        cls.FromString(data)
        parses = True
    except DecodeError:
        parses = False
    before = snapshot(admin, (DEP,))
    code, details = raw_call(channel, method, data)
    if not parses:
        event("does not parse")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, data)
    if method.endswith(("Resume", "SetPolicy", "Pause")) and code == OK:
        call(admin.Pause, pb.DeploymentRef(deployment=cls.FromString(data).deployment))
        return
    refused_changes_nothing(admin, before, code, details, (method, data))


BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string in every request here): invalid UTF-8
NOT_PROTOBUF = b"\xff\xff\xff"


@pytest.mark.parametrize(
    "method, data",
    [
        ("/rebalancer.v1.AdminService/Status", BAD_UTF8),
        ("/rebalancer.v1.AdminService/Pause", NOT_PROTOBUF),
        ("/rebalancer.v1.WorkerService/Register", NOT_PROTOBUF),
        ("/rebalancer.v1.WorkerService/Register", BAD_UTF8),
        ("/rebalancer.v1.WorkerService/ReportPlan", BAD_UTF8),
        ("/rebalancer.v1.WorkerService/ReportRanks", BAD_UTF8),
        ("/grpc.health.v1.Health/Check", BAD_UTF8),
    ],
)
def test_undecodable_request_is_refused(
    channel: grpc.Channel, admin: pb_grpc.AdminServiceStub, method: str, data: bytes
) -> None:
    """A request grpc-python cannot parse (bytes that are not protobuf, invalid UTF-8 in
    a string field): INVALID_ARGUMENT naming the message type, nothing changed (it used
    to be UNKNOWN "Unexpected DecodeError" from grpc-python's aio server)."""
    before = snapshot(admin, (DEP,))
    code, details = raw_call(channel, method, data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "request is not a valid " in details, details
    refused_changes_nothing(admin, before, code, details, (method, data))


@pytest.mark.parametrize("first", [True, False])
def test_undecodable_stream_message_is_refused(
    channel: grpc.Channel,
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    first: bool,
) -> None:
    """On the Stream: as its first message, or after the hello of a registered session (which
    is then detached, as after any refused window)."""
    session = register(worker, 1).session_id
    before = snapshot(admin, (DEP,))
    messages = [NOT_PROTOBUF] if first else [hello(session).SerializeToString(), BAD_UTF8]
    fn = channel.stream_stream(
        "/rebalancer.v1.WorkerService/Stream", request_serializer=None, response_deserializer=None
    )
    try:
        replies = list(fn(iter(messages), timeout=TIMEOUT))
        code, details = OK, ""
    except grpc.RpcError as exc:
        replies, code, details = [], exc.code(), exc.details() or ""
    assert code == grpc.StatusCode.INVALID_ARGUMENT and not replies, (code, details)
    assert "request is not a valid rebalancer.v1.WorkerMessage" in details, details
    refused_changes_nothing(admin, before, code, details, messages)
    if first:
        consume_sessions(worker, [session])
    else:  # the session ended with its stream
        assert stream(worker, [hello(session)])[0] == grpc.StatusCode.NOT_FOUND


def test_oversized_window_is_refused(
    controller: EmbeddedController,
    admin: pb_grpc.AdminServiceStub,
    worker: pb_grpc.WorkerServiceStub,
) -> None:
    """A message over the server's limit: RESOURCE_EXHAUSTED, nothing counted."""
    assert controller.server is not None
    big = client_options(4 * MAX_MESSAGE_BYTES)
    reply = register(worker, 0)
    before = snapshot(admin, (DEP,))
    with grpc.insecure_channel(controller.server.address, options=big) as ch:
        stub = pb_grpc.WorkerServiceStub(ch)
        msg = pb.WorkerMessage(
            window=pb.Window(
                seq=reply.next_window_seq,
                logical_count=pb.Array(
                    dtype=pb.DTYPE_INT64, shape=[L, E], data=b"\0" * (MAX_MESSAGE_BYTES + 1)
                ),
            )
        )
        code, details, _ = stream(stub, [hello(reply.session_id), msg])
        refused_changes_nothing(admin, before, code, details, "17 MiB window")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, details, _ = call(
            stub.Register,
            pb.RegisterRequest(
                deployment="r-big", rank=0, shape=SHAPE, worker_id="x" * (MAX_MESSAGE_BYTES + 1)
            ),
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    consume_sessions(worker, [reply.session_id])
    assert settled_snapshot(admin, before, (DEP,)) == before


def test_resume_is_ok_and_pause_restores(admin: pb_grpc.AdminServiceStub) -> None:
    assert call(admin.Resume, pb.DeploymentRef(deployment=DEP))[0] == OK
    assert call(admin.Pause, pb.DeploymentRef(deployment=DEP))[0] == OK


@pytest.mark.parametrize("version", [2**63, U64])
@pytest.mark.parametrize(
    "where", ["Register", "Register new", "initial_placement", "ReportPlan", "Window"]
)
def test_versions_beyond_int64_are_refused(
    worker: pb_grpc.WorkerServiceStub, admin: pb_grpc.AdminServiceStub, where: str, version: int
) -> None:
    """A placement or plan version above 2**63 - 1 (a valid uint64 on the wire, more than
    the store's SQLite INTEGER holds): INVALID_ARGUMENT naming the field, nothing changed
    (it used to escape as OverflowError: UNKNOWN). Every RPC that takes a version."""
    name = "r2" if where in ("Register new", "initial_placement") else DEP
    before = snapshot(admin, (DEP, name))
    session = None
    if where.startswith("Register") or where == "initial_placement":
        req = pb.RegisterRequest(deployment=name, rank=0, shape=SHAPE)
        if where == "initial_placement":
            req.initial_placement.version = version
            req.initial_placement.phy2log.CopyFrom(
                codec.encode(np.tile(np.arange(P) % E, (L, 1)).astype(np.int32))
            )
        else:
            req.placement_version = version
        code, details, reply = call(worker.Register, req)
        field = "initial_placement.version" if where == "initial_placement" else "placement_version"
        if code == OK:
            consume_sessions(worker, [reply.session_id])
    else:
        reply = register(worker, 0)
        session = reply.session_id
        before = snapshot(admin, (DEP,))
        if where == "ReportPlan":
            code, details, _ = call(
                worker.ReportPlan,
                pb.PlanReport(session_id=session, version=version, phase=pb.PLAN_PHASE_COMMITTED),
            )
            field = "version"
        else:
            msg = window(reply.next_window_seq, placement_version=version)
            code, details, _ = stream(worker, [hello(session), msg])  # the session ends with it
            field = "window placement_version"
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"{field} {version} is above the largest version {2**63 - 1}"), (
        details
    )
    refused_changes_nothing(admin, before, code, details, where, (DEP, name))
    if session is not None and where == "ReportPlan":
        consume_sessions(worker, [session])


def test_no_plan_version_after_the_largest(
    worker: pb_grpc.WorkerServiceStub, admin: pb_grpc.AdminServiceStub
) -> None:
    """A deployment whose ranks registered at the largest version, 2**63 - 1: a forced
    rebalance has no plan version left and is refused with FAILED_PRECONDITION, nothing
    stored (it used to overflow the store: UNKNOWN)."""
    name, top = "at-the-top", 2**63 - 1
    rng = np.random.default_rng(1)
    sessions = [register(worker, rank, name, placement_version=top).session_id for rank in range(G)]
    for session in sessions:
        code, details, _ = stream(worker, [hello(session), window(0, rng.integers(1, 50, (L, E)))])
        assert code == OK, details
    sessions = [register(worker, rank, name, placement_version=top).session_id for rank in range(G)]
    streams = [OpenStream(worker, s) for s in sessions]
    try:
        deadline = time.monotonic() + 5
        while (
            admin.Status(pb.StatusRequest(deployment=name), timeout=TIMEOUT)
            .deployments[0]
            .connected_ranks
            < G
        ):
            assert time.monotonic() < deadline, "ranks did not connect"
            time.sleep(0.01)
        history = admin.History(pb.HistoryRequest(deployment=name), timeout=TIMEOUT)
        code, details, _ = call(
            admin.ForceRebalance, pb.ForceRebalanceRequest(deployment=name, max_moved_fraction=1.0)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
        assert "no plan version is left" in details, details
        status = admin.Status(pb.StatusRequest(deployment=name), timeout=TIMEOUT).deployments[0]
        assert status.placement_version == top and not status.plan_in_flight
        assert (
            admin.History(pb.HistoryRequest(deployment=name), timeout=TIMEOUT).plans
            == history.plans
        )
    finally:
        for s in streams:
            s.close()


# ---------------------------------------------------------------- reports while a plan is in flight


class OpenStream:
    """A rank's stream kept open on a thread: messages sent on demand, replies queued."""

    def __init__(self, stub: pb_grpc.WorkerServiceStub, session: str) -> None:
        self.outbox: queue.Queue[pb.WorkerMessage | None] = queue.Queue()
        self.replies: queue.Queue[pb.ControllerMessage] = queue.Queue()
        self.outbox.put(hello(session))

        def requests() -> Iterator[pb.WorkerMessage]:
            while (msg := self.outbox.get()) is not None:
                yield msg

        self.call = stub.Stream(requests(), timeout=60)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.put(reply)
        except grpc.RpcError:
            pass

    def wait_for(self, kind: str, timeout: float = 10.0) -> pb.ControllerMessage:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            if msg.WhichOneof("body") == kind:
                return msg

    def close(self) -> None:
        self.outbox.put(None)
        self.thread.join(10)
        self.call.cancel()


def plan_in_flight(admin: pb_grpc.AdminServiceStub) -> int:
    return (
        admin.Status(pb.StatusRequest(deployment=DEP), timeout=TIMEOUT)
        .deployments[0]
        .plan_in_flight
    )


reports = st.lists(
    st.tuples(
        st.integers(0, G),  # G: a session that is not of this deployment's ranks (unknown id)
        st.sampled_from([0, 0, 0, -1, 1, 2**40]),  # version: the plan's, the committed one, ahead
        mostly(st.integers(1, 4), st.integers(-(2**31), 2**31 - 1)),
    ),
    min_size=1,
    max_size=6,
)


@settings(rpc_settings, max_examples=max(5, rpc_settings.max_examples // 3))
@given(reports)
@example(
    steps=[(0, 0, pb.PLAN_PHASE_COMMITTED), (1, 0, pb.PLAN_PHASE_COMMITTED)]
)  # commit before prepare
@example(
    steps=[
        (0, 0, pb.PLAN_PHASE_PREPARED),
        (0, 0, pb.PLAN_PHASE_PREPARED),
        (1, -1, pb.PLAN_PHASE_PREPARED),
        (1, 0, pb.PLAN_PHASE_PREPARED),
        (0, 0, pb.PLAN_PHASE_PREPARED),
    ]
)  # twice, stale, after
@example(
    steps=[(1, 0, pb.PLAN_PHASE_FAILED), (0, 0, pb.PLAN_PHASE_PREPARED)]
)  # prepared after an abort
def test_reports_during_a_plan(
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    steps: list[tuple[int, int, int]],
) -> None:
    """Both ranks streaming and a forced plan in flight: reports of any phase, from any rank,
    for the plan's version, a stale or a future one, in any order."""
    sessions = [register(worker, rank).session_id for rank in range(G)]
    streams = [OpenStream(worker, s) for s in sessions]
    version = 0
    try:
        deadline = time.monotonic() + 5  # both attached before the plan starts
        while (
            admin.Status(pb.StatusRequest(deployment=DEP), timeout=TIMEOUT)
            .deployments[0]
            .connected_ranks
            < G
        ):
            assert time.monotonic() < deadline, "ranks did not connect"
            time.sleep(0.01)
        code, details, reply = call(admin.ForceRebalance, pb.ForceRebalanceRequest(deployment=DEP))
        assert code == OK, details
        version = reply.decision.plan_version
        assert version and plan_in_flight(admin) == version, reply
        for s in streams:
            assert s.wait_for("prepare").prepare.version == version
        for rank, delta, phase in steps:
            session = sessions[rank] if rank < G else "not-a-session"
            req = pb.PlanReport(session_id=session, version=max(0, version + delta), phase=phase)
            before = snapshot(admin, (DEP,))
            code, details, _ = call(worker.ReportPlan, req)
            if phase not in (1, 2, 3, 4) or rank == G or delta > 0:
                assert code != OK, req
            refused_changes_nothing(admin, before, code, details, req)
    finally:
        # A plan every rank prepared is committed whatever happens next: confirm it. One
        # still preparing aborts when its ranks leave.
        status = admin.Status(pb.StatusRequest(deployment=DEP), timeout=TIMEOUT).deployments[0]
        if version and status.plan_in_flight == version and status.plan_phase != "preparing":
            for session in sessions:
                call(
                    worker.ReportPlan,
                    pb.PlanReport(
                        session_id=session, version=version, phase=pb.PLAN_PHASE_COMMITTED
                    ),
                )
        for s in streams:
            s.close()
    deadline = time.monotonic() + 5
    while plan_in_flight(admin) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not plan_in_flight(admin), "the plan did not finish"


# ------------------------------------------------------------------ shapes too large to hold

HUGE_SHAPE_CHILD = r"""
import json, os, resource, sys, tempfile, pathlib
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a failed allocation, never a real one
import grpc
from rebalancer.controller.decide import PolicyConfig
from rebalancer.v1 import rebalancer_pb2 as pb, rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from tests.integration.conftest import start_controller
ctl = start_controller(pathlib.Path(tempfile.mkdtemp()) / "c.sqlite", policy=PolicyConfig(paused=True))
with grpc.insecure_channel(ctl.server.address, options=client_options()) as ch:
    stub = pb_grpc.WorkerServiceStub(ch)
    for shape in json.loads(sys.argv[1]):
        try:
            stub.Register(pb.RegisterRequest(deployment="huge", rank=0, shape=pb.ModelShape(**shape)), timeout=30)
            print("OK", flush=True)
        except grpc.RpcError as exc:
            print(exc.code().name, (exc.details() or "").replace(chr(10), " "), flush=True)
os._exit(0)  # the decision process dies with this one (PR_SET_PDEATHSIG)
"""  # noqa: E501
HUGE_SHAPES = [  # (shape, what the refusal says), each a valid layout but for its size
    (
        dict(num_layers=2**31, num_logical_experts=1, num_physical_slots=1, num_gpus=1),
        f"shape.num_layers {2**31} is above the limit {MAX_LAYERS}",
    ),
    (
        dict(num_layers=1, num_logical_experts=1, num_physical_slots=U32, num_gpus=1),
        f"slots ({U32}) must be at most {MAX_SLOTS}",
    ),
    (
        dict(num_layers=2**16, num_logical_experts=2**16, num_physical_slots=2**16, num_gpus=1),
        f"shape.num_layers {2**16} is above the limit {MAX_LAYERS}",
    ),
    (
        dict(num_layers=MAX_LAYERS + 1, num_logical_experts=1, num_physical_slots=1, num_gpus=1),
        f"shape.num_layers {MAX_LAYERS + 1} is above the limit {MAX_LAYERS}",
    ),
    (
        dict(
            num_layers=MAX_LAYERS,
            num_logical_experts=MAX_SLOTS,
            num_physical_slots=MAX_SLOTS,
            num_gpus=2,
        ),
        f"({MAX_LAYERS} x {MAX_SLOTS} = {MAX_LAYERS * MAX_SLOTS}) is above the limit "
        f"{MAX_LAYER_SLOTS}",
    ),
    (
        dict(num_layers=1, num_logical_experts=1, num_physical_slots=MAX_SLOTS, num_gpus=1),
        f"must be at most {MAX_SLOTS_PER_GPU}",
    ),
    (
        dict(
            num_layers=1, num_logical_experts=1, num_physical_slots=1, num_gpus=1, expert_bytes=U64
        ),
        f"shape.expert_bytes {U64} is above the limit {MAX_EXPERT_BYTES}",
    ),
]


def test_register_huge_shape_is_refused() -> None:
    """A valid but huge shape (L=2**31, or P=2**32-1, or L=E=P=2**16, ...) is refused with
    INVALID_ARGUMENT naming the field and the limit, before anything is allocated (it used
    to make the controller allocate the trivial [L, P] placement: 16-32 GiB). Run in a
    child under a 4 GiB address-space limit, so that a regression fails instead of
    allocating."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shapes = json.dumps([shape for shape, _ in HUGE_SHAPES])
    out = subprocess.run(
        [sys.executable, "-c", HUGE_SHAPE_CHILD, shapes],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(lines) == len(HUGE_SHAPES), out.stdout + out.stderr
    for line, (shape, words) in zip(lines, HUGE_SHAPES, strict=True):
        assert line.startswith("INVALID_ARGUMENT ") and words in line, (shape, line)


@pytest.mark.parametrize(
    "shape, ok",
    [
        (
            dict(num_layers=MAX_LAYERS, num_logical_experts=1, num_physical_slots=1, num_gpus=1),
            True,
        ),
        (
            dict(
                num_layers=MAX_LAYERS,
                num_logical_experts=MAX_LAYER_SLOTS // MAX_LAYERS,
                num_physical_slots=MAX_LAYER_SLOTS // MAX_LAYERS,
                num_gpus=2,
            ),
            True,
        ),
        (
            dict(
                num_layers=MAX_LAYERS,
                num_logical_experts=2,
                num_physical_slots=MAX_LAYER_SLOTS // MAX_LAYERS + 2,
                num_gpus=2,
            ),
            False,
        ),
        (
            dict(
                num_layers=1,
                num_logical_experts=1,
                num_physical_slots=MAX_SLOTS_PER_GPU,
                num_gpus=1,
            ),
            True,
        ),
        (
            dict(
                num_layers=1,
                num_logical_experts=1,
                num_physical_slots=MAX_SLOTS_PER_GPU + 1,
                num_gpus=1,
            ),
            False,
        ),
        (
            dict(
                num_layers=1,
                num_logical_experts=1,
                num_physical_slots=1,
                num_gpus=1,
                expert_bytes=MAX_EXPERT_BYTES,
            ),
            True,
        ),
        (
            dict(
                num_layers=1,
                num_logical_experts=1,
                num_physical_slots=1,
                num_gpus=1,
                expert_bytes=MAX_EXPERT_BYTES + 1,
            ),
            False,
        ),
    ],
)
def test_shape_limits(
    worker: pb_grpc.WorkerServiceStub,
    admin: pb_grpc.AdminServiceStub,
    shape: dict[str, int],
    ok: bool,
) -> None:
    """Each limit of wire/layout.py, at the limit (a new deployment) and one past it
    (INVALID_ARGUMENT naming the limit, nothing changed). All small enough to run here."""
    name = "lim-" + "-".join(str(shape[k]) for k in sorted(shape))
    before = snapshot(admin, (DEP, name))
    code, details, reply = call(
        worker.Register, pb.RegisterRequest(deployment=name, rank=0, shape=pb.ModelShape(**shape))
    )
    if ok:
        assert code == OK, details
        consume_sessions(worker, [reply.session_id])
        return
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "limit" in details or "at most" in details, details
    refused_changes_nothing(admin, before, code, details, shape, (DEP, name))


def test_limits_fit_one_message() -> None:
    """A Prepare that moves every slot of the largest shape (int32 placement [L, P] plus
    transfers [L*P, 5]) fits in one message; so do its windows (int64 [L, E] + [L, P])."""
    assert MAX_LAYER_SLOTS * 4 * (1 + 5) < MAX_MESSAGE_BYTES * 0.9
    assert MAX_LAYER_SLOTS * 8 * 2 < MAX_MESSAGE_BYTES * 0.9
    assert MAX_LAYER_SLOTS * MAX_EXPERT_BYTES < 2**63  # bytes a plan moves, in the store


# ------------------------------------------------------- `rebalancer admin` against this controller


@st.composite
def admin_cli_argv(draw: st.DrawFn) -> list[str]:
    dep = draw(mostly(st.just(DEP), st.sampled_from(["nosuch", "", "a b", "\udcff", "x" * 200])))
    action = draw(
        st.sampled_from(["status", "placement", "history", "force", "pause", "resume", "policy"])
    )
    argv = [action, dep] if action != "status" or dep == DEP else [action]
    if action == "placement":
        argv += draw(
            st.sampled_from(
                [
                    [],
                    ["--out", "@out"],
                    ["--out", "@missing-dir"],
                    ["--sglang", "@dir"],
                    ["--sglang", "@out"],
                ]
            )
        )
    elif action == "history":
        argv += draw(
            st.sampled_from([[], ["--limit", "3"], ["--limit", "-1"], ["--limit", str(2**32)]])
        )
    elif action == "force":
        argv += ["--dry-run"] + draw(
            st.sampled_from(
                [
                    [],
                    ["--max-moved-fraction", "0.5"],
                    ["--max-moved-fraction", "nan"],
                    ["--max-moved-fraction", "7"],
                ]
            )
        )
    elif action == "policy":
        argv += draw(
            st.lists(
                st.sampled_from(
                    [
                        "gain_threshold=0.1",
                        "gain_threshold=2",
                        "min_windows=-1",
                        f"min_windows={2**32}",
                        "min_windows=3",
                        "shrink=maybe",
                        "shrink=false",
                        "decay=x",
                        "decay=nan",
                        "bogus=1",
                        "noeq",
                        "horizon_seconds=0",
                        "prior_decay=0.5",
                    ]
                ),
                max_size=3,
            )
        )
    return draw(st.sampled_from([[], ["--json"]])) + argv


@rpc_settings
@given(admin_cli_argv())
@example(argv=["placement", DEP, "--out", "@missing-dir"])  # FileNotFoundError traceback
@example(argv=["history", DEP, "--limit", "-1"])  # ValueError traceback
@example(argv=["policy", DEP, "min_windows=-1"])  # refused only as "is not a number"
def test_admin_cli(
    controller: EmbeddedController,
    admin: pb_grpc.AdminServiceStub,
    tmp_path_factory: pytest.TempPathFactory,
    argv: list[str],
) -> None:
    assert controller.server is not None
    d = tmp_path_factory.getbasetemp()
    paths = {
        "@out": str(d / "admin-out.json"),
        "@missing-dir": str(d / "nope" / "p.json"),
        "@dir": str(d),
    }
    full = [
        "admin",
        "--address",
        controller.server.address,
        "--timeout",
        "10",
        *(paths.get(a, a) for a in argv),
    ]
    before = snapshot(admin, (DEP,))
    code, _, _ = check_run(full, {0, 2, 3, 4})
    if "resume" in argv and code == 0:
        assert call(admin.Pause, pb.DeploymentRef(deployment=DEP))[0] == OK
    if code != 0:
        assert settled_snapshot(admin, before, (DEP,)) == before, argv
