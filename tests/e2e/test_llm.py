"""E2E: the ``llm`` baseline model in a real tritonserver, against in-process vLLM as the reference."""
from __future__ import annotations

import time

import pytest
import tritonclient.http as httpclient

from backend.protocol.generate import GenerateInputs
from backend.protocol.modality import IMAGE
from backend.triton.counter_batch import CounterBatch
from clients.triton_client import GenerateError, GenerateResult, generate
from tests.e2e.conftest import metric
from tests.images import image_bytes

pytestmark = pytest.mark.e2e

PH = IMAGE.placeholder
GREEDY = {"temperature": 0.0, "max_tokens": 16}
CHAT_PROMPT = "<|im_start|>user\n{images}{text}<|im_end|>\n<|im_start|>assistant\n"

IMG_A = image_bytes(64, 48, seed=1)
IMG_A2 = image_bytes(64, 48, seed=2)  # same size as IMG_A, different pixels
IMG_B = image_bytes(112, 112, seed=3)
IMG_C = image_bytes(200, 150, seed=4, fmt="JPEG")  # resized by the processor

# (name, server inputs, reference case). Reference prompts spell out every placeholder themselves.
CASES = [
    ("one_image", dict(prompt=CHAT_PROMPT.format(images=PH, text="What is this?"), images=[IMG_A]),
     dict(prompt=CHAT_PROMPT.format(images=PH, text="What is this?"), images=[IMG_A])),
    ("same_size_other_image", dict(prompt=CHAT_PROMPT.format(images=PH, text="What is this?"), images=[IMG_A2]),
     dict(prompt=CHAT_PROMPT.format(images=PH, text="What is this?"), images=[IMG_A2])),
    ("square_image", dict(prompt=CHAT_PROMPT.format(images=PH, text="Describe it."), images=[IMG_B]),
     dict(prompt=CHAT_PROMPT.format(images=PH, text="Describe it."), images=[IMG_B])),
    ("jpeg_resized", dict(prompt=CHAT_PROMPT.format(images=PH, text="Colours?"), images=[IMG_C]),
     dict(prompt=CHAT_PROMPT.format(images=PH, text="Colours?"), images=[IMG_C])),
    ("two_images_auto_placeholders", dict(prompt="Compare the pictures.", images=[IMG_A, IMG_B]),
     dict(prompt=PH + PH + "Compare the pictures.", images=[IMG_A, IMG_B])),
    ("text_only", dict(prompt=CHAT_PROMPT.format(images="", text="Tell me a story.")),
     dict(prompt=CHAT_PROMPT.format(images="", text="Tell me a story."))),
    ("chat_one_image", dict(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}],
                            images=[IMG_B]),
     dict(messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}],
          images=[IMG_B])),
    ("chat_multi_turn", dict(messages=[
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}], images=[IMG_A, IMG_C]),
     dict(messages=[
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}], images=[IMG_A, IMG_C])),
]


@pytest.fixture(scope="module")
def expected(reference):
    outputs = reference.run([dict(case, sampling=GREEDY) for _, _, case in CASES])
    return {name: out for (name, _, _), out in zip(CASES, outputs)}


def ask(server, protocol="grpc", cancel_after_chunks=None, cancel_via="grpc", **inputs) -> GenerateResult:
    inputs.setdefault("sampling", GREEDY)
    url = server.grpc_url if protocol == "grpc" else server.http_url
    extra = {} if cancel_after_chunks is None else {"cancel_after_chunks": cancel_after_chunks, "cancel_via": cancel_via}
    return generate(url, "llm", GenerateInputs(**inputs), protocol=protocol, timeout=120, **extra)


def test_health_and_metadata(server):
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("llm")
    meta = client.get_model_metadata("llm")
    assert {i["name"] for i in meta["inputs"]} == {
        "text_input", "messages", "image", "video", "audio", "stream", "sampling_parameters", "exclude_input_in_output",
        "return_num_input_tokens", "return_num_output_tokens"}
    assert {o["name"] for o in meta["outputs"]} == {"text_output", "finish_reason", "num_input_tokens",
                                                   "num_output_tokens", "logprobs", "timings"}


def test_reference_depends_on_the_image(expected):
    """Sensitivity: without it, the equality tests below could pass on a model that ignores images."""
    assert expected["one_image"]["token_ids"] != expected["same_size_other_image"]["token_ids"]
    assert expected["one_image"]["token_ids"] != expected["square_image"]["token_ids"]


