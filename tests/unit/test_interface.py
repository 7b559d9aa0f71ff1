"""The generate interface declared once (backend.protocol.generate) and the modality registry driving it
(backend.protocol.modality): the tensor lists, the typed request's fields, message parsing."""
from __future__ import annotations

import dataclasses
import json

import pytest

from backend.deploy.render import _generate_io
from backend.engine.serving import ResponseChunk
from backend.protocol import generate
from backend.protocol.errors import InvalidInput
from backend.protocol.modality import AUDIO, IMAGE, VIDEO, Modality, content_part, modalities, register, unregister
from backend.request.generate import RawGenerateInputs, parse_generate_request
from tests.fakes import FakeLayoutResolver

FAKE = Modality(name="fake", url_part="fake_url", item_part="fake", media_tensor="fake", layout_tensor="fake_layouts",
                media_field="fakes", layout_field="fake_layouts", media_type="fake/", placeholder_token="<|fake|>",
                placeholder="<|fake|>", limit_key="fake", data_key="fake", embeds_key="fake_embeds",
                grid_key="fake_grid", limit_field="max_images")


@pytest.fixture
def fake_modality():
    register(FAKE)
    yield FAKE
    unregister(FAKE.name)


def names(tensors):
    return [t.name for t in tensors]


def test_every_input_and_output_maps_to_a_field_of_the_typed_request_and_chunk():
    raw_fields = {f.name for f in dataclasses.fields(RawGenerateInputs)}
    # every field is a tensor's but the request parameters: the session (backend.protocol.generate.SESSION_PARAMETER)
    # the media options (backend.protocol.media_options.MEDIA_IO_PARAMETER), the priority, the deadline and the tools
    assert {t.field for t in generate.input_tensors()} == raw_fields - {"session_id", "media_io", "priority", "deadline",
                                                                        "tools"}
    assert {t.field for t in generate.output_tensors()} == {f.name for f in dataclasses.fields(ResponseChunk)}


def test_each_kind_takes_its_media_form():
    assert names(generate.input_tensors("llm")) == names(generate.input_tensors("epd")) == [
        "text_input", "messages", "image", "video", "audio", "stream", "sampling_parameters", "exclude_input_in_output",
        "return_num_input_tokens", "return_num_output_tokens"]
    assert names(generate.input_tensors("pd"))[2] == "image_layouts" and "image" not in names(generate.input_tensors("pd"))
    assert names(generate.input_tensors("pd"))[3] == "video_layouts" and "video" not in names(generate.input_tensors("pd"))
    assert names(generate.input_tensors("pd"))[4] == "audio_layouts" and "audio" not in names(generate.input_tensors("pd"))
    assert names(generate.input_tensors("prefill"))[-5:] == ["original_media", "image", "video", "audio",
                                                             "kv_transfer_params"]
    assert generate.output_names("llm") == ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                                            "logprobs", "timings"]  # llm's: cached_tokens alone
    assert "logprobs" in generate.output_names("epd") and "logprobs" in generate.output_names("decode")
    assert generate.output_names("prefill")[-2:] == ["timings", "kv_transfer_params"]


def test_values_and_fields_round_trip():
    raw = RawGenerateInputs(prompt="hi", image_layouts=('{"a": 1}',), stream=True, kv_transfer_params='{"k": 1}')
    values = generate.input_values(vars(raw))
    assert values == {"text_input": "hi", "image_layouts": ['{"a": 1}'], "stream": True, "exclude_input_in_output": False,
                      "return_num_input_tokens": False, "return_num_output_tokens": False, "kv_transfer_params": '{"k": 1}'}
    sent = {"text_output": b"x", "num_output_tokens": 3, "timings": json.dumps({"encode_ms": 1.0})}
    assert ResponseChunk(**generate.output_fields(sent.get)) == ResponseChunk("x", None, None, 3, {"encode_ms": 1.0})
    assert generate.output_fields({}.get)["text_output"] == ""
    entries = [{"token_id": 1, "token": " a", "logprob": -0.5, "rank": 1, "top_logprobs": []}]
    assert generate.output_fields({"text_output": b" a", "logprobs": json.dumps(entries)}.get)["logprobs"] == entries


def test_a_registered_modality_adds_its_tensors(fake_modality):
    assert modalities() == (IMAGE, VIDEO, AUDIO, FAKE)
    llm, pd = names(generate.input_tensors("llm")), names(generate.input_tensors("pd"))
    assert llm[2:6] == ["image", "video", "audio", "fake"]
    assert pd[2:6] == ["image_layouts", "video_layouts", "audio_layouts", "fake_layouts"]
    assert names(generate.input_tensors("decode"))[-6:] == ["original_media", "image", "video", "audio", "fake",
                                                            "kv_transfer_params"]
    assert '{ name: "fake" data_type: TYPE_STRING dims: [ -1 ] optional: true }' in _generate_io("epd")
    assert generate.input_values({"fakes": [b"f"]})["fake"] == [b"f"]


def test_registration_is_undone():
    assert modalities() == (IMAGE, VIDEO, AUDIO) and content_part("fake") is None
    assert "fake" not in names(generate.input_tensors())


def test_a_registered_modality_s_content_parts_are_parsed(fake_modality):
    content = [{"type": "fake_url", "fake_url": {"url": "data:fake/x;base64,Zg=="}}, {"type": "image"},
               {"type": "text", "text": "?"}]
    request = parse_generate_request(RawGenerateInputs(messages=json.dumps([{"role": "user", "content": content}]),
                                                       image_layouts=("I",)), UrlResolver())
    assert request.conversation == [{"role": "user", "content": [{"type": "fake"}, {"type": "image"},
                                                                  {"type": "text", "text": "?"}]}]
    assert request.items == (("data:fake/x;base64,Zg==", "messages[0].content[0].fake_url", "fake"), "I")
    with pytest.raises(InvalidInput, match="use text, image_url, image, video_url, video, audio_url, input_audio, audio, "
                                           "fake_url or fake"):
        parse_generate_request(RawGenerateInputs(messages=json.dumps([{"role": "user", "content": [{"type": "speech"}]}])),
                               UrlResolver())


def test_a_fake_part_without_items_names_its_tensors(fake_modality):
    messages = json.dumps([{"role": "user", "content": [{"type": "fake"}]}])
    with pytest.raises(InvalidInput, match=r"needs a media item \(fake or fake_layouts\)"):
        parse_generate_request(RawGenerateInputs(messages=messages), FakeLayoutResolver())


def test_content_part_types_are_unique():
    with pytest.raises(ValueError, match="taken"):
        register(dataclasses.replace(FAKE, url_part="image_url"))
    assert content_part("image_url") == (IMAGE, "url") and content_part("image") == (IMAGE, "item")
    assert content_part("input_audio") == (AUDIO, "data") and content_part("audio_url") == (AUDIO, "url")
    with pytest.raises(ValueError, match="taken"):
        register(dataclasses.replace(FAKE, data_part="input_audio"))


class UrlResolver(FakeLayoutResolver):
    """Layouts as their text; a URL as (url, field, modality name)."""

    def from_url(self, url, field, modality=None):
        return url, field, modality.name
