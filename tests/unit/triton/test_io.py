"""``backend.triton.io`` over the fake pb_utils: request tensors to typed values (a bad one: INVALID_ARG naming it),
the response sink's send path (final flag exactly once, cancel checks), in-band cancels, lookups, error codes."""
import json

import pytest

from backend.engine.serving import ResponseChunk
from backend.protocol.errors import Cancelled, InvalidInput, Unavailable
from backend.triton import io
from orchestrator.cancel_board import CancelBoard
from tests.unit.triton.inputs import generate_request, only_error, outputs

FINAL = 1


def test_request_tensors_become_typed_inputs(pb):
    raw = io.read_generate_inputs(generate_request(
        text_input="hi <image>", image=[b"\x89PNG", b"GIF8"], stream=True, sampling_parameters={"max_tokens": 3},
        parameters={"session_id": "s1"}))
    assert (raw.prompt, raw.images, raw.stream, raw.session_id) == ("hi <image>", (b"\x89PNG", b"GIF8"), True, "s1")
    assert json.loads(raw.sampling) == {"max_tokens": 3}
    assert raw.messages is None and raw.videos == () and raw.exclude_input_in_output is False


@pytest.mark.parametrize("inputs, field", [
    ({"text_input": b"\xff\xfe"}, "text_input"),                       # not UTF-8
    ({"text_input": ["a", "b"]}, "text_input"),                         # two elements where one is expected
    ({"sampling_parameters": ["{}", "{}"]}, "sampling_parameters"),
    ({"image_layouts": [b"\xc3("]}, "image_layouts"),
    ({"stream": [True, False]}, "stream"),
])
def test_a_bad_input_is_invalid_arg_naming_it(pb, inputs, field):
    with pytest.raises(InvalidInput) as caught:
        io.read_generate_inputs(generate_request(**inputs))
    error = io.to_triton_error(caught.value)
    assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith(field)


def test_a_bad_session_parameter_names_it(pb):
    with pytest.raises(InvalidInput, match="session_id"):
        io.read_generate_inputs(generate_request(text_input="a", parameters={"session_id": 5}))


def test_request_parameters_tolerate_junk(pb):
    assert io.request_parameters(pb.InferenceRequest("m", [], [], parameters="[1, 2]")) == {}
    assert io.request_parameters(pb.InferenceRequest("m", [], [], parameters="{not json")) == {}
    assert io.wants_error_codes(generate_request(parameters={"epd_error_codes": True}))


@pytest.mark.parametrize("exc, code", [(InvalidInput("image[0]", "too big"), "INVALID_ARG"),
                                       (Unavailable("lease expired", "image_layouts[0]"), "UNAVAILABLE"),
                                       (Cancelled("client gone"), "CANCELLED"), (KeyError("x"), "INTERNAL")])
def test_domain_errors_map_to_their_triton_code(pb, exc, code):
    error = io.to_triton_error(exc)
    assert pb.code_name(error.code()) == code
    tagged = io.to_triton_error(exc, tag_code=True)
    assert tagged.message().startswith(f"[{code}] ")
    assert io.from_triton_error(tagged).code.value == code  # what a caller of the stage reads back


def test_sink_streams_then_completes_once(pb):
    sender = generate_request().get_response_sender()
    sink = io.TritonSink(sender)
    sink.send(ResponseChunk("Hel"), final=False)
    sink.send(ResponseChunk("lo", "stop", 7, 2), final=True)
    assert [flags for _, flags in sender.sent] == [0, FINAL]
    assert outputs(sender.responses[0]) == {"text_output": "Hel"}  # optional outputs left out while None
    assert outputs(sender.responses[1]) == {"text_output": "lo", "finish_reason": "stop", "num_input_tokens": 7,
                                            "num_output_tokens": 2}
    with pytest.raises(RuntimeError, match="after the request was completed"):
        sink.send(ResponseChunk("more"), final=False)
    sink.send_error(ValueError("late"))
    sink.close()
    assert len(sender.sent) == 2  # nothing after the final flag


