"""The OpenAI-compatible endpoint (``python -m frontend.openai``) in front of the session's tritonserver, driven by
the ``openai`` Python SDK: the same tokens as Triton's generate endpoint on ``llm``, ``epd`` and ``epd_disagg`` for
text, image and video parts, streaming and not; errors as OpenAI error objects with their HTTP status; a client that
leaves mid-stream cancels its request; health and models."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from backend.deploy.local_server import ROOT
from backend.protocol.generate import GenerateInputs
from clients.triton_client import GenerateError, generate
from tests.e2e.conftest import assert_same_logprobs, metric, openai_endpoint
from tests.images import image_bytes
from tests.videos import make_video

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0, "max_tokens": 12}


def _url(kind: str, data: bytes) -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


CASES = {
    "text": [{"role": "user", "content": "Tell me a story."}],
    "image": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url("image/png", image_bytes(
        96, 64, 1))}}, {"type": "text", "text": "What is in the image?"}]}],
    "video": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _url("video/mp4", make_video(
        64, 64, frames=8, fps=4, seed=3))}}, {"type": "text", "text": "What happens?"}]}],
}


@pytest.fixture(scope="module")
def endpoint(server):
    """The endpoint on a free port, pointed at the session's server; stopped (and checked stopped) after."""
    with openai_endpoint(server.grpc_url, extra=("--tokenizer", str(ROOT / "models" / "tiny-qwen2-vl"))) as base:
        yield base


@pytest.fixture(scope="module")
def sdk(endpoint):
    return openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0)


def _triton(server, model: str, messages) -> tuple[str, int, int]:
    result = generate(server.grpc_url, model, GenerateInputs(messages=messages, sampling=GREEDY))
    return result.text, result.num_input_tokens, result.num_output_tokens


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_sdk_answers_equal_tritons_generate_streaming_and_not(server, sdk, model, case):
    assert_answers(sdk, model, CASES[case], _triton(server, model, CASES[case]))


def assert_answers(sdk, model: str, messages, want: tuple[str, int, int]) -> None:
    """``sdk``'s greedy answer to ``messages``, whole and streamed (with usage), is ``want`` (text, prompt tokens,
    completion tokens), with OpenAI's shapes: the role first, ``finish_reason`` last, more than one chunk."""
    whole = sdk.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert (whole.choices[0].message.content, whole.usage.prompt_tokens, whole.usage.completion_tokens) == want
    assert whole.choices[0].finish_reason == "length" and whole.object == "chat.completion"
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the role alone first, as vLLM's server sends it, even where a busy engine hands all 12 tokens over in one
    # step's output (vLLM merges the deltas a slow reader has not taken: more pieces are load-dependent; seen in CI)
    assert chunks[0].choices[0].delta.model_dump(exclude_none=True) == {"role": "assistant", "content": ""}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (text, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == want
    assert len([c for c in chunks if c.choices]) >= 2


@pytest.mark.parametrize("model", ["llm", "epd"])
def test_media_io_kwargs_sample_the_video_as_they_say(server, sdk, model):
    """vLLM's per-request ``media_io_kwargs`` through the SDK's ``extra_body``: the answer Triton's generate gives
    with the request parameter of that name, and another than the default sampling's (8 frames at 4 fps: 4 frames at
    2 fps, 16 at 8 fps)."""
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": _url("video/mp4", make_video(
        64, 64, frames=16, fps=4, seed=5))}}, {"type": "text", "text": "What happens?"}]}]
    options = {"video": {"fps": 8}}
    want = generate(server.grpc_url, model, GenerateInputs(messages=video, sampling=GREEDY,
                                                           parameters={"media_io_kwargs": json.dumps(options)}))
    got = sdk.chat.completions.create(model=model, messages=video, extra_body={"media_io_kwargs": options}, **GREEDY)
    assert (got.choices[0].message.content, got.usage.prompt_tokens) == (want.text, want.num_input_tokens)
    default = sdk.chat.completions.create(model=model, messages=video, **GREEDY)
    assert default.usage.prompt_tokens < got.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=video, extra_body={"media_io_kwargs": {"audio": {}}},
                                    **GREEDY)
    assert "parameters.media_io_kwargs.audio" in str(info.value)


def test_completions_text(server, sdk):
    want = generate(server.grpc_url, "llm", GenerateInputs(prompt="Once upon a time", sampling=GREEDY))
    got = sdk.completions.create(model="llm", prompt="Once upon a time", **GREEDY)
    assert (got.choices[0].text, got.usage.completion_tokens) == (want.text, want.num_output_tokens)


TOP3 = {**GREEDY, "logprobs": True, "top_logprobs": 3}


