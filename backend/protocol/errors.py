"""Domain errors, the one vocabulary of failure shared by every stage, and their envelope on the wire.

Logic code raises these; each Triton adapter maps them to a ``TritonError`` code in one place
(``backend.triton.io.to_triton_error``). Anything else that escapes is an internal error.

Between stages an error travels as text: Triton 2.51 turns every BLS response error into INTERNAL and its gRPC
stream errors carry a message only. A caller that asks for it (request parameter ``epd_error_codes``) gets the
envelope (``encode`` / ``decode``, version ``ENVELOPE_VERSION``)::

    [UNAVAILABLE] image_layouts[0]: embedding lease 3f.. expired before it was read
    epd-error: {"v": 1, "field": "image_layouts[0]", "retryable": true}

The first line is what a person reads (code, then the message, which starts with the field at fault); the second
carries the fields a program needs. ``decode`` also reads a first line alone, and maps Triton's own answers for a
model that cannot serve (a dead stub, an unknown or unloaded model) to UNAVAILABLE naming the stage: the only place
that matches Triton's wording.
"""
from __future__ import annotations

import enum
import json


class ErrorCode(enum.Enum):
    INVALID_ARG = "INVALID_ARG"    # the request is wrong; retrying it unchanged will fail again
    UNAVAILABLE = "UNAVAILABLE"    # a stage, buffer or embedding is not available now
    CANCELLED = "CANCELLED"        # the client went away
    INTERNAL = "INTERNAL"          # a defect or an unexpected engine failure


class EpdError(Exception):
    """``field``: the request field or item at fault, if one is ("" otherwise); its name leads the message.
    ``retryable``: whether asking again unchanged may succeed."""

    code = ErrorCode.INTERNAL
    retryable = False

    def __init__(self, message: str = "", field: str = ""):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)

    @property
    def problem(self) -> str:
        """The message without its leading field."""
        text = str(self)
        return text[len(self.field) + 2:] if self.field and text.startswith(self.field + ": ") else text


class InvalidInput(EpdError):
    """Bad input. ``field`` names the request field at fault, e.g. ``image[1]`` or
    ``sampling_parameters.max_tokens``; it leads the message so clients see it first."""

    code = ErrorCode.INVALID_ARG

    def __init__(self, field: str, problem: str):
        super().__init__(problem, field)


class Unavailable(EpdError):
    """A stage, buffer or embedding is not available now; the orchestrator may retry."""

    code = ErrorCode.UNAVAILABLE
    retryable = True


class Overloaded(Unavailable):
    """Capacity is exhausted (e.g. the encoder's embedding pool is full of unread leases). Still
    UNAVAILABLE for the client, but not retried: asking again at once only adds load. Its message
    starts with ``PREFIX`` (after the field), for the people reading it."""

    PREFIX = "overloaded: "
    retryable = False

    def __init__(self, message: str, field: str = "", retry_after: float = 0.0):
        """``retry_after``: seconds after which asking again may succeed (0: unknown); the OpenAI endpoint's
        ``Retry-After``."""
        super().__init__(message if message.startswith(self.PREFIX) else self.PREFIX + message, field)
        self.retry_after = retry_after


class DeadlineExceeded(Unavailable):
    """The request's deadline passed (``backend.protocol.generate.DEADLINE_PARAMETER``): UNAVAILABLE for the client,
    never retried; every stage stops its work for the request. The envelope says so (``"reason": "deadline"``)."""

    retryable = False
    reason = "deadline"


class Cancelled(EpdError):
    code = ErrorCode.CANCELLED


def error_code(exc: BaseException) -> ErrorCode:
    return exc.code if isinstance(exc, EpdError) else ErrorCode.INTERNAL


# -- the envelope -----------------------------------------------------------------------------------
ENVELOPE_VERSION = 1
_DETAILS = "\nepd-error: "
_CLASSES = {ErrorCode.INVALID_ARG: InvalidInput, ErrorCode.UNAVAILABLE: Unavailable, ErrorCode.CANCELLED: Cancelled}


def encode(exc: BaseException) -> str:
    """``exc`` as envelope text (see the module docstring); anything but an ``EpdError`` is INTERNAL."""
    if not isinstance(exc, EpdError):
        return f"[{ErrorCode.INTERNAL.value}] internal error: {type(exc).__name__}: {exc}"
    details = {"v": ENVELOPE_VERSION, "field": exc.field, "retryable": exc.retryable}
    if getattr(exc, "retry_after", 0):
        details["retry_after"] = exc.retry_after
    if isinstance(exc, DeadlineExceeded):
        details["reason"] = DeadlineExceeded.reason
    return f"[{exc.code.value}] {exc}{_DETAILS}{json.dumps(details)}"


def decode(text: str, stage: str = "") -> EpdError:
    """The domain error an envelope (or its first line alone, or one of Triton's own answers) describes.
    ``stage``: the model that answered, named in what Triton's own answers become. A details line of another
    version is ignored (the first line still gives code and message)."""
    head, _, tail = text.partition(_DETAILS)
    details = {}
    if tail:
        try:
            doc = json.loads(tail)
            details = doc if isinstance(doc, dict) and doc.get("v") == ENVELOPE_VERSION else {}
        except ValueError:
            pass
    code, message = ErrorCode.INTERNAL, head
    if head.startswith("["):
        tag, _, rest = head[1:].partition("] ")
        if tag in ErrorCode.__members__:
            code, message = ErrorCode[tag], rest
    if code is ErrorCode.INTERNAL:
        return _triton_answer(message, stage)
    field = str(details.get("field") or "")
    if not details and code is ErrorCode.INVALID_ARG:  # a first line alone: its field leads the message
        field = message.partition(": ")[0] if ": " in message else "request"
    problem = message[len(field) + 2:] if field and message.startswith(field + ": ") else message
    if code is ErrorCode.INVALID_ARG:
        return InvalidInput(field, problem)
    if code is ErrorCode.UNAVAILABLE and details.get("reason") == DeadlineExceeded.reason:
        return DeadlineExceeded(problem, field)
    if code is ErrorCode.UNAVAILABLE and (details.get("retryable") is False or problem.startswith(Overloaded.PREFIX)):
        retry_after = details.get("retry_after", 0)
        return Overloaded(problem, field, retry_after if isinstance(retry_after, (int, float)) else 0.0)
    return _CLASSES[code](problem, field)


def _triton_answer(message: str, stage: str) -> EpdError:
    """Triton's own answers for a model that cannot serve, as UNAVAILABLE naming the stage: a dead stub
    ("Stub process 'encoder_0_1' is not healthy."), a model unloaded or loading ("Request for unknown model:
    ...", "... is not ready"). Anything else stays INTERNAL."""
    if "is not healthy" in message:
        return Unavailable(f"{stage} instance down: {message}")
    if "Request for unknown model" in message or "is not ready" in message:
        return Unavailable(f"stage {stage} unavailable: {message}")
    return EpdError(message)
