"""A small client library for the generating models' shared Triton interface.

``generate(...)`` sends one request (text prompt or chat ``messages``, plus image bytes) over gRPC
streaming or HTTP ``/generate_stream`` and returns a ``GenerateResult`` with the text, finish reason,
token counts, time to first token and total time. The CLI (``clients.chat``), the demo, the tests and
the benchmarks all use it.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np


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


class GenerateError(RuntimeError):
    """The server answered with an error. ``status`` is gRPC's code name or the HTTP status."""

    def __init__(self, status: str, message: str):
        self.status, self.message = status, message
        super().__init__(f"[{status}] {message}")


@dataclass
class GenerateInputs:
    prompt: str | None = None
    messages: list[dict] | str | None = None
    images: Sequence[bytes] = ()
    image_layouts: Sequence[str] = ()  # metadata-only media, for a consumer model (pd, prefill, decode)
    kv_transfer_params: dict | None = None  # prefill / decode stages: vLLM KV connector parameters
    sampling: dict[str, Any] | str | None = None  # a dict, or JSON text sent as is
    stream: bool = True
    exclude_input_in_output: bool = True
    return_counts: bool = True
    parameters: dict[str, Any] | None = None  # Triton request parameters (gRPC), e.g. {"epd_metadata_only": False}

    def as_values(self) -> dict[str, Any]:
        """Input name -> value for the shared interface; absent inputs are left out."""
        values: dict[str, Any] = {"stream": self.stream, "exclude_input_in_output": self.exclude_input_in_output,
                                  "return_num_input_tokens": self.return_counts,
                                  "return_num_output_tokens": self.return_counts}
        if self.prompt is not None:
            values["text_input"] = self.prompt
        if self.messages is not None:
            values["messages"] = self.messages if isinstance(self.messages, str) else json.dumps(self.messages)
        if self.images:
            values["image"] = list(self.images)
        if self.image_layouts:
            values["image_layouts"] = list(self.image_layouts)
        if self.kv_transfer_params is not None:
            values["kv_transfer_params"] = json.dumps(self.kv_transfer_params)
        if self.sampling is not None:
            values["sampling_parameters"] = self.sampling if isinstance(self.sampling, str) else json.dumps(self.sampling)
        return values


def grpc_inputs(values: dict[str, Any]):
    """Triton gRPC input tensors for the shared interface's values (see ``GenerateInputs.as_values``)."""
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value in values.items():
        if isinstance(value, bool):
            arr, dtype = np.array([value], dtype=bool), "BOOL"
        elif isinstance(value, list):
            arr, dtype = np.array(value, dtype=np.object_), "BYTES"
        else:
            arr, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    return tensors


END_OF_STREAM_SECONDS = 5.0


class _Stream:
    """tritonclient's gRPC response iterator (``stream_infer``), remembering whether it was cancelled."""

    def __init__(self, inner, done: asyncio.Event | None = None):
        self._inner, self.cancelled, self._done = inner, False, done

    def done_writing(self) -> None:
        """Close the request side now: the stream then ends once the server has completed the request (a bare
        final flag, e.g. after an in-band cancel, sends no response over gRPC; only the stream's end shows it)."""
        if self._done is not None:
            self._done.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._inner.__anext__()

    def cancel(self):
        self.cancelled = True
        return self._inner.cancel()


