"""The sidecar's upstream link outlives a controller that ends the group stream between two
of its writes. Found by the chaos campaign (reliability/chaos/: a controller restarted on a
read-only store while links dropped): `call.write` raised asyncio.InvalidStateError ("RPC
already finished"), which the link did not catch, so the upstream task ended and the pod
never reached the controller again (its ranks served on, but no window or plan got
through until the sidecar was restarted). Here a real gRPC server ends every stream right
after the hello while the pod has windows to send: the link must keep reconnecting."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.sidecar.upstream import Upstream
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.link import Link

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=1, expert_bytes=8
)


class EndsStreams(pb_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.streams = 0

    async def Register(self, request: pb.RegisterRequest, context: object) -> pb.RegisterResponse:
        return pb.RegisterResponse(
            session_id="s", committed=pb.Placement(version=0), next_window_seq=0
        )

    async def Stream(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        self.streams += 1
        await context.read()  # the hello; then the controller goes (restart, drain)


async def scenario() -> tuple[int, int, bool]:
    server = grpc.aio.server()
    servicer = EndsStreams()
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = SidecarConfig(
        link=Link(f"127.0.0.1:{port}"),
        ranks=(0,),
        backoff_initial_seconds=0.01,
        backoff_max_seconds=0.02,
    )
    pod = Pod(config)
    reply = pod.register(pb.RegisterRequest(deployment="d", rank=0, shape=SHAPE))
    session = pod.attach(reply.session_id, lambda msg: None)
    upstream = Upstream(config, pod)
    task = asyncio.create_task(upstream.run())
    counts = codec.encode_counts(np.ones((2, 4), dtype=np.int64))
    try:
        for seq in range(300):  # windows keep coming, so writes follow the hello
            pod.window(
                session, pb.Window(seq=seq, first_step=seq, num_steps=1, logical_count=counts)
            )
            await asyncio.sleep(0.01)
            if task.done():
                break
        died = task.done()
        if died:
            task.result()  # raises what ended the link
    finally:
        upstream.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        await server.stop(0)
    return servicer.streams, upstream.reconnects, died


def test_the_link_reconnects_when_the_controller_ends_streams() -> None:
    streams, reconnects, died = asyncio.run(scenario())
    assert not died
    assert streams >= 5 and reconnects >= 5
