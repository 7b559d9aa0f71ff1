"""The OpenAI-compatible endpoint served from the served model's own process (topology ``openai_port``,
``frontend.openai.in_process``): one tritonserver whose repository holds ``llm`` (its endpoint on one port) and E+PD
(``epd``'s endpoint on another), rendered from the default topology as a user's ``openai_port`` renders them. Driven by
the ``openai`` SDK: the same tokens as Triton's generate endpoint of the same server (streaming and not, text and
image), usage counts, errors as OpenAI error objects with their status, a client that leaves mid-stream cancels its
request, the model's own health and model list, and the Triton metrics of those requests."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from backend.deploy.local_server import Ports, ROOT, TritonServer
from backend.deploy.ports import free_ports
from backend.deploy.render import render_files, write_files
from backend.deploy.topology import load
from tests.e2e.conftest import metric
from tests.e2e.test_openai import CASES, GREEDY, _triton, assert_answers

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

TOPOLOGY = ROOT / "topologies" / "default.yaml"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, {model: base URL}): ``llm`` and ``epd`` each with its endpoint in its process."""
    topology = load(TOPOLOGY)
    *server_ports, llm_port, epd_port = free_ports(5)  # all distinct
    ports = {"llm": llm_port, "epd": epd_port}
    repo = tmp_path_factory.mktemp("repo")
    files = {**render_files(topology.only("baseline", openai_port=ports["llm"]), repo),
             **render_files(topology.only("E+PD", openai_port=ports["epd"]), repo)}
    write_files(repo, files)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    with TritonServer(repo, ports=Ports(*server_ports), log_path=log) as server:
        yield server, {model: f"http://127.0.0.1:{port}" for model, port in ports.items()}


def _sdk(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("case", ["text", "image"])
@pytest.mark.parametrize("model", ["llm", "epd"])
def test_answers_equal_tritons_generate_streaming_and_not(served, model, case):
    server, bases = served
    sdk = _sdk(bases[model])
    assert_answers(sdk, model, CASES[case], _triton(server, model, CASES[case]))


@pytest.mark.parametrize("model", ["llm", "epd"])
def test_errors_are_openai_error_objects_and_the_model_keeps_serving(served, model):
    server, bases = served
    sdk = _sdk(bases[model])
    bad = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=model, messages=bad, stream=stream, **GREEDY)
        assert info.value.body["param"] == "messages[0].content[1].image_url", info.value.body
    with pytest.raises(openai.BadRequestError) as info:  # a bad request parameter: the sink gets it, not the loop
        sdk.chat.completions.create(model=model, messages=CASES["text"], extra_body={"media_io_kwargs": {"video": 3}},
                                    **GREEDY)
    assert info.value.body["param"].startswith("parameters.media_io_kwargs"), info.value.body
    with pytest.raises(openai.NotFoundError):  # the endpoint serves its own model only
        sdk.chat.completions.create(model="epd" if model == "llm" else "llm", messages=CASES["text"], **GREEDY)
    assert sdk.chat.completions.create(model=model, messages=CASES["text"], **GREEDY).choices[0].message.content


def test_a_client_leaving_mid_stream_cancels_its_request(served):
    server, bases = served
    for model in ("llm", "epd"):
        before = metric(server, "epd_requests_total", model=model, outcome="cancelled")
        stream = _sdk(bases[model]).chat.completions.create(
            model=model, messages=CASES["image"], stream=True, temperature=0.0, max_tokens=4000,
            extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        deadline = time.monotonic() + 30
        while metric(server, "epd_requests_total", model=model, outcome="cancelled") == before:
            assert time.monotonic() < deadline, f"{model}: the request was not cancelled"
            time.sleep(0.2)


def test_health_models_and_the_models_metrics(served):
    server, bases = served
    for model, base in bases.items():
        assert [m.id for m in _sdk(base).models.list()] == [model]
        assert json.loads(urllib.request.urlopen(base + "/health", timeout=5).read()) == {"ready": {model: True}}
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert f'openai_requests_total{{model="{model}",status="200"}}' in text
        # the requests count where Triton's requests of the model count (its RequestMetrics)
        assert metric(server, "epd_requests_total", model=model, outcome="ok") > 0



@pytest.mark.parametrize("model", ["llm", "epd"])
def test_tool_calls_in_process_with_the_served_checkpoints_tokenizer(served, model):
    """Tools in the model's own endpoint (it parses with its checkpoint's tokenizer, as ``--tokenizer`` gives the
    separate one): a named function is generated under its schema, whole and streamed; ``auto`` answers."""
    _, bases = served
    sdk = _sdk(bases[model])
    tool = {"type": "function", "function": {"name": "click", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    named = {"type": "function", "function": {"name": "click"}}
    ask = dict(model=model, messages=CASES["image"], tools=[tool], max_tokens=24, temperature=0.0)
    whole = sdk.chat.completions.create(tool_choice=named, **ask)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "click" and isinstance(json.loads(call.function.arguments)["x"], int)
    streamed = "".join(c.function.arguments for chunk in sdk.chat.completions.create(tool_choice=named, stream=True,
                                                                                    **ask)
                       for choice in chunk.choices for c in (choice.delta.tool_calls or []))
    assert streamed == call.function.arguments
    auto = sdk.chat.completions.create(**ask)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_llm_reports_the_prompt_tokens_its_prefix_cache_covered(served):
    """``llm``'s ``usage.prompt_tokens_details.cached_tokens`` on a request with media (its final response's
    timings): the same request twice, the second covered by the prefix cache."""
    _, bases = served
    sdk = _sdk(bases["llm"])
    text = {"type": "text", "text": "Describe it. " * 40}
    long = [{"role": "user", "content": [*CASES["image"][0]["content"], text]}]
    got = [sdk.chat.completions.create(model="llm", messages=long, max_tokens=2, temperature=0.0).usage
           for _ in range(2)]  # longer than one of vLLM's blocks (128 tokens on CPU): the prefix cache keeps whole ones
    assert got[0].prompt_tokens_details is not None and got[1].prompt_tokens_details.cached_tokens > 0, got
    assert "epd_media" not in (got[1].model_extra or {})
