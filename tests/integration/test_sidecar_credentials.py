"""The inference pod comes first: a sidecar whose credential Secrets are missing still
starts (its startup probe gates the engine), serves its ranks on the socket and merges
their windows, and says why it cannot reach the controller (log, metric, `--check`).
When the files appear it connects, with mutual TLS and no worker token, which is all the
prod overlay needs, and the windows it held reach the controller.

Real parts: a controller with mutual TLS on loopback, `rebalancer sidecar` as a process,
two ranks' agents (worker_hooks.agent) on its Unix socket.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from tests.integration.conftest import start_controller
from tests.integration.test_security import openssl
from worker_hooks.agent import AgentConfig, WorkerAgent

pytestmark = pytest.mark.slow

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=2, num_nodes=1
)


def wait_for(predicate: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


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


class _Handlers:
    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        k: float(v)
        for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")
    }


def check(target: str) -> subprocess.CompletedProcess[str]:
    """`rebalancer sidecar --check`: what the startup and liveness probes run."""
    return subprocess.run(
        [sys.executable, "-m", "rebalancer", "sidecar", "--check", target, "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def start_sidecar(
    target: str, controller: str, log_path: Path, *credentials: str
) -> subprocess.Popen[str]:
    with log_path.open("w") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rebalancer",
                "sidecar",
                "--listen",
                target,
                "--controller",
                controller,
                "--ranks",
                "0-1",
                "--pod",
                "ns/a",
                "--metrics-port",
                "0",
                "--metrics-host",
                "127.0.0.1",
                "--grace",
                "1",
                *credentials,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def serve_two_ranks(target: str, windows: int) -> list[WorkerAgent]:
    """The pod's two ranks on the socket, each having sent `windows` windows."""
    agents = [
        WorkerAgent(
            AgentConfig(
                Link(target, deployment="prod", worker_id=f"rank {rank}"), rank, shape_of(SHAPE)
            ),
            _Handlers(),
            lambda: 0,
        )
        for rank in (0, 1)
    ]
    for agent in agents:
        agent.start()
    for agent in agents:
        assert agent.connected.wait(30), "a rank could not connect to the sidecar"
    counts = np.arange(8, dtype=np.int64).reshape(2, 4)
    for step in range(windows):
        for agent in agents:
            agent.submit_window(step * 16, 16, 0, counts, None)
    return agents


