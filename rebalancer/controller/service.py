"""WorkerService: what inference ranks speak (register, stream, report plans).

This layer only translates: protobuf in, validated numpy and calls on the
Controller out, and StateError / InputError into a gRPC status with a message
and a log line. Validation happens before any state is touched (invariant 6).
A session is one rank or, with `RegisterRequest.ranks`, a group of ranks (a pod's
sidecar): its windows are summed over its ranks and its reports stand for all of them;
its sidecar reports which of its ranks are there (ReportRanks).
Tokens are checked by the server's interceptor (auth.py); this layer only says which
deployment a call is about, once it knows.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import grpc

from rebalancer.controller.clock import Clock
from rebalancer.controller.config import ShardConfig
from rebalancer.controller.contingency import Loss
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.deployment import Resize
from rebalancer.controller.state import Controller
from rebalancer.controller.store import MAX_VERSION
from rebalancer.errors import InputError, StateError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.service import EOF_OF_STREAM, StreamWriter, read_hello, refuse
from rebalancer.wire.shape import dispatch_shape, shape_of, unknown_of

log = logging.getLogger("rebalancer.service")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_POD_CHARS = 253  # a Kubernetes namespace/name fits
_PHASES = {
    pb.PLAN_PHASE_PREPARED: "prepared",
    pb.PLAN_PHASE_FAILED: "failed",
    pb.PLAN_PHASE_COMMITTED: "committed",
    pb.PLAN_PHASE_ABORTED: "aborted",
}


def check_name(name: str, what: str = "deployment") -> str:
    if not NAME_RE.match(name):
        raise InputError(f"{what} name {name!r} must match {NAME_RE.pattern}")
    return name


def ranks_of(request: pb.RegisterRequest, num_gpus: int) -> int | tuple[int, ...]:
    """The rank, or a group session's ranks (distinct, each in range)."""
    if not request.ranks:
        if request.rank >= num_gpus:
            raise InputError(f"rank {request.rank} out of range for {num_gpus} GPUs")
        return int(request.rank)
    ranks = tuple(int(r) for r in request.ranks)
    if len(set(ranks)) != len(ranks):
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise InputError(f"ranks {list(ranks)} name rank {twice[0]} more than once")
    out = [r for r in ranks if r >= num_gpus]
    if out:
        raise InputError(f"rank {out[0]} out of range for {num_gpus} GPUs")
    if len(request.pod) > MAX_POD_CHARS or not request.pod.isprintable():
        raise InputError(f"pod must be at most {MAX_POD_CHARS} printable characters")
    return ranks


def register_label(request: pb.RegisterRequest) -> str:
    if request.ranks:
        return f"ranks {list(request.ranks)}" + (
            f" (pod {request.pod[:64]})" if request.pod else ""
        )
    return f"rank {request.rank}"


def check_version(value: int, field: str) -> int:
    """A placement or plan version from the wire (uint64), refused above MAX_VERSION
    (2**63 - 1, what the store holds). Every RPC that takes a version checks it here,
    before the version is compared, looked up or stored."""
    if value > MAX_VERSION:
        raise InputError(f"{field} {value} is above the largest version {MAX_VERSION} (2**63 - 1)")
    return int(value)


def placement_msg(version: int, phy2log: Any) -> pb.Placement:
    return pb.Placement(version=version, phy2log=codec.encode(phy2log.astype("int32")))


class _PrepareArrays:
    """The arrays of the plan being prepared, encoded once for all its sessions: a Prepare
    goes to every rank or pod of the deployment in one burst. One plan is held (the
    newest asked for); another plan's Prepare encodes again."""

    def __init__(self) -> None:
        self._plan: Plan | None = None
        self._arrays: tuple[pb.Placement, pb.Array] | None = None

    def of(self, plan: Plan) -> tuple[pb.Placement, pb.Array]:
        if plan is not self._plan or self._arrays is None:
            self._plan, self._arrays = (
                plan,
                (
                    placement_msg(plan.version, plan.phy2log),
                    codec.encode(plan.transfers.astype("int32")),
                ),
            )
        return self._arrays


_prepare_arrays = _PrepareArrays()


