"""Bearer tokens: one server interceptor reads and checks them for both services.

AdminService calls must carry `authorization: Bearer <admin token>` when the server has
one. WorkerService calls must carry a worker token when the server has any: each token
belongs to one deployment (`[worker_tokens]`), and a rank may speak only for its own.
The interceptor cannot see the deployment (Stream and ReportPlan name only a session),
so it authenticates: the token must be one the server knows, and the deployments it
belongs to are noted for the call; the service then authorizes with `check_deployment`
once it knows which deployment the call is about. Tokens are compared in constant time;
a refusal is UNAUTHENTICATED (no token) or PERMISSION_DENIED (a wrong one), with a log
line, before the service sees the call.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from rebalancer.errors import StateError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.bearer import bearer_token
from rebalancer.wire.bearer import same_token as _same

log = logging.getLogger("rebalancer.auth")

ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name

# The deployments whose worker token the call in progress presented.
_DEPLOYMENTS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "rebalancer_token_deployments", default=frozenset()
)


class TokenAuth(grpc.aio.ServerInterceptor):
    """`admin_token`: None, no admin auth; `worker_tokens`: deployment -> token, empty:
    workers unauthenticated (use mutual TLS or a private network)."""

    def __init__(
        self, admin_token: str | None = None, worker_tokens: Mapping[str, str] | None = None
    ) -> None:
        self.admin_token = admin_token or None
        self.worker_tokens = dict(worker_tokens or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method: str = details.method  # type: ignore[attr-defined]
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        if service == ADMIN_SERVICE and self.admin_token:
            token = bearer_token(metadata)
            if token is None:
                return _refusal(
                    handler,
                    method,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "admin calls need 'authorization: Bearer <token>'",
                )
            if not _same(token, self.admin_token):
                return _refusal(
                    handler, method, grpc.StatusCode.PERMISSION_DENIED, "admin token not accepted"
                )
        elif service == WORKER_SERVICE and self.worker_tokens:
            token = bearer_token(metadata)
            if token is None:
                return _refusal(
                    handler,
                    method,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "worker calls need 'authorization: Bearer <token>'",
                )
            # Every token is compared, so the time taken does not tell which one matched.
            matches = [
                name for name, expected in self.worker_tokens.items() if _same(token, expected)
            ]
            if not matches:
                return _refusal(
                    handler,
                    method,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "worker token not accepted for any deployment",
                )
            return _with_deployments(handler, frozenset(matches))
        return handler

    def check_deployment(self, deployment: str) -> None:
        """Raise StateError unless the call in progress may speak for `deployment`."""
        if self.worker_tokens and deployment not in _DEPLOYMENTS.get():
            raise StateError(
                "PERMISSION_DENIED", f"token does not allow speaking for deployment {deployment!r}"
            )


def _wrap(behavior: Callable[..., Any], before: Callable[[], None]) -> Callable[..., Any]:
    """`behavior` with `before()` run first in the call's own context, of the same kind
    (coroutine or async generator) so the server drives it the same way."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            before()
            async for item in behavior(request, context):
                yield item

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        before()
        return await behavior(request, context)

    return call


def _rebuild(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers whose behavior is `wrap(behavior)`."""
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), des, ser)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), des, ser)


def _with_deployments(
    handler: grpc.RpcMethodHandler, deployments: frozenset[str]
) -> grpc.RpcMethodHandler:
    def note() -> None:
        _DEPLOYMENTS.set(deployments)

    return _rebuild(handler, lambda behavior: _wrap(behavior, note))


def _refusal(
    handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    log.warning("%s refused: %s: %s", method, code.name, message)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return _rebuild(handler, lambda _behavior: refuse)
