"""The controller process: one grpc.aio server with both services.

Standard health checking (per service; NOT_SERVING until loaded and while
draining) and reflection are registered; keepalive and message sizes are set
on purpose (config.py); bearer tokens are checked by one interceptor (auth.py).
Shutdown drains: health flips to NOT_SERVING, new calls are refused, calls in
flight get `grace_seconds`, the decision process ends (decision_process.py) and every ingest
cursor is saved before the store closes.

One controller per store and port: the store's lock (store.StoreLock) is taken before
the store is opened, and the gRPC port is bound without SO_REUSEPORT (wire/channel.py),
so a second controller on either is refused with InUseError instead of sharing. Every
failure to start (store, TLS files, ports) is an InputError of one line naming the
reason, raised after undoing whatever had started.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sqlite3
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rebalancer.controller import exposition
from rebalancer.controller.admin import AdminService
from rebalancer.controller.auth import ADMIN_SERVICE, WORKER_SERVICE, TokenAuth
from rebalancer.controller.config import (
    ControllerConfig,
    check_exposure,
    exposure_warnings,
    validate_config,
)
from rebalancer.controller.decision_process import DecisionProcess
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.service import WorkerService
from rebalancer.controller.state import Controller
from rebalancer.controller.store import InUseError, Store, StoreLock, check_store_path
from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import check_key_pair, server_options
from rebalancer.wire.service import add_service

log = logging.getLogger("rebalancer.server")

SERVICE_NAMES = (WORKER_SERVICE, ADMIN_SERVICE)


def preflight(config: ControllerConfig) -> grpc.ServerCredentials | None:
    """Every check of the settings that can refuse a start, in one pass and before
    anything is opened, so a refused start changes nothing: settings in range, exposure,
    the store's path, the ports apart, the TLS files usable. Returns the server's TLS
    credentials (None without TLS). InputError of one line naming the reason."""
    validate_config(config)
    check_exposure(config)
    check_store_path(config.db_path)
    if config.metrics_port and config.metrics_port == config.port:
        raise InputError(
            f"metrics port and gRPC port are both {config.port}: "
            f"the metrics need a port of their own"
        )
    return _tls_credentials(config)


class ControllerServer:
    """Owns the store, the controller state, the gRPC server and the tick task.

    Built in one line of steps, each pushing its undo onto one exit stack: a start that
    fails half-way unwinds what it had opened, and `stop` drains, then unwinds the same
    stack (tick, gRPC server with its grace, metrics, decision process, the ingest
    cursors saved, store, lock), so start-up and teardown cannot drift apart."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        tls = preflight(config)
        self._grace: float | None = None  # the gRPC server's grace when the stack unwinds
        self._opened = contextlib.ExitStack()  # what __init__ opened, synchronously
        try:
            self._open(config, tls)
        except BaseException:
            self._opened.close()
            raise
        self._stack = contextlib.AsyncExitStack()
        self._tick_task: asyncio.Task[None] | None = None
        self._metrics_http: Any = None
        self.metrics_port: int | None = None
        self._started = False
        self._stopping = False
        self._stopped = asyncio.Event()

    def _open(self, config: ControllerConfig, tls: grpc.ServerCredentials | None) -> None:
        opened = self._opened
        # The lock first, so a controller started twice with the same settings hears which
        # process holds the store; then the ports, each with its own message (gRPC reports
        # a failed bind without its reason).
        if config.db_path != ":memory:":
            opened.callback(StoreLock(config.db_path).release)
        probe_port(config.host, config.port, "gRPC")
        if config.metrics_port is not None:
            probe_port(config.host, config.metrics_port, "metrics")
        self.store = Store(config.db_path)
        opened.callback(self.store.close)
        # Decisions run in a process of their own (decision_process.py), started in `start`.
        self.decision_process = DecisionProcess()
        opened.callback(self.decision_process.close)
        try:
            self.controller = Controller(
                self.store,
                config.policy,
                config.persist_seconds,
                background=self.decision_process.submit,
                cursor_bytes_per_second=config.cursor_mb_per_second * 1e6,
                pool_max_moving=config.pool_max_moving,
                decision_cpu_share=config.decision_cpu_share,
                contingency_take_bytes_per_second=config.contingency_take_mb_per_second * 1e6,
                cpu_cores=config.cpu_cores,
            )
        except sqlite3.DatabaseError as exc:  # an SQLite file, but not one we can load
            raise InputError(f"store {config.db_path}: cannot load it ({exc})") from None
        self.auth = TokenAuth(config.admin_token, config.worker_tokens)
        self.server = grpc.aio.server(
            interceptors=[self.auth], options=server_options(config.max_message_bytes)
        )
        self.health = (
            health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        )
        self.metrics = ControllerMetrics(self.controller, config.per_layer_metrics, config.shard)
        # Requests that do not parse are refused with INVALID_ARGUMENT (wire/service.py).
        add_service(
            pb_grpc.add_WorkerServiceServicer_to_server,
            WorkerService(
                self.controller,
                self.auth.check_deployment,
                self.metrics.on_ingest,
                config.ack_interval_seconds,
                on_refused=self.metrics.on_refused,
                shard=config.shard,
            ),
            self.server,
        )
        add_service(
            pb_grpc.add_AdminServiceServicer_to_server, AdminService(self.controller), self.server
        )
        add_service(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        address = f"{_bracketed(config.host)}:{config.port}"
        try:
            if tls is not None:
                self.port = self.server.add_secure_port(address, tls)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            probe_port(config.host, config.port, "gRPC")  # taken meanwhile?
            raise InputError(f"cannot listen on {address} (gRPC)")

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        """Start serving; on failure (a busy metrics port, ...) everything started is
        stopped again, the store closed and its lock released, then the error raised."""
        stack = self._stack
        # Unwound last: what __init__ opened, after the cursors are saved.
        stack.enter_context(self._opened)
        stack.callback(self._save_cursors)
        try:
            self._start_metrics()  # first: the likeliest to fail
            self.decision_process.start()
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            stack.push_async_callback(self._stop_grpc)
            await self.server.start()
        except BaseException:
            self._stopping = True
            await stack.aclose()
            self._stopped.set()
            raise
        self._started = True
        self._tick_task = asyncio.create_task(self._ticker())
        stack.callback(self._tick_task.cancel)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        for line in exposure_warnings(self.config):
            log.warning("%s", line)
        shard = self.config.shard
        log.info(
            "controller serving on %s (store %s%s)",
            self.address,
            self.store.path,
            f"; shard {shard.index} of {shard.count}" if shard.count > 1 else "",
        )

    def _start_metrics(self) -> None:
        port = self.config.metrics_port
        if port is None:
            return
        try:
            self._metrics_http, _ = exposition.serve(self.config.host, port, self.metrics.scrape)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InUseError(f"metrics port {port} is in use (another controller?)") from None
            raise InputError(
                f"cannot serve metrics on {_bracketed(self.config.host)}:{port}: "
                f"{exc.strerror or exc}"
            ) from None
        self._stack.callback(self._metrics_http.server_close)
        self._stack.callback(self._metrics_http.shutdown)
        self.metrics_port = int(self._metrics_http.server_port)
        log.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)

    def _save_cursors(self) -> None:
        if self._started:  # a refused start writes nothing
            self.controller.persist_all()

    async def _stop_grpc(self) -> None:
        await self.server.stop(self._grace)
        self.decision_process.close()  # after the last call that could start a decision

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_seconds)
            try:
                for _ in self.controller.tick_steps():
                    await asyncio.sleep(0)  # windows that arrived meanwhile go first
            except Exception:  # a bug in one tick must not stop timeouts for good
                log.exception("tick failed")

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.decision_process.stop_accepting()  # no plan starts while draining
        log.info(
            "draining (%.1fs not ready, then grace %.1fs)",
            self.config.drain_seconds,
            self.config.grace_seconds,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Still serving, but reported NOT_SERVING: probes and balancers stop sending
        # new work before the port closes.
        await asyncio.sleep(self.config.drain_seconds)
        self._grace = self.config.grace_seconds
        await self._stack.aclose()
        self._stopped.set()
        log.info("controller stopped")

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(
    config: ControllerConfig, ready: Callable[[ControllerServer], None] | None = None
) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    server = ControllerServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
    if ready:
        ready(server)
    await server.wait()


def _bracketed(host: str) -> str:
    """An IPv6 literal in brackets, as `host:port` needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def probe_port(host: str, port: int, what: str) -> None:
    """Bind `host:port` as gRPC would (SO_REUSEADDR, no SO_REUSEPORT) and let go at once:
    InUseError when another process listens there, InputError for any other reason."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise InputError(f"cannot listen on {host}: unknown host ({exc.strerror})") from None
    failures: list[OSError] = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InUseError(f"{what} port {port} is in use (another controller?)") from None
            failures.append(exc)
    # gRPC listens on the addresses it can bind ("localhost" without IPv6: 127.0.0.1 only)
    # and fails only when none is left.
    if failures and len(failures) == len(infos):
        first = failures[0]
        raise InputError(
            f"cannot listen on {_bracketed(host)}:{port} ({what}): {first.strerror or first}"
        )


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except IsADirectoryError:
        raise InputError(f"{what} {path}: is a folder, not a file") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None


def _tls_credentials(config: ControllerConfig) -> grpc.ServerCredentials | None:
    """The server's TLS credentials, the files checked first with Python's own TLS: gRPC
    would only fail to bind the port, without saying which file is wrong or why."""
    if not (config.tls_cert and config.tls_key):
        return None
    cert = _read_pem(config.tls_cert, "tls cert")
    key = _read_pem(config.tls_key, "tls key")
    ca = _read_pem(config.tls_client_ca, "tls client_ca") if config.tls_client_ca else None
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise InputError(f"tls cert {config.tls_cert}: no PEM certificate in it")
    if b"PRIVATE KEY-----" not in key:
        raise InputError(f"tls key {config.tls_key}: no PEM private key in it")
    if b"ENCRYPTED" in key:
        raise InputError(f"tls key {config.tls_key}: is encrypted (gRPC needs an unencrypted key)")
    if ca is not None and b"-----BEGIN CERTIFICATE-----" not in ca:
        raise InputError(f"tls client_ca {config.tls_client_ca}: no PEM certificate in it")
    check_key_pair(config.tls_cert, config.tls_key, "tls cert", "tls key")
    if ca is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or str(exc)
            raise InputError(
                f"tls client_ca {config.tls_client_ca}: not a usable PEM CA certificate ({reason})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )
