"""The Triton boundary's request side: tensors <-> typed values, response sending, error codes, in-band cancels.

``backend/triton/`` is the Triton boundary: only its modules import ``triton_python_backend_utils`` or
``tritonclient`` (tests/unit/test_house.py checks it), so everything under it stays testable without
tritonserver. Domain errors are mapped to ``TritonError`` codes here, once.
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol.errors import ErrorCode, EpdError, InvalidInput, decode, encode, error_code
from backend.protocol.generate import (CANCEL_PARAMETER, ERROR_CODES_PARAMETER, HELD_PARAMETER, Form, input_tensors,
                                       output_tensors, parse_session)
from backend.request.generate import RawGenerateInputs, parameter_inputs
from backend.engine.serving import ResponseChunk
from orchestrator.core import run_options

if TYPE_CHECKING:
    from backend.triton.metrics import RequestMetrics
    from orchestrator.core import Orchestrator

log = logging.getLogger(__name__)


def request_parameters(request) -> dict:
    try:
        doc = json.loads(request.parameters() or "{}")
    except (ValueError, AttributeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def wants_error_codes(request) -> bool:
    return bool(request_parameters(request).get(ERROR_CODES_PARAMETER))


def from_triton_error(error, stage: str = "") -> EpdError:
    """A stage's error (a BLS response's TritonError or a gRPC InferenceServerException: both have
    ``message()``) as the domain error its envelope describes (``backend.protocol.errors.decode``)."""
    return decode(error.message(), stage)


def to_triton_error(exc: BaseException, tag_code: bool = False):
    """``exc`` as a TritonError of its code; ``tag_code``: the message is the error envelope."""
    code = error_code(exc)
    message = str(exc) if isinstance(exc, EpdError) else f"internal error: {type(exc).__name__}: {exc}"
    if code is ErrorCode.INTERNAL:
        log.error("request failed: %s", message, exc_info=exc)
    # Looked up per call: the stub adds TritonError to pb_utils after importing model.py.
    return pb_utils.TritonError(encode(exc) if tag_code else message, getattr(pb_utils.TritonError, code.value))


def _array(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(request, name: str) -> str | None:
    arr = _array(request, name)
    if arr is None:
        return None
    if arr.size != 1:
        raise InvalidInput(name, f"expected one element, got {arr.size}")
    value = arr.reshape(-1)[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise InvalidInput(name, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _texts(request, name: str) -> tuple[str, ...]:
    arr = _array(request, name)
    if arr is None:
        return ()
    try:
        return tuple(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in arr.reshape(-1))
    except UnicodeDecodeError as exc:
        raise InvalidInput(name, f"not valid UTF-8 ({exc.reason})") from None


def _bool(request, name: str) -> bool:
    arr = _array(request, name)
    if arr is None:
        return False
    if arr.size != 1:
        raise InvalidInput(name, f"expected one element, got {arr.size}")
    return bool(arr.reshape(-1)[0])


def _bytes_items(request, name: str) -> tuple[bytes, ...]:
    arr = _array(request, name)
    return () if arr is None else tuple(bytes(x) for x in arr.reshape(-1))


_READ = {Form.TEXT: _text, Form.TEXTS: _texts, Form.BYTES: _bytes_items, Form.BOOL: _bool}


def read_generate_inputs(request) -> RawGenerateInputs:
    """The request's tensors of the generate interface (``backend.protocol.generate.input_tensors``) as typed values,
    and its ``session_id`` and ``media_io_kwargs`` parameters (InvalidInput naming what is wrong)."""
    return RawGenerateInputs(**{t.field: _READ[t.form](request, t.name) for t in input_tensors()},
                             **parameter_inputs(request_parameters(request)))


def _output(tensor, value) -> "pb_utils.Tensor":
    if tensor.form is Form.UINT:
        return pb_utils.Tensor(tensor.name, np.array([value], dtype=np.uint32))
    text = json.dumps(value) if tensor.form is Form.JSON else value
    return pb_utils.Tensor(tensor.name, np.array([text.encode("utf-8")], dtype=np.object_))


class TritonSink:
    """``backend.engine.serving.ResponseSink`` over a decoupled model's response sender.

    ``is_cancelled`` asks the server at most every ``CANCEL_CHECK_SECONDS``, the first time that long after the
    request was read (each ask is a round trip from the stub to the server: every 20 ms, from the first token, it was
    0.3-0.5 ms of a stage's CPU per request, docs/benchmarks.md); a cancel is seen that much later. An in-band
    cancel (``epd_cancel``, what the orchestrators and the OpenAI endpoint send) is checked every
    ``BOARD_CHECK_SECONDS``, from the first token.

    The request is always completed exactly once: a send that fails (e.g. the client went away) still
    sends the final flag, and later ``send_error``/``close`` calls are no-ops. A decoupled request that
    never gets its final flag keeps Triton from unloading the model (seen at shutdown after a soak
    with cancelling clients: the server waited out its exit timeout and left the stub's /dev/shm region).
    """

    CANCEL_CHECK_SECONDS = 0.1
    BOARD_CHECK_SECONDS = 0.02

    def __init__(self, sender, tag_error_codes: bool = False, cancelled=None, timer: "RequestMetrics | None" = None):
        """``cancelled``: another check, asked first (``CancelBoard.watch``: an in-band cancel). ``timer`` is told
        the time from now (the request read in ``execute``) to its first text and to its final response."""
        self._sender = sender
        self._tag = tag_error_codes
        self._also_cancelled = cancelled
        self._cancelled = False
        self._checked = time.monotonic()
        self._board_checked = float("-inf")
        self._completed = False
        self._timer, self._started, self._first = timer, time.monotonic(), True

    def is_cancelled(self) -> bool:
        if self._cancelled:
            return True
        now = time.monotonic()
        if self._also_cancelled is not None and now - self._board_checked >= self.BOARD_CHECK_SECONDS:
            self._board_checked = now  # in band: no round trip (a dict lookup and a stat)
            self._cancelled = bool(self._also_cancelled())
        if not self._cancelled and now - self._checked >= self.CANCEL_CHECK_SECONDS:
            self._checked = now
            self._cancelled = self._sender.is_cancelled()
        return self._cancelled

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        values = ((t, getattr(chunk, t.field)) for t in output_tensors())
        outputs = [_output(t, value) for t, value in values if value is not None or not t.optional]
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if self._completed:
            raise RuntimeError("response sent after the request was completed")
        # as it leaves: the client may read it before send() returns
        elapsed = time.monotonic() - self._started if self._timer is not None else 0.0
        try:
            self._sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
        except Exception:
            self.close()
            raise
        if self._timer is not None:
            if self._first and chunk.text_output:
                self._first = False
                self._timer.first_text(elapsed)
            if final:
                self._timer.final_response(elapsed, chunk.timings)
        self._completed = final

    def send_error(self, exc: BaseException) -> None:
        if self._completed:
            return
        try:
            send_error(self._sender, exc, self._tag)
            self._completed = True
        except Exception as send_failure:  # noqa: BLE001 - the client may be gone; still complete the request
            log.warning("could not send error %r: %s", exc, send_failure)
            self.close()

    def close(self) -> None:
        if self._completed:
            return
        self._completed = True
        try:
            self._sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001 - already closed by the server side
            log.warning("could not complete the request: %s", exc)


def in_band_cancel(sender, params: dict, board, tag_code: bool) -> bool:
    """Answer the request (of ``sender`` and ``params``) if it is a cancel (``CANCEL_PARAMETER``: the id of
    the request to cancel): cancel that one on ``board`` and complete this one (the final flag, no response).
    False: not a cancel."""
    target = params.get(CANCEL_PARAMETER)
    if target is None:
        return False
    if not isinstance(target, str) or not target:
        send_error(sender, InvalidInput(f"parameters.{CANCEL_PARAMETER}", f"expected a request id, got {target!r}"), tag_code)
    else:
        board.cancel(target)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    return True


def answer_held_lookup(sender, query, held, tag_code: bool) -> None:
    """Answer a lookup of held embeddings (``HELD_PARAMETER``'s JSON ``{"keys": [...], "session": id or null}``):
    one final response whose ``text_output`` is the JSON object {content key: layout document} of the keys ``held``
    (``backend.transfer.held.HeldEmbeddings``; None: this consumer keeps no copies) holds."""
    try:
        try:
            doc = json.loads(query) if isinstance(query, str) else None
        except ValueError:
            doc = None
        keys, session = (doc.get("keys"), doc.get("session")) if isinstance(doc, dict) else (None, None)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise InvalidInput(f"parameters.{HELD_PARAMETER}", 'expected JSON {"keys": [content key, ...], "session": ...}, '
                                                               f"got {query!r:.80}")
        found = held.lookup(keys, parse_session(session)) if held is not None else {}
    except Exception as exc:  # noqa: BLE001 - the asker's error, never this model's
        send_error(sender, exc, tag_code)
        return
    answer_json(sender, found)


def answer_json(sender, doc) -> None:
    """One final response whose ``text_output`` is ``doc`` as JSON (the answer to a lookup or a load probe)."""
    text = pb_utils.Tensor("text_output", np.array([json.dumps(doc).encode()], dtype=np.object_))
    sender.send(pb_utils.InferenceResponse(output_tensors=[text]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def watched_sink(request, sender, board, tag_code: bool, timer: "RequestMetrics | None" = None) -> tuple[str, "TritonSink"]:
    """The request's id and its sink, which also sees in-band cancels of that id (registered on ``board``:
    the caller ends the registration with ``board.tracking``) and reports its latencies to ``timer``."""
    request_id = request.request_id() or ""
    return request_id, TritonSink(sender, tag_code, board.watch(request_id) if request_id else None, timer)


def orchestrate(requests, orchestrator: "Orchestrator", metrics, submit, cancels) -> None:
    """``execute`` of the orchestrator models (``epd``, ``backend.triton.models.colocated``): read each request (a bad
    one is answered with its error at once; an in-band cancel cancels on ``cancels``, a ``CancelBoard``) and
    ``submit`` the orchestrator's run of it to the model's event loop."""
    for request in requests:
        sender = request.get_response_sender()
        params = request_parameters(request)
        tag = bool(params.get(ERROR_CODES_PARAMETER))  # clients may ask for "[CODE] " before messages, as stages do
        if in_band_cancel(sender, params, cancels, tag):
            continue
        try:
            raw = read_generate_inputs(request)
            options = run_options(params)
        except Exception as exc:
            send_error(sender, exc, tag)
            continue
        request_id, sink = watched_sink(request, sender, cancels, tag, metrics)
        submit(cancels.tracking(request_id, orchestrator.run(raw, sink, metrics, *options)))


def send_error(sender, exc: BaseException, tag_code: bool = False) -> None:
    sender.send(pb_utils.InferenceResponse(error=to_triton_error(exc, tag_code)),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
