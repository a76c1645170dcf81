"""The WorkerService the pod's ranks speak, on the sidecar's Unix socket.

The same API a rank speaks to the controller (worker_hooks' agent works unchanged against
either): Register, one Stream (windows up, plan phases down) and ReportPlan. This layer
only translates, as the controller's does: protobuf in, calls on the Pod out, and
StateError / InputError into a gRPC status with a message and a log line, before any
state changes (invariant 6). Windows are acknowledged as soon as they are merged: from
then on the sidecar answers for them (its buffer is bounded; the rank's resend buffer
must not grow while the controller is away). So a sidecar killed loses what it held and
had not sent (at most its bounded buffer, as a controller crash loses its last unfolded
windows); nothing is ever counted twice.

A sidecar that merges its EP group (rebalancer/sidecar/merge.py) serves the same service
to its followers on TCP, where each call must carry the deployment's worker token when
the leader has one (`token`: read at each call, as the controller's rule: none is
UNAUTHENTICATED, another PERMISSION_DENIED), and a follower tells its ranks' presence
with ReportRanks, as a sidecar tells the controller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from rebalancer.errors import InputError, StateError
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.bearer import bearer_token, same_token
from rebalancer.wire.service import EOF_OF_STREAM, StreamWriter, read_hello, refuse

log = logging.getLogger("rebalancer.sidecar")


class RankService(pb_grpc.WorkerServiceServicer):
    """`token`: None on the ranks' socket; on a merging leader's TCP port, what gives the
    token its followers must present (None from it: none needed)."""

    def __init__(self, pod: Pod, token: Callable[[], str | None] | None = None) -> None:
        self.pod = pod
        self.token = token

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        expected = self.token() if self.token is not None else None
        if expected is None:
            return
        presented = bearer_token(context.invocation_metadata())
        if presented is None:
            raise StateError(
                "UNAUTHENTICATED", "a follower's calls need 'authorization: Bearer <token>'"
            )
        if not same_token(presented, expected):
            raise StateError(
                "PERMISSION_DENIED", "worker token not accepted by this group's leader"
            )

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        try:
            self._authenticate(context)
            return self.pod.register(request)
        except (StateError, InputError) as exc:
            await refuse(context, exc, f"Register(rank {request.rank})", log)
            raise AssertionError("unreachable") from exc

    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            self._authenticate(context)
        except StateError as exc:
            await refuse(context, exc, "Stream", log)
            return
        hello = await read_hello(context)
        if hello is None:
            return
        writer = StreamWriter(context, "stream of a rank")
        try:
            session = self.pod.attach(hello.session_id, writer.put)
        except StateError as exc:
            writer.cancel()
            await refuse(context, exc, "Stream hello", log)
            return
        try:
            while True:
                msg = await context.read()
                if msg is EOF_OF_STREAM:
                    await writer.stop(flush=True)
                    break
                if not msg.HasField("window"):
                    raise InputError("only windows may follow hello on the stream")
                self.pod.window(session, msg.window)
                ack = pb.ControllerMessage()
                ack.window_ack.seq = msg.window.seq
                writer.put(ack)
        except (InputError, StateError) as exc:
            await writer.stop(flush=False)
            await refuse(context, exc, f"Stream window from rank {session.rank}", log)
        finally:
            writer.cancel()
            self.pod.detach(session)

    async def ReportPlan(
        self, request: pb.PlanReport, context: grpc.aio.ServicerContext
    ) -> pb.PlanReportResponse:
        try:
            self._authenticate(context)
            self.pod.report(request)
        except (StateError, InputError) as exc:
            await refuse(context, exc, f"ReportPlan(v{request.version})", log)
        return pb.PlanReportResponse()

    async def ReportRanks(
        self, request: pb.RankPresence, context: grpc.aio.ServicerContext
    ) -> pb.RankPresenceResponse:
        # A rank's presence is its stream; a follower sidecar tells its ranks' (a leader).
        if not self.pod.leader:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "ReportRanks is what a sidecar tells the controller, not a rank's call",
            )
        try:
            self._authenticate(context)
            self.pod.presence(request.session_id, frozenset(request.connected_ranks))
        except (StateError, InputError) as exc:
            await refuse(context, exc, "ReportRanks", log)
        return pb.RankPresenceResponse()
