"""The error envelope (``backend.protocol.errors``): every code, a field or none, retryable or not, both ways;
a first line alone (what a client that asked for codes reads); Triton's own answers, mapped in one place."""
import json

import pytest

from backend.protocol.errors import (ENVELOPE_VERSION, Cancelled, EpdError, ErrorCode, InvalidInput, Overloaded,
                                     Unavailable, decode, encode)

ERRORS = [
    InvalidInput("sampling_parameters.max_tokens", "must be >= 1, got -1"),
    InvalidInput("messages[0].content[2].type", "unsupported content type 'x: y'"),  # ": " inside the problem
    Unavailable("embedding lease 2b expired before it was read", "image_layouts[1]"),
    Unavailable("engine unavailable: EngineDeadError"),
    Overloaded("embedding pool full: 64 MiB held by 3 leases", "image[0]"),
    Cancelled("the client went away"),
    EpdError("the engine failed this request"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: f"{type(e).__name__}-{e.field or 'nofield'}")
def test_round_trip_keeps_type_code_field_message_and_retryable(exc):
    text = encode(exc)
    first, details = text.split("\n")
    assert first == f"[{exc.code.value}] {exc}"  # what a person reads: code, then "field: problem"
    assert json.loads(details.removeprefix("epd-error: ")) == {"v": ENVELOPE_VERSION, "field": exc.field,
                                                               "retryable": exc.retryable}
    back = decode(text)
    assert type(back) is type(exc) and back.code is exc.code
    assert (back.field, back.problem, str(back), back.retryable) == (exc.field, exc.problem, str(exc), exc.retryable)


def test_retryable_by_kind():
    assert Unavailable("x").retryable and not Overloaded("x").retryable
    assert not InvalidInput("f", "x").retryable and not EpdError("x").retryable


def test_a_first_line_alone_decodes_to_its_code_and_field():
    assert isinstance(decode("[INVALID_ARG] image[1]: cannot decode image"), InvalidInput)
    assert decode("[INVALID_ARG] image[1]: cannot decode image").field == "image[1]"
    assert decode("[INVALID_ARG] no field here").field == "request"
    assert type(decode("[UNAVAILABLE] overloaded: pool full")) is Overloaded
    assert type(decode("[CANCELLED] gone")) is Cancelled and decode("[CANCELLED] gone").code is ErrorCode.CANCELLED


def test_details_of_another_version_are_ignored_not_misread():
    text = '[UNAVAILABLE] image_layouts[0]: lost\nepd-error: {"v": 99, "field": "image_layouts[0]", "retryable": false}'
    exc = decode(text)
    assert type(exc) is Unavailable and exc.retryable and str(exc) == "image_layouts[0]: lost"
    assert type(decode('[UNAVAILABLE] lost\nepd-error: not json')) is Unavailable


def test_triton_s_own_answers_are_unavailable_naming_the_stage():
    dead = decode("Stub process 'encoder_0_1' is not healthy.", stage="encoder")
    assert type(dead) is Unavailable and str(dead) == "encoder instance down: Stub process 'encoder_0_1' is not healthy."
    for answer in ("Request for unknown model: 'pd' is not found", "Request for unknown model: 'pd' version 1 is not ready"):
        gone = decode(answer, stage="pd")
        assert type(gone) is Unavailable and str(gone).startswith("stage pd unavailable: ")
    other = decode("something else broke", stage="pd")
    assert type(other) is EpdError and other.code is ErrorCode.INTERNAL and str(other) == "something else broke"


def test_anything_but_a_domain_error_is_internal():
    assert encode(KeyError("k")) == "[INTERNAL] internal error: KeyError: 'k'"
    assert decode(encode(KeyError("k"))).code is ErrorCode.INTERNAL
