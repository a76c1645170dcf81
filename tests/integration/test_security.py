"""TLS, mutual TLS and tokens on real servers: unauthenticated or unauthorised calls
get UNAUTHENTICATED / PERMISSION_DENIED (or no channel at all) and change nothing."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from rebalancer.cli import main as cli
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import sync_channel
from rebalancer.wire.link import Link
from tests.integration.conftest import start_controller

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=2, num_nodes=1
)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            "san.cnf",
            cwd=d,
        )
    return d


def register(config: Link, deployment: str = "prod") -> pb.RegisterResponse:
    with sync_channel(config) as channel:
        return pb_grpc.WorkerServiceStub(channel).Register(
            pb.RegisterRequest(deployment=deployment, rank=0, shape=SHAPE),
            timeout=5,
            metadata=config.metadata(),
        )


def test_mutual_tls(pki: Path, tmp_path: Path) -> None:
    ctl = start_controller(
        tmp_path / "c.sqlite",
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        good = Link(address, str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key"))
        assert register(good).session_id
        for bad in (Link(address), Link(address, str(pki / "ca.crt"))):
            with pytest.raises(grpc.RpcError) as info:
                register(bad)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli(
                [
                    "admin",
                    "--address",
                    address,
                    "--ca",
                    str(pki / "ca.crt"),
                    "--cert",
                    str(pki / "client.crt"),
                    "--key",
                    str(pki / "client.key"),
                    "--json",
                    "status",
                ]
            )
        assert code == 0 and '"prod"' in out.getvalue()
        assert ctl.call(lambda: len(ctl.server.controller.deployments)) == 1  # type: ignore[union-attr]
    finally:
        ctl.stop()


def test_worker_tokens_bind_ranks_to_their_deployment(tmp_path: Path) -> None:
    ctl = start_controller(
        tmp_path / "c.sqlite", worker_tokens={"prod": "p-token", "canary": "c-token"}
    )
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        for config, code in (
            (Link(address), grpc.StatusCode.UNAUTHENTICATED),
            (Link(address, token="c-token"), grpc.StatusCode.PERMISSION_DENIED),
            (Link(address, token="nonsense"), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as info:
                register(config)
            assert info.value.code() == code
        assert ctl.call(lambda: len(ctl.server.controller.deployments)) == 0  # type: ignore[union-attr]
        session = register(Link(address, token="p-token")).session_id
        # The session of "prod" cannot be used with the token of "canary".
        with sync_channel(Link(address)) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.ReportPlan(
                    pb.PlanReport(session_id=session, version=1, phase=pb.PLAN_PHASE_PREPARED),
                    timeout=5,
                    metadata=(("authorization", "Bearer c-token"),),
                )
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # The stream too: refused by the interceptor without a token, by the service
            # with the token of another deployment, accepted with its own.
            hello = pb.WorkerMessage(hello=pb.Hello(session_id=session))
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", "Bearer c-token"),), grpc.StatusCode.PERMISSION_DENIED),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Stream(iter([hello]), timeout=5, metadata=metadata))
                assert info.value.code() == code
            assert (
                list(
                    stub.Stream(
                        iter([hello]), timeout=5, metadata=(("authorization", "Bearer p-token"),)
                    )
                )
                == []
            )
    finally:
        ctl.stop()


def test_bad_config_files_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, words in (
        ("[server]\nprot = 1\n", "unknown [server] key"),
        ("[policy]\ndecay = 3\n", "decay"),
        ("[tls]\ncert = 'missing.crt'\n", "TLS needs both"),
        ("not toml = = 1", "not valid TOML"),
    ):
        bad.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli(["serve", "--config", str(bad)])
        assert code == 2 and words in err.getvalue(), err.getvalue()


def test_sigterm_drains_with_health_not_serving(tmp_path: Path) -> None:
    """SIGTERM: health turns NOT_SERVING for every service while the port still answers,
    then the process exits 0 with its state saved."""
    import signal
    import sys
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    (tmp_path / "c.toml").write_text("[server]\ndrain_seconds = 3.0\ngrace_seconds = 1.0\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rebalancer",
            "serve",
            "--config",
            str(tmp_path / "c.toml"),
            "--port",
            str(port),
            "--db",
            str(tmp_path / "c.sqlite"),
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and "serving on" in proc.stdout.readline()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = lambda name: (  # noqa: E731
                health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2).status
            )
            assert check("rebalancer.v1.WorkerService") == health_pb2.HealthCheckResponse.SERVING
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 2.5
            seen = set()
            while time.monotonic() < deadline and len(seen) < 3:
                for name in ("", "rebalancer.v1.WorkerService", "rebalancer.v1.AdminService"):
                    if check(name) == health_pb2.HealthCheckResponse.NOT_SERVING:
                        seen.add(name)
                time.sleep(0.05)
            assert len(seen) == 3
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
