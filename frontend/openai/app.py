"""The OpenAI-compatible endpoint's FastAPI application: each request one generate request on tritonserver's gRPC
streaming endpoint (``backend.triton.grpc_stream``), answered as OpenAI answers (``frontend.openai.translate``).

A client that goes away before the answer is complete (a closed SSE stream, a dropped connection) gets its request
cancelled in band (``epd_cancel``), which every model here passes on to its stages, so nothing keeps generating.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from backend.protocol.generate import ERROR_CODES_PARAMETER, PRIORITY_PARAMETER, GenerateInputs
from backend.triton.grpc_stream import StreamPool, cancel_in_band, grpc_inputs
from frontend.openai import translate
from frontend.openai.choices import interleaved
from frontend.openai.logprobs import text_length
from frontend.openai.metrics import Clock, Metrics
from frontend.openai.shedding import Shedding
from frontend.openai.tools import ToolSupport
from frontend.openai.translate import ApiError, GenerateCall

DISCONNECT_POLL_SECONDS = 0.25


class Piece(NamedTuple):
    """One generate response: its text, finish reason, (prompt, completion) token counts (the final response's),
    its tokens' logprobs entries (``backend.engine.logprobs``; None where the request asked for none), whether it
    is the request's last, and the final response's ``timings`` (orchestrators, consumers: items, held, cached
    tokens)."""

    text: str
    reason: str | None
    counts: tuple[int, int] | None
    logprobs: list[dict] | None
    final: bool = False
    timings: dict | None = None


class Backend:
    """tritonserver's gRPC endpoint at ``url`` and the generating models served through it (``models``)."""

    def __init__(self, url: str, models: list[str]):
        self.url, self.models = url, list(models)
        self._client, self._streams = None, None

    @property
    def client(self):
        if self._client is None:  # made in the serving event loop
            import tritonclient.grpc.aio as grpcaio

            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    @property
    def streams(self) -> StreamPool:
        """Kept gRPC streams, one request at a time each (``StreamPool``)."""
        if self._streams is None:
            self._streams = StreamPool(self.client)
        return self._streams

    async def close(self) -> None:
        """Close the kept streams, then the channel."""
        if self._streams is not None:
            await self._streams.close()
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> dict[str, bool]:
        """Every model of the server's repository (the served ones and the stages behind them: ``encoder``, ``pd``,
        ...) -> whether it is READY; a served model the index lacks, and everything while the server does not
        answer, is not."""
        try:
            index = await self.client.get_model_repository_index(as_json=True)
            states = {m["name"]: m.get("state") == "READY" for m in index.get("models", [])}
            return {**{m: False for m in self.models}, **states}
        except Exception:  # noqa: BLE001 - the server is down or not answering: nothing is ready
            return {m: False for m in self.models}

    async def generate(self, call: GenerateCall, clock: Clock | None = None) -> AsyncIterator[Piece]:
        """One ``Piece`` per response, up to the final one; ApiError for the request's error. Leaving early (the caller
        stops iterating before the final piece) cancels the request in band; closing it after the final piece reads
        the gRPC stream to its end (so a caller can answer its client first). ``clock``: waits on responses count
        there."""
        inputs = GenerateInputs(stream=True, **call.inputs).as_values()
        request = {"model_name": call.model, "inputs": grpc_inputs(inputs), "request_id": call.request_id,
                   "parameters": {ERROR_CODES_PARAMETER: True, **call.parameters}, "enable_empty_final_response": True}
        finished = False
        async with self.streams.stream(request) as stream:
            try:
                async for result, error in _timed(stream, clock):
                    if error is not None:
                        finished = True
                        raise translate.api_error(_message(error), call.model)
                    final = result.get_response().parameters["triton_final_response"].bool_param
                    logprobs, timings = _json(result.as_numpy("logprobs")), _json(result.as_numpy("timings"))
                    finished = final
                    yield Piece(_str(result.as_numpy("text_output")) or "", _str(result.as_numpy("finish_reason")),
                                _counts(result), logprobs, final, timings)
                    if final:
                        return
                finished = True
                raise ApiError(502, "the generate stream ended before its final response", "internal_error")
            finally:
                if not finished:
                    with contextlib.suppress(Exception):
                        await cancel_in_band(self.client, call.model, call.request_id)


async def _timed(stream, clock: Clock | None):
    """``stream``'s items, each wait for one told to ``clock``."""
    while True:
        since = clock.waiting() if clock is not None else 0.0
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            return
        finally:
            if clock is not None:
                clock.responded(since)
        yield item


def _message(error) -> str:
    return error.message() if callable(getattr(error, "message", None)) else str(error)


def _str(arr) -> str | None:
    if arr is None or not arr.size:
        return None
    value = arr.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def _json(arr):
    text = _str(arr)
    return None if not text else json.loads(text)


def _counts(result) -> tuple[int, int] | None:
    prompt, completion = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
    if prompt is None or completion is None:
        return None
    return int(prompt.reshape(-1)[0]), int(completion.reshape(-1)[0])


def _error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(int(err.retry_after))} if err.retry_after else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _whole(backend: Backend, calls: list[GenerateCall], request: Request, clock: Clock) -> dict[str, Any]:
    """A request without ``stream`` (each of its choices' ``calls`` read to the end), cancelled if the client
    disconnects meanwhile."""
    async def read(call: GenerateCall):
        text, reason, counts, logprobs, timings = [], None, (0, 0), [], None
        async for piece in backend.generate(call, clock):
            text.append(piece.text)
            logprobs.extend(piece.logprobs or ())
            reason, counts, timings = piece.reason or reason, piece.counts or counts, piece.timings or timings
        return translate.completion(call, "".join(text), reason, counts, logprobs, timings)

    task = asyncio.ensure_future(asyncio.gather(*(read(call) for call in calls)))
    while not task.done():
        await asyncio.wait([task], timeout=DISCONNECT_POLL_SECONDS)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # leaves backend.generate early: it cancels the request in band
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError(499, "client disconnected", "cancelled")
    return translate.merged(task.result())


