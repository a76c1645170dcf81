"""Service registration that refuses requests which do not parse, with INVALID_ARGUMENT.

Both gRPC servers of the project (the controller's WorkerService and AdminService, the
sidecar's WorkerService on its socket) register their services with `add_service`, so a
rank, a fuzzer or a broken proxy that sends bytes protobuf cannot parse hears the same
precise status from either (invariant 6), never grpc-python's UNKNOWN.

grpc-python parses a request with the handler's `request_deserializer` and, when that
raises (bytes that are not protobuf, invalid UTF-8 in a string field), answers with a
status of its own: UNKNOWN "Unexpected DecodeError" on the aio server (INTERNAL
"Exception deserializing request!" on the sync one). The deserializer cannot choose the
status: it runs before the servicer, with no context. So each service is registered
with handlers built from the generated ones where the deserializer returns an
`Undecodable` in place of a message that does not parse, and the method refuses it
with INVALID_ARGUMENT before the servicer sees it: a unary request at once; on a
request stream where it is read (`context.read()` or the request iterator raise
UndecodableRequest, an InputError the servicer refuses like any bad message; one it
lets escape is refused by the wrapper). Nothing has changed: invariant 6.

Both servers' Stream handlers also write through one `StreamWriter` each, and refuse a
well-formed call that does not fit their state with `refuse` (StateError's code, else
INVALID_ARGUMENT), the same status and log line from either.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from rebalancer.errors import InputError, StateError

log = logging.getLogger("rebalancer.wire")


def status_of(exc: Exception) -> grpc.StatusCode:
    """The status a refused call answers with: a StateError's own, else INVALID_ARGUMENT."""
    if isinstance(exc, StateError):
        return getattr(grpc.StatusCode, exc.code)
    return grpc.StatusCode.INVALID_ARGUMENT


async def refuse(
    context: grpc.aio.ServicerContext, exc: Exception, what: str, logger: logging.Logger
) -> None:
    """End the call with `exc`'s status and message, and say so in `logger`'s log."""
    code = status_of(exc)
    logger.warning("%s refused: %s: %s", what, code.name, exc)
    await context.abort(code, str(exc))


# The end of a client stream as `context.read()` returns it (exported at runtime,
# missing in the stubs).
EOF_OF_STREAM: Any = grpc.aio.EOF  # type: ignore[attr-defined]


async def read_hello(context: grpc.aio.ServicerContext) -> Any | None:
    """The Hello that opens a worker stream, or None after aborting the call
    INVALID_ARGUMENT when the stream opens with anything else or ends at once."""
    first = await context.read()
    if first is EOF_OF_STREAM or not first.HasField("hello"):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "the first stream message must be hello"
        )
        return None
    return first.hello


class UndecodableRequest(InputError):
    """A request message that does not parse, raised where a handler reads it."""


class Undecodable:
    """Stands in for a request message that did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: UndecodableRequest) -> None:
        self.error = error


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(parse, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", "message")

    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a parser raises on bad bytes
            return Undecodable(UndecodableRequest(f"request is not a valid {type_name}: {exc}"))

    return parse_or_mark


def _parsed(message: Any) -> Any:
    if isinstance(message, Undecodable):
        raise message.error
    return message


class _CheckedReads:
    """The call's context, whose `read` raises UndecodableRequest for a message that did
    not parse; everything else is the context's own."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def read(self) -> Any:
        return _parsed(await self._context.read())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


async def _checked_iter(requests: Any) -> AsyncIterator[Any]:
    async for message in requests:
        yield _parsed(message)


