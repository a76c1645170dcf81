"""The pod's one link to the controller: a group session and its stream.

Once every rank has registered on the socket, the link registers the pod as one group
session of its ranks (pod identity, rank set, shape, the version the ranks serve), opens
one stream, sends the merged windows (numbered from the controller's cursor of the
group), relays the controller's plan phases to the Pod, and sends the pod's plan reports
with the unary ReportPlan, and which ranks have a stream open here with the unary
ReportRanks (whenever that changes: the controller counts a rank whose engine exited as
gone). It holds the credentials (TLS, mutual TLS, bearer token).

When the controller is unreachable nothing waits on it: windows pile up merged in the
pod's bounded buffer, reports stay queued. The link reconnects with exponential backoff
and jitter, registers again (which resyncs the placement version: the controller
reconciles, answers with its committed placement and its cursor, and tells the group the
newest aborted plan and any commit it missed), resends the windows it had sent but that
were not acknowledged from that cursor on, and carries on.

The credential files are read at every connection attempt (a Secret projected late, or
rotated, is picked up without a restart). A certificate file missing or unreadable:
the link does not connect (never plain text instead) and is `no_credentials` until the
file is there. A token file missing or empty: the link connects without a token (mutual
TLS, or a controller without [worker_tokens], needs none) and says so once. Either way
the ranks go on being served here and their windows merged; the state is a metric, a log
line when it changes, and what `rebalancer sidecar --check` prints.

A follower of a merged EP group (rebalancer/sidecar/merge.py) links to its leader's
sidecar instead, with the same files and token, and to the controller while the leader
is away (`via`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import replace
from typing import Literal, get_args

import grpc

from rebalancer.errors import InputError
from rebalancer.sidecar.config import SidecarConfig, format_ranks
from rebalancer.sidecar.merge import leader_serves
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire.channel import aio_channel
from rebalancer.wire.delivery import SentWindows, send_report
from rebalancer.wire.link import Link
from rebalancer.wire.windows import CountWindow

log = logging.getLogger("rebalancer.sidecar")

UpstreamState = Literal[
    "waiting_for_ranks",
    "connecting",
    "connected",
    "backoff",
    "refused",
    "no_credentials",
    "stopped",
]
UPSTREAM_STATES: tuple[UpstreamState, ...] = get_args(UpstreamState)
# Whom the link reaches: the controller, or (a follower of a merged EP group) its leader.
Via = Literal["controller", "leader"]
VIAS: tuple[Via, ...] = get_args(Via)

# A refusal that another try can fix (the controller restarting, or still holding the
# previous stream of this pod): retried quietly; anything else is logged as an error.
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Upstream:
    def __init__(self, config: SidecarConfig, pod: Pod) -> None:
        self.config = config
        self.pod = pod
        self._metadata: tuple[tuple[str, str], ...] = ()
        self.state: UpstreamState = "waiting_for_ranks"
        self.reconnects = 0
        self.last_error = ""
        self._session = ""
        self._sent = SentWindows()
        self._world = pod.world  # the pod's world the windows sent belong to
        # The ranks last told connected in this session (None: not yet). A controller older
        # than ReportRanks counts the group by its stream: not told again in that session.
        self._told_connected: frozenset[int] | None = None
        self._ranks_report_known = True
        self._token_missing = ""  # why the token file gave no token, as last logged
        self._outage = False  # a link loss was logged and the link has not been up since
        self._stop = asyncio.Event()
        self.follower = config.merge.role == "follower"
        self.via: Via = "leader" if self.follower else "controller"
        self._leader_lost_since: float | None = None  # the leader failed since then
        self._sent_via: Via = self.via  # whom the windows in `_sent` were numbered for

    @property
    def unacked(self) -> int:
        return len(self._sent)

    def summary(self) -> str:
        """The link's state and, unless connected, the last error: one printable ASCII line
        (it travels as gRPC metadata)."""
        failed = self.state in ("backoff", "refused", "no_credentials") and self.last_error
        text = f"{self.state} ({self.last_error})" if failed else self.state
        if self.state == "connected" and self._token_missing:
            text += " (without a worker token)"
        if self.follower:
            text += (
                f" via the group's leader {self.config.merge.leader}"
                if self.via == "leader"
                else " straight to the controller (the group's leader away)"
            )
        return "".join(c if " " <= c <= "~" else "?" for c in " ".join(text.split()))

    def stop(self) -> None:
        """Leave: the session loop sends what is buffered, ends the stream and returns."""
        self._stop.set()
        self.pod.changed.set()

    async def run(self) -> None:
        backoff = self.config.backoff_initial_seconds
        while not self._stop.is_set():
            channel = self._credentials()
            if channel is None:  # reported; the ranks are served here meanwhile
                await self._wait(self.config.backoff_max_seconds, only_stop=True)
                continue
            self.state = "waiting_for_ranks"
            while not self.pod.upstream_ready() and not self._stop.is_set():
                await self._wait(1.0)
            if self._stop.is_set():
                break
            self.state = "connecting"
            self._metadata = channel.metadata()
            target = self._target(channel)
            try:
                async with aio_channel(target) as grpc_channel:
                    stub = pb_grpc.WorkerServiceStub(grpc_channel)
                    await self._register(stub, target)
                    backoff = self.config.backoff_initial_seconds
                    await self._session_loop(stub, channel)
            except grpc.aio.AioRpcError as exc:
                self._lost(exc.code(), exc.details() or "")
            except (ConnectionError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: the controller ended the stream between two writes
                # ("RPC already finished"); left uncaught it ended this link for good.
                self._lost(None, str(exc) or type(exc).__name__)
            if self._stop.is_set():
                break
            if self.via == "leader" and self.state != "connected":
                self._leader_failed()
            self.reconnects += 1
            delay = backoff * (0.5 + random.random())
            backoff = min(backoff * 2, self.config.backoff_max_seconds)
            await self._wait(delay, only_stop=True)
        self.state = "stopped"

    def _target(self, channel: Link) -> Link:
        """Whom this attempt reaches: the controller, or a follower's leader (the same
        TLS files and token)."""
        if self.via == "leader":
            return replace(channel, address=self.config.merge.leader)
        # Controller shards: the one that owns the pod's pool or deployment, as its ranks
        # named them (rebalancer.wire.shards; the one controller's address without shards).
        return channel.routed(self.pod.deployment, self.pod.pool)

    def _whom(self) -> str:
        return "the group's leader sidecar" if self.via == "leader" else "controller"

    def _leader_failed(self) -> None:
        """The leader was unreachable (or refused this follower): after `wait_seconds` of
        that, stream straight to the controller (rebalancer/sidecar/merge.py)."""
        now = time.monotonic()
        if self._leader_lost_since is None:
            self._leader_lost_since = now
            return
        if now - self._leader_lost_since < self.config.merge.wait_seconds:
            return
        log.warning(
            "the group's leader sidecar %s unreachable for %.0f s (%s): ranks %s stream straight "
            "to the controller %s; asking the leader again every %.0f s",
            self.config.merge.leader,
            now - self._leader_lost_since,
            self.last_error or "?",
            self.pod.ranks_label,
            self.config.link.address,
            self.config.merge.retry_leader_seconds,
        )
        self.via, self._leader_lost_since = "controller", None

    def _credentials(self) -> Link | None:
        """The channel settings with the credential files read now; None (state
        `no_credentials`, logged once per cause) while a certificate file is missing."""
        try:
            channel = self.config.channel()
        except InputError as exc:
            message = str(exc)
            if message != self.last_error:
                log.error(
                    "cannot connect to the controller (%s); serving ranks %s here, merging their "
                    "windows, reading the files again every %.0f s",
                    exc,
                    self.pod.ranks_label,
                    self.config.backoff_max_seconds,
                )
            self.state, self.last_error = "no_credentials", message
            return None
        missing = self.config.token_missing()
        if missing and missing != self._token_missing:
            log.warning(
                "no worker token (%s): connecting without one, as mutual TLS or a controller "
                "without [worker_tokens] allows",
                missing,
            )
        self._token_missing = missing
        return channel

    def _lost(self, code: grpc.StatusCode | None, detail: str) -> None:
        name = code.name if code is not None else "ConnectionError"
        message = f"{name}: {detail}"
        if code is None or code in _TRANSIENT:
            # Once per outage (from the first failure until the link is up again), not once
            # per try nor per cause: the words change within one outage (the stream cut,
            # then the refused connection of the next try). The latest try's cause is in
            # --check and at DEBUG.
            first = not self._outage
            self._outage = True
            self.state = "backoff"
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "%s link lost (%s)",
                self._whom(),
                message,
            )
        else:
            self.state = "refused"
            if self._token_missing and code in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                message += f" (sent without a token: {self._token_missing})"
            if message != self.last_error:
                log.error(
                    "%s refused the pod (%s); serving the ranks here, retrying",
                    self._whom(),
                    message,
                )
        self.last_error = message

    async def _wait(self, timeout: float, only_stop: bool = False) -> None:
        """Until the pod changes (or only a stop, with `only_stop`), at most `timeout` s."""
        event = self._stop if only_stop else self.pod.changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        if not only_stop:
            self.pod.changed.clear()

    async def _register(self, stub: pb_grpc.WorkerServiceStub, target: Link) -> None:
        if (
            self._world != self.pod.world
        ):  # the pod took a resize: nothing of the old world is resent
            self._sent, self._world = SentWindows(), self.pod.world
        if self._sent_via != self.via:  # numbered for the other upstream: not resent here
            self._sent, self._sent_via = SentWindows(), self.via
        request = self.pod.group_request()
        response = await stub.Register(
            request, timeout=self.config.rpc_timeout_seconds, metadata=self._metadata
        )
        self._session = response.session_id
        self._told_connected, self._ranks_report_known = None, True  # a new session: tell it
        self.pod.registered_upstream(response)
        # Resend what the controller has not counted, renumbered from its cursor.
        expected = response.next_window_seq
        self._sent.resume(expected)
        # What those windows said the ranks serve may be stale now (ranks that restarted
        # make the group register again): resent without it; fresh windows state it.
        self._sent.withdraw_statements()
        self._leader_lost_since = None
        log.info(
            "registered ranks %s as one group with %s%s (v%d committed, resend %d windows)",
            format_ranks(self.pod.upstream_ranks),
            target.address,
            " (the group's leader)" if self.via == "leader" else "",
            response.committed.version,
            len(self._sent),
        )

    async def _session_loop(self, stub: pb_grpc.WorkerServiceStub, channel: Link) -> None:
        call = stub.Stream(metadata=self._metadata)
        await call.write(pb.WorkerMessage(hello=pb.Hello(session_id=self._session)))
        for resent in self._sent.waiting():
            await call.write(pb.WorkerMessage(window=resent))
        self.state = "connected"
        self.last_error = ""
        self._outage = False
        reader = asyncio.create_task(self._read(call))
        # A follower streaming straight to the controller asks now and then whether its
        # leader serves again, without holding up its windows.
        asking: asyncio.Task[bool] | None = None
        ask_at = time.monotonic() + self.config.merge.retry_leader_seconds
        leader = replace(channel, address=self.config.merge.leader)
        try:
            while True:
                self.pod.changed.clear()
                if reader.done():
                    reader.result()  # raises the stream's error
                    raise ConnectionError("controller closed the stream")
                if self.follower and self.via == "controller":
                    if asking is not None and asking.done():
                        if asking.result():
                            log.info(
                                "the group's leader sidecar %s serves again: "
                                "ranks %s go back to it",
                                self.config.merge.leader,
                                self.pod.ranks_label,
                            )
                            self.via = "leader"
                            break
                        asking = None
                    if asking is None and time.monotonic() >= ask_at:
                        ask_at = time.monotonic() + self.config.merge.retry_leader_seconds
                        asking = asyncio.create_task(
                            leader_serves(leader, self.config.rpc_timeout_seconds)
                        )
                await self._flush_reports(stub)
                await self._tell_connected(stub)
                for window in self.pod.take_windows():
                    msg = self._window(window)
                    await call.write(pb.WorkerMessage(window=msg))
                    self.pod.stats.windows_out += 1
                if self._stop.is_set() or self.pod.resync:
                    break  # leaving, or the ranks restarted: end the session, register again
                waiter = asyncio.create_task(self.pod.changed.wait())
                await asyncio.wait(
                    {waiter, reader}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
            # Leaving: the controller reads to the end, then ends the call.
            await call.done_writing()
            await asyncio.wait({reader}, timeout=self.config.grace_seconds)
        finally:
            if asking is not None:
                asking.cancel()
            reader.cancel()
            call.cancel()

    def _window(self, window: CountWindow) -> pb.Window:
        return self._sent.number(
            window.first_step,
            window.num_steps,
            window.version,
            window.logical,
            window.physical,
            self.pod.statement(),
        )

    async def _flush_reports(self, stub: pb_grpc.WorkerServiceStub) -> None:
        while self.pod.reports:
            report = self.pod.reports[0]
            await send_report(
                stub,
                report,
                self._session,
                self.config.rpc_timeout_seconds,
                self._metadata,
                log,
                f"ranks {self.pod.ranks_label}",
            )
            if self.pod.reports and self.pod.reports[0] is report:
                self.pod.reports.popleft()

    async def _tell_connected(self, stub: pb_grpc.WorkerServiceStub) -> None:
        """Tell the controller which ranks have a stream open here, when that changed, so
        it counts a rank whose engine exited as gone although this pod's stream is open."""
        connected = self.pod.connected() & frozenset(self.pod.upstream_ranks)
        if not self._ranks_report_known or connected == self._told_connected:
            return
        request = pb.RankPresence(session_id=self._session, connected_ranks=sorted(connected))
        try:
            await stub.ReportRanks(
                request, timeout=self.config.rpc_timeout_seconds, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise  # reconnect; the new session is told
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning(
                    "the controller does not take ReportRanks (older than this sidecar): "
                    "it counts ranks %s connected while this pod's stream is open",
                    self.pod.ranks_label,
                )
                self._ranks_report_known = False
                return
            log.warning(
                "ranks connected %s refused: %s: %s",
                sorted(connected),
                exc.code().name,
                exc.details(),
            )
        self._told_connected = connected

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for msg in call:
            if msg.WhichOneof("body") == "window_ack":
                self._sent.ack(msg.window_ack.seq)
            else:
                self.pod.from_controller(msg)