async def _events(calls: list[GenerateCall], responses, head: tuple, answered) -> AsyncIterator[str]:
    """Server-Sent Events as OpenAI sends them: ``data: {...}`` lines, ``data: [DONE]`` last; ``responses``: the
    choices' ``(index, piece)`` (``frontend.openai.choices.interleaved``), ``head`` the first of them, read before the
    HTTP status was sent (so an error of the request itself is an HTTP error). An error after that is sent as an error
    object (as vLLM does), then [DONE]. What follows the last final response (its chunk, the usage chunk, [DONE])
    goes out in one write; ``answered()`` once it is sent. A client that leaves stops this generator, which closes
    ``responses`` before their final piece and so cancels the requests."""
    first, offset, counts = [True] * len(calls), [0] * len(calls), [None] * len(calls)
    tail, timings, finals = [], None, 0
    pieces = _chain(head, responses)
    try:
        try:
            async for index, piece in pieces:
                call = calls[index]
                counts[index], timings = piece.counts or counts[index], piece.timings or timings
                event = _sse(translate.role_chunk(call)) if first[index] and call.chat else ""
                if piece.text or piece.reason or piece.logprobs or (first[index] and not call.chat):
                    event += _sse(translate.chunk(call, piece.text, piece.reason, logprobs=piece.logprobs,
                                                  offset=offset[index]))
                    offset[index] += text_length(piece.logprobs or [])
                first[index] = False
                finals += piece.final
                if finals == len(calls):
                    tail += [event] if event else []
                    break
                if event:
                    yield event
            if calls[0].include_usage:
                done = [c or (0, 0) for c in counts]
                total = (done[0][0], sum(c[1] for c in done))
                tail.append(_sse(translate.chunk(calls[0], None, counts=total, timings=timings)))
        except ApiError as err:
            tail.append(_sse(err.body()))
        yield "".join(tail) + "data: [DONE]\n\n"
        answered()
    finally:
        await pieces.aclose()
        await responses.aclose()


