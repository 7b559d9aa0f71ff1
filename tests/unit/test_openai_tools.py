"""Tool calls through the OpenAI endpoint (``frontend.openai.tools``): the checks of ``tools`` / ``tool_choice``,
and the answers' shapes with vLLM's own hermes parser and schema code on the tiny checkpoint's tokenizer."""
from __future__ import annotations

import json

import pytest

from backend.deploy.local_server import ROOT
from frontend.openai import tools
from frontend.openai.structured import FieldError

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
CLICK = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_name_their_field(body, param):
    with pytest.raises(FieldError) as info:
        tools.parse(body)
    assert info.value.param == param


def test_tool_choices():
    assert tools.parse({}) is None and tools.parse({"tool_choice": "none"}) is None
    assert tools.parse({"tools": [WEATHER]}).choice == "auto"
    named = tools.parse({"tools": [CLICK, WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert (named.choice, named.named) == ("weather", True)


@pytest.fixture(scope="module")
def support():
    return tools.ToolSupport(str(ROOT / "models" / "tiny-qwen2-vl"))


def _output(support, **body):
    import asyncio

    return asyncio.run(support.output(tools.parse({"tools": [CLICK, WEATHER], **body}), "llm"))


def test_auto_parses_hermes_calls_whole_and_streamed(support):
    assert support.parser_name == "hermes"
    text = 'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = _output(support)
    assert whole.sampling() == {"skip_special_tokens": False}
    message = whole.message(text)
    assert message["content"].strip() == "Let me look." and whole.finish("stop") == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["id"]
    streamed, deltas = _output(support), []
    for i in range(0, len(text), 7):
        deltas.append(streamed.delta(text[i:i + 7], final=i + 7 >= len(text)))
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    assert calls[0]["function"]["name"] == "weather" and calls[0]["id"]
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Oslo"}
    assert streamed.finish("stop") == "tool_calls"
    plain = _output(support)
    assert plain.message("no tools here") == {"content": "no tools here"} and plain.finish("stop") == "stop"


def test_named_and_required_go_through_vllm_s_schemas(support):
    named = _output(support, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.sampling() == {"structured_outputs": {"json": WEATHER["function"]["parameters"]}}
    assert named.error_field() == "tools[1].function.parameters"
    assert named.message('{"city": "Paris"}')["tool_calls"][0]["function"] == {"name": "weather",
                                                                             "arguments": '{"city": "Paris"}'}
    assert named.finish("stop") == "stop"
    first, more = named.delta('{"city"', False), named.delta(': "Oslo"}', True)
    assert first["tool_calls"][0]["function"]["name"] == "weather" and "id" not in more["tool_calls"][0]
    required = _output(support, tool_choice="required", parallel_tool_calls=False)
    schema = required.sampling()["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["maxItems"] == 1 and required.error_field() == "tools"
    answer = '[{"name": "weather", "parameters": {"city":"Oslo"}}, {"name": "click", "parameters": {}}]'
    assert required.message(answer)["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    required = _output(support, tool_choice="required")
    deltas = [required.delta(answer[i:i + 5], final=i + 5 >= len(answer)) for i in range(0, len(answer), 5)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    announced = [c for c in calls if "id" in c]  # each call once, as soon as its name is out (vLLM's streaming)
    assert [(c["index"], c["function"]["name"], c["type"]) for c in announced] == [(0, "weather", "function"),
                                                                                    (1, "click", "function")]
    assert deltas.index(next(d for d in deltas if d.get("tool_calls"))) < len(deltas) - 3  # not only at the end
    for index, arguments in ((0, '{"city":"Oslo"}'), (1, "{}")):  # the parameters' text as generated
        assert "".join(c["function"].get("arguments", "") for c in calls if c["index"] == index) == arguments
    assert all(c["id"].startswith("chatcmpl-tool-") for c in announced) and announced[0]["id"] != announced[1]["id"]
    assert required.finish("stop") == "tool_calls"
    last = tools.ToolOutput(tools.parse({"tools": [CLICK, WEATHER], "tool_choice": "required"}), "llm",
                            *support._load()[:5])  # a vLLM without the streaming function (0.26): at the end
    assert last.delta(answer, False) == {} and len(last.delta("", True)["tool_calls"]) == 2
