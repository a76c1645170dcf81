"""A sidecar refuses requests that do not parse with INVALID_ARGUMENT naming the message
type, as the controller does (both register through rebalancer.wire.service): it used to
answer grpc-python's UNKNOWN "Unexpected DecodeError" on its socket."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rebalancer.launch.processes import free_port

BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string in these requests): invalid UTF-8
NOT_PROTOBUF = b"\xff\xff\xff"


@pytest.fixture
def sidecar_target() -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="scu", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{folder}/agent.sock"
    # The controller is not there: the sidecar serves its ranks anyway.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "sidecar",
            "--listen",
            target,
            "--controller",
            f"127.0.0.1:{free_port()}",
            "--ranks",
            "0-1",
            "--pod",
            "ns/u",
            "--grace",
            "0",
            "--log-level",
            "ERROR",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "sidecar serving on" in proc.stdout.readline()
        yield target
    finally:
        proc.kill()
        proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    "method, data, message",
    [
        ("/rebalancer.v1.WorkerService/Register", NOT_PROTOBUF, "rebalancer.v1.RegisterRequest"),
        ("/rebalancer.v1.WorkerService/Register", BAD_UTF8, "rebalancer.v1.RegisterRequest"),
        ("/rebalancer.v1.WorkerService/ReportPlan", BAD_UTF8, "rebalancer.v1.PlanReport"),
        ("/rebalancer.v1.WorkerService/ReportRanks", BAD_UTF8, "rebalancer.v1.RankPresence"),
        ("/grpc.health.v1.Health/Check", BAD_UTF8, "grpc.health.v1.HealthCheckRequest"),
    ],
)
def test_sidecar_refuses_undecodable_unary_request(
    sidecar_target: str, method: str, data: bytes, message: str
) -> None:
    with grpc.insecure_channel(sidecar_target) as channel:
        fn = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            fn(data, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert f"request is not a valid {message}" in (info.value.details() or "")


def test_sidecar_refuses_undecodable_stream_message(sidecar_target: str) -> None:
    with grpc.insecure_channel(sidecar_target) as channel:
        fn = channel.stream_stream(
            "/rebalancer.v1.WorkerService/Stream",
            request_serializer=None,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(fn(iter([NOT_PROTOBUF]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "request is not a valid rebalancer.v1.WorkerMessage" in (info.value.details() or "")