@pytest.mark.parametrize("name, inputs", [(name, inputs) for name, inputs, _ in CASES], ids=[c[0] for c in CASES])
def test_greedy_tokens_equal_in_process_vllm(server, expected, name, inputs):
    ref = expected[name]
    got = ask(server, **inputs)
    assert got.text == ref["text"]
    assert got.num_output_tokens == len(ref["token_ids"])
    assert got.num_input_tokens == ref["num_input_tokens"]
    assert got.finish_reason == ref["finish_reason"]


def test_different_image_gives_different_tokens(server):
    a = ask(server, **CASES[0][1])
    b = ask(server, **CASES[1][1])
    assert a.text != b.text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streaming_and_non_streaming_agree(server, expected, protocol):
    inputs = dict(CASES[2][1])
    streamed = ask(server, protocol, stream=True, **inputs)
    whole = ask(server, protocol, stream=False, **inputs)
    assert len(streamed.chunks) > 1 and len(whole.chunks) == 1
    assert streamed.text == whole.text == expected["square_image"]["text"]
    with_prompt = ask(server, protocol, stream=False, exclude_input_in_output=False, **inputs)
    assert with_prompt.text == inputs["prompt"] + whole.text


@pytest.mark.parametrize("via", ["grpc", "request"])
def test_cancellation_stops_generation(server, via):
    """A client cancels after 3 chunks: by cancelling the gRPC stream, or in band (a request on the same stream
    whose parameter ``epd_cancel`` names the request's id; then the request's final response ends the stream)."""
    cancelled_before = metric(server, "epd_requests_total", model="llm", outcome="cancelled")
    tokens_before = metric(server, "epd_generated_tokens_total", model="llm")
    result = ask(server, prompt="Count forever.", sampling={"max_tokens": 3000, "ignore_eos": True},
                 cancel_after_chunks=3, cancel_via=via)
    assert result.cancelled and (len(result.chunks) == 3 if via == "grpc" else 3 <= len(result.chunks) < 1000)
    assert result.finish_reason is None
    deadline = time.monotonic() + 20
    while metric(server, "epd_requests_total", model="llm", outcome="cancelled") == cancelled_before:
        assert time.monotonic() < deadline, "the cancelled request never finished in the model"
        time.sleep(0.1)
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # the request's token count may come in the next flush
    generated = metric(server, "epd_generated_tokens_total", model="llm") - tokens_before
    assert 3 <= generated < 1000, f"{generated} tokens generated for a request cancelled after 3"
    assert ask(server, **CASES[0][1]).finish_reason is not None  # still serving


BAD_INPUTS = [
    ("corrupt_image", dict(prompt="x", images=[b"\x89PNG\r\n\x1a\n corrupt"]), "image[0]"),
    ("truncated_image", dict(prompt="x", images=[IMG_B[: len(IMG_B) // 2]]), "image[0]"),
    ("both_prompts", dict(prompt="x", messages=[{"role": "user", "content": "x"}]), "text_input"),
    ("neither_prompt", dict(), "text_input"),
    ("bad_sampling_json", dict(prompt="x", sampling="{max_tokens: 3"), "sampling_parameters"),
    ("negative_max_tokens", dict(prompt="x", sampling={"max_tokens": -5}), "sampling_parameters.max_tokens"),
    ("malformed_messages", dict(messages="[{\"role\": "), "messages"),
    ("prompt_too_long", dict(prompt="word " * 5000), "text_input"),
]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("name, inputs, field", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_invalid_arg_naming_the_field(server, protocol, name, inputs, field):
    with pytest.raises(GenerateError) as info:
        ask(server, protocol, **inputs)
    assert info.value.message.startswith(field), info.value.message
    if protocol == "http":
        assert info.value.status == "400"


@pytest.mark.parametrize("target", [5, "", True])
def test_an_in_band_cancel_without_a_request_id_is_invalid_arg(server, target):
    with pytest.raises(GenerateError) as info:
        ask(server, prompt="x", parameters={"epd_cancel": target, "epd_error_codes": True})
    assert info.value.message.startswith("[INVALID_ARG] parameters.epd_cancel: expected a request id"), info.value.message


def test_server_keeps_serving_after_bad_input(server, expected):
    with pytest.raises(GenerateError):
        ask(server, prompt="x", images=[b"garbage"])
    assert ask(server, **CASES[0][1]).text == expected["one_image"]["text"]