def _content(logprobs) -> list[dict]:
    return [entry.model_dump() for entry in logprobs.content]


def _spelt(text: str | None) -> str:
    """What a text's tokens spell as vLLM decodes each token: the random checkpoint samples byte tokens that form no
    character, which the text shows as U+FFFD and vLLM's per-token decoding as "" (a character's bytes: "" until the
    token that completes it, which carries the character)."""
    return (text or "").replace("\ufffd", "")


@pytest.fixture(scope="module")
def image_logprobs(sdk):
    """model -> (the whole answer, the streamed chunks) of the image request with ``top_logprobs`` 3, greedy."""
    return {model: (sdk.chat.completions.create(model=model, messages=CASES["image"], **TOP3),
                    list(sdk.chat.completions.create(model=model, messages=CASES["image"], stream=True, **TOP3)))
            for model in ("llm", "epd", "epd_disagg")}


@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_logprobs_streamed_are_the_whole_answer_s_and_spell_its_text(image_logprobs, model):
    whole, chunks = image_logprobs[model]
    content = _content(whole.choices[0].logprobs)
    assert len(content) == whole.usage.completion_tokens == GREEDY["max_tokens"]
    assert "".join(e["token"] for e in content) == _spelt(whole.choices[0].message.content)
    for entry in content:  # greedy: the sampled token is the most likely; the top 3 by rank
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and (tops[0]["token"], tops[0]["logprob"]) == (entry["token"], entry["logprob"])
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] < 0
    role, *streamed = [c.choices[0] for c in chunks if c.choices]
    assert role.logprobs is None and role.delta.role == "assistant"  # the role alone, as vLLM's server sends it
    assert all(c.logprobs is not None for c in streamed)  # asked: every other chunk carries its tokens' (maybe none)
    for choice in streamed:  # each chunk's tokens are those of its text
        assert "".join(e.token for e in choice.logprobs.content) == _spelt(choice.delta.content)
    assert_same_logprobs([e for c in streamed for e in _content(c.logprobs)], content, tol=0)


@pytest.mark.parametrize("model", ["epd", "epd_disagg"])
def test_logprobs_of_every_deployment_are_the_baseline_s(server, image_logprobs, model):
    """E+PD and E/P/D (decode's engine samples the tokens; prefill's one token is not among them) against llm; and
    Triton's generate endpoint (the sampling parameter ``logprobs``) gives the same entries over gRPC and HTTP."""
    want = _content(image_logprobs["llm"][0].choices[0].logprobs)
    assert_same_logprobs(_content(image_logprobs[model][0].choices[0].logprobs), want)
    for protocol in ("grpc", "http"):
        url = server.grpc_url if protocol == "grpc" else server.http_url
        native = generate(url, model, GenerateInputs(messages=CASES["image"], sampling={**GREEDY, "logprobs": 3}),
                          protocol=protocol)
        assert len(native.logprobs) == native.num_output_tokens == len(want)
        assert all(e["rank"] == 1 and e["token_id"] == e["top_logprobs"][0]["token_id"] for e in native.logprobs)
        assert_same_logprobs(native.logprobs, want)


def test_logprobs_are_vllms_own(image_logprobs, reference):
    """The baseline's against vLLM's ``LLM.chat`` on the same checkpoint and engine arguments (tests.vllm_reference)."""
    url = CASES["image"][0]["content"][0]["image_url"]["url"]
    messages = [{"role": "user", "content": [{"type": "image"}, CASES["image"][0]["content"][1]]}]
    [out] = reference.run([{"messages": messages, "images": [base64.b64decode(url.split(",", 1)[1])],
                            "sampling": {**GREEDY, "logprobs": 3}}])
    assert_same_logprobs(_content(image_logprobs["llm"][0].choices[0].logprobs), out["logprobs"])


def test_completions_logprobs_in_the_legacy_form(sdk):
    whole = sdk.completions.create(model="epd", prompt="Once upon a time", logprobs=2, **GREEDY)
    chunks = list(sdk.completions.create(model="epd", prompt="Once upon a time", logprobs=2, stream=True, **GREEDY))
    got = whole.choices[0].logprobs
    assert "".join(got.tokens) == _spelt(whole.choices[0].text) and len(got.tokens) == whole.usage.completion_tokens
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    for token, value, top in zip(got.tokens, got.token_logprobs, got.top_logprobs):
        assert token in top and len(top) <= 2, (token, value, top)  # greedy: the sampled token is the top 2's first
        if len(top) == 2:  # else both decode alike ("" for bytes): one key, as in vLLM's server
            assert top[token] == value == max(top.values()), (token, value, top)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == got.tokens
    assert [o for s in streamed for o in s.text_offset] == got.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == got.token_logprobs


