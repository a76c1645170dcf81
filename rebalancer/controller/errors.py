"""The controller's state errors: a well-formed request that does not fit the state."""


class StateError(Exception):
    """`code` names the gRPC status (NOT_FOUND, FAILED_PRECONDITION, ALREADY_EXISTS, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