def test_sidecar_without_its_secrets_serves_its_ranks_and_connects_once_they_appear(
    pki: Path, tmp_path: Path
) -> None:
    ctl = start_controller(
        tmp_path / "c.sqlite",
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )  # mutual TLS, no [worker_tokens]
    assert ctl.server is not None
    creds = tmp_path / "credentials"  # the projected volume, with neither Secret there yet
    creds.mkdir()
    sockets = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))  # short: 107-byte socket paths
    target = f"unix://{sockets}/run/agent.sock"
    log_path = tmp_path / "sidecar.log"
    proc = start_sidecar(
        target,
        ctl.server.address,
        log_path,
        "--token-file",
        str(creds / "token"),
        "--ca",
        str(creds / "ca.crt"),
        "--cert",
        str(creds / "tls.crt"),
        "--key",
        str(creds / "tls.key"),
    )
    agents: list[WorkerAgent] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "sidecar serving on" in line, (line, proc.poll(), log_path.read_text()[-2000:])
        port = int(line.rsplit(":", 1)[1])
        probe = check(target)
        assert probe.returncode == 0, probe  # the engine may start
        assert (
            "no_credentials" in probe.stdout and f"{creds / 'ca.crt'}: no such file" in probe.stdout
        ), probe.stdout
        assert metrics(port)['rebalancer_sidecar_upstream_state{state="no_credentials"}'] == 1

        # The ranks are served: registered, streaming, their windows merged and held.
        agents = serve_two_ranks(target, 3)
        wait_for(
            lambda: metrics(port)["rebalancer_sidecar_windows_in_total"] == 6,
            30,
            "6 rank windows merged",
        )
        m = metrics(port)
        assert (
            m["rebalancer_sidecar_ranks_connected"] == 2
            and m["rebalancer_sidecar_buffer_depth"] == 3
        )
        assert (
            m["rebalancer_sidecar_upstream_up"] == 0
            and m["rebalancer_sidecar_windows_out_total"] == 0
        )

        # The client TLS Secret appears (no worker-token Secret at all): read at the next try.
        for name, source in (
            ("ca.crt", "ca.crt"),
            ("tls.crt", "client.crt"),
            ("tls.key", "client.key"),
        ):
            shutil.copy(pki / source, creds / name)
        wait_for(
            lambda: metrics(port)["rebalancer_sidecar_upstream_up"] == 1,
            30,
            "the group stream with mutual TLS",
        )
        folded = lambda: ctl.call(  # noqa: E731
            lambda: ctl.server.controller.deployments["prod"].estimator.windows
        )  # type: ignore[union-attr]
        wait_for(lambda: folded() == 3, 30, "the 3 held windows folded at the controller")
        probe = check(target)
        assert (
            probe.returncode == 0
            and "controller link: connected (without a worker token)" in probe.stdout
        ), probe
    finally:
        for agent in agents:
            agent.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        ctl.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    assert code == 0
    text = log_path.read_text()
    # Said once, not once per attempt (it tried about every 2 s meanwhile).
    assert text.count("cannot connect to the controller") == 1, text
    assert text.count("no worker token") == 1, text


def test_sidecar_refused_for_want_of_a_token_serves_its_ranks_and_says_why(tmp_path: Path) -> None:
    """A controller with [worker_tokens] and a sidecar whose token Secret is missing: the
    pod is refused (UNAUTHENTICATED), the ranks are served and their windows held, the log
    and --check say which file is missing; the token file appears and the pod connects."""
    ctl = start_controller(tmp_path / "c.sqlite", worker_tokens={"prod": "p-token"})
    assert ctl.server is not None
    token = tmp_path / "token"
    sockets = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    target = f"unix://{sockets}/run/agent.sock"
    log_path = tmp_path / "sidecar.log"
    proc = start_sidecar(target, ctl.server.address, log_path, "--token-file", str(token))
    agents: list[WorkerAgent] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "sidecar serving on" in line, (line, proc.poll(), log_path.read_text()[-2000:])
        port = int(line.rsplit(":", 1)[1])
        agents = serve_two_ranks(target, 2)
        wait_for(
            lambda: metrics(port)['rebalancer_sidecar_upstream_state{state="refused"}'] == 1,
            30,
            "refused",
        )
        wait_for(
            lambda: metrics(port)["rebalancer_sidecar_buffer_depth"] == 2,
            30,
            "2 merged windows held",
        )
        probe = check(target)
        assert probe.returncode == 0, probe
        assert (
            "controller link: refused (UNAUTHENTICATED: worker calls need 'authorization: Bearer "
            f"<token>' (sent without a token: {token}: no such file (worker token)))"
            in probe.stdout
        ), probe.stdout
        token.write_text("p-token\n")  # the Secret, projected late
        wait_for(
            lambda: metrics(port)["rebalancer_sidecar_upstream_up"] == 1,
            30,
            "connected with the token",
        )
        folded = lambda: ctl.call(  # noqa: E731
            lambda: ctl.server.controller.deployments["prod"].estimator.windows
        )  # type: ignore[union-attr]
        wait_for(lambda: folded() == 2, 30, "the 2 held windows folded at the controller")
    finally:
        for agent in agents:
            agent.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        ctl.stop()
        shutil.rmtree(sockets, ignore_errors=True)
    assert code == 0
    assert log_path.read_text().count("controller refused the pod (UNAUTHENTICATED") == 1
