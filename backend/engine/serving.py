"""Streaming one generate request from an engine to a response sink.

Who calls it: a generating model schedules ``stream_generation`` on its engine loop for each request
it has parsed. The sink is the Triton response sender behind an adapter (``backend.triton.io``) or a
fake in unit tests. Contract, whatever happens: the sink gets exactly one final signal (a final
chunk, an error, or a bare close after a client cancel), and a cancelled request is aborted in the
engine so it stops generating and frees its KV.
"""
from __future__ import annotations

import asyncio
import enum
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Protocol

from backend.engine.host import GenerationDelta
from backend.protocol.errors import DeadlineExceeded
from backend.request.generate import GenerateRequest


@dataclass(frozen=True)
class ResponseChunk:
    text_output: str
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    timings: dict | None = None  # stage breakdown on an orchestrator's final response
    kv_transfer_params: dict | None = None  # a prefill stage's handle to its KV, for decode
    logprobs: list | None = None  # this response's tokens' entries (backend.engine.logprobs), when asked for


class ResponseSink(Protocol):
    def is_cancelled(self) -> bool: ...
    def send(self, chunk: ResponseChunk, final: bool) -> None: ...
    def send_error(self, exc: BaseException) -> None:
        """Send ``exc`` as the request's final response."""
    def close(self) -> None:
        """Send the final flag with no response (after a client cancel)."""


class Outcome(enum.Enum):
    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    EXPIRED = "deadline"  # its deadline passed: the stage stopped its work for it (DeadlineExceeded)
    SHED = "shed"  # refused for load before any work (Overloaded)


class RequestObserver(Protocol):
    def request_finished(self, outcome: Outcome, num_output_tokens: int) -> None: ...
    def request_retried(self, what: str) -> None: ...  # orchestrators: "encode" (one item) or "request"


class GenerationEngine(Protocol):
    def prompt_text(self, request: GenerateRequest) -> str: ...
    def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[GenerationDelta]: ...
    async def abort(self, request_id: str) -> None: ...


async def stream_generation(engine: GenerationEngine, request: GenerateRequest, sink: ResponseSink,
                            observer: RequestObserver | None = None, request_id: str | None = None,
                            prepare: Callable[[GenerateRequest], Awaitable[GenerateRequest]] | None = None,
                            interval: float = 0.0) -> Outcome:
    """Run one request to its end. ``prepare`` (e.g. pulling embeddings) runs first; its failure is
    the request's error, and nothing is submitted to the engine.

    Streaming sends the first text at once, then at most one response per ``interval`` seconds: text of
    the steps in between waits for the next step at least ``interval`` after the last send (or the end).
    0 sends every step's text (vLLM itself merges steps a slow reader has not taken yet).

    The request's ``deadline`` (Unix time) is checked before ``prepare`` and before the engine gets it; when it passes
    while the engine works on it, the engine's request is aborted at once (no step is spent on it afterwards) and the
    request's error is ``DeadlineExceeded``; the outcome is ``Outcome.EXPIRED``."""
    request_id = request_id or uuid.uuid4().hex
    last: GenerationDelta | None = None
    outcome = Outcome.ERROR
    try:
        _check_deadline(request, "before this stage started it")
        if prepare is not None:
            request = await prepare(request)
            _check_deadline(request, "before the engine got it")
        chunker = Chunker(engine, request, interval)
        left = None if request.deadline is None else request.deadline - time.time()
        async with asyncio.timeout(left):
            async for delta in engine.generate(request, request_id):
                last = delta
                if sink.is_cancelled():
                    await engine.abort(request_id)
                    sink.close()
                    outcome = Outcome.CANCELLED
                    return outcome
                chunk = chunker.add(delta)
                if chunk is not None:
                    sink.send(chunk, final=delta.finished)
                if delta.finished:
                    outcome = Outcome.OK
                    return outcome
        raise RuntimeError("engine stream ended without a finished output")
    except BaseException as exc:
        if isinstance(exc, TimeoutError) and request.deadline is not None and time.time() >= request.deadline - 0.01:
            exc = DeadlineExceeded("the deadline passed while the engine worked on it", "request")
        outcome = Outcome.EXPIRED if isinstance(exc, DeadlineExceeded) else Outcome.ERROR
        await _abort_quietly(engine, request_id)
        sink.send_error(exc)
        if not isinstance(exc, Exception):
            raise
        return outcome
    finally:
        if observer is not None:
            observer.request_finished(outcome, last.num_output_tokens if last else 0)


