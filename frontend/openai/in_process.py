"""The OpenAI-compatible endpoint served from inside a generating model's own process (issue 36): the ``llm`` model,
or an orchestrator (``epd``, ``epd_disagg``), with the config parameter ``openai_port`` (topology ``openai_port``).

The separate endpoint (``python -m frontend.openai``) costs each request a process of its own, a gRPC stream into
tritonserver and the stub's per-response IPC (measured on 2 cores: 2.5 ms of endpoint CPU, 1.1 ms of tritonserver's
and ~1.5 ms of the stub's sends per 16-token request, docs/benchmarks.md). Here the same FastAPI application
(``frontend.openai.app``) runs on the model's own event loop and hands each request to the model's own request
function, as ``execute`` would, with a sink (``QueueSink``) whose responses go straight to the HTTP response: no
tensors, no IPC, no second process. vLLM's ``vllm serve`` is shaped the same way (its API server and its engine client
in one process).

What the model gives: its name, its event loop, and ``start(raw, parameters, sink)``: the coroutine that answers one
request (``RawGenerateInputs`` and the request's parameters, the same ones ``execute`` reads), errors included (a bad
request is sent to the sink as its error, never raised). A model of several instances has each bind the same port
with ``SO_REUSEPORT`` (the kernel spreads the connections over them). The model serves its own name only: a repository
serving several deployments keeps the separate endpoint, which reaches them all (the topology refuses
``openai_port`` with more than one served deployment).
"""
from __future__ import annotations

import asyncio
import socket
from concurrent.futures import Future
from typing import AsyncIterator, Callable, Coroutine

from backend.engine.serving import ResponseChunk
from backend.protocol.errors import encode
from backend.protocol.generate import GenerateInputs
from backend.request.generate import RawGenerateInputs, raw_inputs
from frontend.openai import translate
from frontend.openai.app import Piece, make_app
from frontend.openai.metrics import Clock
from frontend.openai.tools import ToolSupport
from frontend.openai.translate import ApiError, GenerateCall

Start = Callable[[RawGenerateInputs, dict, "QueueSink"], Coroutine]

_DONE = object()  # the queue's end mark (after the final piece, or an error)


class QueueSink:
    """``backend.engine.serving.ResponseSink`` into an asyncio queue read on the same loop (``LocalBackend.generate``):
    responses as ``Piece``s, an error as the ``ApiError`` it becomes. ``cancel`` (the reader left) makes
    ``is_cancelled`` true, so the request is aborted as a cancelled Triton request is. ``timer``: the model's
    ``RequestMetrics``, told the first text and the final response as ``TritonSink`` tells it."""

    def __init__(self, model: str, timer=None):
        self.model, self.queue = model, asyncio.Queue()
        self._cancelled = self._completed = False
        self._timer, self._first = timer, True
        self._started = asyncio.get_running_loop().time()

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        if self._completed:
            raise RuntimeError("response sent after the request was completed")
        counts = None
        if chunk.num_input_tokens is not None and chunk.num_output_tokens is not None:
            counts = (chunk.num_input_tokens, chunk.num_output_tokens)
        self.queue.put_nowait(Piece(chunk.text_output or "", chunk.finish_reason, counts, chunk.logprobs, final,
                                 chunk.timings))
        if self._timer is not None:
            elapsed = asyncio.get_running_loop().time() - self._started
            if self._first and chunk.text_output:
                self._first = False
                self._timer.first_text(elapsed)
            if final:
                self._timer.final_response(elapsed, chunk.timings)
        if final:
            self._complete()

    def send_error(self, exc: BaseException) -> None:
        if self._completed:
            return
        self.queue.put_nowait(translate.api_error(encode(exc), self.model))
        self._complete()

    def close(self) -> None:
        if not self._completed:
            self._complete()

    def _complete(self) -> None:
        self._completed = True
        self.queue.put_nowait(_DONE)


class LocalBackend:
    """``frontend.openai.app``'s backend for one model served in this process: ``generate`` starts the model's request
    function on this loop and reads its sink."""

    def __init__(self, model: str, start: Start, timer=None):
        self.models, self._start, self._timer = [model], start, timer
        self._tasks: set[asyncio.Task] = set()

    async def ready(self) -> dict[str, bool]:
        return {self.models[0]: True}  # the model is loaded: this runs in it

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def generate(self, call: GenerateCall, clock: Clock | None = None) -> AsyncIterator[Piece]:
        """As ``frontend.openai.app.Backend.generate``: one ``Piece`` per response up to the final one, ApiError for
        the request's error; leaving early cancels the request."""
        try:
            raw = raw_inputs(GenerateInputs(stream=True, **call.inputs).as_values(), call.parameters)
        except Exception as exc:  # noqa: BLE001 - a bad session_id or media_io_kwargs: the request's error
            raise translate.api_error(encode(exc), call.model) from None
        sink = QueueSink(call.model, self._timer)
        task = asyncio.ensure_future(self._start(raw, call.parameters, sink))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        finished = False
        try:
            while True:
                since = clock.waiting() if clock is not None else 0.0
                try:
                    item = await sink.queue.get()
                finally:
                    if clock is not None:
                        clock.responded(since)
                if item is _DONE:
                    finished = True
                    raise ApiError(502, "the request ended before its final response", "internal_error")
                if isinstance(item, ApiError):
                    finished = True
                    raise item
                finished = item.final
                yield item
                if finished:
                    return
        finally:
            if not finished:
                sink.cancel()  # the request stops at its next step and completes the sink


class InProcessEndpoint:
    """The endpoint's uvicorn server on the model's event loop (``submit`` runs a coroutine there), bound to
    ``host:port`` (``shared``: with ``SO_REUSEPORT``, every instance of the model); ``close`` stops it (waits up to
    ``timeout`` seconds for the requests in flight)."""

    def __init__(self, model: str, start: Start, submit: Callable[[Coroutine], Future], host: str, port: int,
                 timer=None, shared: bool = False, tokenizer: str | None = None):
        import uvicorn

        self.backend = LocalBackend(model, start, timer)
        self.socket = bound_socket(host, port, shared)
        tools = ToolSupport(tokenizer) if tokenizer else None  # the served checkpoint's: tool calls as the separate one
        self.app = make_app(self.backend, tools)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", loop="none",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.served = submit(self.server.serve(sockets=[self.socket]))

    def close(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        try:
            self.served.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - stopping anyway; the socket is closed below
            self.served.cancel()
        self.socket.close()


def serve_for(model: str, settings, start: Start, submit: Callable[[Coroutine], Future], timer,
              instances: int, checkpoint: str | None = None) -> InProcessEndpoint | None:
    """The endpoint of a model whose settings (``backend.protocol.settings.OpenAISettings``) have an ``openai_port``,
    on its loop (``submit``), answered by ``start``; None without one. ``instances``: how many instances of the model
    Triton runs (more than one share the port). ``checkpoint``: the served checkpoint's folder, whose tokenizer the
    tool calls parse with (``frontend.openai.tools``; None: requests with tools are 400 naming ``tools``)."""
    if not getattr(settings, "openai_port", 0):
        return None
    return InProcessEndpoint(model, start, submit, settings.openai_host, settings.openai_port, timer,
                             shared=instances > 1, tokenizer=checkpoint)


def bound_socket(host: str, port: int, shared: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port``; ``shared`` (a model of several instances): every instance binds it
    (``SO_REUSEPORT``). Alone it is not shared, so a port another server already listens on (gRPC servers set
    ``SO_REUSEPORT`` too) fails the load instead of splitting the connections with it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock

