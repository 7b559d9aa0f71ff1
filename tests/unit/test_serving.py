import asyncio

import pytest

from backend.protocol.errors import InvalidInput
from backend.request.generate import GenerateRequest
from backend.engine.serving import Outcome, stream_generation
from tests.fakes import FakeEngine, FakeSink, RecordingObserver


def request(**kwargs) -> GenerateRequest:
    defaults = dict(prompt="Q: ", conversation=None, items=(), sampling={}, return_num_input_tokens=True, return_num_output_tokens=True)
    return GenerateRequest(**{**defaults, **kwargs})


def run(engine, req, sink, observer=None):
    return asyncio.run(stream_generation(engine, req, sink, observer, request_id="r1"))


def test_streaming_sends_each_delta_and_one_final_with_counts():
    sink, observer = FakeSink(), RecordingObserver()
    assert run(FakeEngine(), request(stream=True), sink, observer) is Outcome.OK
    assert [(c.text_output, final) for c, final in sink.chunks] == [("Hel", False), ("lo", False), ("!", True)]
    last = sink.chunks[-1][0]
    assert (last.finish_reason, last.num_input_tokens, last.num_output_tokens) == ("stop", 7, 3)
    assert sink.chunks[0][0].finish_reason is None
    assert sink.finals == 1 and observer.finished == [(Outcome.OK, 3)]


def test_stream_interval_merges_steps_but_sends_the_first_text_at_once():
    sink = FakeSink()
    engine = FakeEngine(pieces=["a", "b", "c", "d", "e", "f"], step_delay=0.01)
    asyncio.run(stream_generation(engine, request(stream=True), sink, request_id="r1", interval=0.025))
    texts = [c.text_output for c, _ in sink.chunks]
    assert texts[0] == "a" and "".join(texts) == "abcdef"
    assert 2 <= len(texts) < 6, texts  # ~every third step after the first, plus the final
    assert [final for _, final in sink.chunks] == [False] * (len(texts) - 1) + [True]


def test_the_first_token_is_sent_at_once_even_when_its_text_is_empty():
    """A first token that decodes to "" (a partial character, a special token) still gets its response when the
    engine gives it, as vLLM's server sends its first chunk: the client's TTFT is the first token's, not the first
    visible text's (on an H100 a random checkpoint's E+PD answers otherwise read TTFT = the whole request). Later
    empty steps wait for text as before."""
    sink = FakeSink()
    engine = FakeEngine(pieces=["", "", "a", "", "b"], step_delay=0.0)
    asyncio.run(stream_generation(engine, request(stream=True), sink, request_id="r1", interval=0.0))
    assert [c.text_output for c, _ in sink.chunks] == ["", "a", "b"]
    assert [final for _, final in sink.chunks] == [False, False, True]


@pytest.mark.parametrize("exclude, expected", [(False, "Q: Hello!"), (True, "Hello!")])
def test_non_streaming_sends_one_response(exclude, expected):
    sink = FakeSink()
    run(FakeEngine(), request(exclude_input_in_output=exclude), sink)
    assert len(sink.chunks) == 1 and sink.chunks[0][1] is True
    assert sink.chunks[0][0].text_output == expected


def test_counts_only_when_asked():
    sink = FakeSink()
    run(FakeEngine(), request(return_num_input_tokens=False, return_num_output_tokens=False), sink)
    chunk = sink.chunks[-1][0]
    assert chunk.num_input_tokens is None and chunk.num_output_tokens is None and chunk.finish_reason == "stop"


def test_client_cancel_aborts_the_engine_request():
    engine, sink, observer = FakeEngine(pieces=["t"] * 50), FakeSink(cancel_after=2), RecordingObserver()
    assert run(engine, request(stream=True), sink, observer) is Outcome.CANCELLED
    assert engine.aborted == ["r1"] and engine.steps_run == 3
    assert sink.closed == 1 and sink.finals == 1
    assert observer.finished == [(Outcome.CANCELLED, 3)]


def test_engine_error_becomes_the_final_response_and_aborts():
    error = InvalidInput("text_input", "prompt too long")
    engine, sink, observer = FakeEngine(fail_with=error, fail_after=1), FakeSink(), RecordingObserver()
    assert run(engine, request(stream=True), sink, observer) is Outcome.ERROR
    assert sink.errors == [error] and sink.finals == 1 and engine.aborted == ["r1"]
    assert observer.finished == [(Outcome.ERROR, 1)]


def test_stream_that_ends_without_finishing_is_an_error():
    engine = FakeEngine(finish_reason=None)
    sink = FakeSink()
    assert run(engine, request(stream=True), sink) is Outcome.ERROR
    assert len(sink.errors) == 1 and "without a finished output" in str(sink.errors[0])
