"""Tool calls through the OpenAI endpoint, as vLLM's own server makes them (vLLM 0.32's chat serving, read for this):

- ``tools`` go to the engines as the request parameter ``tools``: every engine stage's chat template renders them
  into the prompt alike (``backend.engine.host.EngineHost.prompt_text``);
- ``tool_choice`` ``"auto"`` (the default with tools): the answer is parsed by vLLM's tool parser for the served
  family (``ToolParserManager``; ``hermes`` for the Qwen families), whole or streamed as tool-call deltas;
- a named function: the engines generate its arguments under vLLM's structured outputs (the function's
  ``parameters`` schema), answered as that one call (``finish_reason`` ``stop``, as vLLM's);
- ``"required"``: structured outputs with vLLM's schema of a list of calls (``get_json_schema_from_tools``),
  answered as those calls (``finish_reason`` ``tool_calls``); a stream sends them once the list is complete;
- ``"none"``: the tools are rendered, the answer is text.

Checked here before any stage sees the request (400 naming the field): tool types other than ``function``, a
function without a name, ``parameters`` that are no JSON Schema, a ``tool_choice`` naming no declared tool or
given without tools. vLLM (its tokenizer, parser and schema code) is imported on the first request with tools."""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.openai.structured import FieldError, SchemaError, check_schema

DEFAULT_PARSER = "hermes"
PARSERS = {"qwen2_vl": "hermes", "qwen2_5_vl": "hermes", "qwen3_vl": "hermes", "qwen2_audio": "hermes",
           "qwen2_5_omni": "hermes", "qwen2_5_omni_thinker": "hermes"}  # a checkpoint's model_type -> vLLM's parser
CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    """A chat body's tools, checked: ``tools`` (OpenAI's definitions), ``choice`` (``none``, ``auto``, ``required``
    or the name of the function to call) and ``parallel`` (``parallel_tool_calls``)."""

    tools: list[dict]
    choice: str
    named: bool
    parallel: bool | None


def parse(body: dict[str, Any]) -> ToolRequest | None:
    """The body's ``tools`` / ``tool_choice``; None without tools; FieldError naming what is wrong."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools", "expected a non-empty list of tools")
    names = [_tool_name(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "must be true or false")
    if choice is None or choice in CHOICES:
        return ToolRequest(tools, choice or "auto", False, parallel)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FieldError("tool_choice", 'expected none, auto, required or {"type": "function", "function": {"name"}}')
    if function["name"] not in names:
        raise FieldError("tool_choice.function.name", f"no declared tool is named {function['name']!r:.80}")
    return ToolRequest(tools, function["name"], True, parallel)


def _tool_name(tool: Any, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"{where}.type", "only function tools are served")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise FieldError(f"{where}.function.name", "required: the function's name")
    if function.get("parameters") is not None:
        try:
            check_schema(function["parameters"])
        except SchemaError as exc:
            raise FieldError(f"{where}.function.parameters", exc.problem) from None
    return function["name"]


class ToolSupport:
    """The endpoint's tool calling for one served checkpoint: its tokenizer (``tokenizer``: the checkpoint's folder)
    and vLLM's tool parser for its family (``parser``: a name ``ToolParserManager`` knows; None: by the checkpoint's
    ``model_type``, ``PARSERS``), loaded on first use."""

    def __init__(self, tokenizer: str, parser: str | None = None):
        self.path, self.parser_name = tokenizer, parser or _parser_for(tokenizer)
        self._loaded, self._lock = None, threading.Lock()

    def _load(self):
        with self._lock:
            if self._loaded is None:
                from transformers import AutoTokenizer
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
                from vllm.renderers.chat_utils import make_tool_call_id
                from vllm.tool_parsers import ToolParserManager
                from vllm.tool_parsers.utils import get_json_schema_from_tools

                try:  # vLLM 0.32's; where it is missing (0.26) a required answer's calls come in its last chunk
                    from vllm.tool_parsers.streaming import extract_required_tool_call_streaming as required_stream
                except ImportError:
                    required_stream = None
                self._loaded = (AutoTokenizer.from_pretrained(self.path), ToolParserManager.get_tool_parser(
                    self.parser_name), ChatCompletionRequest, get_json_schema_from_tools, make_tool_call_id,
                    required_stream)
            return self._loaded

    async def output(self, request: ToolRequest, model: str) -> "ToolOutput":
        """One request's ``ToolOutput`` (vLLM is imported off the event loop the first time)."""
        loaded = self._loaded or await asyncio.to_thread(self._load)
        return ToolOutput(request, model, *loaded)


