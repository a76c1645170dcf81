"""The controller's one error type: a well-formed request that does not fit the state.

Raised by every part of the controller (registry, ingest, plan coordination, operator
calls, worker authorization); the gRPC layer turns `code` into the status of that name.
"""

from __future__ import annotations

from typing import Literal

StatusName = Literal[
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "ALREADY_EXISTS",
    "INVALID_ARGUMENT",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
]


class StateError(Exception):
    """`code` names the gRPC status (NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, ...)."""

    def __init__(self, code: StatusName, message: str) -> None:
        super().__init__(message)
        self.code: StatusName = code
