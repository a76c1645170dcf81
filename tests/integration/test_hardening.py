"""Hardening of the controller, through real `rebalancer serve` processes and real servers.

- One controller per store and port: a second one is refused (exit 7, one line), and a
  controller killed with SIGKILL leaves a store that reopens at once.
- Safe by default: without credentials only loopback; another host needs --insecure, and
  what is open is logged as a WARNING.
- Every error a user can reach ends in one line on stderr and an exit code, never a
  traceback.
- Security: a worker token cannot call the admin service; TLS and mutual TLS refuse a
  wrong CA and a missing client certificate; oversized messages get RESOURCE_EXHAUSTED
  and change nothing; no token appears in the log or on /metrics.

Every process started here is reaped in `finally` (tests/conftest.py fails on leaks).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rebalancer.controller.embedded import EmbeddedController
from rebalancer.launch.processes import free_port
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import client_options, sync_channel
from rebalancer.wire.link import Link
from tests.integration.conftest import start_controller
from tests.integration.test_security import openssl

ROOT = Path(__file__).resolve().parents[2]
SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=4, num_gpus=1, num_nodes=1
)
IN_USE, BAD_INPUT = 7, 2

ADMIN_TOKEN = "adm-7f3a9c1e5b2d4f60a8e1"
WORKER_TOKEN = "wrk-4b8e2a6c0d9f1e3a5c7b"
OTHER_WORKER_TOKEN = "wrk-0c2e4a6b8d1f3e5a7c9b"
WRONG_TOKEN = "bad-9e8d7c6b5a4f3e2d1c0b"
SECRETS = (ADMIN_TOKEN, WORKER_TOKEN, OTHER_WORKER_TOKEN, WRONG_TOKEN)


# ------------------------------------------------------------------ helpers


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`python -m rebalancer ARGS` to the end; stdout and stderr captured."""
    return subprocess.run(
        [sys.executable, "-m", "rebalancer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def assert_one_line_error(run: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Exit `code`, exactly one line on stderr holding every one of `words`, no traceback."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == code, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr
    assert len(lines) == 1, run.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


class Serve:
    """A `rebalancer serve` process; `wait_serving` reads its "serving on" line."""

    def __init__(self, *args: str, log_level: str = "INFO") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rebalancer", "serve", *args, "--log-level", log_level],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.stderr_lines: list[str] = []
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def wait_serving(self, timeout: float = 60) -> str:
        line: list[str] = []
        assert self.proc.stdout is not None
        reader = threading.Thread(
            target=lambda: line.append(self.proc.stdout.readline()), daemon=True
        )  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        assert line and "serving on" in line[0], (line, self.stderr)
        return line[0]

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self._drain.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._drain.join(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def procs() -> Iterator[list[Serve]]:
    """Every serve process a test starts; all reaped however the test ends."""
    started: list[Serve] = []
    try:
        yield started
    finally:
        for p in started:
            p.reap()


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        return int(reply.status)


def register(address: str, token: str | None = None, deployment: str = "prod") -> str:
    config = Link(address, token=token)
    with sync_channel(config) as channel:
        reply = pb_grpc.WorkerServiceStub(channel).Register(
            pb.RegisterRequest(deployment=deployment, rank=0, shape=SHAPE),
            timeout=5,
            metadata=config.metadata(),
        )
        return str(reply.session_id)


def listening_socket() -> socket.socket:
    """A port held the way another server would hold it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


# ---------------------------------------------------------------- one controller per store and port


def test_second_controller_on_the_same_port_is_refused(tmp_path: Path, procs: list[Serve]) -> None:
    port = free_port()
    first = Serve("--port", str(port), "--db", str(tmp_path / "a.sqlite"))
    procs.append(first)
    first.wait_serving()
    second = Serve("--port", str(port), "--db", str(tmp_path / "b.sqlite"))
    procs.append(second)
    assert second.wait(60) == IN_USE
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert lines == [
        f"rebalancer serve: error: gRPC port {port} is in use (another controller?)"
    ], second.stderr
    # The first one still serves, alone: every call reaches it.
    for _ in range(5):
        assert health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
    register(f"127.0.0.1:{port}")
    assert first.proc.poll() is None


def test_second_controller_on_the_same_store_is_refused(tmp_path: Path, procs: list[Serve]) -> None:
    db = tmp_path / "c.sqlite"
    first = Serve("--port", str(free_port()), "--db", str(db))
    procs.append(first)
    first.wait_serving()
    run = cli("serve", "--port", str(free_port()), "--db", str(db))
    line = assert_one_line_error(
        run, IN_USE, f"store {db} is in use by another controller", f"pid {first.proc.pid}"
    )
    assert line.startswith("rebalancer serve: error: ")
    assert first.proc.poll() is None


def test_a_link_to_a_store_in_use_is_refused(tmp_path: Path, procs: list[Serve]) -> None:
    """The lock is keyed on the store file, not on the path given: `--db link.sqlite`, a
    symbolic link to the store of a running controller, is refused like the store itself."""
    db, link = tmp_path / "c.sqlite", tmp_path / "link.sqlite"
    link.symlink_to(db)
    first = Serve("--port", str(free_port()), "--db", str(db))
    procs.append(first)
    first.wait_serving()
    run = cli("serve", "--port", str(free_port()), "--db", str(link))
    assert_one_line_error(
        run, IN_USE, f"store {link} is in use by another controller", f"pid {first.proc.pid}"
    )
    assert first.proc.poll() is None


def test_refused_starts_leave_no_files(tmp_path: Path, procs: list[Serve]) -> None:
    """A start refused after it took the store's lock (a busy port) leaves neither the lock
    file nor a store behind; a controller that stops cleanly leaves only its store."""
    busy = listening_socket()
    try:
        run = cli("serve", "--port", str(busy.getsockname()[1]), "--db", str(tmp_path / "c.sqlite"))
        assert_one_line_error(run, IN_USE, "is in use")
    finally:
        busy.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    serve = Serve("--port", str(free_port()), "--db", str(tmp_path / "c.sqlite"))
    procs.append(serve)
    serve.wait_serving()
    assert (tmp_path / "c.sqlite.lock").exists()  # held while it runs
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.wait(30) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.sqlite"]


def test_sigkilled_controllers_store_reopens_at_once(tmp_path: Path, procs: list[Serve]) -> None:
    db, port = tmp_path / "c.sqlite", free_port()
    first = Serve("--port", str(port), "--db", str(db))
    procs.append(first)
    first.wait_serving()
    register(f"127.0.0.1:{port}")
    first.proc.send_signal(signal.SIGKILL)
    first.wait(30)
    started = time.monotonic()
    second = Serve("--port", str(port), "--db", str(db))  # same store, same port, right away
    procs.append(second)
    second.wait_serving()
    assert time.monotonic() - started < 30
    assert "is in use" not in second.stderr
    with sync_channel(Link(f"127.0.0.1:{port}")) as channel:
        status = pb_grpc.AdminServiceStub(channel).Status(pb.StatusRequest(), timeout=5)
    assert [d.deployment for d in status.deployments] == ["prod"]  # nothing lost
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0


def test_a_failed_start_releases_the_store_without_a_traceback(tmp_path: Path) -> None:
    """The metrics port taken after the checks (a race the probe cannot see): the started
    gRPC server is stopped inside the event loop (no "Event loop is closed" traceback),
    the store's lock released, exit 7 with one line."""
    busy = listening_socket()
    try:
        metrics_port = busy.getsockname()[1]
        code = (
            "import sys\n"
            "import rebalancer.controller.server as server\n"
            "real = server.probe_port\n"
            "server.probe_port = lambda host, port, what: None if what == 'metrics' else "
            "real(host, port, what)\n"
            "from rebalancer.cli import main\n"
            f"sys.exit(main(['serve', '--port', '0', '--db', {str(tmp_path / 'c.sqlite')!r}, "
            f"'--metrics-port', '{metrics_port}']))\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=ROOT
        )
        assert_one_line_error(
            run, IN_USE, f"metrics port {metrics_port} is in use (another controller?)"
        )
        assert "Event loop is closed" not in run.stderr
    finally:
        busy.close()


# ------------------------------------------------------------------ safe by default


def test_non_loopback_without_credentials_is_refused(tmp_path: Path) -> None:
    run = cli("serve", "--host", "0.0.0.0", "--port", "0", "--db", str(tmp_path / "c.sqlite"))
    assert_one_line_error(
        run,
        BAD_INPUT,
        "refusing to listen on 0.0.0.0",
        "admin service",
        "worker service",
        "--insecure",
    )
    assert not (tmp_path / "c.sqlite").exists()  # refused before anything was opened
    # The shipped config listens on 0.0.0.0 without tokens: refused the same way.
    run = cli(
        "serve",
        "--config",
        str(ROOT / "deploy" / "controller.toml"),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--db",
        str(tmp_path / "c.sqlite"),
    )
    assert_one_line_error(run, BAD_INPUT, "refusing to listen on 0.0.0.0")
    # An admin token alone leaves the worker service open: still refused, naming it.
    (tmp_path / "admin-token").write_text(ADMIN_TOKEN + "\n")
    run = cli(
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--db",
        str(tmp_path / "c.sqlite"),
        "--admin-token-file",
        str(tmp_path / "admin-token"),
    )
    line = assert_one_line_error(
        run, BAD_INPUT, "the worker service unauthenticated", "[worker_tokens]"
    )
    assert "admin service" not in line and ADMIN_TOKEN not in run.stderr


def warnings_of(serve: Serve) -> list[str]:
    return [line for line in serve.stderr.splitlines() if " WARNING " in line]


def test_insecure_allows_and_warns(tmp_path: Path, procs: list[Serve]) -> None:
    port = free_port()
    insecure = Serve(
        "--host", "0.0.0.0", "--insecure", "--port", str(port), "--db", str(tmp_path / "a.sqlite")
    )
    procs.append(insecure)
    insecure.wait_serving()
    assert health(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.SERVING
    insecure.proc.send_signal(signal.SIGTERM)
    assert insecure.wait(30) == 0
    warned = warnings_of(insecure)
    assert any(
        "admin service unauthenticated" in w and "0.0.0.0, not loopback" in w for w in warned
    ), warned
    assert any("worker service unauthenticated" in w for w in warned), warned
    assert any("TLS off" in w for w in warned), warned
    # The same from the config file: server.insecure = true.
    (tmp_path / "c.toml").write_text('[server]\nhost = "0.0.0.0"\ninsecure = true\n')
    from_file = Serve(
        "--config",
        str(tmp_path / "c.toml"),
        "--port",
        str(free_port()),
        "--db",
        str(tmp_path / "b.sqlite"),
    )
    procs.append(from_file)
    from_file.wait_serving()
    from_file.proc.send_signal(signal.SIGTERM)
    assert from_file.wait(30) == 0
    assert any("worker service unauthenticated" in w for w in warnings_of(from_file))


def test_loopback_without_credentials_serves_and_warns(tmp_path: Path, procs: list[Serve]) -> None:
    local = Serve("--port", str(free_port()), "--db", str(tmp_path / "c.sqlite"))
    procs.append(local)
    local.wait_serving()
    local.proc.send_signal(signal.SIGTERM)
    assert local.wait(30) == 0
    warned = warnings_of(local)
    assert any("admin service unauthenticated" in w and "loopback only" in w for w in warned), (
        warned
    )
    assert any("worker service unauthenticated" in w for w in warned), warned


def test_credentials_allow_any_host_and_only_tls_is_warned(
    tmp_path: Path, procs: list[Serve]
) -> None:
    (tmp_path / "admin-token").write_text(ADMIN_TOKEN + "\n")
    (tmp_path / "c.toml").write_text(
        f'[server]\nhost = "0.0.0.0"\n[worker_tokens]\nprod = "{WORKER_TOKEN}"\n'
    )
    port = free_port()
    server = Serve(
        "--config",
        str(tmp_path / "c.toml"),
        "--admin-token-file",
        str(tmp_path / "admin-token"),
        "--port",
        str(port),
        "--db",
        str(tmp_path / "c.sqlite"),
    )
    procs.append(server)
    server.wait_serving()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    warned = warnings_of(server)
    assert not any("unauthenticated" in w for w in warned), warned
    assert any("TLS off" in w for w in warned), warned


# ------------------------------------------------------------------ one line and an exit code


def test_store_errors(tmp_path: Path) -> None:
    run = cli("serve", "--port", "0", "--db", str(tmp_path / "missing" / "c.sqlite"))
    assert_one_line_error(run, BAD_INPUT, f"folder {tmp_path / 'missing'} does not exist")
    text = tmp_path / "notes.txt"
    text.write_text("these are notes, not a database\n" * 200)
    run = cli("serve", "--port", "0", "--db", str(text))
    assert_one_line_error(run, BAD_INPUT, f"store {text}", "not an SQLite database")
    assert text.read_text().startswith("these are notes")  # untouched
    run = cli("serve", "--port", "0", "--db", str(tmp_path))
    assert_one_line_error(run, BAD_INPUT, "is a folder, not an SQLite file")


def test_plan_out_into_a_missing_folder(tmp_path: Path) -> None:
    counts = ROOT / "rebalancer" / "data" / "deepseek-v3" / "prefill_in4096.json"
    if not counts.exists():
        pytest.skip("routing data not shipped")
    out = tmp_path / "missing" / "placement.json"
    run = cli(
        "plan",
        "--counts",
        str(counts),
        "--gpus",
        "32",
        "--slots",
        "288",
        "--nodes",
        "4",
        "--out",
        str(out),
    )
    assert_one_line_error(run, BAD_INPUT, f"--out {out}: folder {out.parent} does not exist")
    run = cli(
        "plan",
        "--counts",
        str(counts),
        "--gpus",
        "32",
        "--slots",
        "288",
        "--nodes",
        "4",
        "--sglang-out",
        str(tmp_path),
    )
    assert_one_line_error(run, BAD_INPUT, "--sglang-out", "is a folder, not a file")


def test_busy_ports(tmp_path: Path) -> None:
    busy = listening_socket()
    try:
        port = busy.getsockname()[1]
        run = cli(
            "serve", "--port", "0", "--metrics-port", str(port), "--db", str(tmp_path / "c.sqlite")
        )
        assert_one_line_error(run, IN_USE, f"metrics port {port} is in use (another controller?)")
        run = cli("serve", "--port", str(port), "--db", str(tmp_path / "c.sqlite"))
        assert_one_line_error(run, IN_USE, f"gRPC port {port} is in use (another controller?)")
    finally:
        busy.close()
    port = free_port()
    run = cli(
        "serve",
        "--port",
        str(port),
        "--metrics-port",
        str(port),
        "--db",
        str(tmp_path / "c.sqlite"),
    )
    assert_one_line_error(run, BAD_INPUT, f"both {port}")


def test_unusable_tls_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    db = str(tmp_path / "c.sqlite")
    run = cli(
        "serve", "--port", "0", "--db", db, "--tls-cert", str(garbage), "--tls-key", str(garbage)
    )
    assert_one_line_error(run, BAD_INPUT, f"tls cert {garbage}: no PEM certificate in it")
    run = cli(
        "serve", "--port", "0", "--db", db, "--tls-cert", str(tmp_path), "--tls-key", str(garbage)
    )
    assert_one_line_error(run, BAD_INPUT, f"tls_cert {tmp_path}: is a folder")
    run = cli(
        "serve",
        "--port",
        "0",
        "--db",
        db,
        "--tls-cert",
        str(tmp_path / "nope.crt"),
        "--tls-key",
        str(garbage),
    )
    assert_one_line_error(run, BAD_INPUT, "nope.crt: no such file")
    if os.geteuid() != 0:  # root reads a file whatever its mode
        locked = tmp_path / "locked.pem"
        locked.write_text("-----BEGIN CERTIFICATE-----\n")
        locked.chmod(0)
        run = cli(
            "serve", "--port", "0", "--db", db, "--tls-cert", str(locked), "--tls-key", str(garbage)
        )
        assert_one_line_error(run, BAD_INPUT, f"tls cert {locked}: cannot read it")


def test_config_file_errors(tmp_path: Path) -> None:
    run = cli("serve", "--config", str(tmp_path))
    assert_one_line_error(run, BAD_INPUT, f"config {tmp_path}: is a folder, not a file")
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[server]\nhost = "h\xf6st"\n')
    run = cli("serve", "--config", str(latin))
    assert_one_line_error(run, BAD_INPUT, "not UTF-8")
    for text, words in (
        ("server = 5\n", "server must be a table"),
        ("[server]\nport = true\n", "port must be a port number"),
        ("[server]\ntick_seconds = -1.0\n", "tick_seconds"),
        ("[server]\ninsecure = 'yes'\n", "insecure must be true or false"),
        ("[server]\nadmin_token_file = 5\n", "admin_token_file must be a file name"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        assert_one_line_error(cli("serve", "--config", str(bad)), BAD_INPUT, words)


def test_help_lists_every_exit_code() -> None:
    run = cli("--help")
    assert run.returncode == 0
    for code in ("0", "1", "2", "3", "4", "5", "6", "7", "130"):
        assert any(line.strip().startswith(code + " ") for line in run.stdout.splitlines()), code
    from rebalancer.cli.admin_cmd import EXIT_CODES

    for status in EXIT_CODES:
        assert status in run.stdout, status


# ------------------------------------------------------------------ security


def test_worker_token_cannot_call_the_admin_service(tmp_path: Path) -> None:
    ctl = start_controller(
        tmp_path / "c.sqlite", admin_token=ADMIN_TOKEN, worker_tokens={"prod": WORKER_TOKEN}
    )
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        register(address, WORKER_TOKEN)
        with grpc.insecure_channel(address) as channel:
            admin = pb_grpc.AdminServiceStub(channel)
            for token, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                (WORKER_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
                (WRONG_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
            ):
                metadata = (("authorization", f"Bearer {token}"),) if token else ()
                for call, request in (
                    (admin.Status, pb.StatusRequest()),
                    (admin.Pause, pb.DeploymentRef(deployment="prod")),
                    (admin.ForceRebalance, pb.ForceRebalanceRequest(deployment="prod")),
                ):
                    with pytest.raises(grpc.RpcError) as info:
                        call(request, timeout=5, metadata=metadata)
                    assert info.value.code() == code, (token, call)
            # Nothing changed: not paused, no plan; the admin token works.
            status = admin.Status(
                pb.StatusRequest(deployment="prod"),
                timeout=5,
                metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
            ).deployments[0]
            assert not status.paused and status.placement_version == 0
            # And the admin token is not a worker token.
            with pytest.raises(grpc.RpcError) as info:
                register(address, ADMIN_TOKEN)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        ctl.stop()


@pytest.fixture(scope="module")
def two_cas(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two CAs: `ca` signs the server and `client`; `other-ca` signs `stranger`."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("pki2")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other-ca"):
        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.crt",
            "-days",
            "2",
            "-subj",
            f"/CN={ca}",
            cwd=d,
        )
    for name, ca in (("server", "ca"), ("client", "ca"), ("stranger", "other-ca")):
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
            f"{ca}.crt",
            "-CAkey",
            f"{ca}.key",
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


def deployments(ctl: EmbeddedController) -> int:
    return int(ctl.call(lambda: len(ctl.server.controller.deployments)))  # type: ignore[union-attr,arg-type]


def test_tls_refuses_a_wrong_ca(two_cas: Path, tmp_path: Path) -> None:
    d = two_cas
    ctl = start_controller(
        tmp_path / "c.sqlite", tls_cert=str(d / "server.crt"), tls_key=str(d / "server.key")
    )
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        for config in (
            Link(address, str(d / "other-ca.crt")),  # does not trust the server
            Link(address),
        ):  # plain text to a TLS port
            with pytest.raises(grpc.RpcError) as info:
                with sync_channel(config) as channel:
                    pb_grpc.WorkerServiceStub(channel).Register(
                        pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE), timeout=5
                    )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert deployments(ctl) == 0
        with sync_channel(Link(address, str(d / "ca.crt"))) as channel:
            assert (
                pb_grpc.WorkerServiceStub(channel)
                .Register(pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE), timeout=5)
                .session_id
            )
    finally:
        ctl.stop()


def test_mutual_tls_refuses_a_missing_or_foreign_client_certificate(
    two_cas: Path, tmp_path: Path
) -> None:
    d = two_cas
    ctl = start_controller(
        tmp_path / "c.sqlite",
        tls_cert=str(d / "server.crt"),
        tls_key=str(d / "server.key"),
        tls_client_ca=str(d / "ca.crt"),
    )
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        for config in (
            Link(address, str(d / "ca.crt")),  # no certificate
            Link(
                address, str(d / "ca.crt"), str(d / "stranger.crt"), str(d / "stranger.key")
            ),  # other CA
            Link(address, str(d / "other-ca.crt"), str(d / "client.crt"), str(d / "client.key")),
        ):
            for call in ("worker", "admin"):
                with pytest.raises(grpc.RpcError) as info:
                    with sync_channel(config) as channel:
                        if call == "worker":
                            pb_grpc.WorkerServiceStub(channel).Register(
                                pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE),
                                timeout=5,
                            )
                        else:
                            pb_grpc.AdminServiceStub(channel).Pause(
                                pb.DeploymentRef(deployment="prod"), timeout=5
                            )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (config, call)
        assert deployments(ctl) == 0
        good = Link(address, str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))
        with sync_channel(good) as channel:
            assert (
                pb_grpc.WorkerServiceStub(channel)
                .Register(pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE), timeout=5)
                .session_id
            )
        assert deployments(ctl) == 1
    finally:
        ctl.stop()


def test_admin_names_the_likely_cause_of_a_tls_failure(two_cas: Path, tmp_path: Path) -> None:
    """`rebalancer admin` against mutual TLS with a missing, foreign or untrusting
    certificate, or plain text to TLS and TLS to plain text: exit 5 and one line naming
    the likely cause, not "Socket closed" nor gRPC's handshake log lines."""
    d = two_cas
    ctl = start_controller(
        tmp_path / "c.sqlite",
        tls_cert=str(d / "server.crt"),
        tls_key=str(d / "server.key"),
        tls_client_ca=str(d / "ca.crt"),
    )
    plain = start_controller(tmp_path / "p.sqlite")
    address, plain_address = ctl.server.address, plain.server.address  # type: ignore[union-attr]
    ca, other_ca = str(d / "ca.crt"), str(d / "other-ca.crt")
    client, stranger = (
        (str(d / "client.crt"), str(d / "client.key")),
        (str(d / "stranger.crt"), str(d / "stranger.key")),
    )
    cases = [
        (
            (address, "--ca", ca),
            "it likely asks for a client certificate (mutual TLS): give --cert and --key",
        ),
        (
            (address, "--ca", ca, "--cert", stranger[0], "--key", stranger[1]),
            f"it likely does not accept the client certificate {stranger[0]}",
        ),
        (
            (address, "--ca", other_ca, "--cert", client[0], "--key", client[1]),
            f"the server's certificate is not signed by the CA of --ca {other_ca}",
        ),
        ((address,), "it likely serves TLS (give --ca"),
        ((plain_address, "--ca", ca), f"the server at {plain_address} does not speak TLS"),
    ]
    try:
        for (where, *flags), cause in cases:
            run = cli("admin", "--address", where, "--timeout", "10", *flags, "status")
            assert_one_line_error(run, 5, "UNAVAILABLE: ", cause)
            assert "Socket closed" not in run.stderr and "ssl_transport_security" not in run.stderr
        run = cli(
            "admin",
            "--address",
            address,
            "--timeout",
            "10",
            "--ca",
            ca,
            "--cert",
            client[0],
            "--key",
            client[1],
            "status",
        )
        assert run.returncode == 0 and run.stdout.strip() == "no deployments", run.stderr
    finally:
        ctl.stop()
        plain.stop()


def test_admin_with_a_key_that_is_not_its_certificates(two_cas: Path, tmp_path: Path) -> None:
    """A client key that does not match the client certificate is bad input named as such
    (exit 2, one line, nothing sent), not a controller that reads as unreachable."""
    d = two_cas
    ctl = start_controller(
        tmp_path / "c.sqlite",
        tls_cert=str(d / "server.crt"),
        tls_key=str(d / "server.key"),
        tls_client_ca=str(d / "ca.crt"),
    )
    try:
        run = cli(
            "admin",
            "--address",
            ctl.server.address,
            "--timeout",
            "10",  # type: ignore[union-attr]
            "--ca",
            str(d / "ca.crt"),
            "--cert",
            str(d / "client.crt"),
            "--key",
            str(d / "stranger.key"),
            "pause",
            "prod",
        )
        assert_one_line_error(
            run,
            BAD_INPUT,
            f"client key {d / 'stranger.key'} is not the key of client "
            f"certificate {d / 'client.crt'}",
        )
        assert "UNAVAILABLE" not in run.stderr
    finally:
        ctl.stop()


def test_admin_at_the_metrics_port_says_it_is_not_grpc(tmp_path: Path) -> None:
    """`admin --address` naming the controller's metrics port (HTTP) says so in one line,
    not gRPC's HTTP/2 parse error."""
    ctl = start_controller(tmp_path / "c.sqlite", metrics_port=0)
    try:
        where = f"127.0.0.1:{ctl.server.metrics_port}"  # type: ignore[union-attr]
        run = cli("admin", "--address", where, "--timeout", "10", "status")
        assert_one_line_error(
            run,
            5,
            "UNAVAILABLE: ",
            f"the server at {where} answers HTTP, not gRPC",
            "not the controller's gRPC port",
        )
        assert "HTTP/2" not in run.stderr and "SETTINGS frame" not in run.stderr
    finally:
        ctl.stop()


def test_tls_key_that_is_not_the_certificates(two_cas: Path, tmp_path: Path) -> None:
    d = two_cas
    run = cli(
        "serve",
        "--port",
        "0",
        "--db",
        str(tmp_path / "c.sqlite"),
        "--tls-cert",
        str(d / "server.crt"),
        "--tls-key",
        str(d / "client.key"),
    )
    assert_one_line_error(run, BAD_INPUT, f"tls key {d / 'client.key'} is not the key of tls cert")


def test_message_size_limit_holds_and_changes_nothing(tmp_path: Path) -> None:
    limit = 64 * 1024
    ctl = start_controller(tmp_path / "c.sqlite", max_message_bytes=limit, ack_interval_seconds=0.0)
    address = ctl.server.address  # type: ignore[union-attr]
    try:
        with grpc.insecure_channel(address, options=client_options()) as channel:
            worker = pb_grpc.WorkerServiceStub(channel)
            admin = pb_grpc.AdminServiceStub(channel)
            # A unary call over the limit: refused before the service sees it.
            with pytest.raises(grpc.RpcError) as info:
                worker.Register(
                    pb.RegisterRequest(deployment="x" * (2 * limit), rank=0, shape=SHAPE), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert deployments(ctl) == 0
            session = worker.Register(
                pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE), timeout=5
            ).session_id
            hello = pb.WorkerMessage(hello=pb.Hello(session_id=session))
            # A window over the limit on the stream: the stream ends RESOURCE_EXHAUSTED.
            huge = pb.Array(dtype=pb.DTYPE_INT64, shape=[2, 4], data=b"\0" * (2 * limit))
            big = pb.WorkerMessage(window=pb.Window(seq=0, num_steps=1, logical_count=huge))
            with pytest.raises(grpc.RpcError) as info:
                list(worker.Stream(iter([hello, big]), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = admin.Status(pb.StatusRequest(deployment="prod"), timeout=5).deployments[0]
            assert status.windows_ingested == 0 and status.placement_version == 0
            # The controller is fine: the rank registers again (its stream ended) and the
            # same window at its real size goes in.
            session = worker.Register(
                pb.RegisterRequest(deployment="prod", rank=0, shape=SHAPE), timeout=5
            ).session_id
            hello = pb.WorkerMessage(hello=pb.Hello(session_id=session))
            counts = codec.encode(np.array([[5, 1, 1, 1], [1, 1, 1, 9]], dtype=np.int64))
            small = pb.WorkerMessage(window=pb.Window(seq=0, num_steps=1, logical_count=counts))
            list(worker.Stream(iter([hello, small]), timeout=10))
            deadline = time.monotonic() + 10
            while (
                admin.Status(pb.StatusRequest(deployment="prod"), timeout=5)
                .deployments[0]
                .windows_ingested
                < 1
            ):
                assert time.monotonic() < deadline, "the window of normal size was not ingested"
                time.sleep(0.05)
    finally:
        ctl.stop()


def test_no_secret_in_logs_or_metrics(tmp_path: Path, procs: list[Serve]) -> None:
    (tmp_path / "admin-token").write_text(ADMIN_TOKEN + "\n")
    (tmp_path / "c.toml").write_text(
        f'[worker_tokens]\nprod = "{WORKER_TOKEN}"\ncanary = "{OTHER_WORKER_TOKEN}"\n'
    )
    port, metrics_port = free_port(), free_port()
    server = Serve(
        "--config",
        str(tmp_path / "c.toml"),
        "--admin-token-file",
        str(tmp_path / "admin-token"),
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--db",
        str(tmp_path / "c.sqlite"),
        log_level="DEBUG",
    )
    procs.append(server)
    server.wait_serving()
    address = f"127.0.0.1:{port}"
    # Every kind of auth failure, and successes, on both services.
    register(address, WORKER_TOKEN)
    for token in (None, WRONG_TOKEN, OTHER_WORKER_TOKEN, ADMIN_TOKEN):
        with pytest.raises(grpc.RpcError):
            register(address, token)
    with grpc.insecure_channel(address) as channel:
        admin = pb_grpc.AdminServiceStub(channel)
        for token in (None, WRONG_TOKEN, WORKER_TOKEN, "Bearer-less " + WRONG_TOKEN):
            metadata: Sequence[tuple[str, str]] = (
                (("authorization", f"Bearer {token}"),) if token else ()
            )
            if token and token.startswith("Bearer-less"):
                metadata = (("authorization", token),)
            with pytest.raises(grpc.RpcError):
                admin.Status(pb.StatusRequest(), timeout=5, metadata=metadata)
        admin.Status(
            pb.StatusRequest(), timeout=5, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)
        )
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert "rebalancer_build_info" in metrics
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0
    log = server.stderr
    assert "refused" in log  # the failures were logged, just without the tokens
    for secret in SECRETS:
        assert secret not in log, f"a token is in the log: {secret}"
        assert secret not in metrics, f"a token is on /metrics: {secret}"