class Chunker:
    """Engine deltas -> the responses a client gets (``stream_generation``'s rules, also used by an in-process
    generator stage): streaming sends the first token's response at once, even where its text is still "" (a token
    that starts a multi-byte character, a special token): the client's first token then comes when the engine gives
    it, as vLLM's OpenAI server sends its first chunk (on an H100 a random checkpoint's answers began with tokens that
    decode to "", and ours' E+PD sent its first chunk with the last token); then responses with text at most one per
    ``interval`` seconds (and the final one); non-streaming sends one final response, the prompt in front unless
    ``exclude_input_in_output``. A request that asked for ``logprobs`` gets on each response the entries of the
    tokens whose text it carries (steps merged into one response: their tokens' entries together; a step whose
    tokens added no text yet: with the next response's), the generated tokens only (not the prompt in front)."""

    def __init__(self, engine: GenerationEngine, request: GenerateRequest, interval: float = 0.0):
        self.engine, self.request, self.interval = engine, request, interval
        self.pieces: list[str] = []
        self.logprobs: list[dict] | None = [] if request.sampling.get("logprobs") is not None else None
        self.last_sent = float("-inf")
        self.started = False  # the first token's response is sent

    def add(self, delta: GenerationDelta) -> ResponseChunk | None:
        """The response to send after ``delta``, or None (nothing to send yet)."""
        request, pieces = self.request, self.pieces
        pieces.append(delta.text)
        if self.logprobs is not None:
            self.logprobs.extend(delta.logprobs or ())
        if request.stream:
            now = time.monotonic()
            if delta.finished or not self.started or (any(pieces) and now - self.last_sent >= self.interval):
                self.last_sent, self.started = now, True
                chunk = self._chunk(delta, "".join(pieces))
                pieces.clear()
                return chunk
        elif delta.finished:
            prefix = "" if request.exclude_input_in_output else self.engine.prompt_text(request)
            return self._chunk(delta, prefix + "".join(pieces))
        return None

    def _chunk(self, delta: GenerationDelta, text: str) -> ResponseChunk:
        logprobs, request = self.logprobs, self.request
        if logprobs is not None:
            self.logprobs = []
        if not delta.finished:
            return ResponseChunk(text, logprobs=logprobs)
        return ResponseChunk(
            text, finish_reason=delta.finish_reason,
            num_input_tokens=delta.num_input_tokens if request.return_num_input_tokens else None,
            num_output_tokens=delta.num_output_tokens if request.return_num_output_tokens else None,
            timings=_with_cached(request.timings, delta.cached_tokens), kv_transfer_params=delta.kv_transfer_params,
            logprobs=logprobs,
        )


def _with_cached(timings: dict | None, cached_tokens: int | None) -> dict | None:
    """A consumer's timings (a request with media) and the prompt tokens vLLM's prefix cache covered."""
    if timings is None or cached_tokens is None:
        return timings
    return {**timings, "cached_tokens": cached_tokens}


def _check_deadline(request: GenerateRequest, when: str) -> None:
    if request.deadline is not None and time.time() >= request.deadline:
        raise DeadlineExceeded(f"the deadline passed {when}", "request")


async def _abort_quietly(engine: GenerationEngine, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:  # the engine may already be gone; the request's error is what matters
        pass
