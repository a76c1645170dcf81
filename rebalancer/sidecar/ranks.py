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
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from rebalancer.errors import InputError, StateError
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.service import EOF_OF_STREAM, StreamWriter, read_hello, refuse

log = logging.getLogger("rebalancer.sidecar")


class RankService(pb_grpc.WorkerServiceServicer):
    def __init__(self, pod: Pod) -> None:
        self.pod = pod

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        try:
            return self.pod.register(request)
        except (StateError, InputError) as exc:
            await refuse(context, exc, f"Register(rank {request.rank})", log)
            raise AssertionError("unreachable") from exc

    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
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
            self.pod.report(request)
        except (StateError, InputError) as exc:
            await refuse(context, exc, f"ReportPlan(v{request.version})", log)
        return pb.PlanReportResponse()

    async def ReportRanks(
        self, request: pb.RankPresence, context: grpc.aio.ServicerContext
    ) -> pb.RankPresenceResponse:
        # The sidecar's own call to the controller; here a rank's presence is its stream.
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "ReportRanks is what a sidecar tells the controller, not a rank's call",
        )
        raise AssertionError("unreachable")