def _parser_for(tokenizer: str) -> str:
    try:
        model_type = json.loads((Path(tokenizer) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    return PARSERS.get(model_type, DEFAULT_PARSER)


class ToolOutput:
    """One request's answer in tool-calling terms: ``sampling()`` (what the request's sampling parameters need),
    ``message(text)`` (a whole answer's message fields), ``delta(text, final)`` (a stream chunk's delta) and
    ``finish(reason)``."""

    def __init__(self, request: ToolRequest, model: str, tokenizer, parser_class, request_class, schema_of, new_id,
                 required_stream=None):
        self.request, self.new_id, self.required_stream = request, new_id, required_stream
        self.vllm_request = request_class(model=model, messages=[{"role": "user", "content": ""}], tools=request.tools,
                                          tool_choice=_vllm_choice(request), parallel_tool_calls=request.parallel)
        self.schema = schema_of(self.vllm_request.tool_choice, self.vllm_request.tools, request.parallel)
        self.parser = parser_class(tokenizer, self.vllm_request.tools) if request.choice == "auto" else None
        self.text, self.called, self.call_id = "", False, None

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters the choice needs: structured outputs for a named or required call; the special
        tokens kept for the parser (``ToolParser.adjust_request``: hermes's ``<tool_call>`` tokens are special)."""
        if self.schema is not None:
            return {"structured_outputs": {"json": self.schema}}
        if self.parser is not None:
            adjusted = self.parser.adjust_request(self.vllm_request)
            return {} if adjusted.skip_special_tokens else {"skip_special_tokens": False}
        return {}

    def error_field(self) -> str:
        """The field a structured-outputs error of this request names."""
        if self.request.named:
            index = [t["function"]["name"] for t in self.request.tools].index(self.request.choice)
            return f"tools[{index}].function.parameters"
        return "tools"

    def message(self, text: str) -> dict[str, Any]:
        if self.request.named:
            return self._calls("", [{"name": self.request.choice, "arguments": text}])
        if self.request.choice == "required":
            calls = _listed_calls(text)
            return self._calls("", calls) if calls is not None else {"content": text}
        if self.parser is not None:
            info = self.parser.extract_tool_calls(text, self.vllm_request)
            if info.tools_called:
                return self._calls(info.content, [c.function.model_dump() for c in info.tool_calls])
        return {"content": text}

    def _calls(self, content: str | None, functions: list[dict]) -> dict[str, Any]:
        self.called = True
        return {"content": content, "tool_calls": [{"id": self.new_id(), "type": "function", "function": {
            "name": f["name"], "arguments": f["arguments"]}} for f in functions]}

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        previous, self.text = self.text, self.text + text
        if self.request.named:
            return self._named_delta(text) if text else {}
        if self.request.choice == "required":
            return self._required_delta(previous, final)
        if self.parser is not None:
            found = self.parser.extract_tool_calls_streaming(previous, self.text, text, [], [], [], self.vllm_request)
            doc = {} if found is None else found.model_dump(exclude_none=True)
            self.called = self.called or bool(doc.get("tool_calls"))
            return {k: v for k, v in doc.items() if k in ("content", "tool_calls") and v not in ("", [])}
        return {"content": text} if text else {}

    def _required_delta(self, previous: str, final: bool) -> dict[str, Any]:
        """A ``required`` answer streamed as vLLM streams it (``extract_required_tool_call_streaming``): each call once
        its name is generated (with its id and the arguments so far), then its arguments as they grow: the text of
        its ``parameters`` as generated, where the whole answer gives them re-serialised."""
        if self.required_stream is None:  # the calls at the end, from the whole answer
            if not final:
                return {}
            message = self.message(self.text)
            return {**message, "tool_calls": [{"index": i, **c} for i, c in enumerate(message.get("tool_calls", []))]}
        found, _ = self.required_stream(previous_text=previous, current_text=self.text, tool_call_idx=None,
                                        tool_call_id_type="random")
        if found is None:
            return {}
        calls = [call.model_dump(exclude_none=True) for call in found.tool_calls]
        for call in calls:
            if "id" in call:
                call["id"] = self.new_id()  # the endpoint's ids, as its whole answers have
        self.called = self.called or bool(calls)
        return {"tool_calls": calls}

    def _named_delta(self, text: str) -> dict[str, Any]:
        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if self.call_id is None:
            self.call_id, self.called = self.new_id(), True
            call = {"index": 0, "id": self.call_id, "type": "function",
                    "function": {"name": self.request.choice, "arguments": text}}
        return {"tool_calls": [call]}

    def finish(self, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` when ``auto`` called a tool or ``required`` stopped; a named call's stays."""
        if reason == "stop" and self.called and not self.request.named:
            return "tool_calls"
        return reason


def _vllm_choice(request: ToolRequest) -> Any:
    return {"type": "function", "function": {"name": request.choice}} if request.named else request.choice


def _listed_calls(text: str) -> list[dict] | None:
    """A ``required`` answer's calls (vLLM's schema: a list of ``{"name", "parameters"}``); None if it is not one
    (cut short by ``max_tokens``)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, list):
        return None
    return [{"name": c.get("name"), "arguments": json.dumps(c.get("parameters"), ensure_ascii=False)}
            for c in doc if isinstance(c, dict)]
