"""``frontend.openai.in_process``'s logic with a stand-in request function (the real models are in
tests/e2e/test_openai_in_process.py): the sink's responses become the HTTP answer (streamed and whole), the request's
error its OpenAI error, a client that leaves cancels the request through the sink, a bad request parameter is a 400
before anything starts; the values a client sends become the ``RawGenerateInputs`` a Triton request's tensors would;
the topology's ``openai_port`` renders into the one served deployment's front model only."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from backend.deploy.local_server import ROOT
from backend.deploy.render import render_files
from backend.deploy.schema import TopologyError
from backend.deploy.topology import load
from backend.engine.serving import ResponseChunk
from backend.protocol.errors import InvalidInput
from backend.protocol.generate import GenerateInputs
from backend.request.generate import RawGenerateInputs, raw_inputs
from frontend.openai.app import make_app
from frontend.openai.in_process import LocalBackend

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Script:
    """A request function that sends ``pieces`` (then a final one), or raises ``error`` into the sink, and records
    what it was given and whether it saw a cancel."""

    def __init__(self, pieces=("a", "b"), error: Exception | None = None, hold: bool = False,
                 last: tuple[str, str] = ("c", "length")):
        self.pieces, self.error, self.hold, self.last = pieces, error, hold, last
        self.given: list[tuple[RawGenerateInputs, dict]] = []
        self.cancelled = asyncio.Event()

    async def __call__(self, raw, params, sink):
        self.given.append((raw, params))
        if self.error is not None:
            sink.send_error(self.error)
            return
        for piece in self.pieces:
            sink.send(ResponseChunk(piece), final=False)
            await asyncio.sleep(0)
        while self.hold:
            await asyncio.sleep(0.01)
            if sink.is_cancelled():
                self.cancelled.set()
                sink.close()
                return
        sink.send(ResponseChunk(self.last[0], finish_reason=self.last[1], num_input_tokens=5, num_output_tokens=3),
                  final=True)


async def _post(script: Script, body: dict) -> httpx.Response:
    app = make_app(LocalBackend("m", script))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/chat/completions", json=body)


def test_a_whole_answer_and_a_streamed_one():
    script = Script()
    whole = asyncio.run(_post(script, BODY)).json()
    assert whole["choices"][0]["message"]["content"] == "abc" and whole["usage"]["completion_tokens"] == 3
    streamed = asyncio.run(_post(script, {**BODY, "stream": True, "stream_options": {"include_usage": True}}))
    docs = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in docs if d["choices"]) == "abc"
    assert docs[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert streamed.text.endswith("data: [DONE]\n\n")
    raw, params = script.given[-1]
    assert json.loads(raw.messages) == BODY["messages"] and raw.stream and raw.return_num_input_tokens
    assert json.loads(raw.sampling)["max_tokens"] == 3


def test_the_requests_error_is_its_openai_error():
    answer = asyncio.run(_post(Script(error=InvalidInput("messages[0].content", "bad part")), BODY))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages[0].content"


def test_a_bad_request_parameter_is_a_400_and_nothing_starts():
    script = Script()
    answer = asyncio.run(_post(script, {**BODY, "media_io_kwargs": {"video": 3}}))
    assert answer.status_code == 400 and answer.json()["error"]["param"].startswith("parameters.media_io_kwargs")
    assert script.given == []


def test_a_reader_that_leaves_cancels_the_request():
    async def run():
        script = Script(hold=True)
        backend = LocalBackend("m", script)
        from frontend.openai.translate import chat_call

        pieces = backend.generate(chat_call({**BODY, "stream": True}, {"m"}))
        assert (await pieces.__anext__()).text == "a"
        await pieces.aclose()  # the HTTP response stopped reading
        await asyncio.wait_for(script.cancelled.wait(), 5)
        await backend.close()
    asyncio.run(run())


def test_values_become_the_inputs_a_triton_request_carries():
    values = GenerateInputs(messages=[{"role": "user", "content": "x"}], images=[b"png"], sampling={"max_tokens": 2},
                            stream=True).as_values()
    raw = raw_inputs(values, {"session_id": "s1"})
    assert raw.images == (b"png",) and raw.stream and raw.return_num_output_tokens and raw.session_id == "s1"
    assert json.loads(raw.sampling) == {"max_tokens": 2}
    with pytest.raises(InvalidInput):
        raw_inputs(values, {"session_id": 7})


def test_the_topology_port_renders_into_the_one_served_deployment(tmp_path):
    text = (ROOT / "topologies" / "default.yaml").read_text().replace("checkpoint: ../models", f"checkpoint: {ROOT}/models")
    path = tmp_path / "t.yaml"
    path.write_text(text + "\nopenai_port: 9000\n")
    with pytest.raises(TopologyError, match="openai_port"):  # three served deployments
        load(path)
    default = load(ROOT / "topologies" / "default.yaml")
    with pytest.raises(TopologyError, match="openai_port"):
        default.only(("baseline", "E+PD"), openai_port=9000)
    for serve, front in (("E+PD", "epd"), ("baseline", "llm"), ("E/P/D", "epd")):
        files = render_files(default.only(serve, openai_port=9000), Path("/tmp/repo"))
        assert 'key: "openai_port" value: { string_value: "9000" }' in files[f"{front}/config.pbtxt"]
        assert [n for n, t in files.items() if "openai_port" in t] == [f"{front}/config.pbtxt"]
    colocated = default.with_orchestrator("colocated").only("E+PD", openai_port=9000)
    files = render_files(colocated, Path("/tmp/repo"))
    assert [n for n, t in files.items() if "openai_port" in t] == ["epd/config.pbtxt"]


def test_tools_in_process_parse_with_the_served_checkpoints_tokenizer():
    """The model gives its checkpoint (``serve_for``'s ``checkpoint``): an ``auto`` answer is parsed by vLLM's hermes
    parser as by the separate endpoint; without one a request with tools is 400 naming ``tools``."""
    from concurrent.futures import Future

    from frontend.openai.in_process import InProcessEndpoint

    def submit(coroutine):  # the server is not run: the test talks to its application
        coroutine.close()
        return Future()

    call = '<tool_call>\n{"name": "click", "arguments": {"x": 3}}\n</tool_call>'
    tool = {"type": "function", "function": {"name": "click", "parameters": {"type": "object"}}}
    body = {**BODY, "tools": [tool]}
    answers = {}
    for tokenizer in (str(ROOT / "models" / "tiny-qwen2-vl"), None):
        endpoint = InProcessEndpoint("m", Script((call,), last=("", "stop")), submit, "127.0.0.1", 0,
                                     tokenizer=tokenizer)
        try:
            async def post():
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app), base_url="http://t") as c:
                    return await c.post("/v1/chat/completions", json=body)

            answers[tokenizer is not None] = asyncio.run(post())
        finally:
            endpoint.socket.close()
    choice = answers[True].json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", answers[True].text
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "click", "arguments": '{"x": 3}'}]
    assert answers[False].status_code == 400 and answers[False].json()["error"]["param"] == "tools"
