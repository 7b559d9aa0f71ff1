"""OpenAI request bodies to this project's generate interface, and its results and errors back to OpenAI's shapes.
Pure functions: the FastAPI app (``frontend.openai.app``) does the I/O."""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from backend.protocol import errors
from backend.protocol.generate import DEADLINE_PARAMETER, PRIORITY_PARAMETER, SESSION_PARAMETER, TOOLS_PARAMETER, \
    parse_deadline, parse_priority, parse_session
from backend.protocol.media_options import MEDIA_IO_PARAMETER
from frontend.openai import logprobs as logprob_shapes
from frontend.openai import tools as tool_calls
from frontend.openai.structured import STRUCTURED_PARAM, FieldError, response_format

DEADLINE_HEADER = "x-deadline-ms"  # the request's deadline_ms, for clients that cannot add fields to the body
SESSION_HEADER = "x-session-id"  # the request's session_id (vLLM's extra field), for the same clients
# OpenAI sampling fields -> the generate interface's sampling_parameters keys (vLLM's names); vLLM's extras too
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
            "repetition_penalty": "repetition_penalty", "stop_token_ids": "stop_token_ids",
            "skip_special_tokens": "skip_special_tokens"}
IGNORED = {"model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
           "user", "logprobs", "echo", "media_io_kwargs", "priority", "deadline_ms",
           "session_id"}  # handled below, or no effect (user)
MAX_N = 8  # choices per request (`n`): each its own generate request, as vLLM's own sequences (python -m frontend.openai --max-n)
DEFAULT_MAX_TOKENS = 16  # the generate interface's default (vLLM's OpenAI server: the rest of the context)


