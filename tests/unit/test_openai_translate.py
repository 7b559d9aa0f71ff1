"""The OpenAI endpoint's translation (``frontend.openai.translate``): request bodies to generate requests, and the
project's errors to OpenAI error objects with their HTTP status."""
from __future__ import annotations

import pytest

from backend.protocol import errors
from frontend.openai import translate
from frontend.openai.translate import ApiError

SERVED = {"llm", "epd"}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_chat_body_becomes_one_generate_request_with_vllm_sampling_names():
    call = translate.chat_call({"model": "epd", "messages": MESSAGES, "max_completion_tokens": 7, "temperature": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                                "user": "someone"}, SERVED)
    assert (call.model, call.stream, call.include_usage, call.chat) == ("epd", True, True, True)
    assert call.inputs == {"messages": MESSAGES, "sampling": {"max_tokens": 7, "temperature": 0, "ignore_eos": True}}
    assert translate.chat_call({"model": "llm", "messages": MESSAGES}, SERVED).inputs["sampling"] == {"max_tokens": 16}


def test_media_io_kwargs_go_on_as_the_request_parameter():
    call = translate.chat_call({"model": "epd", "messages": MESSAGES, "media_io_kwargs": {"video": {"fps": 1}}}, SERVED)
    assert call.parameters == {"media_io_kwargs": '{"video": {"fps": 1}}'}
    assert translate.chat_call({"model": "epd", "messages": MESSAGES}, SERVED).parameters == {}


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "messages": MESSAGES}, 404, "model"),
    ({"messages": MESSAGES}, 400, "model"),
    ({"model": "llm", "messages": []}, 400, "messages"),
    ({"model": "llm", "messages": MESSAGES, "n": 9}, 400, "n"),
    ({"model": "llm", "messages": MESSAGES, "n": 0}, 400, "n"),
    ({"model": "llm", "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "llm", "messages": MESSAGES, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": "llm", "messages": MESSAGES, "logprobs": True, "top_logprobs": -2}, 400, "top_logprobs"),
    ({"model": "llm", "messages": MESSAGES, "logprobs": True, "top_logprobs": "3"}, 400, "top_logprobs"),
    ({"model": "llm", "messages": MESSAGES, "logprobs": "yes"}, 400, "logprobs"),
    ({"model": "llm", "messages": MESSAGES, "tools": []}, 400, "tools"),
    ({"model": "llm", "messages": MESSAGES, "stream": "yes"}, 400, "stream"),
    ({"model": "llm", "messages": MESSAGES, "media_io_kwargs": "fps=1"}, 400, "media_io_kwargs"),
    ({"model": "llm", "messages": MESSAGES, "mm_processor_kwargs": {"fps": 1}}, 400, "mm_processor_kwargs"),
])
def test_bad_bodies_name_the_field(body, status, param):
    with pytest.raises(ApiError) as info:
        translate.chat_call(body, SERVED)
    assert (info.value.status, info.value.param) == (status, param)
    assert info.value.body()["error"]["param"] == param


@pytest.mark.parametrize("exc, status, kind, retry", [
    (errors.InvalidInput("image[0]", "cannot decode image"), 400, "invalid_request_error", None),
    (errors.Overloaded("embedding pool full", "image[0]"), 429, "rate_limit_error", 1),
    (errors.Unavailable("stage pd unavailable"), 503, "service_unavailable", 1),
    (RuntimeError("boom"), 500, "internal_error", None),
])
def test_errors_map_to_openai_statuses(exc, status, kind, retry):
    err = translate.api_error(errors.encode(exc), "epd")
    assert (err.status, err.type, err.retry_after) == (status, kind, retry)
    if isinstance(exc, errors.InvalidInput):
        assert err.param == "image[0]" and err.message == "image[0]: cannot decode image"


