"""The rank's link to the controller, on a background thread (invariant 3).

The serving loop only calls `submit_window` and `report`, which take a lock
for a few list operations and wake the agent's event loop; they never wait
for the network. The agent owns its own asyncio loop and gRPC channel,
registers, keeps one stream open (windows up, plan phases down), resends
windows the controller has not acknowledged after a reconnect, and
reconnects with exponential backoff and jitter. With the controller gone the
rank keeps serving; windows not yet sent are merged once more than
`max_pending` wait, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal, Protocol, cast, get_args

import grpc
import numpy as np

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import aio_channel
from rebalancer.wire.codec import Statement
from rebalancer.wire.delivery import SentWindows, send_report
from rebalancer.wire.layout import placement_digest
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape, shape_msg
from rebalancer.wire.windows import BoundedWindows, CountWindow

log = logging.getLogger("worker_hooks.agent")


@dataclass(frozen=True)
class AgentConfig:
    # The controller (or the pod's sidecar), token and TLS files, and what Register tells:
    # deployment, worker id, replica pool. A token file is read once, at the agent's start.
    link: Link
    rank: int
    # The EP group's shape told at Register, its dispatch mode and top_k among it (the
    # controller predicts a placement's balance under them); expert_bytes 0: not known yet.
    shape: ClusterShape
    max_pending: int = 32  # unsent windows before merging
    rpc_timeout_seconds: float = 5.0
    backoff_initial_seconds: float = 0.2
    backoff_max_seconds: float = 5.0
    # An elastic engine resized the EP group (vLLM's elastic EP): (version, GPUs) of the
    # world before, told at Register until the controller answered once
    # (RegisterRequest.resized_from); the rank then serves the version it is given.
    resized_from: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        for name in ("rpc_timeout_seconds", "backoff_initial_seconds", "backoff_max_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_seconds < self.backoff_initial_seconds:
            raise ValueError(
                f"backoff_max_seconds ({self.backoff_max_seconds}) must be >= "
                f"backoff_initial_seconds ({self.backoff_initial_seconds})"
            )


# What the controller sends down the stream: the `body` of a ControllerMessage.
ControllerMessageKind = Literal[
    "window_ack", "prepare", "commit", "abort", "warm_start", "planned_loss"
]
CONTROLLER_MESSAGE_KINDS: tuple[ControllerMessageKind, ...] = get_args(ControllerMessageKind)


# Statuses that turn this rank down (another deployment on the sidecar, a shape or token
# that does not fit): asking again gets the same answer until someone changes the pod, so
# they are an error said once and asked again at the slowest pace, not a link lost.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


class PlanHandlers(Protocol):
    """What the rank does when the controller speaks: one method per plan message
    (`prepare`, `commit`, `abort`), each with that message's fields. Called on the
    agent thread; each must return quickly (start work on another thread if it is long)."""

    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


class WorkerAgent:
    def __init__(
        self,
        config: AgentConfig,
        handlers: PlanHandlers,
        version: Callable[[], int],
        initial_phy2log: np.ndarray | None = None,
        served_map: Callable[[], np.ndarray] | None = None,
    ) -> None:
        self.config = config
        self.handlers = handlers
        self._version = version
        # The map the rank serves (read with the version): every window states both, so
        # the controller converges to what the ranks serve whatever reports were lost.
        # None: the version alone is told, and the controller relies on the reports.
        self._served_map = served_map
        self._digest: tuple[int, int, int] = (-1, 0, 0)  # (version, id of the map, digest)
        self._initial = initial_phy2log
        self._lock = threading.Lock()
        self._pending = BoundedWindows(config.max_pending)  # rebalancer.wire.windows' rule
        self._reports: deque[pb.PlanReport] = deque()
        self._sent = SentWindows()  # numbered, not yet acknowledged (under the lock)
        self._session = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop = threading.Event()
        # Set by `drain`: once everything is written the stream is ended, so the controller
        # acks the last window at once instead of after its ack interval.
        self._draining = threading.Event()
        self._channel = config.link.with_token()  # InputError now for an unreadable token file
        self._channel.credentials()  # InputError now, at start, for TLS settings that cannot work
        self._metadata = self._channel.metadata()
        self._thread = threading.Thread(
            target=self._run, name=f"rebalancer-agent-{config.rank}", daemon=True
        )
        self.connected = threading.Event()
        self.reconnects = 0
        self.refused = (
            ""  # "STATUS: message" while the controller (or sidecar) turns this rank down
        )
        self._logged_loss = ""  # the loss last logged: said once per outage, not per try
        self.committed_placement: np.ndarray | None = None
        self.committed_version = 0  # set after committed_placement, at every Register
        self._resized_from = config.resized_from  # told until a Register is answered
        # The pool placement offered to this fresh rank (RegisterResponse.warm_start or,
        # through a sidecar, ControllerMessage.warm_start): read by the hook at start.
        self.warm_start: pb.Placement | None = None
        self.warm_offered = threading.Event()
        # The newest contingency set told (ControllerMessage.planned_loss): lost ranks ->
        # the survivors' placement (None: no placement can serve them), planned on the
        # placement of version `_planned_base`.
        self._planned_base = -1
        self._planned: dict[tuple[int, ...], np.ndarray | None] = {}

    # ------------------------------------------------------------ serving-thread API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._poke()
        self._thread.join(timeout)

    def drain(self, timeout: float) -> bool:
        """Wait (off the hot path) until every window and report was delivered; False on
        timeout. The last act of a rank before `stop`: once all is written the agent ends
        its stream, and the controller acks what it read at the stream's end (its acks are
        otherwise paced, one per ack interval)."""
        self._draining.set()
        self._poke()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._delivered():
                return True
            time.sleep(0.02)
        return False

    def submit_window(
        self,
        first_step: int,
        num_steps: int,
        version: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
    ) -> None:
        """Queue one window; O(1), never blocks on the network."""
        with self._lock:
            self._pending.push(CountWindow(-1, first_step, num_steps, version, logical, physical))
        self._poke()

    def report(
        self,
        version: int,
        phase: pb.PlanPhase,
        step: int = 0,
        error: str = "",
        bytes_received: int = 0,
        seconds: float = 0.0,
        serving: np.ndarray | None = None,
    ) -> None:
        """`serving`: with FAILED after a Commit, the placement the rank serves (applied in
        part)."""
        placement = (
            None
            if serving is None
            else pb.Placement(phy2log=codec.encode(serving.astype(np.int32)))
        )
        with self._lock:
            self._reports.append(
                pb.PlanReport(
                    version=version,
                    phase=phase,
                    step=step,
                    error=error,
                    bytes_received=bytes_received,
                    seconds=seconds,
                    serving=placement,
                )
            )
        self._poke()

    @property
    def merged_windows(self) -> int:
        """Times two unsent windows were merged to keep within `max_pending`."""
        return self._pending.merged

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # loop closing

    # ------------------------------------------------------------ agent thread

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            # Let gRPC's own tasks see their calls cancelled before the loop goes.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # The loop is left unclosed on purpose: gRPC's process-wide completion-queue
            # poller may still post to it, which on a closed loop logs spurious errors.

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        backoff = self.config.backoff_initial_seconds
        while not self._stop.is_set():
            try:
                channel = aio_channel(self._channel)  # reads the certificate files
            except (
                InputError
            ) as exc:  # one gone since start (rotated away): retried, the agent lives on
                log.error(
                    "rank %d: cannot connect to %s: %s",
                    self.config.rank,
                    self.config.link.address,
                    exc,
                )
            else:
                async with channel:
                    stub = pb_grpc.WorkerServiceStub(channel)
                    try:
                        await self._register(stub)
                        backoff = self.config.backoff_initial_seconds
                        await self._session_loop(stub)
                    except (
                        grpc.aio.AioRpcError,
                        ConnectionError,
                        asyncio.InvalidStateError,
                    ) as exc:
                        # InvalidStateError: gRPC's answer to a write on a stream that ended
                        # between two writes (a proxy's GOAWAY): a lost link like any other.
                        # Uncaught, it ended the agent's thread, and the rank never came back
                        # (the short campaign, seed 532).
                        lost = (
                            ConnectionError(f"the stream ended under a write: {exc}")
                            if isinstance(exc, asyncio.InvalidStateError)
                            else exc
                        )
                        if self._link_failed(lost):  # turned down: the slowest pace at once
                            backoff = self.config.backoff_max_seconds
            self.connected.clear()
            if self._stop.is_set():
                break
            if self._draining.is_set() and self._delivered():
                await self._wait_stop()  # drained: no new stream until stop
                break
            self.reconnects += 1
            delay = backoff * (0.5 + random.random())
            backoff = min(backoff * 2, self.config.backoff_max_seconds)
            try:
                await asyncio.wait_for(self._wait_stop(), timeout=delay)
            except TimeoutError:
                pass

    def _link_failed(self, exc: grpc.aio.AioRpcError | ConnectionError) -> bool:
        """Log why the link failed, once per cause (not once per try); True if this rank was
        refused (the `refused` attribute then holds the status and the message)."""
        if isinstance(exc, grpc.aio.AioRpcError):
            code: grpc.StatusCode | None = exc.code()
            message = f"{exc.code().name}: {exc.details()}"
        else:
            code, message = None, f"{type(exc).__name__}: {exc}"
        was_connected = self.connected.is_set()
        if code in REFUSALS:
            if message != self.refused:
                log.error(
                    "rank %d: refused by %s (%s); serving on without rebalancing, asking again "
                    "every ~%g s",
                    self.config.rank,
                    self.config.link.address,
                    message,
                    self.config.backoff_max_seconds,
                )
            self.refused = message
            return True
        loss = was_connected or bool(self.refused) or message != self._logged_loss
        log.log(
            logging.WARNING if loss else logging.DEBUG,
            "rank %d: controller link lost (%s)",
            self.config.rank,
            message,
        )
        self._logged_loss, self.refused = message, ""
        return False

    async def _wait_stop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(0.05)

    def register_request(self) -> pb.RegisterRequest:
        """What this rank tells the controller at Register: its link's names, the shape
        (dispatch mode and top_k among it), the version it serves, and once, a resize."""
        shape = self.config.shape
        request = pb.RegisterRequest(
            deployment=self.config.link.deployment,
            rank=self.config.rank,
            shape=shape_msg(shape),
            placement_version=self._version(),
            worker_id=self.config.link.worker_id,
            dispatch_mode=shape.dispatch_mode,
            top_k=shape.top_k,
            pool=self.config.link.pool,
        )
        if self._initial is not None:
            request.initial_placement.CopyFrom(
                pb.Placement(version=0, phy2log=codec.encode(self._initial.astype(np.int32)))
            )
        if self._resized_from is not None:
            request.resized_from.CopyFrom(
                pb.Resize(version=self._resized_from[0], num_gpus=self._resized_from[1])
            )
        return request

    async def _register(self, stub: pb_grpc.WorkerServiceStub) -> None:
        request = self.register_request()
        response = await stub.Register(
            request,
            timeout=self.config.rpc_timeout_seconds,
            wait_for_ready=True,
            metadata=self._metadata,
        )
        self._session = response.session_id
        self.refused = ""
        self.committed_placement = codec.decode(response.committed.phy2log, "committed").astype(
            np.int64
        )
        self.committed_version = int(response.committed.version)
        self._resized_from = None  # the controller took the resize (or knew it): said once
        if response.HasField("warm_start"):
            self._offer(response.warm_start)
        # Resend what the controller has not counted; renumber if it expects less.
        expected = response.next_window_seq
        with self._lock:
            self._sent.resume(expected)
        log.info(
            "rank %d registered with %s (session %s, resend %d windows)",
            self.config.rank,
            self.config.link.address,
            self._session[:8],
            len(self._sent),
        )

    async def _session_loop(self, stub: pb_grpc.WorkerServiceStub) -> None:
        assert self._wake is not None
        call = stub.Stream(metadata=self._metadata)
        await call.write(pb.WorkerMessage(hello=pb.Hello(session_id=self._session)))
        with self._lock:
            resend = self._sent.waiting()
        for w in resend:
            await call.write(pb.WorkerMessage(window=w))
        self.connected.set()
        reader = asyncio.create_task(self._read(call))
        try:
            while not self._stop.is_set():
                if reader.done():
                    reader.result()  # raises the stream's error
                    raise ConnectionError("controller closed the stream")
                await self._flush_reports(stub)
                for w in self._take_pending():
                    await call.write(pb.WorkerMessage(window=w))
                if self._draining.is_set() and self._written():
                    # The controller reads to the end, acks the last window and ends the call.
                    await call.done_writing()
                    await asyncio.wait({reader}, timeout=self.config.rpc_timeout_seconds)
                    if reader.done():
                        reader.result()
                    return
                self._wake.clear()
                waiter = asyncio.create_task(self._wake.wait())
                await asyncio.wait(
                    {waiter, reader}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
            await call.done_writing()
        finally:
            reader.cancel()
            call.cancel()

    def _written(self) -> bool:
        """Whether no window or report waits to be written."""
        with self._lock:
            return not (self._pending or self._reports)

    def _delivered(self) -> bool:
        """Whether everything was written and every window acked."""
        with self._lock:
            return not (self._pending or self._sent or self._reports)

    def _take_pending(self) -> list[pb.Window]:
        out = []
        with self._lock:
            for w in self._pending.take():
                out.append(
                    self._sent.number(
                        w.first_step,
                        w.num_steps,
                        w.version,
                        w.logical,
                        w.physical,
                        self.statement(),
                    )
                )
        return out

    def statement(self) -> Statement:
        """(version, digest) of the placement served now, for the windows (agent thread).
        The map is read after the version: should a switch fall between the two reads,
        the digest names the newer map, the controller finds no match for that one window
        and logs it, and the next window states the pair right."""
        version = self._version()
        if self._served_map is None:
            return version, 0
        phy2log = self._served_map()
        cached_version, cached_id, digest = self._digest
        if cached_version != version or cached_id != id(phy2log):
            digest = placement_digest(phy2log)
            self._digest = (version, id(phy2log), digest)
        return version, digest

    async def _flush_reports(self, stub: pb_grpc.WorkerServiceStub) -> None:
        while True:
            with self._lock:
                if not self._reports:
                    return
                report = self._reports[0]
            await send_report(
                stub,
                report,
                self._session,
                self.config.rpc_timeout_seconds,
                self._metadata,
                log,
                f"rank {self.config.rank}",
            )
            with self._lock:
                self._reports.popleft()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for msg in call:
            self._deliver(msg)

    def _offer(self, placement: pb.Placement) -> None:
        """Keep the first warm start offered (every later one of the same deployment is
        the same while the offer stands)."""
        if self.warm_start is None and placement.version > 0:
            self.warm_start = placement
            self.warm_offered.set()

    def _keep_planned(self, loss: pb.PlannedLoss) -> None:
        """Keep one loss of the newest contingency set (a newer set replaces the older
        whole; the dictionary is swapped, never changed, so readers need no lock)."""
        held = self._planned
        planned = {} if loss.base_version != self._planned_base else dict(held)
        phy2log = (
            codec.decode(loss.phy2log, "phy2log").astype(np.int64)
            if loss.HasField("phy2log")
            else None
        )
        planned[tuple(sorted(loss.lost_ranks))] = phy2log
        self._planned_base, self._planned = loss.base_version, planned

    def survivor_map(self, lost: Collection[int], serving: int) -> np.ndarray | None:
        """The survivors' placement `[L, P']` the controller planned for losing the ranks
        `lost`, when it was planned on the placement `serving` (what the rank serves) and no
        placement can be none; works with the controller gone (told ahead). New rank i is the
        i-th surviving old rank."""
        if self._planned_base != serving:
            return None
        return self._planned.get(tuple(sorted(lost)))

    def _deliver(self, msg: pb.ControllerMessage) -> None:
        """One message from the controller: an ack here, a plan phase to the handlers."""
        kind = cast(ControllerMessageKind | None, msg.WhichOneof("body"))
        match kind:
            case "window_ack":
                with self._lock:
                    self._sent.ack(msg.window_ack.seq)
            case "prepare":
                self.handlers.on_prepare(msg.prepare)
            case "commit":
                self.handlers.on_commit(msg.commit.version)
            case "abort":
                self.handlers.on_abort(msg.abort.version, msg.abort.reason)
            case "warm_start":
                self._offer(msg.warm_start)
            case "planned_loss":
                self._keep_planned(msg.planned_loss)
            case _:  # empty, or a kind this version does not know
                log.warning("rank %d: controller message %r ignored", self.config.rank, kind)