async def read_to_end(stream, timeout: float = END_OF_STREAM_SECONDS) -> None:
    """Read a gRPC stream whose request side is closed to its end: the server's OK status. A client that closes
    its channel (or drops the call) after the last response but before that status cancels the RPC, and Triton
    2.51's gRPC frontend can then leak the stream's state and the request it holds: the server grows, and the
    model never unloads, so the server waits out its exit timeout (docs/robustness.md, "Shutdown"). Cancels
    the stream if it has not ended within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in stream:
                pass
    except TimeoutError:
        stream.cancel()
    except Exception:  # noqa: BLE001 - the RPC ended with an error status: it ended
        pass


@contextlib.asynccontextmanager
async def single_request_stream(client, request: dict):
    """A gRPC stream (``tritonclient.grpc.aio`` ``client``) carrying one request (``stream_infer``'s dict).
    Its request side stays open until the block exits, so Triton keeps streaming the responses; a caller
    leaving before the last response should ``cancel()`` the yielded stream, which cancels the request.
    Otherwise the block's exit closes the request side and reads the stream to its end (``read_to_end``)."""
    done = asyncio.Event()

    async def requests():
        yield request
        await done.wait()

    stream = _Stream(client.stream_infer(requests()), done)
    try:
        yield stream
    finally:
        done.set()
        if not stream.cancelled:
            await read_to_end(stream)


async def cancel_in_band(client, model: str, request_id: str, parameters: dict | None = None,
                         timeout: float = END_OF_STREAM_SECONDS) -> None:
    """Cancel the request ``request_id`` of ``model`` (one of this project's) in band: a second request, on
    its own stream of ``client`` (``tritonclient.grpc.aio``), whose parameter ``epd_cancel`` names it
    (``backend.cancel_board``). Raises the server's error, or TimeoutError."""
    from backend.cancel_board import CANCEL_PARAMETER

    async def one_request():  # then the request side closes, so the stream ends once the server answered
        yield {"model_name": model, "inputs": [], "parameters": {**(parameters or {}), CANCEL_PARAMETER: request_id}}

    stream, failed = client.stream_infer(one_request()), None
    try:
        async with asyncio.timeout(timeout):
            async for _result, error in stream:  # no response: the model sends the final flag alone
                failed = failed or error
    except TimeoutError:
        stream.cancel()
        raise
    if failed is not None:
        raise failed


def _absorb(result: GenerateResult, text: str | None, fields: dict[str, Any], started: float,
            on_text: Callable[[str], None] | None) -> None:
    if text:
        if result.ttft is None:
            result.ttft = time.perf_counter() - started
        result.chunks.append(text)
        if on_text:
            on_text(text)
    for key in ("finish_reason", "num_input_tokens", "num_output_tokens"):
        if fields.get(key) is not None:
            setattr(result, key, fields[key])
    for key in ("timings", "kv_transfer_params"):
        if fields.get(key):
            setattr(result, key, json.loads(fields[key]))


def generate_grpc(url: str, model: str, inputs: GenerateInputs, on_text: Callable[[str], None] | None = None,
                  timeout: float = 300.0, cancel_after_chunks: int | None = None, cancel_via: str = "grpc") -> GenerateResult:
    """One request over a gRPC bidirectional stream. With ``cancel_after_chunks`` the client cancels
    the request once that many text chunks have arrived: ``cancel_via="grpc"`` cancels the stream (as a user
    closing it would), ``"request"`` sends an in-band cancel on the same stream (a request whose parameter
    ``epd_cancel`` is the request's id, ``backend.cancel_board``) and reads on to the request's final
    response, which the model sends once it has stopped."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from backend.cancel_board import CANCEL_PARAMETER

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
                # model from unloading at shutdown (docs/robustness.md, "Shutdown").
                finished = True
                if isinstance(err, InferenceServerException):
                    # gRPC stream errors carry only a message (ModelStreamInferResponse.error_message).
                    raise GenerateError(str(err.status() or "STREAM_ERROR").replace("StatusCode.", ""),
                                        err.message())
                raise err
            fields = {k: _scalar(res.as_numpy(k)) for k in ("text_output", "finish_reason", "num_input_tokens",
                                                             "num_output_tokens", "timings", "kv_transfer_params")}
            _absorb(result, fields.pop("text_output"), fields, started, on_text)
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
    if "image" in values:
        values["image"] = [base64.b64encode(b).decode() for b in values["image"]]
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
                _absorb(result, _first(doc.get("text_output")), {k: _first(doc.get(k)) for k in
                        ("finish_reason", "num_input_tokens", "num_output_tokens", "timings", "kv_transfer_params")},
                        started, on_text)
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