def test_chunks_and_completions_have_openais_shape():
    call = translate.chat_call({"model": "llm", "messages": MESSAGES, "stream": True,
                                "stream_options": {"include_usage": True}}, SERVED)
    first = translate.role_chunk(call)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                            "content": ""}
    assert translate.chunk(call, "He")["choices"][0]["delta"] == {"content": "He"}
    assert translate.chunk(call, "", "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                 "finish_reason": "length"}
    assert translate.chunk(call, None, counts=(5, 2)) == {**{k: first[k] for k in ("id", "object", "created", "model")},
                                                          "choices": [], "usage": {"prompt_tokens": 5,
                                                                                   "completion_tokens": 2,
                                                                                   "total_tokens": 7}}
    whole = translate.completion(call, "Hello", "stop", (5, 2))
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello"} and whole["id"].startswith(
        "chatcmpl-")


def test_the_overhead_benchmark_summary_compares_the_two_paths():
    from clients.bench.openai import summary

    rows = [{"path": p, "req_per_s": rps, "latency_p50_ms": p50, "latency_p90_ms": p50 * 2, "ttft_p50_ms": 1.0,
             "errors": 0} for p, rps, p50 in (("grpc", 10.0, 100.0), ("openai", 9.0, 101.5), ("grpc", 12.0, 98.0),
                                               ("openai", 11.0, 99.0))]
    text = summary(rows)
    assert "| openai | 2 | 11.0 | 99.0 / 198.0 | 1.0 | 0 |" in text
    assert "requests/s 0.909 (mean of rounds), latency p50 +1.25 ms (median of rounds)" in text


def test_the_paired_figures_median_interval_and_the_endpoint_s_own_count():
    from clients.bench.openai import added_summary, median_interval

    assert median_interval([5.0, 1.0, 3.0]) == (3.0, 1.0, 5.0)  # n = 3: the interval is the whole range
    values = [float(v) for v in range(100)]
    median, low, high = median_interval(values)
    assert (median, low, high) == (49.5, 40.0, 59.0)  # ranks 50 -+ 9.8: 40 and 59
    before = {0.0005: 1.0, 0.001: 2.0, 0.002: 2.0, float("inf"): 2.0}
    after = {0.0005: 4.0, 0.001: 9.0, 0.002: 11.0, float("inf"): 12.0}  # 10 new: 3 <= 0.5 ms, 4 more <= 1 ms
    own = {0.0005: 0.0, 0.001: 0.0, 0.002: 1.0, float("inf"): 10.0}      # 10: 1 <= 2 ms, 9 above
    text = added_summary({"openai_added_seconds": before}, {"openai_added_seconds": after, "openai_own_seconds": own})
    assert text == ("the endpoint's time per request (10 requests): on the request's path (openai_added_seconds): "
                    "p50 in (0.5, 1] ms, 70.0% of requests <= 1 ms; all of its own (openai_own_seconds): p50 in "
                    "(2, inf] ms, 0.0% of requests <= 1 ms")
    same = {"openai_added_seconds": after, "openai_own_seconds": own}
    assert added_summary(same, same).count("no request counted") == 2


@pytest.mark.parametrize("fields, asked", [
    ({"logprobs": True, "top_logprobs": 3}, 3), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": None}, 0),
    ({"logprobs": True, "top_logprobs": -1}, -1), ({"logprobs": False, "top_logprobs": 0}, None), ({}, None),
])
def test_chat_logprobs_become_vllms_sampling_logprobs(fields, asked):
    call = translate.chat_call({"model": "llm", "messages": MESSAGES, **fields}, SERVED)
    assert call.logprobs == asked and call.inputs["sampling"].get("logprobs") == asked


def test_completions_take_logprobs_as_a_number_and_no_top_logprobs():
    call = translate.completion_call({"model": "llm", "prompt": "hi", "logprobs": 2}, SERVED)
    assert call.logprobs == 2 and call.inputs["sampling"]["logprobs"] == 2
    for bad, param in (({"logprobs": True}, "logprobs"), ({"logprobs": -3}, "logprobs"),
                       ({"logprobs": 2, "top_logprobs": 2}, "top_logprobs")):
        with pytest.raises(ApiError) as info:
            translate.completion_call({"model": "llm", "prompt": "hi", **bad}, SERVED)
        assert (info.value.status, info.value.param) == (400, param)


