"""Domain errors: the one vocabulary of failure shared by every stage.

Logic code raises these; each Triton adapter maps them to a ``TritonError`` code in one place
(``backend.triton_io.to_triton_error``). Anything else that escapes is an internal error.
"""
from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARG = "INVALID_ARG"    # the request is wrong; retrying it unchanged will fail again
    UNAVAILABLE = "UNAVAILABLE"    # a stage, buffer or embedding is not available now
    CANCELLED = "CANCELLED"        # the client went away
    INTERNAL = "INTERNAL"          # a defect or an unexpected engine failure


class EpdError(Exception):
    code = ErrorCode.INTERNAL


class InvalidInput(EpdError):
    """Bad input. ``field`` names the request field at fault, e.g. ``image[1]`` or
    ``sampling_parameters.max_tokens``; it leads the message so clients see it first."""

    code = ErrorCode.INVALID_ARG

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class Unavailable(EpdError):
    code = ErrorCode.UNAVAILABLE


class Overloaded(Unavailable):
    """Capacity is exhausted (e.g. the encoder's embedding pool is full of unread leases). Still
    UNAVAILABLE for the client, but not retried by the orchestrator: asking again at once only adds load.
    The message starts with ``PREFIX``, which survives the trip through BLS and gRPC."""

    PREFIX = "overloaded: "

    def __init__(self, message: str):
        super().__init__(message if message.startswith(self.PREFIX) else self.PREFIX + message)


class Cancelled(EpdError):
    code = ErrorCode.CANCELLED


def error_code(exc: BaseException) -> ErrorCode:
    return exc.code if isinstance(exc, EpdError) else ErrorCode.INTERNAL
