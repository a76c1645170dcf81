"""Fuzz the bearer tokens of both services against a real controller on loopback that has
an admin token and per-deployment worker tokens: missing, malformed, wrong, another
deployment's, repeated `authorization` headers. A call without the right token is refused
with UNAUTHENTICATED or PERMISSION_DENIED and a message, and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.embedded import EmbeddedController
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import client_options
from tests.fuzz.rpc_helpers import (
    OK,
    SHAPE,
    G,
    assert_refusal,
    call,
    consume_sessions,
    hello,
    settled_snapshot,
    snapshot,
    stream,
    window,
)
from tests.integration.conftest import start_controller

ADMIN = "adm-secret"
TOKENS = {"dep": "wtok-dep", "other": "wtok-other"}
AUTH = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
rpc_settings = settings(max_examples=max(10, settings.default.max_examples * 2 // 3))


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedController]:
    ctl = start_controller(
        tmp_path_factory.mktemp("fuzz_auth") / "controller.sqlite",
        policy=PolicyConfig(paused=True),
        admin_token=ADMIN,
        worker_tokens=TOKENS,
    )
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture(scope="module")
def stubs(
    controller: EmbeddedController,
) -> Iterator[tuple[pb_grpc.WorkerServiceStub, pb_grpc.AdminServiceStub]]:
    assert controller.server is not None
    with grpc.insecure_channel(controller.server.address, options=client_options()) as ch:
        worker, admin = pb_grpc.WorkerServiceStub(ch), pb_grpc.AdminServiceStub(ch)
        code, details, reply = call(
            worker.Register,
            pb.RegisterRequest(deployment="dep", rank=0, shape=SHAPE),
            bearer(TOKENS["dep"]),
        )
        assert code == OK, details
        code, details, _ = stream(
            worker, [hello(reply.session_id), window(0)], bearer(TOKENS["dep"])
        )
        assert code == OK, details
        yield worker, admin


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


ADMIN_MD = bearer(ADMIN)
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
header_values = st.one_of(
    st.sampled_from(
        [
            f"Bearer {ADMIN}",
            f"Bearer {TOKENS['dep']}",
            f"Bearer {TOKENS['other']}",
            f"bearer {ADMIN}",
            "Bearer ",
            "Bearer",
            f"Basic {ADMIN}",
            f"Bearer {ADMIN} ",
            f"Bearer  {ADMIN}",
            f"Bearer {ADMIN}x",
            f"Bearer {ADMIN[:-1]}",
            f"Bearer {TOKENS['dep'].upper()}",
        ]
    ),
    printable.map(lambda t: f"Bearer {t}"),
    printable,
)
metadata = st.lists(
    st.tuples(
        st.sampled_from(["authorization", "authorization", "x-token", "auth"]), header_values
    ),
    max_size=3,
).map(tuple)


def first_token(md: tuple[tuple[str, str], ...]) -> str | None:
    for key, value in md:
        if key == "authorization":
            return value[len("Bearer ") :] if value.startswith("Bearer ") else None
    return None


@rpc_settings
@given(
    st.sampled_from(
        ["Status", "GetPlacement", "GetPolicy", "History", "Pause", "ForceRebalance", "SetPolicy"]
    ),
    metadata,
)
@example(method="Pause", md=())
@example(method="SetPolicy", md=bearer(TOKENS["dep"]))
@example(
    method="Status",
    md=(("authorization", f"Bearer {ADMIN}x"), ("authorization", f"Bearer {ADMIN}")),
)
def test_admin_tokens(stubs: tuple, method: str, md: tuple[tuple[str, str], ...]) -> None:
    _, admin = stubs
    request = {
        "Status": pb.StatusRequest(),
        "History": pb.HistoryRequest(deployment="dep"),
        "ForceRebalance": pb.ForceRebalanceRequest(deployment="dep", dry_run=True),
        "SetPolicy": pb.SetPolicyRequest(
            deployment="dep",
            policy=pb.Policy(
                gain_threshold=0.5,
                horizon_seconds=10,
                max_moved_fraction=0.5,
                decision_period_seconds=1,
                prepare_timeout_seconds=1,
                link_bandwidth_gbps=1,
                step_seconds=1,
                commit_gbps=1,
            ),
        ),
    }.get(method, pb.DeploymentRef(deployment="dep"))
    before = snapshot(admin, ("dep",), ADMIN_MD)
    code, details, _ = call(getattr(admin, method), request, md)
    if first_token(md) == ADMIN:
        assert code not in AUTH, (code, details, md)
        return
    assert code in AUTH, (code, details, md)
    assert_refusal(code, details, md)
    assert settled_snapshot(admin, before, ("dep",), ADMIN_MD) == before


@rpc_settings
@given(st.sampled_from(["dep", "other", "nosuch"]), st.integers(0, G - 1), metadata)
@example(name="dep", rank=1, md=bearer(TOKENS["other"]))
@example(name="other", rank=0, md=bearer(TOKENS["dep"]))
@example(name="dep", rank=1, md=bearer(ADMIN))
def test_worker_tokens(stubs: tuple, name: str, rank: int, md: tuple[tuple[str, str], ...]) -> None:
    worker, admin = stubs
    before = snapshot(admin, ("dep", "other"), ADMIN_MD)
    code, details, reply = call(
        worker.Register, pb.RegisterRequest(deployment=name, rank=rank, shape=SHAPE), md
    )
    token = first_token(md)
    if token is not None and token == TOKENS.get(name):
        assert code not in AUTH, (code, details, md)
        if code == OK:
            consume_sessions(worker, [reply.session_id], md)
        return
    assert code in AUTH, (code, details, md)
    assert_refusal(code, details, md)
    assert settled_snapshot(admin, before, ("dep", "other"), ADMIN_MD) == before


@rpc_settings
@given(metadata)
@example(md=bearer(TOKENS["other"]))  # the right session, another deployment's token
@example(md=())
def test_stream_and_report_tokens(stubs: tuple, md: tuple[tuple[str, str], ...]) -> None:
    """A session of `dep` used with other tokens: its stream and its reports are refused."""
    worker, admin = stubs
    code, details, reply = call(
        worker.Register,
        pb.RegisterRequest(deployment="dep", rank=1, shape=SHAPE),
        bearer(TOKENS["dep"]),
    )
    assert code == OK, details
    before = snapshot(admin, ("dep",), ADMIN_MD)
    right = first_token(md) == TOKENS["dep"]
    code, details, _ = call(
        worker.ReportPlan,
        pb.PlanReport(session_id=reply.session_id, version=1, phase=pb.PLAN_PHASE_PREPARED),
        md,
    )
    assert (code not in AUTH) if right else (code in AUTH), (code, details, md)
    code, details, _ = stream(worker, [hello(reply.session_id)], md)
    if right:
        assert code == OK, details
        return
    assert code in AUTH, (code, details, md)
    assert_refusal(code, details, md)
    assert settled_snapshot(admin, before, ("dep",), ADMIN_MD) == before
    consume_sessions(worker, [reply.session_id], bearer(TOKENS["dep"]))


@pytest.mark.parametrize(
    "method", ["/rebalancer.v1.AdminService/Status", "/rebalancer.v1.WorkerService/Register"]
)
@pytest.mark.parametrize("token", [None, "wrong", "right"])
def test_undecodable_request_and_tokens(
    controller: EmbeddedController, stubs: tuple, method: str, token: str | None
) -> None:
    """A request that does not parse: the token is checked first (UNAUTHENTICATED /
    PERMISSION_DENIED), then INVALID_ARGUMENT for the bytes; nothing changes."""
    _, admin = stubs
    assert controller.server is not None
    right = ADMIN if "Admin" in method else TOKENS["dep"]
    md = () if token is None else bearer(right if token == "right" else "wrong")
    before = snapshot(admin, ("dep",), ADMIN_MD)
    with grpc.insecure_channel(controller.server.address, options=client_options()) as channel:
        fn = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            fn(b"\x0a\x02\xff\xfe", timeout=10, metadata=md)  # field 1, a string: invalid UTF-8
            code, details = OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
    expected = {
        None: grpc.StatusCode.UNAUTHENTICATED,
        "wrong": grpc.StatusCode.PERMISSION_DENIED,
        "right": grpc.StatusCode.INVALID_ARGUMENT,
    }[token]
    assert code == expected, (code, details)
    assert_refusal(code, details, md)
    assert settled_snapshot(admin, before, ("dep",), ADMIN_MD) == before
