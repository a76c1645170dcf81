"""What a rank's agent and a pod's sidecar both do on their link to the controller
(how they reach it: rebalancer.wire.link).

`SentWindows` numbers the windows a link sends and keeps those the controller has not
acknowledged: after a (re-)Register they are resent, renumbered from the controller's
cursor, so nothing is lost or counted twice; an ack drops every window up to its seq.
`send_report` delivers one plan report: a lost link raises (the caller reconnects and
sends it again), a refusal is logged and the report dropped (sending it again would be
refused again). The agent calls both under its lock (its serving thread adds windows);
the sidecar on its one event loop.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec

# The statuses of a link that is gone or stalled, not of a refusal: try again after a reconnect.
LINK_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SentWindows:
    """Windows sent on a link and not yet acknowledged (module doc)."""

    def __init__(self) -> None:
        self.unacked: dict[int, pb.Window] = {}
        self.next_seq = 0

    def __len__(self) -> int:
        return len(self.unacked)

    def number(
        self,
        first_step: int,
        num_steps: int,
        version: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
        serving: codec.Statement = (0, 0),
    ) -> pb.Window:
        """The next window to send, numbered and kept until acknowledged; `serving`: what
        the sender serves now (Window.serving_version / serving_hash)."""
        msg = codec.window_message(
            self.next_seq, first_step, num_steps, version, logical, physical, serving
        )
        self.unacked[self.next_seq] = msg
        self.next_seq += 1
        return msg

    def resume(self, expected: int) -> list[pb.Window]:
        """After a (re-)Register with the controller's cursor `expected`: the windows to
        send again, in order (those it has not counted, renumbered from `expected`)."""
        self.unacked = codec.resend_from(self.unacked, expected)
        self.next_seq = expected + len(self.unacked)
        return self.waiting()

    def waiting(self) -> list[pb.Window]:
        """Every unacknowledged window, oldest first (sent again on a new stream)."""
        return [self.unacked[s] for s in sorted(self.unacked)]

    def withdraw_statements(self) -> None:
        """The sender's ranks restarted: what the unacknowledged windows say they serve is
        no longer true, so they are resent without it (a stale statement would make the
        controller adopt a version no rank serves any more)."""
        for msg in self.unacked.values():
            msg.serving_hash = 0

    def ack(self, seq: int) -> None:
        """The controller counted every window up to `seq`."""
        for s in [s for s in self.unacked if s <= seq]:
            del self.unacked[s]


async def send_report(
    stub: pb_grpc.WorkerServiceStub,
    report: pb.PlanReport,
    session_id: str,
    timeout: float,
    metadata: tuple[tuple[str, str], ...],
    logger: logging.Logger,
    who: str,
) -> None:
    """Deliver one plan report for `session_id` (module doc); `who` names the sender in the log."""
    report.session_id = session_id
    try:
        await stub.ReportPlan(report, timeout=timeout, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in LINK_LOST:
            raise  # reconnect, then send it again
        logger.warning(
            "%s: report of v%d (%s) refused: %s: %s",
            who,
            report.version,
            pb.PlanPhase.Name(report.phase),
            exc.code().name,
            exc.details(),
        )