def test_json_outputs_are_json_text(pb):
    sender = generate_request().get_response_sender()
    io.TritonSink(sender).send(ResponseChunk("", "stop", timings={"encode_ms": 1.5}, logprobs=[{"t": 1}]), final=True)
    out = outputs(sender.responses[0])
    assert json.loads(out["timings"]) == {"encode_ms": 1.5} and json.loads(out["logprobs"]) == [{"t": 1}]


def test_a_failed_send_still_completes_the_request(pb):
    sender = generate_request().get_response_sender()

    def failing(response=None, flags=0):
        if response is not None:
            raise pb.TritonModelException("client gone")
        pb.ResponseSender.send(sender, response, flags)

    sender.send = failing
    sink = io.TritonSink(sender)
    with pytest.raises(pb.TritonModelException):
        sink.send(ResponseChunk("a"), final=False)
    assert sender.sent == [(None, FINAL)] and sender.closed
    sink.send_error(ValueError("after"))  # a no-op: completed
    assert len(sender.sent) == 1


def test_sink_error_is_one_final_response(pb):
    sender = generate_request().get_response_sender()
    io.TritonSink(sender, tag_error_codes=True).send_error(InvalidInput("messages", "not a list"))
    error = only_error(sender)
    assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith("[INVALID_ARG] messages")


def test_sink_asks_the_server_for_cancels_at_most_every_interval(pb, monkeypatch):
    request = generate_request()
    sink = io.TritonSink(request.get_response_sender())
    request.cancel()
    assert not sink.is_cancelled()  # asked less than CANCEL_CHECK_SECONDS after the request was read
    monkeypatch.setattr(io.TritonSink, "CANCEL_CHECK_SECONDS", 0.0)
    assert sink.is_cancelled() and sink.is_cancelled()


def test_watched_sink_sees_an_in_band_cancel(pb, monkeypatch):
    monkeypatch.setattr(io.TritonSink, "BOARD_CHECK_SECONDS", 0.0)
    board = CancelBoard(None)
    request = generate_request(request_id="r1")
    request_id, sink = io.watched_sink(request, request.get_response_sender(), board, tag_code=False)
    assert request_id == "r1" and not sink.is_cancelled()
    canceller = generate_request(parameters={"epd_cancel": "r1"})
    sender = canceller.get_response_sender()
    assert io.in_band_cancel(sender, io.request_parameters(canceller), board, tag_code=False)
    assert sender.sent == [(None, FINAL)]  # the cancel itself: completed with no response
    assert sink.is_cancelled()


def test_an_in_band_cancel_without_an_id_is_invalid(pb):
    request = generate_request(parameters={"epd_cancel": ""})
    sender = request.get_response_sender()
    assert io.in_band_cancel(sender, io.request_parameters(request), CancelBoard(None), tag_code=False)
    assert only_error(sender).code() == pb.TritonError.INVALID_ARG
    assert not io.in_band_cancel(sender, {}, CancelBoard(None), tag_code=False)  # not a cancel


class Held:
    def lookup(self, keys, session):
        return {k: f"layout of {k}" for k in keys if k != "missing"}


def test_held_lookup_answers_json(pb):
    sender = generate_request().get_response_sender()
    io.answer_held_lookup(sender, json.dumps({"keys": ["a", "missing"], "session": None}), Held(), tag_code=False)
    (response, flags), = sender.sent
    assert flags == FINAL and json.loads(outputs(response)["text_output"]) == {"a": "layout of a"}


@pytest.mark.parametrize("query", ["not json", json.dumps({"keys": "a"}), json.dumps([1])])
def test_a_bad_held_lookup_is_invalid_arg(pb, query):
    sender = generate_request().get_response_sender()
    io.answer_held_lookup(sender, query, Held(), tag_code=False)
    error = only_error(sender)
    assert error.code() == pb.TritonError.INVALID_ARG and error.message().startswith("parameters.epd_held")
