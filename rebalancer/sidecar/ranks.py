"""The WorkerService the pod's ranks speak, on the sidecar's Unix socket.

The same API a rank speaks to the controller (worker_hooks' agent works unchanged against
either): Register, one Stream (windows up, plan phases down) and ReportPlan. This layer
only translates, as the controller's does: protobuf in, calls on the Pod out, and
SidecarError / InputError into a gRPC status with a message and a log line, before any
state changes (invariant 6). Windows are acknowledged as soon as they are merged: from
then on the sidecar answers for them (its buffer is bounded; the rank's resend buffer
must not grow while the controller is away). So a sidecar killed loses what it held and
had not sent (at most its bounded buffer, as a controller crash loses its last unfolded
windows); nothing is ever counted twice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from rebalancer.errors import InputError
from rebalancer.sidecar.errors import SidecarError
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc

log = logging.getLogger("rebalancer.sidecar")

_EOF = grpc.aio.EOF  # type: ignore[attr-defined]  # exported at runtime, missing in the stubs
# Per-stream queue of outgoing messages (plan phases, acks), bounded as the controller's.
_SEND_QUEUE = 256


async def refuse(context: grpc.aio.ServicerContext, exc: Exception, what: str) -> None:
    code = getattr(grpc.StatusCode, exc.code) if isinstance(exc, SidecarError) else grpc.StatusCode.INVALID_ARGUMENT
    log.warning("%s refused: %s: %s", what, code.name, exc)
    await context.abort(code, str(exc))


class RankService(pb_grpc.WorkerServiceServicer):
    def __init__(self, pod: Pod) -> None:
        self.pod = pod

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        try:
            return self.pod.register(request)
        except (SidecarError, InputError) as exc:
            await refuse(context, exc, f"Register(rank {request.rank})")
            raise AssertionError("unreachable") from exc

    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is _EOF or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first stream message must be hello")
            return
        outbox: asyncio.Queue[pb.ControllerMessage | None] = asyncio.Queue(_SEND_QUEUE)

        def send(msg: pb.ControllerMessage) -> None:
            try:
                outbox.put_nowait(msg)
            except asyncio.QueueFull:
                log.error("stream of a rank is full; dropping a %s", msg.WhichOneof("body"))

        try:
            session = self.pod.attach(first.hello.session_id, send)
        except SidecarError as exc:
            await refuse(context, exc, "Stream hello")
            return

        async def writer() -> None:
            while (out := await outbox.get()) is not None:
                await context.write(out)

        write_task = asyncio.create_task(writer())
        try:
            while True:
                msg = await context.read()
                if msg is _EOF:
                    await outbox.put(None)  # let the writer finish what is queued
                    await asyncio.gather(write_task, return_exceptions=True)
                    break
                if not msg.HasField("window"):
                    raise InputError("only windows may follow hello on the stream")
                self.pod.window(session, msg.window)
                ack = pb.ControllerMessage()
                ack.window_ack.seq = msg.window.seq
                send(ack)
        except (InputError, SidecarError) as exc:
            write_task.cancel()
            await asyncio.gather(write_task, return_exceptions=True)
            await refuse(context, exc, f"Stream window from rank {session.rank}")
        finally:
            write_task.cancel()
            self.pod.detach(session)

    async def ReportPlan(self, request: pb.PlanReport, context: grpc.aio.ServicerContext) -> pb.PlanReportResponse:
        try:
            self.pod.report(request)
        except (SidecarError, InputError) as exc:
            await refuse(context, exc, f"ReportPlan(v{request.version})")
        return pb.PlanReportResponse()
