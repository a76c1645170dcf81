"""The controller process: one grpc.aio server with both services.

Standard health checking (per service; NOT_SERVING until loaded and while
draining) and reflection are registered; keepalive and message sizes are set
on purpose (config.py); bearer tokens are checked by one interceptor (auth.py).
Shutdown drains: health flips to NOT_SERVING, new calls are refused, calls in
flight get `grace_seconds`, the decision process ends (pool.py) and every ingest
cursor is saved before the store closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from rebalancer.controller.admin import AdminService
from rebalancer.controller.auth import ADMIN_SERVICE, WORKER_SERVICE, TokenAuth
from rebalancer.controller.config import ControllerConfig
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.pool import DecisionPool
from rebalancer.controller.service import WorkerService
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import server_options

log = logging.getLogger("rebalancer.server")

SERVICE_NAMES = (WORKER_SERVICE, ADMIN_SERVICE)


class ControllerServer:
    """Owns the store, the controller state, the gRPC server and the tick task."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.store = Store(config.db_path)
        # Decisions run in a process of their own (pool.py), started in `start`.
        self.pool = DecisionPool()
        self.controller = Controller(
            self.store, config.policy, config.persist_seconds, background=self.pool.submit
        )
        self.auth = TokenAuth(config.admin_token, config.worker_tokens)
        self.server = grpc.aio.server(
            interceptors=[self.auth], options=server_options(config.max_message_bytes)
        )
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.metrics = ControllerMetrics(self.controller)
        self.metrics_port: int | None = None
        pb_grpc.add_WorkerServiceServicer_to_server(
            WorkerService(
                self.controller, self.auth.check_deployment, self.metrics.on_ingest,
                config.ack_interval_seconds,
            ),
            self.server,
        )
        pb_grpc.add_AdminServiceServicer_to_server(AdminService(self.controller), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        address = f"{config.host}:{config.port}"
        if config.tls_cert and config.tls_key:
            creds = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                root_certificates=Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None,
                require_client_auth=bool(config.tls_client_ca),
            )
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        self._tick_task: asyncio.Task[None] | None = None
        self._metrics_http: Any = None
        self._stopping = False
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def _set_health(self, status: int) -> None:
        for name in ("", *SERVICE_NAMES):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        self.pool.start()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.config.metrics_port is not None:
            self._metrics_http, _ = start_http_server(
                self.config.metrics_port, addr=self.config.host, registry=self.metrics.registry
            )
            self.metrics_port = int(self._metrics_http.server_port)
            log.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)
        self._tick_task = asyncio.create_task(self._ticker())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("controller serving on %s (store %s)", self.address, self.store.path)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_seconds)
            try:
                self.controller.tick()
            except Exception:  # a bug in one tick must not stop timeouts for good
                log.exception("tick failed")

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.pool.stop_accepting()  # no plan starts while draining
        log.info("draining (%.1fs not ready, then grace %.1fs)", self.config.drain_seconds,
                 self.config.grace_seconds)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # Still serving, but reported NOT_SERVING: probes and balancers stop sending
        # new work before the port closes.
        await asyncio.sleep(self.config.drain_seconds)
        if self._tick_task:
            self._tick_task.cancel()
        await self.server.stop(self.config.grace_seconds)
        self.pool.close()
        self.controller.persist_all()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.store.close()
        self._stopped.set()
        log.info("controller stopped")

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ControllerConfig, ready: Callable[[ControllerServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    server = ControllerServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.stop()))
    if ready:
        ready(server)
    await server.wait()

