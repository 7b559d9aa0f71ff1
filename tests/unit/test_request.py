import base64
import json

import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import IMAGE
from backend.request.generate import (DecodeMedia, EncodedMedia, LayoutMedia, RawGenerateInputs, RequestLimits,
                             parse_generate_request)
from tests.fakes import render_chat
from tests.images import image_bytes

PH = IMAGE.placeholder


def parse(resolver=None, **kwargs):
    return parse_generate_request(RawGenerateInputs(**kwargs), resolver or DecodeMedia(), RequestLimits(max_images=3))


def test_text_prompt_with_placeholders_and_images():
    req = parse(prompt=f"{PH}{PH} compare", images=(image_bytes(8, 8, 1), image_bytes(16, 8, 2)),
                sampling='{"max_tokens": 4}', stream=True, return_num_output_tokens=True)
    assert req.prompt == f"{PH}{PH} compare"
    assert [im.size for im in req.items] == [(8, 8), (16, 8)]
    assert req.sampling == {"max_tokens": 4} and req.stream and req.return_num_output_tokens


def test_placeholders_are_added_when_the_prompt_has_none():
    req = parse(prompt="what is this?", images=(image_bytes(8, 8), image_bytes(8, 8, 1)))
    assert req.prompt == PH + PH + "what is this?"


def test_text_only_request_has_no_images():
    req = parse(prompt="hello")
    assert req.prompt == "hello" and req.items == ()


@pytest.mark.parametrize("kwargs, field, fragment", [
    (dict(), "text_input", "got neither"),
    (dict(prompt="a", messages="[]"), "text_input", "not both"),
    (dict(prompt="  "), "text_input", "empty prompt"),
    (dict(prompt=f"{PH}{PH}x", images=(image_bytes(8, 8),)), "image", "2 image placeholder(s)"),
    (dict(prompt=f"{PH}x"), "text_input", "but 0 image(s)"),
    (dict(prompt="x", images=(image_bytes(8, 8),) * 4), "image", "per-request limit of 3"),
    (dict(prompt="x", images=(image_bytes(8, 8),), image_layouts=("{}",)), "image_layouts", "not both"),
    (dict(prompt="x", images=(b"\x89PNG broken",)), "image[0]", "cannot decode"),
    (dict(prompt="x", sampling="{"), "sampling_parameters", "not valid JSON"),
])
def test_text_prompt_errors(kwargs, field, fragment):
    with pytest.raises(InvalidInput) as info:
        parse(**kwargs)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_messages_with_data_url_and_tensor_images():
    url = "data:image/png;base64," + base64.b64encode(image_bytes(12, 8)).decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "two pictures"},
        {"role": "user", "content": [{"type": "text", "text": "which is larger?"}]},
    ]
    req = parse(messages=json.dumps(messages), images=(image_bytes(20, 10),))
    assert req.prompt is None and req.prompt_field == "messages"
    assert render_chat(req.conversation) == ("system: be brief\nuser: <image>and<image>\nassistant: two pictures\n"
                                             "user: which is larger?\nassistant: ")
    assert [im.size for im in req.items] == [(12, 8), (20, 10)]


@pytest.mark.parametrize("messages, images, field, fragment", [
    ("[{", (), "messages", "not valid JSON"),
    ("[]", (), "messages", "non-empty JSON list"),
    ('["hi"]', (), "messages[0]", "object with 'role'"),
    ('[{"role": "robot", "content": "x"}]', (), "messages[0].role", "robot"),
    ('[{"role": "user", "content": 3}]', (), "messages[0].content", "string or a list"),
    ('[{"role": "user", "content": [{"type": "speech_url"}]}]', (), "messages[0].content[0].type", "speech_url"),
    ('[{"role": "user", "content": [{"type": "text"}]}]', (), "messages[0].content[0].text", "string"),
    ('[{"role": "user", "content": [{"type": "image"}]}]', (), "messages[0].content[0]", "none is left"),
    ('[{"role": "user", "content": "hi"}]', (image_bytes(8, 8),), "image", "not referenced"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]', (),
     "messages[0].content[0].image_url", "http(s) media URLs are disabled"),
])
def test_messages_errors(messages, images, field, fragment):
    with pytest.raises(InvalidInput) as info:
        parse(messages=messages, images=images)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_encoded_media_keeps_bytes_and_rewrites_image_parts():
    png = image_bytes(12, 8)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "image"},
                                             {"type": "text", "text": "same?"}]}]
    req = parse(EncodedMedia(), messages=json.dumps(messages), images=(b"tensor-bytes",))
    assert [(m.data, m.field) for m in req.items] == [  # prompt order; nothing decoded
        (png, "messages[0].content[0].image_url"), (b"tensor-bytes", "image[0]")]
    assert req.conversation == [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                              {"type": "text", "text": "same?"}]}]


def test_layout_media_refuses_media_and_checks_layouts():
    resolver = LayoutMedia("qwen2_vl:abc")
    with pytest.raises(InvalidInput, match="metadata-only") as info:
        parse(resolver, prompt="x", images=(image_bytes(8, 8),))
    assert info.value.field == "image[0]"
    url = "data:image/png;base64," + base64.b64encode(image_bytes(8, 8)).decode()
    with pytest.raises(InvalidInput, match="metadata-only"):
        parse(resolver, messages=json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]))
    with pytest.raises(InvalidInput) as info:
        parse(resolver, prompt="x", image_layouts=('{"version": 99}',))
    assert info.value.field == "image_layouts[0].version"


def test_tool_turns_and_the_tools_parameter_are_kept_for_the_chat_template():
    from backend.request.generate import parameter_inputs

    tools = [{"type": "function", "function": {"name": "click"}}]
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                        "function": {"name": "click", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "done"}, {"type": "image"}]}]
    raw = RawGenerateInputs(messages=json.dumps(messages), images=(image_bytes(32, 32, 1),),
                            **parameter_inputs({"tools": json.dumps(tools)}))
    request = parse_generate_request(raw, EncodedMedia())
    assert request.tools == tools and len(request.items) == 1
    assert request.conversation[1] == {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]}
    assert request.conversation[2]["tool_call_id"] == "c1" and request.conversation[2]["role"] == "tool"
    for parameters, field in (({"tools": "{}"}, "parameters.tools"), ({"tools": "not json"}, "parameters.tools")):
        with pytest.raises(InvalidInput) as info:
            parameter_inputs(parameters)
        assert info.value.field == field
    bad = [{"role": "tool", "content": "x", "tool_call_id": 3}]
    with pytest.raises(InvalidInput) as info:
        parse_generate_request(RawGenerateInputs(messages=json.dumps(bad)), EncodedMedia())
    assert info.value.field == "messages[0].tool_call_id"
