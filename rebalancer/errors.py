"""Errors with a message fit for an operator, shared by every process of the project.

InputError marks bad input (a file, a flag, a message): the CLI turns it into
exit code 2 and one line, the gRPC layer into INVALID_ARGUMENT. Nothing that
raises it may have changed state first.

StateError marks a well-formed request that does not fit the state it meets (the
controller's deployments and plans, a sidecar's pod): `code` names the gRPC status the
servers answer with (`rebalancer.wire.service.refuse`). Nothing that raises it may have
changed state first either.
"""

from __future__ import annotations

from typing import Literal

StatusName = Literal[
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "ALREADY_EXISTS",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",  # not now: the caller asks again (a resize while a plan is under way)
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
]


# The error a rank reports (FAILED) for a plan it fails because it is stopping: a planned
# shutdown, not a fault. The plan aborts on every rank as any failed plan does, but the
# controller counts it apart from the aborts that mean something went wrong
# (rebalancer_plans_total{outcome="stopped"}, not the aborts' alert) and logs it at INFO.
SHUTTING_DOWN = "rank is shutting down"


class InputError(ValueError):
    """Input that is malformed or inconsistent; the message says what and where."""


class StateError(Exception):
    """`code` names the gRPC status (NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, ...)."""

    def __init__(self, code: StatusName, message: str) -> None:
        super().__init__(message)
        self.code: StatusName = code