ENTRY = {"token_id": 5, "token": "He", "logprob": -0.25, "rank": 1, "top_logprobs": [
    {"token_id": 5, "token": "He", "logprob": -0.25}, {"token_id": 9, "token": "A", "logprob": -2.0}]}


def test_chunks_and_answers_carry_their_tokens_logprobs_in_openais_shapes():
    chat = translate.chat_call({"model": "llm", "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}, SERVED)
    doc = translate.chunk(chat, "He", logprobs=[ENTRY])["choices"][0]["logprobs"]
    assert doc == {"content": [{"token": "He", "logprob": -0.25, "bytes": [72, 101], "top_logprobs": [
        {"token": "He", "logprob": -0.25, "bytes": [72, 101]}, {"token": "A", "logprob": -2.0, "bytes": [65]}]}],
        "refusal": None}
    assert translate.chunk(chat, "", "stop")["choices"][0]["logprobs"] == {"content": [], "refusal": None}
    assert translate.completion(chat, "HeHe", "stop", (1, 2), [ENTRY, ENTRY])["choices"][0]["logprobs"]["content"] == (
        doc["content"] * 2)
    text = translate.completion_call({"model": "llm", "prompt": "hi", "logprobs": 2, "stream": True}, SERVED)
    assert translate.chunk(text, "He", logprobs=[ENTRY], offset=4)["choices"][0]["logprobs"] == {
        "tokens": ["He"], "token_logprobs": [-0.25], "top_logprobs": [{"He": -0.25, "A": -2.0}], "text_offset": [4]}
    plain = translate.chat_call({"model": "llm", "messages": MESSAGES}, SERVED)
    assert translate.chunk(plain, "He", logprobs=[ENTRY])["choices"][0]["logprobs"] is None


def test_priority_and_deadline_come_from_vllm_s_field_the_deadline_field_or_its_header():
    body = {"model": "epd", "messages": [{"role": "user", "content": "hi"}], "priority": 1, "deadline_ms": 500}
    call = translate.chat_call(body, {"epd"})
    assert call.inputs["sampling"] == {"max_tokens": 16}  # neither is a sampling setting
    assert translate.urgency(body, {}) == {"epd_priority": 1, "deadline_ms": 500.0}
    assert translate.urgency({"model": "epd"}, {"x-deadline-ms": "250"}) == {"deadline_ms": 250.0}
    assert translate.urgency({"model": "epd"}, {}) == {}


@pytest.mark.parametrize("body, headers, param", [
    ({"priority": -1}, {}, "priority"), ({"priority": "high"}, {}, "priority"),
    ({"deadline_ms": 0}, {}, "deadline_ms"), ({}, {"x-deadline-ms": "later"}, "x-deadline-ms"),
])
def test_a_bad_priority_or_deadline_is_a_400_naming_it(body, headers, param):
    with pytest.raises(ApiError) as info:
        translate.urgency(body, headers)
    assert (info.value.status, info.value.param) == (400, param)


def test_a_shed_request_is_a_429_with_the_estimated_wait_and_a_deadline_miss_a_503():
    shed = translate.api_error(errors.encode(errors.Overloaded("stage encoder is at its budget", retry_after=2.2)), "epd")
    assert (shed.status, shed.retry_after, shed.code) == (429, 3, "overloaded")
    late = translate.api_error(errors.encode(errors.DeadlineExceeded("deadline of 1 s exceeded", "request")), "epd")
    assert (late.status, late.code, late.retry_after) == (503, "deadline_exceeded", None)


def test_a_session_comes_from_the_body_or_the_header_and_a_bad_one_names_its_field():
    assert translate.session({"session_id": "agent-1"}, {}) == {"session_id": "agent-1"}
    assert translate.session({}, {"x-session-id": "agent-2"}) == {"session_id": "agent-2"}
    assert translate.session({"session_id": "body"}, {"x-session-id": "header"}) == {"session_id": "body"}
    assert translate.session({}, {}) == {}
    for body, headers, param in (({"session_id": ""}, {}, "session_id"), ({"session_id": 3}, {}, "session_id"),
                                 ({}, {"x-session-id": "x" * 257}, "x-session-id")):
        with pytest.raises(ApiError) as info:
            translate.session(body, headers)
        assert (info.value.status, info.value.param) == (400, param)
    translate.chat_call({"model": "epd", "messages": MESSAGES, "session_id": "s"}, SERVED)  # a field it takes


def test_usage_reports_cached_tokens_and_the_media_reused_and_encoded():
    assert translate.usage(10, 2) == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    doc = translate.usage(40, 4, {"items": 3, "held": 2, "cached_tokens": 16, "encode_ms": 1.0})
    assert doc["prompt_tokens_details"] == {"cached_tokens": 16}
    assert doc["epd_media"] == {"items": 3, "reused": 2, "encoded": 1}
    assert translate.usage(40, 4, {"items": 2, "encode_ms": 1.0})["epd_media"] == {"items": 2, "reused": 0, "encoded": 2}
    assert doc["epd_timings"] == {"encode_ms": 1.0}  # the stages' milliseconds, not the counts
    assert "epd_timings" not in translate.usage(40, 4, {"cached_tokens": 0})  # llm's: no stage times


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}


@pytest.mark.parametrize("fmt, want", [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}, {"json": SCHEMA}),
])
def test_response_format_becomes_vllm_structured_outputs(fmt, want):
    call = translate.chat_call({"model": "epd", "messages": MESSAGES, "response_format": fmt}, SERVED)
    assert call.inputs["sampling"].get("structured_outputs") == want


