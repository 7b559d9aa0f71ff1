"""A small client library for the generating models' shared Triton interface.

``generate(...)`` sends one request (text prompt or chat ``messages``, plus image bytes) over gRPC
streaming or HTTP ``/generate_stream`` and returns a ``GenerateResult`` with the text, finish reason,
token counts, time to first token and total time. The CLI (``clients.chat``), the demo, the tests and
the benchmarks all use it.
"""
from __future__ import annotations

import base64
import json
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from backend.protocol import generate as interface
from backend.protocol.generate import GenerateInputs
# the stream helpers are this library's too (the benchmarks and tests import them from here)
from backend.triton.grpc_stream import (END_OF_STREAM_SECONDS, cancel_in_band, grpc_inputs,  # noqa: F401
                                         read_to_end, single_request_stream)


@dataclass
class GenerateResult:
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    ttft: float | None = None   # seconds from send to the first non-empty text chunk
    total: float = 0.0          # seconds from send to the final response
    cancelled: bool = False
    timings: dict | None = None  # stage breakdown from an orchestrator (epd): encode_ms, transfer_ms, ...
    kv_transfer_params: dict | None = None  # from a prefill stage
    logprobs: list | None = None  # every generated token's entry (sampling ``logprobs``), the responses' joined


class GenerateError(RuntimeError):
    """The server answered with an error. ``status`` is gRPC's code name or the HTTP status."""

    def __init__(self, status: str, message: str):
        self.status, self.message = status, message
        super().__init__(f"[{status}] {message}")


def _absorb(result: GenerateResult, value: Callable[[str], Any], started: float,
            on_text: Callable[[str], None] | None) -> None:
    """One response into ``result``; ``value(name)``: the response's output ``name`` (None: absent)."""
    fields = interface.output_fields(value)
    text = fields.pop("text_output")
    if text:
        if result.ttft is None:
            result.ttft = time.perf_counter() - started
        result.chunks.append(text)
        if on_text:
            on_text(text)
    logprobs = fields.pop("logprobs")
    if logprobs is not None:
        result.logprobs = (result.logprobs or []) + logprobs
    for key, item in fields.items():
        if item is not None:
            setattr(result, key, item)


def generate_grpc(url: str, model: str, inputs: GenerateInputs, on_text: Callable[[str], None] | None = None,
                  timeout: float = 300.0, cancel_after_chunks: int | None = None, cancel_via: str = "grpc") -> GenerateResult:
    """One request over a gRPC bidirectional stream. With ``cancel_after_chunks`` the client cancels
    the request once that many text chunks have arrived: ``cancel_via="grpc"`` cancels the stream (as a user
    closing it would), ``"request"`` sends an in-band cancel on the same stream (a request whose parameter
    ``epd_cancel`` is the request's id, ``orchestrator.cancel_board``) and reads on to the request's final
    response, which the model sends once it has stopped."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from backend.protocol.generate import CANCEL_PARAMETER

    if cancel_via not in ("grpc", "request"):
        raise ValueError(f"cancel_via: expected grpc or request, got {cancel_via!r}")
    request_id = uuid.uuid4().hex

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    result = GenerateResult()
    started = time.perf_counter()
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(inputs.as_values()), request_id=request_id,
                                  enable_empty_final_response=True, parameters=inputs.parameters)
        while True:
            try:
                res, err = responses.get(timeout=max(0.0, timeout - (time.perf_counter() - started)))
            except queue.Empty:
                raise TimeoutError(f"no final response from {model} within {timeout} s") from None
            if err is not None:
                # An error is the request's last response (the server completed it): cancelling the stream
                # now only races Triton 2.51's gRPC frontend, which can then leak the request and keep the
                # model from unloading at shutdown (docs/results/robustness.md, "Shutdown").
                finished = True
                if isinstance(err, InferenceServerException):
                    # gRPC stream errors carry only a message (ModelStreamInferResponse.error_message).
                    raise GenerateError(str(err.status() or "STREAM_ERROR").replace("StatusCode.", ""),
                                        err.message())
                raise err
            _absorb(result, lambda name: _scalar(res.as_numpy(name)), started, on_text)
            params = res.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                finished = True
                break
            if cancel_after_chunks is not None and len(result.chunks) >= cancel_after_chunks and not result.cancelled:
                result.cancelled = True
                if cancel_via == "grpc":
                    client.stop_stream(cancel_requests=True)
                    break
                client.async_stream_infer(model, [], request_id=f"cancel-{request_id}",
                                          parameters={CANCEL_PARAMETER: request_id})
    finally:
        # Unfinished (timeout, error, cancel): cancel the stream, or stop_stream waits for the server forever.
        client.stop_stream(cancel_requests=not finished and not (result.cancelled and cancel_via == "grpc"))
        client.close()
    result.total = time.perf_counter() - started
    result.text = "".join(result.chunks)
    return result


def generate_http(url: str, model: str, inputs: GenerateInputs, on_text: Callable[[str], None] | None = None,
                  timeout: float = 300.0) -> GenerateResult:
    """One request to Triton's HTTP generate extension (``/generate_stream``, server-sent events).
    Image bytes travel base64-encoded in the JSON body."""
    import urllib.error
    import urllib.request

    values = inputs.as_values()
    values.update(inputs.parameters or {})  # the generate extension takes a key that names no input as a parameter
    for tensor in interface.input_tensors():  # media bytes travel base64-encoded
        if tensor.form is interface.Form.BYTES and tensor.name in values:
            values[tensor.name] = [base64.b64encode(b).decode() for b in values[tensor.name]]
    endpoint = "generate_stream" if inputs.stream else "generate"
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=json.dumps(values).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    result = GenerateResult()
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            lines = resp if inputs.stream else [b"data: " + resp.read()]
            for raw in lines:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                doc = json.loads(line[5:])
                if "error" in doc:
                    raise GenerateError("HTTP", doc["error"])
                _absorb(result, lambda name: _first(doc.get(name)), started, on_text)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace").strip()
        try:  # generate_stream sends its error as one SSE event
            body = json.loads(body.removeprefix("data:")).get("error", body)
        except ValueError:
            pass
        raise GenerateError(str(exc.code), body) from None
    result.total = time.perf_counter() - started
    result.text = "".join(result.chunks)
    return result


def generate(url: str, model: str, inputs: GenerateInputs, protocol: str = "grpc", **kwargs) -> GenerateResult:
    if protocol == "grpc":
        return generate_grpc(url, model, inputs, **kwargs)
    if protocol == "http":
        return generate_http(url, model, inputs, **kwargs)
    raise ValueError(f"unknown protocol {protocol!r}; use grpc or http")


def _scalar(arr):
    if arr is None or arr.size == 0:
        return None
    value = arr.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _first(value):
    return value[0] if isinstance(value, list) else value
