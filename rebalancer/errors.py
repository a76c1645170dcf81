"""Errors with a message fit for an operator.

InputError marks bad input (a file, a flag, a message): the CLI turns it into
exit code 2 and one line, the gRPC layer into INVALID_ARGUMENT. Nothing that
raises it may have changed state first.
"""


class InputError(ValueError):
    """Input that is malformed or inconsistent; the message says what and where."""
