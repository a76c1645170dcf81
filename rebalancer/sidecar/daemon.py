"""The sidecar process: one grpc.aio server on the ranks' socket and one upstream link,
on one event loop.

Start: claim the socket path (one sidecar per path; a stale socket is replaced), serve
the WorkerService and gRPC health (NOT_SERVING until up, then SERVING: the startup
probe, `rebalancer sidecar --check`, waits for it) on the socket, born with its
restrictive mode; Prometheus metrics on a port of their own; then the upstream link.
Shutdown (SIGTERM, SIGINT) drains: health turns NOT_SERVING, the windows still being
merged are sent with the last ones and the group stream ends cleanly, ranks' calls in
flight get `grace_seconds`, the socket and its lock go. A plan still preparing aborts
when the group stream ends (invariant 5), as it does when the sidecar dies.

The leader of a merged EP group (rebalancer/sidecar/merge.py) also serves its group's
follower sidecars on TCP (`merge_server`), with TLS and the worker token as configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from rebalancer.errors import InputError
from rebalancer.sidecar import listen
from rebalancer.sidecar.config import SidecarConfig, format_ranks, read_token
from rebalancer.sidecar.merge import server_credentials
from rebalancer.sidecar.metrics import SidecarMetrics
from rebalancer.sidecar.pod import Pod
from rebalancer.sidecar.ranks import RankService
from rebalancer.sidecar.upstream import Upstream
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import server_options
from rebalancer.wire.service import add_service

log = logging.getLogger("rebalancer.sidecar")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name


class _Health(health.aio.HealthServicer):
    """gRPC health, with the controller link's state in the answer's trailing metadata
    (the probe's status is about the socket only: the ranks are served either way)."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__()
        self._upstream = upstream

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        context.set_trailing_metadata(((listen.UPSTREAM_KEY, self._upstream.summary()),))
        return await super().Check(request, context)


class Sidecar:
    """Owns the pod state, the socket server, the upstream link and the metrics server."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.pod = Pod(config)
        self.upstream = Upstream(config, self.pod)
        self.metrics = SidecarMetrics(self.pod, self.upstream)
        self.health = _Health(self.upstream)
        self.server = grpc.aio.server(options=server_options())
        # Requests that do not parse are refused with INVALID_ARGUMENT, as the controller
        # refuses them (wire/service.py), not grpc-python's UNKNOWN.
        add_service(pb_grpc.add_WorkerServiceServicer_to_server, RankService(self.pod), self.server)
        add_service(health_pb2_grpc.add_HealthServicer_to_server, self.health, self.server)
        # The leader of a merged EP group: the same service to its followers, on TCP.
        self.merge_server: grpc.aio.Server | None = None
        self.merge_port: int | None = None
        if config.merge.role == "leader":
            self.merge_server = grpc.aio.server(options=server_options())
            followers = RankService(self.pod, token=lambda: read_token(config.link.token_file)[0])
            add_service(pb_grpc.add_WorkerServiceServicer_to_server, followers, self.merge_server)
            add_service(
                health_pb2_grpc.add_HealthServicer_to_server, self.health, self.merge_server
            )
        self.metrics_port: int | None = None
        self._claim: listen.SocketClaim | None = None
        self._metrics_http: Any = None
        self._upstream_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()

    @property
    def target(self) -> str:
        return f"unix://{self.config.socket}"

    async def _set_health(self, status: int) -> None:
        for name in ("", WORKER_SERVICE):
            await self.health.set(name, status)

    async def start(self) -> None:
        dir_mode, socket_mode = self.config.modes
        self._claim = listen.claim(self.config.socket, dir_mode)
        try:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            with listen.umask_for(socket_mode):
                if self.server.add_insecure_port(self.target) == 0:
                    raise OSError(f"cannot listen on {self.target}")
                await self.server.start()
            os.chmod(self.config.socket, socket_mode)
            if self.merge_server is not None:
                await self._serve_followers(self.merge_server)
            if self.config.metrics_port is not None:
                try:
                    self._metrics_http, _ = start_http_server(
                        self.config.metrics_port,
                        addr=self.config.metrics_host,
                        registry=self.metrics.registry,
                    )
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise listen.InUse(
                            f"metrics port {self.config.metrics_port} is in use"
                        ) from None
                    raise
                self.metrics_port = int(self._metrics_http.server_port)
                log.info(
                    "metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port
                )
        except BaseException:
            await self.server.stop(0)  # a server already started must not outlive the failure
            if self.merge_server is not None:
                await self.merge_server.stop(0)
            self._claim.release()
            raise
        self._upstream_task = asyncio.create_task(self.upstream.run())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "sidecar of ranks %s serving on %s (controller %s)",
            self.config.ranks_label,
            self.target,
            self.config.link.address,
        )

    async def _serve_followers(self, server: grpc.aio.Server) -> None:
        """Listen for the group's followers on `merge.listen` (TLS when configured)."""
        merge = self.config.merge
        try:
            tls = server_credentials(merge)
        except InputError as exc:
            # A Secret missing or late never stops the pod's sidecar (its ranks come first):
            # the followers, finding no leader, stream straight to the controller.
            log.error(
                "not serving the group's followers (%s): they stream straight to the controller",
                exc,
            )
            return
        try:
            port = (
                server.add_secure_port(merge.listen, tls)
                if tls is not None
                else server.add_insecure_port(merge.listen)
            )
        except RuntimeError:
            port = 0
        if port == 0:
            raise listen.InUse(f"cannot listen for the group's followers on {merge.listen}")
        await server.start()
        self.merge_port = port
        log.info(
            "merging EP group ranks %s: followers reach this sidecar on %s (port %d%s)",
            format_ranks(self.config.group_ranks),
            merge.listen,
            port,
            ", TLS" if tls is not None else "",
        )

    async def stop(self) -> None:
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        log.info("draining (grace %.1fs)", self.config.grace_seconds)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.pod.flush_windows()
        self.upstream.stop()
        if self._upstream_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._upstream_task, self.config.grace_seconds + 1.0)
        await self.server.stop(self.config.grace_seconds)
        if self.merge_server is not None:
            await self.merge_server.stop(self.config.grace_seconds)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        if self._claim is not None:
            self._claim.release()
        self._stopped.set()
        log.info("sidecar stopped")

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: SidecarConfig, ready: Callable[[Sidecar], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    sidecar = Sidecar(config)
    await sidecar.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(sidecar.stop()))
    if ready is not None:
        ready(sidecar)
    await sidecar.wait()