def test_logprobs_out_of_range_name_the_field(server, sdk):
    """Over the engines' ``max_logprobs`` (vLLM's default, 20): the engine's INVALID_ARG naming the key, E/P/D's
    from prefill, before any KV is held; ``top_logprobs`` without ``logprobs``: 400 as vLLM's server answers it."""
    for model in ("llm", "epd_disagg"):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=model, messages=CASES["image"], logprobs=True, top_logprobs=21,
                                        **GREEDY)
        assert info.value.body["param"] == "sampling_parameters.logprobs", info.value.body
        assert "greater than max allowed: 20" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="llm", messages=CASES["text"], top_logprobs=2, **GREEDY)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(GenerateError) as failed:
        generate(server.grpc_url, "epd", GenerateInputs(messages=CASES["text"], sampling={"logprobs": -2}))
    assert failed.value.message.startswith("sampling_parameters.logprobs: must be >= 0"), failed.value.message


def test_errors_are_openai_error_objects(sdk):
    bad = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    for model in ("llm", "epd"):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model=model, messages=bad, **GREEDY)
        err = info.value.body
        assert err["param"] == "messages[0].content[1].image_url" and err["message"].startswith(
            "messages[0].content[1].image_url: not a PNG/JPEG"), err
        with pytest.raises(openai.BadRequestError) as info:  # the same error before a stream starts: HTTP 400 too
            sdk.chat.completions.create(model=model, messages=bad, stream=True, **GREEDY)
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="nope", messages=CASES["text"], **GREEDY)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="llm", messages=CASES["text"], n=9, **GREEDY)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="llm", messages=CASES["text"], temperature=0.0, max_tokens=-1)
    assert info.value.body["param"] == "sampling_parameters.max_tokens", info.value.body


def test_a_client_leaving_mid_stream_cancels_its_request(server, sdk):
    before = metric(server, "epd_requests_total", model="epd", outcome="cancelled")
    stream = sdk.chat.completions.create(model="epd", messages=CASES["image"], stream=True, temperature=0.0,
                                         max_tokens=4000, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while metric(server, "epd_requests_total", model="epd", outcome="cancelled") == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.2)


def test_health_models_and_metrics(endpoint, sdk):
    assert sorted(m.id for m in sdk.models.list()) == ["epd", "epd_disagg", "llm"]
    health = json.loads(urllib.request.urlopen(endpoint + "/health", timeout=5).read())
    assert health == {"ready": {m: True for m in ("llm", "encoder", "pd", "epd", "prefill", "decode", "epd_disagg")}}
    text = urllib.request.urlopen(endpoint + "/metrics", timeout=5).read().decode()
    assert 'openai_requests_total{model="llm",status="200"}' in text


def test_the_endpoint_counts_its_own_time_per_answered_request(endpoint, sdk):
    """``openai_own_seconds`` and ``openai_added_seconds``: one observation each per answered request, streaming
    and not; the time on the request's path is part of the endpoint's own time, which leaves out the waits on
    tritonserver (so is shorter than the requests)."""
    def counted() -> dict[str, tuple[float, float]]:
        text = urllib.request.urlopen(endpoint + "/metrics", timeout=5).read().decode()
        found = {}
        for name in ("openai_own_seconds", "openai_added_seconds"):
            count, total = (re.search(rf'^{name}_{k}\{{model="llm"\}} (\S+)$', text, re.M) for k in ("count", "sum"))
            found[name] = (float(count.group(1)), float(total.group(1))) if count else (0.0, 0.0)
        return found

    before, started = counted(), time.perf_counter()
    sdk.chat.completions.create(model="llm", messages=CASES["image"], **GREEDY)
    list(sdk.chat.completions.create(model="llm", messages=CASES["image"], stream=True, **GREEDY))
    wall, deadline = time.perf_counter() - started, time.monotonic() + 10
    # a stream's is counted once its [DONE] is sent: just after the client has it
    while any(counted()[name][0] < before[name][0] + 2 for name in before):
        assert time.monotonic() < deadline, f"{counted()} after {before}: not 2 requests more"
        time.sleep(0.05)
    after = counted()
    own, added = (after[name][1] - before[name][1] for name in ("openai_own_seconds", "openai_added_seconds"))
    assert all(after[name][0] == before[name][0] + 2 for name in before), (before, after)
    assert 0 < added <= own + 1e-6 and own < wall, (added, own, wall)