async def _chain(head, rest):
    yield head
    async for item in rest:
        yield item


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


async def _bind_tools(call: GenerateCall, tools: ToolSupport | None) -> None:
    """A call with tools (``tool_choice`` other than ``none``) gets its ``ToolOutput``, and the sampling parameters
    its choice needs; 400 naming ``tools`` where this endpoint has no tokenizer, or the body also asks a
    ``response_format`` (both would constrain the same tokens)."""
    if call.tools is None or call.tools.choice == "none":
        return
    if tools is None:
        raise ApiError(400, "tools: this endpoint serves no tool calls (started without --tokenizer)", param="tools")
    try:
        call.output = await tools.output(call.tools, call.model)
    except ValueError as exc:  # vLLM's own checks of the tools (its ChatCompletionRequest, its schema of the calls)
        raise ApiError(400, f"tools: {exc}", param="tools") from None
    needs = call.output.sampling()
    if "structured_outputs" in needs and "structured_outputs" in call.inputs["sampling"]:
        raise ApiError(400, "response_format: not with a named or required tool_choice", param="response_format")
    call.inputs["sampling"].update(needs)
    call.structured_param = call.output.error_field()


def create_app(grpc_url: str, models: list[str], tools: ToolSupport | None = None,
               shedding: Shedding | None = None) -> FastAPI:
    """The application for tritonserver's gRPC endpoint ``grpc_url`` serving ``models`` (``tools``: its tool
    calling, ``frontend.openai.tools``; ``shedding``: refusals for load answered here, ``frontend.openai.shedding``)."""
    return make_app(Backend(grpc_url, models), tools, shedding)


def make_app(backend, tools: ToolSupport | None = None, shedding: Shedding | None = None) -> FastAPI:
    """The application over ``backend``: ``Backend`` (tritonserver's gRPC endpoint) or one with its ``models``,
    ``generate``, ``ready`` and ``close`` (``frontend.openai.in_process.LocalBackend``: a model's own process)."""
    metrics, shedding = Metrics(), shedding or Shedding()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await backend.close()  # the kept streams end with their OK status (see read_to_end)

    app = FastAPI(title="triton-epd OpenAI endpoint", lifespan=lifespan)
    app.state.backend = backend

    async def answer(request: Request, make_call) -> Any:
        clock, model, call = Clock(), "-", None
        started = clock.started
        try:
            try:
                body = await request.json()
            except ValueError:
                raise ApiError(400, "body: not valid JSON", param="body") from None
            if isinstance(body, dict) and isinstance(body.get("model"), str):
                model = body["model"]  # for the metrics, whatever happens next
            shedding.check_body(body)  # before the request is read any further: a refusal costs little here
            call = make_call(body, set(backend.models))
            calls = call.choices()
            for choice in calls:
                await _bind_tools(choice, tools)
            call.parameters.update(translate.urgency(body, request.headers))
            call.parameters.update(translate.session(body, request.headers))
            model = call.model
            if call.stream:
                responses = interleaved([backend.generate(choice, clock) for choice in calls])
                try:
                    head = await responses.__anext__()
                except StopAsyncIteration:
                    raise ApiError(502, "the generate stream ended before its first response", "internal_error")
                except BaseException:
                    await responses.aclose()
                    raise
                metrics.done(model, 200, started)
                return StreamingResponse(_events(calls, responses, head, lambda: metrics.answered(model, clock)),
                                         media_type="text/event-stream")
            doc = await _whole(backend, calls, request, clock)
            metrics.done(model, 200, started)
            response = JSONResponse(doc)
            metrics.answered(model, clock)
            return response
        except ApiError as err:
            metrics.done(model, err.status, started)
            if call is not None:
                shedding.refused(model, call.parameters.get(PRIORITY_PARAMETER, 0), err)
            return _error_response(translate.in_client_terms(err, call))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, translate.chat_call)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, translate.completion_call)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "triton-epd"}
                                           for m in backend.models]}

    @app.get("/health")
    async def health():
        ready = await backend.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready and all(ready.values()) else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
