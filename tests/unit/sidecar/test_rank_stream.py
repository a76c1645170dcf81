"""The ranks' socket of a real sidecar (in process, its controller unreachable): a stream
must open with the Hello of a registered rank; anything else is refused precisely and
leaves the pod as it was."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc
import pytest

from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.daemon import Sidecar
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.link import Link


@pytest.mark.parametrize(
    "first",
    [
        pb.WorkerMessage(window=pb.Window(seq=0, num_steps=1)),
        pb.WorkerMessage(),
        None,  # the stream ends at once
    ],
)
def test_a_stream_that_does_not_open_with_hello_is_refused(first: pb.WorkerMessage | None) -> None:
    async def run() -> tuple[grpc.StatusCode, str, int]:
        with tempfile.TemporaryDirectory(prefix="sc", dir="/tmp") as d:
            config = SidecarConfig(
                link=Link("127.0.0.1:1"), ranks=(0, 1), listen=f"unix://{Path(d)}/agent.sock"
            )
            sidecar = Sidecar(config)
            await sidecar.start()
            try:
                async with grpc.aio.insecure_channel(sidecar.target) as channel:
                    call = pb_grpc.WorkerServiceStub(channel).Stream(timeout=10)
                    if first is not None:
                        await call.write(first)
                    await call.done_writing()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        async for _ in call:
                            pass
                    return info.value.code(), info.value.details() or "", len(sidecar.pod.sessions)
            finally:
                await sidecar.stop()

    code, details, ranks = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "the first stream message must be hello"
    assert ranks == 0  # no session attached