def test_the_readme_commands_answer_as_triton_does(server, endpoint, tmp_path):
    """The README's OpenAI examples (the ``sh`` curl block and the ``py`` SDK block), run as written against this
    endpoint: both answer what Triton's generate answers for the same request."""
    import re

    from tests.e2e.test_readme import README

    (tmp_path / "cat.png").write_bytes(image_bytes(64, 48, seed=11))
    (curl,) = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    (snippet,) = re.findall(r"```py\n(.*?)```", README, flags=re.S)
    port = endpoint.rsplit(":", 1)[1]
    url = "data:image/png;base64," + base64.b64encode((tmp_path / "cat.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in it?"}]}]
    want = generate(server.grpc_url, "epd", GenerateInputs(messages=messages, sampling={"max_tokens": 16,
                                                                                        "temperature": 0})).text
    done = subprocess.run(["bash", "-c", curl.replace("127.0.0.1:9000", f"127.0.0.1:{port}")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["choices"][0]["message"]["content"] == want, done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-c", snippet.replace("127.0.0.1:9000", f"127.0.0.1:{port}")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.rstrip("\n") == want and want, done.stdout + done.stderr


def _health(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as failed:
        return failed.code, json.loads(failed.read())


def test_the_floor_tool_measures_the_endpoint_s_grpc_side_against_the_session_server(server):
    """``clients.tools.openai_http_floor --grpc-url``: the endpoint's ``Backend`` in process, paired with the plain
    gRPC client on ``epd``: both paths answer every request (a failed one raises), and the differences come with
    their intervals (a short run: this checks the tool, not the figures)."""
    import asyncio

    from clients.tools.openai_http_floor import grpc_side

    diffs = asyncio.run(grpc_side(server.grpc_url, pairs=4, warm=1))
    for median, low, high in diffs.values():
        assert low <= median <= high and abs(median) < 1000


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
FORMATS = {"json_schema": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
           "json_object": {"type": "json_object"}}


@pytest.fixture(scope="module")
def structured(sdk):
    """(format, model) -> (the whole answer's text, the streamed text, finish reason) of the image request with
    ``response_format``, greedy."""
    out = {}
    for name, fmt in FORMATS.items():
        for model in ("llm", "epd", "epd_disagg"):
            args = dict(model=model, messages=CASES["image"], response_format=fmt, temperature=0.0, max_tokens=48)
            whole = sdk.chat.completions.create(**args)
            chunks = list(sdk.chat.completions.create(stream=True, **args))
            out[name, model] = (whole.choices[0].message.content, "".join(
                c.choices[0].delta.content or "" for c in chunks if c.choices), whole.choices[0].finish_reason)
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_response_format_forces_json_the_baseline_s_tokens_streaming_and_not(structured, fmt, model):
    """The random-weight model's answer is JSON all the same (the grammar constrains every token, decode's too on
    E/P/D), following the schema, the same text as ``llm``'s, whole and streamed."""
    import jsonschema

    text, streamed, reason = structured[fmt, model]
    assert (text, streamed) == (structured[fmt, "llm"][0], text)
    assert reason == "stop", (text, reason)
    doc = json.loads(text)
    assert isinstance(doc, dict)
    if fmt == "json_schema":
        jsonschema.validate(doc, SCHEMA)


def test_a_schema_that_does_not_compile_is_400_naming_response_format(sdk):
    for schema in ({"type": "nonsense"}, {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}):
        for model in ("llm", "epd_disagg"):
            with pytest.raises(openai.BadRequestError) as info:
                sdk.chat.completions.create(model=model, messages=CASES["text"], max_tokens=4, response_format={
                    "type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
            assert info.value.body["param"] == "response_format.json_schema", info.value.body


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLICK = {"type": "function", "function": {"name": "click", "parameters": {
    "type": "object", "properties": {"button": {"enum": ["left", "right"]}}, "required": ["button"],
    "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "weather"}}


def _tool_answers(sdk, model: str, **args) -> tuple:
    """(the whole answer, its tool calls as (name, arguments), the streamed calls joined, the finish reasons)."""
    args = dict(model=model, messages=CASES["image"], tools=[CLICK, WEATHER], temperature=0.0, max_tokens=40, **args)
    whole = sdk.chat.completions.create(**args)
    chunks = [c.choices[0] for c in sdk.chat.completions.create(stream=True, **args) if c.choices]
    calls: dict[int, list[str]] = {}
    for delta in (c.delta for c in chunks):
        for call in delta.tool_calls or ():
            name, text = calls.setdefault(call.index, ["", ""])
            calls[call.index] = [name + (call.function.name or ""), text + (call.function.arguments or "")]
    got = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or ()]
    return whole, got, [tuple(calls[i]) for i in sorted(calls)], (whole.choices[0].finish_reason,
                                                                   chunks[-1].finish_reason)


@pytest.mark.parametrize("model", ["llm", "epd", "epd_disagg"])
def test_a_named_tool_call_is_the_functions_arguments_streaming_and_not(sdk, model):
    """``tool_choice`` naming a function: its arguments generated under its schema (vLLM's structured outputs; the
    random weights give valid arguments all the same), the same call as ``llm``'s, whole and streamed."""
    import jsonschema

    whole, got, streamed, reasons = _tool_answers(sdk, model, tool_choice=NAMED)
    assert got == streamed and len(got) == 1 and got[0][0] == "weather" and reasons == ("stop", "stop"), (got, streamed)
    jsonschema.validate(json.loads(got[0][1]), WEATHER["function"]["parameters"])
    assert whole.choices[0].message.tool_calls[0].id and whole.choices[0].message.tool_calls[0].type == "function"
    if model != "llm":
        assert got == _tool_answers(sdk, "llm", tool_choice=NAMED)[1]


def test_required_tool_calls_and_auto_through_vllm_s_hermes_parser(sdk):
    """``required``: calls of declared tools (vLLM's schema of a list of calls), ``finish_reason`` tool_calls; ``auto``:
    the answer through the hermes parser (the random weights call none: the text, as ``llm``'s)."""
    import jsonschema

    whole, got, streamed, reasons = _tool_answers(sdk, "epd_disagg", tool_choice="required", parallel_tool_calls=False)
    assert reasons[0] == reasons[1], (got, streamed, reasons)
    if reasons[0] == "length":  # vLLM's schema of the calls leaves the objects open: the random weights may not close one
        assert not got and whole.choices[0].message.content.startswith("["), whole
        assert len(streamed) <= 1  # streamed as generated (vLLM's): a call whose name came out was sent
    else:
        # streamed as vLLM streams them: each call once its name is out, then its parameters' text as generated (the
        # whole answer re-serialises them: the same JSON)
        assert [(n, json.loads(a)) for n, a in got] == [(n, json.loads(a)) for n, a in streamed], (got, streamed)
        assert len(got) == 1 and reasons[0] == "tool_calls", (got, reasons)
        schema = {"weather": WEATHER, "click": CLICK}[got[0][0]]["function"]["parameters"]
        jsonschema.validate(json.loads(got[0][1]), schema)
    auto = {model: _tool_answers(sdk, model) for model in ("llm", "epd")}
    assert auto["epd"][0].choices[0].message.content == auto["llm"][0].choices[0].message.content
    assert auto["epd"][1] == auto["llm"][1] == []


def test_a_tool_turn_with_an_image_is_taken_and_answered_as_llm_answers_it(sdk):
    """An agent's loop: the assistant's tool call, then the tool's result with a screenshot (``role: tool``)."""
    shot = _url("image/png", image_bytes(80, 64, 7))
    messages = [*CASES["text"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "click", "arguments": '{"button": "left"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": [
            {"type": "text", "text": "clicked; the screen now:"}, {"type": "image_url", "image_url": {"url": shot}}]}]
    answers = {model: sdk.chat.completions.create(model=model, messages=messages, tools=[CLICK], **GREEDY)
               for model in ("llm", "epd", "epd_disagg")}
    texts = {model: (a.choices[0].message.content, a.usage.prompt_tokens) for model, a in answers.items()}
    assert texts["epd"] == texts["epd_disagg"] == texts["llm"] and texts["llm"][1] > 64, texts


@pytest.mark.parametrize("args, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [CLICK], "tool_choice": NAMED}, "tool_choice.function.name"),
])
def test_bad_tools_are_400_naming_the_field(sdk, args, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="epd", messages=CASES["text"], **args, **GREEDY)
    assert info.value.body["param"] == param, info.value.body


def test_n_choices_are_each_their_own_sequence_seeded_as_vllm_seeds_them(sdk):
    """``n`` 3 with a ``seed``: choice i is the answer of one request with seed + i (vLLM's child sequences), the same
    on ``epd`` as on ``llm``, whole and streamed (chunks tagged by index), the completions summed in usage."""
    args = dict(messages=CASES["image"], temperature=1.0, max_tokens=8, seed=11)
    whole = sdk.chat.completions.create(model="epd", n=3, **args)
    singles = [sdk.chat.completions.create(model="llm", **{**args, "seed": 11 + i}) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [s.choices[0].message.content for s in singles]
    assert whole.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens
    chunks = list(sdk.chat.completions.create(model="epd", n=3, stream=True, stream_options={"include_usage": True},
                                              **args))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and len({c.id for c in chunks}) == 1