@pytest.mark.parametrize("fmt, param", [
    ({"type": "xml"}, "response_format.type"), ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "nonsense"}}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"properties": 3}}}, "response_format.json_schema"),
])
def test_a_bad_response_format_names_its_field(fmt, param):
    with pytest.raises(ApiError) as info:
        translate.chat_call({"model": "epd", "messages": MESSAGES, "response_format": fmt}, SERVED)
    assert (info.value.status, info.value.param) == (400, param)


def test_the_engine_s_structured_outputs_errors_name_the_client_s_field():
    call = translate.chat_call({"model": "epd", "messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}, SERVED)
    err = translate.api_error(errors.encode(errors.InvalidInput("sampling_parameters.structured_outputs",
                                                                "Failed to transform json schema")), "epd")
    mapped = translate.in_client_terms(err, call)
    assert (mapped.status, mapped.param) == (400, "response_format.json_schema")
    assert mapped.message.startswith("response_format.json_schema: Failed")
    other = ApiError(400, "x", param="messages")
    assert translate.in_client_terms(other, call) is other


def test_each_choice_is_its_own_request_seeded_as_vllm_seeds_its_sequences():
    call = translate.chat_call({"model": "epd", "messages": MESSAGES, "n": 3, "seed": 7}, SERVED)
    calls = call.choices()
    assert [c.index for c in calls] == [0, 1, 2] and [c.inputs["sampling"]["seed"] for c in calls] == [7, 8, 9]
    assert len({c.request_id for c in calls}) == 3 and {c.response_id for c in calls} == {call.response_id}
    assert call.inputs["sampling"]["seed"] == 7
    one = translate.chat_call({"model": "epd", "messages": MESSAGES}, SERVED)
    assert one.choices() == [one]
    docs = [translate.completion(c, f"t{c.index}", "stop", (10, 2 + c.index)) for c in calls]
    doc = translate.merged(docs)
    assert [ch["index"] for ch in doc["choices"]] == [0, 1, 2] and doc["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19}
