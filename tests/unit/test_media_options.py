"""Per-request media options (``backend.protocol.media_options``, vLLM's ``media_io_kwargs``): what is taken and what
is refused, how they reach the loader, and that they are part of the content key."""
from __future__ import annotations

import json

import pytest

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import content_key
from backend.protocol.media_options import MediaOptions
from backend.request.generate import DecodeMedia, EncodedMedia, RawGenerateInputs, RequestLimits, \
    parse_generate_request
from backend.request.media import MediaLimits
from backend.request.video import decode_video
from tests.images import image_bytes
from tests.videos import make_video

LIMITS = MediaLimits(video_processor="Qwen2VLVideoProcessor")


def test_options_are_canonical_whatever_the_order_or_form():
    a = MediaOptions.parse('{"video": {"num_frames": 8, "fps": 1}}')
    b = MediaOptions.parse({"video": {"fps": 1.0, "num_frames": 8}})
    assert a == b and a.key("video") == '{"fps":1.0,"num_frames":8}' and a.key("image") == ""
    assert a.kwargs("video") == {"fps": 1.0, "num_frames": 8}
    assert MediaOptions.parse(a.parameter()) == a
    assert not MediaOptions.parse(None) and not MediaOptions.parse("") and not MediaOptions.parse('{"video": {}}')


@pytest.mark.parametrize("value, field, fragment", [
    ("{nope", "parameters.media_io_kwargs", "not JSON"),
    ("[1]", "parameters.media_io_kwargs", "keyed by modality"),
    ({"image": {"mode": "RGB"}}, "parameters.media_io_kwargs.image", "no per-request options"),
    ({"video": 2}, "parameters.media_io_kwargs.video", "an object of options"),
    ({"video": {"backend": "torchcodec"}}, "parameters.media_io_kwargs.video.backend", "unsupported option"),
    ({"video": {"fps": 0}}, "parameters.media_io_kwargs.video.fps", "frames a second"),
    ({"video": {"fps": float("nan")}}, "parameters.media_io_kwargs.video.fps", "frames a second"),
    ({"video": {"fps": True}}, "parameters.media_io_kwargs.video.fps", "frames a second"),
    ({"video": {"fps": "2"}}, "parameters.media_io_kwargs.video.fps", "frames a second"),
    ({"video": {"num_frames": 0}}, "parameters.media_io_kwargs.video.num_frames", "frame count"),
    ({"video": {"num_frames": 2.5}}, "parameters.media_io_kwargs.video.num_frames", "frame count"),
    ({"video": {"num_frames": 1 << 20}}, "parameters.media_io_kwargs.video.num_frames", "frame count"),
])
def test_bad_options_are_invalid_input_naming_what_is_wrong(value, field, fragment):
    with pytest.raises(InvalidInput, match=fragment) as info:
        MediaOptions.parse(value)
    assert info.value.field == field


def test_mm_processor_kwargs_are_refused_by_name():
    assert MediaOptions.from_parameters({"media_io_kwargs": '{"video": {"fps": 2}}', "mm_processor_kwargs": "{}"})
    with pytest.raises(InvalidInput, match="not supported") as info:
        MediaOptions.from_parameters({"mm_processor_kwargs": '{"max_pixels": 1000}'})
    assert info.value.field == "parameters.mm_processor_kwargs"


def test_the_options_are_part_of_the_content_key():
    data = b"the same bytes"
    plain = content_key(data, "p", "m")
    assert content_key(data, "p", "m", options="") == plain
    one = content_key(data, "p", "m", options=MediaOptions.parse({"video": {"fps": 1}}).key("video"))
    assert one != plain and one != content_key(data, "p", "m", options='{"fps":3.0}')
    assert content_key(data, "p", "m", (0, 2), one) != content_key(data, "p", "m", (0, 2))


def test_fps_samples_the_video_as_vllm_s_loader_does():
    data = make_video(96, 64, frames=60, fps=10)  # 6 s
    default = decode_video(data, "video[0]", LIMITS)
    slow = decode_video(data, "video[0]", LIMITS, **MediaOptions.parse({"video": {"fps": 1}}).kwargs("video"))
    assert len(default.frames) == 12 and len(slow.frames) == 6  # 2 a second; 1 a second (6 s)
    assert slow.metadata["frames_indices"] != default.metadata["frames_indices"]


def _request(options: dict | None, resolver):
    raw = RawGenerateInputs(prompt="<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|>"
                                       "<|vision_end|>Describe.",
                            videos=(make_video(96, 64, frames=60, fps=10),), images=(image_bytes(64, 48),),
                            media_io=MediaOptions.parse(options))
    return parse_generate_request(raw, resolver, RequestLimits(media=LIMITS))


def test_the_request_s_options_reach_each_video_and_no_image():
    encoded = _request({"video": {"fps": 1}}, EncodedMedia(LIMITS))
    image, video = sorted(encoded.items, key=lambda item: item.modality)
    assert json.loads(video.options) == {"fps": 1.0} and image.options == ""
    assert [item.options for item in _request(None, EncodedMedia(LIMITS)).items] == ["", ""]
    decoded = _request({"video": {"fps": 1}}, DecodeMedia(LIMITS))
    frames = [len(item.frames) for item in decoded.items if hasattr(item, "frames")]
    assert frames == [6]  # the llm engine samples it as the encoder will


def test_a_resolver_is_not_changed_by_one_request_s_options():
    shared = DecodeMedia(LIMITS)
    _request({"video": {"fps": 1}}, shared)
    assert not shared.options
    frames = [len(item.frames) for item in _request(None, shared).items if hasattr(item, "frames")]
    assert frames == [12]
