"""OpenAI request bodies to this project's generate interface, and its results and errors back to OpenAI's shapes.
Pure functions: the FastAPI app (``frontend.openai.app``) does the I/O."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from backend.protocol import errors
from backend.protocol.media_options import MEDIA_IO_PARAMETER

# OpenAI sampling fields -> the generate interface's sampling_parameters keys (vLLM's names); vLLM's extras too
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
            "repetition_penalty": "repetition_penalty", "stop_token_ids": "stop_token_ids",
            "skip_special_tokens": "skip_special_tokens"}
IGNORED = {"model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
           "user", "logprobs", "top_logprobs", "echo", "media_io_kwargs"}  # handled below, or without effect (user)
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
    """One generate request: the model, the interface's inputs (``clients.triton_client.GenerateInputs`` fields) and
    how to answer (``stream``, ``include_usage``; ``chat``: chat.completion objects, else text_completion)."""

    model: str
    inputs: dict[str, Any]
    stream: bool
    include_usage: bool
    chat: bool
    parameters: dict[str, Any] = field(default_factory=dict)  # Triton request parameters (media_io_kwargs)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("n", 1) != 1:
        raise _invalid("n", f"only n=1 is served, got {body['n']!r}")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise _invalid("logprobs", "log probabilities are not returned by this server's generate interface")
    unknown = sorted(set(body) - set(SAMPLING) - IGNORED)
    if unknown:
        raise _invalid(unknown[0], "unsupported field")
    sampling = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    sampling["max_tokens"] = DEFAULT_MAX_TOKENS if limit is None else limit
    return sampling


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
    return GenerateCall(model, {"messages": messages, "sampling": _sampling(body)}, stream, usage, chat=True,
                        parameters=_media_io(body))


def _media_io(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's per-request ``media_io_kwargs`` (``{"video": {"fps": 1}}``), checked by the server as its request
    parameter of that name (``backend.protocol.media_options``); errors name it."""
    options = body.get("media_io_kwargs")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise _invalid("media_io_kwargs", "must be an object keyed by modality")
    return {MEDIA_IO_PARAMETER: json.dumps(options)}


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
    return GenerateCall(model, {"prompt": prompt, "sampling": _sampling(body)}, stream, usage, chat=False)


def api_error(message: str, stage: str) -> ApiError:
    """The OpenAI error of a generate request's error (this project's envelope, or Triton's own answer)."""
    err = errors.decode(message, stage)
    if isinstance(err, errors.InvalidInput):
        return ApiError(400, str(err), param=err.field or None)
    if isinstance(err, errors.Overloaded):
        return ApiError(429, str(err), "rate_limit_error", code="overloaded", retry_after=1)
    if isinstance(err, errors.Unavailable):
        return ApiError(503, str(err), "service_unavailable", code="unavailable", retry_after=1)
    if isinstance(err, errors.Cancelled):
        return ApiError(499, str(err), "cancelled")
    return ApiError(500, str(err), "internal_error")


_FINISH = {"length": "length", "stop": "stop", "abort": "stop"}


def finish_reason(value: str | None) -> str | None:
    return None if value is None else _FINISH.get(value, value)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(call: GenerateCall, text: str | None, reason: str | None, delta: bool, first: bool = False) -> dict:
    if not call.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason(reason)}
    if delta:
        content = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish_reason(reason)}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason(reason)}


def chunk(call: GenerateCall, text: str | None, reason: str | None = None, first: bool = False,
          counts: tuple[int, int] | None = None) -> dict:
    """One streamed object; ``counts`` (prompt, completion tokens): the usage chunk (no choices) instead."""
    doc = {"id": call.response_id, "object": "chat.completion.chunk" if call.chat else "text_completion",
           "created": call.created, "model": call.model}
    if counts is not None:
        return {**doc, "choices": [], "usage": usage(*counts)}
    return {**doc, "choices": [_choice(call, text, reason, delta=True, first=first)],
            **({"usage": None} if call.include_usage else {})}


def completion(call: GenerateCall, text: str, reason: str | None, counts: tuple[int, int]) -> dict:
    """The whole answer of a request without ``stream``."""
    return {"id": call.response_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created, "model": call.model,
            "choices": [_choice(call, text, reason, delta=False)], "usage": usage(*counts)}