async def _refuse_undecodable(
    context: grpc.aio.ServicerContext, method: str, exc: UndecodableRequest
) -> None:
    log.warning("%s refused: INVALID_ARGUMENT: %s", method, exc)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _guard(
    behavior: Callable[..., Any], method: str, request_streaming: bool
) -> Callable[..., Any]:
    """`behavior` refusing a request that did not parse, of the same kind (coroutine or
    async generator) so the server drives it the same way."""

    def arguments(request: Any, context: grpc.aio.ServicerContext) -> tuple[Any, Any]:
        if request_streaming:
            return _checked_iter(request), _CheckedReads(context)
        return _parsed(request), context

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in behavior(*arguments(request, context)):
                    yield item
            except UndecodableRequest as exc:
                await _refuse_undecodable(context, method, exc)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(*arguments(request, context))
        except UndecodableRequest as exc:
            await _refuse_undecodable(context, method, exc)

    return call


def _guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with a tolerant deserializer and its behavior guarded; as it is when its
    behavior is not async (a sync servicer would then run on the event loop)."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    parse = handler.request_deserializer
    if parse is None or not (
        inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)
    ):
        return handler
    guarded = _guard(behavior, method, handler.request_streaming)
    des, ser = _tolerant(parse), handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(guarded, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(guarded, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(guarded, des, ser)
    return grpc.unary_unary_rpc_method_handler(guarded, des, ser)


class _Collector:
    """Stands in for the server while a generated `add_*_to_server` registers a service:
    keeps its method handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = dict(handlers)


def add_service(add: Callable[[Any, Any], None], servicer: Any, server: Any) -> None:
    """Register `servicer` on `server` as the generated `add(servicer, server)` does, each
    method refusing a request that does not parse with INVALID_ARGUMENT."""
    collector = _Collector()
    add(servicer, collector)
    if (
        not collector.services
    ):  # generated code older than grpcio 1.63 registers generic handlers only
        raise RuntimeError(f"{add.__qualname__} registered no method handlers")
    for service, handlers in collector.services.items():
        guarded = {name: _guarded(h, f"/{service}/{name}") for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
        server.add_registered_method_handlers(service, guarded)


# Outgoing messages queued per stream, bounded so a slow reader cannot grow the server's
# memory (acks are cumulative: a dropped one is covered by the next).
SEND_QUEUE = 256


# How long an aborting stream waits for the write under way to finish (StreamWriter.stop).
STOP_GRACE = 2.0


class StreamWriter:
    """The one writer of a server stream. Callbacks on the event loop `put` messages (plan
    phases, acks); one task writes them in order, so writes on the call never overlap."""

    def __init__(
        self, context: grpc.aio.ServicerContext, what: str, size: int = SEND_QUEUE
    ) -> None:
        self.what = what  # names the stream in the log line of a dropped message
        self._queue: asyncio.Queue[Any] = asyncio.Queue(size)
        self._task = asyncio.create_task(self._run(context))

    async def _run(self, context: grpc.aio.ServicerContext) -> None:
        while (out := await self._queue.get()) is not None:
            await context.write(out)

    def put(self, msg: Any) -> None:
        try:
            self._queue.put_nowait(msg)
        except asyncio.QueueFull:
            log.error("%s: send queue full; dropping a %s", self.what, msg.WhichOneof("body"))

    async def stop(self, flush: bool) -> None:
        """End the writer: after what is queued (`flush`, a clean end), or after the write
        under way only (before an abort). A write cancelled half-way leaves its operation
        open on the call, and the abort that follows then fails (TOO_MANY_OPERATIONS)
        instead of telling the peer why: so the write under way may finish, for at most
        STOP_GRACE seconds (a peer that reads nothing keeps it from finishing)."""
        if not flush:
            while not self._queue.empty():
                self._queue.get_nowait()
        await self._queue.put(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), None if flush else STOP_GRACE)
        except TimeoutError:
            self._task.cancel()
        except Exception:  # noqa: BLE001 - the write failed: the call is broken, the writer ended
            pass
        await asyncio.gather(self._task, return_exceptions=True)

    def cancel(self) -> None:
        """The handler is leaving however it leaves: nothing more is written."""
        self._task.cancel()
