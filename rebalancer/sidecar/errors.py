"""The sidecar's one error type: a well-formed call that does not fit the pod's state.

Raised by the pod state and the plan relay; the socket's WorkerService turns `code` into
the gRPC status of that name, with the message and a log line (as the controller does).
"""

from __future__ import annotations

from typing import Literal

StatusName = Literal["NOT_FOUND", "FAILED_PRECONDITION", "ALREADY_EXISTS", "INVALID_ARGUMENT"]


class SidecarError(Exception):
    """`code` names the gRPC status (NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, ...)."""

    def __init__(self, code: StatusName, message: str) -> None:
        super().__init__(message)
        self.code: StatusName = code