class _PlannedLossMessages:
    """Planned-loss messages encoded once for all the sessions told: a contingency set goes
    to every rank or pod of the deployment in one burst, one message per loss, each with a
    survivor placement [L, P]. Keyed by the payload object (contingency.tell makes one per
    loss for all its sessions), the newest `size` kept."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._made: dict[
            int, tuple[Any, pb.ControllerMessage]
        ] = {}  # id -> (payload held, message)

    def of(self, told: Any) -> pb.ControllerMessage:
        hit = self._made.get(id(told))
        if hit is not None and hit[0] is told:
            return hit[1]
        msg = pb.ControllerMessage(
            planned_loss=planned_loss_msg(told.loss, told.version, told.set_size)
        )
        self._made[id(told)] = (told, msg)
        while len(self._made) > self.size:
            del self._made[next(iter(self._made))]
        return msg


_planned_losses = _PlannedLossMessages()


def controller_message(kind: str, payload: Any) -> pb.ControllerMessage:
    """A plan phase for a session's stream. `payload` is the Plan, or for "abort"
    anything with `version` and `reason` (an Aborted)."""
    plan: Plan = payload
    if kind == "prepare":
        placement, transfers = _prepare_arrays.of(plan)
        # Prepare's layers_per_chunk and timeout_seconds stay unset: ranks pace and time
        # their transfers by their own settings (HookConfig), the controller by the plan's
        # deadline.
        return pb.ControllerMessage(
            prepare=pb.Prepare(
                version=plan.version,
                base_version=plan.base_version,
                placement=placement,
                transfers=transfers,
            )
        )
    if kind == "commit":
        return pb.ControllerMessage(commit=pb.Commit(version=plan.version))
    if kind == "abort":
        return pb.ControllerMessage(abort=pb.Abort(version=plan.version, reason=plan.reason))
    if kind == "planned_loss":
        return _planned_losses.of(payload)
    raise ValueError(kind)


def planned_loss_msg(loss: Loss, base_version: int = 0, set_size: int = 0) -> pb.PlannedLoss:
    """One loss of a contingency set as the admin API and the ranks see it."""
    msg = pb.PlannedLoss(
        kind=loss.kind,
        lost_ranks=loss.lost,
        balancedness=loss.balancedness if loss.feasible else 0.0,
        slots_moved=loss.slots_moved,
        from_storage=loss.from_storage,
        unserved=loss.unserved,
        base_version=base_version,
        set_size=set_size,
    )
    if loss.phy2log is not None:
        msg.phy2log.CopyFrom(codec.encode(loss.phy2log.astype("int32")))
    return msg


class AckPacer:
    """Cumulative window acks, at most one per `interval` seconds per stream.

    An ack only lets the rank drop windows from its resend buffer, so it may wait;
    pacing saves most per-window writes, the largest cost of ingest after the read.
    The first window after a quiet interval is acked at once; later ones by a timer.
    Each ack says how long it was held, so senders can still tell ingest latency."""

    def __init__(
        self, write: Callable[[pb.ControllerMessage], None], interval: float, clock: Clock
    ) -> None:
        self._write = write
        self.interval = interval
        self._clock = clock
        self._seq: int | None = None
        self._ingested_at = 0.0
        self._last_ack = -float("inf")
        self._timer: asyncio.TimerHandle | None = None

    def ingested(self, seq: int) -> None:
        now = self._clock()
        self._seq, self._ingested_at = seq, now
        if now - self._last_ack >= self.interval:
            self.flush()
        elif self._timer is None:
            delay = self._last_ack + self.interval - now
            self._timer = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._seq is None:
            return
        now = self._clock()
        msg = pb.ControllerMessage()
        msg.window_ack.seq = self._seq
        msg.window_ack.held_seconds = now - self._ingested_at
        self._seq, self._last_ack = None, now
        self._write(msg)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class WorkerService(pb_grpc.WorkerServiceServicer):
    """`check_deployment(name)` raises StateError unless the call in progress may speak
    for deployment `name` (auth.TokenAuth.check_deployment); None: no such check.
    `shard`: this controller's place among controller shards (config.ShardConfig): a
    Register for a pool or deployment another shard owns is refused before anything
    changes; None: one controller, owning everything."""

    def __init__(
        self,
        controller: Controller,
        check_deployment: Callable[[str], None] | None = None,
        on_ingest: Callable[[str, int, float], None] | None = None,
        ack_interval: float = 0.0,
        on_refused: Callable[[str], None] | None = None,
        shard: ShardConfig | None = None,
    ) -> None:
        self.controller = controller
        self.shard = shard if shard is not None and shard.count > 1 else None
        self.clock = controller.clock
        self.ack_interval = ack_interval  # 0: every window acked at once
        self.check_deployment = check_deployment or (lambda _name: None)
        self.on_ingest = on_ingest  # (deployment, bytes, seconds) per window, for metrics
        self.on_refused = on_refused  # (deployment) per window refused, for metrics

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        try:
            name = check_name(request.deployment)
            self.check_deployment(name)
            shape = dispatch_shape(shape_of(request.shape), request.dispatch_mode, request.top_k)
            ranks = ranks_of(request, shape.num_gpus)
            version = check_version(request.placement_version, "placement_version")
            initial = None
            if request.HasField("initial_placement"):
                check_version(request.initial_placement.version, "initial_placement.version")
                initial = codec.decode_phy2log(
                    request.initial_placement.phy2log,
                    shape.num_layers,
                    shape.num_slots,
                    shape.num_logical,
                )
            pool = check_name(request.pool, "pool") if request.pool else ""
            if self.shard is not None and (refusal := self.shard.refusal(name, pool)):
                raise StateError("FAILED_PRECONDITION", refusal)
            # expert_bytes 0: not known yet (wire/shape.py UNKNOWN_EXPERT_BYTES), a later
            # Register fills it in.
            unknown = unknown_of(request.shape)
            resized_from = None
            if request.HasField("resized_from"):
                resized_from = Resize(
                    check_version(request.resized_from.version, "resized_from.version"),
                    int(request.resized_from.num_gpus),
                )
                if resized_from.num_gpus <= 0:
                    raise InputError("resized_from.num_gpus must be positive")
            session, dep = self.controller.register(
                name,
                ranks,
                shape,
                version,
                initial,
                request.worker_id,
                request.pod,
                pool,
                unknown,
                resized_from,
            )
            warm = self.controller.warm_offer(dep, version) if pool else None
        except (InputError, StateError) as exc:
            await refuse(
                context, exc, f"Register({request.deployment!r}, {register_label(request)})", log
            )
            raise AssertionError("unreachable") from exc
        response = pb.RegisterResponse(
            session_id=session.session_id,
            committed=placement_msg(dep.version, dep.phy2log),
            next_window_seq=dep.expected_window(session.ranks),
        )
        if warm is not None:
            response.warm_start.CopyFrom(placement_msg(*warm))
        return response

    async def Stream(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        hello = await read_hello(context)
        if hello is None:
            return
        writer = StreamWriter(context, "stream to a session")

        def send(kind: str, payload: Any) -> None:
            writer.put(controller_message(kind, payload))

        session_id = hello.session_id
        try:
            self.check_deployment(self.controller.session(session_id)[0].name)
            dep, session = self.controller.attach(session_id, send)
        except StateError as exc:
            writer.cancel()
            await refuse(context, exc, "Stream hello", log)
            return
        shape = dep.shape
        logical_shape = (shape.num_layers, shape.num_logical)
        physical_shape = (shape.num_layers, shape.num_slots)

        acks = AckPacer(writer.put, self.ack_interval, self.clock)
        try:
            while True:
                msg = await context.read()
                if msg is EOF_OF_STREAM:
                    acks.flush()
                    await writer.stop(flush=True)
                    break
                if not msg.HasField("window"):
                    raise InputError("only windows may follow hello on the stream")
                w = msg.window
                if session.ended_by_resize:
                    raise StateError(
                        "NOT_FOUND",
                        f"{session.label} of {dep.name!r} belongs to a world the "
                        "deployment was resized from: register again",
                    )
                t0 = self.clock()
                check_version(w.placement_version, "window placement_version")
                logical = codec.decode_counts(w.logical_count, "logical_count", logical_shape)
                physical = None
                if w.HasField("physical_count"):
                    physical = codec.decode_counts(
                        w.physical_count, "physical_count", physical_shape
                    )
                check_version(w.serving_version, "window serving_version")
                self.controller.ingest(
                    dep,
                    session.ranks,
                    w.seq,
                    w.placement_version,
                    logical,
                    physical,
                    (w.serving_version, w.serving_hash),
                )
                if self.on_ingest is not None:  # the arrays' sizes: re-reading .data would copy it
                    nbytes = logical.nbytes + (physical.nbytes if physical is not None else 0)
                    self.on_ingest(dep.name, nbytes, self.clock() - t0)
                acks.ingested(w.seq)
        except (InputError, StateError) as exc:
            if self.on_refused is not None:
                self.on_refused(dep.name)
            await writer.stop(flush=False)
            await refuse(context, exc, f"Stream window from {session.label} of {dep.name!r}", log)
        finally:
            acks.close()
            writer.cancel()
            self.controller.detach(session_id)

    async def ReportPlan(
        self, request: pb.PlanReport, context: grpc.aio.ServicerContext
    ) -> pb.PlanReportResponse:
        try:
            self.check_deployment(self.controller.session(request.session_id)[0].name)
            phase = _PHASES.get(request.phase)
            if phase is None:
                raise InputError(f"plan phase {request.phase} is not reportable")
            version = check_version(request.version, "version")
            serving = None
            if request.HasField("serving"):
                shape = self.controller.session(request.session_id)[0].shape
                serving = codec.decode_phy2log(
                    request.serving.phy2log, shape.num_layers, shape.num_slots, shape.num_logical
                )
            self.controller.report(request.session_id, version, phase, request.error, serving)
        except (InputError, StateError) as exc:
            await refuse(context, exc, f"ReportPlan(v{request.version})", log)
        return pb.PlanReportResponse()

    async def ReportRanks(
        self, request: pb.RankPresence, context: grpc.aio.ServicerContext
    ) -> pb.RankPresenceResponse:
        try:
            self.check_deployment(self.controller.session(request.session_id)[0].name)
            connected = [int(r) for r in request.connected_ranks]
            if len(set(connected)) != len(connected):
                twice = sorted({r for r in connected if connected.count(r) > 1})
                raise InputError(f"connected_ranks name rank {twice[0]} more than once")
            self.controller.presence(request.session_id, frozenset(connected))
        except (InputError, StateError) as exc:
            await refuse(context, exc, "ReportRanks", log)
        return pb.RankPresenceResponse()