class ApiError(Exception):
    """An OpenAI error object with its HTTP status: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerateCall:
    """One generate request: the model, the interface's inputs (``backend.protocol.generate.GenerateInputs`` fields) and
    how to answer (``stream``, ``include_usage``; ``chat``: chat.completion objects, else text_completion;
    ``logprobs``: the top tokens asked for per token, None: no log probabilities)."""

    model: str
    inputs: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: int | None = None
    parameters: dict[str, Any] = field(default_factory=dict)  # Triton request parameters (media_io_kwargs)
    structured_param: str = "response_format"  # the field the engine's structured_outputs errors are about
    tools: Any = None  # the body's tools (frontend.openai.tools.ToolRequest), None: none
    output: Any = None  # and their answer's shape (frontend.openai.tools.ToolOutput), once bound
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1  # choices asked for
    index: int = 0  # which choice this call generates
    answer_id: str | None = None  # the response's id (the first choice's request id)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + (self.answer_id or self.request_id)

    def choices(self) -> list["GenerateCall"]:
        """One call per choice: each its own request (and sequence); with a ``seed``, choice i samples with seed + i,
        as vLLM's parallel sampling seeds its child sequences."""
        if self.n == 1:
            return [self]
        seed = self.inputs["sampling"].get("seed")
        return [replace(self, index=i, answer_id=self.request_id, request_id=uuid.uuid4().hex, inputs={
            **self.inputs, "sampling": {**self.inputs["sampling"], **({"seed": seed + i} if seed is not None else {})}})
            for i in range(self.n)]


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _sampling(body: dict[str, Any], logprobs: int | None, also: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The sampling parameters of ``body``; ``logprobs``: vLLM's ``logprobs`` (None: none); ``also``: the endpoint's
    own fields beside the shared ones (checked by the caller)."""
    unknown = sorted(set(body) - set(SAMPLING) - IGNORED - also)
    if unknown:
        raise _invalid(unknown[0], "unsupported field")
    sampling = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling["max_tokens"] = DEFAULT_MAX_TOKENS if limit is None else limit
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    return sampling


def choices_asked(body: dict[str, Any], limit: int | None = None) -> int:
    """``n``: an integer from 1 to ``limit`` (default ``MAX_N``: this endpoint's ``--max-n``)."""
    n, limit = body.get("n"), MAX_N if limit is None else limit
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise _invalid("n", f"expected an integer from 1 to {limit} (this endpoint's limit), got {n!r:.40}")
    return n


def _top_count(param: str, value: Any) -> int:
    """A number of top tokens as vLLM's server takes it: an integer >= 0, or -1 (the whole vocabulary; the engine's
    ``max_logprobs``, 20 by default, bounds it, and the engine answers a larger one as an error naming
    ``sampling_parameters.logprobs``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(param, f"must be an integer, got {value!r}")
    if value < -1:
        raise _invalid(param, f"must be >= 0 or -1 (all), got {value}")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (true: the sampled tokens' log probabilities) and ``top_logprobs`` (how many most likely
    tokens beside them; null: 0), checked as vLLM's server checks them: ``top_logprobs`` needs ``logprobs``."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _invalid("logprobs", f"must be true or false, got {wanted!r}")
    top = 0 if top is None else _top_count("top_logprobs", top)
    if top and not wanted:
        raise _invalid("top_logprobs", "when using top_logprobs, logprobs must be set to true")
    return top if wanted else None


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _invalid("stream_options", "must be an object")
    return stream, bool(options.get("include_usage", False)) and stream


def _model(body: dict[str, Any], served: set[str]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "required: one of " + ", ".join(sorted(served)))
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist; served: {', '.join(sorted(served))}",
                       param="model", code="model_not_found")
    return model


def chat_call(body: Any, served: set[str]) -> GenerateCall:
    """The generate request of a ``/v1/chat/completions`` body (``messages`` passed on as they are)."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    model = _model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "required: a non-empty list of messages")
    stream, usage = _stream_flags(body)
    logprobs = _chat_logprobs(body)
    sampling = _sampling(body, logprobs, frozenset({"top_logprobs", "response_format", "tools", "tool_choice",
                                                    "parallel_tool_calls"}))
    try:
        structured, structured_param = response_format(body.get("response_format"))
        tools = tool_calls.parse(body)
    except FieldError as exc:
        raise _invalid(exc.param, exc.problem) from None
    if structured is not None:
        sampling["structured_outputs"] = structured
    parameters = _media_io(body)
    if tools is not None:
        parameters[TOOLS_PARAMETER] = json.dumps(tools.tools)
    return GenerateCall(model, {"messages": messages, "sampling": sampling}, stream, usage, chat=True, logprobs=logprobs,
                        parameters=parameters, structured_param=structured_param, tools=tools, n=choices_asked(body))


def _media_io(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's per-request ``media_io_kwargs`` (``{"video": {"fps": 1}}``), checked by the server as its request
    parameter of that name (``backend.protocol.media_options``); errors name it."""
    options = body.get("media_io_kwargs")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise _invalid("media_io_kwargs", "must be an object keyed by modality")
    return {MEDIA_IO_PARAMETER: json.dumps(options)}


def urgency(body: dict[str, Any], headers: Any) -> dict[str, Any]:
    """The request parameters of a body's ``priority`` (vLLM's field: an integer >= 0, lower served first) and
    ``deadline_ms`` (a field, or the ``X-Deadline-Ms`` header for clients that cannot add fields); errors name them."""
    params: dict[str, Any] = {}
    try:
        priority = parse_priority(body.get("priority"))
    except errors.InvalidInput as exc:
        raise _invalid("priority", exc.problem) from None
    if priority is not None:
        params[PRIORITY_PARAMETER] = priority
    deadline = body.get("deadline_ms")
    field = "deadline_ms"
    if deadline is None and headers.get(DEADLINE_HEADER) is not None:
        deadline, field = headers.get(DEADLINE_HEADER), DEADLINE_HEADER
    if deadline is not None:
        try:
            params[DEADLINE_PARAMETER] = parse_deadline({DEADLINE_PARAMETER: deadline}, 0.0) * 1000.0
        except errors.InvalidInput as exc:
            raise _invalid(field, exc.problem) from None
    return params


def session(body: dict[str, Any], headers: Any) -> dict[str, Any]:
    """The request parameter ``session_id`` of a body's ``session_id`` (vLLM's extra field), or of the
    ``X-Session-Id`` header: the conversation this request is a turn of (docs/reuse.md); errors name the field."""
    value, name = body.get("session_id"), "session_id"
    if value is None and headers.get(SESSION_HEADER) is not None:
        value, name = headers.get(SESSION_HEADER), SESSION_HEADER
    try:
        value = parse_session(value)
    except errors.InvalidInput as exc:
        raise _invalid(name, exc.problem) from None
    return {} if value is None else {SESSION_PARAMETER: value}


def completion_call(body: Any, served: set[str]) -> GenerateCall:
    """The generate request of a ``/v1/completions`` body (one text prompt)."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    model = _model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _invalid("prompt", "required: one non-empty string")
    if body.get("echo"):
        raise _invalid("echo", "not supported")
    stream, usage = _stream_flags(body)
    logprobs = None if body.get("logprobs") is None else _top_count("logprobs", body["logprobs"])
    return GenerateCall(model, {"prompt": prompt, "sampling": _sampling(body, logprobs)}, stream, usage, chat=False,
                        logprobs=logprobs, n=choices_asked(body))


def in_client_terms(err: ApiError, call: GenerateCall | None) -> ApiError:
    """``err`` naming the request field it is about: the engine's ``structured_outputs`` errors name the
    ``response_format`` (or the tool) they came from."""
    if call is None or err.param != STRUCTURED_PARAM:
        return err
    message = err.message.replace(STRUCTURED_PARAM, call.structured_param, 1)
    return ApiError(err.status, message, err.type, call.structured_param, err.code, err.retry_after)


def api_error(message: str, stage: str) -> ApiError:
    """The OpenAI error of a generate request's error (this project's envelope, or Triton's own answer)."""
    err = errors.decode(message, stage)
    if isinstance(err, errors.InvalidInput):
        return ApiError(400, str(err), param=err.field or None)
    if isinstance(err, errors.Overloaded):
        return ApiError(429, str(err), "rate_limit_error", code="overloaded",
                        retry_after=max(1, math.ceil(err.retry_after)))
    if isinstance(err, errors.DeadlineExceeded):
        return ApiError(503, str(err), "service_unavailable", code="deadline_exceeded")
    if isinstance(err, errors.Unavailable):
        return ApiError(503, str(err), "service_unavailable", code="unavailable", retry_after=1)
    if isinstance(err, errors.Cancelled):
        return ApiError(499, str(err), "cancelled")
    return ApiError(500, str(err), "internal_error")


_FINISH = {"length": "length", "stop": "stop", "abort": "stop"}


def finish_reason(value: str | None) -> str | None:
    return None if value is None else _FINISH.get(value, value)


def usage(prompt_tokens: int, completion_tokens: int, timings: dict | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; from the final response's ``timings`` (the orchestrators', a consumer's): vLLM's
    ``prompt_tokens_details.cached_tokens`` (the prompt tokens its prefix cache covered) and the extension
    ``epd_media``: the request's media ``items``, how many were ``reused`` (the consumer's copies: not encoded,
    not transferred) and how many ``encoded``; and the extension ``epd_timings``: the stages' milliseconds (the
    timings' ``*_ms``: ``queued_ms`` at the admission gates, ``encode_ms`` and ``first_chunk_ms`` from the
    orchestrator's start, ``generate_ms``, ``total_ms``, ...; docs/interface.md)."""
    doc: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    timings = timings or {}
    if timings.get("cached_tokens") is not None:
        doc["prompt_tokens_details"] = {"cached_tokens": int(timings["cached_tokens"])}
    if timings.get("items") is not None:
        items, reused = int(timings["items"]), int(timings.get("held") or 0)
        doc["epd_media"] = {"items": items, "reused": reused, "encoded": max(items - reused, 0)}
    if stages := {key: value for key, value in timings.items() if key.endswith("_ms")}:
        doc["epd_timings"] = stages
    return doc


def _logprobs(call: GenerateCall, entries: list[dict] | None, offset: int) -> dict | None:
    """A choice's ``logprobs``: None unless the request asked (``frontend.openai.logprobs``)."""
    if call.logprobs is None:
        return None
    if call.chat:
        return logprob_shapes.chat(entries or [])
    return logprob_shapes.completion(entries or [], offset)


def _choice(call: GenerateCall, text: str | None, reason: str | None, delta: bool,
            logprobs: dict | None = None) -> dict:
    if not call.chat:
        return {"index": call.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    output, reason = call.output, finish_reason(reason)
    if delta:
        content = output.delta(text or "", reason is not None) if output else ({"content": text} if text else {})
    else:
        content = {"role": "assistant", **(output.message(text or "") if output else {"content": text})}
    reason = output.finish(reason) if output else reason
    return {"index": call.index, "delta" if delta else "message": content, "logprobs": logprobs, "finish_reason": reason}


def role_chunk(call: GenerateCall) -> dict:
    """A chat stream's first object for a choice: the role alone, before its first text (as vLLM's server and
    OpenAI send it)."""
    return _streamed(call, {"index": call.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})


def _chunk_head(call: GenerateCall) -> dict:
    return {"id": call.response_id, "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.model}


def _streamed(call: GenerateCall, choice: dict) -> dict:
    """A streamed object carrying one choice (``usage: null`` where the stream ends with a usage chunk)."""
    return {**_chunk_head(call), "choices": [choice], **({"usage": None} if call.include_usage else {})}


def chunk(call: GenerateCall, text: str | None, reason: str | None = None,
          counts: tuple[int, int] | None = None, logprobs: list[dict] | None = None, offset: int = 0,
          timings: dict | None = None) -> dict:
    """One streamed object; ``counts`` (prompt, completion tokens): the usage chunk (no choices) instead.
    ``logprobs``: the entries of the chunk's tokens (the interface's), ``offset``: where in the completion's text the
    first of them starts (completions' ``text_offset``)."""
    if counts is not None:
        return {**_chunk_head(call), "choices": [], "usage": usage(*counts, timings)}
    return _streamed(call, _choice(call, text, reason, delta=True, logprobs=_logprobs(call, logprobs, offset)))


def completion(call: GenerateCall, text: str, reason: str | None, counts: tuple[int, int],
               logprobs: list[dict] | None = None, timings: dict | None = None) -> dict:
    """The whole answer of a request without ``stream``; ``logprobs``: every generated token's entry."""
    return {"id": call.response_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created, "model": call.model,
            "choices": [_choice(call, text, reason, delta=False, logprobs=_logprobs(call, logprobs, 0))],
            "usage": usage(*counts, timings)}


def merged(docs: list[dict]) -> dict:
    """The whole answers of a request's choices as one answer: every choice, the prompt counted once and the
    completions summed in ``usage`` (as vLLM's)."""
    if len(docs) == 1:
        return docs[0]
    first, completions = docs[0], sum(doc["usage"]["completion_tokens"] for doc in docs)
    return {**first, "choices": [choice for doc in docs for choice in doc["choices"]],
            "usage": {**first["usage"], "completion_tokens": completions,
                      "total_tokens": first["usage"]["prompt_tokens"] + completions}}
