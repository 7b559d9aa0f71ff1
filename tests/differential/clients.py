"""Sending one built request (``tests.differential.requests.Built``) to a model and reading its outcome as an
``Outcome``: the answer (text, token counts, finish reason) or the refusal (code and field), whichever route it took.
gRPC refusals come in this project's error envelope (the request parameter ``epd_error_codes``); the OpenAI endpoint's
as OpenAI error objects (HTTP status, ``param``)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from backend.protocol import errors
from clients.triton_client import GenerateError, generate

TIMEOUT = 180.0


@dataclass
class Outcome:
    """``code``: ``OK``, or the refusal's code (``INVALID_ARG``, ``UNAVAILABLE``, ``INTERNAL``, ``CANCELLED``,
    ``TIMEOUT``, ``CLIENT``: the client failed); ``field``: the field a refusal named; ``message``: its text."""

    code: str
    text: str = ""
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    finish_reason: str | None = None
    field: str = ""
    message: str = ""
    seconds: float = 0.0
    token_ids: tuple[int, ...] | None = None  # gRPC: from the sampling parameter logprobs 0 (``requests``)

    @property
    def answer(self) -> tuple:
        return self.text, self.num_input_tokens, self.num_output_tokens, self.finish_reason

    def brief(self) -> str:
        if self.code == "OK":
            ids = "" if self.token_ids is None else f", ids {list(self.token_ids)}"
            return (f"{self.text!r} (in {self.num_input_tokens}, out {self.num_output_tokens}, "
                    f"{self.finish_reason}{ids})")
        return f"[{self.code}] {self.message[:400]}"


def ask_grpc(url: str, model: str, built) -> Outcome:
    started = time.monotonic()
    try:
        result = generate(url, model, built.inputs, timeout=TIMEOUT)
    except GenerateError as exc:
        err = errors.decode(exc.message, model)
        return Outcome(err.code.value, field=err.field, message=exc.message.split("\nepd-error:")[0],
                       seconds=time.monotonic() - started)
    except TimeoutError as exc:
        return Outcome("TIMEOUT", message=str(exc), seconds=time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - the client's own failure is an outcome to report, not a crash
        return Outcome("CLIENT", message=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
    ids = None if result.logprobs is None else tuple(entry["token_id"] for entry in result.logprobs)
    return Outcome("OK", result.text, result.num_input_tokens, result.num_output_tokens, result.finish_reason,
                   seconds=time.monotonic() - started, token_ids=ids)


_STATUS = {400: "INVALID_ARG", 404: "NOT_FOUND", 429: "UNAVAILABLE", 503: "UNAVAILABLE"}


def ask_openai(base: str, model: str, built) -> Outcome:
    """One request through the OpenAI endpoint at ``base``; finish reasons are mapped back to the generate
    interface's (``stop``, ``length``) as the endpoint maps them (the same words)."""
    started = time.monotonic()
    body = json.dumps({**built.body, "model": model}).encode()
    request = urllib.request.Request(base + built.path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            outcome = _streamed(response) if built.body.get("stream") else _whole(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        error = _error_object(exc.read())
        outcome = Outcome(_STATUS.get(exc.code, "INTERNAL"), field=error.get("param") or "",
                          message=f"HTTP {exc.code}: {error.get('message', '')}")
    except Exception as exc:  # noqa: BLE001 - as in ask_grpc
        outcome = Outcome("CLIENT", message=f"{type(exc).__name__}: {exc}")
    outcome.seconds = time.monotonic() - started
    return outcome


def _error_object(raw: bytes) -> dict:
    try:
        return json.loads(raw).get("error", {})
    except ValueError:
        return {"message": raw.decode("utf-8", "replace")[:400]}


def _text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _whole(doc: dict) -> Outcome:
    choice = doc["choices"][0]
    usage = doc.get("usage") or {}
    return Outcome("OK", _text(choice), usage.get("prompt_tokens"), usage.get("completion_tokens"),
                   choice.get("finish_reason"))


def _streamed(response) -> Outcome:
    """An SSE stream's text, usage and finish reason; an error object in the stream is that error."""
    outcome = Outcome("OK")
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        doc = json.loads(line[5:])
        if "error" in doc:
            return Outcome("INTERNAL", field=doc["error"].get("param") or "",
                           message=f"in stream: {doc['error'].get('message', '')}")
        for choice in doc.get("choices") or ():
            outcome.text += _text(choice)
            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        if doc.get("usage"):
            outcome.num_input_tokens = doc["usage"]["prompt_tokens"]
            outcome.num_output_tokens = doc["usage"]["completion_tokens"]
    return outcome
